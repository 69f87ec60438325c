//! Operator commands (locking-semantics.md O-2, O-3, D-3): `locketd enqueue`, `locks`,
//! `counters`, `holds`, `delayed`, `stats`. Everything is read through the indexes of K-1
//! (`locks`, `deps`, `delayed`, `<ns>:queues`), never KEYS. Human tables by default, `--json`
//! for scripts.

use crate::client::{enqueue_script, Client};
use crate::config::Config;
use crate::conn::Manager;
use crate::resque::keys::Keys;
use crate::store::{self, AdminRelease};
use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::process::ExitCode;

mod cancel;
mod delayed;
mod enqueue;
mod limits;
mod parked;
mod pause;
mod read;
mod schedule;
pub mod why;
pub use cancel::{await_cancel, cancel_job, CancelArgs, Cancelled, Outcome, Request};

pub use limits::{clock as clock_ms, read_limits, LimitsArgs};
pub use parked::{ParkedArgs, UnparkArgs};
pub use pause::PauseArgs;
pub use read::{
    now_ms, read_counters, read_delayed, read_holds, read_locks, read_minutes, reset_counter,
    Listing,
};

pub use crate::ops::queue_name;

/// The O-3 events, in the order `locketd stats` prints them.
pub const EVENTS: &[&str] = &[
    "reserved",
    "started",
    "acquired",
    "conflict",
    "requeued",
    "queue_skipped",
    "discarded",
    "waited",
    "wait_timeout",
    "delayed",
    "promoted",
    "conflict_failed",
    "extended",
    "lock_lost",
    "released",
    "expired",
    "force_released",
    "holds_added",
    "holds_released",
    "holds_expired",
    "recovered_reserved",
    "recovered_running",
    "returned",
    "finished_after_recovery",
    "parked",
    "woken",
    "park_full",
    "rate_limited",
    "throttled",
    "unique_refused",
    "unique_released",
    "unique_replaced",
];

/// The operator subcommands, flattened into the binary's command enum.
#[derive(Subcommand, Debug, Clone)]
pub enum AdminCommand {
    /// Push a job in Resque's format with its enqueue-time holds, in one atomic step.
    Enqueue(EnqueueArgs),
    /// List job locks and their holders; `locks release` frees one.
    Locks(LocksArgs),
    /// Show the per-queue lock counters; reset them.
    Counters(CountersArgs),
    /// List dependency holds; `holds release` frees them.
    Holds(HoldsArgs),
    /// List delayed jobs; `delayed promote` moves one back now.
    Delayed(DelayedArgs),
    /// Locket event totals and recent per-minute counts.
    Stats(StatsArgs),
    /// The [schedule.*] tables: next fire, last enqueue, the scheduler lock's holder;
    /// `schedule run NAME` enqueues one tick now.
    Schedule(ScheduleArgs),
    /// List the jobs parked on locks and holds (PK-8), by lock or by queue.
    Parked(ParkedArgs),
    /// Move parked jobs back to the heads of their queues (PK-9), e.g. before stopping a
    /// fleet for good.
    Unpark(UnparkArgs),
    /// List the keyed rate limits in use (rate-limits.md RL-5): allowed now, next start,
    /// back-off closes, parked jobs.
    Limits(LimitsArgs),
    /// Pause queues (resque-pause's keys, A-20): their jobs stay in their queues, running
    /// ones finish; delayed and scheduled jobs are still delivered into them.
    Pause(PauseArgs),
    /// Resume paused queues: idle workers start their jobs at once.
    Resume(PauseArgs),
    /// Cancel a job: a running one's handler gets the polite stop, then the hard stop
    /// after kill_grace; a reserved, waiting, parked or delayed one never starts. Recorded as
    /// failed with Locket::Cancelled, or put back with --requeue; waits for the outcome.
    Cancel(CancelArgs),
}

