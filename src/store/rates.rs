//! Keyed rate limits as an operator sees them (rate-limits.md RL-5): the keys in use, found by
//! SCAN (bounded; never KEYS) and through the parked index, and one key's state; and the
//! key's log as the scripts write it (`src/store/lua/rate.lua`).

use super::parked::parked_resources;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::BTreeSet;

/// Most rate keys listed.
const MAX_KEYS: usize = 10_000;

/// The rate keys in use: those with a log (starts or a back-off close; the ZSET of a limit
/// above [`RATE_STRING_MAX`]) or parked jobs (at most 10,000, sorted).
pub async fn rate_keys<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> RedisResult<Vec<String>> {
    let mut out = BTreeSet::new();
    for prefix in [keys.locket("ratelog:"), keys.locket("rate:")] {
        let mut cursor: u64 = 0;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(conn)
                .await?;
            out.extend(
                found
                    .into_iter()
                    .filter_map(|k| k.strip_prefix(&prefix).map(str::to_string)),
            );
            cursor = next;
            if cursor == 0 || out.len() >= MAX_KEYS {
                break;
            }
        }
    }
    for res in parked_resources(conn, keys, 100_000).await? {
        if let Some(k) = res.strip_prefix("rate:") {
            out.insert(k.to_string());
        }
    }
    Ok(out.into_iter().take(MAX_KEYS).collect())
}

/// One rate key's state at `now_ms` (Redis clock), for the limit and period given.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RateState {
    /// The key.
    pub key: String,
    /// Starts in the window now.
    pub used: u64,
    /// Starts allowed now.
    pub allowed_now: u64,
    /// When the next start is allowed (ms; now when one is).
    pub next_allowed_ms: u64,
    /// Closed by a handler's back-off until (ms), if it is (RL-4).
    pub closed_until_ms: Option<u64>,
    /// Jobs parked on the key.
    pub parked: u64,
    /// When the janitor looks at its parked jobs next (ms).
    pub parked_due_ms: Option<u64>,
}

pub use crate::config::rates::RATE_STRING_MAX;

/// The first byte of a rate log: its format (rate.lua).
pub const RATE_LOG_MAGIC: u8 = 0xB1;
/// The log's header: the format byte and the close (6 bytes).
const RATE_LOG_HEAD: usize = 7;

/// A rate key's log (rate.lua's `<prefix>ratelog:<key>`, one STRING): the close of a
/// handler's back-off (RL-4) and the starts, oldest first, by Redis's clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLog {
    /// Closed until (ms), 0 when it is not.
    pub closed_until_ms: u64,
    /// The starts (ms), oldest first.
    pub starts: Vec<u64>,
}

fn u48(b: &[u8]) -> u64 {
    b.iter().fold(0, |a, x| (a << 8) | u64::from(*x))
}

impl RateLog {
    /// Reads a log; None for bytes that are no log (another format or a length that is not
    /// a header and whole starts).
    pub fn parse(b: &[u8]) -> Option<RateLog> {
        if b.len() < RATE_LOG_HEAD
            || b[0] != RATE_LOG_MAGIC
            || !(b.len() - RATE_LOG_HEAD).is_multiple_of(6)
        {
            return None;
        }
        Some(RateLog {
            closed_until_ms: u48(&b[1..RATE_LOG_HEAD]),
            starts: b[RATE_LOG_HEAD..].chunks(6).map(u48).collect(),
        })
    }

    /// The log as the scripts write it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![RATE_LOG_MAGIC];
        for x in std::iter::once(self.closed_until_ms).chain(self.starts.iter().copied()) {
            out.extend_from_slice(&x.to_be_bytes()[2..]);
        }
        out
    }
}

/// The replies of [`rate_state`]'s reads: the log, the parked count and the index score.
type Reads = (Option<Vec<u8>>, Option<u64>, Option<f64>);

