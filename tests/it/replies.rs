//! Replies the daemon cannot read (E-3; issue 37 findings 3–5), through a proxy between the
//! daemon and a real `redis-server` that tampers with the reply to the first call that carries
//! a FINISH (TAKE, A-7a, with its inner FINISH+RESERVE; or FINISH+RESERVE itself where TAKE is
//! not sent): Redis ran the call (the last job's end recorded, the next job reserved and
//! started), but the daemon
//! cannot tell. Whatever the reply (garbage, a RESP3 type, a reply with an unrequested one
//! behind it, arrays nested a million deep), the call's outcome is unknown and it takes the
//! path of a call whose connection dropped: no job is lost, none is recorded twice, and the
//! worker neither crashes nor restarts.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{
    is_fcall_of, read_lossy, wait_until, write_script, Daemon, RedisServer, ReplyProxy, Tamper,
};

const LONG: Duration = Duration::from_secs(30);
const JOBS: usize = 4;

/// Runs `JOBS` jobs through a daemon of `slots` slots behind a proxy that tampers with the
/// reply to the first FINISH+RESERVE as `tamper` says, and checks what users rely on.
fn every_job_survives(tamper: Tamper, slots: u32) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let ran = work.path().join("ran.log");
    let h = write_script(
        work.path(),
        "job.sh",
        &format!(
            "cat >/dev/null\necho \"$LOCKETD_ARGS $LOCKETD_WORKER\" >> '{}'\n",
            ran.display()
        ),
    );
    let config = cfg("q")
        .top(&format!("slots = {slots}"))
        .class("Job", &h, "")
        .render();
    for i in 1..=JOBS {
        r.push("q", &format!(r#"{{"class":"Job","args":[{i}]}}"#));
    }
    let proxy = ReplyProxy::start(&redis, tamper, 1, |args| {
        is_fcall_of(args, "finish_reserve")
            || (is_fcall_of(args, "take") && args.iter().any(|a| a == b"finish_reserve"))
    });
    let mut d = Daemon::builder(&redis)
        .config(&config)
        .redis_url(&proxy.url())
        .start();
    let runs = |ran: &std::path::Path| -> BTreeMap<String, Vec<String>> {
        let mut m = BTreeMap::<String, Vec<String>>::new();
        for l in read_lossy(ran).lines() {
            let (args, worker) = l.split_once(' ').unwrap_or((l, ""));
            m.entry(args.to_string())
                .or_default()
                .push(worker.to_string());
        }
        m
    };
    let accounted = |r: &mut R| {
        runs(&ran).len() + r.llen(&format!("{NS}:queue:q")) + r.llen(&format!("{NS}:failed"))
    };
    // Every job ran, or is still where a user can see it: its queue, the failed list.
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(LONG, "every job run and counted", || {
            runs(&ran).len() == JOBS
                && r.keys(&format!("{NS}:locket:inflight:*")).is_empty()
                && r.processed() >= JOBS as i64
        })
    }));
    let log = d.log();
    assert!(
        waited.is_ok(),
        "{tamper:?}: {} of {JOBS} jobs accounted for (ran: {:?}, queued: {}, failed: {:?});\n{log}",
        accounted(&mut r),
        runs(&ran),
        r.llen(&format!("{NS}:queue:q")),
        r.failures(),
    );
    assert_eq!(
        proxy.tampered(),
        1,
        "{tamper:?}: the proxy tampered with no reply"
    );
    // Each exactly once, no failure recorded (none, let alone two), the stats counted once.
    for (args, workers) in runs(&ran) {
        assert_eq!(workers.len(), 1, "{tamper:?}: job {args} ran {workers:?}");
    }
    assert!(r.failures().is_empty(), "{tamper:?}: {:?}", r.failures());
    assert_eq!(r.processed(), JOBS as i64, "{tamper:?}\n{log}");
    assert_eq!(r.failed_stat(), 0, "{tamper:?}");
    // The worker neither crashed nor was restarted: every job ran in one process.
    assert!(!log.contains("worker died"), "{tamper:?}:\n{log}");
    let pids: std::collections::BTreeSet<String> = runs(&ran)
        .values()
        .flatten()
        // host:pid:queues, or host:pid+k:queues for slot k.
        .map(|w| {
            let pid = w.split(':').nth(1).unwrap_or_default();
            pid.split('+').next().unwrap_or_default().to_string()
        })
        .collect();
    assert_eq!(pids.len(), 1, "{tamper:?}: workers {pids:?}\n{log}");
    // Said above INFO: the reply could not be read, so the call was taken as one that may
    // have run.
    assert!(
        log.contains("unreadable reply from redis"),
        "{tamper:?}:\n{log}"
    );
    assert_eq!(d.terminate(LONG).code(), Some(0), "{log}");
}

// Finding 3: a reply that is not RESP at all.
#[test]
fn a_garbled_reply_to_finish_and_reserve_loses_no_job() {
    every_job_survives(Tamper::Garbage, 1);
}

// Finding 3: a RESP3 reply (a map) where the job path reads RESP2.
#[test]
fn a_resp3_reply_to_finish_and_reserve_loses_no_job() {
    every_job_survives(Tamper::Resp3, 1);
}

// Finding 3 on the multi-slot path: the batch's reply is read by the redis crate's parser
// on the shared connection, whose parse error the crate ends the connection on.
#[test]
fn a_garbled_reply_to_a_batch_loses_no_job() {
    every_job_survives(Tamper::Garbage, 2);
}

// Finding 4: the reply is followed by one no call asked for; read as the next call's reply,
// it would put every later call one reply behind.
#[test]
fn an_unrequested_reply_puts_no_call_behind() {
    every_job_survives(Tamper::ExtraReply, 1);
}

// Finding 5: arrays nested a million deep, which a parser without a depth limit recurses into
// until the worker's stack overflows.
#[test]
fn a_deeply_nested_reply_does_not_crash_the_worker() {
    every_job_survives(Tamper::Nested(1_000_000), 1);
}
