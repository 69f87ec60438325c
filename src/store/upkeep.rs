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

/// Lists a lock's members (live or not yet purged) with their metadata.
pub async fn holders<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    lock_id: &str,
) -> RedisResult<Vec<Holder>> {
    let members: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(keys.lock(lock_id))
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
