//! The readers behind `locketd locks`, `counters`, `holds`, `delayed` and `stats` (and the web
//! page's sections): bounded, pipelined, each row in the shape of the CLI's `--json`.

use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::{json, Value};
use std::collections::HashMap;

/// A bounded listing: the first rows (each in the shape of the CLI's `--json`) and how many
/// entries the index holds in all, so a reader can say "500 of 10,000".
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Listing {
    /// Entries of the index behind the rows (locks held, hold names, delayed jobs, queues).
    pub total: u64,
    /// The rows read, at most the limit asked for.
    pub rows: Vec<Value>,
}

/// Deletes a queue's lock counter (`locketd counters --reset`); true when it was set.
pub async fn reset_counter<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queue: &str,
) -> RedisResult<bool> {
    let n: i64 = redis::cmd("DEL")
        .arg(keys.counter(queue))
        .query_async(conn)
        .await?;
    Ok(n > 0)
}

/// Redis server time in ms.
pub async fn now_ms<C: ConnectionLike + Send>(conn: &mut C) -> RedisResult<i64> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(s * 1000 + us / 1000)
}

/// Lock ids read per pipeline.
const CHUNK: usize = 200;

/// The next page of at most [`CHUNK`] members of the index ZSET `key` from `*start` (moved past
/// them), those starting with `prefix` kept; `None` past the index's end.
async fn index_page<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    start: &mut usize,
    prefix: Option<&str>,
) -> RedisResult<Option<Vec<String>>> {
    let page: Vec<String> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(*start)
        .arg(*start + CHUNK - 1)
        .query_async(conn)
        .await?;
    if page.is_empty() {
        return Ok(None);
    }
    *start += page.len();
    Ok(Some(
        page.into_iter()
            .filter(|m| prefix.is_none_or(|p| m.starts_with(p)))
            .collect(),
    ))
}

/// The locks with a live holder, in `locket:locks` order (earliest deadline first): per lock
/// its holders (`locketd locks --json`) and the queues it made skip jobs (`blocked_queues`).
/// At most `limit` locks; `prefix` keeps ids starting with it. One pipeline per 200 locks.
pub async fn read_locks<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    prefix: Option<&str>,
    limit: usize,
) -> RedisResult<Listing> {
    let now = now_ms(conn).await?;
    let (held, indexed): (u64, u64) = redis::pipe()
        .cmd("ZCOUNT")
        .arg(keys.locks())
        .arg(format!("({now}"))
        .arg("+inf")
        .zcard(keys.locks())
        .query_async(conn)
        .await?;
    let mut out = Listing {
        total: held,
        rows: Vec::new(),
    };
    let mut matching = 0u64;
    let mut start = 0usize;
    while (start as u64) < indexed && (out.rows.len() < limit || prefix.is_some()) {
        let Some(ids) = index_page(conn, &keys.locks(), &mut start, prefix).await? else {
            break;
        };
        if ids.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.cmd("ZRANGE")
                .arg(keys.lock(id))
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .hgetall(keys.lockinfo(id))
                .smembers(keys.blocked_lock(id));
        }
        let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (id, r) in ids.iter().zip(replies.chunks(3)) {
            let members: Vec<(String, f64)> =
                redis::from_redis_value(r[0].clone()).unwrap_or_default();
            let infos: HashMap<String, String> =
                redis::from_redis_value(r[1].clone()).unwrap_or_default();
            let mut blocked: Vec<String> =
                redis::from_redis_value(r[2].clone()).unwrap_or_default();
            blocked.sort();
            let mut hs = Vec::new();
            for (token, deadline) in members {
                let left = deadline as i64 - now;
                if left <= 0 {
                    continue;
                }
                let info: Value = infos
                    .get(&token)
                    .and_then(|s| serde_json::from_str(s).ok())
                    .unwrap_or(Value::Null);
                hs.push(holder_row(&token, &info, now, left));
            }
            if hs.is_empty() {
                continue;
            }
            matching += 1;
            if out.rows.len() < limit {
                out.rows
                    .push(json!({"lock_id": id, "holders": hs, "blocked_queues": blocked}));
            }
        }
    }
    if prefix.is_some() {
        out.total = matching;
    }
    // Limit-1 locks have no index (store::held_lock1): found by SCAN, merged in by deadline.
    let lock1: Vec<_> = crate::store::held_lock1(conn, keys, 10_000)
        .await?
        .into_iter()
        .filter(|l| prefix.is_none_or(|p| l.id.starts_with(p)))
        .collect();
    out.total += lock1.len() as u64;
    // A-7a: a job TAKE started on free limit-1 locks has no digest in its lock's value; it is
    // worked out from the payload in its slot's record (row, token, record key).
    let mut no_digest: Vec<(usize, String, String)> = Vec::new();
    for chunk in lock1.chunks(CHUNK) {
        let mut pipe = redis::pipe();
        for l in chunk {
            pipe.smembers(keys.blocked_lock(&l.id));
        }
        let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (l, r) in chunk.iter().zip(replies) {
            let mut blocked: Vec<String> = redis::from_redis_value(r).unwrap_or_default();
            blocked.sort();
            let info = l.holder.info.clone().unwrap_or(Value::Null);
            if let (Value::Null, Some(p), Some(s)) = (
                &info["digest"],
                info["process"].as_str(),
                info["slot"].as_u64(),
            ) {
                let record = keys.inflight(&format!("{p}:{s}"));
                no_digest.push((out.rows.len(), l.holder.token.clone(), record));
            }
            let left = l.holder.deadline_ms as i64 - now;
            let hs = vec![holder_row(&l.holder.token, &info, now, left)];
            out.rows
                .push(json!({"lock_id": l.id, "holders": hs, "blocked_queues": blocked}));
        }
    }
    fill_digests(conn, &mut out.rows, &no_digest).await;
    // Earliest deadline first, as the index orders the others.
    out.rows.sort_by_key(|r| {
        r["holders"]
            .as_array()
            .and_then(|hs| hs.iter().filter_map(|h| h["left_ms"].as_i64()).min())
            .unwrap_or(i64::MAX)
    });
    out.rows.truncate(limit);
    // PK-8: the jobs parked on each lock.
    let resources: Vec<String> = out
        .rows
        .iter()
        .map(|r| format!("lock:{}", r["lock_id"].as_str().unwrap_or("")))
        .collect();
    let parked = crate::store::parked_counts(conn, keys, &resources)
        .await
        .unwrap_or_default();
    for (row, n) in out.rows.iter_mut().zip(parked) {
        row["parked"] = json!(n);
    }
    Ok(out)
}

