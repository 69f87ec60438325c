//! The Resque worker registry: registration, heartbeats, unregistration and Resque's own
//! pruning rules (resque-protocol.md §4, checklist 11-18).
//!
//! ```text
//! 127.0.0.1:6379> SMEMBERS resque:workers
//! 1) "vm:4242:high,low"
//! 127.0.0.1:6379> GET resque:worker:vm:4242:high,low:started
//! "2026-11-21 12:18:29 +0000"
//! 127.0.0.1:6379> HGET resque:workers:heartbeat vm:4242:high,low
//! "2026-11-21T12:18:29+00:00"
//! ```

use crate::host;
use crate::resque::failure::FailureBackend;
use crate::resque::failure::JobFailure;
use crate::resque::keys::Keys;
use crate::resque::time;
use crate::store::scripts::scripts;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde_json::value::RawValue;
use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

/// Resque's prune threshold: a heartbeat older than this is a dead worker.
pub const PRUNE_AGE: Duration = Duration::from_secs(300);

/// One registered slot: its Resque id and the locket process it belongs to.
#[derive(Debug, Clone)]
pub struct Registration<'a> {
    /// Key names.
    pub keys: &'a Keys,
    /// `host:pid:queues`.
    pub worker_id: &'a str,
    /// `host:pid:incarnation`.
    pub process_id: &'a str,
    /// Slot number.
    pub slot: u32,
}

/// Registers the slot as a Resque worker and the process as live (checklist 12, R-1).
pub async fn register<C: ConnectionLike + Send>(
    conn: &mut C,
    reg: &Registration<'_>,
    alive_json: &str,
    process_ttl: Duration,
) -> RedisResult<String> {
    let k = reg.keys;
    scripts()
        .register
        .key(k.heartbeat())
        .key(k.workers())
        .key(k.worker_started(reg.worker_id))
        .key(k.processes())
        .key(k.slots(reg.process_id))
        .key(k.alive(reg.process_id))
        .arg(reg.worker_id)
        .arg(time::started_at(SystemTime::now()))
        .arg(reg.process_id)
        .arg(reg.slot)
        .arg(alive_json)
        .arg(u64::try_from(process_ttl.as_millis()).unwrap_or(u64::MAX))
        .invoke_async(conn)
        .await
}

/// Renews the process lease and the Resque heartbeats. Returns false when the lease was gone:
/// the process is presumed dead and must stop (R-2).
pub async fn heartbeat<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    process_id: &str,
    worker_ids: &[&str],
    process_ttl: Duration,
) -> RedisResult<bool> {
    let mut inv = scripts().heartbeat.prepare_invoke();
    inv.key(keys.alive(process_id))
        .key(keys.heartbeat())
        .arg(u64::try_from(process_ttl.as_millis()).unwrap_or(u64::MAX));
    for id in worker_ids {
        inv.arg(*id);
    }
    let reply: String = inv.invoke_async(conn).await?;
    Ok(reply == "ok")
}

/// Removes the slot's Resque registration and, with its last slot, the process (checklist 16,
/// R-8). A reservation the slot still holds keeps the slot listed for the janitor (R-4).
pub async fn unregister<C: ConnectionLike + Send>(
    conn: &mut C,
    reg: &Registration<'_>,
) -> RedisResult<()> {
    let k = reg.keys;
    let _: String = scripts()
        .unregister
        .key(k.workers())
        .key(k.worker(reg.worker_id))
        .key(k.worker_started(reg.worker_id))
        .key(k.heartbeat())
        .key(k.stat_processed_by(reg.worker_id))
        .key(k.stat_failed_by(reg.worker_id))
        .key(k.processes())
        .key(k.slots(reg.process_id))
        .key(k.alive(reg.process_id))
        .key(k.inflight(&format!("{}:{}", reg.process_id, reg.slot)))
        .arg(reg.worker_id)
        .arg(reg.process_id)
        .arg(reg.slot)
        .invoke_async(conn)
        .await?;
    Ok(())
}

/// What a `worker:<id>` record says, as far as pruning needs it. Tolerates every shape of
/// resque-protocol.md §11 (cjson's `args:{}`, missing fields, non-JSON).
#[derive(Debug, Clone, Default)]
pub struct WorkingOn {
    /// `queue`, if a string.
    pub queue: Option<String>,
    /// `payload` verbatim, if JSON.
    pub payload: Option<String>,
    /// `payload.class`, if a string.
    pub class: Option<String>,
}

