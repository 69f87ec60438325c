//! The TOML configuration: defaults, parsing and the start-up check (locking-semantics.md §3,
//! C-1, C-2). Every setting is described in `reference` (the table `locketd config reference`
//! prints), which `config/locketd.toml` and docs/reference/config.md are generated from.

use crate::resque::failure::FailureBackend;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod check;
mod handlers;
pub mod hosts;
pub mod plans;
pub mod published;
pub mod rates;
pub mod reference;
pub mod schedule;
mod values;

pub use handlers::{parse_bytes, Bytes, HandlerConfig, HandlerMode};
use values::from_text;
pub use values::{parse_duration, List, Secs};

/// The names `builtin` accepts.
pub const BUILTIN_NAMES: &[&str] = &["noop", "probe", "sleep"];

/// A built-in handler (`builtin = "<name>"`; the handlers themselves are
/// `handler::builtin`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// Succeeds at once.
    Noop,
    /// Succeeds at once and logs the enqueue-to-start latency of jobs that carry one.
    Probe,
    /// Sleeps `args[0]` seconds.
    Sleep,
}

impl Builtin {
    /// The builtin called `name`, or `None` when there is none.
    pub fn from_name(name: &str) -> Option<Builtin> {
        match name {
            "noop" => Some(Builtin::Noop),
            "probe" => Some(Builtin::Probe),
            "sleep" => Some(Builtin::Sleep),
            _ => None,
        }
    }
}

/// Where the daemon looks for its config when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/locketd/locketd.toml";

pub use crate::error::ConfigError;

fn invalid(setting: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting: setting.to_string(),
        message: message.into(),
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// What happens when a running job's lock is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnLockLost {
    /// Stop the handler and record `Locket::LockLost`.
    #[default]
    Kill,
    /// Stop the handler and put the payload back at the tail of its queue.
    Requeue,
    /// Log and count only; the job keeps running without exclusivity.
    Continue,
}

/// What happens to a job that was running in a process that died.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnWorkerDeath {
    /// Record `Resque::DirtyExit`, as Resque does.
    #[default]
    Fail,
    /// Requeue to the tail, up to `max_recoveries` times per payload digest.
    Requeue,
}

/// `[queue.<name>]`: settings of one queue.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    /// At most this many jobs reserved from the queue run at once across every daemon on the
    /// Redis; none: no cap.
    #[serde(default)]
    pub concurrency: Option<u32>,
}

