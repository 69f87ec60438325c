//! One worker process: one slot, one Resque worker, one job at a time.
//!
//! The loop is the locket loop of locking-semantics.md §5: RESERVE (skip rule atomic with the
//! pop) → classify → ACQUIRE (+START) → run with lock heartbeats → FINISH, with a process
//! heartbeat and the janitor running beside it.

mod idle;
mod janitor;
mod run;
pub mod signals;

pub use janitor::{janitor_pass, recover_process, JanitorReport};

use crate::config::plans::{Plans, RenderedPlan};
use crate::config::{Config, OnLockLost};
use crate::conn::{check_eviction, connect};
use crate::error::Result;
use crate::handler::{Handlers, JobContext};
use crate::locks::canonical;
use crate::locks::template::RenderInput;
use crate::locks::LockSpec;
use crate::locks::Policy;
use crate::resque::failure::{self, JobFailure};
use crate::resque::keys::Keys;
use crate::resque::patterns::QueueSpec;
use crate::resque::payload::Job;
use crate::store::batch::Conn;
use crate::store::random_hex;
use crate::store::registry::{self, Registration};
use crate::store::{
    self, AcquireOptions, AcquireOutcome, AcquireRequest, Finish, FinishHolds, FinishRequest,
    Reserved, Settled, SlotRef,
};
use crate::{host, proctitle};
use run::RunEnd;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// How the worker is driven from outside: stops, pause and USR1 (resque-protocol.md §7).
#[derive(Debug, Clone)]
pub struct Control {
    /// Stop reserving; the running job gets `shutdown_timeout` to finish (QUIT).
    pub quit: CancellationToken,
    /// Stop the running job now: a polite stop, then SIGKILL after `term_timeout` (TERM, INT).
    /// Also stops reserving.
    pub term: CancellationToken,
    /// Stop the running job at once with SIGKILL (a second TERM).
    pub kill: CancellationToken,
    paused: Arc<watch::Sender<bool>>,
    kills: Arc<watch::Sender<u64>>,
}

impl Default for Control {
    fn default() -> Control {
        Control {
            quit: CancellationToken::new(),
            term: CancellationToken::new(),
            kill: CancellationToken::new(),
            paused: Arc::new(watch::channel(false).0),
            kills: Arc::new(watch::channel(0).0),
        }
    }
}

impl Control {
    /// QUIT: finish the running job, then stop.
    pub fn quit(&self) {
        self.quit.cancel();
    }

    /// TERM: stop now (polite stop, then SIGKILL after `term_timeout`); a second call kills at
    /// once.
    pub fn terminate(&self) {
        if self.term.is_cancelled() {
            self.kill.cancel();
        }
        self.quit.cancel();
        self.term.cancel();
    }

    /// USR2 (`true`) / CONT (`false`): stop or resume reserving.
    pub fn set_paused(&self, paused: bool) {
        self.paused.send_replace(paused);
    }

    /// Whether reserving is paused.
    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// USR1: kill the running job (if any) at once and keep working.
    pub fn kill_running_job(&self) {
        self.kills.send_modify(|n| *n += 1);
    }

    fn stopping(&self) -> bool {
        self.quit.is_cancelled() || self.term.is_cancelled()
    }
}

/// Why [`Worker::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// Asked to stop.
    Shutdown,
    /// `interval = 0` and the queues were empty.
    Drained,
    /// The process lease lapsed and another process may have recovered its work.
    PresumedDead,
}

/// The identities of one worker process and one of its slots (locking-semantics.md §1.1).
#[derive(Debug, Clone)]
pub struct Identity {
    /// `host:pid:incarnation`.
    pub process_id: String,
    /// Slot number: 0 in the one-job-per-process mode, 1..=K with `slots = K`.
    pub slot: u32,
    /// `<process id>:<slot>`.
    pub slot_key: String,
    /// Resque worker id: `host:pid:queues`, or node-resque's `host:pid+<slot>:queues` with
    /// several slots.
    pub worker_id: String,
}

impl Identity {
    /// Identity of this process (one slot) for a queue list.
    pub fn new(spec: &QueueSpec) -> Identity {
        let host = host::hostname();
        let pid = std::process::id();
        // The master chooses the incarnation (INCARNATION_ENV), so that it can recover exactly
        // this process when it dies; a process started on its own picks one.
        let incarnation = std::env::var(crate::process::INCARNATION_ENV)
            .ok()
            .filter(|i| {
                i.len() == 8
                    && i.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            })
            .unwrap_or_else(|| random_hex(4));
        let process_id = format!("{host}:{pid}:{incarnation}");
        Identity {
            slot: 0,
            slot_key: format!("{process_id}:0"),
            worker_id: format!("{host}:{pid}:{}", spec.id_part()),
            process_id,
        }
    }

    /// Identity of slot `slot` (1-based) of the same process, in the multi-slot mode.
    pub fn slot(&self, spec: &QueueSpec, slot: u32) -> Identity {
        let host = host::hostname();
        let pid = std::process::id();
        Identity {
            process_id: self.process_id.clone(),
            slot,
            slot_key: format!("{}:{slot}", self.process_id),
            worker_id: format!("{host}:{pid}+{slot}:{}", spec.id_part()),
        }
    }
}

fn epoch_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A connected, registered worker.
pub struct Worker {
    config: Config,
    handlers: Handlers,
    keys: Keys,
    spec: QueueSpec,
    id: Identity,
    conn: Conn,
    lock_queues: Option<QueueSpec>,
    plans: std::sync::Arc<Plans>,
    title_prefix: String,
    /// Queues whose key is not a list, warned about once each.
    unreadable_warned: std::collections::HashSet<String>,
    /// The last title set, so a poll loop does not rewrite (or flicker) the same one.
    title: String,
    redis_down: bool,
    /// The other slots of this process (`slots = K`), run beside this one by [`Worker::run`].
    peers: Vec<Worker>,
    /// Several slots share the process title: only the process-wide state is shown.
    multi: bool,
    /// The process's idle waiter, shared by its slots.
    idle: Arc<idle::Idle>,
    /// The last job's end, recorded by the next RESERVE's call (FINISH+RESERVE) or flushed
    /// on its own before the loop waits or stops.
    pending: Option<PendingFinish>,
    metrics: crate::metrics::Metrics,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.id).finish()
    }
}

