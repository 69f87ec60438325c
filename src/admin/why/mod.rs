//! `locketd why JOB`: where one job is and, while it waits, every reason it waits, each with
//! its owner and the earliest time it can change.
//!
//! The job is named by its reservation id (`status --json`, `parked --json`, `delayed`, the
//! page), or by `QUEUE CLASS ARGS...` (the payload `locketd enqueue` would push, byte for byte).
//! [`explain`] gathers the facts with bounded reads only (one `LPOS` on the queue, paged reads
//! of parked lists, of `delayed` and of the failure list's tail, each with a ceiling), so it
//! is safe on a queue of millions; [`text`] and `--json` (the [`Why`] itself) show them, and
//! the web page serves the same at `/api/why` and `/why`.

mod find;
mod reasons;
pub mod text;

use crate::config::plans::{Plans, RenderedPlan};
use crate::config::Config;
use crate::locks::template::RenderInput;
use crate::resque::keys::Keys;
use crate::resque::payload::Job;
use crate::store;
use clap::Args;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use serde::Serialize;
use std::collections::HashMap;
use std::process::ExitCode;

/// `locketd why RID` or `locketd why QUEUE CLASS [ARG_JSON]...`.
#[derive(Args, Debug, Clone)]
pub struct WhyArgs {
    /// A reservation id (16 hex characters), or the job's queue followed by CLASS and ARGS.
    #[arg(value_name = "RID|QUEUE")]
    pub first: String,
    /// The job's class (with QUEUE).
    pub class: Option<String>,
    /// Its arguments, each one JSON value, as `locketd enqueue` takes them: 42 '"text"'.
    pub args: Vec<String>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// Which job to explain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A reservation id.
    Rid(String),
    /// A payload: the bytes `locketd enqueue QUEUE CLASS ARGS` pushes.
    Payload {
        /// Its queue.
        queue: String,
        /// Its class.
        class: String,
        /// Its arguments, each one JSON text.
        args: Vec<String>,
    },
}

impl WhyArgs {
    /// The target these arguments name.
    pub fn target(&self) -> Target {
        match &self.class {
            None => Target::Rid(self.first.clone()),
            Some(class) => Target::Payload {
                queue: self.first.clone(),
                class: class.clone(),
                args: self.args.clone(),
            },
        }
    }
}

/// Why `why` could not answer.
#[derive(Debug, thiserror::Error)]
pub enum WhyError {
    /// The job was named wrongly (an argument that is not JSON, an empty queue name).
    #[error("{0}")]
    BadInput(String),
    /// Redis did not answer.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// The job as found.
#[derive(Debug, Clone, Serialize)]
pub struct JobFacts {
    /// Its queue.
    pub queue: String,
    /// Its class (`?` when the payload does not decode).
    pub class: String,
    /// Its args.
    pub args: serde_json::Value,
    /// The payload, exactly.
    pub payload: String,
    /// Its payload digest (§1.1), when the payload decodes.
    pub digest: Option<String>,
    /// Its reservation id, when it has one (reserved, running, parked, delayed).
    pub rid: Option<String>,
}

/// Where the job is.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Place {
    /// In its queue: `position` jobs are ahead of it (0: it is next).
    Queued {
        /// Jobs ahead of it.
        position: u64,
        /// The queue's length.
        length: u64,
    },
    /// In locket's `delayed` set (P-4) until `until_ms`.
    Delayed {
        /// When it goes back to its queue (ms).
        until_ms: u64,
        /// Why it was delayed (`lock`, `dep`).
        reason: serde_json::Value,
        /// The lock or hold that refused it.
        resource: serde_json::Value,
        /// Delays so far.
        attempt: serde_json::Value,
    },
    /// Parked on a lock, hold or rate (PK-1): back at the head of its queue when woken.
    Parked {
        /// `lock:<id>`, `dep:<name>` or `rate:<key>`.
        resource: String,
        /// Jobs parked ahead of it on the resource.
        position: u64,
        /// Jobs parked on the resource.
        parked: u64,
        /// When it parked (ms).
        parked_at_ms: u64,
        /// When the janitor looks at the resource next (ms).
        next_check_ms: Option<u64>,
    },
    /// Reserved by a worker slot and not started: `reserved` (taking its locks, its handler
    /// getting ready) or `waiting` (the `wait` policy, in its slot).
    Reserved {
        /// `reserved` or `waiting`.
        step: String,
        /// The slot's Resque worker id.
        worker: String,
        /// The host of that worker.
        host: String,
        /// When it was reserved (ms).
        since_ms: u64,
    },
    /// Running.
    Running {
        /// The slot's Resque worker id.
        worker: String,
        /// The host of that worker.
        host: String,
        /// When it started (ms).
        since_ms: u64,
        /// The locks it holds.
        locks: serde_json::Value,
    },
    /// In the failure list (the last entries read).
    Failed {
        /// The list.
        list: String,
        /// Its index in the list.
        index: u64,
        /// The record's `failed_at`.
        failed_at: serde_json::Value,
        /// The record's `exception`.
        exception: serde_json::Value,
        /// The record's `error`.
        error: serde_json::Value,
        /// The record's `worker`.
        worker: serde_json::Value,
    },
    /// Nowhere `why` looked: finished, never pushed, or past the bounds of the search.
    NotFound {
        /// Where it looked, with the bounds.
        searched: Vec<String>,
    },
}

