//! Job locks, queue lock counters and the locket loop's atomic steps, as a typed API over the
//! Lua scripts in `lua/` (locking-semantics.md §5, §7, §9).
//!
//! Each function is one script call, so one round trip; the rules each one keeps are named on
//! the script itself.

pub mod batch;
pub mod registry;
pub mod scripts;

use crate::conn::evalsha;
use crate::locks::{DelaySettings, LockSpec, Policy};
use crate::resque::failure::FailureBackend;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::{Cmd, RedisResult, Value};
use scripts::scripts;
use std::time::Duration;

/// `n` random bytes as lowercase hex (OS CSPRNG via `rand`'s thread RNG, reseeded from the OS).
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut buf);
    hex::encode(buf)
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
        /// Queues whose key is not a list (written by another tool): passed over.
        unreadable: Vec<String>,
    },
    /// `pause-all-workers` is set.
    Paused,
    /// The slot already holds a reservation (K-2).
    Busy,
    /// The slot's process lease `alive:<process id>` is gone (R-2): it may have been recovered,
    /// so it reserved nothing.
    Dead,
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
    /// The reservation is no longer this slot's (R-6).
    Missing,
    /// The slot's process lease is gone (R-2): nothing was started.
    Dead,
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
    /// Counter lifetime (A-15).
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

/// RESERVE's keys, written into `cmd` (as [`evalsha`] fills it).
fn reserve_keys(cmd: &mut Cmd, slot: &SlotRef<'_>) {
    cmd.arg(slot.keys.inflight(slot.slot_key))
        .arg(slot.keys.pause_all());
}

/// RESERVE's arguments: the queue keys are built from the names in the script.
fn reserve_args(
    cmd: &mut Cmd,
    slot: &SlotRef<'_>,
    rid: &str,
    queues: &[String],
    clear_counters_when_idle: bool,
) {
    cmd.arg(rid)
        .arg(slot.worker_id)
        .arg(if clear_counters_when_idle { "1" } else { "0" })
        .arg(slot.keys.locket_prefix())
        .arg(slot.keys.queue(""));
    for q in queues {
        cmd.arg(q.as_str());
    }
}

/// Marks the RESERVE part of a FINISH+RESERVE that raised (finish_reserve.lua).
const RESERVE_ERROR: &[u8] = b"__locket_reserve_error__";

fn parse_reserved(reply: Vec<Value>) -> RedisResult<Reserved> {
    match reply.first().map(text).as_deref() {
        Some("job") if reply.len() == 4 => Ok(Reserved::Job {
            queue: text(&reply[1]),
            payload: match &reply[2] {
                Value::BulkString(b) => b.clone(),
                other => text(other).into_bytes(),
            },
            rid: text(&reply[3]),
        }),
        Some("nothing") => {
            let names = |v: Option<&Value>| match v {
                Some(Value::Array(a)) => a.iter().map(text).collect(),
                _ => Vec::new(),
            };
            Ok(Reserved::Nothing {
                skipped: names(reply.get(1)),
                unreadable: names(reply.get(2)),
            })
        }
        Some("paused") => Ok(Reserved::Paused),
        Some("busy") => Ok(Reserved::Busy),
        Some("dead") => Ok(Reserved::Dead),
        _ => unexpected("reserve", &Value::Array(reply)),
    }
}

/// RESERVE (A-1): pop the first job whose queue is not skipped, into the slot's inflight record.
pub async fn reserve<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queues: &[String],
    clear_counters_when_idle: bool,
) -> RedisResult<Reserved> {
    let reply: Vec<Value> = evalsha(conn, &scripts().reserve, 2, |cmd| {
        reserve_keys(cmd, slot);
        reserve_args(cmd, slot, rid, queues, clear_counters_when_idle);
    })
    .await?;
    parse_reserved(reply)
}

