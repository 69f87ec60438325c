//! Where `locketd why`'s job is ([`locate`]; why it waits is `reasons.rs`'s). Every read is
//! bounded: the queue gets one `LPOS`, parked lists, `delayed` and the failure list are read in
//! pages up to a ceiling, and the rest are single keys.

use super::{host_of, num, JobFacts, Place, Slot, Target};
use super::{UniqueFacts, WhyError};
use crate::config::plans::{Plans, UniquePlan};
use crate::config::Config;
use crate::locks::template::RenderInput;
use crate::resque::failure::FailureBackend;
use crate::resque::keys::Keys;
use crate::resque::payload::Job;
use crate::store;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::{json, Value};

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
    /// The member or handoff token a woken job's unit has: `~` and its payload's SHA1 (PK-3).
    pub unit: &'a str,
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
