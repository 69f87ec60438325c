//! Jobs processed and failed per minute. Resque keeps only their totals (`stat:processed`,
//! `stat:failed`, counted by every worker of the namespace), so the listener samples them every
//! [`EVERY`] and keeps the last value seen in each of the last 61 minutes; a minute's count is
//! the difference to the minute before. The series start when the daemon (or its listener)
//! started.

use crate::config::Config;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

/// How often the totals are read.
pub const EVERY: Duration = Duration::from_secs(10);

/// Minutes kept: an hour of differences.
const KEPT: usize = 61;

/// The last totals seen per minute: (epoch minute, processed, failed), oldest first.
#[derive(Debug, Default)]
pub struct Minutes {
    seen: Mutex<VecDeque<(u64, u64, u64)>>,
}

impl Minutes {
    /// Reads the totals once (bounded at 2 s; a failed read records nothing).
    pub async fn sample<C: ConnectionLike + Send>(&self, conn: &mut C, config: &Config) {
        let k = Keys::new(&config.namespace);
        let read = async {
            redis::pipe()
                .cmd("TIME")
                .get(k.stat_processed())
                .get(k.stat_failed())
                .query_async::<((u64, u64), Option<String>, Option<String>)>(conn)
                .await
        };
        if let Ok(Ok(((now, _), p, f))) = tokio::time::timeout(Duration::from_secs(2), read).await {
            let n = |v: Option<String>| v.and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0);
            self.record(now / 60, n(p), n(f));
        }
    }

    /// Records the totals seen in `minute`.
    pub fn record(&self, minute: u64, processed: u64, failed: u64) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.back_mut() {
            Some(last) if last.0 == minute => *last = (minute, processed, failed),
            Some(last) if last.0 > minute => {}
            _ => seen.push_back((minute, processed, failed)),
        }
        while seen.len() > KEPT {
            seen.pop_front();
        }
    }

    /// Processed and failed per minute for the `n` minutes from `first`; None where the
    /// minute or the one before it was not seen.
    pub fn per_minute(&self, first: u64, n: u64) -> (Vec<Option<i64>>, Vec<Option<i64>>) {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let at = |m: u64| seen.iter().find(|s| s.0 == m).copied();
        let mut processed = Vec::new();
        let mut failed = Vec::new();
        for m in first..first + n {
            let d = match (m.checked_sub(1).and_then(at), at(m)) {
                (Some(a), Some(b)) => Some((b.1 as i64 - a.1 as i64, b.2 as i64 - a.2 as i64)),
                _ => None,
            };
            // A total that went down (FLUSHDB, a reset) counts as nothing, not as negative.
            processed.push(d.map(|d| d.0.max(0)));
            failed.push(d.map(|d| d.1.max(0)));
        }
        (processed, failed)
    }

    /// The first minute seen, if any.
    pub fn since(&self) -> Option<u64> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.front().map(|s| s.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Minutes;

    #[test]
    fn a_minute_counts_the_difference_to_the_one_before() {
        let m = Minutes::default();
        m.record(100, 10, 1);
        m.record(101, 12, 1);
        m.record(101, 15, 2);
        m.record(103, 20, 2);
        m.record(102, 99, 9); // late: ignored
        let (p, f) = m.per_minute(100, 4);
        assert_eq!(p, vec![None, Some(5), None, None]);
        assert_eq!(f, vec![None, Some(1), None, None]);
        for i in 104..200 {
            m.record(i, i, 0);
        }
        assert_eq!(m.since(), Some(200 - 61));
        assert_eq!(m.per_minute(198, 2).0, vec![Some(1), Some(1)]);
    }
}
