//! `locketd parked` and `locketd unpark` (parked-waits.md PK-8, PK-9): the jobs parked on
//! locks and holds, listed through the `parked` index (never KEYS), and moved back to the
//! heads of their queues in bounded, atomic batches.

use super::{human_ms, now_ms, print_json, table, Admin};
use crate::store;
use clap::Args;
use serde_json::json;
use std::process::ExitCode;

/// `locketd parked [--lock ID | --queue Q] [--limit N] [--json]`.
#[derive(Args, Debug, Clone)]
pub struct ParkedArgs {
    /// Only the jobs parked on this lock id.
    #[arg(long, value_name = "ID", conflicts_with_all = ["hold", "queue"])]
    pub lock: Option<String>,
    /// Only the jobs parked on this hold name.
    #[arg(long, value_name = "NAME", conflicts_with = "queue")]
    pub hold: Option<String>,
    /// Only the jobs that go back to this queue.
    #[arg(long, value_name = "QUEUE", value_parser = super::queue_name)]
    pub queue: Option<String>,
    /// At most this many jobs per lock or hold.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `locketd unpark (--lock ID | --hold NAME | --queue Q | --all)`.
#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["lock", "hold", "queue", "all"])))]
pub struct UnparkArgs {
    /// The jobs parked on this lock id.
    #[arg(long, value_name = "ID")]
    pub lock: Option<String>,
    /// The jobs parked on this hold name.
    #[arg(long, value_name = "NAME")]
    pub hold: Option<String>,
    /// The parked jobs of this queue, whatever they wait for.
    #[arg(long, value_name = "QUEUE", value_parser = super::queue_name)]
    pub queue: Option<String>,
    /// Every parked job.
    #[arg(long)]
    pub all: bool,
}

/// Most resources the index is read for at once.
const MAX_RESOURCES: usize = 100_000;

impl Admin {
    /// The resources named by --lock / --hold, else every indexed one.
    async fn parked_targets(
        &mut self,
        lock: Option<&str>,
        hold: Option<&str>,
    ) -> anyhow::Result<Vec<String>> {
        Ok(match (lock, hold) {
            (Some(id), _) => vec![format!("lock:{id}")],
            (None, Some(name)) => vec![format!("dep:{name}")],
            (None, None) => {
                store::parked_resources(&mut self.conn, &self.keys, MAX_RESOURCES).await?
            }
        })
    }

    pub(super) async fn parked(&mut self, a: &ParkedArgs) -> anyhow::Result<ExitCode> {
        let targets = self
            .parked_targets(a.lock.as_deref(), a.hold.as_deref())
            .await?;
        let counts = store::parked_counts(&mut self.conn, &self.keys, &targets).await?;
        let now = now_ms(&mut self.conn).await.unwrap_or(0);
        let mut jobs = Vec::new();
        let mut per_resource = Vec::new();
        for (res, n) in targets.iter().zip(&counts) {
            if *n == 0 {
                continue;
            }
            let due = store::parked_due(&mut self.conn, &self.keys, res).await?;
            let why = super::limits::parked_reason(res, due);
            per_resource.push(json!({"resource": res, "parked": n, "why": why}));
            for j in store::parked_jobs(&mut self.conn, &self.keys, res, a.limit).await? {
                if a.queue.as_deref().is_none_or(|q| q == j.queue) {
                    jobs.push(j);
                }
            }
        }
        if a.json {
            let per_queue = store::parked_per_queue(&mut self.conn, &self.keys).await?;
            print_json(&json!({
                "resources": per_resource,
                "queues": per_queue,
                "jobs": jobs,
            }));
            return Ok(ExitCode::SUCCESS);
        }
        if per_resource.is_empty() {
            println!("no parked jobs");
            return Ok(ExitCode::SUCCESS);
        }
        let rows: Vec<Vec<String>> = per_resource
            .iter()
            .map(|r| {
                vec![
                    r["resource"].as_str().unwrap_or("").to_string(),
                    r["parked"].to_string(),
                    r["why"].as_str().unwrap_or("").to_string(),
                ]
            })
            .collect();
        table(&["LOCK, HOLD OR RATE", "PARKED", "WHY"], &rows);
        println!();
        let rows: Vec<Vec<String>> = jobs
            .iter()
            .map(|j| {
                vec![
                    j.resource.clone(),
                    j.position.to_string(),
                    j.queue.clone(),
                    j.class.clone(),
                    human_ms(now - j.parked_at as i64),
                    j.payload.chars().take(60).collect(),
                ]
            })
            .collect();
        table(&["ON", "#", "QUEUE", "CLASS", "WAITING", "PAYLOAD"], &rows);
        Ok(ExitCode::SUCCESS)
    }

    pub(super) async fn unpark(&mut self, a: &UnparkArgs) -> anyhow::Result<ExitCode> {
        let targets = self
            .parked_targets(a.lock.as_deref(), a.hold.as_deref())
            .await?;
        let (moved, stuck) =
            store::unpark(&mut self.conn, &self.keys, &targets, a.queue.as_deref()).await?;
        tracing::warn!(
            moved,
            "parked jobs moved back to their queues by an operator"
        );
        println!("moved {moved} parked job(s) back to the head of their queues");
        for s in &stuck {
            println!("{s}: the next job cannot move (a key holds another type); mend it and run this again");
        }
        Ok(if stuck.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    }
}
