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

use crate::config::Config;
use crate::metrics::{self, Aggregate};
use crate::process::{INCARNATION_ENV, PAUSED_ENV, ROLE_ENV, WORKER_INDEX_ENV};
use crate::resque::keys::Keys;
use crate::service::{self, Sidecars};
use crate::worker::{self, JanitorReport};
use futures::StreamExt;
use redis::aio::ConnectionManager;
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
    conn: Option<ConnectionManager>,
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
        let exit = self.supervise(&mut signals).await;
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
                for index in 0..self.current.config.workers {
                    self.spawn(index).await;
                }
                self.set_title();
            }
        }
    }

    async fn spawn(&mut self, index: u32) {
        let incarnation = crate::store::random_hex(4);
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(&self.args)
            .env(ROLE_ENV, "worker")
            .env(INCARNATION_ENV, &incarnation)
            .env(PAUSED_ENV, if self.paused { "1" } else { "0" })
            .env(WORKER_INDEX_ENV, index.to_string())
            // The master alone talks to systemd.
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        // The worker writes metrics snapshots to fd 3; the master reads the other end.
        let pipe = metrics_pipe();
        let child_fd = pipe.as_ref().map(|(_, w)| w.as_raw_fd());
        if child_fd.is_some() {
            cmd.env(metrics::METRICS_FD_ENV, "3");
        }
        // SAFETY: prctl and dup2 only, between fork and exec; both async-signal-safe. If the
        // master dies (even SIGKILL), each worker gets TERM and stops its job, releasing its
        // locks, instead of running on unsupervised. dup2 leaves fd 3 without FD_CLOEXEC.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if let Some(fd) = child_fd {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                error!(index, error = %e, "cannot start a worker process");
                self.schedule_restart(index, Duration::ZERO);
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        if let Some((read, write)) = pipe {
            drop(write);
            match tokio::net::unix::pipe::Receiver::from_owned_fd(read) {
                Ok(rx) => {
                    tokio::spawn(metrics::read_reports(rx, pid, self.aggregate.clone()));
                }
                Err(e) => warn!(error = %e, "cannot read the worker's metrics"),
            }
        }
        if let Some(mut stdin) = child.stdin.take() {
            let text = self.current.text.clone().into_bytes();
            tokio::spawn(async move {
                let _ = stdin.write_all(&text).await;
                let _ = stdin.shutdown().await;
            });
        }
        let tx = self.events_tx.clone();
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = tx.send(Event::Exited { pid, status });
            }
        });
        info!(index, pid, "worker started");
        self.slots.insert(
            pid,
            Slot {
                config: Arc::new(self.current.config.clone()),
                index,
                generation: self.generation,
                pid,
                incarnation,
                started: Instant::now(),
                retiring: false,
            },
        );
        self.update_health();
    }

    fn schedule_restart(&mut self, index: u32, ran: Duration) {
        let delay = if ran >= STABLE_RUN {
            // A worker that had been running fine starts its backoff afresh.
            self.backoff.remove(&index);
            Duration::from_millis(100)
        } else {
            let last = self.backoff.get(&index).copied().unwrap_or_default();
            let next = if last.is_zero() {
                Duration::from_secs(1)
            } else {
                (last * 2).min(MAX_RESTART_DELAY)
            };
            self.backoff.insert(index, next);
            next
        };
        let (tx, generation) = (self.events_tx.clone(), self.generation);
        info!(
            index,
            delay_secs = delay.as_secs_f64(),
            "restarting the worker"
        );
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(Event::Restart { index, generation });
        });
    }

    async fn on_exit(&mut self, pid: u32, status: ExitStatus) {
        let Some(slot) = self.slots.remove(&pid) else {
            return;
        };
        let ran = slot.started.elapsed();
        let clean = status.code() == Some(0);
        let why = describe(&status);
        let drained = clean && self.current.config.interval.get().is_zero();
        if drained {
            self.drained = true;
        }
        if clean && (slot.retiring || self.stopping.is_some() || drained) {
            info!(index = slot.index, pid, "worker stopped");
        } else if clean {
            warn!(index = slot.index, pid, "worker exited unexpectedly: {why}");
        } else {
            error!(
                index = slot.index,
                pid,
                ran_secs = ran.as_secs(),
                "worker died: {why}"
            );
        }
        if !clean {
            // Its handler (re-parented to us) dies before its locks are released.
            kill_orphans(&self.worker_pids()).await;
            self.recover(
                pid,
                &slot.incarnation,
                &slot.config,
                format!("died ({why})"),
            );
        }
        if self.stopping.is_none()
            && !self.drained
            && slot.generation == self.generation
            && !slot.retiring
        {
            self.schedule_restart(slot.index, ran);
        }
        self.set_title();
        self.update_health();
    }

    /// R-4 for a worker we know is dead: delete its lease and recover its slots now, instead
    /// of waiting `process_ttl` for the janitor. Retried in the background while Redis is
    /// away (bounded: about two minutes), after which the janitor's lease rule takes over.
    /// It runs against the namespace and Redis the worker was started with.
    fn recover(&mut self, pid: u32, incarnation: &str, config: &Arc<Config>, why: String) {
        let cfg = Config::clone(config);
        let keys = Keys::new(&cfg.namespace);
        let process = format!("{}:{pid}:{incarnation}", self.host);
        let mut conn = if cfg.redis == self.current.config.redis {
            self.conn.clone()
        } else {
            None
        };
        self.recoveries.retain(|t| !t.is_finished());
        self.recoveries.push(tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            for attempt in 0..40 {
                if conn.is_none() {
                    conn = crate::conn::connect(&cfg.redis, Duration::from_secs(2))
                        .await
                        .ok();
                }
                if let Some(c) = conn.as_mut() {
                    match recover_exactly(c, &keys, &cfg, &process, &why).await {
                        Ok(r) => {
                            for (slot, result) in &r.recovered {
                                info!(slot = %slot, result = %result, "recovered the dead worker's slot");
                            }
                            return;
                        }
                        Err(e) if attempt == 0 => {
                            warn!(error = %e, "recovering a dead worker: redis error; retrying");
                        }
                        Err(e) => debug!(error = %e, "recovering a dead worker: still failing"),
                    }
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            warn!(
                pid,
                "could not recover the dead worker; the janitor will once its lease lapses"
            );
        }));
    }

    /// Waits (at most 30 s) for the recoveries still running: a worker killed at the stop
    /// deadline, or one that crashed during a stop, is recovered before the master exits
    /// instead of being left to a janitor that may never come.
    async fn finish_recoveries(&mut self) {
        let pending: Vec<_> = self.recoveries.drain(..).collect();
        if pending.is_empty() {
            return;
        }
        let all = futures::future::join_all(pending);
        if tokio::time::timeout(Duration::from_secs(30), all)
            .await
            .is_err()
        {
            warn!("recoveries of dead workers did not finish in 30 s; the janitor will do them");
        }
    }
}

