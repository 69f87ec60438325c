//! The real `locketd` binary, run as a child in its own process group.

use std::ffi::OsString;
use std::fs::{self, File};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::{
    child_pids, pid_alive, proc_stat, process_group_members, read_lossy, tail, RedisServer,
    POLL_INTERVAL,
};

/// Name of the config file written into the daemon's dir.
pub const CONFIG_FILE: &str = "locketd.toml";
/// Name of the file that receives the daemon's stdout and stderr.
pub const LOG_FILE: &str = "locketd.log";
/// How long `kill`/drop waits for the killed process group to vanish.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// Options for starting a [`Daemon`]; get one from [`Daemon::builder`].
///
/// The builder already owns the daemon's temp dir, so tests can write
/// handler scripts into [`dir`](Self::dir) and reference them in the config
/// before starting.
pub struct DaemonBuilder {
    dir: TempDir,
    config: String,
    redis_url: Option<String>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    env_remove: Vec<OsString>,
    current_dir: Option<PathBuf>,
    program: PathBuf,
}

impl DaemonBuilder {
    /// The daemon's own temp dir (config, log; default working dir).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Path the config will be written to (`<dir>/locketd.toml`).
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join(CONFIG_FILE)
    }

    /// The TOML written to `locketd.toml` (default: empty).
    pub fn config(mut self, toml: &str) -> Self {
        self.config = toml.to_string();
        self
    }

    /// Passes `--redis URL` instead of the server's URL.
    pub fn redis_url(mut self, url: &str) -> Self {
        self.redis_url = Some(url.to_string());
        self
    }

    /// Passes no `--redis` argument at all.
    pub fn no_redis_arg(mut self) -> Self {
        self.redis_url = None;
        self
    }

    /// One more argument after `--config P --redis URL`.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable (also overrides the default
    /// `RUST_LOG=locketd=debug` / `NO_COLOR=1`).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        let key = key.into();
        self.env_remove.retain(|k| *k != key);
        self.env.retain(|(k, _)| *k != key);
        self.env.push((key, value.into()));
        self
    }

    /// Removes an environment variable from the daemon's environment.
    pub fn env_remove(mut self, key: impl Into<OsString>) -> Self {
        let key = key.into();
        self.env.retain(|(k, _)| *k != key);
        self.env_remove.push(key);
        self
    }

    /// Working directory of the daemon (default: its temp dir).
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// Runs another program instead of `locketd` (for the harness's own
    /// tests; it gets the same arguments).
    pub fn program(mut self, program: impl Into<PathBuf>) -> Self {
        self.program = program.into();
        self
    }

    /// Writes the config and spawns the daemon in its own process group,
    /// stdout+stderr appended to `<dir>/locketd.log`.
    pub fn start(self) -> Daemon {
        let config_path = self.config_path();
        let log_path = self.dir.path().join(LOG_FILE);
        fs::write(&config_path, &self.config).expect("write locketd.toml");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("create daemon log");
        let log_err = log.try_clone().expect("clone daemon log");

        let mut cmd = Command::new(&self.program);
        cmd.arg("--config").arg(&config_path);
        if let Some(url) = &self.redis_url {
            cmd.arg("--redis").arg(url);
        }
        cmd.args(&self.args)
            .current_dir(self.current_dir.as_deref().unwrap_or(self.dir.path()))
            .env("RUST_LOG", "locketd=debug")
            .env("NO_COLOR", "1");
        for key in &self.env_remove {
            cmd.env_remove(key);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", self.program));
        let pid = child.id() as i32;
        Daemon {
            child: Some(child),
            pid,
            exit: None,
            config_path,
            log_path,
            dir: self.dir,
        }
    }
}

/// A running `locketd` (the real binary). Its pid is also its process
/// group id; dropping it SIGKILLs the whole group (the daemon and any
/// handler processes it left) and reaps the daemon.
///
/// [`wait_exit`](Self::wait_exit) observes the exit *without* reaping, so
/// the pid (= pgid) cannot be reused by another process before drop.
pub struct Daemon {
    child: Option<Child>,
    pid: i32,
    exit: Option<ExitStatus>,
    config_path: PathBuf,
    log_path: PathBuf,
    dir: TempDir,
}

