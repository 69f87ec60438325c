//! H-18: the processes of a threaded persistent handler (`threads = N > 1`), shared by the
//! slots of one worker. Each process runs up to N jobs at once when its `ready` says
//! `threads` (else one). A demultiplexer per process routes `started`, `done` and `group` by
//! id to the job waiting for it; a task per process sees its exit, kills and reaps what is
//! left of it (its group and every job group it recorded) and only then says it is gone, so
//! that a job that ends with it releases its locks after the process is dead (L-9).

use super::frame::Frame;
use super::proc::{self, Proc, SpawnSpec};
use super::*;
use std::collections::HashMap;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

/// Why locketd killed a process (none: it died on its own, a crash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Kill {
    /// Job `id` did not end by its stop's kill point, or was stopped at once (USR1).
    Stopped(String),
    /// Job `id` was not started within `start_timeout` (H-9).
    NoStart(String),
    /// The process broke the protocol (H-5). Its frames cannot say which job's code wrote
    /// the bad one, so each job it was running is recorded with `error`.
    Protocol(String),
    /// Retired (H-13) or the worker stopped (H-12), with no job running.
    Retired,
}

impl Kill {
    /// Whether locketd killed the process to stop or unwedge a job other than `id`: `id`
    /// is then a sibling that did nothing wrong (H-18).
    pub(super) fn for_another(&self, id: &str) -> bool {
        match self {
            Kill::Stopped(k) | Kill::NoStart(k) => k != id,
            Kill::Protocol(_) | Kill::Retired => false,
        }
    }

    /// The restart reason booked for it.
    fn reason(&self) -> &'static str {
        match self {
            Kill::Stopped(_) => "killed",
            Kill::NoStart(_) => "no_start",
            Kill::Protocol(_) => "protocol",
            Kill::Retired => "retired",
        }
    }
}

/// A job (or a failure-hooks request) outstanding in a process.
struct Outstanding {
    thread: u32,
    tx: mpsc::UnboundedSender<Frame>,
    /// H-18: the job's own process groups (`group` frames), also put on its lease's `watch`.
    groups: Vec<i32>,
    watch: crate::watchdog::Watch,
}

/// What changes while a process lives.
pub(super) struct PState {
    running: HashMap<String, Outstanding>,
    pub(super) jobs: u64,
    pub(super) retiring: bool,
    /// Its retirement (EOF on fd 3) began.
    retired: bool,
    pub(super) bye: bool,
    pub(super) killed: Option<Kill>,
    last_active: Instant,
    pub(super) rss: Option<u64>,
}

/// One process of the pool.
pub(super) struct PProc {
    pub(super) pid: u32,
    pub(super) pgid: i32,
    /// Jobs it may run at once: `threads`, or 1 without the feature.
    pub(super) capacity: u32,
    max_jobs: u64,
    spawned_at: Instant,
    writer: tokio::sync::Mutex<Option<pipe::Sender>>,
    proc: tokio::sync::Mutex<Proc>,
    pub(super) st: Mutex<PState>,
    exit: watch::Receiver<Option<ExitStatus>>,
    gone: watch::Sender<bool>,
    /// The slot that booted it books its restarts.
    booted_by: Arc<Shared>,
}

