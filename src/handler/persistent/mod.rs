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

mod frame;
mod proc;

use super::{Handler, HandlerResult, JobContext, Readiness, RESCHEDULE};
use crate::config::{Config, HandlerConfig};
use crate::metrics::HandlerStats;
use crate::resque::failure::{signal_status_text, JobFailure};
use frame::{Done, Frame};
use futures::future::BoxFuture;
use proc::{Proc, SpawnSpec};
use serde::Serialize;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

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
}

/// A `failure_hooks` request waiting for a fresh process.
#[derive(Debug, Clone)]
struct Hook {
    id: String,
    payload: String,
    exception: String,
    error: String,
}

/// One slot's process and its bookkeeping, behind the slot's lock.
#[derive(Default)]
struct Slot {
    proc: Option<Proc>,
    next_backoff: Duration,
    sent: Option<Sent>,
    /// The payload of the last job its handler never started (H-9's second no-start).
    no_start: Option<String>,
    hooks: Vec<Hook>,
}

/// A persistent handler: one worker slot's instance.
pub struct PersistentHandler {
    spec: Arc<Spec>,
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

/// Kills the process group when dropped while armed: a run whose future is dropped (a hard
/// stop) leaves no process of the handler able to act (H-11).
struct KillOnDrop {
    pgid: i32,
    armed: bool,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.armed && self.pgid > 0 {
            // SAFETY: kill(2) on a process group; no memory is shared.
            unsafe {
                libc::kill(-self.pgid, libc::SIGKILL);
            }
        }
    }
}

/// How a job's wait on its handler ended.
enum End {
    Done(Done),
    Exited(ExitStatus),
    Protocol(String),
    NoStart,
}

#[derive(Serialize)]
struct JobFrame<'a> {
    t: &'static str,
    id: &'a str,
    payload: &'a str,
    queue: &'a str,
    class: &'a str,
    worker: &'a str,
    lock_keys: &'a [String],
    lock_token: &'a str,
    deadline_ms: Option<u64>,
}

