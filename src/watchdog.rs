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

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

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
        Watch {
            entry: Some(Arc::new(Entry {
                deadline_ms: AtomicU64::new(NEVER),
                pgid: AtomicI32::new(0),
                fired: AtomicBool::new(false),
            })),
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

    /// The process group this run's handler started (a command handler calls this after
    /// spawn): the entry joins the watchdog's list.
    pub fn attach(&self, pgid: i32) {
        let Some(entry) = &self.entry else { return };
        if pgid <= 0 || entry.pgid.swap(pgid, Ordering::SeqCst) > 0 {
            return;
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

    /// Whether the watchdog killed this run's process group.
    pub fn fired(&self) -> bool {
        self.entry
            .as_ref()
            .is_some_and(|e| e.fired.load(Ordering::SeqCst))
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
                    // SAFETY: kill(2) with a negative pid signals that process group; no
                    // memory is shared.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                    tracing::error!(
                        pgid,
                        "the job lock's deadline and kill_grace passed while the worker was stalled; the watchdog killed the handler's process group"
                    );
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
mod tests {
    use super::*;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command};

    /// A `sleep` in a process group of its own, as the command handler starts handlers.
    fn group() -> Child {
        Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn sleep")
    }

    /// Waits (bounded) for the child to end; `None` if it still runs after `limit`.
    fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    fn cleanup(mut child: Child) {
        let _ = child.kill();
        let _ = child.wait();
    }

    // No async runtime runs in these tests: the kill comes from the watchdog's thread alone.
    #[test]
    fn kills_the_attached_group_once_its_deadline_passes() {
        let mut child = group();
        let watch = Watch::new();
        watch.attach(child.id() as i32);
        let t0 = Instant::now();
        watch.kill_at(t0 + Duration::from_millis(300));
        let status = wait_for(&mut child, Duration::from_secs(5)).expect("killed");
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "not before its deadline"
        );
        assert!(watch.fired());
    }

    #[test]
    fn a_moved_deadline_moves_the_kill() {
        let mut child = group();
        let watch = Watch::new();
        watch.attach(child.id() as i32);
        let t0 = Instant::now();
        watch.kill_at(t0 + Duration::from_millis(300));
        // An extension before the first deadline, as a lock heartbeat would.
        watch.kill_at(t0 + Duration::from_millis(1500));
        assert!(wait_for(&mut child, Duration::from_millis(900)).is_none());
        let status = wait_for(&mut child, Duration::from_secs(5)).expect("killed");
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(t0.elapsed() >= Duration::from_millis(1500));
    }

    #[test]
    fn a_dropped_or_unattached_entry_kills_nothing() {
        let mut dropped = group();
        let watch = Watch::new();
        watch.attach(dropped.id() as i32);
        watch.kill_at(Instant::now() + Duration::from_millis(200));
        drop(watch);
        let mut unattached = group();
        let other = Watch::new();
        other.kill_at(Instant::now());
        assert!(wait_for(&mut dropped, Duration::from_millis(1200)).is_none());
        assert!(wait_for(&mut unattached, Duration::from_millis(10)).is_none());
        assert!(!other.fired());
        cleanup(dropped);
        cleanup(unattached);
    }
}
