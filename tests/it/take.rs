//! TAKE (locking-semantics.md A-7a): RESERVE and the job's ACQUIRE+START in one call, by the
//! worker's take plan. At the script level: a free job starts in the call that reserves it, a
//! resend after a lost reply is answered as the first call left things, a locked job is
//! settled away and the next one taken in the same call, and a class or a plan TAKE cannot
//! use leaves the job reserved. With daemons: two daemons whose plans differ (a rolling
//! deploy) run the one-call path and the two-call path side by side, with no overlap under
//! one lock and every job run once.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use locketd::config::plans::Plans;
use locketd::config::Config;
use locketd::handler::Handlers;
use locketd::locks::LockSpec;
use locketd::store::{
    self, random_hex, AcquireOutcome, ReserveFlags, Reserved, Settled, SlotRef, TakeArgs, TakePlan,
    TakeReply, Taken,
};
use redis::aio::MultiplexedConnection as Conn;

use crate::daemon::{cfg, workdir, R};
use crate::policies::{cmd, keys, lrange, payload_of, NS};
use crate::support::Daemon;
use crate::support::{read_lossy, wait_until, write_script, RedisServer};

const CONFIG: &str = "queues = \"q\"\n\
    [classes.Mail]\nbuiltin = \"noop\"\nlock = \"acct:{args[0]}\"\n\
    [classes.Slow]\nbuiltin = \"noop\"\nlock = \"acct:{args[0]}\"\non_conflict = \"delay\"\n";

fn plan() -> TakePlan {
    let config = Config::parse(CONFIG, "take.toml").expect("config");
    let plans = Plans::compile(&config).expect("plans");
    let handlers = Handlers::from_config(&config);
    let handled: Vec<&str> = handlers.classes().collect();
    TakePlan::new(&keys(), &plans, &handled, handlers.has_fallback())
}

struct Slot {
    slot_key: String,
    worker_id: String,
}

impl Slot {
    async fn new(c: &mut Conn, name: &str) -> Slot {
        let slot_key = format!("testhost:{name}:0");
        crate::lock::mark_alive(c, &slot_key).await;
        Slot {
            slot_key,
            worker_id: format!("testhost:{name}:q"),
        }
    }
}

/// One TAKE of `q` on `slot` with `rids` and `token`.
async fn take<C: redis::aio::ConnectionLike + Send>(
    c: &mut C,
    slot: &Slot,
    plan: &TakePlan,
    rids: &[String],
    token: &str,
    resent: bool,
) -> TakeReply {
    let k = keys();
    let sref = SlotRef {
        keys: &k,
        slot_key: &slot.slot_key,
        worker_id: &slot.worker_id,
    };
    // The holder's fields as a worker of this slot writes them (Identity::lockinfo_head).
    let process = slot.slot_key.strip_suffix(":0").expect("slot 0");
    let head = format!(
        r#"{{"process":"{process}","slot":0,"resque_worker":"{}""#,
        slot.worker_id
    );
    let args = TakeArgs {
        plan_key: &plan.key,
        token,
        lock_ttl: Duration::from_secs(30),
        counter_ttl: Duration::from_secs(15),
        lockinfo_head: &head,
        run_at: "2026-11-28T12:00:00.000Z",
        node_worker: "\"testhost:1\"",
        max_payload: 1 << 20,
        resent,
        rid: &rids[0],
        reservations: rids.len(),
    };
    store::take(
        c,
        &sref,
        None,
        &["q".to_string()],
        ReserveFlags::default(),
        &args,
    )
    .await
    .expect("TAKE")
}

/// The rids of a TAKE of up to 8 reservations: a random first, and the ones take.lua makes
/// from it (A-7a), which the step's replies must name.
fn rids() -> Vec<String> {
    let first = random_hex(8);
    (1..=8).map(|k| store::take_rid(&first, k)).collect()
}