impl Daemon {
    /// Starts `locketd --config <dir>/locketd.toml --redis <redis.url()>
    /// <extra_args>` with `RUST_LOG=locketd=debug`.
    pub fn start(redis: &RedisServer, config_toml: &str, extra_args: &[&str]) -> Daemon {
        Self::builder(redis)
            .config(config_toml)
            .args(extra_args)
            .start()
    }

    /// A builder with `--redis <redis.url()>`, empty config, no extra args.
    pub fn builder(redis: &RedisServer) -> DaemonBuilder {
        super::panic_echo::install();
        let dir = tempfile::Builder::new()
            .prefix("locketd-daemon-")
            .tempdir()
            .expect("create daemon temp dir");
        DaemonBuilder {
            dir,
            config: String::new(),
            redis_url: Some(redis.url()),
            args: Vec::new(),
            env: Vec::new(),
            env_remove: Vec::new(),
            current_dir: None,
            program: PathBuf::from(env!("CARGO_BIN_EXE_locketd")),
        }
    }

    /// The daemon's pid, which is also its process group id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the daemon printed so far (stdout and stderr).
    pub fn log(&self) -> String {
        read_lossy(&self.log_path)
    }

    /// Sends `sig` (e.g. `libc::SIGTERM`) to the daemon process only.
    /// Panics if the daemon has already exited.
    pub fn signal(&self, sig: i32) {
        assert!(
            self.child.is_some(),
            "daemon {} was already killed",
            self.pid
        );
        // SAFETY: plain kill(2); the pid is our unreaped child.
        let rc = unsafe { libc::kill(self.pid, sig) };
        assert_eq!(
            rc,
            0,
            "kill({}, {sig}): {}",
            self.pid,
            std::io::Error::last_os_error()
        );
    }

    /// Sends `sig` to the daemon's whole process group (ignores ESRCH).
    pub fn signal_group(&self, sig: i32) {
        if self.child.is_some() {
            // SAFETY: plain kill(2) on our child's process group.
            unsafe { libc::kill(-self.pid, sig) };
        }
    }

