//! Parked waits (parked-waits.md, locking-semantics.md PK-1..PK-10): the `park` conflict
//! policy at the script level and through the real daemon, against a real redis-server.

use std::time::Duration;

use locketd::locks::canonical::sha1_hex;
use locketd::locks::Policy;
use locketd::store::{self, AcquireOutcome, Finish, Settled};
use redis::aio::MultiplexedConnection as Conn;
use serde_json::json;

use crate::policies::{cmd, exists, keys, lrange, opts, reserve_next, reserved, spec};
use crate::support::RedisServer;

async fn llen(c: &mut Conn, key: &str) -> i64 {
    cmd(c, &["LLEN", key]).await
}

fn parked_key(res: &str) -> String {
    keys().locket(&format!("parked:{res}"))
}

// PK-1, PK-2, PK-3: a conflicting job parks on the lock (not its queue, no counter), the
// holder's release wakes it to the head of its queue with the unit handed to it, and a third
// job of the key meets the handoff and parks behind.
#[tokio::test]
async fn pk1_pk2_a_conflict_parks_and_the_release_hands_the_lock_to_the_first_parked_job() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let lock = [spec("user:1", 1)];
    let mut a = reserved(&mut c, "pa", "q", "Hot", json!([1, "a"])).await;
    assert!(matches!(
        a.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([1, "b"])).await;
    match b.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    assert!(!exists(&mut c, &b.inflight()).await, "the record went");
    assert_eq!(llen(&mut c, &k.queue("q")).await, 0, "not requeued");
    assert!(!exists(&mut c, &k.counter("q")).await, "no counter");
    assert_eq!(llen(&mut c, &parked_key("lock:user:1")).await, 1);
    let score: Option<f64> = cmd(&mut c, &["ZSCORE", &k.locket("parked"), "lock:user:1"]).await;
    assert!(score.is_some(), "indexed");
    let per_q: Option<i64> = cmd(&mut c, &["HGET", &k.locket("parked_queues"), "q"]).await;
    assert_eq!(per_q, Some(1));
    // The holder's release wakes b: head of its queue, the lock handed to it.
    assert!(a.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert_eq!(lrange(&mut c, &k.queue("q")).await, vec![b.payload.clone()]);
    assert_eq!(llen(&mut c, &parked_key("lock:user:1")).await, 0);
    assert!(exists(&mut c, &k.lock("user:1")).await, "handed, not freed");
    let score: Option<f64> = cmd(&mut c, &["ZSCORE", &k.locket("parked"), "lock:user:1"]).await;
    assert!(score.is_none(), "out of the index");
    // A fresh job of the key meets the handoff and parks.
    let mut d = reserved(&mut c, "pd", "q2", "Hot", json!([1, "d"])).await;
    match d.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    // b takes its handoff over.
    let mut b2 = reserve_next(&mut c, "pb", "q").await;
    assert_eq!(b2.payload, b.payload);
    assert!(matches!(
        b2.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    // b's release wakes d in turn.
    assert!(b2.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert_eq!(
        lrange(&mut c, &k.queue("q2")).await,
        vec![d.payload.clone()]
    );
    let per_q: Vec<String> = cmd(&mut c, &["HGETALL", &k.locket("parked_queues")]).await;
    assert_eq!(per_q, vec!["q", "0", "q2", "0"]);
    let mut d2 = reserve_next(&mut c, "pd", "q2").await;
    assert!(matches!(
        d2.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    assert!(d2.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert!(!exists(&mut c, &k.lock("user:1")).await, "free at last");
}

// PK-3: a release hands the lock to the first parked job under `~` and the SHA1 of its exact
// payload (Redis's own SHA1: no digest is needed, and TAKE sends none), and that job takes it
// over. A handoff an earlier version left, `~` and the job's digest, is taken over by its job
// too, and refused to another job of the key.
#[tokio::test]
async fn pk3_the_handoff_is_keyed_by_the_payload_sha1_and_an_earlier_digest_handoff_still_works() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let lock = [spec("user:9", 1)];
    let token_of = |v: Option<String>| -> String {
        let v: serde_json::Value = serde_json::from_str(&v.expect("lock value")).expect("JSON");
        v["token"].as_str().unwrap_or_default().to_string()
    };
    let mut a = reserved(&mut c, "pa", "q", "Hot", json!([9, "a"])).await;
    assert!(matches!(
        a.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([9, "b"])).await;
    b.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    assert!(a.finish(&mut c, &lock, Finish::Success, &[]).await);
    let handed: Option<String> = cmd(&mut c, &["GET", &k.lock("user:9")]).await;
    assert_eq!(
        token_of(handed),
        format!("~{}", sha1_hex(b.payload.as_bytes()))
    );
    let mut b2 = reserve_next(&mut c, "pb", "q").await;
    assert!(matches!(
        b2.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    assert!(b2.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert!(!exists(&mut c, &k.lock("user:9")).await, "free");

    // The handoff as an earlier version leaves it, to d's digest.
    let mut d = reserved(&mut c, "pd", "q", "Hot", json!([9, "d"])).await;
    let mut e = reserved(&mut c, "pe", "q", "Hot", json!([9, "e"])).await;
    let old = format!(
        r#"{{"blocked":0,"token":"~{}","handoff":true,"queue":"q"}}"#,
        d.digest
    );
    let _: () = cmd(&mut c, &["SET", &k.lock("user:9"), &old, "PX", "10000"]).await;
    match e.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("another job took d's handoff: {other:?}"),
    }
    assert!(matches!(
        d.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    // d's release hands the lock on to e, the new way.
    assert!(d.finish(&mut c, &lock, Finish::Success, &[]).await);
    let handed: Option<String> = cmd(&mut c, &["GET", &k.lock("user:9")]).await;
    assert_eq!(
        token_of(handed),
        format!("~{}", sha1_hex(e.payload.as_bytes()))
    );
}

// PK-4: a holder that lapses wakes nobody by itself; the janitor's pass over the index does.
#[tokio::test]
async fn pk4_the_janitor_wakes_the_jobs_of_a_lapsed_holder() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let lock = [spec("user:2", 1)];
    let mut a = reserved(&mut c, "pa", "q", "Hot", json!([2, "a"])).await;
    assert!(matches!(
        a.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([2, "b"])).await;
    b.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    // The holder's host died: its lease lapses.
    let _: i64 = cmd(&mut c, &["PEXPIRE", &k.lock("user:2"), "1"]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _: i64 = cmd(&mut c, &["ZADD", &k.locket("parked"), "0", "lock:user:2"]).await;
    let r = store::wake_due(&mut c, &k, 100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(r.woken, 1, "{r:?}");
    assert_eq!(lrange(&mut c, &k.queue("q")).await, vec![b.payload.clone()]);
}

// The members of a limit-N lock's ZSET whose name starts with `~`: units kept for woken jobs.
async fn kept_units(c: &mut Conn, id: &str) -> Vec<String> {
    let members: Vec<String> = cmd(c, &["ZRANGE", &keys().lock(id), "0", "-1"]).await;
    members.into_iter().filter(|m| m.starts_with('~')).collect()
}

// PK-3 for a limit-2 lock at the script level: a release keeps the freed unit for the job it
// wakes, a fresh job meets the lock full and parks, the woken job takes the unit over; a kept
// unit its job never takes lapses, and the janitor's purge keeps it for the next job instead.
#[tokio::test]
async fn pk3_a_limit_n_release_keeps_the_unit_for_the_woken_job_until_it_lapses() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let lock = [spec("team:1", 2)];
    let mut a = reserved(&mut c, "pa", "q", "Hot", json!([1, "a"])).await;
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([1, "b"])).await;
    for j in [&mut a, &mut b] {
        assert!(matches!(
            j.acquire(&mut c, &lock, &opts(Policy::Park)).await,
            AcquireOutcome::Started { .. }
        ));
    }
    let mut w = reserved(&mut c, "pw", "q", "Hot", json!([1, "w"])).await;
    w.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    assert_eq!(llen(&mut c, &parked_key("lock:team:1")).await, 1);
    // a's release wakes w and keeps the unit for it: still two holders.
    assert!(a.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert_eq!(lrange(&mut c, &k.queue("q")).await, vec![w.payload.clone()]);
    let kept = kept_units(&mut c, "team:1").await;
    assert_eq!(kept, vec![format!("~{}", sha1_hex(w.payload.as_bytes()))]);
    let info: Option<String> = cmd(&mut c, &["HGET", &k.lockinfo("team:1"), &kept[0]]).await;
    assert!(info.unwrap_or_default().contains("\"handoff\":true"));
    // A fresh job of the key, from a higher queue, meets the lock full and parks.
    let mut f = reserved(&mut c, "pf", "high", "Hot", json!([1, "f"])).await;
    match f.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    // w takes its unit over: two real holders, nothing kept.
    let mut w2 = reserve_next(&mut c, "pw", "q").await;
    assert_eq!(w2.payload, w.payload);
    assert!(matches!(
        w2.acquire(&mut c, &lock, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    assert!(kept_units(&mut c, "team:1").await.is_empty());
    let holders: i64 = cmd(&mut c, &["ZCARD", &k.lock("team:1")]).await;
    assert_eq!(holders, 2);
    // b's release keeps its unit for f; f's job never comes (its queue is not served): the
    // kept unit lapses like a lease, and the janitor keeps the unit for the next parked job.
    let mut g = reserved(&mut c, "pg", "q", "Hot", json!([1, "g"])).await;
    g.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    assert!(b.finish(&mut c, &lock, Finish::Success, &[]).await);
    assert_eq!(
        lrange(&mut c, &k.queue("high")).await,
        vec![f.payload.clone()]
    );
    let kept = kept_units(&mut c, "team:1").await;
    assert_eq!(kept.len(), 1);
    let _: i64 = cmd(&mut c, &["ZADD", &k.lock("team:1"), "XX", "1", &kept[0]]).await;
    let _: i64 = cmd(&mut c, &["ZADD", &k.locket("parked"), "0", "lock:team:1"]).await;
    let woke = store::wake_due(&mut c, &k, 100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(woke.woken, 1, "{woke:?}");
    assert_eq!(lrange(&mut c, &k.queue("q")).await, vec![g.payload.clone()]);
    let now_kept = kept_units(&mut c, "team:1").await;
    assert_eq!(now_kept.len(), 1);
    assert_ne!(now_kept, kept, "the lapsed unit went to g");
    // f comes late: the lock is full (w and g's unit), so it parks again.
    let mut f2 = reserve_next(&mut c, "pf", "high").await;
    match f2.acquire(&mut c, &lock, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    let holders: i64 = cmd(&mut c, &["ZCARD", &k.lock("team:1")]).await;
    assert_eq!(holders, 2, "never more than the limit");
}

// L-1b at the script level: two jobs parked with limit 2 are woken with a unit each; a daemon
// whose limit for the class is now 1 reserves them. The first one the lock refuses (the other
// unit is there) parks again at the head and gives its unit back; the second then finds only
// its own unit, takes the lock over as a limit-1 lock, and its release hands the lock to the
// first. Before, each unit counted against the other job: both parked again with their units
// kept, and nothing ran until they lapsed (and then again, at each wake).
#[tokio::test]
async fn l1b_jobs_woken_with_units_of_a_larger_limit_take_the_lock_with_limit_one() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let wide = [spec("team:9", 2)];
    let narrow = [spec("team:9", 1)];
    let mut holders = Vec::new();
    for name in ["a", "b"] {
        let mut h = reserved(&mut c, &format!("p{name}"), "hold", "Hot", json!([9, name])).await;
        assert!(matches!(
            h.acquire(&mut c, &wide, &opts(Policy::Park)).await,
            AcquireOutcome::Started { .. }
        ));
        holders.push(h);
    }
    for name in ["w1", "w2"] {
        let mut w = reserved(&mut c, &format!("p{name}"), "q", "Hot", json!([9, name])).await;
        match w.acquire(&mut c, &wide, &opts(Policy::Park)).await {
            AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
            other => panic!("{other:?}"),
        }
    }
    for h in holders {
        assert!(h.finish(&mut c, &wide, Finish::Success, &[]).await);
    }
    assert_eq!(
        kept_units(&mut c, "team:9").await.len(),
        2,
        "a unit kept for each"
    );
    // The new daemon (limit 1) reserves the first woken job: the other's unit is there.
    let mut first = reserve_next(&mut c, "n1", "q").await;
    match first.acquire(&mut c, &narrow, &opts(Policy::Park)).await {
        AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
        other => panic!("{other:?}"),
    }
    assert_eq!(llen(&mut c, &parked_key("lock:team:9")).await, 1);
    assert_eq!(
        kept_units(&mut c, "team:9").await.len(),
        1,
        "its unit went back"
    );
    // The second finds only its own unit: it takes the lock, as a limit-1 lock.
    let mut second = reserve_next(&mut c, "n2", "q").await;
    assert_ne!(second.payload, first.payload);
    assert!(matches!(
        second.acquire(&mut c, &narrow, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    let t: String = cmd(&mut c, &["TYPE", &k.lock("team:9")]).await;
    assert_eq!(t, "string");
    assert!(!exists(&mut c, &k.lockinfo("team:9")).await);
    let indexed: Option<f64> = cmd(&mut c, &["ZSCORE", &k.locket("locks"), "team:9"]).await;
    assert!(indexed.is_none(), "a limit-1 lock is not in the index");
    // Its release hands the lock to the first, which runs with limit 1 too.
    assert!(second.finish(&mut c, &narrow, Finish::Success, &[]).await);
    assert_eq!(
        lrange(&mut c, &k.queue("q")).await,
        vec![first.payload.clone()]
    );
    let mut again = reserve_next(&mut c, "n1", "q").await;
    assert!(matches!(
        again.acquire(&mut c, &narrow, &opts(Policy::Park)).await,
        AcquireOutcome::Started { .. }
    ));
    assert!(again.finish(&mut c, &narrow, Finish::Success, &[]).await);
    assert!(!exists(&mut c, &k.lock("team:9")).await, "free at last");
    assert!(!exists(&mut c, &parked_key("lock:team:9")).await);
}

// ---------------------------------------------------------------------------------------------
// Through the daemon
// ---------------------------------------------------------------------------------------------

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon};
use std::path::{Path, PathBuf};
use std::time::Instant;

const LONG: Duration = Duration::from_secs(60);

/// A handler that logs `start <args>` and `end <args>` around `body` (shell), to `log`.
fn handler(dir: &Path, name: &str, log: &Path, body: &str) -> PathBuf {
    write_script(
        dir,
        name,
        &format!(
            "cat >/dev/null\necho \"start $LOCKETD_ARGS\" >> {log}\n{body}\nrc=$?\n\
             echo \"end $LOCKETD_ARGS\" >> {log}\nexit $rc\n",
            log = log.display()
        ),
    )
}

/// The `start` lines of a handler log, in order: each job's args.
fn started(log: &Path) -> Vec<String> {
    read_lossy(log)
        .lines()
        .filter_map(|l| l.strip_prefix("start ").map(str::to_string))
        .collect()
}

fn ended(log: &Path) -> usize {
    read_lossy(log)
        .lines()
        .filter(|l| l.starts_with("end "))
        .count()
}

fn max_running(log: &Path) -> usize {
    crate::support::most_at_once(&read_lossy(log))
}

fn stat(r: &mut R, event: &str) -> i64 {
    r.int(&format!("{NS}:locket:stat:{event}"))
}

/// The PK-3 tests' handler: a job whose second arg starts with `h` (a holder) runs until
/// `release` exists (at most 30 s); any other sleeps `secs`.
fn held_until(dir: &Path, log: &Path, release: &Path, secs: &str) -> PathBuf {
    handler(
        dir,
        "hot.sh",
        log,
        &format!(
            "case \"$LOCKETD_ARGS\" in *'\"h'*) i=0; while [ ! -f {} ] && [ $i -lt 300 ]; \
             do sleep 0.1; i=$((i+1)); done;; *) sleep {secs};; esac",
            release.display()
        ),
    )
}

/// The PK-3 tests' configuration: class `Hot` locked on `user:{args[0]}` (plus `extra`).
fn hot_config(h: &Path, queues: &str, extra: &str) -> String {
    cfg(queues)
        .locket("lock_ttl", "\"10s\"")
        .locket("process_ttl", "\"20s\"")
        .class("Hot", h, &format!("lock = \"user:{{args[0]}}\"{extra}"))
        .render()
}

/// The second arg of each job parked in `key`, head first.
fn parking_order(r: &mut R, key: &str) -> Vec<i64> {
    let entries: Vec<String> = r.cmd(&["LRANGE", key, "0", "-1"]);
    entries
        .iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(e).unwrap();
            let p: serde_json::Value =
                serde_json::from_str(v["payload"].as_str().unwrap()).unwrap();
            p["args"][1].as_i64().unwrap()
        })
        .collect()
}

/// The second arg of each job in the order they started, past the first `skip` (the holders).
fn start_order(log: &Path, skip: usize) -> Vec<i64> {
    started(log)[skip..]
        .iter()
        .map(|a| {
            let v: serde_json::Value = serde_json::from_str(a).unwrap();
            v[1].as_i64().unwrap()
        })
        .collect()
}

// PK-3: 50 jobs of one key, parked behind a running holder, run in the order they parked, and
// jobs of the key that arrive on a higher queue meanwhile (while they wait, and while they run)
// park behind them instead of jumping ahead. Two workers park them, so the parking order is
// read from the parked list before the holder ends.
#[test]
fn pk3_jobs_of_one_key_run_in_parking_order_while_others_arrive_on_a_higher_queue() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let release = work.path().join("release");
    let h = held_until(work.path(), &log, &release, "0.02");
    let config = |queues: &str| hot_config(&h, queues, "");
    // The holder runs on a daemon of its own queue.
    let mut holder = Daemon::start(&redis, &config("hold"), &[]);
    r.push("hold", r#"{"class":"Hot","args":[1,"h"]}"#);
    wait_until(LONG, "the holder runs", || started(&log).len() == 1);
    for i in 0..50 {
        r.push("low", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    let mut d = Daemon::start(&redis, &config("high,low"), &["--workers", "2"]);
    let parked = format!("{NS}:locket:parked:lock:user:1");
    wait_until(LONG, "the backlog parked", || r.llen(&parked) == 50);
    for j in 0..10 {
        r.push(
            "high",
            &format!(r#"{{"class":"Hot","args":[1,{}]}}"#, 100 + j),
        );
    }
    wait_until(LONG, "the higher queue's jobs parked", || {
        r.llen(&parked) == 60
    });
    let parking_order = parking_order(&mut r, &parked);
    let mut lows: Vec<i64> = parking_order.iter().copied().filter(|i| *i < 100).collect();
    lows.sort();
    assert_eq!(lows, (0..50).collect::<Vec<_>>());
    assert!(
        parking_order[..50].iter().all(|i| *i < 100),
        "the higher queue's jobs parked behind: {parking_order:?}"
    );
    std::fs::write(&release, "").unwrap();
    // More jobs of the key on the higher queue while the backlog runs.
    wait_until(LONG, "ten jobs ran", || ended(&log) >= 11);
    for j in 0..5 {
        r.push(
            "high",
            &format!(r#"{{"class":"Hot","args":[1,{}]}}"#, 200 + j),
        );
    }
    wait_until(LONG, "every job ran", || ended(&log) == 66);
    let order = start_order(&log, 1);
    assert_eq!(order[..60], parking_order[..], "parking order");
    let mut late = order[60..].to_vec();
    late.sort();
    assert_eq!(late, (200..205).collect::<Vec<_>>());
    assert_eq!(max_running(&log), 1);
    // The job path's counts are written once a second, and at the stop.
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(holder.terminate(LONG).code(), Some(0));
    assert_eq!(stat(&mut r, "requeued"), 0);
    assert!(stat(&mut r, "parked") >= 65, "{}", stat(&mut r, "parked"));
}

// PK-3 for a lock of a larger limit: each unit a holder frees is kept for the next parked job
// (a `~<digest>` member), so jobs of the key that arrive on a higher queue while the backlog
// runs park behind it instead of taking the freed units, and the backlog runs in parking order
// (two at a time: a neighbour may start first). Before, the woken job went to its queue's
// head, a new job on the higher queue took the unit, and the woken one parked again at the tail
// (seen: the higher queue's jobs started 6th to 10th, the woken ones last).
#[test]
fn pk3_a_limit_two_lock_keeps_each_freed_unit_for_the_next_parked_job() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let release = work.path().join("release");
    let h = held_until(work.path(), &log, &release, "0.05");
    let config = |queues: &str| hot_config(&h, queues, "\nlimit = 2");
    let mut holder = Daemon::start(&redis, &config("hold"), &["--workers", "2"]);
    r.push("hold", r#"{"class":"Hot","args":[1,"h1"]}"#);
    r.push("hold", r#"{"class":"Hot","args":[1,"h2"]}"#);
    wait_until(LONG, "the two holders run", || started(&log).len() == 2);
    for i in 0..30 {
        r.push("low", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    let mut d = Daemon::start(&redis, &config("high,low"), &["--workers", "2"]);
    let parked = format!("{NS}:locket:parked:lock:user:1");
    wait_until(LONG, "the backlog parked", || r.llen(&parked) == 30);
    let parking_order = parking_order(&mut r, &parked);
    std::fs::write(&release, "").unwrap();
    wait_until(LONG, "six jobs ran", || ended(&log) >= 6);
    for j in 0..5 {
        r.push(
            "high",
            &format!(r#"{{"class":"Hot","args":[1,{}]}}"#, 200 + j),
        );
    }
    wait_until(LONG, "every job ran", || ended(&log) == 37);
    let order = start_order(&log, 2);
    // A late job is woken only after every backlog job: at most one of those (woken with it,
    // the other unit's) can still be waiting to start when it starts.
    for late in 200..205 {
        let at = order.iter().position(|j| *j == late).unwrap();
        assert!(
            at >= 29,
            "job {late} of the higher queue started {at}th, ahead of the backlog: {order:?}"
        );
    }
    // The backlog's own order (a late job may be 30th, beside the last backlog job).
    let backlog: Vec<i64> = order.iter().copied().filter(|j| *j < 200).collect();
    assert_eq!(backlog.len(), 30, "{order:?}");
    for (at, job) in backlog.iter().enumerate() {
        let parked_at = parking_order.iter().position(|p| p == job).unwrap();
        assert!(
            at.abs_diff(parked_at) <= 2,
            "job {job} parked {parked_at}th, started {at}th: {order:?} (parked {parking_order:?})"
        );
    }
    assert!(max_running(&log) <= 2, "{}", max_running(&log));
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(holder.terminate(LONG).code(), Some(0));
    assert_eq!(stat(&mut r, "requeued"), 0);
}

// PK-4: the holder's whole daemon is SIGKILLed (no release ever runs, and its process lease
// outlives the lock's): the jobs parked on its lock run within lock_ttl + 2 s after the kill,
// woken by the janitor of another daemon.
#[test]
fn pk4_parked_jobs_run_soon_after_the_lease_of_a_sigkilled_holder_lapses() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(
        work.path(),
        "hot.sh",
        &log,
        "case \"$LOCKETD_ARGS\" in *holder*) sleep 60;; esac",
    );
    let config = cfg("q")
        .locket("lock_ttl", "\"2s\"")
        .locket("process_ttl", "\"30s\"")
        .class("Hot", &h, "lock = \"user:{args[0]}\"")
        .render();
    let mut holder = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Hot","args":[1,"holder"]}"#);
    wait_until(LONG, "the holder runs", || started(&log).len() == 1);
    let mut other = Daemon::builder(&redis)
        .config(&format!("{config}\n"))
        .arg("--metrics")
        .arg("127.0.0.1:0")
        .start();
    for i in 0..5 {
        r.push("q", &format!(r#"{{"class":"Hot","args":[1,"w{i}"]}}"#));
    }
    let parked = format!("{NS}:locket:parked:lock:user:1");
    wait_until(LONG, "five jobs parked", || r.llen(&parked) == 5);
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    // PK-8: /metrics shows them (the parks' count is written within a second).
    let addr = crate::service::metrics_addr(&other);
    wait_until(LONG, "the parks in /metrics", || {
        let body = crate::service::scrape(&addr).unwrap_or_default();
        body.contains("locketd_parked_jobs{queue=\"q\"} 5")
            && body.contains("locketd_parks_total 5")
    });
    let killed = Instant::now();
    holder.kill_master_and_workers();
    wait_until(LONG, "the parked jobs ran", || ended(&log) == 5);
    let took = killed.elapsed();
    assert!(
        took <= Duration::from_secs(2 + 2 + 1),
        "parked jobs ran {took:?} after their holder died (lock_ttl 2s)"
    );
    holder.kill();
    assert_eq!(other.terminate(LONG).code(), Some(0));
    assert_eq!(stat(&mut r, "requeued"), 0);
}

// PK-5, NEVER-1: a limit-3 lock with 30 parked jobs: never more than 3 run at once, all 30 run.
#[test]
fn pk5_a_limit_three_lock_with_thirty_parked_jobs_runs_them_all_three_at_a_time() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = handler(work.path(), "hot.sh", &log, "sleep 0.1");
    let config = cfg("q")
        .class("Hot", &h, "lock = \"user:{args[0]}\"\nlimit = 3")
        .render();
    for i in 0..33 {
        r.push("q", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    let mut ds: Vec<Daemon> = (0..2)
        .map(|_| Daemon::start(&redis, &config, &["--workers", "3"]))
        .collect();
    let mut max_seen = 0;
    wait_until(LONG, "every job ran", || {
        max_seen = max_seen.max(r.lock_holders(&format!("{NS}:locket:lock:user:1")).len());
        ended(&log) == 33
    });
    assert!(max_running(&log) <= 3, "{}", max_running(&log));
    assert!(max_seen <= 3, "{max_seen}");
    assert_eq!(started(&log).len(), 33);
    for d in &mut ds {
        assert_eq!(d.terminate(LONG).code(), Some(0));
    }
    assert_eq!(stat(&mut r, "requeued"), 0);
    assert!(stat(&mut r, "parked") > 0);
}

// PK-7, PK-2 for holds: 2,500 dependents parked on a hold all run after its release, woken in
// batches of 1,000 (the release's own step, then the janitor).
#[test]
fn pk7_a_hold_with_2500_parked_dependents_wakes_them_all_in_batches() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let a = handler(work.path(), "a.sh", &log, "sleep 3");
    let config = cfg("q")
        .class(
            "Import",
            &a,
            "lock = false\nholds = [{ name = \"batch:{args[0]}\", when = \"start\", release_on = \"completion\" }]",
        )
        .render()
        + "\n[classes.Report]\nbuiltin = \"noop\"\nlock = false\n\
           locked_by = [\"batch:{args[0]}\"]\non_dependency_conflict = \"park\"\n";
    let mut d = Daemon::start(&redis, &config, &["--workers", "2"]);
    r.push("q", r#"{"class":"Import","args":[7]}"#);
    wait_until(LONG, "the import runs", || started(&log).len() == 1);
    let mut pipe = redis::pipe();
    for i in 0..2500 {
        pipe.cmd("RPUSH")
            .arg(format!("{NS}:queue:q"))
            .arg(format!(r#"{{"class":"Report","args":[7,{i}]}}"#))
            .ignore();
    }
    let _: () = pipe.query(&mut r.0).unwrap();
    let parked = format!("{NS}:locket:parked:dep:batch:7");
    wait_until(LONG, "every report ran", || r.processed() == 2501);
    assert_eq!(r.llen(&parked), 0);
    assert!(r.failures().is_empty());
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert!(stat(&mut r, "parked") >= 1000, "{}", stat(&mut r, "parked"));
    assert_eq!(stat(&mut r, "requeued"), 0);
    assert_eq!(stat(&mut r, "delayed"), 0);
}

// Section 1's shape, small: one queue, jobs of one user behind a limit-1 lock and free jobs:
// no job is ever requeued, all run (the cost per job is locketd-bench's `hot-key`).
#[test]
fn pk1_a_hot_key_backlog_is_parked_not_cycled() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let config = cfg("q").render()
        + "\n[classes.Hot]\nbuiltin = \"sleep\"\nlock = \"user:{args[1]}\"\n\
           \n[classes.Free]\nbuiltin = \"noop\"\nlock = false\n";
    let mut pipe = redis::pipe();
    for i in 0..100 {
        pipe.cmd("RPUSH")
            .arg(format!("{NS}:queue:q"))
            .arg(format!(r#"{{"class":"Hot","args":[0.02,"u1",{i}]}}"#))
            .ignore();
        for j in 0..2 {
            pipe.cmd("RPUSH")
                .arg(format!("{NS}:queue:q"))
                .arg(format!(r#"{{"class":"Free","args":[{i},{j}]}}"#))
                .ignore();
        }
    }
    pipe.cmd("SADD")
        .arg(format!("{NS}:queues"))
        .arg("q")
        .ignore();
    let _: () = pipe.query(&mut r.0).unwrap();
    let mut d = Daemon::start(&redis, &config, &["--workers", "2"]);
    wait_until(LONG, "every job ran", || r.processed() == 300);
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(stat(&mut r, "requeued"), 0);
    assert!(stat(&mut r, "parked") > 0);
}

fn cli(redis: &RedisServer, dir: &Path, args: &[&str]) -> std::process::Output {
    let config = dir.join("locketd.toml");
    std::fs::write(&config, "queues = \"*\"\n").unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(&config)
        .arg("--redis")
        .arg(redis.url())
        .args(args)
        .output()
        .expect("run locketd")
}

// PK-8, PK-9: with jobs parked on three locks, `locketd parked` lists them (per lock and per
// queue) and `locketd unpark --all` puts every one back in its queue exactly once, leaving no
// parked list, index entry or count behind.
#[tokio::test]
async fn pk9_unpark_all_moves_every_parked_job_back_to_its_queue_once() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let work = workdir();
    let mut want: Vec<String> = Vec::new();
    for (n, lock) in ["a", "b", "c"].iter().enumerate() {
        let l = [spec(&format!("user:{lock}"), 1)];
        let mut holder = reserved(&mut c, &format!("h{n}"), "q", "Hot", json!([lock, "h"])).await;
        assert!(matches!(
            holder.acquire(&mut c, &l, &opts(Policy::Park)).await,
            AcquireOutcome::Started { .. }
        ));
        for i in 0..(n + 2) {
            let q = if i % 2 == 0 { "q" } else { "q2" };
            let mut j = reserved(&mut c, &format!("w{n}{i}"), q, "Hot", json!([lock, i])).await;
            match j.acquire(&mut c, &l, &opts(Policy::Park)).await {
                AcquireOutcome::Conflict { action, .. } => assert_eq!(action, Settled::Parked),
                other => panic!("{other:?}"),
            }
            want.push(j.payload.clone());
        }
    }
    assert_eq!(llen(&mut c, &k.queue("q")).await, 0);
    let out = cli(&r, work.path(), &["parked", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"].as_array().unwrap().len(), 9, "{v}");
    assert_eq!(v["resources"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["queues"]["q"], 5, "{v}");
    assert_eq!(v["queues"]["q2"], 4, "{v}");
    let out = cli(&r, work.path(), &["parked", "--queue", "q2", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"].as_array().unwrap().len(), 4, "{v}");
    let out = cli(&r, work.path(), &["status"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("PARKED"),
        "{out:?}"
    );

    let out = cli(&r, work.path(), &["unpark", "--all"]);
    assert!(out.status.success(), "{out:?}");
    let mut back = lrange(&mut c, &k.queue("q")).await;
    back.extend(lrange(&mut c, &k.queue("q2")).await);
    back.sort();
    want.sort();
    assert_eq!(back, want, "every job back once");
    for lock in ["a", "b", "c"] {
        assert!(!exists(&mut c, &parked_key(&format!("lock:user:{lock}"))).await);
    }
    let n: i64 = cmd(&mut c, &["ZCARD", &k.locket("parked")]).await;
    assert_eq!(n, 0);
    let per_q = store::parked_per_queue(&mut c, &k).await.unwrap();
    assert!(per_q.is_empty(), "{per_q:?}");
    // The holders' releases then find nobody to wake: plain releases.
    let out = cli(&r, work.path(), &["unpark", "--all"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("moved 0"));
}

// ---------------------------------------------------------------------------------------------
// Mixed limits on one lock id (L-1b): a limit-1 job and jobs of a larger limit share the lock
// ---------------------------------------------------------------------------------------------

/// A handler whose log lines carry `tag`: `start <tag> <args>` and `end <tag> <args>`. A job
/// whose second arg starts with `h` (a holder) runs until `release` exists (at most 30 s); any
/// other sleeps 0.05 s.
fn tagged_held_until(dir: &Path, name: &str, log: &Path, release: &Path, tag: &str) -> PathBuf {
    write_script(
        dir,
        name,
        &format!(
            "cat >/dev/null\necho \"start {tag} $LOCKETD_ARGS\" >> {log}\n\
             case \"$LOCKETD_ARGS\" in *'\"h'*) i=0; while [ ! -f {release} ] && [ $i -lt 300 ]; \
             do sleep 0.1; i=$((i+1)); done;; *) sleep 0.05;; esac\n\
             echo \"end {tag} $LOCKETD_ARGS\" >> {log}\n",
            log = log.display(),
            release = release.display()
        ),
    )
}

/// The runs of a tagged log: (start?, tag, args).
fn tagged_runs(log: &Path) -> Vec<(bool, String, String)> {
    read_lossy(log)
        .lines()
        .filter_map(|l| {
            let (kind, rest) = l.split_once(' ')?;
            let (tag, args) = rest.split_once(' ')?;
            Some((kind == "start", tag.to_string(), args.to_string()))
        })
        .collect()
}

/// NEVER-1 with mixed limits: at most `most` jobs of the key ran at once, and a job of tag
/// `alone` (run with limit 1) never overlapped another.
fn assert_overlaps(log: &Path, alone: &str, most: usize) {
    let mut running: Vec<(String, String)> = Vec::new();
    for (start, tag, args) in tagged_runs(log) {
        if start {
            assert!(
                tag != alone || running.is_empty(),
                "{tag} {args} (limit 1) started while {running:?} ran"
            );
            assert!(
                !running.iter().any(|(t, _)| t == alone),
                "{tag} {args} started while a limit-1 job ran: {running:?}"
            );
            running.push((tag, args));
            assert!(
                running.len() <= most,
                "more than {most} at once: {running:?}"
            );
        } else {
            let at = running
                .iter()
                .position(|(t, a)| *t == tag && *a == args)
                .unwrap_or_else(|| panic!("end of {tag} {args} without its start"));
            running.remove(at);
        }
    }
}

/// The second arg of each job (not a holder) in the order they started, and checks that each
/// of `want` started exactly once.
fn tagged_start_order(log: &Path, want: usize) -> Vec<i64> {
    let order: Vec<i64> = tagged_runs(log)
        .into_iter()
        .filter(|(start, _, _)| *start)
        .filter_map(|(_, _, args)| {
            let v: serde_json::Value = serde_json::from_str(&args).unwrap();
            v[1].as_i64()
        })
        .collect();
    let mut once = order.clone();
    once.sort();
    assert_eq!(
        once,
        (0..want as i64).collect::<Vec<_>>(),
        "each job once: {order:?}"
    );
    order
}

/// PK-3 with mixed limits: each job started within two places of where it parked.
fn assert_near_parking_order(order: &[i64], parking_order: &[i64]) {
    for (at, job) in order.iter().enumerate() {
        let parked_at = parking_order.iter().position(|p| p == job).unwrap();
        assert!(
            at.abs_diff(parked_at) <= 2,
            "job {job} parked {parked_at}th, started {at}th: {order:?} (parked {parking_order:?})"
        );
    }
}

/// Nothing is left parked, and the lock is gone once its last holder released it.
fn assert_nothing_parked(r: &mut R, id: &str) {
    wait_until(LONG, "the lock released", || {
        !r.exists(&format!("{NS}:locket:lock:{id}"))
    });
    assert!(!r.exists(&format!("{NS}:locket:parked:lock:{id}")));
    let n: i64 = r.cmd(&["ZCARD", &format!("{NS}:locket:parked")]);
    assert_eq!(n, 0, "the parked index is empty");
    let per_q: Vec<String> = r.cmd(&["HVALS", &format!("{NS}:locket:parked_queues")]);
    assert!(per_q.iter().all(|n| n == "0"), "{per_q:?}");
    let kept: Vec<String> = r.cmd(&["ZRANGE", &format!("{NS}:locket:locks"), "0", "-1"]);
    assert!(kept.is_empty(), "{kept:?}");
}

// L-1b, PK-3: a rolling deploy that lowers a class's limit from 2 to 1. The old daemon (limit
// 2) runs two holders; thirty jobs of the key park behind them, parked by both daemons (with
// limits 2 and 1); both then serve the backlog, and the old one stops halfway (QUIT, as a
// deploy stops it). Every job runs once, near its
// parking order, never more than two at once, and a job run with limit 1 runs alone; nothing
// stays parked. Before, a limit-1 job handed a unit of the ZSET parked again at each wake (its
// own unit counted as a holder) and every later job of the key parked behind it for good.
#[test]
fn l1b_a_rolling_deploy_that_lowers_a_limit_from_two_to_one_runs_every_job_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let release = work.path().join("release");
    let ha = tagged_held_until(work.path(), "a.sh", &log, &release, "A");
    let hb = tagged_held_until(work.path(), "b.sh", &log, &release, "B");
    // Three workers: two run the holders, the third parks jobs with limit 2 beside the new
    // daemon's, which park with limit 1.
    let mut old = Daemon::start(
        &redis,
        &hot_config(&ha, "low", "\nlimit = 2"),
        &["--workers", "3"],
    );
    r.push("low", r#"{"class":"Hot","args":[1,"h1"]}"#);
    r.push("low", r#"{"class":"Hot","args":[1,"h2"]}"#);
    wait_until(LONG, "the two holders run", || tagged_runs(&log).len() == 2);
    let parked = format!("{NS}:locket:parked:lock:user:1");
    for i in 0..15 {
        r.push("low", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    wait_until(LONG, "the old daemon parked 15", || r.llen(&parked) == 15);
    let mut new = Daemon::start(&redis, &hot_config(&hb, "low", ""), &["--workers", "2"]);
    wait_until(LONG, "the new daemon runs", || r.workers().len() == 5);
    for i in 15..30 {
        r.push("low", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    wait_until(LONG, "the backlog parked", || r.llen(&parked) == 30);
    let parking_order = parking_order(&mut r, &parked);
    let limits: Vec<String> = r.cmd(&["LRANGE", &parked, "0", "-1"]);
    let limits: Vec<i64> = limits
        .iter()
        .map(|e| {
            serde_json::from_str::<serde_json::Value>(e).unwrap()["limit"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert!(limits[..15].iter().all(|l| *l == 2), "{limits:?}");
    std::fs::write(&release, "").unwrap();
    wait_until(LONG, "ten jobs ran", || ended(&log) >= 12);
    // The deploy stops the old daemon as Resque's QUIT does: its running job ends first.
    old.signal(libc::SIGQUIT);
    let stopped = old.wait_exit(LONG).expect("the old daemon stops");
    assert_eq!(stopped.code(), Some(0));
    wait_until(LONG, "every job ran", || ended(&log) == 32);
    assert_overlaps(&log, "B", 2);
    let order = tagged_start_order(&log, 30);
    assert_near_parking_order(&order, &parking_order);
    assert_nothing_parked(&mut r, "user:1");
    assert_eq!(new.terminate(LONG).code(), Some(0));
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(stat(&mut r, "requeued"), 0);
}

// L-1b, PK-3: two classes share a lock id, `Wide` with limit 2 and `Narrow` with limit 1 (the
// default). Thirty jobs of both park behind two Wide holders; every one runs once, near its
// parking order, never more than two at once, and each Narrow job runs alone; nothing stays
// parked.
#[test]
fn l1b_two_classes_that_share_a_lock_id_with_limits_two_and_one_run_every_job_once() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let release = work.path().join("release");
    let hw = tagged_held_until(work.path(), "w.sh", &log, &release, "W");
    let hn = tagged_held_until(work.path(), "n.sh", &log, &release, "N");
    let config = |queues: &str| {
        cfg(queues)
            .locket("lock_ttl", "\"10s\"")
            .locket("process_ttl", "\"20s\"")
            .class("Wide", &hw, "lock = \"shared:{args[0]}\"\nlimit = 2")
            .class("Narrow", &hn, "lock = \"shared:{args[0]}\"")
            .render()
    };
    let mut holder = Daemon::start(&redis, &config("hold"), &["--workers", "2"]);
    r.push("hold", r#"{"class":"Wide","args":[1,"h1"]}"#);
    r.push("hold", r#"{"class":"Wide","args":[1,"h2"]}"#);
    wait_until(LONG, "the two holders run", || tagged_runs(&log).len() == 2);
    for i in 0..30 {
        let class = if i % 3 == 0 { "Wide" } else { "Narrow" };
        r.push("low", &format!(r#"{{"class":"{class}","args":[1,{i}]}}"#));
    }
    let mut d = Daemon::start(&redis, &config("low"), &["--workers", "3"]);
    let parked = format!("{NS}:locket:parked:lock:shared:1");
    wait_until(LONG, "the backlog parked", || r.llen(&parked) == 30);
    let parking_order = parking_order(&mut r, &parked);
    std::fs::write(&release, "").unwrap();
    wait_until(LONG, "every job ran", || ended(&log) == 32);
    assert_overlaps(&log, "N", 2);
    let order = tagged_start_order(&log, 30);
    assert_near_parking_order(&order, &parking_order);
    assert_nothing_parked(&mut r, "shared:1");
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(holder.terminate(LONG).code(), Some(0));
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(stat(&mut r, "requeued"), 0);
}

// L-1b, PK-2, O-2: a limit-2 holder that does not end keeps five limit-1 jobs parked; `locks
// release --force` frees the lock and they run, one at a time, in parking order, and nothing
// stays parked. Before, the force release kept a unit of the ZSET for the first of them, which
// then parked again at every wake: the lock stayed stuck.
#[test]
fn l1b_a_force_release_of_a_larger_lock_runs_the_limit_one_jobs_parked_on_it() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let release = work.path().join("release");
    let ha = tagged_held_until(work.path(), "a.sh", &log, &release, "A");
    let hb = tagged_held_until(work.path(), "b.sh", &log, &release, "B");
    let mut old = Daemon::start(&redis, &hot_config(&ha, "hold", "\nlimit = 2"), &[]);
    r.push("hold", r#"{"class":"Hot","args":[1,"h1"]}"#);
    wait_until(LONG, "the holder runs", || tagged_runs(&log).len() == 1);
    for i in 0..5 {
        r.push("low", &format!(r#"{{"class":"Hot","args":[1,{i}]}}"#));
    }
    let mut new = Daemon::start(&redis, &hot_config(&hb, "low", ""), &["--workers", "2"]);
    let parked = format!("{NS}:locket:parked:lock:user:1");
    wait_until(LONG, "five jobs parked", || r.llen(&parked) == 5);
    let parking_order = parking_order(&mut r, &parked);
    let out = cli(
        &redis,
        work.path(),
        &["locks", "release", "user:1", "--force"],
    );
    assert!(out.status.success(), "{out:?}");
    wait_until(LONG, "the five jobs ran", || {
        tagged_runs(&log)
            .iter()
            .filter(|(start, tag, _)| !*start && tag == "B")
            .count()
            == 5
    });
    let order: Vec<i64> = tagged_runs(&log)
        .into_iter()
        .filter(|(start, tag, _)| *start && tag == "B")
        .map(|(_, _, args)| {
            serde_json::from_str::<serde_json::Value>(&args).unwrap()[1]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(order, parking_order, "one at a time, in parking order");
    std::fs::write(&release, "").unwrap();
    assert_nothing_parked(&mut r, "user:1");
    assert_eq!(new.terminate(LONG).code(), Some(0));
    assert_eq!(old.terminate(LONG).code(), Some(0));
}
