//! The command handler: one process per job, in a process group of its own, fed the payload
//! on stdin and described in `LOCKETD_*` variables; its exit status is the job's outcome. The
//! process is started by [`super::spawn`], which does not fork the worker and still gives it
//! `PR_SET_PDEATHSIG`, so it dies with the worker.

use super::{
    Handler, HandlerResult, JobContext, ARGS_ENV_LIMIT, EX_TEMPFAIL, EX_THROTTLED, RESCHEDULE,
};
use crate::config::ClassConfig;
use crate::resque::failure::{signal_status_text, JobFailure};
use futures::future::BoxFuture;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::lines::{for_each_line, STDERR_TAIL_LINES};
use super::spawn::{env_entry, Child, Program};

/// Runs a configured command per job.
///
/// Its program, directory and environment are prepared once, when the handler is built (the
/// daemon's environment is read then), and each job's process is started by
/// [`Program::spawn`](super::spawn): no fork of the worker.
#[derive(Debug, Clone)]
pub struct CommandHandler {
    program_name: Arc<str>,
    program: Arc<std::io::Result<Program>>,
    /// The exit status that reports a throttled run (RL-4).
    throttled_code: i32,
}

/// The daemon's own variables, which a handler does not inherit: the service manager's, the
/// metrics pipe's and the master's. A handler that runs locketd itself must not start as a
/// worker.
pub(super) fn daemon_env() -> [&'static str; 9] {
    [
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        crate::metrics::METRICS_FD_ENV,
        crate::process::ROLE_ENV,
        crate::process::PAUSED_ENV,
        crate::process::WORKER_INDEX_ENV,
        crate::process::INCARNATION_ENV,
        crate::process::PICKUP_FD_ENV,
    ]
}

/// The variables that describe a job, set per job over any inherited or configured value.
const JOB_ENV: [&str; 8] = [
    "LOCKETD_CLASS",
    "LOCKETD_QUEUE",
    "LOCKETD_WORKER",
    "LOCKETD_LOCK_KEYS",
    "LOCKETD_LOCK_TOKEN",
    "LOCKETD_LOCK_FENCES",
    "LOCKETD_ARGS",
    "LOCKETD_ARGS_OMITTED",
];

impl CommandHandler {
    /// From a class table (`command` must be set and non-empty; `Config::check` ensures it).
    pub fn new(class: &ClassConfig) -> CommandHandler {
        let argv = class.command.clone().unwrap_or_default();
        let mut h = CommandHandler::build(argv, class.dir.clone(), env_pairs(&class.env));
        h.throttled_code = class.throttled_exit_code.unwrap_or(EX_THROTTLED);
        h
    }

    /// From a `[handlers.<name>]` table of mode `exec`.
    pub fn from_table(table: &crate::config::HandlerConfig) -> CommandHandler {
        CommandHandler::build(
            table.command.clone(),
            table.dir.clone(),
            env_pairs(&table.env),
        )
    }

    /// A handler running `argv`.
    pub fn from_argv(argv: Vec<String>) -> CommandHandler {
        CommandHandler::build(argv, None, Vec::new())
    }

    fn build(
        argv: Vec<String>,
        dir: Option<PathBuf>,
        env: Vec<(String, String)>,
    ) -> CommandHandler {
        let program = Program::new(&argv, dir.as_deref(), &env, &daemon_env(), &JOB_ENV);
        CommandHandler {
            program_name: argv.first().map(String::as_str).unwrap_or_default().into(),
            program: Arc::new(program),
            throttled_code: EX_THROTTLED,
        }
    }
}

/// Kills the handler's whole process group when dropped, so a hard stop (the supervisor dropping
/// the future) never leaves it running.
pub(super) struct GroupGuard {
    pub(super) pgid: Option<i32>,
}

