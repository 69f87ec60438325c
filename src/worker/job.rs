//! One reserved job's path, a function per step of the guide's "How it works"
//! (docs/guide/how-it-works.md): decode and plan, ACQUIRE (with the conflict path and lock
//! waits; what a conflict can lead to is `conflict.rs`), run under supervision, and the end
//! handed to FINISH (`finish.rs`).

use super::epoch_secs;
use super::retry::{retry, sleep_unless_stopped, GaveUp};
use super::run::{self, RunEnd};
use super::take::Took;
use super::{Control, StopReason, Worker};
use crate::config::plans::{ClassPlan, Plans, RenderedPlan};
use crate::config::OnLockLost;
use crate::handler::{Handler, JobContext, Stopped};
use crate::locks::canonical;
use crate::locks::template::RenderInput;
use crate::locks::Policy;
use crate::resque::failure::{self, JobFailure};
use crate::resque::payload::Job;
use crate::store::random_hex;
use crate::store::{
    self, AcquireOptions, AcquireOutcome, AcquireRequest, Finish, FinishHolds, Settled, Taken,
    UniqueEntry,
};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::worker";

impl Worker {
    /// whether jobs reserved from this queue take their class's execution locks
    /// (`lock_queues`); whether the class has any is its plan's business.
    pub(super) fn is_locked(&self, job: &Job) -> bool {
        match &self.lock_queues {
            None => true,
            Some(spec) => {
                if spec.is_dynamic() {
                    spec.patterns()
                        .iter()
                        .any(|p| crate::resque::patterns::fnmatch(p, &job.queue))
                        && !spec
                            .skips()
                            .iter()
                            .any(|p| crate::resque::patterns::fnmatch(p, &job.queue))
                } else {
                    spec.patterns().iter().any(|p| p == &job.queue)
                }
            }
        }
    }

    /// Runs one reserved job to its end, a step per function (docs/guide/how-it-works.md): plan,
    /// ACQUIRE, run, FINISH. Returns a stop reason when the worker must stop.
    pub(super) async fn process(
        &mut self,
        queue: String,
        payload: Vec<u8>,
        rid: String,
        took: Option<Took>,
        control: &Control,
        dead: &CancellationToken,
    ) -> Option<StopReason> {
        let started = Instant::now();
        let mut p = match self.plan_job(queue, payload, rid, started) {
            Ok(p) => p,
            Err(u) => return self.unstarted(*u, took, started).await,
        };
        let taken = match took {
            Some(Took {
                taken: Taken::Acquired { outcome, locks, .. },
                token,
                sent_at,
            }) => Some((outcome, locks, token, sent_at)),
            Some(Took {
                taken: Taken::Kept(why),
                ..
            }) => {
                self.metrics.take(&why);
                None
            }
            None => None,
        };
        let (fences, sent_at) = if let Some((outcome, locks, token, sent_at)) = taken {
            // TAKE ran the job's ACQUIRE in the call that reserved it (A-7a).
            self.metrics.take("one_call");
            p.taken_locks(locks, token);
            match self.taken(&p, outcome, sent_at, control, dead).await {
                Acquire::Started { fences, sent_at } => (fences, sent_at),
                Acquire::Ended(stop) => return stop,
            }
        } else {
            if control.stopping() {
                // shutting down before the job started: back to the head of its queue.
                self.return_job(&p.rid, &p.queue).await;
                return Some(StopReason::Shutdown);
            }
            if let Some(stop) = self.prepare_handler(&p, control, dead).await {
                return stop;
            }
            match self.acquire(&p, control, dead).await {
                Acquire::Started { fences, sent_at } => (fences, sent_at),
                Acquire::Ended(stop) => return stop,
            }
        };
        let (end, on_lost, recorded) = self.run_job(&p, fences, sent_at, control, dead).await;
        self.end_job(&p, end, on_lost, recorded, dead).await
    }

