//! `locketd cancel RID|WORKER_ID [--requeue]` (locking-semantics.md A-21): finds the slot that
//! holds the job (through `locket:processes` and each process's `slots:` hash, never KEYS) and
//! records a cancel request its process reads within a second; the job's handler then gets the
//! polite stop and, after `kill_grace`, the hard stop, as for a lost lock.

use super::Admin;
use crate::resque::keys::Keys;
use crate::store;
use clap::Args;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

/// `locketd cancel RID|WORKER_ID [--requeue]`.
#[derive(Args, Debug, Clone)]
pub struct CancelArgs {
    /// The job's reservation id (`locketd status --json`, the page), or the Resque worker id
    /// of the slot running it.
    #[arg(value_name = "RID|WORKER_ID")]
    pub target: String,
    /// Put the job back at the tail of its queue instead of recording a failure.
    #[arg(long)]
    pub requeue: bool,
}

/// How long an unread cancel request is kept.
const KEEP: Duration = Duration::from_secs(600);

/// What a cancel found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// The request was recorded for this job (rid, Resque worker id, its state).
    Requested {
        /// The reservation id.
        rid: String,
        /// The slot's Resque worker id.
        worker: String,
        /// `reserved` or `running`.
        state: String,
    },
    /// No slot holds such a job: it finished (or never was).
    NotRunning,
}

/// Records a cancel request for the job named by `target` (a rid or a worker id); `by` says
/// who asked, from which host.
pub async fn cancel_job<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    target: &str,
    requeue: bool,
    by: &str,
) -> RedisResult<Cancelled> {
    let processes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.processes())
        .query_async(conn)
        .await?;
    // (process, slot key, worker id) of every slot.
    let mut slots: Vec<(String, String, String)> = Vec::new();
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
            let request = serde_json::json!({"by": by, "requeue": requeue}).to_string();
            return Ok(
                match store::request_cancel(conn, keys, process, slot_key, &rid, &request, KEEP)
                    .await?
                {
                    Some(state) => Cancelled::Requested {
                        rid,
                        worker: worker.clone(),
                        state,
                    },
                    None => Cancelled::NotRunning,
                },
            );
        }
    }
    Ok(Cancelled::NotRunning)
}

/// `user@host` of the operator running this command.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "operator".into());
    format!("{user} on {}", crate::host::hostname())
}

impl Admin {
    pub(super) async fn cancel(&mut self, a: &CancelArgs) -> anyhow::Result<ExitCode> {
        let by = format!("locketd cancel by {}", operator());
        match cancel_job(&mut self.conn, &self.keys, &a.target, a.requeue, &by).await? {
            Cancelled::Requested { rid, worker, state } => {
                tracing::warn!(rid = %rid, worker = %worker, requeue = a.requeue, "job cancelled by an operator");
                println!(
                    "cancel sent for job {rid} ({state}) on {worker}: its handler is stopped within 2 s, killed after kill_grace; {}",
                    if a.requeue {
                        "the job goes back to the tail of its queue"
                    } else {
                        "recorded as failed with Locket::Cancelled"
                    }
                );
                Ok(ExitCode::SUCCESS)
            }
            Cancelled::NotRunning => {
                println!(
                    "no running job {}: it finished already (or never ran); nothing done",
                    a.target
                );
                Ok(ExitCode::from(1))
            }
        }
    }
}