async fn push(c: &mut Conn, class: &str, args: serde_json::Value) -> String {
    let k = keys();
    let p = payload_of(class, &args);
    let _: i64 = cmd(c, &["RPUSH", &k.queue("q"), &p]).await;
    let _: i64 = cmd(c, &["SADD", &k.queues(), "q"]).await;
    p
}

fn rid_of(r: &TakeReply) -> String {
    match &r.reserved {
        Ok(Reserved::Job { rid, .. }) => rid.clone(),
        other => panic!("expected a job, got {other:?}"),
    }
}

// A-7a: a job whose locks are free starts in the call that reserved it, and the same call
// sent again (its reply lost) finds it started: the same answer, one holder, nothing reserved
// twice.
#[tokio::test]
async fn a7a_a_free_job_starts_in_one_call_and_a_resend_is_answered_as_it_stands() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let plan = plan();
    store::publish_take_plan(c, &plan).await.expect("publish");
    let p1 = push(c, "Mail", serde_json::json!([7])).await;
    let p2 = push(c, "Mail", serde_json::json!([8])).await;
    let slot = Slot::new(c, "a").await;
    let (rids, token) = (rids(), random_hex(16));
    let first = take(c, &slot, &plan, &rids, &token, false).await;
    assert_eq!(rid_of(&first), rids[0]);
    let want = Taken::Acquired {
        outcome: AcquireOutcome::Started {
            deadline_ms: 0,
            fences: vec![],
        },
        digest: String::new(),
        locks: vec![LockSpec {
            id: "acct:7".into(),
            limit: 1,
        }],
    };
    // The digest: none for a start on free limit-1 locks (the worker works it out).
    let same = |t: &Option<Taken>, no_digest: bool| match (t, &want) {
        (
            Some(Taken::Acquired {
                outcome: AcquireOutcome::Started { .. },
                digest,
                locks,
            }),
            Taken::Acquired {
                digest: d,
                locks: l,
                ..
            },
        ) => (!no_digest || digest == d) && locks == l,
        _ => false,
    };
    assert!(same(&first.taken, true), "{:?}", first.taken);
    assert!(first.settled.is_empty());
    let k = keys();
    let rec: HashMap<String, String> = cmd(c, &["HGETALL", &k.inflight(&slot.slot_key)]).await;
    assert_eq!(rec["state"], "running");
    assert_eq!(rec["token"], token);
    assert_eq!(rec["payload"], p1);
    let lock: String = cmd(c, &["GET", &format!("{NS}:locket:lock:acct:7")]).await;
    assert!(lock.contains(&token), "{lock}");
    assert!(lock.contains(r#""class":"Mail""#) && lock.contains(r#""queue":"q""#));
    let working: String = cmd(c, &["GET", &k.worker(&slot.worker_id)]).await;
    let w: serde_json::Value = serde_json::from_str(&working).expect("working-on JSON");
    assert_eq!(w["queue"], "q");
    assert_eq!(w["payload"]["args"][0], 7);

    // The lock's value has no digest (none was worked out); `locketd locks` gives the one of
    // the payload in the holder's record.
    assert!(!lock.contains("\"digest\""), "{lock}");
    let listing = locketd::admin::read_locks(c, &k, None, 10)
        .await
        .expect("locks");
    let row = listing
        .rows
        .iter()
        .find(|r| r["lock_id"] == "acct:7")
        .expect("acct:7 listed");
    let digest = locketd::locks::canonical::digest("Mail", &serde_json::json!([7]));
    assert_eq!(row["holders"][0]["digest"], digest.as_str());

    let again = take(c, &slot, &plan, &rids, &token, true).await;
    assert_eq!(rid_of(&again), rids[0]);
    assert!(same(&again.taken, false), "{:?}", again.taken);
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![p2],
        "nothing reserved twice"
    );
    let rec2: HashMap<String, String> = cmd(c, &["HGETALL", &k.inflight(&slot.slot_key)]).await;
    assert_eq!(rec2, rec);
}

