//! The command handler: one process per job, in a process group of its own, fed the payload
//! on stdin and described in `LOCKETD_*` variables; its exit status is the job's outcome.

use super::{Handler, HandlerResult, JobContext, ARGS_ENV_LIMIT, EX_TEMPFAIL, RESCHEDULE};
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

/// Runs a configured command per job.
#[derive(Debug, Clone)]
pub struct CommandHandler {
    argv: Vec<String>,
    dir: Option<PathBuf>,
    env: Vec<(String, String)>,
}

impl CommandHandler {
    /// From a class table (`command` must be set and non-empty; `Config::check` ensures it).
    pub fn new(class: &ClassConfig) -> CommandHandler {
        CommandHandler {
            argv: class.command.clone().unwrap_or_default(),
            dir: class.dir.clone(),
            env: env_pairs(&class.env),
        }
    }

    /// From a `[handlers.<name>]` table of mode `exec`.
    pub fn from_table(table: &crate::config::HandlerConfig) -> CommandHandler {
        CommandHandler {
            argv: table.command.clone(),
            dir: table.dir.clone(),
            env: env_pairs(&table.env),
        }
    }

    /// A handler running `argv`.
    pub fn from_argv(argv: Vec<String>) -> CommandHandler {
        CommandHandler {
            argv,
            dir: None,
            env: Vec::new(),
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
        let program = &self.argv[0];
        let mut child = match self.command(&job).spawn() {
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
        let pid = child.id().unwrap_or(0);
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
                guard.signal(libc::SIGTERM);
                child.wait().await
            }
        };
        // The handler is gone; anything it left in its group goes too.
        drop(guard);
        let tail = pipes.finish().await;
        match status {
            Ok(status) => outcome(program, pid, status, tail),
            Err(e) => Err(JobFailure::new(
                "Locket::HandlerError",
                format!("waiting for handler {program:?}: {e}"),
            )),
        }
    }

    /// The handler's command: its argv, directory and environment, the job described in
    /// `LOCKETD_*` variables, pipes, a process group of its own, and death with its parent.
    fn command(&self, job: &JobContext) -> tokio::process::Command {
        let mut cmd = base_command(&self.argv, self.dir.as_deref(), &self.env);
        cmd.env("LOCKETD_CLASS", &job.class)
            .env("LOCKETD_QUEUE", &job.queue)
            .env("LOCKETD_WORKER", &job.worker)
            .env(
                "LOCKETD_LOCK_KEYS",
                serde_json::to_string(&job.lock_keys).unwrap_or_else(|_| "[]".into()),
            )
            .env("LOCKETD_LOCK_TOKEN", &job.lock_token)
            .env(
                "LOCKETD_LOCK_FENCES",
                serde_json::to_string(&job.lock_fences).unwrap_or_else(|_| "[]".into()),
            )
            .stdin(Stdio::piped());
        // Linux refuses to exec with one environment string over 128 KiB (E2BIG): the job
        // could never run. Large args are read from the payload on stdin instead.
        if job.args_raw.len() <= ARGS_ENV_LIMIT {
            cmd.env("LOCKETD_ARGS", &job.args_raw);
        } else {
            cmd.env_remove("LOCKETD_ARGS")
                .env("LOCKETD_ARGS_OMITTED", "1");
        }
        cmd
    }
}

/// A table's `env`, as the pairs a command sets.
pub(super) fn env_pairs(env: &std::collections::BTreeMap<String, String>) -> Vec<(String, String)> {
    env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A handler process's command: its argv, directory and environment without the daemon's own
/// variables, stdout and stderr piped, a process group of its own, and death with its parent
/// (H-3 for persistent handlers; the same for one process per job).
pub(super) fn base_command(
    argv: &[String],
    dir: Option<&std::path::Path>,
    env: &[(String, String)],
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        // The service manager's, the metrics pipe's and the master's variables are the
        // daemon's own: a handler that runs locketd itself must not start as a worker.
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .env_remove(crate::metrics::METRICS_FD_ENV)
        .env_remove(crate::process::ROLE_ENV)
        .env_remove(crate::process::PAUSED_ENV)
        .env_remove(crate::process::WORKER_INDEX_ENV)
        .env_remove(crate::process::INCARNATION_ENV)
        .env_remove(crate::process::PICKUP_FD_ENV)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
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
}

impl Pipes {
    fn start(child: &mut tokio::process::Child, job: &JobContext) -> Pipes {
        let stdin = child.stdin.take().map(|mut stdin| {
            let payload = job.payload.clone().into_bytes();
            tokio::spawn(async move {
                // A handler that does not read stdin closes the pipe: that is not an error.
                let _ = stdin.write_all(&payload).await;
                let _ = stdin.shutdown().await;
            })
        });
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let (class, queue) = (job.class.clone(), job.queue.clone());
        let out = tokio::spawn(async move {
            if let Some(out) = stdout {
                for_each_line(out, |line| {
                    tracing::info!(target: "locketd::handler", class = %class, queue = %queue, stream = "stdout", "{}", line);
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
        }
    }

    /// Once the handler is gone: the stderr tail. A process that left the group (setsid) may
    /// still hold the pipes: the readers get a moment to drain what the handler wrote, then
    /// they and the stdin writer are stopped, so nothing of this job outlives it.
    async fn finish(self) -> Vec<String> {
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
        tail.iter().cloned().collect()
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
