//! A persistent handler's life cycle around its jobs: readiness and boots with their backoff
//! (H-8), an idle process's health, ends and replacements (H-10, H-11), recycling (H-13),
//! failure hooks (H-14) and the idle timeout.

use super::frame::{Done, Frame};
use super::job::line_of;
use super::proc::{Proc, SpawnSpec};
use super::*;

impl Parts {
    /// H-8: a live process that sent `ready`, or a boot now; a backoff or a failed boot is
    /// `NotReady` until the backoff ends.
    pub(super) async fn ready(&self, slot: &mut Slot) -> Readiness {
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
    pub(super) async fn check_idle(&self, slot: &mut Slot) {
        let Some(p) = slot.proc.as_mut() else { return };
        let why = if let Some(status) = p.exited() {
            Some(("exit", format!("exited while idle ({})", describe(status))))
        } else {
            match p.frames.try_recv() {
                Ok(Ok(Frame::Bye { reason })) => {
                    Some(("bye", format!("said bye ({})", brief(&reason))))
                }
                Ok(Ok(f)) => Some((
                    "protocol",
                    format!("sent {} while idle", brief(&format!("{f:?}"))),
                )),
                Ok(Err(e)) => Some(("protocol", format!("wrote {e} while idle"))),
                Err(_) => None,
            }
        };
        if let Some((reason, text)) = why {
            let mut p = slot.proc.take().expect("checked above");
            let tail = p.tail();
            if reason == "bye" {
                p.retire(self.spec.term_timeout).await;
                info!(target: LOG_TARGET, handler = %self.spec.name, pid = p.pid, "handler {text}; starting a new one");
            } else {
                p.kill_and_reap().await;
                warn!(target: LOG_TARGET, handler = %self.spec.name, pid = p.pid, stderr = ?tail, "handler {text}; starting a new one");
            }
            self.ended(slot, &p, reason, &text);
        }
    }

    /// Bookkeeping of an incarnation's end.
    pub(super) fn ended(&self, slot: &mut Slot, p: &Proc, reason: &str, text: &str) {
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
    pub(super) async fn boot(&self, slot: &mut Slot) -> Result<(), String> {
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
                slot.app_records = features.iter().any(|f| f == "failure_backend");
                p.ready_at = Some(Instant::now());
                if spec.max_jobs > 0 {
                    p.max_jobs = spec.max_jobs + rand::random_range(0..=spec.max_jobs_jitter);
                }
                info!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, boot_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), max_jobs = p.max_jobs, features = ?features, "handler ready");
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
                if let Some(p) = slot.proc.as_ref() {
                    p.set_idle();
                    self.watch_frames(p);
                }
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
                warn!(target: LOG_TARGET, handler = %spec.name, error = %why, retry_in_s = delay.as_secs_f64(), stderr = ?tail, "handler failed to start; its jobs wait in their queues");
                Err(why)
            }
        }
    }

    /// The first frame must be `ready`, within `boot_timeout`.
    pub(super) async fn await_ready(&self, p: &mut Proc) -> Result<Vec<String>, String> {
        let (features, pid) = self.await_ready_frame(p).await?;
        p.ready_pid(pid);
        Ok(features)
    }

    /// The `ready` frame's features and pid.
    async fn await_ready_frame(&self, p: &mut Proc) -> Result<(Vec<String>, Option<u64>), String> {
        let deadline = tokio::time::Instant::now() + self.spec.boot_timeout;
        let mut exit = p.exit_watch();
        let mut frames_open = true;
        loop {
            tokio::select! {
                f = p.frames.recv(), if frames_open => match f {
                    Some(Ok(Frame::Ready { features, pid, .. })) => return Ok((features, pid)),
                    Some(Ok(other)) => return Err(format!("sent {other:?} before ready")),
                    Some(Err(e)) => return Err(format!("protocol error before ready: {e}")),
                    None => frames_open = false,
                },
                status = proc::exited(&mut exit) => {
                    // A ready already written still counts.
                    if let Ok(Ok(Frame::Ready { features, pid, .. })) = p.frames.try_recv() {
                        if p.exited().is_none() { return Ok((features, pid)); }
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

    /// Kills and reaps the slot's process now (H-10, H-11) and books its end.
    pub(super) async fn end_now(&self, slot: &mut Slot, reason: &str, text: &str) {
        if let Some(mut p) = slot.proc.take() {
            p.kill_and_reap().await;
            self.ended(slot, &p, reason, text);
        }
    }

    /// H-11 after a stopped run: the group is dead before the outcome is recorded; a fresh
    /// handler starts unless the worker is stopping, and runs the job's failure hooks (H-14)
    /// unless the job goes back to its queue: a requeue is no failure.
    pub(super) async fn after_stop(&self, stopped: Stopped) {
        let reason = stopped.reason;
        let mut slot = self.slot.clone().lock_owned().await;
        let text = format!("stopped ({reason})");
        self.end_now(&mut slot, "killed", &text).await;
        let stopping = matches!(reason, "shutdown" | "presumed_dead");
        if let Some(sent) = slot.sent.take() {
            if stopped.requeued {
                debug!(target: LOG_TARGET, handler = %self.spec.name, id = %sent.id, reason, "the stopped job is requeued, not failed: no failure hooks");
            } else if !stopping {
                let exception = match reason {
                    "timeout" => "Locket::Timeout",
                    "lock_lost" => "Locket::LockLost",
                    "cancelled" => "Locket::Cancelled",
                    _ => "Resque::DirtyExit",
                };
                self.queue_hooks(&mut slot, sent, exception, &text);
            }
        }
        if !stopping {
            self.replace_and_record(slot).await;
        }
    }

    pub(super) fn queue_hooks(&self, slot: &mut Slot, sent: Sent, exception: &str, error: &str) {
        if self.spec.failure_hooks {
            slot.hooks.push(Hook {
                id: sent.id,
                payload: sent.payload,
                exception: exception.to_string(),
                error: error.to_string(),
                queue: sent.queue,
                worker: sent.worker,
                record: slot.app_records,
                recorded: sent.recorded,
            });
        }
    }

    /// Boots the replacement at once, in the background, holding the slot so the next job
    /// waits for it (H-11, H-13); a failure backs off as any boot does.
    pub(super) fn replace_later(&self, slot: OwnedMutexGuard<Slot>) {
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
    pub(super) fn recycle_if_due(&self, mut slot: OwnedMutexGuard<Slot>) {
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
        info!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, jobs = p.jobs, rss_bytes = ?memory, reason, "recycling handler");
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
    pub(super) async fn send_hooks(&self, slot: &mut Slot) {
        while let Some(hook) = slot.hooks.first().cloned() {
            let Some(p) = slot.proc.as_mut() else { return };
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
            let answer = tokio::time::timeout(HOOKS_TIMEOUT, async {
                p.send(&line).await.map_err(|e| e.to_string())?;
                loop {
                    match p.frames.recv().await {
                        Some(Ok(Frame::Started { .. })) => {}
                        Some(Ok(Frame::Done {
                            id,
                            outcome,
                            recorded,
                        })) if id == hook.id => {
                            if recorded && hook.record {
                                hook.recorded.set();
                            }
                            return Ok(outcome);
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
            if answer.is_ok() {
                // As after a job's `done` (H-9): nothing a hook started outlives it.
                if let Some(p) = slot.proc.as_mut() {
                    p.kill_others().await;
                }
            }
            match answer {
                Ok(Done::Failed {
                    exception, error, ..
                }) => {
                    warn!(target: LOG_TARGET, handler = %self.spec.name, id = %hook.id, exception = %exception, error = %error, "a failure hook raised")
                }
                Ok(_) => {
                    debug!(target: LOG_TARGET, handler = %self.spec.name, id = %hook.id, "failure hooks ran")
                }
                Err(e) => {
                    warn!(target: LOG_TARGET, handler = %self.spec.name, id = %hook.id, error = %e, "failure hooks did not run; restarting the handler");
                    self.end_now(slot, "protocol", &e).await;
                    return;
                }
            }
        }
    }

    /// H-5: a frame while the process is idle ends it at once, and a fresh one starts. The
    /// reader holds that frame and reads no further; this task, one per process, is woken by
    /// it and ends with the process.
    pub(super) fn watch_frames(&self, p: &Proc) {
        let parts = self.clone();
        let idle = p.idle.clone();
        let mut exit = p.exit_watch();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = idle.frame.notified() => {}
                    _ = super::proc::exited(&mut exit) => return,
                    _ = parts.shared.stopping.cancelled() => return,
                }
                let mut slot = parts.slot.clone().lock_owned().await;
                let ours = slot
                    .proc
                    .as_ref()
                    .is_some_and(|p| Arc::ptr_eq(&p.idle, &idle));
                if !ours {
                    return;
                }
                if idle.busy() {
                    continue; // a request went out meanwhile: the frame is its answer's business
                }
                parts.check_idle(&mut slot).await;
                if slot.proc.is_none() {
                    parts.replace_later(slot);
                    return;
                }
            }
        });
    }

    /// `idle_timeout`: one task per slot ends a process that served no job for that long.
    pub(super) fn watch_idle(&self) {
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
                    info!(target: LOG_TARGET, handler = %parts.spec.name, pid = p.pid, idle_s = idle.as_secs_f64(), "idle handler exits; the next job starts it again");
                    p.retire(parts.spec.term_timeout).await;
                    parts.ended(&mut slot, &p, "idle", "idle");
                }
            }
        });
    }
}

/// The start of a text for the log: a frame's fields may be as long as `max_frame_bytes`.
fn brief(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}
