//! Persistent handlers (persistent-handlers.md, issue 13) end to end: the real `locketd`
//! binary, a private redis-server, and `fixtures/protocol_handler.py`, a handler that speaks
//! the protocol on fds 3 and 4 and misbehaves on purpose as each job's class says. Every test
//! names the H-rule or the §7 failure case it checks.
//! Run: `cargo test --test it -- persistent::`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::daemon::{cfg, default_lock_id, wait_registered, workdir, NS, R, SHORT};
use crate::support::{
    manifest_dir, pid_alive, process_group_members, wait_until, Daemon, RedisServer,
};

/// Long enough for a boot of python3 on a loaded 2-core machine, many times over.
const LONG: Duration = Duration::from_secs(30);

fn fixture() -> PathBuf {
    manifest_dir().join("tests/it/fixtures/protocol_handler.py")
}

/// A daemon whose every class goes to the protocol fixture, with `extra` lines in the
/// `[handlers.t]` table and `classes` appended as they are.
struct Setup {
    redis: RedisServer,
    r: R,
    _work: tempfile::TempDir,
    events: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let redis = RedisServer::start();
        let r = R::new(&redis);
        let work = workdir();
        let events = work.path().join("events.jsonl");
        Setup {
            redis,
            r,
            _work: work,
            events,
        }
    }

    fn config(&self, handler_extra: &str, env: &str, classes: &str) -> String {
        let boot = if handler_extra.contains("boot_timeout") {
            ""
        } else {
            "boot_timeout = \"20s\"\n"
        };
        format!(
            "{}\n[handlers.t]\nmode = \"persistent\"\ncommand = [\"{}\"]\n{boot}\
             env = {{ EVENTS = \"{}\"{env} }}\n{handler_extra}\n\n[classes.\"*\"]\nhandler = \"t\"\n{classes}\n",
            cfg("q").render(),
            fixture().display(),
            self.events.display(),
        )
    }

    fn start(&self, handler_extra: &str, env: &str, classes: &str) -> Daemon {
        let config = self.config(handler_extra, env, classes);
        Daemon::start(&self.redis, &config, &[])
    }

    /// The events the fixture wrote, parsed.
    fn events(&self) -> Vec<Value> {
        read_events(&self.events)
    }

    /// The events of one kind (`boot`, `job`, `failure_hooks`, `eof`, ...).
    fn of(&self, kind: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == kind)
            .collect()
    }

    fn jobs_of(&self, class: &str) -> Vec<Value> {
        self.of("job")
            .into_iter()
            .filter(|e| e["job_class"] == class)
            .collect()
    }

    fn push(&mut self, class: &str, args: Value) {
        let payload = json!({"class": class, "args": args}).to_string();
        self.r.push("q", &payload);
    }
}

fn read_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn pid_of(e: &Value) -> i32 {
    i32::try_from(e["pid"].as_i64().expect("pid")).expect("pid fits")
}

/// H-1, H-7, H-9: jobs run one after another in one process that loaded once; success,
/// failure (Resque's exact record, the handler's backtrace) and a skipped job are recorded as
/// Resque records them; the handler's stdout is logged under the job's class.
#[test]
fn h9_jobs_run_in_one_preloaded_process_and_outcomes_are_recorded_as_resque_does() {
    let mut s = Setup::new();
    let d = s.start("", "", "");
    let worker = wait_registered(&mut s.r, &d);
    for i in 0..5 {
        s.push("Ok", json!([i]));
    }
    s.push("Fail", json!(["x"]));
    wait_until(LONG, "six jobs processed", || s.r.processed() == 6);
    assert_eq!(s.of("boot").len(), 1, "one boot for every job");
    let pids: Vec<i32> = s.of("job").iter().map(pid_of).collect();
    assert_eq!(pids.len(), 6);
    assert!(pids.iter().all(|p| *p == pids[0]), "{pids:?}");
    assert_eq!(s.r.failed_stat(), 1);
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "RuntimeError");
    assert_eq!(f["error"], "it broke");
    assert_eq!(
        f["backtrace"],
        json!(["job.py:1:in `perform'", "adapter:2"])
    );
    assert_eq!(f["payload"], json!({"class": "Fail", "args": ["x"]}));
    assert_eq!(f["worker"], worker.as_str());
    assert_eq!(f["queue"], "q");
    d.wait_for_log("running Ok class=Ok queue=q handler=t", SHORT);
}

/// H-8, §7 "boot crash", "a crash loop consumes no jobs": a handler that exits before
/// `ready` is started again with a backoff doubling from 1 s; its jobs wait in their queue,
/// nothing is failed or counted, and the log says why with the handler's stderr.
#[test]
fn h8_a_boot_crash_loop_backs_off_and_consumes_no_jobs() {
    let mut s = Setup::new();
    let d = s.start("", ", BOOT = \"crash\"", "");
    for i in 0..3 {
        s.push("Ok", json!([i]));
    }
    wait_until(LONG, "three boots", || s.of("boot").len() >= 3);
    d.wait_for_log("handler failed to start", SHORT);
    d.wait_for_log("cannot load the app", SHORT);
    // Backoff: 1 s after the first failure, 2 s after the second, 4 s after the third.
    let boots = s.of("boot");
    assert_eq!(
        boots.len(),
        3,
        "no fourth boot within the backoff: {boots:?}"
    );
    // Between boots the jobs wait in their queue (during one, one of them is reserved).
    wait_until(SHORT, "the jobs wait in their queue", || {
        s.r.llen(&format!("{NS}:queue:q")) == 3
    });
    assert!(s.r.failures().is_empty());
    assert_eq!(s.r.processed(), 0);
    assert!(s.of("job").is_empty());
}

