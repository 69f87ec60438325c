//! The operator commands through the real binary (locking-semantics.md O-2, O-3, D-3):
//! `locketd enqueue`, `locks`, `locks release`, `counters`, `holds`, `delayed`, `stats`.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

/// `locketd --config <config> --redis <redis> <args>`, its output.
pub(crate) fn cli(redis: &RedisServer, config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(config)
        .arg("--redis")
        .arg(redis.url())
        .args(args)
        .output()
        .expect("run locketd")
}

#[track_caller]
fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[track_caller]
fn json_out(out: &Output) -> Value {
    let text = ok(out);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn write_config(dir: &Path, text: &str) -> std::path::PathBuf {
    let p = dir.join("admin.toml");
    std::fs::write(&p, text).unwrap();
    p
}

const HOLDS: &str = r#"
[classes."Orders::Ship"]
command = ["/bin/true"]
holds = [ { name = "order:{args[0].id}" } ]
"#;

/// D-3, T-2, O-2: `locketd enqueue` pushes Resque's exact format (class first, args as written:
/// member order, big integers and floats kept, whitespace dropped) and adds the enqueue-time
/// holds in the same step; `--json` reports it.
#[test]
fn enqueue_pushes_resques_format_and_places_holds() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = write_config(dir.path(), HOLDS);
    let out = json_out(&cli(
        &redis,
        &config,
        &[
            "enqueue",
            "ship",
            "Orders::Ship",
            r#"{ "id": 12345678901234567890, "b": 1.0, "a": "é" }"#,
            "true",
            "--json",
        ],
    ));
    let expected =
        r#"{"class":"Orders::Ship","args":[{"id":12345678901234567890,"b":1.0,"a":"é"},true]}"#;
    assert_eq!(out["payload"], expected);
    assert_eq!(
        out["holds"],
        serde_json::json!(["order:12345678901234567890"])
    );
    let queue: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:ship"), "0", "-1"]);
    assert_eq!(queue, [expected]);
    let queues: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:queues")]);
    assert_eq!(queues, ["ship"]);
    let hold: HashMap<String, String> = r.cmd(&[
        "HGETALL",
        &format!("{NS}:locket:dep:order:12345678901234567890"),
    ]);
    assert_eq!(hold.len(), 1);
    assert_eq!(hold.keys().next().unwrap(), out["digest"].as_str().unwrap());

    // `locketd holds` lists it; `holds release --digest` with the 12 characters the table
    // shows removes one count.
    let holds = json_out(&cli(&redis, &config, &["holds", "--json"]));
    assert_eq!(holds[0]["name"], "order:12345678901234567890");
    assert_eq!(holds[0]["count"], 1);
    let text = ok(&cli(&redis, &config, &["holds"]));
    assert!(text.contains("order:12345678901234567890"), "{text}");
    let digest = &out["digest"].as_str().unwrap()[..12];
    assert!(text.contains(digest), "{text}");
    ok(&cli(
        &redis,
        &config,
        &[
            "holds",
            "release",
            "order:12345678901234567890",
            "--digest",
            digest,
        ],
    ));
    let holds = json_out(&cli(&redis, &config, &["holds", "--json"]));
    assert_eq!(holds, serde_json::json!([]));
}

/// D-3, NEVER-6, E-2: a bad argument or a hold template that cannot render is an error, and
/// nothing is pushed and no hold is added.
#[test]
fn enqueue_refuses_bad_input_and_pushes_nothing() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = write_config(dir.path(), HOLDS);
    for args in [
        &["enqueue", "ship", "Orders::Ship", "{not json"][..],
        &["enqueue", "ship", "Orders::Ship", "42"][..],
    ] {
        let out = cli(&redis, &config, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("cannot enqueue"), "{err}");
    }
    assert_eq!(r.llen(&format!("{NS}:queue:ship")), 0);
    assert!(r.keys(&format!("{NS}:locket:dep:*")).is_empty());
}

