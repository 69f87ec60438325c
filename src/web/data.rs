//! What the page shows, read from Redis through the readers the CLI uses: `status`'s
//! [`collect`](crate::ops::status::collect) for queues and workers, the admin readers for
//! locks, holds, delayed jobs and the per-minute buckets, `failed`'s list for failures; plus
//! resque-scheduler's own keys (scheduler-protocol.md §1) for its delayed jobs and schedules.
//!
//! Every section is a JSON object `{"total": N, "rows": [...]}` (rows in the shape of the
//! CLI's `--json`, at most [`MAX_ROWS`]), with a few extra fields per section. Never `KEYS`.

use super::minutes::Minutes;
use crate::admin::{self, Listing};
use crate::config::Config;
use crate::ops::status::{self, Status};
use crate::ops::unreadable::{self, Unreadable};
use crate::resque::keys::Keys;
use crate::resque::time;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Most rows a section shows; its `total` says how many there are.
pub const MAX_ROWS: usize = 500;

/// The sections, in page order, each with its own `/api/<name>`.
pub const SECTIONS: &[&str] = &[
    "chart",
    "queues",
    "workers",
    "locks",
    "holds",
    "rates",
    "delayed",
    "schedules",
    "failures",
];

/// The series of the chart, with their labels.
/// `processed` and `failed` come from [`Minutes`] (Resque's totals sampled by the listener), the
/// others from locket's per-minute buckets.
pub const SERIES: &[(&str, &str)] = &[
    ("processed", "processed"),
    ("failed", "failed"),
    ("started", "started"),
    ("conflict", "lock conflicts"),
    ("conflict_failed", "conflict failures"),
    ("queue_skipped", "queue skips"),
];

/// Everything the page shows at one moment.
#[derive(Debug, Clone)]
pub struct PageData {
    /// `locketd status`.
    pub status: Status,
    /// Each of [`SECTIONS`] by name.
    pub sections: BTreeMap<&'static str, Value>,
}

fn listing(l: Listing) -> Value {
    json!({"total": l.total, "rows": l.rows})
}

/// Reads every section; one `status` read serves queues and workers. Fails only when Redis
/// does not answer: a section that meets a key it cannot read (another type, a name that is
/// not UTF-8) shows what it could and names the key in its `unreadable`, and the others are
/// unaffected.
pub async fn page<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    minutes: &Minutes,
) -> crate::error::Result<PageData> {
    let status = status::collect(conn, config).await?;
    let mut sections = BTreeMap::new();
    let delayed = read_one(conn, config, minutes, "delayed", Some(&status), None).await?;
    for name in SECTIONS {
        let v = if *name == "delayed" {
            delayed.clone()
        } else {
            read_one(conn, config, minutes, name, Some(&status), Some(&delayed)).await?
        };
        sections.insert(*name, v);
    }
    Ok(PageData { status, sections })
}

/// One section by name; None for a name that is not one.
pub async fn section<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    minutes: &Minutes,
    name: &str,
) -> crate::error::Result<Option<Value>> {
    if !SECTIONS.contains(&name) {
        return Ok(None);
    }
    let status = match name {
        "queues" | "workers" => Some(status::collect(conn, config).await?),
        _ => None,
    };
    let delayed = match name {
        "locks" => Some(read_one(conn, config, minutes, "delayed", None, None).await?),
        _ => None,
    };
    Ok(Some(
        read_one(
            conn,
            config,
            minutes,
            name,
            status.as_ref(),
            delayed.as_ref(),
        )
        .await?,
    ))
}

