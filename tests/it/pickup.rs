//! Instant pickup on every queue (issue 15 item 2): an idle `--workers 2` daemon whose
//! `interval` is 30 s picks up a job pushed to any of its queues, and to a queue a pattern
//! matches once it appears, long before its next pass; and it idles cheaply, in Redis commands
//! and connections, even where Redis refuses the commands it waits with.
//!
//! Speeds are the bench's (`locketd-bench idle`); the bounds here only tell a push-driven
//! wake-up from a pass every 30 s, and a bounded idle from a poll loop.

use std::time::{Duration, Instant};

use crate::daemon::{exit_code, NS, R, SHORT};
use crate::support::{wait_until, Daemon, RedisServer};

/// Within this a pickup cannot have come from the 30 s interval.
const PICKUP: Duration = Duration::from_secs(5);
/// Queues of the explicit list.
const K: usize = 16;
const NOOP: &str = "[classes.Noop]\nbuiltin = \"noop\"\n";
const JOB: &str = r#"{"class":"Noop","args":[]}"#;

fn config(queues: &str) -> String {
    format!("queues = \"{queues}\"\ninterval = 30\n\n{NOOP}")
}

fn sixteen() -> Vec<String> {
    (0..K).map(|i| format!("q{i:02}")).collect()
}

fn start(redis: &RedisServer, r: &mut R, queues: &str) -> Daemon {
    let d = Daemon::start(redis, &config(queues), &["--workers", "2"]);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
    // Their first passes found nothing: both wait now.
    std::thread::sleep(Duration::from_millis(1500));
    d
}

/// Pushes a job to `queue` and returns how long until `stat:processed` reached `n`.
fn pickup(r: &mut R, d: &Daemon, queue: &str, n: i64) -> Duration {
    let t = Instant::now();
    r.push(queue, JOB);
    wait_until(SHORT, &format!("the job pushed to {queue} ran"), || {
        r.int(&format!("{NS}:stat:processed")) >= n
    });
    let took = t.elapsed();
    assert!(
        took < PICKUP,
        "a job pushed to {queue} waited {took:?}: found by a pass, not a wake-up\n{}",
        crate::support::tail(&d.log(), 40)
    );
    took
}

/// Every command Redis counted (inside scripts too, refused ones too), but INFO's.
fn commands(r: &mut R) -> u64 {
    let info: String = r.cmd(&["INFO", "commandstats"]);
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter(|l| !l.starts_with("info:"))
        .map(|l| field(l, "calls=") + field(l, "rejected_calls=") + field(l, "failed_calls="))
        .sum()
}

/// One command's count (calls, refused included) from INFO commandstats.
fn calls_of(r: &mut R, cmd: &str) -> u64 {
    let info: String = r.cmd(&["INFO", "commandstats"]);
    info.lines()
        .filter_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:")))
        .map(|l| field(l, "calls=") + field(l, "rejected_calls="))
        .sum()
}