/// A live holder of a lock.
#[derive(Debug, Clone, Serialize)]
pub struct HolderFacts {
    /// The holder's Resque worker id (null for a unit kept for a woken job).
    pub worker: serde_json::Value,
    /// The host it runs on.
    pub host: Option<String>,
    /// Its locketd process id.
    pub process: serde_json::Value,
    /// Its class and queue.
    pub class: serde_json::Value,
    /// Its queue.
    pub queue: serde_json::Value,
    /// When it took the lock (ms).
    pub since_ms: Option<u64>,
    /// When its lease ends unless extended (ms).
    pub lease_end_ms: u64,
    /// The first 8 characters of its token (O-1).
    pub token: String,
    /// A unit kept for a job woken from the parked list (PK-3), not a running holder.
    pub handoff: bool,
}

/// A live field of a hold name.
#[derive(Debug, Clone, Serialize)]
pub struct HoldField {
    /// The digest of the payload that placed it.
    pub digest: String,
    /// Its count.
    pub count: i64,
    /// When it expires (ms).
    pub deadline_ms: u64,
    /// Placed by this very job (D-5: it does not block itself).
    pub own: bool,
    /// The running or reserved jobs with that digest: worker, class, state.
    pub owners: Vec<serde_json::Value>,
}

/// One reason the job waits.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// A lock of the job is full.
    Lock {
        /// The lock id.
        lock_id: String,
        /// The job's limit for it.
        limit: u32,
        /// Its live holders.
        holders: Vec<HolderFacts>,
        /// Jobs parked on it.
        parked: u64,
        /// The earliest lease end: it can change then (or sooner, at a release).
        until_ms: Option<u64>,
    },
    /// A `locked_by` name has live holds.
    Hold {
        /// The hold name.
        name: String,
        /// Its live fields.
        fields: Vec<HoldField>,
        /// The latest deadline of the fields that block: it ends then at the latest.
        until_ms: Option<u64>,
    },
    /// A rate key allows no start now.
    Rate {
        /// The rendered key.
        key: String,
        /// Starts per period.
        limit: u32,
        /// The period (ms).
        period_ms: u64,
        /// Starts in the window now.
        used: u64,
        /// Closed by a handler's back-off until (ms).
        closed_until_ms: Option<u64>,
        /// When the next start is allowed (ms).
        until_ms: u64,
    },
    /// The queue is paused until an operator resumes it.
    Paused {
        /// The queue, or `*` for every queue.
        scope: String,
        /// The key that pauses it.
        key: String,
    },
    /// The queue's fleet-wide cap is reached.
    Cap {
        /// The queue.
        queue: String,
        /// Its cap.
        cap: u64,
        /// Units held now.
        running: u64,
        /// The reservations holding them (at most 20): rid and worker.
        units: Vec<serde_json::Value>,
    },
    /// RESERVE skips the queue: its lock counter has reached its length.
    Skipped {
        /// The queue.
        queue: String,
        /// The counter.
        counter: u64,
        /// The queue's length.
        length: u64,
        /// When the counter expires (ms).
        until_ms: Option<u64>,
    },
    /// No live locketd process works the queue (R-1: its `alive:` lease, its queue list).
    NoWorker {
        /// The queue.
        queue: String,
        /// Live locketd processes (serving other queues).
        processes: u64,
    },
    /// The class's persistent handler is ready on no slot (H-8): its jobs are deferred.
    HandlerNotReady {
        /// The `[handlers.<name>]` table.
        handler: String,
        /// Slots that report it.
        slots: u64,
        /// The last boot failure or death.
        last_error: String,
        /// The end of the shortest boot backoff (ms), if one is running.
        until_ms: Option<u64>,
    },
}