/// Reads section `name` (`status` for queues and workers, the delayed section for locks).
/// A key it cannot read leaves it empty with the key named in its `unreadable` (with the
/// queues' or workers' keys `status` could not read); only Redis not answering is an error.
async fn read_one<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    minutes: &Minutes,
    name: &str,
    status: Option<&Status>,
    delayed_v: Option<&Value>,
) -> crate::error::Result<Value> {
    let k = Keys::new(&config.namespace);
    let none = Value::Null;
    let read: crate::error::Result<Value> = match (name, status) {
        ("queues", Some(st)) => queues(conn, &k, st).await.map_err(Into::into),
        ("workers", Some(st)) => Ok(workers(st)),
        ("locks", _) => locks(conn, &k, delayed_v.unwrap_or(&none))
            .await
            .map_err(Into::into),
        ("holds", _) => admin::read_holds(conn, &k, None, MAX_ROWS)
            .await
            .map(listing)
            .map_err(Into::into),
        ("delayed", _) => delayed(conn, &k).await.map_err(Into::into),
        ("rates", _) => rates(conn, &k, config).await.map_err(Into::into),
        ("schedules", _) => schedules(conn, config).await,
        ("failures", _) => failures(conn, config).await,
        ("chart", _) => chart(conn, &k, minutes).await.map_err(Into::into),
        _ => Ok(json!({"total": 0, "rows": []})),
    };
    let mut v = match read {
        Ok(v) => v,
        Err(crate::Error::Redis(e)) if unreadable::is_connection(&e) => return Err(e.into()),
        Err(e) => {
            let u = match &e {
                crate::Error::Redis(e) => {
                    let expected = expected_keys(conn, config, &k, name).await;
                    unreadable::name_key(conn, name, &expected, e).await
                }
                other => Unreadable {
                    section: name.into(),
                    key: String::new(),
                    error: other.to_string(),
                },
            };
            let mut v = empty(name);
            v["unreadable"] = json!([u]);
            v
        }
    };
    // Queues and workers are read by `status`: its keys of theirs. (Its locks, failures and
    // delayed keys are the page's summary's: those sections read theirs themselves.)
    let from_status: Vec<&Unreadable> = match (name, status) {
        ("queues" | "workers", Some(st)) => {
            st.unreadable.iter().filter(|u| u.section == name).collect()
        }
        _ => Vec::new(),
    };
    if !from_status.is_empty() {
        let mut all = v["unreadable"].as_array().cloned().unwrap_or_default();
        all.extend(from_status.into_iter().map(|u| json!(u)));
        v["unreadable"] = Value::Array(all);
    }
    Ok(v)
}

/// A section with nothing read, in its shape.
fn empty(name: &str) -> Value {
    match name {
        "delayed" => {
            json!({"total": 0, "rows": [], "scheduler": {"total": 0, "timestamps": 0, "timestamps_read": 0, "rows": []}})
        }
        "failures" => json!({"total": 0, "rows": [], "by_class": []}),
        "schedules" => json!({"total": 0, "rows": [], "master_lock": null}),
        "chart" => json!({"total": 0, "series": {}, "note": ""}),
        _ => json!({"total": 0, "rows": []}),
    }
}

/// The keys a section reads through, each with the type locketd, Resque or resque-scheduler
/// gives it: a section that fails names the one of another type.
async fn expected_keys<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    k: &Keys,
    name: &str,
) -> Vec<(String, &'static str)> {
    let ns = k.ns();
    match name {
        "locks" => vec![(k.locks(), "zset")],
        "holds" => vec![(k.deps(), "zset")],
        "delayed" => vec![(k.delayed(), "zset"), (k.delayed_schedule(), "zset")],
        "schedules" => vec![
            (format!("{ns}:persistent_schedules"), "hash"),
            (format!("{ns}:delayed:last_enqueued_at"), "hash"),
            (config.scheduler.lock_key(&config.namespace), "string"),
        ],
        "failures" => {
            let mut out = Vec::new();
            if matches!(
                config.failure_backend,
                crate::resque::failure::FailureBackend::RedisMultiQueue
            ) {
                out.push((k.failed_queues(), "set"));
            }
            let lists = crate::ops::failed::lists(conn, config, None)
                .await
                .unwrap_or_default();
            out.extend(lists.into_iter().take(MAX_ROWS).map(|l| (l.key, "list")));
            out
        }
        "rates" => vec![(
            format!("{} and {}", k.locket("ratelog:*"), k.locket("rate:*")),
            "",
        )],
        _ => Vec::new(),
    }
}

/// Whether a section has anything to show (the page leaves out the others): rows, or a key it
/// could not read.
pub fn has_data(name: &str, v: &Value) -> bool {
    if v["unreadable"].as_array().is_some_and(|u| !u.is_empty()) {
        return true;
    }
    match name {
        "chart" | "queues" | "workers" => true,
        "delayed" => v["total"].as_u64() > Some(0) || v["scheduler"]["total"].as_u64() > Some(0),
        "schedules" => v["total"].as_u64() > Some(0) || !v["master_lock"].is_null(),
        _ => v["total"].as_u64() > Some(0),
    }
}

