//! Keyed rate limits as an operator sees them (rate-limits.md RL-5): the keys in use, found by
//! SCAN (bounded; never KEYS) and through the parked index, and one key's state.

use super::parked::parked_resources;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::BTreeSet;

/// Most rate keys listed.
const MAX_KEYS: usize = 10_000;

/// The rate keys in use: those with a start log, a back-off close or parked jobs (at most
/// 10,000, sorted).
pub async fn rate_keys<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> RedisResult<Vec<String>> {
    let mut out = BTreeSet::new();
    for prefix in [keys.locket("rate:"), keys.locket("rate_closed:")] {
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

/// The replies of [`rate_state`]'s reads: the window's count, the `limit`-th newest and the
/// newest start, the close, the parked count and the index score.
type Reads = (
    Option<u64>,
    Vec<(String, f64)>,
    Vec<(String, f64)>,
    Option<u64>,
    Option<u64>,
    Option<f64>,
);

/// Reads `key`'s state (six reads, pipelined).
pub async fn rate_state<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    key: &str,
    limit: u32,
    period_ms: u64,
    spread: bool,
    now_ms: u64,
) -> RedisResult<RateState> {
    let log = keys.locket(&format!("rate:{key}"));
    let limit = i64::from(limit.max(1));
    let (used, nth, last, closed, parked, due): Reads = redis::pipe()
        .cmd("ZCOUNT")
        .arg(&log)
        .arg(format!("({}", now_ms.saturating_sub(period_ms)))
        .arg("+inf")
        .cmd("ZRANGE")
        .arg(&log)
        .arg(-limit)
        .arg(-limit)
        .arg("WITHSCORES")
        .cmd("ZRANGE")
        .arg(&log)
        .arg(-1)
        .arg(-1)
        .arg("WITHSCORES")
        .cmd("GET")
        .arg(keys.locket(&format!("rate_closed:{key}")))
        .cmd("LLEN")
        .arg(keys.locket(&format!("parked:rate:{key}")))
        .cmd("ZSCORE")
        .arg(keys.locket("parked"))
        .arg(format!("rate:{key}"))
        .ignore_errors()
        .query_async(conn)
        .await
        .unwrap_or_default();
    let used = used.unwrap_or(0);
    let closed_until_ms = closed.filter(|c| *c > now_ms);
    let mut next = now_ms;
    if let Some(c) = closed_until_ms {
        next = next.max(c);
    }
    if let Some((_, s)) = nth.first() {
        next = next.max(*s as u64 + period_ms);
    }
    if spread {
        if let Some((_, s)) = last.first() {
            next = next.max(*s as u64 + period_ms.div_ceil(limit as u64));
        }
    }
    let mut allowed_now = (limit as u64).saturating_sub(used);
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