/// The class's `unique` key (U-1), when it has one and the key is taken.
#[derive(Debug, Clone, Serialize)]
pub struct UniqueFacts {
    /// The rendered key.
    pub key: String,
    /// The digest of the push that took it.
    pub digest: String,
    /// Taken by a push of this payload.
    pub own: bool,
    /// When it lapses (ms).
    pub until_ms: Option<u64>,
}

/// Everything `why` found about one job.
#[derive(Debug, Clone, Serialize)]
pub struct Why {
    /// Redis server time (ms).
    pub now_ms: u64,
    /// The job, when found (or named by its payload).
    pub job: Option<JobFacts>,
    /// Where it is.
    pub place: Place,
    /// While it waits: every reason, each with its owner and when it can change.
    pub reasons: Vec<Reason>,
    /// The class's unique key, when taken.
    pub unique: Option<UniqueFacts>,
    /// What the reader should know about the answer (a bound reached, a plan mismatch).
    pub notes: Vec<String>,
}

/// One worker slot and its inflight record.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub worker: String,
    pub key: String,
    pub rec: HashMap<String, String>,
}

/// The host part of a process id or Resque worker id (`host:pid:...`).
fn host_of(id: &str) -> String {
    id.split(':').next().unwrap_or("").to_string()
}

fn num(s: Option<&String>) -> u64 {
    s.and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
        .max(0.0) as u64
}

/// Every slot of every registered process with its inflight record (bounded by the fleet's
/// slots: a pipeline per 100 processes, then per 100 slots).
pub(crate) async fn read_slots<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> RedisResult<Vec<Slot>> {
    let processes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.processes())
        .query_async(conn)
        .await
        .unwrap_or_default();
    let mut slots: Vec<Slot> = crate::admin::cancel::slots_of(conn, keys, &processes)
        .await?
        .into_iter()
        .map(|(_, key, worker)| Slot {
            worker,
            key,
            rec: HashMap::new(),
        })
        .collect();
    for chunk in slots.chunks_mut(100) {
        let mut pipe = redis::pipe();
        for s in chunk.iter() {
            pipe.hgetall(keys.inflight(&s.key));
        }
        let recs: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
        for (s, r) in chunk.iter_mut().zip(recs) {
            s.rec = redis::from_redis_value(r).unwrap_or_default();
        }
    }
    Ok(slots)
}

/// Whether the execution locks apply to jobs of `queue` (`[locket] lock_queues`), as the
/// worker decides it.
fn locked_queue(config: &Config, queue: &str) -> bool {
    let list = &config.locket.lock_queues.0;
    if list.is_empty() {
        return true;
    }
    crate::resque::patterns::QueueSpec::from_list(list).map_or(true, |s| serves(&s, queue))
}

/// Whether a queue list (Resque's syntax) takes in `queue`, as a worker reads it.
pub(crate) fn serves(spec: &crate::resque::patterns::QueueSpec, queue: &str) -> bool {
    let m = |p: &String| crate::resque::patterns::fnmatch(p, queue);
    if spec.is_dynamic() {
        spec.patterns().iter().any(m) && !spec.skips().iter().any(m)
    } else {
        spec.patterns().iter().any(|p| p == queue)
    }
}

/// The job's class plan, rendered for its payload: `None` (with a note) when it cannot be.
fn render(
    plans: &Plans,
    config: &Config,
    job: &Job,
    digest: &str,
    notes: &mut Vec<String>,
) -> Option<RenderedPlan> {
    let input = RenderInput {
        class: &job.class,
        queue: &job.queue,
        digest,
        args: &job.args,
    };
    match plans
        .get(&job.class)
        .render(&input, locked_queue(config, &job.queue))
    {
        Ok(r) => Some(r),
        Err(e) => {
            notes.push(format!(
                "its lock keys cannot be rendered ({e}): a worker records it as failed \
                 (Locket::BadLockKey) when it reserves it"
            ));
            None
        }
    }
}

