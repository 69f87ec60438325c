//! H-8 on the job's path: a job's handler gets ready (a persistent handler boots) before the
//! job's locks are taken, or the job is deferred to its queue.

use super::job::Planned;
use super::{Control, StopReason, Worker};
use crate::store;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error};

/// The target of this file's log lines (the job path's).
const LOG_TARGET: &str = "locketd::worker";

impl Worker {
    /// H-8: the job's handler gets ready (a persistent handler boots) before its locks are
    /// taken. One that cannot take it yet has it deferred: back to the tail of its queue with
    /// the queue's lock counter bumped, as a lock conflict's requeue, so a queue of such jobs is
    /// skipped and the other queues keep draining. `Some` ends the job's path here.
    pub(super) async fn prepare_handler(
        &mut self,
        p: &Planned,
        control: &Control,
        dead: &CancellationToken,
    ) -> Option<Option<StopReason>> {
        let readiness = tokio::select! {
            r = p.handler.prepare() => r,
            _ = control.quit.cancelled() => {
                self.return_job(&p.rid, &p.queue).await;
                return Some(Some(StopReason::Shutdown));
            }
            _ = dead.cancelled() => return Some(Some(StopReason::PresumedDead)),
        };
        let crate::handler::Readiness::NotReady { why, .. } = readiness else {
            return None;
        };
        debug!(target: LOG_TARGET, queue = %p.queue, class = %p.job.class, why = %why, "handler not ready: job deferred to the tail of its queue");
        self.metrics.lock_conflict("deferred");
        let slot = self.slot();
        let ttl = self.config.locket.counter_ttl.get();
        match store::move_back(&mut self.conn.clone(), &slot, &p.rid, &p.queue, Some(ttl)).await {
            // cancelled by an operator before it started: recorded as such instead.
            Ok(store::MovedBack::Cancelled(request)) => {
                let job = Some((p.job.raw.as_str(), p.job.class.as_str()));
                let stop = self.cancel_unstarted(&p.rid, &p.queue, job, p.started(), &request);
                return Some(stop.await);
            }
            Ok(_) => {}
            Err(e) => {
                error!(target: LOG_TARGET, step = "defer", queue = %p.queue, error = %e, "could not put a job whose handler is not ready back in its queue; it stays in its inflight record for recovery");
            }
        }
        Some(None)
    }
}