/// `status`'s queues (configured order, then the rest by name), each with its head job's
/// class and, when the payload carries its enqueue time, the oldest job's age.
async fn queues<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    status: &Status,
) -> RedisResult<Value> {
    let shown = &status.queues[..status.queues.len().min(MAX_ROWS)];
    let mut heads: Vec<Option<String>> = Vec::new();
    for chunk in shown.chunks(200) {
        let mut pipe = redis::pipe();
        for q in chunk {
            pipe.cmd("LINDEX").arg(k.queue(&q.name)).arg(0);
        }
        let r: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        heads.extend(
            r.into_iter()
                .map(|v| redis::from_redis_value::<Option<String>>(v).unwrap_or(None)),
        );
    }
    let rows: Vec<Value> = shown
        .iter()
        .zip(heads)
        .map(|(q, head)| {
            let mut row = serde_json::to_value(q).unwrap_or(Value::Null);
            let p: Value = head
                .as_deref()
                .and_then(|h| serde_json::from_str(h).ok())
                .unwrap_or(Value::Null);
            row["head_class"] = p["class"].clone();
            row["oldest_age_secs"] = json!(enqueued_at(&p).map(|t| status.now.saturating_sub(t)));
            row
        })
        .collect();
    Ok(json!({"total": status.queues.len(), "rows": rows}))
}

/// A payload's enqueue time, when it carries one: `enqueued_at` (seconds or a time), or in its
/// first argument ActiveJob's `enqueued_at` or `enqueued_at_us`.
fn enqueued_at(p: &Value) -> Option<u64> {
    let arg = &p["args"][0];
    let t = |v: &Value| -> Option<u64> {
        v.as_f64()
            .map(|f| f as u64)
            .or_else(|| v.as_str().and_then(time::parse_heartbeat))
    };
    t(&p["enqueued_at"])
        .or_else(|| t(&arg["enqueued_at"]))
        .or_else(|| arg["enqueued_at_us"].as_u64().map(|us| us / 1_000_000))
}

fn workers(status: &Status) -> Value {
    let rows: Vec<Value> = status
        .workers
        .iter()
        .take(MAX_ROWS)
        .map(|w| serde_json::to_value(w).unwrap_or(Value::Null))
        .collect();
    json!({"total": status.workers.len(), "rows": rows})
}

/// The locks (`locketd locks --json` rows), each with the delayed job that has waited on it
/// longest (most attempts, then due first) as `waiting`.
async fn locks<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    delayed: &Value,
) -> RedisResult<Value> {
    let l = admin::read_locks(conn, k, None, MAX_ROWS).await?;
    let mut waiting: BTreeMap<&str, &Value> = BTreeMap::new();
    for d in delayed["rows"].as_array().into_iter().flatten() {
        if d["reason"] != "lock" {
            continue;
        }
        let Some(res) = d["resource"].as_str() else {
            continue;
        };
        let better = waiting
            .get(res)
            .is_none_or(|w| d["attempt"].as_u64() > w["attempt"].as_u64());
        if better {
            waiting.insert(res, d);
        }
    }
    let rows: Vec<Value> = l
        .rows
        .into_iter()
        .map(|mut r| {
            let w = r["lock_id"]
                .as_str()
                .and_then(|id| waiting.get(id))
                .map(|d| {
                    json!({"rid": d["rid"], "class": d["class"], "queue": d["queue"],
                           "attempt": d["attempt"], "due_in_ms": d["due_in_ms"]})
                });
            r["waiting"] = w.unwrap_or(Value::Null);
            r
        })
        .collect();
    Ok(json!({"total": l.total, "rows": rows}))
}

/// The keyed rate limits in use (rate-limits.md RL-5): `locketd limits --json`'s rows, with
/// the Redis clock they were read at as `now_ms`.
async fn rates<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    config: &Config,
) -> RedisResult<Value> {
    let now = admin::now_ms(conn).await?.max(0) as u64;
    let l = admin::read_limits(conn, k, config, now, MAX_ROWS).await?;
    Ok(json!({"total": l.total, "rows": l.rows, "now_ms": now}))
}

