//! The lock model, without Redis: what a job's lock is ([`LockSpec`]), how its id is written
//! from the job's args ([`template`], T-*), the canonical JSON that makes ids and digests
//! stable ([`canonical`]), and what happens on a conflict ([`Policy`], [`DelaySettings`]).
//! The configuration compiles classes into these; the store sends them to Redis.

pub mod canonical;
pub mod template;

use serde::Deserialize;
use std::time::Duration;

/// One lock a job needs: its rendered id and how many holders it may have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockSpec {
    /// The lock id (rendered key template, T-4/T-5).
    pub id: String,
    /// Most live holders (L-1), at least 1.
    pub limit: u32,
}

/// One keyed rate limit a job's start must meet (rate-limits.md RL-1): at most `limit` starts
/// of `key` in any sliding window of `period`, by Redis's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateSpec {
    /// The rendered key (its log is `<ns>:locket:ratelog:<key>`, and for a limit above 256 also
    /// `<ns>:locket:rate:<key>`: src/store/lua/rate.lua).
    pub key: String,
    /// Most starts per period.
    pub limit: u32,
    /// The window.
    pub period: Duration,
    /// Starts spaced at least `period / limit` apart.
    pub spread: bool,
}

/// What happens to a job whose lock (or dependency) is taken (§6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Back to the tail of its queue, counted (P-1).
    #[default]
    Requeue,
    /// Parked on the resource that refused it, woken by the step that frees a unit of it
    /// (PK-1..PK-7): the default for execution locks.
    Park,
    /// Dropped on purpose, logged and counted, not a failure (P-2).
    Discard,
    /// Keep the reservation and retry for up to `wait_timeout` (P-3).
    Wait,
    /// Put aside with exponential backoff; the janitor promotes it back (P-4).
    Delay,
    /// Recorded as a `Locket::LockConflict` failure (P-5).
    Fail,
}

impl Policy {
    /// The word the ACQUIRE script takes as a fallback (`wait` keeps the job: `none`).
    pub fn script_word(self) -> &'static str {
        match self {
            Policy::Requeue => "requeue",
            Policy::Park => "park",
            Policy::Discard => "discard",
            Policy::Wait => "none",
            Policy::Delay => "delay",
            Policy::Fail => "fail",
        }
    }

    /// The config word.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Requeue => "requeue",
            Policy::Park => "park",
            Policy::Discard => "discard",
            Policy::Wait => "wait",
            Policy::Delay => "delay",
            Policy::Fail => "fail",
        }
    }
}

/// The `delay` policy's backoff (P-4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DelaySettings {
    /// First delay.
    pub base: Duration,
    /// Cap before jitter.
    pub max: Duration,
    /// Jitter fraction.
    pub jitter: f64,
    /// Delays before failing; 0 = unlimited.
    pub max_delays: u32,
}

impl DelaySettings {
    /// The delay before attempt `attempt` (1-based) with jitter draw `r` in `[0, jitter)`:
    /// `min(base × 2^(attempt−1), max) × (1 + r)`. The ACQUIRE script computes the same from
    /// the attempt number it reads in Redis; this is the reference the tests compare against.
    pub fn delay(&self, attempt: u32, r: f64) -> Duration {
        let exp = attempt.saturating_sub(1).min(40);
        let raw = self.base.as_secs_f64() * 2f64.powi(exp as i32);
        let capped = raw.min(self.max.as_secs_f64());
        Duration::from_secs_f64(capped * (1.0 + r))
    }
}