fn field(stats: &str, name: &str) -> u64 {
    stats
        .split(',')
        .find_map(|kv| {
            kv.strip_prefix(name)
                .or_else(|| kv.split_once(':').and_then(|(_, v)| v.strip_prefix(name)))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// (every client but this one, those of them waiting for pushes: blocked in BLMOVE or tracking)
fn connections(r: &mut R) -> (usize, usize) {
    let me: i64 = r.cmd(&["CLIENT", "ID"]);
    let list: String = r.cmd(&["CLIENT", "LIST"]);
    let lines: Vec<&str> = list
        .lines()
        .filter(|l| !l.starts_with(&format!("id={me} ")))
        .collect();
    let waiting = lines
        .iter()
        .filter(|l| {
            l.split(' ').any(|kv| {
                kv == "cmd=blmove" || kv.strip_prefix("flags=").is_some_and(|f| f.contains('t'))
            })
        })
        .count();
    (lines.len(), waiting)
}

/// How long the idle rate is measured: two whole janitor intervals (5 s each), so that the
/// figure is the daemon's average and not the phase of its periodic passes in the window
/// (a 3 s window read anywhere from 6 to 21 commands/s of one and the same daemon).
const IDLE_WINDOW: u64 = 10;

/// Commands a second over `secs`, the daemon idle.
fn idle_rate(r: &mut R, secs: u64) -> f64 {
    let before = commands(r);
    std::thread::sleep(Duration::from_secs(secs));
    // Our own INFO is not counted; nothing else runs.
    (commands(r) - before) as f64 / secs as f64
}

#[test]
fn a_push_to_any_of_16_queues_wakes_an_idle_daemon_that_idles_cheaply() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let queues = sixteen();
    let mut d = start(&redis, &mut r, &queues.join(","));
    let mut n = 0;
    for q in [&queues[K - 1], &queues[0], &queues[7], &queues[K - 1]] {
        n += 1;
        let took = pickup(&mut r, &d, q, n);
        eprintln!("pickup on {q}: {took:?}");
        // Both workers wait again before the next push.
        std::thread::sleep(Duration::from_millis(300));
    }
    // Idle: a few commands a second (process heartbeats, the janitor, a BLMOVE per queue every
    // 30 s), where a pass over 16 queues in a loop costs hundreds.
    let rate = idle_rate(&mut r, IDLE_WINDOW);
    let (all, waiting) = connections(&mut r);
    eprintln!("idle: {rate:.1} commands/s, {all} connections, {waiting} waiting");
    assert!(rate <= 20.0, "{rate:.1} commands/s while idle");
    assert!(
        waiting <= K + 2,
        "{waiting} connections wait for {K} queues"
    );
    // Not one per queue and per worker process.
    assert!(
        all < 2 * K,
        "{all} connections for 2 workers and {K} queues"
    );
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A queue that a pattern matches, created after start, is picked up as its first job is
/// pushed (client tracking of `<ns>:queues`), and so are the next ones.
#[test]
fn a_push_to_a_new_queue_matching_a_pattern_wakes_an_idle_daemon() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut d = start(&redis, &mut r, "mail*,!mail-skip");
    pickup(&mut r, &d, "mail-a", 1);
    std::thread::sleep(Duration::from_millis(300));
    pickup(&mut r, &d, "mail-b", 2);
    std::thread::sleep(Duration::from_millis(300));
    pickup(&mut r, &d, "mail-a", 3);
    // A queue the list skips is not worked.
    r.push("mail-skip", JOB);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(r.llen(&format!("{NS}:queue:mail-skip")), 1);
    let rate = idle_rate(&mut r, IDLE_WINDOW);
    assert!(rate <= 20.0, "{rate:.1} commands/s while idle");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// Where client tracking is refused (an ACL here), new queues are found by reading
/// `<ns>:queues` once a second while a worker with patterns waits: still long before the
/// interval, and still cheap.
#[test]
fn without_client_tracking_new_queues_are_found_by_a_slow_read_of_the_queue_set() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _: () = r.cmd(&["ACL", "SETUSER", "default", "-client|tracking"]);
    let mut d = start(&redis, &mut r, "*");
    pickup(&mut r, &d, "fresh", 1);
    std::thread::sleep(Duration::from_millis(300));
    pickup(&mut r, &d, "fresher", 2);
    wait_until(SHORT, "the fallback logged", || {
        d.log().contains("no client tracking")
    });
    let rate = idle_rate(&mut r, IDLE_WINDOW);
    assert!(rate <= 20.0, "{rate:.1} commands/s while idle");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// BLMOVE refused by an ACL: the master says so once and stops asking (no loop of refused
/// BLMOVEs); the workers find jobs at their next pass, every `interval` (1 s here).
#[test]
fn a_refused_blmove_falls_back_to_the_interval_without_a_loop() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _: () = r.cmd(&["ACL", "SETUSER", "default", "-blmove"]);
    let queues = sixteen().join(",");
    let cfg = format!("queues = \"{queues}\"\ninterval = 1\n\n{NOOP}");
    let mut d = Daemon::start(&redis, &cfg, &["--workers", "2"]);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
    d.wait_for_log("BLMOVE refused", SHORT);
    let before = calls_of(&mut r, "blmove");
    std::thread::sleep(Duration::from_secs(3));
    let refused = calls_of(&mut r, "blmove") - before;
    // At most the one refused BLMOVE per queue still on its way when the first was logged.
    assert!(
        refused <= K as u64,
        "{refused} BLMOVEs sent in 3 s after a refusal"
    );
    r.push("q15", JOB);
    wait_until(SHORT, "the job ran at a pass", || {
        r.int(&format!("{NS}:stat:processed")) == 1
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}
