//! PUSH, the enqueue function (locking-semantics.md D-3, D-3a): class plans published by the
//! daemon, hold names rendered in Redis from the exact payload, and seed 001's story with a
//! client that knows nothing of locketd but one FCALL.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use crate::admin::cli;
use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

/// The library's PUSH function, loaded as any client could (the daemon loads the same one).
fn push_function(r: &mut R) -> String {
    let lib = &locketd::store::scripts::scripts().library;
    let loaded: redis::RedisResult<String> = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(&lib.source)
        .query(&mut r.0);
    if let Err(e) = loaded {
        assert!(e.to_string().contains("already exists"), "{e}");
    }
    lib.function("push")
}

/// `FCALL push 3 <queue key> <queues> <plans> <queue> <payload> <prefix>`, as redis-cli would.
fn fcall(r: &mut R, f: &str, queue: &str, payload: &str) -> redis::RedisResult<Vec<String>> {
    redis::cmd("FCALL")
        .arg(f)
        .arg(3)
        .arg(format!("{NS}:queue:{queue}"))
        .arg(format!("{NS}:queues"))
        .arg(format!("{NS}:locket:plans"))
        .arg(queue)
        .arg(payload)
        .arg(format!("{NS}:locket:"))
        .query(&mut r.0)
}

pub(crate) fn plans(r: &mut R) -> HashMap<String, String> {
    r.cmd(&["HGETALL", &format!("{NS}:locket:plans")])
}

pub(crate) fn logger(dir: &Path, name: &str, log: &Path, body: &str) -> std::path::PathBuf {
    write_script(
        dir,
        name,
        &format!(
            "cat >/dev/null\necho \"start {name} $(date +%s%N) $LOCKETD_ARGS\" >> {log}\n{body}\n\
             echo \"end {name} $(date +%s%N) $LOCKETD_ARGS\" >> {log}\n",
            log = log.display()
        ),
    )
}

/// (event, handler, time ns, the order number args[0]) of each log line.
pub(crate) fn events(log: &Path) -> Vec<(String, String, u128, u64)> {
    read_lossy(log)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.splitn(4, ' ').collect();
            let args: serde_json::Value = serde_json::from_str(f[3]).unwrap();
            (
                f[0].to_string(),
                f[1].to_string(),
                f[2].parse().unwrap(),
                args[0].as_f64().unwrap() as u64,
            )
        })
        .collect()
}