    /// The exit status if the daemon has exited (without reaping it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() && self.child.is_some() {
            self.exit = peek_exit(self.pid);
        }
        self.exit
    }

    /// True while the daemon process itself runs.
    pub fn is_running(&mut self) -> bool {
        self.child.is_some() && self.try_exit().is_none()
    }

    /// Polls (every 20 ms) until the daemon exits or `timeout` passes.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            let now = Instant::now();
            if now >= deadline || self.child.is_none() {
                return None;
            }
            std::thread::sleep(POLL_INTERVAL.min(deadline - now));
        }
    }

    /// SIGTERM, then waits up to `timeout` for the exit; panics (with the
    /// log) if the daemon is still running then.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        if let Some(status) = self.try_exit() {
            return status;
        }
        self.signal(libc::SIGTERM);
        match self.wait_exit(timeout) {
            Some(status) => status,
            None => panic!(
                "locketd (pid {}) did not exit within {timeout:?} after SIGTERM\n--- log ---\n{}",
                self.pid,
                tail(&self.log(), 200)
            ),
        }
    }

    /// Polls the log until it contains `needle`; panics with the log tail.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                panic!(
                    "locketd log has no {needle:?} after {timeout:?}\n--- log ---\n{}",
                    tail(&self.log(), 200)
                );
            }
            std::thread::sleep(POLL_INTERVAL.min(deadline - now));
        }
    }

    /// Live processes in the daemon's process group: the daemon (while it
    /// runs) and handler children that did not leave the group.
    pub fn group_pids(&self) -> Vec<i32> {
        if self.child.is_none() {
            return Vec::new();
        }
        process_group_members(self.pid)
    }

    /// The master's worker processes (its children whose title is a Resque worker's), sorted.
    pub fn worker_pids(&self) -> Vec<i32> {
        if self.child.is_none() {
            return Vec::new();
        }
        child_pids(self.pid)
            .into_iter()
            .filter(|&p| {
                fs::read(format!("/proc/{p}/cmdline"))
                    .map(|c| c.starts_with(b"resque-"))
                    .unwrap_or(false)
            })
            .collect()
    }

    /// SIGKILLs the master and its worker processes together, as a crash of the whole daemon
    /// (or the host) would: the master is stopped first so it cannot react to its workers'
    /// deaths. Handlers are left to the kernel (their PR_SET_PDEATHSIG).
    pub fn kill_master_and_workers(&self) {
        let workers = self.worker_pids();
        // SAFETY: kill(2) on our child and its worker children.
        unsafe {
            libc::kill(self.pid, libc::SIGSTOP);
            for w in &workers {
                libc::kill(*w, libc::SIGKILL);
            }
            libc::kill(self.pid, libc::SIGKILL);
        }
        let deadline = Instant::now() + KILL_TIMEOUT;
        while Instant::now() < deadline && workers.iter().any(|&w| pid_alive(w)) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The pid of the (first) worker process, waiting up to 10 s for one to run. With the
    /// default `workers = 1` this is the Resque worker's pid.
    pub fn worker_pid(&self) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(&p) = self.worker_pids().first() {
                return p;
            }
            if Instant::now() >= deadline {
                panic!(
                    "locketd master {} has no worker process\n--- log ---\n{}",
                    self.pid,
                    tail(&self.log(), 100)
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// SIGKILLs the master's process group, every descendant (workers and handlers, which
    /// lead their own groups) and their groups; waits (up to 5 s) until none is left alive,
    /// and reaps the daemon. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let mut victims = descendants(self.pid);
            victims.push((self.pid, self.pid));
            for &(pid, pgid) in &victims {
                // SAFETY: kill(2) on processes descending from our child, and their groups
                // (never ours: the daemon was spawned in its own group, and so are workers).
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    if pgid > 1 {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
            }
            let _ = child.kill();
            // SIGKILL is delivered asynchronously; wait for the processes (zombies excluded)
            // to be gone so callers can rely on it.
            let deadline = Instant::now() + KILL_TIMEOUT;
            while Instant::now() < deadline
                && (!process_group_members(self.pid).is_empty()
                    || victims.iter().any(|&(p, _)| p != self.pid && pid_alive(p)))
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            if let Ok(status) = child.wait() {
                self.exit.get_or_insert(status);
            }
        }
    }
}

/// Every live descendant of `root` as (pid, pgid).
fn descendants(root: i32) -> Vec<(i32, i32)> {
    let mut all = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for child in child_pids(parent) {
            if all.iter().any(|&(p, _)| p == child) {
                continue;
            }
            let pgid = proc_stat(child).map(|(_, _, g)| g).unwrap_or(0);
            all.push((child, pgid));
            frontier.push(child);
        }
    }
    all
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- locketd pid {} (last lines of {}) ---\n{}",
                self.pid,
                self.log_path.display(),
                tail(&self.log(), 200)
            );
            if let Some(msg) = super::panic_echo::message() {
                eprintln!("--- the test failed: {msg} ---");
            }
        }
        self.kill();
    }
}

/// Exit status of child `pid` if it has exited, leaving it a zombie
/// (`waitid` with `WNOWAIT`).
fn peek_exit(pid: i32) -> Option<ExitStatus> {
    // SAFETY: zeroed siginfo_t is a valid out-parameter for waitid(2).
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child with a valid siginfo pointer.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: waitid filled in a SIGCHLD siginfo (or left it zeroed).
    let (si_pid, si_status) = unsafe { (info.si_pid(), info.si_status()) };
    if si_pid == 0 {
        return None; // still running
    }
    let raw = match info.si_code {
        libc::CLD_EXITED => (si_status & 0xff) << 8,
        libc::CLD_KILLED => si_status & 0x7f,
        libc::CLD_DUMPED => (si_status & 0x7f) | 0x80,
        _ => return None,
    };
    Some(ExitStatus::from_raw(raw))
}