/// locket's delayed jobs (`locketd delayed --json`) and, as `scheduler`, resque-scheduler's
/// (`delayed_queue_schedule` and its `delayed:<ts>` lists), due first.
async fn delayed<C: ConnectionLike + Send>(conn: &mut C, k: &Keys) -> RedisResult<Value> {
    let own = admin::read_delayed(conn, k, None, MAX_ROWS).await?;
    let zset = format!("{}:delayed_queue_schedule", k.ns());
    let (count, stamps): (u64, Vec<String>) = redis::pipe()
        .zcard(&zset)
        .cmd("ZRANGE")
        .arg(&zset)
        .arg(0)
        .arg(MAX_ROWS - 1)
        .query_async(conn)
        .await?;
    let list = |ts: &str| format!("{}:delayed:{ts}", k.ns());
    let mut lens: Vec<u64> = Vec::new();
    if !stamps.is_empty() {
        let mut pipe = redis::pipe();
        for ts in &stamps {
            pipe.llen(list(ts));
        }
        let r: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        lens = r
            .into_iter()
            .map(|v| redis::from_redis_value(v).unwrap_or(0))
            .collect();
    }
    let mut rows = Vec::new();
    let mut pipe = redis::pipe();
    let mut wanted = Vec::new();
    let mut room = MAX_ROWS;
    for (ts, len) in stamps.iter().zip(&lens) {
        if room == 0 {
            break;
        }
        let n = (*len as usize).min(room);
        if n > 0 {
            pipe.lrange(list(ts), 0, n as isize - 1);
            wanted.push(ts);
            room -= n;
        }
    }
    if !wanted.is_empty() {
        let r: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (ts, items) in wanted.into_iter().zip(r) {
            let items: Vec<String> = redis::from_redis_value(items).unwrap_or_default();
            for item in items {
                let v: Value = serde_json::from_str(&item).unwrap_or(Value::Null);
                rows.push(json!({"at": ts.parse::<u64>().ok(), "queue": v["queue"],
                                 "class": v["class"], "args": v["args"]}));
            }
        }
    }
    let jobs: u64 = lens.iter().sum();
    Ok(json!({
        "total": own.total,
        "rows": own.rows,
        "scheduler": {"total": jobs, "timestamps": count,
                      "timestamps_read": stamps.len(), "rows": rows},
    }))
}

/// The schedules: this daemon's `[schedule.<name>]` tables (`locketd schedule`'s rows, with
/// their next tick, `source: "locketd"`), then resque-scheduler's `persistent_schedules`
/// (dynamic schedules, name → config) and `delayed:last_enqueued_at` (name → last enqueue),
/// and the holder of the scheduler's master lock (SC-6) with its TTL.
async fn schedules<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
) -> crate::error::Result<Value> {
    let k = Keys::new(&config.namespace);
    let mut v = gem_schedules(conn, &k, &config.scheduler.lock_key(&config.namespace)).await?;
    let own = crate::scheduler::ops::listing(conn, config, crate::scheduler::unix_now()).await?;
    let mut rows: Vec<Value> = own
        .schedules
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "source": "locketd",
                "config": {"class": r.class, "queue": r.queue, "when": r.when},
                "next": r.next,
                "last_enqueued_at": r.last_enqueued_at,
            })
        })
        .collect();
    let names: std::collections::HashSet<&str> =
        own.schedules.iter().map(|r| r.name.as_str()).collect();
    rows.extend(
        v["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| !names.contains(r["name"].as_str().unwrap_or_default()))
            .cloned(),
    );
    rows.truncate(MAX_ROWS);
    let gem_total = v["total"].as_u64().unwrap_or(0);
    v["total"] = json!(gem_total.max(rows.len() as u64));
    v["rows"] = Value::Array(rows);
    Ok(v)
}

