//! H-17: failures recorded by the app's own failure backend. A handler whose `ready` has the
//! `failure_backend` feature records its jobs' failures itself (`done` says `recorded`). For a
//! job whose handler was killed or died, the H-14 `failure_hooks` request asks the fresh
//! process to record the failure too; that process is booted before the job's FINISH (not in
//! the background), so FINISH knows whether the app kept the record. When it cannot start, or
//! does not answer that it recorded, locketd records the failure itself and the request goes
//! out later with `record: false` (hooks only).

use super::*;
use std::sync::atomic::Ordering;

impl Parts {
    /// After a kill (H-11) or a death (H-10): the fresh process now, when a queued request
    /// asks it to record a failure; otherwise in the background, as before.
    pub(super) async fn replace_and_record(&self, mut slot: OwnedMutexGuard<Slot>) {
        self.shared.record_pending.store(false, Ordering::SeqCst);
        if slot.proc.is_some()
            || self.shared.stopping.is_cancelled()
            || !slot.hooks.iter().any(|h| h.record)
        {
            self.replace_later(slot);
            return;
        }
        // boot() sends the queued requests once the process is ready.
        if let Err(why) = self.boot(&mut slot).await {
            debug!(target: LOG_TARGET, handler = %self.spec.name, error = %why, "no fresh handler to record the killed job's failure; locketd records it");
        }
        // Any request still queued goes out later for its hooks only: locketd records it.
        for h in &mut slot.hooks {
            h.record = false;
        }
    }

    /// `after_run` of a run that was not stopped: a handler that died during it left a
    /// failure for its fresh process to record.
    pub(super) async fn record_if_pending(&self) {
        if !self.shared.record_pending.load(Ordering::SeqCst) {
            return;
        }
        let slot = self.slot.clone().lock_owned().await;
        self.replace_and_record(slot).await;
    }
}
