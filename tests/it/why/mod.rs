//! `locketd why JOB` against a real redis-server: one test per place a job can be (queued at a
//! position, parked, delayed, reserved, running, failed, not found) and per reason it waits (a
//! lock and its holder, a rate, a pause, a cap, a hold and its owner, a handler not ready, a
//! skipped queue, no worker), through the library and the binary (text and `--json`), and the
//! web page's `/api/why` and `/why`. Run: `cargo test --test it why::`.

use std::path::PathBuf;
use std::process::{Command, Output};

use locketd::admin::why::{explain, Place, Reason, Target, Why};
use locketd::config::Config;
use locketd::locks::Policy;
use locketd::store::{AcquireOutcome, Settled};
use redis::aio::MultiplexedConnection as Conn;
use serde_json::{json, Value};

use crate::policies::{cmd, keys, opts, payload_of, reserved, server_ms, spec, Job};
use crate::support::RedisServer;

mod places;
mod web;

/// The classes every test's configuration names.
const CLASSES: &str = r#"queues = "q"

[classes.Hot]
lock = "user:{args[0]}"

[classes.Mailer]
lock = false
rate = { key = "smtp:{args[0]}", limit = 1, period = "1h" }

[classes.Child]
lock = false
locked_by = ["order:{args[0]}"]

[classes.Booted]
lock = false
handler = "app"

[classes.Plain]
lock = false

[classes.Once]
lock = false
unique = "until_expired"
unique_ttl = "1h"

[handlers.app]
mode = "persistent"
command = ["/bin/true"]
"#;

fn config() -> Config {
    Config::parse(CLASSES, "why.toml").expect("the test configuration parses")
}

/// The configuration as a file in the server's temp dir, for the binary.
fn config_file(r: &RedisServer) -> PathBuf {
    let p = r.dir().join("why.toml");
    std::fs::write(&p, CLASSES).unwrap();
    p
}