// A-7a, P-1, PK-1: a job whose lock is held is settled away by its policy (parked) and the
// next job is reserved and taken in the same call; the settled job's digest is the worker's
// (SHA-256 of the canonical class and args), worked out from the payload the step sends back.
#[tokio::test]
async fn a7a_a_locked_job_is_parked_and_the_next_taken_in_the_same_call() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let plan = plan();
    store::publish_take_plan(c, &plan).await.expect("publish");
    push(c, "Mail", serde_json::json!([7])).await;
    let a = Slot::new(c, "a").await;
    let held = take(c, &a, &plan, &rids(), &random_hex(16), false).await;
    assert!(matches!(
        held.taken,
        Some(Taken::Acquired {
            outcome: AcquireOutcome::Started { .. },
            ..
        })
    ));
    let parked_payload = push(c, "Mail", serde_json::json!([7])).await;
    let free = push(c, "Mail", serde_json::json!([9])).await;
    let b = Slot::new(c, "b").await;
    let (rids, token) = (rids(), random_hex(16));
    let got = take(c, &b, &plan, &rids, &token, false).await;
    assert_eq!(got.settled.len(), 1, "{:?}", got.settled);
    let s = &got.settled[0];
    assert_eq!((s.queue.as_str(), s.class.as_str()), ("q", "Mail"));
    assert_eq!(s.rid, rids[0]);
    let digest = locketd::locks::canonical::digest("Mail", &serde_json::json!([7]));
    assert_eq!(s.digest, digest);
    assert!(matches!(
        &s.outcome,
        AcquireOutcome::Conflict {
            action: Settled::Parked,
            ..
        }
    ));
    let parked = lrange(c, &format!("{NS}:locket:parked:lock:acct:7")).await;
    assert_eq!(parked.len(), 1);
    // PK-3: the entry is the job's exact payload; no digest was worked out in Lua for it (its
    // unit would be keyed by the payload's SHA1), the worker's is the one above.
    let entry: serde_json::Value = serde_json::from_str(&parked[0]).expect("entry");
    assert_eq!(entry["payload"], parked_payload.as_str(), "{parked:?}");
    assert!(entry.get("digest").is_none(), "{parked:?}");
    assert_eq!(rid_of(&got), rids[1]);
    let rec: HashMap<String, String> = cmd(c, &["HGETALL", &keys().inflight(&b.slot_key)]).await;
    assert_eq!(
        (rec["state"].as_str(), rec["payload"].as_str()),
        ("running", free.as_str())
    );
}

// A-7a, PK-3: TAKE takes over a handoff to its job whether a release of this version made it
// (`~` and the SHA1 of the payload) or an earlier version did (`~` and the job's digest, which
// TAKE works out in Lua only then); a job of the key for which neither is meant parks.
#[tokio::test]
async fn a7a_take_takes_over_a_handoff_of_either_form() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let plan = plan();
    store::publish_take_plan(c, &plan).await.expect("publish");
    let k = keys();
    let a = Slot::new(c, "a").await;
    for (n, args) in [
        (1, serde_json::json!([5, "x"])),
        (2, serde_json::json!([5, "y"])),
    ] {
        let p = payload_of("Mail", &args);
        let key = if n == 1 {
            locketd::locks::canonical::sha1_hex(p.as_bytes())
        } else {
            locketd::locks::canonical::digest("Mail", &args)
        };
        let v = format!(r#"{{"blocked":0,"token":"~{key}","handoff":true,"queue":"q"}}"#);
        let _: () = cmd(c, &["SET", &k.lock("acct:5"), &v, "PX", "10000"]).await;
        // Another job of the key first: it meets the handoff and parks.
        push(c, "Mail", serde_json::json!([5, "other"])).await;
        let got = take(c, &a, &plan, &rids(), &random_hex(16), false).await;
        assert_eq!(got.settled.len(), 1, "form {n}: {:?}", got.settled);
        assert!(got.taken.is_none(), "form {n}: nothing else queued");
        // The job the handoff is for takes it over in one call.
        let _: i64 = cmd(c, &["RPUSH", &k.queue("q"), &p]).await;
        let token = random_hex(16);
        let got = take(c, &a, &plan, &rids(), &token, false).await;
        assert!(
            matches!(
                got.taken,
                Some(Taken::Acquired {
                    outcome: AcquireOutcome::Started { .. },
                    ..
                })
            ),
            "form {n}: {:?}",
            got.taken
        );
        let held: Option<String> = cmd(c, &["GET", &k.lock("acct:5")]).await;
        assert!(held.unwrap_or_default().contains(&token), "form {n}");
        let _: i64 = cmd(
            c,
            &["DEL", &k.lock("acct:5"), &keys().inflight(&a.slot_key)],
        )
        .await;
    }
}

