//! H-18: one worker slot's instance of a threaded persistent handler (`threads = N > 1`).
//! Its jobs run in the processes of a [`Pool`] shared with the worker's other slots. Each job
//! keeps its own reservation, lease, heartbeat, timeout and outcome (the worker's); what
//! differs is how a job is stopped:
//! - a stop writes `stop` for that job only (no signal): a `done` before the kill point ends
//!   it as with `threads = 1`, and the process lives on;
//! - at the kill point (the supervisor drops the job's future, [`JobGuard`]) or at once
//!   (USR1), the whole process and every job group it recorded are SIGKILLed; the stopped
//!   job is recorded for its reason once the process is gone ([`Handler::after_run`]);
//! - each sibling (a job of the same process that did nothing wrong) returns, once the
//!   process is gone, as [`NOT_STARTED`]: back to the head of its queue, no failure, no
//!   stats; more than [`MAX_SIBLING_RETURNS`] times for one payload, `Resque::DirtyExit`.
//!
//! A death locketd did not cause is each running job's death failure, as with `threads = 1`.

use super::frame::{Done, Frame};
use super::job::{death_failure, line_of, note_recorded, result_of_done, JobFrame};
use super::pool::{Kill, PProc, Pool};
use super::siblings::{Returns, MAX_SIBLING_RETURNS};
use super::*;

/// The `job` frame with the thread locketd assigned (H-18).
#[derive(Serialize)]
struct ThreadedJobFrame<'a> {
    #[serde(flatten)]
    job: JobFrame<'a>,
    thread: u32,
}

/// The slot's current (or last) job.
struct Current {
    p: Arc<PProc>,
    sent: Sent,
    /// It ended with a `done` (or its stop was handled): nothing is left to kill.
    done: bool,
}

/// SIGKILLs the job's process (and its job groups) when the job's future is dropped while
/// armed: the supervisor's kill point (L-9, H-11).
struct JobGuard {
    p: Arc<PProc>,
    id: String,
    armed: bool,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        if self.armed {
            self.p.kill(Kill::Stopped(self.id.clone()));
            self.p.forget(&self.id);
        }
    }
}

/// One slot's instance of a threaded handler.
pub struct ThreadedHandler {
    pool: Arc<Pool>,
    no_starts: Arc<NoStarts>,
    returns: Arc<Returns>,
    shared: Arc<Shared>,
    current: Arc<Mutex<Option<Current>>>,
    /// H-14, H-17: failure hooks of a job whose process died, for `after_run`.
    pending: Arc<Mutex<Option<Hook>>>,
}

impl std::fmt::Debug for ThreadedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedHandler")
            .field("name", &self.pool.spec.name)
            .field("threads", &self.pool.spec.threads)
            .finish()
    }
}

enum End {
    Done(Done),
    Exited(ExitStatus),
}

impl ThreadedHandler {
    pub(super) fn new(spec: Arc<Spec>) -> ThreadedHandler {
        ThreadedHandler::sharing(Arc::new(Pool::new(spec)), Arc::default(), Arc::default())
    }

    fn sharing(pool: Arc<Pool>, no_starts: Arc<NoStarts>, returns: Arc<Returns>) -> Self {
        pool.slots.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let shared = Shared::default();
        shared.state(|s| {
            s.name = pool.spec.name.clone();
            s.threads = pool.spec.threads;
        });
        ThreadedHandler {
            pool,
            no_starts,
            returns,
            shared: Arc::new(shared),
            current: Arc::default(),
            pending: Arc::default(),
        }
    }

    fn clone_parts(&self) -> ThreadedHandler {
        ThreadedHandler {
            pool: self.pool.clone(),
            no_starts: self.no_starts.clone(),
            returns: self.returns.clone(),
            shared: self.shared.clone(),
            current: self.current.clone(),
            pending: self.pending.clone(),
        }
    }

    fn spec(&self) -> &Spec {
        &self.pool.spec
    }