/// `locketd --config <file> --redis <url> why <args>`.
fn cli(r: &RedisServer, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(config_file(r))
        .arg("--redis")
        .arg(r.url())
        .arg("why")
        .args(args)
        .output()
        .expect("run locketd why")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The `--json` answer, exit 0.
fn cli_json(r: &RedisServer, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let o = cli(r, &a);
    assert!(
        o.status.success(),
        "{o:?}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
}

async fn why(c: &mut Conn, target: Target) -> Why {
    explain(c, &config(), &target).await.expect("why answers")
}

fn rid(r: &str) -> Target {
    Target::Rid(r.to_string())
}

fn payload(queue: &str, class: &str, args: &[&str]) -> Target {
    Target::Payload {
        queue: queue.into(),
        class: class.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
    }
}

/// Registers the test slot of `job` as a live process's slot, as a worker's start does.
async fn register(c: &mut Conn, job: &Job) {
    let k = keys();
    let process = job.slot_key.rsplit_once(':').unwrap().0.to_string();
    let _: i64 = cmd(c, &["SADD", &k.processes(), &process]).await;
    let _: i64 = cmd(c, &["HSET", &k.slots(&process), "0", &job.worker_id]).await;
}

/// A live process working `queue`, with one idle slot.
async fn live_worker(c: &mut Conn, queue: &str) {
    let k = keys();
    let _: i64 = cmd(c, &["SADD", &k.processes(), "w:1:aa"]).await;
    let _: i64 = cmd(
        c,
        &["HSET", &k.slots("w:1:aa"), "0", &format!("w:1:{queue}")],
    )
    .await;
    let alive = json!({ "queues": queue }).to_string();
    let _: () = cmd(c, &["SET", &k.alive("w:1:aa"), &alive]).await;
}

async fn push(c: &mut Conn, queue: &str, class: &str, args: Value) -> String {
    let p = payload_of(class, &args);
    let _: i64 = cmd(c, &["RPUSH", &keys().queue(queue), &p]).await;
    p
}

/// A job of `Hot` holding lock user:1, running on a registered slot `pa`.
async fn running_holder(c: &mut Conn) -> Job {
    let mut a = reserved(c, "pa", "q", "Hot", json!([1, "a"])).await;
    register(c, &a).await;
    let lock = [spec("user:1", 1)];
    assert!(matches!(
        a.acquire(c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    a
}

#[tokio::test]
async fn a_queued_job_has_its_position_and_nothing_else_holds_it_back() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    for n in 0..3 {
        push(&mut c, "q", "Plain", json!([n])).await;
    }
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    assert!(
        matches!(
            w.place,
            Place::Queued {
                position: 1,
                length: 3
            }
        ),
        "{w:?}"
    );
    assert!(w.reasons.is_empty(), "{w:?}");
    let j = w.job.unwrap();
    assert_eq!(j.payload, r#"{"class":"Plain","args":[1]}"#);
    // The binary: the same answer, as text and JSON.
    let text = stdout(&cli(&r, &["q", "Plain", "1"]));
    assert!(text.contains("queued: position 1 of 3"), "{text}");
    assert!(text.contains("nothing holds it back now"), "{text}");
    let v = cli_json(&r, &["q", "Plain", "1"]);
    assert_eq!(
        v["place"],
        json!({"state": "queued", "position": 1, "length": 3})
    );
    assert_eq!(v["reasons"], json!([]));
}

#[tokio::test]
async fn a_queue_no_live_worker_works_is_a_reason() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    push(&mut c, "q", "Plain", json!([1])).await;
    let k = keys();
    let _: i64 = cmd(&mut c, &["SADD", &k.processes(), "h:1:aa"]).await;
    let _: i64 = cmd(&mut c, &["HSET", &k.slots("h:1:aa"), "0", "h:1:other"]).await;
    let alive = json!({"queues": "other,mail*"}).to_string();
    let _: () = cmd(&mut c, &["SET", &k.alive("h:1:aa"), &alive]).await;
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    assert!(
        matches!(&w.reasons[..], [Reason::NoWorker { queue, processes: 1 }] if queue == "q"),
        "{w:?}"
    );
    // A process whose list takes the queue in (a pattern) removes the reason.
    let alive = json!({"queues": "other,*"}).to_string();
    let _: () = cmd(&mut c, &["SET", &k.alive("h:1:aa"), &alive]).await;
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    assert!(w.reasons.is_empty(), "{w:?}");
}

#[tokio::test]
async fn a_lock_names_its_holder_and_lease_end_and_a_rid_finds_the_running_holder() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let a = running_holder(&mut c).await;
    push(&mut c, "q", "Hot", json!([1, "b"])).await;
    let now = server_ms(&mut c).await;
    let w = why(&mut c, payload("q", "Hot", &["1", "\"b\""])).await;
    assert!(
        matches!(w.place, Place::Queued { position: 0, .. }),
        "{w:?}"
    );
    let [Reason::Lock {
        lock_id,
        limit: 1,
        holders,
        until_ms: Some(until),
        ..
    }] = &w.reasons[..]
    else {
        panic!("{w:?}")
    };
    assert_eq!(lock_id, "user:1");
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].worker, json!(a.worker_id));
    assert_eq!(holders[0].class, json!("Hot"));
    assert!(!holders[0].handoff);
    assert_eq!(holders[0].token, a.token[..8]);
    assert!(*until > now && *until <= now + 10_500, "{until} vs {now}");
    assert_eq!(holders[0].lease_end_ms, *until);
    assert!(holders[0].since_ms.is_some_and(|s| s <= now + 1));
    // The holder itself, by its rid: running on its slot, no reasons.
    let w = why(&mut c, rid(&a.rid)).await;
    assert!(
        matches!(&w.place, Place::Running { worker, .. } if *worker == a.worker_id),
        "{w:?}"
    );
    assert!(w.reasons.is_empty());
    // The text says who holds it.
    let text = stdout(&cli(&r, &["q", "Hot", "1", "\"b\""]));
    assert!(text.contains("lock user:1 is full"), "{text}");
    assert!(text.contains(&format!("held by {}", a.worker_id)), "{text}");
    let v = cli_json(&r, &[&a.rid]);
    assert_eq!(v["place"]["state"], "running");
    assert_eq!(v["job"]["rid"], json!(a.rid));
}

#[tokio::test]
async fn a_parked_job_is_found_by_rid_and_by_payload_with_its_place_in_line() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let _a = running_holder(&mut c).await;
    let lock = [spec("user:1", 1)];
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([1, "b"])).await;
    match b.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    for t in [rid(&b.rid), payload("q", "Hot", &["1", "\"b\""])] {
        let w = why(&mut c, t).await;
        assert!(
            matches!(&w.place, Place::Parked { resource, position: 0, parked: 1, .. }
                     if resource == "lock:user:1"),
            "{w:?}"
        );
        assert_eq!(w.job.as_ref().unwrap().rid.as_deref(), Some(b.rid.as_str()));
        assert!(
            matches!(&w.reasons[..], [Reason::Lock { parked: 1, .. }]),
            "{w:?}"
        );
    }
    let text = stdout(&cli(&r, &[&b.rid]));
    assert!(
        text.contains("parked on lock:user:1: position 0 of 1"),
        "{text}"
    );
}