/// resque-scheduler's own schedule keys and the master lock `lock_key`.
async fn gem_schedules<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    lock_key: &str,
) -> RedisResult<Value> {
    let ns = k.ns();
    let (defs_key, last_key) = (
        format!("{ns}:persistent_schedules"),
        format!("{ns}:delayed:last_enqueued_at"),
    );
    let (n_defs, n_last, holder, ttl): (u64, u64, Option<String>, i64) = redis::pipe()
        .hlen(&defs_key)
        .hlen(&last_key)
        .get(lock_key)
        .ttl(lock_key)
        .ignore_errors()
        .query_async(conn)
        .await
        .unwrap_or((0, 0, None, -2));
    let mut rows: BTreeMap<String, Value> = BTreeMap::new();
    for (key, n, field) in [
        (&defs_key, n_defs, "config"),
        (&last_key, n_last, "last_enqueued_at"),
    ] {
        if n == 0 {
            continue;
        }
        // Bounded: one HSCAN page of about MAX_ROWS fields for a large hash.
        let map: Vec<(String, String)> = if n as usize <= MAX_ROWS {
            redis::cmd("HGETALL").arg(key).query_async(conn).await?
        } else {
            let (_, page): (String, Vec<(String, String)>) = redis::cmd("HSCAN")
                .arg(key)
                .arg(0)
                .arg("COUNT")
                .arg(MAX_ROWS)
                .query_async(conn)
                .await?;
            page
        };
        for (name, v) in map {
            let e = rows
                .entry(name.clone())
                .or_insert_with(|| json!({"name": name, "config": null, "last_enqueued_at": null}));
            e[field] = if field == "config" {
                serde_json::from_str(&v).unwrap_or(Value::String(v))
            } else {
                Value::String(v)
            };
        }
    }
    let rows: Vec<Value> = rows.into_values().take(MAX_ROWS).collect();
    Ok(json!({
        "total": n_defs.max(n_last),
        "rows": rows,
        "master_lock": holder.map(|h| json!({"holder": h, "ttl_secs": ttl})),
    }))
}

/// The newest failure records (`locketd failed list --json` rows, at most [`MAX_ROWS`] over
/// the backend's lists) and their count by class and exception; `total` is every record.
async fn failures<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
) -> crate::error::Result<Value> {
    use crate::ops::failed;
    let map = |e: failed::FailedError| match e {
        failed::FailedError::Redis(r) => crate::Error::from(r),
        other => crate::Error::from(redis::RedisError::from((
            redis::ErrorKind::Client,
            "failures",
            other.to_string(),
        ))),
    };
    let total = failed::listed_total(conn, config, MAX_ROWS).await?;
    let mut rows = Vec::new();
    for l in failed::lists(conn, config, None)
        .await?
        .iter()
        .take(MAX_ROWS)
    {
        let room = MAX_ROWS - rows.len();
        if room == 0 {
            break;
        }
        let (_, list) = failed::list(conn, l, room as u64).await.map_err(map)?;
        rows.extend(list);
    }
    let mut by: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in &rows {
        let key = (
            r.class.clone().unwrap_or_default(),
            r.exception.clone().unwrap_or_default(),
        );
        *by.entry(key).or_default() += 1;
    }
    let mut by_class: Vec<Value> = by
        .into_iter()
        .map(|((class, exception), count)| {
            json!({"class": class, "exception": exception, "count": count})
        })
        .collect();
    by_class.sort_by(|a, b| b["count"].as_u64().cmp(&a["count"].as_u64()));
    Ok(json!({
        "total": total,
        "rows": rows,
        "by_class": by_class,
        "resque_web_url": config.resque_web_url,
    }))
}

/// The last hour, one point per minute per series of [`SERIES`]: locket's events from its
/// `metrics:<minute>` buckets, processed and failed jobs from [`Minutes`] (null for a minute
/// the listener did not see).
async fn chart<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    minutes: &Minutes,
) -> RedisResult<Value> {
    let buckets = admin::read_minutes(conn, k, 60).await?;
    let first = buckets.first().map(|(m, _)| *m).unwrap_or(0);
    let (processed, failed) = minutes.per_minute(first, buckets.len() as u64);
    let mut series = serde_json::Map::new();
    for (ev, label) in SERIES {
        let points: Value = match *ev {
            "processed" => json!(processed),
            "failed" => json!(failed),
            _ => json!(buckets
                .iter()
                .map(|(_, h)| h.get(*ev).copied().unwrap_or(0))
                .collect::<Vec<i64>>()),
        };
        series.insert(ev.to_string(), json!({"label": label, "points": points}));
    }
    let since = minutes.since().map(|m| {
        time::run_at(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(m * 60))
    });
    Ok(json!({
        "total": buckets.len(),
        "first_minute": buckets.first().map(|(m, _)| *m),
        "series": series,
        "note": format!(
            "processed and failed: Resque's totals (all workers of the namespace), sampled by \
             this daemon every 10 s{}; the rest: locket's per-minute event counts",
            since.map(|s| format!(" since {s}")).unwrap_or_default()
        ),
    }))
}