/// Finds the job named by `target` and explains it, with bounded reads. `config` gives the
/// namespace and the class plans (the daemons' configuration: a different one renders other
/// lock ids, and a note says so when the plans published in Redis differ).
pub async fn explain<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    target: &Target,
) -> Result<Why, WhyError> {
    let keys = Keys::new(&config.namespace);
    let plans = Plans::compile(config)
        .map_err(|e| WhyError::BadInput(format!("the configuration's class plans: {e}")))?;
    let now = super::now_ms(conn).await?.max(0) as u64;
    let slots = read_slots(conn, &keys).await?;
    let mut notes = Vec::new();
    let found = find::locate(conn, &keys, config, &plans, target, &slots, &mut notes).await?;
    let mut why = Why {
        now_ms: now,
        job: found.job,
        place: found.place,
        reasons: Vec::new(),
        unique: None,
        notes,
    };
    let Some(facts) = &why.job else {
        return Ok(why);
    };
    let Ok(job) = Job::decode(facts.payload.as_bytes(), &facts.queue, 0) else {
        why.notes.push(
            "its payload does not decode (E-1): a worker records it as failed \
             (Locket::BadPayload)"
                .into(),
        );
        return Ok(why);
    };
    let digest = crate::locks::canonical::digest(&job.class, &job.args);
    if let Ok(diffs) = store::plans::compare(conn, &keys, &plans).await {
        let mine = |c: &str| c == job.class || c == "*" || c.is_empty();
        if diffs.iter().any(|d| match d {
            store::plans::Difference::Differs { class, .. } => mine(class),
            _ => false,
        }) {
            why.notes.push(
                "this configuration's plan for the class differs from the one published in \
                 Redis: lock ids and holds are rendered from this configuration (give the \
                 daemons' --config)"
                    .into(),
            );
        }
    }
    let plan = plans.get(&job.class);
    let Some(rendered) = render(&plans, config, &job, &digest, &mut why.notes) else {
        return Ok(why);
    };
    if let Some(u) = &plan.unique {
        why.unique = find::unique(conn, &keys, u, &job, &digest, now).await?;
    }
    let waits = matches!(
        why.place,
        Place::Queued { .. }
            | Place::Delayed { .. }
            | Place::Parked { .. }
            | Place::Reserved { .. }
    );
    if !waits {
        return Ok(why);
    }
    let stage = match why.place {
        Place::Queued { .. } => reasons::Stage::Queued,
        Place::Reserved { .. } => reasons::Stage::Reserved,
        _ => reasons::Stage::Away,
    };
    let unit = format!(
        "~{}",
        crate::locks::canonical::sha1_hex(facts.payload.as_bytes())
    );
    let ctx = find::Ctx {
        keys: &keys,
        config,
        slots: &slots,
        now,
        digest: &digest,
        unit: &unit,
    };
    why.reasons = reasons::reasons(conn, &ctx, &job, &rendered, stage).await?;
    Ok(why)
}

/// Runs `locketd why` to completion: exit 0 when the job was found, 1 when not, 69 when
/// Redis does not answer, 64 for a job named wrongly.
pub fn run_cli(config: &Config, args: &WhyArgs) -> anyhow::Result<ExitCode> {
    let target = args.target();
    if let Target::Payload { queue, .. } = &target {
        if let Err(e) = crate::ops::queue_name(queue) {
            eprintln!("locketd: why: {e}");
            return Ok(ExitCode::from(64));
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut conn = match crate::ops::connect_or_report(config).await {
            Ok(c) => c,
            Err(code) => return Ok(code),
        };
        match explain(&mut conn, config, &target).await {
            Ok(why) => {
                if args.json {
                    super::print_json(&serde_json::to_value(&why).unwrap_or_default());
                } else {
                    print!("{}", text::render(&why));
                }
                Ok(if matches!(why.place, Place::NotFound { .. }) {
                    ExitCode::from(1)
                } else {
                    ExitCode::SUCCESS
                })
            }
            Err(WhyError::BadInput(e)) => {
                eprintln!("locketd: why: {e}");
                Ok(ExitCode::from(64))
            }
            Err(e) => {
                eprintln!("locketd: why: {e}");
                Ok(ExitCode::from(69))
            }
        }
    })
}
