//! Operator pause of queues (locking-semantics.md A-20): resque-pause's keys
//! `<ns>:pause:queue:<q>` and `<ns>:pause:all`, set and deleted by `pause.lua`, read here for
//! `status`, the web page and `/metrics`. RESERVE reads them itself, in its own script. And the
//! other operator control of a queue's jobs: a cancel request for a running job.

use super::scripts::scripts;
use crate::conn::evalsha;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;

/// What pauses a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseState {
    /// Not paused.
    Running,
    /// `<ns>:pause:queue:<q>` exists.
    Queue,
    /// `<ns>:pause:all` exists.
    All,
}

impl PauseState {
    /// Whether RESERVE passes the queue over.
    pub fn is_paused(self) -> bool {
        self != PauseState::Running
    }
}

/// Pauses (`on`) or resumes `queues`, or every queue (`None`: `<ns>:pause:all`). Returns how
/// many keys changed. A key of another type refuses the whole call before any write (S-6).
pub async fn set_paused<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: Option<&[String]>,
    on: bool,
) -> RedisResult<u64> {
    let names: Vec<String> = match queues {
        Some(qs) => qs.iter().map(|q| keys.pause_queue(q)).collect(),
        None => vec![keys.pause_every_queue()],
    };
    evalsha(conn, &scripts().pause, names.len(), |cmd| {
        for k in &names {
            cmd.arg(k.as_str());
        }
        cmd.arg(if on { "pause" } else { "resume" });
    })
    .await
}

/// The pause state of each of `queues`, in order, read with one pipeline of `EXISTS` (a key of
/// any type pauses, as RESERVE reads it).
pub async fn pause_states<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: &[String],
) -> RedisResult<Vec<PauseState>> {
    let mut pipe = redis::pipe();
    pipe.cmd("EXISTS").arg(keys.pause_every_queue());
    for q in queues {
        pipe.cmd("EXISTS").arg(keys.pause_queue(q));
    }
    let found: Vec<bool> = pipe.query_async(conn).await?;
    let all = found.first().copied().unwrap_or(false);
    Ok(queues
        .iter()
        .enumerate()
        .map(|(i, _)| {
            if all {
                PauseState::All
            } else if found.get(i + 1).copied().unwrap_or(false) {
                PauseState::Queue
            } else {
                PauseState::Running
            }
        })
        .collect())
}

/// Records a cancel request for reservation `rid` of slot `slot_key` (of process
/// `process`), read by that process within a second. Returns the reservation's state
/// (`reserved`, `running`), or `None` when the slot no longer holds `rid` (nothing written).
pub async fn request_cancel<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    process: &str,
    slot_key: &str,
    rid: &str,
    request: &str,
    keep: std::time::Duration,
) -> RedisResult<Option<String>> {
    let state: String = evalsha(conn, &scripts().cancel, 2, |cmd| {
        cmd.arg(keys.inflight(slot_key))
            .arg(keys.cancel(process))
            .arg(rid)
            .arg(request)
            .arg(u64::try_from(keep.as_millis()).unwrap_or(u64::MAX));
    })
    .await?;
    Ok((state != "gone").then_some(state))
}

/// writes the fleet-wide caps of the config (`[queue.<q>] concurrency = N`) to
/// `<ns>:locket:cap:<q>`, where every daemon's RESERVE reads them.
pub async fn publish_caps<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    caps: &[(String, u32)],
) -> RedisResult<()> {
    if caps.is_empty() {
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for (q, n) in caps {
        pipe.set(keys.cap(q), *n).ignore();
    }
    pipe.query_async(conn).await
}

/// frees the units of `queue` whose reservation is over without a FINISH having freed
/// them (the job was requeued or parked by its ACQUIRE, returned, or its record is gone).
/// A member names its reservation and its slot record, so a unit is lapsed when the record no
/// longer holds that rid; nothing re-adds a member once lapsed (rids are never reused).
/// Returns the number freed.
pub async fn free_lapsed_units<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queue: &str,
) -> RedisResult<u64> {
    let running = keys.running(queue);
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&running)
        .query_async(conn)
        .await?;
    if members.is_empty() {
        return Ok(0);
    }
    let mut pipe = redis::pipe();
    for m in &members {
        let inflight = m.split_once(' ').map(|(_, k)| k).unwrap_or("");
        pipe.hget(inflight, "rid");
    }
    let rids: Vec<Option<String>> = pipe.query_async(conn).await?;
    let lapsed: Vec<&String> = members
        .iter()
        .zip(rids)
        .filter(|(m, rid)| {
            let want = m.split_once(' ').map(|(r, _)| r).unwrap_or(m.as_str());
            rid.as_deref() != Some(want)
        })
        .map(|(m, _)| m)
        .collect();
    if lapsed.is_empty() {
        return Ok(0);
    }
    redis::cmd("SREM")
        .arg(&running)
        .arg(&lapsed)
        .query_async(conn)
        .await
}

/// `(running, cap)` of each of `queues`; `cap` is `None` for a queue without one.
pub async fn cap_states<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: &[String],
) -> RedisResult<Vec<(u64, Option<u64>)>> {
    if queues.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for q in queues {
        pipe.get(keys.cap(q)).scard(keys.running(q));
    }
    let flat: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
    Ok(flat
        .chunks(2)
        .map(|c| {
            let cap = redis::from_redis_value::<Option<String>>(c[0].clone())
                .ok()
                .flatten()
                .and_then(|s| s.trim().parse().ok());
            let running = redis::from_redis_value::<u64>(c[1].clone()).unwrap_or(0);
            (running, cap)
        })
        .collect())
}