/// FINISH of the slot's job and RESERVE of its next one in one round trip. Returns whether the
/// FINISH found its reservation (as [`finish_with`]) and the reservation. An `Ok` means the
/// FINISH landed, even when the RESERVE failed (the inner error): the FINISH must then not be
/// sent again, as a second one would release the job's holds twice (D-8).
#[allow(clippy::too_many_arguments)]
pub async fn finish_and_reserve<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
    holds: &FinishHolds<'_>,
    rid: &str,
    queues: &[String],
    clear_counters_when_idle: bool,
) -> RedisResult<(bool, RedisResult<Reserved>)> {
    let (fkeys, fargs) = finish_parts(slot, req, holds);
    let numkeys = fkeys.len() + 2;
    let reply: Vec<Value> = evalsha(conn, &scripts().finish_reserve, numkeys, |cmd| {
        for k in &fkeys {
            cmd.arg(k.as_str());
        }
        reserve_keys(cmd, slot);
        cmd.arg(fkeys.len()).arg(fargs.len());
        for a in &fargs {
            cmd.arg(a.as_str());
        }
        reserve_args(cmd, slot, rid, queues, clear_counters_when_idle);
    })
    .await?;
    match <[Value; 2]>::try_from(reply) {
        Ok([finished, Value::Array(reserved)]) => {
            let reserved = match reserved.as_slice() {
                [Value::BulkString(mark), msg] if mark == RESERVE_ERROR => {
                    Err(redis::RedisError::from((
                        redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                        "RESERVE failed after its FINISH landed",
                        text(msg),
                    )))
                }
                _ => parse_reserved(reserved),
            };
            Ok((text(&finished) == "ok", reserved))
        }
        Ok(other) => unexpected("finish_reserve", &Value::Array(other.to_vec())),
        Err(v) => unexpected("finish_reserve", &Value::Array(v)),
    }
}

/// ACQUIRE with START (A-6, A-8): take all locks or none; start the job or handle the conflict.
/// Reports the first conflicting lock; [`acquire_with`] reports all of them and takes the
/// policies, holds and fencing options.
pub async fn acquire<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &AcquireRequest<'_>,
) -> RedisResult<Acquired> {
    Ok(match acquire_with(conn, slot, req, None).await? {
        AcquireOutcome::Started { deadline_ms, .. } => Acquired::Started { deadline_ms },
        AcquireOutcome::Missing => Acquired::Missing,
        AcquireOutcome::Dead => Acquired::Dead,
        AcquireOutcome::Conflict { action, conflicts } => {
            let first = conflicts.into_iter().next().unwrap_or(Conflict {
                kind: ConflictKind::Lock,
                id: String::new(),
                holders: 0,
                limit: 0,
                earliest_deadline_ms: 0,
            });
            Acquired::Conflict {
                requeued: action == Settled::Requeued,
                lock_id: first.id,
                holders: first.holders,
                limit: first.limit,
            }
        }
    })
}

/// The options of ACQUIRE beyond [`AcquireRequest`] (§6, §8, L-10).
#[derive(Debug, Clone)]
pub struct AcquireOptions<'a> {
    /// Policy on a lock conflict (overrides `requeue_on_conflict`); `Wait` leaves the job
    /// reserved.
    pub on_lock_conflict: Policy,
    /// Policy on a `locked_by` conflict; it wins when both kinds conflict.
    pub on_dep_conflict: Policy,
    /// Hold names that must be free (D-5).
    pub locked_by: &'a [String],
    /// The job's enqueue-time holds: ensured on start (D-4), self-exclusion (D-5).
    pub enqueue_holds: &'a [String],
    /// Holds added on start (D-9).
    pub start_holds: &'a [String],
    /// Hold lifetime.
    pub hold_ttl: Duration,
    /// Hand out fencing numbers (L-10).
    pub fencing: bool,
    /// Full rendered text per lock (`lock_id_source`, T-5); empty = the ids.
    pub sources: &'a [String],
    /// Backoff of the `delay` policy and its jitter draw `r` in `[0, jitter)`.
    pub delay: Option<(DelaySettings, f64)>,
    /// The Resque failure record for `fail` / exhausted `max_delays`, with the JSON string
    /// `"__LOCKET_CONFLICT__"` as its error (the script writes the message naming the resource).
    pub failure_record: Option<&'a str>,
    /// Failure list choice.
    pub backend: FailureBackend,
    /// Last try of a wait: a conflict counts `wait_timeout`.
    pub last_wait: bool,
}

impl Default for AcquireOptions<'_> {
    fn default() -> Self {
        AcquireOptions {
            on_lock_conflict: Policy::Requeue,
            on_dep_conflict: Policy::Delay,
            locked_by: &[],
            enqueue_holds: &[],
            start_holds: &[],
            hold_ttl: Duration::from_secs(86400),
            fencing: false,
            sources: &[],
            delay: None,
            failure_record: None,
            backend: FailureBackend::Redis,
            last_wait: false,
        }
    }
}

/// Kind of a conflicting resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictKind {
    /// An execution lock was full.
    Lock,
    /// A `locked_by` hold was live.
    Dependency,
}