/// D-3, D-3a: the printed script is PUSH, loaded as a client in another language would: with
/// the documented keys and arguments it renders the class's hold from the published plan,
/// places it and pushes.
#[test]
fn the_printed_enqueue_script_is_callable_by_other_clients() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = write_config(dir.path(), HOLDS);
    // A first `locketd enqueue` offers the configuration's plans (no daemon runs here).
    ok(&cli(
        &redis,
        &config,
        &["enqueue", "ship", "Orders::Ship", r#"{"id":1}"#],
    ));
    let script = ok(&cli(&redis, &config, &["enqueue", "--print-script"]));
    assert!(script.contains("KEYS[3]  <ns>:locket:plans"), "{script}");
    let sha: String = r.cmd(&["SCRIPT", "LOAD", &script]);
    let reply: Vec<String> = r.cmd(&[
        "EVALSHA",
        &sha,
        "3",
        &format!("{NS}:queue:py"),
        &format!("{NS}:queues"),
        &format!("{NS}:locket:plans"),
        "py",
        r#"{"class": "Orders::Ship", "queue": "py", "args": [{"id": 2.0}]}"#,
        &format!("{NS}:locket:"),
    ]);
    assert_eq!(reply, ["1", "1", "order:2"]);
    let hold: HashMap<String, String> = r.cmd(&["HGETALL", &format!("{NS}:locket:dep:order:2")]);
    let digest = locketd::locks::canonical::digest("Orders::Ship", &serde_json::json!([{"id": 2}]));
    assert!(hold[&digest].starts_with("1:"), "{hold:?}");
    // O-3: its event is counted, as when locketd enqueues.
    assert_eq!(r.int(&format!("{NS}:locket:stat:holds_added")), 2);
}

/// O-2, A-11, NEVER-5: `locketd locks` shows the live holder of a running job (class, queue,
/// worker, time left); `locks release --token` with a wrong token changes nothing; `--force`
/// removes it, and the running job's supervisor finds out at its next heartbeat and records
/// Locket::LockLost.
#[test]
fn locks_lists_holders_and_force_release_makes_the_job_lose_its_lock() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pidf = work.path().join("pid");
    let h = write_script(
        work.path(),
        "long.sh",
        &format!("echo $$ > {}\nsleep 20", pidf.display()),
    );
    let config_text = cfg("q")
        .class("Long::Job", &h, "lock = \"long:{args[0]}\"\nfencing = true")
        .render();
    let config = write_config(work.path(), &config_text);
    let mut d = Daemon::start(&redis, &config_text, &[]);
    r.push("q", r#"{"class":"Long::Job","args":[3]}"#);
    wait_until(LONG, "the job started", || !read_lossy(&pidf).is_empty());
    let locks = json_out(&cli(&redis, &config, &["locks", "--json"]));
    assert_eq!(locks[0]["lock_id"], "long:3");
    let holder = &locks[0]["holders"][0];
    assert_eq!(holder["class"], "Long::Job");
    assert_eq!(holder["queue"], "q");
    assert_eq!(holder["fence"], 1);
    assert!(holder["resque_worker"]
        .as_str()
        .unwrap()
        .contains(&format!(":{}:", d.worker_pid())));
    let left = holder["left_ms"].as_i64().unwrap();
    assert!(left > 0 && left <= 2000, "{left}");
    let table = ok(&cli(&redis, &config, &["locks", "--prefix", "long:"]));
    assert!(
        table.contains("long:3") && table.contains("Long::Job"),
        "{table}"
    );
    let none = ok(&cli(&redis, &config, &["locks", "--prefix", "other"]));
    assert!(none.contains("no locks"), "{none}");

    let out = cli(
        &redis,
        &config,
        &["locks", "release", "long:3", "--token", "nope"],
    );
    assert!(!out.status.success());
    assert_eq!(
        json_out(&cli(&redis, &config, &["locks", "--json"]))[0]["lock_id"],
        "long:3"
    );

    let out = cli(&redis, &config, &["locks", "release", "long:3", "--force"]);
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("force-released 1"));
    wait_until(LONG, "the job failed as LockLost", || {
        r.failures().len() == 1
    });
    assert_eq!(r.failures()[0]["exception"], "Locket::LockLost");
    // The job path's counts (`started`) reach Redis with the worker's next flush, at most a
    // second later (O-3); the admin step wrote its own (`force_released`) at once.
    let mut stats = Value::Null;
    wait_until(LONG, "the worker's counts to be flushed", || {
        stats = json_out(&cli(&redis, &config, &["stats", "--json"]));
        stats["events"]["started"]["recent_by_class"]["Long::Job"] != Value::Null
    });
    assert_eq!(stats["events"]["force_released"]["total"], 1);
    assert!(stats["events"]["lock_lost"]["total"].as_i64().unwrap() >= 1);
    assert_eq!(
        stats["events"]["started"]["recent_by_class"]["Long::Job"],
        1
    );
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

