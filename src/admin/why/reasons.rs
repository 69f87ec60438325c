//! Why a job waits, once `locketd why` has found it: each reason a worker would meet, read
//! with single-key reads (and one pipeline per 100 processes for the fleet's reports).

use super::find::Ctx;
use super::{host_of, HoldField, HolderFacts, Reason, Slot};
use crate::config::plans::RenderedPlan;
use crate::resque::payload::Job;
use crate::store;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::{json, Value};
use std::collections::HashMap;

/// Where a waiting job is, for the reasons that apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// In its queue: every reason, the skip rule too.
    Queued,
    /// Parked or delayed: back in its queue later, where the queue's reasons apply.
    Away,
    /// Reserved by a slot: past the queue's reasons (no worker, pause, cap).
    Reserved,
}

/// Why a job of `job`'s queue and plan waits now: every reason found, in the order a worker
/// meets them (the queue's pause, cap and skip; its handler; its locks, holds and rates).
pub(super) async fn reasons<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    job: &Job,
    rendered: &RenderedPlan,
    stage: Stage,
) -> RedisResult<Vec<Reason>> {
    let mut out = Vec::new();
    if stage != Stage::Reserved {
        queue_reasons(conn, ctx, &job.queue, stage == Stage::Queued, &mut out).await?;
    }
    if let Some(r) = handler_reason(conn, ctx, &job.class).await? {
        out.push(r);
    }
    lock_reasons(conn, ctx, rendered, &mut out).await?;
    for name in &rendered.locked_by {
        if let Some(r) = hold_reason(conn, ctx, name, rendered).await? {
            out.push(r);
        }
    }
    for r in &rendered.rates {
        let period = r.period.as_millis() as u64;
        let st =
            store::rate_state(conn, ctx.keys, &r.key, r.limit, period, r.spread, ctx.now).await?;
        if st.allowed_now == 0 {
            out.push(Reason::Rate {
                key: r.key.clone(),
                limit: r.limit,
                period_ms: period,
                used: st.used,
                closed_until_ms: st.closed_until_ms,
                until_ms: st.next_allowed_ms,
            });
        }
    }
    Ok(out)
}

/// The queue's own reasons: no live worker, a pause, a full cap, and (`queued`) the skip rule.
async fn queue_reasons<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    q: &str,
    queued: bool,
    out: &mut Vec<Reason>,
) -> RedisResult<()> {
    let (keys, now) = (ctx.keys, ctx.now);
    let q = q.to_string();
    let qs = [q.clone()];
    if let Some(r) = worker_reason(conn, ctx, &q).await? {
        out.push(r);
    }
    match store::pause_states(conn, keys, &qs).await?.first() {
        Some(store::PauseState::Queue) => out.push(Reason::Paused {
            scope: q.clone(),
            key: keys.pause_queue(&q),
        }),
        Some(store::PauseState::All) => out.push(Reason::Paused {
            scope: "*".into(),
            key: keys.pause_every_queue(),
        }),
        _ => {}
    }
    if let Some((running, Some(cap))) = store::cap_states(conn, keys, &qs).await?.first() {
        if running >= cap {
            out.push(cap_reason(conn, ctx, &q, *cap, *running).await?);
        }
    }
    if queued {
        let (counter, ttl, len): (Option<String>, i64, u64) = redis::pipe()
            .get(keys.counter(&q))
            .cmd("PTTL")
            .arg(keys.counter(&q))
            .llen(keys.queue(&q))
            .ignore_errors()
            .query_async(conn)
            .await
            .unwrap_or((None, -2, 0));
        let counter = counter.and_then(|c| c.trim().parse::<u64>().ok());
        if let Some(c) = counter.filter(|c| len > 0 && *c >= len) {
            out.push(Reason::Skipped {
                queue: q.clone(),
                counter: c,
                length: len,
                until_ms: (ttl > 0).then(|| now + ttl as u64),
            });
        }
    }
    Ok(())
}

/// Each of the job's locks that is full, with its holders. A unit kept for this very job (it
/// was woken from the lock's parked list, PK-3: the holder `~<SHA1 of its payload>`, or
/// `~<its digest>` from an earlier version) is its own, not a holder in its way.
async fn lock_reasons<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    rendered: &RenderedPlan,
    out: &mut Vec<Reason>,
) -> RedisResult<()> {
    let (keys, now) = (ctx.keys, ctx.now);
    let mine = format!("~{}", ctx.digest);
    for l in &rendered.locks {
        let mut live: Vec<_> = store::holders(conn, keys, &l.id)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|h| h.deadline_ms > now)
            .collect();
        live.retain(|h| h.token != mine && h.token != ctx.unit);
        if live.is_empty() || (live.len() as u64) < u64::from(l.limit) {
            continue;
        }
        let parked = store::parked_counts(conn, keys, &[format!("lock:{}", l.id)])
            .await?
            .first()
            .copied()
            .unwrap_or(0);
        let holders: Vec<HolderFacts> = live.iter().map(holder_facts).collect();
        out.push(Reason::Lock {
            lock_id: l.id.clone(),
            limit: l.limit,
            until_ms: holders.iter().map(|h| h.lease_end_ms).min(),
            holders,
            parked,
        });
    }
    Ok(())
}

fn holder_facts(h: &store::Holder) -> HolderFacts {
    let info = h.info.clone().unwrap_or(Value::Null);
    let process = info["process"].clone();
    HolderFacts {
        worker: info["resque_worker"].clone(),
        host: process.as_str().map(host_of),
        process,
        class: info["class"].clone(),
        queue: info["queue"].clone(),
        since_ms: info["acquired_at"].as_f64().map(|a| a as u64),
        lease_end_ms: h.deadline_ms,
        token: super::super::token_prefix(&h.token).to_string(),
        handoff: info["handoff"] == true || h.token.starts_with('~'),
    }
}