impl Config {
    /// the queues with a fleet-wide cap, `[queue.<q>] concurrency = N`.
    pub fn queue_caps(&self) -> Vec<(String, u32)> {
        self.queue
            .iter()
            .filter_map(|(q, c)| Some((q.clone(), c.concurrency?)))
            .collect()
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Redis URL (`redis://`, `rediss://`, `unix://`), overridden by `--redis` / `REDIS_URL`.
    #[serde(default = "default_redis")]
    pub redis: String,
    /// How long start-up waits for Redis to answer before exiting 69.
    #[serde(default = "d30s")]
    pub redis_connect_timeout: Secs,
    /// Resque namespace: every key is `<namespace>:<key>`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Queue patterns in priority order, Resque's syntax (`*`, globs, `!skip`).
    #[serde(default)]
    pub queues: List,
    /// Seconds to sleep after a pass that found nothing (Resque's INTERVAL); 0 drains and exits.
    #[serde(default = "default_interval")]
    pub interval: Secs,
    /// `text` or `json`.
    #[serde(default)]
    pub log_format: LogFormat,
    /// Log filter when `RUST_LOG` is not set, e.g. `info` or `locketd=debug`.
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Largest payload run, in bytes; larger ones are failed with `Locket::BadPayload`.
    #[serde(default = "default_max_payload")]
    pub max_payload_bytes: usize,
    /// `redis` (the `failed` list) or `redis_multi_queue` (`<q>_failed` lists).
    #[serde(default)]
    pub failure_backend: FailureBackend,
    /// Serve Prometheus metrics on `GET /metrics` at this address (`host:port`), overridden by
    /// `--metrics`. None: no metrics endpoint.
    #[serde(default)]
    pub metrics: Option<String>,
    /// The same listener under a clearer name (issue 16): `GET /metrics`, the web page at `/`
    /// and its JSON API under `/api/`, overridden by `--http`. A bare port means
    /// `127.0.0.1:<port>`. Set one of `http` and `metrics`, or both to the same address.
    #[serde(default)]
    pub http: Option<String>,
    /// The token the web page's actions (release a lock holder, reset a counter, retry or
    /// remove a failure) need, sent as `Authorization: Bearer <token>`. None: actions are off.
    #[serde(default)]
    pub http_admin_token: Option<Secret>,
    /// Host names (each with an optional `:port`) the listener answers for besides its own
    /// address, `localhost`, `127.0.0.1`, `[::1]` and the machine's host name: a request whose
    /// `Host` is none of them gets 421, so a DNS-rebinding page cannot read the listener
    /// (issue 23). Empty by default.
    #[serde(default)]
    pub http_allowed_hosts: Vec<String>,
    /// resque-web's address (e.g. `http://127.0.0.1:5678`): the web page links its failures
    /// there.
    #[serde(default)]
    pub resque_web_url: Option<String>,
    /// Prune dead Resque workers at start, by Resque's own rules.
    #[serde(default = "yes")]
    pub prune_dead_workers: bool,
    /// Worker processes the master runs (each one Resque worker).
    #[serde(default = "one")]
    pub workers: u32,
    /// Concurrent jobs per worker process (multi-slot mode), each slot its own Resque worker
    /// `host:pid+k:queues`, all over one multiplexed Redis connection. 1 keeps Resque's
    /// one-job-per-process model exactly.
    #[serde(default = "one")]
    pub slots: u32,
    /// TERM behaves like QUIT: running jobs finish (Resque's `GRACEFUL_TERM`). INT never does.
    #[serde(default)]
    pub graceful_term: bool,
    /// On TERM/INT: time a running handler gets between the polite stop (SIGTERM to its
    /// process group) and SIGKILL (Resque's `RESQUE_TERM_TIMEOUT`).
    #[serde(default = "d4s")]
    pub term_timeout: Secs,
    /// Locket settings.
    #[serde(default)]
    pub locket: Locket,
    /// Handlers and lock settings per job class; `"*"` is the fallback.
    #[serde(default)]
    pub classes: BTreeMap<String, ClassConfig>,
    /// Per-queue settings, `[queue.<name>]` (the queue list itself is `queues`).
    #[serde(default)]
    pub queue: BTreeMap<String, QueueConfig>,
    /// Named handlers that classes point at with `handler = "<name>"`: a command run per job
    /// (`mode = "exec"`, the default) or a preloaded process serving many jobs
    /// (`mode = "persistent"`, persistent-handlers.md).
    #[serde(default)]
    pub handlers: BTreeMap<String, HandlerConfig>,
    /// The scheduler (scheduler-protocol.md §3): delayed delivery and recurring schedules.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Recurring schedules, `[schedule.<name>]` (SC-10).
    #[serde(default)]
    pub schedule: BTreeMap<String, ScheduleConfig>,
}

/// The `[locket]` table (locking-semantics.md §3).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Locket {
    /// Lock every class that did not opt out.
    #[serde(default = "yes")]
    pub lock_all: bool,
    /// Only jobs from these queues are locked (resque-locket's `locketed_queues`); empty = all.
    #[serde(default)]
    pub lock_queues: List,
    /// Lease length.
    #[serde(default = "d35s")]
    pub lock_ttl: Secs,
    /// Time between extensions while a job runs; unset, a third of `lock_ttl`
    /// ([`Locket::heartbeat`]).
    #[serde(default)]
    pub heartbeat_interval: Option<Secs>,
    /// Longest life of a queue lock counter.
    #[serde(default = "d15s")]
    pub counter_ttl: Secs,
    /// Delete the skipped queues' counters after a pass that reserved nothing.
    #[serde(default)]
    pub clear_counters_when_idle: bool,
    /// RESERVE and the job's ACQUIRE+START in one call where the class's plan allows (A-7a).
    #[serde(default = "yes")]
    pub one_call_take: bool,
    /// `kill`, `requeue` or `continue`.
    #[serde(default)]
    pub on_lock_lost: OnLockLost,
    /// Time between the polite stop (SIGTERM) and the hard stop (SIGKILL) of a handler.
    #[serde(default = "d10s")]
    pub kill_grace: Secs,
    /// Process liveness renewal period.
    #[serde(default = "d10s")]
    pub process_heartbeat: Secs,
    /// Process liveness lease; a process silent this long is recovered.
    #[serde(default = "d60s")]
    pub process_ttl: Secs,
    /// Janitor period.
    #[serde(default = "d5s")]
    pub janitor_interval: Secs,
    /// `fail` or `requeue` for jobs running in a dead process.
    #[serde(default)]
    pub on_worker_death: OnWorkerDeath,
    /// Crash requeues of one payload before it is failed instead.
    #[serde(default = "three")]
    pub max_recoveries: u32,
    /// Time running jobs get to finish on shutdown.
    #[serde(default = "d25s")]
    pub shutdown_timeout: Secs,
    /// Run even if Redis may evict keys (S-7).
    #[serde(default)]
    pub allow_evicting_redis: bool,
    /// Policy for execution-lock conflicts (P-1..P-5, PK-1): `park` unless set.
    #[serde(default = "policy_park")]
    pub on_conflict: Policy,
    /// Policy for `locked_by` conflicts (D-10).
    #[serde(default = "policy_delay")]
    pub on_dependency_conflict: Policy,
    /// Bound of the `wait` policy (P-3), at most 60s.
    #[serde(default = "d5s")]
    pub wait_timeout: Secs,
    /// What a timed-out wait does: `requeue`, `delay`, `discard` or `fail`.
    #[serde(default)]
    pub wait_then: Policy,
    /// First delay of the `delay` policy (P-4).
    #[serde(default = "d5s")]
    pub delay_base: Secs,
    /// Longest delay before jitter.
    #[serde(default = "d5m")]
    pub delay_max: Secs,
    /// Random extra fraction added to each delay, in `[0, delay_jitter)`.
    #[serde(default = "jitter")]
    pub delay_jitter: f64,
    /// Delays of one payload digest before it is failed; 0 = unlimited.
    #[serde(default)]
    pub max_delays: u32,
    /// Hand out fencing numbers (L-10).
    #[serde(default)]
    pub fencing: bool,
    /// Lifetime of a dependency hold (§8).
    #[serde(default = "d24h")]
    pub hold_ttl: Secs,
    // -- parked waits (parked-waits.md, issue 25) --
    /// Most jobs parked on one lock or hold (PK-7).
    #[serde(default = "d_max_parked")]
    pub max_parked: u64,
    /// What a conflict does when the resource's parked list is full: `requeue`, `delay`,
    /// `discard` or `fail` (PK-7).
    #[serde(default)]
    pub on_park_full: Policy,
    /// How often the janitor looks for parked jobs whose holder's lease lapsed (PK-4).
    #[serde(default = "d1s")]
    pub park_check_interval: Secs,
}

