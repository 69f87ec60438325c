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