/// O-2, A-16: `locketd counters` shows each queue's counter with its length and time left;
/// `--reset` deletes one, `--reset-all` every one.
#[test]
fn counters_are_listed_and_reset() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = write_config(dir.path(), "");
    for q in ["a", "b"] {
        r.push(q, r#"{"class":"X","args":[]}"#);
        let _: () = r.cmd(&[
            "SET",
            &format!("{NS}:locket:counter:{q}"),
            "1",
            "PX",
            "10000",
        ]);
    }
    r.push("c", r#"{"class":"X","args":[]}"#);
    let list = json_out(&cli(&redis, &config, &["counters", "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 3);
    assert_eq!(list[0]["queue"], "a");
    assert_eq!(list[0]["counter"], 1);
    assert_eq!(list[0]["length"], 1);
    assert!(list[0]["ttl_ms"].as_i64().unwrap() > 0);
    assert_eq!(list[2]["counter"], Value::Null);
    let table = ok(&cli(&redis, &config, &["counters"]));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("a ") && l.contains("yes")),
        "{table}"
    );
    ok(&cli(&redis, &config, &["counters", "--reset", "a"]));
    assert!(!r.exists(&format!("{NS}:locket:counter:a")));
    assert!(r.exists(&format!("{NS}:locket:counter:b")));
    ok(&cli(&redis, &config, &["counters", "--reset-all"]));
    assert!(!r.exists(&format!("{NS}:locket:counter:b")));
}

/// O-2, P-4: `locketd delayed` lists delayed jobs (queue, class, resource, attempt, due) and
/// `delayed promote <rid>` moves one back to its queue at once.
#[test]
fn delayed_jobs_are_listed_and_promoted() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = write_script(work.path(), "ok.sh", "true");
    let config_text = cfg("b")
        .class(
            "B",
            &h,
            "locked_by = [\"gate\"]\ndelay_base = \"1h\"\ndelay_max = \"1h\"",
        )
        .render();
    let config = write_config(work.path(), &config_text);
    let _: () = r.cmd(&[
        "HSET",
        &format!("{NS}:locket:dep:gate"),
        "someone",
        "1:99999999999999",
    ]);
    let mut d = Daemon::start(&redis, &config_text, &[]);
    r.push("b", r#"{"class":"B","args":[1]}"#);
    wait_until(LONG, "the job was delayed", || {
        let n: i64 = r.cmd(&["ZCARD", &format!("{NS}:locket:delayed")]);
        n == 1
    });
    let list = json_out(&cli(&redis, &config, &["delayed", "--json"]));
    assert_eq!(list[0]["queue"], "b");
    assert_eq!(list[0]["class"], "B");
    assert_eq!(list[0]["reason"], "dep");
    assert_eq!(list[0]["resource"], "gate");
    assert_eq!(list[0]["attempt"], 1);
    let due_in = list[0]["due_in_ms"].as_i64().unwrap();
    assert!(due_in > 3_000_000, "{due_in}");
    let empty = json_out(&cli(
        &redis,
        &config,
        &["delayed", "--queue", "x", "--json"],
    ));
    assert_eq!(empty, serde_json::json!([]));
    let rid = list[0]["rid"].as_str().unwrap().to_string();
    d.kill();
    ok(&cli(&redis, &config, &["delayed", "promote", &rid]));
    let queue: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:b"), "0", "-1"]);
    assert_eq!(queue, [r#"{"class":"B","args":[1]}"#]);
    let n: i64 = r.cmd(&["ZCARD", &format!("{NS}:locket:delayed")]);
    assert_eq!(n, 0);
    let out = cli(&redis, &config, &["delayed", "promote", &rid]);
    assert!(!out.status.success(), "a second promote finds nothing");
}