impl ConflictKind {
    /// `lock` or `dep`, as in the `blocked:<kind>:` keys.
    pub fn word(self) -> &'static str {
        match self {
            ConflictKind::Lock => "lock",
            ConflictKind::Dependency => "dep",
        }
    }
}

/// One conflicting resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// Lock or dependency.
    pub kind: ConflictKind,
    /// Lock id or hold name.
    pub id: String,
    /// Live holders (for a dependency: live holds, less the job's own).
    pub holders: u64,
    /// The limit asked for (0 for a dependency).
    pub limit: u64,
    /// Earliest holder deadline, Redis server ms.
    pub earliest_deadline_ms: u64,
}

/// Where a conflicting job went, in the same script (§6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Still reserved (`wait`).
    None,
    /// Tail of its queue, counter bumped (P-1).
    Requeued,
    /// In `delayed` until `due_ms` (P-4).
    Delayed {
        /// Due time, Redis server ms.
        due_ms: u64,
        /// Delay number of this digest.
        attempt: u64,
    },
    /// Dropped on purpose (P-2).
    Discarded,
    /// Recorded as `Locket::LockConflict` (P-5, or `max_delays` exhausted: `attempt` > 0).
    Failed {
        /// The delay attempt that exceeded `max_delays`, 0 for the `fail` policy.
        attempt: u64,
    },
}

/// What [`acquire_with`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// All locks taken, dependencies free, job started.
    Started {
        /// Lease deadline, Redis server time in ms (0 without locks).
        deadline_ms: u64,
        /// Fencing number per lock (empty without fencing).
        fences: Vec<u64>,
    },
    /// Something conflicted.
    Conflict {
        /// What happened to the job.
        action: Settled,
        /// Every conflicting resource.
        conflicts: Vec<Conflict>,
    },
    /// The reservation is no longer this slot's (R-6).
    Missing,
    /// The slot's process lease is gone (R-2): nothing changed, the job stays reserved.
    Dead,
}

