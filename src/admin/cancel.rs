//! `locketd cancel RID|WORKER_ID [--requeue] [--wait SECS]` (locking-semantics.md A-21).
//!
//! A job a worker holds is found through `locket:processes` and each process's `slots:` hash
//! (never KEYS), and a cancel request is recorded for that worker to act on: a running job's
//! handler gets the polite stop and, after `kill_grace`, the hard stop, as for a lost lock
//! a job that has not started (reserved, or waiting on its lock) is never started: the
//! step that would start it takes the request instead. The command then waits, bounded, for
//! the worker to act, and says what happened. A parked or delayed job (no worker holds it) is
//! found by its rid in the `parked` lists and the `delayed` set and cancelled at once, in one
//! step.

use super::Admin;
use crate::config::Config;
use crate::resque::failure::{FailureBackend, JobFailure};
use crate::resque::keys::Keys;
use crate::store::{self, CancelProgress, Waiting};
use clap::Args;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

/// `locketd cancel RID|WORKER_ID [--requeue] [--wait SECS]`.
#[derive(Args, Debug, Clone)]
pub struct CancelArgs {
    /// The job's reservation id (`locketd status --json`, `locketd parked --json`,
    /// `locketd delayed`, the page), or the Resque worker id of the slot holding it.
    #[arg(value_name = "RID|WORKER_ID")]
    pub target: String,
    /// Put the job back at the tail of its queue instead of recording a failure.
    #[arg(long)]
    pub requeue: bool,
    /// How long to wait for the job's worker to act on the cancel, in seconds (0: do not wait).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub wait: u64,
}

/// How long an unread cancel request is kept.
const KEEP: Duration = Duration::from_secs(600);

/// Exit code of a cancel whose outcome is not known yet (EX_TEMPFAIL).
const NOT_YET: u8 = 75;

/// What a cancel found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// A worker holds the job: the request was recorded for it to act on.
    Requested(Request),
    /// A parked or delayed job was cancelled at once: removed from where it waited and
    /// recorded (or put back in its queue with `--requeue`). No handler of it ran.
    Done {
        /// The reservation id.
        rid: String,
        /// Where it waited: `parked on lock:<id>`, `delayed`.
        was: String,
    },
    /// Nothing holds such a job: it finished, runs under another reservation id (a parked or
    /// delayed job that was woken or promoted), or never was.
    NotRunning,
}

/// A cancel request recorded for the worker that holds the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The reservation id.
    pub rid: String,
    /// The slot's Resque worker id.
    pub worker: String,
    /// `reserved`, `waiting` or `running`.
    pub state: String,
    /// The process and slot holding it.
    process: String,
    slot_key: String,
}

impl Request {
    /// Whether the job's handler had started when the request was recorded.
    pub fn running(&self) -> bool {
        self.state == "running"
    }
}

/// How a worker acted on a [`Request`], as far as [`await_cancel`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The job was cancelled and its end recorded (a failure, or back in its queue).
    Done,
    /// The job ended some other way before its worker took the request, which was withdrawn.
    Missed,
    /// The worker took the request but the job's end is not recorded yet (its handler is
    /// still stopping, or Redis refused its FINISH).
    Taken,
    /// The worker has not taken the request yet; it stays for 10 minutes.
    Pending,
}

/// (process id, slot key, Resque worker id) of every slot of `processes` (K-1: each
/// `slots:<id>`, a pipeline per 100 processes).
pub(crate) async fn slots_of<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    processes: &[String],
) -> RedisResult<Vec<(String, String, String)>> {
    let mut slots = Vec::new();
    for chunk in processes.chunks(100) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.hgetall(keys.slots(p));
        }
        let maps: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (p, m) in chunk.iter().zip(maps) {
            let m: HashMap<String, String> = redis::from_redis_value(m).unwrap_or_default();
            slots.extend(
                m.into_iter()
                    .map(|(n, id)| (p.clone(), format!("{p}:{n}"), id)),
            );
        }
    }
    Ok(slots)
}

