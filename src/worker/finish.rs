//! The last step of a job's path: FINISH, which records the outcome the way Resque does
//! and releases the job's locks and holds; kept pending to travel with the next RESERVE, and
//! parked when Redis refuses it (E-3).

use super::retry::{retry, GaveUp};
use super::{Control, StopReason, Worker};
use crate::config::plans::RenderedPlan;
use crate::locks::LockSpec;
use crate::store::{self, Finish, FinishHolds, FinishRequest, UniqueEntry};
use std::time::{Duration, Instant, SystemTime};
use tracing::{error, info, warn};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::worker";

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn finish_job(
        &mut self,
        rid: &str,
        queue: &str,
        token: &str,
        locks: &[LockSpec],
        payload: &str,
        result: crate::handler::HandlerResult,
        class: &str,
        started: Instant,
        holds: Option<(&str, &RenderedPlan)>,
        unique: Option<(&UniqueEntry, bool)>,
    ) -> Option<StopReason> {
        let release = holds
            .map(|(_, r)| r.releases(result.is_ok()))
            .unwrap_or_default();
        let fh = FinishHolds {
            class,
            digest: holds.map(|(d, _)| d).unwrap_or(""),
            release: &release,
            resent: false,
            unique: "",
        };
        // U-2..U-4: the entry is compared with the job's digest, which an unstarted job's
        // FINISH is not given otherwise.
        let fh = match (unique, holds) {
            (Some((u, _)), None) => FinishHolds {
                digest: &u.digest,
                ..fh
            },
            _ => fh,
        };
        // Ends that go back to the queue, recorded nowhere: exit 75 (EX_TEMPFAIL) to the tail,
        // the lock released in the same FINISH so the next run of this key starts without
        // overlap; a job a persistent handler never started (H-9, no code of it ran) to the
        // head.
        // RL-4: the remote side throttled the run: the class's first rate key is closed and
        // the job waits at the head of its line; not a failure (no record, no hooks).
        let rate = holds.and_then(|(_, r)| r.rates.first());
        if let (Err(f), Some(rate)) = (&result, rate) {
            if f.exception == crate::handler::THROTTLED {
                let retry_after = crate::handler::throttled_retry_after(f).unwrap_or(rate.period);
                info!(target: LOG_TARGET, queue = %queue, class = %class, rate = %rate.key, retry_after_s = retry_after.as_secs_f64(), "job throttled by the remote side: its rate key is closed until then");
                let outcome = Finish::Throttled {
                    rate: rate.clone(),
                    retry_after,
                };
                return self
                    .finish_outcome(
                        rid,
                        queue,
                        token,
                        locks,
                        outcome,
                        class,
                        started,
                        "throttled",
                        &fh,
                        unique,
                    )
                    .await;
            }
        }
        let back = result.as_ref().err().and_then(|f| {
            if f.exception == crate::handler::RESCHEDULE || f.exception == crate::handler::THROTTLED
            {
                Some((
                    Finish::Requeue,
                    "rescheduled",
                    "job asked to be rescheduled (exit 75)",
                ))
            } else if f.exception == crate::handler::persistent::NOT_STARTED {
                Some((
                    Finish::Return,
                    "returned",
                    "handler did not start the job: back to the head of its queue",
                ))
            } else {
                None
            }
        });
        if let Some((outcome, label, message)) = back {
            info!(target: LOG_TARGET, queue = %queue, class = %class, "{message}");
            return self
                .finish_outcome(
                    rid, queue, token, locks, outcome, class, started, label, &fh, unique,
                )
                .await;
        }
        let (outcome, label) = match &result {
            Ok(()) => (Finish::Success, "success"),
            Err(f) => {
                // H-17: a failure the app recorded through its own backend gets no second
                // record; FINISH still counts it.
                let record = if f.recorded {
                    String::new()
                } else {
                    f.record(payload, &self.id.worker_id, queue, SystemTime::now())
                };
                if f.dirty {
                    (Finish::Dirty(record), "killed")
                } else {
                    (Finish::Failure(record), "failed")
                }
            }
        };
        if let Err(f) = &result {
            warn!(target: LOG_TARGET, queue = %queue, class = %class, exception = %f.exception, error = %f.error, recorded_by_app = f.recorded, "job failed");
        }
        self.finish_outcome(
            rid, queue, token, locks, outcome, class, started, label, &fh, unique,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn finish_outcome(
        &mut self,
        rid: &str,
        queue: &str,
        token: &str,
        locks: &[LockSpec],
        outcome: Finish,
        class: &str,
        started: Instant,
        label: &str,
        holds: &FinishHolds<'_>,
        unique: Option<(&UniqueEntry, bool)>,
    ) -> Option<StopReason> {
        // Recorded with the next RESERVE (one round trip for both), or flushed on its own
        // before the loop waits or stops.
        if let Some(r) = self.flush_pending().await {
            return Some(r);
        }
        let unique = unique
            .map(|(u, started)| u.finish_arg(&outcome, started))
            .unwrap_or_default();
        self.pending = Some(PendingFinish {
            unique,
            rid: rid.to_string(),
            queue: queue.to_string(),
            token: token.to_string(),
            locks: locks.to_vec(),
            outcome,
            class: class.to_string(),
            digest: holds.digest.to_string(),
            release: holds.release.to_vec(),
            started,
            label: label.to_string(),
            tried: false,
            parked_until: None,
        });
        None
    }

    /// Records the pending job end on its own (FINISH), retrying while Redis is away; it must
    /// land even while shutting down. `Some` when it could not be recorded.
    pub(super) async fn flush_pending(&mut self) -> Option<StopReason> {
        let p = self.pending.take()?;
        let slot = self.slot();
        let req = p.request(self.config.failure_backend);
        let holds = p.holds();
        // A fresh control that is never cancelled keeps retrying, bounded by retry()'s own
        // deadline.
        let never = Control::default();
        // Every attempt after the first is a resend: the one before may have landed.
        let mut resent = holds.resent;
        let done = retry(&mut self.conn.clone(), "finish", &never, |mut c| {
            let (slot, req) = (slot.clone(), req.clone());
            let holds = FinishHolds {
                resent,
                ..holds.clone()
            };
            resent = true;
            async move { store::finish_with(&mut c, &slot, &req, &holds).await }
        })
        .await;
        match done {
            Ok(found) => {
                self.report_finish(&p, Some(found), p.tried);
                None
            }
            Err(GaveUp::Away) => {
                self.report_finish(&p, None, p.tried);
                Some(StopReason::PresumedDead)
            }
            Err(GaveUp::Refused(why)) => {
                // E-3: FINISH changed nothing (S-6), so the job stays in its inflight record,
                // its locks and holds kept. The slot parks: it reserves nothing (its record is
                // taken, K-2) and tries the FINISH again every PARK_RETRY, silently, until the
                // operator has mended the key the log names. The record says so for `status`.
                if p.parked_until.is_none() {
                    error!(target: LOG_TARGET, queue = %p.queue, class = %p.class, outcome = %p.label, retry_s = PARK_RETRY.as_secs(), "the job's end was refused by Redis; the job stays in its inflight record and the slot is parked, trying again periodically");
                    let at = crate::resque::time::run_at(SystemTime::now());
                    if let Err(e) =
                        store::park(&mut self.conn.clone(), &slot, &p.rid, &at, &why).await
                    {
                        warn!(target: LOG_TARGET, error = %e, "could not mark the inflight record as parked");
                    }
                }
                let mut p = p;
                p.parked_until = Some(Instant::now() + PARK_RETRY);
                self.pending = Some(p);
                None
            }
        }
    }

    /// Logs and counts a job end once its FINISH ran (`Some(found its reservation)`) or gave up.
    /// `retried`: an earlier attempt may have landed, so a missing reservation is no surprise.
    pub(super) fn report_finish(&mut self, p: &PendingFinish, done: Option<bool>, retried: bool) {
        let (queue, class, label) = (&p.queue, &p.class, p.label.as_str());
        let elapsed = p.started.elapsed().as_secs_f64();
        if done.is_some() {
            self.metrics.job_finished(
                queue,
                class,
                crate::metrics::Outcome::from_label(label),
                p.started.elapsed(),
            );
        }
        match done {
            Some(true) => {
                info!(target: LOG_TARGET, queue = %queue, class = %class, worker = %self.id.worker_id, elapsed, outcome = label, "job finished");
            }
            Some(false) if retried => {
                info!(target: LOG_TARGET, queue = %queue, class = %class, worker = %self.id.worker_id, elapsed, outcome = label, "job finished (recorded by an attempt whose reply was lost)");
            }
            Some(false) => {
                error!(target: LOG_TARGET, queue = %queue, class = %class, elapsed, outcome = label, "job finished after its reservation was recovered elsewhere; nothing recorded twice");
            }
            None => {
                error!(target: LOG_TARGET, queue = %queue, class = %class, "could not record the job's end; its inflight record is left for recovery");
            }
        }
    }
}

/// A job's end, waiting for its FINISH.
#[derive(Debug)]
pub(super) struct PendingFinish {
    pub(super) rid: String,
    pub(super) queue: String,
    pub(super) token: String,
    pub(super) locks: Vec<LockSpec>,
    pub(super) outcome: Finish,
    pub(super) class: String,
    pub(super) digest: String,
    pub(super) release: Vec<String>,
    /// FINISH's ARGV for the job's unique entry (U-2..U-4), `""` for nothing.
    pub(super) unique: String,
    pub(super) started: Instant,
    pub(super) label: String,
    /// A FINISH+RESERVE carrying it failed: it may have landed.
    pub(super) tried: bool,
    /// Redis refused its FINISH (E-3): the slot is parked and tries again at this time.
    pub(super) parked_until: Option<Instant>,
}

impl PendingFinish {
    pub(super) fn request(
        &self,
        backend: crate::resque::failure::FailureBackend,
    ) -> FinishRequest<'_> {
        FinishRequest {
            rid: &self.rid,
            token: &self.token,
            queue: &self.queue,
            locks: &self.locks,
            outcome: &self.outcome,
            backend,
        }
    }

    pub(super) fn holds(&self) -> FinishHolds<'_> {
        FinishHolds {
            class: &self.class,
            digest: &self.digest,
            release: &self.release,
            resent: self.tried,
            unique: &self.unique,
        }
    }
}

/// How long a parked slot waits before it sends a refused FINISH again (E-3).
const PARK_RETRY: Duration = Duration::from_secs(30);