    /// Decode, handler and lock plan (T-*): a job that cannot start is failed as it is, never
    /// run unlocked and never dropped (E-1, E-2).
    fn plan_job(
        &self,
        queue: String,
        payload: Vec<u8>,
        rid: String,
        started: Instant,
    ) -> Result<Planned, Box<Unstarted>> {
        let job = match Job::decode(&payload, &queue, self.config.max_payload_bytes) {
            Ok(job) => job,
            Err(e) => {
                let raw = String::from_utf8_lossy(&payload).into_owned();
                warn!(target: LOG_TARGET, queue = %queue, error = %e, "bad payload recorded as failed");
                let failure = JobFailure::new("Locket::BadPayload", e.to_string());
                let class = "?".to_string();
                return Err(Box::new(Unstarted {
                    rid,
                    queue,
                    raw,
                    class,
                    failure,
                    unique: None,
                }));
            }
        };
        let digest = canonical::digest(&job.class, &job.args);
        // U-2..U-4: known before anything can fail the job, so that a job failed unstarted
        // (no handler, a bad lock key) releases its entry too.
        let unique = self.unique_of(&job, &queue, &digest);
        let unstarted = |job: &Job, failure| Unstarted {
            rid: rid.clone(),
            queue: queue.clone(),
            raw: job.raw.clone(),
            class: job.class.clone(),
            failure,
            unique: unique.clone(),
        };
        let Some(handler) = self.handlers.get(&job.class) else {
            let f = JobFailure::new(
                "NameError",
                format!(
                    "uninitialized constant {} (locketd has no handler for class {:?})",
                    job.class, job.class
                ),
            );
            warn!(target: LOG_TARGET, queue = %queue, class = %job.class, "no handler for class");
            return Err(Box::new(unstarted(&job, f)));
        };
        let plans = self.plans.clone();
        let input = RenderInput {
            class: &job.class,
            queue: &queue,
            digest: &digest,
            args: &job.args,
        };
        let rendered = match plans.get(&job.class).render(&input, self.is_locked(&job)) {
            Ok(r) => r,
            Err(e) => {
                // T-6, E-2: never run unlocked, never dropped.
                warn!(target: LOG_TARGET, queue = %queue, class = %job.class, error = %e, "lock key cannot be rendered; job failed");
                let f = JobFailure::new("Locket::BadLockKey", e.to_string());
                return Err(Box::new(unstarted(&job, f)));
            }
        };
        let token = if rendered.locks.is_empty() {
            String::new()
        } else {
            random_hex(16)
        };
        Ok(Planned {
            rid,
            queue,
            job,
            handler,
            started,
            digest,
            plans,
            rendered,
            token,
            unique,
        })
    }

    /// U-2..U-4: the unique entry of a job whose class's policy follows the job (rendered as
    /// PUSH renders it), or `None` (no such policy, or a key the args cannot render, which
    /// PUSH refused too).
    pub(super) fn unique_of(&self, job: &Job, queue: &str, digest: &str) -> Option<UniqueEntry> {
        let u = self.plans.get(&job.class).unique.as_ref()?;
        if !u.policy.follows_job() {
            return None;
        }
        let input = RenderInput {
            class: &job.class,
            queue,
            digest,
            args: &job.args,
        };
        let id = u.key.render(&input).ok()?.id;
        Some(UniqueEntry::new(&self.keys, &id, u.policy, u.ttl, digest))
    }

    /// [`Self::unique_of`] for a payload read back from the slot's record.
    pub(super) fn unique_of_payload(&self, payload: &str, queue: &str) -> Option<UniqueEntry> {
        if !self.plans.any_unique_follows_job() {
            return None;
        }
        let job = Job::decode(payload.as_bytes(), queue, self.config.max_payload_bytes).ok()?;
        let digest = canonical::digest(&job.class, &job.args);
        self.unique_of(&job, queue, &digest)
    }