/// H-8, §7 "boot hang": a handler that never says `ready` is killed after `boot_timeout`
/// (its whole group) and started again later; its jobs stay in the queue.
#[test]
fn h8_a_boot_hang_is_killed_at_boot_timeout() {
    let mut s = Setup::new();
    let d = s.start("boot_timeout = \"500ms\"", ", BOOT = \"hang\"", "");
    s.push("Ok", json!([1]));
    wait_until(LONG, "two boots", || s.of("boot").len() >= 2);
    let first = pid_of(&s.of("boot")[0]);
    wait_until(SHORT, "the hung handler is gone", || !pid_alive(first));
    d.wait_for_log("no ready within boot_timeout", SHORT);
    // Between boots the job waits in its queue (during one, it is reserved).
    wait_until(SHORT, "the job is back in its queue", || {
        s.r.llen(&format!("{NS}:queue:q")) == 1
    });
    assert!(s.r.failures().is_empty());
    assert_eq!(s.r.processed(), 0);
}

/// H-5, H-8: garbage instead of `ready` is a failed start, not a crash of the daemon.
#[test]
fn h8_garbage_instead_of_ready_is_a_failed_start() {
    let mut s = Setup::new();
    let d = s.start("", ", BOOT = \"garbage\"", "");
    s.push("Ok", json!([1]));
    d.wait_for_log("protocol error before ready", LONG);
    d.wait_for_log("this is not json", SHORT);
    // The log line comes before the job's return, and the next boot reserves it again: it is
    // waited for in its queue, not read at once.
    wait_until(SHORT, "the job is back in its queue", || {
        s.r.llen(&format!("{NS}:queue:q")) == 1
    });
    assert!(s.r.failures().is_empty());
}

/// H-8 "other classes keep running": jobs of a class whose handler cannot start are
/// deferred to their queue's tail (the queue's counter rises, as for a lock conflict), and
/// the jobs of other classes, in the same queue and in the queue below, still run.
#[test]
fn h8_other_classes_keep_running_while_one_handler_cannot_start() {
    let mut s = Setup::new();
    let config = format!(
        "{}\n[handlers.t]\nmode = \"persistent\"\ncommand = [\"{fx}\"]\nenv = {{ EVENTS = \"{ev}\" }}\n\
         [handlers.bad]\nmode = \"persistent\"\ncommand = [\"{fx}\"]\nenv = {{ BOOT = \"crash\" }}\n\
         [classes.\"*\"]\nhandler = \"t\"\n[classes.\"Bad\"]\nhandler = \"bad\"\n",
        cfg("q,low").render(),
        fx = fixture().display(),
        ev = s.events.display(),
    );
    let d = Daemon::start(&s.redis, &config, &[]);
    for i in 0..3 {
        s.push("Bad", json!([i]));
    }
    s.push("Ok", json!(["same queue"]));
    s.r.push("low", r#"{"class":"Ok","args":["low queue"]}"#);
    wait_until(LONG, "both good jobs ran", || s.jobs_of("Ok").len() == 2);
    // The handler writes its event while the job runs; the worker counts it after `done`.
    wait_until(SHORT, "both good jobs finished", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    wait_until(SHORT, "the bad jobs are back in their queue", || {
        s.r.llen(&format!("{NS}:queue:q")) == 3
    });
    d.wait_for_log("handler failed to start", SHORT);
}

/// H-5, §7 "garbage, oversized or wrong-id frames": each is a protocol error: the group is
/// killed, the job recorded as `Locket::ProtocolError` quoting the frame's first bytes, and a
/// new handler serves the next job. The daemon keeps running.
#[test]
fn h5_garbage_wrong_id_and_oversized_frames_are_protocol_errors() {
    let mut s = Setup::new();
    let _d = s.start("max_frame_bytes = \"1MiB\"", "", "");
    s.push("Garbage", json!([]));
    s.push("WrongId", json!([]));
    s.push("Oversize", json!([2_000_000]));
    s.push("Ok", json!(["after"]));
    wait_until(LONG, "four jobs processed", || s.r.processed() == 4);
    let failures = s.r.failures();
    assert_eq!(failures.len(), 3, "{failures:?}");
    for f in &failures {
        assert_eq!(f["exception"], "Locket::ProtocolError", "{f}");
    }
    let errors: Vec<String> = failures
        .iter()
        .map(|f| f["error"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        errors[0].contains("not JSON") && errors[0].contains("garbage on fd 4"),
        "{errors:?}"
    );
    assert!(
        errors[1].contains("not-"),
        "the wrong id is quoted: {errors:?}"
    );
    assert!(
        errors[2].contains("longer than max_frame_bytes"),
        "{errors:?}"
    );
    assert!(errors[2].len() < 400, "only the first bytes are quoted");
    let pids: Vec<i32> = s.of("job").iter().map(pid_of).collect();
    let mut distinct = pids.clone();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        4,
        "a new handler after each protocol error: {pids:?}"
    );
    for p in &pids[..3] {
        assert!(!pid_alive(*p), "the broken handler {p} is dead");
    }
}

/// H-10, H-14, §7 "SIGKILL mid-job": a handler killed by a signal locketd did not send is
/// Resque's DirtyExit (counted processed, not failed); a new handler starts and runs the
/// job's `on_failure` hooks (`failure_hooks`), then takes the next job.
#[test]
fn h10_a_handler_killed_mid_job_is_a_dirty_exit_and_its_hooks_run_in_the_next() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("KillSelf", json!([]));
    s.push("Ok", json!([]));
    wait_until(LONG, "two jobs processed", || s.r.processed() == 2);
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
    assert!(
        f["error"].as_str().unwrap_or_default().contains("SIGKILL"),
        "{f}"
    );
    assert_eq!(
        s.r.failed_stat(),
        0,
        "DirtyExit is not counted in stat:failed"
    );
    wait_until(SHORT, "failure hooks ran", || {
        !s.of("failure_hooks").is_empty()
    });
    let hooks = &s.of("failure_hooks")[0];
    assert_eq!(hooks["exception"], "Resque::DirtyExit");
    assert_eq!(hooks["payload"], r#"{"class":"KillSelf","args":[]}"#);
    let killed = pid_of(&s.jobs_of("KillSelf")[0]);
    assert_ne!(pid_of(hooks), killed);
    assert_eq!(pid_of(&s.jobs_of("Ok")[0]), pid_of(hooks));
}

/// H-10, §7 "`exit!(3)` mid-job": another exit without `done` is `Locket::CommandFailed`
/// with the status and the last stderr lines.
#[test]
fn h10_an_exit_mid_job_is_command_failed_with_the_stderr_tail() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("Exit3", json!([]));
    wait_until(LONG, "the job failed", || !s.r.failures().is_empty());
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "Locket::CommandFailed", "{f}");
    let error = f["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("status 3") && error.contains("about to exit with 3"),
        "{f}"
    );
    assert!(
        f["backtrace"].to_string().contains("about to exit with 3"),
        "{f}"
    );
    assert_eq!(s.r.failed_stat(), 1);
}