// A-7a: a class the plan leaves to the worker (a delay policy needs options) and a plan gone
// from Redis leave the job reserved, with the reason, for the worker's own ACQUIRE.
#[tokio::test]
async fn a7a_a_class_or_a_plan_take_cannot_use_leaves_the_job_reserved() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let plan = plan();
    store::publish_take_plan(c, &plan).await.expect("publish");
    push(c, "Slow", serde_json::json!([1])).await;
    let a = Slot::new(c, "a").await;
    let got = take(c, &a, &plan, &rids(), &random_hex(16), false).await;
    assert_eq!(got.taken, Some(Taken::Kept("class".into())));
    let k = keys();
    let state: String = cmd(c, &["HGET", &k.inflight(&a.slot_key), "state"]).await;
    assert_eq!(state, "reserved");

    let _: i64 = cmd(c, &["DEL", &plan.key]).await;
    push(c, "Mail", serde_json::json!([2])).await;
    let b = Slot::new(c, "b").await;
    let got = take(c, &b, &plan, &rids(), &random_hex(16), false).await;
    assert_eq!(got.taken, Some(Taken::Kept("no_plan".into())));
    let state: String = cmd(c, &["HGET", &k.inflight(&b.slot_key), "state"]).await;
    assert_eq!(state, "reserved");
    let locks: Vec<String> = cmd(c, &["KEYS", &format!("{NS}:locket:lock:*")]).await;
    assert!(locks.is_empty(), "{locks:?}");
}

/// The `locketd_takes_total` counts of a daemon's /metrics, by path.
fn takes(d: &Daemon) -> HashMap<String, u64> {
    let addr = crate::service::metrics_addr(d);
    let body = crate::service::scrape(&addr).unwrap_or_default();
    body.lines()
        .filter_map(|l| l.strip_prefix("locketd_takes_total{path=\""))
        .filter_map(|l| {
            let (path, n) = l.split_once("\"} ")?;
            Some((path.to_string(), n.trim().parse().ok()?))
        })
        .collect()
}

// A-7a, NEVER-1: a rolling deploy. Two daemons whose plans for one class differ (the second's
// `max_parked` needs ACQUIRE's options, so TAKE leaves its jobs to the worker) drain one
// queue: the first locks in the call that reserves, the second in two calls, side by side;
// no two jobs under one lock overlap and every job runs once.
#[test]
fn a7a_two_daemons_with_different_plans_run_both_paths_without_overlap() {
    two_daemons_side_by_side(&[]);
}

// A-7a, the multi-slot mode: the same rolling deploy with three slots per process. Their jobs
// (20 ms each) keep the batches light, so the first daemon's slots send TAKE in their batches
// (`one_call` counted), beside the second's two calls; no overlap under one lock, every job once.
#[test]
fn a7a_multi_slot_daemons_take_in_their_batches_beside_two_call_ones_without_overlap() {
    two_daemons_side_by_side(&["--slots", "3"]);
}

