//! `locketd status`: one screen that answers "is it working?", read from Redis alone.
//!
//! Reads only Resque's and locket's own index keys (never `KEYS`): `queues` and `LLEN` of each
//! queue, the locket counter of each queue, `workers` with each worker's `worker:<id>`,
//! `:started` and heartbeat, `locket:processes` (which workers are locketd's) with each
//! process's `slots:` and their inflight records' parked marks (E-3), `locket:locks`, the
//! failure list(s), the global stats, and the jobs parked per queue (`locket:parked_queues`,
//! PK-8).
//!
//! ```text
//! $ locketd status
//! redis redis://127.0.0.1:6379/0  namespace resque  at 2026-11-21T13:58:02Z
//! processed 12  failed 2  failures listed 2  locks held 1
//!
//! QUEUE     LENGTH  PARKED  COUNTER  RUNNING/CAP  STATE
//! high           3       0        3  -            skipped (every job waits on a lock)
//! low            0      12        -  2/3          ok
//! ```

use super::unreadable::{self, Unreadable};
use crate::config::Config;
use crate::error::Result;
use crate::resque::keys::Keys;
use crate::resque::patterns::QueueSpec;
use crate::resque::time;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::SystemTime;

/// Everything `locketd status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The Redis URL, password redacted.
    pub redis: String,
    /// For a `redis+sentinel://` URL, the primary the sentinels named (`host:port`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// Namespace.
    pub namespace: String,
    /// Redis server time, seconds since the epoch.
    pub now: u64,
    /// `pause-all-workers` is set.
    pub paused: bool,
    /// `stat:processed`.
    pub processed: u64,
    /// `stat:failed`.
    pub failed: u64,
    /// Records in the failure list(s).
    pub failures_listed: u64,
    /// Locks with at least one live holder (`locket:locks` entries whose deadline is ahead).
    pub locks_held: u64,
    /// Queues: the configured ones in priority order, then every other known queue by name.
    pub queues: Vec<QueueStatus>,
    /// Registered workers, locketd's and other Resque implementations', by id.
    pub workers: Vec<WorkerStatus>,
    /// The workers' persistent handler processes (H-8, H-18): a process shared by slots
    /// (`threads`) once, with its threads busy / total and each running job's slot and thread.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handler_processes: Vec<super::handler_procs::ProcessStatus>,
    /// resque-scheduler's delayed queue: scheduled, due, oldest overdue, items kept back.
    pub delayed: crate::scheduler::ops::DelayedCounts,
    /// Keys that could not be read (another type, names that are not UTF-8): the part that
    /// reads each shows what it could, and this names the key.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<Unreadable>,
}

/// One queue.
#[derive(Debug, Clone, Serialize)]
pub struct QueueStatus {
    /// Queue name.
    pub name: String,
    /// `LLEN queue:<name>`.
    pub length: u64,
    /// The locket lock counter, when set (jobs requeued because their lock was held).
    pub counter: Option<u64>,
    /// Whether RESERVE skips it now: `counter >= length` with jobs waiting.
    pub skipped: bool,
    /// Whether the config's queue list matches it (false: known to Redis, not worked here).
    pub configured: bool,
    /// Jobs of this queue parked on a lock or hold (PK-8): not in `LLEN`, nor in Resque's
    /// queue sizes, and back at the head of the queue when woken.
    pub parked_jobs: u64,
    /// Whether an operator paused it (A-20: `<ns>:pause:queue:<q>` or `<ns>:pause:all`):
    /// `running`, `queue` or `all`.
    pub paused: crate::store::PauseState,
    /// Jobs of the queue holding a unit of its fleet-wide cap (A-22).
    pub running: u64,
    /// The queue's fleet-wide cap (`[queue.<q>] concurrency`, A-22), if any.
    pub cap: Option<u64>,
}

/// One registered worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerStatus {
    /// The Resque id `host:pid:queues`.
    pub id: String,
    /// Host part of the id.
    pub host: String,
    /// Pid part of the id.
    pub pid: String,
    /// Queue part of the id.
    pub queues: String,
    /// `locketd` when a live locketd process owns it, else `resque` (any other implementation).
    pub kind: &'static str,
    /// `worker:<id>:started`, verbatim.
    pub started: Option<String>,
    /// `workers:heartbeat` entry, verbatim.
    pub heartbeat: Option<String>,
    /// The running job, when `worker:<id>` is set.
    pub job: Option<JobStatus>,
    /// Set when the worker is a locketd slot parked because Redis refused its last job's end
    /// (E-3): the job stays in its inflight record until the key the refusal names is mended.
    pub parked: Option<Parked>,
    /// The slot's persistent handler processes (persistent-handlers.md), as its worker last
    /// wrote them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handlers: Vec<crate::metrics::HandlerStats>,
}