/// H-10, §7 "`done` written then exit": a `done` already in the pipe when the handler exits
/// still counts; the next job gets a new handler.
#[test]
fn h10_done_written_then_exit_counts_the_done() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("DoneThenExit", json!([]));
    s.push("Ok", json!([]));
    wait_until(LONG, "two jobs processed", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    let first = pid_of(&s.jobs_of("DoneThenExit")[0]);
    assert_ne!(pid_of(&s.jobs_of("Ok")[0]), first);
}

/// H-10: a handler that exits after its `done` without reading the next job's frame never said
/// `started` for that job: none of its code ran, so it goes back to the head of its queue and
/// runs on a fresh handler, with no failure recorded.
#[test]
fn h10_an_exit_before_started_puts_the_job_back_without_a_failure() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("DoneThenLinger", json!([0.5]));
    s.push("Ok", json!([]));
    wait_until(LONG, "two jobs processed", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    assert_eq!(s.r.failed_stat(), 0);
    let first = pid_of(&s.jobs_of("DoneThenLinger")[0]);
    let ok: Vec<_> = s.jobs_of("Ok");
    // The frame written to the lingering handler was never read: the job reached only the
    // fresh one.
    assert!(ok.iter().all(|j| pid_of(j) != first), "{ok:?}");
}

/// H-10, §7 "a grandchild holding fd 4 after the handler dies": the death is seen by the
/// exit, not by the end of fd 4, so the job ends at once, not when the grandchild does.
#[test]
fn h10_a_grandchild_holding_fd4_does_not_hide_the_handlers_death() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("HoldFd4", json!([60]));
    let t = Instant::now();
    wait_until(LONG, "the job failed", || !s.r.failures().is_empty());
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "Locket::CommandFailed", "{f}");
    assert!(
        f["error"].as_str().unwrap_or_default().contains("status 0"),
        "{f}"
    );
}

/// H-3, §7 "a grandchild writing to fd 4": fds 3 and 4 are close-on-exec in the handler, so
/// a job's subprocess cannot write frames; the job succeeds.
#[test]
fn h3_a_grandchild_cannot_write_to_fd4() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("WriteFd4", json!([]));
    wait_until(LONG, "the job ran", || s.r.processed() == 1);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    let e = &s.of("grandchild_write")[0];
    assert_ne!(e["rc"], 0, "the grandchild's write to fd 4 failed: {e}");
}

/// H-11, §7 "timeout with TERM ignored": `stop` and SIGTERM, then SIGKILL after kill_grace;
/// the group is dead and reaped before `Locket::Timeout` is recorded; a fresh handler runs the
/// job's failure hooks (H-14) and the next job.
#[test]
fn h11_a_timeout_with_term_ignored_kills_the_group_before_recording() {
    let mut s = Setup::new();
    let _d = s.start(
        "",
        "",
        "[classes.\"IgnoreTerm\"]\nhandler = \"t\"\ntimeout = \"500ms\"\nkill_grace = \"500ms\"\n",
    );
    s.push("IgnoreTerm", json!([60]));
    s.push("Ok", json!([]));
    wait_until(LONG, "the timeout is recorded", || {
        !s.r.failures().is_empty()
    });
    let stuck = pid_of(&s.jobs_of("IgnoreTerm")[0]);
    assert!(!pid_alive(stuck), "recorded only once the handler is dead");
    assert!(process_group_members(stuck).is_empty());
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "Locket::Timeout", "{f}");
    wait_until(LONG, "the next job ran", || s.jobs_of("Ok").len() == 1);
    let hooks = s.of("failure_hooks");
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    assert_eq!(hooks[0]["exception"], "Locket::Timeout");
}

