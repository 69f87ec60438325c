//! FINISH with its hold releases, RETURN of an unstarted job, and PARK (E-3).

use super::scripts::scripts;
use super::{Finish, SlotRef};
use crate::conn::evalsha;
use crate::locks::LockSpec;
use crate::resque::failure::FailureBackend;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};

/// Inputs of FINISH.
#[derive(Debug, Clone)]
pub struct FinishRequest<'a> {
    /// Reservation id.
    pub rid: &'a str,
    /// The attempt's token, empty when no lock was taken.
    pub token: &'a str,
    /// Queue the job came from.
    pub queue: &'a str,
    /// The attempt's locks.
    pub locks: &'a [LockSpec],
    /// Outcome.
    pub outcome: &'a Finish,
    /// Failure list choice.
    pub backend: FailureBackend,
}

/// FINISH. Returns false when the reservation had been recovered elsewhere ("missing").
pub async fn finish<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
) -> RedisResult<bool> {
    finish_with(conn, slot, req, &FinishHolds::default()).await
}

/// What FINISH releases besides locks, and the class for the stats (D-6, D-7, O-3).
#[derive(Debug, Clone, Default)]
pub struct FinishHolds<'a> {
    /// Job class.
    pub class: &'a str,
    /// Payload digest.
    pub digest: &'a str,
    /// Hold names to release (chosen from the outcome and each hold's `release_on`).
    pub release: &'a [String],
    /// This FINISH is sent again after an attempt whose reply never came. If its reservation
    /// is gone, that attempt most likely landed, so the holds are not released a second time.
    pub resent: bool,
    /// What FINISH does with the job's unique entry ([`UniqueEntry::finish_arg`](super::UniqueEntry::finish_arg)), `""` for nothing.
    pub unique: &'a str,
}

/// FINISH with hold releases (A-13 step 3).
pub async fn finish_with<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
    holds: &FinishHolds<'_>,
) -> RedisResult<bool> {
    let (keys, args) = finish_parts(slot, req, holds);
    let reply: Value = evalsha(conn, &scripts().direct.finish, keys.len(), |cmd| {
        cmd.arg(&keys).arg(&args);
    })
    .await?;
    Ok(super::text(&reply) == "ok")
}

/// FINISH's keys and arguments.
pub(super) fn finish_parts(
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
    holds: &FinishHolds<'_>,
) -> (Vec<String>, Vec<String>) {
    let keys = slot.keys;
    let (failed_list, multi_name) = match req.backend {
        FailureBackend::Redis => (keys.failed(), String::new()),
        FailureBackend::RedisMultiQueue => (
            keys.queue_failed(req.queue),
            format!("{}_failed", req.queue),
        ),
    };
    let throttled;
    let (outcome, record) = match req.outcome {
        Finish::Success => ("success", ""),
        Finish::Failure(r) => ("failure", r.as_str()),
        Finish::Dirty(r) => ("dirty", r.as_str()),
        Finish::Requeue => ("requeue", ""),
        Finish::Return => ("return", ""),
        Finish::Throttled { rate, retry_after } => {
            throttled = serde_json::json!({
                "key": rate.key,
                "limit": rate.limit,
                "period": super::ms(rate.period),
                "spread": u8::from(rate.spread),
                "for": super::ms(*retry_after),
            })
            .to_string();
            ("throttled", throttled.as_str())
        }
    };
    let mut k = vec![
        keys.inflight(slot.slot_key),
        keys.worker(slot.worker_id),
        keys.stat_processed(),
        keys.stat_processed_by(slot.worker_id),
        keys.stat_failed(),
        keys.stat_failed_by(slot.worker_id),
        failed_list,
        keys.failed_queues(),
        keys.queue(req.queue),
        keys.queues(),
        keys.locks(),
    ];
    // Only the lock keys: finish.lua names a lock's lockinfo and blocked set from its id when
    // it needs them.
    for l in req.locks {
        k.push(keys.lock(&l.id));
    }
    let mut a = vec![
        req.rid.to_string(),
        req.token.to_string(),
        outcome.to_string(),
        record.to_string(),
        multi_name,
        keys.counter_prefix(),
        req.queue.to_string(),
        holds.class.to_string(),
        holds.digest.to_string(),
        if holds.release.is_empty() {
            String::new()
        } else {
            serde_json::Value::from(holds.release.to_vec()).to_string()
        },
        if holds.resent { "1" } else { "" }.to_string(),
        holds.unique.to_string(),
    ];
    for l in req.locks {
        a.push(l.id.clone());
        a.push(l.limit.max(1).to_string());
    }
    (k, a)
}

/// Returns a reservation that never started to the head of its queue. False when the
/// record was not this reservation's, or an operator's cancel was taken instead ([`move_back`]).
pub async fn return_to_queue<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queue: &str,
) -> RedisResult<bool> {
    Ok(move_back(conn, slot, rid, queue, None).await? == MovedBack::Moved)
}

/// DEFER (H-8): a reservation whose handler cannot take it yet goes to the tail of its queue
/// and the queue's lock counter goes up, so a queue of such jobs is skipped until the
/// counter lapses after `counter_ttl`. Rid-checked, like RETURN.
pub async fn defer_to_queue<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queue: &str,
    counter_ttl: std::time::Duration,
) -> RedisResult<bool> {
    Ok(move_back(conn, slot, rid, queue, Some(counter_ttl)).await? == MovedBack::Moved)
}

/// What RETURN (or DEFER) did with a reservation that never started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MovedBack {
    /// Back in its queue.
    Moved,
    /// The record was not this reservation's: nothing done.
    Missing,
    /// An operator had cancelled it: the request (JSON `{by, requeue}`) was taken, and
    /// the job stays in its record for the worker to record as cancelled.
    Cancelled(String),
}

/// RETURN, or DEFER with the counter's TTL (`return.lua`).
pub async fn move_back<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queue: &str,
    defer: Option<std::time::Duration>,
) -> RedisResult<MovedBack> {
    let keys = slot.keys;
    let mut inv = scripts().return_job.prepare_invoke();
    inv.key(keys.inflight(slot.slot_key))
        .key(keys.queue(queue))
        .key(keys.queues())
        .arg(rid)
        .arg(queue)
        .arg(keys.locket_prefix());
    if let Some(ttl) = defer {
        inv.key(keys.counter(queue))
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
    }
    let reply: Value = inv.invoke_async(conn).await?;
    Ok(match reply {
        Value::Array(v) if v.len() == 2 && super::text(&v[0]) == "cancelled" => {
            MovedBack::Cancelled(super::text(&v[1]))
        }
        v if super::text(&v) == "ok" => MovedBack::Moved,
        _ => MovedBack::Missing,
    })
}

/// PARK (E-3): marks the slot's inflight record, if it is still reservation `rid`'s, as parked
/// since `at` because Redis refused its FINISH with `why`. True when marked.
pub async fn park<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    at: &str,
    why: &str,
) -> RedisResult<bool> {
    let marked: i64 = scripts()
        .park
        .key(slot.keys.inflight(slot.slot_key))
        .arg(rid)
        .arg(at)
        .arg(why)
        .invoke_async(conn)
        .await?;
    Ok(marked == 1)
}
