//! The reads behind `locketd why`: where the job is ([`locate`]) and why it waits
//! ([`reasons`]). Every read is bounded: the queue gets one `LPOS`, parked lists, `delayed`
//! and the failure list are read in pages up to a ceiling, and the rest are single keys.

use super::{host_of, num, HoldField, HolderFacts, JobFacts, Place, Reason, Slot, Target};
use super::{UniqueFacts, WhyError};
use crate::config::plans::{Plans, RenderedPlan, UniquePlan};
use crate::config::Config;
use crate::locks::template::RenderInput;
use crate::resque::failure::FailureBackend;
use crate::resque::keys::Keys;
use crate::resque::payload::Job;
use crate::store;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::{json, Value};
use std::collections::HashMap;

/// Entries read per page of a parked list or of `delayed`.
const PAGE: usize = 500;
/// Most parked-list and `delayed` entries read in all to find a job by its rid.
const RID_BUDGET: usize = 20_000;
/// Most entries read of one parked list to find a payload.
const LIST_BUDGET: usize = 10_000;
/// Most parked resources looked through to find a rid.
const RESOURCES: usize = 1_000;
/// The newest failure records read.
const FAILED_TAIL: usize = 1_000;

/// The job and where it is.
pub(super) struct Found {
    pub job: Option<JobFacts>,
    pub place: Place,
}

/// What the reasons need besides the job.
pub(super) struct Ctx<'a> {
    pub keys: &'a Keys,
    pub config: &'a Config,
    pub slots: &'a [Slot],
    pub now: u64,
    pub digest: &'a str,
}

fn facts(queue: &str, payload: &str, rid: Option<&str>) -> JobFacts {
    let job = Job::decode(payload.as_bytes(), queue, 0).ok();
    JobFacts {
        queue: queue.to_string(),
        class: job.as_ref().map_or("?".into(), |j| j.class.clone()),
        args: job.as_ref().map_or(Value::Null, |j| j.args.clone()),
        digest: job
            .as_ref()
            .map(|j| crate::locks::canonical::digest(&j.class, &j.args)),
        payload: payload.to_string(),
        rid: rid.map(str::to_string),
    }
}

/// The place of a job a worker slot holds.
fn slot_place(s: &Slot) -> Place {
    let host = host_of(&s.worker);
    match s.rec.get("state").map(String::as_str) {
        Some("running") => Place::Running {
            worker: s.worker.clone(),
            host,
            since_ms: num(s.rec.get("started_at")),
            locks: s
                .rec
                .get("locks")
                .and_then(|l| serde_json::from_str(l).ok())
                .unwrap_or(json!([])),
        },
        step => Place::Reserved {
            step: step.unwrap_or("reserved").to_string(),
            worker: s.worker.clone(),
            host,
            since_ms: num(s.rec.get("reserved_at")),
        },
    }
}

/// A list entry or set member (JSON with `rid`, `queue`, `payload`) that `want` accepts.
fn entry_matches(e: &[u8], want: &(dyn Fn(&Value) -> bool + Sync)) -> Option<Value> {
    let v: Value = serde_json::from_slice(e).ok()?;
    want(&v).then_some(v)
}

/// Looks through the parked list of `resource` from its head, at most `budget` entries:
/// (position, length, entry) of the first that `want` accepts, and the entries read.
async fn search_parked<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resource: &str,
    budget: usize,
    want: &(dyn Fn(&Value) -> bool + Sync),
) -> RedisResult<(Option<(u64, Value)>, usize)> {
    let list = store::parked_list(keys, resource);
    let mut read = 0usize;
    while read < budget {
        let n = PAGE.min(budget - read);
        let page: Vec<Vec<u8>> = match redis::cmd("LRANGE")
            .arg(&list)
            .arg(read)
            .arg(read + n - 1)
            .query_async(conn)
            .await
        {
            Ok(p) => p,
            Err(e) if crate::conn::is_refusal(&e) => break,
            Err(e) => return Err(e),
        };
        for (i, e) in page.iter().enumerate() {
            if let Some(v) = entry_matches(e, want) {
                return Ok((Some(((read + i) as u64, v)), read + i + 1));
            }
        }
        read += page.len();
        if page.len() < n {
            break;
        }
    }
    Ok((None, read))
}