/// `locketd schedule [run NAME]`.
#[derive(Args, Debug, Clone)]
pub struct ScheduleArgs {
    /// What to do (default: list).
    #[command(subcommand)]
    pub action: Option<ScheduleAction>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd schedule run`.
#[derive(Subcommand, Debug, Clone)]
pub enum ScheduleAction {
    /// Enqueue one tick of a schedule now (not recorded as a tick: the next one still fires).
    Run {
        /// The schedule's name.
        name: String,
    },
}

/// `locketd enqueue QUEUE CLASS [ARG_JSON...]`.
#[derive(Args, Debug, Clone)]
pub struct EnqueueArgs {
    /// Queue name.
    #[arg(required_unless_present = "print_script", value_parser = queue_name)]
    pub queue: Option<String>,
    /// Job class.
    #[arg(required_unless_present = "print_script")]
    pub class: Option<String>,
    /// Arguments, each one JSON value: 42 '"text"' '{"id":7}'.
    pub args: Vec<String>,
    /// Print the PUSH Lua script (D-3a: for clients in other languages that cannot FCALL the
    /// daemon's library) and exit.
    #[arg(long)]
    pub print_script: bool,
    /// Deliver at this time (Unix seconds or RFC 3339, e.g. 2026-11-25T10:00:00Z) through
    /// resque-scheduler's delayed queue (`Resque.enqueue_at`'s format, SC-1, SC-2); the
    /// enqueue-time holds and `unique` key are placed now (D-3b).
    #[arg(long, value_name = "TIME", conflicts_with = "in_")]
    pub at: Option<String>,
    /// Deliver after this long ("300", "5m", "1h"), as `Resque.enqueue_in` does.
    #[arg(long = "in", id = "in_", value_name = "DURATION")]
    pub in_: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `locketd locks`.
#[derive(Args, Debug, Clone)]
pub struct LocksArgs {
    /// What to do (default: list).
    #[command(subcommand)]
    pub action: Option<LocksAction>,
    /// Only lock ids starting with this.
    #[arg(long)]
    pub prefix: Option<String>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd locks release`.
#[derive(Subcommand, Debug, Clone)]
pub enum LocksAction {
    /// Release one holder by token (compare-and-delete), or every holder with --force.
    Release {
        /// Lock id.
        lock_id: String,
        /// The holder's token.
        #[arg(long, required_unless_present = "force", conflicts_with = "force")]
        token: Option<String>,
        /// Remove every holder; their supervisors find out at the next heartbeat.
        #[arg(long)]
        force: bool,
    },
}

/// `locketd counters`.
#[derive(Args, Debug, Clone)]
pub struct CountersArgs {
    /// Delete this queue's counter.
    #[arg(long, value_name = "QUEUE", conflicts_with = "reset_all", value_parser = queue_name)]
    pub reset: Option<String>,
    /// Delete every queue's counter.
    #[arg(long)]
    pub reset_all: bool,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd holds`.
#[derive(Args, Debug, Clone)]
pub struct HoldsArgs {
    /// What to do (default: list).
    #[command(subcommand)]
    pub action: Option<HoldsAction>,
    /// Only hold names starting with this.
    #[arg(long)]
    pub prefix: Option<String>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd holds release`.
#[derive(Subcommand, Debug, Clone)]
pub enum HoldsAction {
    /// Release one hold of a digest, or all holds of the name.
    Release {
        /// Hold name.
        name: String,
        /// The payload digest whose hold is released (one count).
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        digest: Option<String>,
        /// Every hold of the name.
        #[arg(long)]
        all: bool,
    },
}

/// `locketd delayed`.
#[derive(Args, Debug, Clone)]
pub struct DelayedArgs {
    /// What to do (default: list).
    #[command(subcommand)]
    pub action: Option<DelayedAction>,
    /// Only jobs of this queue.
    #[arg(long, value_parser = queue_name)]
    pub queue: Option<String>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd delayed promote`.
#[derive(Subcommand, Debug, Clone)]
pub enum DelayedAction {
    /// Move one delayed job (by rid) to the tail of its queue now.
    Promote {
        /// The reservation id shown by `locketd delayed`.
        rid: String,
    },
}

/// `locketd stats`.
#[derive(Args, Debug, Clone)]
pub struct StatsArgs {
    /// Also sum the per-minute buckets of the last N minutes (at most 480).
    #[arg(long, default_value_t = 60)]
    pub minutes: u64,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// Runs an operator command to completion on its own runtime.
pub fn run(cmd: &AdminCommand, config: &Config) -> anyhow::Result<ExitCode> {
    if let AdminCommand::Enqueue(a) = cmd {
        if a.print_script {
            print!("{}", enqueue_script());
            return Ok(ExitCode::SUCCESS);
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the async runtime")?;
    rt.block_on(async {
        // As `status` and `failed`: at most 5 s, then exit 69 (or 78: refused) saying why.
        let conn = match crate::ops::connect_or_report(config).await {
            Ok(c) => c,
            Err(code) => return Ok(code),
        };
        let keys = Keys::new(&config.namespace);
        let mut a = Admin { conn, keys };
        match cmd {
            AdminCommand::Enqueue(e) => a.enqueue(e, config).await,
            AdminCommand::Locks(l) => a.locks(l).await,
            AdminCommand::Counters(c) => a.counters(c).await,
            AdminCommand::Holds(h) => a.holds(h).await,
            AdminCommand::Delayed(d) => a.delayed(d).await,
            AdminCommand::Stats(s) => a.stats(s).await,
            AdminCommand::Schedule(s) => a.schedule(s, config).await,
            AdminCommand::Parked(p) => a.parked(p).await,
            AdminCommand::Unpark(u) => a.unpark(u).await,
            AdminCommand::Limits(l) => a.limits(l, config).await,
            AdminCommand::Pause(p) => a.pause(p, true).await,
            AdminCommand::Resume(p) => a.pause(p, false).await,
            AdminCommand::Cancel(c) => a.cancel(c, config).await,
        }
    })
}

struct Admin {
    conn: Manager,
    keys: Keys,
}

/// `1234` ms as `1.2s`, `3m04s`, `2h05m`, `-` for negative.
pub fn human_ms(ms: i64) -> String {
    if ms < 0 {
        return "-".into();
    }
    let s = ms / 1000;
    if s < 60 {
        format!("{}.{}s", s, (ms % 1000) / 100)
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// Prints rows under a header, columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, c) in cells.iter().enumerate() {
            out.push_str(c);
            if i + 1 < cells.len() {
                // By hand: a format width over 65,535 (a class name that long) panics.
                let n = w[i].saturating_sub(c.chars().count()) + 2;
                out.extend(std::iter::repeat_n(' ', n));
            }
        }
        println!("{}", out.trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

impl Admin {
    async fn locks(&mut self, a: &LocksArgs) -> anyhow::Result<ExitCode> {
        if let Some(LocksAction::Release {
            lock_id,
            token,
            force,
        }) = &a.action
        {
            // Tokens are shown as their first 8 characters (O-1): a unique prefix names one.
            let token = match token.as_deref() {
                Some(t) if !*force => {
                    match holder_token(&mut self.conn, &self.keys, lock_id, t).await? {
                        Ok(full) => full,
                        Err(ambiguous) => bail!("{ambiguous}"),
                    }
                }
                other => other.unwrap_or("").to_string(),
            };
            let what = if *force {
                AdminRelease::LockForce(lock_id)
            } else {
                AdminRelease::LockToken(lock_id, &token)
            };
            let n = store::admin_release(&mut self.conn, &self.keys, &what).await?;
            if *force {
                tracing::warn!(lock_id = %lock_id, holders = n, "lock force-released by an operator");
                eprintln!("locketd: warning: force-released {n} holder(s) of lock {lock_id}");
            } else {
                tracing::warn!(lock_id = %lock_id, token = %token_prefix(&token), released = n,
                               "lock holder released by an operator");
            }
            if a.json {
                print_json(&json!({"lock_id": lock_id, "released": n}));
            } else {
                println!("released {n} holder(s) of {lock_id}");
            }
            return Ok(if n > 0 || *force {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
        let listing =
            read_locks(&mut self.conn, &self.keys, a.prefix.as_deref(), usize::MAX).await?;
        let mut rows = Vec::new();
        for l in &listing.rows {
            for h in l["holders"].as_array().into_iter().flatten() {
                let s = |k: &str| h[k].as_str().unwrap_or("").to_string();
                rows.push(vec![
                    l["lock_id"].as_str().unwrap_or("").to_string(),
                    h["limit"].as_u64().map_or("-".into(), |l| l.to_string()),
                    l["parked"].as_u64().unwrap_or(0).to_string(),
                    s("resque_worker"),
                    s("class"),
                    s("queue"),
                    human_ms(h["age_ms"].as_i64().unwrap_or(0)),
                    human_ms(h["left_ms"].as_i64().unwrap_or(0)),
                    h["fence"].as_u64().map_or("-".into(), |f| f.to_string()),
                    s("token"),
                ]);
            }
        }
        let out = listing.rows;
        if a.json {
            print_json(&Value::Array(out));
        } else if rows.is_empty() {
            println!("no locks held");
        } else {
            table(
                &[
                    "LOCK", "LIMIT", "PARKED", "WORKER", "CLASS", "QUEUE", "AGE", "LEFT", "FENCE",
                    "TOKEN",
                ],
                &rows,
            );
        }
        Ok(ExitCode::SUCCESS)
    }

    async fn counters(&mut self, a: &CountersArgs) -> anyhow::Result<ExitCode> {
        let mut queues: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys.queues())
            .query_async(&mut self.conn)
            .await?;
        queues.sort();
        if let Some(q) = &a.reset {
            let was = reset_counter(&mut self.conn, &self.keys, q).await?;
            println!(
                "reset the counter of {q} ({})",
                if was { "was set" } else { "was not set" }
            );
            return Ok(ExitCode::SUCCESS);
        }
        if a.reset_all {
            let mut n = 0;
            for q in &queues {
                let d: i64 = redis::cmd("DEL")
                    .arg(self.keys.counter(q))
                    .query_async(&mut self.conn)
                    .await?;
                n += d;
            }
            println!("reset {n} counter(s)");
            return Ok(ExitCode::SUCCESS);
        }
        let out = read_counters(&mut self.conn, &self.keys, usize::MAX)
            .await?
            .rows;
        let rows: Vec<Vec<String>> = out
            .iter()
            .map(|r| {
                let c = r["counter"].as_i64();
                let len = r["length"].as_i64().unwrap_or(0);
                vec![
                    r["queue"].as_str().unwrap_or("").to_string(),
                    c.map_or("-".into(), |c| c.to_string()),
                    len.to_string(),
                    r["ttl_ms"].as_i64().map_or("-".into(), human_ms),
                    if c.is_some_and(|c| c >= len && len > 0) {
                        "yes".into()
                    } else {
                        "no".into()
                    },
                ]
            })
            .collect();
        if a.json {
            print_json(&Value::Array(out));
        } else {
            table(&["QUEUE", "COUNTER", "LENGTH", "LEFT", "SKIPPED"], &rows);
        }
        Ok(ExitCode::SUCCESS)
    }

    async fn holds(&mut self, a: &HoldsArgs) -> anyhow::Result<ExitCode> {
        if let Some(HoldsAction::Release { name, digest, all }) = &a.action {
            // The table shows 12 characters of a digest: a unique prefix names it.
            let digest = match digest.as_deref() {
                Some(d) if !*all => {
                    let all: Vec<String> = redis::cmd("HKEYS")
                        .arg(self.keys.dep(name))
                        .query_async(&mut self.conn)
                        .await?;
                    complete_prefix(d, all, "digest")?
                }
                other => other.unwrap_or("").to_string(),
            };
            let what = if *all {
                AdminRelease::HoldAll(name)
            } else {
                AdminRelease::HoldDigest(name, &digest)
            };
            let n = store::admin_release(&mut self.conn, &self.keys, &what).await?;
            tracing::warn!(hold = %name, released = n, "hold released by an operator");
            println!("released {n} hold(s) of {name}");
            return Ok(if n > 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
        let out = read_holds(&mut self.conn, &self.keys, a.prefix.as_deref(), usize::MAX)
            .await?
            .rows;
        let rows: Vec<Vec<String>> = out
            .iter()
            .map(|r| {
                vec![
                    r["name"].as_str().unwrap_or("").to_string(),
                    r["digest"]
                        .as_str()
                        .unwrap_or("")
                        .chars()
                        .take(12)
                        .collect(),
                    r["count"].to_string(),
                    human_ms(r["left_ms"].as_i64().unwrap_or(0)),
                ]
            })
            .collect();
        if a.json {
            print_json(&Value::Array(out));
        } else if rows.is_empty() {
            println!("no holds");
        } else {
            table(&["NAME", "DIGEST", "COUNT", "LEFT"], &rows);
        }
        Ok(ExitCode::SUCCESS)
    }

    async fn stats(&mut self, a: &StatsArgs) -> anyhow::Result<ExitCode> {
        let minutes = a.minutes.min(480);
        let mut recent: HashMap<String, i64> = HashMap::new();
        for (_, h) in read_minutes(&mut self.conn, &self.keys, minutes).await? {
            for (k, v) in h {
                *recent.entry(k).or_default() += v;
            }
        }
        let mut rows = Vec::new();
        let mut out = serde_json::Map::new();
        for ev in EVENTS {
            let total: Option<i64> = redis::cmd("GET")
                .arg(self.keys.stat(ev))
                .query_async(&mut self.conn)
                .await?;
            let total = total.unwrap_or(0);
            let last = recent.get(*ev).copied().unwrap_or(0);
            rows.push(vec![ev.to_string(), total.to_string(), last.to_string()]);
            let by_class: serde_json::Map<String, Value> = recent
                .iter()
                .filter_map(|(k, v)| {
                    k.strip_prefix(&format!("{ev}|"))
                        .map(|c| (c.to_string(), json!(v)))
                })
                .collect();
            out.insert(
                ev.to_string(),
                json!({"total": total, "recent": last, "recent_by_class": by_class}),
            );
        }
        if a.json {
            print_json(&json!({"minutes": minutes, "events": out}));
        } else {
            let last = format!("LAST {minutes}M");
            table(&["EVENT", "TOTAL", &last], &rows);
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// How many characters of a lock token are ever shown (O-1): by `locks`, its `--json`, the
/// web page and its API, and the logs. The whole token is the holder's lease: whoever has it
/// can release or extend the lock as its holder.
pub const TOKEN_SHOWN: usize = 8;

/// The first [`TOKEN_SHOWN`] characters of a lock token: the only part of it that is shown.
pub fn token_prefix(token: &str) -> &str {
    token
        .char_indices()
        .nth(TOKEN_SHOWN)
        .map_or(token, |(end, _)| &token[..end])
}

/// The full token of the holder of `lock_id` that `given` names (a whole token, or a prefix
/// of exactly one holder's, such as the 8 characters shown): `given` itself when it names
/// none (the release then finds nothing), and `Err` with a message when it names more than
/// one.
pub async fn holder_token<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    lock_id: &str,
    given: &str,
) -> redis::RedisResult<Result<String, String>> {
    let all = store::holders(conn, keys, lock_id)
        .await?
        .into_iter()
        .map(|h| h.token)
        .collect();
    Ok(complete(given, all, "token"))
}

/// The one value of `all` that `given` starts with (the tables show prefixes of tokens and
/// digests), `given` itself when it is one of them or matches none (the release then finds
/// nothing), or a message when the prefix is ambiguous.
fn complete(given: &str, all: Vec<String>, what: &str) -> Result<String, String> {
    if given.is_empty() || all.iter().any(|v| v == given) {
        return Ok(given.to_string());
    }
    let mut matches = all.into_iter().filter(|v| v.starts_with(given));
    match (matches.next(), matches.next()) {
        (Some(one), None) => Ok(one),
        (None, _) => Ok(given.to_string()),
        (Some(_), Some(_)) => Err(format!(
            "{what} prefix {given:?} matches more than one; nothing released: give more of it"
        )),
    }
}

/// [`complete`] for the CLI.
fn complete_prefix(given: &str, all: Vec<String>, what: &str) -> anyhow::Result<String> {
    complete(given, all, what).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::{complete_prefix, token_prefix};

    #[test]
    fn a_token_is_shown_as_its_first_8_characters() {
        assert_eq!(token_prefix("0123456789abcdef0123456789abcdef"), "01234567");
        assert_eq!(token_prefix("abc"), "abc");
        assert_eq!(token_prefix("ééééééééé"), "éééééééé");
    }

    #[test]
    fn a_unique_prefix_names_its_value() {
        let all = || vec!["abc123".to_string(), "abd456".to_string()];
        assert_eq!(complete_prefix("abc", all(), "digest").unwrap(), "abc123");
        assert_eq!(
            complete_prefix("abd456", all(), "digest").unwrap(),
            "abd456"
        );
        assert_eq!(complete_prefix("zz", all(), "digest").unwrap(), "zz");
        assert!(complete_prefix("ab", all(), "digest").is_err());
    }
}