// PK-3: the release hands the lock to the parked job and puts it back at the head of its
// queue; the unit kept for it is its own, not in its way, while a job behind it meets it.
#[tokio::test]
async fn a_woken_job_is_not_held_back_by_the_unit_kept_for_it() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    let a = running_holder(&mut c).await;
    let lock = [spec("user:1", 1)];
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([1, "b"])).await;
    b.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    push(&mut c, "q", "Hot", json!([1, "c"])).await;
    assert!(
        a.finish(&mut c, &lock, locketd::store::Finish::Success, &[])
            .await
    );
    let w = why(&mut c, payload("q", "Hot", &["1", "\"b\""])).await;
    assert!(
        matches!(w.place, Place::Queued { position: 0, .. }),
        "{w:?}"
    );
    assert!(w.reasons.is_empty(), "{w:?}");
    let w = why(&mut c, payload("q", "Hot", &["1", "\"c\""])).await;
    assert!(
        matches!(w.place, Place::Queued { position: 1, .. }),
        "{w:?}"
    );
    let [Reason::Lock { holders, .. }] = &w.reasons[..] else {
        panic!("{w:?}")
    };
    assert!(holders[0].handoff, "{holders:?}");
}

#[tokio::test]
async fn a_rate_gives_its_next_allowed_start() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    push(&mut c, "q", "Mailer", json!([7])).await;
    let start = server_ms(&mut c).await - 1000;
    let log = locketd::store::RateLog {
        closed_until_ms: 0,
        starts: vec![start],
    }
    .encode();
    let key = keys().locket("ratelog:smtp:7");
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(log)
        .query_async(&mut c)
        .await
        .unwrap();
    let w = why(&mut c, payload("q", "Mailer", &["7"])).await;
    let [Reason::Rate {
        key,
        limit: 1,
        used: 1,
        until_ms,
        ..
    }] = &w.reasons[..]
    else {
        panic!("{w:?}")
    };
    assert_eq!(key, "smtp:7");
    assert_eq!(*until_ms, start + 3_600_000);
    let text = stdout(&cli(&r, &["q", "Mailer", "7"]));
    assert!(
        text.contains("rate smtp:7: 1 of 1 starts per 1h00m used"),
        "{text}"
    );
}

#[tokio::test]
async fn a_pause_of_the_queue_or_of_every_queue_is_a_reason() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    push(&mut c, "q", "Plain", json!([1])).await;
    let k = keys();
    let _: () = cmd(&mut c, &["SET", &k.pause_queue("q"), "true"]).await;
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    assert!(
        matches!(&w.reasons[..], [Reason::Paused { scope, key }]
                 if scope == "q" && *key == k.pause_queue("q")),
        "{w:?}"
    );
    let _: () = cmd(&mut c, &["SET", &k.pause_every_queue(), "true"]).await;
    let v = cli_json(&r, &["q", "Plain", "1"]);
    assert_eq!(v["reasons"][0]["kind"], "paused");
    assert_eq!(v["reasons"][0]["scope"], "*");
}

#[tokio::test]
async fn a_full_cap_names_the_jobs_holding_its_units() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let holder = reserved(&mut c, "pc", "q", "Plain", json!([0])).await;
    register(&mut c, &holder).await;
    push(&mut c, "q", "Plain", json!([1])).await;
    let k = keys();
    let _: () = cmd(&mut c, &["SET", &k.cap("q"), "1"]).await;
    let unit = format!("{} {}", holder.rid, holder.inflight());
    let _: i64 = cmd(&mut c, &["SADD", &k.running("q"), &unit]).await;
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    let [Reason::Cap {
        cap: 1,
        running: 1,
        units,
        ..
    }] = &w.reasons[..]
    else {
        panic!("{w:?}")
    };
    assert_eq!(units[0]["rid"], json!(holder.rid));
    assert_eq!(units[0]["worker"], json!(holder.worker_id));
}