/// H-11, NEVER-1, §7 "lock lost mid-job": the group is dead before the lock is free for
/// another worker: when `Locket::LockLost` is recorded the handler no longer exists.
#[test]
fn h11_a_lost_lock_kills_the_group_before_the_job_is_recorded() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("IgnoreTerm", json!([60]));
    wait_until(LONG, "the job runs", || s.jobs_of("IgnoreTerm").len() == 1);
    let handler = pid_of(&s.jobs_of("IgnoreTerm")[0]);
    let lock_key = format!("{NS}:locket:lock:{}", default_lock_id("IgnoreTerm", "[60]"));
    wait_until(SHORT, "the lock is held", || s.r.exists(&lock_key));
    let _: i64 = s.r.cmd(&["DEL", &lock_key]);
    wait_until(LONG, "LockLost recorded", || !s.r.failures().is_empty());
    assert!(
        !pid_alive(handler),
        "the handler is dead when the failure is recorded"
    );
    assert_eq!(s.r.failures()[0]["exception"], "Locket::LockLost");
}

/// H-14, A-11 (issue 23 #2): a lost lock under `on_lock_lost = "requeue"` puts the job back
/// in its queue and is no failure, so no `on_failure` hooks run for it: a retry hook
/// (resque-retry's shape) would enqueue a second copy beside the requeued one.
#[test]
fn h14_a_lost_lock_requeued_runs_no_failure_hooks() {
    let mut s = Setup::new();
    let _d = s.start(
        "",
        "",
        "[classes.\"IgnoreTerm\"]\nhandler = \"t\"\non_lock_lost = \"requeue\"\nkill_grace = \"300ms\"\n",
    );
    s.push("IgnoreTerm", json!([60]));
    wait_until(LONG, "the job runs", || s.jobs_of("IgnoreTerm").len() == 1);
    let handler = pid_of(&s.jobs_of("IgnoreTerm")[0]);
    let lock_key = format!("{NS}:locket:lock:{}", default_lock_id("IgnoreTerm", "[60]"));
    wait_until(SHORT, "the lock is held", || s.r.exists(&lock_key));
    let _: i64 = s.r.cmd(&["DEL", &lock_key]);
    // The fresh handler runs any failure hooks before it takes a job: once the requeued job
    // runs again there, the hooks would have run.
    wait_until(LONG, "the requeued job runs again", || {
        s.jobs_of("IgnoreTerm").len() == 2
    });
    assert!(!pid_alive(handler));
    assert_ne!(pid_of(&s.jobs_of("IgnoreTerm")[1]), handler);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    assert_eq!(s.of("failure_hooks"), Vec::<Value>::new());
}

/// H-9 (issue 23 #1), §7 "`sleep &` and `setsid sleep` spawned by a job": after `done`, every
/// other process of the handler's group (the job's child, and a double-forked one the master
/// adopted) is dead before the job is recorded, as in exec mode, while the handler lives on
/// for the next job. A process in a session of its own (`setsid`) is not in the group.
#[test]
fn h9_a_jobs_subprocesses_are_dead_before_its_done_is_recorded() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("Spawn", json!([60]));
    wait_until(LONG, "the job is processed", || s.r.processed() == 1);
    // FINISH counted the job: whatever was killed for it was killed before.
    let e = s.of("spawned").remove(0);
    let pid = |k: &str| i32::try_from(e[k].as_i64().expect("pid")).expect("pid fits");
    let (child, orphan, own) = (pid("child"), pid("orphan"), pid("setsid"));
    let alive = [pid_alive(child), pid_alive(orphan)];
    let own_alive = pid_alive(own);
    // SAFETY: kill(2) of the setsid sleep this test's job started.
    unsafe {
        libc::kill(own, libc::SIGKILL);
    }
    assert_eq!(alive, [false, false], "the job's child and orphan: {e}");
    assert!(own_alive, "a setsid process is not the job's group");
    s.push("Ok", json!([]));
    wait_until(LONG, "the next job is processed", || s.r.processed() == 2);
    assert_eq!(
        pid_of(&s.jobs_of("Ok")[0]),
        pid_of(&s.jobs_of("Spawn")[0]),
        "the handler itself serves on"
    );
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
}

/// H-9 (issue 23 #1): the process that said `ready` (its `pid`) and the processes between it
/// and the spawned one are the handler, not a job's subprocesses: a wrapper shell that forks
/// the adapter instead of exec'ing it keeps it across jobs.
#[test]
fn h9_a_wrapped_handler_is_not_taken_for_a_jobs_subprocess() {
    let mut s = Setup::new();
    let config = s.config("", "", "").replacen(
        &format!("command = [\"{}\"]", fixture().display()),
        &format!(
            "command = [\"sh\", \"-c\", \"{} ; exit $?\"]",
            fixture().display()
        ),
        1,
    );
    assert!(config.contains("exit $?"), "{config}");
    let _d = Daemon::start(&s.redis, &config, &[]);
    s.push("Spawn", json!([60]));
    s.push("Ok", json!([]));
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    let e = s.of("spawned").remove(0);
    let own = i32::try_from(e["setsid"].as_i64().expect("pid")).expect("pid fits");
    // SAFETY: kill(2) of the setsid sleep this test's job started.
    unsafe {
        libc::kill(own, libc::SIGKILL);
    }
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    assert_eq!(s.of("boot").len(), 1, "one handler served both jobs");
    let child = i32::try_from(e["child"].as_i64().expect("pid")).expect("pid fits");
    assert!(!pid_alive(child), "the job's own child is gone");
}

