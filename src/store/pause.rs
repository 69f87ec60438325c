//! Operator pause of queues (locking-semantics.md A-20): resque-pause's keys
//! `<ns>:pause:queue:<q>` and `<ns>:pause:all`, set and deleted by `pause.lua`, read here for
//! `status`, the web page and `/metrics`. RESERVE reads them itself, in its own script. And the
//! other operator control of a queue's jobs: the cancel of a job.

use super::scripts::scripts;
use crate::conn::evalsha;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;

/// What pauses a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseState {
    /// Not paused.
    Running,
    /// `<ns>:pause:queue:<q>` exists.
    Queue,
    /// `<ns>:pause:all` exists.
    All,
}

impl PauseState {
    /// Whether RESERVE passes the queue over.
    pub fn is_paused(self) -> bool {
        self != PauseState::Running
    }
}

/// Pauses (`on`) or resumes `queues`, or every queue (`None`: `<ns>:pause:all`). Returns how
/// many keys changed. A key of another type refuses the whole call before any write (S-6).
pub async fn set_paused<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: Option<&[String]>,
    on: bool,
) -> RedisResult<u64> {
    let names: Vec<String> = match queues {
        Some(qs) => qs.iter().map(|q| keys.pause_queue(q)).collect(),
        None => vec![keys.pause_every_queue()],
    };
    evalsha(conn, &scripts().pause, names.len(), |cmd| {
        for k in &names {
            cmd.arg(k.as_str());
        }
        cmd.arg(if on { "pause" } else { "resume" });
    })
    .await
}

/// The pause state of each of `queues`, in order, read with one pipeline of `EXISTS` (a key of
/// any type pauses, as RESERVE reads it).
pub async fn pause_states<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: &[String],
) -> RedisResult<Vec<PauseState>> {
    let mut pipe = redis::pipe();
    pipe.cmd("EXISTS").arg(keys.pause_every_queue());
    for q in queues {
        pipe.cmd("EXISTS").arg(keys.pause_queue(q));
    }
    let found: Vec<bool> = pipe.query_async(conn).await?;
    let all = found.first().copied().unwrap_or(false);
    Ok(queues
        .iter()
        .enumerate()
        .map(|(i, _)| {
            if all {
                PauseState::All
            } else if found.get(i + 1).copied().unwrap_or(false) {
                PauseState::Queue
            } else {
                PauseState::Running
            }
        })
        .collect())
}

/// Records a cancel request for reservation `rid` of slot `slot_key` (of process
/// `process`): a running job's in the process's cancel hash, read by that process within a
/// second; a job that has not started (reserved, waiting on its lock) in `cancel_start:<rid>`,
/// which the step that would start it takes instead. Returns the reservation's state
/// (`reserved`, `waiting`, `running`), or `None` when the slot no longer holds `rid` (nothing
/// written).
pub async fn request_cancel<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    process: &str,
    slot_key: &str,
    rid: &str,
    request: &str,
    keep: std::time::Duration,
) -> RedisResult<Option<String>> {
    let state: String = evalsha(conn, &scripts().cancel, 3, |cmd| {
        cmd.arg(keys.inflight(slot_key))
            .arg(keys.cancel(process))
            .arg(keys.cancel_start(rid))
            .arg(rid)
            .arg(request)
            .arg(u64::try_from(keep.as_millis()).unwrap_or(u64::MAX));
    })
    .await?;
    Ok((state != "gone").then_some(state))
}

/// Where a cancel request stands, read in one atomic step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelProgress {
    /// Not taken yet: the request is still there and the slot holds the job.
    Pending,
    /// Taken by the job's worker, whose end of the job is not recorded yet.
    Taken,
    /// Taken, and the job has left its slot: its end (the cancel) is recorded.
    Done,
    /// The job left its slot without taking the request: it ended some other way first.
    Missed,
}