impl Worker {
    /// Connects, checks Redis, prunes dead workers by Resque's rules and registers.
    pub async fn start(config: Config, handlers: Handlers) -> Result<Worker> {
        config.check()?;
        let spec = QueueSpec::from_list(&config.queues.0)?;
        let lock_queues = if config.locket.lock_queues.0.is_empty() {
            None
        } else {
            Some(QueueSpec::from_list(&config.locket.lock_queues.0)?)
        };
        let plans = std::sync::Arc::new(Plans::compile(&config)?);
        let mut conn = connect(&config.redis, config.redis_connect_timeout.get()).await?;
        check_eviction(&mut conn, config.locket.allow_evicting_redis).await?;
        let keys = Keys::new(&config.namespace);
        let slots = config.slots.max(1);
        let multi = slots > 1;
        let mut id = Identity::new(&spec);
        if multi {
            id = id.slot(&spec, 1);
        }
        // The slots of one process share one connection; their job-path scripts go out in
        // batches (src/lock/batch.rs).
        let conn = if multi {
            Conn::batched(conn)
        } else {
            Conn::direct(conn)
        };
        let mut worker = Worker {
            title_prefix: proctitle::title_prefix(),
            unreadable_warned: Default::default(),
            title: String::new(),
            config,
            handlers,
            keys,
            spec,
            id,
            conn,
            lock_queues,
            plans,
            redis_down: false,
            peers: Vec::new(),
            multi,
            metrics: crate::metrics::Metrics::default(),
            idle: Arc::default(),
            pending: None,
        };
        for k in 2..=slots {
            let peer = Worker {
                title_prefix: worker.title_prefix.clone(),
                unreadable_warned: Default::default(),
                title: String::new(),
                config: worker.config.clone(),
                handlers: worker.handlers.clone(),
                keys: worker.keys.clone(),
                spec: worker.spec.clone(),
                id: worker.id.slot(&worker.spec, k),
                conn: worker.conn.clone(),
                lock_queues: worker.lock_queues.clone(),
                redis_down: false,
                peers: Vec::new(),
                multi,
                metrics: crate::metrics::Metrics::default(),
                idle: worker.idle.clone(),
                plans: worker.plans.clone(),
                pending: None,
            };
            worker.peers.push(peer);
        }
        proctitle::set_title(&format!("{}: Starting", worker.title_prefix));
        // Recover dead locketd processes before Resque's pruning, so their jobs are recorded
        // once, with their locks released.
        if let Err(e) = janitor_pass(
            &mut worker.conn,
            &worker.keys,
            &worker.config,
            &random_hex(16),
        )
        .await
        {
            warn!(error = %e, "janitor pass at start failed");
        }
        if worker.config.prune_dead_workers {
            // Housekeeping of other workers' leftovers: whatever it meets there (a record
            // another tool wrote in a shape Redis refuses to read as we ask) must not stop
            // this worker from starting.
            match registry::prune_dead_workers(
                &mut worker.conn,
                &worker.keys,
                &worker.id.worker_id,
                worker.spec.patterns(),
                worker.config.failure_backend,
            )
            .await
            {
                Ok(report) => {
                    for id in &report.pruned {
                        info!(worker = %id, "pruned dead resque worker");
                    }
                }
                Err(e) => warn!(error = %e, "pruning dead resque workers failed; starting anyway"),
            }
        }
        let alive = serde_json::json!({
            "started_at": epoch_secs(),
            "version": env!("CARGO_PKG_VERSION"),
            "concurrency": slots,
            "queues": worker.spec.id_part(),
            "resque_worker": worker.id.worker_id,
        })
        .to_string();
        let ids: Vec<Identity> = std::iter::once(worker.id.clone())
            .chain(worker.peers.iter().map(|p| p.id.clone()))
            .collect();
        for id in &ids {
            let reg = Registration {
                keys: &worker.keys,
                worker_id: &id.worker_id,
                process_id: &id.process_id,
                slot: id.slot,
            };
            registry::register(
                &mut worker.conn.clone(),
                &reg,
                &alive,
                worker.config.locket.process_ttl.get(),
            )
            .await?;
        }
        if multi {
            proctitle::set_title(&format!(
                "{}: {slots} slots for {}",
                worker.title_prefix,
                worker.spec.id_part()
            ));
            info!(first = %worker.id.worker_id, slots, process = %worker.id.process_id, queues = %worker.spec.id_part(), "worker registered");
        } else {
            info!(worker = %worker.id.worker_id, process = %worker.id.process_id, queues = %worker.spec.id_part(), "worker registered");
        }
        Ok(worker)
    }

    /// The Resque worker id (`host:pid:queues`).
    pub fn worker_id(&self) -> &str {
        &self.id.worker_id
    }

    /// The metrics recorders of this worker's slots (shared: read them while the worker runs;
    /// [`crate::metrics::Metrics::sum`] adds them up).
    pub fn metrics(&self) -> Vec<crate::metrics::Metrics> {
        std::iter::once(self.metrics.clone())
            .chain(self.peers.iter().map(|p| p.metrics.clone()))
            .collect()
    }

