//! Job handlers: the configured command per class, or an in-process [`Handler`] registered by a
//! program that uses locketd as a library.
//!
//! The command contract (docs/guide/handlers.md, "the handler contract"): argv without a shell, the payload on stdin,
//! `LOCKETD_CLASS`, `LOCKETD_QUEUE`, `LOCKETD_ARGS` (JSON), `LOCKETD_WORKER`, `LOCKETD_LOCK_KEYS`
//! (JSON array) and `LOCKETD_LOCK_TOKEN` in the environment; exit 0 is success; a polite stop is
//! SIGTERM to the handler's process group, a hard stop SIGKILL.

pub mod builtin;
mod command;
mod lines;
pub mod persistent;
mod spawn;

pub use command::CommandHandler;
pub use persistent::PersistentHandler;

use crate::config::Config;
use crate::resque::failure::JobFailure;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// What a handler sees of one job.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// Job class.
    pub class: String,
    /// Queue it was reserved from.
    pub queue: String,
    /// The payload exactly as enqueued.
    pub payload: String,
    /// `args` as decoded (exact number text).
    pub args: serde_json::Value,
    /// `args` exactly as enqueued.
    pub args_raw: String,
    /// The Resque worker id running it.
    pub worker: String,
    /// Ids of the locks held for it.
    pub lock_keys: Vec<String>,
    /// The attempt's lock token (empty when unlocked).
    pub lock_token: String,
    /// Fencing number per lock, in `lock_keys` order (empty without `fencing`, L-10).
    pub lock_fences: Vec<u64>,
    /// The run's entry on the lease watchdog: a handler that starts a process group attaches
    /// it, so the group is killed at the lock's deadline even if the worker stalls.
    pub watch: crate::watchdog::Watch,
    /// The reservation id (a persistent handler's job `id`, H-4).
    pub id: String,
    /// The class's `timeout`, if it has one (a persistent handler's `deadline_ms`).
    pub timeout: Option<std::time::Duration>,
    /// Why the supervisor asked the run to stop, set just before `stop` is cancelled.
    pub stop_reason: StopNote,
    /// Set by a handler whose app recorded the run's failure itself (H-17).
    pub recorded: RecordedNote,
}

/// Whether the app recorded a run's failure through its own failure backend (a persistent
/// Ruby handler's `Resque::Failure.create`, H-17): set by the handler, read by the worker
/// after `after_run`, so that FINISH pushes no record of its own (it still counts the stats).
#[derive(Debug, Clone, Default)]
pub struct RecordedNote(Arc<std::sync::atomic::AtomicBool>);

impl RecordedNote {
    /// The app recorded the failure.
    pub fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether it did.
    pub fn get(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Why a run was asked to stop (`timeout`, `lock_lost`, `shutdown`, `usr1`,
/// `presumed_dead`), whether the job then goes back to its queue instead of being recorded (a
/// lost lock under `on_lock_lost = "requeue"`), and whether the stop is a kill at once (USR1, a
/// second TERM): written by the supervisor, read by a handler that tells its process (a
/// persistent handler's `stop` frame, H-14) or signals its group.
#[derive(Debug, Clone, Default)]
pub struct StopNote(Arc<std::sync::OnceLock<StopKind>>);

/// What a [`StopNote`] records.
#[derive(Debug, Clone, Copy)]
struct StopKind {
    reason: &'static str,
    requeue: bool,
    at_once: bool,
}

impl StopNote {
    /// Records the reason, whether the job is requeued and whether the stop is a kill with no
    /// polite stop before it (the first call counts).
    pub fn set(&self, reason: &'static str, requeue: bool, at_once: bool) {
        let _ = self.0.set(StopKind {
            reason,
            requeue,
            at_once,
        });
    }

    /// The reason, once set.
    pub fn get(&self) -> Option<&'static str> {
        self.0.get().map(|k| k.reason)
    }

    /// Whether the stopped job goes back to its queue rather than being recorded.
    pub fn requeue(&self) -> bool {
        self.0.get().is_some_and(|k| k.requeue)
    }

    /// Whether the group is to be SIGKILLed now, with no `stop` frame or SIGTERM first, as
    /// Resque's `kill_child` does on USR1: a job given a polite stop it has no time to use
    /// could run its own failure path (a Ruby job's `on_failure` with
    /// `Resque::TermException`) against a failure recorded as `Resque::DirtyExit`.
    pub fn at_once(&self) -> bool {
        self.0.get().is_some_and(|k| k.at_once)
    }
}

/// How a supervised run was stopped, told to [`Handler::after_run`] before the outcome is
/// recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Why (`timeout`, `lock_lost`, `shutdown`, `usr1`, `presumed_dead`), as in [`StopNote`].
    pub reason: &'static str,
    /// The job goes back to its queue instead of the failed list (a lost lock under
    /// `on_lock_lost = "requeue"`): it did not fail, so no failure hooks run for it (H-14).
    pub requeued: bool,
}

/// Whether a handler can take a job now (H-8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// It can.
    Ready,
    /// It cannot before `until` (a boot that failed, backing off): the job goes back to its
    /// queue and waits there.
    NotReady {
        /// When to ask again.
        until: std::time::Instant,
        /// Why, for the log.
        why: String,
    },
}

