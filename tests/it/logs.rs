//! Log filters and the JSON log fields README "Log fields" documents.
//! Run: `cargo test --test it logs::`.

use std::time::Duration;

use serde_json::Value;

use crate::daemon::{cfg, R};
use crate::support::{wait_until, write_script, Daemon, RedisServer};

const SHORT: Duration = Duration::from_secs(10);

fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Runs one good and one failing job with `log_level` in the file and `rust_log` (None: unset).
fn run_jobs(level: &str, rust_log: Option<&str>) -> Vec<Value> {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let ok = write_script(builder.dir(), "ok.sh", "echo hello from ok\n");
    let bad = write_script(builder.dir(), "bad.sh", "echo broken >&2\nexit 3\n");
    let config = cfg("q")
        .top(&format!("log_level = \"{level}\""))
        .top("log_format = \"json\"")
        .class("Ok", &ok, "")
        .class("Bad", &bad, "")
        .render();
    let builder = builder.config(&config);
    let builder = match rust_log {
        Some(f) => builder.env("RUST_LOG", f),
        None => builder.env_remove("RUST_LOG"),
    };
    let mut d = builder.start();
    r.push("q", r#"{"class":"Ok","args":[1]}"#);
    r.push("q", r#"{"class":"Bad","args":[2]}"#);
    wait_until(SHORT, "both jobs ran", || r.processed() == 2);
    d.terminate(SHORT);
    json_lines(&d.log())
}

fn has(events: &[Value], msg: &str) -> bool {
    events.iter().any(|e| e["message"] == msg)
}

#[test]
fn log_level_from_the_config_filters_when_rust_log_is_unset() {
    let events = run_jobs("warn", None);
    assert!(
        !has(&events, "job started"),
        "info lines at log_level = warn"
    );
    assert!(has(&events, "job failed"), "warn lines kept: {events:?}");
    assert!(events
        .iter()
        .all(|e| e["level"] == "WARN" || e["level"] == "ERROR"));
}

#[test]
fn rust_log_overrides_log_level_with_per_target_directives() {
    // Handler output (target locketd::handler) at info, everything else at warn.
    let events = run_jobs("debug", Some("warn,locketd::handler=info"));
    assert!(
        !has(&events, "job started"),
        "locketd::worker info filtered"
    );
    assert!(
        !events.iter().any(|e| e["level"] == "DEBUG"),
        "log_level ignored"
    );
    let out = events
        .iter()
        .find(|e| e["message"] == "hello from ok")
        .expect("handler stdout line");
    assert_eq!(out["target"], "locketd::handler");
    assert_eq!(out["stream"], "stdout");
    assert_eq!(out["class"], "Ok");
    assert_eq!(out["queue"], "q");
}

#[test]
fn json_events_carry_the_documented_fields() {
    let events = run_jobs("info", None);
    for e in &events {
        for k in ["timestamp", "level", "target", "message"] {
            assert!(e.get(k).is_some(), "{k} missing in {e}");
        }
    }
    let find = |msg: &str, class: &str| {
        events
            .iter()
            .find(|e| e["message"] == msg && e["class"] == class)
            .unwrap_or_else(|| panic!("no {msg:?} for {class}"))
            .clone()
    };
    let reg = events
        .iter()
        .find(|e| e["message"] == "worker registered")
        .unwrap();
    for k in ["worker", "process", "queues"] {
        assert!(reg[k].is_string(), "worker registered: {k}");
    }
    let started = find("job started", "Bad");
    for k in ["queue", "class", "worker"] {
        assert!(started[k].is_string(), "job started: {k}");
    }
    let failed = find("job failed", "Bad");
    assert_eq!(failed["exception"], "Locket::CommandFailed");
    assert!(failed["error"].as_str().unwrap().contains("status 3"));
    let finished = find("job finished", "Bad");
    assert_eq!(finished["outcome"], "failed");
    assert!(finished["elapsed"].is_f64());
    assert_eq!(find("job finished", "Ok")["outcome"], "success");
    let err = find("broken", "Bad");
    assert_eq!(err["stream"], "stderr");
    assert_eq!(err["level"], "WARN");
    let stopped = events
        .iter()
        .find(|e| e["message"] == "worker stopped")
        .unwrap();
    assert_eq!(stopped["reason"], "Shutdown");
}
