//! The processes a benchmark run owns: a scratch dir, a private redis-server and the real
//! `locketd` binary. Every one is stopped (and the dir removed) when its guard drops, so an
//! error, a panic or Ctrl-C leaves nothing behind.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set by SIGINT/SIGTERM: every wait gives up and the guards clean up.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Registers SIGINT and SIGTERM to set [`INTERRUPTED`].
pub fn install_interrupt() -> Result<()> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone())?;
    }
    std::thread::spawn(move || loop {
        if flag.load(Ordering::Relaxed) {
            INTERRUPTED.store(true, Ordering::Relaxed);
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    });
    Ok(())
}

/// Fails once the run was interrupted.
pub fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// Sleeps `d` in small steps, failing early when interrupted.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupt()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(20)));
    }
}

/// A directory under the system temp dir, removed on drop.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `locketd-bench-<pid>-<nanos>`.
    pub fn new() -> Result<ScratchDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("locketd-bench-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(ScratchDir(p))
    }
    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A private redis-server on a free loopback port, no persistence.
pub struct RedisServer {
    child: Child,
    /// Its port.
    pub port: u16,
}

impl RedisServer {
    /// Starts it in `dir` and waits (up to 10 s) until it answers PING.
    pub fn start(dir: &Path) -> Result<RedisServer> {
        let port = free_port()?;
        let log = File::create(dir.join("redis.log"))?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting redis-server (is it installed and on PATH?)")?;
        let server = RedisServer { child, port };
        let client = redis::Client::open(server.url())?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            check_interrupt()?;
            if let Ok(mut c) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return Ok(server);
                }
            }
            if Instant::now() > deadline {
                bail!("redis-server on port {port} did not answer within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A new connection.
    pub fn conn(&self) -> Result<redis::Connection> {
        let c =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(5))?;
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(c)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `locketd` in its own process group, logging to a file.
pub struct Daemon {
    child: Child,
    exited: Option<ExitStatus>,
    /// Its pid (and process group id).
    pub pid: i32,
    /// Its log file.
    pub log: PathBuf,
    exe: PathBuf,
}

impl Daemon {
    /// Writes `config` to `<dir>/<name>.toml` and starts `locketd --config it <args>`.
    pub fn start(
        exe: &Path,
        dir: &Path,
        name: &str,
        config: &str,
        args: &[String],
    ) -> Result<Daemon> {
        let cfg = dir.join(format!("{name}.toml"));
        fs::write(&cfg, config)?;
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log)?;
        let err = out.try_clone()?;
        let child = Command::new(exe)
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("QUEUES")
            .env_remove("QUEUE")
            .env_remove("INTERVAL")
            .env_remove("REDIS_URL")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let pid = child.id() as i32;
        Ok(Daemon {
            child,
            exited: None,
            pid,
            log,
            exe: fs::canonicalize(exe).unwrap_or_else(|_| exe.to_path_buf()),
        })
    }

    /// The daemon's output so far.
    pub fn log_text(&self) -> String {
        fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Fails with a clear message when the daemon has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        let Some(status) = self.exited else {
            return Ok(());
        };
        let log = self.log_text();
        for flag in ["--workers", "--slots"] {
            if log.contains(&format!("unexpected argument '{flag}'")) {
                bail!(
                    "this locketd binary rejects {flag} (no multi-process / multi-slot mode yet, \
                     issues 3 and 6): rerun without it or with --workers 1"
                );
            }
        }
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "locketd exited early ({status}); last log lines:\n{}",
            tail.join("\n")
        )
    }

    /// Waits (bounded) until the log contains `needle`.
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            check_interrupt()?;
            if self.log_text().contains(needle) {
                return Ok(());
            }
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!("locketd did not log {needle:?} within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Peak RSS (VmHWM, KiB) of the daemon and of each live child running the same binary.
    pub fn peak_rss(&self, into: &mut RssPeaks) {
        if self.exited.is_some() {
            return;
        }
        if let Some(k) = vm_field(self.pid, "VmHWM:") {
            into.master_kib = into.master_kib.max(k);
        }
        if let Some(t) = cpu_ticks(self.pid) {
            into.cpu_ticks.insert(self.pid, t);
        }
        for child in children(self.pid) {
            // The master's worker processes run the same binary, each leading its own process
            // group; command handlers are the workers' children, not the master's.
            let same = fs::read_link(format!("/proc/{child}/exe"))
                .map(|p| p == self.exe)
                .unwrap_or(false);
            if same && matches!(pgid(child), Some(g) if g == child || g == self.pid) {
                if let Some(k) = vm_field(child, "VmHWM:") {
                    // A child seen once may be a handler between fork and exec: a worker
                    // process counts from its second sighting on.
                    let e = into.seen.entry(child).or_default();
                    e.0 += 1;
                    e.1 = e.1.max(k);
                    if e.0 >= 2 {
                        into.workers_kib.insert(child, e.1);
                        if let Some(t) = cpu_ticks(child) {
                            into.cpu_ticks.insert(child, t);
                        }
                    }
                }
            }
        }
        // Long-lived handler processes (persistent handlers): children of the daemon or of a
        // worker process that run another program, counted from their second sighting on (a
        // command handler seldom lives that long).
        let mut parents = vec![self.pid];
        parents.extend(into.workers_kib.keys().copied());
        for parent in parents {
            for h in children(parent) {
                let other = fs::read_link(format!("/proc/{h}/exe"))
                    .map(|p| p != self.exe)
                    .unwrap_or(false);
                if !other {
                    continue;
                }
                let Some(k) = vm_field(h, "VmHWM:") else {
                    continue;
                };
                let e = into.seen.entry(h).or_default();
                e.0 += 1;
                e.1 = e.1.max(k);
                if e.0 >= 2 {
                    into.handlers_kib.insert(h, e.1);
                    if let Some(t) = cpu_ticks(h) {
                        into.handler_ticks.insert(h, t);
                    }
                }
            }
        }
    }

    /// SIGTERM, then waits up to `grace` before SIGKILLing the group.
    pub fn stop(mut self, grace: Duration) -> Option<ExitStatus> {
        self.stop_inner(grace)
    }

    fn stop_inner(&mut self, grace: Duration) -> Option<ExitStatus> {
        if self.exited.is_none() {
            // SAFETY: kill(2) on our own unreaped child's process group.
            unsafe { libc::kill(-self.pid, libc::SIGTERM) };
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(Some(s)) = self.child.try_wait() {
                    self.exited = Some(s);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // Whatever is left goes now: the master's group, and each worker's own group (workers
        // and their handlers lead groups of their own). The group id stays ours while any
        // member lives.
        let workers = children(self.pid);
        // SAFETY: as above; ESRCH when a group is already empty is harmless. The worker pids
        // are our child's unreaped children.
        unsafe {
            libc::kill(-self.pid, libc::SIGKILL);
            for w in workers {
                libc::kill(-w, libc::SIGKILL);
                libc::kill(w, libc::SIGKILL);
            }
        }
        if self.exited.is_none() {
            self.exited = self.child.wait().ok();
        }
        self.exited
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_inner(Duration::from_secs(5));
    }
}

/// Peak resident set sizes seen while polling.
#[derive(Debug, Default, Clone)]
pub struct RssPeaks {
    /// The daemon process itself (the master once there are worker processes).
    pub master_kib: u64,
    /// Child processes running the locketd binary (worker processes), by pid.
    pub workers_kib: BTreeMap<i32, u64>,
    /// Every locketd child sampled: (times seen, peak KiB).
    seen: BTreeMap<i32, (u32, u64)>,
    /// CPU time (user + system, clock ticks) at the latest sample, of the daemon and of each
    /// worker process, by pid.
    cpu_ticks: BTreeMap<i32, u64>,
    /// Long-lived handler processes (persistent handlers), by pid: peak KiB.
    pub handlers_kib: BTreeMap<i32, u64>,
    /// CPU time (clock ticks) of each handler process at its latest sample.
    handler_ticks: BTreeMap<i32, u64>,
}

impl RssPeaks {
    /// Largest worker peak, if any worker process was seen.
    pub fn max_worker_kib(&self) -> Option<u64> {
        self.workers_kib.values().copied().max()
    }

    /// CPU seconds the daemon and its worker processes had used by the latest sample (start-up
    /// included).
    pub fn cpu_secs(&self) -> f64 {
        self.cpu_ticks.values().sum::<u64>() as f64 / clk_tck()
    }

    /// CPU seconds the handler processes had used by their latest samples (boot included).
    pub fn handler_cpu_secs(&self) -> f64 {
        self.handler_ticks.values().sum::<u64>() as f64 / clk_tck()
    }

    /// Largest handler peak, if any handler process was seen.
    pub fn max_handler_kib(&self) -> Option<u64> {
        self.handlers_kib.values().copied().max()
    }
}

/// Clock ticks per second (`/proc/<pid>/stat` counts CPU time in them).
pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// utime + stime of `pid` (fields 14 and 15 of `/proc/<pid>/stat`), in clock ticks.
pub fn cpu_ticks(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = s[s.rfind(')')? + 1..].split_whitespace();
    // After the command name: state is field 3, so utime (14) is the 12th field from here.
    let utime: u64 = rest.nth(11)?.parse().ok()?;
    let stime: u64 = rest.next()?.parse().ok()?;
    Some(utime + stime)
}

/// A `Vm*:` field of `/proc/<pid>/status`, in KiB.
pub fn vm_field(pid: i32, field: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The process group of `pid` (field 5 of `/proc/<pid>/stat`).
fn pgid(pid: i32) -> Option<i32> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its ')' do not.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Direct children of `pid`, from every thread's `children` file.
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// `Pss:` of `/proc/<pid>/smaps_rollup`, in KiB: the process's proportional share of every
/// page it maps (a page shared by k processes counts 1/k to each), so the PSS of a set of
/// processes sums to the memory they use together.
pub fn pss_kib(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// `root` and every process below it (children of any of its threads, recursively).
pub fn process_tree(root: i32) -> Vec<i32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        for k in children(out[i]) {
            if !out.contains(&k) {
                out.push(k);
            }
        }
        i += 1;
    }
    out
}

/// The summed PSS of some process trees at one moment.
#[derive(Debug, Default, Clone, Copy)]
pub struct TreePss {
    /// Sum of `Pss:` over the processes read, KiB.
    pub kib: u64,
    /// Processes whose `smaps_rollup` was read.
    pub processes: usize,
    /// How long reading them took.
    pub took: Duration,
}

/// The summed PSS of the trees under `roots` (a process that ends meanwhile is not counted).
pub fn tree_pss(roots: &[i32]) -> TreePss {
    let t = Instant::now();
    let mut r = TreePss::default();
    for &root in roots {
        for pid in process_tree(root) {
            if let Some(k) = pss_kib(pid) {
                r.kib += k;
                r.processes += 1;
            }
        }
    }
    r.took = t.elapsed();
    r
}

/// `name` as found on `PATH` (an executable file), like `command -v`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            fs::metadata(p)
                .map(|m| {
                    m.is_file()
                        && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
                })
                .unwrap_or(false)
        })
}