impl Default for Locket {
    fn default() -> Locket {
        // An empty table gets every default.
        toml::from_str("").unwrap_or_else(|_| unreachable_defaults())
    }
}

impl Locket {
    /// The time between extensions while a job runs: `heartbeat_interval`, by default
    /// a third of `lock_ttl`, so that two renewals can fail before a stop begins (L-9).
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat_interval
            .map_or(self.lock_ttl.get() / 3, Secs::get)
    }
}

fn unreachable_defaults() -> Locket {
    Locket {
        lock_all: true,
        lock_queues: List::default(),
        lock_ttl: d35s(),
        heartbeat_interval: None,
        counter_ttl: d15s(),
        clear_counters_when_idle: false,
        one_call_take: true,
        on_lock_lost: OnLockLost::Kill,
        kill_grace: d10s(),
        process_heartbeat: d10s(),
        process_ttl: d60s(),
        janitor_interval: d5s(),
        on_worker_death: OnWorkerDeath::Fail,
        max_recoveries: 3,
        shutdown_timeout: d25s(),
        allow_evicting_redis: false,
        on_conflict: Policy::Park,
        on_dependency_conflict: Policy::Delay,
        wait_timeout: d5s(),
        wait_then: Policy::Requeue,
        delay_base: d5s(),
        delay_max: d5m(),
        delay_jitter: jitter(),
        max_delays: 0,
        fencing: false,
        hold_ttl: d24h(),
        max_parked: d_max_parked(),
        on_park_full: Policy::Requeue,
        park_check_interval: d1s(),
    }
}

