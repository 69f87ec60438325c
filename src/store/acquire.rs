//! ACQUIRE with START (A-6..A-9) and the conflict policies (§6), and EXTEND (A-10).

use super::scripts::scripts;
use super::{int, lock_keys, ms, text, unexpected, Acquired, SlotRef};
use crate::conn::evalsha;
use crate::locks::{DelaySettings, LockSpec, Policy, RateSpec};
use crate::resque::failure::FailureBackend;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use std::time::Duration;

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
    /// This ACQUIRE is sent again after an attempt whose reply never came: the script then
    /// reads the reservation to tell "already started" from a first start.
    pub resent: bool,
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
        AcquireOutcome::Cancelled(_) => Acquired::Cancelled,
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
    /// Most jobs parked on one resource (PK-7).
    pub max_parked: u64,
    /// The policy when the resource's parked list is full (PK-7).
    pub on_park_full: Policy,
    /// Keyed rate limits, checked with the locks, all or nothing (rate-limits.md RL-1, RL-2).
    pub rates: &'a [RateSpec],
    /// The job's unique entry when its class's policy follows the job (U-2..U-4).
    pub unique: Option<&'a super::UniqueEntry>,
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
            max_parked: DEFAULT_MAX_PARKED,
            on_park_full: Policy::Requeue,
            rates: &[],
            unique: None,
        }
    }
}

/// `max_parked`'s default, which acquire.lua assumes when it is not sent.
pub(super) const DEFAULT_MAX_PARKED: u64 = 100_000;

/// Kind of a conflicting resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictKind {
    /// An execution lock was full.
    Lock,
    /// A `locked_by` hold was live.
    Dependency,
    /// A keyed rate allowed no start yet (RL-1); `earliest_deadline_ms` is when it will.
    Rate,
}

impl ConflictKind {
    /// `lock` or `dep`, as in the `blocked:<kind>:` keys.
    pub fn word(self) -> &'static str {
        match self {
            ConflictKind::Lock => "lock",
            ConflictKind::Dependency => "dep",
            ConflictKind::Rate => "rate",
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
    /// Parked on the first resource that refused it, woken when it frees a unit (PK-1).
    Parked,
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
    /// An operator cancelled the reservation before it started (A-21): nothing started, the
    /// job stays reserved for the worker to record. The request (JSON `{by, requeue}`).
    Cancelled(String),
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
    let fallback = match opts {
        Some(o) => o.on_lock_conflict.script_word(),
        None if req.requeue_on_conflict => "requeue",
        None => "none",
    };
    let extras = opts.map(|o| extras(slot, req, o)).unwrap_or_default();
    // The command is written once, straight into its buffer (no ScriptInvocation, whose
    // per-argument copies the EVALSHA then copies again).
    let reply: Value = evalsha(
        conn,
        &scripts().direct.acquire,
        6 + req.locks.len(),
        |cmd| {
            cmd.arg(keys.inflight(slot.slot_key))
                .arg(keys.queue(req.queue))
                .arg(keys.queues())
                .arg(keys.counter(req.queue))
                .arg(keys.worker(slot.worker_id))
                .arg(keys.locks());
            // Only the lock keys: acquire.lua names a lock's lockinfo and blocked set from its id
            // when it needs them.
            for l in req.locks {
                cmd.arg(keys.lock(&l.id));
            }
            cmd.arg(req.rid)
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
                .arg(&extras)
                .arg(super::wall_ms())
                .arg(if req.resent { "1" } else { "" });
            for l in req.locks {
                cmd.arg(&l.id).arg(l.limit.max(1));
            }
        },
    )
    .await?;
    match reply {
        Value::Array(reply) => parse_acquired(reply),
        other => unexpected("acquire", &other),
    }
}

/// ACQUIRE's options as the JSON object the script reads (only what differs from the plain
/// path), or "" when nothing does.
fn extras(slot: &SlotRef<'_>, req: &AcquireRequest<'_>, o: &AcquireOptions<'_>) -> String {
    let keys = slot.keys;
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
    if o.max_parked != DEFAULT_MAX_PARKED {
        m.insert("max_parked".into(), o.max_parked.into());
    }
    if o.on_park_full != Policy::Requeue {
        m.insert("park_full".into(), o.on_park_full.script_word().into());
    }
    if !o.rates.is_empty() {
        let rates: Vec<serde_json::Value> = o
            .rates
            .iter()
            .map(|r| serde_json::json!([r.key, r.limit, ms(r.period), u8::from(r.spread)]))
            .collect();
        m.insert("rates".into(), rates.into());
    }
    if let Some(u) = o.unique {
        m.insert("unique".into(), u.spec());
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

/// ACQUIRE's reply: `ok` with the deadline and fences, `conflict` with where the job went and
/// each conflicting resource, `cancelled` with the operator's request, `missing`, or `dead`.
pub(super) fn parse_acquired(reply: Vec<Value>) -> RedisResult<AcquireOutcome> {
    match reply.first().map(text).as_deref() {
        Some("ok") if reply.len() >= 2 => Ok(AcquireOutcome::Started {
            deadline_ms: int(&reply[1]),
            fences: reply[2..].iter().map(int).collect(),
        }),
        Some("conflict") if reply.len() >= 4 && (reply.len() - 4).is_multiple_of(5) => {
            let (due_ms, attempt) = (int(&reply[2]), int(&reply[3]));
            let action = match text(&reply[1]).as_str() {
                "requeued" => Settled::Requeued,
                "parked" => Settled::Parked,
                "delayed" => Settled::Delayed { due_ms, attempt },
                "discarded" => Settled::Discarded,
                "failed" => Settled::Failed { attempt },
                _ => Settled::None,
            };
            let conflicts = reply[4..]
                .chunks(5)
                .map(|c| Conflict {
                    kind: match text(&c[0]).as_str() {
                        "dep" => ConflictKind::Dependency,
                        "rate" => ConflictKind::Rate,
                        _ => ConflictKind::Lock,
                    },
                    id: text(&c[1]),
                    holders: int(&c[2]),
                    limit: int(&c[3]),
                    earliest_deadline_ms: text(&c[4]).parse::<f64>().unwrap_or(0.0) as u64,
                })
                .collect();
            Ok(AcquireOutcome::Conflict { action, conflicts })
        }
        Some("cancelled") if reply.len() == 2 => Ok(AcquireOutcome::Cancelled(text(&reply[1]))),
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
