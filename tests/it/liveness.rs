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