/// Reads where the cancel request for reservation `rid` of `slot_key` stands: `running` says
/// which request it is (the process's cancel hash, or `cancel_start:<rid>`).
pub async fn cancel_progress<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    process: &str,
    slot_key: &str,
    rid: &str,
    running: bool,
) -> RedisResult<CancelProgress> {
    let mut pipe = redis::pipe();
    pipe.atomic();
    if running {
        pipe.hexists(keys.cancel(process), rid);
    } else {
        pipe.exists(keys.cancel_start(rid));
    }
    pipe.hget(keys.inflight(slot_key), "rid");
    let (asked, held): (bool, Option<String>) = pipe.query_async(conn).await?;
    let held = held.as_deref() == Some(rid);
    Ok(match (asked, held) {
        (true, true) => CancelProgress::Pending,
        (false, true) => CancelProgress::Taken,
        (false, false) => CancelProgress::Done,
        (true, false) => CancelProgress::Missed,
    })
}

/// Withdraws a cancel request that nothing will take any more (its job ended first).
pub async fn withdraw_cancel<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    process: &str,
    rid: &str,
) -> RedisResult<()> {
    let mut pipe = redis::pipe();
    pipe.hdel(keys.cancel(process), rid)
        .ignore()
        .del(keys.cancel_start(rid))
        .ignore();
    pipe.query_async(conn).await
}

/// A job that waits with no worker holding it: parked (PK-1) or delayed (P-4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiting {
    /// Parked on `resource` (`lock:<id>`, `dep:<name>`, `rate:<key>`).
    Parked {
        /// What it waits for.
        resource: String,
    },
    /// In the `delayed` set.
    Delayed,
}

/// One parked or delayed job, as its entry holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingJob {
    /// Where it waits.
    pub waiting: Waiting,
    /// The exact entry (list element or set member).
    pub entry: Vec<u8>,
    /// Its queue.
    pub queue: String,
    /// Its payload.
    pub payload: String,
}

