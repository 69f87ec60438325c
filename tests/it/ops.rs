//! Operator commands against a real redis-server and the real binary: `locketd status`,
//! `locketd failed`. Run: `cargo test --test it ops::`.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use crate::daemon::{cfg, NS, R};
use crate::support::{wait_until, write_script, Daemon, RedisServer};

const SHORT: Duration = Duration::from_secs(10);

/// Runs `locketd --redis <url> <args>` to completion (bounded by the command's own exit).
pub(crate) fn locketd(redis: &RedisServer, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--redis")
        .arg(redis.url())
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("run locketd");
    out
}

pub(crate) fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "locketd failed: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A worker of Ruby Resque 3.0 as it registers itself and starts a job (resque-protocol.md §4).
pub(crate) fn fake_ruby_worker(r: &mut R, id: &str, queue: &str, class: &str) {
    let _: i64 = r.cmd(&["SADD", &format!("{NS}:workers"), id]);
    let _: () = r.cmd(&[
        "SET",
        &format!("{NS}:worker:{id}:started"),
        "2026-11-21 12:18:29 +0000",
    ]);
    let _: i64 = r.cmd(&[
        "HSET",
        &format!("{NS}:workers:heartbeat"),
        id,
        "2026-11-21T12:18:29+00:00",
    ]);
    let _: () = r.cmd(&[
        "SET",
        &format!("{NS}:worker:{id}"),
        &format!(
            r#"{{"queue":"{queue}","run_at":"2026-11-21T12:18:29Z","payload":{{"class":"{class}","args":[7]}}}}"#
        ),
    ]);
}

fn slow_handler(dir: &Path) -> std::path::PathBuf {
    write_script(dir, "slow.sh", "sleep 30\n")
}

#[test]
fn status_shows_queues_workers_locks_and_failures() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let slow = slow_handler(builder.dir());
    let config = cfg("slow").class("Slow", &slow, "").render();
    let mut daemon = builder.config(&config).start();
    r.push("slow", r#"{"class":"Slow","args":[1]}"#);
    r.push("slow", r#"{"class":"Slow","args":[2]}"#);
    wait_until(SHORT, "the daemon runs the first job", || {
        r.llen(&format!("{NS}:queue:slow")) == 1
            && r.workers().iter().any(|w| {
                let v: Option<String> = r.cmd(&["GET", &format!("{NS}:worker:{w}")]);
                v.is_some()
            })
    });
    // A queue nobody works whose only jobs were requeued on a held lock: RESERVE skips it.
    r.push("high", r#"{"class":"Other","args":[1]}"#);
    let _: () = r.cmd(&["SET", &format!("{NS}:locket:counter:high"), "1"]);
    fake_ruby_worker(&mut r, "rubyhost:4242:mail", "mail", "Mailer");
    let _: i64 = r.cmd(&[
        "RPUSH",
        &format!("{NS}:failed"),
        r#"{"failed_at":"2026/11/21 12:18:24 UTC","payload":{"class":"B","args":[]},"exception":"E","error":"e","backtrace":[],"worker":"x:1:q","queue":"q"}"#,
    ]);
    let _: () = r.cmd(&["SET", &format!("{NS}:stat:processed"), "41"]);

    let out = stdout_ok(&locketd(
        &redis,
        &["--queues", "high,slow", "status", "--json"],
    ));
    let s: Value = serde_json::from_str(out.trim()).expect("status JSON");
    assert_eq!(s["processed"], 41);
    assert_eq!(s["failures_listed"], 1);
    assert_eq!(s["locks_held"], 1, "the running Slow job holds its lock");
    let queues = s["queues"].as_array().unwrap();
    let names: Vec<&str> = queues.iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["high", "slow"], "priority order of --queues");
    assert_eq!(queues[0]["length"], 1);
    assert_eq!(queues[0]["counter"], 1);
    assert_eq!(queues[0]["skipped"], true);
    assert_eq!(queues[1]["length"], 1);
    assert_eq!(queues[1]["skipped"], false);
    let workers = s["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{workers:?}");
    let ours = workers
        .iter()
        .find(|w| w["kind"] == "locketd")
        .expect("the daemon is listed");
    assert_eq!(ours["pid"], daemon.worker_pid().to_string());
    assert_eq!(ours["queues"], "slow");
    assert_eq!(ours["job"]["class"], "Slow");
    assert_eq!(ours["job"]["queue"], "slow");
    let ruby = workers
        .iter()
        .find(|w| w["kind"] == "resque")
        .expect("the Ruby worker is listed");
    assert_eq!(ruby["host"], "rubyhost");
    assert_eq!(ruby["pid"], "4242");
    assert_eq!(ruby["job"]["class"], "Mailer");
    assert_eq!(ruby["job"]["run_at"], "2026-11-21T12:18:29Z");
    assert_eq!(ruby["started"], "2026-11-21 12:18:29 +0000");

    let text = stdout_ok(&locketd(&redis, &["status", "--queues", "high,slow"]));
    eprintln!("{text}");
    assert!(text.contains("skipped"), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("rubyhost")
            && l.contains("4242")
            && l.contains("Mailer on mail")),
        "{text}"
    );
    assert!(text.contains("Slow on slow since"), "{text}");

    // --watch with --count: bounded refresh, one JSON document per screen.
    let out = stdout_ok(&locketd(
        &redis,
        &["status", "--json", "--watch", "0.1", "--count", "3"],
    ));
    assert_eq!(out.lines().count(), 3, "{out}");
    for line in out.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["workers"].as_array().unwrap().len(), 2);
    }
    daemon.kill();
}