/// ACQUIRE with START and the conflict policies in one script (A-6, P-1..P-5, D-4, D-5, D-9).
/// Without `opts`, a conflict requeues when `req.requeue_on_conflict`, else leaves the job.
pub async fn acquire_with<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &AcquireRequest<'_>,
    opts: Option<&AcquireOptions<'_>>,
) -> RedisResult<AcquireOutcome> {
    let keys = slot.keys;
    let mut inv = scripts().acquire.prepare_invoke();
    inv.key(keys.inflight(slot.slot_key))
        .key(keys.queue(req.queue))
        .key(keys.queues())
        .key(keys.counter(req.queue))
        .key(keys.worker(slot.worker_id))
        .key(keys.locks());
    lock_keys(&mut inv, keys, req.locks.iter().map(|l| l.id.as_str()));
    let fallback = match opts {
        Some(o) => o.on_lock_conflict.script_word(),
        None if req.requeue_on_conflict => "requeue",
        None => "none",
    };
    let extras = match opts {
        None => String::new(),
        Some(o) => {
            let mut m = serde_json::Map::new();
            let list = |v: &[String]| serde_json::Value::from(v.to_vec());
            if !o.locked_by.is_empty() {
                m.insert("locked_by".into(), list(o.locked_by));
            }
            if !o.enqueue_holds.is_empty() {
                m.insert("enqueue_holds".into(), list(o.enqueue_holds));
            }
            if !o.start_holds.is_empty() {
                m.insert("start_holds".into(), list(o.start_holds));
            }
            if !o.locked_by.is_empty() || !o.enqueue_holds.is_empty() || !o.start_holds.is_empty() {
                m.insert("hold_ttl".into(), ms(o.hold_ttl).into());
                m.insert(
                    "dep_fallback".into(),
                    o.on_dep_conflict.script_word().into(),
                );
            }
            if o.fencing {
                m.insert("fencing".into(), true.into());
            }
            if o.sources.iter().zip(req.locks).any(|(s, l)| *s != l.id) {
                m.insert("sources".into(), list(o.sources));
            }
            if let Some((d, r)) = &o.delay {
                m.insert(
                    "delay".into(),
                    serde_json::json!({"base": ms(d.base), "max": ms(d.max), "r": r,
                                       "max_delays": d.max_delays}),
                );
                m.insert("attempts".into(), true.into());
            }
            if let Some(rec) = o.failure_record {
                let (list_key, multi) = match o.backend {
                    FailureBackend::Redis => (keys.failed(), String::new()),
                    FailureBackend::RedisMultiQueue => (
                        keys.queue_failed(req.queue),
                        format!("{}_failed", req.queue),
                    ),
                };
                m.insert("failure".into(), rec.into());
                m.insert("failed_list".into(), list_key.into());
                m.insert("multi_name".into(), multi.into());
                m.insert("failed_queues".into(), keys.failed_queues().into());
                m.insert("stat_failed".into(), keys.stat_failed().into());
                m.insert(
                    "stat_failed_by".into(),
                    keys.stat_failed_by(slot.worker_id).into(),
                );
            }
            if o.last_wait {
                m.insert("last_wait".into(), true.into());
            }
            if o.on_lock_conflict == Policy::Wait || o.on_dep_conflict == Policy::Wait {
                m.insert("wait".into(), true.into());
            }
            if m.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(m).to_string()
            }
        }
    };
    inv.arg(req.rid)
        .arg(req.token)
        .arg(ms(req.lock_ttl))
        .arg(ms(req.counter_ttl))
        .arg(fallback)
        .arg(req.working_on)
        .arg(req.lockinfo)
        .arg(keys.counter_prefix())
        .arg(req.queue)
        .arg(req.class)
        .arg(req.digest)
        .arg(extras);
    for l in req.locks {
        inv.arg(&l.id).arg(l.limit.max(1));
    }
    let reply: Vec<Value> = inv.invoke_async(conn).await?;
    match reply.first().map(text).as_deref() {
        Some("ok") if reply.len() >= 2 => Ok(AcquireOutcome::Started {
            deadline_ms: int(&reply[1]),
            fences: reply[2..].iter().map(int).collect(),
        }),
        Some("conflict") if reply.len() >= 4 && (reply.len() - 4).is_multiple_of(5) => {
            let (due_ms, attempt) = (int(&reply[2]), int(&reply[3]));
            let action = match text(&reply[1]).as_str() {
                "requeued" => Settled::Requeued,
                "delayed" => Settled::Delayed { due_ms, attempt },
                "discarded" => Settled::Discarded,
                "failed" => Settled::Failed { attempt },
                _ => Settled::None,
            };
            let conflicts = reply[4..]
                .chunks(5)
                .map(|c| Conflict {
                    kind: if text(&c[0]) == "dep" {
                        ConflictKind::Dependency
                    } else {
                        ConflictKind::Lock
                    },
                    id: text(&c[1]),
                    holders: int(&c[2]),
                    limit: int(&c[3]),
                    earliest_deadline_ms: text(&c[4]).parse::<f64>().unwrap_or(0.0) as u64,
                })
                .collect();
            Ok(AcquireOutcome::Conflict { action, conflicts })
        }
        Some("missing") => Ok(AcquireOutcome::Missing),
        Some("dead") => Ok(AcquireOutcome::Dead),
        _ => unexpected("acquire", &Value::Array(reply)),
    }
}

/// EXTEND (A-10): compare-and-extend. Returns the new server deadline and, per lock, whether
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

/// FINISH (A-13). Returns false when the reservation had been recovered elsewhere ("missing").
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
}

/// FINISH with hold releases (A-13 step 3).
pub async fn finish_with<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
    holds: &FinishHolds<'_>,
) -> RedisResult<bool> {
    let (keys, args) = finish_parts(slot, req, holds);
    let mut inv = scripts().finish.prepare_invoke();
    for k in &keys {
        inv.key(k);
    }
    for a in &args {
        inv.arg(a);
    }
    let reply: String = inv.invoke_async(conn).await?;
    Ok(reply == "ok")
}

/// FINISH's keys and arguments.
fn finish_parts(
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
    let (outcome, record) = match req.outcome {
        Finish::Success => ("success", ""),
        Finish::Failure(r) => ("failure", r.as_str()),
        Finish::Dirty(r) => ("dirty", r.as_str()),
        Finish::Requeue => ("requeue", ""),
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
    for l in req.locks {
        k.push(keys.lock(&l.id));
        k.push(keys.lockinfo(&l.id));
        k.push(keys.blocked_lock(&l.id));
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
    ];
    a.extend(req.locks.iter().map(|l| l.id.clone()));
    (k, a)
}

/// Returns a reservation that never started to the head of its queue (R-8). False when the
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
        .arg(keys.locket_prefix())
        .invoke_async(conn)
        .await?;
    Ok(reply == "ok")
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

/// Reads a value that scripts return as a status or bulk string.
pub fn reply_text(v: &Value) -> String {
    text(v)
}
