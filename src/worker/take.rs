//! TAKE on the worker's side (locking-semantics.md A-7a): whether the next RESERVE goes out as
//! TAKE (RESERVE and the job's ACQUIRE+START in one call), the call itself with the slot's
//! pending FINISH, what the worker does with the jobs TAKE settled away, and with the job TAKE
//! answered for (`taken`, `unstarted`; the rest of its path is `job.rs`'s `process`).

use super::job::{Acquire, Planned, Unstarted};
use super::reserve::Next;
use super::{Control, StopReason, Worker};
use crate::resque::failure;
use crate::store::{self, random_hex, AcquireOutcome, ReserveFlags, Reserved, TakeArgs, Taken};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

/// The target of this file's log lines (the job path's).
const LOG_TARGET: &str = "locketd::worker";

/// Reservations one TAKE may make: the slot's, and one more for each job before it that its
/// class's policy settled away (parked, requeued, discarded), so a backlog of locked jobs is
/// passed over eight at a time.
pub(super) const TAKE_RIDS: usize = 8;

/// The process's take plan and whether Redis holds it (shared by a process's slots).
#[derive(Debug)]
pub(super) struct TakeState {
    pub(super) plan: store::TakePlan,
    /// Written to Redis; cleared when TAKE finds it gone (it is written again).
    pub(super) published: AtomicBool,
    /// TAKE was refused by Redis (a script error): the slots send the two calls from then on.
    pub(super) refused: AtomicBool,
    /// The multi-slot mode's choice: TAKE now, or the two calls ([`take_fits`]).
    pub(super) batch_take: AtomicBool,
}

/// Whether a multi-slot process sends TAKE now (`on`: it did so far), given the mean calls per
/// batch of its connection (`fill`, src/store/batch.rs) and its number of slots.
///
/// A TAKE saves a job one round trip and costs Redis more CPU than the two calls it replaces
/// (its render and plan in Lua, and its ACQUIRE's reads are not in the batch's MGET). While
/// batches run nearly full, the slots are waiting on Redis and the two calls drain faster
/// (`noop --workers 2 --slots 4|8|32` ran at 0.80-0.88 of their jobs/s under TAKE); while they
/// carry one or two calls, each job's own path (a persistent handler's frames and process
/// switches) is the longer wait, and the round trip saved is the gain (`ruby --workers 2
/// --slots 4|8`; docs/dev/performance-log.md, issue 40, fourth session). Between half and three
/// quarters of the slots the choice stays as it was, so that it does not flip batch to batch.
pub(super) fn take_fits(on: bool, fill: f64, slots: u32) -> bool {
    let slots = f64::from(slots.max(1));
    if on {
        fill <= slots * 0.75
    } else {
        fill < slots * 0.5
    }
}

/// The job TAKE left in the slot, with what the worker needs to go on from there.
#[derive(Debug)]
pub(super) struct Took {
    pub(super) taken: Taken,
    /// The lock token TAKE was given.
    pub(super) token: String,
    /// When TAKE was sent (L-9's `t` for a job it started).
    pub(super) sent_at: Instant,
}

impl Worker {
    /// The take plan of this worker's config and handlers (None when TAKE is off).
    pub(super) fn take_state(&self) -> Option<Arc<TakeState>> {
        if !self.config.locket.one_call_take || self.lock_queues.is_some() {
            return None;
        }
        let handled: Vec<&str> = self.handlers.classes().collect();
        let fallback = self.handlers.has_fallback();
        let plan = store::TakePlan::new(&self.keys, &self.plans, &handled, fallback);
        if !plan.takes_any() {
            return None;
        }
        Some(Arc::new(TakeState {
            plan,
            published: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            batch_take: AtomicBool::new(true),
        }))
    }