#[test]
fn status_exits_69_when_redis_is_away() {
    // A socket nobody serves: a stopped server's TCP port can be taken at once by another
    // test's redis-server (this test once found one there and exited 0).
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "redis+unix://{}",
        dir.path().join("no-redis.sock").display()
    );
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, "redis_connect_timeout = \"1s\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(&conf)
        .args(["--redis", &url, "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    // The admin commands answer the same way.
    for cmd in [&["locks"][..], &["counters"], &["holds"], &["stats"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
            .arg("--config")
            .arg(&conf)
            .args(["--redis", &url, "--queues", "q"])
            .args(cmd)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(69), "{cmd:?}: {out:?}");
    }
}

/// A negative or non-numeric --interval / --term-timeout (or INTERVAL) is a usage error naming
/// the option, not a value quietly ignored.
#[test]
fn bad_interval_and_term_timeout_are_usage_errors() {
    for (args, env) in [
        (&["--interval=-1"][..], None),
        (&["--term-timeout", "NaN"], None),
        (&[], Some(("INTERVAL", "soon"))),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_locketd"));
        cmd.args(["--queues", "q"]).args(args).arg("check-config");
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--interval") || err.contains("--term-timeout"),
            "{err}"
        );
    }
}

fn failure(class: &str, args: &str, queue: &str, extra: &str) -> String {
    format!(
        r#"{{"failed_at":"2026/11/21 12:18:24 UTC","payload":{{"class":"{class}","args":{args}{extra}}},"exception":"ArgumentError","error":"bad {class}","backtrace":["a.rb:1"],"worker":"vm:9397:{queue}","queue":"{queue}"}}"#
    )
}

fn failed_list(r: &mut R, key: &str) -> Vec<String> {
    r.cmd(&["LRANGE", key, "0", "-1"])
}

