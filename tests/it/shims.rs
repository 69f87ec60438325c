//! The client shims (clients/node/locketd-resque.js, clients/python/locketd_pyres.py) with the
//! real client libraries (node-resque 9.7.1 from tests/node, pyres from PyPI in the venv
//! .ci/run makes): they find PUSH in `<ns>:locket:push` (D-3a), place the enqueue-time holds
//! with the push (seed 001), and return false for a push `unique` refused (U-1).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::admin::cli;
use crate::daemon::{workdir, NS, R};
use crate::push::{assert_b_after_a, events, logger, plans, seed_001_cfg};
use crate::support::{manifest_dir, node_resque_dir, run_node, wait_until, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

/// What an enqueue through a shim returned, one per job of `jobs` (`[{queue, class, args}]`).
pub(crate) type Enqueue = dyn Fn(u16, &Value) -> Vec<bool>;

/// redis-server arguments that take Redis 7's FUNCTION commands away, as on Redis 6: no
/// library can be loaded, and the daemon, `locketd enqueue` and the shims run PUSH by EVALSHA.
pub(crate) const REDIS_6: &[&str] = &[
    "--rename-command",
    "FUNCTION",
    "",
    "--rename-command",
    "FCALL",
    "",
    "--rename-command",
    "FCALL_RO",
    "",
];

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
/// before any daemon published is a plain push, returning true. `redis_args` start the
/// redis-server ([`REDIS_6`]: no FUNCTION, so PUSH goes by EVALSHA, the daemon's job path too).
pub(crate) fn seed_001_story(enqueue: &Enqueue, redis_args: &[&str]) {
    let redis = RedisServer::start_with(redis_args);
    let redis6 = !redis_args.is_empty();
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
        let entry: std::collections::HashMap<String, String> =
            r.cmd(&["HGETALL", &format!("{NS}:locket:push")]);
        assert!(
            entry.contains_key("sha1") && entry.contains_key("sha1_at"),
            "{entry:?}"
        );
        // Without FUNCTION, no FCALL name is published: clients go straight to EVALSHA.
        assert_eq!(entry.contains_key("function"), !redis6, "{entry:?}");
        if workers == 2 {
            if !redis6 {
                let _: () = r.cmd(&["FUNCTION", "FLUSH"]);
            }
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
    seed_001_story(&node_enqueue, &[]);
}

#[test]
fn pyres_through_the_shim_places_holds_and_refuses_duplicates() {
    let Some(python) = pyres_python() else {
        return;
    };
    seed_001_story(&pyres_enqueue(python), &[]);
}

/// The Redis-6 path: a redis-server without FUNCTION, FCALL and FCALL_RO. The daemon runs its
/// job path by EVALSHA and publishes PUSH without an FCALL name; node-resque and pyres push
/// through the shims with their holds by EVALSHA (and SCRIPT LOAD after a SCRIPT FLUSH), and
/// node-resque's enqueueAt schedules through PUSH_AT by EVALSHA;
/// `locketd enqueue`, now and `--in`, places its holds the same way.
#[test]
fn without_functions_the_daemon_the_cli_and_the_shims_push_by_evalsha() {
    seed_001_story(&node_enqueue, REDIS_6);
    delayed_story(&node_enqueue, REDIS_6);
    if let Some(python) = pyres_python() {
        seed_001_story(&pyres_enqueue(python), REDIS_6);
    }
    let redis = RedisServer::start_with(REDIS_6);
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        "queues = \"q\"\n[classes.\"Held\"]\ncommand = [\"/bin/true\"]\n\
         holds = [ { name = \"h:{args[0]}\", when = \"enqueue\" } ]\n",
    )
    .unwrap();
    for (arg, delayed) in [("1", &[][..]), ("2", &["--in", "1h"][..])] {
        let mut argv = vec!["enqueue", "q", "Held", arg];
        argv.extend_from_slice(delayed);
        let out = cli(&redis, &config, &argv);
        assert!(out.status.success(), "{out:?}");
        assert!(r.exists(&format!("{NS}:locket:dep:h:{arg}")), "{out:?}");
    }
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 1);
    let scheduled: i64 = r.cmd(&["ZCARD", &format!("{NS}:delayed_queue_schedule")]);
    assert_eq!(scheduled, 1);
}

/// Seed 001 with a delayed A (D-3b) through a shim: A for orders 1..=3 is scheduled (`at` in
/// the jobs: node-resque's enqueueAt, resque-scheduler's enqueue_at) five seconds ahead, its
/// hold placed when it is scheduled; B (`locked_by` it) is pushed plainly to the queue the
/// workers take first, reserved long before A is due, and must not start before A (delivered
/// by locketd's scheduler) succeeded. A `unique` duplicate scheduled returns false and writes
/// nothing. `redis_args` start the redis-server, as for [`seed_001_story`].
pub(crate) fn delayed_story(enqueue: &Enqueue, redis_args: &[&str]) {
    let redis = RedisServer::start_with(redis_args);
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let a = logger(work.path(), "a.sh", &log, "sleep 0.3");
    let b = logger(work.path(), "b.sh", &log, "true");
    let config = seed_001_cfg(&a, &b, 2)
        .class(
            "Sync",
            &b,
            "unique = \"until_expired\"\nunique_ttl = \"60s\"\nunique_key = \"sync:{args[0]}\"",
        )
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "plans published", || {
        plans(&mut r).contains_key("Webhook::Receive")
    });
    assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // A is due a few seconds from now: after the client has scheduled it (a client whose
    // start takes longer pushes it at once, as enqueue_at does for a time past: the bucket
    // check below says so).
    let (at, later) = (now + 5, now + 3600);
    let mut jobs: Vec<Value> = (1..=3)
        .map(|i| json!({"queue": "a", "class": "Webhook::Receive", "args": [i, {"event": "paid"}], "at": at}))
        .collect();
    // The duplicate a second later: node-resque itself refuses the same item at the same
    // second, before any push.
    for (k, t) in [(7, later), (7, later + 1), (8, later)] {
        jobs.push(json!({"queue": "u", "class": "Sync", "args": [k], "at": t}));
    }
    assert_eq!(
        enqueue(redis.port(), &Value::from(jobs)),
        [true, true, true, true, false, true]
    );
    for n in 1..=3 {
        assert!(
            r.exists(&format!("{NS}:locket:dep:order:{n}")),
            "no hold placed when A {n} was scheduled"
        );
        r.push(
            "b",
            &format!(r#"{{"class":"Order::CancelUnshipped","args":[{n}]}}"#),
        );
    }
    assert_eq!(r.llen(&format!("{NS}:delayed:{at}")), 3);
    assert_eq!(r.llen(&format!("{NS}:delayed:{later}")), 2);
    let second = later + 1;
    assert!(
        !r.exists(&format!("{NS}:delayed:{second}")),
        "the duplicate wrote nothing"
    );
    let scheduled: i64 = r.cmd(&["ZCARD", &format!("{NS}:delayed_queue_schedule")]);
    assert_eq!(scheduled, 2, "the duplicate wrote nothing");
    assert_eq!(r.llen(&format!("{NS}:queue:a")), 0);
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "every job ran", || {
        events(&log).iter().filter(|e| e.0 == "end").count() == 6
    });
    assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
    assert_b_after_a(&mut r, &log, 3);
}

#[test]
fn node_resque_enqueue_at_through_the_shim_places_holds_when_scheduled() {
    delayed_story(&node_enqueue, &[]);
}