/// Cancels the job named by `target` (a rid or a worker id); `by` says who asked, from which
/// host. A job a worker holds gets a request ([`Cancelled::Requested`], then see
/// [`await_cancel`]); a parked or delayed one is cancelled at once, its failure recorded with
/// `backend`.
pub async fn cancel_job<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    target: &str,
    requeue: bool,
    by: &str,
    backend: FailureBackend,
) -> RedisResult<Cancelled> {
    let processes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.processes())
        .query_async(conn)
        .await?;
    let slots = slots_of(conn, keys, &processes).await?;
    let request = serde_json::json!({"by": by, "requeue": requeue}).to_string();
    for chunk in slots.chunks(100) {
        let mut pipe = redis::pipe();
        for (_, slot_key, _) in chunk {
            pipe.hget(keys.inflight(slot_key), "rid");
        }
        let rids: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for ((process, slot_key, worker), rid) in chunk.iter().zip(rids) {
            let Ok(Some(rid)) = redis::from_redis_value::<Option<String>>(rid) else {
                continue;
            };
            if rid != target && worker != target {
                continue;
            }
            return Ok(
                match store::request_cancel(conn, keys, process, slot_key, &rid, &request, KEEP)
                    .await?
                {
                    Some(state) => Cancelled::Requested(Request {
                        rid,
                        worker: worker.clone(),
                        state,
                        process: process.clone(),
                        slot_key: slot_key.clone(),
                    }),
                    None => Cancelled::NotRunning,
                },
            );
        }
    }
    // No worker holds it: a parked or delayed job, found by its rid.
    let Some(job) = store::find_waiting(conn, keys, target).await? else {
        return Ok(Cancelled::NotRunning);
    };
    let was = match &job.waiting {
        Waiting::Parked { resource } => format!("parked on {resource}"),
        Waiting::Delayed => "delayed".to_string(),
    };
    let record = (!requeue).then(|| {
        JobFailure::new(
            "Locket::Cancelled",
            format!("cancelled by an operator while {was}, before it started: {by}"),
        )
        .record(
            &job.payload,
            &cancel_worker_id(),
            &job.queue,
            SystemTime::now(),
        )
    });
    let (list, failed_queue) = match backend {
        FailureBackend::Redis => (keys.failed(), None),
        FailureBackend::RedisMultiQueue => (
            keys.queue_failed(&job.queue),
            Some(format!("{}_failed", job.queue)),
        ),
    };
    let done = store::cancel_waiting(
        conn,
        keys,
        &job,
        record.as_deref(),
        &list,
        failed_queue.as_deref(),
    )
    .await?;
    Ok(match done {
        Some(_) => Cancelled::Done {
            rid: target.to_string(),
            was,
        },
        // Woken or promoted meanwhile: it is queued (or runs) under a new reservation id.
        None => Cancelled::NotRunning,
    })
}

/// Waits up to `wait` for the worker holding the job of `r` to act on the request, and says
/// how it did. A request that nothing will take any more (the job ended first) is withdrawn.
pub async fn await_cancel<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    r: &Request,
    wait: Duration,
) -> RedisResult<Outcome> {
    let until = Instant::now() + wait;
    loop {
        let p = store::cancel_progress(conn, keys, &r.process, &r.slot_key, &r.rid, r.running())
            .await?;
        match p {
            CancelProgress::Done => return Ok(Outcome::Done),
            CancelProgress::Missed => {
                store::withdraw_cancel(conn, keys, &r.process, &r.rid).await?;
                return Ok(Outcome::Missed);
            }
            CancelProgress::Taken | CancelProgress::Pending if Instant::now() >= until => {
                return Ok(if p == CancelProgress::Taken {
                    Outcome::Taken
                } else {
                    Outcome::Pending
                });
            }
            _ => {}
        }
        let left = until.saturating_duration_since(Instant::now());
        tokio::time::sleep(left.min(Duration::from_millis(100))).await;
    }
}

