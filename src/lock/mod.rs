//! Job locks, queue lock counters and the locket loop's atomic steps, as a typed API over the
//! Lua scripts in `lua/` (locking-semantics.md §5, §7, §9).
//!
//! Each function is one script call, so one round trip; the rules each one keeps are named on
//! the script itself.

pub mod canonical;
pub mod scripts;

use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use scripts::scripts;
use std::time::Duration;

/// One lock a job needs: its rendered id and how many holders it may have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockSpec {
    /// The lock id (rendered key template, T-4/T-5).
    pub id: String,
    /// Most live holders (L-1), at least 1.
    pub limit: u32,
}

/// What RESERVE found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// A job left `queue` and now sits in the slot's inflight record under `rid`.
    Job {
        /// Queue it came from.
        queue: String,
        /// Exact payload bytes.
        payload: Vec<u8>,
        /// Reservation id.
        rid: String,
    },
    /// No queue yielded a job; these queues were skipped by the counter rule.
    Nothing {
        /// Queues skipped because `counter >= LLEN`.
        skipped: Vec<String>,
    },
    /// `pause-all-workers` is set.
    Paused,
    /// The slot already holds a reservation (K-2).
    Busy,
}

/// What ACQUIRE did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// All locks taken and the job started; `deadline_ms` is the server-side lease end.
    Started {
        /// Lease deadline, Redis server time in ms.
        deadline_ms: u64,
    },
    /// A lock was full.
    Conflict {
        /// True when the job went back to the tail of its queue with the counter bumped.
        requeued: bool,
        /// The first full lock.
        lock_id: String,
        /// Its live holders.
        holders: u64,
        /// The limit this job asked for.
        limit: u64,
    },
    /// The reservation is no longer this slot's.
    Missing,
}

/// How a job ended, for FINISH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// Ran and succeeded.
    Success,
    /// Failed by itself: the record is pushed and counted in `stat:failed`.
    Failure(String),
    /// Killed: the record is pushed, not counted in `stat:failed` (Resque's DirtyExit).
    Dirty(String),
    /// Back to the tail of its queue, no Resque stats.
    Requeue,
}

/// The slot-level inputs shared by every step of one job.
#[derive(Debug, Clone)]
pub struct SlotRef<'a> {
    /// Key names.
    pub keys: &'a Keys,
    /// `<process id>:<slot number>`.
    pub slot_key: &'a str,
    /// The slot's Resque worker id.
    pub worker_id: &'a str,
}

/// Inputs of ACQUIRE.
#[derive(Debug, Clone)]
pub struct AcquireRequest<'a> {
    /// Reservation id.
    pub rid: &'a str,
    /// New token for this attempt (L-3).
    pub token: &'a str,
    /// Queue the job came from.
    pub queue: &'a str,
    /// Job class.
    pub class: &'a str,
    /// Payload digest.
    pub digest: &'a str,
    /// Locks, all or nothing. Empty means START alone.
    pub locks: &'a [LockSpec],
    /// Lease length.
    pub lock_ttl: Duration,
    /// Counter lifetime.
    pub counter_ttl: Duration,
    /// Requeue on conflict (P-1) rather than leave the job reserved.
    pub requeue_on_conflict: bool,
    /// Resque's working-on JSON.
    pub working_on: &'a str,
    /// Holder metadata JSON object for `lockinfo`.
    pub lockinfo: &'a str,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn int(v: &Value) -> u64 {
    match v {
        Value::Int(i) => u64::try_from(*i).unwrap_or(0),
        other => text(other).parse().unwrap_or(0),
    }
}

fn unexpected<T>(what: &str, v: &Value) -> RedisResult<T> {
    Err(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected script reply",
        format!("{what}: {v:?}"),
    )))
}

/// Appends the three keys every lock-touching script takes per lock, in the order the scripts
/// document: `lock:<id>`, `lockinfo:<id>`, `blocked:lock:<id>`.
pub fn lock_keys<'a>(
    inv: &mut redis::ScriptInvocation<'_>,
    keys: &Keys,
    ids: impl IntoIterator<Item = &'a str>,
) {
    for id in ids {
        inv.key(keys.lock(id))
            .key(keys.lockinfo(id))
            .key(keys.blocked_lock(id));
    }
}

/// RESERVE: pop the first job whose queue is not skipped, into the slot's inflight record.
pub async fn reserve<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queues: &[String],
    clear_counters_when_idle: bool,
) -> RedisResult<Reserved> {
    let mut inv = scripts().reserve.prepare_invoke();
    inv.key(slot.keys.inflight(slot.slot_key))
        .key(slot.keys.pause_all());
    for q in queues {
        inv.key(slot.keys.queue(q)).key(slot.keys.counter(q));
    }
    inv.arg(rid)
        .arg(slot.worker_id)
        .arg(if clear_counters_when_idle { "1" } else { "0" });
    for q in queues {
        inv.arg(q);
    }
    let reply: Vec<Value> = inv.invoke_async(conn).await?;
    match reply.first().map(text).as_deref() {
        Some("job") if reply.len() == 4 => Ok(Reserved::Job {
            queue: text(&reply[1]),
            payload: match &reply[2] {
                Value::BulkString(b) => b.clone(),
                other => text(other).into_bytes(),
            },
            rid: text(&reply[3]),
        }),
        Some("nothing") => Ok(Reserved::Nothing {
            skipped: reply[1..].iter().map(text).collect(),
        }),
        Some("paused") => Ok(Reserved::Paused),
        Some("busy") => Ok(Reserved::Busy),
        _ => unexpected("reserve", &Value::Array(reply)),
    }
}