#[tokio::test]
async fn a_hold_names_the_job_that_placed_it() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    // The parent runs on a registered slot with the digest that placed the hold.
    let parent = running_holder(&mut c).await;
    push(&mut c, "q", "Child", json!([7])).await;
    let deadline = server_ms(&mut c).await + 60_000;
    let _: i64 = cmd(
        &mut c,
        &[
            "HSET",
            &keys().dep("order:7"),
            &parent.digest,
            &format!("1:{deadline}"),
        ],
    )
    .await;
    let w = why(&mut c, payload("q", "Child", &["7"])).await;
    let [Reason::Hold {
        name,
        fields,
        until_ms,
    }] = &w.reasons[..]
    else {
        panic!("{w:?}")
    };
    assert_eq!(name, "order:7");
    assert_eq!(*until_ms, Some(deadline));
    assert_eq!(fields[0].digest, parent.digest);
    assert!(!fields[0].own);
    assert_eq!(fields[0].owners[0]["worker"], json!(parent.worker_id));
    assert_eq!(fields[0].owners[0]["class"], json!("Hot"));
    // A lapsed hold holds nothing.
    let lapsed = server_ms(&mut c).await - 1;
    let _: i64 = cmd(
        &mut c,
        &[
            "HSET",
            &keys().dep("order:7"),
            &parent.digest,
            &format!("1:{lapsed}"),
        ],
    )
    .await;
    let w = why(&mut c, payload("q", "Child", &["7"])).await;
    assert!(w.reasons.is_empty(), "{w:?}");
}

#[tokio::test]
async fn a_persistent_handler_ready_on_no_slot_is_a_reason() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let slot = reserved(&mut c, "ph", "other", "Plain", json!([0])).await;
    register(&mut c, &slot).await;
    push(&mut c, "q", "Booted", json!([1])).await;
    let report = |ready: bool| {
        json!([{"worker": slot.worker_id, "name": "app", "pid": null, "ready": ready,
                "jobs": 0, "jobs_total": 0, "rss_bytes": null, "boots": 3, "restarts": {},
                "backoff_ms": 5000, "last_error": "boot failed: exit status 1"}])
        .to_string()
    };
    let key = keys().handlers("ph");
    let _: () = cmd(&mut c, &["SET", &key, &report(false)]).await;
    let now = server_ms(&mut c).await;
    let w = why(&mut c, payload("q", "Booted", &["1"])).await;
    let [Reason::HandlerNotReady {
        handler,
        slots: 1,
        last_error,
        until_ms: Some(until),
    }] = &w.reasons[..]
    else {
        panic!("{w:?}")
    };
    assert_eq!(handler, "app");
    assert_eq!(last_error, "boot failed: exit status 1");
    assert!(*until >= now + 5000 && *until < now + 6000, "{until} {now}");
    // Ready on one slot: no reason.
    let _: () = cmd(&mut c, &["SET", &key, &report(true)]).await;
    let w = why(&mut c, payload("q", "Booted", &["1"])).await;
    assert!(w.reasons.is_empty(), "{w:?}");
}

#[tokio::test]
async fn a_skipped_queue_is_a_reason_while_its_counter_lasts() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    push(&mut c, "q", "Plain", json!([1])).await;
    let _: () = cmd(&mut c, &["SET", &keys().counter("q"), "1", "PX", "60000"]).await;
    let w = why(&mut c, payload("q", "Plain", &["1"])).await;
    assert!(
        matches!(
            &w.reasons[..],
            [Reason::Skipped {
                counter: 1,
                length: 1,
                until_ms: Some(_),
                ..
            }]
        ),
        "{w:?}"
    );
}

#[tokio::test]
async fn a_unique_key_taken_by_the_push_is_shown_with_its_end() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    live_worker(&mut c, "q").await;
    let o = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(config_file(&r))
        .arg("--redis")
        .arg(r.url())
        .args(["enqueue", "q", "Once", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let now = server_ms(&mut c).await;
    let w = why(&mut c, payload("q", "Once", &["1"])).await;
    assert!(
        matches!(w.place, Place::Queued { position: 0, .. }),
        "{w:?}"
    );
    let u = w.unique.expect("the unique key");
    assert!(u.own, "{u:?}");
    assert_eq!(Some(u.digest.as_str()), w.job.unwrap().digest.as_deref());
    let until = u.until_ms.unwrap();
    assert!(
        until > now + 3_590_000 && until <= now + 3_600_000,
        "{until} {now}"
    );
    let text = stdout(&cli(&r, &["q", "Once", "1"]));
    assert!(text.contains("is taken by this payload"), "{text}");
}
