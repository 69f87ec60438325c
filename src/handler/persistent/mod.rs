//! Persistent handlers (persistent-handlers.md): one long-lived process per worker slot and
//! named handler that loads the app once and runs one job at a time over pipes on fds 3 and 4.
//!
//! The life cycle, rule by rule:
//! - H-1: a [`PersistentHandler`] is one slot's instance ([`Handler::for_slot`] makes the
//!   others); its process starts at the first job ([`Handler::prepare`]) or with the slot
//!   (`preload`).
//! - H-8: `prepare` boots it before the job's locks are taken; a boot that fails backs off
//!   (1 s doubling to 60 s) and the job goes back to its queue, not to the failed list.
//! - H-9: `perform` writes the `job` frame, waits for `started` (`start_timeout`) and `done`.
//! - H-10: a death is seen by the exit; a `done` already written still counts.
//! - H-11: a stopped run (timeout, lost lock, USR1, shutdown) ends with the group SIGKILLed,
//!   reaped and confirmed empty ([`Handler::after_run`]) before the outcome is recorded.
//! - H-12, H-13: shutdown and recycling close fd 3, wait `term_timeout`, then SIGKILL.
//! - H-14: after a kill the fresh process runs the job's `on_failure` hooks.
//! - H-17: an app with its own failure backend records its jobs' failures; after a kill the
//!   fresh process is booted before the job's FINISH and records it ([`record`]).
//! - H-18: with `threads > 1` the slots of a worker share a pool of processes ([`pool`],
//!   [`demux`]), each running several jobs; [`threaded`] is a slot's instance, and
//!   [`siblings`] bounds the jobs returned because another job's stop killed their process.

mod demux;
mod frame;
mod job;
mod life;
mod pool;
mod proc;
mod siblings;
mod threaded;
pub use job::JobFrame;
pub use proc::protocol_fds_in_child;
pub use siblings::MAX_SIBLING_RETURNS;
pub use threaded::ThreadedHandler;
mod record;

use super::{Handler, HandlerResult, JobContext, Readiness, Stopped, RESCHEDULE};
use crate::config::{Config, HandlerConfig};
use crate::metrics::HandlerStats;
use crate::resque::failure::{signal_status_text, JobFailure};

use futures::future::BoxFuture;
use proc::Proc;
use serde::Serialize;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The target of the log lines of every file here (`RUST_LOG=locketd::handler::persistent=debug`).
const LOG_TARGET: &str = "locketd::handler::persistent";

/// The exception of a job that a persistent handler never started (H-9): FINISH puts it back
/// at the head of its queue, with no failure recorded and no stats counted.
pub const NOT_STARTED: &str = "Locket::NotStarted";

/// Backoff of failed boots (H-8).
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// A handler that stayed up this long resets the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// How long a `done` already written is looked for after the handler exited (H-10).
const LATE_DONE: Duration = Duration::from_millis(300);
/// The longest wait for a `failure_hooks` answer (H-14).
const HOOKS_TIMEOUT: Duration = Duration::from_secs(60);

/// What a `[handlers.<name>]` table of mode `persistent` says.
#[derive(Debug)]
struct Spec {
    name: String,
    argv: Vec<String>,
    dir: Option<std::path::PathBuf>,
    env: Vec<(String, String)>,
    boot_timeout: Duration,
    start_timeout: Duration,
    max_jobs: u64,
    max_jobs_jitter: u64,
    max_rss: Option<u64>,
    max_lifetime: Option<Duration>,
    idle_timeout: Option<Duration>,
    preload: bool,
    max_frame: usize,
    failure_hooks: bool,
    term_timeout: Duration,
    /// H-18: jobs per process (1: one per slot, this file's code path).
    threads: u32,
}

/// What is read without the slot's lock.
#[derive(Debug, Default)]
struct Shared {
    state: Mutex<HandlerStats>,
    backoff_until: Mutex<Option<Instant>>,
    /// The worker stops: boots give up, nothing new starts.
    stopping: CancellationToken,
    /// The last job's end, for the idle timeout.
    last_active: Mutex<Option<Instant>>,
    idle_watch: std::sync::atomic::AtomicBool,
    /// H-17: a handler died during a job whose failure its fresh process is to record; the
    /// next `after_run` boots it.
    record_pending: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn state(&self, f: impl FnOnce(&mut HandlerStats)) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn backoff_until(&self) -> Option<Instant> {
        let b = *self.backoff_until.lock().unwrap_or_else(|p| p.into_inner());
        b.filter(|t| *t > Instant::now())
    }

