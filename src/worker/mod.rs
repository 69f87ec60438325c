//! One worker process: one slot, one Resque worker, one job at a time.
//!
//! The loop is the locket loop of locking-semantics.md §5: RESERVE (skip rule atomic with the
//! pop) → classify → ACQUIRE (+START) → run with lock heartbeats → FINISH, with a process
//! heartbeat and the janitor running beside it.

mod cancel;
mod conflict;
mod finish;
mod idle;
mod janitor;
mod job;
pub mod pickup;
mod prepare;
mod reserve;
mod retry;
mod run;
pub mod signals;
mod take;

pub use janitor::{janitor_pass, recover_process, JanitorReport};

use crate::config::plans::Plans;
use crate::config::Config;
use crate::conn::{check_eviction, connect};
use crate::error::Result;
use crate::handler::Handlers;
use crate::resque::keys::Keys;
use crate::resque::patterns::QueueSpec;
use crate::store::batch::Conn;
use crate::store::random_hex;
use crate::store::registry::{self, Registration};
use crate::store::SlotRef;
use crate::{host, proctitle};
use finish::PendingFinish;
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
    /// Cancel requests for this process's jobs (A-21), read by `cancel::watch_requests`.
    cancels: Arc<watch::Sender<cancel::Requests>>,
    /// The master's death was seen (`process::parent_death_signal`): one event, however
    /// often the kernel delivers it.
    orphaned: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Control {
    fn default() -> Control {
        Control {
            quit: CancellationToken::new(),
            term: CancellationToken::new(),
            kill: CancellationToken::new(),
            paused: Arc::new(watch::channel(false).0),
            kills: Arc::new(watch::channel(0).0),
            cancels: Arc::new(watch::channel(cancel::Requests::new()).0),
            orphaned: Arc::default(),
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

    /// The master died: true the first time only, so that the caller applies it once, as a
    /// first TERM (or QUIT with `graceful_term`); never a second TERM.
    pub fn orphan(&self) -> bool {
        !self
            .orphaned
            .swap(true, std::sync::atomic::Ordering::SeqCst)
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
    /// The process lease lapsed and another process may have recovered its work (R-2).
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
    /// The holder fields of [`Identity::lockinfo`], as the object's text without its closing
    /// brace: TAKE (lib_take.lua) appends the queue, class and digest it learns in Redis.
    pub fn lockinfo_head(&self) -> String {
        let mut s = self.lockinfo("", "", "");
        let cut = s.rfind(",\"queue\":").unwrap_or(s.len());
        s.truncate(cut);
        s
    }

    /// The holder metadata stored with a job's locks (`lockinfo`, shown by `locketd locks`).
    /// Serialized from borrowed fields: a `json!` map first costs a job about 7k instructions
    /// more.
    pub fn lockinfo(&self, queue: &str, class: &str, digest: &str) -> String {
        #[derive(serde::Serialize)]
        struct LockInfo<'a> {
            process: &'a str,
            slot: u32,
            resque_worker: &'a str,
            queue: &'a str,
            class: &'a str,
            digest: &'a str,
        }
        serde_json::to_string(&LockInfo {
            process: &self.process_id,
            slot: self.slot,
            resque_worker: &self.worker_id,
            queue,
            class,
            digest,
        })
        .unwrap_or_default()
    }

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
    /// The handler every class goes to, when there is one (H-8's wait before RESERVE).
    sole_handler: Option<Arc<dyn crate::handler::Handler>>,
    keys: Keys,
    spec: QueueSpec,
    id: Identity,
    conn: Conn,
    lock_queues: Option<QueueSpec>,
    plans: std::sync::Arc<Plans>,
    title_prefix: String,
    /// Queues whose key is not a list, warned about once each.
    unreadable_warned: std::collections::HashSet<String>,
    /// Queues whose cap key is spoiled (A-22), warned about once each.
    cap_refused_warned: std::collections::HashSet<String>,
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
    /// When this slot's last RESERVE that looked at the pause and cap keys' types was sent
    /// (A-20): a fused RESERVE within a second of it trusts its `MGET` of them.
    guard_types_seen: Option<Instant>,
    metrics: crate::metrics::Metrics,
    /// TAKE (A-7a): the process's take plan, when TAKE is on.
    take: Option<Arc<take::TakeState>>,
    /// This slot's handlers, each once: TAKE is sent only while all are ready now (H-8).
    take_handlers: Vec<Arc<dyn crate::handler::Handler>>,
    /// A TAKE whose reply never came: its first rid and token, sent again as they were.
    take_resend: Option<(String, String)>,
    /// TAKE's texts of this slot, made at its first TAKE: the Resque worker id they were made
    /// for, the lockinfo head and the node-resque worker name as JSON.
    take_texts: Option<(String, String, String)>,
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
        // batches (src/store/batch.rs).
        let conn = if multi {
            Conn::batched(conn)
        } else {
            Conn::with_plain(conn, &config.redis)
        };
        conn.record_libraries_in(keys.locket("functions"));
        let mut worker = Worker {
            title_prefix: proctitle::title_prefix(),
            unreadable_warned: Default::default(),
            cap_refused_warned: Default::default(),
            title: String::new(),
            config,
            sole_handler: handlers.sole(),
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
            idle: Arc::new(idle::Idle::new()),
            pending: None,
            guard_types_seen: None,
            take: None,
            take_handlers: Vec::new(),
            take_resend: None,
            take_texts: None,
        };
        worker.take = worker.take_state();
        worker.take_handlers = worker.handlers.distinct();
        worker.idle.report_leases();
        for k in 2..=slots {
            let peer = worker.peer(k);
            worker.peers.push(peer);
        }
        worker.report_handlers();
        proctitle::set_title(&format!("{}: Starting", worker.title_prefix));
        worker.housekeep_at_start().await;
        worker.register_slots(slots).await?;
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

    /// Slot `k` of a multi-slot process: a worker sharing this one's connection, config and
    /// handlers, with an identity of its own.
    fn peer(&self, k: u32) -> Worker {
        let handlers = self.handlers.for_slot();
        let handlers_distinct = handlers.distinct();
        Worker {
            sole_handler: handlers.sole(),
            title_prefix: self.title_prefix.clone(),
            unreadable_warned: Default::default(),
            cap_refused_warned: Default::default(),
            title: String::new(),
            config: self.config.clone(),
            handlers,
            keys: self.keys.clone(),
            spec: self.spec.clone(),
            id: self.id.slot(&self.spec, k),
            conn: self.conn.clone(),
            lock_queues: self.lock_queues.clone(),
            redis_down: false,
            peers: Vec::new(),
            multi: self.multi,
            metrics: crate::metrics::Metrics::default(),
            idle: self.idle.clone(),
            plans: self.plans.clone(),
            pending: None,
            guard_types_seen: None,
            take: self.take.clone(),
            take_handlers: handlers_distinct,
            take_resend: None,
            take_texts: None,
        }
    }

    /// Start-up housekeeping that must not stop the start: recovery of dead locketd
    /// processes, then Resque's pruning of dead workers.
    async fn housekeep_at_start(&mut self) {
        // Recover dead locketd processes before Resque's pruning, so their jobs are recorded
        // once, with their locks released (R-4).
        if let Err(e) =
            janitor_pass(&mut self.conn, &self.keys, &self.config, &random_hex(16)).await
        {
            warn!(error = %e, "janitor pass at start failed");
        }
        if self.config.prune_dead_workers {
            // Housekeeping of other workers' leftovers: whatever it meets there (a record
            // another tool wrote in a shape Redis refuses to read as we ask) must not stop
            // this worker from starting.
            match registry::prune_dead_workers(
                &mut self.conn,
                &self.keys,
                &self.id.worker_id,
                self.spec.patterns(),
                self.config.failure_backend,
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
    }

    /// Registers every slot as a Resque worker with its process lease (R-1).
    async fn register_slots(&mut self, slots: u32) -> Result<()> {
        let alive = serde_json::json!({
            "started_at": epoch_secs(),
            "version": env!("CARGO_PKG_VERSION"),
            "concurrency": slots,
            "queues": self.spec.id_part(),
            "resque_worker": self.id.worker_id,
        })
        .to_string();
        let ids: Vec<Identity> = std::iter::once(self.id.clone())
            .chain(self.peers.iter().map(|p| p.id.clone()))
            .collect();
        for id in &ids {
            let reg = Registration {
                keys: &self.keys,
                worker_id: &id.worker_id,
                process_id: &id.process_id,
                slot: id.slot,
            };
            registry::register(
                &mut self.conn.clone(),
                &reg,
                &alive,
                self.config.locket.process_ttl.get(),
            )
            .await?;
        }
        Ok(())
    }

    /// The Resque worker id (`host:pid:queues`).
    pub fn worker_id(&self) -> &str {
        &self.id.worker_id
    }

    /// Lets each slot's metrics read its persistent handler processes.
    fn report_handlers(&self) {
        for w in std::iter::once(self).chain(self.peers.iter()) {
            let handlers: Vec<_> = w
                .handlers
                .distinct()
                .into_iter()
                .filter(|h| h.state().is_some())
                .collect();
            if handlers.is_empty() {
                continue;
            }
            let worker = w.id.worker_id.clone();
            w.metrics.set_handler_source(Box::new(move || {
                handlers
                    .iter()
                    .filter_map(|h| h.state())
                    .map(|mut s| {
                        s.worker.clone_from(&worker);
                        s
                    })
                    .collect()
            }));
        }
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
            if crate::conn::classify(e) == crate::conn::Failure::Unknown {
                error!(error = %e, step = what, "unreadable reply from redis: the call may have run; retrying with backoff as after a dropped connection");
            } else {
                error!(error = %e, step = what, "redis unavailable; retrying with backoff");
            }
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
        let all_metrics = self.metrics();
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
        let reporting = all_metrics.iter().any(|m| !m.handlers().is_empty());
        let handlers_task = reporting.then(|| {
            tokio::spawn(run::report_handlers(
                self.conn.manager().clone(),
                self.keys.handlers(&self.id.process_id),
                all_metrics,
                self.config.locket.process_heartbeat.get(),
                background.clone(),
            ))
        });
        // A-22: the caps of this config, before the first RESERVE.
        let caps = self.config.queue_caps();
        if let Err(e) =
            crate::store::publish_caps(&mut self.conn.manager().clone(), &self.keys, &caps).await
        {
            warn!(error = %e, "could not write the queue caps; the janitor tries again");
        }
        // A-21: cancel requests, read once a second while a job runs.
        let cancels = tokio::spawn(cancel::watch_requests(
            self.conn.manager().clone(),
            self.keys.cancel(&self.id.process_id),
            control.cancels.clone(),
            background.clone(),
        ));
        // O-3 counts of the job path: written once per second and at stop (store::tally).
        let counts = tokio::spawn(crate::store::tally::flush_loop(
            self.conn.manager().clone(),
            self.conn.tally().clone(),
            self.keys.clone(),
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
        let _ = counts.await;
        let _ = cancels.await;
        if let Some(t) = handlers_task {
            let _ = t.await;
        }
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
        // H-1: handlers that start with their slot boot beside the loop (which waits for
        // a handler every class goes to, H-8).
        for h in self.handlers.distinct() {
            if h.preload() {
                tokio::spawn(h.prepare());
            }
        }
        let reason = self.work_loop(control, dead).await;
        let reason = match self.flush_pending().await {
            Some(r) => r,
            None => reason,
        };
        // H-12: processes kept between jobs get EOF, then term_timeout, then SIGKILL.
        futures::future::join_all(self.handlers.distinct().iter().map(|h| h.shutdown())).await;
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::Identity;

    #[test]
    fn lockinfo_names_the_holder_in_a_fixed_field_order() {
        let id = Identity {
            process_id: "vm:7:c0ffee01".into(),
            slot: 2,
            slot_key: "vm:7:c0ffee01:2".into(),
            worker_id: "vm:7+2:q\"x".into(),
        };
        assert_eq!(
            id.lockinfo("q", "A::B", "d1"),
            r#"{"process":"vm:7:c0ffee01","slot":2,"resque_worker":"vm:7+2:q\"x","queue":"q","class":"A::B","digest":"d1"}"#
        );
    }
}
