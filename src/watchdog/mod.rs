//! The backstop of the lease deadline (issue 11, item 6): a thread of its own that SIGKILLs a
//! handler's process group once the job lock's local deadline (L-9) plus `kill_grace` has
//! passed, whatever the worker's runtime is doing.
//!
//! The worker's supervisor stops handlers on time as long as its runtime runs; this thread
//! covers the case where it does not (a blocked write, a stalled thread): then nothing else
//! would stop the handler while a second holder is admitted by the server (NEVER-1). It takes
//! no lock that the runtime holds across I/O and writes nothing but its log line, which goes to
//! the bounded log queue.
//!
//! A [`Watch`] is one run's entry: the supervisor moves its deadline on every lock extension,
//! the command handler attaches the process group it started (which puts the entry on the
//! list), and dropping the last clone takes the entry off the list at the thread's next look.
//!
//! A thread of the worker does nothing when the whole worker is frozen (SIGSTOP, a cgroup
//! freezer, a debugger) while its handler, a process of its own, runs on (finding #8). So each
//! attached entry is also reported, through the hook a worker installs ([`set_reporter`]), to
//! a process outside it: the group, and the lease's local end as an absolute CLOCK_MONOTONIC
//! time (the same clock for every process of the host, so no message delay moves it), on every
//! change; and its end when the last clone is dropped. The master (`master/pickup.rs`) keeps
//! one entry of its own per reported run on this same list, of its own process
//! ([`Watch::guard`]), and kills the group at that end if it still lives. Its entries carry the
//! group leader's start time: a group id the kernel reused for another process is never killed.
//!
//! H-18: a job of a threaded handler may start process groups of its own; each is added to
//! the job's entry ([`Watch::attach_job_group`]), reported as well, and killed with the
//! handler's group, before it (`groups.rs` says how they are checked and bounded).

mod groups;
pub(crate) use groups::has_members;

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// How long the thread sleeps at most between two looks at the list.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// "No deadline" in [`Entry::deadline_ms`].
const NEVER: u64 = u64::MAX;

struct Entry {
    /// Milliseconds after [`base`], or [`NEVER`].
    deadline_ms: AtomicU64,
    /// The process group to kill (0: none attached yet).
    pgid: AtomicI32,
    fired: AtomicBool,
    /// This process's number for the run, named in its reports.
    serial: u64,
    /// The lease end last reported (CLOCK_MONOTONIC ns; 0: none yet, [`NEVER`]: no end).
    reported: AtomicU64,
    /// The same end as nanoseconds after [`base`]: stable for one `Instant`, unlike its
    /// conversion to CLOCK_MONOTONIC (two clock reads), so an unchanged end is not resent.
    reported_key: AtomicU64,
    /// Whose entry it is.
    role: Role,
    /// H-18: the job's own process groups (none but in threaded mode).
    groups: groups::Groups,
}

#[derive(Clone, Copy)]
enum Role {
    /// A worker's own run.
    Own,
    /// The master's guard over a worker's run: the worker's pid, and the group leader's start
    /// time (`/proc/<pid>/stat` field 22) when the worker reported it.
    Guard { worker: u32, start: u64 },
}

/// What a worker tells the master about its runs (see the module's text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseNote {
    /// Run `serial`'s handler group is `pgid`; its lease ends at `until_ns` (CLOCK_MONOTONIC
    /// nanoseconds; `None`: no end, the run keeps going without its lock).
    Lease {
        /// The run's number in this process.
        serial: u64,
        /// The handler's process group.
        pgid: i32,
        /// The lease's local end.
        until_ns: Option<u64>,
    },
    /// H-18: run `serial`'s job started process group `pgid` of its own (its leader is a
    /// child of the handler), to be killed with the handler's group.
    Group {
        /// The run's number in this process.
        serial: u64,
        /// The job's process group.
        pgid: i32,
    },
    /// Run `serial` is over: its group is no longer the lease's.
    Forget {
        /// The run's number in this process.
        serial: u64,
    },
}

/// Where [`LeaseNote`]s go in this process (none until a worker installs it).
static REPORTER: OnceLock<UnboundedSender<LeaseNote>> = OnceLock::new();

/// Sends every attached run's [`LeaseNote`]s to `to` from now on (once per process; a second
/// call is ignored).
pub fn set_reporter(to: UnboundedSender<LeaseNote>) {
    let _ = REPORTER.set(to);
}