/// A parked slot's mark on its inflight record.
#[derive(Debug, Clone, Serialize)]
pub struct Parked {
    /// Since when (Resque's time format).
    pub since: String,
    /// The refusal, as Redis gave it.
    pub why: String,
}

/// What a worker is working on (`worker:<id>`).
#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    /// `queue`.
    pub queue: Option<String>,
    /// `payload.class`.
    pub class: Option<String>,
    /// `run_at`, verbatim.
    pub run_at: Option<String>,
    /// Seconds since `run_at`, when it parses.
    pub running_secs: Option<u64>,
}

fn int(v: Option<String>) -> u64 {
    v.and_then(|s| s.trim().parse::<i64>().ok())
        .map(|n| n.max(0) as u64)
        .unwrap_or(0)
}

/// Reads the status. `config` supplies the namespace, the queue order and the failure backend.
/// Fails only when Redis does not answer: a key of another type, or a name that is not UTF-8,
/// leaves its part empty and is named in [`Status::unreadable`].
pub async fn collect<C: ConnectionLike + Send>(conn: &mut C, config: &Config) -> Result<Status> {
    Ok(read(conn, config).await?)
}

/// `Err(e)` when `e` is Redis not answering; else notes the key `e` refused and gives `T`'s
/// default.
fn refused<T: Default>(
    r: RedisResult<T>,
    section: &str,
    key: &str,
    u: &mut Vec<Unreadable>,
) -> RedisResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(e) if unreadable::is_connection(&e) => Err(e),
        Err(e) => {
            u.push(Unreadable {
                section: section.into(),
                key: key.into(),
                error: unreadable::error_text(&e),
            });
            Ok(T::default())
        }
    }
}

async fn read<C: ConnectionLike + Send>(conn: &mut C, config: &Config) -> RedisResult<Status> {
    let k = Keys::new(&config.namespace);
    let (now, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let mut u: Vec<Unreadable> = Vec::new();
    // One pipeline: queues, workers, locket processes, paused, processed, failed. Each reply on
    // its own: a key of another type empties its part only.
    let head: Vec<redis::Value> = redis::pipe()
        .smembers(k.queues())
        .smembers(k.workers())
        .smembers(k.processes())
        .exists(k.pause_all())
        .get(k.stat_processed())
        .get(k.stat_failed())
        .ignore_errors()
        .query_async(conn)
        .await?;
    let mut head = head.into_iter();
    let mut next = || head.next().unwrap_or(redis::Value::Nil);
    let known = unreadable::names(next(), "queues", &k.queues(), &mut u);
    let workers = unreadable::names(next(), "workers", &k.workers(), &mut u);
    let processes = unreadable::names(next(), "workers", &k.processes(), &mut u);
    let paused: bool = unreadable::reply(next()).unwrap_or(false);
    let mut stat = |v: redis::Value, key: String| -> Option<String> {
        unreadable::reply(v)
            .map_err(|error| {
                u.push(Unreadable {
                    section: "totals".into(),
                    key,
                    error,
                })
            })
            .ok()
            .flatten()
    };
    let processed = stat(next(), k.stat_processed());
    let failed = stat(next(), k.stat_failed());

    // Queues: configured order first, then the rest of `queues` by name.
    let mut names: Vec<(String, bool)> = Vec::new();
    if let Ok(spec) = QueueSpec::from_list(&config.queues.0) {
        for q in spec.expand(&known) {
            names.push((q, true));
        }
    }
    let listed: BTreeSet<String> = names.iter().map(|(q, _)| q.clone()).collect();
    let rest: BTreeSet<&String> = known.iter().filter(|q| !listed.contains(*q)).collect();
    names.extend(rest.into_iter().map(|q| (q.clone(), false)));
    let queue_names: Vec<String> = names.iter().map(|(q, _)| q.clone()).collect();
    let lens = super::queue_lengths(conn, &k, &queue_names).await?;
    let parked_jobs = crate::store::parked_per_queue(conn, &k)
        .await
        .unwrap_or_default();
    let pauses = crate::store::pause_states(conn, &k, &queue_names).await?;
    let caps = crate::store::cap_states(conn, &k, &queue_names).await?;
    let queues = names
        .into_iter()
        .zip(lens)
        .zip(pauses)
        .zip(caps)
        .map(
            |((((name, configured), (length, counter)), paused), (running, cap))| QueueStatus {
                paused,
                running,
                cap,
                skipped: length > 0 && counter.is_some_and(|c| c >= length),
                parked_jobs: parked_jobs.get(&name).copied().unwrap_or(0),
                name,
                length,
                counter,
                configured,
            },
        )
        .collect();

    // Workers.
    let mut ids = workers;
    ids.sort();
    let mut ws = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(100) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.get(k.worker(id))
                .get(k.worker_started(id))
                .hget(k.heartbeat(), id);
        }
        // A queue key another tool made a string or a hash answers WRONGTYPE: it reads as
        // empty instead of failing the whole status.
        let flat: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (id, c) in chunk.iter().zip(flat.chunks(3)) {
            let s =
                |i: usize| redis::from_redis_value::<Option<String>>(c[i].clone()).unwrap_or(None);
            ws.push(worker_status(id, s(0), s(1), s(2), &processes, now));
        }
    }

    let parked = parked_slots(conn, &k, &processes).await?;
    let mut handlers = handler_states(conn, &k, &processes).await?;
    for w in &mut ws {
        w.parked = parked.get(&w.id).cloned();
        w.handlers = handlers.remove(&w.id).unwrap_or_default();
    }

    let (failures_listed, lists_refused) = refused(
        super::failed::listed_counts(conn, config, usize::MAX).await,
        "failures",
        &k.failed_queues(),
        &mut u,
    )?;
    for (key, error) in lists_refused {
        u.push(Unreadable {
            section: "failures".into(),
            key,
            error,
        });
    }
    let locks_held = match crate::store::locks_held(conn, &k, now.saturating_mul(1000)).await {
        Err(e) if !unreadable::is_connection(&e) => {
            u.push(unreadable::name_key(conn, "locks", &[(k.locks(), "zset")], &e).await);
            0
        }
        other => other?,
    };
    let delayed = match crate::scheduler::ops::delayed_counts(conn, &k, now as i64).await {
        Err(e) if !unreadable::is_connection(&e) => {
            let expected = [(k.delayed_schedule(), "zset")];
            u.push(unreadable::name_key(conn, "delayed", &expected, &e).await);
            Default::default()
        }
        other => other?,
    };

    Ok(Status {
        unreadable: u,
        delayed,
        redis: crate::conn::redact(&config.redis),
        primary: None,
        namespace: config.namespace.clone(),
        now,
        paused,
        processed: int(processed),
        failed: int(failed),
        failures_listed,
        locks_held,
        queues,
        handler_processes: super::handler_procs::list(&ws),
        workers: ws,
    })
}