impl GroupGuard {
    pub(super) fn signal(&self, sig: i32) {
        if let Some(pgid) = self.pgid {
            // SAFETY: kill(2) with a negative pid signals that process group; no memory is shared.
            unsafe {
                libc::kill(-pgid, sig);
            }
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

impl Handler for CommandHandler {
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        let this = self.clone();
        Box::pin(async move { this.run(job, stop).await })
    }
}

impl CommandHandler {
    async fn run(&self, job: JobContext, stop: CancellationToken) -> HandlerResult {
        let program = &*self.program_name;
        let mut child = match self.spawn(&job) {
            Ok(c) => c,
            Err(e) => {
                return Err(JobFailure::new(
                    "Locket::HandlerError",
                    format!(
                        "cannot start handler {program:?} for class {}: {e}",
                        job.class
                    ),
                ))
            }
        };
        let pid = child.id();
        let guard = GroupGuard {
            pgid: i32::try_from(pid).ok().filter(|p| *p > 0),
        };
        if let Some(pgid) = guard.pgid {
            job.watch.attach(pgid);
        }
        let pipes = Pipes::start(&mut child, &job);
        let status = tokio::select! {
            s = child.wait() => s,
            _ = stop.cancelled() => {
                let at_once = job.stop_reason.at_once();
                guard.signal(if at_once { libc::SIGKILL } else { libc::SIGTERM });
                child.wait().await
            }
        };
        // The handler is gone; anything it left in its group goes too.
        drop(guard);
        let (tail, last_out) = pipes.finish().await;
        match status {
            Ok(status) if status.code() == Some(self.throttled_code) => {
                // RL-4: the remote side throttled the job; its last stdout line may say how long.
                Err(super::throttled(
                    last_out.as_deref().and_then(super::parse_retry_after),
                ))
            }
            Ok(status) => outcome(program, pid, status, tail),
            Err(e) => Err(JobFailure::new(
                "Locket::HandlerError",
                format!("waiting for handler {program:?}: {e}"),
            )),
        }
    }

    /// Starts the job's process: the handler's argv, directory and environment, the job
    /// described in `LOCKETD_*` variables, the payload on stdin, stdout and stderr piped, a
    /// process group of its own, and death with its parent.
    fn spawn(&self, job: &JobContext) -> std::io::Result<Child> {
        let program = match &*self.program {
            Ok(p) => p,
            Err(e) => return Err(std::io::Error::new(e.kind(), e.to_string())),
        };
        let json = |v: &serde_json::Result<String>| {
            v.as_ref()
                .map_or(b"[]".as_slice(), |s| s.as_bytes())
                .to_vec()
        };
        let mut env = vec![
            env_entry("LOCKETD_CLASS", job.class.as_bytes())?,
            env_entry("LOCKETD_QUEUE", job.queue.as_bytes())?,
            env_entry("LOCKETD_WORKER", job.worker.as_bytes())?,
            env_entry(
                "LOCKETD_LOCK_KEYS",
                &json(&serde_json::to_string(&job.lock_keys)),
            )?,
            env_entry("LOCKETD_LOCK_TOKEN", job.lock_token.as_bytes())?,
            env_entry(
                "LOCKETD_LOCK_FENCES",
                &json(&serde_json::to_string(&job.lock_fences)),
            )?,
        ];
        // Linux refuses to exec with one environment string over 128 KiB (E2BIG): the job
        // could never run. Large args are read from the payload on stdin instead.
        if job.args_raw.len() <= ARGS_ENV_LIMIT {
            env.push(env_entry("LOCKETD_ARGS", job.args_raw.as_bytes())?);
        } else {
            env.push(env_entry("LOCKETD_ARGS_OMITTED", b"1")?);
        }
        program.spawn(&env, job.payload.as_bytes())
    }
}

/// A table's `env`, as the pairs a command sets.
pub(super) fn env_pairs(env: &std::collections::BTreeMap<String, String>) -> Vec<(String, String)> {
    env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A persistent handler's command: its argv, directory and environment without the daemon's own
/// variables, stdout and stderr piped, a process group of its own, and death with its parent
/// (H-3). It is started once per slot, so the fork that `pre_exec` costs does not matter here;
/// one process per job goes through [`Program::spawn`] instead.
pub(super) fn base_command(
    argv: &[String],
    dir: Option<&std::path::Path>,
    env: &[(String, String)],
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    for name in daemon_env() {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(dir) = dir {
        cmd.current_dir(dir);
    }
    // SAFETY: prctl only sets a flag on the child between fork and exec; it allocates
    // nothing and is async-signal-safe. If locketd dies, the kernel kills the handler, so
    // no handler outlives the lock it ran under.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// The tasks serving a handler's pipes: the payload written to its stdin, its stdout and
/// stderr logged line by line, and the last lines of stderr kept for the failure record.
struct Pipes {
    stdin: Option<tokio::task::JoinHandle<()>>,
    out: tokio::task::JoinHandle<()>,
    err: tokio::task::JoinHandle<()>,
    tail: Arc<std::sync::Mutex<VecDeque<String>>>,
    /// The last non-empty stdout line (RL-4's `retry-after: S`).
    last_out: Arc<std::sync::Mutex<Option<String>>>,
}

impl Pipes {
    fn start(child: &mut Child, job: &JobContext) -> Pipes {
        // Only a payload too large for the pipe needs a writer; a smaller one is in it already.
        let stdin = child.stdin.take().map(|(mut stdin, written)| {
            let rest = job.payload.as_bytes()[written..].to_vec();
            tokio::spawn(async move {
                // A handler that does not read stdin closes the pipe: that is not an error.
                let _ = stdin.write_all(&rest).await;
                let _ = stdin.shutdown().await;
            })
        });
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let (class, queue) = (job.class.clone(), job.queue.clone());
        let last_out = Arc::new(std::sync::Mutex::new(None));
        let out_last = last_out.clone();
        let out = tokio::spawn(async move {
            if let Some(out) = stdout {
                for_each_line(out, |line| {
                    tracing::info!(target: "locketd::handler", class = %class, queue = %queue, stream = "stdout", "{}", line);
                    if !line.trim().is_empty() {
                        *out_last.lock().unwrap_or_else(|p| p.into_inner()) = Some(line);
                    }
                })
                .await;
            }
        });
        // Shared, so the tail is there even when the reader is cut off below.
        let tail = Arc::new(std::sync::Mutex::new(VecDeque::new()));
        let (class, queue, err_tail) = (job.class.clone(), job.queue.clone(), tail.clone());
        let err = tokio::spawn(async move {
            if let Some(err) = stderr {
                for_each_line(err, |line| {
                    tracing::warn!(target: "locketd::handler", class = %class, queue = %queue, stream = "stderr", "{}", line);
                    let mut tail = err_tail.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == STDERR_TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                })
                .await;
            }
        });
        Pipes {
            stdin,
            out,
            err,
            tail,
            last_out,
        }
    }

    /// Once the handler is gone: the stderr tail and the last stdout line. A process that left the group (setsid) may
    /// still hold the pipes: the readers get a moment to drain what the handler wrote, then
    /// they and the stdin writer are stopped, so nothing of this job outlives it.
    async fn finish(self) -> (Vec<String>, Option<String>) {
        let drain = Duration::from_secs(1);
        let (out_abort, err_abort) = (self.out.abort_handle(), self.err.abort_handle());
        let (out, err) = (self.out, self.err);
        let _ = tokio::time::timeout(drain, async {
            let _ = out.await;
            let _ = err.await;
        })
        .await;
        out_abort.abort();
        err_abort.abort();
        if let Some(t) = self.stdin {
            t.abort();
        }
        let tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let last = self.last_out.lock().unwrap_or_else(|p| p.into_inner());
        (tail.iter().cloned().collect(), last.clone())
    }
}

/// The job's result from the handler's exit: 0 is success, 75 asks to run again, another
/// status fails with the last stderr line, a signal is Resque's DirtyExit.
fn outcome(
    program: &str,
    pid: u32,
    status: std::process::ExitStatus,
    tail: Vec<String>,
) -> HandlerResult {
    use std::os::unix::process::ExitStatusExt;

    if status.success() {
        return Ok(());
    }
    let last = tail
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
        .cloned()
        .unwrap_or_default();
    if status.code() == Some(EX_TEMPFAIL) {
        return Err(JobFailure::new(
            RESCHEDULE,
            format!("{program} exited with status 75 (EX_TEMPFAIL): run again"),
        ));
    }
    if let Some(code) = status.code() {
        let mut error = format!("{program} exited with status {code}");
        if !last.is_empty() {
            error.push_str(": ");
            error.push_str(last.trim());
        }
        Err(JobFailure::new("Locket::CommandFailed", error).with_backtrace(tail))
    } else {
        let sig = status.signal().unwrap_or(0);
        Err(JobFailure::new(
            "Resque::DirtyExit",
            format!(
                "Child process received unhandled signal {}",
                signal_status_text(pid, sig)
            ),
        )
        // Resque's DirtyExit records carry an empty backtrace (resque-protocol.md §6);
        // the handler's stderr is in the log.
        .dirty())
    }
}