fn report(note: LeaseNote) {
    if let Some(to) = REPORTER.get() {
        let _ = to.send(note);
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let attached = *self.pgid.get_mut() > 0 && *self.reported.get_mut() != 0;
        if attached && matches!(self.role, Role::Own) {
            report(LeaseNote::Forget {
                serial: self.serial,
            });
        }
    }
}

/// CLOCK_MONOTONIC now, in nanoseconds: the clock std's `Instant` reads on Linux, and the
/// same for every process of the host (and its time namespace).
fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

/// `at` as CLOCK_MONOTONIC nanoseconds, to be read by another process of this host.
pub fn monotonic_ns(at: Instant) -> u64 {
    let (now, now_ns) = (Instant::now(), monotonic_now_ns());
    match at.checked_duration_since(now) {
        Some(ahead) => now_ns.saturating_add(u64::try_from(ahead.as_nanos()).unwrap_or(u64::MAX)),
        None => now_ns.saturating_sub(
            u64::try_from(now.saturating_duration_since(at).as_nanos()).unwrap_or(u64::MAX),
        ),
    }
}

/// The `Instant` of CLOCK_MONOTONIC nanoseconds `ns` (as [`monotonic_ns`] gave them).
pub fn instant_of(ns: u64) -> Instant {
    let (now, now_ns) = (Instant::now(), monotonic_now_ns());
    if ns >= now_ns {
        now + Duration::from_nanos(ns - now_ns)
    } else {
        now.checked_sub(Duration::from_nanos(now_ns - ns))
            .unwrap_or(now)
    }
}

