//! H-18, L-9: the process groups a job of a threaded handler started besides the handler's
//! own (its `group` frames). They are on the job's watchdog entry with the handler's group, so
//! that both backstops of the lease (the worker's thread and the master's guard) kill them
//! too, before the handler's group: once the handler is dead their leaders are the master's
//! (a subreaper), and nothing tells a frozen worker's master about them any more.
//!
//! Each group is kept with its leader's start time (`/proc/<pid>/stat` field 22) as read when
//! it was added, and killed only if that leader still lives with the same start time, or if
//! no process has its number any more (the kernel keeps a group's number while any member
//! lives, so it cannot name another group then). A reused number is never signalled.
//!
//! Bound: at most [`MAX_GROUPS`] per entry. A job may start many over its life; when the list
//! is full, the groups with no member left are dropped first, and a group that finds the list
//! full of live ones is not added (the worker still kills it at the job's `done` and at its
//! handler's death; the log says so once per entry).

use std::sync::Mutex;

/// The most job groups one entry holds.
pub(super) const MAX_GROUPS: usize = 64;

/// What [`Groups::add`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Added {
    /// A group not held before.
    New,
    /// Held already.
    Known,
    /// Not held: the list is full of live groups (`true` the first time).
    Full(bool),
}

/// An entry's job groups: `(pgid, the leader's start time)`; a start of 0 means the leader
/// was gone when the group was added.
#[derive(Default)]
pub(super) struct Groups {
    list: Mutex<(Vec<(i32, u64)>, bool)>,
}

