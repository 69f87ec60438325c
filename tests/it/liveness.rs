//! Process liveness through the real binary (locking-semantics.md R-1, R-2, R-4; issue 11
//! finding 3): a worker whose process lease lapsed (a stall or a partition longer than
//! `process_ttl`) and that was recovered must not reserve or start anything afterwards, since
//! nothing would recover what it took.

use std::time::Duration;

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

// R-2 (finding 3): the lease of a busy worker is removed (as a partition past process_ttl
// would let it lapse) and its process is recovered (its job A failed as DirtyExit); when A's
// handler then ends, the worker must not reserve the queued job B under its dead identity: B
// runs once, to its end, in a worker with a live lease, and no inflight record is left.
#[test]
fn a_recovered_worker_reserves_nothing_under_its_dead_identity() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let go = work.path().join("go");
    let h = write_script(
        work.path(),
        "job.sh",
        &format!(
            "cat >/dev/null\necho \"start $LOCKETD_ARGS\" >> {log}\n\
             case \"$LOCKETD_ARGS\" in *'\"A\"'*) for i in $(seq 300); do [ -f {go} ] && break; sleep 0.1; done;; \
             *) sleep 8;; esac\necho \"end $LOCKETD_ARGS\" >> {log}\n",
            log = log.display(),
            go = go.display()
        ),
    );
    // Heartbeats 5 s apart: the worker learns of its lost lease late, as after a stall.
    let config = cfg("q")
        .locket("process_heartbeat", "\"5s\"")
        .locket("process_ttl", "\"15s\"")
        .class("Job", &h, "lock = \"job:{args[0]}\"")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Job","args":["A"]}"#);
    wait_until(LONG, "A started", || {
        read_lossy(&log).contains("start [\"A\"]")
    });
    r.push("q", r#"{"class":"Job","args":["B"]}"#);
    let leases = r.keys(&format!("{NS}:locket:alive:*"));
    assert_eq!(leases.len(), 1, "{leases:?}");
    let _: () = r.cmd(&["DEL", &leases[0]]);
    // A janitor (the daemon's own, every 200 ms) recovers the process: A is a DirtyExit.
    wait_until(LONG, "A recovered as a DirtyExit", || {
        r.failures().len() == 1
    });
    std::fs::write(&go, "").unwrap();
    wait_until(LONG, "B ran to its end", || {
        read_lossy(&log).contains("end [\"B\"]")
    });
    let text = read_lossy(&log);
    assert_eq!(text.matches("start [\"B\"]").count(), 1, "{text}");
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "B failed or was killed: {failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    wait_until(LONG, "no inflight record left", || {
        r.keys(&format!("{NS}:locket:inflight:*")).is_empty()
    });
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    d.terminate(LONG);
}

// R-2 (issue 11 item 4): a local process-lease deadline. Redis stops answering (SIGSTOP of
// the server) while an unlocked job runs: once renewals have failed for process_ttl the
// lease has lapsed in Redis and a janitor may recover the job, so the worker stops its
// handler instead of letting it run on beside a recovered copy.
#[test]
fn renewals_failing_for_process_ttl_stop_the_running_handler() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("pid");
    let h = write_script(
        work.path(),
        "long.sh",
        &format!(
            "cat >/dev/null\necho $$ > {}\nsleep 60\n",
            pid_file.display()
        ),
    );
    let config = cfg("q").class("Long", &h, "lock = false").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Long","args":[]}"#);
    let handler = crate::daemon::wait_pid(&pid_file, LONG);
    let server = redis.pid().expect("redis-server pid");
    // SAFETY: plain kill(2) of the test's own redis-server.
    unsafe { libc::kill(server, libc::SIGSTOP) };
    // process_ttl is 2 s and kill_grace 1 s: well within 10 s the handler is stopped.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while crate::support::pid_alive(handler) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let stopped = !crate::support::pid_alive(handler);
    // SAFETY: as above.
    unsafe { libc::kill(server, libc::SIGCONT) };
    assert!(
        stopped,
        "the handler ran on after the process lease lapsed:\n{}",
        d.log()
    );
    assert!(
        d.log().contains("renewals failed for process_ttl"),
        "{}",
        d.log()
    );
    d.kill();
}