    fn slot(&self) -> SlotRef<'_> {
        SlotRef {
            keys: &self.keys,
            slot_key: &self.id.slot_key,
            worker_id: &self.id.worker_id,
        }
    }

    fn title(&mut self, state: &str) {
        if self.multi {
            return;
        }
        let title = format!("{}: {state}", self.title_prefix);
        if title != self.title {
            proctitle::set_title(&title);
            self.title = title;
        }
    }

    fn redis_error(&mut self, what: &str, e: &redis::RedisError) {
        self.metrics.redis_error();
        if !self.redis_down {
            self.redis_down = true;
            error!(error = %e, step = what, "redis unavailable; retrying with backoff");
        } else {
            debug!(error = %e, step = what, "redis still unavailable");
        }
    }

    fn redis_ok(&mut self) {
        if self.redis_down {
            self.redis_down = false;
            self.metrics.redis_reconnected();
            info!("redis reachable again");
        }
    }

    /// Runs until stopped (every slot, with `slots = K`); unregisters before returning.
    pub async fn run(mut self, control: Control) -> Result<StopReason> {
        let dead = CancellationToken::new();
        let background = CancellationToken::new();
        let mut peers = std::mem::take(&mut self.peers);
        let worker_ids: Vec<String> = std::iter::once(self.id.worker_id.clone())
            .chain(peers.iter().map(|p| p.id.worker_id.clone()))
            .collect();
        let beat = tokio::spawn(run::process_heartbeat(
            self.conn.manager().clone(),
            self.keys.clone(),
            self.id.process_id.clone(),
            worker_ids,
            self.config.locket.process_heartbeat.get(),
            self.config.locket.process_ttl.get(),
            dead.clone(),
            background.clone(),
        ));
        let jan = tokio::spawn(janitor::janitor_loop(
            self.conn.clone(),
            self.keys.clone(),
            self.config.clone(),
            background.clone(),
        ));
        let reason = if peers.is_empty() {
            self.work(&control, &dead).await
        } else {
            let mut all: Vec<&mut Worker> = vec![&mut self];
            all.extend(peers.iter_mut());
            let reasons =
                futures::future::join_all(all.into_iter().map(|w| w.work(&control, &dead))).await;
            if reasons.contains(&StopReason::PresumedDead) {
                StopReason::PresumedDead
            } else if reasons.iter().all(|r| *r == StopReason::Drained) {
                StopReason::Drained
            } else {
                StopReason::Shutdown
            }
        };
        background.cancel();
        let _ = beat.await;
        let _ = jan.await;
        if self.multi {
            proctitle::set_title(&format!("{}: Shutting down", self.title_prefix));
        }
        self.title("Shutting down");
        if reason != StopReason::PresumedDead {
            self.unregister_with_retry().await;
            for p in &mut peers {
                p.unregister_with_retry().await;
            }
        }
        info!(worker = %self.id.worker_id, slots = peers.len() + 1, reason = ?reason, "worker stopped");
        Ok(reason)
    }

    async fn unregister_with_retry(&mut self) {
        let mut delay = Duration::from_millis(100);
        for _ in 0..20 {
            let reg = Registration {
                keys: &self.keys,
                worker_id: &self.id.worker_id,
                process_id: &self.id.process_id,
                slot: self.id.slot,
            };
            match registry::unregister(&mut self.conn.clone(), &reg).await {
                Ok(()) => return,
                Err(e) => {
                    self.redis_error("unregister", &e);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
        error!("could not unregister; a janitor will recover this worker's registration");
    }

    async fn work(&mut self, control: &Control, dead: &CancellationToken) -> StopReason {
        let reason = self.work_loop(control, dead).await;
        match self.flush_pending().await {
            Some(r) => r,
            None => reason,
        }
    }

    async fn work_loop(&mut self, control: &Control, dead: &CancellationToken) -> StopReason {
        let interval = self.config.interval.get();
        let waiting = format!("Waiting for {}", self.spec.id_part());
        let mut backoff = Duration::from_millis(100);
        loop {
            if dead.is_cancelled() {
                return StopReason::PresumedDead;
            }
            if control.stopping() {
                return StopReason::Shutdown;
            }
            if control.is_paused() {
                if let Some(r) = self.flush_pending().await {
                    return r;
                }
                self.title("Paused");
                info!("paused (USR2): reserving nothing until CONT");
                wait_unpaused(control, dead).await;
                if !control.is_paused() {
                    info!("resumed (CONT)");
                }
                continue;
            }
            if let Some(until) = self.pending.as_ref().and_then(|p| p.parked_until) {
                self.title("Parked: Redis refused the end of its last job (see the log)");
                let now = Instant::now();
                if now < until && !sleep_or_stop(until - now, control, dead).await {
                    continue;
                }
                if let Some(r) = self.flush_pending().await {
                    return r;
                }
                continue;
            }
            let queues = match self.expand_queues().await {
                Ok(q) => q,
                Err(e) => {
                    self.redis_error("queues", &e);
                    sleep_or_stop(backoff, control, dead).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let rid = random_hex(8);
            let clear = self.config.locket.clear_counters_when_idle;
            let reserved = if queues.is_empty() {
                if let Some(r) = self.flush_pending().await {
                    return r;
                }
                Ok(Reserved::Nothing {
                    skipped: vec![],
                    unreadable: vec![],
                })
            } else if let Some(mut p) = self.pending.take() {
                // The last job's FINISH and this RESERVE in one round trip.
                let slot = self.slot();
                let fused = store::finish_and_reserve(
                    &mut self.conn.clone(),
                    &slot,
                    &p.request(self.config.failure_backend),
                    &p.holds(),
                    &rid,
                    &queues,
                    clear,
                )
                .await;
                match fused {
                    // The FINISH landed; a RESERVE error is handled below like any other.
                    Ok((finished, reserved)) => {
                        self.report_finish(&p, Some(finished), p.tried);
                        reserved
                    }
                    Err(e) if crate::conn::is_refusal(&e) => {
                        // Refused before any write (S-6): not a resend. Flushed on its own,
                        // which logs it once and parks the slot.
                        self.pending = Some(p);
                        if let Some(r) = self.flush_pending().await {
                            return r;
                        }
                        continue;
                    }
                    Err(e) => {
                        p.tried = true;
                        self.pending = Some(p);
                        Err(e)
                    }
                }
            } else {
                let slot = self.slot();
                store::reserve(&mut self.conn.clone(), &slot, &rid, &queues, clear).await
            };
            match reserved {
                Err(e) => {
                    self.redis_error("reserve", &e);
                    sleep_or_stop(backoff, control, dead).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Ok(Reserved::Job {
                    queue,
                    payload,
                    rid,
                }) => {
                    self.redis_ok();
                    backoff = Duration::from_millis(100);
                    if let Some(reason) = self.process(queue, payload, rid, control, dead).await {
                        return reason;
                    }
                    self.title(&waiting);
                }
                Ok(Reserved::Nothing {
                    skipped,
                    unreadable,
                }) => {
                    self.redis_ok();
                    self.title(&waiting);
                    self.metrics.queues_skipped(&skipped);
                    if !skipped.is_empty() {
                        debug!(skipped = ?skipped, "queues skipped: every job in them is locked");
                    }
                    for q in &unreadable {
                        if self.unreadable_warned.insert(q.clone()) {
                            warn!(queue = %q, key = %self.keys.queue(q), "queue key is not a list (another tool wrote it): passed over until it is one");
                        }
                    }
                    if interval.is_zero() {
                        return StopReason::Drained;
                    }
                    // The highest-priority queue that was empty (not merely skipped).
                    let empty = queues
                        .iter()
                        .find(|q| !skipped.contains(q) && !unreadable.contains(q));
                    let key = empty.map(|q| self.keys.queue(q));
                    let mut paused = control.paused.subscribe();
                    let stop = async {
                        tokio::select! {
                            _ = control.quit.cancelled() => {}
                            _ = control.term.cancelled() => {}
                            _ = dead.cancelled() => {}
                            _ = paused.wait_for(|p| *p) => {}
                        }
                    };
                    self.idle
                        .wait(&self.config.redis, key.as_deref(), interval, stop)
                        .await;
                }
                Ok(Reserved::Paused) => {
                    self.redis_ok();
                    self.title("Paused");
                    sleep_or_stop(interval.max(Duration::from_millis(100)), control, dead).await;
                }
                Ok(Reserved::Dead) => {
                    // the lease lapsed (a stall or a partition longer than process_ttl)
                    // and this process may have been recovered: it reserves nothing more.
                    error!(process = %self.id.process_id, "process lease gone: presumed dead, reserving nothing");
                    dead.cancel();
                    return StopReason::PresumedDead;
                }
                Ok(Reserved::Busy) => {
                    // Only after a RESERVE whose reply was lost (connection dropped after the
                    // script ran): the job is safe in the inflight record and goes back to the
                    // head of its queue, where it was.
                    warn!(slot = %self.id.slot_key, "slot already holds a reservation; returning it to its queue");
                    self.return_stale().await;
                    sleep_or_stop(backoff, control, dead).await;
                }
            }
        }
    }

    async fn expand_queues(&mut self) -> redis::RedisResult<Vec<String>> {
        if !self.spec.is_dynamic() {
            return Ok(self.spec.expand(&[]));
        }
        let known: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys.queues())
            .query_async(&mut self.conn)
            .await?;
        Ok(self.spec.expand(&known))
    }

    async fn return_stale(&mut self) {
        let fields: redis::RedisResult<(Option<String>, Option<String>)> = redis::cmd("HMGET")
            .arg(self.keys.inflight(&self.id.slot_key))
            .arg("rid")
            .arg("queue")
            .query_async(&mut self.conn)
            .await;
        if let Ok((Some(rid), Some(queue))) = fields {
            self.return_job(&rid, &queue).await;
        }
    }

    /// RETURN: a reservation that never started goes back to the head of its queue. If
    /// Redis refuses or is away, the job stays in its inflight record (S-6: RETURN changed
    /// nothing), where `status` shows it and recovery finds it; that is logged, once per job.
    async fn return_job(&mut self, rid: &str, queue: &str) {
        let slot = self.slot();
        if let Err(e) = store::return_to_queue(&mut self.conn.clone(), &slot, rid, queue).await {
            error!(step = "return", queue = %queue, slot = %self.id.slot_key, error = %e, "could not return an unstarted job to its queue; it stays in its inflight record for recovery");
        }
    }

    /// whether jobs reserved from this queue take their class's execution locks
    /// (`lock_queues`); whether the class has any is its plan's business.
    fn is_locked(&self, job: &Job) -> bool {
        match &self.lock_queues {
            None => true,
            Some(spec) => {
                if spec.is_dynamic() {
                    spec.patterns()
                        .iter()
                        .any(|p| crate::resque::patterns::fnmatch(p, &job.queue))
                        && !spec
                            .skips()
                            .iter()
                            .any(|p| crate::resque::patterns::fnmatch(p, &job.queue))
                } else {
                    spec.patterns().iter().any(|p| p == &job.queue)
                }
            }
        }
    }

    /// Runs one reserved job to its end. Returns a stop reason when the worker must stop.
    async fn process(
        &mut self,
        queue: String,
        payload: Vec<u8>,
        rid: String,
        control: &Control,
        dead: &CancellationToken,
    ) -> Option<StopReason> {
        let started = Instant::now();
        let job = match Job::decode(&payload, &queue, self.config.max_payload_bytes) {
            Ok(job) => job,
            Err(e) => {
                let raw = String::from_utf8_lossy(&payload).into_owned();
                warn!(queue = %queue, error = %e, "bad payload recorded as failed");
                let f = JobFailure::new("Locket::BadPayload", e.to_string());
                return self
                    .fail_unstarted(&rid, &queue, &raw, "?", f, started)
                    .await;
            }
        };
        let Some(handler) = self.handlers.get(&job.class) else {
            let f = JobFailure::new(
                "NameError",
                format!(
                    "uninitialized constant {} (locketd has no handler for class {:?})",
                    job.class, job.class
                ),
            );
            warn!(queue = %queue, class = %job.class, "no handler for class");
            return self
                .fail_unstarted(&rid, &queue, &job.raw, &job.class, f, started)
                .await;
        };
        let digest = canonical::digest(&job.class, &job.args);
        let plans = self.plans.clone();
        let plan = plans.get(&job.class);
        let input = RenderInput {
            class: &job.class,
            queue: &queue,
            digest: &digest,
            args: &job.args,
        };
        let rendered = match plan.render(&input, self.is_locked(&job)) {
            Ok(r) => r,
            Err(e) => {
                // T-6, E-2: never run unlocked, never dropped.
                warn!(queue = %queue, class = %job.class, error = %e, "lock key cannot be rendered; job failed");
                let f = JobFailure::new("Locket::BadLockKey", e.to_string());
                return self
                    .fail_unstarted(&rid, &queue, &job.raw, &job.class, f, started)
                    .await;
            }
        };
        let locks = rendered.locks.clone();
        let token = if locks.is_empty() {
            String::new()
        } else {
            random_hex(16)
        };
        let lockinfo = serde_json::json!({
            "process": self.id.process_id,
            "slot": self.id.slot,
            "resque_worker": self.id.worker_id,
            "queue": queue,
            "class": job.class,
            "digest": digest,
        })
        .to_string();
        let lt = &self.config.locket;
        let (lock_ttl, counter_ttl) = (lt.lock_ttl.get(), lt.counter_ttl.get());
        if control.stopping() {
            // shutting down before the job started: it goes back to the head of its queue.
            self.return_job(&rid, &queue).await;
            return Some(StopReason::Shutdown);
        }
        // The plain path (requeue policy, no holds, no fencing) sends no options at all.
        let plain = plan.on_conflict == Policy::Requeue
            && !plan.has_dependencies()
            && !plan.fencing
            && rendered
                .lock_sources
                .iter()
                .zip(&locks)
                .all(|(s, l)| *s == l.id);
        // The policies this job can meet: the dependency policy only with locked_by, the lock
        // policy only with locks, wait_then only after a wait.
        let mut policies = Vec::with_capacity(3);
        if !locks.is_empty() {
            policies.push(plan.on_conflict);
        }
        if !rendered.locked_by.is_empty() {
            policies.push(plan.on_dependency_conflict);
        }
        let waits = policies.contains(&Policy::Wait);
        if waits {
            policies.push(plan.wait_then);
        }
        let delay_possible = policies.contains(&Policy::Delay);
        let failure_record =
            if policies.contains(&Policy::Fail) || (delay_possible && plan.delay.max_delays > 0) {
                Some(
                    JobFailure::new("Locket::LockConflict", "__LOCKET_CONFLICT__").record(
                        &job.raw,
                        &self.id.worker_id,
                        &queue,
                        SystemTime::now(),
                    ),
                )
            } else {
                None
            };
        let jitter: f64 = if plan.delay.jitter > 0.0 {
            rand::random::<f64>() * plan.delay.jitter
        } else {
            0.0
        };
        let mut opts = AcquireOptions {
            on_lock_conflict: plan.on_conflict,
            on_dep_conflict: plan.on_dependency_conflict,
            locked_by: &rendered.locked_by,
            enqueue_holds: &rendered.enqueue_holds,
            start_holds: &rendered.start_holds,
            hold_ttl: plan.hold_ttl,
            fencing: plan.fencing,
            sources: &rendered.lock_sources,
            delay: delay_possible.then_some((plan.delay, jitter)),
            failure_record: failure_record.as_deref(),
            backend: self.config.failure_backend,
            last_wait: false,
        };
        let wait_until = Instant::now() + plan.wait_timeout;
        let mut pause = Duration::from_millis(50);
        let mut waiting = false;
        let (acquired, sent_at) = loop {
            let sent_at = Instant::now();
            // Resque's run_at is when the job starts: taken per attempt, so that a lock wait
            // before it is not shown as time spent working.
            let working_on = failure::working_on(&job.raw, &queue, SystemTime::now());
            let req = AcquireRequest {
                rid: &rid,
                token: &token,
                queue: &queue,
                class: &job.class,
                digest: &digest,
                locks: &locks,
                lock_ttl,
                counter_ttl,
                requeue_on_conflict: true,
                working_on: &working_on,
                lockinfo: &lockinfo,
            };
            let acquired = {
                let slot = self.slot();
                let o = (!plain).then_some(&opts);
                retry(&mut self.conn.clone(), "acquire", control, |mut c| {
                    let (slot, req, o) = (slot.clone(), req.clone(), o.cloned());
                    async move { store::acquire_with(&mut c, &slot, &req, o.as_ref()).await }
                })
                .await
            };
            let acquired = match acquired {
                Ok(a) => Some(a),
                Err(GaveUp::Away) => None,
                Err(GaveUp::Refused(why)) => {
                    // E-3: ACQUIRE changed nothing (S-6) and sending it again would be refused
                    // again: the job is failed where Resque users look, retryable once the
                    // operator has mended the key the error names.
                    let f = JobFailure::new(
                        "Locket::StoreError",
                        format!("Redis refused the job's lock step (ACQUIRE): {why}"),
                    );
                    return self
                        .fail_unstarted(&rid, &queue, &job.raw, &job.class, f, started)
                        .await;
                }
            };
            // P-3: still reserved, so wait (bounded) and try again; the last try settles the
            // job by `wait_then` in the same script as the check.
            if waits
                && !opts.last_wait
                && matches!(
                    acquired,
                    Some(AcquireOutcome::Conflict {
                        action: Settled::None,
                        ..
                    })
                )
            {
                if !waiting {
                    // The job starts waiting (O-1's `wait` action); how the wait ends is
                    // counted too, when it is settled.
                    waiting = true;
                    self.metrics.lock_conflict("wait");
                }
                let now = Instant::now();
                if now >= wait_until {
                    if opts.on_lock_conflict == Policy::Wait {
                        opts.on_lock_conflict = plan.wait_then;
                    }
                    if opts.on_dep_conflict == Policy::Wait {
                        opts.on_dep_conflict = plan.wait_then;
                    }
                    opts.last_wait = true;
                    continue;
                }
                let nap = pause.min(wait_until - now);
                // A pause (USR2) only stops new reservations: a job already waiting on its lock
                // keeps waiting (P-3); QUIT, TERM and presumed death end the wait.
                if !sleep_unless_stopped(nap, control, dead).await {
                    // a waiting job goes back to the head of its queue (rid-checked).
                    self.return_job(&rid, &queue).await;
                    return Some(if dead.is_cancelled() {
                        StopReason::PresumedDead
                    } else {
                        StopReason::Shutdown
                    });
                }
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
            break (acquired, sent_at);
        };
        let fences = match acquired {
            None => {
                // Redis stayed away until we were told to stop: the reservation stays in the
                // inflight record for recovery (E-3).
                return Some(StopReason::Shutdown);
            }
            Some(AcquireOutcome::Started { fences, .. }) => fences,
            Some(AcquireOutcome::Conflict { action, conflicts }) => {
                if opts.last_wait {
                    info!(queue = %queue, class = %job.class, digest = %&digest[..12], waited_ms = u64::try_from(plan.wait_timeout.as_millis()).unwrap_or(u64::MAX), then = plan.wait_then.name(), "lock wait timed out");
                }
                self.log_conflict(&job.class, &queue, &digest, &action, &conflicts, waiting);
                if action == Settled::None {
                    // Not settled (a wait interrupted): back to the head, where it was.
                    self.return_job(&rid, &queue).await;
                }
                return None;
            }
            Some(AcquireOutcome::Dead) => {
                // nothing was started; the reservation stays for recovery.
                error!(queue = %queue, class = %job.class, process = %self.id.process_id, "process lease gone: presumed dead, the job is left reserved for recovery");
                dead.cancel();
                return Some(StopReason::PresumedDead);
            }
            Some(AcquireOutcome::Missing) => {
                error!(queue = %queue, class = %job.class, "reservation was recovered elsewhere before it started");
                return None;
            }
        };

        self.title(&format!(
            "Processing {queue} since {} [{}]",
            epoch_secs(),
            job.class
        ));
        info!(queue = %queue, class = %job.class, worker = %self.id.worker_id, "job started");
        self.metrics.job_started(&queue, &job.class);
        // Its own table, else the "*" fallback (as for its handler and lock plan).
        let class_cfg = self
            .config
            .classes
            .get(&job.class)
            .or_else(|| self.config.classes.get("*"))
            .cloned()
            .unwrap_or_default();
        let ctx = JobContext {
            class: job.class.clone(),
            queue: queue.clone(),
            payload: job.raw.clone(),
            args: job.args.clone(),
            args_raw: job.args_raw.clone(),
            worker: self.id.worker_id.clone(),
            lock_keys: locks.iter().map(|l| l.id.clone()).collect(),
            lock_token: token.clone(),
            lock_fences: fences,
            watch: crate::watchdog::Watch::default(),
        };
        let on_lost = class_cfg
            .on_lock_lost
            .unwrap_or(self.config.locket.on_lock_lost);
        let sup = run::Supervision {
            conn: self.conn.manager().clone(),
            keys: self.keys.clone(),
            token: token.clone(),
            locks: locks.clone(),
            lock_ttl: self.config.locket.lock_ttl.get(),
            heartbeat_interval: self.config.locket.heartbeat_interval.get(),
            sent_at,
            max_runtime: class_cfg.timeout.map(|t| t.get()),
            kill_grace: class_cfg
                .kill_grace
                .unwrap_or(self.config.locket.kill_grace)
                .get(),
            shutdown_timeout: self.config.locket.shutdown_timeout.get(),
            term_timeout: self.config.term_timeout.get(),
            on_lock_lost: on_lost,
        };
        let end = sup.run(handler, ctx, control, dead).await;
        let result = match end {
            RunEnd::Finished(r) => r,
            RunEnd::LockLost => {
                self.metrics.lock_lost();
                error!(queue = %queue, class = %job.class, token = %&token[..8.min(token.len())], locks = ?locks.iter().map(|l| &l.id).collect::<Vec<_>>(), "job lock lost");
                if on_lost == OnLockLost::Requeue {
                    let release = rendered.releases(false);
                    return self
                        .finish_outcome(
                            &rid,
                            &queue,
                            &token,
                            &locks,
                            Finish::Requeue,
                            &job.class,
                            started,
                            "requeued",
                            &FinishHolds {
                                class: &job.class,
                                digest: &digest,
                                release: &release,
                                resent: false,
                            },
                        )
                        .await;
                }
                Err(JobFailure::new(
                    "Locket::LockLost",
                    format!(
                        "lost the job lock {} while the job ran; it was stopped",
                        locks.first().map(|l| l.id.as_str()).unwrap_or("")
                    ),
                ))
            }
            RunEnd::TimedOut(limit) => Err(JobFailure::new(
                "Locket::Timeout",
                format!(
                    "job ran longer than its timeout of {}s and was stopped",
                    limit.as_secs_f64()
                ),
            )),
            RunEnd::Terminated { killed: false } => {
                Err(JobFailure::new("Resque::TermException", "SIGTERM"))
            }
            RunEnd::Terminated { killed: true } => Err(JobFailure::new(
                "Resque::DirtyExit",
                "Child process received unhandled signal SIGKILL (signal 9): stopped by a shutdown",
            )
            .dirty()),
            RunEnd::KilledByUsr1 => Err(JobFailure::new(
                "Resque::DirtyExit",
                "Child process received unhandled signal SIGKILL (signal 9): killed by USR1",
            )
            .dirty()),
            RunEnd::PresumedDead => Err(JobFailure::new(
                "Resque::DirtyExit",
                "locketd process was presumed dead and stopped the job",
            )
            .dirty()),
        };
        let class = job.class.clone();
        let stop = self
            .finish_job(
                &rid,
                &queue,
                &token,
                &locks,
                &job.raw,
                result,
                &class,
                started,
                Some((&digest, &rendered)),
            )
            .await;
        if dead.is_cancelled() {
            return Some(StopReason::PresumedDead);
        }
        stop
    }

    /// Records a reserved job that never ran (bad payload, no handler, bad lock key) as failed:
    /// no lock, no token, nothing to release.
    async fn fail_unstarted(
        &mut self,
        rid: &str,
        queue: &str,
        payload: &str,
        class: &str,
        failure: JobFailure,
        started: Instant,
    ) -> Option<StopReason> {
        self.finish_job(
            rid,
            queue,
            "",
            &[],
            payload,
            Err(failure),
            class,
            started,
            None,
        )
        .await
    }

    /// Logs a conflict the way O-1 says: requeues at debug, discards, delays and wait
    /// timeouts at info, conflict failures at warn.
    fn log_conflict(
        &self,
        class: &str,
        queue: &str,
        digest: &str,
        action: &Settled,
        conflicts: &[store::Conflict],
        counted_wait: bool,
    ) {
        let resources: Vec<String> = conflicts
            .iter()
            .map(|c| format!("{}:{} ({}/{})", c.kind.word(), c.id, c.holders, c.limit))
            .collect();
        let lock_id = conflicts.first().map(|c| c.id.as_str()).unwrap_or("");
        let digest = &digest[..12.min(digest.len())];
        let counted = match action {
            Settled::None if counted_wait => None,
            Settled::None => Some("wait"),
            Settled::Requeued => Some("requeue"),
            Settled::Discarded => Some("discard"),
            Settled::Delayed { .. } => Some("delay"),
            Settled::Failed { .. } => Some("fail"),
        };
        if let Some(action) = counted {
            self.metrics.lock_conflict(action);
        }
        match action {
            Settled::Requeued | Settled::None => {
                debug!(queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, action = ?action, "lock conflict: job requeued")
            }
            Settled::Discarded => {
                info!(queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, "lock conflict: job discarded")
            }
            Settled::Delayed { due_ms, attempt } => {
                info!(queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, attempt, due_ms, "lock conflict: job delayed")
            }
            Settled::Failed { attempt } => {
                warn!(queue = %queue, class = %class, lock_id = %lock_id, digest = %digest, resources = ?resources, attempt, "lock conflict: job failed as Locket::LockConflict")
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn finish_job(
        &mut self,
        rid: &str,
        queue: &str,
        token: &str,
        locks: &[LockSpec],
        payload: &str,
        result: crate::handler::HandlerResult,
        class: &str,
        started: Instant,
        holds: Option<(&str, &RenderedPlan)>,
    ) -> Option<StopReason> {
        let release = holds
            .map(|(_, r)| r.releases(result.is_ok()))
            .unwrap_or_default();
        let fh = FinishHolds {
            class,
            digest: holds.map(|(d, _)| d).unwrap_or(""),
            release: &release,
            resent: false,
        };
        if let Err(f) = &result {
            if f.exception == crate::handler::RESCHEDULE {
                // EX_TEMPFAIL: the lock is released and the payload goes back to the tail in
                // the same FINISH, so the next run of this key starts without overlap.
                info!(queue = %queue, class = %class, "job asked to be rescheduled (exit 75)");
                return self
                    .finish_outcome(
                        rid,
                        queue,
                        token,
                        locks,
                        Finish::Requeue,
                        class,
                        started,
                        "rescheduled",
                        &fh,
                    )
                    .await;
            }
        }
        let (outcome, label) = match &result {
            Ok(()) => (Finish::Success, "success"),
            Err(f) => {
                let record = f.record(payload, &self.id.worker_id, queue, SystemTime::now());
                if f.dirty {
                    (Finish::Dirty(record), "killed")
                } else {
                    (Finish::Failure(record), "failed")
                }
            }
        };
        if let Err(f) = &result {
            warn!(queue = %queue, class = %class, exception = %f.exception, error = %f.error, "job failed");
        }
        self.finish_outcome(
            rid, queue, token, locks, outcome, class, started, label, &fh,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn finish_outcome(
        &mut self,
        rid: &str,
        queue: &str,
        token: &str,
        locks: &[LockSpec],
        outcome: Finish,
        class: &str,
        started: Instant,
        label: &str,
        holds: &FinishHolds<'_>,
    ) -> Option<StopReason> {
        // Recorded with the next RESERVE (one round trip for both), or flushed on its own
        // before the loop waits or stops.
        if let Some(r) = self.flush_pending().await {
            return Some(r);
        }
        self.pending = Some(PendingFinish {
            rid: rid.to_string(),
            queue: queue.to_string(),
            token: token.to_string(),
            locks: locks.to_vec(),
            outcome,
            class: class.to_string(),
            digest: holds.digest.to_string(),
            release: holds.release.to_vec(),
            started,
            label: label.to_string(),
            tried: false,
            parked_until: None,
        });
        None
    }

    /// Records the pending job end on its own (FINISH), retrying while Redis is away; it must
    /// land even while shutting down. `Some` when it could not be recorded.
    async fn flush_pending(&mut self) -> Option<StopReason> {
        let p = self.pending.take()?;
        let slot = self.slot();
        let req = p.request(self.config.failure_backend);
        let holds = p.holds();
        // A fresh control that is never cancelled keeps retrying, bounded by retry()'s own
        // deadline.
        let never = Control::default();
        // Every attempt after the first is a resend: the one before may have landed.
        let mut resent = holds.resent;
        let done = retry(&mut self.conn.clone(), "finish", &never, |mut c| {
            let (slot, req) = (slot.clone(), req.clone());
            let holds = FinishHolds {
                resent,
                ..holds.clone()
            };
            resent = true;
            async move { store::finish_with(&mut c, &slot, &req, &holds).await }
        })
        .await;
        match done {
            Ok(found) => {
                self.report_finish(&p, Some(found), p.tried);
                None
            }
            Err(GaveUp::Away) => {
                self.report_finish(&p, None, p.tried);
                Some(StopReason::PresumedDead)
            }
            Err(GaveUp::Refused(why)) => {
                // E-3: FINISH changed nothing (S-6), so the job stays in its inflight record,
                // its locks and holds kept. The slot parks: it reserves nothing (its record is
                // taken, K-2) and tries the FINISH again every PARK_RETRY, silently, until the
                // operator has mended the key the log names. The record says so for `status`.
                if p.parked_until.is_none() {
                    error!(queue = %p.queue, class = %p.class, outcome = %p.label, retry_s = PARK_RETRY.as_secs(), "the job's end was refused by Redis; the job stays in its inflight record and the slot is parked, trying again periodically");
                    let at = crate::resque::time::run_at(SystemTime::now());
                    if let Err(e) =
                        store::park(&mut self.conn.clone(), &slot, &p.rid, &at, &why).await
                    {
                        warn!(error = %e, "could not mark the inflight record as parked");
                    }
                }
                let mut p = p;
                p.parked_until = Some(Instant::now() + PARK_RETRY);
                self.pending = Some(p);
                None
            }
        }
    }

    /// Logs and counts a job end once its FINISH ran (`Some(found its reservation)`) or gave up.
    /// `retried`: an earlier attempt may have landed, so a missing reservation is no surprise.
    fn report_finish(&mut self, p: &PendingFinish, done: Option<bool>, retried: bool) {
        let (queue, class, label) = (&p.queue, &p.class, p.label.as_str());
        let elapsed = p.started.elapsed().as_secs_f64();
        if done.is_some() {
            self.metrics.job_finished(
                queue,
                class,
                crate::metrics::Outcome::from_label(label),
                p.started.elapsed(),
            );
        }
        match done {
            Some(true) => {
                info!(queue = %queue, class = %class, worker = %self.id.worker_id, elapsed, outcome = label, "job finished");
            }
            Some(false) if retried => {
                info!(queue = %queue, class = %class, worker = %self.id.worker_id, elapsed, outcome = label, "job finished (recorded by an attempt whose reply was lost)");
            }
            Some(false) => {
                error!(queue = %queue, class = %class, elapsed, outcome = label, "job finished after its reservation was recovered elsewhere; nothing recorded twice");
            }
            None => {
                error!(queue = %queue, class = %class, "could not record the job's end; its inflight record is left for recovery");
            }
        }
    }
}

/// A job's end, waiting for its FINISH.
#[derive(Debug)]
struct PendingFinish {
    rid: String,
    queue: String,
    token: String,
    locks: Vec<LockSpec>,
    outcome: Finish,
    class: String,
    digest: String,
    release: Vec<String>,
    started: Instant,
    label: String,
    /// A FINISH+RESERVE carrying it failed: it may have landed.
    tried: bool,
    /// Redis refused its FINISH (E-3): the slot is parked and tries again at this time.
    parked_until: Option<Instant>,
}

impl PendingFinish {
    fn request(&self, backend: crate::resque::failure::FailureBackend) -> FinishRequest<'_> {
        FinishRequest {
            rid: &self.rid,
            token: &self.token,
            queue: &self.queue,
            locks: &self.locks,
            outcome: &self.outcome,
            backend,
        }
    }

    fn holds(&self) -> FinishHolds<'_> {
        FinishHolds {
            class: &self.class,
            digest: &self.digest,
            release: &self.release,
            resent: self.tried,
        }
    }
}

/// How long a parked slot waits before it sends a refused FINISH again (E-3).
const PARK_RETRY: Duration = Duration::from_secs(30);

/// Why [`retry`] ended without a reply.
enum GaveUp {
    /// Redis stayed away until the control asked to stop, or for ten minutes.
    Away,
    /// Redis refused the call in a way a resend cannot change ([`crate::conn::is_refusal`]); logged.
    /// The refusal's text.
    Refused(String),
}

/// Retries a Redis step with capped backoff (E-3) until it succeeds, the control asks to stop,
/// or ten minutes pass. A refusal ([`crate::conn::is_refusal`]: a key of another type, a full Redis, a
/// Lua error) is logged once and ends it at once: the same call is never resent in a loop.
async fn retry<T, F, Fut>(
    conn: &mut Conn,
    what: &str,
    control: &Control,
    mut f: F,
) -> std::result::Result<T, GaveUp>
where
    F: FnMut(Conn) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut delay = Duration::from_millis(50);
    let mut logged = false;
    loop {
        match f(conn.clone()).await {
            Ok(v) => {
                if logged {
                    info!(step = what, "redis reachable again");
                }
                return Ok(v);
            }
            Err(e) if crate::conn::is_refusal(&e) => {
                error!(step = what, error = %e, "redis refused the step; not sending it again");
                return Err(GaveUp::Refused(e.to_string()));
            }
            Err(e) => {
                if !logged {
                    error!(step = what, error = %e, "redis error; retrying with backoff");
                    logged = true;
                }
                if Instant::now() + delay > deadline || control.kill.is_cancelled() {
                    return Err(GaveUp::Away);
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = control.kill.cancelled() => return Err(GaveUp::Away),
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Sleeps `d` unless told to stop (or paused) first. True when the sleep ran to its end.
async fn sleep_or_stop(d: Duration, control: &Control, dead: &CancellationToken) -> bool {
    let mut paused = control.paused.subscribe();
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = control.quit.cancelled() => false,
        _ = control.term.cancelled() => false,
        _ = dead.cancelled() => false,
        _ = paused.wait_for(|p| *p) => false,
    }
}

/// Sleeps `d` unless told to stop first; a pause does not end it. True when the sleep ran to
/// its end.
async fn sleep_unless_stopped(d: Duration, control: &Control, dead: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = control.quit.cancelled() => false,
        _ = control.term.cancelled() => false,
        _ = dead.cancelled() => false,
    }
}

/// Waits while paused, until CONT or a stop. Bounded by the stop signals it listens for.
async fn wait_unpaused(control: &Control, dead: &CancellationToken) {
    let mut paused = control.paused.subscribe();
    tokio::select! {
        _ = paused.wait_for(|p| !*p) => {}
        _ = control.quit.cancelled() => {}
        _ = control.term.cancelled() => {}
        _ = dead.cancelled() => {}
    }
}
