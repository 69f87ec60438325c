//! Job locks, queue lock counters and the locket loop's atomic steps, as a typed API over the
//! Lua scripts in `lua/` (locking-semantics.md §5, §7, §9).
//!
//! Each function is one script call, so one round trip; the rules each one keeps are named on
//! the script itself.

mod acquire;
pub mod batch;
mod fcall;
mod finish;
mod parked;
mod pause;
pub mod plans;
mod rates;
pub mod registry;
mod reserve;
pub mod schedule;
pub mod scripts;
mod take;
mod take_args;
pub mod tally;
mod unique;
mod upkeep;

// The typed API, one module per group of steps; callers name it `store::<fn>`.
pub use acquire::*;
/// How a connection calls the library's functions (FCALL, else EVALSHA): PUSH's callers keep one.
pub(crate) use fcall::Mode as FcallMode;
pub use finish::*;
pub use parked::*;
pub use pause::*;
pub use rates::*;
pub use reserve::*;
pub use take::*;
pub use unique::UniqueEntry;
pub use upkeep::*;

use crate::resque::keys::Keys;
use redis::{RedisResult, Value};
use std::time::Duration;

/// `n` random bytes as lowercase hex (OS CSPRNG via `rand`'s thread RNG, reseeded from the OS).
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut buf);
    crate::locks::canonical::lower_hex(&buf)
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
        /// The RESERVE found a pause or cap key of another type (A-20, S-6): the worker's
        /// next RESERVEs look at the keys' types again instead of trusting their `MGET`.
        odd_guards: bool,
    },
    /// No queue yielded a job; these queues were skipped by the counter rule.
    Nothing {
        /// Queues skipped because `counter >= LLEN`.
        skipped: Vec<String>,
        /// Queues whose key is not a list (written by another tool): passed over.
        unreadable: Vec<String>,
        /// Queues that hold jobs but are paused (A-20: `<ns>:pause:queue:<q>` or
        /// `<ns>:pause:all` exists): passed over, nothing popped.
        paused: Vec<String>,
        /// Queues that hold jobs but are at their fleet-wide cap: passed over.
        capped: Vec<String>,
        /// Queues that hold jobs but whose cap key `<ns>:locket:cap:<q>` holds another type
        /// or a string that is not a number (spoiled by hand, S-6): passed over, not read as
        /// "no cap".
        refused: Vec<String>,
    },
    /// `pause-all-workers` is set.
    Paused,
    /// The slot already holds a reservation (K-2).
    Busy,
    /// The slot's process lease `alive:<process id>` is gone: it may have been recovered,
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
    /// An operator cancelled the reservation before it started: nothing was started.
    Cancelled,
    /// The reservation is no longer this slot's.
    Missing,
    /// The slot's process lease is gone: nothing was started.
    Dead,
}

/// How a job ended, for FINISH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// Ran and succeeded.
    Success,
    /// Failed by itself: the record is pushed and counted in `stat:failed`. An empty record:
    /// the app recorded the failure itself (H-17), only the stats are counted.
    Failure(String),
    /// Killed: the record is pushed, not counted in `stat:failed` (Resque's DirtyExit). An
    /// empty record: the app recorded it (H-17).
    Dirty(String),
    /// Back to the tail of its queue, no Resque stats.
    Requeue,
    /// Back to the head of its queue, no Resque stats: no code of the job ran (H-9).
    Return,
    /// The remote side throttled the run (rate-limits.md RL-4): `rate`'s key is closed for
    /// `retry_after`, and the job is parked at the head of the key's line; no Resque stats, no
    /// failure.
    Throttled {
        /// The rate whose key is closed.
        rate: crate::locks::RateSpec,
        /// How long.
        retry_after: std::time::Duration,
    },
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

/// This machine's clock in ms since the epoch: written as `reserved_at`, `started_at` and a
/// limit-1 lock's `acquired_at`, which are shown, never compared with a deadline (S-2).
pub(crate) fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
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

/// Reads a value that scripts return as a status or bulk string.
pub fn reply_text(v: &Value) -> String {
    text(v)
}
