//! Parked waits (parked-waits.md; locking-semantics.md PK-*): the janitor's pass over the
//! `parked` index (PK-4), `locketd unpark` (PK-9), and the bounded reads `locketd parked`,
//! `status`, `locks`, the web page and `/metrics` show (PK-8). Parking and waking themselves
//! happen inside ACQUIRE and the release steps (`acquire.lua`, `lib_lock.lua`, `lib_conflict.lua`).

use super::ms;
use super::scripts::scripts;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::BTreeMap;
use std::time::Duration;

/// `<ns>:locket:parked`: the index of the resources with parked jobs.
pub fn parked_index(keys: &Keys) -> String {
    keys.locket("parked")
}

/// `<ns>:locket:parked:<resource>`, the list of one resource (`lock:<id>` or `dep:<name>`).
pub fn parked_list(keys: &Keys, resource: &str) -> String {
    keys.locket(&format!("parked:{resource}"))
}

/// `<ns>:locket:parked_queues`: parked jobs per queue.
pub fn parked_queues_key(keys: &Keys) -> String {
    keys.locket("parked_queues")
}

/// What one [`wake_due`] pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Jobs moved back to their queues.
    pub woken: u64,
    /// Whether the index still names a resource (due now or later): while it does not,
    /// nothing is parked anywhere and the checks between janitor passes can rest.
    pub pending: bool,
    /// While something is pending, when to look next: the `every` asked for, or sooner when a
    /// rate's next start (RL-3) comes first (locks and holds keep `every`, PK-4).
    pub next_in: Duration,
    /// Resources whose first entry cannot move (a key of another type, PK-6); each is
    /// reported at most once a minute.
    pub stuck: Vec<String>,
}

/// PK-4: wakes the jobs parked on up to `batch` due resources that have a free unit (their
/// holder lapsed, or a hold's wake has more to move).
pub async fn wake_due<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    batch: usize,
    every: Duration,
) -> RedisResult<WakeReport> {
    let reply: Vec<redis::Value> = scripts()
        .wake_due
        .key(parked_index(keys))
        .arg(keys.locket_prefix())
        .arg(batch.min(100))
        .arg(ms(every))
        .invoke_async(conn)
        .await?;
    let mut it = reply.iter();
    let woken = it.next().map(super::int).unwrap_or(0);
    let pending_ms = it.next().map(super::int).unwrap_or(1);
    Ok(WakeReport {
        woken,
        pending: pending_ms != 0,
        next_in: Duration::from_millis(pending_ms.saturating_sub(1)).min(every),
        stuck: it.map(super::text).collect(),
    })
}

/// PK-9: moves up to 1,000 jobs parked on `resource` back to the heads of their queues
/// (only those of `queue` when given, then at most 100, looking from position `from`).
/// Returns (moved, looked at, stuck).
pub async fn unpark_batch<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resource: &str,
    queue: Option<&str>,
    from: u64,
) -> RedisResult<(u64, u64, bool)> {
    let (moved, looked, stuck): (u64, u64, u64) = scripts()
        .unpark
        .arg(keys.locket_prefix())
        .arg(resource)
        .arg(1000)
        .arg(queue.unwrap_or(""))
        .arg(from)
        .invoke_async(conn)
        .await?;
    Ok((moved, looked, stuck == 1))
}

/// Every resource with parked jobs (`lock:<id>` or `dep:<name>`), at most `limit`.
pub async fn parked_resources<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    limit: usize,
) -> RedisResult<Vec<String>> {
    redis::cmd("ZRANGE")
        .arg(parked_index(keys))
        .arg(0)
        .arg(limit.max(1) as i64 - 1)
        .query_async(conn)
        .await
}

/// When the janitor looks at `resource`'s parked jobs next (ms, the `parked` index's score):
/// for a rate key (RL-3), when its next start is allowed.
pub async fn parked_due<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resource: &str,
) -> RedisResult<Option<u64>> {
    let s: Option<f64> = redis::cmd("ZSCORE")
        .arg(parked_index(keys))
        .arg(resource)
        .query_async(conn)
        .await?;
    Ok(s.map(|s| s as u64))
}

/// PK-9: moves every job parked on `resources` (only those of `queue` when given) back to
/// the heads of their queues, in batches. Returns the jobs moved and the resources whose
/// next entry could not move (PK-6).
pub async fn unpark<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resources: &[String],
    queue: Option<&str>,
) -> RedisResult<(u64, Vec<String>)> {
    let (mut total, mut stuck) = (0, Vec::new());
    for r in resources {
        let mut from = 0;
        loop {
            let (moved, looked, bad) = unpark_batch(conn, keys, r, queue, from).await?;
            total += moved;
            if bad {
                stuck.push(r.clone());
                break;
            }
            if looked == 0 || (queue.is_none() && moved == 0) {
                break;
            }
            if queue.is_some() {
                from += looked - moved;
            }
        }
    }
    Ok((total, stuck))
}

/// Parked jobs per queue (PK-8), from the counts the park and wake steps keep; a queue whose
/// count fell to 0 or below is left out.
pub async fn parked_per_queue<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> RedisResult<BTreeMap<String, u64>> {
    let raw: BTreeMap<String, i64> = redis::cmd("HGETALL")
        .arg(parked_queues_key(keys))
        .query_async(conn)
        .await
        .unwrap_or_default();
    Ok(raw
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(q, n)| (q, n as u64))
        .collect())
}

/// The number of jobs parked on each of `resources`, in order (0 for a list that is missing or
/// of another type).
pub async fn parked_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resources: &[String],
) -> RedisResult<Vec<u64>> {
    if resources.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for r in resources {
        pipe.cmd("LLEN").arg(parked_list(keys, r));
    }
    let replies: Vec<redis::Value> = pipe.query_async(conn).await?;
    Ok(replies.iter().map(super::int).collect())
}

/// One parked job, as `locketd parked` lists it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ParkedJob {
    /// `lock:<id>` or `dep:<name>`.
    pub resource: String,
    /// Its place in the resource's list (0: next to wake).
    pub position: u64,
    /// The queue it goes back to.
    pub queue: String,
    /// Its class.
    pub class: String,
    /// Its reservation id when it parked.
    pub rid: String,
    /// When it parked, Redis server ms.
    pub parked_at: u64,
    /// The payload, as text.
    pub payload: String,
}

/// Up to `limit` jobs parked on `resource`, from the head.
pub async fn parked_jobs<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resource: &str,
    limit: usize,
) -> RedisResult<Vec<ParkedJob>> {
    let raw: Vec<Vec<u8>> = redis::cmd("LRANGE")
        .arg(parked_list(keys, resource))
        .arg(0)
        .arg(limit.max(1) as i64 - 1)
        .query_async(conn)
        .await
        .unwrap_or_default();
    Ok(raw
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let v: serde_json::Value = serde_json::from_slice(e).ok()?;
            Some(ParkedJob {
                resource: resource.to_string(),
                position: i as u64,
                queue: v["queue"].as_str().unwrap_or("").to_string(),
                class: v["class"].as_str().unwrap_or("").to_string(),
                rid: v["rid"].as_str().unwrap_or("").to_string(),
                parked_at: v["parked_at"].as_f64().unwrap_or(0.0) as u64,
                payload: v["payload"].as_str().unwrap_or("").to_string(),
            })
        })
        .collect())
}
