//! H-18: the bound on returning a job because another job's stop killed its process.

use super::{NoStarts, NO_STARTS_KEPT};
use std::collections::VecDeque;
use std::sync::Mutex;

/// How often one payload may go back to its queue because a sibling's stop killed its
/// process, before it is recorded as `Resque::DirtyExit` (H-18).
pub const MAX_SIBLING_RETURNS: u32 = 3;

/// The payloads (as hashes) returned because of a sibling's stop, with their counts, shared
/// by the slots of a worker; the oldest is forgotten past [`NO_STARTS_KEPT`].
#[derive(Debug, Default)]
pub(super) struct Returns(Mutex<VecDeque<(u64, u32)>>);

impl Returns {
    /// Books a return of `payload`: whether it is past [`MAX_SIBLING_RETURNS`] (then it is
    /// forgotten).
    pub(super) fn again(&self, payload: &str) -> bool {
        let h = NoStarts::hash(payload);
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = seen.iter().position(|x| x.0 == h) {
            seen[i].1 += 1;
            if seen[i].1 > MAX_SIBLING_RETURNS {
                seen.remove(i);
                return true;
            }
            return false;
        }
        if seen.len() == NO_STARTS_KEPT {
            seen.pop_front();
        }
        seen.push_back((h, 1));
        false
    }

    /// `payload` ran to its `done`: its count starts again.
    pub(super) fn forget(&self, payload: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.is_empty() {
            let h = NoStarts::hash(payload);
            seen.retain(|x| x.0 != h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Returns, MAX_SIBLING_RETURNS};

    #[test]
    fn a_payload_returned_past_the_bound_is_a_dirty_exit_and_a_done_resets_it() {
        let r = Returns::default();
        for _ in 0..MAX_SIBLING_RETURNS {
            assert!(!r.again("a"));
            assert!(!r.again("b"));
        }
        assert!(r.again("a"), "a's fourth return");
        assert!(!r.again("a"), "forgotten after it was recorded");
        r.forget("b");
        assert!(
            !r.again("b"),
            "b ran to its done in between: its count starts again"
        );
    }
}
