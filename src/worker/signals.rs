//! Signals → [`Control`] in a worker process, as a Resque worker answers them
//! (resque-protocol.md §7): QUIT finishes the running job and stops; TERM and INT stop now
//! (polite stop, SIGKILL after `term_timeout`; a second one kills at once); TERM behaves like
//! QUIT with `graceful_term` (INT never does, as in Resque); USR1 kills the running job and keeps working; USR2 pauses; CONT
//! resumes. HUP is the master's (reload) and is only logged here.

use super::Control;
use crate::process::signal_name;
use futures::StreamExt;
use signal_hook::consts::signal::{SIGCONT, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook_tokio::Signals;
use tracing::{info, warn};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::shutdown";

/// Installs the handlers and returns the control they drive. Must be called inside a runtime.
pub fn install(graceful_term: bool) -> std::io::Result<Control> {
    let control = Control::default();
    if std::env::var(crate::process::PAUSED_ENV).is_ok_and(|v| v == "1") {
        info!(target: LOG_TARGET, "starting paused: the master is paused (USR2); CONT resumes");
        control.set_paused(true);
    }
    let mut signals = Signals::new([SIGQUIT, SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGCONT, SIGHUP])?;
    let c = control.clone();
    tokio::spawn(async move {
        while let Some(sig) = signals.next().await {
            apply(&c, sig, graceful_term);
        }
    });
    Ok(control)
}

/// What one signal does to a worker's control.
pub fn apply(c: &Control, sig: i32, graceful_term: bool) {
    match sig {
        SIGQUIT => {
            info!(target: LOG_TARGET,
                signal = "QUIT",
                "finishing the running job, reserving nothing new"
            );
            c.quit();
        }
        SIGTERM if graceful_term => {
            info!(target: LOG_TARGET,
                signal = "TERM",
                "graceful_term: finishing the running job, reserving nothing new"
            );
            c.quit();
        }
        SIGTERM | SIGINT => {
            if c.term.is_cancelled() {
                warn!(target: LOG_TARGET,
                    signal = signal_name(sig),
                    "second stop signal: killing the running job now"
                );
            } else {
                info!(target: LOG_TARGET,
                    signal = signal_name(sig),
                    "stopping now: the running job gets term_timeout"
                );
            }
            c.terminate();
        }
        SIGUSR1 => c.kill_running_job(),
        SIGUSR2 => {
            info!(target: LOG_TARGET, signal = "USR2", "pausing: no new jobs until CONT");
            c.set_paused(true);
        }
        SIGCONT => {
            if c.is_paused() {
                info!(target: LOG_TARGET, signal = "CONT", "resuming");
            }
            c.set_paused(false);
        }
        SIGHUP => info!(target: LOG_TARGET, "HUP is handled by the master; ignored by a worker"),
        _ => {}
    }
}