/// Two daemons started with `args`, the first with a take plan for `Same`, the second leaving
/// `Same` to two calls, drain 60 jobs over 3 limit-1 locks; see the tests above.
fn two_daemons_side_by_side(args: &[&str]) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let runs = work.path().join("runs.log");
    let script = write_script(
        work.path(),
        "job.sh",
        &format!(
            "tag=$(cat | sed -n 's/.*\"tag\":\\([0-9][0-9]*\\).*/\\1/p')\n\
             echo \"start $(date +%s%N) $tag\" >> {runs}\nsleep 0.02\n\
             echo \"end $(date +%s%N) $tag\" >> {runs}\n",
            runs = runs.display()
        ),
    );
    // A second class that TAKE can lock keeps TAKE on in the second daemon too, so its jobs
    // of `Same` are left to two calls by the plan (counted as `class`), not by TAKE being off.
    let base = cfg("q").class("Other", &script, "lock = \"o:{args[0]}\"");
    let one = base
        .clone()
        .class("Same", &script, "lock = \"k:{args[0]}\"")
        .render();
    let two = base
        .class("Same", &script, "lock = \"k:{args[0]}\"\nmax_parked = 5000")
        .render();
    let start = |config: &str| {
        Daemon::builder(&redis)
            .config(config)
            .arg("--metrics")
            .arg("127.0.0.1:0")
            .args(args.iter().copied())
            .start()
    };
    let mut a = start(&one);
    let mut b = start(&two);
    let mut pipe = redis::pipe();
    pipe.sadd(format!("{NS}:queues"), "q").ignore();
    let mut expected = BTreeSet::new();
    for tag in 0..60u32 {
        let key = tag % 3;
        pipe.rpush(
            format!("{NS}:queue:q"),
            format!(r#"{{"class":"Same","args":[{key}],"tag":{tag}}}"#),
        )
        .ignore();
        expected.insert(tag);
    }
    let () = pipe.query(&mut r.0).expect("push jobs");
    wait_until(Duration::from_secs(90), "every job ran", || {
        read_lossy(&runs).matches("end ").count() == expected.len()
    });
    let text = read_lossy(&runs);
    let mut spans: HashMap<u32, (u128, u128)> = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (t, tag): (u128, u32) = (f[1].parse().expect("time"), f[2].parse().expect("tag"));
        let e = spans.entry(tag).or_insert((0, 0));
        if f[0] == "start" {
            assert_eq!(e.0, 0, "job {tag} started twice");
            e.0 = t;
        } else {
            e.1 = t;
        }
    }
    assert_eq!(spans.keys().copied().collect::<BTreeSet<_>>(), expected);
    for key in 0..3 {
        let mut s: Vec<(u128, u128, u32)> = spans
            .iter()
            .filter(|(tag, _)| *tag % 3 == key)
            .map(|(tag, (b, e))| (*b, *e, *tag))
            .collect();
        s.sort();
        for w in s.windows(2) {
            assert!(w[0].1 <= w[1].0, "jobs of lock k:{key} overlapped: {w:?}");
        }
    }
    // The workers' counts reach the master's /metrics within a second or so.
    let n = |m: &HashMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    wait_until(
        Duration::from_secs(30),
        "both paths counted in /metrics",
        || n(&takes(&a), "one_call") > 0 && n(&takes(&b), "class") > 0,
    );
    let tb = takes(&b);
    assert_eq!(n(&tb, "one_call"), 0, "b: {tb:?}");
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    assert_eq!(a.terminate(Duration::from_secs(30)).code(), Some(0));
    assert_eq!(b.terminate(Duration::from_secs(30)).code(), Some(0));
}

