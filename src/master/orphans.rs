//! Processes the master adopts as a subreaper: a handler a dead worker left behind is killed
//! and reaped, so none outlives the lock it ran under.

use super::*;

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::master";

pub(super) fn signal(pid: u32, sig: i32) {
    if let Ok(p) = i32::try_from(pid) {
        if p > 0 {
            // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
            unsafe { libc::kill(p, sig) };
        }
    }
}

pub(super) fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc != 0 {
        warn!(target: LOG_TARGET,
            error = %std::io::Error::last_os_error(),
            "cannot become child subreaper: a SIGKILLed worker's handler children may outlive it"
        );
    }
}

/// Our children that are not workers: processes re-parented to us (a dead worker's handler or
/// its children), with their state letter and process group.
pub(super) fn adopted(workers: &HashSet<u32>) -> Vec<(u32, char, i32)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for pid in crate::host::pids() {
        if workers.contains(&pid) {
            continue;
        }
        // "S ppid pgrp ...": what follows the command name.
        let Some(rest) = crate::host::stat_fields(pid) else {
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
pub(super) async fn kill_orphans(workers: &HashSet<u32>) {
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
                warn!(target: LOG_TARGET,
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
pub(super) fn reap_adopted(workers: &HashSet<u32>) {
    for (pid, state, _) in adopted(workers) {
        if state == 'Z' {
            let mut status = 0;
            // SAFETY: waitpid on one specific adopted child, non-blocking.
            unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
        }
    }
}