    fn restarted(&self, reason: &str) {
        self.state(|s| *s.restarts.entry(reason.to_string()).or_default() += 1);
    }
}

/// A job sent to the handler and not yet answered: what H-14's hooks need after a kill.
#[derive(Debug, Clone)]
struct Sent {
    id: String,
    payload: String,
    queue: String,
    worker: String,
    /// The job's note, set when the app recorded its failure (H-17).
    recorded: crate::handler::RecordedNote,
}

/// A `failure_hooks` request waiting for a fresh process.
#[derive(Debug, Clone)]
struct Hook {
    id: String,
    payload: String,
    exception: String,
    error: String,
    queue: String,
    worker: String,
    /// H-17: the fresh process records the failure too (`"record": true`); false once
    /// locketd recorded it itself.
    record: bool,
    recorded: crate::handler::RecordedNote,
}

/// How many payloads [`NoStarts`] remembers.
const NO_STARTS_KEPT: usize = 1024;

/// The payloads (as hashes) of jobs a handler did not start (H-9), shared by the slots of a
/// worker: a payload's second no-start on any of them is `Locket::HandlerCrashed`, however
/// many other jobs came in between (one remembered payload let two wedging jobs that take
/// turns be "first" forever). The oldest is forgotten past [`NO_STARTS_KEPT`].
#[derive(Debug, Default)]
struct NoStarts(Mutex<std::collections::VecDeque<u64>>);

impl NoStarts {
    fn hash(payload: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        payload.hash(&mut h);
        h.finish()
    }

    /// Books a no-start of `payload`: whether it is its second (then it is forgotten).
    fn again(&self, payload: &str) -> bool {
        let h = NoStarts::hash(payload);
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = seen.iter().position(|x| *x == h) {
            seen.remove(i);
            return true;
        }
        if seen.len() == NO_STARTS_KEPT {
            seen.pop_front();
        }
        seen.push_back(h);
        false
    }

    /// `payload` started after all: a later no-start is a first one again.
    fn started(&self, payload: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.is_empty() {
            let h = NoStarts::hash(payload);
            seen.retain(|x| *x != h);
        }
    }
}

/// One slot's process and its bookkeeping, behind the slot's lock.
#[derive(Default)]
struct Slot {
    proc: Option<Proc>,
    next_backoff: Duration,
    sent: Option<Sent>,
    hooks: Vec<Hook>,
    /// The last process said `ready` with the `failure_backend` feature (H-17).
    app_records: bool,
}

/// A persistent handler: one worker slot's instance.
pub struct PersistentHandler {
    spec: Arc<Spec>,
    no_starts: Arc<NoStarts>,
    slot: Arc<tokio::sync::Mutex<Slot>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PersistentHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PersistentHandler")
            .field("name", &self.spec.name)
            .finish()
    }
}

/// "exit status 3" / "signal 9 (SIGKILL)", for the log.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (_, Some(s)) => format!("killed by {}", crate::process::signal_name(s)),
        _ => status.to_string(),
    }
}

impl PersistentHandler {
    /// The first slot's instance of `[handlers.<name>]`.
    pub fn new(name: &str, table: &HandlerConfig, config: &Config) -> PersistentHandler {
        let max_frame = table.max_frame_bytes.map_or_else(
            || (2 * config.max_payload_bytes).max(1024 * 1024),
            |b| usize::try_from(b.0).unwrap_or(usize::MAX),
        );
        let spec = Spec {
            name: name.to_string(),
            argv: table.command.clone(),
            dir: table.dir.clone(),
            env: crate::handler::command::env_pairs(&table.env),
            boot_timeout: table.boot_timeout.get(),
            start_timeout: table.start_timeout.get(),
            max_jobs: table.max_jobs,
            max_jobs_jitter: table.max_jobs_jitter,
            max_rss: table.max_rss.map(|b| b.0),
            max_lifetime: table.max_lifetime.map(|t| t.get()),
            idle_timeout: table.idle_timeout.map(|t| t.get()),
            preload: table.preload,
            max_frame,
            failure_hooks: table.failure_hooks_after_kill,
            term_timeout: config.term_timeout.get(),
            threads: table.threads.max(1),
        };
        PersistentHandler::with_spec(Arc::new(spec), Arc::default())
    }