/// One `[classes."Name"]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Handler command as argv (no shell): `["bin/sync", "--fast"]`.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// A built-in in-process handler instead of a command: `"noop"`, `"probe"` or `"sleep"`
    /// (see [`Builtin`]).
    #[serde(default)]
    pub builtin: Option<String>,
    /// Longest run of one job; then it is stopped and failed with `Locket::Timeout`.
    #[serde(default, alias = "max_runtime")]
    pub timeout: Option<Secs>,
    /// `false` opts the class out of locking, `true` takes the default lock, a string is a key
    /// template (`"user:{args[0]}"`, locking-semantics.md §4).
    #[serde(default)]
    pub lock: Option<LockSetting>,
    /// Working directory of the command.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Extra environment for the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Per-class override of `locket.on_lock_lost`.
    #[serde(default)]
    pub on_lock_lost: Option<OnLockLost>,
    /// Per-class override of `locket.kill_grace`.
    #[serde(default)]
    pub kill_grace: Option<Secs>,
    /// Limit of the `lock` template (L-1), default 1.
    #[serde(default)]
    pub limit: Option<u32>,
    /// Several locks, all or nothing (L-4): `[{ key = "...", limit = 3 }, ...]`.
    #[serde(default)]
    pub locks: Option<Vec<LockEntry>>,
    /// Per-class override of `locket.on_conflict`.
    #[serde(default)]
    pub on_conflict: Option<Policy>,
    /// Per-class override of `locket.on_dependency_conflict`.
    #[serde(default)]
    pub on_dependency_conflict: Option<Policy>,
    /// Per-class override of `locket.wait_timeout`.
    #[serde(default)]
    pub wait_timeout: Option<Secs>,
    /// Per-class override of `locket.wait_then`.
    #[serde(default)]
    pub wait_then: Option<Policy>,
    /// Per-class override of `locket.delay_base`.
    #[serde(default)]
    pub delay_base: Option<Secs>,
    /// Per-class override of `locket.delay_max`.
    #[serde(default)]
    pub delay_max: Option<Secs>,
    /// Per-class override of `locket.delay_jitter`.
    #[serde(default)]
    pub delay_jitter: Option<f64>,
    /// Per-class override of `locket.max_delays`.
    #[serde(default)]
    pub max_delays: Option<u32>,
    /// Per-class override of `locket.fencing`.
    #[serde(default)]
    pub fencing: Option<bool>,
    /// Per-class override of `locket.hold_ttl`.
    #[serde(default)]
    pub hold_ttl: Option<Secs>,
    /// Dependency holds this class places (§8).
    #[serde(default)]
    pub holds: Vec<HoldEntry>,
    /// Unique jobs at enqueue (locking-semantics.md U-1..U-4): PUSH does not push a duplicate
    /// (same `unique_key`) for `unique_ttl` after a push (`"until_expired"`), while the job waits
    /// (`"until_executing"`), or while it waits or runs (`"until_executed"`).
    #[serde(default)]
    pub unique: Option<String>,
    /// How long `until_expired` refuses duplicates after a push; for the other two policies an
    /// optional backstop lifetime of the entry (U-4).
    #[serde(default)]
    pub unique_ttl: Option<Secs>,
    /// The key template of `unique` (default `{class}:{args_digest}`, T-4).
    #[serde(default)]
    pub unique_key: Option<String>,
    /// Hold names (templates) that must be free before this class starts (D-5).
    #[serde(default)]
    pub locked_by: Vec<String>,
    /// The `[handlers.<name>]` table that runs this class (instead of `command`/`builtin`).
    #[serde(default)]
    pub handler: Option<String>,
    // -- parked waits (parked-waits.md, issue 25) --
    /// Per-class override of `locket.max_parked`.
    #[serde(default)]
    pub max_parked: Option<u64>,
    /// Per-class override of `locket.on_park_full`.
    #[serde(default)]
    pub on_park_full: Option<Policy>,
    // -- keyed rate limits (rate-limits.md, issue 26) --
    /// One rate limit: `{ key = "api:{args[0]}", limit = 10, period = "1s", spread = false }`.
    #[serde(default)]
    pub rate: Option<RateEntry>,
    /// Several rate limits, all must allow the start (RL-1).
    #[serde(default)]
    pub rates: Option<Vec<RateEntry>>,
    /// The command's exit status that reports a throttled run (RL-4), default 76.
    #[serde(default)]
    pub throttled_exit_code: Option<i32>,
}

