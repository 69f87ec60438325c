//! The janitor's and the operator's steps: purges of expired holders and holds, the
//! promotion of delayed jobs (P-4), lock holders for `locketd locks`, ENQUEUE with holds
//! (D-3) and the operator's releases (O-2).

use super::ms;
use super::scripts::scripts;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::time::Duration;

/// Purges up to `batch` locks whose earliest deadline has passed (R-3 step 2). Returns the
/// number of holders removed.
pub async fn purge_expired<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    batch: usize,
) -> RedisResult<u64> {
    scripts()
        .purge
        .key(keys.locks())
        .arg(keys.locket_prefix())
        .arg(batch.min(100))
        .invoke_async(conn)
        .await
}

/// Where the last [`unblock_lapsed`] of this process stopped in its SCAN, so that a large
/// keyspace is covered over several janitor passes instead of its start only.
static UNBLOCK_CURSOR: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A-14 for limit-1 locks that lapsed: the `blocked:lock:` sets whose lock key is gone have
/// their queues' counters reset (`unblock.lua`). The sets are found with SCAN (they have no
/// index), at most `max_scans` calls of 1,000 keys per call of this, going on where the last
/// call stopped. Returns the number of counters reset.
pub async fn unblock_lapsed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    max_scans: usize,
) -> RedisResult<u64> {
    use std::sync::atomic::Ordering;
    let prefix = keys.blocked_lock("");
    let mut cursor: u64 = UNBLOCK_CURSOR.load(Ordering::Relaxed);
    let mut reset = 0;
    for _ in 0..max_scans.max(1) {
        let (next, batch) = scan_page(conn, &prefix, cursor, None).await?;
        if !batch.is_empty() {
            let mut inv = scripts().unblock.prepare_invoke();
            inv.arg(keys.locket_prefix());
            for name in &batch {
                inv.arg(&name[prefix.len()..]);
            }
            let n: u64 = inv.invoke_async(conn).await?;
            reset += n;
        }
        cursor = next;
        UNBLOCK_CURSOR.store(cursor, Ordering::Relaxed);
        if cursor == 0 {
            break;
        }
    }
    Ok(reset)
}

/// A live holder of a lock, as `lockinfo` and the lock's ZSET describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    /// The holder's token.
    pub token: String,
    /// Its deadline, Redis server time in ms.
    pub deadline_ms: u64,
    /// Its `lockinfo` JSON, if present.
    pub info: Option<serde_json::Value>,
}

/// Lists a lock's members (live or not yet purged) with their metadata: the one holder of a
/// limit-1 lock (a STRING whose value is its info, lib.lua), or the members of a larger one.
pub async fn holders<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    lock_id: &str,
) -> RedisResult<Vec<Holder>> {
    let key = keys.lock(lock_id);
    let kind: String = redis::cmd("TYPE").arg(&key).query_async(conn).await?;
    if kind == "string" {
        let (value, left, (s, us)): (Option<String>, i64, (u64, u64)) = redis::pipe()
            .get(&key)
            .cmd("PTTL")
            .arg(&key)
            .cmd("TIME")
            .query_async(conn)
            .await?;
        let now = s * 1000 + us / 1000;
        return Ok(value
            .and_then(|v| lock1_holder(&v, now, left))
            .into_iter()
            .collect());
    }
    let members: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(conn)
        .await?;
    let mut out = Vec::with_capacity(members.len());
    for (token, score) in members {
        let info: Option<String> = redis::cmd("HGET")
            .arg(keys.lockinfo(lock_id))
            .arg(&token)
            .query_async(conn)
            .await?;
        out.push(Holder {
            token,
            deadline_ms: score as u64,
            info: info.and_then(|s| serde_json::from_str(&s).ok()),
        });
    }
    Ok(out)
}

/// The holder a limit-1 lock's value names, its deadline `now + left` (the key's PTTL).
pub fn lock1_holder(value: &str, now_ms: u64, left_ms: i64) -> Option<Holder> {
    let info: serde_json::Value = serde_json::from_str(value).ok()?;
    let token = info["token"].as_str()?.to_string();
    Some(Holder {
        token,
        deadline_ms: now_ms + u64::try_from(left_ms.max(0)).unwrap_or(0),
        info: Some(info),
    })
}

/// A held limit-1 lock, as [`held_lock1`] finds it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldLock1 {
    /// The lock id.
    pub id: String,
    /// Its holder.
    pub holder: Holder,
}