/// The place of a parked entry found at `position` of `resource`'s list.
async fn parked_place<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    resource: &str,
    position: u64,
    v: &Value,
) -> RedisResult<Place> {
    let parked = store::parked_counts(conn, keys, &[resource.to_string()])
        .await?
        .first()
        .copied()
        .unwrap_or(0);
    Ok(Place::Parked {
        resource: resource.to_string(),
        position,
        parked,
        parked_at_ms: v["parked_at"].as_f64().unwrap_or(0.0) as u64,
        next_check_ms: store::parked_due(conn, keys, resource).await?,
    })
}

/// Looks through `delayed` by due time, at most `budget` members: the first `want` accepts.
async fn search_delayed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    budget: usize,
    want: &(dyn Fn(&Value) -> bool + Sync),
) -> RedisResult<(Option<(Value, u64)>, usize)> {
    let mut read = 0usize;
    while read < budget {
        let n = PAGE.min(budget - read);
        let page: Vec<(Vec<u8>, f64)> = match redis::cmd("ZRANGE")
            .arg(keys.delayed())
            .arg(read)
            .arg(read + n - 1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await
        {
            Ok(p) => p,
            Err(e) if crate::conn::is_refusal(&e) => break,
            Err(e) => return Err(e),
        };
        for (e, due) in &page {
            if let Some(v) = entry_matches(e, want) {
                return Ok((Some((v, *due as u64)), read));
            }
        }
        read += page.len();
        if page.len() < n {
            break;
        }
    }
    Ok((None, read))
}

fn delayed_place(v: &Value, due: u64) -> Place {
    Place::Delayed {
        until_ms: due,
        reason: v["reason"].clone(),
        resource: v["resource"].clone(),
        attempt: v["attempt"].clone(),
    }
}

/// Finds the job `target` names: in a worker slot, its queue, a parked list, `delayed` or the
/// failure list's tail, in that order.
#[allow(clippy::too_many_arguments)]
pub(super) async fn locate<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    plans: &Plans,
    target: &Target,
    slots: &[Slot],
    notes: &mut Vec<String>,
) -> Result<Found, WhyError> {
    match target {
        Target::Rid(rid) => Ok(by_rid(conn, keys, rid, slots, notes).await?),
        Target::Payload { queue, class, args } => {
            let (_, payload) = crate::client::payload_json(class, args).map_err(|e| match e {
                crate::Error::Enqueue(m) => WhyError::BadInput(m),
                other => WhyError::BadInput(other.to_string()),
            })?;
            by_payload(conn, keys, config, plans, queue, &payload, slots, notes).await
        }
    }
}

async fn by_rid<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    rid: &str,
    slots: &[Slot],
    notes: &mut Vec<String>,
) -> RedisResult<Found> {
    if let Some(s) = slots
        .iter()
        .find(|s| s.rec.get("rid").is_some_and(|r| r == rid))
    {
        let queue = s.rec.get("queue").cloned().unwrap_or_default();
        let payload = s.rec.get("payload").cloned().unwrap_or_default();
        return Ok(Found {
            job: Some(facts(&queue, &payload, Some(rid))),
            place: slot_place(s),
        });
    }
    let want = |v: &Value| v["rid"].as_str() == Some(rid);
    let resources = store::parked_resources(conn, keys, RESOURCES).await?;
    let mut budget = RID_BUDGET;
    for res in &resources {
        if budget == 0 {
            break;
        }
        let (hit, read) = search_parked(conn, keys, res, budget, &want).await?;
        budget -= read.min(budget);
        if let Some((pos, v)) = hit {
            let (queue, payload) = (
                v["queue"].as_str().unwrap_or(""),
                v["payload"].as_str().unwrap_or(""),
            );
            return Ok(Found {
                job: Some(facts(queue, payload, Some(rid))),
                place: parked_place(conn, keys, res, pos, &v).await?,
            });
        }
    }
    let (hit, _) = search_delayed(conn, keys, RID_BUDGET, &want).await?;
    if let Some((v, due)) = hit {
        let (queue, payload) = (
            v["queue"].as_str().unwrap_or(""),
            v["payload"].as_str().unwrap_or(""),
        );
        return Ok(Found {
            job: Some(facts(queue, payload, Some(rid))),
            place: delayed_place(&v, due),
        });
    }
    if budget == 0 {
        notes.push(format!(
            "the search stopped after {RID_BUDGET} parked entries: name the job by QUEUE CLASS \
             ARGS to look in the lists of its own locks"
        ));
    }
    notes.push(
        "a rid names one reservation: a job that finished, failed, or went back to its queue \
         (woken, promoted, requeued) no longer has it; name it by QUEUE CLASS ARGS"
            .into(),
    );
    Ok(Found {
        job: None,
        place: Place::NotFound {
            searched: vec![
                "the inflight records of every registered slot".into(),
                format!(
                    "the parked lists of the first {RESOURCES} resources, {RID_BUDGET} entries \
                     in all"
                ),
                format!("the first {RID_BUDGET} entries of the delayed set"),
            ],
        },
    })
}

