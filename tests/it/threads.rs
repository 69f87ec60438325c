//! Threaded persistent handlers (H-18, issue 38) end to end: the real `locketd` binary, a
//! private redis-server, and `fixtures/threaded_handler.py`, a handler that runs each job in a
//! thread of its own and behaves as each job's class says.
//! Run: `cargo test --test it -- threads::`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, default_lock_id, workdir, NS, R};
use crate::support::{manifest_dir, pid_alive, read_lossy, wait_until, Daemon, RedisServer};

/// Long enough for a boot of python3 on a loaded 2-core machine, many times over.
const LONG: Duration = Duration::from_secs(30);

fn fixture() -> PathBuf {
    manifest_dir().join("tests/it/fixtures/threaded_handler.py")
}

struct Setup {
    redis: RedisServer,
    r: R,
    work: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let redis = RedisServer::start();
        let r = R::new(&redis);
        Setup {
            redis,
            r,
            work: workdir(),
        }
    }

    fn events_path(&self) -> PathBuf {
        self.work.path().join("events.jsonl")
    }

    /// A daemon with `slots` slots whose every class goes to the threaded fixture, with
    /// `extra` lines in `[handlers.t]`, `env` appended to its env table and `classes` as is.
    fn start(&self, slots: u32, extra: &str, env: &str, classes: &str) -> Daemon {
        let config = format!(
            "{}\n[handlers.t]\nmode = \"persistent\"\ncommand = [\"{}\"]\nboot_timeout = \"20s\"\n\
             env = {{ EVENTS = \"{}\"{env} }}\n{extra}\n\n[classes.\"*\"]\nhandler = \"t\"\n{classes}\n",
            cfg("q").top(&format!("slots = {slots}")).render(),
            fixture().display(),
            self.events_path().display(),
        );
        Daemon::start(&self.redis, &config, &[])
    }

    fn events(&self) -> Vec<Value> {
        read_lossy(&self.events_path())
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn of(&self, kind: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == kind)
            .collect()
    }

    fn push(&mut self, class: &str, args: Value) {
        let payload = json!({"class": class, "args": args}).to_string();
        self.r.push("q", &payload);
    }
}

fn pid_of(e: &Value) -> i32 {
    i32::try_from(e["pid"].as_i64().expect("pid")).expect("pid fits")
}

fn lock_key(class: &str, args: &str) -> String {
    format!("{NS}:locket:lock:{}", default_lock_id(class, args))
}

/// H-18: two jobs of one process hold two different locks at once and both finish; they ran
/// in one pid, on two threads, at the same time.
#[test]
fn h18_two_jobs_of_one_process_hold_two_locks_and_both_finish() {
    let mut s = Setup::new();
    let _d = s.start(2, "threads = 2", "", "");
    s.push("Sleep", json!([2]));
    s.push("Sleep", json!([2.5]));
    let (a, b) = (lock_key("Sleep", "[2]"), lock_key("Sleep", "[2.5]"));
    wait_until(LONG, "both locks held at once", || {
        s.r.exists(&a) && s.r.exists(&b)
    });
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    let jobs = s.of("job");
    assert_eq!(jobs.len(), 2);
    assert_eq!(pid_of(&jobs[0]), pid_of(&jobs[1]), "one process: {jobs:?}");
    let threads: BTreeSet<i64> = jobs.iter().filter_map(|j| j["thread"].as_i64()).collect();
    assert_eq!(threads, BTreeSet::from([0, 1]), "{jobs:?}");
    assert_eq!(s.of("boot").len(), 1);
    assert_eq!(s.of("boot")[0]["threads"], "2", "LOCKETD_THREADS");
    assert!(!s.r.exists(&a) && !s.r.exists(&b));
}

/// H-18: with threads = 25 and 25 slots, one handler process serves every slot.
#[test]
fn h18_one_process_serves_25_slots() {
    let mut s = Setup::new();
    let _d = s.start(25, "threads = 25\npreload = true", "", "");
    for i in 0..25 {
        s.push("Sleep", json!([1.5, i]));
    }
    wait_until(LONG, "25 jobs processed", || s.r.processed() == 25);
    assert!(s.r.failures().is_empty());
    let pids: BTreeSet<i32> = s.of("job").iter().map(pid_of).collect();
    assert_eq!(pids.len(), 1, "{pids:?}");
    assert_eq!(s.of("boot").len(), 1);
}