pub use crate::locks::Policy;
pub use plans::{HoldEntry, LockEntry, LockSetting};
pub use rates::RateEntry;
pub use schedule::{Schedule, ScheduleConfig, SchedulerConfig};

fn default_redis() -> String {
    "redis://127.0.0.1:6379/0".to_string()
}
fn default_namespace() -> String {
    "resque".to_string()
}
fn default_interval() -> Secs {
    Secs(Duration::from_secs(5))
}
fn default_log_level() -> String {
    "info".to_string()
}
fn default_max_payload() -> usize {
    8 * 1024 * 1024
}
pub(crate) fn yes() -> bool {
    true
}
fn three() -> u32 {
    3
}
fn one() -> u32 {
    1
}
fn d4s() -> Secs {
    Secs(Duration::from_secs(4))
}
fn d5s() -> Secs {
    Secs(Duration::from_secs(5))
}
fn d10s() -> Secs {
    Secs(Duration::from_secs(10))
}
fn d15s() -> Secs {
    Secs(Duration::from_secs(15))
}
fn d25s() -> Secs {
    Secs(Duration::from_secs(25))
}
fn d30s() -> Secs {
    Secs(Duration::from_secs(30))
}
fn d35s() -> Secs {
    Secs(Duration::from_secs(35))
}
fn d60s() -> Secs {
    Secs(Duration::from_secs(60))
}
fn d5m() -> Secs {
    Secs(Duration::from_secs(300))
}
fn d24h() -> Secs {
    Secs(Duration::from_secs(86400))
}
fn jitter() -> f64 {
    0.2
}
fn policy_delay() -> Policy {
    Policy::Delay
}
// -- parked waits (issue 25) --
fn policy_park() -> Policy {
    Policy::Park
}
fn d_max_parked() -> u64 {
    100_000
}
fn d1s() -> Secs {
    Secs(Duration::from_secs(1))
}

impl Default for Config {
    fn default() -> Config {
        Config {
            redis: default_redis(),
            redis_connect_timeout: d30s(),
            namespace: default_namespace(),
            queues: List::default(),
            interval: default_interval(),
            log_format: LogFormat::Text,
            log_level: default_log_level(),
            max_payload_bytes: default_max_payload(),
            failure_backend: FailureBackend::Redis,
            prune_dead_workers: true,
            workers: 1,
            slots: 1,
            graceful_term: false,
            term_timeout: d4s(),
            metrics: None,
            http: None,
            http_admin_token: None,
            http_allowed_hosts: Vec::new(),
            resque_web_url: None,
            locket: Locket::default(),
            classes: BTreeMap::new(),
            queue: BTreeMap::new(),
            handlers: BTreeMap::new(),
            scheduler: SchedulerConfig::default(),
            schedule: BTreeMap::new(),
        }
    }
}