impl Groups {
    fn with<T>(&self, f: impl FnOnce(&mut (Vec<(i32, u64)>, bool)) -> T) -> T {
        f(&mut self.list.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Holds `pgid` (its leader started at `start`), within [`MAX_GROUPS`].
    pub(super) fn add(&self, pgid: i32, start: u64) -> Added {
        self.with(|(list, warned)| {
            if list.iter().any(|(g, _)| *g == pgid) {
                return Added::Known;
            }
            if list.len() >= MAX_GROUPS {
                list.retain(|(g, _)| has_members(*g));
            }
            if list.len() >= MAX_GROUPS {
                let first = !*warned;
                *warned = true;
                return Added::Full(first);
            }
            list.push((pgid, start));
            Added::New
        })
    }

    /// The groups held.
    pub(super) fn pgids(&self) -> Vec<i32> {
        self.with(|(list, _)| list.iter().map(|(g, _)| *g).collect())
    }

    /// SIGKILLs every group held that is still the one added (see the module's text): how
    /// many were signalled.
    pub(super) fn kill_all(&self) -> usize {
        let list = self.with(|(list, _)| list.clone());
        list.into_iter()
            .filter(|&(pgid, start)| still_ours(pgid, start))
            // SAFETY: kill(2) with a negative pid signals that process group; no memory is
            // shared.
            .filter(|&(pgid, _)| unsafe { libc::kill(-pgid, libc::SIGKILL) } == 0)
            .count()
    }
}

/// Whether group `pgid`, whose leader started at `start` when it was added, is still that
/// group: its leader lives with that start time, or no process leads a group of that number
/// (then, if members live, the number is still theirs).
pub(super) fn still_ours(pgid: i32, start: u64) -> bool {
    match super::proc_identity(pgid) {
        None => true,
        Some((_, _, now)) => now == start && start != 0,
    }
}

/// Whether any process is in group `pgid`.
pub(crate) fn has_members(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks.
    let rc = unsafe { libc::kill(-pgid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::super::{proc_identity, Watch};
    use super::*;
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    /// A "handler" in a group of its own whose child `sleep` leads a group of its own
    /// (`setsid`), as a threaded job's subprocess: the handler and the child's pid. `nested`:
    /// the child's parent is another process of the handler's group, not its leader.
    fn handler_with_job_group(nested: bool) -> (Child, i32) {
        let script = if nested {
            "sh -c 'setsid sleep 30 & echo $!; wait'"
        } else {
            "setsid sleep 30 & echo $!; wait"
        };
        let mut handler = Command::new("sh")
            .args(["-c", script])
            .process_group(0)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        std::io::BufReader::new(handler.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the child's pid");
        let child: i32 = line.trim().parse().expect("a pid");
        let limit = Instant::now() + Duration::from_secs(5);
        while proc_identity(child).map(|(_, g, _)| g) != Some(child) && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        (handler, child)
    }

    /// Whether `pid` is gone or a zombie (bounded wait up to `limit`).
    fn ends_within(pid: i32, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = s[s.rfind(')')? + 1..].trim_start().to_string();
                    rest.chars().next()
                });
            if matches!(state, None | Some('Z') | Some('X')) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn cleanup(mut handler: Child, child: i32) {
        // SAFETY: kill(2) of the test's own processes' groups.
        unsafe {
            libc::kill(-child, libc::SIGKILL);
            libc::kill(-(handler.id() as i32), libc::SIGKILL);
        }
        let _ = handler.wait();
    }

    /// H-18, L-9: the worker's watchdog kills a job's own group with the handler's.
    #[test]
    fn the_watchdog_kills_the_job_groups_with_the_handler() {
        let (mut handler, child) = handler_with_job_group(false);
        let w = Watch::new();
        w.attach(handler.id() as i32);
        w.attach_job_group(child);
        w.kill_at(Instant::now());
        assert!(
            ends_within(child, Duration::from_secs(5)),
            "the job group lives"
        );
        assert!(handler.wait().is_ok());
        assert!(w.fired());
        cleanup(handler, child);
    }

    /// H-18, L-9: the master guards a job group only if its leader is the guarded handler's
    /// child, and kills it with the handler's group.
    #[test]
    fn a_guard_takes_only_the_handlers_childrens_groups() {
        let (nested, grandchild) = handler_with_job_group(true);
        let guard = Watch::guard(std::process::id(), 2, nested.id() as i32).expect("ours");
        assert!(
            guard.guard_job_group(grandchild),
            "a child of the handler's group"
        );
        cleanup(nested, grandchild);
        let (handler, child) = handler_with_job_group(false);
        let pgid = handler.id() as i32;
        let me = std::process::id();
        let guard = Watch::guard(me, 1, pgid).expect("our child's group");
        // Ours (the test's group) and the handler's own are not its job groups.
        assert!(!guard.guard_job_group(unsafe { libc::getpgrp() }));
        assert!(!guard.guard_job_group(pgid));
        assert!(guard.guard_job_group(child));
        assert!(!guard.guard_job_group(child), "held once");
        guard.kill_later(Instant::now());
        assert!(
            ends_within(child, Duration::from_secs(5)),
            "the job group lives"
        );
        assert!(
            ends_within(pgid, Duration::from_secs(5)),
            "the handler lives"
        );
        cleanup(handler, child);
    }

    #[test]
    fn the_list_is_bounded_and_drops_dead_groups_first() {
        let g = Groups::default();
        // Group numbers no process has (far above any pid_max): dead from the start.
        for k in 0..MAX_GROUPS {
            assert_eq!(g.add(i32::MAX - k as i32, 0), Added::New);
        }
        assert_eq!(g.add(i32::MAX, 0), Added::Known);
        // Full of dead groups: they make room.
        let me = unsafe { libc::getpgrp() };
        assert_eq!(g.add(me, 1), Added::New);
        assert_eq!(g.pgids(), vec![me]);
        for k in 1..MAX_GROUPS {
            assert_eq!(g.add(i32::MAX - k as i32, 0), Added::New);
        }
        // Full, one of them live: the dead ones go again; with live ones only it says full.
        assert_eq!(g.add(i32::MAX, 0), Added::New);
        assert_eq!(g.pgids().len(), 2);
    }
}