#[allow(clippy::too_many_arguments)]
async fn by_payload<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    plans: &Plans,
    queue: &str,
    payload: &str,
    slots: &[Slot],
    notes: &mut Vec<String>,
) -> Result<Found, WhyError> {
    let mine = |s: &&Slot| {
        s.rec.get("payload").is_some_and(|p| p == payload)
            && s.rec.get("queue").is_some_and(|q| q == queue)
    };
    if let Some(s) = slots.iter().find(mine) {
        return Ok(Found {
            job: Some(facts(queue, payload, s.rec.get("rid").map(String::as_str))),
            place: slot_place(s),
        });
    }
    // One LPOS: O(N) in the server, but one call and no data back.
    let (pos, len): (Option<u64>, u64) = match redis::pipe()
        .cmd("LPOS")
        .arg(keys.queue(queue))
        .arg(payload)
        .llen(keys.queue(queue))
        .query_async(conn)
        .await
    {
        Ok(r) => r,
        Err(e) if crate::conn::is_refusal(&e) => {
            notes.push(format!("the queue's key cannot be read: {e}"));
            (None, 0)
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(position) = pos {
        return Ok(Found {
            job: Some(facts(queue, payload, None)),
            place: Place::Queued {
                position,
                length: len,
            },
        });
    }
    // Parked: on the resources its plan names.
    let job = Job::decode(payload.as_bytes(), queue, 0).ok();
    let mut resources = Vec::new();
    if let Some(job) = &job {
        let digest = crate::locks::canonical::digest(&job.class, &job.args);
        let mut ignore = Vec::new();
        if let Some(r) = super::render(plans, config, job, &digest, &mut ignore) {
            resources.extend(r.locks.iter().map(|l| format!("lock:{}", l.id)));
            resources.extend(r.locked_by.iter().map(|n| format!("dep:{n}")));
            resources.extend(r.rates.iter().map(|r| format!("rate:{}", r.key)));
        }
    }
    let want = |v: &Value| v["payload"].as_str() == Some(payload) && v["queue"] == queue;
    for res in &resources {
        let (hit, _) = search_parked(conn, keys, res, LIST_BUDGET, &want).await?;
        if let Some((pos, v)) = hit {
            let rid = v["rid"].as_str().map(str::to_string);
            return Ok(Found {
                job: Some(facts(queue, payload, rid.as_deref())),
                place: parked_place(conn, keys, res, pos, &v).await?,
            });
        }
    }
    let (hit, _) = search_delayed(conn, keys, RID_BUDGET, &want).await?;
    if let Some((v, due)) = hit {
        return Ok(Found {
            job: Some(facts(queue, payload, v["rid"].as_str())),
            place: delayed_place(&v, due),
        });
    }
    if let Some(job) = &job {
        if let Some(place) = search_failed(conn, keys, config, job).await? {
            return Ok(Found {
                job: Some(facts(queue, payload, None)),
                place,
            });
        }
    }
    notes.push(
        "a job is found by its payload's exact bytes, as `locketd enqueue` writes them (class \
         first, no spaces); a client that writes other bytes pushes a payload this cannot find"
            .into(),
    );
    Ok(Found {
        job: Some(facts(queue, payload, None)),
        place: Place::NotFound {
            searched: vec![
                "the inflight records of every registered slot".into(),
                format!("the whole queue {queue} (LPOS)"),
                format!(
                    "the first {LIST_BUDGET} entries parked on each lock, hold and rate of its \
                     plan"
                ),
                format!("the first {RID_BUDGET} entries of the delayed set"),
                format!("the newest {FAILED_TAIL} failure records"),
            ],
        },
    })
}

/// The newest record of the failure list's tail whose payload has the job's class and args.
async fn search_failed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    job: &Job,
) -> RedisResult<Option<Place>> {
    let list = match config.failure_backend {
        FailureBackend::Redis => keys.failed(),
        FailureBackend::RedisMultiQueue => keys.queue_failed(&job.queue),
    };
    let read: RedisResult<(u64, Vec<Vec<u8>>)> = redis::pipe()
        .llen(&list)
        .lrange(&list, -(FAILED_TAIL as isize), -1)
        .query_async(conn)
        .await;
    let (len, tail) = match read {
        Ok(r) => r,
        Err(e) if crate::conn::is_refusal(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let first = len.saturating_sub(tail.len() as u64);
    for (i, r) in tail.iter().enumerate().rev() {
        let Ok(v) = serde_json::from_slice::<Value>(r) else {
            continue;
        };
        let p = &v["payload"];
        let args = if p["args"].is_null() {
            json!([])
        } else {
            p["args"].clone()
        };
        if p["class"].as_str() == Some(job.class.as_str()) && args == job.args {
            return Ok(Some(Place::Failed {
                list: list.clone(),
                index: first + i as u64,
                failed_at: v["failed_at"].clone(),
                exception: v["exception"].clone(),
                error: v["error"].clone(),
                worker: v["worker"].clone(),
            }));
        }
    }
    Ok(None)
}

/// The class's unique key, when taken (U-1).
pub(super) async fn unique<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    u: &UniquePlan,
    job: &Job,
    digest: &str,
    now: u64,
) -> RedisResult<Option<UniqueFacts>> {
    let input = RenderInput {
        class: &job.class,
        queue: &job.queue,
        digest,
        args: &job.args,
    };
    let Ok(r) = u.key.render(&input) else {
        return Ok(None);
    };
    let key = keys.locket(&format!("unique:{}", r.id));
    let (held, ttl): (Option<String>, i64) = redis::pipe()
        .get(&key)
        .cmd("PTTL")
        .arg(&key)
        .ignore_errors()
        .query_async(conn)
        .await
        .unwrap_or((None, -2));
    Ok(held.map(|d| UniqueFacts {
        key: r.id,
        own: d == digest,
        digest: d,
        until_ms: (ttl > 0).then(|| now + ttl as u64),
    }))
}

/// Why a job of `job`'s queue and plan waits now: every reason found, in the order a worker
/// meets them (the queue's pause, cap and skip; its handler; its locks, holds and rates).
pub(super) async fn reasons<C: ConnectionLike + Send>(
    conn: &mut C,
    ctx: &Ctx<'_>,
    job: &Job,
    rendered: &RenderedPlan,
    queued: bool,
) -> RedisResult<Vec<Reason>> {
    let (keys, now) = (ctx.keys, ctx.now);
    let q = job.queue.clone();
    let mut out = Vec::new();
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
    if let Some(r) = handler_reason(conn, ctx, &job.class).await? {
        out.push(r);
    }
    for l in &rendered.locks {
        let live: Vec<_> = store::holders(conn, keys, &l.id)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|h| h.deadline_ms > now)
            .collect();
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
    for name in &rendered.locked_by {
        if let Some(r) = hold_reason(conn, ctx, name, rendered).await? {
            out.push(r);
        }
    }
    for r in &rendered.rates {
        let period = r.period.as_millis() as u64;
        let st = store::rate_state(conn, keys, &r.key, r.limit, period, r.spread, now).await?;
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
fn processes<'a>(slots: &'a [Slot]) -> Vec<&'a str> {
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
