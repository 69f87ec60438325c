//! The watchdog's own tests (`mod.rs`).

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

#[test]
fn monotonic_times_round_trip() {
    let at = Instant::now() + Duration::from_millis(1500);
    let back = instant_of(monotonic_ns(at));
    let diff = if back > at { back - at } else { at - back };
    assert!(diff < Duration::from_millis(5), "{diff:?}");
    let past = Instant::now() - Duration::from_millis(10);
    assert!(instant_of(monotonic_ns(past)) <= Instant::now());
}

/// Finding #8: the master guards only a group whose leader is the worker's child or its
/// own (here the test is both "master" and "worker"), and never kills a group id that now names
/// another process (a leader with another start time).
#[test]
fn a_guard_checks_whose_group_it_is() {
    let mut child = group();
    let pgid = child.id() as i32;
    // pid 1 leads its group, but is neither the worker's child nor ours.
    assert!(Watch::guard(std::process::id(), 1, 1).is_none());
    let stale = Watch::with_role(
        Role::Guard {
            worker: std::process::id(),
            start: proc_identity(pgid).expect("stat").2 + 1,
        },
        2,
    );
    stale.attach(pgid);
    stale.kill_at(Instant::now());
    assert!(wait_for(&mut child, Duration::from_millis(1200)).is_none());
    let guard = Watch::guard(std::process::id(), 3, pgid).expect("our child's group");
    guard.kill_later(Instant::now() + Duration::from_millis(200));
    // An older end reported late does not move the kill earlier.
    guard.kill_later(Instant::now() + Duration::from_millis(50));
    let status = wait_for(&mut child, Duration::from_secs(5)).expect("killed");
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    drop(stale);
}

/// Finding #8: an attached run reports its group and lease end once per change (the
/// supervisor re-arms on every turn of its loop), and its end when dropped.
#[test]
fn an_attached_run_reports_each_change_and_its_end() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    set_reporter(tx);
    let child = group();
    let pgid = child.id() as i32;
    let w = Watch::new();
    let serial = w.entry.as_ref().expect("entry").serial;
    let end = Instant::now() + Duration::from_secs(60);
    w.lease_ends(Some(end));
    w.attach(pgid);
    w.lease_ends(Some(end));
    w.lease_ends(Some(end));
    w.lease_ends(Some(end + Duration::from_secs(1)));
    w.lease_ends(None);
    drop(w);
    let mut notes = Vec::new();
    while let Ok(n) = rx.try_recv() {
        let mine = match n {
            LeaseNote::Lease { serial: s, .. }
            | LeaseNote::Group { serial: s, .. }
            | LeaseNote::Forget { serial: s } => s,
        };
        if mine == serial {
            notes.push(n);
        }
    }
    let ends: Vec<Option<u64>> = notes
        .iter()
        .filter_map(|n| match n {
            LeaseNote::Lease {
                pgid: p, until_ns, ..
            } if *p == pgid => Some(*until_ns),
            _ => None,
        })
        .collect();
    assert_eq!(ends.len(), 3, "{notes:?}");
    let first = ends[0].expect("an end");
    let ahead = instant_of(first).saturating_duration_since(Instant::now());
    assert!(ahead > Duration::from_secs(58), "{ahead:?}");
    assert!(ends[1].expect("an end") > first);
    assert_eq!(ends[2], None);
    assert_eq!(notes.last(), Some(&LeaseNote::Forget { serial }));
    cleanup(child);
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