    async fn perform(self, job: JobContext, stop: CancellationToken) -> HandlerResult {
        let name = self.spec().name.clone();
        let (p, thread, mut rx) = match self.pool.acquire(&job.id, &job.watch, &self.shared).await {
            Ok(x) => x,
            Err(why) => {
                return Err(JobFailure::new(
                    RESCHEDULE,
                    format!("handler {name} is not ready: {why}"),
                ))
            }
        };
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(Current {
            p: p.clone(),
            sent: Sent {
                id: job.id.clone(),
                payload: job.payload.clone(),
                queue: job.queue.clone(),
                worker: job.worker.clone(),
                recorded: job.recorded.clone(),
            },
            done: false,
        });
        job.watch.attach(p.pgid);
        let mut guard = JobGuard {
            p: p.clone(),
            id: job.id.clone(),
            armed: true,
        };
        let line = line_of(&ThreadedJobFrame {
            job: JobFrame::of(&job),
            thread,
        });
        debug!(target: LOG_TARGET, handler = %name, pid = p.pid, thread, class = %job.class, "job to a threaded handler");
        let start_deadline = tokio::time::Instant::now() + self.spec().start_timeout;
        let mut exit = p.exit_watch();
        let mut write = Some(Box::pin(p.write(&line)));
        let (mut started, mut stopping, mut no_start, mut open) = (false, false, false, true);
        let end = loop {
            tokio::select! {
                ok = async { write.as_mut().expect("guarded").await }, if write.is_some() => {
                    write = None;
                    if !ok {
                        debug!(target: LOG_TARGET, handler = %name, pid = p.pid, "writing the job frame failed; waiting for the handler's exit");
                    }
                }
                f = rx.recv(), if open => match f {
                    Some(Frame::Started { .. }) => started = true,
                    Some(Frame::Done { outcome, recorded, .. }) => {
                        note_recorded(&job, &outcome, recorded);
                        break End::Done(outcome);
                    }
                    Some(_) => {}
                    None => open = false,
                },
                status = proc::exited(&mut exit) => break End::Exited(status),
                _ = tokio::time::sleep_until(start_deadline), if !started && !stopping && !no_start => {
                    no_start = true;
                    warn!(target: LOG_TARGET, handler = %name, pid = p.pid, class = %job.class, timeout_s = self.spec().start_timeout.as_secs_f64(), "handler did not start the job in time (wedged); killing it");
                    p.kill(Kill::NoStart(job.id.clone()));
                }
                _ = stop.cancelled(), if !stopping => {
                    stopping = true;
                    let reason = job.stop_reason.get().unwrap_or("shutdown");
                    if job.stop_reason.at_once() {
                        info!(target: LOG_TARGET, handler = %name, pid = p.pid, thread, reason, "killing a threaded handler's process at once; its other jobs go back to their queues");
                        p.kill(Kill::Stopped(job.id.clone()));
                        continue;
                    }
                    info!(target: LOG_TARGET, handler = %name, pid = p.pid, thread, reason, "stopping one job of a threaded handler (stop frame, no signal)");
                    let frame = if job.stop_reason.requeue() {
                        serde_json::json!({"t": "stop", "id": job.id, "reason": reason, "requeue": true})
                    } else {
                        serde_json::json!({"t": "stop", "id": job.id, "reason": reason})
                    };
                    let (p, line) = (p.clone(), line_of(&frame));
                    tokio::spawn(async move { p.write(&line).await });
                }
            }
        };
        drop(write);
        guard.armed = false;
        match end {
            End::Done(d) => self.done(&p, &job, d).await,
            End::Exited(status) => {
                // H-10: a `done` already written still counts, after a crash and for a
                // sibling whose process was killed to stop another job (its work is done:
                // returning it would run it twice); not for the job the kill stopped.
                let late = if p.killed().is_none_or(|k| k.for_another(&job.id)) {
                    late_done(&mut rx, &job, &mut started).await
                } else {
                    None
                };
                p.gone().await;
                if let Some(d) = late {
                    return self.done(&p, &job, d).await;
                }
                p.forget(&job.id);
                self.exited(&p, &job, status, started, stopping).await
            }
        }
    }