async fn cap_reason<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    q: &str,
    cap: u64,
    running: u64,
) -> RedisResult<Reason> {
    let members: Vec<String> = redis::cmd("SRANDMEMBER")
        .arg(ctx.keys.running(q))
        .arg(20)
        .query_async(conn)
        .await
        .unwrap_or_default();
    let mut units: Vec<Value> = members
        .iter()
        .map(|m| {
            let (rid, inflight) = m.split_once(' ').unwrap_or((m.as_str(), ""));
            let worker = ctx
                .slots
                .iter()
                .find(|s| ctx.keys.inflight(&s.key) == inflight)
                .map(|s| s.worker.clone());
            json!({"rid": rid, "worker": worker})
        })
        .collect();
    units.sort_by_key(|u| u["rid"].as_str().unwrap_or("").to_string());
    Ok(Reason::Cap {
        queue: q.to_string(),
        cap,
        running,
        units,
    })
}

async fn hold_reason<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    name: &str,
    rendered: &RenderedPlan,
) -> RedisResult<Option<Reason>> {
    let raw: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(ctx.keys.dep(name))
        .query_async(conn)
        .await
        .unwrap_or_default();
    let own_hold = rendered.enqueue_holds.iter().any(|h| h == name);
    let mut fields = Vec::new();
    let mut blocking = 0i64;
    let mut until = None;
    let mut raw: Vec<_> = raw.into_iter().collect();
    raw.sort();
    for (digest, v) in raw {
        let (count, deadline) = v.split_once(':').unwrap_or(("0", "0"));
        let count: i64 = count.parse().unwrap_or(0);
        let deadline = deadline.parse::<f64>().unwrap_or(0.0).max(0.0) as u64;
        if count <= 0 || deadline <= ctx.now {
            continue;
        }
        let own = own_hold && digest == ctx.digest;
        let counts = if own { count - 1 } else { count };
        if counts > 0 {
            blocking += counts;
            until = until.max(Some(deadline));
        }
        let owners = ctx
            .slots
            .iter()
            .filter(|s| s.rec.get("digest") == Some(&digest))
            .map(|s| {
                json!({"worker": s.worker, "class": s.rec.get("class"),
                       "state": s.rec.get("state")})
            })
            .collect();
        fields.push(HoldField {
            digest,
            count,
            deadline_ms: deadline,
            own,
            owners,
        });
    }
    Ok((blocking > 0).then(|| Reason::Hold {
        name: name.to_string(),
        fields,
        until_ms: until,
    }))
}

/// The locketd processes of `slots` (`host:pid:incarnation`), each once.
fn processes(slots: &[Slot]) -> Vec<&str> {
    let mut out: Vec<&str> = slots
        .iter()
        .filter_map(|s| s.key.rsplit_once(':').map(|(p, _)| p))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// no live process (its `alive:` lease held) has `queue` in its queue list.
async fn worker_reason<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    queue: &str,
) -> RedisResult<Option<Reason>> {
    let processes = processes(ctx.slots);
    let mut live = 0u64;
    for chunk in processes.chunks(100) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.get(ctx.keys.alive(p));
        }
        let values: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for v in values {
            let Ok(Some(text)) = redis::from_redis_value::<Option<String>>(v) else {
                continue;
            };
            live += 1;
            let info: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let list = info["queues"].as_str().unwrap_or("");
            let Ok(spec) = crate::resque::patterns::QueueSpec::parse(list) else {
                // A list this build cannot read: assume it serves the queue.
                return Ok(None);
            };
            if super::serves(&spec, queue) {
                return Ok(None);
            }
        }
    }
    Ok(Some(Reason::NoWorker {
        queue: queue.to_string(),
        processes: live,
    }))
}

/// H-8: the class's persistent handler, when no slot that reports it has it ready.
async fn handler_reason<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    class: &str,
) -> RedisResult<Option<Reason>> {
    let classes = &ctx.config.classes;
    let Some(name) = classes
        .get(class)
        .or_else(|| classes.get("*"))
        .and_then(|c| c.handler.clone())
    else {
        return Ok(None);
    };
    let persistent = ctx
        .config
        .handlers
        .get(&name)
        .is_some_and(|t| t.mode == crate::config::HandlerMode::Persistent);
    if !persistent {
        return Ok(None);
    }
    let processes = processes(ctx.slots);
    let mut reports: Vec<crate::metrics::HandlerStats> = Vec::new();
    for chunk in processes.chunks(100) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.get(ctx.keys.handlers(p));
        }
        let texts: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for t in texts {
            let text: Option<String> = redis::from_redis_value(t).unwrap_or(None);
            let list: Vec<crate::metrics::HandlerStats> = text
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default();
            reports.extend(list.into_iter().filter(|h| h.name == name));
        }
    }
    if reports.is_empty() || reports.iter().any(|h| h.ready) {
        return Ok(None);
    }
    Ok(Some(Reason::HandlerNotReady {
        handler: name,
        slots: reports.len() as u64,
        last_error: reports
            .iter()
            .map(|h| h.last_error.clone())
            .find(|e| !e.is_empty())
            .unwrap_or_default(),
        until_ms: reports
            .iter()
            .map(|h| h.backoff_ms)
            .filter(|b| *b > 0)
            .min()
            .map(|b| ctx.now + b),
    }))
}