/// A process's parent, process group and start time (`/proc/<pid>/stat` fields 4, 5, 22),
/// if it exists.
pub fn proc_identity(pid: i32) -> Option<(u32, i32, u64)> {
    // One read: a stat line is short (the command name is at most 15 bytes), and
    // `read_to_string` would first ask procfs for a size (0) and then read in six pieces.
    let mut buf = [0u8; 1024];
    let n = std::io::Read::read(
        &mut std::fs::File::open(format!("/proc/{pid}/stat")).ok()?,
        &mut buf,
    )
    .ok()?;
    let stat = std::str::from_utf8(&buf[..n]).ok()?;
    // "pid (comm) S ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
    // stime cutime cstime priority nice threads itrealvalue starttime ...", comm may hold
    // spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: f[0] is field 3 (state).
    Some((
        f.get(1)?.parse().ok()?,
        f.get(2)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

struct Board {
    entries: Mutex<Vec<Weak<Entry>>>,
    wake: Condvar,
}

/// The instant deadlines are counted from (the first use in this process).
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// The list and its thread, started by the first attached process group.
fn board() -> &'static Board {
    static BOARD: OnceLock<Board> = OnceLock::new();
    BOARD.get_or_init(|| {
        let started = std::thread::Builder::new()
            .name("locketd-watchdog".into())
            .spawn(watch_loop);
        if let Err(e) = started {
            // Without the thread the runtime's own deadline still applies; say so once.
            tracing::error!(error = %e, "cannot start the lease watchdog thread");
        }
        Board {
            entries: Mutex::new(Vec::new()),
            wake: Condvar::new(),
        }
    })
}

/// One supervised run's entry on the watchdog's list. Cheap to clone; the entry leaves the
/// list when the last clone is dropped. [`Watch::default`] is an entry that never fires.
#[derive(Clone, Default)]
pub struct Watch {
    entry: Option<Arc<Entry>>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("armed", &self.entry.is_some())
            .finish()
    }
}

impl Watch {
    /// A new entry with no deadline and no process group. It joins the watchdog's list only
    /// when a process group is attached, so a run without one (an in-process handler) costs
    /// one allocation and never touches the list or its thread.
    pub fn new() -> Watch {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        Watch::with_role(Role::Own, SERIAL.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn with_role(role: Role, serial: u64) -> Watch {
        Watch {
            entry: Some(Arc::new(Entry {
                deadline_ms: AtomicU64::new(NEVER),
                pgid: AtomicI32::new(0),
                fired: AtomicBool::new(false),
                serial,
                reported: AtomicU64::new(0),
                reported_key: AtomicU64::new(0),
                role,
                groups: groups::Groups::default(),
            })),
        }
    }

    /// The master's guard over run `serial` of worker `worker`, whose handler group `pgid`
    /// the worker reported: `None` unless that group's leader lives, leads it, and is the
    /// worker's child (or, the worker gone, this process's adopted one). Its start time is
    /// kept, and checked again before the kill. Without a deadline until [`Watch::kill_at`].
    pub fn guard(worker: u32, serial: u64, pgid: i32) -> Option<Watch> {
        let (ppid, pgrp, start) = proc_identity(pgid)?;
        if pgrp != pgid || (ppid != worker && ppid != std::process::id()) {
            return None;
        }
        let w = Watch::with_role(Role::Guard { worker, start }, serial);
        w.attach(pgid);
        Some(w)
    }

    /// Reports the lease's local end to the master (see the module's text): `None` when the
    /// run goes on without one. Only a change is sent, and only once a group is attached.
    pub fn lease_ends(&self, end: Option<Instant>) {
        let Some(entry) = &self.entry else { return };
        let key = end.map_or(NEVER, |e| {
            let after = e.saturating_duration_since(base()).as_nanos();
            u64::try_from(after).unwrap_or(NEVER - 1).max(1)
        });
        if entry.reported_key.swap(key, Ordering::SeqCst) == key {
            return;
        }
        let ns = end.map_or(NEVER, |e| monotonic_ns(e).max(1));
        let first = entry.reported.swap(ns, Ordering::SeqCst) == 0;
        let pgid = entry.pgid.load(Ordering::SeqCst);
        if pgid > 0 {
            report(LeaseNote::Lease {
                serial: entry.serial,
                pgid,
                until_ns: end.map(|_| ns),
            });
            if first {
                // Job groups added before the run was first reported (H-18).
                for g in entry.groups.pgids() {
                    report(LeaseNote::Group {
                        serial: entry.serial,
                        pgid: g,
                    });
                }
            }
        }
    }

    /// Kill the attached group once `at` has passed (replacing any earlier deadline). A store
    /// of one number: the thread looks at least every [`LOOK_EVERY`], and is woken only for a
    /// deadline nearer than that.
    pub fn kill_at(&self, at: Instant) {
        let Some(entry) = &self.entry else { return };
        let ms = at.saturating_duration_since(base()).as_millis();
        let ms = u64::try_from(ms).unwrap_or(NEVER - 1);
        entry.deadline_ms.store(ms, Ordering::SeqCst);
        if entry.pgid.load(Ordering::SeqCst) > 0 && at < Instant::now() + LOOK_EVERY {
            board().wake.notify_one();
        }
    }

    /// Like [`Watch::kill_at`], but never moves a deadline already set earlier.
    pub fn kill_later(&self, at: Instant) {
        let Some(entry) = &self.entry else { return };
        let ms =
            u64::try_from(at.saturating_duration_since(base()).as_millis()).unwrap_or(NEVER - 1);
        let current = entry.deadline_ms.load(Ordering::SeqCst);
        if current == NEVER || ms > current {
            self.kill_at(at);
        }
    }

    /// The process group this run's handler started (a command handler calls this after
    /// spawn): the entry joins the watchdog's list.
    pub fn attach(&self, pgid: i32) {
        let Some(entry) = &self.entry else { return };
        if pgid <= 0 || entry.pgid.swap(pgid, Ordering::SeqCst) > 0 {
            return;
        }
        let reported = entry.reported.load(Ordering::SeqCst);
        if reported != 0 && matches!(entry.role, Role::Own) {
            report(LeaseNote::Lease {
                serial: entry.serial,
                pgid,
                until_ns: (reported != NEVER).then_some(reported),
            });
        }
        let board = board();
        let mut entries = board.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.push(Arc::downgrade(entry));
        drop(entries);
        // The thread looks at its list at least every LOOK_EVERY: it is woken only for a
        // deadline nearer than that (a persistent handler attaches its group on every job).
        let now_ms = u64::try_from(base().elapsed().as_millis()).unwrap_or(NEVER - 1);
        let soon = now_ms.saturating_add(u64::try_from(LOOK_EVERY.as_millis()).unwrap_or(0));
        if entry.deadline_ms.load(Ordering::SeqCst) < soon {
            board.wake.notify_one();
        }
    }

    /// H-18: a process group the run's job started (a `group` frame), after the handler's
    /// group was attached (else ignored): killed with it, before it, and reported to the
    /// master. Within [`groups::MAX_GROUPS`] (`groups.rs`).
    pub fn attach_job_group(&self, pgid: i32) {
        let Some(entry) = &self.entry else { return };
        let handler = entry.pgid.load(Ordering::SeqCst);
        if pgid <= 1 || handler <= 0 || pgid == handler {
            return;
        }
        let start = match proc_identity(pgid) {
            Some((_, pgrp, start)) if pgrp == pgid => start,
            _ => 0,
        };
        if self.add_group(entry, pgid, start) && entry.reported.load(Ordering::SeqCst) != 0 {
            report(LeaseNote::Group {
                serial: entry.serial,
                pgid,
            });
        }
    }

    /// The master's guard takes job group `pgid` of the run it guards (a [`LeaseNote::Group`])
    /// if its leader lives, leads it, and is a child of a process of the guarded handler's
    /// group (whose leader is still the process the guard was made for: the group's members
    /// are then that handler's) or, the handler gone, this process's adopted one. Whether it
    /// is guarded now.
    pub fn guard_job_group(&self, pgid: i32) -> bool {
        let Some(entry) = &self.entry else {
            return false;
        };
        let Role::Guard { worker, start } = entry.role else {
            return false;
        };
        let handler = entry.pgid.load(Ordering::SeqCst);
        let Some((ppid, pgrp, leader_start)) = proc_identity(pgid) else {
            return false;
        };
        let handler_is_ours = || proc_identity(handler).is_some_and(|(_, _, s)| s == start);
        let parent_in_handler = || match i32::try_from(ppid) {
            Ok(p) if p == handler => true,
            Ok(p) => proc_identity(p).is_some_and(|(_, g, _)| g == handler),
            Err(_) => false,
        };
        let by_handler = handler > 0 && parent_in_handler() && handler_is_ours();
        if pgrp != pgid
            || pgid == handler
            || u32::try_from(pgid).is_ok_and(|p| p == worker)
            || !(by_handler || ppid == std::process::id())
        {
            return false;
        }
        self.add_group(entry, pgid, leader_start)
    }

    fn add_group(&self, entry: &Entry, pgid: i32, start: u64) -> bool {
        match entry.groups.add(pgid, start) {
            groups::Added::New => true,
            groups::Added::Known => false,
            groups::Added::Full(first) => {
                if first {
                    tracing::warn!(
                        pgid,
                        max = groups::MAX_GROUPS,
                        "a job has too many live process groups of its own: the lease's backstops do not cover the newest (locketd still kills them at the job's end)"
                    );
                }
                false
            }
        }
    }

    /// Whether the watchdog killed this run's process group.
    pub fn fired(&self) -> bool {
        self.entry
            .as_ref()
            .is_some_and(|e| e.fired.load(Ordering::SeqCst))
    }
}

/// Kills the group of an entry whose deadline passed.
fn fire(e: &Entry, pgid: i32) {
    // H-18: the job's own groups first; their leaders are the handler's children.
    let jobs = e.groups.kill_all();
    match e.role {
        Role::Own => {
            // SAFETY: kill(2) with a negative pid signals that process group; no memory is
            // shared.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            tracing::error!(
                pgid,
                job_groups = jobs,
                "the job lock's local deadline passed while the worker was stalled; the watchdog killed the handler's process group"
            );
        }
        Role::Guard { worker, start } => {
            // The leader gone, the group id cannot have been reused while members of the
            // group live (the kernel keeps it), so they are killed; a leader with another
            // start time is another process that got the same number: left alone.
            if let Some((_, _, now)) = proc_identity(pgid) {
                if now != start {
                    return;
                }
            }
            // SAFETY: as above.
            let rc = unsafe { libc::kill(-pgid, libc::SIGKILL) };
            if rc == 0 || jobs > 0 {
                tracing::error!(
                    target: "locketd::master",
                    worker,
                    pgid,
                    job_groups = jobs,
                    "a job lock's lease is about to end and its handler still runs (its worker frozen, stalled, or cut off from Redis): the master killed the handler's process group"
                );
            }
        }
    }
}

fn watch_loop() {
    let board = board();
    let mut entries = board.entries.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now_ms = u64::try_from(base().elapsed().as_millis()).unwrap_or(NEVER - 1);
        let mut next = NEVER;
        entries.retain(|w| {
            let Some(e) = w.upgrade() else { return false };
            let pgid = e.pgid.load(Ordering::SeqCst);
            let deadline = e.deadline_ms.load(Ordering::SeqCst);
            if pgid > 0 && !e.fired.load(Ordering::SeqCst) {
                if deadline <= now_ms {
                    e.fired.store(true, Ordering::SeqCst);
                    fire(&e, pgid);
                } else {
                    next = next.min(deadline);
                }
            }
            true
        });
        let wait = Duration::from_millis(next.saturating_sub(now_ms)).min(LOOK_EVERY);
        entries = board
            .wake
            .wait_timeout(entries, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

#[cfg(test)]
mod tests;
