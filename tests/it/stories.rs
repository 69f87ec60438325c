//! The four user stories of issue 4 end to end, through the real binary and command handlers
//! against a real redis-server: lock around an id (`discard`, limit N), one after another
//! (`wait`), B after A (holds, `locked_by`, `delay`), reschedule myself (exit 75). Plus the
//! template rules that users see (T-2 big integers, T-6 BadLockKey) and NEVER-1 with limits
//! 1 and 3 under several daemon processes, random handler durations and SIGKILLs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);
const SHORT_WAIT: Duration = Duration::from_secs(10);

/// A handler that logs `start <ns> <args> <lock keys> <token> <fences>` and `end <ns> <args>`
/// around `body` (shell), to `log`.
fn handler(dir: &Path, name: &str, log: &Path, body: &str) -> PathBuf {
    write_script(
        dir,
        name,
        &format!(
            r#"cat >/dev/null
echo "start $(date +%s%N) $LOCKETD_ARGS $LOCKETD_LOCK_KEYS $LOCKETD_LOCK_TOKEN $LOCKETD_LOCK_FENCES" >> {log}
{body}
rc=$?
echo "end $(date +%s%N) $LOCKETD_ARGS" >> {log}
exit $rc
"#,
            log = log.display()
        ),
    )
}

#[derive(Debug, Clone)]
struct Run {
    args: String,
    keys: String,
    token: String,
    start: u128,
    end: Option<u128>,
}

/// The runs in a handler log, in start order.
fn runs(log: &Path) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for line in read_lossy(log).lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "start" => out.push(Run {
                args: f[2].to_string(),
                keys: f.get(3).unwrap_or(&"").to_string(),
                token: f.get(4).unwrap_or(&"").to_string(),
                start: f[1].parse().unwrap(),
                end: None,
            }),
            "end" => {
                let r = out
                    .iter_mut()
                    .rev()
                    .find(|r| r.args == f[2] && r.end.is_none())
                    .unwrap_or_else(|| panic!("end without start: {line}"));
                r.end = Some(f[1].parse().unwrap());
            }
            _ => panic!("bad line {line:?}"),
        }
    }
    out.sort_by_key(|r| r.start);
    out
}

fn ended(log: &Path) -> usize {
    runs(log).iter().filter(|r| r.end.is_some()).count()
}

/// NEVER-2's tally: how many ends each job (its args) had, from the handler log's completed
/// runs and from the failure records. A SIGKILL of the worker `killed` (":<pid>:") may land
/// after one of its handlers ended but before its FINISH: that job ran once, and its one
/// recorded end is the DirtyExit failure the janitor writes (R-4), so the pair counts once.
/// Two runs, or two failures, of one job still count twice.
fn ends_by_job(log: &Path, failures: &[Value], killed: &str) -> HashMap<String, usize> {
    let mut ends: HashMap<String, usize> = HashMap::new();
    for run in runs(log).iter().filter(|r| r.end.is_some()) {
        *ends.entry(run.args.clone()).or_default() += 1;
    }
    let ran: Vec<String> = ends.keys().cloned().collect();
    for f in failures {
        let args = f["payload"]["args"].to_string();
        let finish_lost = f["exception"] == "Resque::DirtyExit"
            && f["worker"].as_str().is_some_and(|w| w.contains(killed))
            && ran.contains(&args);
        if !finish_lost {
            *ends.entry(args).or_default() += 1;
        }
    }
    ends
}

/// Largest number of runs overlapping at one instant; unfinished runs end at `cutoff`.
fn max_overlap(runs: &[&Run], cutoff: u128) -> usize {
    let mut ev: Vec<(u128, i32)> = Vec::new();
    for r in runs {
        ev.push((r.start, 1));
        ev.push((r.end.unwrap_or(cutoff), -1));
    }
    // Ends before starts at the same instant.
    ev.sort();
    let (mut cur, mut max) = (0i32, 0i32);
    for (_, d) in ev {
        cur += d;
        max = max.max(cur);
    }
    max as usize
}

fn stat(r: &mut R, event: &str) -> i64 {
    r.int(&format!("{NS}:locket:stat:{event}"))
}

