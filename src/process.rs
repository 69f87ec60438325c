//! What a locketd process is told by its parent: the environment variables with which the
//! master starts a worker (and which a handler's environment never inherits), and the names
//! its log lines give signals.

/// The environment variable that makes the binary a worker.
pub const ROLE_ENV: &str = "LOCKETD_ROLE";
/// Set to "1" for a worker started while the master is paused (USR2, not yet CONT): it starts
/// paused, as the workers it joins or replaces are.
pub const PAUSED_ENV: &str = "LOCKETD_PAUSED";
/// The worker's index (0..workers), set in its environment.
pub const WORKER_INDEX_ENV: &str = "LOCKETD_WORKER_INDEX";
/// The incarnation the master chose for the worker's process id (`host:pid:<incarnation>`,
/// locking-semantics.md §1.1), so that it recovers exactly that process when the worker dies,
/// never another daemon's worker whose pid merely matches (pid reuse, or another pid
/// namespace on the same host name).
pub const INCARNATION_ENV: &str = "LOCKETD_INCARNATION";
/// The descriptor of a worker's pickup link to its master (`worker/pickup.rs`): an idle
/// worker asks there to be woken when a job is pushed to one of its queues.
pub const PICKUP_FD_ENV: &str = "LOCKETD_PICKUP_FD";
/// The signal a worker gets from the kernel when its master dies (`PR_SET_PDEATHSIG`). It is
/// not TERM: the kernel sends it each time the worker is re-parented away from a dying thread
/// of the master, so one death can deliver it several times (once per thread of the master
/// that exits after the one that started the worker), and a TERM that came twice would be a
/// second TERM, which kills the running job at once. The worker treats this signal as one
/// event, a first TERM, however often it arrives; an operator's TERM keeps its meaning.
pub fn parent_death_signal() -> i32 {
    libc::SIGRTMIN() + 1
}

/// The name a log line gives a signal (`signal` field): `QUIT`, `TERM`, `USR2`, ... in the
/// master's lines and the workers' alike.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGQUIT => "QUIT",
        libc::SIGTERM => "TERM",
        libc::SIGINT => "INT",
        libc::SIGUSR1 => "USR1",
        libc::SIGUSR2 => "USR2",
        libc::SIGCONT => "CONT",
        libc::SIGHUP => "HUP",
        libc::SIGKILL => "KILL",
        libc::SIGCHLD => "CHLD",
        s if s == parent_death_signal() => "parent death",
        _ => "other",
    }
}