/// The persistent handler processes of locketd's processes, by Resque worker id.
async fn handler_states<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    processes: &[String],
) -> RedisResult<HashMap<String, Vec<crate::metrics::HandlerStats>>> {
    let mut out: HashMap<String, Vec<crate::metrics::HandlerStats>> = HashMap::new();
    for chunk in processes.chunks(100) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.get(k.handlers(p));
        }
        let texts: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for t in texts {
            let text: Option<String> = redis::from_redis_value(t).unwrap_or(None);
            let list: Vec<crate::metrics::HandlerStats> = text
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default();
            for h in list {
                out.entry(h.worker.clone()).or_default().push(h);
            }
        }
    }
    Ok(out)
}

/// E-3: the parked slots of locketd's processes, by Resque worker id: each process's
/// `slots:<process>` (slot → worker id), then each slot's inflight record's marks.
async fn parked_slots<C: ConnectionLike + Send>(
    conn: &mut C,
    k: &Keys,
    processes: &[String],
) -> RedisResult<HashMap<String, Parked>> {
    let mut slots: Vec<(String, String)> = Vec::new();
    for chunk in processes.chunks(100) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.hgetall(k.slots(p));
        }
        let maps: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (p, m) in chunk.iter().zip(maps) {
            let m: HashMap<String, String> = redis::from_redis_value(m).unwrap_or_default();
            slots.extend(m.into_iter().map(|(n, id)| (format!("{p}:{n}"), id)));
        }
    }
    let mut parked = HashMap::new();
    for chunk in slots.chunks(100) {
        let mut pipe = redis::pipe();
        for (slot_key, _) in chunk {
            pipe.cmd("HMGET")
                .arg(k.inflight(slot_key))
                .arg("parked_at")
                .arg("parked_why");
        }
        let marks: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for ((_, id), m) in chunk.iter().zip(marks) {
            let (at, why): (Option<String>, Option<String>) =
                redis::from_redis_value(m).unwrap_or((None, None));
            if let (Some(since), Some(why)) = (at, why) {
                parked.insert(id.clone(), Parked { since, why });
            }
        }
    }
    Ok(parked)
}

