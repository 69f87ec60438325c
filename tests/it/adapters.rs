//! The shipped adapters (issue 13 item 2) through the real `locketd` binary and a private
//! redis-server: the Ruby adapter with the example app (`examples/ruby-app`), in-process and
//! with `--fork`, the Python and Node adapters with theirs. Hooks append to `$HOOK_LOG`, and
//! each hook-order test compares that file with the order Resque's `Job#perform` gives.
//! A test whose interpreter is missing says so and passes; `.ci/run` installs them.
//! Run: `cargo test --test it -- adapters::`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, wait_registered, workdir, NS, R};
use crate::support::{child_pids, manifest_dir, pid_alive, wait_until, Daemon, RedisServer};

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
        App::start_with(command, "", classes)
    }

    /// [`App::start`] with `handler_extra` lines in the `[handlers.app]` table.
    fn start_with(command: &[&str], handler_extra: &str, classes: &str) -> App {
        let redis = RedisServer::start();
        let r = R::new(&redis);
        let work = workdir();
        let hook_log = work.path().join("hooks.log");
        let argv: Vec<String> = command.iter().map(|a| format!("\"{a}\"")).collect();
        let config = format!(
            "{}\n[handlers.app]\nmode = \"persistent\"\ncommand = [{}]\nboot_timeout = \"60s\"\n\
             env = {{ HOOK_LOG = \"{}\" }}\n{handler_extra}\n\n[classes.\"*\"]\nhandler = \"app\"\n{classes}\n",
            cfg("q").render(),
            argv.join(", "),
            hook_log.display()
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
/// the fresh handler, with the exception the failure record names.
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
    assert!(!app.hooks().iter().any(|l| l == "Slow finished"));
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

fn python_app() -> Option<App> {
    if !have("python3")
        || !Path::new(&manifest_dir().join("adapters/python/locketd_handler.py")).exists()
    {
        eprintln!("python3 is not installed: skipped (.ci/run installs it)");
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