/// A process's peak resident size (`VmHWM`), in bytes.
fn peak_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// H-5 (issue 23 #7): locketd reads fd 4 one frame at a time, so a handler writing valid
/// frames while idle costs the worker at most one frame of memory (it was 64 of them), and
/// a frame while idle ends the handler at once; a new one serves the next job.
#[test]
fn h5_frames_written_while_idle_end_the_handler_and_are_not_buffered() {
    const FRAME: u64 = 4 << 20;
    let mut s = Setup::new();
    let d = s.start("max_frame_bytes = \"5MiB\"", "", "");
    s.push("Ok", json!([]));
    wait_until(LONG, "the first job is processed", || s.r.processed() == 1);
    let worker = d.worker_pid();
    let before = peak_rss(worker);
    s.push("IdleFrames", json!([FRAME, 40]));
    wait_until(LONG, "the frames are written or the handler ended", || {
        !s.of("idle_frames_written").is_empty() || s.of("boot").len() >= 2
    });
    let grown = peak_rss(worker).saturating_sub(before);
    eprintln!("the worker's peak RSS grew by {} KiB", grown >> 10);
    assert!(
        grown < 10 * FRAME,
        "the worker's peak RSS grew by {} MiB for 40 idle frames of {} MiB",
        grown >> 20,
        FRAME >> 20
    );
    wait_until(LONG, "a new handler", || s.of("boot").len() >= 2);
    let first = pid_of(&s.jobs_of("IdleFrames")[0]);
    wait_until(SHORT, "the first handler is gone", || !pid_alive(first));
    assert!(
        s.of("idle_frames_written").is_empty(),
        "ended while still writing"
    );
    s.push("Ok", json!([1]));
    wait_until(LONG, "the next job is processed", || s.r.processed() == 3);
    assert_ne!(pid_of(&s.jobs_of("Ok")[1]), first);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
}

/// §7 "`sleep &` and `setsid sleep` spawned by a job": they neither block the daemon (they
/// hold the handler's stdout and stderr) nor, for the one in the group, outlive a kill.
#[test]
fn spawned_background_processes_neither_block_nor_outlive_a_kill_in_the_group() {
    let mut s = Setup::new();
    let _d = s.start(
        "",
        "",
        "[classes.\"Spawn\"]\nhandler = \"t\"\ntimeout = \"1s\"\nkill_grace = \"200ms\"\n",
    );
    s.push("Spawn", json!([60, 30]));
    s.push("Ok", json!([]));
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    let handler = pid_of(&s.jobs_of("Spawn")[0]);
    assert!(
        process_group_members(handler).is_empty(),
        "the group's sleep is gone"
    );
    assert_eq!(s.r.failures()[0]["exception"], "Locket::Timeout");
}

/// §7 "job code that prints 10 MB to stdout with no newline" and "a job reading stdin gets
/// EOF": neither blocks nor fails the job.
#[test]
fn ten_megabytes_without_newline_and_a_stdin_read_do_not_block() {
    let mut s = Setup::new();
    let _d = s.start("", "", "");
    s.push("Print", json!([10_000_000]));
    s.push("Stdin", json!([]));
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
}

/// H-4, H-6, §7 "payloads with raw newlines, U+2028 and big integers delivered byte-exact",
/// "an 8 MiB payload while the handler logs 8 MiB first".
#[test]
fn h4_payloads_are_delivered_byte_exact_even_large_ones_against_a_logging_handler() {
    let mut s = Setup::new();
    // An 8 MiB payload through a debug build's job path (JSON, digests, the worker record)
    // takes over a second: the harness's 2 s leases would make this a test of timing, which
    // it is not. It asserts what is delivered.
    let config = s
        .config("", ", LOG_FIRST = \"8388608\"", "")
        .replace("lock_ttl = \"2s\"", "lock_ttl = \"20s\"")
        .replace("process_ttl = \"2s\"", "process_ttl = \"20s\"");
    assert!(config.contains("process_ttl = \"20s\""), "{config}");
    let _d = Daemon::start(&s.redis, &config, &[]);
    let payloads = [
        "{\"class\":\"Ok\",\"args\":[\"line\\nbreak\",\"\u{2028}\",12345678901234567890123,1.50]}"
            .to_string(),
        format!(
            "{{\"class\":\"Ok\",\"args\":[\"{}\"]}}",
            "z".repeat(8 * 1024 * 1024 - 64)
        ),
    ];
    for p in &payloads {
        s.r.push("q", p);
    }
    wait_until(LONG, "both jobs processed", || s.r.processed() == 2);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    let got: Vec<String> = s
        .jobs_of("Ok")
        .iter()
        .map(|e| e["payload"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], payloads[0]);
    assert!(got[1] == payloads[1], "the 8 MiB payload arrived whole");
}