    /// Whether the next RESERVE goes out as TAKE: it is on, its plan is in Redis (written now
    /// if it is not), and every handler of the slot is ready now (H-8). A TAKE whose reply was
    /// lost is always sent again as TAKE.
    async fn take_ready(&mut self) -> bool {
        let Some(t) = self.take.clone() else {
            return false;
        };
        if self.take_resend.is_some() {
            return true;
        }
        if t.refused.load(Ordering::Relaxed) {
            return false;
        }
        if self.multi {
            let on = t.batch_take.load(Ordering::Relaxed);
            let fits = take_fits(on, self.conn.batch_fill(), self.config.slots);
            if fits != on {
                t.batch_take.store(fits, Ordering::Relaxed);
            }
            if !fits {
                return false;
            }
        }
        if !self.take_handlers.iter().all(|h| h.ready_now()) {
            return false;
        }
        if !t.published.load(Ordering::Relaxed) {
            let mut conn = self.conn.manager().clone();
            match store::publish_take_plan(&mut conn, &t.plan).await {
                Ok(()) => t.published.store(true, Ordering::Relaxed),
                Err(e) => {
                    warn!(target: LOG_TARGET, error = %e, key = %t.plan.key, "could not write the take plan: jobs are reserved and locked in two calls until it is written");
                    return false;
                }
            }
        }
        true
    }

    /// RESERVE as TAKE, with the slot's pending FINISH; `None` when TAKE is not sent now.
    pub(super) async fn take_next(
        &mut self,
        rid: String,
        queues: &[String],
        flags: ReserveFlags,
        sent: Instant,
    ) -> Option<Next<(redis::RedisResult<Reserved>, Option<Took>)>> {
        if !self.take_ready().await {
            return None;
        }
        let (rid, token, resent) = match self.take_resend.take() {
            Some((rid, token)) => (rid, token, true),
            None => (rid, random_hex(16), false),
        };
        let t = self.take.clone()?;
        // The slot's identity does not change job to job: its texts are made once.
        if self
            .take_texts
            .as_ref()
            .is_none_or(|(w, _, _)| *w != self.id.worker_id)
        {
            let node_worker = serde_json::to_string(failure::node_worker_name(&self.id.worker_id))
                .unwrap_or_default();
            let head = self.id.lockinfo_head();
            self.take_texts = Some((self.id.worker_id.clone(), head, node_worker));
        }
        let (_, head, node_worker) = self.take_texts.as_ref()?;
        let lt = &self.config.locket;
        let run_at = crate::resque::time::run_at(SystemTime::now());
        let args = TakeArgs {
            plan_key: &t.plan.key,
            token: &token,
            lock_ttl: lt.lock_ttl.get(),
            counter_ttl: lt.counter_ttl.get(),
            lockinfo_head: head,
            run_at: &run_at,
            node_worker,
            max_payload: self.config.max_payload_bytes,
            resent,
            rid: &rid,
            reservations: TAKE_RIDS,
        };
        let mut pending = self.pending.take();
        let slot = self.slot();
        let backend = self.config.failure_backend;
        let took = {
            let fin = pending.as_ref().map(|p| (p.request(backend), p.holds()));
            let fin = fin.as_ref().map(|(r, h)| (r, h));
            store::take(&mut self.conn.clone(), &slot, fin, queues, flags, &args).await
        };
        match took {
            Ok(reply) => {
                if let Some(p) = &pending {
                    self.report_finish(p, reply.finished, p.tried);
                }
                self.note_guard_look(flags, sent, &reply.reserved);
                for s in &reply.settled {
                    self.settled_away(s);
                }
                if let Some(Taken::Kept(why)) = &reply.taken {
                    if why == "no_plan" {
                        // Gone from Redis (expired, deleted): written again before the next.
                        t.published.store(false, Ordering::Relaxed);
                    }
                }
                let took = reply.taken.map(|taken| Took {
                    taken,
                    token,
                    sent_at: sent,
                });
                Some(Next::Go((reply.reserved, took)))
            }
            Err(e) if crate::conn::is_refusal(&e) => {
                // A deterministic refusal is not sent again: the slots go back to the two
                // calls, which report what Redis refuses in their own steps (E-3).
                error!(target: LOG_TARGET, error = %e, "Redis refused TAKE; reserving and locking in two calls from now on");
                t.refused.store(true, Ordering::Relaxed);
                self.pending = pending;
                Some(Next::Again)
            }
            Err(e) => {
                // It may have landed: sent again with the same rids and token, which finds
                // what it reserved or started (take.lua), and the FINISH marked as a resend.
                if let Some(p) = pending.as_mut() {
                    p.tried = true;
                }
                self.pending = pending;
                self.take_resend = Some((rid, token));
                Some(Next::Go((Err(e), None)))
            }
        }
    }

