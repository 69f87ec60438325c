//! The scheduler (scheduler-protocol.md SC-1 … SC-14) through the real binary and a real
//! redis-server: resque-scheduler's delayed items written as the gem and node-resque write
//! them, the gem's master lock, recurring schedules, bad input.
//! Run: `cargo test --test it -- scheduler::`.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::daemon::{cfg, NS, R};
use crate::support::{node_resque_dir, run_node_json, wait_until, Daemon, RedisServer};

const SHORT: Duration = Duration::from_secs(10);
const LOCK: &str = "resque:resque:resque_scheduler_master_lock";

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A config whose workers watch a queue nothing is delivered to (delivered jobs stay put),
/// with a short scheduler lock TTL and `extra` appended (tables).
fn config(extra: &str) -> String {
    format!(
        "{}\n[scheduler]\nlock_ttl = \"3s\"\n{extra}\n",
        cfg("idle").render()
    )
}

/// What the gem's `enqueue_at` writes (SC-2), byte for byte.
fn gem_enqueue_at(r: &mut R, ts: i64, item: &str) {
    let t = ts.to_string();
    let _: i64 = r.cmd(&["RPUSH", &format!("{NS}:delayed:{t}"), item]);
    let _: i64 = r.cmd(&[
        "SADD",
        &format!("{NS}:timestamps:{item}"),
        &format!("delayed:{t}"),
    ]);
    let _: i64 = r.cmd(&["ZADD", &format!("{NS}:delayed_queue_schedule"), &t, &t]);
}

/// The gem's `remove_delayed` (SC-2): LREM and SREM per bucket, the ZSET entry left.
fn gem_remove_delayed(r: &mut R, item: &str) {
    let idx = format!("{NS}:timestamps:{item}");
    let buckets: Vec<String> = r.cmd(&["SMEMBERS", &idx]);
    for b in buckets {
        let _: i64 = r.cmd(&["LREM", &format!("{NS}:{b}"), "0", item]);
        let _: i64 = r.cmd(&["SREM", &idx, &b]);
    }
}

fn queue(r: &mut R, q: &str) -> Vec<String> {
    r.cmd(&["LRANGE", &format!("{NS}:queue:{q}"), "0", "-1"])
}

fn zcard(r: &mut R) -> i64 {
    r.cmd(&["ZCARD", &format!("{NS}:delayed_queue_schedule")])
}