/// The replies of the ZSET reads of a limit above [`RATE_STRING_MAX`]: the window's count,
/// the `limit`-th newest and the newest start.
type ZsetReads = (Option<u64>, Vec<(String, f64)>, Vec<(String, f64)>);

/// Reads `key`'s state (three reads, pipelined; six for a limit above [`RATE_STRING_MAX`]).
/// A log of another type reads as none.
pub async fn rate_state<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    key: &str,
    limit: u32,
    period_ms: u64,
    spread: bool,
    now_ms: u64,
) -> RedisResult<RateState> {
    let (log, parked, due): Reads = redis::pipe()
        .cmd("GET")
        .arg(keys.locket(&format!("ratelog:{key}")))
        .cmd("LLEN")
        .arg(keys.locket(&format!("parked:rate:{key}")))
        .cmd("ZSCORE")
        .arg(keys.locket("parked"))
        .arg(format!("rate:{key}"))
        .ignore_errors()
        .query_async(conn)
        .await
        .unwrap_or_default();
    let log = log.as_deref().and_then(RateLog::parse).unwrap_or_default();
    let limit = u64::from(limit.max(1));
    let cut = now_ms.saturating_sub(period_ms);
    // The window's count, the limit-th newest start and the newest.
    let (used, nth, last) = if limit > u64::from(RATE_STRING_MAX) {
        let z = keys.locket(&format!("rate:{key}"));
        let l = limit as i64;
        let (used, nth, last): ZsetReads = redis::pipe()
            .cmd("ZCOUNT")
            .arg(&z)
            .arg(format!("({cut}"))
            .arg("+inf")
            .cmd("ZRANGE")
            .arg(&z)
            .arg(-l)
            .arg(-l)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(&z)
            .arg(-1)
            .arg(-1)
            .arg("WITHSCORES")
            .ignore_errors()
            .query_async(conn)
            .await
            .unwrap_or_default();
        (
            used.unwrap_or(0),
            nth.first().map(|(_, s)| *s as u64),
            last.first().map(|(_, s)| *s as u64),
        )
    } else {
        let n = log.starts.len() as u64;
        (
            log.starts.iter().filter(|s| **s > cut).count() as u64,
            (n >= limit).then(|| log.starts[(n - limit) as usize]),
            log.starts.last().copied(),
        )
    };
    let closed_until_ms = Some(log.closed_until_ms).filter(|c| *c > now_ms);
    let mut next = now_ms;
    if let Some(c) = closed_until_ms {
        next = next.max(c);
    }
    if let Some(s) = nth {
        next = next.max(s + period_ms);
    }
    if spread {
        if let Some(s) = last {
            next = next.max(s + period_ms.div_ceil(limit));
        }
    }
    let mut allowed_now = limit.saturating_sub(used);
    if next > now_ms {
        allowed_now = 0;
    } else if spread {
        allowed_now = allowed_now.min(1);
    }
    Ok(RateState {
        key: key.to_string(),
        used,
        allowed_now,
        next_allowed_ms: next,
        closed_until_ms,
        parked: parked.unwrap_or(0),
        parked_due_ms: due.map(|d| d as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_reads_back_what_it_encodes_and_nothing_else_reads_as_one() {
        let l = RateLog {
            closed_until_ms: 1_764_000_000_123,
            starts: vec![1_764_000_000_000, 1_764_000_000_001, (1 << 48) - 1],
        };
        let b = l.encode();
        assert_eq!(b.len(), 7 + 3 * 6);
        assert_eq!(RateLog::parse(&b), Some(l));
        assert_eq!(
            RateLog::parse(&RateLog::default().encode()),
            Some(RateLog::default())
        );
        assert_eq!(RateLog::parse(b"spoiled"), None);
        assert_eq!(RateLog::parse(&b[..b.len() - 1]), None);
        let mut other = b.clone();
        other[0] = b'R';
        assert_eq!(RateLog::parse(&other), None);
    }
}