/// H-18: a timeout stops only its job when the job honours the soft stop: its sibling
/// finishes ok in the same process, which lives on; the stopped job is the timeout.
#[test]
fn h18_a_timeout_honoured_stops_only_that_job() {
    let mut s = Setup::new();
    let _d = s.start(
        2,
        "threads = 2",
        "",
        "[classes.\"Sleep_timed\"]\nhandler = \"t\"\ntimeout = \"1s\"\n",
    );
    s.push("Sleep", json!([4]));
    s.push("Sleep_timed", json!([30]));
    wait_until(LONG, "both jobs ended", || s.r.processed() == 2);
    let failures = s.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["payload"]["class"], "Sleep_timed");
    assert!(
        failures[0]["exception"]
            .as_str()
            .unwrap_or_default()
            .contains("Timeout"),
        "{failures:?}"
    );
    let ends = s.of("end");
    assert!(
        ends.iter()
            .any(|e| e["job_class"] == "Sleep" && e["stopped"] == false),
        "{ends:?}"
    );
    assert_eq!(s.of("boot").len(), 1, "no restart");
    let pid = pid_of(&s.of("boot")[0]);
    assert!(pid_alive(pid), "the process lives on");
    s.push("Sleep", json!([0.1]));
    wait_until(LONG, "a next job", || s.r.processed() == 3);
    assert_eq!(pid_of(s.of("job").last().unwrap()), pid);
}

/// H-18, L-9: a job that ignores its stop takes its process down at the kill point (before its
/// lease ends); its siblings go back to their queue and run again to their end, none recorded
/// as failed; the stopped job is the timeout, recorded after the process died.
#[test]
fn h18_a_job_ignoring_its_stop_takes_the_process_down_and_its_siblings_run_again() {
    let mut s = Setup::new();
    let d = s.start(
        3,
        "threads = 3",
        "",
        "[classes.\"Stubborn_timed\"]\nhandler = \"t\"\ntimeout = \"1s\"\n",
    );
    s.push("Sleep", json!([3, "a"]));
    s.push("Sleep", json!([3, "b"]));
    s.push("Stubborn_timed", json!([60]));
    wait_until(LONG, "three jobs ended", || s.r.processed() == 3);
    let failures = s.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}\n{}", d.log());
    assert_eq!(failures[0]["payload"]["class"], "Stubborn_timed");
    assert!(failures[0]["exception"]
        .as_str()
        .unwrap_or_default()
        .contains("Timeout"));
    let boots = s.of("boot");
    assert!(boots.len() >= 2, "{boots:?}");
    let first = pid_of(&boots[0]);
    assert!(!pid_alive(first), "the first process was killed");
    // Each sibling ran twice: killed in the first process, then to its end in another.
    for tag in ["a", "b"] {
        let runs: Vec<Value> = s
            .of("job")
            .into_iter()
            .filter(|j| j["job_class"] == "Sleep" && j["args"][1] == tag)
            .collect();
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert_eq!(pid_of(&runs[0]), first);
        assert_ne!(pid_of(&runs[1]), first);
    }
    assert!(d.log().contains("goes back to the head of its queue"));
    // H-14: the killed job's failure hooks ran in another process, with its exception.
    wait_until(LONG, "the failure hooks ran", || {
        !s.of("failure_hooks").is_empty()
    });
    let hooks = s.of("failure_hooks");
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    assert_eq!(hooks[0]["exception"], "Locket::Timeout");
    assert!(hooks[0]["payload"]
        .as_str()
        .unwrap()
        .contains("Stubborn_timed"));
    assert_ne!(pid_of(&hooks[0]), first);
}

/// H-13, H-18: a recycle (max_jobs) while jobs run stops none of them: the process takes no
/// new job, its running jobs end, then it retires and the next jobs run in its successor.
#[test]
fn h18_a_recycle_during_running_jobs_interrupts_none() {
    let mut s = Setup::new();
    let _d = s.start(4, "threads = 4\nmax_jobs = 2", "", "");
    s.push("Sleep", json!([0.5, 1]));
    s.push("Sleep", json!([0.7, 2]));
    s.push("Sleep", json!([2.5, 3]));
    s.push("Sleep", json!([3, 4]));
    wait_until(LONG, "four jobs processed", || s.r.processed() == 4);
    let jobs = s.of("job");
    assert_eq!(jobs.len(), 4, "each ran once: {jobs:?}");
    let first = pid_of(&jobs[0]);
    assert!(jobs.iter().all(|j| pid_of(j) == first), "{jobs:?}");
    assert!(s.of("end").iter().all(|e| e["stopped"] == false));
    assert!(s.r.failures().is_empty());
    wait_until(LONG, "the first process retired", || !pid_alive(first));
    assert!(!s.of("eof").is_empty(), "retired with EOF on fd 3");
    s.push("Sleep", json!([0.1, 5]));
    wait_until(LONG, "a fifth job", || s.r.processed() == 5);
    assert_ne!(pid_of(s.of("job").last().unwrap()), first);
}

