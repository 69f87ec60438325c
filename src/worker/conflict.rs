//! What a conflict can lead to for one reserved job (locking-semantics.md §6): the setup worked
//! out once before ACQUIRE, ACQUIRE's options, and the O-1 log line of a settled conflict. The
//! job's path itself is `job.rs`.

use super::job::Planned;
use super::Worker;
use crate::locks::Policy;
use crate::resque::failure::JobFailure;
use crate::store::{self, AcquireOptions, Settled};
use std::time::SystemTime;
use tracing::{debug, info, warn};

/// The target of this file's log lines, as in `job.rs`.
const LOG_TARGET: &str = "locketd::worker";

impl Worker {
    /// What a conflict can lead to for this job (§6), worked out once before ACQUIRE.
    pub(super) fn conflict_setup(&self, p: &Planned) -> ConflictSetup {
        let (plan, rendered) = (p.plan(), &p.rendered);
        // The plain path (requeue policy, no holds, no fencing) sends no options at all.
        let plain = plan.on_conflict == Policy::Requeue
            && p.unique.is_none()
            && !plan.has_dependencies()
            && rendered.rates.is_empty()
            && !plan.fencing
            && rendered
                .lock_sources
                .iter()
                .zip(&rendered.locks)
                .all(|(s, l)| *s == l.id);
        // The policies this job can meet: the dependency policy only with locked_by, the lock
        // policy only with locks, wait_then only after a wait.
        let mut policies = Vec::with_capacity(3);
        if !rendered.locks.is_empty() {
            policies.push(plan.on_conflict);
        }
        if !rendered.locked_by.is_empty() {
            policies.push(plan.on_dependency_conflict);
        }
        let waits = policies.contains(&Policy::Wait);
        if waits {
            policies.push(plan.wait_then);
        }
        // PK-7: a full parked list settles the job by on_park_full.
        if policies.contains(&Policy::Park) {
            policies.push(plan.on_park_full);
        }
        let delay_possible = policies.contains(&Policy::Delay);
        let failure_record =
            if policies.contains(&Policy::Fail) || (delay_possible && plan.delay.max_delays > 0) {
                Some(
                    JobFailure::new("Locket::LockConflict", "__LOCKET_CONFLICT__").record(
                        &p.job.raw,
                        &self.id.worker_id,
                        &p.queue,
                        SystemTime::now(),
                    ),
                )
            } else {
                None
            };
        let jitter: f64 = if plan.delay.jitter > 0.0 {
            rand::random::<f64>() * plan.delay.jitter
        } else {
            0.0
        };
        ConflictSetup {
            plain,
            waits,
            delay_possible,
            failure_record,
            jitter,
        }
    }

    /// ACQUIRE's options for this job (A-6..A-9, §6), borrowed from its plan.
    pub(super) fn acquire_options<'p>(
        &self,
        p: &'p Planned,
        setup: &'p ConflictSetup,
    ) -> AcquireOptions<'p> {
        let plan = p.plan();
        AcquireOptions {
            on_lock_conflict: plan.on_conflict,
            on_dep_conflict: plan.on_dependency_conflict,
            locked_by: &p.rendered.locked_by,
            enqueue_holds: &p.rendered.enqueue_holds,
            start_holds: &p.rendered.start_holds,
            hold_ttl: plan.hold_ttl,
            fencing: plan.fencing,
            sources: &p.rendered.lock_sources,
            delay: setup.delay_possible.then_some((plan.delay, setup.jitter)),
            failure_record: setup.failure_record.as_deref(),
            backend: self.config.failure_backend,
            last_wait: false,
            max_parked: plan.max_parked,
            on_park_full: plan.on_park_full,
            rates: &p.rendered.rates,
            unique: p.unique.as_ref(),
        }
    }

    /// Logs a conflict the way O-1 says: requeues at debug, discards, delays and wait
    /// timeouts at info, conflict failures at warn.
    pub(super) fn log_conflict(
        &self,
        class: &str,
        queue: &str,
        digest: &str,
        action: &Settled,
        conflicts: &[store::Conflict],
        counted_wait: bool,
    ) {
        let resources: Vec<String> = conflicts
            .iter()
            .map(|c| format!("{}:{} ({}/{})", c.kind.word(), c.id, c.holders, c.limit))
            .collect();
        let lock_id = conflicts.first().map(|c| c.id.as_str()).unwrap_or("");
        let digest = &digest[..12.min(digest.len())];
        let counted = match action {
            Settled::None if counted_wait => None,
            Settled::None => Some("wait"),
            Settled::Requeued => Some("requeue"),
            Settled::Parked => Some("park"),
            Settled::Discarded => Some("discard"),
            Settled::Delayed { .. } => Some("delay"),
            Settled::Failed { .. } => Some("fail"),
        };
        if let Some(action) = counted {
            self.metrics.lock_conflict(action);
        }
        match action {
            Settled::Parked => {
                debug!(target: LOG_TARGET, queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, "lock conflict: job parked")
            }
            Settled::Requeued | Settled::None => {
                debug!(target: LOG_TARGET, queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, action = ?action, "lock conflict: job requeued")
            }
            Settled::Discarded => {
                info!(target: LOG_TARGET, queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, "lock conflict: job discarded")
            }
            Settled::Delayed { due_ms, attempt } => {
                info!(target: LOG_TARGET, queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, attempt, due_ms, "lock conflict: job delayed")
            }
            Settled::Failed { attempt } => {
                warn!(target: LOG_TARGET, queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, attempt, "lock conflict: job failed as Locket::LockConflict")
            }
        }
    }
}

/// What a conflict can lead to for one job.
pub(super) struct ConflictSetup {
    /// Requeue policy, no holds, no fencing: ACQUIRE is sent without options.
    pub(super) plain: bool,
    /// A `wait` policy applies (P-3).
    pub(super) waits: bool,
    /// A `delay` policy applies (P-4).
    pub(super) delay_possible: bool,
    /// The failure record a `fail` (or an exhausted `delay`) pushes, prepared in advance.
    pub(super) failure_record: Option<String>,
    /// This attempt's jitter draw for `delay`.
    pub(super) jitter: f64,
}