    /// A job TAKE reserved and settled away by its class's policy: counted and logged as
    /// ACQUIRE's conflicts are (O-1).
    fn settled_away(&mut self, s: &store::SettledAway) {
        self.metrics.take("one_call");
        if let AcquireOutcome::Conflict { action, conflicts } = &s.outcome {
            self.log_conflict(&s.class, &s.queue, &s.digest, action, conflicts, false);
        }
    }
}

impl Worker {
    /// A job TAKE answered for (A-7a): one it started runs once its handler says it is ready
    /// (H-8: TAKE was sent because every handler was ready now; one that is not any more has
    /// the job put back at the tail of its queue, its locks released, by FINISH); any other
    /// answer is ACQUIRE's, settled as `settle` does.
    pub(super) async fn taken(
        &mut self,
        p: &Planned,
        outcome: AcquireOutcome,
        sent_at: Instant,
        control: &Control,
        dead: &CancellationToken,
    ) -> Acquire {
        let AcquireOutcome::Started { fences, .. } = outcome else {
            return self
                .settle(p, Some(outcome), sent_at, false, false, dead)
                .await;
        };
        let readiness = tokio::select! {
            r = p.handler.prepare() => r,
            _ = control.quit.cancelled() => crate::handler::Readiness::NotReady {
                until: Instant::now(),
                why: "the worker is stopping".into(),
            },
            _ = dead.cancelled() => return Acquire::Ended(Some(StopReason::PresumedDead)),
        };
        if let crate::handler::Readiness::NotReady { why, .. } = readiness {
            warn!(target: LOG_TARGET, queue = %p.queue, class = %p.job.class, why = %why, "handler not ready for a job TAKE started: job put back at the tail of its queue");
            self.metrics.lock_conflict("deferred");
            return Acquire::Ended(self.requeue_started(p).await);
        }
        Acquire::Started { fences, sent_at }
    }

    /// A reserved job that cannot start (E-1, E-2): failed as it is. One TAKE started anyway
    /// (its Lua renderer took what the worker's refuses: a bug, logged) has its locks released
    /// by the same FINISH.
    pub(super) async fn unstarted(
        &mut self,
        u: Unstarted,
        took: Option<Took>,
        started: Instant,
    ) -> Option<StopReason> {
        let unique = u.unique.as_ref();
        let (mut token, mut locks) = (String::new(), Vec::new());
        if let Some(Took {
            taken: Taken::Acquired {
                outcome, locks: l, ..
            },
            token: t,
            ..
        }) = took
        {
            match outcome {
                AcquireOutcome::Started { .. } => {
                    error!(target: LOG_TARGET, queue = %u.queue, class = %u.class, "TAKE started a job the worker cannot run; failing it and releasing its locks");
                    (token, locks) = (t, l);
                }
                AcquireOutcome::Conflict { .. } | AcquireOutcome::Missing => {
                    // Settled away by its policy, or no longer this slot's: nothing to record.
                    return None;
                }
                AcquireOutcome::Dead => return Some(StopReason::PresumedDead),
                AcquireOutcome::Cancelled(_) => {}
            }
        }
        self.finish_job(
            &u.rid,
            &u.queue,
            &token,
            &locks,
            &u.raw,
            Err(u.failure),
            &u.class,
            started,
            None,
            unique.map(|u| (u, false)),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::take_fits;

    #[test]
    fn multi_slot_take_follows_how_full_the_batches_run_with_a_dead_band() {
        // Four slots: batches of one or two calls (a slow handler per job) take; full ones do not.
        assert!(take_fits(true, 1.5, 4));
        assert!(take_fits(false, 1.5, 4));
        assert!(!take_fits(true, 3.5, 4));
        assert!(!take_fits(false, 3.5, 4));
        // Between half and three quarters of the slots, the choice made so far stands.
        assert!(take_fits(true, 2.5, 4));
        assert!(!take_fits(false, 2.5, 4));
        // A fresh connection (no batch yet) takes.
        assert!(take_fits(true, 0.0, 32));
        assert!(!take_fits(true, 31.0, 32));
    }
}