/// The exception of a run that asks to be rescheduled: the command exited 75 (EX_TEMPFAIL), or
/// an in-process handler returned [`reschedule`]. FINISH releases the locks and pushes the
/// payload back to the tail of its queue in one step; no failure is recorded.
pub const RESCHEDULE: &str = "Locket::Reschedule";

/// The result an in-process handler returns to be run again later (like exit status 75).
pub fn reschedule() -> JobFailure {
    JobFailure::new(RESCHEDULE, "rescheduled by the handler")
}

/// The exception of a run whose remote side throttled it (rate-limits.md RL-4): a command
/// exited `throttled_exit_code` (default [`EX_THROTTLED`]), a persistent handler answered
/// `result: "throttled"`, an adapter's `Throttled` was raised. Its error text is the seconds to
/// hold the key back (`retry-after`), or empty for the rate's period. FINISH closes the class's
/// first rate key until then and parks the job at the head of its line; no failure is recorded.
pub const THROTTLED: &str = "Locket::Throttled";

/// The default exit status of a throttled command handler (RL-4).
pub const EX_THROTTLED: i32 = 76;

/// The result a handler returns when the remote side throttled it (RL-4): `retry_after` holds
/// every job of the rate key back that long (`None`: the rate's period).
pub fn throttled(retry_after: Option<std::time::Duration>) -> JobFailure {
    JobFailure::new(
        THROTTLED,
        retry_after.map_or(String::new(), |d| format!("{}", d.as_secs_f64())),
    )
}

/// The `retry-after` of a [`THROTTLED`] failure: the seconds in its error text, if any.
pub fn throttled_retry_after(f: &JobFailure) -> Option<std::time::Duration> {
    let s: f64 = f.error.trim().parse().ok()?;
    (s.is_finite() && s >= 0.0).then(|| std::time::Duration::from_secs_f64(s.min(86_400.0 * 7.0)))
}

/// `retry-after: S` (any case, S seconds, fractions allowed) from a handler's last stdout
/// line.
pub fn parse_retry_after(line: &str) -> Option<std::time::Duration> {
    let (k, v) = line.trim().split_once(':')?;
    if !k.trim().eq_ignore_ascii_case("retry-after") {
        return None;
    }
    let s: f64 = v.trim().parse().ok()?;
    (s.is_finite() && s >= 0.0).then(|| std::time::Duration::from_secs_f64(s.min(86_400.0 * 7.0)))
}

/// The longest args JSON handed to a command handler in `LOCKETD_ARGS`. Linux refuses an
/// environment string over 128 KiB; longer args are left out (`LOCKETD_ARGS_OMITTED=1`) and
/// read from the payload on stdin.
pub const ARGS_ENV_LIMIT: usize = 64 * 1024;

/// sysexits EX_TEMPFAIL: a command handler exiting with it is rescheduled.
pub const EX_TEMPFAIL: i32 = 75;

/// The result of one run: `Ok` is success; `Err` becomes a Resque failure record.
pub type HandlerResult = Result<(), JobFailure>;

/// Runs jobs of one class.
///
/// `stop` is cancelled when the supervisor asks the job to stop politely (lost lock, timeout,
/// shutdown); if the future has not completed `kill_grace` (`term_timeout` for a shutdown)
/// later it is dropped. After a shutdown's stop, what the future returns still counts: `Ok`
/// (the work got done) is a success and [`reschedule`] puts the job back in its queue; any
/// other error is recorded as `Resque::TermException`. A lost lock or a timeout records its own
/// failure whatever the future returns.
pub trait Handler: Send + Sync {
    /// Runs one job.
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult>;

    /// Makes the handler ready for a job (a persistent handler boots here), before the job's
    /// locks are taken. A stop drops the future.
    fn prepare(&self) -> BoxFuture<'static, Readiness> {
        Box::pin(async { Readiness::Ready })
    }

    /// Whether a job for this handler would be turned away now, without starting anything:
    /// the time to ask again.
    fn backing_off(&self) -> Option<std::time::Instant> {
        None
    }

    /// H-8 for TAKE (A-7a): whether [`Handler::prepare`] would answer `Ready` now, without
    /// booting or waiting for anything. Only then may a job of this handler's classes be
    /// locked and started in the call that reserves it; `false` sends the two calls, whose
    /// `prepare` comes before the locks.
    fn ready_now(&self) -> bool {
        true
    }

    /// After a supervised run ended, before its outcome is recorded: a handler whose run was
    /// stopped makes sure nothing of it is left running (H-11).
    fn after_run(&self, _stopped: Option<Stopped>) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }

    /// The worker stops: end any process kept between jobs (H-12).
    fn shutdown(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }

    /// Whether the handler starts with its worker slot rather than at its first job.
    fn preload(&self) -> bool {
        false
    }

    /// A fresh instance for another worker slot, for handlers that keep per-slot state
    /// (H-1); `None` when one instance serves every slot.
    fn for_slot(&self) -> Option<Arc<dyn Handler>> {
        None
    }

    /// The state of a per-slot process, for `status` and `/metrics`.
    fn state(&self) -> Option<crate::metrics::HandlerStats> {
        None
    }
}

