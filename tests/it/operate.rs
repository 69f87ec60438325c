//! Operating a fleet (issue 27): pausing queues with resque-pause's keys (A-20), against the
//! real binary and a real redis-server. Run: `cargo test --test it operate::`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::daemon::{cfg, exit_code, workdir, NS, R, SHORT};
use crate::ops::{locketd, stdout_ok};
use crate::support::{
    pid_alive, process_group_members, script_calls, wait_until, write_script, Daemon, RedisServer,
};

const NOOP: &str = "[classes.Noop]\nbuiltin = \"noop\"\n";

fn job(n: usize) -> String {
    format!(r#"{{"class":"Noop","args":[{n}]}}"#)
}

fn lrange(r: &mut R, queue: &str) -> Vec<Vec<u8>> {
    r.cmd(&["LRANGE", &format!("{NS}:queue:{queue}"), "0", "-1"])
}

/// A-20: a queue paused by another tool (`SET resque:pause:queue:mail true`, as resque-pause
/// does) is not popped: its list is byte for byte unchanged after 5 s with idle workers, while
/// another queue runs; `locketd resume mail` wakes the idle workers at once (the interval is
/// 30 s here, so the start cannot come from a pass).
#[test]
fn a20_a_queue_paused_by_another_tool_is_not_popped_and_resume_starts_its_jobs_at_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let _: () = r.cmd(&["SET", &format!("{NS}:pause:queue:mail"), "true"]);
    for n in 0..3 {
        r.push("mail", &job(n));
    }
    let before = lrange(&mut r, "mail");
    let cfg = format!("queues = \"mail,other\"\ninterval = 30\n\n{NOOP}");
    let mut d = Daemon::start(&redis, &cfg, &["--workers", "2"]);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
    r.push("other", &job(10));
    wait_until(SHORT, "the other queue's job ran", || r.processed() == 1);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(lrange(&mut r, "mail"), before, "a paused queue was touched");
    assert_eq!(r.processed(), 1);
    let status = stdout_ok(&locketd(&redis, &["status", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&status).expect("status json");
    let mail = v["queues"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["name"] == "mail"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(mail["paused"], "queue", "status: {status}");

    // From before the command starts: its own start and exit are counted too.
    let resumed = Instant::now();
    let out = stdout_ok(&locketd(&redis, &["resume", "mail"]));
    assert!(out.contains("resumed mail"), "{out}");
    wait_until(SHORT, "the resumed queue's jobs ran", || r.processed() == 4);
    let took = resumed.elapsed();
    eprintln!("resume to 3 jobs done: {took:?}");
    assert!(
        took < Duration::from_secs(3),
        "the resumed jobs waited {took:?}: found by a pass, not a wake-up\n{}",
        crate::support::tail(&d.log(), 40)
    );
    assert!(!r.exists(&format!("{NS}:pause:queue:mail")));

    // `locketd pause` writes resque-pause's own key and value.
    stdout_ok(&locketd(&redis, &["pause", "mail"]));
    let v: Option<String> = r.cmd(&["GET", &format!("{NS}:pause:queue:mail")]);
    assert_eq!(v.as_deref(), Some("true"));
    r.push("mail", &job(20));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(r.llen(&format!("{NS}:queue:mail")), 1);
    stdout_ok(&locketd(&redis, &["resume", "mail"]));
    wait_until(SHORT, "the job pushed while paused ran", || {
        r.processed() == 5
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A-20 with `pause --all` in the multi-slot mode (RESERVE batched per process): no queue is
/// popped until `resume --all`.
#[test]
fn a20_pause_all_holds_every_queue_in_the_multi_slot_mode() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    stdout_ok(&locketd(&redis, &["pause", "--all"]));
    assert!(r.exists(&format!("{NS}:pause:all")));
    let cfg = format!("queues = \"a,b\"\ninterval = 30\n\n{NOOP}");
    let mut d = Daemon::start(&redis, &cfg, &["--workers", "1", "--slots", "3"]);
    wait_until(SHORT, "three slots registered", || r.workers().len() == 3);
    for n in 0..4 {
        r.push("a", &job(n));
        r.push("b", &job(n));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(r.processed(), 0);
    assert_eq!(r.llen(&format!("{NS}:queue:a")), 4);
    let out = stdout_ok(&locketd(&redis, &["resume", "--all"]));
    assert!(out.contains("resumed every queue"), "{out}");
    wait_until(SHORT, "every job ran", || r.processed() == 8);
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A-20, S-6: a pause key of another type (written by hand) pauses its queue all the same and
/// is never overwritten: `locketd pause` refuses before any write, naming the key, and sets
/// none of the other keys it was given.
#[test]
fn a20_a_wrong_typed_pause_key_pauses_and_is_refused_before_any_write() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:pause:queue:mail");
    let _: () = r.cmd(&["HSET", &key, "by", "hand"]);
    r.push("mail", &job(1));
    let out = locketd(&redis, &["pause", "other", "mail"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("WRONGTYPE") && err.contains(&key), "{err}");
    assert!(!r.exists(&format!("{NS}:pause:queue:other")));
    let out = locketd(&redis, &["resume", "mail"]);
    assert!(!out.status.success());
    let t: String = r.cmd(&["TYPE", &key]);
    assert_eq!(t, "hash");

    let cfg = format!("queues = \"mail,other\"\ninterval = 30\n\n{NOOP}");
    let mut d = Daemon::start(&redis, &cfg, &["--workers", "1", "--slots", "2"]);
    wait_until(SHORT, "two slots registered", || r.workers().len() == 2);
    r.push("other", &job(2));
    wait_until(SHORT, "the other queue's job ran", || r.processed() == 1);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(r.llen(&format!("{NS}:queue:mail")), 1);
    let _: i64 = r.cmd(&["DEL", &key]);
    wait_until(SHORT, "the mended queue's job ran", || r.processed() == 2);
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A-20: delayed jobs that fall due while their queue is paused are still delivered into it (a
/// resque-scheduler item, as the gem's `enqueue_at` writes it, and an entry of locketd's own
/// delayed set) and wait there, unpopped, over many passes; `locketd resume` runs them.
#[test]
fn a20_delayed_jobs_are_delivered_into_a_paused_queue_and_run_on_resume() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    stdout_ok(&locketd(&redis, &["pause", "mail"]));
    let ts = (SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 5)
    .to_string();
    let item = r#"{"class":"Noop","args":["scheduled"],"queue":"mail"}"#;
    let _: i64 = r.cmd(&["RPUSH", &format!("{NS}:delayed:{ts}"), item]);
    let _: i64 = r.cmd(&[
        "SADD",
        &format!("{NS}:timestamps:{item}"),
        &format!("delayed:{ts}"),
    ]);
    let _: i64 = r.cmd(&["ZADD", &format!("{NS}:delayed_queue_schedule"), &ts, &ts]);
    let delayed = r#"{"class":"Noop","args":["delayed"]}"#;
    let member = serde_json::json!({"rid": "r1", "queue": "mail", "payload": delayed,
        "reason": "lock", "resource": "L", "attempt": 1})
    .to_string();
    let _: i64 = r.cmd(&["ZADD", &format!("{NS}:locket:delayed"), "1", &member]);

    let config = format!("{}\n{NOOP}", cfg("mail,other").render());
    let mut d = Daemon::start(&redis, &config, &["--workers", "1"]);
    wait_until(SHORT, "both delivered into the paused queue", || {
        r.llen(&format!("{NS}:queue:mail")) == 2
    });
    // Many passes (interval 0.1 s): nothing is popped.
    std::thread::sleep(Duration::from_secs(1));
    let mut held: Vec<String> = lrange(&mut r, "mail")
        .into_iter()
        .map(|b| String::from_utf8(b).unwrap())
        .collect();
    held.sort();
    assert_eq!(
        held,
        [delayed, r#"{"class":"Noop","args":["scheduled"]}"#],
        "{}",
        crate::support::tail(&d.log(), 40)
    );
    assert_eq!(r.processed(), 0);
    stdout_ok(&locketd(&redis, &["resume", "mail"]));
    wait_until(SHORT, "the delivered jobs ran", || r.processed() == 2);
    assert_eq!(r.failures().len(), 0);
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A-22, S-6: a cap key spoiled by hand (a hash) is not read as "no cap": its queue is held
/// (its list byte for byte unchanged over many passes) while the other queue runs; the worker
/// says so once in its log, and does not retry in a loop (its passes stay at the interval's
/// pace); once the key is mended the job runs.
#[test]
fn a22_a_spoiled_cap_key_holds_its_queue_and_is_reported_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:locket:cap:mail");
    let _: i64 = r.cmd(&["HSET", &key, "by", "hand"]);
    r.push("mail", &job(1));
    let before = lrange(&mut r, "mail");
    let cfg = format!("queues = \"mail,other\"\ninterval = 0.2\n\n{NOOP}");
    let mut d = Daemon::start(&redis, &cfg, &["--workers", "1"]);
    wait_until(SHORT, "one worker registered", || r.workers().len() == 1);
    r.push("other", &job(2));
    wait_until(SHORT, "the other queue's job ran", || r.processed() == 1);
    let calls = |r: &mut R| script_calls(&r.cmd::<String>(&["INFO", "commandstats"]));
    let calls_before = calls(&mut r);
    std::thread::sleep(Duration::from_secs(2));
    let passes = calls(&mut r) - calls_before;
    assert_eq!(
        lrange(&mut r, "mail"),
        before,
        "a refused queue was touched"
    );
    assert_eq!(r.processed(), 1);
    let log = d.log();
    assert_eq!(
        log.matches("queue cap key is not a number").count(),
        1,
        "{}",
        crate::support::tail(&log, 40)
    );
    // About 10 passes of 0.2 s (and the janitor's and heartbeats' calls); a loop makes
    // thousands.
    assert!(passes < 100, "{passes} script calls in 2 s");
    let t: String = r.cmd(&["TYPE", &key]);
    assert_eq!(t, "hash", "the spoiled key was overwritten");
    let _: i64 = r.cmd(&["DEL", &key]);
    wait_until(SHORT, "the mended queue's job ran", || r.processed() == 2);
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// The rid of the job in an inflight record (there is one running here), once there is one.
pub(crate) fn running_rid(r: &mut R) -> String {
    let mut found = String::new();
    wait_until(SHORT, "a job is reserved", || {
        for k in r.keys(&format!("{NS}:locket:inflight:*")) {
            let rid: Option<String> = r.cmd(&["HGET", &k, "rid"]);
            if let Some(rid) = rid {
                found = rid;
                return true;
            }
        }
        false
    });
    found
}

/// A-21: a 60 s command job, run by one of two daemons, is cancelled by `locketd cancel RID`
/// (another process): its handler is gone within 2 s + kill_grace (1 s here), the failure
/// record says `Locket::Cancelled` and who asked; a second cancel of the finished job does
/// nothing and says so. With `--requeue` (the queue paused meanwhile so that nothing takes it
/// again) the job is back in its queue, once, with no failure recorded.
#[test]
fn a21_a_running_command_job_is_cancelled_from_another_process() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pids = work.path().join("pids");
    let script = write_script(
        work.path(),
        "long.sh",
        &format!("echo $$ >> {}\nexec sleep 60\n", pids.display()),
    );
    let config = cfg("q").class("Long", &script, "").render();
    let mut a = Daemon::start(&redis, &config, &[]);
    let mut b = Daemon::start(&redis, &config, &[]);
    wait_until(SHORT, "two workers registered", || r.workers().len() == 2);

    r.push("q", r#"{"class":"Long","args":[1]}"#);
    let rid = running_rid(&mut r);
    let pid_of_job = |n: usize| -> i32 {
        let mut pid = 0;
        wait_until(SHORT, "the job's handler started", || {
            let text = std::fs::read_to_string(&pids).unwrap_or_default();
            match text.lines().nth(n).and_then(|l| l.trim().parse().ok()) {
                Some(p) => {
                    pid = p;
                    true
                }
                None => false,
            }
        });
        pid
    };
    let handler = pid_of_job(0);
    let asked = Instant::now();
    let out = stdout_ok(&locketd(&redis, &["cancel", &rid]));
    // The command waits for the outcome and says what happened.
    assert!(out.contains("cancelled: its handler was stopped"), "{out}");
    assert!(
        out.contains("recorded as failed with Locket::Cancelled"),
        "{out}"
    );
    wait_until(SHORT, "the handler is gone", || !pid_alive(handler));
    let took = asked.elapsed();
    eprintln!("cancel to handler gone: {took:?}");
    assert!(
        took < Duration::from_secs(2) + Duration::from_secs(1) + Duration::from_secs(1),
        "the handler outlived 2 s + kill_grace after the cancel: {took:?}"
    );
    assert!(process_group_members(handler).is_empty());
    wait_until(SHORT, "the failure is recorded", || {
        !r.failures().is_empty()
    });
    let f = &r.failures()[0];
    assert_eq!(f["exception"], "Locket::Cancelled", "{f}");
    assert!(
        f["error"]
            .as_str()
            .unwrap_or("")
            .contains("locketd cancel by"),
        "{f}"
    );
    // A finished job: nothing done, and said so.
    let out = locketd(&redis, &["cancel", &rid]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing done"));
    assert!(r.keys(&format!("{NS}:locket:cancel:*")).is_empty());

    // --requeue, by the slot's worker id.
    r.push("q", r#"{"class":"Long","args":[2]}"#);
    let _ = running_rid(&mut r);
    let handler = pid_of_job(1);
    let worker = r
        .workers()
        .into_iter()
        .find(|w| r.exists(&format!("{NS}:worker:{w}")))
        .expect("a busy worker");
    stdout_ok(&locketd(&redis, &["pause", "q"]));
    let out = stdout_ok(&locketd(&redis, &["cancel", &worker, "--requeue"]));
    assert!(
        out.contains("the job went back to the tail of its queue"),
        "{out}"
    );
    wait_until(SHORT, "the job is back in its queue", || {
        r.llen(&format!("{NS}:queue:q")) == 1
    });
    assert!(!pid_alive(handler));
    std::thread::sleep(Duration::from_millis(500));
    let back: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:q"), "0", "-1"]);
    assert_eq!(back, [r#"{"class":"Long","args":[2]}"#]);
    assert_eq!(
        r.failures().len(),
        1,
        "a requeued cancel records no failure"
    );
    for d in [&mut a, &mut b] {
        d.signal(libc::SIGQUIT);
        assert_eq!(exit_code(d, SHORT), Some(0));
    }
}

/// A-22: `[queue.q] concurrency = 3` over two daemons of `--workers 2 --slots 4` (16 slots):
/// 200 jobs of 100 ms never run more than 3 at once, from the jobs' own stamps; all of them
/// run, and no unit is left in use afterwards. `status` shows `running/cap`.
#[test]
fn a22_a_queue_cap_holds_across_two_multi_slot_daemons() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let stamps = work.path().join("stamps");
    let script = write_script(
        work.path(),
        "job.sh",
        &format!(
            "echo \"s $(date +%s%N)\" >> {f}\nsleep 0.1\necho \"e $(date +%s%N)\" >> {f}\n",
            f = stamps.display()
        ),
    );
    let config = format!(
        "{}\n[queue.q]\nconcurrency = 3\n",
        cfg("q").class("Job", &script, "").render()
    );
    let args = ["--workers", "2", "--slots", "4"];
    let mut a = Daemon::start(&redis, &config, &args);
    let mut b = Daemon::start(&redis, &config, &args);
    wait_until(SHORT, "16 slots registered", || r.workers().len() == 16);
    const N: i64 = 200;
    let started = Instant::now();
    for n in 0..N {
        r.push("q", &format!(r#"{{"class":"Job","args":[{n}]}}"#));
    }
    let mut seen_cap = false;
    wait_until(Duration::from_secs(120), "every job ran", || {
        if !seen_cap {
            let st = stdout_ok(&locketd(&redis, &["status"]));
            seen_cap = st.lines().any(|l| l.starts_with("q ") && l.contains("/3"));
        }
        r.processed() == N
    });
    let took = started.elapsed();
    eprintln!(
        "{N} jobs of 100 ms, cap 3: {took:?} (ideal {:.2} s)",
        N as f64 * 0.1 / 3.0
    );
    assert!(seen_cap, "status never showed running/cap");
    let text = std::fs::read_to_string(&stamps).expect("stamps");
    let mut events: Vec<(u128, i32)> = text
        .lines()
        .filter_map(|l| {
            let (kind, t) = l.split_once(' ')?;
            let t: u128 = t.trim().parse().ok()?;
            Some((t, if kind == "s" { 1 } else { -1 }))
        })
        .collect();
    assert_eq!(
        events.len(),
        2 * N as usize,
        "every job stamped its start and end"
    );
    // At one instant an end counts before a start.
    events.sort();
    let (mut now, mut most) = (0, 0);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    eprintln!("most jobs running at once: {most}");
    assert!(most <= 3, "{most} jobs of a queue capped at 3 ran at once");
    assert_eq!(r.failures().len(), 0);
    let left: i64 = r.cmd(&["SCARD", &format!("{NS}:locket:running:q")]);
    assert_eq!(left, 0, "units left in use");
    for d in [&mut a, &mut b] {
        d.signal(libc::SIGQUIT);
        assert_eq!(exit_code(d, SHORT), Some(0));
    }
}

/// An empty queue name is refused by every operator command that takes one, with a clear
/// error and nothing written (`pause ''` used to write `<ns>:pause:queue:`).
#[test]
fn an_empty_queue_name_is_refused_by_every_command_that_takes_one() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let commands: [&[&str]; 9] = [
        &["pause", ""],
        &["pause", "mail", ""],
        &["resume", ""],
        &["enqueue", "", "Job"],
        &["counters", "--reset", ""],
        &["unpark", "--queue", ""],
        &["parked", "--queue", ""],
        &["delayed", "--queue", ""],
        &["failed", "retry", "--queue", ""],
    ];
    for args in commands {
        let out = locketd(&redis, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            err.contains("a queue name cannot be empty"),
            "{args:?}: {err}"
        );
    }
    let keys: Vec<String> = r.cmd(&["KEYS", "*"]);
    assert!(keys.is_empty(), "{keys:?}");
}
