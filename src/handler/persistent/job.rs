//! One job through a persistent handler (H-9 … H-11): the `job` frame, `started` and `done`,
//! the handler's death, protocol errors and stops.

use super::frame::{Done, Frame};
use super::proc::{self, Proc};
use super::*;

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

/// The `job` request (persistent-handlers.md §3), field for field; public so that the
/// benchmark's Ruby floor writes the very frame locketd writes.
#[derive(Serialize)]
pub struct JobFrame<'a> {
    /// Always "job".
    pub t: &'static str,
    /// The request id (the reservation id).
    pub id: &'a str,
    /// The job's exact payload.
    pub payload: &'a str,
    /// The queue it came from.
    pub queue: &'a str,
    /// Its class.
    pub class: &'a str,
    /// The Resque worker id of the slot.
    pub worker: &'a str,
    /// The lock keys it holds.
    pub lock_keys: &'a [String],
    /// Its lease token.
    pub lock_token: &'a str,
    /// When its timeout ends (Unix ms), if it has one.
    pub deadline_ms: Option<u64>,
}

impl<'a> JobFrame<'a> {
    /// The `job` frame of `job`, its deadline counted from now.
    pub(super) fn of(job: &'a JobContext) -> JobFrame<'a> {
        JobFrame {
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
        }
    }
}

pub(super) fn line_of(value: &impl Serialize) -> Vec<u8> {
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

impl Parts {
    /// Runs one job (H-9), booting first if `prepare` was not called or the process died since.
    pub(super) async fn perform(self, job: JobContext, stop: CancellationToken) -> HandlerResult {
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

    pub(super) async fn run_one(
        &self,
        mut slot: OwnedMutexGuard<Slot>,
        job: JobContext,
        stop: CancellationToken,
    ) -> HandlerResult {
        let spec = &self.spec;
        slot.sent = Some(Sent {
            id: job.id.clone(),
            payload: job.payload.clone(),
            queue: job.queue.clone(),
            worker: job.worker.clone(),
            recorded: job.recorded.clone(),
        });
        let p = slot.proc.as_mut().expect("ready");
        p.set_tag(&job.class, &job.queue);
        p.set_busy();
        p.clear_tail();
        let pgid = p.pgid();
        job.watch.attach(pgid);
        let mut kill = KillOnDrop { pgid, armed: true };
        let line = line_of(&JobFrame::of(&job));
        let (end, stopping, mut started) = wait_for_end(spec, p, &job, line, &stop).await;
        let done = match &end {
            End::Done(d) => Some(d.clone()),
            End::Exited(_) => late_done(p, &job, &mut started).await,
            _ => None,
        };
        if let Some(d) = done {
            slot.sent = None;
            self.no_starts.started(&job.payload);
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
            // H-9: nothing the job started outlives its `done` (the handler itself stays).
            p.kill_others().await;
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
            // H-10: a handler that exited before it said `started` ran none of this job's code
            // (a `done` then an exit, seen only once the next job was written): the job goes
            // back to the head of its queue as a no-start does, bounded the same way (H-9).
            End::Exited(status) if !started => {
                info!(target: LOG_TARGET, handler = %spec.name, pid, class = %job.class, status = %describe(status), "handler exited before it started the job");
                slot.sent = None;
                let failure = if self.no_starts.again(&job.payload) {
                    death_failure(&spec.name, pid, status, tail)
                } else {
                    JobFailure::new(NOT_STARTED, "the handler exited before it started the job")
                };
                ("exit", failure)
            }
            End::Exited(status) => ("exit", death_failure(&spec.name, pid, status, tail)),
            End::Protocol(e) => {
                warn!(target: LOG_TARGET, handler = %spec.name, pid, class = %job.class, error = %e, "handler broke the protocol; killing it");
                ("protocol", JobFailure::new("Locket::ProtocolError", e))
            }
            End::NoStart => {
                warn!(target: LOG_TARGET, handler = %spec.name, pid, class = %job.class, timeout_s = spec.start_timeout.as_secs_f64(), "handler did not start the job in time (wedged); killing it");
                slot.sent = None;
                let again = self.no_starts.again(&job.payload);
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
        if slot.hooks.iter().any(|h| h.record) {
            // H-17: after_run boots the fresh process, which records the failure.
            self.shared
                .record_pending
                .store(true, std::sync::atomic::Ordering::SeqCst);
            return Err(failure);
        }
        self.replace_later(slot);
        Err(failure)
    }
}

/// Writes the `job` frame and waits for its end: `done`, the exit, a protocol error, or no
/// `started` in time. A stop writes `stop` and SIGTERMs the group, then keeps waiting (the
/// supervisor drops the future after the grace). Returns the end, whether a stop came and
/// whether the handler said `started`.
async fn wait_for_end(
    spec: &Spec,
    p: &mut Proc,
    job: &JobContext,
    line: Vec<u8>,
    stop: &CancellationToken,
) -> (End, bool, bool) {
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
                    debug!(target: LOG_TARGET, handler = %spec.name, error = %e, "writing the job frame failed; waiting for the handler's exit");
                }
            }
            f = p.frames.recv(), if frames_open => match f {
                Some(Ok(Frame::Started { id, .. })) if id == job.id => started = true,
                Some(Ok(Frame::Done { id, outcome, recorded })) if id == job.id => {
                    note_recorded(job, &outcome, recorded);
                    break End::Done(outcome);
                }
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
                if job.stop_reason.at_once() {
                    // H-11 with no grace (USR1, a second TERM): no `stop`, no SIGTERM, so the
                    // job cannot run its own failure path; the fresh process runs its failure
                    // hooks with the exception that is recorded (H-14).
                    info!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, reason, "killing the handler's job at once");
                    p.signal(libc::SIGKILL);
                    continue;
                }
                info!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, reason, "stopping the handler's job");
                // H-14: `requeue` says the job goes back to its queue rather than being
                // recorded, so the process runs no failure hooks for it and records nothing.
                let frame = if job.stop_reason.requeue() {
                    serde_json::json!({"t": "stop", "id": job.id, "reason": reason, "requeue": true})
                } else {
                    serde_json::json!({"t": "stop", "id": job.id, "reason": reason})
                };
                proc::try_send(requests.as_ref(), &line_of(&frame));
                p.signal(libc::SIGTERM);
            }
        }
    };
    // A job frame cut off mid-write leaves the pipe unusable; every end but a `done` ends the
    // process anyway, and a `done` comes only after the whole frame was read.
    p.put_requests(requests);
    (end, stopping, started)
}