/// Finds the parked or delayed job whose entry names reservation `rid`, reading the lists
/// through the `parked` index and the `delayed` set in bounded pages (never KEYS).
pub async fn find_waiting<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    rid: &str,
) -> RedisResult<Option<WaitingJob>> {
    const PAGE: i64 = 1000;
    let named = |entry: &[u8]| -> Option<(String, String)> {
        let v: serde_json::Value = serde_json::from_slice(entry).ok()?;
        (v["rid"].as_str()? == rid).then(|| {
            (
                v["queue"].as_str().unwrap_or("").to_string(),
                v["payload"].as_str().unwrap_or("").to_string(),
            )
        })
    };
    let resources = super::parked_resources(conn, keys, 100_000).await?;
    for res in resources {
        let list = super::parked_list(keys, &res);
        let mut from = 0i64;
        loop {
            let page: Vec<Vec<u8>> = match redis::cmd("LRANGE")
                .arg(&list)
                .arg(from)
                .arg(from + PAGE - 1)
                .query_async(conn)
                .await
            {
                Ok(p) => p,
                // A list of another type (S-6) holds no job to find.
                Err(e) if crate::conn::is_refusal(&e) => break,
                Err(e) => return Err(e),
            };
            for e in &page {
                if let Some((queue, payload)) = named(e) {
                    return Ok(Some(WaitingJob {
                        waiting: Waiting::Parked { resource: res },
                        entry: e.clone(),
                        queue,
                        payload,
                    }));
                }
            }
            if (page.len() as i64) < PAGE {
                break;
            }
            from += PAGE;
        }
    }
    let mut from = 0i64;
    loop {
        let page: Vec<Vec<u8>> = match redis::cmd("ZRANGE")
            .arg(keys.delayed())
            .arg(from)
            .arg(from + PAGE - 1)
            .query_async(conn)
            .await
        {
            Ok(p) => p,
            Err(e) if crate::conn::is_refusal(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        for e in &page {
            if let Some((queue, payload)) = named(e) {
                return Ok(Some(WaitingJob {
                    waiting: Waiting::Delayed,
                    entry: e.clone(),
                    queue,
                    payload,
                }));
            }
        }
        if (page.len() as i64) < PAGE {
            return Ok(None);
        }
        from += PAGE;
    }
}

/// Cancels a parked or delayed job in one step: its entry is removed, if still there,
/// and `record` (a Resque failure record) pushed to `failed_list`, or with `None` the job goes
/// to the tail of its queue. `failed_queue`: the `<q>_failed` name the `redis_multi_queue`
/// backend indexes. Returns `Some("failed" | "requeued")`, or `None` when the entry had gone
/// meanwhile (nothing written).
pub async fn cancel_waiting<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    job: &WaitingJob,
    record: Option<&str>,
    failed_list: &str,
    failed_queue: Option<&str>,
) -> RedisResult<Option<String>> {
    let (kind, holder, resource) = match &job.waiting {
        Waiting::Parked { resource } => (
            "parked",
            super::parked_list(keys, resource),
            resource.as_str(),
        ),
        Waiting::Delayed => ("delayed", keys.delayed(), ""),
    };
    let done: String = evalsha(conn, &scripts().cancel_parked, 8, |cmd| {
        cmd.arg(holder)
            .arg(failed_list)
            .arg(keys.stat_failed())
            .arg(keys.failed_queues())
            .arg(keys.queue(&job.queue))
            .arg(keys.queues())
            .arg(super::parked_queues_key(keys))
            .arg(super::parked_index(keys))
            .arg(kind)
            .arg(&job.entry)
            .arg(record.unwrap_or(""))
            .arg(&job.queue)
            .arg(resource)
            .arg(failed_queue.unwrap_or(""))
            .arg(&job.payload);
    })
    .await?;
    Ok((done != "gone").then_some(done))
}

/// writes the fleet-wide caps of the config (`[queue.<q>] concurrency = N`) to
/// `<ns>:locket:cap:<q>`, where every daemon's RESERVE reads them.
pub async fn publish_caps<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    caps: &[(String, u32)],
) -> RedisResult<()> {
    if caps.is_empty() {
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for (q, n) in caps {
        pipe.set(keys.cap(q), *n).ignore();
    }
    pipe.query_async(conn).await
}

/// frees the units of `queue` whose reservation is over without a FINISH having freed
/// them (the job was requeued or parked by its ACQUIRE, returned, or its record is gone).
/// A member names its reservation and its slot record, so a unit is lapsed when the record no
/// longer holds that rid; nothing re-adds a member once lapsed (rids are never reused).
/// Returns the number freed.
pub async fn free_lapsed_units<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queue: &str,
) -> RedisResult<u64> {
    let running = keys.running(queue);
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&running)
        .query_async(conn)
        .await?;
    if members.is_empty() {
        return Ok(0);
    }
    let mut pipe = redis::pipe();
    for m in &members {
        let inflight = m.split_once(' ').map(|(_, k)| k).unwrap_or("");
        pipe.hget(inflight, "rid");
    }
    let rids: Vec<Option<String>> = pipe.query_async(conn).await?;
    let lapsed: Vec<&String> = members
        .iter()
        .zip(rids)
        .filter(|(m, rid)| {
            let want = m.split_once(' ').map(|(r, _)| r).unwrap_or(m.as_str());
            rid.as_deref() != Some(want)
        })
        .map(|(m, _)| m)
        .collect();
    if lapsed.is_empty() {
        return Ok(0);
    }
    redis::cmd("SREM")
        .arg(&running)
        .arg(&lapsed)
        .query_async(conn)
        .await
}

/// `(running, cap)` of each of `queues`; `cap` is `None` for a queue without one.
pub async fn cap_states<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    queues: &[String],
) -> RedisResult<Vec<(u64, Option<u64>)>> {
    if queues.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for q in queues {
        pipe.get(keys.cap(q)).scard(keys.running(q));
    }
    let flat: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
    Ok(flat
        .chunks(2)
        .map(|c| {
            let cap = redis::from_redis_value::<Option<String>>(c[0].clone())
                .ok()
                .flatten()
                .and_then(|s| s.trim().parse().ok());
            let running = redis::from_redis_value::<u64>(c[1].clone()).unwrap_or(0);
            (running, cap)
        })
        .collect())
}