/// The `worker` field of the failure record of a job cancelled with no worker holding it:
/// this command's host and pid, as a Resque worker id names them.
fn cancel_worker_id() -> String {
    format!(
        "{}:{}:locketd-cancel",
        crate::host::hostname(),
        std::process::id()
    )
}

/// `user@host` of the operator running this command.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "operator".into());
    format!("{user} on {}", crate::host::hostname())
}

/// What became of the job, in words, for an outcome that is an end.
fn ending(requeue: bool) -> &'static str {
    if requeue {
        "the job went back to the tail of its queue"
    } else {
        "recorded as failed with Locket::Cancelled"
    }
}

impl Admin {
    pub(super) async fn cancel(
        &mut self,
        a: &CancelArgs,
        config: &Config,
    ) -> anyhow::Result<ExitCode> {
        let by = format!("locketd cancel by {}", operator());
        let found = cancel_job(
            &mut self.conn,
            &self.keys,
            &a.target,
            a.requeue,
            &by,
            config.failure_backend,
        )
        .await?;
        let r = match found {
            Cancelled::Requested(r) => r,
            Cancelled::Done { rid, was } => {
                tracing::warn!(rid = %rid, requeue = a.requeue, "job cancelled by an operator");
                println!(
                    "job {rid} ({was}) cancelled: removed before any handler started; {}",
                    ending(a.requeue)
                );
                return Ok(ExitCode::SUCCESS);
            }
            Cancelled::NotRunning => {
                println!(
                    "no job {} is reserved, running, parked or delayed: it finished already, runs under a new reservation id, or never was; nothing done",
                    a.target
                );
                return Ok(ExitCode::from(1));
            }
        };
        tracing::warn!(rid = %r.rid, worker = %r.worker, state = %r.state, requeue = a.requeue, "cancel requested by an operator");
        let (rid, worker, state) = (&r.rid, &r.worker, &r.state);
        let will = if r.running() {
            "its handler gets the polite stop within about a second, the hard stop after kill_grace"
        } else {
            "it will not start: its worker takes the request before starting it"
        };
        if a.wait == 0 {
            println!(
                "cancel requested for job {rid} ({state}) on {worker}: {will}; not waiting for the outcome (the request is kept 10 minutes)"
            );
            return Ok(ExitCode::SUCCESS);
        }
        let outcome =
            await_cancel(&mut self.conn, &self.keys, &r, Duration::from_secs(a.wait)).await?;
        Ok(match outcome {
            Outcome::Done => {
                if r.running() {
                    println!(
                        "job {rid} (running) on {worker} cancelled: its handler was stopped; {}",
                        ending(a.requeue)
                    );
                } else {
                    println!(
                        "job {rid} ({state}) on {worker} cancelled before its handler started; {}",
                        ending(a.requeue)
                    );
                }
                ExitCode::SUCCESS
            }
            Outcome::Missed => {
                if r.running() {
                    println!("job {rid} on {worker} ended on its own before its worker read the cancel; nothing was cancelled, and the request is withdrawn");
                } else {
                    println!("job {rid} ({state}) on {worker} left its slot before its worker took the cancel (its process died and it was recovered, or it failed on its own); nothing was cancelled, and the request is withdrawn");
                }
                ExitCode::from(1)
            }
            Outcome::Taken => {
                println!(
                    "job {rid} ({state}) on {worker}: its worker took the cancel, but the job's end is not recorded after {}s (its handler is still stopping, or Redis refused the step; see locketd status)",
                    a.wait
                );
                ExitCode::from(NOT_YET)
            }
            Outcome::Pending => {
                println!(
                    "cancel requested for job {rid} ({state}) on {worker}, but its worker has not acted on it within {}s: {will}; the request is kept 10 minutes",
                    a.wait
                );
                ExitCode::from(NOT_YET)
            }
        })
    }
}