impl<F, Fut> Handler for F
where
    F: Fn(JobContext) -> Fut + Send + Sync,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    fn perform(
        &self,
        job: JobContext,
        _stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        Box::pin(self(job))
    }
}

/// Class name → handler, with the `"*"` fallback.
#[derive(Clone, Default)]
pub struct Handlers {
    by_class: HashMap<String, Arc<dyn Handler>>,
    fallback: Option<Arc<dyn Handler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("classes", &self.by_class.keys().collect::<Vec<_>>())
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}

impl Handlers {
    /// No handlers.
    pub fn new() -> Handlers {
        Handlers::default()
    }

    /// The command, builtin and named handlers of a config's `[classes]`; a named handler
    /// serves every class that points at it.
    pub fn from_config(config: &Config) -> Handlers {
        let mut h = Handlers::new();
        let mut named: HashMap<&str, Arc<dyn Handler>> = HashMap::new();
        for (name, class) in &config.classes {
            if let Some(hname) = class.handler.as_deref() {
                let Some(table) = config.handlers.get(hname) else {
                    continue;
                };
                let handler = named
                    .entry(hname)
                    .or_insert_with(|| match table.mode {
                        crate::config::HandlerMode::Exec => {
                            Arc::new(CommandHandler::from_table(table))
                        }
                        crate::config::HandlerMode::Persistent => {
                            PersistentHandler::of_table(hname, table, config)
                        }
                    })
                    .clone();
                h.insert_arc(name, handler);
            } else if let Some(b) = class
                .builtin
                .as_deref()
                .and_then(crate::config::Builtin::from_name)
            {
                h.insert(name, b);
            } else if class.command.is_some() {
                h.insert(name, CommandHandler::new(class));
            }
        }
        h
    }

    /// Registers a handler for `class` (`"*"` for the fallback), replacing any before it.
    pub fn insert(&mut self, class: &str, handler: impl Handler + 'static) -> &mut Handlers {
        self.insert_arc(class, Arc::new(handler))
    }

    /// [`Handlers::insert`] of a shared handler.
    pub fn insert_arc(&mut self, class: &str, handler: Arc<dyn Handler>) -> &mut Handlers {
        if class == "*" {
            self.fallback = Some(handler);
        } else {
            self.by_class.insert(class.to_string(), handler);
        }
        self
    }

    /// The handler for `class`, or the fallback.
    pub fn get(&self, class: &str) -> Option<Arc<dyn Handler>> {
        self.by_class.get(class).or(self.fallback.as_ref()).cloned()
    }

    /// The classes with a handler of their own (the fallback's, `"*"`, is not among them).
    pub fn classes(&self) -> impl Iterator<Item = &str> {
        self.by_class.keys().map(String::as_str)
    }

    /// Whether a class without a handler of its own has the fallback's.
    pub fn has_fallback(&self) -> bool {
        self.fallback.is_some()
    }

    /// Every distinct handler, once.
    pub fn distinct(&self) -> Vec<Arc<dyn Handler>> {
        let mut out: Vec<Arc<dyn Handler>> = Vec::new();
        for h in self.by_class.values().chain(self.fallback.iter()) {
            if !out.iter().any(|o| Arc::ptr_eq(o, h)) {
                out.push(h.clone());
            }
        }
        out
    }

    /// The handlers of another worker slot: handlers with per-slot state get a fresh instance
    /// (shared again by every class that shared the original), the others are shared.
    pub fn for_slot(&self) -> Handlers {
        let fresh: Vec<(Arc<dyn Handler>, Arc<dyn Handler>)> = self
            .distinct()
            .into_iter()
            .filter_map(|h| h.for_slot().map(|f| (h, f)))
            .collect();
        let swap = |h: &Arc<dyn Handler>| {
            fresh
                .iter()
                .find(|(old, _)| Arc::ptr_eq(old, h))
                .map_or_else(|| h.clone(), |(_, new)| new.clone())
        };
        Handlers {
            by_class: self
                .by_class
                .iter()
                .map(|(k, h)| (k.clone(), swap(h)))
                .collect(),
            fallback: self.fallback.as_ref().map(swap),
        }
    }

    /// The one handler every class goes to, when there is exactly one (no class has another
    /// and there is a fallback): the worker can wait for it before reserving anything (H-8).
    pub fn sole(&self) -> Option<Arc<dyn Handler>> {
        let fallback = self.fallback.as_ref()?;
        self.by_class
            .values()
            .all(|h| Arc::ptr_eq(h, fallback))
            .then(|| fallback.clone())
    }
}