/// Every held limit-1 lock, found with `SCAN ... TYPE string` over `<ns>:locket:lock:*`
/// (decision 2 of issue 15: these locks have no index, so that taking and releasing one costs
/// one command each; listing them is the operator's cost, outside every script). Stops after
/// `max_scans` SCAN calls of 1,000 keys each.
pub async fn held_lock1<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    max_scans: usize,
) -> RedisResult<Vec<HeldLock1>> {
    let prefix = keys.lock("");
    let names = lock1_names(conn, keys, max_scans).await?;
    let mut out = Vec::with_capacity(names.len());
    for chunk in names.chunks(200) {
        let mut pipe = redis::pipe();
        pipe.cmd("TIME");
        for n in chunk {
            pipe.get(n).cmd("PTTL").arg(n);
        }
        let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        let Some((time, rest)) = replies.split_first() else {
            continue;
        };
        let (s, us): (u64, u64) = redis::from_redis_value(time.clone()).unwrap_or((0, 0));
        let now = s * 1000 + us / 1000;
        for (name, r) in chunk.iter().zip(rest.chunks(2)) {
            let value: Option<String> = redis::from_redis_value(r[0].clone()).unwrap_or(None);
            let left: i64 = redis::from_redis_value(r[1].clone()).unwrap_or(-2);
            if let Some(holder) = value.and_then(|v| lock1_holder(&v, now, left)) {
                if left > 0 {
                    out.push(HeldLock1 {
                        id: name[prefix.len()..].to_string(),
                        holder,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// One `SCAN <cursor> MATCH <prefix>* COUNT 1000 [TYPE <kind>]`: the next cursor and the names.
async fn scan_page<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    cursor: u64,
    kind: Option<&str>,
) -> RedisResult<(u64, Vec<String>)> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(format!("{}*", glob_escape(prefix)))
        .arg("COUNT")
        .arg(1000);
    if let Some(k) = kind {
        cmd.arg("TYPE").arg(k);
    }
    cmd.query_async(conn).await
}

/// The keys of the held limit-1 locks (`SCAN ... TYPE string`, at most `max_scans` calls).
async fn lock1_names<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    max_scans: usize,
) -> RedisResult<Vec<String>> {
    let prefix = keys.lock("");
    let mut cursor: u64 = 0;
    let mut names = Vec::new();
    for _ in 0..max_scans.max(1) {
        let (next, batch) = scan_page(conn, &prefix, cursor, Some("string")).await?;
        names.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    Ok(names)
}

/// The locks with a live holder at server time `now_ms`, for `status` and `/metrics`: the
/// larger locks from the `locks` index, the limit-1 locks by SCAN (a key exists only while
/// its holder's lease lasts, L-1a), at most 10,000 SCAN calls.
pub async fn locks_held<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    now_ms: u64,
) -> RedisResult<u64> {
    let indexed: u64 = redis::cmd("ZCOUNT")
        .arg(keys.locks())
        .arg(format!("({now_ms}"))
        .arg("+inf")
        .query_async(conn)
        .await?;
    Ok(indexed + lock1_names(conn, keys, 10_000).await?.len() as u64)
}

/// `s` with the glob characters of a SCAN MATCH pattern escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Promotes due delayed jobs to the tail of their queues (R-3 step 1, P-4); with `member`,
/// that one member now. Returns the number pushed.
pub async fn promote_delayed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    batch: usize,
    member: Option<&str>,
) -> RedisResult<u64> {
    scripts()
        .promote
        .key(keys.delayed())
        .key(keys.queues())
        .arg(format!("{}:", keys.ns()))
        .arg(keys.locket_prefix())
        .arg(batch.min(100))
        .arg(member.unwrap_or(""))
        .invoke_async(conn)
        .await
}

/// Drops expired dependency holds of up to `batch` names (R-3 step 3). Returns fields dropped.
pub async fn purge_holds<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    batch: usize,
) -> RedisResult<u64> {
    scripts()
        .purge_deps
        .key(keys.deps())
        .arg(keys.locket_prefix())
        .arg(batch.min(100))
        .invoke_async(conn)
        .await
}

/// ENQUEUE (D-3): pushes `payload` to `queue` and adds its enqueue-time holds in one step.
/// Returns the queue length after the push.
pub async fn enqueue<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queue: &str,
    payload: &str,
    digest: &str,
    holds: &[String],
    hold_ttl: Duration,
) -> RedisResult<u64> {
    let mut inv = scripts().enqueue.prepare_invoke();
    inv.key(keys.queue(queue))
        .key(keys.queues())
        .arg(queue)
        .arg(payload)
        .arg(keys.locket_prefix())
        .arg(digest)
        .arg(ms(hold_ttl));
    for h in holds {
        inv.arg(h);
    }
    inv.invoke_async(conn).await
}

/// An operator's release (O-2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminRelease<'a> {
    /// Compare-and-delete of one lock holder.
    LockToken(&'a str, &'a str),
    /// Every holder of a lock (counted as `force_released`).
    LockForce(&'a str),
    /// One hold of a name by one digest.
    HoldDigest(&'a str, &'a str),
    /// Every hold of a name.
    HoldAll(&'a str),
}

/// Runs an operator's release; returns the number of holders or holds removed.
pub async fn admin_release<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    what: &AdminRelease<'_>,
) -> RedisResult<u64> {
    let (op, id, arg) = match what {
        AdminRelease::LockToken(id, t) => ("lock_token", *id, *t),
        AdminRelease::LockForce(id) => ("lock_force", *id, ""),
        AdminRelease::HoldDigest(n, d) => ("hold_digest", *n, *d),
        AdminRelease::HoldAll(n) => ("hold_all", *n, ""),
    };
    scripts()
        .admin
        .key(keys.locks())
        .arg(keys.locket_prefix())
        .arg(op)
        .arg(id)
        .arg(arg)
        .invoke_async(conn)
        .await
}