pub(super) fn worker_status(
    id: &str,
    working: Option<String>,
    started: Option<String>,
    heartbeat: Option<String>,
    processes: &[String],
    now: u64,
) -> WorkerStatus {
    // Resque's own `Worker.find` split: the queue part may contain ':'.
    let mut parts = id.splitn(3, ':');
    let host = parts.next().unwrap_or("").to_string();
    let pid = parts.next().unwrap_or("").to_string();
    let queues = parts.next().unwrap_or("").to_string();
    // A slot id `host:pid+k:queues` belongs to the process `host:pid:<incarnation>`.
    let prefix = format!("{host}:{}:", crate::store::registry::pid_of(&pid));
    let kind = if processes.iter().any(|p| p.starts_with(&prefix)) {
        "locketd"
    } else {
        "resque"
    };
    let job = working.filter(|w| !w.is_empty()).map(|w| {
        let v: serde_json::Value = serde_json::from_str(&w).unwrap_or_default();
        let run_at = v.get("run_at").and_then(|r| r.as_str()).map(str::to_string);
        JobStatus {
            queue: v.get("queue").and_then(|q| q.as_str()).map(str::to_string),
            class: v
                .pointer("/payload/class")
                .and_then(|c| c.as_str())
                .map(str::to_string),
            running_secs: run_at
                .as_deref()
                .and_then(time::parse_heartbeat)
                .map(|t| now.saturating_sub(t)),
            run_at,
        }
    });
    WorkerStatus {
        id: id.to_string(),
        host,
        pid,
        queues,
        kind,
        started,
        heartbeat,
        job,
        parked: None,
        handlers: Vec::new(),
    }
}

fn pad(out: &mut String, cells: &[String], widths: &[usize]) {
    let mut line = String::new();
    for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
        line.push_str(c);
        if i + 1 < cells.len() {
            // By hand: a format width over 65,535 (a queue name that long) panics.
            let n = w.saturating_sub(c.chars().count()) + 2;
            line.extend(std::iter::repeat_n(' ', n));
        }
    }
    out.push_str(line.trim_end());
    out.push('\n');
}

pub(super) fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    pad(
        out,
        &header.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
        &widths,
    );
    for r in rows {
        pad(out, r, &widths);
    }
}

impl Status {
    /// The human-readable screen.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let primary = match &self.primary {
            Some(p) => format!(" (primary {p})"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "redis {}{primary}  namespace {}  at {}",
            self.redis,
            self.namespace,
            time::run_at(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(self.now))
        );
        let busy = self.workers.iter().filter(|w| w.job.is_some()).count();
        let parked = self.workers.iter().filter(|w| w.parked.is_some()).count();
        let _ = writeln!(
            out,
            "processed {}  failed {}  failures listed {}  locks held {}  workers {} ({} busy, {} idle){}{}",
            self.processed,
            self.failed,
            self.failures_listed,
            self.locks_held,
            self.workers.len(),
            busy,
            self.workers.len() - busy,
            if parked > 0 { format!("  PARKED {parked} (see JOB)") } else { String::new() },
            if self.paused { "  PAUSED (pause-all-workers is set)" } else { "" }
        );
        let d = &self.delayed;
        let _ = writeln!(
            out,
            "delayed (resque-scheduler): {} timestamps scheduled, {} due ({} items), oldest overdue {}s{}",
            d.timestamps,
            d.due_timestamps,
            d.due_items,
            d.oldest_overdue_secs,
            if d.kept.is_empty() {
                String::new()
            } else {
                format!("  KEPT BACK {}", d.kept.len())
            }
        );
        for (what, why) in d.kept.iter().take(10) {
            let _ = writeln!(out, "  kept back: {what}: {why}");
        }
        for u in &self.unreadable {
            let _ = writeln!(out, "UNREADABLE ({}) {}", u.section, u.line());
        }
        out.push('\n');
        if self.queues.is_empty() {
            out.push_str("no queues known\n");
        } else {
            let rows: Vec<Vec<String>> = self
                .queues
                .iter()
                .map(|q| {
                    let state = if q.paused == crate::store::PauseState::All {
                        "paused (every queue: locketd resume --all)"
                    } else if q.paused.is_paused() {
                        "paused (locketd resume)"
                    } else if q.skipped {
                        "skipped (every job waits on a lock)"
                    } else if q.length == 0 {
                        "empty"
                    } else {
                        "ok"
                    };
                    vec![
                        q.name.clone(),
                        q.length.to_string(),
                        q.parked_jobs.to_string(),
                        q.counter.map(|c| c.to_string()).unwrap_or("-".into()),
                        q.cap
                            .map(|c| format!("{}/{c}", q.running))
                            .unwrap_or("-".into()),
                        if q.configured {
                            state.to_string()
                        } else {
                            format!("{state}; not in this config's queue list")
                        },
                    ]
                })
                .collect();
            table(
                &mut out,
                &[
                    "QUEUE",
                    "LENGTH",
                    "PARKED",
                    "COUNTER",
                    "RUNNING/CAP",
                    "STATE",
                ],
                &rows,
            );
        }
        out.push('\n');
        if self.workers.is_empty() {
            out.push_str("no workers registered\n");
        } else {
            let rows: Vec<Vec<String>> = self
                .workers
                .iter()
                .map(|w| {
                    let mut job = match &w.job {
                        None => "idle".to_string(),
                        Some(j) => format!(
                            "{} on {} since {}{}",
                            j.class.as_deref().unwrap_or("?"),
                            j.queue.as_deref().unwrap_or("?"),
                            j.run_at.as_deref().unwrap_or("?"),
                            j.running_secs
                                .map(|s| format!(" ({s}s)"))
                                .unwrap_or_default()
                        ),
                    };
                    job.push_str(&super::handler_procs::thread_note(w));
                    if let Some(p) = &w.parked {
                        job = format!(
                            "PARKED since {}: Redis refused the job's end ({}); {job}",
                            p.since, p.why
                        );
                    }
                    vec![
                        w.host.clone(),
                        w.pid.clone(),
                        w.kind.to_string(),
                        w.queues.clone(),
                        w.started.clone().unwrap_or("-".into()),
                        job,
                    ]
                })
                .collect();
            table(
                &mut out,
                &["HOST", "PID", "KIND", "QUEUES", "STARTED", "JOB"],
                &rows,
            );
        }
        super::handler_procs::render(&mut out, &self.workers);
        out
    }
}