    /// ACQUIRE (+START, A-6..A-9), and P-3's bounded wait while the lock is taken.
    async fn acquire(
        &mut self,
        p: &Planned,
        control: &Control,
        dead: &CancellationToken,
    ) -> Acquire {
        let plan = p.plan();
        let setup = self.conflict_setup(p);
        let mut opts = self.acquire_options(p, &setup);
        let lockinfo = self.id.lockinfo(&p.queue, &p.job.class, &p.digest);
        let wait_until = Instant::now() + plan.wait_timeout;
        let mut pause = Duration::from_millis(50);
        let mut waiting = false;
        loop {
            let sent_at = Instant::now();
            let o = (!setup.plain).then_some(&opts);
            let acquired = match self.acquire_once(p, o, &lockinfo, control).await {
                Ok(a) => a,
                Err(why) => {
                    // E-3: ACQUIRE changed nothing (S-6) and sending it again would be refused
                    // again: the job is failed where Resque users look, retryable once the
                    // operator has mended the key the error names.
                    let f = JobFailure::new(
                        "Locket::StoreError",
                        format!("Redis refused the job's lock step (ACQUIRE): {why}"),
                    );
                    let (rid, queue, raw, class) = (&p.rid, &p.queue, &p.job.raw, &p.job.class);
                    let unique = p.unique.as_ref();
                    let stop = self.fail_unstarted(rid, queue, raw, class, f, p.started, unique);
                    return Acquire::Ended(stop.await);
                }
            };
            // P-3: still reserved, so wait (bounded) and try again; the last try settles the
            // job by `wait_then` in the same script as the check.
            let unsettled = matches!(
                acquired,
                Some(AcquireOutcome::Conflict {
                    action: Settled::None,
                    ..
                })
            );
            if !(setup.waits && !opts.last_wait && unsettled) {
                return self
                    .settle(p, acquired, sent_at, opts.last_wait, waiting, dead)
                    .await;
            }
            if !waiting {
                // The job starts waiting (O-1's `wait` action); how the wait ends is counted
                // too, when it is settled.
                waiting = true;
                self.metrics.lock_conflict("wait");
            }
            let now = Instant::now();
            if now >= wait_until {
                if opts.on_lock_conflict == Policy::Wait {
                    opts.on_lock_conflict = plan.wait_then;
                }
                if opts.on_dep_conflict == Policy::Wait {
                    opts.on_dep_conflict = plan.wait_then;
                }
                opts.last_wait = true;
                continue;
            }
            let nap = pause.min(wait_until - now);
            // A pause (USR2) only stops new reservations: a job already waiting on its lock
            // keeps waiting (P-3); QUIT, TERM and presumed death end the wait.
            if !sleep_unless_stopped(nap, control, dead).await {
                // a waiting job goes back to the head of its queue (rid-checked).
                self.return_job(&p.rid, &p.queue).await;
                return Acquire::Ended(Some(if dead.is_cancelled() {
                    StopReason::PresumedDead
                } else {
                    StopReason::Shutdown
                }));
            }
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// One ACQUIRE, resent while Redis is away (E-3). `Ok(None)`: Redis stayed away until the
    /// worker was told to stop; `Err`: Redis refused it (the refusal's text).
    async fn acquire_once(
        &mut self,
        p: &Planned,
        opts: Option<&AcquireOptions<'_>>,
        lockinfo: &str,
        control: &Control,
    ) -> Result<Option<AcquireOutcome>, String> {
        let lt = &self.config.locket;
        // Resque's run_at is when the job starts: taken per attempt, so that a lock wait
        // before it is not shown as time spent working.
        let working_on =
            failure::working_on(&p.job.raw, &p.queue, SystemTime::now(), &self.id.worker_id);
        let req = AcquireRequest {
            rid: &p.rid,
            token: &p.token,
            queue: &p.queue,
            class: &p.job.class,
            digest: &p.digest,
            locks: &p.rendered.locks,
            lock_ttl: lt.lock_ttl.get(),
            counter_ttl: lt.counter_ttl.get(),
            requeue_on_conflict: true,
            working_on: &working_on,
            lockinfo,
            resent: false,
        };
        let slot = self.slot();
        // Every attempt after the first is a resend: the one before may have landed.
        let mut resent = false;
        let acquired = retry(&mut self.conn.clone(), "acquire", control, |mut c| {
            let (slot, o) = (slot.clone(), opts.cloned());
            let req = AcquireRequest {
                resent,
                ..req.clone()
            };
            resent = true;
            async move { store::acquire_with(&mut c, &slot, &req, o.as_ref()).await }
        })
        .await;
        match acquired {
            Ok(a) => Ok(Some(a)),
            Err(GaveUp::Away) => Ok(None),
            Err(GaveUp::Refused(why)) => Err(why),
        }
    }

    /// What ACQUIRE's answer means for the job: it started, or its path ends here (the
    /// conflict path: requeued, discarded, delayed or failed by the script, O-1 logged).
    pub(super) async fn settle(
        &mut self,
        p: &Planned,
        acquired: Option<AcquireOutcome>,
        sent_at: Instant,
        last_wait: bool,
        waiting: bool,
        dead: &CancellationToken,
    ) -> Acquire {
        let (queue, class) = (&p.queue, &p.job.class);
        match acquired {
            // Redis stayed away until we were told to stop: the reservation stays in the
            // inflight record for recovery (E-3).
            None => Acquire::Ended(Some(StopReason::Shutdown)),
            Some(AcquireOutcome::Started { fences, .. }) => Acquire::Started { fences, sent_at },
            Some(AcquireOutcome::Conflict { action, conflicts }) => {
                if last_wait {
                    let plan = p.plan();
                    info!(target: LOG_TARGET, queue = %queue, class = %class, digest = %&p.digest[..12], waited_ms = u64::try_from(plan.wait_timeout.as_millis()).unwrap_or(u64::MAX), then = plan.wait_then.name(), "lock wait timed out");
                }
                self.log_conflict(class, queue, &p.digest, &action, &conflicts, waiting);
                if action == Settled::None {
                    // Not settled (a wait interrupted): back to the head, where it was.
                    self.return_job(&p.rid, queue).await;
                }
                Acquire::Ended(None)
            }
            Some(AcquireOutcome::Dead) => {
                // nothing was started; the reservation stays for recovery.
                error!(target: LOG_TARGET, queue = %queue, class = %class, process = %self.id.process_id, "process lease gone: presumed dead, the job is left reserved for recovery");
                dead.cancel();
                Acquire::Ended(Some(StopReason::PresumedDead))
            }
            Some(AcquireOutcome::Cancelled(request)) => {
                let job = Some((p.job.raw.as_str(), class.as_str()));
                let stop = self.cancel_unstarted(&p.rid, queue, job, p.started, &request);
                Acquire::Ended(stop.await)
            }
            Some(AcquireOutcome::Missing) => {
                error!(target: LOG_TARGET, queue = %queue, class = %class, "reservation was recovered elsewhere before it started");
                Acquire::Ended(None)
            }
        }
    }

    /// Runs the started job through its handler under supervision (A-10..A-12, L-9).
    async fn run_job(
        &mut self,
        p: &Planned,
        fences: Vec<u64>,
        sent_at: Instant,
        control: &Control,
        dead: &CancellationToken,
    ) -> (RunEnd, OnLockLost, bool) {
        let (queue, class) = (&p.queue, &p.job.class);
        self.title(&format!(
            "Processing {queue} since {} [{class}]",
            epoch_secs()
        ));
        info!(target: LOG_TARGET, queue = %queue, class = %class, worker = %self.id.worker_id, "job started");
        self.metrics.job_started(queue, class);
        // Its own table, else the "*" fallback (as for its handler and lock plan).
        let class_cfg = self
            .config
            .classes
            .get(class)
            .or_else(|| self.config.classes.get("*"))
            .cloned()
            .unwrap_or_default();
        let ctx = JobContext {
            class: class.clone(),
            queue: queue.clone(),
            payload: p.job.raw.clone(),
            args: p.job.args.clone(),
            args_raw: p.job.args_raw.clone(),
            worker: self.id.worker_id.clone(),
            lock_keys: p.rendered.locks.iter().map(|l| l.id.clone()).collect(),
            lock_token: p.token.clone(),
            lock_fences: fences,
            watch: crate::watchdog::Watch::default(),
            id: p.rid.clone(),
            timeout: class_cfg.timeout.map(|t| t.get()),
            stop_reason: crate::handler::StopNote::default(),
            recorded: crate::handler::RecordedNote::default(),
        };
        let stop_note = ctx.stop_reason.clone();
        let recorded = ctx.recorded.clone();
        let lt = &self.config.locket;
        let on_lost = class_cfg.on_lock_lost.unwrap_or(lt.on_lock_lost);
        let sup = run::Supervision {
            conn: self.conn.manager().clone(),
            keys: self.keys.clone(),
            token: p.token.clone(),
            locks: p.rendered.locks.clone(),
            lock_ttl: lt.lock_ttl.get(),
            heartbeat_interval: lt.heartbeat(),
            sent_at,
            max_runtime: class_cfg.timeout.map(|t| t.get()),
            kill_grace: class_cfg.kill_grace.unwrap_or(lt.kill_grace).get(),
            shutdown_timeout: lt.shutdown_timeout.get(),
            term_timeout: self.config.term_timeout.get(),
            on_lock_lost: on_lost,
            rid: p.rid.clone(),
        };
        let end = sup.run(p.handler.clone(), ctx, control, dead).await;
        // H-11: whatever a stopped run left of its handler is dead before the end is recorded;
        // the handler is told whether the end is a requeue (no failure hooks for it, H-14).
        let stopped = stop_note.get().map(|reason| Stopped {
            reason,
            requeued: end.requeues(on_lost),
        });
        p.handler.after_run(stopped).await;
        // H-17: read after after_run, where a fresh handler may have recorded a killed job.
        (end, on_lost, recorded.get())
    }

    /// The run's end handed to FINISH: a lost lock with `on_lock_lost = "requeue"` goes back to
    /// its queue; every other end is recorded as Resque records it. `recorded`: the
    /// app recorded the failure through its own backend (H-17), so FINISH pushes no record.
    async fn end_job(
        &mut self,
        p: &Planned,
        end: RunEnd,
        on_lost: OnLockLost,
        recorded: bool,
        dead: &CancellationToken,
    ) -> Option<StopReason> {
        let (queue, class, locks, token) = (&p.queue, &p.job.class, &p.rendered.locks, &p.token);
        // a cancelled job's request is done with (`--requeue` puts it back at the tail,
        // below, as `RunEnd::requeues` says).
        if matches!(end, RunEnd::Cancelled(_)) {
            let mut conn = self.conn.manager().clone();
            super::cancel::forget(&mut conn, &self.keys, &self.id.process_id, &p.rid).await;
        }
        if matches!(end, RunEnd::LockLost) {
            self.metrics.lock_lost();
            error!(target: LOG_TARGET, queue = %queue, class = %class, token = %&token[..8.min(token.len())], locks = ?locks.iter().map(|l| &l.id).collect::<Vec<_>>(), "job lock lost");
        }
        if end.requeues(on_lost) {
            return self.requeue_started(p).await;
        }
        let mut result = end.into_result(locks);
        if let Err(f) = &mut result {
            f.recorded |= recorded;
        }
        let stop = self
            .finish_job(
                &p.rid,
                queue,
                token,
                locks,
                &p.job.raw,
                result,
                class,
                p.started,
                Some((&p.digest, &p.rendered)),
                p.unique.as_ref().map(|u| (u, true)),
            )
            .await;
        if dead.is_cancelled() {
            return Some(StopReason::PresumedDead);
        }
        stop
    }

    /// A started job back to the tail of its queue, its locks and start-time holds released
    /// (A-11's requeue, and a TAKE whose handler was not ready after all).
    pub(super) async fn requeue_started(&mut self, p: &Planned) -> Option<StopReason> {
        let release = p.rendered.releases(false);
        let holds = FinishHolds {
            class: &p.job.class,
            digest: &p.digest,
            release: &release,
            resent: false,
            unique: "",
        };
        self.finish_outcome(
            &p.rid,
            &p.queue,
            &p.token,
            &p.rendered.locks,
            Finish::Requeue,
            &p.job.class,
            p.started,
            "requeued",
            &holds,
            p.unique.as_ref().map(|u| (u, true)),
        )
        .await
    }

    /// Records a reserved job that never ran (bad payload, no handler, bad lock key) as failed:
    /// no lock, no token, nothing to release but its unique entry (U-2..U-4).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn fail_unstarted(
        &mut self,
        rid: &str,
        queue: &str,
        payload: &str,
        class: &str,
        failure: JobFailure,
        started: Instant,
        unique: Option<&UniqueEntry>,
    ) -> Option<StopReason> {
        self.finish_job(
            rid,
            queue,
            "",
            &[],
            payload,
            Err(failure),
            class,
            started,
            None,
            unique.map(|u| (u, false)),
        )
        .await
    }
}

/// A reserved job, decoded and planned: what every later step of its path needs.
pub(super) struct Planned {
    pub(super) rid: String,
    pub(super) queue: String,
    pub(super) job: Job,
    pub(super) handler: Arc<dyn Handler>,
    /// When it was reserved (for the job's duration).
    pub(super) started: Instant,
    /// The payload digest (holds, lockinfo).
    digest: String,
    plans: Arc<Plans>,
    pub(super) rendered: RenderedPlan,
    /// The attempt's lock token (L-3); empty without locks.
    token: String,
    /// Its unique entry when its class's policy follows the job (U-2..U-4).
    pub(super) unique: Option<UniqueEntry>,
}

impl Planned {
    pub(super) fn plan(&self) -> &ClassPlan {
        self.plans.get(&self.job.class)
    }