/// SC-1, SC-2, SC-4, SC-5: items in the gem's exact format are delivered when due, in order,
/// byte-exact (raw args: `1.0e+20`, unicode escapes), exactly once; the index, the bucket and
/// the ZSET entry are cleaned up; a future item waits.
#[test]
fn gem_items_are_delivered_when_due_in_order_byte_exact_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let t0 = now() - 5;
    let items = [
        r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}],"queue":"mailers"}"#,
        r#"{"class":"SendEmail","args":[1.0e+20,"\u00e9t\u00e9",null],"queue":"mailers"}"#,
        r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}],"queue":"mailers"}"#,
        r#"{"class":"Report","args":[],"queue":"low"}"#,
    ];
    for it in &items {
        gem_enqueue_at(&mut r, t0, it);
    }
    let later = r#"{"class":"Later","args":["x"],"queue":"mailers"}"#;
    gem_enqueue_at(&mut r, t0 - 1, later.replace("Later", "Earlier").as_str());
    let due_at = now() + 3;
    gem_enqueue_at(&mut r, due_at, later);
    let mut d = Daemon::start(&redis, &config(""), &[]);
    wait_until(SHORT, "the due items delivered", || {
        queue(&mut r, "mailers").len() == 4
    });
    assert_eq!(
        queue(&mut r, "mailers"),
        [
            r#"{"class":"Earlier","args":["x"]}"#,
            r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}]}"#,
            r#"{"class":"SendEmail","args":[1.0e+20,"\u00e9t\u00e9",null]}"#,
            r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}]}"#,
        ]
    );
    assert_eq!(queue(&mut r, "low"), [r#"{"class":"Report","args":[]}"#]);
    let queues: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:queues")]);
    assert!(queues.contains(&"mailers".to_string()) && queues.contains(&"low".to_string()));
    assert!(!r.exists(&format!("{NS}:delayed:{t0}")));
    for it in &items {
        assert!(!r.exists(&format!("{NS}:timestamps:{it}")), "{it}");
    }
    // The future item is still scheduled, then delivered once, at its time.
    assert_eq!(zcard(&mut r), 1);
    assert!(
        now() < due_at,
        "the test was too slow to see the future item wait"
    );
    wait_until(SHORT, "the later item delivered", || {
        queue(&mut r, "mailers").len() == 5
    });
    assert!(now() >= due_at);
    assert_eq!(
        queue(&mut r, "mailers")[4],
        r#"{"class":"Later","args":["x"]}"#
    );
    assert_eq!(zcard(&mut r), 0);
    assert!(r.keys(&format!("{NS}:timestamps:*")).is_empty());
    // Exactly once: nothing more arrives.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(queue(&mut r, "mailers").len(), 5);
    let log = d.log();
    assert!(log.contains("scheduler lock taken"), "{log}");
    d.terminate(SHORT);
    // Released on shutdown (compare-and-delete).
    assert!(!r.exists(LOCK));
}

/// SC-2, SC-5: `remove_delayed` between scheduling and delivery is honoured; the ZSET entry
/// it leaves (a stale entry) is cleaned up.
#[test]
fn remove_delayed_is_honoured_and_the_stale_entry_cleaned_up() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let d = Daemon::start(&redis, &config(""), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    let ts = now() + 2;
    let keep = r#"{"class":"Keep","args":[1],"queue":"q"}"#;
    let cancel = r#"{"class":"Cancel","args":[2],"queue":"q"}"#;
    gem_enqueue_at(&mut r, ts, cancel);
    gem_enqueue_at(&mut r, ts, keep);
    let lone = ts + 1;
    gem_enqueue_at(&mut r, lone, cancel);
    gem_remove_delayed(&mut r, cancel);
    assert_eq!(zcard(&mut r), 2, "remove_delayed leaves the ZSET entries");
    wait_until(SHORT, "delivery and cleanup", || {
        zcard(&mut r) == 0 && !queue(&mut r, "q").is_empty()
    });
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(queue(&mut r, "q"), [r#"{"class":"Keep","args":[1]}"#]);
    assert!(!r.exists(&format!("{NS}:delayed:{lone}")));
}

/// Items written by node-resque's `queue.enqueueIn` are delivered when due, byte-exact.
#[test]
fn node_resque_enqueue_in_items_are_delivered() {
    node_resque_dir();
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _d = Daemon::start(&redis, &config(""), &[]);
    let out = run_node_json(
        "enqueue.js",
        &json!({"port": redis.port(), "namespace": NS, "jobs": [
            {"queue": "nq", "class": "NodeJob", "args": [1, "two", {"three": 3}], "delay_ms": 1500},
            {"queue": "nq", "class": "NodeJob2", "args": [], "delay_ms": 1500},
        ]}),
        Duration::from_secs(60),
    );
    assert_eq!(out["ok"], json!(true), "{out}");
    assert!(zcard(&mut r) >= 1);
    wait_until(SHORT, "node-resque's delayed jobs delivered", || {
        queue(&mut r, "nq").len() == 2
    });
    assert_eq!(
        queue(&mut r, "nq"),
        [
            r#"{"class":"NodeJob","args":[1,"two",{"three":3}]}"#,
            r#"{"class":"NodeJob2","args":[]}"#
        ]
    );
    assert_eq!(zcard(&mut r), 0);
    assert!(r.keys(&format!("{NS}:timestamps:*")).is_empty());
}

/// SC-5 and bad input: an item without a queue, a malformed item, an item whose queue key
/// holds a hash, a non-integer schedule member and a bucket of the wrong type are kept in
/// place and reported once; the good items around them are delivered; the daemon runs on.
#[test]
fn bad_items_are_kept_reported_and_skipped_and_the_daemon_runs_on() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let ts = now() - 2;
    let no_queue = r#"{"class":"NoQueue","args":[]}"#;
    let malformed = r#"{"class":"Broken","args":[1,"#;
    let wrong = r#"{"class":"Wrong","args":[],"queue":"hashed"}"#;
    let _: i64 = r.cmd(&["HSET", &format!("{NS}:queue:hashed"), "a", "b"]);
    gem_enqueue_at(&mut r, ts, r#"{"class":"Good","args":[1],"queue":"q"}"#);
    gem_enqueue_at(&mut r, ts, no_queue);
    gem_enqueue_at(&mut r, ts, malformed);
    gem_enqueue_at(&mut r, ts, wrong);
    gem_enqueue_at(&mut r, ts, r#"{"class":"Good","args":[2],"queue":"q"}"#);
    let _: i64 = r.cmd(&[
        "ZADD",
        &format!("{NS}:delayed_queue_schedule"),
        "1",
        "not-a-number",
    ]);
    let bad_bucket = ts - 1;
    let _: () = r.cmd(&["SET", &format!("{NS}:delayed:{bad_bucket}"), "x"]);
    let b = bad_bucket.to_string();
    let _: i64 = r.cmd(&["ZADD", &format!("{NS}:delayed_queue_schedule"), &b, &b]);
    let later = now() + 2;
    gem_enqueue_at(&mut r, later, r#"{"class":"Good","args":[3],"queue":"q"}"#);
    let mut d = Daemon::start(&redis, &config(""), &[]);
    wait_until(SHORT, "the good items delivered", || {
        queue(&mut r, "q").len() == 3
    });
    assert_eq!(
        queue(&mut r, "q"),
        [
            r#"{"class":"Good","args":[1]}"#,
            r#"{"class":"Good","args":[2]}"#,
            r#"{"class":"Good","args":[3]}"#
        ]
    );
    let kept: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:delayed:{ts}"), "0", "-1"]);
    assert_eq!(kept, [no_queue, malformed, wrong]);
    assert!(r.exists(&format!("{NS}:timestamps:{no_queue}")));
    let members: Vec<String> =
        r.cmd(&["ZRANGE", &format!("{NS}:delayed_queue_schedule"), "0", "-1"]);
    assert_eq!(
        members,
        ["not-a-number", b.as_str(), ts.to_string().as_str()]
    );
    let hashed: String = r.cmd(&["TYPE", &format!("{NS}:queue:hashed")]);
    assert_eq!(hashed, "hash");
    let log = d.log();
    for what in [
        "no queue",
        "not a JSON object",
        "WRONGTYPE",
        "not an integer timestamp",
    ] {
        assert!(log.contains(what), "{what} not reported:\n{log}");
    }
    // Reported once, not retried in a tight loop.
    std::thread::sleep(Duration::from_secs(2));
    let log = d.log();
    assert_eq!(log.matches("no queue").count(), 1, "{log}");
    let problems: String = r.cmd(&["GET", &format!("{NS}:locket:scheduler:problems")]);
    assert!(problems.contains("no queue"), "{problems}");
    assert!(d.is_running());
}

/// SC-6, SC-7: a foreign holder of the gem's lock key (a Ruby scheduler's `host:pid`) makes
/// locketd deliver nothing until the key expires; then locketd takes it with its own value.
#[test]
fn a_foreign_lock_holder_keeps_locketd_a_standby_until_the_key_expires() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _: () = r.cmd(&["SET", LOCK, "otherhost:123", "EX", "4"]);
    gem_enqueue_at(&mut r, now() - 1, r#"{"class":"J","args":[],"queue":"q"}"#);
    let d = Daemon::start(&redis, &config(""), &[]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        queue(&mut r, "q").is_empty(),
        "delivered while another held the lock"
    );
    let holder: String = r.cmd(&["GET", LOCK]);
    assert_eq!(holder, "otherhost:123", "a live key is never taken");
    wait_until(SHORT, "delivery after the foreign key expired", || {
        queue(&mut r, "q").len() == 1
    });
    let holder: String = r.cmd(&["GET", LOCK]);
    assert!(holder.starts_with("locketd-"), "{holder}");
    assert!(holder.ends_with(&format!(":{}", d.pid())), "{holder}");
    let ttl: i64 = r.cmd(&["TTL", LOCK]);
    assert!((1..=3).contains(&ttl), "{ttl}");
}

/// SC-8, SC-9: two daemons: one delivers; SIGKILL of its master: the other takes over within
/// the TTL. With `[scheduler] enabled = false` a daemon never takes the lock.
#[test]
fn two_daemons_one_scheduler_and_the_standby_takes_over_after_a_kill() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut a = Daemon::start(&redis, &config(""), &[]);
    a.wait_for_log("scheduler lock taken", SHORT);
    let b = Daemon::start(&redis, &config(""), &[]);
    let off = Daemon::start(&redis, &config("enabled = false"), &[]);
    std::thread::sleep(Duration::from_secs(1));
    let holder: String = r.cmd(&["GET", LOCK]);
    assert!(holder.ends_with(&format!(":{}", a.pid())), "{holder}");
    a.kill_master_and_workers();
    let killed = std::time::Instant::now();
    gem_enqueue_at(&mut r, now(), r#"{"class":"J","args":[],"queue":"q"}"#);
    wait_until(SHORT, "the standby delivers", || {
        queue(&mut r, "q").len() == 1
    });
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "{:?}",
        killed.elapsed()
    );
    let holder: String = r.cmd(&["GET", LOCK]);
    assert!(holder.ends_with(&format!(":{}", b.pid())), "{holder}");
    assert!(!off.log().contains("scheduler lock taken"));
    a.kill();
}

fn fired_ticks(log: &str) -> Vec<i64> {
    log.lines()
        .filter(|l| l.contains("schedule fired"))
        .filter_map(|l| {
            let i = l.find("tick=")? + 5;
            l[i..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// SC-10, SC-12: an `every` schedule fires each tick once, with the gem's normalised args, and
/// writes `delayed:last_enqueued_at` in Ruby's `Time#to_s` format; with two daemons racing
/// and the holder killed repeatedly, no tick is fired twice.
#[test]
fn every_ticks_fire_once_across_the_fleet_with_kills() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let sched =
        "[schedule.tick]\nevery = \"1s\"\nclass = \"Tick\"\nqueue = \"ticks\"\nargs = { a = 1 }\n";
    let text = config(sched);
    let mut logs = String::new();
    let mut daemons = vec![
        Daemon::start(&redis, &text, &[]),
        Daemon::start(&redis, &text, &[]),
    ];
    // LOCKETD_SCHED_ROUNDS=60 runs about 200 ticks (3 s a round).
    let rounds: usize = std::env::var("LOCKETD_SCHED_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut kills = 0;
    for round in 0..rounds {
        std::thread::sleep(Duration::from_secs(3));
        let holder: Option<String> = r.cmd(&["GET", LOCK]);
        if let Some(h) = holder {
            if let Some(i) = daemons
                .iter()
                .position(|d| h.ends_with(&format!(":{}", d.pid())))
            {
                let mut d = daemons.remove(i);
                kills += 1;
                d.kill_master_and_workers();
                logs.push_str(&d.log());
                d.kill();
                daemons.push(Daemon::start(&redis, &text, &[]));
            }
        }
        let _ = round;
    }
    std::thread::sleep(Duration::from_secs(2));
    for mut d in daemons {
        d.terminate(SHORT);
        logs.push_str(&d.log());
    }
    let ticks = fired_ticks(&logs);
    eprintln!("{} ticks fired, {kills} holders SIGKILLed", ticks.len());
    let mut seen = BTreeMap::new();
    for t in &ticks {
        *seen.entry(*t).or_insert(0) += 1;
    }
    assert!(
        seen.values().all(|n| *n == 1),
        "a tick fired twice: {seen:?}"
    );
    let items = queue(&mut r, "ticks");
    // Every logged tick is in the queue. A holder SIGKILLed right after a tick's script ran
    // may lose that tick's log line (its log queue dies with it), so the queue may hold up to
    // one item per kill more than the logs show; a tick fired twice would show in the logs
    // above, and fire.lua refuses any tick not later than the recorded one.
    assert!(
        items.len() >= ticks.len() && items.len() <= ticks.len() + kills,
        "{} items, {} logged ticks, {kills} kills",
        items.len(),
        ticks.len()
    );
    // Ticks due while the killed holder's key had not expired yet are lost, as the gem loses
    // them in a failover (SC-13): at most the latest one is fired on takeover.
    assert!(items.len() >= 4, "{} ticks", items.len());
    assert!(items
        .iter()
        .all(|p| p == r#"{"class":"Tick","args":[{"a":1}]}"#));
    let first = *seen.keys().next().unwrap();
    let last = *seen.keys().last().unwrap();
    assert!(items.len() as i64 <= last - first + 1);
    let at: String = r.cmd(&["HGET", &format!("{NS}:delayed:last_enqueued_at"), "tick"]);
    assert_eq!(at.len(), "2026-11-23 20:33:03 +0000".len(), "{at}");
    assert!(at.ends_with(" +0000") && at.as_bytes()[10] == b' ', "{at}");
}

/// SC-13: a tick missed while no scheduler ran fires once when younger than `misfire_grace`,
/// and not at all with `misfire_grace = 0`.
#[test]
fn misfire_grace_fires_the_latest_missed_tick_once() {
    // Keep clear of the minute's start, where the on-time tick would blur the two cases.
    while !(8..50).contains(&(now() % 60)) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let sched = |grace: &str, q: &str| {
        format!(
            "misfire_grace = \"{grace}\"\n[schedule.m]\ncron = \"* * * * *\"\nclass = \"M\"\nqueue = \"{q}\"\n"
        )
    };
    let mut d = Daemon::start(&redis, &config(&sched("0", "none")), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(queue(&mut r, "none").is_empty());
    d.terminate(SHORT);
    let d = Daemon::start(&redis, &config(&sched("2m", "graced")), &[]);
    wait_until(SHORT, "the missed tick fired", || {
        queue(&mut r, "graced").len() == 1
    });
    std::thread::sleep(Duration::from_millis(1500));
    if now() % 60 > 5 {
        assert_eq!(queue(&mut r, "graced").len(), 1, "a burst: {}", d.log());
    }
}

/// SC-14: with `publish = true` every schedule is written to `persistent_schedules` with a
/// string class, a queue and a cron or every string the gem parses, and named in
/// `schedules_changed`; off by default.
#[test]
fn publish_writes_persistent_schedules_only_when_asked() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let tables = "[schedule.nightly]\ncron = \"0 3 * * *\"\ntz = \"Europe/Berlin\"\nclass = \"Report\"\nqueue = \"low\"\nargs = [\"x\"]\n[schedule.tick]\nevery = \"PT5M\"\nclass = \"Tick\"\nqueue = \"high\"\n";
    let mut d = Daemon::start(&redis, &config(tables), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!r.exists(&format!("{NS}:persistent_schedules")));
    d.terminate(SHORT);
    let d = Daemon::start(&redis, &config(&format!("publish = true\n{tables}")), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    wait_until(SHORT, "schedules published", || {
        r.exists(&format!("{NS}:persistent_schedules"))
    });
    let all: BTreeMap<String, String> = r.cmd(&["HGETALL", &format!("{NS}:persistent_schedules")]);
    let nightly: serde_json::Value = serde_json::from_str(&all["nightly"]).unwrap();
    assert_eq!(
        nightly,
        json!({"class": "Report", "queue": "low", "args": ["x"], "cron": "0 3 * * * Europe/Berlin"})
    );
    let tick: serde_json::Value = serde_json::from_str(&all["tick"]).unwrap();
    assert_eq!(
        tick,
        json!({"class": "Tick", "queue": "high", "args": [], "every": "300s"})
    );
    let changed: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:schedules_changed")]);
    assert_eq!(changed.len(), 2);
}

/// HUP reloads the schedules: a schedule added to the file fires without a restart.
#[test]
fn hup_reloads_schedules() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let d = Daemon::start(&redis, &config(""), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    std::fs::write(
        d.config_path(),
        config("[schedule.added]\nevery = \"1s\"\nclass = \"Added\"\nqueue = \"hup\"\n"),
    )
    .unwrap();
    d.signal(libc::SIGHUP);
    wait_until(SHORT, "the added schedule fired", || {
        !queue(&mut r, "hup").is_empty()
    });
}

fn cli(redis: &RedisServer, config: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(config)
        .arg("--redis")
        .arg(redis.url())
        .args(args)
        .output()
        .expect("run locketd");
    assert!(
        out.status.success(),
        "locketd {args:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `locketd enqueue --in/--at` writes the gem's format (SC-1, SC-2: the item, its index, the
/// ZSET entry); `status --json` counts it; the daemon delivers it; `locketd schedule` lists a
/// schedule with its lock holder; `schedule run` enqueues one tick now.
#[test]
fn cli_enqueue_in_status_schedule_and_schedule_run() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locketd.toml");
    std::fs::write(
        &path,
        config("[schedule.report]\ncron = \"0 3 * * *\"\ntz = \"Europe/Berlin\"\nclass = \"Report\"\nqueue = \"low\"\nargs = \"x\"\ndescription = \"nightly\"\n"),
    )
    .unwrap();
    cli(
        &redis,
        &path,
        &[
            "enqueue",
            "mailers",
            "SendEmail",
            "42",
            r#"{"to":"a@b.c"}"#,
            "--in",
            "3",
        ],
    );
    let item = r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}],"queue":"mailers"}"#;
    let members: Vec<String> =
        r.cmd(&["ZRANGE", &format!("{NS}:delayed_queue_schedule"), "0", "-1"]);
    assert_eq!(members.len(), 1);
    let ts = &members[0];
    let bucket: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:delayed:{ts}"), "0", "-1"]);
    assert_eq!(bucket, [item]);
    let idx: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:timestamps:{item}")]);
    assert_eq!(idx, [format!("delayed:{ts}")]);
    let at = (now() + 3600).to_string();
    cli(&redis, &path, &["enqueue", "later", "Later", "--at", &at]);
    let status: serde_json::Value =
        serde_json::from_str(&cli(&redis, &path, &["status", "--json"])).unwrap();
    assert_eq!(status["delayed"]["timestamps"], json!(2), "{status}");
    assert_eq!(status["delayed"]["due_items"], json!(0), "{status}");
    let d = Daemon::start(&redis, &std::fs::read_to_string(&path).unwrap(), &[]);
    wait_until(SHORT, "the --in item delivered", || {
        queue(&mut r, "mailers").len() == 1
    });
    assert_eq!(
        queue(&mut r, "mailers"),
        [r#"{"class":"SendEmail","args":[42,{"to":"a@b.c"}]}"#]
    );
    let list = cli(&redis, &path, &["schedule"]);
    assert!(list.contains(&format!(":{}", d.pid())), "{list}");
    assert!(
        list.contains("report") && list.contains("Europe/Berlin") && list.contains("nightly"),
        "{list}"
    );
    cli(&redis, &path, &["schedule", "run", "report"]);
    assert_eq!(queue(&mut r, "low"), [r#"{"class":"Report","args":["x"]}"#]);
    let last: String = r.cmd(&["HGET", &format!("{NS}:delayed:last_enqueued_at"), "report"]);
    assert!(last.ends_with(" +0000"), "{last}");
    let listing: serde_json::Value =
        serde_json::from_str(&cli(&redis, &path, &["schedule", "--json"])).unwrap();
    assert_eq!(listing["schedules"][0]["last_enqueued_at"], json!(last));
}

/// Target: when nothing is due, the scheduler costs at most 5 Redis commands a second: the
/// commands naming its keys (the delayed schedule, the lock) are counted with MONITOR over
/// 5 s, a holder and a standby running.
#[test]
fn idle_scheduler_costs_few_redis_commands() {
    use std::io::{Read, Write};
    let redis = RedisServer::start();
    let a = Daemon::start(&redis, &config(""), &[]);
    a.wait_for_log("scheduler lock taken", SHORT);
    let _b = Daemon::start(&redis, &config(""), &[]);
    std::thread::sleep(Duration::from_secs(1));
    let mut mon = std::net::TcpStream::connect(("127.0.0.1", redis.port())).unwrap();
    mon.write_all(b"MONITOR\r\n").unwrap();
    mon.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    while start.elapsed() < Duration::from_secs(5) {
        match mon.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let text = String::from_utf8_lossy(&seen);
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.contains("delayed_queue_schedule") || l.contains("resque_scheduler_master_lock")
        })
        // A script's own commands are listed after its EVALSHA: count the call once.
        .filter(|l| !l.contains("[0 lua]"))
        .collect();
    let holder = ours.iter().filter(|l| l.contains("ZRANGEBYSCORE")).count();
    assert!(
        holder >= 3,
        "the holder does not poll:\n{}",
        ours.join("\n")
    );
    // Holder: one poll a second and a renewal every 0.5 s (TTL 3 s); standby: one try to take
    // the lock a second. Per daemon, at most 5 a second.
    assert!(
        ours.len() <= 2 * 5 * 5,
        "{} commands in 5 s:\n{}",
        ours.len(),
        ours.join("\n")
    );
    let per_holder = ours.iter().filter(|l| !l.contains("\"acquire\"")).count();
    eprintln!(
        "idle scheduler over 5 s: {} commands in all, {per_holder} by the holder",
        ours.len()
    );
    if std::env::var("SHOW_MONITOR").is_ok() {
        eprintln!("{}", ours.join("\n"));
    }
    assert!(
        per_holder <= 5 * 5,
        "{per_holder} commands in 5 s by the holder"
    );
}

/// The bench's `delayed` scenario on a tiny N (debug build): it runs and prints its figure.
/// Speed is reported by the harness, never asserted here.
#[test]
fn the_delayed_bench_scenario_runs_on_a_tiny_n() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd-bench"))
        .args([
            "delayed",
            "--jobs",
            "2000",
            "--locketd",
            env!("CARGO_BIN_EXE_locketd"),
        ])
        .output()
        .expect("run locketd-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("delayed: 2000 items over 1000 timestamps delivered in")
            && stdout.contains("(index left: 0)"),
        "{stdout}"
    );
}

/// SC-5 under races: two daemons delivering at once (a split brain: each holds its own lock
/// key) while a client runs the gem's `remove_delayed` on random items. Every item is either
/// removed (LREM said so) or delivered, never both, never twice, never lost.
#[test]
fn split_brain_delivery_with_concurrent_remove_delayed_loses_and_duplicates_nothing() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let n = 3000;
    let base = now() + 2;
    let item = |i: usize| format!(r#"{{"class":"J","args":[{i}],"queue":"race"}}"#);
    for i in 0..n {
        gem_enqueue_at(&mut r, base + (i % 3) as i64, &item(i));
    }
    let _a = Daemon::start(&redis, &config("lock_key = \"lock-a\""), &[]);
    let _b = Daemon::start(&redis, &config("lock_key = \"lock-b\""), &[]);
    let mut removed = std::collections::BTreeSet::new();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    while std::time::Instant::now() < deadline && zcard(&mut r) > 0 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let i = (seed % n as u64) as usize;
        let it = item(i);
        let idx = format!("{NS}:timestamps:{it}");
        let buckets: Vec<String> = r.cmd(&["SMEMBERS", &idx]);
        for b in buckets {
            let gone: i64 = r.cmd(&["LREM", &format!("{NS}:{b}"), "0", &it]);
            if gone > 0 {
                removed.insert(i);
            }
            let _: i64 = r.cmd(&["SREM", &idx, &b]);
        }
    }
    wait_until(SHORT, "every bucket delivered", || zcard(&mut r) == 0);
    let mut delivered = BTreeMap::new();
    for p in queue(&mut r, "race") {
        let v: serde_json::Value = serde_json::from_str(&p).unwrap();
        *delivered
            .entry(v["args"][0].as_u64().unwrap() as usize)
            .or_insert(0) += 1;
    }
    assert!(delivered.values().all(|c| *c == 1), "delivered twice");
    for i in 0..n {
        assert!(
            delivered.contains_key(&i) != removed.contains(&i),
            "item {i}: delivered {} removed {}",
            delivered.contains_key(&i),
            removed.contains(&i)
        );
    }
    assert!(
        !removed.is_empty(),
        "the remover removed nothing: the test raced nothing"
    );
    assert!(r.keys(&format!("{NS}:timestamps:*")).is_empty());
}

/// SC-12 in a split brain: two daemons each holding their own lock key fire the same
/// schedule; the record still lets each tick through once.
#[test]
fn split_brain_schedulers_fire_each_tick_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let sched = "[schedule.tick]\nevery = \"1s\"\nclass = \"Tick\"\nqueue = \"ticks\"\n";
    let mut a = Daemon::start(
        &redis,
        &config(&format!("lock_key = \"lock-a\"\n{sched}")),
        &[],
    );
    let mut b = Daemon::start(
        &redis,
        &config(&format!("lock_key = \"lock-b\"\n{sched}")),
        &[],
    );
    std::thread::sleep(Duration::from_secs(6));
    a.terminate(SHORT);
    b.terminate(SHORT);
    let mut ticks = fired_ticks(&a.log());
    let from_a = ticks.len();
    ticks.extend(fired_ticks(&b.log()));
    let mut sorted = ticks.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), ticks.len(), "a tick fired twice: {ticks:?}");
    assert_eq!(queue(&mut r, "ticks").len(), ticks.len());
    assert!(ticks.len() >= 4, "{ticks:?}");
    eprintln!(
        "split brain: {from_a} ticks by a, {} by b",
        ticks.len() - from_a
    );
}

/// SC-9: a scheduler whose renewal finds the key taken by someone else (here an operator
/// wrote a Ruby scheduler's value) stops delivering at once and waits as a standby.
#[test]
fn a_scheduler_that_loses_its_lock_stops_delivering() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let d = Daemon::start(&redis, &config(""), &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    let _: () = r.cmd(&["SET", LOCK, "otherhost:123", "EX", "5"]);
    d.wait_for_log("scheduler lock lost to another holder", SHORT);
    gem_enqueue_at(&mut r, now() - 1, r#"{"class":"J","args":[],"queue":"q"}"#);
    std::thread::sleep(Duration::from_secs(2));
    assert!(queue(&mut r, "q").is_empty(), "delivered without the lock");
    let holder: String = r.cmd(&["GET", LOCK]);
    assert_eq!(holder, "otherhost:123");
    wait_until(
        SHORT,
        "delivery after the other holder's key expired",
        || queue(&mut r, "q").len() == 1,
    );
}

/// SC-10: `locketd check-config` names the schedule and its bad cron, duration or zone.
#[test]
fn check_config_names_a_bad_schedule() {
    let dir = tempfile::tempdir().unwrap();
    for (table, want) in [
        ("cron = \"0 0 30 2 MON-\"", "schedule.\"bad\": invalid cron"),
        (
            "every = \"5 parsecs\"",
            "schedule.\"bad\": invalid duration",
        ),
        (
            "cron = \"@daily\"\ntz = \"Atlantis/Capital\"",
            "schedule.\"bad\": unknown time zone",
        ),
    ] {
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            format!("queues = \"q\"\n[schedule.bad]\nclass = \"C\"\nqueue = \"q\"\n{table}\n"),
        )
        .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{err}");
        assert!(err.contains(want), "{table}: {err}");
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Issue 23 finding 3 (E-3, SC-5, SC-13): Redis refuses writes for about 1.5 s around a tick
/// and a due delayed item (`min-replicas-to-write` gives NOREPLICAS, a failover's demotion
/// READONLY, a full Redis OOM). None of these is a refusal that waiting cannot change: the
/// tick fires and the item is delivered once Redis takes writes again, within seconds, not
/// lost (the tick) nor put off for a minute (the item).
#[test]
fn a_tick_and_a_due_item_refused_for_a_moment_land_once_redis_takes_writes() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    // A port nothing listens on: the demoted server's master never answers.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let sched = "[schedule.t]\nevery = \"5s\"\nclass = \"T\"\nqueue = \"ticks\"\n";
    // A long lock TTL: the lock stays held through the outage (SC-9 is not what is tested).
    let text = format!(
        "{}\n[scheduler]\nlock_ttl = \"30s\"\n{sched}\n",
        cfg("idle").render()
    );
    let d = Daemon::start(&redis, &text, &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    // Each case: what Redis answers, the commands that make it refuse, those that mend it.
    type Case<'a> = (&'a str, &'a [&'a [&'a str]], &'a [&'a [&'a str]]);
    let cases: [Case; 3] = [
        (
            "NOREPLICAS",
            &[&["CONFIG", "SET", "min-replicas-to-write", "1"]],
            &[&["CONFIG", "SET", "min-replicas-to-write", "0"]],
        ),
        (
            "READONLY",
            &[&["REPLICAOF", "127.0.0.1", &dead]],
            &[&["REPLICAOF", "NO", "ONE"]],
        ),
        (
            "OOM",
            &[
                &["CONFIG", "SET", "maxmemory-policy", "noeviction"],
                &["CONFIG", "SET", "maxmemory", "1"],
            ],
            &[&["CONFIG", "SET", "maxmemory", "0"]],
        ),
    ];
    for (i, (what, refuse, restore)) in cases.iter().enumerate() {
        // 0.8 s before a tick (a multiple of 5 s): the item due then is written, writes are
        // refused, and taken again 1.5 s later.
        wait_until(SHORT, "the moment before a tick", || {
            let ms = now_ms() % 5000;
            (4100..4300).contains(&ms)
        });
        let tick = now() + 1;
        assert_eq!(tick % 5, 0);
        let item = format!(r#"{{"class":"D","args":[{i}],"queue":"items"}}"#);
        gem_enqueue_at(&mut r, tick, &item);
        for c in *refuse {
            let _: redis::Value = r.cmd(c);
        }
        std::thread::sleep(Duration::from_millis(1500));
        for c in *restore {
            let _: redis::Value = r.cmd(c);
        }
        // The redis crate spells the kinds it knows its own way ("ReadOnly").
        let log = d.log();
        assert!(
            log.to_ascii_lowercase()
                .contains(&what.to_ascii_lowercase()),
            "{what}: Redis did not refuse anything:\n{log}"
        );
        // Before the next tick: the refused tick itself is fired, the item delivered.
        wait_until(
            Duration::from_secs(3),
            &format!("{what}: tick {tick} fired and the item delivered"),
            || fired_ticks(&d.log()).contains(&tick) && queue(&mut r, "items").len() == i + 1,
        );
    }
    let mut d = d;
    d.terminate(SHORT);
    let ticks = fired_ticks(&d.log());
    let mut sorted = ticks.clone();
    sorted.dedup();
    assert_eq!(sorted.len(), ticks.len(), "a tick fired twice: {ticks:?}");
}

/// Issue 23, SC-8, SC-9: a scheduler that gave its lock up locally (no renewal for two thirds
/// of the TTL: here Redis refused writes) takes it again as soon as Redis answers when the key
/// still holds its own value, instead of waiting for the key to expire (up to a minute with
/// the default TTL of 180 s, which the test sets on the key by hand).
#[test]
fn a_lock_given_up_locally_is_taken_again_while_the_key_is_still_ours() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let text = format!("{}\n[scheduler]\nlock_ttl = \"6s\"\n", cfg("idle").render());
    let d = Daemon::start(&redis, &text, &[]);
    d.wait_for_log("scheduler lock taken", SHORT);
    let ours: String = r.cmd(&["GET", LOCK]);
    let _: () = r.cmd(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    d.wait_for_log("scheduler lock not renewed in time", SHORT);
    let _: () = r.cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"]);
    // The key outlives the local deadline, as a 180 s key outlives its 120 s one.
    let _: i64 = r.cmd(&["EXPIRE", LOCK, "120"]);
    gem_enqueue_at(&mut r, now() - 1, r#"{"class":"J","args":[],"queue":"q"}"#);
    wait_until(SHORT, "delivery by the same daemon", || {
        queue(&mut r, "q").len() == 1
    });
    let holder: String = r.cmd(&["GET", LOCK]);
    assert_eq!(holder, ours);
    let ttl: i64 = r.cmd(&["TTL", LOCK]);
    assert!(ttl <= 6, "the lock's TTL is not the configured one: {ttl}");
}

/// Issue 23 item 3, E-3, S-6: a lock key another tool made a hash is refused by Redis; the
/// daemon reports it once and does not resend the lock's script in a loop (nor deliver).
#[test]
fn a_lock_key_of_another_type_is_reported_once_and_not_retried_in_a_loop() {
    use std::io::{Read, Write};
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _: i64 = r.cmd(&["HSET", LOCK, "f", "v"]);
    gem_enqueue_at(&mut r, now() - 1, r#"{"class":"J","args":[],"queue":"q"}"#);
    let d = Daemon::start(&redis, &config(""), &[]);
    let needle = "Redis refused the scheduler lock's script";
    d.wait_for_log(needle, SHORT);
    let mut mon = std::net::TcpStream::connect(("127.0.0.1", redis.port())).unwrap();
    mon.write_all(b"MONITOR\r\n").unwrap();
    mon.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    while start.elapsed() < Duration::from_secs(4) {
        match mon.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let text = String::from_utf8_lossy(&seen);
    let calls = text
        .lines()
        .filter(|l| l.contains("resque_scheduler_master_lock") && !l.contains("[0 lua]"))
        .count();
    assert_eq!(calls, 0, "the lock's script resent:\n{text}");
    assert_eq!(d.log().matches(needle).count(), 1, "{}", d.log());
    assert!(queue(&mut r, "q").is_empty(), "delivered without the lock");
}

/// Issue 23, SC-5: one DELIVER call reads at most about 1 MiB of items (at least one item),
/// so a bucket of items of several MB each does not hold Redis for the whole batch of 100;
/// the calls that follow deliver the rest, in order, and clean up.
#[tokio::test]
async fn one_deliver_call_reads_a_bounded_number_of_bytes() {
    use locketd::resque::keys::Keys;
    use locketd::store::schedule::deliver_batch;
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut c = redis.conn().await;
    let keys = Keys::new(NS);
    let big = "x".repeat(600 * 1024);
    for i in 0..5 {
        let item = format!(r#"{{"class":"Big","args":[{i},"{big}"],"queue":"big"}}"#);
        gem_enqueue_at(&mut r, 100, &item);
    }
    let first = deliver_batch(&mut c, &keys, "100", 0, 100).await.unwrap();
    assert!(
        (1..5).contains(&first.delivered),
        "one call delivered {} items of 600 KiB",
        first.delivered
    );
    assert_eq!(first.left, 5 - first.delivered as i64);
    let mut calls = 1;
    while queue(&mut r, "big").len() < 5 {
        let d = deliver_batch(&mut c, &keys, "100", 0, 100).await.unwrap();
        assert!(d.delivered >= 1, "{d:?}");
        calls += 1;
        assert!(calls <= 5);
    }
    let items = queue(&mut r, "big");
    for (i, item) in items.iter().enumerate() {
        assert!(item.starts_with(&format!(r#"{{"class":"Big","args":[{i},"#)));
    }
    assert_eq!(zcard(&mut r), 0);
    assert!(!r.exists(&format!("{NS}:delayed:100")));
}

/// Redis's clock, in Unix seconds.
fn redis_now(r: &mut R) -> i64 {
    let t: Vec<String> = r.cmd(&["TIME"]);
    t[0].parse().unwrap()
}

/// Issue 23, SC-12: a tick later than Redis's clock (a scheduler whose clock jumped ahead) is
/// neither enqueued nor recorded, so it cannot make the fleet skip every tick up to it; and a
/// record already moved that far (by such a scheduler of an older version) does not hold the
/// fleet's ticks back.
#[tokio::test]
async fn a_tick_ahead_of_redis_clock_is_not_recorded_and_a_record_ahead_does_not_block() {
    use locketd::resque::keys::Keys;
    use locketd::store::schedule::{fire, Fired};
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut c = redis.conn().await;
    let keys = Keys::new(NS);
    let stamp = "2026-11-23 20:33:03 +0000";
    let payload = r#"{"class":"T","args":[]}"#;
    let now = redis_now(&mut r);
    let ahead = fire(
        &mut c,
        &keys,
        "t",
        Some(now + 3600),
        "ticks",
        payload,
        stamp,
    )
    .await
    .unwrap();
    assert_eq!(ahead, Fired::AheadOfRedis);
    assert!(queue(&mut r, "ticks").is_empty());
    let last: Option<String> = r.cmd(&["HGET", &format!("{NS}:locket:schedule:last"), "t"]);
    assert_eq!(last, None);
    // On time: fired, once.
    let on_time = fire(&mut c, &keys, "t", Some(now), "ticks", payload, stamp).await;
    assert_eq!(on_time.unwrap(), Fired::Yes);
    let again = fire(&mut c, &keys, "t", Some(now), "ticks", payload, stamp).await;
    assert_eq!(again.unwrap(), Fired::Already);
    // A record an hour ahead of Redis's clock (written by an older scheduler whose clock had
    // jumped): the next tick is fired all the same.
    let _: i64 = r.cmd(&[
        "HSET",
        &format!("{NS}:locket:schedule:last"),
        "t",
        &(now + 3600).to_string(),
    ]);
    let next = fire(&mut c, &keys, "t", Some(now + 1), "ticks", payload, stamp).await;
    assert_eq!(next.unwrap(), Fired::Yes);
    assert_eq!(queue(&mut r, "ticks").len(), 2);
    let last: String = r.cmd(&["HGET", &format!("{NS}:locket:schedule:last"), "t"]);
    assert_eq!(last, (now + 1).to_string());
}

/// Issue 23, SC-11: a cron schedule without `tz` names the same ticks on every daemon of the
/// fleet, whatever the host's zone (`TZ` here): it is read in UTC. Daemons in different zones
/// used to fire a tick each (09:00 in Tokyo and 09:00 in New York).
#[test]
fn a_cron_schedule_without_tz_names_the_same_ticks_in_every_zone() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "queues = \"q\"\n[schedule.daily]\ncron = \"0 9 * * *\"\nclass = \"C\"\nqueue = \"q\"\n",
    )
    .unwrap();
    let listed = |zone: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
            .arg("--config")
            .arg(&path)
            .arg("--redis")
            .arg(redis.url())
            .args(["schedule", "--json"])
            .env("TZ", zone)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["schedules"][0].clone()
    };
    let tokyo = listed("Asia/Tokyo");
    let new_york = listed("America/New_York");
    assert_eq!(tokyo["next"], new_york["next"], "{tokyo} {new_york}");
    let next = tokyo["next"].as_i64().unwrap();
    assert_eq!(next.rem_euclid(86_400), 9 * 3600, "{tokyo}");
    assert!(tokyo["when"].as_str().unwrap().ends_with("UTC"), "{tokyo}");
}