/// `locketd status [--json] [--watch SECS [--count N]]`: prints, and with `--watch` repeats
/// until Ctrl-C (or `count` screens). Exit 0, or 69 when Redis does not answer.
pub fn run_cli(
    config: &Config,
    json: bool,
    watch: Option<f64>,
    count: Option<u64>,
) -> anyhow::Result<std::process::ExitCode> {
    use std::io::{IsTerminal, Write};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut conn = match super::connect_or_report(config).await {
            Ok(c) => c,
            Err(code) => return Ok(code),
        };
        let every = watch
            .filter(|w| w.is_finite() && *w > 0.0)
            .map(std::time::Duration::from_secs_f64);
        let tty = std::io::stdout().is_terminal();
        let mut shown = 0u64;
        loop {
            let mut status = collect(&mut conn, config).await?;
            status.primary = conn.primary();
            let mut text = if json {
                let mut t = serde_json::to_string(&status)?;
                t.push('\n');
                t
            } else {
                status.render()
            };
            if every.is_some() && tty && !json {
                text = format!("\x1b[H\x1b[2J{text}");
            } else if every.is_some() && !json && shown > 0 {
                text = format!("\n{text}");
            }
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.flush()?;
            drop(out);
            shown += 1;
            let Some(every) = every else { break };
            if count.is_some_and(|n| shown >= n) {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = tokio::signal::ctrl_c() => break,
            }
        }
        Ok(std::process::ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_and_locketd_workers_are_told_apart() {
        let procs = vec!["vm:10:ab12cd34".to_string()];
        let w = worker_status("vm:10:high,low", None, None, None, &procs, 0);
        assert_eq!(
            (w.kind, w.host.as_str(), w.pid.as_str()),
            ("locketd", "vm", "10")
        );
        // A slot of the multi-slot mode is the same process's.
        let w = worker_status("vm:10+2:high,low", None, None, None, &procs, 0);
        assert_eq!(w.kind, "locketd");
        let w = worker_status("vm:101+2:high,low", None, None, None, &procs, 0);
        assert_eq!(w.kind, "resque");
        let w = worker_status(
            "other:7:a:b",
            Some(r#"{"queue":"a:b","run_at":"2026-11-21T12:00:00Z","payload":{"class":"X","args":[]}}"#.into()),
            None,
            None,
            &procs,
            time::parse_heartbeat("2026-11-21T12:00:09Z").unwrap(),
        );
        assert_eq!((w.kind, w.queues.as_str()), ("resque", "a:b"));
        let j = w.job.unwrap();
        assert_eq!(j.class.as_deref(), Some("X"));
        assert_eq!(j.running_secs, Some(9));
    }
}
