//! The O-3 counts of the job path (locking-semantics.md O-3), summed in memory and written at
//! most once per second.
//!
//! On a worker's connection (src/store/batch.rs), RESERVE, ACQUIRE, FINISH and their batches
//! do not write `stat:<event>` or the `metrics:<epoch minute>` bucket themselves: the
//! connection sends their tallied variant, which returns what it counted beside its reply
//! (`{reply, counts}`, lib_count.lua `counts_reply`); [`Tally::split_reply`] adds that to the
//! connection's [`Tally`], and [`flush_loop`] writes the sums once per second and once more
//! when the process stops. A process killed with SIGKILL loses at most the last second of
//! these counts; they are observability, not state. Resque's own `stat:processed` and
//! `stat:failed` stay exact, per job, inside FINISH. Any other caller of the store (its tests,
//! say) runs the plain variants, which write their counts in the step, as the steps off the job
//! path (janitor, admin, scheduler) always do.

use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// How often the sums are written.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Life of a per-minute bucket, as the scripts give it.
const BUCKET_TTL_MS: u64 = 8 * 3600 * 1000;

/// Counts not yet written: `<event>` and `<event>|<class>` fields. One per worker connection
/// (src/store/batch.rs), shared by its slots.
#[derive(Debug, Default)]
pub struct Tally {
    pending: Mutex<HashMap<String, i64>>,
}

impl Tally {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, i64>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds counts to the pending sums.
    pub fn add<'a>(&self, counts: impl IntoIterator<Item = (&'a str, i64)>) {
        let mut map = self.lock();
        for (field, n) in counts {
            if n != 0 {
                *map.entry(field.to_string()).or_insert(0) += n;
            }
        }
    }

    /// A tallied job-path script's reply `{reply, counts}`: the counts (entries
    /// `<n>,<length>:<field>` in one string, lib_count.lua `flush_counts`) go to the pending sums,
    /// the reply is returned.
    pub fn split_reply(&self, v: Value) -> RedisResult<Value> {
        match v {
            Value::Array(mut items) if items.len() == 2 => {
                let counts = items.pop().unwrap_or(Value::Nil);
                let reply = items.pop().unwrap_or(Value::Nil);
                if let Value::BulkString(joined) = counts {
                    let mut map = self.lock();
                    for (field, n) in entries(&joined) {
                        let field = String::from_utf8_lossy(field);
                        match map.get_mut(field.as_ref()) {
                            Some(sum) => *sum += n,
                            None => {
                                map.insert(field.into_owned(), n);
                            }
                        }
                    }
                }
                Ok(reply)
            }
            other => super::unexpected("tallied job-path script", &other),
        }
    }

    /// The pending sums, taken (empty when nothing was counted since the last flush).
    fn take(&self) -> HashMap<String, i64> {
        std::mem::take(&mut *self.lock())
    }

    /// Writes the pending sums: `stat:<event>` and the current minute's bucket. On an error
    /// the sums go back, to be written with the next flush.
    pub async fn flush<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
    ) -> RedisResult<usize> {
        let sums = self.take();
        if sums.is_empty() {
            return Ok(0);
        }
        let minute = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() / 60)
            .unwrap_or(0);
        let bucket = keys.locket(&format!("metrics:{minute}"));
        let mut pipe = redis::pipe();
        for (field, n) in &sums {
            if !field.contains('|') {
                pipe.cmd("INCRBY")
                    .arg(keys.locket(&format!("stat:{field}")))
                    .arg(*n)
                    .ignore();
            }
            pipe.cmd("HINCRBY").arg(&bucket).arg(field).arg(*n).ignore();
            // RL-5: the rate paths' per-class counts, fleet-wide, for /metrics (lib_count.lua
            // flush_counts writes the same when a script writes its own counts).
            if field.starts_with("rate_limited|") || field.starts_with("throttled|") {
                pipe.cmd("HINCRBY")
                    .arg(keys.locket("rate_stats"))
                    .arg(field)
                    .arg(*n)
                    .ignore();
            }
        }
        pipe.cmd("PEXPIRE").arg(&bucket).arg(BUCKET_TTL_MS).ignore();
        // A counter key another tool spoiled (another type, not an integer) is passed over,
        // as the scripts do: only a failed round trip keeps the sums for the next flush.
        match pipe.ignore_errors().query_async::<Value>(conn).await {
            Ok(_) => Ok(sums.len()),
            Err(e) => {
                self.add(sums.iter().map(|(f, n)| (f.as_str(), *n)));
                Err(e)
            }
        }
    }
}

/// Flushes `tally` every [`FLUSH_EVERY`] while there is something to write, and once more
/// when `stop` is cancelled (then a few tries, for a Redis that is briefly away).
pub async fn flush_loop<C: ConnectionLike + Send>(
    mut conn: C,
    tally: Arc<Tally>,
    keys: Keys,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = tally.flush(&mut conn, &keys).await {
                    tracing::debug!(error = %e, "locket counts not written; kept for the next flush");
                }
            }
            _ = stop.cancelled() => break,
        }
    }
    for _ in 0..5 {
        match tokio::time::timeout(Duration::from_secs(2), tally.flush(&mut conn, &keys)).await {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "locket counts not written at stop; trying again");
            }
            Err(_) => tracing::warn!("locket counts not written at stop: Redis did not answer"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The entries of a joined counts string, `<n>,<length>:<field>` each, up to the first that
/// does not parse.
fn entries(mut rest: &[u8]) -> impl Iterator<Item = (&[u8], i64)> {
    std::iter::from_fn(move || {
        let comma = rest.iter().position(|b| *b == b',')?;
        let colon = comma + 1 + rest[comma + 1..].iter().position(|b| *b == b':')?;
        let n: i64 = std::str::from_utf8(&rest[..comma]).ok()?.parse().ok()?;
        let len: usize = std::str::from_utf8(&rest[comma + 1..colon])
            .ok()?
            .parse()
            .ok()?;
        let field = rest.get(colon + 1..colon + 1 + len)?;
        rest = &rest[colon + 1 + len..];
        Some((field, n))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_reply_adds_the_counts_and_returns_the_reply() {
        let t = Tally::default();
        // A class name may hold the separators: the length says where it ends.
        let v = Value::Array(vec![
            Value::BulkString(b"ok".to_vec()),
            Value::BulkString(b"2,7:started1,16:started|A,1:B\n:C3,0:".to_vec()),
        ]);
        let reply = t.split_reply(v).expect("a reply");
        assert_eq!(reply, Value::BulkString(b"ok".to_vec()));
        t.add([("started", 3)]);
        let sums = t.take();
        assert_eq!(sums.get("started"), Some(&5));
        assert_eq!(sums.get("started|A,1:B\n:C"), Some(&1));
        assert_eq!(sums.get(""), Some(&3));
        assert!(t.take().is_empty());
    }
}
