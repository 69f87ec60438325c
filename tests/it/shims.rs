//! The client shims (clients/node/locketd-resque.js, clients/python/locketd_pyres.py) with the
//! real client libraries (node-resque 9.7.1 from tests/node, pyres from PyPI in the venv
//! .ci/run makes): they find PUSH in `<ns>:locket:push` (D-3a), place the enqueue-time holds
//! with the push (seed 001), and return false for a push `unique` refused (U-1).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{workdir, NS, R};
use crate::push::{assert_b_after_a, events, logger, plans, seed_001_cfg};
use crate::support::{manifest_dir, node_resque_dir, run_node, wait_until, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

/// What an enqueue through a shim returned, one per job of `jobs` (`[{queue, class, args}]`).
type Enqueue = dyn Fn(u16, &Value) -> Vec<bool>;

fn node_enqueue(port: u16, jobs: &Value) -> Vec<bool> {
    // As in an app that copied the shim beside its code: node-resque is in its node_modules.
    let modules = node_resque_dir().join("node_modules");
    let config = json!({"port": port, "namespace": NS, "jobs": jobs}).to_string();
    let (status, stdout, stderr) = run_node(
        "shim_enqueue.js",
        &[&config],
        &[("NODE_PATH", &modules.display().to_string())],
        LONG,
    );
    assert!(status.success(), "{stdout}\n{stderr}");
    let out: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("node printed no JSON ({e}): {stdout}\n{stderr}"));
    assert_eq!(out["ok"], json!(true), "{out}");
    serde_json::from_value(out["pushed"].clone()).unwrap()
}

/// The venv's interpreter with pyres (`target/pyres-venv`, made by .ci/run), or None outside
/// CI when it is missing (said on stderr: the test is skipped). In CI it must be there.
fn pyres_python() -> Option<PathBuf> {
    let python = manifest_dir().join("target/pyres-venv/bin/python");
    if python.is_file() {
        return Some(python);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: .ci/run makes it (python3 -m venv target/pyres-venv; pip install pyres)",
        python.display()
    );
    eprintln!(
        "pyres is not installed in {}: skipped (.ci/run installs it)",
        python.display()
    );
    None
}

fn pyres_enqueue(python: PathBuf) -> impl Fn(u16, &Value) -> Vec<bool> {
    move |port, jobs| {
        let script = manifest_dir().join("tests/python/pyres_shim_enqueue.py");
        let out = Command::new(&python)
            .arg(&script)
            .arg(json!({"port": port, "jobs": jobs}).to_string())
            .stdin(Stdio::null())
            .output()
            .expect("run the venv's python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "pyres: {stdout}\n{stderr}");
        let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
            .unwrap_or_else(|e| panic!("pyres printed no JSON ({e}): {stdout}\n{stderr}"));
        serde_json::from_value(v["pushed"].clone()).unwrap()
    }
}

/// Seed 001 through a shim (D-3, D-3a, D-5): webhooks A for orders n are enqueued through the
/// shim while no daemon runs (PUSH found in `<ns>:locket:push`, the holds placed with the
/// push), their cancels B (`locked_by`) by a plain RPUSH to a queue the workers take first. B is
/// reserved first and must not start before A succeeded, with one worker and with two. In the
/// second round Redis has lost its functions and scripts: the shim re-reads the entry once and
/// loads the published script. A `unique = "until_expired"` duplicate returns false; a push
/// before any daemon published is a plain push, returning true.
fn seed_001_story(enqueue: &Enqueue) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let port = redis.port();
    // No daemon ever published: the library's own push, no holds.
    let first = enqueue(
        port,
        &json!([{"queue": "u", "class": "Early", "args": [1]}]),
    );
    assert_eq!(first, [true]);
    assert_eq!(r.llen(&format!("{NS}:queue:u")), 1);
    let work = workdir();
    let log = work.path().join("runs.log");
    let a = logger(work.path(), "a.sh", &log, "sleep 0.3");
    let b = logger(work.path(), "b.sh", &log, "true");
    let config_for = |workers: usize| {
        seed_001_cfg(&a, &b, workers)
            .class(
                "Sync",
                &b,
                "unique = \"until_expired\"\nunique_ttl = \"60s\"\nunique_key = \"sync:{args[0]}\"",
            )
            .render()
    };
    let mut n: u64 = 0;
    for workers in [1, 2] {
        let config = config_for(workers);
        let mut d = Daemon::start(&redis, &config, &[]);
        wait_until(LONG, "plans published and the workers registered", || {
            plans(&mut r).contains_key("Webhook::Receive") && r.workers().len() == workers
        });
        assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
        if workers == 2 {
            let _: () = r.cmd(&["FUNCTION", "FLUSH"]);
            let _: () = r.cmd(&["SCRIPT", "FLUSH"]);
        }
        let jobs: Vec<Value> = (n + 1..=n + 3)
            .map(|i| json!({"queue": "a", "class": "Webhook::Receive", "args": [i, {"event": "paid"}]}))
            .collect();
        assert_eq!(enqueue(port, &Value::from(jobs)), [true, true, true]);
        for _ in 0..3 {
            n += 1;
            assert!(
                r.exists(&format!("{NS}:locket:dep:order:{n}")),
                "no hold placed with A {n}"
            );
            r.push(
                "b",
                &format!(r#"{{"class":"Order::CancelUnshipped","args":[{n}]}}"#),
            );
        }
        let mut d = Daemon::start(&redis, &config, &[]);
        wait_until(LONG, "every job ran", || {
            events(&log).iter().filter(|e| e.0 == "end").count() as u64 == 2 * n
        });
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
    assert_b_after_a(&mut r, &log, n);
    // U-1: a duplicate within unique_ttl is refused (false), other args are pushed.
    let sync = |k: u64| json!({"queue": "u", "class": "Sync", "args": [k]});
    let replies = enqueue(port, &json!([sync(7), sync(7), sync(8)]));
    assert_eq!(replies, [true, false, true]);
    assert_eq!(r.llen(&format!("{NS}:queue:u")), 3);
}

#[test]
fn node_resque_through_the_shim_places_holds_and_refuses_duplicates() {
    seed_001_story(&node_enqueue);
}

#[test]
fn pyres_through_the_shim_places_holds_and_refuses_duplicates() {
    let Some(python) = pyres_python() else {
        return;
    };
    seed_001_story(&pyres_enqueue(python));
}
