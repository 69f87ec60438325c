//! Signals → [`Control`] in a worker process, as a Resque worker answers them
//! (resque-protocol.md §7): QUIT finishes the running job and stops; TERM and INT stop now
//! (polite stop, SIGKILL after `term_timeout`; a second one kills at once); TERM behaves like
//! QUIT with `graceful_term` (INT never does, as in Resque); USR1 kills the running job and keeps working; USR2 pauses; CONT
//! resumes. HUP is the master's (reload) and is only logged here. The master's death
//! (`process::parent_death_signal`, which may arrive more than once) is one first TERM.

use super::Control;
use crate::process::{parent_death_signal, signal_name};
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
    let mut signals = Signals::new([
        SIGQUIT,
        SIGTERM,
        SIGINT,
        SIGUSR1,
        SIGUSR2,
        SIGCONT,
        SIGHUP,
        parent_death_signal(),
    ])?;
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
    if sig == parent_death_signal() {
        if !c.orphan() {
            // The same death again, from another exiting thread of the master.
            return;
        }
        if graceful_term {
            warn!(target: LOG_TARGET,
                "the master died; graceful_term: finishing the running job, reserving nothing new"
            );
            c.quit();
        } else if c.term.is_cancelled() {
            // Already stopping (an operator's TERM came first): the death changes nothing.
            warn!(target: LOG_TARGET, "the master died; already stopping");
        } else {
            warn!(target: LOG_TARGET,
                "the master died: stopping now: the running job gets term_timeout"
            );
            c.terminate();
        }
        return;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    // The master's death, however often it arrives, is one first TERM; an operator's TERM
    // after it is the second stop signal, as documented.
    #[test]
    fn the_masters_death_is_one_first_term() {
        let c = Control::default();
        apply(&c, parent_death_signal(), false);
        apply(&c, parent_death_signal(), false);
        assert!(c.term.is_cancelled() && c.quit.is_cancelled());
        assert!(!c.kill.is_cancelled());
        apply(&c, SIGTERM, false);
        assert!(c.kill.is_cancelled());
    }

    // An operator's TERM first, then the master's death: still no kill.
    #[test]
    fn the_masters_death_after_a_term_changes_nothing() {
        let c = Control::default();
        apply(&c, SIGTERM, false);
        apply(&c, parent_death_signal(), false);
        apply(&c, parent_death_signal(), false);
        assert!(c.term.is_cancelled() && !c.kill.is_cancelled());
    }

    // With graceful_term the master's death is QUIT, as TERM is.
    #[test]
    fn with_graceful_term_the_masters_death_is_quit() {
        let c = Control::default();
        apply(&c, parent_death_signal(), true);
        apply(&c, parent_death_signal(), true);
        assert!(c.quit.is_cancelled() && !c.term.is_cancelled());
    }
}