/// The pid a process has inside its own pid namespace (the last field of `NSpid:`).
fn pid_in_namespace(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The worker of a daemon started through `unshare`: unshare -> master -> worker.
fn namespaced_worker(d: &Daemon) -> Option<i32> {
    let master = *crate::support::child_pids(d.pid()).first()?;
    crate::support::child_pids(master).into_iter().find(|&p| {
        std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.starts_with(b"resque-"))
    })
}

// R-4, R-5 (issue 11 finding 4): two daemons with the same host name in separate pid
// namespaces (containers with host networking), whose workers have the same pid. When one
// daemon's worker is SIGKILLed, its master recovers exactly that worker's process id, never
// the other daemon's worker whose id merely starts with the same `host:pid:`.
#[test]
fn a_master_recovers_only_its_own_worker_when_pids_collide_across_namespaces() {
    let probe = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: unshare --pid needs root (CI runs as root)");
        return;
    }
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let marker = work.path().join("started");
    let go = work.path().join("go");
    let h = write_script(
        work.path(),
        "hold.sh",
        &format!(
            "cat >/dev/null\necho $$ > {}\nfor i in $(seq 300); do [ -f {} ] && break; sleep 0.1; done\n",
            marker.display(),
            go.display()
        ),
    );
    let wrapper = write_script(
        work.path(),
        "in-namespace.sh",
        &format!(
            "exec unshare --pid --fork --mount-proc --kill-child {} \"$@\"\n",
            env!("CARGO_BIN_EXE_locketd")
        ),
    );
    let config_x = cfg("x").class("Hold", &h, "lock = \"L\"").render();
    let config_y = cfg("y").class("Hold", &h, "lock = \"L\"").render();
    let mut x = Daemon::builder(&redis)
        .config(&config_x)
        .program(&wrapper)
        .start();
    r.push("x", r#"{"class":"Hold","args":[1]}"#);
    crate::daemon::wait_pid(&marker, LONG);
    let mut y = Daemon::builder(&redis)
        .config(&config_y)
        .program(&wrapper)
        .start();
    wait_until(LONG, "both daemons registered", || r.workers().len() == 2);
    let (wx, wy) = (
        namespaced_worker(&x).unwrap(),
        namespaced_worker(&y).unwrap(),
    );
    assert_eq!(
        pid_in_namespace(wx),
        pid_in_namespace(wy),
        "the two workers' pids do not collide inside their namespaces"
    );
    let inflight = r.keys(&format!("{NS}:locket:inflight:*"));
    assert_eq!(inflight.len(), 1, "{inflight:?}");
    // SAFETY: plain kill(2) of y's worker, a process this test started.
    unsafe { libc::kill(wy, libc::SIGKILL) };
    y.wait_for_log("worker started", LONG);
    wait_until(LONG, "y's worker was replaced", || {
        namespaced_worker(&y).is_some_and(|p| p != wy)
    });
    // Give a wrong recovery ample time to have happened.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        r.failures().is_empty(),
        "x's running job was failed: {:?}",
        r.failures()
    );
    assert_eq!(
        r.keys(&format!("{NS}:locket:inflight:*")),
        inflight,
        "x's record was recovered"
    );
    let holders = r.lock_holders(&format!("{NS}:locket:lock:L"));
    assert_eq!(holders.len(), 1, "x's lock was released while its job runs");
    std::fs::write(&go, "").unwrap();
    wait_until(LONG, "x's job finished", || r.processed() == 1);
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    x.kill();
    y.kill();
}

// ---------------------------------------------------------------------------------------------
// Issue 23 and finding #8: a handler is dead before its lock's lease ends, measured against
// Redis's own clock.
// ---------------------------------------------------------------------------------------------

/// Redis's clock and the lease end of limit-1 lock `key` (its PX), in Redis milliseconds.
const LEASE_END_LUA: &str = r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = redis.call('PTTL', KEYS[1])
return {now, now + left, left}";

/// Redis's clock less this host's wall clock, in ms (the midpoint of the round trip).
fn redis_clock_offset(r: &mut R) -> i64 {
    let before = wall_ms();
    let t: Vec<String> = r.cmd(&["TIME"]);
    let after = wall_ms();
    let server = t[0].parse::<i64>().unwrap() * 1000 + t[1].parse::<i64>().unwrap() / 1000;
    server - (before + after) / 2
}