impl WorkingOn {
    /// Reads a `worker:<id>` value without failing.
    pub fn parse(text: &str) -> WorkingOn {
        #[derive(serde::Deserialize)]
        struct Wire<'a> {
            #[serde(borrow, default)]
            queue: Option<&'a RawValue>,
            #[serde(borrow, default)]
            payload: Option<&'a RawValue>,
        }
        let Ok(w) = serde_json::from_str::<Wire<'_>>(text) else {
            return WorkingOn::default();
        };
        let queue = w
            .queue
            .and_then(|q| serde_json::from_str::<String>(q.get()).ok());
        let class = w.payload.and_then(|p| {
            serde_json::from_str::<serde_json::Value>(p.get())
                .ok()
                .and_then(|v| v.get("class").and_then(|c| c.as_str()).map(str::to_string))
        });
        WorkingOn {
            queue,
            payload: w.payload.map(|p| p.get().to_string()),
            class,
        }
    }
}

/// What one pruning pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Whether this process got the pruning mutex.
    pub ran: bool,
    /// Worker ids unregistered.
    pub pruned: Vec<String>,
}

/// Unregisters one dead Resque worker the way Ruby's `unregister_worker` does, recording a
/// failure for the job it was working on, if any.
async fn prune_one<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    id: &str,
    backend: FailureBackend,
    failure: impl FnOnce(&WorkingOn) -> JobFailure,
) -> RedisResult<()> {
    // Bytes, and a key of another type reads as no record: a leftover in any shape is pruned.
    let working: Option<String> = match redis::cmd("GET")
        .arg(keys.worker(id))
        .query_async::<Option<Vec<u8>>>(conn)
        .await
    {
        Ok(v) => v.map(|b| String::from_utf8_lossy(&b).into_owned()),
        Err(e) if e.code() == Some("WRONGTYPE") => None,
        Err(e) => return Err(e),
    };
    let mut pipe = redis::pipe();
    pipe.atomic();
    if let Some(text) = working.filter(|t| !t.is_empty()) {
        let w = WorkingOn::parse(&text);
        let queue = w.queue.as_deref().unwrap_or("");
        let record = failure(&w).record(
            w.payload.as_deref().unwrap_or("null"),
            id,
            queue,
            SystemTime::now(),
        );
        // Through the configured failure backend, as Ruby's `Failure.create` does.
        match backend {
            FailureBackend::Redis => pipe.rpush(keys.failed(), record).ignore(),
            FailureBackend::RedisMultiQueue => pipe
                .rpush(keys.queue_failed(queue), record)
                .ignore()
                .sadd(keys.failed_queues(), format!("{queue}_failed"))
                .ignore(),
        };
    }
    pipe.srem(keys.workers(), id)
        .ignore()
        .del(&[
            keys.worker(id),
            keys.worker_started(id),
            keys.stat_processed_by(id),
            keys.stat_failed_by(id),
        ])
        .ignore()
        .hdel(keys.heartbeat(), id)
        .ignore();
    pipe.query_async::<()>(conn).await
}

