//! The master process: runs N worker processes (each one Resque worker with its own pid),
//! restarts any that dies, recovers a dead worker's job and locks at once, forwards Resque's
//! signals, and reloads the config on HUP. It never reserves jobs itself.
//!
//! Workers are the same binary re-executed with the same arguments, `LOCKETD_ROLE=worker` in
//! the environment and the config text on stdin, so a worker runs exactly the config the master
//! validated (a file edited later is only read on HUP). Each worker has its own process group,
//! so a terminal's Ctrl-C reaches the master only and every signal reaches a worker once.
//!
//! The master is the workers' child subreaper: a handler left behind by a worker that was
//! SIGKILLed is re-parented to the master, which kills its process group before the dead
//! worker's locks are released (NEVER-1: no orphaned handler runs once its lock is free).

mod children;
mod orphans;
mod pickup;

use orphans::{become_subreaper, kill_orphans, reap_adopted, signal};

use crate::config::Config;
use crate::conn::Manager;
use crate::metrics::{self, Aggregate};
use crate::process::{INCARNATION_ENV, PAUSED_ENV, ROLE_ENV, WORKER_INDEX_ENV};
use crate::resque::keys::Keys;
use crate::service::{self, Sidecars};
use crate::worker::{self, JanitorReport};
use futures::StreamExt;
use signal_hook::consts::signal::{SIGCONT, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook_tokio::Signals;
use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// The largest config text a worker reads from stdin (a larger one is refused by the master
/// when it loads the file).
pub const MAX_CONFIG_BYTES: u64 = crate::config::MAX_CONFIG_BYTES;

/// Longest wait before restarting a worker that keeps dying.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(30);
/// A worker that ran this long before dying is restarted without delay.
const STABLE_RUN: Duration = Duration::from_secs(30);

/// A config as loaded: the effective settings and the text workers get on stdin.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Settings after command-line overrides, checked.
    pub config: Config,
    /// The file's text ("" when there is no file).
    pub text: String,
}

/// How to (re)load the config: called at start and on every HUP.
pub type Loader = Box<dyn Fn() -> Result<Loaded, String> + Send>;

/// How the master ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasterExit {
    /// Every worker stopped after a stop signal.
    Stopped,
    /// `interval = 0`: every worker found its queues empty and exited.
    Drained,
    /// The side-cars (`/metrics`) could not start: the workers were stopped (exit 78).
    SidecarsFailed,
    /// Redis did not answer the side-cars' connection at start: the workers were stopped
    /// (exit 69, so that systemd restarts the service; 78 would say the config is bad).
    RedisUnavailable,
}

struct Slot {
    index: u32,
    generation: u64,
    pid: u32,
    /// The incarnation part of its process id, chosen by the master (INCARNATION_ENV).
    incarnation: String,
    started: Instant,
    /// Told to stop (HUP replacement or shutdown): not restarted.
    retiring: bool,
    /// The config it was started with: its namespace and Redis are where its slots live, even
    /// after a HUP moved the master to others.
    config: Arc<Config>,
}

enum Event {
    Exited { pid: u32, status: ExitStatus },
    Restart { index: u32, generation: u64 },
}

/// Runs the master until a stop signal has stopped every worker.
pub struct Master {
    exe: PathBuf,
    args: Vec<OsString>,
    loader: Loader,
    current: Loaded,
    generation: u64,
    slots: BTreeMap<u32, Slot>,
    /// Per worker index: the last restart delay after a quick death (reset by a stable run).
    backoff: BTreeMap<u32, Duration>,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    conn: Option<Manager>,
    stopping: Option<i32>,
    /// USR2 was forwarded and no CONT since: workers started now start paused.
    paused: bool,
    /// A worker exited 0 by itself with `interval = 0`: no restarts, exit once all are gone.
    drained: bool,
    host: String,
    /// Job metrics merged from every worker's snapshots (`LOCKETD_METRICS_FD`).
    aggregate: Arc<Mutex<Aggregate>>,
    /// Cancelled on a stop signal: the notify side-car sends `STOPPING=1`.
    stop_token: CancellationToken,
    /// Every configured worker is running (part of the watchdog's health check).
    healthy: Arc<AtomicBool>,
    /// Worker processes running and not retiring.
    running: Arc<AtomicU64>,
    /// Slots per worker process in the running config (for the `STATUS=` line).
    slots_per_worker: Arc<AtomicU64>,
    /// The side-cars (`/metrics`, sd_notify), once started: a HUP reloads them too.
    sidecars: Option<Sidecars>,
    /// Recoveries of dead workers still running: the master waits for them before it exits.
    recoveries: Vec<tokio::task::JoinHandle<()>>,
    /// The scheduler task (SC-8: only the master runs it), once started.
    scheduler: Option<crate::scheduler::Handle>,
    /// Watches the idle workers' queues and wakes them on a push (`pickup.rs`).
    pickup: Option<pickup::Pickup>,
}

