//! Delayed delivery (SC-4, SC-5): each due timestamp, oldest first, one `deliver.lua` call per
//! batch of 100 items (fewer when they pass 1 MiB, `store::schedule::BATCH_BYTES`). A member
//! that is not an integer, a bucket that is not a list, or an item kept back (no usable queue,
//! a target key of another type) is logged once, listed for `status`, and that timestamp is
//! not looked at again for a minute: never a tight loop.

use crate::conn::Manager;
use crate::resque::keys::Keys;
use crate::store::schedule as st;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Items per DELIVER call (the gem's batch).
pub const BATCH: usize = 100;
/// How long a timestamp with kept items is left alone.
const SKIP_FOR: Duration = Duration::from_secs(60);

/// What the delivery remembers between passes.
#[derive(Debug, Default)]
pub struct State {
    /// Timestamps (ZSET members) left alone until then.
    skip: HashMap<String, Instant>,
    /// What is kept back and why, reported once each: `delayed:<ts>#<index>` → why.
    problems: BTreeMap<String, String>,
    /// `problems` changed since it was last written for `status`.
    dirty: bool,
    written: Option<Instant>,
}

impl State {
    fn report(&mut self, what: String, why: String) {
        if self.problems.get(&what) != Some(&why) {
            warn!(target: "locketd::scheduler", item = %what, reason = %why,
                "delayed item kept back, not delivered (SC-5)");
            if self.problems.len() < 1000 {
                self.problems.insert(what, why);
            }
            self.dirty = true;
        }
    }

    /// One pass over the timestamps due at `now` (Redis's clock, Unix seconds); stops at
    /// `until` (the lock's local deadline).
    pub async fn pass(
        &mut self,
        conn: &mut Manager,
        keys: &Keys,
        now: i64,
        until: Instant,
    ) -> redis::RedisResult<u64> {
        let mono = Instant::now();
        self.skip.retain(|_, t| *t > mono);
        let mut offset = 0;
        let mut total = 0;
        'pass: loop {
            let due = st::due_timestamps(conn, keys, now, offset, BATCH).await?;
            let n = due.len();
            for (member, _score) in due {
                if Instant::now() >= until {
                    break 'pass;
                }
                if self.skip.contains_key(&member) {
                    offset += 1;
                    continue;
                }
                if member.parse::<i64>().is_err() {
                    self.report(
                        format!("delayed_queue_schedule member {member:?}"),
                        "not an integer timestamp: left in place".into(),
                    );
                    self.skip.insert(member, mono + SKIP_FOR);
                    offset += 1;
                    continue;
                }
                let mut kept = 0;
                loop {
                    let d = match st::deliver_batch(conn, keys, &member, kept, BATCH).await {
                        Ok(d) => d,
                        // An outage (the connection, READONLY, LOADING, OOM, ...): this pass
                        // ends and the next one, a second later, tries again.
                        Err(e) if !crate::conn::is_refusal(&e) => return Err(e),
                        Err(e) => {
                            // A deterministic refusal (LOCKET_STORE, a Lua error): not resent.
                            self.report(format!("delayed:{member}"), e.to_string());
                            self.skip.insert(member.clone(), mono + SKIP_FOR);
                            offset += 1;
                            break;
                        }
                    };
                    total += d.delivered;
                    for (i, why) in &d.problems {
                        let what = if *i < 0 {
                            format!("delayed:{member}")
                        } else {
                            format!("delayed:{member}#{i}")
                        };
                        self.report(what, why.clone());
                    }
                    kept = d.kept;
                    if d.left < 0 || d.left as u64 <= d.kept {
                        if d.left != 0 {
                            self.skip.insert(member.clone(), mono + SKIP_FOR);
                            offset += 1;
                        } else {
                            self.problems
                                .retain(|k, _| !k.starts_with(&format!("delayed:{member}#")));
                        }
                        break;
                    }
                    if Instant::now() >= until {
                        break 'pass;
                    }
                }
            }
            if n < BATCH {
                break;
            }
        }
        if total > 0 {
            info!(target: "locketd::scheduler", delivered = total, "delayed items delivered");
        }
        self.publish_problems(conn, keys).await;
        Ok(total)
    }

    /// Writes the kept items for `status` when they changed, and refreshes them each minute.
    async fn publish_problems(&mut self, conn: &mut Manager, keys: &Keys) {
        let stale = self
            .written
            .is_none_or(|t| t.elapsed() > Duration::from_secs(60));
        if !self.dirty && (self.problems.is_empty() || !stale) {
            return;
        }
        let key = keys.scheduler_problems();
        let r: redis::RedisResult<()> = if self.problems.is_empty() {
            redis::cmd("DEL").arg(&key).query_async(conn).await
        } else {
            let text = serde_json::to_string(&self.problems).unwrap_or_default();
            redis::cmd("SET")
                .arg(&key)
                .arg(text)
                .arg("EX")
                .arg(300)
                .query_async(conn)
                .await
        };
        if r.is_ok() {
            self.dirty = false;
            self.written = Some(Instant::now());
        }
    }
}