/// H-9, §7 "a wedged idle handler": no `started` within start_timeout: the group is killed
/// and the job goes back to the head of its queue, unrecorded; a second no-start of the same
/// job is `Locket::HandlerCrashed`.
#[test]
fn h9_a_wedged_handler_returns_the_job_once_then_fails_it() {
    let mut s = Setup::new();
    let d = s.start("start_timeout = \"500ms\"", "", "");
    s.push("NoStart", json!([]));
    wait_until(LONG, "the job failed", || !s.r.failures().is_empty());
    assert_eq!(s.jobs_of("NoStart").len(), 2, "sent twice");
    let f = &s.r.failures()[0];
    assert_eq!(f["exception"], "Locket::HandlerCrashed", "{f}");
    assert_eq!(s.r.failures().len(), 1);
    d.wait_for_log("back to the head of its queue", SHORT);
    for e in s.jobs_of("NoStart") {
        assert!(!pid_alive(pid_of(&e)));
    }
}

/// H-9 (issue 23, a suspicion that held): the slot remembered only the last payload that did
/// not start, so two wedging jobs taking turns were each "first" again and again. Here A
/// (low queue) does not start, B arrives in the high queue meanwhile and does not start
/// twice; then A's next no-start is its second: each is sent exactly twice.
#[test]
fn h9_two_wedging_jobs_taking_turns_are_each_failed_at_their_second_no_start() {
    let mut s = Setup::new();
    let config = s.config("start_timeout = \"500ms\"", "", "").replacen(
        "queues = \"q\"",
        "queues = \"q1,q2\"",
        1,
    );
    let _d = Daemon::start(&s.redis, &config, &[]);
    let sent = |s: &Setup, n: i64| {
        s.jobs_of("NoStart")
            .iter()
            .filter(|e| e["args"] == json!([n]))
            .count()
    };
    s.r.push("q2", &json!({"class": "NoStart", "args": [1]}).to_string());
    wait_until(LONG, "A is sent", || sent(&s, 1) == 1);
    s.r.push("q1", &json!({"class": "NoStart", "args": [2]}).to_string());
    wait_until(LONG, "both failed", || s.r.failures().len() == 2);
    assert_eq!((sent(&s, 1), sent(&s, 2)), (2, 2), "each sent twice");
    for f in s.r.failures() {
        assert_eq!(f["exception"], "Locket::HandlerCrashed", "{f}");
    }
}

/// H-13, §7 "`max_jobs` with jitter across slots": every handler process serves between
/// max_jobs and max_jobs + jitter jobs before it is replaced, in each of 4 slots.
#[test]
fn h13_max_jobs_with_jitter_recycles_every_slots_handler() {
    let mut s = Setup::new();
    let config = s
        .config("max_jobs = 4\nmax_jobs_jitter = 3", "", "")
        .replacen("interval = 0.1\n", "interval = 0.1\nslots = 4\n", 1);
    let _d = Daemon::start(&s.redis, &config, &[]);
    for i in 0..80 {
        s.push("Ok", json!([i]));
    }
    wait_until(LONG, "80 jobs processed", || s.r.processed() == 80);
    let mut per_pid: std::collections::BTreeMap<i32, usize> = Default::default();
    for e in s.of("job") {
        *per_pid.entry(pid_of(&e)).or_default() += 1;
    }
    let retired: Vec<(i32, usize)> = per_pid
        .iter()
        .filter(|(p, _)| !pid_alive(**p))
        .map(|(p, n)| (*p, *n))
        .collect();
    assert!(retired.len() >= 8, "{per_pid:?}");
    for (pid, n) in &retired {
        assert!((4..=7).contains(n), "pid {pid} served {n}: {per_pid:?}");
    }
    assert!(s.r.failures().is_empty());
}

/// H-13, §7 "memory growth past `max_rss`": the handler that crossed max_rss after a job is
/// replaced before the next one; no job is killed for it.
#[test]
fn h13_max_rss_recycles_after_the_job_that_crossed_it() {
    let mut s = Setup::new();
    let _d = s.start("max_rss = \"120MiB\"", "", "");
    for _ in 0..6 {
        s.push("Hog", json!([50]));
    }
    wait_until(LONG, "six jobs processed", || s.r.processed() == 6);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    let pids: Vec<i32> = s.of("job").iter().map(pid_of).collect();
    let mut runs: Vec<usize> = Vec::new();
    for (i, p) in pids.iter().enumerate() {
        if i == 0 || pids[i - 1] != *p {
            runs.push(0);
        }
        *runs.last_mut().expect("run") += 1;
    }
    // 50 MB each: the second or third job crosses 120 MiB (with the interpreter's own).
    assert!(runs.len() >= 2, "{pids:?}");
    assert!(runs[0] == 2 || runs[0] == 3, "{runs:?}");
}

/// H-12, §7 "shutdown idle": QUIT with an idle handler: it gets EOF on fd 3 and exits by
/// itself; the daemon exits 0 with no handler left.
#[test]
fn h12_quit_with_an_idle_handler_closes_its_fd3() {
    let mut s = Setup::new();
    let mut d = s.start("", "", "");
    s.push("Ok", json!([]));
    wait_until(LONG, "the job ran", || s.r.processed() == 1);
    let handler = pid_of(&s.jobs_of("Ok")[0]);
    d.signal(libc::SIGQUIT);
    let status = d.wait_exit(LONG).expect("the daemon exits");
    assert!(status.success(), "{status:?}");
    assert_eq!(s.of("eof").len(), 1, "the handler read EOF");
    assert!(!pid_alive(handler));
}