/// Seed 001 (D-3, D-3a, D-5): the webhook A for order n is pushed through PUSH by a plain
/// client (FCALL, a payload written as node-resque writes it) while no daemon runs, its cancel
/// B (`locked_by`) by a plain RPUSH to a queue the workers take first. B is reserved first and
/// must not start before A succeeded, with one worker and with two.
#[test]
fn seed_001_b_never_starts_before_a_pushed_through_the_function_succeeded() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let a = logger(work.path(), "a.sh", &log, "sleep 0.3");
    let b = logger(work.path(), "b.sh", &log, "true");
    let config_for = |workers: usize| seed_001_cfg(&a, &b, workers).render();
    let f = push_function(&mut r);
    let mut n: u64 = 0;
    for workers in [1, 2] {
        let config = config_for(workers);
        // The daemon publishes its plans at start; none runs while the jobs are pushed.
        let mut d = Daemon::start(&redis, &config, &[]);
        wait_until(LONG, "plans published and the workers registered", || {
            plans(&mut r).contains_key("Webhook::Receive") && r.workers().len() == workers
        });
        let status = d.terminate(LONG);
        assert_eq!(status.code(), Some(0), "{}", d.log());
        for _ in 0..3 {
            n += 1;
            let payload = format!(
                r#"{{"class": "Webhook::Receive", "queue": "a", "args": [{n}.0, {{"event": "paid"}}]}}"#
            );
            let reply = fcall(&mut r, &f, "a", &payload).unwrap();
            assert_eq!(reply[0], "1");
            assert_eq!(reply[2..], [format!("order:{n}")]);
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
}

/// Seed 001's classes: `Webhook::Receive` (A, `a`) places the hold `order:{args[0]}` at
/// enqueue; `Order::CancelUnshipped` (B, `b`), on the queue the workers take first, is
/// `locked_by` it and delayed while it is held.
pub(crate) fn seed_001_cfg(a: &Path, b: &Path, workers: usize) -> crate::daemon::Cfg {
    cfg("b,a")
        .top(&format!("workers = {workers}"))
        .class(
            "Webhook::Receive",
            a,
            "holds = [ { name = \"order:{args[0]}\", when = \"enqueue\" } ]",
        )
        .class(
            "Order::CancelUnshipped",
            b,
            "locked_by = [ \"order:{args[0]}\" ]\non_dependency_conflict = \"delay\"\n\
             delay_base = \"100ms\"\ndelay_max = \"300ms\"",
        )
}

/// Seed 001's outcome for orders 1..=n: B n started only after A n ended, no hold is left,
/// nothing failed.
pub(crate) fn assert_b_after_a(r: &mut R, log: &Path, n: u64) {
    let ev = events(log);
    for i in 1..=n {
        let a_end = ev
            .iter()
            .find(|e| e.0 == "end" && e.1 == "a.sh" && e.3 == i)
            .unwrap_or_else(|| panic!("A {i} did not end: {ev:?}"))
            .2;
        let b_start = ev
            .iter()
            .find(|e| e.0 == "start" && e.1 == "b.sh" && e.3 == i)
            .unwrap_or_else(|| panic!("B {i} did not start: {ev:?}"))
            .2;
        assert!(b_start >= a_end, "B {i} started before A {i} ended: {ev:?}");
    }
    assert!(
        r.keys(&format!("{NS}:locket:dep:*")).is_empty(),
        "holds left"
    );
    assert_eq!(r.failures().len(), 0);
}

/// D-3a: while no plan holds at enqueue a push is Resque's (SCARD, SADD, RPUSH, the payload
/// unread); then a class whose plan places no hold costs one HMGET more; a payload the renderer
/// cannot read, or a hold template whose path the args lack, is an error and nothing is written.
#[test]
fn push_without_holds_is_resques_push_and_refusals_write_nothing() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let f = push_function(&mut r);
    let commands = |r: &mut R| -> Vec<String> {
        let stats: String = r.cmd(&["INFO", "commandstats"]);
        let mut calls: Vec<String> = stats
            .lines()
            .filter(|l| {
                l.starts_with("cmdstat_")
                    && !l.starts_with("cmdstat_config")
                    && !l.starts_with("cmdstat_info")
            })
            .map(|l| {
                l.split(':')
                    .next()
                    .unwrap()
                    .trim_start_matches("cmdstat_")
                    .to_string()
            })
            .collect();
        calls.sort();
        let _: () = r.cmd(&["CONFIG", "RESETSTAT"]);
        calls
    };
    let _ = commands(&mut r);
    // No plan holds at enqueue: Resque's push, the payload unread (even one that is not JSON).
    assert_eq!(fcall(&mut r, &f, "q", "not json").unwrap(), ["1", "1"]);
    assert_eq!(commands(&mut r), ["fcall", "rpush", "sadd", "scard"]);
    plain_push_of_wrong_types_writes_nothing(&mut r, &f);
    let dir = workdir();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        "queues = \"q\"\n[classes.\"Held\"]\ncommand = [\"/bin/true\"]\n\
         holds = [ { name = \"h:{args[0].id}\" } ]\n",
    )
    .unwrap();
    // `locketd enqueue` offers its configuration's plans where none is published.
    let out = cli(&redis, &config, &["enqueue", "q", "Held", r#"{"id":5}"#]);
    assert!(out.status.success(), "{out:?}");
    assert!(plans(&mut r).contains_key("Held"));
    assert!(r.exists(&format!("{NS}:locket:dep:h:5")));

    let _ = commands(&mut r);
    let reply = fcall(&mut r, &f, "q", r#"{"class":"Plain","args":[1]}"#).unwrap();
    assert_eq!(reply, ["1", "3"]);
    assert_eq!(
        commands(&mut r),
        ["fcall", "hmget", "rpush", "sadd", "scard"]
    );

    for (payload, why) in [
        ("not json", "not valid JSON"),
        (r#"{"class":"Held","args":[{"id":1}]"#, "not valid JSON"),
        (r#"{"class":"Held","args":[7]}"#, "args[0].id"),
        (r#"{"class":"Held","args":["\ud800"]}"#, "surrogate"),
        (r#"{"args":[1]}"#, "no class"),
    ] {
        let e = fcall(&mut r, &f, "q", payload).unwrap_err();
        assert_eq!(e.code(), Some("LOCKET_RENDER"), "{payload}: {e}");
        assert!(e.to_string().contains(why), "{payload}: {e}");
    }
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 3);
    assert_eq!(r.keys(&format!("{NS}:locket:dep:*")).len(), 1);
}

/// S-6 on Resque's own path: a queue key or `queues` of another type is an error and the push
/// writes nothing (no queue name added for a job not pushed, no job pushed without its name).
fn plain_push_of_wrong_types_writes_nothing(r: &mut R, f: &str) {
    let queue = format!("{NS}:queue:typed");
    let _: () = r.cmd(&["SET", &queue, "x"]);
    let e = fcall(r, f, "typed", r#"{"class":"Plain","args":[]}"#).unwrap_err();
    assert!(e.to_string().contains("WRONGTYPE"), "{e}");
    let is_member: bool = r.cmd(&["SISMEMBER", &format!("{NS}:queues"), "typed"]);
    assert!(!is_member, "no queue name for a job not pushed");
    let _: () = r.cmd(&["DEL", &queue]);
    let queues = format!("{NS}:queues");
    let members: Vec<String> = r.cmd(&["SMEMBERS", &queues]);
    let _: () = r.cmd(&["DEL", &queues]);
    let _: () = r.cmd(&["SET", &queues, "x"]);
    let e = fcall(r, f, "typed", r#"{"class":"Plain","args":[]}"#).unwrap_err();
    assert_eq!(e.code(), Some("LOCKET_STORE"), "{e}");
    assert_eq!(r.llen(&queue), 0, "the job was taken back");
    let _: () = r.cmd(&["DEL", &queues]);
    for m in members {
        let _: () = r.cmd(&["SADD", &queues, &m]);
    }
}

/// D-3a: a daemon publishes its plans at start; `check-config` with other settings for a class
/// says so; a daemon that starts with them replaces the plan and logs the difference at warn.
#[test]
fn a_different_plan_is_shown_by_check_config_and_logged_by_the_daemon_that_replaces_it() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = write_script(work.path(), "h.sh", "cat >/dev/null");
    let first = cfg("q")
        .class("Held", &h, "holds = [ { name = \"o:{args[0]}\" } ]")
        .render();
    let second = cfg("q")
        .class("Held", &h, "holds = [ { name = \"o:{args[1]}\" } ]")
        .render();
    let mut d1 = Daemon::start(&redis, &first, &[]);
    wait_until(LONG, "plans published", || {
        plans(&mut r).contains_key("Held")
    });
    let published = plans(&mut r)["Held"].clone();
    assert!(published.contains(r#""src":"o:{args[0]}""#), "{published}");

    let path = work.path().join("second.toml");
    std::fs::write(&path, &second).unwrap();
    let out = cli(&redis, &path, &["check-config"]);
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("class \"Held\": the plan published in Redis"),
        "{err}"
    );
    let same = work.path().join("first.toml");
    std::fs::write(&same, &first).unwrap();
    let out = cli(&redis, &same, &["check-config"]);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("\"Held\""),
        "{out:?}"
    );

    let mut d2 = Daemon::start(&redis, &second, &[]);
    wait_until(LONG, "the second plan published", || {
        plans(&mut r)["Held"].contains(r#""src":"o:{args[1]}""#)
    });
    wait_until(LONG, "the difference logged", || {
        d2.log()
            .contains("published class plan replaced one with other settings")
    });
    assert!(!d1.log().contains("replaced one with other settings"));
    let holding: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:holding_plans")]);
    assert_eq!(holding, ["Held"]);

    // A HUP publishes again: here a configuration without the hold, so no plan holds at
    // enqueue any more and pushes go in unread.
    let third = cfg("q").class("Held", &h, "").render();
    std::fs::write(d1.config_path(), &third).unwrap();
    d1.signal(libc::SIGHUP);
    wait_until(LONG, "the plan of the HUP published", || {
        plans(&mut r)["Held"].contains(r#""holds":[]"#)
    });
    let holding: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:holding_plans")]);
    assert!(holding.is_empty(), "{holding:?}");
    let f = push_function(&mut r);
    assert_eq!(
        fcall(&mut r, &f, "elsewhere", "not json").unwrap(),
        ["1", "1"]
    );
    assert_eq!(d2.terminate(LONG).code(), Some(0));
    assert_eq!(d1.terminate(LONG).code(), Some(0));
}

/// U-1: `unique = "until_expired"`: a push whose unique key is taken is not made (reply 0,
/// nothing written), whoever writes the payload (`1.0` and `1`, member order), until
/// `unique_ttl` after the push that took it; other keys are pushed meanwhile.
#[test]
fn until_expired_refuses_duplicates_until_the_ttl_ends() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        "queues = \"q\"\n[classes.\"Sync\"]\ncommand = [\"/bin/true\"]\n\
         unique = \"until_expired\"\nunique_ttl = \"2s\"\nunique_key = \"sync:{args[0].account}\"\n",
    )
    .unwrap();
    let enqueue = |r: &mut R, arg: &str| -> serde_json::Value {
        let out = cli(&redis, &config, &["enqueue", "q", "Sync", arg, "--json"]);
        assert!(out.status.success(), "{out:?}");
        let _ = r;
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let first = enqueue(&mut r, r#"{"account":1}"#);
    assert_eq!(first["pushed"], true);
    let key = format!("{NS}:locket:unique:sync:1");
    let pttl: i64 = r.cmd(&["PTTL", &key]);
    assert!(pttl > 0 && pttl <= 2000, "{pttl}");
    // The same key from another producer's spelling, and from other args with that key.
    let f = push_function(&mut r);
    let reply = fcall(
        &mut r,
        &f,
        "q",
        r#"{"args": [{"account": 1.0}], "class": "Sync"}"#,
    )
    .unwrap();
    assert_eq!(reply, ["0", "1"]);
    let again = enqueue(&mut r, r#"{"x":2,"account":1}"#);
    assert_eq!(again["pushed"], false);
    assert_eq!(again["queue_length"], 1);
    assert_eq!(enqueue(&mut r, r#"{"account":2}"#)["pushed"], true);
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 2);
    // After the ttl, the key is free again.
    wait_until(LONG, "the unique key expired", || !r.exists(&key));
    assert_eq!(enqueue(&mut r, r#"{"account":1}"#)["pushed"], true);
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 3);
    // A unique key template whose path the args lack is an error, nothing pushed.
    let out = cli(&redis, &config, &["enqueue", "q", "Sync", "7"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("args[0].account"),
        "{out:?}"
    );
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 3);
}