fn line_of(value: &impl Serialize) -> Vec<u8> {
    // Compact JSON holds no raw newline (H-4).
    let mut v = serde_json::to_vec(value).unwrap_or_default();
    v.push(b'\n');
    v
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
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
            env: table
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
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
        };
        PersistentHandler::with_spec(Arc::new(spec))
    }

    fn with_spec(spec: Arc<Spec>) -> PersistentHandler {
        let shared = Shared::default();
        shared.state(|s| s.name = spec.name.clone());
        PersistentHandler {
            spec,
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
            slot: self.slot.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// A handler's parts, owned, for futures and tasks that outlive a borrow.
#[derive(Clone)]
struct Parts {
    spec: Arc<Spec>,
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

    fn after_run(&self, stopped: Option<&'static str>) -> BoxFuture<'static, ()> {
        let parts = self.parts();
        Box::pin(async move {
            if let Some(reason) = stopped {
                parts.after_stop(reason).await;
            }
        })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        let parts = self.parts();
        Box::pin(async move {
            parts.shared.stopping.cancel();
            let mut slot = parts.slot.lock().await;
            if let Some(mut p) = slot.proc.take() {
                debug!(handler = %parts.spec.name, pid = p.pid, "stopping idle handler");
                p.retire(parts.spec.term_timeout).await;
            }
            parts.shared.state(|s| {
                s.pid = None;
                s.ready = false;
            });
        })
    }

    fn for_slot(&self) -> Option<Arc<dyn Handler>> {
        Some(Arc::new(PersistentHandler::with_spec(self.spec.clone())))
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

impl Parts {
    /// H-8: a live process that sent `ready`, or a boot now; a backoff or a failed boot is
    /// `NotReady` until the backoff ends.
    async fn ready(&self, slot: &mut Slot) -> Readiness {
        self.check_idle(slot).await;
        if slot.proc.is_some() {
            return Readiness::Ready;
        }
        match self.boot(slot).await {
            Ok(()) => Readiness::Ready,
            Err(why) => Readiness::NotReady {
                until: self
                    .shared
                    .backoff_until()
                    .unwrap_or_else(|| Instant::now() + BACKOFF_FIRST),
                why,
            },
        }
    }

    /// An idle process that exited, or wrote anything, is ended before it gets a job.
    async fn check_idle(&self, slot: &mut Slot) {
        let Some(p) = slot.proc.as_mut() else { return };
        let why = if let Some(status) = p.exited() {
            Some(("exit", format!("exited while idle ({})", describe(status))))
        } else {
            match p.frames.try_recv() {
                Ok(Ok(Frame::Bye { reason })) => Some(("bye", format!("said bye ({reason})"))),
                Ok(Ok(f)) => Some(("protocol", format!("sent {f:?} while idle"))),
                Ok(Err(e)) => Some(("protocol", format!("wrote {e} while idle"))),
                Err(_) => None,
            }
        };
        if let Some((reason, text)) = why {
            let mut p = slot.proc.take().expect("checked above");
            let tail = p.tail();
            if reason == "bye" {
                p.retire(self.spec.term_timeout).await;
                info!(handler = %self.spec.name, pid = p.pid, "handler {text}; starting a new one");
            } else {
                p.kill_and_reap().await;
                warn!(handler = %self.spec.name, pid = p.pid, stderr = ?tail, "handler {text}; starting a new one");
            }
            self.ended(slot, &p, reason, &text);
        }
    }

    /// Bookkeeping of an incarnation's end.
    fn ended(&self, slot: &mut Slot, p: &Proc, reason: &str, text: &str) {
        if p.ready_at.is_some_and(|t| t.elapsed() >= HEALTHY_AFTER) {
            slot.next_backoff = BACKOFF_FIRST;
        }
        self.shared.restarted(reason);
        self.shared.state(|s| {
            s.pid = None;
            s.ready = false;
            if reason != "max_jobs" && reason != "max_lifetime" && reason != "idle" {
                s.last_error = text.to_string();
            }
        });
    }

    /// Starts a process and waits for its `ready` (H-8). A failure kills what started, logs
    /// the last stderr lines and backs off.
    async fn boot(&self, slot: &mut Slot) -> Result<(), String> {
        if let Some(until) = self.shared.backoff_until() {
            let left = until - Instant::now();
            return Err(format!(
                "backing off for {:.1}s after a failed start",
                left.as_secs_f64()
            ));
        }
        if self.shared.stopping.is_cancelled() {
            return Err("the worker is stopping".to_string());
        }
        let spec = &self.spec;
        self.shared.state(|s| s.boots += 1);
        let started = Instant::now();
        let spawned = Proc::spawn(&SpawnSpec {
            name: &spec.name,
            argv: &spec.argv,
            dir: spec.dir.as_deref(),
            env: &spec.env,
            max_frame: spec.max_frame,
        });
        let result = match spawned {
            Err(e) => Err((None, format!("cannot start {:?}: {e}", spec.argv[0]))),
            Ok(mut p) => match self.await_ready(&mut p).await {
                Ok(features) => Ok((p, features)),
                Err(why) => Err((Some(p), why)),
            },
        };
        match result {
            Ok((mut p, features)) => {
                p.fork = features.iter().any(|f| f == "fork");
                p.ready_at = Some(Instant::now());
                if spec.max_jobs > 0 {
                    p.max_jobs = spec.max_jobs + rand::random_range(0..=spec.max_jobs_jitter);
                }
                info!(handler = %spec.name, pid = p.pid, boot_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), max_jobs = p.max_jobs, features = ?features, "handler ready");
                let pid = p.pid;
                self.shared.state(|s| {
                    s.pid = Some(pid);
                    s.ready = true;
                    s.jobs = 0;
                });
                *self
                    .shared
                    .backoff_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = None;
                slot.proc = Some(p);
                self.watch_idle();
                self.send_hooks(slot).await;
                Ok(())
            }
            Err((p, why)) => {
                let tail = match p {
                    Some(mut p) => {
                        p.kill_and_reap().await;
                        p.tail()
                    }
                    None => Vec::new(),
                };
                let delay = slot.next_backoff;
                slot.next_backoff = (delay * 2).min(BACKOFF_MAX);
                *self
                    .shared
                    .backoff_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + delay);
                self.shared.restarted("boot_failed");
                self.shared.state(|s| {
                    s.pid = None;
                    s.ready = false;
                    s.last_error = why.clone();
                });
                warn!(handler = %spec.name, error = %why, retry_in_s = delay.as_secs_f64(), stderr = ?tail, "handler failed to start; its jobs wait in their queues");
                Err(why)
            }
        }
    }

    /// The first frame must be `ready`, within `boot_timeout`.
    async fn await_ready(&self, p: &mut Proc) -> Result<Vec<String>, String> {
        let deadline = tokio::time::Instant::now() + self.spec.boot_timeout;
        let mut exit = p.exit_watch();
        let mut frames_open = true;
        loop {
            tokio::select! {
                f = p.frames.recv(), if frames_open => match f {
                    Some(Ok(Frame::Ready { features, .. })) => return Ok(features),
                    Some(Ok(other)) => return Err(format!("sent {other:?} before ready")),
                    Some(Err(e)) => return Err(format!("protocol error before ready: {e}")),
                    None => frames_open = false,
                },
                status = proc::exited(&mut exit) => {
                    // A ready already written still counts.
                    if let Ok(Ok(Frame::Ready { features, .. })) = p.frames.try_recv() {
                        if p.exited().is_none() { return Ok(features); }
                    }
                    return Err(format!("exited before ready ({})", describe(status)));
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(format!("no ready within boot_timeout ({}s)", self.spec.boot_timeout.as_secs_f64()));
                }
                _ = self.shared.stopping.cancelled() => return Err("the worker is stopping".to_string()),
            }
        }
    }

    /// Runs one job (H-9), booting first if `prepare` was not called or the process died since.
    async fn perform(self, job: JobContext, stop: CancellationToken) -> HandlerResult {
        let mut slot = self.slot.clone().lock_owned().await;
        if let Readiness::NotReady { why, .. } = self.ready(&mut slot).await {
            // Rare: the process died between prepare and perform and cannot be restarted now.
            return Err(JobFailure::new(
                RESCHEDULE,
                format!("handler {} is not ready: {why}", self.spec.name),
            ));
        }
        self.run_one(slot, job, stop).await
    }

    async fn run_one(
        &self,
        mut slot: OwnedMutexGuard<Slot>,
        job: JobContext,
        stop: CancellationToken,
    ) -> HandlerResult {
        let spec = &self.spec;
        slot.sent = Some(Sent {
            id: job.id.clone(),
            payload: job.payload.clone(),
        });
        let p = slot.proc.as_mut().expect("ready");
        p.set_tag(&job.class, &job.queue);
        p.clear_tail();
        let pgid = p.pgid();
        job.watch.attach(pgid);
        let mut kill = KillOnDrop { pgid, armed: true };
        let line = line_of(&JobFrame {
            t: "job",
            id: &job.id,
            payload: &job.payload,
            queue: &job.queue,
            class: &job.class,
            worker: &job.worker,
            lock_keys: &job.lock_keys,
            lock_token: &job.lock_token,
            deadline_ms: job
                .timeout
                .map(|t| unix_ms(std::time::SystemTime::now() + t)),
        });
        let (end, stopping) = wait_for_end(spec, p, &job, line, &stop).await;
        let done = match &end {
            End::Done(d) => Some(d.clone()),
            End::Exited(_) => late_done(p, &job.id).await,
            _ => None,
        };
        if let Some(d) = done {
            slot.sent = None;
            let p = slot.proc.as_mut().expect("ready");
            p.jobs += 1;
            self.shared.state(|s| {
                s.jobs = p.jobs;
                s.jobs_total += 1;
            });
            let result = result_of_done(d);
            if stopping {
                // H-11: killed and reaped by after_run, whatever `done` said.
                return result;
            }
            if let Some(status) = p.exited() {
                let text = format!("exited after its job ({})", describe(status));
                self.end_now(&mut slot, "exit", &text).await;
                self.replace_later(slot);
                return result;
            }
            kill.armed = false;
            p.set_idle();
            *self
                .shared
                .last_active
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            self.recycle_if_due(slot);
            return result;
        }
        if stopping {
            // The handler did not answer before the stop's kill: after_run reaps it, and
            // sends the job's failure hooks to the next one.
            return Err(JobFailure::new("Resque::DirtyExit", "stopped").dirty());
        }
        let p = slot.proc.as_mut().expect("ready");
        let (pid, tail) = (p.pid, p.tail());
        let (reason, failure) = match end {
            End::Exited(status) => ("exit", death_failure(&spec.name, pid, status, tail)),
            End::Protocol(e) => {
                warn!(handler = %spec.name, pid, class = %job.class, error = %e, "handler broke the protocol; killing it");
                ("protocol", JobFailure::new("Locket::ProtocolError", e))
            }
            End::NoStart => {
                warn!(handler = %spec.name, pid, class = %job.class, timeout_s = spec.start_timeout.as_secs_f64(), "handler did not start the job in time (wedged); killing it");
                slot.sent = None;
                let again = slot.no_start.as_deref() == Some(job.payload.as_str());
                slot.no_start = if again {
                    None
                } else {
                    Some(job.payload.clone())
                };
                let failure = if again {
                    JobFailure::new(
                        "Locket::HandlerCrashed",
                        format!(
                            "handler {} did not start this job twice in a row",
                            spec.name
                        ),
                    )
                } else {
                    JobFailure::new(NOT_STARTED, "the handler did not start the job")
                };
                ("no_start", failure)
            }
            End::Done(_) => unreachable!("handled above"),
        };
        self.end_now(&mut slot, reason, &failure.error).await;
        if let Some(sent) = slot.sent.take() {
            self.queue_hooks(&mut slot, sent, &failure.exception, &failure.error);
        }
        self.replace_later(slot);
        Err(failure)
    }

    /// Kills and reaps the slot's process now (H-10, H-11) and books its end.
    async fn end_now(&self, slot: &mut Slot, reason: &str, text: &str) {
        if let Some(mut p) = slot.proc.take() {
            p.kill_and_reap().await;
            self.ended(slot, &p, reason, text);
        }
    }

    /// H-11 after a stopped run: the group is dead before the outcome is recorded; a fresh
    /// handler starts unless the worker is stopping, and runs the job's failure hooks.
    async fn after_stop(&self, reason: &'static str) {
        let mut slot = self.slot.clone().lock_owned().await;
        let text = format!("stopped ({reason})");
        self.end_now(&mut slot, "killed", &text).await;
        let stopping = matches!(reason, "shutdown" | "presumed_dead");
        if let Some(sent) = slot.sent.take() {
            if !stopping {
                let exception = match reason {
                    "timeout" => "Locket::Timeout",
                    "lock_lost" => "Locket::LockLost",
                    _ => "Resque::DirtyExit",
                };
                self.queue_hooks(&mut slot, sent, exception, &text);
            }
        }
        if !stopping {
            self.replace_later(slot);
        }
    }

    fn queue_hooks(&self, slot: &mut Slot, sent: Sent, exception: &str, error: &str) {
        if self.spec.failure_hooks {
            slot.hooks.push(Hook {
                id: sent.id,
                payload: sent.payload,
                exception: exception.to_string(),
                error: error.to_string(),
            });
        }
    }

    /// Boots the replacement at once, in the background, holding the slot so the next job
    /// waits for it (H-11, H-13); a failure backs off as any boot does.
    fn replace_later(&self, slot: OwnedMutexGuard<Slot>) {
        let parts = self.clone();
        tokio::spawn(async move {
            let mut slot = slot;
            if slot.proc.is_none() && !parts.shared.stopping.is_cancelled() {
                let _ = parts.boot(&mut slot).await;
            }
        });
    }

    /// H-13: between jobs, a process past `max_jobs`, `max_rss` or `max_lifetime` is retired
    /// (EOF, `term_timeout`, SIGKILL) and replaced at once.
    fn recycle_if_due(&self, mut slot: OwnedMutexGuard<Slot>) {
        let spec = &self.spec;
        let p = slot.proc.as_mut().expect("ready");
        // A /proc read per job only when max_rss needs it; otherwise, for status, at most
        // once a second.
        let memory = if spec.max_rss.is_some() || p.memory_read_due() {
            let m = p.memory();
            self.shared.state(|s| s.rss_bytes = m);
            m
        } else {
            None
        };
        let reason = if p.max_jobs > 0 && p.jobs >= p.max_jobs {
            Some("max_jobs")
        } else if spec.max_rss.is_some_and(|m| memory.is_some_and(|r| r > m)) {
            Some("max_rss")
        } else if spec
            .max_lifetime
            .is_some_and(|l| p.spawned_at.elapsed() >= l)
        {
            Some("max_lifetime")
        } else if p.bye {
            Some("bye")
        } else {
            None
        };
        let Some(reason) = reason else { return };
        let mut p = slot.proc.take().expect("ready");
        info!(handler = %spec.name, pid = p.pid, jobs = p.jobs, rss_bytes = ?memory, reason, "recycling handler");
        let parts = self.clone();
        tokio::spawn(async move {
            p.retire(parts.spec.term_timeout).await;
            parts.ended(&mut slot, &p, reason, reason);
            if !parts.shared.stopping.is_cancelled() {
                let _ = parts.boot(&mut slot).await;
            }
        });
    }

    /// H-14: the failure hooks of killed jobs, run by a fresh process once it is ready.
    async fn send_hooks(&self, slot: &mut Slot) {
        while let Some(hook) = slot.hooks.first().cloned() {
            let Some(p) = slot.proc.as_mut() else { return };
            let line = line_of(&serde_json::json!({
                "t": "failure_hooks",
                "id": hook.id,
                "payload": hook.payload,
                "exception": hook.exception,
                "error": hook.error,
            }));
            let answer = tokio::time::timeout(HOOKS_TIMEOUT, async {
                p.send(&line).await.map_err(|e| e.to_string())?;
                loop {
                    match p.frames.recv().await {
                        Some(Ok(Frame::Started { .. })) => {}
                        Some(Ok(Frame::Done { id, outcome })) if id == hook.id => {
                            return Ok(outcome)
                        }
                        Some(Ok(f)) => return Err(format!("answered {f:?}")),
                        Some(Err(e)) => return Err(e.to_string()),
                        None => return Err("closed fd 4".to_string()),
                    }
                }
            })
            .await
            .unwrap_or_else(|_| Err("no answer within 60s".to_string()));
            slot.hooks.remove(0);
            match answer {
                Ok(Done::Failed {
                    exception, error, ..
                }) => {
                    warn!(handler = %self.spec.name, id = %hook.id, exception = %exception, error = %error, "a failure hook raised")
                }
                Ok(_) => debug!(handler = %self.spec.name, id = %hook.id, "failure hooks ran"),
                Err(e) => {
                    warn!(handler = %self.spec.name, id = %hook.id, error = %e, "failure hooks did not run; restarting the handler");
                    self.end_now(slot, "protocol", &e).await;
                    return;
                }
            }
        }
    }

    /// `idle_timeout`: one task per slot ends a process that served no job for that long.
    fn watch_idle(&self) {
        use std::sync::atomic::Ordering;
        let Some(idle) = self.spec.idle_timeout else {
            return;
        };
        if self.shared.idle_watch.swap(true, Ordering::SeqCst) {
            return;
        }
        let parts = self.clone();
        tokio::spawn(async move {
            let mut wait = idle;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = parts.shared.stopping.cancelled() => return,
                }
                let last = *parts
                    .shared
                    .last_active
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let idle_for = last.map_or(idle, |t| t.elapsed());
                if idle_for < idle {
                    wait = idle - idle_for;
                    continue;
                }
                wait = idle;
                let Ok(mut slot) = parts.slot.clone().try_lock_owned() else {
                    continue;
                };
                if let Some(mut p) = slot.proc.take() {
                    info!(handler = %parts.spec.name, pid = p.pid, idle_s = idle.as_secs_f64(), "idle handler exits; the next job starts it again");
                    p.retire(parts.spec.term_timeout).await;
                    parts.ended(&mut slot, &p, "idle", "idle");
                }
            }
        });
    }
}

/// Writes the `job` frame and waits for its end: `done`, the exit, a protocol error, or no
/// `started` in time. A stop writes `stop` and SIGTERMs the group, then keeps waiting (the
/// supervisor drops the future after the grace). Returns the end and whether a stop came.
async fn wait_for_end(
    spec: &Spec,
    p: &mut Proc,
    job: &JobContext,
    line: Vec<u8>,
    stop: &CancellationToken,
) -> (End, bool) {
    let start_deadline = tokio::time::Instant::now() + spec.start_timeout;
    let mut exit = p.exit_watch();
    // The write owns the pipe while it runs and hands it back when it is through.
    let mut requests = None;
    let mut write = Some(Box::pin({
        let w = p.take_requests();
        async move {
            let mut w = w;
            let r = match w.as_mut() {
                Some(w) => tokio::io::AsyncWriteExt::write_all(w, &line).await,
                None => Err(std::io::ErrorKind::BrokenPipe.into()),
            };
            (w, r)
        }
    }));
    let (mut started, mut stopping, mut frames_open) = (false, false, true);
    let end = loop {
        tokio::select! {
            (w, r) = async { write.as_mut().expect("guarded").await }, if write.is_some() => {
                write = None;
                requests = w;
                if let Err(e) = r {
                    debug!(handler = %spec.name, error = %e, "writing the job frame failed; waiting for the handler's exit");
                }
            }
            f = p.frames.recv(), if frames_open => match f {
                Some(Ok(Frame::Started { id, .. })) if id == job.id => started = true,
                Some(Ok(Frame::Done { id, outcome })) if id == job.id => break End::Done(outcome),
                Some(Ok(Frame::Bye { .. })) => p.bye = true,
                Some(Ok(other)) => break End::Protocol(format!("a frame out of turn: {other:?}")),
                Some(Err(e)) => break End::Protocol(e.to_string()),
                None => frames_open = false,
            },
            status = proc::exited(&mut exit) => break End::Exited(status),
            _ = tokio::time::sleep_until(start_deadline), if !started && !stopping => break End::NoStart,
            _ = stop.cancelled(), if !stopping => {
                stopping = true;
                let reason = job.stop_reason.get().unwrap_or("shutdown");
                info!(handler = %spec.name, pid = p.pid, reason, "stopping the handler's job");
                let frame = serde_json::json!({"t": "stop", "id": job.id, "reason": reason});
                proc::try_send(requests.as_ref(), &line_of(&frame));
                p.signal(libc::SIGTERM);
            }
        }
    };
    // A job frame cut off mid-write leaves the pipe unusable; every end but a `done` ends the
    // process anyway, and a `done` comes only after the whole frame was read.
    p.put_requests(requests);
    (end, stopping)
}

/// H-10: after an exit, a `done` already in the pipe still counts.
async fn late_done(p: &mut Proc, id: &str) -> Option<Done> {
    let deadline = tokio::time::Instant::now() + LATE_DONE;
    loop {
        match tokio::time::timeout_at(deadline, p.frames.recv()).await {
            Ok(Some(Ok(Frame::Done { id: got, outcome }))) if got == id => return Some(outcome),
            Ok(Some(Ok(_))) => {}
            _ => return None,
        }
    }
}

/// A `done` frame as the job's result (H-7).
fn result_of_done(d: Done) -> HandlerResult {
    match d {
        Done::Ok { .. } => Ok(()),
        Done::Reschedule => Err(JobFailure::new(RESCHEDULE, "rescheduled by the handler")),
        Done::Failed {
            exception,
            error,
            backtrace,
        } => {
            let f = JobFailure::new(exception, error).with_backtrace(backtrace);
            // Resque counts a killed job (its fork mode's DirtyExit) as processed, not failed.
            Err(if f.exception == "Resque::DirtyExit" {
                f.dirty()
            } else {
                f
            })
        }
    }
}

/// H-10: the failure of a job whose handler died without a `done`.
fn death_failure(name: &str, pid: u32, status: ExitStatus, tail: Vec<String>) -> JobFailure {
    use std::os::unix::process::ExitStatusExt;
    warn!(handler = %name, pid, status = %describe(status), stderr = ?tail, "handler died during a job");
    if let Some(sig) = status.signal() {
        return JobFailure::new(
            "Resque::DirtyExit",
            format!(
                "Child process received unhandled signal {}",
                signal_status_text(pid, sig)
            ),
        )
        .dirty();
    }
    let code = status.code().unwrap_or(-1);
    let last = tail
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| format!(": {}", l.trim()))
        .unwrap_or_default();
    JobFailure::new(
        "Locket::CommandFailed",
        format!("handler {name} (pid {pid}) exited with status {code} during the job{last}"),
    )
    .with_backtrace(tail)
}
