//! The scheduler's operator side: `locketd schedule` (each schedule's next fire, last enqueue,
//! the lock holder), `locketd schedule run <name>`, the delayed counts of `status` and
//! `/metrics`, and SC-14's publishing.

use crate::config::{Config, Schedule};
use crate::resque::keys::Keys;
use crate::store::schedule as st;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde::Serialize;

/// SC-14: each schedule into `persistent_schedules` (class, queue, args and a `cron` or `every`
/// the gem parses) and its name into `schedules_changed`.
pub async fn publish<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    schedules: &[Schedule],
) -> RedisResult<()> {
    for s in schedules {
        let mut p = redis::pipe();
        p.atomic()
            .cmd("HSET")
            .arg(keys.persistent_schedules())
            .arg(&s.name)
            .arg(s.published_json())
            .ignore()
            .cmd("SADD")
            .arg(keys.schedules_changed())
            .arg(&s.name)
            .ignore();
        p.query_async::<()>(conn).await?;
    }
    Ok(())
}

/// The delayed queue at a glance (SC-3 readers' numbers).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct DelayedCounts {
    /// Timestamps scheduled (`ZCARD delayed_queue_schedule`).
    pub timestamps: u64,
    /// Timestamps due now.
    pub due_timestamps: u64,
    /// Items in the due buckets (at most the first 1,000 due timestamps are summed).
    pub due_items: u64,
    /// Seconds since the oldest due timestamp (0: none due).
    pub oldest_overdue_secs: u64,
    /// Items the scheduler keeps back and why (`bucket#index` → reason).
    pub kept: std::collections::BTreeMap<String, String>,
}

/// Reads the delayed counts: a handful of commands, bounded.
pub async fn delayed_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    now: i64,
) -> RedisResult<DelayedCounts> {
    let zset = keys.delayed_schedule();
    let (timestamps, due_timestamps, oldest): (u64, u64, Vec<(String, f64)>) = redis::pipe()
        .cmd("ZCARD")
        .arg(&zset)
        .cmd("ZCOUNT")
        .arg(&zset)
        .arg("-inf")
        .arg(now)
        .cmd("ZRANGE")
        .arg(&zset)
        .arg(0)
        .arg(0)
        .arg("WITHSCORES")
        .query_async(conn)
        .await?;
    let mut out = DelayedCounts {
        timestamps,
        due_timestamps,
        ..DelayedCounts::default()
    };
    if let Some((_, score)) = oldest.first() {
        if (*score as i64) <= now {
            out.oldest_overdue_secs = (now - *score as i64).max(0) as u64;
        }
    }
    if due_timestamps > 0 {
        let due = st::due_timestamps(conn, keys, now, 0, 1000).await?;
        let mut p = redis::pipe();
        for (m, _) in &due {
            p.cmd("LLEN").arg(keys.delayed_bucket(m));
        }
        // A bucket of another type answers WRONGTYPE: counted as 0.
        let lens: Vec<redis::Value> = p.ignore_errors().query_async(conn).await?;
        out.due_items = lens
            .iter()
            .map(|v| match v {
                redis::Value::Int(n) => *n as u64,
                _ => 0,
            })
            .sum();
    }
    let kept: Option<String> = redis::cmd("GET")
        .arg(keys.scheduler_problems())
        .query_async(conn)
        .await
        .unwrap_or(None);
    if let Some(k) = kept {
        out.kept = serde_json::from_str(&k).unwrap_or_default();
    }
    Ok(out)
}

/// One line of `locketd schedule`.
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleRow {
    /// The schedule's name.
    pub name: String,
    /// `cron "<expr>" <zone>` or `every <n>s`.
    pub when: String,
    /// Class and queue.
    pub class: String,
    /// The queue.
    pub queue: String,
    /// The next tick (Unix seconds).
    pub next: Option<i64>,
    /// `delayed:last_enqueued_at` for it (the gem's `Time#to_s`).
    pub last_enqueued_at: Option<String>,
    /// The description.
    pub description: Option<String>,
}

/// What `locketd schedule` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    /// The lock key.
    pub lock_key: String,
    /// Its value (the holder), if held.
    pub lock_holder: Option<String>,
    /// Its TTL in seconds (-2: no key).
    pub lock_ttl: i64,
    /// The schedules of the config.
    pub schedules: Vec<ScheduleRow>,
}

/// Reads `locketd schedule`'s listing.
pub async fn listing<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    now: i64,
) -> crate::Result<Listing> {
    let keys = Keys::new(&config.namespace);
    let lock_key = config.scheduler.lock_key(&config.namespace);
    let (holder, ttl): (Option<String>, i64) = redis::pipe()
        .cmd("GET")
        .arg(&lock_key)
        .cmd("TTL")
        .arg(&lock_key)
        .query_async(conn)
        .await?;
    let mut rows = Vec::new();
    for s in config.schedules()? {
        let last: Option<String> = redis::cmd("HGET")
            .arg(keys.last_enqueued_at())
            .arg(&s.name)
            .query_async(conn)
            .await
            .unwrap_or(None);
        let when = match (&s.config.cron, &s.timing) {
            (Some(c), crate::config::schedule::Timing::Cron(_, z)) => format!("cron {c:?} {z}"),
            (_, crate::config::schedule::Timing::Every(p)) => format!("every {p}s"),
            _ => String::new(),
        };
        rows.push(ScheduleRow {
            name: s.name.clone(),
            when,
            class: s.class.clone(),
            queue: s.queue.clone(),
            next: s.next_tick(now),
            last_enqueued_at: last,
            description: s.config.description.clone(),
        });
    }
    Ok(Listing {
        lock_key,
        lock_holder: holder,
        lock_ttl: ttl,
        schedules: rows,
    })
}

/// `locketd schedule run <name>`: one tick now, not recorded as a tick (the next scheduled
/// tick still fires). False when no such schedule.
pub async fn run_now<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    name: &str,
) -> crate::Result<bool> {
    let Some(s) = config.schedules()?.into_iter().find(|s| s.name == name) else {
        return Ok(false);
    };
    let keys = Keys::new(&config.namespace);
    let stamp = crate::resque::time::started_at(std::time::SystemTime::now());
    st::fire(
        conn,
        &keys,
        &s.name,
        None,
        &s.queue,
        &super::payload(&s),
        &stamp,
    )
    .await?;
    Ok(true)
}