/// H-17: a failed `done` whose failure the app recorded.
pub(super) fn note_recorded(job: &JobContext, outcome: &Done, recorded: bool) {
    if recorded && matches!(outcome, Done::Failed { .. }) {
        job.recorded.set();
    }
}

/// H-10: after an exit, a `done` already in the pipe still counts (and a `started` there is
/// noted in `started`).
async fn late_done(p: &mut Proc, job: &JobContext, started: &mut bool) -> Option<Done> {
    let deadline = tokio::time::Instant::now() + LATE_DONE;
    loop {
        match tokio::time::timeout_at(deadline, p.frames.recv()).await {
            Ok(Some(Ok(Frame::Done {
                id: got,
                outcome,
                recorded,
            }))) if got == job.id => {
                note_recorded(job, &outcome, recorded);
                return Some(outcome);
            }
            Ok(Some(Ok(Frame::Started { id, .. }))) if id == job.id => *started = true,
            Ok(Some(Ok(_))) => {}
            _ => return None,
        }
    }
}

/// A `done` frame as the job's result (H-7).
pub(super) fn result_of_done(d: Done) -> HandlerResult {
    match d {
        Done::Ok { .. } => Ok(()),
        Done::Reschedule => Err(JobFailure::new(RESCHEDULE, "rescheduled by the handler")),
        Done::Throttled { retry_after } => {
            Err(crate::handler::throttled(retry_after.map(|s| {
                std::time::Duration::from_secs_f64(s.min(86_400.0 * 7.0))
            })))
        }
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
pub(super) fn death_failure(
    name: &str,
    pid: u32,
    status: ExitStatus,
    tail: Vec<String>,
) -> JobFailure {
    use std::os::unix::process::ExitStatusExt;
    warn!(target: LOG_TARGET, handler = %name, pid, status = %describe(status), stderr = ?tail, "handler died during a job");
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