/// The digests of the limit-1 holders in `missing` (row, token, slot record), from the payload
/// in each record that the same token still runs; a record gone or moved on leaves it null.
async fn fill_digests<C: ConnectionLike + Send>(
    conn: &mut C,
    rows: &mut [Value],
    missing: &[(usize, String, String)],
) {
    for chunk in missing.chunks(CHUNK) {
        let mut pipe = redis::pipe();
        for (_, _, record) in chunk {
            pipe.cmd("HMGET").arg(record).arg("token").arg("payload");
        }
        let Ok(replies) = pipe
            .ignore_errors()
            .query_async::<Vec<redis::Value>>(conn)
            .await
        else {
            return;
        };
        for ((row, token, _), r) in chunk.iter().zip(replies) {
            let (t, payload): (Option<String>, Option<String>) =
                redis::from_redis_value(r).unwrap_or_default();
            let job: Option<Value> = payload.and_then(|p| serde_json::from_str(&p).ok());
            if let (Some(t), Some(job)) = (t, job) {
                if t == *token {
                    let class = job["class"].as_str().unwrap_or_default();
                    let digest = crate::locks::canonical::digest(class, &job["args"]);
                    rows[*row]["holders"][0]["digest"] = json!(digest);
                }
            }
        }
    }
}

/// One holder as `locketd locks --json` shows it, from its info JSON (`lockinfo`, or a
/// limit-1 lock's own value); its token as its first 8 characters (O-1), which
/// `locks release --token` and the page's release take.
fn holder_row(token: &str, info: &Value, now: i64, left_ms: i64) -> Value {
    let acquired = info["acquired_at"].as_i64().unwrap_or(now);
    json!({
        "token": super::token_prefix(token),
        "process": info["process"],
        "resque_worker": info["resque_worker"],
        "class": info["class"],
        "queue": info["queue"],
        "digest": info["digest"],
        "lock_id_source": info["lock_id_source"],
        "limit": info["limit"],
        "fence": info["fence"],
        "age_ms": (now - acquired).max(0),
        "left_ms": left_ms,
    })
}

/// The queues of `<ns>:queues` by name with their lock counters (`locketd counters --json`),
/// the first `limit` of them; `total` is every known queue.
pub async fn read_counters<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    limit: usize,
) -> RedisResult<Listing> {
    let mut queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.queues())
        .query_async(conn)
        .await?;
    queues.sort();
    let total = queues.len() as u64;
    queues.truncate(limit);
    let mut rows = Vec::with_capacity(queues.len());
    for chunk in queues.chunks(CHUNK) {
        let mut pipe = redis::pipe();
        for q in chunk {
            pipe.get(keys.counter(q))
                .cmd("PTTL")
                .arg(keys.counter(q))
                .llen(keys.queue(q));
        }
        let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (q, r) in chunk.iter().zip(replies.chunks(3)) {
            let c: Option<i64> = redis::from_redis_value(r[0].clone()).unwrap_or(None);
            let ttl: i64 = redis::from_redis_value(r[1].clone()).unwrap_or(-2);
            let len: i64 = redis::from_redis_value(r[2].clone()).unwrap_or(0);
            rows.push(json!({"queue": q, "counter": c, "length": len,
                             "ttl_ms": if c.is_some() { Some(ttl) } else { None }}));
        }
    }
    Ok(Listing { total, rows })
}

