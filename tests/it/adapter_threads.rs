//! The Ruby adapter's threaded mode (issue 38, H-18) at the protocol level: the adapter is
//! driven by `tests/adapters/drive.py` (no daemon, no Redis: what is tested is the adapter's
//! side of the protocol), with `LOCKETD_THREADS` set as locketd sets it for `threads = N`,
//! and the app `tests/adapters/ruby_threads_app.rb`, whose hooks append lines tagged with
//! the job's first argument to `$HOOK_LOG`. Frames are read in the order they arrived.
//! A test whose interpreter is missing says so and passes; `.ci/run` installs them.
//! Run: `cargo test --test it -- adapter_threads::`.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use crate::support::manifest_dir;

const ADAPTER: &str = "adapters/ruby/locketd-ruby";
const APP: &str = "tests/adapters/ruby_threads_app.rb";

/// Whether ruby and python3 run; says the test is skipped when one does not.
fn have_interpreters() -> bool {
    ["ruby", "python3"].iter().all(|program| {
        let there = Command::new(program)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !there {
            eprintln!("{program} is not installed: skipped (.ci/run installs it)");
        }
        there
    })
}

/// One run of drive.py: every line it printed, parsed, and the app's tagged log.
struct Drive {
    lines: Vec<Value>,
    hooks: Vec<String>,
    exit_ok: bool,
    stderr: String,
}