impl Master {
    /// A master for `args` (the arguments after `argv[0]`, as given to this process).
    pub fn new(args: Vec<OsString>, loader: Loader, current: Loaded) -> std::io::Result<Master> {
        let exe = std::env::current_exe()?;
        let (events_tx, events) = mpsc::unbounded_channel();
        Ok(Master {
            exe,
            args,
            loader,
            current,
            generation: 0,
            slots: BTreeMap::new(),
            backoff: BTreeMap::new(),
            events_tx,
            events,
            conn: None,
            stopping: None,
            paused: false,
            drained: false,
            host: crate::host::hostname(),
            aggregate: Arc::new(Mutex::new(Aggregate::default())),
            stop_token: CancellationToken::new(),
            healthy: Arc::new(AtomicBool::new(false)),
            running: Arc::new(AtomicU64::new(0)),
            slots_per_worker: Arc::new(AtomicU64::new(1)),
            sidecars: None,
            recoveries: Vec::new(),
            scheduler: None,
            pickup: None,
        })
    }

    /// Spawns the workers and supervises them until stopped.
    pub async fn run(mut self) -> std::io::Result<MasterExit> {
        become_subreaper();
        let mut signals =
            Signals::new([SIGQUIT, SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGCONT, SIGHUP])?;
        self.conn = crate::conn::connect(&self.current.config.redis, Duration::from_secs(5))
            .await
            .ok();
        self.pickup = Some(pickup::Pickup::start(pickup::Settings::of(
            &self.current.config,
        )));
        self.publish_plans().await;
        for index in 0..self.current.config.workers {
            self.spawn(index).await;
        }
        self.set_title();
        info!(
            workers = self.current.config.workers,
            queues = %self.current.config.queues.0.join(","),
            "master started"
        );
        self.wait_registered(Duration::from_secs(30)).await;
        self.update_health();
        self.sidecars = match self.start_sidecars().await {
            Ok(s) => Some(s),
            Err(e) => {
                let exit = if matches!(e, crate::Error::Config(_)) {
                    MasterExit::SidecarsFailed
                } else {
                    MasterExit::RedisUnavailable
                };
                error!("{:#}", anyhow::Error::from(e));
                for s in self.slots.values() {
                    signal(s.pid, SIGQUIT);
                }
                self.stopping = Some(SIGQUIT);
                let deadline = Instant::now() + Duration::from_secs(30);
                while !self.slots.is_empty() && Instant::now() < deadline {
                    if let Ok(Some(Event::Exited { pid, status })) =
                        tokio::time::timeout(Duration::from_secs(1), self.events.recv()).await
                    {
                        self.on_exit(pid, status).await;
                    }
                }
                self.finish_recoveries().await;
                return Ok(exit);
            }
        };
        self.scheduler = Some(crate::scheduler::spawn(
            &self.current.config,
            self.stop_token.clone(),
        ));
        let exit = self.supervise(&mut signals).await;
        // The stop token was cancelled by the stop signal: the scheduler releases its lock.
        self.stop_token.cancel();
        if let Some(s) = self.scheduler.take() {
            s.join().await;
        }
        self.finish_recoveries().await;
        if let Some(sidecars) = self.sidecars.take() {
            sidecars.stop().await;
        }
        exit
    }