/// H-12, §7 "shutdown busy": TERM during a job: `stop` and SIGTERM; a handler that dies of
/// it gives Resque::TermException, as a command handler does.
#[test]
fn h12_term_during_a_job_is_a_term_exception() {
    let mut s = Setup::new();
    let mut d = s.start("", "", "");
    s.push("Sleep", json!([60]));
    wait_until(LONG, "the job runs", || s.jobs_of("Sleep").len() == 1);
    let handler = pid_of(&s.jobs_of("Sleep")[0]);
    d.signal(libc::SIGTERM);
    let status = d.wait_exit(LONG).expect("the daemon exits");
    assert!(status.success(), "{status:?}");
    assert_eq!(s.r.failures()[0]["exception"], "Resque::TermException");
    assert!(!pid_alive(handler));
}

/// H-12, §7 "shutdown reschedule": a handler that answers a stop with `reschedule` has its
/// job put back in its queue, not failed.
#[test]
fn h12_a_handler_answering_term_with_reschedule_requeues_the_job() {
    let mut s = Setup::new();
    let mut d = s.start("", "", "");
    s.push("TermReschedule", json!([60]));
    wait_until(LONG, "the job runs", || {
        s.jobs_of("TermReschedule").len() == 1
    });
    d.signal(libc::SIGTERM);
    d.wait_exit(LONG).expect("the daemon exits");
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
    assert_eq!(s.r.llen(&format!("{NS}:queue:q")), 1);
}

/// H-12, §7 "shutdown busy": QUIT waits for the running job's `done`.
#[test]
fn h12_quit_waits_for_the_running_jobs_done() {
    let mut s = Setup::new();
    let mut d = s.start("", "", "");
    s.push("Sleep", json!([1]));
    wait_until(LONG, "the job runs", || s.jobs_of("Sleep").len() == 1);
    d.signal(libc::SIGQUIT);
    d.wait_exit(LONG).expect("the daemon exits");
    assert_eq!(s.r.processed(), 1);
    assert!(s.r.failures().is_empty(), "{:?}", s.r.failures());
}

/// H-1 `idle_timeout`: an idle handler exits and the next job starts a new one.
#[test]
fn h1_an_idle_handler_exits_after_idle_timeout_and_comes_back_for_the_next_job() {
    let mut s = Setup::new();
    let d = s.start("idle_timeout = \"500ms\"", "", "");
    s.push("Ok", json!([1]));
    wait_until(LONG, "the job ran", || s.r.processed() == 1);
    let first = pid_of(&s.jobs_of("Ok")[0]);
    wait_until(SHORT, "the idle handler exited", || !pid_alive(first));
    d.wait_for_log("idle handler exits", SHORT);
    s.push("Ok", json!([2]));
    wait_until(LONG, "the second job ran", || s.r.processed() == 2);
    assert_ne!(pid_of(&s.jobs_of("Ok")[1]), first);
}

/// H-2: check-config names what is wrong with a handler table.
#[test]
fn h2_check_config_rejects_bad_handler_tables_by_name() {
    let work = workdir();
    let cases = [
        (
            "[handlers.a]\nmode = \"forked\"\ncommand = [\"x\"]\n",
            "mode",
        ),
        (
            "[handlers.a]\nmode = \"persistent\"\n[classes.X]\nhandler = \"a\"\n",
            "handlers.\"a\".command",
        ),
        (
            "[classes.X]\nhandler = \"missing\"\n",
            "classes.\"X\".handler",
        ),
        (
            "[handlers.a]\nmode = \"persistent\"\ncommand = [\"x\"]\nmax_rss = \"lots\"\n",
            "\"lots\"",
        ),
    ];
    for (text, needle) in cases {
        let path = work.path().join("c.toml");
        std::fs::write(&path, format!("queues = \"q\"\n{text}")).expect("write config");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
            .arg("check-config")
            .arg(&path)
            .output()
            .expect("run check-config");
        let text_out = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(78), "{text}: {text_out}");
        assert!(text_out.contains(needle), "{text}: {text_out}");
    }
}