#[test]
fn failed_list_show_retry_remove_clear_follow_resque() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:failed");
    let recs = [
        failure(
            "A",
            "[1.0,123456789012345678901]",
            "low",
            r#","id":"php-1""#,
        ),
        failure("B", "[2]", "high", ""),
        failure("A", r#"[{"x":"y"}]"#, "high", ""),
    ];
    for rec in &recs {
        let _: i64 = r.cmd(&["RPUSH", &key, rec]);
    }

    // list: newest first, Resque's indexes.
    let out = stdout_ok(&locketd(&redis, &["failed", "list", "--json"]));
    let rows: Vec<Value> = serde_json::from_str(out.trim()).unwrap();
    let idx: Vec<u64> = rows.iter().map(|v| v["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [2, 1, 0]);
    assert_eq!(rows[1]["class"], "B");
    assert_eq!(rows[1]["queue"], "high");
    assert_eq!(rows[1]["exception"], "ArgumentError");
    assert_eq!(rows[1]["error"], "bad B");
    assert_eq!(rows[1]["worker"], "vm:9397:high");
    let text = stdout_ok(&locketd(&redis, &["failed", "list"]));
    let first = text.lines().position(|l| l.starts_with("[2]")).unwrap();
    let last = text.lines().position(|l| l.starts_with("[0]")).unwrap();
    assert!(first < last, "{text}");

    // show: the record itself.
    let out = stdout_ok(&locketd(&redis, &["failed", "show", "1"]));
    assert_eq!(out.trim_end(), recs[1], "not verbatim");
    let out = locketd(&redis, &["failed", "show", "7"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no failure at index 7"));

    // retry 0: retried_at appended in place, {class,args} pushed with args verbatim.
    stdout_ok(&locketd(&redis, &["failed", "retry", "0"]));
    let now = failed_list(&mut r, &key);
    assert_eq!(now.len(), 3, "retry never removes");
    let head = recs[0].strip_suffix('}').unwrap();
    assert!(
        now[0].starts_with(&format!("{head},\"retried_at\":\"")) && now[0].ends_with(" UTC\"}"),
        "{}",
        now[0]
    );
    assert_eq!(now[1..], recs[1..]);
    let low: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:low"), "0", "-1"]);
    assert_eq!(low, [r#"{"class":"A","args":[1.0,123456789012345678901]}"#]);
    let queues: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:queues")]);
    assert!(queues.contains(&"low".to_string()));

    // retry --class A: both A records (index 0 again, as Resque's retry-all would), not B.
    stdout_ok(&locketd(&redis, &["failed", "retry", "--class", "A"]));
    assert_eq!(r.llen(&format!("{NS}:queue:low")), 2);
    let high: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:high"), "0", "-1"]);
    assert_eq!(high, [r#"{"class":"A","args":[{"x":"y"}]}"#]);
    let now = failed_list(&mut r, &key);
    assert_eq!(now[1], recs[1], "B untouched");
    assert!(now[2].contains("retried_at"));
    // --queue high: B and the second A.
    stdout_ok(&locketd(&redis, &["failed", "retry", "--queue", "high"]));
    assert_eq!(r.llen(&format!("{NS}:queue:high")), 3);

    // remove 1: the others keep their order.
    let before = failed_list(&mut r, &key);
    stdout_ok(&locketd(&redis, &["failed", "remove", "1"]));
    let after = failed_list(&mut r, &key);
    assert_eq!(after, [before[0].clone(), before[2].clone()]);

    // --failed-queue names a <Q>_failed list, which the default backend does not use: refused,
    // rather than acting on (and with `clear` wiping) the main list.
    let out = locketd(&redis, &["failed", "--failed-queue", "low", "clear"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("redis_multi_queue"),
        "{out:?}"
    );
    assert!(r.exists(&key), "the main list was cleared");

    // clear: DEL.
    stdout_ok(&locketd(&redis, &["failed", "clear"]));
    assert!(!r.exists(&key));
}

#[test]
fn failed_retry_of_a_record_that_cannot_be_requeued_is_refused() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:failed");
    let rec = r#"{"failed_at":"2026/11/21 12:18:24 UTC","payload":null,"exception":"Locket::BadPayload","error":"x","backtrace":[],"worker":"vm:1:q","queue":"q","raw_payload":"{oops"}"#;
    let _: i64 = r.cmd(&["RPUSH", &key, rec]);
    let out = locketd(&redis, &["failed", "retry", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be retried"));
    assert_eq!(failed_list(&mut r, &key), [rec]);
    assert!(!r.exists(&format!("{NS}:queue:q")));
}

/// Records written by other clients need not be UTF-8: one such record does not break `list`
/// or `retry --all` (it is reported as not retryable), `show` prints its bytes, `remove`
/// removes it, and a huge index is "no failure at index", not a Redis error.
#[test]
fn a_failure_record_that_is_not_utf8_breaks_no_command() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:failed");
    let good = failure("Good", "[1]", "q", "");
    let mut bad = failure("Bad", "[2]", "q", "").into_bytes();
    let at = bad.len() - 2;
    bad.splice(at..at, [0xff, 0xfe]);
    let _: i64 = r.cmd(&["RPUSH", &key, &good]);
    let _: i64 = redis::cmd("RPUSH")
        .arg(&key)
        .arg(&bad)
        .query(&mut r.0)
        .unwrap();

    let text = stdout_ok(&locketd(&redis, &["failed", "list"]));
    assert!(text.contains("[1]") && text.contains("[0]"), "{text}");
    let out = locketd(&redis, &["failed", "show", "1"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout[..out.stdout.len() - 1], bad[..]);
    let out = locketd(&redis, &["failed", "show", "18446744073709551615"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no failure at index"));

    let out = locketd(&redis, &["failed", "retry", "--all"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not UTF-8"),
        "{out:?}"
    );
    assert_eq!(
        r.llen(&format!("{NS}:queue:q")),
        1,
        "the good record was retried"
    );

    stdout_ok(&locketd(&redis, &["failed", "remove", "1"]));
    assert_eq!(r.llen(&key), 1);
}

/// As Ruby's requeue (`*item['payload']['args']`), a payload without `args` (or with
/// `"args":null`) is retried with no arguments; args that are not an array are refused.
#[test]
fn failed_retry_of_a_payload_without_args_pushes_empty_args() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let key = format!("{NS}:failed");
    for payload in [
        r#"{"class":"NoArgs"}"#,
        r#"{"class":"NullArgs","args":null}"#,
    ] {
        let rec = format!(
            r#"{{"failed_at":"2026/11/21 12:18:24 UTC","payload":{payload},"exception":"E","error":"x","backtrace":[],"worker":"vm:1:q","queue":"q"}}"#
        );
        let _: i64 = r.cmd(&["RPUSH", &key, &rec]);
    }
    stdout_ok(&locketd(&redis, &["failed", "retry", "0"]));
    stdout_ok(&locketd(&redis, &["failed", "retry", "1"]));
    let queued: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:q"), "0", "-1"]);
    assert_eq!(
        queued,
        [
            r#"{"class":"NoArgs","args":[]}"#,
            r#"{"class":"NullArgs","args":[]}"#
        ]
    );
}

#[test]
fn failed_job_retried_from_the_cli_runs_again_in_the_daemon() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let marker = builder.dir().join("second-try");
    let flaky = write_script(
        builder.dir(),
        "flaky.sh",
        &format!(
            "if [ -e '{m}' ]; then echo ran >> '{m}'; exit 0; fi\ntouch '{m}'\necho boom >&2\nexit 1\n",
            m = marker.display()
        ),
    );
    let config = cfg("q").class("Flaky", &flaky, "").render();
    let mut daemon = builder.config(&config).start();
    r.push("q", r#"{"class":"Flaky","args":[5]}"#);
    wait_until(SHORT, "the job failed once", || {
        r.llen(&format!("{NS}:failed")) == 1
    });
    let out = stdout_ok(&locketd(&redis, &["failed", "retry", "0"]));
    assert!(out.contains("Flaky"), "{out}");
    wait_until(SHORT, "the retried job succeeded", || {
        std::fs::read_to_string(&marker).is_ok_and(|t| t.contains("ran"))
    });
    assert_eq!(
        r.llen(&format!("{NS}:failed")),
        1,
        "the record stays, marked"
    );
    let rows: Vec<Value> =
        serde_json::from_str(stdout_ok(&locketd(&redis, &["failed", "list", "--json"])).trim())
            .unwrap();
    assert!(rows[0]["retried_at"].is_string());
    daemon.kill();
}

#[test]
fn failed_works_with_the_redis_multi_queue_backend() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, "failure_backend = \"redis_multi_queue\"\n").unwrap();
    let conf = conf.to_str().unwrap();
    for q in ["low", "high"] {
        let _: i64 = r.cmd(&[
            "RPUSH",
            &format!("{NS}:{q}_failed"),
            &failure("M", "[1]", q, ""),
        ]);
        let _: i64 = r.cmd(&[
            "SADD",
            &format!("{NS}:failed_queues"),
            &format!("{q}_failed"),
        ]);
    }
    let rows: Vec<Value> = serde_json::from_str(
        stdout_ok(&locketd(
            &redis,
            &["--config", conf, "failed", "list", "--json"],
        ))
        .trim(),
    )
    .unwrap();
    let lists: Vec<&str> = rows.iter().map(|v| v["list"].as_str().unwrap()).collect();
    assert_eq!(lists, ["high_failed", "low_failed"]);
    // One list must be named for single-record commands.
    let out = locketd(&redis, &["--config", conf, "failed", "retry", "0"]);
    assert!(!out.status.success());
    stdout_ok(&locketd(
        &redis,
        &[
            "--config",
            conf,
            "failed",
            "--failed-queue",
            "low",
            "retry",
            "0",
        ],
    ));
    let rec: String = r.cmd(&["LINDEX", &format!("{NS}:low_failed"), "0"]);
    let v: Value = serde_json::from_str(&rec).unwrap();
    let at = v["retried_at"].as_str().unwrap();
    assert!(!at.ends_with("UTC"), "RedisMultiQueue writes no zone: {at}");
    assert_eq!(r.llen(&format!("{NS}:queue:low")), 1);
    stdout_ok(&locketd(
        &redis,
        &[
            "--config",
            conf,
            "failed",
            "--failed-queue",
            "high",
            "clear",
        ],
    ));
    assert!(!r.exists(&format!("{NS}:high_failed")));
    assert!(r.exists(&format!("{NS}:low_failed")));
}

/// A queue key that another tool turned into a string stops nothing: the daemon passes over
/// it (warning once) and serves the queues after it, and `status` still answers (the queue
/// reads as empty). Before, RESERVE raised WRONGTYPE on every pass, no queue was served, and
/// `status` failed as a whole.
#[test]
fn a_queue_key_that_is_not_a_list_stops_neither_the_daemon_nor_status() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let ok = write_script(builder.dir(), "ok.sh", "exit 0\n");
    let _: () = r.cmd(&["SET", &format!("{NS}:queue:aaa"), "not a list"]);
    let _: i64 = r.cmd(&["SADD", &format!("{NS}:queues"), "aaa"]);
    let config = cfg("aaa,bbb").class("Ok", &ok, "").render();
    let mut d = builder.config(&config).start();
    r.push("bbb", r#"{"class":"Ok","args":[1]}"#);
    r.push("bbb", r#"{"class":"Ok","args":[2]}"#);
    wait_until(SHORT, "the jobs of bbb ran", || r.processed() == 2);
    d.wait_for_log("queue key is not a list", SHORT);
    let warned = d.log().matches("queue key is not a list").count();
    assert_eq!(warned, 1, "{}", d.log());
    let text = stdout_ok(&locketd(&redis, &["--queues", "aaa,bbb", "status"]));
    assert!(text.contains("bbb"), "{text}");
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

/// `status` prints a queue whose name is longer than a format width may be (65,535): it used
/// to panic while padding the table.
#[test]
fn status_prints_a_queue_with_a_huge_name() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let long = "q".repeat(70_000);
    let _: i64 = r.cmd(&["SADD", &format!("{NS}:queues"), &long, "short"]);
    let text = stdout_ok(&locketd(&redis, &["--queues", "short", "status"]));
    assert!(text.contains(&long), "the long name is shown");
}