    /// The handler of `[handlers.<name>]`: with `threads > 1` a [`ThreadedHandler`] whose
    /// slots share processes (H-18), else one process per slot.
    pub fn of_table(name: &str, table: &HandlerConfig, config: &Config) -> Arc<dyn Handler> {
        let h = PersistentHandler::new(name, table, config);
        if h.spec.threads > 1 {
            Arc::new(ThreadedHandler::new(h.spec))
        } else {
            Arc::new(h)
        }
    }

    fn with_spec(spec: Arc<Spec>, no_starts: Arc<NoStarts>) -> PersistentHandler {
        let shared = Shared::default();
        shared.state(|s| {
            s.name = spec.name.clone();
            s.threads = 1;
        });
        PersistentHandler {
            spec,
            no_starts,
            slot: Arc::new(tokio::sync::Mutex::new(Slot {
                next_backoff: BACKOFF_FIRST,
                ..Slot::default()
            })),
            shared: Arc::new(shared),
        }
    }

    /// The parts a background task needs.
    fn parts(&self) -> Parts {
        Parts {
            spec: self.spec.clone(),
            no_starts: self.no_starts.clone(),
            slot: self.slot.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// A handler's parts, owned, for futures and tasks that outlive a borrow.
#[derive(Clone)]
struct Parts {
    spec: Arc<Spec>,
    no_starts: Arc<NoStarts>,
    slot: Arc<tokio::sync::Mutex<Slot>>,
    shared: Arc<Shared>,
}

impl Handler for PersistentHandler {
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        let parts = self.parts();
        Box::pin(async move { parts.perform(job, stop).await })
    }

    fn prepare(&self) -> BoxFuture<'static, Readiness> {
        let parts = self.parts();
        Box::pin(async move {
            let mut slot = parts.slot.clone().lock_owned().await;
            parts.ready(&mut slot).await
        })
    }

    fn backing_off(&self) -> Option<Instant> {
        self.shared.backoff_until()
    }

    fn ready_now(&self) -> bool {
        // A slot busy (a boot, a check) is not ready now.
        self.shared.backoff_until().is_none()
            && self
                .parts()
                .slot
                .try_lock()
                .is_ok_and(|s| s.proc.as_ref().is_some_and(|p| p.exited().is_none()))
    }

    fn after_run(&self, stopped: Option<Stopped>) -> BoxFuture<'static, ()> {
        let parts = self.parts();
        Box::pin(async move {
            if let Some(stopped) = stopped {
                parts.after_stop(stopped).await;
            } else {
                parts.record_if_pending().await;
            }
        })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        let parts = self.parts();
        Box::pin(async move {
            parts.shared.stopping.cancel();
            let mut slot = parts.slot.lock().await;
            if let Some(mut p) = slot.proc.take() {
                debug!(target: LOG_TARGET, handler = %parts.spec.name, pid = p.pid, "stopping idle handler");
                p.retire(parts.spec.term_timeout).await;
            }
            parts.shared.state(|s| {
                s.pid = None;
                s.ready = false;
            });
        })
    }

    fn for_slot(&self) -> Option<Arc<dyn Handler>> {
        Some(Arc::new(PersistentHandler::with_spec(
            self.spec.clone(),
            self.no_starts.clone(),
        )))
    }

    fn preload(&self) -> bool {
        self.spec.preload
    }

    fn state(&self) -> Option<HandlerStats> {
        let mut s = self
            .shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        s.backoff_ms = self.shared.backoff_until().map_or(0, |t| {
            u64::try_from((t - Instant::now()).as_millis()).unwrap_or(u64::MAX)
        });
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::NoStarts;

    #[test]
    fn a_payloads_second_no_start_counts_whatever_came_between() {
        let n = NoStarts::default();
        assert!(!n.again("a"));
        assert!(!n.again("b"));
        assert!(n.again("a"), "a's second, after b's first");
        assert!(n.again("b"));
        assert!(!n.again("a"), "forgotten after its second");
        n.started("a");
        assert!(!n.again("a"), "a started in between: a first again");
    }
}