// A-7a, the arguments: the one-slot job path's own connection sends TAKE's keys and arguments
// whole once, then as their changes from the list the FUNCTION library keeps for the slot
// (take_args.lua); a library that no longer holds the list (loaded again) answers before doing
// anything, and the list goes whole. Every TAKE does what the whole call does.
#[tokio::test]
async fn a7a_take_arguments_go_as_their_changes_and_whole_when_the_library_lost_them() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    if crate::lock::redis_major(c).await < 7 {
        eprintln!("note: Redis < 7 has no FUNCTION; TAKE goes whole by EVALSHA");
        return;
    }
    let plan = plan();
    store::publish_take_plan(c, &plan).await.expect("publish");
    let manager = server
        .client()
        .get_connection_manager()
        .await
        .expect("connection manager");
    let mut conn = store::batch::Conn::with_plain(manager, &server.url());
    let slot = Slot::new(c, "a").await;
    let k = keys();
    let _: String = cmd(c, &["CONFIG", "SET", "slowlog-log-slower-than", "0"]).await;
    let _: String = cmd(c, &["CONFIG", "SET", "slowlog-max-len", "10000"]).await;
    let _: String = cmd(c, &["SLOWLOG", "RESET"]).await;
    for round in 0..4 {
        if round == 2 {
            // The library loaded again: its Lua values, the slot's list among them, are new.
            let source = &store::scripts::scripts().library.source;
            let _: String = cmd(c, &["FUNCTION", "LOAD", "REPLACE", source]).await;
        }
        let p = push(c, "Mail", serde_json::json!([round])).await;
        let (rids, token) = (rids(), random_hex(16));
        let got = take(&mut conn, &slot, &plan, &rids, &token, false).await;
        assert_eq!(rid_of(&got), rids[0], "round {round}");
        match &got.taken {
            Some(Taken::Acquired {
                outcome: AcquireOutcome::Started { .. },
                locks,
                ..
            }) => assert_eq!(locks[0].id, format!("acct:{round}"), "round {round}"),
            other => panic!("round {round}: {other:?}"),
        }
        let rec: HashMap<String, String> = cmd(c, &["HGETALL", &k.inflight(&slot.slot_key)]).await;
        assert_eq!(
            (
                rec["state"].as_str(),
                rec["token"].as_str(),
                rec["payload"].as_str()
            ),
            ("running", token.as_str(), p.as_str()),
            "round {round}"
        );
        let lock: String = cmd(c, &["GET", &format!("{NS}:locket:lock:acct:{round}")]).await;
        assert!(lock.contains(&token), "round {round}: {lock}");
        // The slot is free again for the next round.
        let lock_key = format!("{NS}:locket:lock:acct:{round}");
        let _: i64 = cmd(c, &["DEL", &k.inflight(&slot.slot_key), &lock_key]).await;
    }
    // The calls, oldest first: each `take_args` FCALL's base version ("" for a whole list) and
    // its number of arguments.
    let log: redis::Value = cmd(c, &["SLOWLOG", "GET", "10000"]).await;
    let redis::Value::Array(entries) = log else {
        panic!("SLOWLOG GET: {log:?}")
    };
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    let mut calls: Vec<(String, usize)> = entries
        .iter()
        .rev()
        .filter_map(|e| match e {
            redis::Value::Array(f) => match f.get(3) {
                Some(redis::Value::Array(args))
                    if args.len() > 4 && text(&args[1]).ends_with("_take_args") =>
                {
                    Some((text(&args[4]), args.len()))
                }
                _ => None,
            },
            _ => None,
        })
        .collect();
    let bases: Vec<&str> = calls.iter().map(|(b, _)| b.as_str()).collect();
    // Whole; changes from version 1; changes from 2, missed by the new library; whole; changes
    // from 4.
    assert_eq!(bases, ["", "1", "2", "", "4"], "{calls:?}");
    // A list of changes is a few entries: the rids, the token, the clock; the slot's keys
    // and texts are not sent again.
    let (whole, changes) = (calls.remove(0).1, calls.remove(0).1);
    assert!(
        changes * 2 < whole,
        "changes {changes} arguments against {whole} whole"
    );
}
