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
    assert_eq!(ours["pid"], daemon.pid().to_string());
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

    let text = stdout_ok(&locketd(&redis, &["--queues", "high,slow", "status"]));
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
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.stop();
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, "redis_connect_timeout = \"1s\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(&conf)
        .args(["--redis", &url, "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{out:?}");
}
