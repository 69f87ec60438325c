//! Unique entries that follow their job (locking-semantics.md U-2..U-4): what the worker sends
//! to ACQUIRE and FINISH about a job's `<ns>:locket:unique:<key>` entry. The Lua side is
//! `lua/lib_unique.lua`.

use super::Finish;
use crate::config::plans::UniquePolicy;
use crate::resque::keys::Keys;
use std::time::Duration;

/// One job's unique entry: its key, its class's policy and the backstop lifetime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UniqueEntry {
    /// The full key, `<ns>:locket:unique:<rendered unique_key>`.
    pub key: String,
    /// `until_executing` or `until_executed` (`until_expired` never follows a job).
    pub policy: UniquePolicy,
    /// The backstop lifetime in ms, 0 for none.
    pub ttl_ms: u64,
    /// The job's digest: the entry's value when the job placed it.
    pub digest: String,
}

impl UniqueEntry {
    /// The entry of a rendered `unique_key` (RenderedPlan::unique).
    pub fn new(
        keys: &Keys,
        rendered: &str,
        policy: UniquePolicy,
        ttl: Option<Duration>,
        digest: &str,
    ) -> Self {
        UniqueEntry {
            digest: digest.to_string(),
            key: keys.locket(&format!("unique:{rendered}")),
            policy,
            ttl_ms: ttl.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// The spec ACQUIRE records: `[key, policy, ttl_ms]`.
    pub fn spec(&self) -> serde_json::Value {
        serde_json::json!([self.key, self.policy.word(), self.ttl_ms])
    }

    /// What FINISH does with the entry (U-3's table), as its ARGV[12]: `""` when nothing, else
    /// `[action, key, policy, ttl_ms]`. `started`: ACQUIRE started the job (an
    /// `until_executing` entry is then already gone, and one that is there belongs to a
    /// duplicate pushed since, which a release of the same digest must not take).
    pub fn finish_arg(&self, outcome: &Finish, started: bool) -> String {
        let action = match outcome {
            // The job waits again.
            Finish::Requeue | Finish::Return | Finish::Throttled { .. } => "replace",
            // It ended: an until_executed entry ends with it; an until_executing one ended
            // at its start, unless it never started (failed or cancelled before it).
            Finish::Success | Finish::Failure(_) | Finish::Dirty(_) => {
                if self.policy == UniquePolicy::UntilExecuting && started {
                    return String::new();
                }
                "release"
            }
        };
        serde_json::json!([action, self.key, self.policy.word(), self.ttl_ms]).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(policy: UniquePolicy) -> UniqueEntry {
        UniqueEntry {
            key: "ns:locket:unique:k".into(),
            policy,
            ttl_ms: 0,
            digest: "d".into(),
        }
    }

    // locking-semantics.md U-3: the step table's FINISH rows.
    #[test]
    fn finish_settles_the_entry_by_policy_outcome_and_start() {
        let ing = entry(UniquePolicy::UntilExecuting);
        let ed = entry(UniquePolicy::UntilExecuted);
        let action = |e: &UniqueEntry, o: Finish, started: bool| {
            let a = e.finish_arg(&o, started);
            if a.is_empty() {
                return String::new();
            }
            serde_json::from_str::<serde_json::Value>(&a).unwrap()[0]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(action(&ing, Finish::Success, true), "");
        assert_eq!(action(&ing, Finish::Failure(String::new()), true), "");
        assert_eq!(
            action(&ing, Finish::Failure(String::new()), false),
            "release"
        );
        assert_eq!(action(&ing, Finish::Requeue, true), "replace");
        assert_eq!(action(&ing, Finish::Return, true), "replace");
        assert_eq!(action(&ed, Finish::Success, true), "release");
        assert_eq!(action(&ed, Finish::Dirty(String::new()), true), "release");
        assert_eq!(
            action(&ed, Finish::Failure(String::new()), false),
            "release"
        );
        assert_eq!(action(&ed, Finish::Requeue, true), "replace");
    }
}