/// A setting that must not reach a log line: `Debug` prints `"<redacted>"`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Config {
    /// The address the HTTP listener binds (`http`, else `metrics`), a bare port read as
    /// `127.0.0.1:<port>`; None: no listener.
    pub fn listen(&self) -> Option<String> {
        let a = self.http.as_ref().or(self.metrics.as_ref())?;
        Some(if a.parse::<u16>().is_ok() {
            format!("127.0.0.1:{a}")
        } else {
            a.clone()
        })
    }
}

/// The largest config locketd reads (a file, or the text a worker gets from its master).
pub const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// toml's message with the line and column, without the line's text: the offending line may
/// hold the Redis password, and the message goes to the journal on a refused HUP.
fn parse_message(text: &str, e: &toml::de::Error) -> String {
    let mut m = e.message().trim().replace('\n', " ");
    if let Some(span) = e.span() {
        let before = text.get(..span.start).unwrap_or(text);
        let line = before.matches('\n').count() + 1;
        let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        m.push_str(&format!(" (line {line}, column {col})"));
    }
    m
}

impl Config {
    /// Parses TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::Parse {
                path: origin.to_string(),
                message: format!(
                    "the config is {} bytes; the most locketd reads is {MAX_CONFIG_BYTES}",
                    text.len()
                ),
            });
        }
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: parse_message(text, &e),
        })
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> Config {
        Config::parse(text, "test").unwrap()
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = cfg("queues = \"high,low\"");
        assert_eq!(c.namespace, "resque");
        assert_eq!(c.redis, "redis://127.0.0.1:6379/0");
        assert_eq!(c.queues.0, vec!["high", "low"]);
        assert_eq!(c.locket.lock_ttl.get(), Duration::from_secs(35));
        // Issue 23: a third of lock_ttl, so two renewals can fail before a stop begins.
        assert_eq!(c.locket.heartbeat(), Duration::from_secs(35) / 3);
        let c2 = cfg("queues = \"q\"\n[locket]\nlock_ttl = \"60s\"\nprocess_ttl = \"90s\"");
        assert_eq!(c2.locket.heartbeat(), Duration::from_secs(20));
        assert!(c2.check().is_ok());
        assert_eq!(c.locket.counter_ttl.get(), Duration::from_secs(15));
        assert!(c.locket.lock_all);
        assert!(!c.locket.clear_counters_when_idle);
        assert_eq!(c.interval.get(), Duration::from_secs(5));
        assert!(c.check().is_ok());
        assert_eq!(Config::default().locket.lock_ttl, c.locket.lock_ttl);
    }

    #[test]
    fn durations_take_units_and_numbers() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        // Issue 11 (smaller): a bare integer is range-checked like a string; it used to pass
        // unchecked and panic later in `Instant + Duration`.
        for bad in ["lock_ttl = 99999999999999999", "lock_ttl = -5"] {
            let e = Config::parse(&format!("queues = \"q\"\n[locket]\n{bad}\n"), "t")
                .expect_err(bad)
                .to_string();
            assert!(e.contains("duration") && e.contains("line 3"), "{bad}: {e}");
        }
        let c = Config::parse("queues = \"q\"\n[locket]\nlock_ttl = 40\n", "t").unwrap();
        assert_eq!(c.locket.lock_ttl.get(), Duration::from_secs(40));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        let c = cfg("queues = [\"a\"]\ninterval = 0.5\n[locket]\nlock_ttl = 40\n");
        assert_eq!(c.interval.get(), Duration::from_millis(500));
        assert_eq!(c.locket.lock_ttl.get(), Duration::from_secs(40));
    }

    // locking-semantics.md C-1: rejected at startup with a message naming the setting.
    #[test]
    fn bad_settings_are_rejected_by_name() {
        let cases = [
            ("[locket]\nlock_ttl = \"500ms\"", "locket.lock_ttl"),
            // Issue 11 (smaller), R-4: a lock lease longer than the process lease.
            (
                "[locket]\nlock_ttl = \"90s\"\nprocess_ttl = \"60s\"",
                "locket.lock_ttl",
            ),
            (
                "[locket]\nheartbeat_interval = \"50ms\"",
                "locket.heartbeat_interval",
            ),
            (
                "[locket]\nheartbeat_interval = \"40s\"",
                "locket.heartbeat_interval",
            ),
            ("[locket]\ncounter_ttl = \"10ms\"", "locket.counter_ttl"),
            (
                "[locket]\nprocess_heartbeat = \"90s\"\nprocess_ttl = \"300s\"",
                "locket.process_heartbeat",
            ),
            ("[locket]\nlock_queues = [\"!low\"]", "locket.lock_queues"),
            ("log_level = \"locketd=lots\"", "log_level"),
            ("[classes.\"A\"]\ncommand = []", "command"),
            ("namespace = \"\"", "namespace"),
            // check-config names the schedule and the bad cron, duration or zone (SC-10).
            (
                "[schedule.nightly]\nclass = \"C\"\nqueue = \"q\"\ncron = \"0 25 * * *\"",
                "schedule.\"nightly\": invalid cron \"0 25 * * *\"",
            ),
            (
                "[schedule.tick]\nclass = \"C\"\nqueue = \"q\"\nevery = \"5 minutes\"",
                "schedule.\"tick\": invalid duration \"5 minutes\"",
            ),
            (
                "[schedule.b]\nclass = \"C\"\nqueue = \"q\"\ncron = \"@daily\"\ntz = \"Europe/Berlim\"",
                "schedule.\"b\": unknown time zone \"Europe/Berlim\"",
            ),
            ("[scheduler]\nlock_ttl = \"1s\"", "scheduler.lock_ttl"),
        ];
        for (text, setting) in cases {
            let c = cfg(&format!("queues = \"q\"\n{text}"));
            let err = c.check().unwrap_err().to_string();
            assert!(err.contains(setting), "{text}: {err}");
        }
        let err = Config::parse("queues = \"q\"\nbogus = 1", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus"), "{err}");
        let err = Config::parse("[locket]\nlock_ttl = \"forever\"", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lock_ttl") || err.contains("forever"), "{err}");
        assert!(cfg("").check().unwrap_err().to_string().contains("queues"));
    }

    // locking-semantics.md C-2
    // A parse error names the place, not the line's text: that line may hold the password.
    #[test]
    fn a_parse_error_gives_line_and_column_but_not_the_line() {
        let text = "queues = \"q\"\nredis = \"redis://:S3cret@127.0.0.1/0\" junk\n";
        let e = Config::parse(text, "x.toml").unwrap_err().to_string();
        assert!(e.contains("line 2, column"), "{e}");
        assert!(!e.contains("S3cret"), "{e}");
    }

    // The master reads at most MAX_CONFIG_BYTES of config and its workers as much: a larger
    // file is refused as a whole rather than cut short for the workers.
    #[test]
    fn a_config_over_the_limit_is_refused() {
        let mut text = String::from("queues = \"q\"\n");
        while text.len() as u64 <= MAX_CONFIG_BYTES {
            text.push_str("# padding padding padding padding padding padding padding\n");
        }
        let e = Config::parse(&text, "big.toml").unwrap_err().to_string();
        assert!(e.contains("the most locketd reads"), "{e}");
    }

    #[test]
    fn an_insecure_tls_url_is_a_warning() {
        let c = cfg("queues = \"q\"\nredis = \"rediss://h:6380/0#insecure\"");
        let w = c.check().unwrap();
        assert!(w.iter().any(|w| w.contains("#insecure")), "{w:?}");
    }

    // R-4 in a partition: a process lease shorter than a lock lease plus one heartbeat lets
    // recovery free a lock before its lease ends; the defaults (60 s >= 35 s + 10 s) do not.
    #[test]
    fn a_process_lease_shorter_than_a_lock_lease_and_a_heartbeat_is_a_warning() {
        let c = cfg("queues = \"q\"\n[locket]\nlock_ttl = \"50s\"\nprocess_ttl = \"55s\"");
        let w = c.check().unwrap();
        assert!(w.iter().any(|w| w.contains("at least their sum")), "{w:?}");
        let w = cfg("queues = \"q\"").check().unwrap();
        assert!(!w.iter().any(|w| w.contains("their sum")), "{w:?}");
    }

    #[test]
    fn short_slack_is_a_warning_not_an_error() {
        let c = cfg("queues = \"q\"\n[locket]\nlock_ttl = \"10s\"\nheartbeat_interval = \"4s\"\nkill_grace = \"3s\"");
        let w = c.check().unwrap();
        assert!(
            w.iter().any(|w| w.contains("a single failed renewal")),
            "{w:?}"
        );
        let w = cfg("queues = \"q\"").check().unwrap();
        assert!(!w.iter().any(|w| w.contains("renewal")), "{w:?}");
    }

    /// Issue 23: the hard stop lands before the lease ends only if `heartbeat_interval +
    /// kill_grace` is shorter than `lock_ttl`; refused with the reason, for `[locket]` and for
    /// a locked class's own `kill_grace` (an unlocked class may wait as long as it likes).
    #[test]
    fn a_kill_grace_past_the_lease_is_refused() {
        for (text, setting) in [
            (
                "[locket]\nlock_ttl = \"20s\"\nheartbeat_interval = \"10s\"\nkill_grace = \"10s\"",
                "locket.kill_grace",
            ),
            (
                "[locket]\nlock_ttl = \"20s\"\nkill_grace = \"14s\"",
                "locket.kill_grace",
            ),
            (
                "[locket]\nlock_ttl = \"20s\"\n[classes.\"A\"]\ncommand = [\"/bin/true\"]\nkill_grace = \"15s\"",
                "classes.\"A\".kill_grace",
            ),
        ] {
            let err = cfg(&format!("queues = \"q\"\n{text}"))
                .check()
                .unwrap_err()
                .to_string();
            assert!(err.contains(setting), "{text}: {err}");
            assert!(err.contains("before the lease ends"), "{text}: {err}");
        }
        for ok in [
            "[locket]\nlock_ttl = \"20s\"\nkill_grace = \"12s\"",
            "[locket]\nlock_ttl = \"20s\"\n[classes.\"A\"]\ncommand = [\"/bin/true\"]\nlock = false\nkill_grace = \"60s\"",
            "[locket]\nlock_all = false\nkill_grace = \"60s\"",
        ] {
            let c = cfg(&format!("queues = \"q\"\n{ok}"));
            assert!(c.check().is_ok(), "{ok}: {:?}", c.check());
        }
    }

    #[test]
    fn builtin_is_checked_and_exclusive_with_command() {
        let ok = cfg("queues = \"q\"\n[classes.Noop]\nbuiltin = \"noop\"\n");
        let w = ok.check().unwrap();
        assert!(!w.iter().any(|w| w.contains("Noop")), "{w:?}");
        assert_eq!(ok.classes["Noop"].builtin.as_deref(), Some("noop"));
        let err = cfg("queues = \"q\"\n[classes.X]\nbuiltin = \"teleport\"\n")
            .check()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("classes.\"X\".builtin") && err.contains("teleport"),
            "{err}"
        );
        let err =
            cfg("queues = \"q\"\n[classes.X]\nbuiltin = \"noop\"\ncommand = [\"/bin/true\"]\n")
                .check()
                .unwrap_err()
                .to_string();
        assert!(err.contains("builtin") && err.contains("not both"), "{err}");
    }

    #[test]
    fn the_shipped_example_config_loads_and_checks() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/locketd.toml");
        let c = Config::load(&path).unwrap();
        c.check().unwrap();
        assert!(c.classes.contains_key("*"));
    }
}