/// H-18: an adapter whose `ready` does not say "threads" gets one job per process, whatever
/// `threads` says; the log says why.
#[test]
fn h18_an_adapter_without_the_threads_feature_gets_one_job_per_process() {
    let mut s = Setup::new();
    let d = s.start(2, "threads = 4", ", NO_THREADS = \"1\"", "");
    s.push("Sleep", json!([2, 1]));
    s.push("Sleep", json!([2, 2]));
    let (a, b) = (lock_key("Sleep", "[2,1]"), lock_key("Sleep", "[2,2]"));
    wait_until(LONG, "both locks held at once", || {
        s.r.exists(&a) && s.r.exists(&b)
    });
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    let pids: BTreeSet<i32> = s.of("job").iter().map(pid_of).collect();
    assert_eq!(pids.len(), 2, "one job per process: {pids:?}");
    d.wait_for_log("adapter did not say \"threads\" in ready", LONG);
}

/// H-18, H-9: a job's own process group (its `group` frame) is dead after its `done`, and
/// after its process is killed at a stop's kill point.
#[test]
fn h18_a_jobs_group_is_dead_after_its_done_and_after_a_process_kill() {
    let mut s = Setup::new();
    let _d = s.start(
        2,
        "threads = 2",
        "",
        "[classes.\"GroupStubborn_timed\"]\nhandler = \"t\"\ntimeout = \"1s\"\n",
    );
    s.push("Group", json!([60, 0.2]));
    wait_until(LONG, "the job processed", || s.r.processed() == 1);
    let child = s.of("group")[0]["child"].as_i64().unwrap() as i32;
    wait_until(
        Duration::from_secs(5),
        "its group is dead after its done",
        || !pid_alive(child),
    );
    s.push("GroupStubborn_timed", json!([60, 60]));
    wait_until(LONG, "the stubborn job recorded", || s.r.processed() == 2);
    let groups = s.of("group");
    let child = groups[1]["child"].as_i64().unwrap() as i32;
    assert!(!pid_alive(child), "dead when the timeout was recorded");
    assert_eq!(s.r.failures().len(), 1);
}

/// H-18: `status` shows, for each slot of a threaded handler, its job's process (one pid for
/// both slots), its threads busy and total, and the slot's thread.
#[test]
fn h18_status_shows_each_slots_process_and_thread() {
    let mut s = Setup::new();
    let _d = s.start(2, "threads = 2\npreload = true", "", "");
    s.push("Sleep", json!([4, 1]));
    s.push("Sleep", json!([4, 2]));
    let mut slots: Vec<Value> = Vec::new();
    wait_until(LONG, "status shows both slots busy in one process", || {
        let out = crate::ops::locketd(&s.redis, &["--queues", "q", "status", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        slots = v["workers"]
            .as_array()
            .map(|w| {
                w.iter()
                    .flat_map(|w| w["handlers"].as_array().cloned().unwrap_or_default())
                    .collect()
            })
            .unwrap_or_default();
        slots.len() == 2 && slots.iter().all(|h| h["threads_busy"] == 2)
    });
    assert_eq!(slots[0]["pid"], slots[1]["pid"], "{slots:?}");
    let threads: BTreeSet<i64> = slots.iter().filter_map(|h| h["thread"].as_i64()).collect();
    assert_eq!(threads, BTreeSet::from([0, 1]), "{slots:?}");
    assert!(slots
        .iter()
        .all(|h| h["threads"] == 2 && h["retiring"] == false));
}

/// H-12, H-18: QUIT while one slot is idle and another's job runs in the shared process: the
/// idle slot's stop does not end the process; the job finishes, then the process gets EOF.
#[test]
fn h18_quit_waits_for_a_job_of_a_shared_process() {
    let mut s = Setup::new();
    let mut d = s.start(2, "threads = 2", "", "");
    s.push("Sleep", json!([2]));
    wait_until(LONG, "the job runs", || s.of("job").len() == 1);
    d.signal(libc::SIGQUIT);
    d.wait_exit(LONG).expect("the daemon exits");
    assert_eq!(s.r.processed(), 1);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    assert_eq!(s.of("end").len(), 1);
    assert!(!s.of("eof").is_empty(), "the process got EOF on fd 3");
}

/// H-10, H-18: a process that dies on its own (not killed by locketd) fails each job it was
/// running with the death failure; none goes back to its queue as a sibling.
#[test]
fn h18_a_crash_fails_every_running_job() {
    let mut s = Setup::new();
    let _d = s.start(3, "threads = 3", "", "");
    s.push("Sleep", json!([30, "a"]));
    s.push("Sleep", json!([30, "b"]));
    wait_until(LONG, "both run", || s.of("job").len() == 2);
    s.push("Exit", json!([3]));
    wait_until(LONG, "three failures", || s.r.failures().len() == 3);
    let failures = s.r.failures();
    assert!(
        failures
            .iter()
            .all(|f| f["exception"] == "Locket::CommandFailed"),
        "{failures:?}"
    );
    assert_eq!(s.of("job").len(), 3, "none ran again");
}