fn wall_ms() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(d.as_millis()).unwrap()
}

/// Polls `pids` (a handler group's members) every 2 ms until none is alive (a zombie is dead),
/// at most `limit`; the wall-clock ms at which they were seen dead.
fn wait_dead(pids: &[i32], limit: Duration) -> Option<i64> {
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        if pids.iter().all(|p| !crate::support::pid_alive(*p)) {
            return Some(wall_ms());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// A command handler that ignores SIGTERM and leaves a child in its group; pid and child in
/// `<dir>/pid.<queue>` and `<dir>/child.<queue>`.
fn stubborn_group_handler(dir: &std::path::Path) -> std::path::PathBuf {
    write_script(
        dir,
        "stubborn.sh",
        &format!(
            "trap '' TERM\ncat >/dev/null\nsleep 60 &\necho $! > {d}/child.$LOCKETD_QUEUE\n\
             echo $$ > {d}/pid.$LOCKETD_QUEUE\nwhile :; do wait; done\n",
            d = dir.display()
        ),
    )
}

// Issue 23, L-9, A-11: Redis stops answering (its server SIGSTOPped, as in a partition) while a
// locked job runs whose handler ignores SIGTERM and has a child. The polite stop comes
// kill_grace before the lease's local end and the hard stop at it, so the handler's group is
// dead before the lock key's PX runs out by Redis's clock (read when it resumes). Before, the
// hard stop came kill_grace after the local end: beside the next holder.
#[test]
fn a_partition_kills_the_handler_group_before_the_lease_ends_by_redis_clock() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = stubborn_group_handler(work.path());
    let config = cfg("q")
        .locket("lock_ttl", "\"6s\"")
        .locket("heartbeat_interval", "\"2s\"")
        .locket("kill_grace", "\"2s\"")
        .locket("process_ttl", "\"60s\"")
        .class("Stubborn", &h, "lock = \"stubborn\"")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Stubborn","args":[]}"#);
    let pid = crate::daemon::wait_pid(&work.path().join("pid.q"), LONG);
    let child = crate::daemon::wait_pid(&work.path().join("child.q"), LONG);
    let key = format!("{NS}:locket:lock:stubborn");
    wait_until(LONG, "the lock is held", || r.exists(&key));
    let server = redis.pid().expect("redis-server pid");
    // The lease end by Redis's clock, right before it freezes: an EXTEND that lands between
    // this read and the freeze only moves the real end later (so the gap below is a lower
    // bound); none can land after it.
    let v: Vec<i64> = r.cmd(&["EVAL", LEASE_END_LUA, "1", &key]);
    // SAFETY: plain kill(2) of the test's own redis-server.
    unsafe { libc::kill(server, libc::SIGSTOP) };
    let end = v[1];
    // Redis frozen, the lease can end only by its clock: at most lock_ttl from now.
    let died = wait_dead(&[pid, child], Duration::from_secs(20));
    // SAFETY: as above.
    unsafe { libc::kill(server, libc::SIGCONT) };
    let died = died.unwrap_or_else(|| panic!("the handler outlived its lease:\n{}", d.log()));
    // Redis's clock after it resumes, against this host's: when the group died by Redis's.
    let offset = redis_clock_offset(&mut r);
    let gap = end - (died + offset);
    eprintln!(
        "partition: the handler group was dead {gap} ms before the lock key's PX ran out \
         (by Redis's clock; PX left at the freeze {} ms, clock offset {offset} ms)",
        v[2]
    );
    assert!(
        gap > 0,
        "the handler group died {} ms after its lease ended:\n{}",
        -gap,
        d.log()
    );
    assert!(crate::support::process_group_members(pid).is_empty());
    wait_until(LONG, "LockLost recorded", || !r.failures().is_empty());
    assert_eq!(r.failures()[0]["exception"], "Locket::LockLost");
    assert!(
        d.log().contains("lease ends within kill_grace"),
        "{}",
        d.log()
    );
    d.kill();
}

/// Finding #8: the worker process is frozen (SIGSTOP) while its handler, a process of its own,
/// is not. Its master, told the handler's group and lease end on every ACQUIRE and EXTEND,
/// kills the group before the lease ends by Redis's clock; a second daemon's job under the
/// same limit-1 lock then runs, never beside it. `handler` is "command", "persistent",
/// "threaded" or "threaded_group" (its job starts a process group of its own, H-18).
fn frozen_worker_case(handler: &str) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let events = dir.join("events.jsonl");
    // A long process lease, so that the frozen worker is not recovered as dead meanwhile (that
    // releases its locks at once, R-4: another path).
    let table = match handler {
        "command" => format!(
            "[classes.\"Excl\"]\ncommand = [\"{}\"]\nlock = \"excl\"\non_conflict = \"wait\"\n\
             wait_timeout = \"20s\"\n",
            stubborn_group_handler(dir).display()
        ),
        // H-18: a threaded handler (two slots share its process).
        _ => format!(
            "[handlers.t]\nmode = \"persistent\"\ncommand = [\"{}\"]\nboot_timeout = \"20s\"\n\
             {}env = {{ EVENTS = \"{}\" }}\n\n[classes.\"Sleep\"]\nhandler = \"t\"\nlock = \"excl\"\n\
             on_conflict = \"wait\"\nwait_timeout = \"20s\"\n\n[classes.\"Group\"]\nhandler = \"t\"\n\
             lock = \"excl\"\non_conflict = \"wait\"\nwait_timeout = \"20s\"\n",
            crate::support::manifest_dir()
                .join(if handler.starts_with("threaded") {
                    "tests/it/fixtures/threaded_handler.py"
                } else {
                    "tests/it/fixtures/protocol_handler.py"
                })
                .display(),
            if handler.starts_with("threaded") {
                "threads = 2\n"
            } else {
                ""
            },
            events.display()
        ),
    };
    let config = |queue: &str| {
        format!(
            "{}\n{table}",
            cfg(queue)
                .top(if handler.starts_with("threaded") {
                    "slots = 2"
                } else {
                    "slots = 1"
                })
                .locket("lock_ttl", "\"5s\"")
                .locket("heartbeat_interval", "\"1s\"")
                .locket("kill_grace", "\"1s\"")
                .locket("process_ttl", "\"60s\"")
                .render()
        )
    };
    let payload = match handler {
        "command" => r#"{"class":"Excl","args":[]}"#,
        _ => r#"{"class":"Sleep","args":[60]}"#,
    };
    let mut first = Daemon::start(&redis, &config("a"), &[]);
    let mut second = Daemon::start(&redis, &config("b"), &[]);
    // H-18: the job starts `sleep 600` in a process group of its own.
    r.push(
        "a",
        if handler == "threaded_group" {
            r#"{"class":"Group","args":[600,60]}"#
        } else {
            payload
        },
    );
    let key = format!("{NS}:locket:lock:excl");
    let group: Vec<i32> = match handler {
        "command" => vec![
            crate::daemon::wait_pid(&dir.join("pid.a"), LONG),
            crate::daemon::wait_pid(&dir.join("child.a"), LONG),
        ],
        _ => {
            let mut pid = 0;
            let first_event = |kind: &str, field: &str| {
                read_lossy(&events)
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .find(|e| e["event"] == kind)
                    .and_then(|e| e[field].as_i64())
                    .unwrap_or(0) as i32
            };
            wait_until(LONG, "the persistent handler runs the job", || {
                pid = first_event("job", "pid");
                pid > 0
            });
            if handler == "threaded_group" {
                let mut child = 0;
                wait_until(LONG, "the job's subprocess group starts", || {
                    child = first_event("group", "child");
                    child > 0
                });
                vec![pid, child]
            } else {
                vec![pid]
            }
        }
    };
    wait_until(LONG, "the lock is held", || r.exists(&key));
    let worker = first.worker_pid();
    // SAFETY: kill(2) of the first daemon's worker process.
    unsafe { libc::kill(worker, libc::SIGSTOP) };
    // An EXTEND the worker sent just before it froze lands within this while.
    std::thread::sleep(Duration::from_millis(200));
    let v: Vec<i64> = r.cmd(&["EVAL", LEASE_END_LUA, "1", &key]);
    let end = v[1];
    r.push("b", payload);
    let jobs_seen = |events: &std::path::Path| {
        read_lossy(events)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["event"] == "job")
            .count()
    };
    let second_ran = || match handler {
        "command" => dir.join("pid.b").exists(),
        _ => jobs_seen(&events) >= 2,
    };
    // Until the group is dead: the second daemon's handler must not have started.
    let mut died = None;
    let limit = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < limit {
        let started = second_ran();
        if group.iter().all(|p| !crate::support::pid_alive(*p)) {
            died = Some(wall_ms());
            break;
        }
        assert!(
            !started,
            "the second daemon's job ran beside the frozen worker's handler"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let offset = redis_clock_offset(&mut r);
    // SAFETY: as above.
    unsafe { libc::kill(worker, libc::SIGCONT) };
    let died = died.unwrap_or_else(|| {
        panic!(
            "the frozen worker's handler outlived its lease:\n{}",
            first.log()
        )
    });
    let gap = end - (died + offset);
    eprintln!(
        "frozen worker ({handler} handler): the handler group was dead {gap} ms before the \
         lock key's PX ran out (by Redis's clock; PX left 200 ms after the freeze {} ms, clock \
         offset {offset} ms)",
        v[2]
    );
    assert!(
        gap > 0,
        "the handler group died {} ms after its lease ended:\n{}",
        -gap,
        first.log()
    );
    for g in &group {
        assert!(crate::support::process_group_members(*g).is_empty(), "{g}");
    }
    // The second daemon takes the lock once the lease has ended, and runs its job.
    wait_until(LONG, "the second daemon's job runs", second_ran);
    assert!(
        first
            .log()
            .contains("the master killed the handler's process group"),
        "{}",
        first.log()
    );
    first.kill();
    second.kill();
}

#[test]
fn a_frozen_workers_command_handler_is_killed_by_its_master_before_the_lease_ends() {
    frozen_worker_case("command");
}

#[test]
fn a_frozen_workers_persistent_handler_is_killed_by_its_master_before_the_lease_ends() {
    frozen_worker_case("persistent");
}

/// H-18: as above with a threaded handler: the master kills its process, which every job
/// running in it attached, before another daemon takes the lock.
#[test]
fn a_frozen_workers_threaded_handler_is_killed_by_the_master_before_its_lease_ends() {
    frozen_worker_case("threaded");
}

/// H-18, L-9: a threaded job's subprocess in a process group of its own (`group` frame) is
/// killed by the frozen worker's master with the handler, before the lease ends, not left to
/// outlive it (re-parented to the master).
#[test]
fn a_frozen_workers_threaded_job_group_is_killed_by_the_master_before_its_lease_ends() {
    frozen_worker_case("threaded_group");
}

/// Finding #8, the other side: a locked job that ends is forgotten by the master, so the
/// persistent handler that ran it, idle past that job's lease, is not killed (and the same
/// process runs the next job).
#[test]
fn the_master_leaves_a_persistent_handler_alone_once_its_job_ended() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let events = work.path().join("events.jsonl");
    let config = format!(
        "{}\n[handlers.t]\nmode = \"persistent\"\ncommand = [\"{}\"]\nboot_timeout = \"20s\"\n\
         env = {{ EVENTS = \"{}\" }}\n\n[classes.\"Ok\"]\nhandler = \"t\"\nlock = \"ok\"\n",
        cfg("q").render(),
        crate::support::manifest_dir()
            .join("tests/it/fixtures/protocol_handler.py")
            .display(),
        events.display()
    );
    let mut d = Daemon::start(&redis, &config, &[]);
    let job_pids = || -> Vec<i64> {
        read_lossy(&events)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["event"] == "job")
            .filter_map(|e| e["pid"].as_i64())
            .collect()
    };
    r.push("q", r#"{"class":"Ok","args":[1]}"#);
    wait_until(LONG, "the first job done", || r.processed() == 1);
    let first = job_pids()[0];
    // Past the lease (lock_ttl 2 s) the first job had, and its master backstop.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        crate::support::pid_alive(i32::try_from(first).unwrap()),
        "the idle handler was killed:\n{}",
        d.log()
    );
    r.push("q", r#"{"class":"Ok","args":[2]}"#);
    wait_until(LONG, "the second job done", || r.processed() == 2);
    assert_eq!(job_pids(), vec![first, first], "one handler ran both");
    assert!(!d.log().contains("the master killed"), "{}", d.log());
    d.kill();
}