/// Resque's `prune_dead_workers` (checklist 17), run once at start.
///
/// Ids that belong to a locketd process still listed in `<ns>:locket:processes` are left to
/// the janitor, which recovers them with their locks and in-flight records (R-4); pruning them
/// here too would record their running job twice.
pub async fn prune_dead_workers<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    own_id: &str,
    own_queues: &[String],
    backend: FailureBackend,
) -> RedisResult<PruneReport> {
    let got: Option<String> = redis::cmd("SET")
        .arg(keys.pruning())
        .arg(own_id)
        .arg("EX")
        .arg(60)
        .arg("NX")
        .query_async(conn)
        .await?;
    if got.is_none() {
        return Ok(PruneReport::default());
    }
    let mut report = PruneReport {
        ran: true,
        pruned: Vec::new(),
    };
    let processes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.processes())
        .query_async(conn)
        .await?;
    let locket_owned = |id: &str| -> bool {
        let mut parts = id.splitn(3, ':');
        match (parts.next(), parts.next()) {
            (Some(h), Some(p)) => {
                let prefix = format!("{h}:{}:", pid_of(p));
                processes.iter().any(|pid| pid.starts_with(&prefix))
            }
            _ => false,
        }
    };

    // 1. Expired heartbeats, any host, any queues, registered or not.
    let beats: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.heartbeat())
        .query_async::<Vec<(Vec<u8>, Vec<u8>)>>(conn)
        .await?
        .into_iter()
        .map(|(id, beat)| {
            (
                String::from_utf8_lossy(&id).into_owned(),
                String::from_utf8_lossy(&beat).into_owned(),
            )
        })
        .collect();
    let (now, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let mut done: HashSet<String> = HashSet::new();
    for (id, beat) in beats {
        let Some(at) = time::parse_heartbeat(&beat) else {
            continue;
        };
        if id == own_id || now.saturating_sub(at) <= PRUNE_AGE.as_secs() || locket_owned(&id) {
            continue;
        }
        prune_one(conn, keys, &id, backend, |w| {
            JobFailure::new(
                "Resque::PruneDeadWorkerDirtyExit",
                format!(
                    "Worker {id} did not gracefully exit while processing {}",
                    w.class.as_deref().unwrap_or("<Unknown Job>")
                ),
            )
            .dirty()
        })
        .await?;
        done.insert(id.clone());
        report.pruned.push(id);
    }

    // 2. Host-local: same host, same queue set (or we listen on `*`), pid not a live worker:
    // dead, or a locketd process other than a registered worker.
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.workers())
        .query_async(conn)
        .await?;
    let me = host::hostname();
    let wildcard = own_queues.iter().any(|q| q == "*");
    let mine: BTreeSet<&str> = own_queues.iter().map(String::as_str).collect();
    let mut live: Option<HashSet<u32>> = None;
    for id in members {
        if id == own_id || done.contains(&id) || locket_owned(&id) {
            continue;
        }
        // Ruby's pruner splits on every ':' (a queue name with ':' is cut short).
        let parts: Vec<&str> = id.split(':').collect();
        if parts.len() < 3 || parts[0] != me {
            continue;
        }
        let theirs: BTreeSet<&str> = parts[2].split(',').collect();
        if !wildcard && theirs != mine {
            continue;
        }
        // Resque's rule keeps a pid that shows a Resque worker's command line. Better than
        // the rule, a live pid that is neither a locketd nor a Resque process is kept too: a
        // pyres or node-resque worker (they write no heartbeat, so this check is the only
        // one that could prune them, and their command lines never pass Resque's grep).
        let pids = live.get_or_insert_with(host::resque_worker_pids);
        if pid_of(parts[1])
            .parse::<u32>()
            .is_ok_and(|p| pids.contains(&p) || (host::pid_alive(p) && !host::pid_is_locketd(p)))
        {
            continue;
        }
        prune_one(conn, keys, &id, backend, |_| {
            JobFailure::new("Resque::DirtyExit", "Job still being processed").dirty()
        })
        .await?;
        report.pruned.push(id);
    }
    Ok(report)
}

/// The process id in the pid part of a worker id: `4580` of Ruby's `host:4580:q`, and of a
/// slot's `host:4580+2:q` (locketd's multi-slot mode and node-resque's multi-worker form).
pub fn pid_of(part: &str) -> &str {
    part.split('+').next().unwrap_or(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    // resque-protocol.md §13 item 18: foreign worker records never break the reader.
    #[test]
    fn working_on_records_of_every_shape_parse() {
        let w = WorkingOn::parse(
            r#"{"run_at":"Sat Nov 21 2026","worker":"h:1","payload":{"class":"X","args":{}},"queue":"q"}"#,
        );
        assert_eq!(w.class.as_deref(), Some("X"));
        assert_eq!(w.queue.as_deref(), Some("q"));
        assert_eq!(w.payload.as_deref(), Some(r#"{"class":"X","args":{}}"#));
        let w = WorkingOn::parse("not json");
        assert!(w.class.is_none() && w.payload.is_none());
        let w = WorkingOn::parse(r#"{"queue":5,"payload":"str"}"#);
        assert!(w.class.is_none() && w.queue.is_none());
    }
}