    /// Waits (bounded) until every started worker's Resque registration is visible in Redis,
    /// so `READY=1` means the workers are registered.
    async fn wait_registered(&mut self, limit: Duration) {
        let Some(mut conn) = self.conn.clone() else {
            return;
        };
        let keys = Keys::new(&self.current.config.namespace);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let ids: Vec<String> = redis::cmd("SMEMBERS")
                .arg(keys.workers())
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            let all = self.slots.values().all(|s| {
                let (a, b) = (
                    format!("{}:{}:", self.host, s.pid),
                    format!("{}:{}+1:", self.host, s.pid),
                );
                ids.iter()
                    .any(|id| id.starts_with(&a) || id.starts_with(&b))
            });
            if all {
                return;
            }
            // A worker that died at start is handled (and restarted) by the main loop.
            if let Ok(Some(ev)) =
                tokio::time::timeout(Duration::from_millis(50), self.events.recv()).await
            {
                match ev {
                    Event::Exited { pid, status } => self.on_exit(pid, status).await,
                    Event::Restart { index, generation } => {
                        let _ = self.events_tx.send(Event::Restart { index, generation });
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
        warn!("workers not all registered after {limit:?}; reporting ready anyway");
    }

    fn update_health(&self) {
        let running = self.slots.values().filter(|s| !s.retiring).count();
        self.running.store(running as u64, Ordering::Relaxed);
        let want = self.current.config.workers as usize;
        self.healthy.store(
            self.stopping.is_some() || running >= want,
            Ordering::Relaxed,
        );
    }

    async fn start_sidecars(&self) -> crate::Result<Sidecars> {
        let agg = self.aggregate.clone();
        let healthy = self.healthy.clone();
        let running = self.running.clone();
        let slots_per_worker = self.slots_per_worker.clone();
        slots_per_worker.store(
            u64::from(self.current.config.slots.max(1)),
            Ordering::Relaxed,
        );
        service::start(
            &self.current.config,
            self.aggregate.clone(),
            move || {
                let m = agg.lock().unwrap_or_else(|p| p.into_inner()).merged();
                let failed: u64 = m.jobs.iter().map(|j| j.failed + j.killed).sum();
                let slots =
                    running.load(Ordering::Relaxed) * slots_per_worker.load(Ordering::Relaxed);
                format!(
                    "{} busy, {} idle; {} jobs done, {failed} failed",
                    m.busy,
                    slots.saturating_sub(m.busy),
                    m.jobs_done()
                )
            },
            move || healthy.load(Ordering::Relaxed),
            self.stop_token.clone(),
        )
        .await
    }

    async fn supervise(&mut self, signals: &mut Signals) -> std::io::Result<MasterExit> {
        let mut sweep = tokio::time::interval(Duration::from_secs(5));
        let mut stop_deadline: Option<tokio::time::Instant> = None;
        loop {
            if self.stopping.is_some() && self.slots.is_empty() {
                info!("every worker stopped; master exiting");
                return Ok(MasterExit::Stopped);
            }
            if self.drained && self.slots.is_empty() {
                info!("interval = 0: every worker drained its queues; master exiting");
                return Ok(MasterExit::Drained);
            }
            let deadline = stop_deadline
                .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86400));
            tokio::select! {
                Some(sig) = signals.next() => {
                    if let Some(d) = self.on_signal(sig).await {
                        stop_deadline.get_or_insert(tokio::time::Instant::now() + d);
                    }
                }
                Some(ev) = self.events.recv() => match ev {
                    Event::Exited { pid, status } => self.on_exit(pid, status).await,
                    Event::Restart { index, generation } => {
                        if self.stopping.is_none() && generation == self.generation
                            && !self.slots.values().any(|s| s.index == index && !s.retiring)
                        {
                            self.spawn(index).await;
                            self.set_title();
                        }
                    }
                },
                _ = sweep.tick() => reap_adopted(&self.worker_pids()),
                _ = tokio::time::sleep_until(deadline) => {
                    error!(left = self.slots.len(), "workers did not stop in time; killing them");
                    for s in self.slots.values() {
                        signal(s.pid, libc::SIGKILL);
                    }
                    stop_deadline = Some(tokio::time::Instant::now() + Duration::from_secs(10));
                }
            }
        }
    }

    fn worker_pids(&self) -> HashSet<u32> {
        self.slots.values().map(|s| s.pid).collect()
    }

    fn set_title(&self) {
        let state = match self.stopping {
            Some(_) => "stopping".to_string(),
            None => format!(
                "{} workers for {}",
                self.slots.values().filter(|s| !s.retiring).count(),
                self.current.config.queues.0.join(",")
            ),
        };
        crate::proctitle::set_title(&format!("locketd master: {state}"));
    }

    /// Returns how long to wait for the workers when the signal starts a stop.
    async fn on_signal(&mut self, sig: i32) -> Option<Duration> {
        let cfg = &self.current.config;
        match sig {
            SIGHUP if self.stopping.is_some() => {
                // New workers now would take new jobs, and get no stop signal.
                warn!("HUP while stopping: ignored");
                None
            }
            SIGHUP => {
                self.reload().await;
                None
            }
            SIGUSR1 | SIGUSR2 | SIGCONT => {
                if sig == SIGUSR2 {
                    self.paused = true;
                } else if sig == SIGCONT {
                    self.paused = false;
                }
                info!(
                    signal = crate::process::signal_name(sig),
                    "forwarding to every worker"
                );
                for s in self.slots.values() {
                    signal(s.pid, sig);
                }
                None
            }
            SIGQUIT | SIGTERM | SIGINT => {
                let graceful = sig == SIGQUIT || (sig == SIGTERM && cfg.graceful_term);
                let second = self.stopping.is_some();
                info!(
                    signal = crate::process::signal_name(sig),
                    graceful, second, "stopping: forwarding to every worker"
                );
                self.stopping = Some(sig);
                self.stop_token.cancel();
                for s in self.slots.values_mut() {
                    s.retiring = true;
                    signal(s.pid, sig);
                }
                self.set_title();
                let wait = if graceful {
                    cfg.locket.shutdown_timeout.get() + cfg.term_timeout.get()
                } else {
                    cfg.term_timeout.get()
                };
                Some(wait + Duration::from_secs(15))
            }
            _ => None,
        }
    }

    /// D-3a: the class plans into `<ns>:locket:plans`, before the workers start; a plan of
    /// another daemon that this one replaces with different settings is logged at warn.
    async fn publish_plans(&mut self) {
        let Some(mut conn) = self.conn.clone() else {
            return;
        };
        let plans = match crate::config::plans::Plans::compile(&self.current.config) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "class plans not published");
                return;
            }
        };
        let keys = Keys::new(&self.current.config.namespace);
        match crate::store::plans::publish(&mut conn, &keys, &plans).await {
            Ok(replaced) => {
                for d in replaced {
                    warn!(difference = %d, "published class plan replaced one with other settings (another daemon of this namespace runs another configuration)");
                }
            }
            Err(e) => {
                warn!(error = %e, "class plans not published: pushes through the enqueue function place the holds of the plans published before");
            }
        }
    }

    async fn reload(&mut self) {
        match (self.loader)() {
            Err(e) => {
                error!(error = %e, "HUP: the new config is refused; the running config stays");
            }
            Ok(loaded) => {
                // The side-cars take the new config first: a metrics address that cannot be
                // bound, or a Redis that does not answer, refuses the whole config.
                if let Some(sidecars) = self.sidecars.as_mut() {
                    if let Err(e) = sidecars.reload(&loaded.config).await {
                        error!(error = %e, "HUP: the new config is refused; the running config stays");
                        return;
                    }
                }
                self.slots_per_worker
                    .store(u64::from(loaded.config.slots.max(1)), Ordering::Relaxed);
                info!(
                    workers = loaded.config.workers,
                    "HUP: config reloaded; replacing workers gracefully"
                );
                if let Some(s) = &self.scheduler {
                    s.reload(&loaded.config);
                }
                if let Some(p) = &self.pickup {
                    p.reload(pickup::Settings::of(&loaded.config));
                }
                self.current = loaded;
                self.generation += 1;
                self.backoff.clear();
                let old: Vec<u32> = self
                    .slots
                    .values_mut()
                    .filter(|s| !s.retiring)
                    .map(|s| {
                        s.retiring = true;
                        s.pid
                    })
                    .collect();
                for pid in old {
                    signal(pid, SIGQUIT);
                }
                if let Ok(c) =
                    crate::conn::connect(&self.current.config.redis, Duration::from_secs(5)).await
                {
                    self.conn = Some(c);
                }
                self.publish_plans().await;
                for index in 0..self.current.config.workers {
                    self.spawn(index).await;
                }
                self.set_title();
            }
        }
    }
}