    /// TAKE took the job's locks (A-7a): its token is TAKE's, and its locks the ones TAKE
    /// rendered. They are the worker's own (tests/it/render.rs holds the two renderers to
    /// one answer); where they differ anyway, TAKE's are the ones held, so they are the ones
    /// extended and released, and the difference is logged as the bug it is.
    fn taken_locks(&mut self, locks: Vec<crate::locks::LockSpec>, token: String) {
        if locks != self.rendered.locks {
            error!(target: LOG_TARGET, queue = %self.queue, class = %self.job.class, worker = ?self.rendered.locks, take = ?locks, "TAKE rendered other lock ids than the worker; the ones TAKE took are held");
            self.rendered.locks = locks;
        }
        self.token = token;
    }

    /// When it was reserved.
    pub(super) fn started(&self) -> Instant {
        self.started
    }
}

/// A reserved job that cannot start, to be failed as it is.
pub(super) struct Unstarted {
    pub(super) rid: String,
    pub(super) queue: String,
    /// The payload as text (lossy when it was not UTF-8).
    pub(super) raw: String,
    pub(super) class: String,
    pub(super) failure: JobFailure,
    pub(super) unique: Option<UniqueEntry>,
}

/// How ACQUIRE ended for the job's path.
pub(super) enum Acquire {
    /// The job started: its fencing numbers, and when the ACQUIRE that started it was sent
    /// (L-9's `t`).
    Started { fences: Vec<u64>, sent_at: Instant },
    /// The path ends here (a conflict settled, the job returned or failed); `Some` when the
    /// worker must stop.
    Ended(Option<StopReason>),
}
