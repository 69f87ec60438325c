//! O-3 counts off the job path (issue 15, decision 1; locking-semantics.md O-3): each process
//! sums its locket events in memory and writes them at most once per second and at stop. After
//! a QUIT the written totals equal the events; after a SIGKILL at most the last second of them
//! is missing. Resque's own `stat:processed` stays exact per job throughout.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::daemon::{cfg, NS, R, SHORT};
use crate::support::{wait_until, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(60);

fn stat(r: &mut R, event: &str) -> i64 {
    r.int(&format!("{NS}:locket:stat:{event}"))
}

/// The sums of `field` over every per-minute bucket.
fn bucket_total(r: &mut R, field: &str) -> i64 {
    let mut total = 0;
    for b in r.keys(&format!("{NS}:locket:metrics:*")) {
        let h: HashMap<String, i64> = r.cmd(&["HGETALL", &b]);
        total += h.get(field).copied().unwrap_or(0);
    }
    total
}

fn noop_daemon(redis: &RedisServer) -> Daemon {
    let config = cfg("counts").render() + "\n[classes.Noop]\nbuiltin = \"noop\"\n";
    Daemon::builder(redis)
        .config(&config)
        .args(["--workers", "2"])
        .start()
}

fn push_noops(r: &mut R, n: usize) {
    let payloads: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"class":"Noop","args":[{i}]}}"#))
        .collect();
    for chunk in payloads.chunks(1000) {
        let mut args = vec!["RPUSH", "resque:queue:counts"];
        args.extend(chunk.iter().map(String::as_str));
        let _: i64 = r.cmd(&args);
    }
    let _: i64 = r.cmd(&["SADD", "resque:queues", "counts"]);
}

#[test]
fn o3_totals_written_at_quit_equal_the_events() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut d = noop_daemon(&redis);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
    let n = 3000;
    push_noops(&mut r, n);
    wait_until(LONG, "every job processed", || r.processed() == n as i64);
    // At once, so that the last events are younger than a flush period.
    d.signal(libc::SIGQUIT);
    let status = d.wait_exit(LONG).expect("the daemon exits on QUIT");
    assert!(status.success(), "exit: {status:?}");
    let n = n as i64;
    for event in ["reserved", "started", "acquired", "released"] {
        assert_eq!(stat(&mut r, event), n, "stat:{event}");
        assert_eq!(bucket_total(&mut r, event), n, "bucket {event}");
    }
    assert_eq!(
        bucket_total(&mut r, "started|Noop"),
        n,
        "bucket started|Noop"
    );
    for b in r.keys(&format!("{NS}:locket:metrics:*")) {
        let ttl: i64 = r.cmd(&["PTTL", &b]);
        assert!(ttl > 0, "bucket {b} has no expiry");
    }
    assert_eq!(r.processed(), n, "Resque's own count stays exact");
}

#[test]
fn o3_totals_lose_at_most_one_second_after_sigkill() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let d = noop_daemon(&redis);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
    // More than the daemon drains in the time below, so that it is busy when killed.
    push_noops(&mut r, 200_000);
    // (time, stat:processed) every 20 ms for 3 s of steady work.
    let mut samples: Vec<(Instant, i64)> = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        samples.push((Instant::now(), r.processed()));
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed_at = Instant::now();
    // Waits until the workers are gone.
    d.kill_master_and_workers();
    let processed = r.processed();
    assert!(processed > 0, "the daemon ran jobs before the kill");
    // Everything processed more than a second (and a margin for the flush's own round trip
    // and this loop's sampling) before the kill was written.
    let cutoff = killed_at - Duration::from_millis(1300);
    let processed_before = samples
        .iter()
        .filter(|(t, _)| *t <= cutoff)
        .map(|(_, p)| *p)
        .max()
        .unwrap_or(0);
    let started = stat(&mut r, "started");
    assert!(
        started >= processed_before,
        "stat:started {started} lost more than a second of counts: {processed_before} jobs \
         had finished 1.3 s before the kill"
    );
    // Nothing is counted twice either: a job starts before it finishes.
    assert!(
        started <= processed + 2,
        "stat:started {started} > processed {processed} + the 2 running"
    );
}