fn start_daemons(redis: &RedisServer, r: &mut R, config: &str, n: usize) -> Vec<Daemon> {
    let ds: Vec<Daemon> = (0..n).map(|_| Daemon::start(redis, config, &[])).collect();
    wait_until(LONG, "every daemon registered", || r.workers().len() == n);
    ds
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

// ---------------------------------------------------------------------------------------------
// Story 1: lock around an id
// ---------------------------------------------------------------------------------------------

/// Story 1, P-2, T-1, O-1: "only one job per user at a time; a second one for the same user
/// exits at once". `lock = "user:{args[0]}"`, `on_conflict = "discard"`: the second job for
/// user 1 is dropped (logged at info, counted, not a failure), user 2 runs.
#[test]
fn story_lock_around_an_id_discards_a_second_job_for_the_same_user() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "api.sh", &log, "sleep 2");
    let config = cfg("q")
        .class(
            "Api::Call",
            &h,
            "lock = \"user:{args[0]}\"\non_conflict = \"discard\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 2);
    r.push("q", r#"{"class":"Api::Call","args":[1,"a"]}"#);
    r.push("q", r#"{"class":"Api::Call","args":[1,"b"]}"#);
    r.push("q", r#"{"class":"Api::Call","args":[2,"c"]}"#);
    // The handler logs its end before the worker counts the job: wait for both.
    wait_until(LONG, "two runs and one discard", || {
        ended(&log) == 2 && stat(&mut r, "discarded") == 1 && r.processed() == 2
    });
    // Which of the two user-1 jobs wins depends on which ACQUIRE lands first, not on the pops.
    let got: BTreeSet<String> = runs(&log).into_iter().map(|r| r.args).collect();
    assert!(got.contains(r#"[2,"c"]"#), "{got:?}");
    assert_eq!(
        got.iter().filter(|a| a.starts_with("[1,")).count(),
        1,
        "{got:?}"
    );
    let keys: BTreeSet<String> = runs(&log).into_iter().map(|r| r.keys).collect();
    assert!(
        keys.contains(r#"["user:1"]"#) && keys.contains(r#"["user:2"]"#),
        "{keys:?}"
    );
    assert!(r.failures().is_empty(), "a discard is not a failure");
    assert_eq!(r.processed(), 2);
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    let logs: String = ds.iter().map(|d| d.log()).collect();
    let line = logs
        .lines()
        .find(|l| l.contains("job discarded"))
        .expect("a discard log line");
    assert!(
        line.contains("INFO") && line.contains("Api::Call") && line.contains("user:1"),
        "{line}"
    );
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

/// Story 1 with a limit, L-1, L-2, NEVER-1: `limit = 2` lets two jobs of one user run at once and
/// discards the third, with three daemons competing.
#[test]
fn story_lock_around_an_id_with_a_limit_runs_at_most_n_at_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "api.sh", &log, "sleep 2.5");
    let config = cfg("q")
        .class(
            "Api::Call",
            &h,
            "lock = \"user:{args[0]}\"\nlimit = 2\non_conflict = \"discard\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 3);
    for t in ["a", "b", "c"] {
        r.push("q", &format!(r#"{{"class":"Api::Call","args":[1,"{t}"]}}"#));
    }
    let mut max_holders = 0;
    wait_until(LONG, "two runs and one discard", || {
        let n = r.lock_holders(&format!("{NS}:locket:lock:user:1")).len();
        max_holders = max_holders.max(n);
        ended(&log) == 2 && stat(&mut r, "discarded") == 1
    });
    let all = runs(&log);
    assert_eq!(all.len(), 2);
    let refs: Vec<&Run> = all.iter().collect();
    assert_eq!(
        max_overlap(&refs, now_ns()),
        2,
        "the two ran at the same time"
    );
    assert!(max_holders <= 2, "{max_holders} holders of limit 2");
    assert!(r.failures().is_empty());
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

// ---------------------------------------------------------------------------------------------
// Story 2: one after another
// ---------------------------------------------------------------------------------------------

/// Story 2, P-3: `on_conflict = "wait"`: jobs for the same key wait for each other instead of
/// being dropped or requeued; they never overlap and the waits are counted.
#[test]
fn story_one_after_another_waits_instead_of_dropping() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "seq.sh", &log, "sleep 0.4");
    let config = cfg("q")
        .class(
            "Ledger::Post",
            &h,
            "lock = \"acct:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"10s\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 3);
    for i in 0..4 {
        r.push(
            "q",
            &format!(r#"{{"class":"Ledger::Post","args":[9,{i}]}}"#),
        );
    }
    wait_until(LONG, "all four ran", || ended(&log) == 4);
    let all = runs(&log);
    let refs: Vec<&Run> = all.iter().collect();
    assert_eq!(max_overlap(&refs, now_ns()), 1, "{all:?}");
    assert!(stat(&mut r, "waited") >= 1, "the jobs waited");
    assert_eq!(stat(&mut r, "requeued"), 0);
    assert_eq!(stat(&mut r, "discarded"), 0);
    assert!(r.failures().is_empty());
    assert_eq!(r.processed(), 4);
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

/// resque-protocol.md checklist 15 with P-3: a job that waited for its lock shows resque-web,
/// in its "working on" record, the time it started running, not the time it was reserved and
/// began to wait (here about 2 s earlier).
#[test]
fn a_job_that_waited_for_its_lock_shows_when_it_started() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "slow.sh", &log, "sleep 2");
    let config = cfg("q")
        .class(
            "Slow",
            &h,
            "lock = \"s:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"30s\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 2);
    r.push("q", r#"{"class":"Slow","args":[1,"a"]}"#);
    wait_until(LONG, "the first job started", || runs(&log).len() == 1);
    r.push("q", r#"{"class":"Slow","args":[1,"b"]}"#);
    wait_until(LONG, "the second job started", || runs(&log).len() == 2);
    let first_end = runs(&log)[0]
        .end
        .expect("the first ended before the second started");
    let mut record: Option<Value> = None;
    wait_until(LONG, "the second job's working-on record", || {
        record = r
            .keys(&format!("{NS}:worker:*"))
            .iter()
            .filter_map(|k| r.cmd::<Option<String>>(&["GET", k]))
            .filter_map(|v| serde_json::from_str::<Value>(&v).ok())
            .find(|v| v["payload"]["args"][1] == "b");
        record.is_some()
    });
    let run_at = record.unwrap()["run_at"].as_str().unwrap().to_string();
    // Whole seconds (Resque's format): the second the first job ended, or later.
    let free_at =
        locketd::resque::time::run_at(UNIX_EPOCH + Duration::from_nanos(first_end as u64));
    assert!(
        run_at >= free_at,
        "run_at {run_at} is before the lock was free ({free_at})"
    );
    wait_until(LONG, "both ran", || ended(&log) == 2);
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

/// Story 2 bounded, P-3: a wait that times out applies `wait_then` (here `discard`), counted as
/// `wait_timeout`; the slot waited at least `wait_timeout`.
#[test]
fn a_wait_is_bounded_and_then_applies_wait_then() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "slow.sh", &log, "sleep 3");
    let config = cfg("q")
        .class(
            "Slow",
            &h,
            "lock = \"s:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"500ms\"\nwait_then = \"discard\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 2);
    r.push("q", r#"{"class":"Slow","args":[1,"a"]}"#);
    wait_until(LONG, "the first job started", || runs(&log).len() == 1);
    let t0 = Instant::now();
    r.push("q", r#"{"class":"Slow","args":[1,"b"]}"#);
    wait_until(LONG, "the wait timed out", || {
        stat(&mut r, "wait_timeout") == 1
    });
    assert!(t0.elapsed() >= Duration::from_millis(500));
    assert_eq!(stat(&mut r, "discarded"), 1);
    assert_eq!(runs(&log).len(), 1, "the waiting job never ran");
    // The worker logs the timeout once the script has answered, so the line may trail the
    // counter by a moment.
    let timed_out = |ds: &[Daemon]| {
        ds.iter()
            .flat_map(|d| d.log().lines().map(str::to_string).collect::<Vec<_>>())
            .find(|l| l.contains("lock wait timed out"))
    };
    wait_until(LONG, "an O-1 line for the wait timeout", || {
        timed_out(&ds).is_some()
    });
    let line = timed_out(&ds).expect("an O-1 line for the wait timeout");
    assert!(line.contains("INFO") && line.contains("discard"), "{line}");
    for d in &mut ds {
        d.kill();
    }
}

// ---------------------------------------------------------------------------------------------
// Story 3: don't run B until A has finished
// ---------------------------------------------------------------------------------------------

/// Story 3, D-3, D-5, D-6, D-7, D-8, D-10, P-4, O-2 (`locketd enqueue`): three A jobs enqueued
/// with `locketd enqueue` place three counted holds; B (`locked_by`) is delayed with backoff
/// until all three succeeded. The first A fails: its hold stays, B keeps waiting, until the
/// failed A is retried and succeeds.
#[test]
fn story_b_waits_until_every_a_succeeded() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let marker = work.path().join("failed-once");
    let a = handler(
        work.path(),
        "a.sh",
        &log,
        &format!(
            "if [ ! -e {m} ]; then touch {m}; echo boom >&2; false; else sleep 0.1; fi",
            m = marker.display()
        ),
    );
    let b = handler(work.path(), "b.sh", &log, "true");
    let config = cfg("b,a")
        .class(
            "Webhook::Receive",
            &a,
            "holds = [ { name = \"order:{args[0]}\", when = \"enqueue\", release_on = \"success\" } ]",
        )
        .class(
            "Order::Fulfil",
            &b,
            "locked_by = [ \"order:{args[0]}\" ]\non_dependency_conflict = \"delay\"\n\
             delay_base = \"100ms\"\ndelay_max = \"300ms\"",
        )
        .render();
    let dir = workdir();
    let cfg_path = dir.path().join("locketd.toml");
    std::fs::write(&cfg_path, &config).unwrap();
    for _ in 0..3 {
        let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
            .arg("--config")
            .arg(&cfg_path)
            .arg("--redis")
            .arg(redis.url())
            .args(["enqueue", "a", "Webhook::Receive", "7"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    let held: HashMap<String, String> = r.cmd(&["HGETALL", &format!("{NS}:locket:dep:order:7")]);
    assert_eq!(held.len(), 1);
    assert!(held.values().next().unwrap().starts_with("3:"), "{held:?}");
    r.push("b", r#"{"class":"Order::Fulfil","args":[7]}"#);

    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "the three A runs", || {
        runs(&log).iter().filter(|r| r.end.is_some()).count() == 3
    });
    // One A failed: its hold is kept, so B is still delayed after several promotions.
    let dep = format!("{NS}:locket:dep:order:7");
    wait_until(LONG, "the failed A recorded and B delayed twice", || {
        let held: HashMap<String, String> = r.cmd(&["HGETALL", &dep]);
        r.failures().len() == 1
            && held.values().next().is_some_and(|v| v.starts_with("1:"))
            && stat(&mut r, "delayed") >= 2
    });
    assert!(runs(&log).iter().all(|r| r.args == "[7]"));
    assert_eq!(r.failures().len(), 1);
    let b_runs = |log: &Path| {
        read_lossy(log)
            .lines()
            .filter(|l| l.starts_with("start"))
            .count()
    };
    assert_eq!(b_runs(&log), 3, "B did not run while a hold was left");
    let held: HashMap<String, String> = r.cmd(&["HGETALL", &dep]);
    assert!(held.values().next().unwrap().starts_with("1:"), "{held:?}");

    // Retry the failed A as resque-web does: its payload back on its queue.
    let failed = r.failures();
    r.push("a", &failed[0]["payload"].to_string());
    wait_until(LONG, "B ran", || b_runs(&log) == 5);
    let all = runs(&log);
    let last_a_end = all[..4].iter().filter_map(|r| r.end).max().unwrap();
    assert!(
        all[4].start >= last_a_end,
        "B started before the last A ended"
    );
    assert!(
        !r.exists(&format!("{NS}:locket:dep:order:7")),
        "no hold left"
    );
    wait_until(LONG, "B finished", || r.processed() == 5);
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// Story 4: reschedule myself
// ---------------------------------------------------------------------------------------------

/// Story 4, A-13: a handler exiting 75 (EX_TEMPFAIL) is pushed back to the tail in the FINISH
/// that releases its lock, so the next run of the same key starts without overlap; no failure
/// is recorded. Each run gets a fresh token (L-3).
#[test]
fn story_exit_75_reschedules_the_job_after_its_lock_is_released() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let count = work.path().join("count");
    let h = handler(
        work.path(),
        "feed.sh",
        &log,
        &format!(
            "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; sleep 0.2; \
             if [ $n -lt 3 ]; then sh -c 'exit 75'; fi",
            c = count.display()
        ),
    );
    let config = cfg("q")
        .class("Feed::Sync", &h, "lock = \"feed:{args[0]}\"")
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 2);
    r.push("q", r#"{"class":"Feed::Sync","args":[5]}"#);
    wait_until(LONG, "three runs", || ended(&log) == 3);
    let all = runs(&log);
    assert_eq!(all.len(), 3);
    let refs: Vec<&Run> = all.iter().collect();
    assert_eq!(max_overlap(&refs, now_ns()), 1);
    let tokens: BTreeSet<&str> = all.iter().map(|r| r.token.as_str()).collect();
    assert_eq!(tokens.len(), 3, "a fresh token per run");
    assert!(all.iter().all(|r| r.keys == r#"["feed:5"]"#));
    wait_until(LONG, "the last run recorded", || r.processed() == 1);
    assert!(r.failures().is_empty());
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    let logs: String = ds.iter().map(|d| d.log()).collect();
    assert_eq!(
        logs.matches("outcome=\"rescheduled\"").count()
            + logs.matches("outcome=rescheduled").count(),
        2,
        "{logs}"
    );
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

// ---------------------------------------------------------------------------------------------
// Templates as users see them
// ---------------------------------------------------------------------------------------------

/// T-2, T-3: ids beyond 2^53 give distinct keys (both jobs run at once under `discard`), while
/// Ruby's `1.0` and JavaScript's `1` give the same key (one is discarded).
#[test]
fn big_integer_ids_give_distinct_keys_and_1_0_equals_1() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "u.sh", &log, "sleep 2");
    let config = cfg("q")
        .class(
            "User::Sync",
            &h,
            "lock = \"user:{args[0]}\"\non_conflict = \"discard\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 2);
    r.push("q", r#"{"class":"User::Sync","args":[9007199254740993]}"#);
    r.push("q", r#"{"class":"User::Sync","args":[9007199254740992]}"#);
    wait_until(LONG, "both ran", || ended(&log) == 2);
    let keys: BTreeSet<String> = runs(&log).into_iter().map(|r| r.keys).collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            r#"["user:9007199254740993"]"#.to_string(),
            r#"["user:9007199254740992"]"#.to_string()
        ])
    );
    assert_eq!(stat(&mut r, "discarded"), 0);
    r.push("q", r#"{"class":"User::Sync","args":[1.0,"ruby"]}"#);
    r.push("q", r#"{"class":"User::Sync","args":[1,"js"]}"#);
    wait_until(LONG, "one ran, one discarded", || {
        ended(&log) == 3 && stat(&mut r, "discarded") == 1
    });
    assert_eq!(runs(&log)[2].keys, r#"["user:1"]"#);
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

/// T-6, E-2: a payload missing the template's path is failed with Locket::BadLockKey naming
/// the template and the path; it never runs unlocked; other jobs of the class run.
#[test]
fn a_missing_template_path_fails_the_job_with_bad_lock_key() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "t.sh", &log, "true");
    let config = cfg("q")
        .class("Acct::Sync", &h, "lock = \"acct:{args[0].id}\"")
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 1);
    r.push("q", r#"{"class":"Acct::Sync","args":["no-object"]}"#);
    r.push("q", r#"{"class":"Acct::Sync","args":[{"id":5}]}"#);
    wait_until(LONG, "one failure and one run", || {
        r.failures().len() == 1 && ended(&log) == 1
    });
    let f = &r.failures()[0];
    assert_eq!(f["exception"], "Locket::BadLockKey");
    let msg = f["error"].as_str().unwrap();
    assert!(
        msg.contains("acct:{args[0].id}") && msg.contains("args[0].id"),
        "{msg}"
    );
    assert_eq!(f["payload"]["args"][0], "no-object");
    assert_eq!(runs(&log)[0].keys, r#"["acct:5"]"#);
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
}

// ---------------------------------------------------------------------------------------------
// NEVER-1 under several processes
// ---------------------------------------------------------------------------------------------

/// NEVER-1, NEVER-2, L-1, L-2, R-4: three daemon processes, jobs over three keys with limit
/// `limit`, random handler durations, one daemon SIGKILLed mid-run and replaced. Sampled holder
/// counts never exceed the limit, runs of one key never overlap beyond it, and every job either
/// ended once or was failed once (the killed daemon's running job, Resque::DirtyExit).
fn limit_holds_under_several_processes_and_kills(limit: usize) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    // Random 0..250 ms from the nanoseconds of the clock.
    let h = handler(
        work.path(),
        "rand.sh",
        &log,
        "r=$(od -An -N1 -tu1 /dev/urandom | tr -d ' '); sleep 0.$(printf %02d $((r % 25)))",
    );
    let config = cfg("q")
        .class(
            "Hammer",
            &h,
            &format!("lock = \"k:{{args[0]}}\"\nlimit = {limit}"),
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 3);
    let total = 60;
    for i in 0..total {
        r.push(
            "q",
            &format!(r#"{{"class":"Hammer","args":[{},{i}]}}"#, i % 3),
        );
    }
    let mut max_seen = 0usize;
    let mut kill_at = None;
    let mut probe = redis.sync_conn();
    let mut sample = |_: &mut R| {
        for k in 0..3 {
            let live: usize = redis::Script::new(
                "if redis.call('TYPE', KEYS[1])['ok'] == 'string' then return 1 end
                 local t = redis.call('TIME')
                 local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
                 return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')",
            )
            .key(format!("{NS}:locket:lock:k:{k}"))
            .invoke(&mut probe)
            .unwrap();
            max_seen = max_seen.max(live);
        }
    };
    wait_until(LONG, "a third of the jobs ended", || {
        sample(&mut r);
        ended(&log) >= total / 3
    });
    // SIGKILL one daemon (and its handler) mid-run, start a replacement.
    let pid = format!(":{}:", ds[0].worker_pid());
    wait_until(LONG, "a job running on the first daemon", || {
        sample(&mut r);
        let id = r
            .workers()
            .into_iter()
            .find(|w| w.contains(&pid))
            .unwrap_or_default();
        r.exists(&format!("{NS}:worker:{id}"))
    });
    ds[0].kill();
    kill_at = kill_at.or(Some(now_ns()));
    ds.push(Daemon::start(&redis, &config, &[]));
    wait_until(Duration::from_secs(60), "every job accounted for", || {
        sample(&mut r);
        let ends: usize = ends_by_job(&log, &r.failures(), &pid).values().sum();
        ends >= total && r.llen(&format!("{NS}:queue:q")) == 0
    });
    let all = runs(&log);
    let killed_at = kill_at.unwrap();
    let mut by_key: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for run in &all {
        by_key.entry(run.keys.clone()).or_default().push(run);
    }
    for (key, rs) in &by_key {
        // The only run without an end is the one killed with its daemon.
        let over = max_overlap(rs, killed_at);
        assert!(
            over <= limit,
            "{key}: {over} runs at once with limit {limit}"
        );
    }
    assert!(
        max_seen <= limit,
        "sampled {max_seen} live holders with limit {limit}"
    );
    // NEVER-2: each job ended once, or failed once (DirtyExit of the killed run).
    let fails: Vec<Value> = r.failures();
    for f in &fails {
        assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
    }
    let done = ends_by_job(&log, &fails, &pid);
    assert_eq!(done.len(), total, "every job accounted for");
    assert!(done.values().all(|n| *n == 1), "{done:?}");
    for d in &mut ds {
        d.kill();
    }
}

#[test]
fn never1_limit_one_holds_under_three_daemons_and_a_sigkill() {
    limit_holds_under_several_processes_and_kills(1);
}

#[test]
fn never1_limit_three_holds_under_three_daemons_and_a_sigkill() {
    limit_holds_under_several_processes_and_kills(3);
}

/// P-3, R-8, R-4, NEVER-2: a slot waiting for a lock keeps its job in its inflight record
/// (state "waiting"); on shutdown the job goes back to the head of its queue, and when the
/// waiting daemon is SIGKILLed instead, the janitor puts it back at the head.
#[test]
fn a_waiting_job_returns_to_the_head_on_shutdown_and_on_a_crash() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "hold.sh", &log, "sleep 30");
    let config = cfg("q")
        .class(
            "W",
            &h,
            "lock = \"w:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"60s\"",
        )
        .render();
    let mut holder = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "registered", || r.workers().len() == 1);
    r.push("q", r#"{"class":"W","args":[1,"holder"]}"#);
    wait_until(LONG, "the holder runs", || runs(&log).len() == 1);
    let q = format!("{NS}:queue:q");
    for crash in [false, true] {
        let mut waiter = Daemon::start(&redis, &config, &[]);
        wait_until(LONG, "registered", || r.workers().len() == 2);
        r.push("q", r#"{"class":"W","args":[1,"waiter"]}"#);
        r.push("q", r#"{"class":"Other","args":[]}"#);
        wait_until(LONG, "the waiter waits", || {
            r.keys(&format!("{NS}:locket:inflight:*")).iter().any(|k| {
                let s: Option<String> = r.cmd(&["HGET", k, "state"]);
                s.as_deref() == Some("waiting")
            })
        });
        assert_eq!(r.llen(&q), 1, "the waiting job left the queue");
        if crash {
            waiter.kill();
        } else {
            waiter.signal(libc::SIGQUIT);
            assert_eq!(waiter.wait_exit(LONG).and_then(|s| s.code()), Some(0));
        }
        wait_until(LONG, "the waiting job is back at the head", || {
            let head: Vec<String> = r.cmd(&["LRANGE", &q, "0", "0"]);
            r.llen(&q) == 2 && head[0] == r#"{"class":"W","args":[1,"waiter"]}"#
        });
        let other: String = r.cmd(&["RPOP", &q]);
        assert_eq!(other, r#"{"class":"Other","args":[]}"#);
        let _: String = r.cmd(&["LPOP", &q]);
        wait_until(LONG, "the waiter is gone", || r.workers().len() == 1);
    }
    assert_eq!(runs(&log).len(), 1, "the waiting job never ran");
    assert!(r.failures().is_empty());
    holder.kill();
}

/// NEVER-2, NEVER-3, P-1..P-4, PK-6, R-4: jobs of five classes sharing one lock key with
/// different policies (park, requeue, discard, delay, wait then delay), three daemons, one SIGKILLed mid-run and
/// replaced. At quiescence every job ran exactly once, was discarded (counted), or was failed
/// once; nothing is left queued, delayed or in flight.
#[test]
fn never2_mixed_policies_and_a_sigkill_lose_and_duplicate_nothing() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(
        work.path(),
        "mix.sh",
        &log,
        "r=$(od -An -N1 -tu1 /dev/urandom | tr -d ' '); sleep 0.$(printf %02d $((r % 15)))",
    );
    // Debug lines name every requeue and wait: evidence that survives the SIGKILL below,
    // which may take the killed process's last second of O-3 counts with it.
    let config = cfg("q")
        .top("log_level = \"debug\"")
        .locket("delay_base", "\"50ms\"")
        .locket("delay_max", "\"200ms\"")
        .class("Req", &h, "lock = \"k:{args[0]}\"\non_conflict = \"requeue\"")
        .class("Par", &h, "lock = \"k:{args[0]}\"")
        .class("Dis", &h, "lock = \"k:{args[0]}\"\non_conflict = \"discard\"")
        .class("Del", &h, "lock = \"k:{args[0]}\"\non_conflict = \"delay\"")
        .class(
            "Wai",
            &h,
            "lock = \"k:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"300ms\"\nwait_then = \"delay\"",
        )
        .render();
    let mut ds = start_daemons(&redis, &mut r, &config, 3);
    let classes = ["Req", "Par", "Dis", "Del", "Wai"];
    let total = 50;
    for i in 0..total {
        let class = classes[i % 5];
        r.push(
            "q",
            &format!(r#"{{"class":"{class}","args":[{},{i}]}}"#, i % 2),
        );
    }
    wait_until(LONG, "some jobs ended", || ended(&log) >= 8);
    let killed_worker = format!(":{}:", ds[0].worker_pid());
    ds[0].kill();
    ds.push(Daemon::start(&redis, &config, &[]));
    let tally = |r: &mut R| ends_by_job(&log, &r.failures(), &killed_worker);
    // Discards are counted from the daemons' logs, the killed one's included: the O-3 counts
    // of a SIGKILLed process may miss its last second (locking-semantics.md O-3).
    let discards = |ds: &[Daemon]| {
        let mut digests = BTreeSet::new();
        for d in ds {
            for line in d.log().lines() {
                if let Some(p) = line
                    .contains("lock conflict: job discarded")
                    .then(|| line.find("digest="))
                    .flatten()
                {
                    digests.insert(line[p..].split(' ').next().unwrap_or("").to_string());
                }
            }
        }
        digests.len()
    };
    // Quiescence is judged by Redis, where every job that is not over must be: queued,
    // delayed, parked or in a slot's inflight record. Once none is anywhere for two seconds
    // running, the survivors have nothing left to do. (Waiting for the tally alone to reach
    // the total hangs when the SIGKILLed daemon's last discards die in its log queue.)
    let delayed = format!("{NS}:locket:delayed");
    let parked = format!("{NS}:locket:parked");
    let mut settled_since: Option<Instant> = None;
    let mut last;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let d: i64 = r.cmd(&["ZCARD", &delayed]);
        let p: i64 = r.cmd(&["ZCARD", &parked]);
        let queued = r.llen(&format!("{NS}:queue:q"));
        let busy = r
            .keys(&format!("{NS}:locket:inflight:*"))
            .iter()
            .filter(|k| {
                let s: Option<String> = r.cmd(&["HGET", k, "state"]);
                s.is_some()
            })
            .count();
        let done = tally(&mut r).values().sum::<usize>() + discards(&ds);
        last = format!(
            "done {done}/{total}, queued {queued}, delayed {d}, parked {p}, in slots {busy}"
        );
        let empty = d == 0 && p == 0 && queued == 0 && busy == 0;
        if empty && done >= total {
            break;
        }
        let since = *settled_since.get_or_insert_with(Instant::now);
        if !empty {
            settled_since = None;
        } else if since.elapsed() >= Duration::from_secs(2) {
            break;
        }
        assert!(Instant::now() < deadline, "no quiescence in 90 s: {last}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let seen = tally(&mut r);
    assert!(
        seen.values().all(|n| *n == 1),
        "a job ran or failed twice: {seen:?}"
    );
    // The test only means something if the policies were exercised: counted (the survivors'
    // counts are written within a second), or logged by any daemon, the killed one included.
    let logged = |ds: &[Daemon], needle: &str| ds.iter().any(|d| d.log().contains(needle));
    for (ev, needle) in [
        ("requeued", "action=Requeued"),
        ("parked", "lock conflict: job parked"),
        ("discarded", "lock conflict: job discarded"),
        ("delayed", "lock conflict: job delayed"),
        ("promoted", ""),
        ("waited", "action=None"),
    ] {
        wait_until(SHORT_WAIT, &format!("a {ev} event"), || {
            stat(&mut r, ev) > 0 || (!needle.is_empty() && logged(&ds, needle))
        });
    }
    // Every job ran or failed once, or was discarded (logged). The one exception allowed:
    // a discard by the SIGKILLed daemon whose log line was still in its queue (logsink.rs)
    // leaves no trace at all; such a job must be of the discarding class, and there can be
    // only the few its one worker discarded in its last instant.
    let discarded = discards(&ds);
    let missing: Vec<usize> = (0..total)
        .filter(|i| !seen.contains_key(&format!("[{},{i}]", i % 2)))
        .collect();
    assert!(
        missing.iter().all(|i| classes[i % 5] == "Dis"),
        "jobs lost: {missing:?} (state: {last}; seen {seen:?})"
    );
    assert!(
        missing.len() >= discarded && missing.len() - discarded <= 2,
        "{} jobs neither ran, failed nor were discarded: {missing:?}, {discarded} discards logged (state: {last})",
        missing.len().saturating_sub(discarded)
    );
    assert!(
        r.keys(&format!("{NS}:locket:inflight:*")).len() <= 3,
        "only idle slots' records"
    );
    for k in r.keys(&format!("{NS}:locket:inflight:*")) {
        let state: Option<String> = r.cmd(&["HGET", &k, "state"]);
        assert_eq!(state, None, "{k} still holds a job");
    }
    for d in &mut ds {
        d.kill();
    }
}

/// P-3 with USR2 (issue 11, finding 10): pausing a worker whose slot is waiting on a lock
/// only stops new reservations: the waiting job keeps waiting, runs when the lock is free,
/// and the worker neither ends its loop nor is restarted.
#[test]
fn a_pause_during_a_lock_wait_keeps_the_job_waiting() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let go = work.path().join("go");
    let h = handler(
        work.path(),
        "hold.sh",
        &log,
        &format!(
            "case \"$LOCKETD_ARGS\" in *'\"a\"'*) for i in $(seq 300); do [ -f {} ] && break; sleep 0.1; done;; esac",
            go.display()
        ),
    );
    let config = cfg("q")
        .class(
            "Ledger::Post",
            &h,
            "lock = \"acct:{args[0]}\"\non_conflict = \"wait\"\nwait_timeout = \"60s\"",
        )
        .render();
    let mut d1 = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "the first daemon registered", || {
        r.workers().len() == 1
    });
    r.push("q", r#"{"class":"Ledger::Post","args":[1,"a"]}"#);
    wait_until(LONG, "the holder started", || runs(&log).len() == 1);
    let mut d2 = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "the second daemon registered", || {
        r.workers().len() == 2
    });
    let waiter = d2.worker_pid();
    r.push("q", r#"{"class":"Ledger::Post","args":[1,"b"]}"#);
    wait_until(LONG, "the second job waits on the lock", || {
        stat(&mut r, "waited") >= 1
    });
    d2.signal(libc::SIGUSR2);
    d2.wait_for_log("forwarding to every worker", LONG);
    // Long enough for a wait that ended on the pause to have returned its job.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&go, "").unwrap();
    wait_until(LONG, "both jobs ran", || ended(&log) == 2);
    assert_eq!(
        d2.worker_pid(),
        waiter,
        "the paused worker's loop ended and it was restarted:\n{}",
        d2.log()
    );
    assert_eq!(stat(&mut r, "returned"), 0, "the waiting job was returned");
    assert_eq!(d1.terminate(LONG).code(), Some(0));
    assert_eq!(d2.terminate(LONG).code(), Some(0));
}