/// A long-running helper (a peer worker such as Sidekiq) in its own process group, output to
/// `<dir>/<name>.log`. Dropping it stops the group: SIGTERM, a grace, then SIGKILL.
pub struct Spawned {
    child: Child,
    exited: Option<ExitStatus>,
    /// Its pid (and process group id).
    pub pid: i32,
    /// Its output (stdout and stderr).
    pub log: PathBuf,
    name: String,
}

impl Spawned {
    /// Starts `cmd` (stdin from /dev/null).
    pub fn start(mut cmd: Command, dir: &Path, name: &str) -> Result<Spawned> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let pid = child.id() as i32;
        Ok(Spawned {
            child,
            exited: None,
            pid,
            log,
            name: name.to_string(),
        })
    }

    /// Fails, with the last lines of its output, once it has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        let Some(status) = self.exited else {
            return Ok(());
        };
        let text = fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{} exited early ({status}); last output lines:\n{}",
            self.name,
            tail.join("\n")
        )
    }

    /// SIGTERM to the group, up to `grace` for it to exit, then SIGKILL to the group.
    pub fn stop(mut self, grace: Duration) -> Option<ExitStatus> {
        self.stop_inner(grace)
    }

    fn stop_inner(&mut self, grace: Duration) -> Option<ExitStatus> {
        if self.exited.is_none() {
            // SAFETY: kill(2) on our own unreaped child's process group.
            unsafe { libc::kill(-self.pid, libc::SIGTERM) };
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(Some(s)) = self.child.try_wait() {
                    self.exited = Some(s);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // SAFETY: as above; the group id stays ours while any member lives (ESRCH otherwise).
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        if self.exited.is_none() {
            self.exited = self.child.wait().ok();
        }
        self.exited
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.stop_inner(Duration::from_secs(5));
    }
}

/// Runs `cmd` with a time limit, killing it when it runs over. Returns status, stdout, stderr.
pub fn run_bounded(
    mut cmd: Command,
    timeout: Duration,
    dir: &Path,
    name: &str,
) -> Result<(ExitStatus, String, String)> {
    let out_path = dir.join(format!("{name}.out"));
    let err_path = dir.join(format!("{name}.err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out_path)?)
        .stderr(File::create(&err_path)?)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let pid = child.id() as i32;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Ok(s);
        }
        if INTERRUPTED.load(Ordering::Relaxed) || Instant::now() > deadline {
            // SAFETY: kill(2) on our own child's process group.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = child.wait();
            break Err(anyhow::anyhow!("{name} did not finish within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| {
        fs::read(p)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    let (out, err) = (read(&out_path), read(&err_path));
    match status {
        Ok(s) => Ok((s, out, err)),
        Err(e) => Err(e.context(format!("stderr:\n{err}"))),
    }
}

/// One lowest-priority busy thread per CPU, stopped on drop. On a VM an idle vCPU halts and
/// takes long to wake, which slows every request/response ping-pong; these keep the vCPUs
/// awake while taking almost no time from normal-priority processes.
pub struct Spinners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    /// Starts them.
    pub fn start() -> Spinners {
        let stop = Arc::new(AtomicBool::new(false));
        let n = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    // SAFETY: setpriority on this thread's own id; no pointers.
                    unsafe {
                        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
                    }
                    while !stop.load(Ordering::Relaxed) && !INTERRUPTED.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