fn sigkill_group(pgid: i32) {
    if pgid > 1 {
        // SAFETY: kill(2) on a process group; no memory is shared.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

impl PProc {
    pub(super) fn state<T>(&self, f: impl FnOnce(&mut PState) -> T) -> T {
        f(&mut self.st.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Takes jobs: alive, not killed, not retiring.
    fn usable(&self) -> bool {
        self.exit.borrow().is_none() && self.state(|s| s.killed.is_none() && !s.retiring)
    }

    /// A free thread, booked for `id`, with the receiver of its frames.
    fn take_thread(
        &self,
        id: &str,
        watch: &crate::watchdog::Watch,
    ) -> Option<(u32, mpsc::UnboundedReceiver<Frame>)> {
        self.state(|s| {
            if s.killed.is_some() || s.retiring || s.running.len() >= self.capacity as usize {
                return None;
            }
            let thread = (0..self.capacity).find(|k| s.running.values().all(|o| o.thread != *k))?;
            let (tx, rx) = mpsc::unbounded_channel();
            s.running.insert(
                id.to_string(),
                Outstanding {
                    thread,
                    tx,
                    groups: Vec::new(),
                    watch: watch.clone(),
                },
            );
            Some((thread, rx))
        })
    }

    pub(super) fn busy(&self) -> u32 {
        self.state(|s| u32::try_from(s.running.len()).unwrap_or(u32::MAX))
    }

    pub(super) fn thread_of(&self, id: &str) -> Option<u32> {
        self.state(|s| s.running.get(id).map(|o| o.thread))
    }

    /// SIGKILLs the process's group and every job group it recorded, booking why (the first
    /// reason counts). Synchronous: a dropped job future calls it.
    pub(super) fn kill(&self, why: Kill) {
        let groups: Vec<i32> = self.state(|s| {
            s.killed.get_or_insert(why);
            s.running.values().flat_map(|o| o.groups.clone()).collect()
        });
        sigkill_group(self.pgid);
        groups.into_iter().for_each(sigkill_group);
    }

    pub(super) fn killed(&self) -> Option<Kill> {
        self.state(|s| s.killed.clone())
    }

    pub(super) fn exited(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    pub(super) fn exit_watch(&self) -> watch::Receiver<Option<ExitStatus>> {
        self.exit.clone()
    }

    /// Waits until the process exited and nothing of it (its group, its jobs' groups) is
    /// left alive.
    pub(super) async fn gone(&self) {
        let mut rx = self.gone.subscribe();
        let _ = rx.wait_for(|g| *g).await;
    }

    /// Writes one frame line; `false` if the pipe is closed or the write failed.
    pub(super) async fn write(&self, line: &[u8]) -> bool {
        let mut w = self.writer.lock().await;
        match w.as_mut() {
            Some(w) => tokio::io::AsyncWriteExt::write_all(w, line).await.is_ok(),
            None => false,
        }
    }

    /// The last stderr lines.
    pub(super) async fn tail(&self) -> Vec<String> {
        self.proc.lock().await.tail()
    }

    /// The job (or hook) `id` is over: its groups are killed (H-18), its thread is free. When
    /// no job is left running, what the jobs left in the handler's own group is killed too
    /// (H-9; with jobs running it would kill theirs).
    pub(super) async fn release(&self, id: &str, counted: bool) {
        let (groups, idle) = self.state(|s| {
            let groups = s.running.remove(id).map(|o| o.groups).unwrap_or_default();
            if counted {
                s.jobs += 1;
            }
            s.last_active = Instant::now();
            (groups, s.running.is_empty())
        });
        groups.into_iter().for_each(sigkill_group);
        if idle && self.exited().is_none() {
            self.proc.lock().await.kill_others().await;
        }
    }

    /// Where the frames of outstanding job `id` go.
    pub(super) fn route(&self, id: &str) -> Option<mpsc::UnboundedSender<Frame>> {
        self.state(|s| s.running.get(id).map(|o| o.tx.clone()))
    }

    /// H-18: job `id` started a process group of its own (ignored once the job ended).
    /// It goes on the job's lease watchdog entry too (L-9's backstops).
    pub(super) fn add_group(&self, id: &str, pgid: i32) {
        let watch = self.state(|s| {
            let o = s.running.get_mut(id)?;
            (!o.groups.contains(&pgid)).then(|| {
                if o.groups.len() >= PRUNE_GROUPS_AT {
                    // A job that runs many commands announces a group for each: those with no
                    // process left are dropped (their number may be reused by another group).
                    o.groups.retain(|&g| crate::watchdog::has_members(g));
                }
                o.groups.push(pgid);
                o.watch.clone()
            })
        });
        if let Some(w) = watch {
            w.attach_job_group(pgid);
        }
    }

    /// Forgets job `id` without waiting (a dropped job future).
    pub(super) fn forget(&self, id: &str) {
        self.state(|s| s.running.remove(id));
    }
}

/// A job's recorded groups past which the empty ones are dropped at its next `group` frame.
const PRUNE_GROUPS_AT: usize = 64;

/// The processes of one handler in one worker, and their boots.
pub(super) struct Pool {
    pub(super) spec: Arc<Spec>,
    procs: Mutex<Vec<Arc<PProc>>>,
    boot_lock: tokio::sync::Mutex<()>,
    backoff: Mutex<(Option<Instant>, Duration)>,
    pub(super) stopping: CancellationToken,
    idle_watch: std::sync::atomic::AtomicBool,
    pub(super) app_records: std::sync::atomic::AtomicBool,
    /// Slot instances sharing the pool, and how many of them stopped (H-12: the processes
    /// end when the last slot stops, not while another slot's job runs).
    pub(super) slots: std::sync::atomic::AtomicUsize,
    slots_stopped: std::sync::atomic::AtomicUsize,
}

impl Pool {
    pub(super) fn new(spec: Arc<Spec>) -> Pool {
        Pool {
            spec,
            procs: Mutex::default(),
            boot_lock: tokio::sync::Mutex::new(()),
            backoff: Mutex::new((None, BACKOFF_FIRST)),
            stopping: CancellationToken::new(),
            idle_watch: std::sync::atomic::AtomicBool::new(false),
            app_records: std::sync::atomic::AtomicBool::new(false),
            slots: std::sync::atomic::AtomicUsize::new(0),
            slots_stopped: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn procs(&self) -> Vec<Arc<PProc>> {
        self.procs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A live process of the pool, for `status` of a slot that ran no job yet.
    pub(super) fn any(&self) -> Option<Arc<PProc>> {
        self.procs().into_iter().find(|p| p.exited().is_none())
    }

    pub(super) fn backoff_until(&self) -> Option<Instant> {
        let b = self.backoff.lock().unwrap_or_else(|p| p.into_inner()).0;
        b.filter(|t| *t > Instant::now())
    }

    /// A free thread of a usable process, booked for `id`.
    fn find(
        &self,
        id: &str,
        watch: &crate::watchdog::Watch,
    ) -> Option<(Arc<PProc>, u32, mpsc::UnboundedReceiver<Frame>)> {
        self.procs()
            .into_iter()
            .filter(|p| p.usable())
            .find_map(|p| p.take_thread(id, watch).map(|(k, rx)| (p, k, rx)))
    }

    pub(super) fn has_room(&self) -> bool {
        self.procs()
            .iter()
            .any(|p| p.usable() && p.busy() < p.capacity)
    }

    /// H-8: a process with a free thread, or a boot now.
    pub(super) async fn ready(self: &Arc<Pool>, by: &Arc<Shared>) -> Result<(), String> {
        if self.has_room() {
            return Ok(());
        }
        let _boot = self.boot_lock.lock().await;
        if self.has_room() {
            return Ok(());
        }
        self.boot(by).await
    }

    /// A thread for `id` (its lease's `watch`): of a process with room, or of one booted now.
    pub(super) async fn acquire(
        self: &Arc<Pool>,
        id: &str,
        watch: &crate::watchdog::Watch,
        by: &Arc<Shared>,
    ) -> Result<(Arc<PProc>, u32, mpsc::UnboundedReceiver<Frame>), String> {
        for _ in 0..8 {
            if let Some(found) = self.find(id, watch) {
                return Ok(found);
            }
            let _boot = self.boot_lock.lock().await;
            if let Some(found) = self.find(id, watch) {
                return Ok(found);
            }
            self.boot(by).await?;
        }
        Err("no handler process had room after 8 boots".to_string())
    }

    /// Starts a process and waits for its `ready` (H-8); a failure backs off.
    async fn boot(self: &Arc<Pool>, by: &Arc<Shared>) -> Result<(), String> {
        if let Some(until) = self.backoff_until() {
            return Err(format!(
                "backing off for {:.1}s after a failed start",
                (until - Instant::now()).as_secs_f64()
            ));
        }
        if self.stopping.is_cancelled() {
            return Err("the worker is stopping".to_string());
        }
        let spec = &self.spec;
        by.state(|s| s.boots += 1);
        let started = Instant::now();
        let mut env = spec.env.clone();
        env.push(("LOCKETD_THREADS".to_string(), spec.threads.to_string()));
        let spawned = Proc::spawn(&SpawnSpec {
            name: &spec.name,
            argv: &spec.argv,
            dir: spec.dir.as_deref(),
            env: &env,
            max_frame: spec.max_frame,
        });
        let mut p = match spawned {
            Ok(p) => p,
            Err(e) => {
                return Err(self
                    .failed(by, None, format!("cannot start {:?}: {e}", spec.argv[0]))
                    .await)
            }
        };
        let features =
            match super::demux::ready_frame(&mut p, spec.boot_timeout, &self.stopping).await {
                Ok((features, pid)) => {
                    p.ready_pid(pid);
                    features
                }
                Err(why) => return Err(self.failed(by, Some(p), why).await),
            };
        let threaded = features.iter().any(|f| f == "threads");
        if !threaded {
            warn!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, threads = spec.threads, "adapter did not say \"threads\" in ready: one job per process");
        }
        p.fork = features.iter().any(|f| f == "fork");
        self.app_records.store(
            features.iter().any(|f| f == "failure_backend"),
            std::sync::atomic::Ordering::SeqCst,
        );
        let max_jobs = if spec.max_jobs > 0 {
            spec.max_jobs + rand::random_range(0..=spec.max_jobs_jitter)
        } else {
            0
        };
        info!(target: LOG_TARGET, handler = %spec.name, pid = p.pid, boot_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), max_jobs, threads = if threaded { spec.threads } else { 1 }, features = ?features, "handler ready");
        *self.backoff.lock().unwrap_or_else(|p| p.into_inner()) = (None, BACKOFF_FIRST);
        let frames = std::mem::replace(&mut p.frames, mpsc::channel(1).1);
        let writer = p.take_requests();
        let (gone, _) = watch::channel(false);
        let pp = Arc::new(PProc {
            pid: p.pid,
            pgid: p.pgid(),
            capacity: if threaded { spec.threads } else { 1 },
            max_jobs,
            spawned_at: p.spawned_at,
            writer: tokio::sync::Mutex::new(writer),
            exit: p.exit_watch(),
            proc: tokio::sync::Mutex::new(p),
            st: Mutex::new(PState {
                running: HashMap::new(),
                jobs: 0,
                retiring: false,
                retired: false,
                bye: false,
                killed: None,
                last_active: Instant::now(),
                rss: None,
            }),
            gone,
            booted_by: by.clone(),
        });
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(pp.clone());
        tokio::spawn(super::demux::demux(self.clone(), pp.clone(), frames));
        tokio::spawn(self.clone().lifecycle(pp));
        self.watch_idle();
        Ok(())
    }

    /// A failed boot: what started is killed, the backoff grows (H-8).
    async fn failed(&self, by: &Shared, p: Option<Proc>, why: String) -> String {
        let tail = match p {
            Some(mut p) => {
                p.kill_and_reap().await;
                p.tail()
            }
            None => Vec::new(),
        };
        let delay = {
            let mut b = self.backoff.lock().unwrap_or_else(|p| p.into_inner());
            let delay = b.1;
            *b = (Some(Instant::now() + delay), (delay * 2).min(BACKOFF_MAX));
            delay
        };
        by.restarted("boot_failed");
        by.state(|s| s.last_error = why.clone());
        warn!(target: LOG_TARGET, handler = %self.spec.name, error = %why, retry_in_s = delay.as_secs_f64(), stderr = ?tail, "handler failed to start; its jobs wait in their queues");
        why
    }

    /// One task per process: at its exit, its group and its jobs' groups are killed and
    /// reaped (H-10, H-11, H-18), it leaves the pool, and then it is `gone`.
    async fn lifecycle(self: Arc<Pool>, p: Arc<PProc>) {
        let mut exit = p.exit_watch();
        let status = proc::exited(&mut exit).await;
        let groups: Vec<i32> =
            p.state(|s| s.running.values().flat_map(|o| o.groups.clone()).collect());
        groups.into_iter().for_each(sigkill_group);
        p.proc.lock().await.kill_and_reap().await;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|q| !Arc::ptr_eq(q, &p));
        let (killed, retiring) = p.state(|s| (s.killed.clone(), s.retiring));
        let reason = match &killed {
            Some(k) => k.reason(),
            None if retiring => "retired",
            None => "exit",
        };
        if reason != "retired" {
            let text = format!("pid {} ended ({reason}, {})", p.pid, describe(status));
            p.booted_by.state(|s| s.last_error = text.clone());
            if killed.is_none() {
                warn!(target: LOG_TARGET, handler = %self.spec.name, pid = p.pid, status = %describe(status), "handler exited");
            }
        }
        p.booted_by.restarted(reason);
        if p.ready_at_healthy() {
            self.backoff.lock().unwrap_or_else(|p| p.into_inner()).1 = BACKOFF_FIRST;
        }
        p.gone.send_replace(true);
        // A fresh process at once after a kill or a death (as with threads = 1), or with
        // `preload` after a retirement, unless another has room.
        if !self.stopping.is_cancelled() && (reason != "retired" || self.spec.preload) {
            self.boot_if_needed(&p.booted_by).await;
        }
    }

    /// Boots a process unless one takes jobs. Boxed: a boot spawns the task that may call it.
    fn boot_if_needed(self: &Arc<Pool>, by: &Arc<Shared>) -> BoxFuture<'static, ()> {
        let (pool, by) = (self.clone(), by.clone());
        Box::pin(async move {
            if pool.procs().iter().any(|p| p.usable()) {
                return;
            }
            let _boot = pool.boot_lock.lock().await;
            if !pool.procs().iter().any(|p| p.usable()) {
                let _ = pool.boot(&by).await;
            }
        })
    }

    /// After a job's `done` (H-13): a process past `max_jobs`, `max_rss` or `max_lifetime`,
    /// or that said `bye`, takes no new job; it is retired once its last job ended.
    pub(super) fn recycle_if_due(self: &Arc<Pool>, p: &Arc<PProc>, memory: Option<u64>) {
        let spec = &self.spec;
        let reason = p.state(|s| {
            if p.max_jobs > 0 && s.jobs >= p.max_jobs {
                Some("max_jobs")
            } else if spec.max_rss.is_some_and(|m| memory.is_some_and(|r| r > m)) {
                Some("max_rss")
            } else if spec
                .max_lifetime
                .is_some_and(|l| p.spawned_at.elapsed() >= l)
            {
                Some("max_lifetime")
            } else if s.bye {
                Some("bye")
            } else {
                None
            }
        });
        if let Some(reason) = reason {
            self.retire(p, reason);
        }
    }

    /// Marks `p` retiring; retires it now if it runs no job (EOF on fd 3, `term_timeout`,
    /// SIGKILL). With `preload` a successor boots at once.
    pub(super) fn retire(self: &Arc<Pool>, p: &Arc<PProc>, reason: &'static str) {
        let (first, now) = p.state(|s| {
            let first = !s.retiring;
            s.retiring = true;
            let now = s.running.is_empty() && !s.retired;
            if now {
                s.retired = true;
            }
            (first, now)
        });
        if first {
            info!(target: LOG_TARGET, handler = %self.spec.name, pid = p.pid, jobs = p.state(|s| s.jobs), reason, "recycling handler: it takes no new job and retires when its running jobs end");
            if self.spec.preload && !self.stopping.is_cancelled() {
                let (pool, by) = (self.clone(), p.booted_by.clone());
                tokio::spawn(pool.boot_if_needed(&by));
            }
        }
        if now {
            let (p, grace) = (p.clone(), self.spec.term_timeout);
            tokio::spawn(async move { retire_now(&p, grace).await });
        }
    }

    /// A retiring process whose last job just ended.
    pub(super) fn retire_if_idle(self: &Arc<Pool>, p: &Arc<PProc>) {
        if p.state(|s| s.retiring && !s.retired && s.running.is_empty()) {
            self.retire(p, "retiring");
        }
    }

    /// A slot stops; at the last one (H-12) every process is retired and gone.
    pub(super) async fn shutdown(self: &Arc<Pool>) {
        use std::sync::atomic::Ordering::SeqCst;
        if self.slots_stopped.fetch_add(1, SeqCst) + 1 < self.slots.load(SeqCst) {
            return;
        }
        self.stopping.cancel();
        let procs = self.procs();
        for p in &procs {
            p.state(|s| s.retiring = true);
            if p.state(|s| !std::mem::replace(&mut s.retired, true)) {
                let (p, grace) = (p.clone(), self.spec.term_timeout);
                tokio::spawn(async move { retire_now(&p, grace).await });
            }
        }
        for p in procs {
            p.gone().await;
        }
    }

    /// `idle_timeout`: one task per pool retires a process that ran no job for that long.
    fn watch_idle(self: &Arc<Pool>) {
        let Some(idle) = self.spec.idle_timeout else {
            return;
        };
        if self
            .idle_watch
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let every = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = pool.stopping.cancelled() => return,
                }
                for p in pool.procs() {
                    let due = p.state(|s| {
                        s.running.is_empty() && !s.retiring && s.last_active.elapsed() >= idle
                    });
                    if due {
                        info!(target: LOG_TARGET, handler = %pool.spec.name, pid = p.pid, idle_s = idle.as_secs_f64(), "idle handler exits; the next job starts it again");
                        pool.retire(&p, "idle");
                    }
                }
            }
        });
    }
}

impl PProc {
    fn ready_at_healthy(&self) -> bool {
        self.spawned_at.elapsed() >= HEALTHY_AFTER
    }

    /// The memory, read at most once a second (every call when `max_rss` needs it).
    pub(super) async fn memory(&self, every_time: bool) -> Option<u64> {
        let mut p = self.proc.lock().await;
        if every_time || p.memory_read_due() {
            let m = p.memory();
            self.state(|s| s.rss = m);
            return m;
        }
        None
    }
}

/// Closes fd 3, gives the process `grace` to exit, then SIGKILLs it (H-12, H-13).
async fn retire_now(p: &PProc, grace: Duration) {
    *p.writer.lock().await = None;
    let mut exit = p.exit_watch();
    if tokio::time::timeout(grace, proc::exited(&mut exit))
        .await
        .is_err()
    {
        p.kill(Kill::Retired);
    }
    p.gone().await;
}