/// Recovers the dead worker's process id, exactly: its lease is deleted first, since the
/// process is known dead.
async fn recover_exactly(
    conn: &mut ConnectionManager,
    keys: &Keys,
    config: &Config,
    process: &str,
    why: &str,
) -> redis::RedisResult<JanitorReport> {
    let mut report = JanitorReport {
        ran: true,
        ..JanitorReport::default()
    };
    let _: () = redis::cmd("DEL")
        .arg(keys.alive(process))
        .query_async(conn)
        .await?;
    worker::recover_process(conn, keys, config, process, why, &mut report).await?;
    Ok(report)
}

/// A close-on-exec pipe (read end, write end) for a worker's metrics, or `None` (logged).
fn metrics_pipe() -> Option<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        warn!(error = %std::io::Error::last_os_error(), "cannot create a metrics pipe");
        return None;
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { Some((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(0), _) => "exit status 0".into(),
        (Some(3), _) => "exit status 3 (presumed dead: its lease lapsed)".into(),
        (Some(69), _) => "exit status 69 (redis unreachable at start)".into(),
        (Some(78), _) => "exit status 78 (config error)".into(),
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!(
            "killed by {}",
            crate::resque::failure::signal_status_text(0, s).trim_start_matches("pid 0 ")
        ),
        _ => "unknown status".into(),
    }
}

fn signal(pid: u32, sig: i32) {
    if let Ok(p) = i32::try_from(pid) {
        if p > 0 {
            // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
            unsafe { libc::kill(p, sig) };
        }
    }
}

fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc != 0 {
        warn!(
            error = %std::io::Error::last_os_error(),
            "cannot become child subreaper: a SIGKILLed worker's handler children may outlive it"
        );
    }
}

/// Our children that are not workers: processes re-parented to us (a dead worker's handler or
/// its children), with their state letter and process group.
fn adopted(workers: &HashSet<u32>) -> Vec<(u32, char, i32)> {
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if workers.contains(&pid) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) S ppid pgrp ..." where comm may contain spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid: u32 = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let pgrp: i32 = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        if ppid == me {
            found.push((pid, state, pgrp));
        }
    }
    found
}

/// Kills every adopted process and its process group, and reaps them; repeats for a moment,
/// since a dead worker's handler dies (PR_SET_PDEATHSIG) and re-parents its own children a
/// little after the worker's exit is seen. Bounded: at most ~1.5 s.
async fn kill_orphans(workers: &HashSet<u32>) {
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut quiet_rounds = 0;
    while Instant::now() < deadline && quiet_rounds < 4 {
        let found = adopted(workers);
        if found.iter().all(|(_, state, _)| *state == 'Z') {
            quiet_rounds += 1;
        } else {
            quiet_rounds = 0;
        }
        for (pid, state, pgrp) in &found {
            if *state != 'Z' {
                warn!(
                    pid,
                    pgrp, "killing a dead worker's orphaned handler process group"
                );
                // SAFETY: kill(2). The group is the handler's own (never ours: workers and
                // handlers each lead a group), and the pid is our (adopted) child.
                unsafe {
                    if *pgrp > 0 && *pgrp != me {
                        libc::kill(-*pgrp, libc::SIGKILL);
                    }
                    libc::kill(*pid as i32, libc::SIGKILL);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        reap_adopted(workers);
    }
}

/// Reaps adopted children that have exited (never a worker: tokio waits for those).
fn reap_adopted(workers: &HashSet<u32>) {
    for (pid, state, _) in adopted(workers) {
        if state == 'Z' {
            let mut status = 0;
            // SAFETY: waitpid on one specific adopted child, non-blocking.
            unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
        }
    }
}