    async fn done(&self, p: &Arc<PProc>, job: &JobContext, d: Done) -> HandlerResult {
        p.release(&job.id, true).await;
        self.no_starts.started(&job.payload);
        self.returns.forget(&job.payload);
        if let Some(c) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            c.done = true;
        }
        self.shared.state(|s| s.jobs_total += 1);
        if p.exited().is_none() {
            let memory = p.memory(self.spec().max_rss.is_some()).await;
            self.pool.recycle_if_due(p, memory);
            self.pool.retire_if_idle(p);
        }
        result_of_done(d)
    }

    /// The job's process is gone without its `done`.
    async fn exited(
        &self,
        p: &Arc<PProc>,
        job: &JobContext,
        status: ExitStatus,
        started: bool,
        stopping: bool,
    ) -> HandlerResult {
        let name = &self.spec().name;
        if stopping {
            // after_run records nothing of its own: the supervisor records the stop.
            return Err(JobFailure::new("Resque::DirtyExit", "stopped").dirty());
        }
        let failure = match p.killed() {
            Some(Kill::NoStart(id)) if id == job.id => {
                if self.no_starts.again(&job.payload) {
                    JobFailure::new(
                        "Locket::HandlerCrashed",
                        format!("handler {name} did not start this job twice in a row"),
                    )
                } else {
                    return Err(JobFailure::new(
                        NOT_STARTED,
                        "the handler did not start the job",
                    ));
                }
            }
            Some(Kill::Protocol(e)) => JobFailure::new("Locket::ProtocolError", e),
            Some(_) => {
                // A sibling: another job's stop killed the process.
                if self.returns.again(&job.payload) {
                    warn!(target: LOG_TARGET, handler = %name, class = %job.class, max = MAX_SIBLING_RETURNS, "a job returned too often because another job's stop killed its handler process");
                    return Err(JobFailure::new(
                        "Resque::DirtyExit",
                        format!(
                            "its handler {name} (pid {}) was killed to stop another job more than {MAX_SIBLING_RETURNS} times",
                            p.pid
                        ),
                    )
                    .dirty());
                }
                info!(target: LOG_TARGET, handler = %name, pid = p.pid, class = %job.class, "another job's stop killed the handler process: this job goes back to the head of its queue");
                return Err(JobFailure::new(
                    NOT_STARTED,
                    "its handler process was killed to stop another job",
                ));
            }
            None if !started => {
                info!(target: LOG_TARGET, handler = %name, pid = p.pid, class = %job.class, status = %describe(status), "handler exited before it started the job");
                if self.no_starts.again(&job.payload) {
                    death_failure(name, p.pid, status, p.tail().await)
                } else {
                    return Err(JobFailure::new(
                        NOT_STARTED,
                        "the handler exited before it started the job",
                    ));
                }
            }
            None => death_failure(name, p.pid, status, p.tail().await),
        };
        if self.spec().failure_hooks {
            *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(Hook {
                id: job.id.clone(),
                payload: job.payload.clone(),
                exception: failure.exception.clone(),
                error: failure.error.clone(),
                queue: job.queue.clone(),
                worker: job.worker.clone(),
                record: self
                    .pool
                    .app_records
                    .load(std::sync::atomic::Ordering::SeqCst),
                recorded: job.recorded.clone(),
            });
        }
        Err(failure)
    }

    /// H-11 for one job of many: a job whose stop did not end with a `done` has its process
    /// gone before its outcome is recorded; its failure hooks go to a fresh process (H-14).
    async fn after_run(self, stopped: Option<Stopped>) {
        let Some(stopped) = stopped else {
            let hook = self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(hook) = hook {
                self.hooks_of(hook).await;
            }
            return;
        };
        let killed = {
            let mut c = self.current.lock().unwrap_or_else(|p| p.into_inner());
            c.as_mut().filter(|c| !c.done).map(|c| {
                c.done = true;
                (c.p.clone(), c.sent.clone())
            })
        };
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some((p, sent)) = killed else { return };
        if p.exited().is_none() {
            p.kill(Kill::Stopped(sent.id.clone()));
        }
        p.gone().await;
        let reason = stopped.reason;
        if stopped.requeued || matches!(reason, "shutdown" | "presumed_dead") {
            return;
        }
        if !self.spec().failure_hooks {
            return;
        }
        let exception = match reason {
            "timeout" => "Locket::Timeout",
            "lock_lost" => "Locket::LockLost",
            "cancelled" => "Locket::Cancelled",
            _ => "Resque::DirtyExit",
        };
        let hook = Hook {
            id: sent.id,
            payload: sent.payload,
            exception: exception.to_string(),
            error: format!("stopped ({reason})"),
            queue: sent.queue,
            worker: sent.worker,
            record: self
                .pool
                .app_records
                .load(std::sync::atomic::Ordering::SeqCst),
            recorded: sent.recorded,
        };
        self.hooks_of(hook).await;
    }

    /// H-14, H-17: a request that records runs now (FINISH waits for it); hooks only run in
    /// the background.
    async fn hooks_of(&self, hook: Hook) {
        if hook.record {
            self.run_hook(hook).await;
        } else {
            let this = self.clone_parts();
            tokio::spawn(async move { this.run_hook(hook).await });
        }
    }

    /// Sends `failure_hooks` to a process with a free thread (booted if need be).
    async fn run_hook(&self, hook: Hook) {
        let name = &self.spec().name;
        let (p, _, mut rx) = match self
            .pool
            .acquire(&hook.id, &crate::watchdog::Watch::default(), &self.shared)
            .await
        {
            Ok(x) => x,
            Err(why) => {
                warn!(target: LOG_TARGET, handler = %name, id = %hook.id, error = %why, "no handler process for a killed job's failure hooks");
                return;
            }
        };
        let line = line_of(&serde_json::json!({
            "t": "failure_hooks",
            "id": hook.id,
            "payload": hook.payload,
            "exception": hook.exception,
            "error": hook.error,
            "queue": hook.queue,
            "worker": hook.worker,
            "record": hook.record,
        }));
        let mut exit = p.exit_watch();
        let answer = tokio::time::timeout(HOOKS_TIMEOUT, async {
            if !p.write(&line).await {
                return Err("could not write the request".to_string());
            }
            loop {
                tokio::select! {
                    f = rx.recv() => match f {
                        Some(Frame::Done { outcome, recorded, .. }) => return Ok((outcome, recorded)),
                        Some(_) => {}
                        None => return Err("no answer".to_string()),
                    },
                    status = proc::exited(&mut exit) => return Err(format!("exited ({})", describe(status))),
                }
            }
        })
        .await
        .unwrap_or_else(|_| Err("no answer within 60s".to_string()));
        match answer {
            Ok((outcome, recorded)) => {
                if recorded && hook.record {
                    hook.recorded.set();
                }
                if let Done::Failed { exception, .. } = outcome {
                    warn!(target: LOG_TARGET, handler = %name, id = %hook.id, exception = %exception, "a failure hook raised");
                }
                p.release(&hook.id, false).await;
                self.pool.retire_if_idle(&p);
            }
            Err(e) => {
                warn!(target: LOG_TARGET, handler = %name, id = %hook.id, error = %e, "failure hooks did not run; restarting the handler");
                p.kill(Kill::Protocol(format!("failure hooks: {e}")));
                p.forget(&hook.id);
            }
        }
    }
}