impl Drive {
    /// `drive.py ARGS -- ADAPTER APP [adapter_extra]` from the repository root. drive.py
    /// bounds every wait (--timeout per reply, 10 s for the exit) and kills what is left.
    fn run(args: &[&str], adapter_extra: &[&str]) -> Drive {
        let work = tempfile::tempdir().unwrap();
        let hook_log = work.path().join("hooks.log");
        let out = Command::new("python3")
            .current_dir(manifest_dir())
            .env("HOOK_LOG", &hook_log)
            .env_remove("LOCKETD_THREADS")
            .arg("tests/adapters/drive.py")
            .args(["--timeout", "20"])
            .args(args)
            .args(["--", ADAPTER, APP])
            .args(adapter_extra)
            .output()
            .expect("python3 runs drive.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let lines = stdout
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .collect();
        Drive {
            lines,
            hooks: read_lines(&hook_log),
            exit_ok: out.status.success(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The adapter's frames (lines with a "t"), in arrival order.
    fn frames(&self) -> Vec<&Value> {
        self.lines.iter().filter(|v| v.get("t").is_some()).collect()
    }

    /// Index of the first frame of type `t` for job `id`.
    fn at(&self, t: &str, id: &str) -> usize {
        self.frames()
            .iter()
            .position(|f| f["t"] == t && f["id"] == id)
            .unwrap_or_else(|| panic!("no {t} frame for {id}: {}", self.dump()))
    }

    fn done(&self, id: &str) -> &Value {
        self.frames()[self.at("done", id)]
    }

    fn ready_features(&self) -> Vec<String> {
        let ready = self.frames().into_iter().find(|f| f["t"] == "ready");
        let ready = ready.unwrap_or_else(|| panic!("no ready frame: {}", self.dump()));
        ready["features"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect()
    }

    /// The process groups announced for job `id`.
    fn groups(&self, id: &str) -> Vec<i64> {
        self.frames()
            .iter()
            .filter(|f| f["t"] == "group" && f["id"] == id)
            .map(|f| f["pgid"].as_i64().unwrap())
            .collect()
    }

    /// drive.py's note after the done of job `id`: (alive, dead) announced groups.
    fn groups_after_done(&self, id: &str) -> (Vec<i64>, Vec<i64>) {
        let note = self
            .lines
            .iter()
            .find(|v| v["driver"] == "groups" && v["after_done"] == id)
            .unwrap_or_else(|| panic!("no group note after {id}'s done: {}", self.dump()));
        let list = |key: &str| -> Vec<i64> {
            note[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_i64().unwrap())
                .collect()
        };
        (list("alive"), list("dead"))
    }

    /// The app's log lines of the job tagged `tag`, without the tag.
    fn hooks_of(&self, tag: &str) -> Vec<String> {
        let prefix = format!("{tag} ");
        self.hooks
            .iter()
            .filter_map(|line| line.strip_prefix(&prefix).map(str::to_string))
            .collect()
    }

    fn dump(&self) -> String {
        let lines: Vec<String> = self.lines.iter().map(Value::to_string).collect();
        format!(
            "\n--- drive.py\n{}\n--- hooks\n{}\n--- stderr\n{}",
            lines.join("\n"),
            self.hooks.join("\n"),
            self.stderr
        )
    }
}

fn read_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn tagged(tag: &str, seconds: f64, fail: bool) -> String {
    let mut args = vec![json!(tag), json!(seconds)];
    if fail {
        args.push(json!("fail"));
    }
    json!({"class": "Tagged", "args": args}).to_string()
}

fn spawning(tag: &str, form: &str, job_seconds: f64) -> String {
    json!({"class": "Spawning", "args": [tag, form, 60, job_seconds]}).to_string()
}

/// Resque's `Job#perform` order for `Tagged` (hooks sorted by name, around hooks nested
/// with the first outermost), as the job tagged so logs it.
fn resque_order(fail: bool) -> Vec<String> {
    let mut order = vec![
        "before_perform_a",
        "before_perform_b",
        "around_perform_x enter",
        "around_perform_y enter",
        "perform locals=[nil, nil]",
        "perform ensure",
    ];
    if fail {
        order.extend([
            "on_failure_log ArgumentError",
            "recorded ArgumentError worker=WORKER queue=default",
        ]);
    } else {
        order.extend([
            "around_perform_y exit",
            "around_perform_x exit",
            "after_perform_z",
        ]);
    }
    order.into_iter().map(str::to_string).collect()
}

#[test]
fn h18_ruby_ready_says_threads_only_with_more_than_one_thread() {
    if !have_interpreters() {
        return;
    }
    let unset = Drive::run(&[], &[]);
    assert!(unset.exit_ok, "{}", unset.dump());
    assert!(!unset.ready_features().contains(&"threads".to_string()));
    let one = Drive::run(&["--threads", "1"], &[]);
    assert!(!one.ready_features().contains(&"threads".to_string()));
    let two = Drive::run(&["--threads", "2"], &[]);
    assert!(two.exit_ok, "{}", two.dump());
    assert!(
        two.ready_features().contains(&"threads".to_string()),
        "{}",
        two.dump()
    );
    // --fork runs one job at a time in a child: with threads it refuses to start, and says why.
    let fork = Drive::run(&["--threads", "2"], &["--fork"]);
    assert!(
        fork.lines
            .iter()
            .any(|v| v["driver"] == "exit" && v["exit"] == 2),
        "{}",
        fork.dump()
    );
    assert!(fork.stderr.contains("LOCKETD_THREADS"), "{}", fork.dump());
}

#[test]
fn h18_ruby_two_jobs_run_at_once_in_one_process() {
    if !have_interpreters() {
        return;
    }
    let a = tagged("A", 1.5, false);
    let b = tagged("B", 1.5, false);
    let d = Drive::run(
        &[
            "--threads",
            "2",
            "--concurrent",
            "2",
            "--id",
            "A",
            "--payload",
            &a,
            "--id",
            "B",
            "--payload",
            &b,
        ],
        &[],
    );
    assert!(d.exit_ok, "{}", d.dump());
    // Both started before either is done: they ran at once, in the one adapter process.
    let first_done = d.at("done", "A").min(d.at("done", "B"));
    assert!(d.at("started", "A") < first_done, "{}", d.dump());
    assert!(d.at("started", "B") < first_done, "{}", d.dump());
    let readies = d.frames().iter().filter(|f| f["t"] == "ready").count();
    assert_eq!(readies, 1, "{}", d.dump());
    for id in ["A", "B"] {
        assert_eq!(d.done(id)["status"], "ok", "{}", d.dump());
        assert_eq!(d.hooks_of(id), resque_order(false), "{}", d.dump());
    }
}

#[test]
fn h18_ruby_hook_order_failure_record_and_locals_are_per_job_under_concurrency() {
    if !have_interpreters() {
        return;
    }
    // Three jobs at once, one failing: each job's hooks in Resque's order, its failure
    // recorded through the app's backend (H-17) with its own payload, fresh locals each.
    let jobs = [("A", 1.2, false), ("B", 0.6, true), ("C", 0.9, false)];
    let payloads: Vec<String> = jobs.iter().map(|(t, s, f)| tagged(t, *s, *f)).collect();
    let mut args = vec!["--threads", "3", "--concurrent", "3"];
    for ((tag, _, _), payload) in jobs.iter().zip(&payloads) {
        args.extend(["--id", tag, "--payload", payload]);
    }
    let d = Drive::run(&args, &[]);
    assert!(d.exit_ok, "{}", d.dump());
    // They overlapped: every job's perform began before any job's perform ended.
    let last_begin = d
        .hooks
        .iter()
        .rposition(|l| l.contains(" perform locals="))
        .unwrap();
    let first_end = d
        .hooks
        .iter()
        .position(|l| l.ends_with("perform ensure"))
        .unwrap();
    assert!(last_begin < first_end, "{}", d.dump());
    for (tag, _, fail) in jobs {
        let expected: Vec<String> = resque_order(fail)
            .into_iter()
            .map(|l| l.replace("WORKER", &driver_worker(&d)))
            .collect();
        assert_eq!(d.hooks_of(tag), expected, "{tag}: {}", d.dump());
        let done = d.done(tag);
        if fail {
            assert_eq!(done["status"], "failed", "{}", d.dump());
            assert_eq!(done["exception"], "ArgumentError");
            assert_eq!(done["recorded"], true, "{}", d.dump());
        } else {
            assert_eq!(done["status"], "ok", "{}", d.dump());
        }
    }
}

/// The worker id drive.py puts in job frames: "driver:<its pid>:default".
fn driver_worker(d: &Drive) -> String {
    let recorded = d
        .hooks
        .iter()
        .find_map(|l| l.split(" worker=").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or("driver:?:default");
    assert!(recorded.starts_with("driver:") && recorded.ends_with(":default"));
    recorded.to_string()
}

#[test]
fn h18_ruby_a_stop_raises_term_exception_in_its_job_alone() {
    if !have_interpreters() {
        return;
    }
    let a = tagged("A", 30.0, false);
    let b = tagged("B", 1.5, false);
    let r = tagged("R", 30.0, false);
    let d = Drive::run(
        &[
            "--threads",
            "3",
            "--concurrent",
            "3",
            "--id",
            "A",
            "--payload",
            &a,
            "--id",
            "B",
            "--payload",
            &b,
            "--id",
            "R",
            "--payload",
            &r,
            "--stop-after",
            "A:0.5",
            "--stop-after",
            "R:0.5:requeue",
        ],
        &[],
    );
    assert!(d.exit_ok, "{}", d.dump());
    // A: Resque::TermException raised in its perform, its ensure and on_failure hook ran,
    // and the failure went to the app's backend.
    let done = d.done("A");
    assert_eq!(done["status"], "failed", "{}", d.dump());
    assert_eq!(done["exception"], "Resque::TermException", "{}", d.dump());
    let a_hooks = d.hooks_of("A");
    assert!(
        a_hooks.contains(&"on_failure_log Resque::TermException".to_string()),
        "{}",
        d.dump()
    );
    assert!(a_hooks
        .iter()
        .any(|l| l.starts_with("recorded Resque::TermException")));
    assert!(!a_hooks.contains(&"after_perform_z".to_string()));
    // R: stopped to be requeued (H-14): no on_failure hook, no record.
    let done = d.done("R");
    assert_eq!(done["exception"], "Resque::TermException", "{}", d.dump());
    assert_ne!(done["recorded"], true, "{}", d.dump());
    let r_hooks = d.hooks_of("R");
    assert!(
        r_hooks.contains(&"perform ensure".to_string()),
        "{}",
        d.dump()
    );
    assert!(
        !r_hooks
            .iter()
            .any(|l| l.starts_with("on_failure") || l.starts_with("recorded")),
        "{}",
        d.dump()
    );
    // B: untouched, and it ended after both stops.
    assert_eq!(d.done("B")["status"], "ok", "{}", d.dump());
    assert_eq!(d.hooks_of("B"), resque_order(false), "{}", d.dump());
    assert!(d.at("done", "A") < d.at("done", "B"), "{}", d.dump());
}

#[test]
fn h18_ruby_a_jobs_subprocesses_are_in_its_own_group_and_die_at_its_done() {
    if !have_interpreters() {
        return;
    }
    // Each subprocess form in a job of its own, all at once, ending one after the other
    // while a sibling (Z, the longest) still runs with its own child.
    let forms = [
        ("S", "system"),
        ("T", "backticks"),
        ("P", "process_spawn"),
        ("K", "kernel_spawn"),
        ("I", "popen"),
        ("O", "open3"),
        ("F", "fork"),
    ];
    let payloads: Vec<String> = forms
        .iter()
        .enumerate()
        .map(|(i, (tag, form))| spawning(tag, form, 0.4 + 0.3 * i as f64))
        .chain([spawning("Z", "process_spawn", 3.5)])
        .collect();
    let mut args = vec!["--threads", "8", "--concurrent", "8"];
    for ((tag, _), payload) in forms.iter().chain([("Z", "")].iter()).zip(&payloads) {
        args.extend(["--id", tag, "--payload", payload]);
    }
    let d = Drive::run(&args, &[]);
    assert!(d.exit_ok, "{}", d.dump());
    let adapter_pid = d.frames()[0]["pid"].as_i64().unwrap();
    let sibling = d.groups("Z");
    assert_eq!(sibling.len(), 1, "{}", d.dump());
    for (tag, form) in forms {
        let groups = d.groups(tag);
        assert_eq!(groups.len(), 1, "{form}: one group: {}", d.dump());
        assert_ne!(groups[0], adapter_pid, "{}", d.dump());
        assert!(d.at("group", tag) < d.at("done", tag), "{}", d.dump());
        let (alive, dead) = d.groups_after_done(tag);
        assert!(dead.contains(&groups[0]), "{form}: {}", d.dump());
        assert!(alive.contains(&sibling[0]), "{form}: {}", d.dump());
        assert_eq!(d.done(tag)["status"], "ok", "{form}: {}", d.dump());
    }
    let (alive, _) = d.groups_after_done("Z");
    assert!(alive.is_empty(), "{}", d.dump());
    // system and backticks keep their results, $? and captured output.
    assert!(
        d.hooks_of("S").contains(&"system true 0".to_string()),
        "{}",
        d.dump()
    );
    assert!(
        d.hooks_of("T")
            .contains(&"backticks \"out\\n\" 0".to_string()),
        "{}",
        d.dump()
    );
}

#[test]
fn h18_ruby_failure_hooks_run_while_jobs_run() {
    if !have_interpreters() {
        return;
    }
    let a = tagged("A", 3.0, false);
    let hooks = json!({
        "t": "failure_hooks", "id": "F", "payload": tagged("F", 0.0, false),
        "exception": "Resque::DirtyExit", "error": "killed", "record": true,
        "queue": "default", "worker": "w:1:default"
    })
    .to_string();
    let d = Drive::run(
        &[
            "--threads",
            "2",
            "--concurrent",
            "2",
            "--id",
            "A",
            "--payload",
            &a,
            "--frame",
            &hooks,
        ],
        &[],
    );
    assert!(d.exit_ok, "{}", d.dump());
    assert!(d.at("done", "F") < d.at("done", "A"), "{}", d.dump());
    assert_eq!(d.done("F")["recorded"], true, "{}", d.dump());
    assert_eq!(
        d.hooks_of("F"),
        vec![
            "on_failure_log Resque::DirtyExit".to_string(),
            "recorded Resque::DirtyExit worker=w:1:default queue=default".to_string()
        ],
        "{}",
        d.dump()
    );
    assert_eq!(d.done("A")["status"], "ok", "{}", d.dump());
}

#[test]
fn h18_ruby_sigterm_still_shuts_down_every_running_job() {
    if !have_interpreters() {
        return;
    }
    // SIGTERM keeps its meaning with threads: Resque::TermException in every running
    // job (their on_failure hooks run), then `bye` and exit 0.
    let a = tagged("A", 30.0, false);
    let b = tagged("B", 30.0, false);
    let d = Drive::run(
        &[
            "--threads",
            "2",
            "--signal",
            "pid:TERM:0.5",
            "--concurrent",
            "2",
            "--id",
            "A",
            "--payload",
            &a,
            "--id",
            "B",
            "--payload",
            &b,
        ],
        &[],
    );
    for id in ["A", "B"] {
        assert_eq!(
            d.done(id)["exception"],
            "Resque::TermException",
            "{}",
            d.dump()
        );
        assert!(
            d.hooks_of(id)
                .contains(&"on_failure_log Resque::TermException".to_string()),
            "{}",
            d.dump()
        );
    }
    assert!(d.frames().iter().any(|f| f["t"] == "bye"), "{}", d.dump());
    assert!(
        d.lines
            .iter()
            .any(|v| v["driver"] == "exit" && v["exit"] == 0),
        "{}",
        d.dump()
    );
}
