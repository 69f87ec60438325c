//! The shipped adapters (issue 13 item 2) through the real `locketd` binary and a private
//! redis-server: the Ruby adapter with the example app (`examples/ruby-app`), in-process and
//! with `--fork`, the Python and Node adapters with theirs. Hooks append to `$HOOK_LOG`, and
//! each hook-order test compares that file with the order Resque's `Job#perform` gives.
//! A test whose interpreter is missing says so and passes; `.ci/run` installs them.
//! Run: `cargo test --test it -- adapters::`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, default_lock_id, wait_registered, workdir, NS, R};
use crate::support::{
    child_pids, manifest_dir, pid_alive, wait_until, zombie_children, Daemon, RedisServer,
};

const LONG: Duration = Duration::from_secs(60);

fn have(program: &str) -> bool {
    std::process::Command::new(program)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Whether `program` runs; says the test is skipped when it does not.
fn have_or_skip(program: &str) -> bool {
    let there = have(program);
    if !there {
        eprintln!("{program} is not installed: skipped (.ci/run installs it)");
    }
    there
}

/// A daemon running every class through `command` (paths relative to the repository root,
/// the daemon's working directory), with `HOOK_LOG` set.
struct App {
    _redis: RedisServer,
    r: R,
    _work: tempfile::TempDir,
    hook_log: PathBuf,
    daemon: Daemon,
}

impl App {
    fn start(command: &[&str], classes: &str) -> App {
        App::start_env(command, classes, &[])
    }

    /// [`App::start`] with `handler_extra` lines in the `[handlers.app]` table.
    fn start_with(command: &[&str], handler_extra: &str, classes: &str) -> App {
        App::start_full(command, handler_extra, classes, &[])
    }

    /// With more variables in the handler's environment: `{work}` in a value is the test's
    /// work directory, `{redis}` the redis-server's host:port.
    fn start_env(command: &[&str], classes: &str, env: &[(&str, &str)]) -> App {
        App::start_full(command, "", classes, env)
    }

    fn start_full(
        command: &[&str],
        handler_extra: &str,
        classes: &str,
        env: &[(&str, &str)],
    ) -> App {
        let redis = RedisServer::start();
        let r = R::new(&redis);
        let work = workdir();
        let hook_log = work.path().join("hooks.log");
        let argv: Vec<String> = command.iter().map(|a| format!("\"{a}\"")).collect();
        let mut vars = format!("HOOK_LOG = \"{}\"", hook_log.display());
        for (k, v) in env {
            let v = v
                .replace("{work}", &work.path().display().to_string())
                .replace("{redis}", &format!("127.0.0.1:{}", redis.port()));
            vars.push_str(&format!(", {k} = \"{v}\""));
        }
        let config = format!(
            "{}\n[handlers.app]\nmode = \"persistent\"\ncommand = [{}]\nboot_timeout = \"60s\"\n\
             env = {{ {vars} }}\n{handler_extra}\n\n[classes.\"*\"]\nhandler = \"app\"\n{classes}\n",
            cfg("q").render(),
            argv.join(", "),
        );
        let daemon = Daemon::builder(&redis)
            .config(&config)
            .current_dir(manifest_dir())
            .start();
        App {
            _redis: redis,
            r,
            _work: work,
            hook_log,
            daemon,
        }
    }

    fn push(&mut self, class: &str, args: Value) {
        self.r
            .push("q", &json!({"class": class, "args": args}).to_string());
    }

    fn hooks(&self) -> Vec<String> {
        std::fs::read_to_string(&self.hook_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Waits until `n` jobs are processed.
    fn processed(&mut self, n: i64) {
        let r = &mut self.r;
        wait_until(LONG, &format!("{n} jobs processed"), || r.processed() == n);
    }
}

/// Resque's `Job#perform` order for `Audited` (examples/ruby-app/jobs/audited.rb): before
/// hooks sorted, around hooks nested with the first outermost, perform, after hooks on success.
fn audited_success(args: &str) -> Vec<String> {
    [
        "before_perform_a",
        "before_perform_b",
        "around_perform_x enter",
        "around_perform_y enter",
        &format!("perform {args}"),
        "around_perform_y exit",
        "around_perform_x exit",
        "after_perform_z",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The three stories of the hook-order test: a success, a failure (on_failure once, no
/// after hooks, the record as Resque writes it), and DontPerform (no perform, not a failure).
fn check_ruby_hook_order(app: &mut App) {
    app.push("Audited", json!(["ok", 1]));
    app.processed(1);
    app.push("Audited", json!(["fail"]));
    app.processed(2);
    app.push("Audited", json!(["skip"]));
    app.processed(3);
    let mut want = audited_success("[\"ok\",1]");
    want.extend(
        [
            "before_perform_a",
            "before_perform_b",
            "around_perform_x enter",
            "around_perform_y enter",
            "perform [\"fail\"]",
            "on_failure_log ArgumentError: audited job failed [\"fail\"]",
            "before_perform_a",
            "before_perform_b",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    assert_eq!(app.hooks(), want);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    assert_eq!(f["exception"], "ArgumentError");
    assert_eq!(f["error"], "audited job failed");
    assert_eq!(f["payload"], json!({"class": "Audited", "args": ["fail"]}));
    assert!(
        f["backtrace"][0]
            .as_str()
            .unwrap_or_default()
            .contains("audited.rb"),
        "{f}"
    );
    assert_eq!(app.r.failed_stat(), 1);
}

/// H-15: the Ruby adapter runs Resque's hook order exactly, in one preloaded process.
#[test]
fn h15_ruby_adapter_runs_resques_hook_order() {
    if !have_or_skip("ruby") {
        return;
    }
    let mut app = App::start(
        &["adapters/ruby/locketd-ruby", "examples/ruby-app/app.rb"],
        "",
    );
    check_ruby_hook_order(&mut app);
    // Constant paths resolve; an unknown class is Ruby's NameError.
    app.push("Namespaced::Job", json!([]));
    app.push("Nope::Missing", json!([]));
    app.processed(5);
    let f = &app.r.failures()[1];
    assert_eq!(f["exception"], "NameError", "{f}");
    assert!(
        f["error"]
            .as_str()
            .unwrap_or_default()
            .contains("uninitialized constant"),
        "{f}"
    );
}

/// H-15 `--fork`: the same order with each job in a child forked from the loaded parent.
#[test]
fn h15_ruby_adapter_with_fork_runs_resques_hook_order() {
    if !have_or_skip("ruby") {
        return;
    }
    let mut app = App::start(
        &[
            "adapters/ruby/locketd-ruby",
            "examples/ruby-app/app.rb",
            "--fork",
        ],
        "",
    );
    check_ruby_hook_order(&mut app);
}

/// The example app with a `Slow` job running; and the worker's pid.
fn slow_job_running(fork: bool) -> (App, i32) {
    let mut command = vec!["adapters/ruby/locketd-ruby", "examples/ruby-app/app.rb"];
    if fork {
        command.push("--fork");
    }
    let mut app = App::start(&command, "");
    let worker = app.daemon.worker_pid();
    wait_registered(&mut app.r, &app.daemon);
    app.push("Slow", json!([60]));
    let hooks = app.hook_log.clone();
    wait_until(LONG, "the job runs", || {
        std::fs::read_to_string(&hooks)
            .unwrap_or_default()
            .contains("Slow start")
    });
    (app, worker)
}

/// The adapter of the worker's slot, and the job's forked child under it.
fn adapter_and_child(worker: i32) -> (i32, Option<i32>) {
    let adapter = child_pids(worker)
        .into_iter()
        .next()
        .expect("the worker has a handler process");
    (adapter, child_pids(adapter).into_iter().next())
}

/// H-15 `--fork`, §7: a child killed by a signal is Resque's DirtyExit, recorded after the
/// parent ran the job's `on_failure` hooks; the loaded parent serves the next job.
#[test]
fn h15_a_killed_fork_child_is_a_dirty_exit_with_on_failure_in_the_parent() {
    if !have_or_skip("ruby") {
        return;
    }
    let (mut app, worker) = slow_job_running(true);
    let (adapter, child) = adapter_and_child(worker);
    let child = child.expect("the job runs in a forked child");
    // SAFETY: kill(2) of a test's own grandchild.
    unsafe {
        libc::kill(child, libc::SIGKILL);
    }
    wait_until(LONG, "the failure is recorded", || {
        !app.r.failures().is_empty()
    });
    let f = &app.r.failures()[0];
    assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
    assert!(
        f["error"].as_str().unwrap_or_default().contains("SIGKILL"),
        "{f}"
    );
    assert!(
        app.hooks()
            .iter()
            .any(|l| l.starts_with("Slow.on_failure_note Resque::DirtyExit")),
        "{:?}",
        app.hooks()
    );
    app.push("Greeter", json!(["again"]));
    app.processed(2);
    assert!(pid_alive(adapter), "the loaded parent keeps serving");
}

/// §7 "worker SIGKILLed in fork mode": the handler and the job's forked child die with the
/// worker (the handler by PR_SET_PDEATHSIG, the orphaned child by the master, their
/// subreaper); the job is recovered as Resque's DirtyExit and a new worker goes on.
#[test]
fn a_worker_sigkilled_in_fork_mode_takes_its_handler_and_forked_child_with_it() {
    if !have_or_skip("ruby") {
        return;
    }
    let (mut app, worker) = slow_job_running(true);
    let (adapter, child) = adapter_and_child(worker);
    let child = child.expect("the job runs in a forked child");
    // SAFETY: kill(2) of the test's own daemon's worker.
    unsafe {
        libc::kill(worker, libc::SIGKILL);
    }
    wait_until(LONG, "the handler and its child are gone", || {
        !pid_alive(adapter) && !pid_alive(child)
    });
    wait_until(LONG, "the job is recorded", || !app.r.failures().is_empty());
    assert_eq!(app.r.failures()[0]["exception"], "Resque::DirtyExit");
    let before = app.r.processed();
    app.push("Greeter", json!(["after"]));
    wait_until(LONG, "a new worker runs the next job", || {
        app.r.processed() == before + 1 && app.r.llen(&format!("{NS}:queue:q")) == 0
    });
}

/// H-14 with the Ruby adapter: a job killed at once (USR1) has its `on_failure` hooks run by
/// the fresh handler, with the exception the failure record names; the killed process got no
/// SIGTERM, so the job ran no failure path of its own (`Resque::TermException`).
#[test]
fn h14_ruby_on_failure_hooks_run_after_a_kill() {
    if !have_or_skip("ruby") {
        return;
    }
    let (mut app, worker) = slow_job_running(false);
    // SAFETY: kill(2) of the test's own daemon's worker.
    unsafe {
        libc::kill(worker, libc::SIGUSR1);
    }
    wait_until(LONG, "the failure is recorded", || {
        !app.r.failures().is_empty()
    });
    assert_eq!(app.r.failures()[0]["exception"], "Resque::DirtyExit");
    wait_until(LONG, "the hooks ran in the next handler", || {
        app.hooks()
            .iter()
            .any(|l| l.starts_with("Slow.on_failure_note Resque::DirtyExit"))
    });
    let hooks = app.hooks();
    assert!(!hooks.iter().any(|l| l == "Slow finished"), "{hooks:?}");
    assert!(
        !hooks.iter().any(|l| l.contains("TermException")),
        "{hooks:?}"
    );
}

/// H-17: the app of tests/it/fixtures/ruby_failure_app.rb with its failure backend
/// `backend` (`multiple`, `suppress`, `raising`); and its worker's id.
fn backend_app(backend: &str, fork: bool) -> Option<(App, String)> {
    backend_app_with(backend, fork, "")
}

/// The same, with more class tables.
fn backend_app_with(backend: &str, fork: bool, classes: &str) -> Option<(App, String)> {
    if !have_or_skip("ruby") {
        return None;
    }
    let mut command = vec![
        "adapters/ruby/locketd-ruby",
        "tests/it/fixtures/ruby_failure_app.rb",
    ];
    if fork {
        command.push("--fork");
    }
    let mut app = App::start_env(
        &command,
        classes,
        &[
            ("FAILURE_REDIS", "{redis}"),
            ("FAILURE_FILE", "{work}/failures.jsonl"),
            ("FAILURE_BACKEND", backend),
            ("FAILURE_NO_BOOT", "{work}/no-boot"),
        ],
    );
    let id = wait_registered(&mut app.r, &app.daemon);
    Some((app, id))
}

impl App {
    /// What the app's FileBackend saved, one record per line.
    fn saved(&self) -> Vec<Value> {
        std::fs::read_to_string(self._work.path().join("failures.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect()
    }

    fn failed_by(&mut self, worker: &str) -> i64 {
        self.r.int(&format!("{NS}:stat:failed:{worker}"))
    }
}

/// H-17: a job's failure goes through the app's `Resque::Failure::Multiple` (the Redis backend
/// and an error tracker's stand-in) once per failure, after the on_failure hooks, with the
/// exception, message, backtrace, queue and locketd's worker id; locketd adds no record of
/// its own and counts `stat:failed` once per failure. With `--fork` the parent records.
fn check_multiple_backend(fork: bool) {
    let Some((mut app, worker)) = backend_app("multiple", fork) else {
        return;
    };
    app.push("Boom", json!(["x"]));
    app.processed(1);
    let adapter = child_pids(app.daemon.worker_pid())[0];
    // Recorded before the job's FINISH.
    let saved = app.saved();
    assert_eq!(saved.len(), 1, "{saved:?}");
    let s = &saved[0];
    assert_eq!(s["exception"], "ArgumentError", "{s}");
    assert_eq!(s["error"], "boom x", "{s}");
    assert_eq!(s["queue"], "q", "{s}");
    assert_eq!(s["worker"], worker.as_str(), "{s}");
    assert_eq!(s["payload"], json!({"class": "Boom", "args": ["x"]}));
    assert_eq!(
        s["pid"], adapter,
        "the loaded process records, not a forked child: {s}"
    );
    assert!(
        s["backtrace"][0]
            .as_str()
            .unwrap_or_default()
            .contains("ruby_failure_app.rb"),
        "{s}"
    );
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "one record, the app's: {failures:?}");
    let f = &failures[0];
    assert_eq!(f["exception"], "ArgumentError", "{f}");
    assert_eq!(f["error"], "boom x", "{f}");
    assert_eq!(f["queue"], "q", "{f}");
    assert_eq!(f["worker"], worker.as_str(), "{f}");
    assert_eq!(f["payload"], json!({"class": "Boom", "args": ["x"]}));
    assert!(
        f["backtrace"][0]
            .as_str()
            .unwrap_or_default()
            .contains("ruby_failure_app.rb"),
        "{f}"
    );
    assert_eq!(
        app.hooks(),
        ["Boom.on_failure ArgumentError", "save ArgumentError"],
        "hooks first, then the backend, as Resque's Job#fail"
    );
    assert_eq!(app.r.failed_stat(), 1);
    assert_eq!(app.failed_by(&worker), 1);
    app.push("Boom", json!(["y"]));
    app.push("Fine", json!([]));
    app.processed(3);
    assert_eq!(app.saved().len(), 2);
    assert_eq!(app.r.failures().len(), 2);
    assert_eq!(app.r.failures()[1]["error"], "boom y");
    assert_eq!(app.r.failed_stat(), 2);
    assert_eq!(app.failed_by(&worker), 2);
}

#[test]
fn h17_ruby_failures_go_through_the_apps_multiple_backend_once() {
    check_multiple_backend(false);
}

#[test]
fn h17_ruby_fork_failures_are_recorded_by_the_parent_through_the_apps_backend() {
    check_multiple_backend(true);
}

/// H-17 with resque-retry's kind of backend: a failure that the job's on_failure hook retries
/// is not saved, so a job that fails twice then succeeds leaves no record and one that runs
/// out of retries leaves exactly one; `stat:failed` counts every failed attempt.
#[test]
fn h17_a_suppressing_backend_keeps_only_the_last_failure_and_every_attempt_is_counted() {
    let Some((mut app, worker)) = backend_app("suppress", false) else {
        return;
    };
    app.push("Flaky", json!(["a", 3]));
    app.processed(3);
    assert_eq!(app.r.failures(), Vec::<Value>::new());
    assert!(app.saved().is_empty(), "{:?}", app.saved());
    assert_eq!(app.r.failed_stat(), 2);
    assert_eq!(app.failed_by(&worker), 2);
    app.push("Flaky", json!(["b", 0]));
    app.processed(6);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "IOError");
    assert_eq!(failures[0]["error"], "attempt 3");
    assert_eq!(failures[0]["worker"], worker.as_str());
    assert_eq!(app.saved().len(), 1);
    assert_eq!(app.r.failed_stat(), 5);
    assert_eq!(app.failed_by(&worker), 5);
}

/// H-17 + H-14: a handler SIGKILLed mid-job is Resque::DirtyExit; the fresh handler runs the
/// job's on_failure hooks and records it through the app's backend, before the job's FINISH;
/// locketd adds no record. DirtyExit is processed, not failed, as Resque counts it.
#[test]
fn h17_a_sigkilled_handlers_dirty_exit_reaches_the_apps_backend_through_the_fresh_handler() {
    let Some((mut app, worker)) = backend_app("multiple", false) else {
        return;
    };
    app.push("Slow", json!([60]));
    let hooks = app.hook_log.clone();
    wait_until(LONG, "the job runs", || {
        std::fs::read_to_string(&hooks)
            .unwrap_or_default()
            .contains("Slow start")
    });
    let adapter = child_pids(app.daemon.worker_pid())[0];
    // SAFETY: kill(2) of the test's own daemon's handler.
    unsafe {
        libc::kill(adapter, libc::SIGKILL);
    }
    app.processed(1);
    let saved = app.saved();
    assert_eq!(saved.len(), 1, "recorded before FINISH: {saved:?}");
    assert_eq!(saved[0]["exception"], "Resque::DirtyExit", "{}", saved[0]);
    assert_eq!(saved[0]["worker"], worker.as_str());
    assert_eq!(saved[0]["queue"], "q");
    assert_ne!(saved[0]["pid"], adapter, "the fresh handler records");
    assert_eq!(
        app.hooks(),
        [
            "Slow start",
            "Slow.on_failure Resque::DirtyExit",
            "save Resque::DirtyExit"
        ]
    );
    app.push("Fine", json!([]));
    app.processed(2);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    assert!(
        failures[0]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("SIGKILL"),
        "{}",
        failures[0]
    );
    assert_eq!(failures[0]["worker"], worker.as_str());
    assert_eq!(app.r.failed_stat(), 0);
}

/// Waits until the hook log has `line`.
fn wait_hook(app: &App, line: &str) {
    let hooks = app.hook_log.clone();
    wait_until(LONG, line, || {
        std::fs::read_to_string(&hooks)
            .unwrap_or_default()
            .lines()
            .any(|l| l == line)
    });
}

/// The class table of a job whose lost lock puts it back in its queue (A-11).
const REQUEUE_ON_LOST: &str =
    "[classes.Lingering]\nhandler = \"app\"\non_lock_lost = \"requeue\"\n";

impl App {
    /// Takes the lock of the running job with args `[1]` of `class` away, as another
    /// holder's expiry would: the next extension finds it gone.
    fn lose_lock(&mut self, class: &str) {
        let lock_key = format!("{NS}:locket:lock:{}", default_lock_id(class, "[1]"));
        let r = &mut self.r;
        wait_until(LONG, "the lock is held", || r.exists(&lock_key));
        let _: i64 = self.r.cmd(&["DEL", &lock_key]);
    }

    /// Pushes `Fine` behind whatever is queued and waits until it ran: a copy of a job
    /// queued before it has run by then (one worker, FIFO).
    fn drain_behind_sentinel(&mut self, processed_before: i64) {
        self.push("Fine", json!([]));
        let q = format!("{NS}:queue:q");
        let r = &mut self.r;
        wait_until(LONG, "the queue drained behind Fine", || {
            r.llen(&q) == 0 && r.processed() > processed_before
        });
    }

    /// Waits until at least `n` jobs are processed.
    fn processed_at_least(&mut self, n: i64) {
        let r = &mut self.r;
        wait_until(LONG, &format!("{n} jobs processed"), || r.processed() >= n);
    }
}

/// H-14 (issue 23 #2): a lost lock under `on_lock_lost = "requeue"`, the job stopped with
/// `Resque::TermException`: the `stop` frame says `requeue`, so the adapter runs none of the
/// job's `on_failure` hooks (a retry hook would enqueue a copy beside the requeued job) and
/// records nothing through the app's backend; the job runs again exactly once.
fn check_requeued_lost_lock(fork: bool) {
    let Some((mut app, _worker)) = backend_app_with("multiple", fork, REQUEUE_ON_LOST) else {
        return;
    };
    app.push("Lingering", json!([1]));
    wait_hook(&app, "Lingering 1 attempt 1");
    app.lose_lock("Lingering");
    wait_hook(&app, "Lingering 1 attempt 2");
    app.processed_at_least(1);
    app.drain_behind_sentinel(1);
    assert_eq!(
        app.hooks(),
        ["Lingering 1 attempt 1", "Lingering 1 attempt 2"],
        "no on_failure hook, no backend save, no third run"
    );
    assert_eq!(app.saved(), Vec::<Value>::new());
    assert_eq!(app.r.failures(), Vec::<Value>::new());
    assert_eq!(app.r.failed_stat(), 0);
    assert_eq!(app.r.processed(), 2, "the requeue counts no run");
}

#[test]
fn h14_ruby_a_requeued_lost_lock_runs_no_on_failure_hook_and_records_nothing() {
    check_requeued_lost_lock(false);
}

#[test]
fn h14_ruby_fork_a_requeued_lost_lock_runs_no_on_failure_hook_and_records_nothing() {
    check_requeued_lost_lock(true);
}

/// H-17 `--fork`: a child killed by a signal is Resque::DirtyExit, recorded by the parent
/// through the app's backend after its on_failure hooks, as Resque's perform_with_fork does.
#[test]
fn h17_fork_a_killed_childs_dirty_exit_is_recorded_by_the_parent_through_the_backend() {
    let Some((mut app, worker)) = backend_app("multiple", true) else {
        return;
    };
    app.push("Slow", json!([60]));
    wait_hook(&app, "Slow start");
    let (adapter, child) = adapter_and_child(app.daemon.worker_pid());
    // SAFETY: kill(2) of the test's own grandchild.
    unsafe {
        libc::kill(
            child.expect("the job runs in a forked child"),
            libc::SIGKILL,
        );
    }
    app.processed(1);
    let saved = app.saved();
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert_eq!(saved[0]["exception"], "Resque::DirtyExit");
    assert_eq!(saved[0]["pid"], adapter, "the parent records");
    assert_eq!(saved[0]["worker"], worker.as_str());
    assert_eq!(
        app.hooks(),
        [
            "Slow start",
            "Slow.on_failure Resque::DirtyExit",
            "save Resque::DirtyExit"
        ]
    );
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    assert_eq!(app.r.failed_stat(), 0);
}

/// H-17 + H-11: a job that outlives its timeout and survives the TERM is killed; the fresh
/// handler runs its hooks and records Locket::Timeout through the app's backend, before
/// FINISH, which counts it in `stat:failed` and adds no record.
#[test]
fn h17_a_timed_out_jobs_locket_timeout_is_recorded_by_the_fresh_handler() {
    let Some((mut app, worker)) = backend_app_with(
        "multiple",
        false,
        "[classes.Stubborn]\nhandler = \"app\"\ntimeout = \"1s\"\n",
    ) else {
        return;
    };
    app.push("Stubborn", json!([]));
    app.processed(1);
    let saved = app.saved();
    assert_eq!(saved.len(), 1, "recorded before FINISH: {saved:?}");
    assert_eq!(saved[0]["exception"], "Locket::Timeout", "{}", saved[0]);
    assert_eq!(saved[0]["worker"], worker.as_str());
    assert_eq!(
        app.hooks(),
        [
            "Stubborn start",
            "Stubborn ignores TERM",
            "Stubborn.on_failure Locket::Timeout",
            "save Locket::Timeout"
        ]
    );
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Locket::Timeout");
    assert_eq!(app.r.failed_stat(), 1);
    assert_eq!(app.failed_by(&worker), 1);
}

/// H-17: when no fresh handler can start after a kill, locketd records the failure itself;
/// the hooks run later, in the handler that does start, without a second record.
#[test]
fn h17_when_the_fresh_handler_cannot_start_locketd_records_the_killed_job() {
    let Some((mut app, worker)) = backend_app("multiple", false) else {
        return;
    };
    app.push("Slow", json!([60]));
    wait_hook(&app, "Slow start");
    let no_boot = app._work.path().join("no-boot");
    std::fs::write(&no_boot, "").expect("no-boot file");
    let adapter = child_pids(app.daemon.worker_pid())[0];
    // SAFETY: kill(2) of the test's own daemon's handler.
    unsafe {
        libc::kill(adapter, libc::SIGKILL);
    }
    app.processed(1);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "locketd's own record: {failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    assert_eq!(failures[0]["worker"], worker.as_str());
    assert!(app.saved().is_empty(), "{:?}", app.saved());
    std::fs::remove_file(&no_boot).expect("remove no-boot");
    app.push("Fine", json!([]));
    app.processed(2);
    wait_hook(&app, "Slow.on_failure Resque::DirtyExit");
    assert!(app.saved().is_empty(), "{:?}", app.saved());
    assert_eq!(app.r.failures().len(), 1);
}

/// H-17: a backend that raises loses nothing: the failure is locketd's own record, and counted.
#[test]
fn h17_a_failure_backend_that_raises_leaves_locketds_own_record() {
    let Some((mut app, worker)) = backend_app("raising", false) else {
        return;
    };
    app.push("Boom", json!(["z"]));
    app.processed(1);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "ArgumentError");
    assert_eq!(failures[0]["error"], "boom z");
    assert_eq!(failures[0]["worker"], worker.as_str());
    assert_eq!(app.r.failed_stat(), 1);
}

/// H-9 with the Ruby adapter (issue 23 #1): a job that `spawn`s a subprocess and one that
/// backgrounds one through `system("... &")` returns; both are dead before the job is
/// counted processed (as in exec mode: nothing a job started keeps running), and the
/// adapter serves on.
#[test]
fn h9_ruby_a_jobs_spawned_processes_do_not_outlive_it() {
    if !have_or_skip("ruby") {
        return;
    }
    let dir = workdir();
    let app_file = dir.path().join("spawner.rb");
    std::fs::write(
        &app_file,
        "class Spawner\n  def self.perform(dir)\n    \
         File.write(File.join(dir, \"spawn.pid\"), spawn(\"sleep\", \"60\").to_s)\n    \
         system(\"sleep 60 >/dev/null 2>&1 & echo $! > #{dir}/system.pid\")\n  end\nend\n",
    )
    .expect("write the app");
    let app_path = app_file.display().to_string();
    let mut app = App::start(&["adapters/ruby/locketd-ruby", &app_path], "");
    app.push("Spawner", json!([dir.path().display().to_string()]));
    app.processed(1);
    let pid = |name: &str| -> i32 {
        std::fs::read_to_string(dir.path().join(name))
            .expect("the job wrote the pid")
            .trim()
            .parse()
            .expect("a pid")
    };
    let (spawned, backgrounded) = (pid("spawn.pid"), pid("system.pid"));
    assert_eq!(
        [pid_alive(spawned), pid_alive(backgrounded)],
        [false, false],
        "dead when the job is counted"
    );
    assert!(app.r.failures().is_empty(), "{:?}", app.r.failures());
    app.push("Spawner", json!([dir.path().display().to_string()]));
    app.processed(2);
}

/// H-9, H-15 `--fork` (issue 23, a suspicion that held): `started` goes out before any hook
/// runs, `before_fork` included, so a slow `before_fork` is not taken for a wedged handler
/// (killed, the job sent back, then failed as `Locket::HandlerCrashed`).
#[test]
fn h15_ruby_fork_a_slow_before_fork_is_not_a_no_start() {
    if !have_or_skip("ruby") {
        return;
    }
    let dir = workdir();
    let app_file = dir.path().join("slow_fork.rb");
    std::fs::write(
        &app_file,
        "module Resque\n  def self.before_fork = [proc { sleep 2 }]\nend\n\
         class Quick\n  def self.perform(*) = nil\nend\n",
    )
    .expect("write the app");
    let app_path = app_file.display().to_string();
    let mut app = App::start_with(
        &["adapters/ruby/locketd-ruby", &app_path, "--fork"],
        "start_timeout = \"1s\"",
        "",
    );
    app.push("Quick", json!([]));
    app.processed(1);
    assert!(app.r.failures().is_empty(), "{:?}", app.r.failures());
    assert!(
        !app.daemon.log().contains("did not start the job in time"),
        "taken for a wedged handler"
    );
}

/// Whether python3 or the adapter is missing (said once on stderr: the test is skipped).
fn python_app_missing() -> bool {
    if !have("python3")
        || !Path::new(&manifest_dir().join("adapters/python/locketd_handler.py")).exists()
    {
        eprintln!("python3 is not installed: skipped (.ci/run installs it)");
        return true;
    }
    false
}

fn python_app() -> Option<App> {
    if python_app_missing() {
        return None;
    }
    Some(App::start(
        &[
            "python3",
            "adapters/python/locketd_handler.py",
            "examples/python-app/jobs.py",
        ],
        "",
    ))
}

/// H-9: processes that job code started and never waited for are zombies of the adapter once
/// the job is done (locketd killed or outlived them); the adapter reaps them before its next
/// job, so a long-lived handler does not pile them up (they count against TasksMax).
fn check_unwaited_children_are_reaped(command: &[&str]) {
    let mut app = App::start(command, "");
    let worker = app.daemon.worker_pid();
    wait_registered(&mut app.r, &app.daemon);
    app.push("Spawn", json!([5]));
    app.processed(1);
    let adapter = child_pids(worker)
        .into_iter()
        .next()
        .expect("the worker has a handler process");
    wait_until(LONG, "the job's 5 processes are zombies", || {
        zombie_children(adapter) == 5
    });
    app.push("Noop", json!([]));
    app.processed(2);
    assert_eq!(
        child_pids(worker),
        vec![adapter],
        "the same handler ran both"
    );
    assert_eq!(zombie_children(adapter), 0, "reaped before the next job");
}

#[test]
fn h9_ruby_adapter_reaps_the_children_a_job_left_unwaited() {
    if !have_or_skip("ruby") {
        return;
    }
    check_unwaited_children_are_reaped(&[
        "adapters/ruby/locketd-ruby",
        "tests/it/fixtures/spawning_app.rb",
    ]);
}

#[test]
fn h9_python_adapter_reaps_the_children_a_job_left_unwaited() {
    if python_app_missing() {
        return;
    }
    check_unwaited_children_are_reaped(&[
        "python3",
        "adapters/python/locketd_handler.py",
        "tests/it/fixtures/spawning_app.py",
    ]);
}

/// H-16 Python: pyres-style classes and `module:function`, hooks in Resque's order, a
/// failure recorded with the Python exception and traceback.
#[test]
fn h16_python_adapter_runs_pyres_classes_with_hooks() {
    let Some(mut app) = python_app() else { return };
    app.push("Audited", json!(["ok"]));
    app.processed(1);
    app.push("Failing", json!(["x"]));
    app.push("tasks:send_email", json!(["a@example.com"]));
    app.processed(3);
    // Resque's order, as the Ruby adapter runs it: before hooks sorted, perform, after hooks
    // on success; on_failure once for the failure.
    assert_eq!(
        app.hooks(),
        [
            "before_perform_a",
            "before_perform_b",
            "perform [\"ok\"]",
            "after_perform_z",
            "Failing.on_failure_report RuntimeError: boom: ['x']",
        ]
    );
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        !failures[0]["backtrace"]
            .as_array()
            .map(|b| b.is_empty())
            .unwrap_or(true),
        "{failures:?}"
    );
}

/// A Python job module for [`check_requeue_without_hooks`]: `Lingering` sleeps through its
/// first attempt (counted in `{dir}/attempts`), and its `on_failure` hook logs and enqueues a
/// copy as resque-retry does (a bare RESP `RPUSH` to `$FAILURE_REDIS`).
const PYTHON_LINGERING: &str = r#"
import os, socket, time

def log(line):
    with open(os.environ["HOOK_LOG"], "a") as f:
        f.write(line + "\n")

def attempt():
    path = os.path.join(os.path.dirname(os.environ["HOOK_LOG"]), "attempts")
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(n))
    return n

def rpush(key, value):
    host, port = os.environ["FAILURE_REDIS"].split(":")
    with socket.create_connection((host, int(port))) as s:
        parts = [b"RPUSH", key.encode(), value.encode()]
        s.sendall(b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        s.recv(64)

class Lingering:
    @staticmethod
    def perform(key):
        n = attempt()
        log("Lingering %s attempt %d" % (key, n))
        if n == 1:
            time.sleep(30)

    @staticmethod
    def on_failure_retry(exception, key):
        log("Lingering.on_failure " + type(exception).__name__)
        rpush("resque:queue:q", '{"class":"Lingering","args":[%s]}' % key)

class Fine:
    @staticmethod
    def perform(*args):
        pass
"#;

/// The same for Node.
const NODE_LINGERING: &str = r#""use strict";
const fs = require("fs");
const net = require("net");
const path = require("path");
const log = (line) => fs.appendFileSync(process.env.HOOK_LOG, `${line}\n`);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
function attempt() {
  const file = path.join(path.dirname(process.env.HOOK_LOG), "attempts");
  const n = fs.existsSync(file) ? Number(fs.readFileSync(file, "utf8")) + 1 : 1;
  fs.writeFileSync(file, String(n));
  return n;
}
function rpush(key, value) {
  const [host, port] = process.env.FAILURE_REDIS.split(":");
  return new Promise((resolve) => {
    const parts = ["RPUSH", key, value].map((p) => `$${Buffer.byteLength(p)}\r\n${p}\r\n`);
    const s = net.connect(Number(port), host, () => s.write(`*3\r\n${parts.join("")}`));
    s.once("data", () => { s.end(); resolve(); });
    s.once("error", resolve);
  });
}
module.exports.jobs = {
  Lingering: {
    perform: async (key) => {
      const n = attempt();
      log(`Lingering ${key} attempt ${n}`);
      if (n === 1) await sleep(30000);
    },
    onFailure: async (error, key) => {
      log(`Lingering.on_failure ${error.name}`);
      await rpush("resque:queue:q", JSON.stringify({ class: "Lingering", args: [key] }));
    },
  },
  Fine: { perform: async () => {} },
};
"#;

/// H-14 (issue 23 #2) for the Python and Node adapters: the job of a lost lock under
/// `on_lock_lost = "requeue"` is stopped without its `on_failure` hook (which would enqueue
/// a copy), and runs again exactly once.
fn check_requeue_without_hooks(interpreter: &str, adapter: &str, file: &str, module: &str) {
    if !have_or_skip(interpreter) {
        return;
    }
    let dir = workdir();
    let jobs = dir.path().join(file);
    std::fs::write(&jobs, module).unwrap();
    let jobs = jobs.display().to_string();
    let mut app = App::start_env(
        &[interpreter, adapter, &jobs],
        REQUEUE_ON_LOST,
        &[("FAILURE_REDIS", "{redis}")],
    );
    app.push("Lingering", json!([1]));
    wait_hook(&app, "Lingering 1 attempt 1");
    app.lose_lock("Lingering");
    wait_hook(&app, "Lingering 1 attempt 2");
    app.processed_at_least(1);
    app.drain_behind_sentinel(1);
    assert_eq!(
        app.hooks(),
        ["Lingering 1 attempt 1", "Lingering 1 attempt 2"],
        "no on_failure hook, no third run"
    );
    assert_eq!(app.r.failures(), Vec::<Value>::new());
    assert_eq!(app.r.failed_stat(), 0);
    assert_eq!(app.r.processed(), 2, "the requeue counts no run");
}

#[test]
fn h14_python_a_requeued_lost_lock_runs_no_on_failure_hook() {
    check_requeue_without_hooks(
        "python3",
        "adapters/python/locketd_handler.py",
        "lingering_jobs.py",
        PYTHON_LINGERING,
    );
}

#[test]
fn h14_node_a_requeued_lost_lock_runs_no_on_failure_hook() {
    check_requeue_without_hooks(
        "node",
        "adapters/node/locketd-handler.js",
        "lingering_jobs.js",
        NODE_LINGERING,
    );
}

/// H-16 Node: node-resque-style job definitions, awaited; a rejection is a failure.
#[test]
fn h16_node_adapter_runs_node_resque_jobs() {
    if !have("node")
        || !manifest_dir()
            .join("adapters/node/locketd-handler.js")
            .exists()
    {
        eprintln!("node is not installed: skipped (.ci/run installs it)");
        return;
    }
    let mut app = App::start(
        &[
            "node",
            "adapters/node/locketd-handler.js",
            "examples/node-app/jobs.js",
        ],
        "",
    );
    app.push("Noop", json!([1]));
    app.push("Failing", json!([]));
    app.processed(2);
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
}

/// Issue 23 #4, the Node adapter and TERM: the SIGTERM decides the outcome. A job whose
/// promise settles successfully while its `onFailure` hook (run for the TERM) is still going
/// is recorded as the `Resque::TermException` failure the hook was told about, never as a
/// success.
#[test]
fn node_adapter_term_outcome_is_not_overturned_by_a_job_settling_during_on_failure() {
    if !have_or_skip("node") {
        return;
    }
    let module = workdir();
    let jobs = module.path().join("jobs.js");
    std::fs::write(
        &jobs,
        r#""use strict";
const fs = require("fs");
const log = (line) => fs.appendFileSync(process.env.HOOK_LOG, `${line}\n`);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
module.exports.jobs = {
  SettlesDuringHook: {
    perform: async () => { log("perform start"); await sleep(800); log("perform end"); },
    onFailure: async (error) => { log(`onFailure ${error.name}`); await sleep(2000); log("onFailure end"); },
  },
};
"#,
    )
    .unwrap();
    let jobs = jobs.display().to_string();
    let mut app = App::start(&["node", "adapters/node/locketd-handler.js", &jobs], "");
    app.push("SettlesDuringHook", json!([]));
    wait_until(LONG, "the job started", || {
        app.hooks().iter().any(|l| l == "perform start")
    });
    app.daemon.signal(libc::SIGTERM);
    let _ = app.daemon.wait_exit(LONG);
    let hooks = app.hooks();
    assert!(
        hooks.iter().any(|l| l == "onFailure Resque::TermException"),
        "{hooks:?}"
    );
    let failures = app.r.failures();
    assert_eq!(failures.len(), 1, "one failure record: {failures:?}");
    assert_eq!(
        failures[0]["exception"], "Resque::TermException",
        "{failures:?}"
    );
    assert_eq!(app.r.failed_stat(), 1, "the job counted as failed");
    assert_eq!(app.r.processed(), 1, "counted once");
}