/// H-10: after an exit, a `done` already written still counts (and a `started` there is
/// noted in `started`).
async fn late_done(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Frame>,
    job: &JobContext,
    started: &mut bool,
) -> Option<Done> {
    let deadline = tokio::time::Instant::now() + LATE_DONE;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Frame::Done {
                outcome, recorded, ..
            })) => {
                note_recorded(job, &outcome, recorded);
                return Some(outcome);
            }
            Ok(Some(Frame::Started { .. })) => *started = true,
            Ok(Some(_)) => {}
            _ => return None,
        }
    }
}

impl Handler for ThreadedHandler {
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        let this = self.clone_parts();
        Box::pin(async move { this.perform(job, stop).await })
    }

    fn prepare(&self) -> BoxFuture<'static, Readiness> {
        let this = self.clone_parts();
        Box::pin(async move {
            match this.pool.ready(&this.shared).await {
                Ok(()) => Readiness::Ready,
                Err(why) => Readiness::NotReady {
                    until: this
                        .pool
                        .backoff_until()
                        .unwrap_or_else(|| Instant::now() + BACKOFF_FIRST),
                    why,
                },
            }
        })
    }

    fn backing_off(&self) -> Option<Instant> {
        self.pool.backoff_until()
    }

    fn ready_now(&self) -> bool {
        self.pool.backoff_until().is_none() && self.pool.has_room()
    }

    fn after_run(&self, stopped: Option<Stopped>) -> BoxFuture<'static, ()> {
        let this = self.clone_parts();
        Box::pin(async move { this.after_run(stopped).await })
    }

    fn shutdown(&self) -> BoxFuture<'static, ()> {
        let pool = self.pool.clone();
        Box::pin(async move { pool.shutdown().await })
    }

    fn for_slot(&self) -> Option<Arc<dyn Handler>> {
        Some(Arc::new(ThreadedHandler::sharing(
            self.pool.clone(),
            self.no_starts.clone(),
            self.returns.clone(),
        )))
    }

    fn preload(&self) -> bool {
        self.spec().preload
    }

    /// H-18: the slot's job's process (or its last one, or any of the pool's), with its
    /// threads busy and total, its jobs and memory, and the slot's thread in it.
    fn state(&self) -> Option<HandlerStats> {
        let mut s = self
            .shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        s.backoff_ms = self.pool.backoff_until().map_or(0, |t| {
            u64::try_from((t - Instant::now()).as_millis()).unwrap_or(u64::MAX)
        });
        let (p, running) = {
            let c = self.current.lock().unwrap_or_else(|p| p.into_inner());
            match c.as_ref() {
                Some(c) if c.p.exited().is_none() => {
                    (Some(c.p.clone()), (!c.done).then(|| c.sent.id.clone()))
                }
                _ => (self.pool.any(), None),
            }
        };
        s.thread = None;
        s.threads_busy = 0;
        s.retiring = false;
        match p {
            Some(p) => {
                s.pid = Some(p.pid);
                s.ready = p.exited().is_none() && p.killed().is_none();
                s.threads = p.capacity;
                s.threads_busy = p.busy();
                s.thread = running.and_then(|id| p.thread_of(&id));
                p.state(|st| {
                    s.retiring = st.retiring;
                    s.jobs = st.jobs;
                    s.rss_bytes = st.rss.or(s.rss_bytes);
                });
            }
            None => {
                s.pid = None;
                s.ready = false;
                s.threads = self.spec().threads;
            }
        }
        Some(s)
    }
}