/// ACQUIRE with START: take all locks or none; start the job or handle the conflict.
pub async fn acquire<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &AcquireRequest<'_>,
) -> RedisResult<Acquired> {
    let keys = slot.keys;
    let mut inv = scripts().acquire.prepare_invoke();
    inv.key(keys.inflight(slot.slot_key))
        .key(keys.queue(req.queue))
        .key(keys.queues())
        .key(keys.counter(req.queue))
        .key(keys.worker(slot.worker_id))
        .key(keys.locks());
    lock_keys(&mut inv, keys, req.locks.iter().map(|l| l.id.as_str()));
    inv.arg(req.rid)
        .arg(req.token)
        .arg(ms(req.lock_ttl))
        .arg(ms(req.counter_ttl))
        .arg(if req.requeue_on_conflict {
            "requeue"
        } else {
            "none"
        })
        .arg(req.working_on)
        .arg(req.lockinfo)
        .arg(keys.counter_prefix())
        .arg(req.queue)
        .arg(req.class)
        .arg(req.digest);
    for l in req.locks {
        inv.arg(&l.id).arg(l.limit.max(1));
    }
    let reply: Vec<Value> = inv.invoke_async(conn).await?;
    match reply.first().map(text).as_deref() {
        Some("ok") if reply.len() == 2 => Ok(Acquired::Started {
            deadline_ms: int(&reply[1]),
        }),
        Some("conflict") if reply.len() == 6 => Ok(Acquired::Conflict {
            requeued: text(&reply[1]) == "requeued",
            lock_id: text(&reply[2]),
            holders: int(&reply[3]),
            limit: int(&reply[4]),
        }),
        Some("missing") => Ok(Acquired::Missing),
        _ => unexpected("acquire", &Value::Array(reply)),
    }
}

/// EXTEND: compare-and-extend. Returns the new server deadline and, per lock, whether
/// it was lost.
pub async fn extend<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    token: &str,
    locks: &[LockSpec],
    lock_ttl: Duration,
) -> RedisResult<(u64, Vec<bool>)> {
    let mut inv = scripts().extend.prepare_invoke();
    inv.key(keys.locks());
    lock_keys(&mut inv, keys, locks.iter().map(|l| l.id.as_str()));
    inv.arg(token).arg(ms(lock_ttl)).arg(keys.counter_prefix());
    for l in locks {
        inv.arg(&l.id);
    }
    let reply: Vec<u64> = inv.invoke_async(conn).await?;
    match reply.split_first() {
        Some((deadline, lost)) => Ok((*deadline, lost.iter().map(|v| *v == 1).collect())),
        None => unexpected("extend", &Value::Nil),
    }
}

/// Where failure records go (resque-protocol.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureBackend {
    /// `RPUSH <ns>:failed` (Resque's default).
    #[default]
    Redis,
    /// `RPUSH <ns>:<q>_failed` and `SADD <ns>:failed_queues <q>_failed`.
    RedisMultiQueue,
}

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
    let keys = slot.keys;
    let (failed_list, multi_name) = match req.backend {
        FailureBackend::Redis => (keys.failed(), String::new()),
        FailureBackend::RedisMultiQueue => (
            keys.queue_failed(req.queue),
            format!("{}_failed", req.queue),
        ),
    };
    let (outcome, record) = match req.outcome {
        Finish::Success => ("success", ""),
        Finish::Failure(r) => ("failure", r.as_str()),
        Finish::Dirty(r) => ("dirty", r.as_str()),
        Finish::Requeue => ("requeue", ""),
    };
    let mut inv = scripts().finish.prepare_invoke();
    inv.key(keys.inflight(slot.slot_key))
        .key(keys.worker(slot.worker_id))
        .key(keys.stat_processed())
        .key(keys.stat_processed_by(slot.worker_id))
        .key(keys.stat_failed())
        .key(keys.stat_failed_by(slot.worker_id))
        .key(failed_list)
        .key(keys.failed_queues())
        .key(keys.queue(req.queue))
        .key(keys.queues())
        .key(keys.locks());
    lock_keys(&mut inv, keys, req.locks.iter().map(|l| l.id.as_str()));
    inv.arg(req.rid)
        .arg(req.token)
        .arg(outcome)
        .arg(record)
        .arg(multi_name)
        .arg(keys.counter_prefix())
        .arg(req.queue);
    for l in req.locks {
        inv.arg(&l.id);
    }
    let reply: String = inv.invoke_async(conn).await?;
    Ok(reply == "ok")
}

/// Returns a reservation that never started to the head of its queue. False when the
/// record was not this reservation's.
pub async fn return_to_queue<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queue: &str,
) -> RedisResult<bool> {
    let keys = slot.keys;
    let reply: String = scripts()
        .return_job
        .key(keys.inflight(slot.slot_key))
        .key(keys.queue(queue))
        .key(keys.queues())
        .arg(rid)
        .arg(queue)
        .invoke_async(conn)
        .await?;
    Ok(reply == "ok")
}

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

/// Reads a value that scripts return as a status or bulk string.
pub fn reply_text(v: &Value) -> String {
    text(v)
}