/// Issue 13 item 4: `status` (text and `--json`) and `/metrics` show, per slot, the
/// handler's pid, readiness, jobs served, memory, boots and restarts by reason.
#[test]
fn status_and_metrics_show_each_slots_handler() {
    let mut s = Setup::new();
    let config = s.config("max_jobs = 3\npreload = true", "", "").replacen(
        "interval = 0.1\n",
        "interval = 0.1\nslots = 2\n",
        1,
    );
    let d = Daemon::builder(&s.redis)
        .config(&config)
        .args(["--metrics", "127.0.0.1:0"])
        .start();
    for i in 0..10 {
        s.push("Ok", json!([i]));
    }
    wait_until(LONG, "ten jobs processed", || s.r.processed() == 10);
    let addr = crate::service::metrics_addr(&d);
    let mut slots: Vec<Value> = Vec::new();
    wait_until(
        LONG,
        "status shows both slots' handlers with ten jobs",
        || {
            let out = crate::ops::locketd(&s.redis, &["--queues", "q", "status", "--json"]);
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
            slots = v["workers"]
                .as_array()
                .map(|w| {
                    w.iter()
                        .filter_map(|w| w["handlers"].get(0).cloned())
                        .collect()
                })
                .unwrap_or_default();
            // Both handlers ready: one recycled after its last job may still be booting.
            slots.len() == 2
                && slots.iter().all(|h| h["ready"] == true)
                && slots
                    .iter()
                    .map(|h| h["jobs_total"].as_u64().unwrap_or(0))
                    .sum::<u64>()
                    == 10
        },
    );
    for h in &slots {
        assert_eq!(h["name"], "t", "{h}");
        let pid = i32::try_from(h["pid"].as_i64().expect("a pid")).expect("pid");
        assert!(pid_alive(pid), "{h}");
        let served = h["jobs_total"].as_u64().unwrap_or(0);
        if served > 0 {
            assert!(h["rss_bytes"].as_u64().unwrap_or(0) > 1024 * 1024, "{h}");
        }
        // A slot's handler is replaced after every 3 jobs (and booted with the slot).
        assert_eq!(h["boots"].as_u64(), Some(1 + served / 3), "{h}");
    }
    let text = crate::ops::stdout_ok(&crate::ops::locketd(&s.redis, &["--queues", "q", "status"]));
    assert!(
        text.contains("HANDLER") && text.contains("ready") && text.contains("max_jobs="),
        "{text}"
    );
    // The master serves what its workers report once a second.
    let mut body = String::new();
    let ready_lines = |b: &str| -> Vec<String> {
        b.lines()
            .filter(|l| l.starts_with("locketd_handler_ready{"))
            .map(str::to_string)
            .collect()
    };
    wait_until(LONG, "/metrics shows both slots' handlers ready", || {
        body = crate::service::scrape(&addr).unwrap_or_default();
        let ready = ready_lines(&body);
        ready.len() == 2 && ready.iter().all(|l| l.ends_with(" 1"))
    });
    assert!(
        body.contains("locketd_handler_restarts_total{") && body.contains("reason=\"max_jobs\""),
        "{body}"
    );
    assert!(
        body.contains("locketd_handler_jobs_served_total{"),
        "{body}"
    );
    // threads = 1 (H-18): a process per slot, no THREADS column, no thread series.
    assert!(!text.contains("THREADS"), "{text}");
    assert!(!body.contains("locketd_handler_thread"), "{body}");
}

/// H-1 `preload`: the handler starts with its worker slot, before any job is pushed; without
/// it, not before the first job.
#[test]
fn h1_preload_starts_the_handler_with_its_slot() {
    let s = Setup::new();
    let _d = s.start("preload = true", "", "");
    wait_until(LONG, "the handler booted with no job", || {
        s.of("boot").len() == 1
    });
    let lazy = Setup::new();
    let d = lazy.start("", "", "");
    let mut r = R::new(&lazy.redis);
    wait_registered(&mut r, &d);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        lazy.of("boot").is_empty(),
        "a lazy handler waits for its first job"
    );
}

/// A-21, H-11, H-14: a 60 s job of a persistent handler that ignores SIGTERM, run by one of two
/// daemons, cancelled by `locketd cancel` (another process): the handler's group is gone within
/// 2 s + kill_grace (1 s), the failure record says `Locket::Cancelled`, the failure hooks run
/// in the fresh handler, which runs the next job.
#[test]
fn a21_a_cancelled_persistent_job_kills_the_group_and_a_fresh_handler_runs_the_next() {
    let mut s = Setup::new();
    let config = s.config("", "", "");
    let _a = Daemon::start(&s.redis, &config, &[]);
    let _b = Daemon::start(&s.redis, &config, &[]);
    wait_until(LONG, "two workers registered", || s.r.workers().len() == 2);
    s.push("IgnoreTerm", json!([60]));
    wait_until(LONG, "the job runs", || s.jobs_of("IgnoreTerm").len() == 1);
    let handler = pid_of(&s.jobs_of("IgnoreTerm")[0]);
    let rid = crate::operate::running_rid(&mut s.r);
    let asked = Instant::now();
    let out = crate::ops::locketd(&s.redis, &["cancel", &rid]);
    assert!(out.status.success(), "{out:?}");
    wait_until(LONG, "the group is gone", || {
        process_group_members(handler).is_empty()
    });
    let took = asked.elapsed();
    eprintln!("cancel to group gone: {took:?}");
    assert!(
        took < Duration::from_secs(4),
        "the group outlived 2 s + kill_grace after the cancel: {took:?}"
    );
    assert!(!pid_alive(handler));
    wait_until(LONG, "the failure is recorded", || {
        !s.r.failures().is_empty()
    });
    assert_eq!(s.r.failures()[0]["exception"], "Locket::Cancelled");
    s.push("Ok", json!([]));
    wait_until(LONG, "the next job ran", || s.jobs_of("Ok").len() == 1);
    assert_ne!(pid_of(&s.jobs_of("Ok")[0]), handler);
    wait_until(LONG, "the failure hooks ran", || {
        s.of("failure_hooks").len() == 1
    });
    let hooks = s.of("failure_hooks");
    assert_eq!(hooks[0]["exception"], "Locket::Cancelled");
}