/// The live dependency holds (`locketd holds --json`), name by name in `locket:deps` order,
/// each with the queues it made skip jobs (`blocked_queues`), at most `limit` rows; `total` is
/// the number of hold names in the index.
pub async fn read_holds<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    prefix: Option<&str>,
    limit: usize,
) -> RedisResult<Listing> {
    let now = now_ms(conn).await?;
    let indexed: u64 = redis::cmd("ZCARD")
        .arg(keys.deps())
        .query_async(conn)
        .await?;
    let mut out = Listing {
        total: indexed,
        rows: Vec::new(),
    };
    let mut start = 0usize;
    while (start as u64) < indexed && out.rows.len() < limit {
        let Some(names) = index_page(conn, &keys.deps(), &mut start, prefix).await? else {
            break;
        };
        if names.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for n in &names {
            pipe.hgetall(keys.dep(n)).smembers(keys.blocked_dep(n));
        }
        let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (name, r) in names.iter().zip(replies.chunks(2)) {
            let fields: HashMap<String, String> =
                redis::from_redis_value(r[0].clone()).unwrap_or_default();
            let mut blocked: Vec<String> =
                redis::from_redis_value(r[1].clone()).unwrap_or_default();
            blocked.sort();
            let mut fields: Vec<_> = fields.into_iter().collect();
            fields.sort();
            for (digest, v) in fields {
                let (count, deadline) = v.split_once(':').unwrap_or(("0", "0"));
                let count: i64 = count.parse().unwrap_or(0);
                let left = deadline.parse::<i64>().unwrap_or(0) - now;
                if left <= 0 || count <= 0 || out.rows.len() >= limit {
                    continue;
                }
                out.rows
                    .push(json!({"name": name, "digest": digest, "count": count,
                                     "left_ms": left, "blocked_queues": blocked}));
            }
        }
    }
    Ok(out)
}

/// locket's delayed jobs (`locketd delayed --json`), due first, at most `limit`; `queue`
/// keeps one queue's. `total` is every delayed job (of that queue).
pub async fn read_delayed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queue: Option<&str>,
    limit: usize,
) -> RedisResult<Listing> {
    let now = now_ms(conn).await?;
    let total: u64 = redis::cmd("ZCARD")
        .arg(keys.delayed())
        .query_async(conn)
        .await?;
    // Filtered by queue, every member is read (the CLI's `--queue`); else only the first.
    let last = if queue.is_some() || limit == usize::MAX {
        -1
    } else {
        limit as i64 - 1
    };
    let raw: Vec<(String, f64)> = if limit == 0 {
        Vec::new()
    } else {
        redis::cmd("ZRANGE")
            .arg(keys.delayed())
            .arg(0)
            .arg(last)
            .arg("WITHSCORES")
            .query_async(conn)
            .await?
    };
    let mut out = Listing {
        total,
        rows: Vec::new(),
    };
    let mut matching = 0u64;
    for (m, due) in raw {
        let v: Value = serde_json::from_str(&m).unwrap_or(Value::Null);
        let due = due as i64;
        let q = v["queue"].as_str().unwrap_or("").to_string();
        if queue.is_some_and(|want| want != q) {
            continue;
        }
        matching += 1;
        if out.rows.len() >= limit {
            continue;
        }
        let class = v["payload"]
            .as_str()
            .and_then(|p| serde_json::from_str::<Value>(p).ok())
            .and_then(|p| p["class"].as_str().map(str::to_string))
            .unwrap_or_default();
        out.rows
            .push(json!({"rid": v["rid"], "queue": q, "class": class,
                        "reason": v["reason"], "resource": v["resource"],
                        "attempt": v["attempt"], "due_ms": due, "due_in_ms": due - now,
                        "payload": v["payload"]}));
    }
    if queue.is_some() {
        out.total = matching;
    }
    Ok(out)
}

/// The O-3 events of the last `minutes` minutes (at most 480), one map per minute, oldest
/// first, read in one pipeline from the `metrics:<minute>` buckets: (epoch minute, counts).
pub async fn read_minutes<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    minutes: u64,
) -> RedisResult<Vec<(u64, HashMap<String, i64>)>> {
    let now = now_ms(conn).await?;
    let this_minute = (now / 60_000) as u64;
    let first = (this_minute + 1).saturating_sub(minutes.min(480));
    if minutes == 0 {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for m in first..=this_minute {
        pipe.hgetall(keys.metrics(m));
    }
    let replies: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
    Ok((first..=this_minute)
        .zip(replies)
        .map(|(m, r)| (m, redis::from_redis_value(r).unwrap_or_default()))
        .collect())
}
