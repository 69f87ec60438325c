//! Locket locks at the script level (locking-semantics.md §5, §7, §9, §12).
//!
//! Each test drives the typed API of `locketd::store` (RESERVE, ACQUIRE+START, EXTEND, FINISH,
//! purge), the janitor and the registry against its own `redis-server`, and checks the Redis
//! state the rules promise. Every test names the rules it covers.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use locketd::config::Config;
use locketd::locks::canonical::sha256_hex;
use locketd::locks::LockSpec;
use locketd::resque::failure::FailureBackend;
use locketd::resque::failure::{working_on, JobFailure};
use locketd::resque::keys::Keys;
use locketd::store::random_hex;
use locketd::store::registry::{self, Registration};
use locketd::store::scripts::scripts;
use locketd::store::{self, AcquireRequest, Acquired, Finish, FinishRequest, Reserved, SlotRef};
use locketd::worker::janitor_pass;
use rand::Rng;
use redis::aio::MultiplexedConnection as Conn;
use serde_json::{json, Value};

use crate::support::{wait_until_async, RedisServer};

const NS: &str = "resque";

/// Runs one Redis command, panicking on error; the reply type comes from the binding.
macro_rules! rcmd {
    ($conn:expr, $name:literal $(, $arg:expr)* $(,)?) => {{
        #[allow(unused_mut)]
        let mut cmd = redis::cmd($name);
        $( cmd.arg($arg); )*
        cmd.query_async($conn)
            .await
            .unwrap_or_else(|e| panic!("{} failed: {e}", $name))
    }};
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn keys() -> Keys {
    Keys::new(NS)
}

fn payload(class: &str, args: Value) -> Vec<u8> {
    json!({"class": class, "args": args})
        .to_string()
        .into_bytes()
}

fn spec(id: &str, limit: u32) -> LockSpec {
    LockSpec {
        id: id.to_string(),
        limit,
    }
}

fn set_of<const N: usize>(items: [&str; N]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// One execution slot: its key and its Resque worker id.
struct Slot {
    keys: Keys,
    slot_key: String,
    worker_id: String,
}

impl Slot {
    fn new(slot_key: impl Into<String>, worker_id: impl Into<String>) -> Slot {
        Slot {
            keys: keys(),
            slot_key: slot_key.into(),
            worker_id: worker_id.into(),
        }
    }

    fn r(&self) -> SlotRef<'_> {
        SlotRef {
            keys: &self.keys,
            slot_key: &self.slot_key,
            worker_id: &self.worker_id,
        }
    }

    fn inflight(&self) -> String {
        self.keys.inflight(&self.slot_key)
    }
}

/// A reservation as RESERVE returned it.
#[derive(Debug, Clone)]
struct Res {
    queue: String,
    payload: Vec<u8>,
    rid: String,
}

#[derive(Debug, Clone, Copy)]
struct Opts {
    ttl: Duration,
    counter_ttl: Duration,
    requeue: bool,
    resent: bool,
}

fn opts(ttl_ms: u64, counter_ttl_ms: u64, requeue: bool) -> Opts {
    Opts {
        ttl: Duration::from_millis(ttl_ms),
        counter_ttl: Duration::from_millis(counter_ttl_ms),
        requeue,
        resent: false,
    }
}

async fn push(conn: &mut Conn, queue: &str, body: &[u8]) {
    let k = keys();
    let _: i64 = rcmd!(conn, "RPUSH", k.queue(queue), body);
    let _: i64 = rcmd!(conn, "SADD", k.queues(), queue);
}

/// Gives the process owning `slot_key` ("<process id>:<n>") a lease, as registration does
/// (R-1): RESERVE and ACQUIRE refuse a slot whose process holds none (R-2).
pub(crate) async fn mark_alive(conn: &mut Conn, slot_key: &str) {
    let process = slot_key.rsplit_once(':').map_or(slot_key, |(p, _)| p);
    // NX: a lease that registration gave (and a test lets lapse) is left as it is.
    let _: Option<String> = rcmd!(
        conn,
        "SET",
        keys().alive(process),
        "{}",
        "PX",
        600_000,
        "NX"
    );
}

async fn reserve(conn: &mut Conn, slot: &Slot, queues: &[&str], clear: bool) -> Reserved {
    mark_alive(conn, &slot.slot_key).await;
    let qs: Vec<String> = queues.iter().map(|q| q.to_string()).collect();
    store::reserve(conn, &slot.r(), &random_hex(8), &qs, clear)
        .await
        .expect("RESERVE")
}

async fn reserve_job(conn: &mut Conn, slot: &Slot, queues: &[&str]) -> Res {
    match reserve(conn, slot, queues, false).await {
        Reserved::Job {
            queue,
            payload,
            rid,
            ..
        } => Res {
            queue,
            payload,
            rid,
        },
        other => panic!("expected a job from {queues:?}, got {other:?}"),
    }
}

async fn acquire(
    conn: &mut Conn,
    slot: &Slot,
    res: &Res,
    token: &str,
    locks: &[LockSpec],
    o: Opts,
) -> Acquired {
    try_acquire(conn, slot, res, token, locks, o)
        .await
        .expect("ACQUIRE")
}

/// [`acquire`], with the script's error returned.
async fn try_acquire(
    conn: &mut Conn,
    slot: &Slot,
    res: &Res,
    token: &str,
    locks: &[LockSpec],
    o: Opts,
) -> redis::RedisResult<Acquired> {
    let text = String::from_utf8_lossy(&res.payload).into_owned();
    let class = serde_json::from_slice::<Value>(&res.payload)
        .ok()
        .and_then(|v| v.get("class")?.as_str().map(str::to_string))
        .unwrap_or_else(|| "Unknown".to_string());
    let digest = sha256_hex(&res.payload);
    let working = working_on(&text, &res.queue, SystemTime::now(), &slot.worker_id);
    let info = json!({
        "process": slot.slot_key,
        "slot": 0,
        "resque_worker": slot.worker_id,
        "queue": res.queue,
        "class": class,
        "digest": digest,
    })
    .to_string();
    let req = AcquireRequest {
        rid: &res.rid,
        token,
        queue: &res.queue,
        class: &class,
        digest: &digest,
        locks,
        lock_ttl: o.ttl,
        counter_ttl: o.counter_ttl,
        requeue_on_conflict: o.requeue,
        working_on: &working,
        lockinfo: &info,
        resent: o.resent,
    };
    store::acquire(conn, &slot.r(), &req).await
}

#[track_caller]
fn started(a: Acquired) -> u64 {
    match a {
        Acquired::Started { deadline_ms } => deadline_ms,
        other => panic!("expected the job to start, got {other:?}"),
    }
}

/// FINISH's request for `res`, started with `token` and `locks`, with the default backend.
fn finish_request<'a>(
    res: &'a Res,
    token: &'a str,
    locks: &'a [LockSpec],
    outcome: &'a Finish,
) -> FinishRequest<'a> {
    FinishRequest {
        rid: &res.rid,
        token,
        queue: &res.queue,
        locks,
        outcome,
        backend: FailureBackend::Redis,
    }
}

/// FINISH's holds for a job that releases none.
const NO_HOLDS: store::FinishHolds<'static> = store::FinishHolds {
    class: "Job",
    digest: "d",
    release: &[],
    resent: false,
    unique: "",
};

async fn finish(
    conn: &mut Conn,
    slot: &Slot,
    res: &Res,
    token: &str,
    locks: &[LockSpec],
    outcome: Finish,
) -> bool {
    let req = finish_request(res, token, locks, &outcome);
    store::finish(conn, &slot.r(), &req).await.expect("FINISH")
}

/// A job that holds `locks`: pushed to its own queue, reserved on its own slot, started.
struct Held {
    slot: Slot,
    res: Res,
    token: String,
    locks: Vec<LockSpec>,
    deadline: u64,
}

impl Held {
    async fn finish(&self, conn: &mut Conn) -> bool {
        finish(
            conn,
            &self.slot,
            &self.res,
            &self.token,
            &self.locks,
            Finish::Success,
        )
        .await
    }
}

async fn hold(conn: &mut Conn, name: &str, locks: &[LockSpec], ttl_ms: u64) -> Held {
    let queue = format!("hq-{name}");
    push(conn, &queue, &payload("Holder", json!([name]))).await;
    let slot = Slot::new(
        format!("holder-{name}:0"),
        format!("testhost:{}:{queue}", 1000 + name.len()),
    );
    let res = reserve_job(conn, &slot, &[&queue]).await;
    let token = random_hex(16);
    let deadline =
        started(acquire(conn, &slot, &res, &token, locks, opts(ttl_ms, 1000, false)).await);
    Held {
        slot,
        res,
        token,
        locks: locks.to_vec(),
        deadline,
    }
}

/// Pushes `body` to a fresh `queue`, reserves it on a fresh slot and tries `locks`.
async fn try_job(
    conn: &mut Conn,
    slot_name: &str,
    queue: &str,
    body: &[u8],
    locks: &[LockSpec],
    o: Opts,
) -> (Slot, Res, String, Acquired) {
    push(conn, queue, body).await;
    let slot = Slot::new(
        format!("{slot_name}:0"),
        format!("testhost:{slot_name}:{queue}"),
    );
    let res = reserve_job(conn, &slot, &[queue]).await;
    let token = random_hex(16);
    let a = acquire(conn, &slot, &res, &token, locks, o).await;
    (slot, res, token, a)
}

/// `try_job`, asserting the attempt conflicted and was requeued (P-1).
async fn assert_requeued(
    conn: &mut Conn,
    slot_name: &str,
    queue: &str,
    body: &[u8],
    locks: &[LockSpec],
    o: Opts,
) {
    let (.., a) = try_job(conn, slot_name, queue, body, locks, o).await;
    assert!(
        matches!(a, Acquired::Conflict { requeued: true, .. }),
        "{a:?}"
    );
}

async fn server_ms(conn: &mut Conn) -> u64 {
    let (s, us): (u64, u64) = rcmd!(conn, "TIME");
    s * 1000 + us / 1000
}

/// Sleeps until the Redis clock has passed `t_ms` (bounded).
async fn sleep_past_server_ms(conn: &mut Conn, t_ms: u64) {
    let started = Instant::now();
    loop {
        let now = server_ms(conn).await;
        if now > t_ms {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "server clock did not pass {t_ms}"
        );
        tokio::time::sleep(Duration::from_millis((t_ms - now).min(50) + 1)).await;
    }
}

async fn lrange(conn: &mut Conn, key: &str) -> Vec<Vec<u8>> {
    rcmd!(conn, "LRANGE", key, 0, -1)
}

async fn get(conn: &mut Conn, key: &str) -> Option<String> {
    rcmd!(conn, "GET", key)
}

async fn exists(conn: &mut Conn, key: &str) -> bool {
    let n: i64 = rcmd!(conn, "EXISTS", key);
    n == 1
}

/// A lock's holders as (token, deadline ms) whatever its kind: the one holder of a limit-1
/// lock (a STRING holding its info, deadline = server now + PTTL) or a larger lock's members.
async fn lock_holders(conn: &mut Conn, key: &str) -> Vec<(String, u64)> {
    let v: Vec<(String, f64)> = redis::Script::new(
        r"if redis.call('TYPE', KEYS[1])['ok'] == 'string' then
            local info = cjson.decode(redis.call('GET', KEYS[1]))
            local t = redis.call('TIME')
            local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
            return {info['token'], tostring(now + redis.call('PTTL', KEYS[1]))}
          end
          return redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')",
    )
    .key(key)
    .invoke_async(conn)
    .await
    .expect("lock_holders script");
    v.into_iter().map(|(m, s)| (m, s as u64)).collect()
}

async fn zscore(conn: &mut Conn, key: &str, member: &str) -> Option<u64> {
    lock_holders(conn, key)
        .await
        .into_iter()
        .find(|(m, _)| m == member)
        .map(|(_, s)| s)
}

async fn zcard(conn: &mut Conn, key: &str) -> u64 {
    lock_holders(conn, key).await.len() as u64
}

async fn zrange_scores(conn: &mut Conn, key: &str) -> Vec<(String, u64)> {
    let mut v = lock_holders(conn, key).await;
    v.sort_by_key(|(_, s)| *s);
    v
}

async fn smembers(conn: &mut Conn, key: &str) -> BTreeSet<String> {
    rcmd!(conn, "SMEMBERS", key)
}

async fn hgetall(conn: &mut Conn, key: &str) -> HashMap<String, String> {
    rcmd!(conn, "HGETALL", key)
}

async fn hget_bytes(conn: &mut Conn, key: &str, field: &str) -> Option<Vec<u8>> {
    rcmd!(conn, "HGET", key, field)
}

/// When `key` expires, in Redis server ms (TIME + PTTL read in one script); negative PTTL
/// values (-1 no expiry, -2 no key) are returned as they are.
async fn expire_at(conn: &mut Conn, key: &str) -> i64 {
    redis::Script::new(
        r"local p = redis.call('PTTL', KEYS[1])
          if p < 0 then return p end
          local t = redis.call('TIME')
          return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + p",
    )
    .key(key)
    .invoke_async(conn)
    .await
    .expect("expire_at script")
}

/// Members of `key` whose deadline is later than the server's now (L-1's live holders; a
/// limit-1 lock's key exists only while its holder is live, L-1a).
async fn live_holders(conn: &mut Conn, key: &str) -> u64 {
    redis::Script::new(
        r"if redis.call('TYPE', KEYS[1])['ok'] == 'string' then return 1 end
          local t = redis.call('TIME')
          local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
          return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')",
    )
    .key(key)
    .invoke_async(conn)
    .await
    .expect("live_holders script")
}

#[track_caller]
fn assert_near(actual: i64, expected: i64, slack: i64, what: &str) {
    assert!(
        (actual - expected).abs() <= slack,
        "{what}: {actual} is not within {slack} ms of {expected}"
    );
}

/// How much later than the deadline ACQUIRE reported a limit-1 lock's lease may end on the
/// server (L-1a): the reply is the worker's clock, read before the call, + lock_ttl; the key's
/// PX starts when the script runs, after the call's transit (and, on a script's first call,
/// its loading). The two clocks' millisecond roundings may put it up to 2 ms earlier.
const LEASE_SLACK_MS: i64 = 50;

/// Asserts that a limit-1 lease whose deadline the server keeps at `server` is the one
/// ACQUIRE (or EXTEND) reported as ending at `reported`.
#[track_caller]
fn assert_lease_near(server: u64, reported: u64, what: &str) {
    let d = server as i64 - reported as i64;
    assert!(
        (-2..=LEASE_SLACK_MS).contains(&d),
        "{what}: the server's deadline {server} is not within [-2, {LEASE_SLACK_MS}] ms of \
         the reported {reported}"
    );
}

/// Asserts that `key`'s holders are `want` (token, deadline as reported), in deadline order,
/// with each deadline compared by [`assert_lease_near`] (exact for a larger lock's members,
/// whose deadline the server stamps and reports itself).
async fn assert_holders(conn: &mut Conn, key: &str, want: &[(String, u64)], what: &str) {
    let got = zrange_scores(conn, key).await;
    let tokens = |v: &[(String, u64)]| v.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&got), tokens(want), "{what}: holders of {key}");
    for ((_, g), (_, w)) in got.iter().zip(want) {
        assert_lease_near(*g, *w, what);
    }
}

/// A FINISH sent again after an attempt whose reply never came (the worker marks every retry
/// so, A-13 step 1): its rid is checked even while the process lease is held.
async fn finish_resent(
    conn: &mut Conn,
    slot: &Slot,
    res: &Res,
    token: &str,
    locks: &[LockSpec],
    outcome: Finish,
) -> bool {
    let req = finish_request(res, token, locks, &outcome);
    let holds = store::FinishHolds {
        resent: true,
        ..NO_HOLDS
    };
    store::finish_with(conn, &slot.r(), &req, &holds)
        .await
        .expect("FINISH")
}

/// Waits (bounded) until `key` no longer exists.
async fn wait_gone(conn: &Conn, key: String, timeout: Duration, what: &str) {
    let c = conn.clone();
    wait_until_async(timeout, what, move || {
        let mut c = c.clone();
        let key = key.clone();
        async move { !exists(&mut c, &key).await }
    })
    .await;
}

/// Locket key names of locking-semantics.md §2 (a trailing ':' means "prefix").
const LOCKET_KEY_NAMES: &[&str] = &[
    "lock:",
    "lockinfo:",
    "locks",
    "fence",
    "counter:",
    "blocked:lock:",
    "blocked:dep:",
    "dep:",
    "deps",
    "inflight:",
    "delayed",
    "attempts",
    "recoveries",
    "processes",
    "alive:",
    "slots:",
    "janitor",
    "stat:",
    "metrics:",
    "plans",
    "holding_plans",
    "push",
    "unique:",
];

/// The only locket keys that may live without an expiry (NEVER-4).
const WITHOUT_EXPIRY: &[&str] = &[
    "locks",
    "deps",
    "processes",
    "slots:",
    "fence",
    "stat:",
    "delayed",
    "inflight:",
    "plans",
    "holding_plans",
    "push",
];

fn name_matches(rest: &str, names: &[&str]) -> bool {
    names.iter().any(|n| {
        if n.ends_with(':') {
            rest.starts_with(n)
        } else {
            rest == *n
        }
    })
}

/// K-1, NEVER-4: every locket key has a documented name and only the documented ones have no
/// expiry. Returns the key names below `<ns>:locket:`.
async fn audit_locket_keys(conn: &mut Conn, when: &str) -> BTreeSet<String> {
    let prefix = format!("{NS}:locket:");
    let all: Vec<String> = rcmd!(conn, "KEYS", format!("{prefix}*"));
    let mut out = BTreeSet::new();
    for key in all {
        let rest = key.strip_prefix(&prefix).unwrap().to_string();
        assert!(
            name_matches(&rest, LOCKET_KEY_NAMES),
            "{when}: undocumented locket key {key}"
        );
        let ttl: i64 = rcmd!(conn, "PTTL", &key);
        if ttl == -1 {
            assert!(
                name_matches(&rest, WITHOUT_EXPIRY),
                "{when}: {key} has no expiry"
            );
        }
        out.insert(rest);
    }
    out
}

fn janitor_config(extra: &str) -> Config {
    Config::parse(
        &format!("queues = \"q\"\n[locket]\njanitor_interval = \"1s\"\n{extra}\n"),
        "tests/it/lock.rs",
    )
    .expect("janitor config")
}

async fn register(conn: &mut Conn, process: &str, slot: u32, worker_id: &str, ttl: Duration) {
    let k = keys();
    let reg = Registration {
        keys: &k,
        worker_id,
        process_id: process,
        slot,
    };
    let alive =
        json!({"started_at": 0, "version": "test", "concurrency": 1, "queues": "q"}).to_string();
    registry::register(conn, &reg, &alive, ttl)
        .await
        .expect("register");
}

async fn wait_dead(conn: &Conn, process: &str) {
    wait_gone(
        conn,
        keys().alive(process),
        Duration::from_secs(5),
        "the process lease to lapse",
    )
    .await;
}

/// Asserts that nothing of a slot's Resque registration is left.
async fn assert_unregistered(conn: &mut Conn, worker_id: &str) {
    let k = keys();
    assert!(!smembers(conn, &k.workers()).await.contains(worker_id));
    assert!(!exists(conn, &k.worker(worker_id)).await);
    assert!(!exists(conn, &k.worker_started(worker_id)).await);
    let beat: Option<String> = rcmd!(conn, "HGET", k.heartbeat(), worker_id);
    assert_eq!(beat, None, "heartbeat of {worker_id} left behind");
}

// ---------------------------------------------------------------------------------------------
// 5.1 RESERVE
// ---------------------------------------------------------------------------------------------

// locking-semantics.md S-6, NEVER-2: a requeue whose push raises (the queue key holds a value
// of another type) leaves the job in its inflight record, to be returned or recovered, instead
// of deleting the record first and losing the payload.
#[tokio::test]
async fn a_requeue_that_cannot_push_keeps_the_reservation() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("acct:1", 1);
    let _h = hold(c, "h", std::slice::from_ref(&l), 20_000).await;
    let job = payload("J", json!([1]));
    push(c, "q", &job).await;
    let s1 = Slot::new("p:1:0", "testhost:11:q");
    let r1 = reserve_job(c, &s1, &["q"]).await;
    let _: () = rcmd!(c, "SET", k.queue("q"), "not a list");
    let res = try_acquire(
        c,
        &s1,
        &r1,
        &random_hex(16),
        std::slice::from_ref(&l),
        opts(10_000, 2_000, true),
    )
    .await;
    let err = res.expect_err("the requeue's push raised");
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    assert_eq!(
        hget_bytes(c, &s1.inflight(), "payload").await,
        Some(job),
        "the reservation was dropped"
    );
}

// locking-semantics.md A-1, A-3
#[tokio::test]
async fn reserve_pops_the_head_of_the_first_nonempty_queue_into_a_reserved_inflight_record() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    // Odd spacing, a float, a big integer, non-ASCII text and an extra key: bytes must survive.
    let raw: &[u8] = "{\"class\" : \"Mail::Send\",\"args\":[1.0, \"\u{e9}\u{1f600}\", 123456789012345678901],\"id\":\"php-7\" }".as_bytes();
    let b2 = payload("B2", json!([]));
    let c1 = payload("C1", json!([]));
    push(c, "b", raw).await;
    push(c, "b", &b2).await;
    push(c, "c", &c1).await;

    let slot = Slot::new("testhost:1:aaaaaaaa:0", "testhost:1:a,b,c");
    mark_alive(c, &slot.slot_key).await;
    let before = server_ms(c).await;
    let rid = random_hex(8);
    let qs: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let got = store::reserve(c, &slot.r(), &rid, &qs, false)
        .await
        .unwrap();
    let after = server_ms(c).await;
    assert_eq!(
        got,
        Reserved::Job {
            queue: "b".into(),
            payload: raw.to_vec(),
            rid: rid.clone(),
            odd_guards: false,
        }
    );

    let rec = hgetall(c, &slot.inflight()).await;
    assert_eq!(rec.get("rid"), Some(&rid));
    assert_eq!(rec.get("queue").map(String::as_str), Some("b"));
    assert_eq!(rec.get("state").map(String::as_str), Some("reserved"));
    let reserved_at: u64 = rec["reserved_at"].parse().unwrap();
    assert!(
        (before..=after).contains(&reserved_at),
        "reserved_at {reserved_at} is not server time in [{before}, {after}]"
    );
    assert_eq!(
        hget_bytes(c, &slot.inflight(), "payload").await.as_deref(),
        Some(raw)
    );
    assert_eq!(lrange(c, &k.queue("b")).await, vec![b2.clone()]);
    assert_eq!(lrange(c, &k.queue("c")).await, vec![c1.clone()]);

    // Priority order on every pass: b's next job, then c, then nothing.
    let s2 = Slot::new("testhost:1:aaaaaaaa:1", "testhost:1:a,b,c#2");
    let r2 = reserve_job(c, &s2, &["a", "b", "c"]).await;
    assert_eq!((r2.queue.as_str(), r2.payload), ("b", b2));
    let s3 = Slot::new("testhost:1:aaaaaaaa:2", "testhost:1:a,b,c#3");
    let r3 = reserve_job(c, &s3, &["a", "b", "c"]).await;
    assert_eq!((r3.queue.as_str(), r3.payload), ("c", c1));
    let s4 = Slot::new("testhost:1:aaaaaaaa:3", "testhost:1:a,b,c#4");
    assert_eq!(
        reserve(c, &s4, &["a", "b", "c"], false).await,
        Reserved::Nothing {
            skipped: vec![],
            unreadable: vec![],
            paused: vec![],
            capped: vec![],
            refused: vec![],
        }
    );
    assert!(!exists(c, &s4.inflight()).await);
}

// A queue key that another tool turned into a string or a hash is passed over and reported:
// it does not stop the queues after it (before, the script raised WRONGTYPE on every pass and
// no queue was served).
#[tokio::test]
async fn reserve_passes_over_a_queue_key_that_is_not_a_list() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _: () = rcmd!(c, "SET", k.queue("aaa"), "not a list");
    let _: i64 = rcmd!(c, "HSET", k.queue("bbb"), "f", "v");
    let _: () = rcmd!(c, "SET", k.counter("bbb"), 1);
    let job = payload("J", json!([1]));
    push(c, "ccc", &job).await;
    let slot = Slot::new("p:1:0", "testhost:1:aaa,bbb,ccc");
    let r = reserve_job(c, &slot, &["aaa", "bbb", "ccc"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("ccc", job));
    let slot = Slot::new("p:2:0", "testhost:2:aaa,bbb,ccc");
    assert_eq!(
        reserve(c, &slot, &["aaa", "bbb", "ccc"], false).await,
        Reserved::Nothing {
            skipped: vec![],
            unreadable: vec!["aaa".into(), "bbb".into()],
            paused: vec![],
            capped: vec![],
            refused: vec![],
        }
    );
}

// A-22, S-6: a cap key spoiled by hand (a hash, or a string that is not a number) is not read
// as "no cap": RESERVE pops nothing from its queue and reports it, and serves the queues after
// it; once mended, the queue is served and its unit taken. The K-2 check, made in the same
// EXISTS as the pause and cap keys (lib.lua, queue_guards), still finds a slot's reservation.
// With more than 16 queues (the keys not read ahead), a spoiled cap key and a pause key of
// another type are found too.
#[tokio::test]
async fn reserve_refuses_a_queue_whose_cap_key_is_spoiled() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let a1 = payload("A", json!([1]));
    let b = |i: i64| payload("B", json!([i]));
    push(c, "aaa", &a1).await;
    push(c, "bbb", &b(1)).await;
    let cap = k.cap("aaa");
    let _: i64 = rcmd!(c, "HSET", &cap, "by", "hand");
    let slot = Slot::new("p:1:0", "testhost:1:aaa,bbb");
    let r = reserve_job(c, &slot, &["aaa", "bbb"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("bbb", b(1)));
    assert_eq!(
        reserve(c, &slot, &["aaa", "bbb"], false).await,
        Reserved::Busy
    );
    let refused = Reserved::Nothing {
        skipped: vec![],
        unreadable: vec![],
        paused: vec![],
        capped: vec![],
        refused: vec!["aaa".into()],
    };
    let slot2 = Slot::new("p:2:0", "testhost:2:aaa,bbb");
    assert_eq!(reserve(c, &slot2, &["aaa", "bbb"], false).await, refused);
    let _: i64 = rcmd!(c, "DEL", &cap);
    let _: () = rcmd!(c, "SET", &cap, "three");
    assert_eq!(reserve(c, &slot2, &["aaa", "bbb"], false).await, refused);
    assert_eq!(lrange(c, &k.queue("aaa")).await, vec![a1.clone()]);
    assert!(!exists(c, &k.running("aaa")).await);
    assert!(!exists(c, &slot2.inflight()).await);

    let _: () = rcmd!(c, "SET", &cap, "3");
    let r = reserve_job(c, &slot2, &["aaa", "bbb"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("aaa", a1));
    let units: i64 = rcmd!(c, "SCARD", k.running("aaa"));
    assert_eq!(units, 1);

    // 20 queues: q5's cap key is a hash, q7's pause key a hash; jobs in q5, q7 and q19.
    let names: Vec<String> = (0..20).map(|i| format!("q{i}")).collect();
    let qs: Vec<&str> = names.iter().map(String::as_str).collect();
    for q in ["q5", "q7", "q19"] {
        push(c, q, &b(2)).await;
    }
    let _: i64 = rcmd!(c, "HSET", k.cap("q5"), "by", "hand");
    let _: i64 = rcmd!(c, "HSET", k.pause_queue("q7"), "by", "hand");
    let slot3 = Slot::new("p:3:0", "testhost:3:q*");
    let r = reserve_job(c, &slot3, &qs).await;
    assert_eq!(r.queue, "q19");
    let slot4 = Slot::new("p:4:0", "testhost:4:q*");
    assert_eq!(
        reserve(c, &slot4, &qs, false).await,
        Reserved::Nothing {
            skipped: vec![],
            unreadable: vec![],
            paused: vec!["q7".into()],
            capped: vec![],
            refused: vec!["q5".into()],
        }
    );
    assert_eq!(c_len(c, &k.queue("q5")).await, 1);
    assert_eq!(c_len(c, &k.queue("q7")).await, 1);
}

async fn c_len(conn: &mut Conn, key: &str) -> i64 {
    rcmd!(conn, "LLEN", key)
}

// locking-semantics.md A-1 step 2, A-2, A-3, A-15
#[tokio::test]
async fn reserve_skips_a_queue_whose_counter_reached_its_length_for_that_pass_only() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let h: Vec<Vec<u8>> = (1..=3).map(|i| payload("High", json!([i]))).collect();
    let l1 = payload("Low", json!([1]));
    push(c, "high", &h[0]).await;
    push(c, "high", &h[1]).await;
    push(c, "low", &l1).await;
    let mut n = 0;
    let mut slot = || {
        n += 1;
        Slot::new(format!("p:{n}:0"), format!("testhost:{n}:high,low"))
    };

    // counter == LLEN: skipped, the next queue is served.
    let _: () = rcmd!(c, "SET", k.counter("high"), 2);
    let r = reserve_job(c, &slot(), &["high", "low"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("low", l1));
    assert_eq!(lrange(c, &k.queue("high")).await, h[..2].to_vec());

    // Nothing else to serve: the skipped queue is reported.
    assert_eq!(
        reserve(c, &slot(), &["high", "low"], false).await,
        Reserved::Nothing {
            skipped: vec!["high".into()],
            unreadable: vec![],
            paused: vec![],
            capped: vec![],
            refused: vec![],
        }
    );
    // counter > LLEN: still skipped.
    let _: () = rcmd!(c, "SET", k.counter("high"), 5);
    assert_eq!(
        reserve(c, &slot(), &["high", "low"], false).await,
        Reserved::Nothing {
            skipped: vec!["high".into()],
            unreadable: vec![],
            paused: vec![],
            capped: vec![],
            refused: vec![],
        }
    );
    assert_eq!(lrange(c, &k.queue("high")).await, h[..2].to_vec());

    // A job arriving makes the length exceed the counter once: the head is served.
    let _: () = rcmd!(c, "SET", k.counter("high"), 2);
    push(c, "high", &h[2]).await;
    let r = reserve_job(c, &slot(), &["high", "low"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("high", h[0].clone()));

    // counter < LLEN: served. An empty queue with a counter is not "skipped".
    let _: () = rcmd!(c, "SET", k.counter("high"), 1);
    let _: () = rcmd!(c, "SET", k.counter("empty"), 9);
    let r = reserve_job(c, &slot(), &["empty", "high"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("high", h[1].clone()));
    assert_eq!(
        reserve(c, &slot(), &["empty", "high", "low"], false).await,
        Reserved::Nothing {
            skipped: vec!["high".into()],
            unreadable: vec![],
            paused: vec![],
            capped: vec![],
            refused: vec![],
        }
    );
    assert_eq!(lrange(c, &k.queue("high")).await, vec![h[2].clone()]);
    // RESERVE never touches counters on its own (the idle clear is off here).
    assert_eq!(get(c, &k.counter("high")).await.as_deref(), Some("1"));
    assert_eq!(get(c, &k.counter("empty")).await.as_deref(), Some("9"));
}

// locking-semantics.md K-2, A-1
#[tokio::test]
async fn reserve_returns_busy_and_changes_nothing_while_the_slot_holds_a_reservation() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let j1 = payload("J", json!([1]));
    let j2 = payload("J", json!([2]));
    push(c, "q", &j1).await;
    push(c, "q", &j2).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    let first = reserve_job(c, &slot, &["q"]).await;
    let record = hgetall(c, &slot.inflight()).await;

    assert_eq!(reserve(c, &slot, &["q"], false).await, Reserved::Busy);
    assert_eq!(reserve(c, &slot, &["q"], true).await, Reserved::Busy);
    assert_eq!(hgetall(c, &slot.inflight()).await, record);
    assert_eq!(record["rid"], first.rid);
    assert_eq!(lrange(c, &k.queue("q")).await, vec![j2]);
}

// The multi-slot connection (src/store/batch.rs): the job-path calls of six slots made at the
// same moment go out as one batch; each slot gets its own reply, and a call that fails (a FINISH
// whose failure list has the wrong type, S-6) fails alone (A-1, K-2).
#[tokio::test]
async fn batched_calls_get_their_own_replies_and_a_failing_call_fails_alone() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let jobs: Vec<Vec<u8>> = (1..=5).map(|i| payload("J", json!([i]))).collect();
    for j in &jobs {
        push(c, "q", j).await;
    }
    // Slot 2 holds a job whose FINISH with a failure must raise: the failure list is a hash.
    push(c, "bad", &payload("Job", json!(["bad"]))).await;
    let _: () = rcmd!(c, "CONFIG", "RESETSTAT");
    let manager = server
        .client()
        .get_connection_manager()
        .await
        .expect("connection manager");
    let conn = locketd::store::batch::Conn::batched(manager);
    let slots: Vec<Slot> = (1..=6)
        .map(|i| Slot::new(format!("p:1:{i}"), format!("testhost:1+{i}:q")))
        .collect();
    for slot in &slots {
        mark_alive(c, &slot.slot_key).await;
    }
    let bad = reserve_job(c, &slots[2], &["bad"]).await;
    let _: i64 = rcmd!(c, "HSET", k.failed(), "f", "v");
    let _: () = rcmd!(c, "CONFIG", "RESETSTAT");
    let failure = Finish::Failure("{}".to_string());
    let bad_req = finish_request(&bad, "", &[], &failure);
    let calls = slots.iter().enumerate().map(|(i, slot)| {
        let mut conn = conn.clone();
        let bad_req = bad_req.clone();
        async move {
            if i == 2 {
                return store::finish(&mut conn, &slot.r(), &bad_req)
                    .await
                    .map(|_| Reserved::Busy);
            }
            store::reserve(
                &mut conn,
                &slot.r(),
                &random_hex(8),
                &["q".to_string()],
                false,
            )
            .await
        }
    });
    let replies = futures::future::join_all(calls).await;

    let mut got = Vec::new();
    for (i, reply) in replies.into_iter().enumerate() {
        if i == 2 {
            let e = reply.expect_err("a FINISH onto a failure list of the wrong type fails");
            assert!(e.to_string().contains("WRONGTYPE"), "{e}");
            continue;
        }
        match reply.expect("RESERVE") {
            Reserved::Job { payload, .. } => got.push(payload),
            other => panic!("slot {i}: {other:?}"),
        }
    }
    got.sort();
    let mut want = jobs.clone();
    want.sort();
    assert_eq!(got, want, "each job reserved by exactly one slot");
    for (i, slot) in slots.iter().enumerate() {
        // Slot 2's job stays in its record: the FINISH changed nothing (S-6).
        let record = hgetall(c, &slot.inflight()).await;
        assert!(!record.is_empty(), "slot {i}: {record:?}");
    }
    // (The O-3 counts of these calls are the process's, written by a worker's flush:
    // tests/it/counts.rs checks them through the daemon.)
    let info: String = rcmd!(c, "INFO", "commandstats");
    let evalsha = crate::support::script_calls(&info);
    assert!(evalsha <= 2, "six calls took {evalsha} script calls");
}

// A-1 through the multi-slot connection with more queue names than Lua's `unpack` takes at
// once (about 8,000 values): a batch cuts each call's arguments out of the batch's ARGV, and a
// RESERVE over 9,000 queues still reserves from the last of them.
#[tokio::test]
async fn a_batched_reserve_over_nine_thousand_queues_reaches_the_last() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let queues: Vec<String> = (0..9_000).map(|i| format!("q{i}")).collect();
    let jobs: Vec<Vec<u8>> = (1..=2).map(|i| payload("J", json!([i]))).collect();
    for j in &jobs {
        push(c, "q8999", j).await;
    }
    let manager = server
        .client()
        .get_connection_manager()
        .await
        .expect("connection manager");
    let conn = locketd::store::batch::Conn::batched(manager);
    let slots: Vec<Slot> = (1..=2)
        .map(|i| Slot::new(format!("p:1:{i}"), format!("testhost:1+{i}:q")))
        .collect();
    for slot in &slots {
        mark_alive(c, &slot.slot_key).await;
    }
    let _: () = rcmd!(c, "CONFIG", "RESETSTAT");
    let calls = slots.iter().map(|slot| {
        let mut conn = conn.clone();
        let queues = queues.clone();
        async move { store::reserve(&mut conn, &slot.r(), &random_hex(8), &queues, false).await }
    });
    let mut got = Vec::new();
    for reply in futures::future::join_all(calls).await {
        match reply.expect("RESERVE over 9,000 queues") {
            Reserved::Job { queue, payload, .. } => {
                assert_eq!(queue, "q8999");
                got.push(payload);
            }
            other => panic!("{other:?}"),
        }
    }
    got.sort();
    assert_eq!(got, jobs, "each slot reserved one of the two jobs");
    let info: String = rcmd!(c, "INFO", "commandstats");
    let evalsha = crate::support::script_calls(&info);
    assert!(evalsha <= 2, "two calls took {evalsha} script calls");
}

/// The major version of a test server's Redis.
pub(crate) async fn redis_major(c: &mut redis::aio::MultiplexedConnection) -> u32 {
    let info: String = rcmd!(c, "INFO", "server");
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .and_then(|v| v.split('.').next())
        .and_then(|v| v.trim().parse().ok())
        .expect("redis_version in INFO server")
}

// src/store/fcall.rs: the job path's connection calls its scripts as FCALL of one FUNCTION
// library where Redis has FUNCTION, loads it again after a FUNCTION FLUSH, and runs the same
// calls by EVALSHA where Redis has no FUNCTION (Redis 6; here: the command renamed away).
#[tokio::test]
async fn the_job_path_calls_the_function_library_or_falls_back_to_scripts() {
    // `plain`: the one-slot worker's own connection (src/conn/plain.rs), which packs its FCALL
    // itself; else the shared one.
    for (functions, plain) in [(true, false), (false, false), (true, true), (false, true)] {
        let server = if functions {
            RedisServer::start()
        } else {
            RedisServer::start_with(&["--rename-command", "FUNCTION", "\"\""])
        };
        let c = &mut server.conn().await;
        if functions && redis_major(c).await < 7 {
            eprintln!("note: Redis < 7 has no FUNCTION; only the fallback is checked");
            continue;
        }
        let jobs: Vec<Vec<u8>> = (1..=3).map(|i| payload("J", json!([i]))).collect();
        for j in &jobs {
            push(c, "q", j).await;
        }
        let manager = server
            .client()
            .get_connection_manager()
            .await
            .expect("connection manager");
        let mut conn = if plain {
            locketd::store::batch::Conn::with_plain(manager, &server.url())
        } else {
            locketd::store::batch::Conn::direct(manager)
        };
        let slot = Slot::new("p:1:0", "testhost:1:q");
        mark_alive(c, &slot.slot_key).await;
        let _: () = rcmd!(c, "CONFIG", "RESETSTAT");
        let mut got = Vec::new();
        for round in 0..3 {
            if functions && round == 1 {
                let _: () = rcmd!(c, "FUNCTION", "FLUSH");
            }
            let r = store::reserve(&mut conn, &slot.r(), &random_hex(8), &["q".into()], false)
                .await
                .expect("RESERVE");
            let Reserved::Job { payload, .. } = r else {
                panic!("round {round}: {r:?}")
            };
            got.push(payload);
            // The slot is free again for the next round.
            let _: i64 = rcmd!(c, "DEL", slot.inflight());
        }
        assert_eq!(got, jobs, "functions = {functions}, plain = {plain}");
        assert_eq!(conn.uses_functions(), functions);
        let info: String = rcmd!(c, "INFO", "commandstats");
        let (fcall, evalsha) = (
            crate::support::command_calls(&info, "fcall"),
            crate::support::command_calls(&info, "evalsha"),
        );
        if functions {
            assert_eq!(
                (fcall, evalsha),
                (4, 0),
                "three calls, one sent again after the flush"
            );
            let libs: redis::Value = rcmd!(c, "FUNCTION", "LIST", "LIBRARYNAME", "locketd_*");
            assert!(format!("{libs:?}").contains("locketd_"), "{libs:?}");
        } else {
            assert_eq!(
                (fcall, evalsha),
                (0, 4),
                "three calls, the first sent again after NOSCRIPT"
            );
        }
    }
}

// Issue 23: FUNCTION libraries `locketd_<hash>`, one per build, do not pile up in Redis: a
// worker's connection that loads its own deletes the other builds' libraries that no
// connection has loaded for 24 hours (`<ns>:locket:functions` records each library's last
// load; a library without a record is given one, so an older build's library is kept for 24
// hours during a rolling upgrade). A library of another build still in use is left alone;
// another tool's library too.
#[tokio::test]
async fn stale_function_libraries_of_other_builds_are_deleted_on_load() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    if redis_major(c).await < 7 {
        eprintln!("note: Redis < 7 has no FUNCTION");
        return;
    }
    let lib = |name: &str| {
        format!("#!lua name={name}\nredis.register_function('{name}_f', function() return 1 end)")
    };
    let now: i64 = {
        let (s, _us): (i64, i64) = rcmd!(c, "TIME");
        s
    };
    for name in [
        "locketd_00000000000000aa",
        "locketd_00000000000000bb",
        "locketd_00000000000000cc",
        "otherapp",
    ] {
        let _: String = rcmd!(c, "FUNCTION", "LOAD", lib(name));
    }
    // aa: last loaded two days ago; bb: an hour ago (a build still running); cc: no record.
    let _: i64 = rcmd!(
        c,
        "HSET",
        k.locket("functions"),
        "locketd_00000000000000aa",
        now - 2 * 86_400,
        "locketd_00000000000000bb",
        now - 3600
    );
    let manager = server
        .client()
        .get_connection_manager()
        .await
        .expect("connection manager");
    let mut conn = locketd::store::batch::Conn::direct(manager);
    conn.record_libraries_in(k.locket("functions"));
    let slot = Slot::new("p:1:0", "testhost:1:q");
    mark_alive(c, &slot.slot_key).await;
    let r = store::reserve(&mut conn, &slot.r(), &random_hex(8), &["q".into()], false)
        .await
        .expect("RESERVE");
    assert!(matches!(r, Reserved::Nothing { .. }), "{r:?}");
    assert!(conn.uses_functions());
    let libs: redis::Value = rcmd!(c, "FUNCTION", "LIST");
    let libs = format!("{libs:?}");
    assert!(!libs.contains("locketd_00000000000000aa"), "{libs}");
    for kept in [
        "locketd_00000000000000bb",
        "locketd_00000000000000cc",
        "otherapp",
    ] {
        assert!(libs.contains(kept), "{kept}: {libs}");
    }
    let ours = locketd::store::scripts::scripts().library.name.clone();
    assert!(libs.contains(&ours), "{libs}");
    let seen: std::collections::HashMap<String, i64> = rcmd!(c, "HGETALL", k.locket("functions"));
    assert!(!seen.contains_key("locketd_00000000000000aa"), "{seen:?}");
    assert!(seen["locketd_00000000000000cc"] >= now, "{seen:?}");
    assert!(seen[&ours] >= now, "{seen:?}");
}

// locking-semantics.md A-1 (resque-protocol.md pause rule)
#[tokio::test]
async fn reserve_returns_paused_while_pause_all_workers_is_set() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let j = payload("J", json!([1]));
    push(c, "q", &j).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    for value in ["true", " TRUE "] {
        let _: () = rcmd!(c, "SET", k.pause_all(), value);
        assert_eq!(reserve(c, &slot, &["q"], false).await, Reserved::Paused);
        assert!(!exists(c, &slot.inflight()).await);
        assert_eq!(lrange(c, &k.queue("q")).await, vec![j.clone()]);
    }
    let _: () = rcmd!(c, "SET", k.pause_all(), "false");
    assert_eq!(reserve_job(c, &slot, &["q"]).await.payload, j);
}

// ---------------------------------------------------------------------------------------------
// 5.3 ACQUIRE: conflicts
// ---------------------------------------------------------------------------------------------

// locking-semantics.md A-6, A-7, P-1, A-15, A-18
#[tokio::test]
async fn a_conflict_with_requeue_moves_the_original_bytes_to_the_tail_and_counts_the_queue() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("acct:42", 1);
    let h = hold(c, "h", std::slice::from_ref(&l), 20_000).await;

    let j1: &[u8] = b"{\"class\":\"Billing::Sync\", \"args\":[42, 1.0],\"id\":\"php-1\"}";
    let x1 = payload("Billing::Sync", json!([42, "x1"]));
    let x2 = payload("Other", json!([7]));
    for p in [j1, &x1, &x2] {
        push(c, "q", p).await;
    }
    let s1 = Slot::new("p:1:0", "testhost:11:q");
    let r1 = reserve_job(c, &s1, &["q"]).await;
    assert_eq!(r1.payload, j1);
    // A push that lands between RESERVE and the conflict keeps its place ahead of the requeue.
    let y = payload("Late", json!([]));
    push(c, "q", &y).await;

    let o = opts(10_000, 2_000, true);
    let before = server_ms(c).await as i64;
    let a = acquire(c, &s1, &r1, &random_hex(16), std::slice::from_ref(&l), o).await;
    let after = server_ms(c).await as i64;
    assert_eq!(
        a,
        Acquired::Conflict {
            requeued: true,
            lock_id: "acct:42".into(),
            holders: 1,
            limit: 1
        }
    );
    assert!(!exists(c, &s1.inflight()).await, "inflight record left");
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![x1.clone(), x2.clone(), y.clone(), j1.to_vec()]
    );
    assert!(smembers(c, &k.queues()).await.contains("q"));
    assert_eq!(get(c, &k.counter("q")).await.as_deref(), Some("1"));
    let counter_exp = expire_at(c, &k.counter("q")).await;
    assert!(
        counter_exp >= before + 2000 - 2 && counter_exp <= after + 2000 + 2,
        "counter expires at {counter_exp}, not counter_ttl after its creation in [{before}, {after}]"
    );
    assert_eq!(smembers(c, &k.blocked_lock("acct:42")).await, set_of(["q"]));
    let blocked_exp = expire_at(c, &k.blocked_lock("acct:42")).await;
    assert!(blocked_exp >= before + 2000 - 2 && blocked_exp <= after + 2000 + 2);
    // The holder keeps its lease (L-1a: the key's PX is its deadline); its value is flagged
    // so that its release resets the blocked set (A-14).
    assert_holders(
        c,
        &k.lock("acct:42"),
        &[(h.token.clone(), h.deadline)],
        "the holder after a conflict",
    )
    .await;
    let value = get(c, &k.lock("acct:42"))
        .await
        .expect("the holder's value");
    assert!(
        value.starts_with(&format!("{{\"blocked\":1,\"token\":\"{}\"", h.token)),
        "{value}"
    );

    // A second conflict from the same queue 400 ms later: counted, but its expiry stays
    // counter_ttl after creation (A-15); the blocked set's expiry is refreshed.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s2 = Slot::new("p:2:0", "testhost:12:q");
    let r2 = reserve_job(c, &s2, &["q"]).await;
    assert_eq!(r2.payload, x1);
    let before2 = server_ms(c).await as i64;
    let a = acquire(c, &s2, &r2, &random_hex(16), std::slice::from_ref(&l), o).await;
    assert!(
        matches!(a, Acquired::Conflict { requeued: true, .. }),
        "{a:?}"
    );
    assert_eq!(get(c, &k.counter("q")).await.as_deref(), Some("2"));
    assert_near(
        expire_at(c, &k.counter("q")).await,
        counter_exp,
        3,
        "counter expiry after a second INCR",
    );
    assert!(expire_at(c, &k.blocked_lock("acct:42")).await >= before2 + 2000 - 2);
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![x2, y, j1.to_vec(), x1.clone()]
    );

    // The counter is gone counter_ttl after its creation.
    let now = server_ms(c).await as i64;
    wait_gone(
        c,
        k.counter("q"),
        Duration::from_millis((counter_exp + 600 - now).max(0) as u64),
        "the counter to expire counter_ttl after its creation",
    )
    .await;
}

// locking-semantics.md A-6 step 4 (fallback none), A-17
#[tokio::test]
async fn a_conflict_without_fallback_leaves_the_job_reserved_and_counts_nothing() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 1);
    let h = hold(c, "h", std::slice::from_ref(&l), 20_000).await;
    let j = payload("J", json!([1]));
    let other = payload("J", json!([2]));
    push(c, "q", &j).await;
    push(c, "q", &other).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    let res = reserve_job(c, &slot, &["q"]).await;
    let record = hgetall(c, &slot.inflight()).await;

    let a = acquire(
        c,
        &slot,
        &res,
        &random_hex(16),
        std::slice::from_ref(&l),
        opts(5000, 1000, false),
    )
    .await;
    assert_eq!(
        a,
        Acquired::Conflict {
            requeued: false,
            lock_id: "L".into(),
            holders: 1,
            limit: 1
        }
    );
    assert_eq!(hgetall(c, &slot.inflight()).await, record);
    assert_eq!(record["state"], "reserved");
    assert_eq!(lrange(c, &k.queue("q")).await, vec![other]);
    assert!(!exists(c, &k.counter("q")).await);
    assert!(!exists(c, &k.blocked_lock("L")).await);

    // Once the holder is gone, the same reservation starts with a new token.
    assert!(h.finish(c).await);
    let token = random_hex(16);
    started(acquire(c, &slot, &res, &token, &[l], opts(5000, 1000, false)).await);
    assert_eq!(zrange_scores(c, &k.lock("L")).await.len(), 1);
    assert!(zscore(c, &k.lock("L"), &token).await.is_some());
}

// locking-semantics.md A-19, NEVER-10
#[tokio::test]
async fn conflicts_leave_resque_stats_failures_and_working_on_untouched() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _: () = rcmd!(c, "SET", k.stat_processed(), 7);
    let _: i64 = rcmd!(c, "RPUSH", k.failed(), "{\"old\":true}");
    let l = spec("L", 1);
    let _h = hold(c, "h", std::slice::from_ref(&l), 20_000).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    for i in 0..3 {
        push(c, "q", &payload("J", json!([i]))).await;
    }
    for (i, requeue) in [(0, true), (1, true), (2, false)] {
        let res = reserve_job(c, &slot, &["q"]).await;
        let a = acquire(
            c,
            &slot,
            &res,
            &random_hex(16),
            std::slice::from_ref(&l),
            opts(5000, 5000, requeue),
        )
        .await;
        assert!(matches!(a, Acquired::Conflict { .. }), "attempt {i}: {a:?}");
        if !requeue {
            assert!(store::return_to_queue(c, &slot.r(), &res.rid, "q")
                .await
                .unwrap());
        }
    }
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("7"));
    assert_eq!(get(c, &k.stat_failed()).await, None);
    assert_eq!(get(c, &k.stat_processed_by(&slot.worker_id)).await, None);
    assert_eq!(get(c, &k.stat_failed_by(&slot.worker_id)).await, None);
    let failed: Vec<String> = rcmd!(c, "LRANGE", k.failed(), 0, -1);
    assert_eq!(failed, vec!["{\"old\":true}".to_string()]);
    assert!(
        !exists(c, &k.worker(&slot.worker_id)).await,
        "working-on record written"
    );
}

// ---------------------------------------------------------------------------------------------
// 5.4 START
// ---------------------------------------------------------------------------------------------

// locking-semantics.md A-8, A-6 step 5
#[tokio::test]
async fn acquire_success_starts_the_job_resets_its_queue_counter_and_writes_working_on() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    // counter:q below LLEN (so q is served) must be reset by START; counter:other stays.
    let _: () = rcmd!(c, "SET", k.counter("q"), 1, "PX", 10_000);
    let _: () = rcmd!(c, "SET", k.counter("other"), 3, "PX", 10_000);
    let j: &[u8] = b"{\"class\":\"Billing::Sync\",\"args\":[42],  \"queue\":\"q\"}";
    push(c, "q", j).await;
    push(c, "q", &payload("Billing::Sync", json!([43]))).await;
    let slot = Slot::new("testhost:9:abcdef01:0", "testhost:9:q");
    let res = reserve_job(c, &slot, &["q"]).await;
    let token = random_hex(16);
    let l = spec("Billing::Sync:42", 1);
    let deadline = started(
        acquire(
            c,
            &slot,
            &res,
            &token,
            std::slice::from_ref(&l),
            opts(5000, 1000, true),
        )
        .await,
    );

    assert!(!exists(c, &k.counter("q")).await, "counter of q not reset");
    assert_eq!(get(c, &k.counter("other")).await.as_deref(), Some("3"));

    let working: Value = serde_json::from_str(
        &get(c, &k.worker(&slot.worker_id))
            .await
            .expect("worker:<id>"),
    )
    .unwrap();
    assert_eq!(working["queue"], "q");
    assert_eq!(
        working["payload"],
        serde_json::from_slice::<Value>(j).unwrap()
    );
    assert!(working["run_at"].is_string());

    let rec = hgetall(c, &slot.inflight()).await;
    assert_eq!(rec["rid"], res.rid);
    assert_eq!(rec["queue"], "q");
    assert_eq!(rec["state"], "running");
    assert_eq!(rec["token"], token);
    assert_eq!(rec["class"], "Billing::Sync");
    assert_eq!(rec["digest"], sha256_hex(j));
    assert_eq!(
        serde_json::from_str::<Value>(&rec["locks"]).unwrap(),
        json!(["Billing::Sync:42"])
    );
    assert_eq!(rec["started_at"].parse::<u64>().unwrap(), deadline - 5000);
    assert!(rec.contains_key("reserved_at"));
    assert_eq!(
        hget_bytes(c, &slot.inflight(), "payload").await.as_deref(),
        Some(j)
    );

    // A limit-1 lock is its key (L-1a): the holder's info is its value, the lease its PX;
    // it has no `lockinfo` hash and no `locks` entry.
    let holders = store::holders(c, &k, &l.id).await.unwrap();
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].token, token);
    assert_lease_near(holders[0].deadline_ms, deadline, "the holder's deadline");
    assert_lease_near(
        expire_at(c, &k.lock(&l.id)).await as u64,
        deadline,
        "the lock key's expiry",
    );
    let info = holders[0].info.clone().expect("lockinfo");
    assert_eq!(info["limit"], 1);
    assert_eq!(info["acquired_at"].as_u64(), Some(deadline - 5000));
    assert_eq!(info["class"], "Billing::Sync");
    assert_eq!(info["queue"], "q");
    assert_eq!(info["resque_worker"], slot.worker_id.as_str());
    assert!(!exists(c, &k.lockinfo(&l.id)).await);
    assert!(!exists(c, &k.locks()).await);

    // START alone (an unlocked job) does the same without touching any lock.
    let _: () = rcmd!(c, "SET", k.counter("u"), 1, "PX", 10_000);
    push(c, "u", &payload("Unlocked", json!([]))).await;
    push(c, "u", &payload("Unlocked", json!([2]))).await;
    let s2 = Slot::new("testhost:9:abcdef01:1", "testhost:9:u");
    let r2 = reserve_job(c, &s2, &["u"]).await;
    started(acquire(c, &s2, &r2, "", &[], opts(5000, 1000, true)).await);
    assert!(!exists(c, &k.counter("u")).await);
    let rec = hgetall(c, &s2.inflight()).await;
    assert_eq!(rec["state"], "running");
    assert_eq!(rec["token"], "");
    let locks = serde_json::from_str::<Value>(&rec["locks"]).unwrap();
    assert!(
        locks.as_array().is_some_and(|a| a.is_empty())
            || locks.as_object().is_some_and(|o| o.is_empty()),
        "{locks}"
    );
    assert!(exists(c, &k.worker(&s2.worker_id)).await);
}

// locking-semantics.md A-6 step 1, R-6, R-8
#[tokio::test]
async fn acquire_for_a_reservation_no_longer_in_the_slot_returns_missing_and_changes_nothing() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let j = payload("J", json!([1]));
    let next = payload("J", json!([2]));
    push(c, "q", &j).await;
    push(c, "q", &next).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    let res = reserve_job(c, &slot, &["q"]).await;
    let record = hgetall(c, &slot.inflight()).await;
    let l = spec("L", 1);

    let stale = Res {
        rid: "0123456789abcdef".into(),
        ..res.clone()
    };
    // The record is read when the process lease is gone (recovery needs it gone, R-4) or
    // when the call is sent again after a lost reply: both find the rid changed.
    let _: i64 = rcmd!(c, "DEL", k.alive("p:1"));
    for resent in [false, true] {
        if resent {
            mark_alive(c, &slot.slot_key).await;
        }
        for requeue in [false, true] {
            let o = Opts {
                resent,
                ..opts(5000, 1000, requeue)
            };
            let a = acquire(
                c,
                &slot,
                &stale,
                &random_hex(16),
                std::slice::from_ref(&l),
                o,
            )
            .await;
            assert_eq!(a, Acquired::Missing, "resent: {resent}, requeue: {requeue}");
        }
    }
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!exists(c, &k.locks()).await);
    assert_eq!(hgetall(c, &slot.inflight()).await, record);
    assert_eq!(lrange(c, &k.queue("q")).await, vec![next.clone()]);

    // Returned to the head of its queue (R-8); the old rid then finds nothing.
    assert!(store::return_to_queue(c, &slot.r(), &res.rid, "q")
        .await
        .unwrap());
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![j.clone(), next.clone()]
    );
    // (A retry of an ACQUIRE whose reply was lost: the worker marks it resent.)
    let a = acquire(
        c,
        &slot,
        &res,
        &random_hex(16),
        &[l],
        Opts {
            resent: true,
            ..opts(5000, 1000, true)
        },
    )
    .await;
    assert_eq!(a, Acquired::Missing);
    assert_eq!(lrange(c, &k.queue("q")).await, vec![j, next]);
    assert!(!exists(c, &k.counter("q")).await);
    assert!(!store::return_to_queue(c, &slot.r(), &res.rid, "q")
        .await
        .unwrap());
}

// ---------------------------------------------------------------------------------------------
// A-14..A-18 counters
// ---------------------------------------------------------------------------------------------

// locking-semantics.md A-14, A-13 step 2, L-5
#[tokio::test]
async fn finish_releases_the_lock_and_resets_only_the_counters_of_queues_it_blocked() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 1);
    let m = spec("M", 1);
    let hl = hold(c, "hl", std::slice::from_ref(&l), 20_000).await;
    let _hm = hold(c, "hm", std::slice::from_ref(&m), 20_000).await;
    let o = opts(5000, 10_000, true);
    for (name, q) in [("s1", "q1"), ("s2", "q2")] {
        let (.., a) = try_job(
            c,
            name,
            q,
            &payload("J", json!([q])),
            std::slice::from_ref(&l),
            o,
        )
        .await;
        assert!(
            matches!(a, Acquired::Conflict { requeued: true, .. }),
            "{a:?}"
        );
    }
    assert_requeued(
        c,
        "s4",
        "q4",
        &payload("J", json!(["q4"])),
        std::slice::from_ref(&m),
        o,
    )
    .await;
    let _: () = rcmd!(c, "SET", k.counter("q3"), 1, "PX", 10_000);
    assert_eq!(
        smembers(c, &k.blocked_lock("L")).await,
        set_of(["q1", "q2"])
    );
    for q in ["q1", "q2", "q3", "q4"] {
        assert_eq!(get(c, &k.counter(q)).await.as_deref(), Some("1"), "{q}");
    }

    assert!(hl.finish(c).await);
    assert!(!exists(c, &k.counter("q1")).await);
    assert!(!exists(c, &k.counter("q2")).await);
    assert!(!exists(c, &k.blocked_lock("L")).await);
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!exists(c, &k.lockinfo("L")).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, None);
    // Other resources' blocked queues and hand-set counters are not touched.
    assert_eq!(get(c, &k.counter("q3")).await.as_deref(), Some("1"));
    assert_eq!(get(c, &k.counter("q4")).await.as_deref(), Some("1"));
    assert_eq!(smembers(c, &k.blocked_lock("M")).await, set_of(["q4"]));
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("1"));
}

// locking-semantics.md A-14, A-10, A-6 step 2, R-3 step 2, R-7, L-7
#[tokio::test]
async fn an_expiry_purge_resets_the_counters_of_queues_the_lock_blocked() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    // Locks of limit 2, full: purges remove a ZSET's lapsed members (L-1). A limit-1 lock has
    // nothing to purge, its key lapses on its own (L-1a): the next test covers it.
    let l = spec("L", 2);
    let m = spec("M", 2);
    let n = spec("N", 2);
    let hn1 = hold(c, "hn1", std::slice::from_ref(&n), 500).await;
    let hn2 = hold(c, "hn2", std::slice::from_ref(&n), 20_000).await;
    let hl = hold(c, "hl", std::slice::from_ref(&l), 1200).await;
    let hl2 = hold(c, "hl2", std::slice::from_ref(&l), 1200).await;
    let hm = hold(c, "hm", std::slice::from_ref(&m), 2500).await;
    let hm2 = hold(c, "hm2", std::slice::from_ref(&m), 2500).await;
    let o = opts(5000, 20_000, true);
    assert_requeued(
        c,
        "s1",
        "q1",
        &payload("J", json!([1])),
        std::slice::from_ref(&l),
        o,
    )
    .await;
    assert_requeued(
        c,
        "s2",
        "q2",
        &payload("J", json!([2])),
        std::slice::from_ref(&m),
        o,
    )
    .await;

    assert_requeued(
        c,
        "s5",
        "q5",
        &payload("J", json!([5])),
        std::slice::from_ref(&n),
        o,
    )
    .await;

    // EXTEND's purge (A-10) of N's lapsed holder resets the queue N blocked.
    sleep_past_server_ms(c, hn1.deadline).await;
    assert!(
        server_ms(c).await < hl.deadline,
        "test too slow: L expired too"
    );
    let (_, lost) = store::extend(
        c,
        &k,
        &hn2.token,
        std::slice::from_ref(&n),
        Duration::from_millis(20_000),
    )
    .await
    .unwrap();
    assert_eq!(lost, vec![false]);
    assert!(
        !exists(c, &k.counter("q5")).await,
        "counter of q5 survived EXTEND's purge"
    );
    assert!(!exists(c, &k.blocked_lock("N")).await);
    assert_eq!(zcard(c, &k.lock("N")).await, 1);
    assert_eq!(get(c, &k.counter("q1")).await.as_deref(), Some("1"));

    // The janitor's purge (R-3 step 2) of L, whose holders lapsed; M is still live.
    sleep_past_server_ms(c, hl.deadline.max(hl2.deadline)).await;
    assert!(
        server_ms(c).await < hm.deadline,
        "test too slow: M expired too"
    );
    assert_eq!(store::purge_expired(c, &k, 100).await.unwrap(), 2);
    assert!(
        !exists(c, &k.counter("q1")).await,
        "counter of q1 survived the purge"
    );
    assert!(!exists(c, &k.blocked_lock("L")).await);
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!exists(c, &k.lockinfo("L")).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, None);
    assert_eq!(get(c, &k.counter("q2")).await.as_deref(), Some("1"));
    assert_eq!(zscore(c, &k.locks(), "M").await, Some(hm.deadline));

    // ACQUIRE's own purge (A-6 step 2) when M's holders lapse.
    sleep_past_server_ms(c, hm.deadline.max(hm2.deadline)).await;
    let (_, _, token, a) = try_job(
        c,
        "s3",
        "q3",
        &payload("J", json!([3])),
        std::slice::from_ref(&m),
        o,
    )
    .await;
    started(a);
    assert!(
        !exists(c, &k.counter("q2")).await,
        "counter of q2 survived ACQUIRE's purge"
    );
    assert!(!exists(c, &k.blocked_lock("M")).await);
    assert_eq!(
        zrange_scores(c, &k.lock("M"))
            .await
            .into_iter()
            .map(|(t, _)| t)
            .collect::<Vec<_>>(),
        vec![token]
    );
}

// locking-semantics.md A-14, R-3 step 2, R-3 step 2a, R-7, A-6 step 2, L-6, L-1a
#[tokio::test]
async fn a_lock_key_that_lapsed_on_its_own_still_resets_the_counters_it_blocked() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    // L and M, of limit 2 (full), are ZSETs whose keys vanish 1 s after their last lease
    // lapsed (L-6), before anyone purges them: with the default janitor_interval (5 s) that is
    // the usual case. S, of limit 1, is a key that vanishes when its lease lapses (L-1a).
    let l = spec("L", 2);
    let m = spec("M", 2);
    let sl = spec("S", 1);
    let mut held = Vec::new();
    for (name, lock) in [
        ("hl", &l),
        ("hl2", &l),
        ("hm", &m),
        ("hm2", &m),
        ("hs", &sl),
    ] {
        held.push(hold(c, name, std::slice::from_ref(lock), 1000).await);
    }
    let hl = &held[0];
    let hm = &held[2];
    let o = opts(5000, 20_000, true);
    for (name, q, lock) in [("s1", "q1", &l), ("s2", "q2", &m), ("s4", "q4", &sl)] {
        assert_requeued(
            c,
            name,
            q,
            &payload("J", json!([q])),
            std::slice::from_ref(lock),
            o,
        )
        .await;
    }
    let last = held.iter().map(|h| h.deadline).max().unwrap();
    sleep_past_server_ms(c, last + 1000).await;
    for id in ["L", "M", "S"] {
        assert!(!exists(c, &k.lock(id)).await, "lock {id} still exists");
    }
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(hl.deadline));
    assert_eq!(
        zscore(c, &k.locks(), "S").await,
        None,
        "a limit-1 lock has no entry"
    );
    for q in ["q1", "q2", "q4"] {
        assert_eq!(get(c, &k.counter(q)).await.as_deref(), Some("1"), "{q}");
    }

    // The janitor's purge: L lost its holders by expiry, so q1 may run again.
    store::purge_expired(c, &k, 1).await.unwrap();
    assert_eq!(zscore(c, &k.locks(), "L").await, None);
    assert!(
        !exists(c, &k.counter("q1")).await,
        "counter of q1 outlived the lock that blocked it"
    );
    assert!(!exists(c, &k.blocked_lock("L")).await);
    // The purge leaves S's queue alone: it has no index entry to find.
    assert_eq!(get(c, &k.counter("q4")).await.as_deref(), Some("1"));

    // ACQUIRE of M (its key gone too, its index entry not yet purged).
    assert_eq!(zscore(c, &k.locks(), "M").await, Some(hm.deadline));
    let (.., a) = try_job(
        c,
        "s3",
        "q3",
        &payload("J", json!([3])),
        std::slice::from_ref(&m),
        o,
    )
    .await;
    started(a);
    assert!(
        !exists(c, &k.counter("q2")).await,
        "counter of q2 outlived the lock that blocked it"
    );
    assert!(!exists(c, &k.blocked_lock("M")).await);

    // The janitor's SCAN of blocked sets (R-3 step 2a) finds S's, whose key is gone: q4 may
    // run again (M's set went with ACQUIRE's purge); a second pass finds nothing to reset.
    assert_eq!(store::unblock_lapsed(c, &k, 10).await.unwrap(), 1);
    assert!(
        !exists(c, &k.counter("q4")).await,
        "counter of q4 outlived the lock that blocked it"
    );
    assert!(!exists(c, &k.blocked_lock("S")).await);
    assert_eq!(store::unblock_lapsed(c, &k, 10).await.unwrap(), 0);
}

// locking-semantics.md A-16
#[tokio::test]
async fn an_idle_pass_clears_only_the_skipped_queues_counters_and_only_when_enabled() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    push(c, "a", &payload("A", json!([]))).await;
    let _: () = rcmd!(c, "SET", k.counter("a"), 1, "PX", 10_000);
    let _: () = rcmd!(c, "SET", k.counter("b"), 3, "PX", 10_000); // empty queue: not skipped
    let _: () = rcmd!(c, "SET", k.counter("e"), 1, "PX", 10_000); // not in the list
    let slot = Slot::new("p:1:0", "testhost:1:a,b,d");
    let skipped_a = Reserved::Nothing {
        skipped: vec!["a".into()],
        unreadable: vec![],
        paused: vec![],
        capped: vec![],
        refused: vec![],
    };

    assert_eq!(reserve(c, &slot, &["a", "b", "d"], false).await, skipped_a);
    for q in ["a", "b", "e"] {
        assert!(
            exists(c, &k.counter(q)).await,
            "flag off, yet counter:{q} was cleared"
        );
    }

    assert_eq!(reserve(c, &slot, &["a", "b", "d"], true).await, skipped_a);
    assert!(
        !exists(c, &k.counter("a")).await,
        "skipped queue's counter kept"
    );
    assert_eq!(get(c, &k.counter("b")).await.as_deref(), Some("3"));
    assert_eq!(get(c, &k.counter("e")).await.as_deref(), Some("1"));

    // A pass that reserved something clears nothing, even with the flag.
    let _: () = rcmd!(c, "SET", k.counter("a"), 1, "PX", 10_000);
    push(c, "d", &payload("D", json!([]))).await;
    let got = reserve(c, &slot, &["a", "b", "d"], true).await;
    assert!(
        matches!(&got, Reserved::Job { queue, .. } if queue == "d"),
        "{got:?}"
    );
    assert_eq!(get(c, &k.counter("a")).await.as_deref(), Some("1"));
}

// locking-semantics.md A-17, A-13 step 4
#[tokio::test]
async fn only_conflict_requeues_increment_a_queue_counter() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let slot = Slot::new("p:1:0", "testhost:1:q");
    let free = spec("free", 1);
    let o = opts(5000, 5000, true);

    // FINISH with outcome requeue puts the job at the tail without counting.
    let j = payload("J", json!([1]));
    let tail = payload("J", json!([2]));
    push(c, "q", &j).await;
    push(c, "q", &tail).await;
    let res = reserve_job(c, &slot, &["q"]).await;
    let tok = random_hex(16);
    started(acquire(c, &slot, &res, &tok, std::slice::from_ref(&free), o).await);
    assert!(
        finish(
            c,
            &slot,
            &res,
            &tok,
            std::slice::from_ref(&free),
            Finish::Requeue
        )
        .await
    );
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![tail.clone(), j.clone()]
    );
    assert!(!exists(c, &k.counter("q")).await);

    // A failure, a fallback-none conflict and a return to the queue don't count either.
    let res = reserve_job(c, &slot, &["q"]).await;
    let tok = random_hex(16);
    started(acquire(c, &slot, &res, &tok, std::slice::from_ref(&free), o).await);
    let rec = JobFailure::new("RuntimeError", "boom").record(
        &String::from_utf8_lossy(&res.payload),
        &slot.worker_id,
        "q",
        SystemTime::now(),
    );
    assert!(
        finish(
            c,
            &slot,
            &res,
            &tok,
            std::slice::from_ref(&free),
            Finish::Failure(rec)
        )
        .await
    );
    let l = spec("L", 1);
    let _h = hold(c, "h", std::slice::from_ref(&l), 20_000).await;
    let res = reserve_job(c, &slot, &["q"]).await;
    let a = acquire(
        c,
        &slot,
        &res,
        &random_hex(16),
        std::slice::from_ref(&l),
        opts(5000, 5000, false),
    )
    .await;
    assert!(matches!(
        a,
        Acquired::Conflict {
            requeued: false,
            ..
        }
    ));
    assert!(store::return_to_queue(c, &slot.r(), &res.rid, "q")
        .await
        .unwrap());
    assert!(!exists(c, &k.counter("q")).await);

    // The conflict requeue does.
    let res = reserve_job(c, &slot, &["q"]).await;
    let a = acquire(c, &slot, &res, &random_hex(16), &[l], o).await;
    assert!(matches!(a, Acquired::Conflict { requeued: true, .. }));
    assert_eq!(get(c, &k.counter("q")).await.as_deref(), Some("1"));
}

// ---------------------------------------------------------------------------------------------
// 7. Lock primitives and limits
// ---------------------------------------------------------------------------------------------

// locking-semantics.md L-1, L-2, L-3
#[tokio::test]
async fn a_limit_one_lock_admits_one_holder_and_the_next_token_after_release() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("one", 1);
    let o = opts(10_000, 1000, false);
    let (sa, ra, ta, a) = try_job(
        c,
        "a",
        "qa",
        &payload("J", json!(["a"])),
        std::slice::from_ref(&l),
        o,
    )
    .await;
    started(a);
    let (sb, rb, _, b) = try_job(
        c,
        "b",
        "qb",
        &payload("J", json!(["b"])),
        std::slice::from_ref(&l),
        o,
    )
    .await;
    assert_eq!(
        b,
        Acquired::Conflict {
            requeued: false,
            lock_id: "one".into(),
            holders: 1,
            limit: 1
        }
    );
    assert_eq!(zcard(c, &k.lock("one")).await, 1);
    assert!(zscore(c, &k.lock("one"), &ta).await.is_some());

    assert!(finish(c, &sa, &ra, &ta, std::slice::from_ref(&l), Finish::Success).await);
    let tb = random_hex(16);
    started(acquire(c, &sb, &rb, &tb, std::slice::from_ref(&l), o).await);
    let members: Vec<String> = zrange_scores(c, &k.lock("one"))
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    assert_eq!(members, vec![tb.clone()]);
    assert_ne!(ta, tb);

    // L-3: tokens are 128-bit lowercase hex and never repeat.
    let tokens: BTreeSet<String> = (0..2000).map(|_| random_hex(16)).collect();
    assert_eq!(tokens.len(), 2000);
    assert!(tokens
        .iter()
        .all(|t| t.len() == 32 && t.chars().all(|ch| matches!(ch, '0'..='9' | 'a'..='f'))));
}

// locking-semantics.md L-1, L-2, L-3, C-3
#[tokio::test]
async fn a_limit_three_lock_admits_three_distinct_holders_and_the_fourth_conflicts() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("three", 3);
    let o = opts(10_000, 1000, false);
    let mut held = Vec::new();
    for i in 0..3 {
        let name = format!("s{i}");
        let (s, r, t, a) = try_job(
            c,
            &name,
            &format!("q{i}"),
            &payload("J", json!([i])),
            std::slice::from_ref(&l),
            o,
        )
        .await;
        started(a);
        held.push((s, r, t));
    }
    let (s4, r4, _, a) = try_job(
        c,
        "s4",
        "q4",
        &payload("J", json!([4])),
        std::slice::from_ref(&l),
        o,
    )
    .await;
    assert_eq!(
        a,
        Acquired::Conflict {
            requeued: false,
            lock_id: "three".into(),
            holders: 3,
            limit: 3
        }
    );
    let members: BTreeSet<String> = zrange_scores(c, &k.lock("three"))
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    let tokens: BTreeSet<String> = held.iter().map(|(_, _, t)| t.clone()).collect();
    assert_eq!(members, tokens);
    assert_eq!(tokens.len(), 3);
    let info = hgetall(c, &k.lockinfo("three")).await;
    assert_eq!(info.keys().cloned().collect::<BTreeSet<_>>(), tokens);
    for v in info.values() {
        assert_eq!(serde_json::from_str::<Value>(v).unwrap()["limit"], 3);
    }

    let (s, r, t) = &held[1];
    assert!(finish(c, s, r, t, std::slice::from_ref(&l), Finish::Success).await);
    let t4 = random_hex(16);
    started(acquire(c, &s4, &r4, &t4, std::slice::from_ref(&l), o).await);
    assert_eq!(zcard(c, &k.lock("three")).await, 3);
    assert!(zscore(c, &k.lock("three"), &t4).await.is_some());
    assert!(zscore(c, &k.lock("three"), t).await.is_none());
}

// locking-semantics.md L-4, A-6, S-6: a job with no options and limit-1 locks only takes the
// short path of ACQUIRE; a lock key of another type (MGET reads it as absent, its SET NX
// refuses) must still leave no lock taken, and settle the job by its policy.
#[tokio::test]
async fn plain_limit_one_locks_are_all_or_nothing_when_a_key_holds_another_type() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let a_lock = spec("A", 1);
    let b_lock = spec("B", 1);
    let both = [a_lock.clone(), b_lock.clone()];
    let _: i64 = rcmd!(c, "HSET", k.lock("B"), "written", "by hand");

    let (s, r, _, a) = try_job(
        c,
        "p",
        "q",
        &payload("P", json!([1])),
        &both,
        opts(10_000, 5000, false),
    )
    .await;
    assert!(
        matches!(&a, Acquired::Conflict { lock_id, holders: 1, limit: 1, requeued: false, .. } if lock_id == "B"),
        "{a:?}"
    );
    assert!(
        !exists(c, &k.lock("A")).await,
        "A taken although B was not free"
    );
    assert_eq!(hgetall(c, &s.inflight()).await["state"], "reserved");

    // With requeue: the copy is back in its queue, A still free, B still the hand's hash.
    let (.., a) = try_job(
        c,
        "p2",
        "q2",
        &payload("P", json!([2])),
        &both,
        opts(10_000, 5000, true),
    )
    .await;
    assert!(
        matches!(a, Acquired::Conflict { requeued: true, .. }),
        "{a:?}"
    );
    assert_eq!(lrange(c, &k.queue("q2")).await.len(), 1);
    assert!(!exists(c, &k.lock("A")).await);
    let kind: String = rcmd!(c, "TYPE", k.lock("B"));
    assert_eq!(kind, "hash");

    // B free: both taken with the attempt's token, in the full path's format.
    let _: i64 = rcmd!(c, "DEL", k.lock("B"));
    let t = random_hex(16);
    let before = server_ms(c).await;
    let deadline = started(acquire(c, &s, &r, &t, &both, opts(10_000, 5000, false)).await);
    for id in ["A", "B"] {
        let v: Value = serde_json::from_str(&get(c, &k.lock(id)).await.expect("lock value"))
            .expect("a lock value is JSON");
        assert_eq!(v["token"], json!(t), "{id}: {v}");
        assert_eq!(v["blocked"], json!(0), "{id}: {v}");
        assert_eq!(v["limit"], json!(1), "{id}: {v}");
        assert_eq!(v["lock_id"], json!(id), "{id}: {v}");
        assert_eq!(v["lock_id_source"], json!(id), "{id}: {v}");
        assert_eq!(v["process"], json!(s.slot_key), "{id}: {v}");
        assert_eq!(v["class"], json!("P"), "{id}: {v}");
        assert!(v["acquired_at"].as_u64().is_some(), "{id}: {v}");
        let left: i64 = rcmd!(c, "PTTL", k.lock(id));
        assert!(left > 9_000 && left <= 10_000, "{id}: PTTL {left}");
    }
    assert!(deadline >= before, "deadline {deadline} before {before}");
    let rec = hgetall(c, &s.inflight()).await;
    assert_eq!(rec["state"], "running");
    assert_eq!(rec["token"], t);
    assert_eq!(
        serde_json::from_str::<Value>(&rec["locks"]).unwrap(),
        json!(["A", "B"])
    );
}

// locking-semantics.md L-4, A-6 step 4
#[tokio::test]
async fn several_locks_are_taken_all_or_nothing_in_any_order() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let x = spec("X", 2);
    let y = spec("Y", 1);
    let hy = hold(c, "hy", std::slice::from_ref(&y), 20_000).await;
    let none = opts(10_000, 5000, false);

    let (s, r, _, a) = try_job(
        c,
        "j",
        "q",
        &payload("J", json!([1])),
        &[x.clone(), y.clone()],
        none,
    )
    .await;
    assert!(
        matches!(&a, Acquired::Conflict { lock_id, holders: 1, limit: 1, .. } if lock_id == "Y"),
        "{a:?}"
    );
    let a = acquire(c, &s, &r, &random_hex(16), &[y.clone(), x.clone()], none).await;
    assert!(
        matches!(&a, Acquired::Conflict { lock_id, .. } if lock_id == "Y"),
        "{a:?}"
    );
    assert!(
        !exists(c, &k.lock("X")).await,
        "X taken although Y was full"
    );
    assert!(!exists(c, &k.lockinfo("X")).await);
    assert_eq!(zscore(c, &k.locks(), "X").await, None);
    assert_eq!(hgetall(c, &s.inflight()).await["state"], "reserved");

    // With requeue, only the full lock records the blocked queue.
    let (.., a) = try_job(
        c,
        "j2",
        "q2",
        &payload("J", json!([2])),
        &[x.clone(), y.clone()],
        opts(10_000, 5000, true),
    )
    .await;
    assert!(matches!(a, Acquired::Conflict { requeued: true, .. }));
    assert_eq!(smembers(c, &k.blocked_lock("Y")).await, set_of(["q2"]));
    assert!(!exists(c, &k.blocked_lock("X")).await);
    assert!(!exists(c, &k.lock("X")).await);

    // Y freed: both are taken with one token.
    assert!(hy.finish(c).await);
    let t = random_hex(16);
    started(acquire(c, &s, &r, &t, &[x.clone(), y.clone()], none).await);
    assert!(zscore(c, &k.lock("X"), &t).await.is_some());
    assert!(zscore(c, &k.lock("Y"), &t).await.is_some());
    assert_eq!(
        serde_json::from_str::<Value>(&hgetall(c, &s.inflight()).await["locks"]).unwrap(),
        json!(["X", "Y"])
    );

    // X full (two holders), Z free: Z is not taken.
    let z = spec("Z", 1);
    let _x2 = hold(c, "hx", std::slice::from_ref(&x), 20_000).await;
    let (.., a) = try_job(
        c,
        "j3",
        "q3",
        &payload("J", json!([3])),
        &[z.clone(), x.clone()],
        none,
    )
    .await;
    assert!(
        matches!(&a, Acquired::Conflict { lock_id, holders: 2, limit: 2, .. } if lock_id == "X"),
        "{a:?}"
    );
    assert!(
        !exists(c, &k.lock("Z")).await,
        "Z taken although X was full"
    );
    assert_eq!(zscore(c, &k.locks(), "Z").await, None);
}

// locking-semantics.md L-5, L-7, A-13 step 5
#[tokio::test]
async fn release_is_by_token_and_releasing_a_non_member_changes_nothing() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 2);
    let ha = hold(c, "a", std::slice::from_ref(&l), 10_000).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let hb = hold(c, "b", std::slice::from_ref(&l), 10_000).await;
    let members = zrange_scores(c, &k.lock("L")).await;
    let info = hgetall(c, &k.lockinfo("L")).await;
    let exp = expire_at(c, &k.lock("L")).await;

    // A stranger's token (and a rid that is not the slot's): nothing changes.
    let stranger = Slot::new("x:1:0", "testhost:77:x");
    let bogus = Res {
        queue: "x".into(),
        payload: vec![],
        rid: "ffffffffffffffff".into(),
    };
    assert!(
        !finish(
            c,
            &stranger,
            &bogus,
            &random_hex(16),
            std::slice::from_ref(&l),
            Finish::Success
        )
        .await
    );
    assert_eq!(zrange_scores(c, &k.lock("L")).await, members);
    assert_eq!(hgetall(c, &k.lockinfo("L")).await, info);
    assert_near(expire_at(c, &k.lock("L")).await, exp, 3, "lock expiry");
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(ha.deadline));
    assert!(lrange(c, &k.queue("x")).await.is_empty());
    assert_eq!(get(c, &k.stat_processed()).await, None);

    assert!(ha.finish(c).await);
    assert_eq!(
        zrange_scores(c, &k.lock("L")).await,
        vec![(hb.token.clone(), hb.deadline)]
    );
    assert_eq!(
        hgetall(c, &k.lockinfo("L"))
            .await
            .keys()
            .cloned()
            .collect::<Vec<_>>(),
        vec![hb.token.clone()]
    );
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(hb.deadline));

    // A's second (stale) FINISH, sent again as after a lost reply, finds nothing and changes
    // nothing.
    assert!(!finish_resent(c, &ha.slot, &ha.res, &ha.token, &ha.locks, Finish::Success).await);
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("1"));
    assert_eq!(zcard(c, &k.lock("L")).await, 1);

    assert!(hb.finish(c).await);
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!exists(c, &k.lockinfo("L")).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, None);
}

// locking-semantics.md L-6, A-10
#[tokio::test]
async fn lock_keys_expire_one_second_after_the_latest_deadline() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 2);
    let ha = hold(c, "a", std::slice::from_ref(&l), 2000).await;
    let check = |d: u64| d as i64 + 1000;
    assert_near(
        expire_at(c, &k.lock("L")).await,
        check(ha.deadline),
        3,
        "lock after A",
    );
    assert_near(
        expire_at(c, &k.lockinfo("L")).await,
        check(ha.deadline),
        3,
        "lockinfo after A",
    );

    tokio::time::sleep(Duration::from_millis(300)).await;
    let hb = hold(c, "b", std::slice::from_ref(&l), 2000).await;
    assert!(hb.deadline > ha.deadline);
    assert_near(
        expire_at(c, &k.lock("L")).await,
        check(hb.deadline),
        3,
        "lock after B",
    );
    assert_near(
        expire_at(c, &k.lockinfo("L")).await,
        check(hb.deadline),
        3,
        "lockinfo after B",
    );

    let (da2, lost) = store::extend(
        c,
        &k,
        &ha.token,
        std::slice::from_ref(&l),
        Duration::from_millis(3000),
    )
    .await
    .unwrap();
    assert_eq!(lost, vec![false]);
    assert!(da2 > hb.deadline);
    assert_near(
        expire_at(c, &k.lock("L")).await,
        check(da2),
        3,
        "lock after extend",
    );
    assert_near(
        expire_at(c, &k.lockinfo("L")).await,
        check(da2),
        3,
        "lockinfo after extend",
    );

    // Releasing the latest holder brings the expiry back to the remaining one's deadline.
    assert!(ha.finish(c).await);
    assert_near(
        expire_at(c, &k.lock("L")).await,
        check(hb.deadline),
        3,
        "lock after release",
    );
    assert_near(
        expire_at(c, &k.lockinfo("L")).await,
        check(hb.deadline),
        3,
        "lockinfo after release",
    );
}

// locking-semantics.md L-7, A-10
#[tokio::test]
async fn the_locks_index_holds_the_earliest_deadline_and_forgets_empty_locks() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 2);
    let ha = hold(c, "a", std::slice::from_ref(&l), 3000).await;
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(ha.deadline));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let hb = hold(c, "b", std::slice::from_ref(&l), 1000).await;
    assert!(hb.deadline < ha.deadline);
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(hb.deadline));

    let (db2, lost) = store::extend(
        c,
        &k,
        &hb.token,
        std::slice::from_ref(&l),
        Duration::from_millis(4000),
    )
    .await
    .unwrap();
    assert_eq!(lost, vec![false]);
    assert!(db2 > ha.deadline);
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(ha.deadline));

    assert!(ha.finish(c).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, Some(db2));
    assert!(hb.finish(c).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, None);
    assert!(!exists(c, &k.locks()).await);
}

// locking-semantics.md L-8, A-10, NEVER-1
#[tokio::test]
async fn extend_moves_a_live_lease_but_never_revives_an_expired_or_released_one() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 2);
    let ls = std::slice::from_ref(&l);
    let ha = hold(c, "a", ls, 1000).await;

    let before = server_ms(c).await;
    let (d1, lost) = store::extend(c, &k, &ha.token, ls, Duration::from_millis(1000))
        .await
        .unwrap();
    assert_eq!(lost, vec![false]);
    assert!(d1 >= before + 1000);
    assert_eq!(zscore(c, &k.lock("L"), &ha.token).await, Some(d1));
    let info: Value = serde_json::from_str(&hgetall(c, &k.lockinfo("L")).await[&ha.token]).unwrap();
    assert_eq!(info["extended_at"].as_u64(), Some(d1 - 1000));
    assert_eq!(info["acquired_at"].as_u64(), Some(ha.deadline - 1000));

    // Lapsed: reported lost, not re-added although the lock has room.
    sleep_past_server_ms(c, d1).await;
    let (_, lost) = store::extend(c, &k, &ha.token, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![true]);
    assert_eq!(zcard(c, &k.lock("L")).await, 0);
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!exists(c, &k.lockinfo("L")).await);
    assert_eq!(zscore(c, &k.locks(), "L").await, None);

    // Released: the same.
    let hb = hold(c, "b", ls, 5000).await;
    assert!(hb.finish(c).await);
    let (_, lost) = store::extend(c, &k, &hb.token, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![true]);
    assert_eq!(zcard(c, &k.lock("L")).await, 0);

    // With another live holder present, the lapsed token is still not re-added.
    let hc = hold(c, "c", ls, 5000).await;
    let (_, lost) = store::extend(c, &k, &ha.token, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![true]);
    assert_eq!(
        zrange_scores(c, &k.lock("L")).await,
        vec![(hc.token.clone(), hc.deadline)]
    );
}

// locking-semantics.md L-9, S-2, A-10
#[tokio::test]
async fn the_deadline_returned_is_redis_server_time_plus_the_ttl() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    // A lock of limit 2: its holder's deadline is a ZSET score stamped with the server's clock
    // (a limit-1 lock's lease is its key's PX, L-1a, checked below by PTTL).
    let l = spec("L", 2);
    push(c, "q", &payload("J", json!([1]))).await;
    let slot = Slot::new("p:1:0", "testhost:1:q");
    let res = reserve_job(c, &slot, &["q"]).await;
    let token = random_hex(16);
    let before = server_ms(c).await;
    let deadline = started(
        acquire(
            c,
            &slot,
            &res,
            &token,
            std::slice::from_ref(&l),
            opts(1500, 1000, false),
        )
        .await,
    );
    let after = server_ms(c).await;
    assert!(
        (before + 1500..=after + 1500).contains(&deadline),
        "deadline {deadline} is not server time in [{before}, {after}] + 1500"
    );
    assert_eq!(zscore(c, &k.lock("L"), &token).await, Some(deadline));

    let before = server_ms(c).await;
    let (d2, lost) = store::extend(
        c,
        &k,
        &token,
        std::slice::from_ref(&l),
        Duration::from_millis(2500),
    )
    .await
    .unwrap();
    let after = server_ms(c).await;
    assert_eq!(lost, vec![false]);
    assert!(
        (before + 2500..=after + 2500).contains(&d2),
        "extend deadline {d2}"
    );
    assert_eq!(zscore(c, &k.lock("L"), &token).await, Some(d2));
}

// ---------------------------------------------------------------------------------------------
// NEVER-1: more holders than the limit
// ---------------------------------------------------------------------------------------------

/// 20 tasks, each on its own connection and slot, loop RESERVE → ACQUIRE (new token each
/// try) → hold briefly → FINISH(requeue) on one lock id; two of them abandon a short lease
/// (as a crashed holder would) so that expiry purges run under contention too. A sampler
/// counts live members; every start is checked against an in-process "running" counter.
async fn hammer(limit: u32) {
    const TASKS: usize = 20;
    // At least RUN, and on past it (up to MAX_RUN) until the run has exercised enough: a
    // loaded machine gives the tasks fewer turns per second.
    const RUN: Duration = Duration::from_millis(2500);
    const MAX_RUN: Duration = Duration::from_secs(15);
    let server = RedisServer::start();
    let k = keys();
    let lock_id = format!("hot:{limit}");
    let running = Arc::new(AtomicI64::new(0));
    let max_running = Arc::new(AtomicI64::new(0));
    let starts = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let abandons = Arc::new(AtomicU64::new(0));
    let violations = Arc::new(Mutex::new(Vec::<String>::new()));
    let started = Instant::now();
    let stopped = Arc::new(AtomicBool::new(false));

    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let mut c = server.conn().await;
        let stopped = stopped.clone();
        let (running, max_running, starts, conflicts, abandons, violations) = (
            running.clone(),
            max_running.clone(),
            starts.clone(),
            conflicts.clone(),
            abandons.clone(),
            violations.clone(),
        );
        let lock = spec(&lock_id, limit);
        tasks.push(tokio::spawn(async move {
            let c = &mut c;
            let queue = format!("q{i}");
            let mut generation = 0;
            let mut slot = Slot::new(
                format!("hammer:{i}:{generation}"),
                format!("testhost:{i}:{queue}"),
            );
            push(c, &queue, &payload("Hot", json!([i]))).await;
            'work: while !stopped.load(Ordering::SeqCst) {
                let res = reserve_job(c, &slot, &[&queue]).await;
                let abandon = rand::rng().random_bool(0.03)
                    && abandons
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                            (n < 2).then_some(n + 1)
                        })
                        .is_ok();
                let ttl = if abandon { 1000 } else { 10_000 };
                let token = loop {
                    let token = random_hex(16);
                    match acquire(
                        c,
                        &slot,
                        &res,
                        &token,
                        std::slice::from_ref(&lock),
                        opts(ttl, 1000, false),
                    )
                    .await
                    {
                        Acquired::Started { .. } => break token,
                        Acquired::Conflict {
                            holders, limit: l, ..
                        } => {
                            conflicts.fetch_add(1, Ordering::Relaxed);
                            if holders < l {
                                violations.lock().unwrap().push(format!(
                                    "conflict reported with {holders} holders below limit {l}"
                                ));
                            }
                            if stopped.load(Ordering::SeqCst) {
                                if abandon {
                                    abandons.fetch_sub(1, Ordering::SeqCst);
                                }
                                store::return_to_queue(c, &slot.r(), &res.rid, &queue)
                                    .await
                                    .unwrap();
                                break 'work;
                            }
                            let pause = rand::rng().random_range(1..4);
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                        }
                        other @ (Acquired::Missing | Acquired::Dead | Acquired::Cancelled) => {
                            violations
                                .lock()
                                .unwrap()
                                .push(format!("task {i}: {other:?}"));
                            break 'work;
                        }
                    }
                };
                starts.fetch_add(1, Ordering::Relaxed);
                if abandon {
                    // Crash: the lease stays until it lapses; a new slot gets a new job.
                    generation += 1;
                    slot = Slot::new(
                        format!("hammer:{i}:{generation}"),
                        format!("testhost:{i}:{queue}"),
                    );
                    push(c, &queue, &payload("Hot", json!([i, generation]))).await;
                    continue;
                }
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                max_running.fetch_max(now, Ordering::SeqCst);
                if now > i64::from(limit) {
                    violations
                        .lock()
                        .unwrap()
                        .push(format!("{now} jobs running under limit {limit}"));
                }
                let hold_for = rand::rng().random_range(0..4);
                tokio::time::sleep(Duration::from_millis(hold_for)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                if !finish(
                    c,
                    &slot,
                    &res,
                    &token,
                    std::slice::from_ref(&lock),
                    Finish::Requeue,
                )
                .await
                {
                    violations
                        .lock()
                        .unwrap()
                        .push(format!("task {i}: FINISH found no reservation"));
                }
            }
        }));
    }

    let mut sc = server.conn().await;
    let key = k.lock(&lock_id);
    let mut samples = 0u64;
    let mut max_live = 0u64;
    loop {
        let elapsed = started.elapsed();
        let exercised = samples > 50
            && starts.load(Ordering::Relaxed) >= 50
            && conflicts.load(Ordering::Relaxed) > 0
            && max_running.load(Ordering::SeqCst) == i64::from(limit);
        if elapsed >= MAX_RUN || (elapsed >= RUN && exercised) {
            stopped.store(true, Ordering::SeqCst);
            break;
        }
        let live = live_holders(&mut sc, &key).await;
        let card = zcard(&mut sc, &key).await;
        max_live = max_live.max(live);
        if live > u64::from(limit) {
            violations.lock().unwrap().push(format!(
                "sampled {live} live holders (ZCARD {card}) under limit {limit}"
            ));
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("a hammer task hung")
            .expect("a hammer task panicked");
    }
    let v = violations.lock().unwrap().clone();
    assert!(v.is_empty(), "NEVER-1 violated: {v:?}");
    let starts = starts.load(Ordering::Relaxed);
    let conflicts = conflicts.load(Ordering::Relaxed);
    assert!(
        starts >= 50,
        "only {starts} starts: the test exercised too little"
    );
    assert!(conflicts > 0, "no conflicts: the test exercised nothing");
    assert_eq!(
        max_running.load(Ordering::SeqCst),
        i64::from(limit),
        "the limit was never reached ({starts} starts, {conflicts} conflicts)"
    );
    assert!(
        samples > 50 && max_live >= 1,
        "sampler saw nothing ({samples} samples)"
    );
    assert!(live_holders(&mut sc, &key).await <= u64::from(limit));
}

// locking-semantics.md NEVER-1, L-1, L-2, A-6 step 2
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_acquirers_never_exceed_a_limit_of_one() {
    hammer(1).await;
}

// locking-semantics.md NEVER-1, L-1, L-2, A-6 step 2
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_acquirers_never_exceed_a_limit_of_three() {
    hammer(3).await;
}

// ---------------------------------------------------------------------------------------------
// NEVER-2 / NEVER-3: recovery of dead processes
// ---------------------------------------------------------------------------------------------

// locking-semantics.md R-4, R-8, NEVER-2: a slot that unregisters while it still holds a
// reservation (its worker could neither finish nor return it) leaves that reservation to the
// janitor: the process stays listed, its lease ends with its last registered slot, and the
// next pass puts the job back. Before, the slot and the process were dropped and the payload
// stayed in the inflight record for good.
#[tokio::test]
async fn a_reservation_left_behind_at_unregister_is_recovered_by_the_janitor() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("");
    let process = "testhost:4243:0a1b2c3d";
    let (w1, w2) = ("testhost:4243+1:q", "testhost:4243+2:q");
    register(c, process, 1, w1, Duration::from_secs(60)).await;
    register(c, process, 2, w2, Duration::from_secs(60)).await;
    let job = payload("J", json!([1]));
    push(c, "q", &job).await;
    let s1 = Slot::new(format!("{process}:1"), w1);
    reserve_job(c, &s1, &["q"]).await;
    registry::unregister(c, &reg_of(&k, process, 1, w1))
        .await
        .unwrap();
    assert_unregistered(c, w1).await;
    // Slot 2 is still registered: the lease stays and nothing is recovered yet.
    assert!(exists(c, &k.alive(process)).await);
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert!(report.recovered.is_empty(), "{report:?}");
    assert!(exists(c, &s1.inflight()).await);

    registry::unregister(c, &reg_of(&k, process, 2, w2))
        .await
        .unwrap();
    assert_unregistered(c, w2).await;
    assert!(
        !exists(c, &k.alive(process)).await,
        "the lease ends with the last registered slot"
    );
    assert!(smembers(c, &k.processes()).await.contains(process));
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert_eq!(
        report.recovered,
        vec![(format!("{process}:1"), "recovered_reserved".to_string())]
    );
    assert_eq!(lrange(c, &k.queue("q")).await, vec![job]);
    assert!(!exists(c, &s1.inflight()).await);
    assert!(!smembers(c, &k.processes()).await.contains(process));
    assert!(!exists(c, &k.slots(process)).await);

    // Without a reservation left, unregistering the last slot removes everything at once.
    let other = "testhost:4244:0a1b2c3d";
    register(c, other, 0, "testhost:4244:q", Duration::from_secs(60)).await;
    registry::unregister(c, &reg_of(&k, other, 0, "testhost:4244:q"))
        .await
        .unwrap();
    assert!(!exists(c, &k.alive(other)).await);
    assert!(!exists(c, &k.slots(other)).await);
    assert!(!smembers(c, &k.processes()).await.contains(other));
}

fn reg_of<'a>(k: &'a Keys, process: &'a str, slot: u32, worker_id: &'a str) -> Registration<'a> {
    Registration {
        keys: k,
        worker_id,
        process_id: process,
        slot,
    }
}

// locking-semantics.md R-3 step 4, R-4 (reserved), NEVER-2, R-1
#[tokio::test]
async fn the_janitor_returns_a_dead_process_reserved_job_to_the_head_of_its_queue() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("");
    let process = "testhost:4242:0a1b2c3d";
    let worker = "testhost:4242:q";
    register(c, process, 0, worker, Duration::from_millis(1000)).await;
    let j1: &[u8] = b"{\"class\":\"J\", \"args\":[1],\"id\":\"x\"}";
    let j2 = payload("J", json!([2]));
    push(c, "q", j1).await;
    push(c, "q", &j2).await;
    let slot = Slot::new(format!("{process}:0"), worker);
    let res = reserve_job(c, &slot, &["q"]).await;
    assert_eq!(res.payload, j1);

    // Alive: nothing is recovered.
    assert!(
        exists(c, &k.alive(process)).await,
        "test too slow: lease already gone"
    );
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert!(report.ran);
    assert!(report.recovered.is_empty(), "{report:?}");
    assert!(exists(c, &slot.inflight()).await);

    wait_dead(c, process).await;
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert_eq!(
        report.recovered,
        vec![(format!("{process}:0"), "recovered_reserved".to_string())]
    );
    assert_eq!(
        lrange(c, &k.queue("q")).await,
        vec![j1.to_vec(), j2.clone()]
    );
    assert!(!exists(c, &slot.inflight()).await);
    assert_unregistered(c, worker).await;
    assert!(!smembers(c, &k.processes()).await.contains(process));
    assert!(!exists(c, &k.slots(process)).await);
    assert!(lrange(c, &k.failed()).await.is_empty());

    // A second pass finds nothing to do.
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert!(report.recovered.is_empty(), "{report:?}");
    assert_eq!(lrange(c, &k.queue("q")).await, vec![j1.to_vec(), j2]);
    // The reservation is gone for its old owner too.
    assert_eq!(
        acquire(
            c,
            &slot,
            &res,
            &random_hex(16),
            &[spec("L", 1)],
            opts(5000, 1000, true)
        )
        .await,
        Acquired::Missing
    );
}

// locking-semantics.md R-4, NEVER-2, E-1: a payload that is not UTF-8 in a dead process's slot
// is recovered byte for byte, and does not stop the recovery of the other dead processes
// (before, reading its record as text failed the pass at that process, pass after pass).
#[tokio::test]
async fn a_payload_that_is_not_utf8_does_not_stop_the_janitor_recovering_every_dead_process() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("");
    let bad: &[u8] = b"{\"class\":\"J\",\"args\":[\"\xff\"]}";
    let mut expected = vec![bad.to_vec()];
    let mut slots = Vec::new();
    for i in 0..4u32 {
        let process = format!("testhost:{}:0000000{i}", 5000 + i);
        let worker = format!("testhost:{}:q", 5000 + i);
        register(c, &process, 0, &worker, Duration::from_millis(300)).await;
        let body = if i == 0 {
            bad.to_vec()
        } else {
            let p = payload("J", json!([i]));
            expected.push(p.clone());
            p
        };
        push(c, "q", &body).await;
        let slot = Slot::new(format!("{process}:0"), &worker);
        let res = reserve_job(c, &slot, &["q"]).await;
        assert_eq!(res.payload, body);
        slots.push((process, slot));
    }
    for (process, _) in &slots {
        wait_dead(c, process).await;
    }
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert_eq!(report.recovered.len(), 4, "{report:?}");
    let mut back = lrange(c, &k.queue("q")).await;
    back.sort();
    expected.sort();
    assert_eq!(back, expected, "every reservation is back, byte for byte");
    for (process, slot) in &slots {
        assert!(!exists(c, &slot.inflight()).await);
        assert!(!smembers(c, &k.processes()).await.contains(process));
    }
}

// locking-semantics.md R-4 (running, fail), L-5, A-14, NEVER-2, NEVER-3, R-6, A-13 step 5
#[tokio::test]
async fn the_janitor_fails_a_dead_process_running_job_as_dirty_exit_and_frees_its_lock_at_once() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("on_worker_death = \"fail\"");
    let process = "testhost:4343:deadbeef";
    let worker = "testhost:4343:q";
    register(c, process, 0, worker, Duration::from_millis(300)).await;
    let j = payload("Billing::Sync", json!([42]));
    push(c, "q", &j).await;
    let slot = Slot::new(format!("{process}:0"), worker);
    let res = reserve_job(c, &slot, &["q"]).await;
    let l = spec("acct:42", 1);
    let token = random_hex(16);
    started(
        acquire(
            c,
            &slot,
            &res,
            &token,
            std::slice::from_ref(&l),
            opts(30_000, 10_000, true),
        )
        .await,
    );
    assert!(exists(c, &k.worker(worker)).await);
    // A job of q2 blocked by the dead holder's lock.
    let (.., a) = try_job(
        c,
        "w2",
        "q2",
        &payload("Billing::Sync", json!([42, 2])),
        std::slice::from_ref(&l),
        opts(30_000, 10_000, true),
    )
    .await;
    assert!(matches!(a, Acquired::Conflict { requeued: true, .. }));

    wait_dead(c, process).await;
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
    assert_eq!(
        report.recovered,
        vec![(format!("{process}:0"), "recovered_running".to_string())]
    );
    let failed: Vec<String> = rcmd!(c, "LRANGE", k.failed(), 0, -1);
    assert_eq!(failed.len(), 1, "{failed:?}");
    let rec: Value = serde_json::from_str(&failed[0]).unwrap();
    assert_eq!(rec["exception"], "Resque::DirtyExit");
    assert_eq!(rec["payload"], serde_json::from_slice::<Value>(&j).unwrap());
    assert_eq!(rec["queue"], "q");
    assert_eq!(rec["worker"], worker);
    assert!(
        lrange(c, &k.queue("q")).await.is_empty(),
        "payload also requeued"
    );
    assert!(!exists(c, &slot.inflight()).await);
    assert_unregistered(c, worker).await;
    assert!(!smembers(c, &k.processes()).await.contains(process));

    // Locks released at once (30 s lease), with the A-14 reset of the blocked queue.
    assert!(!exists(c, &k.lock("acct:42")).await);
    assert!(!exists(c, &k.lockinfo("acct:42")).await);
    assert_eq!(zscore(c, &k.locks(), "acct:42").await, None);
    assert!(!exists(c, &k.counter("q2")).await);
    let s3 = Slot::new("live:1:0", "testhost:99:q2");
    let r3 = reserve_job(c, &s3, &["q2"]).await;
    let t3 = random_hex(16);
    let d3 = started(
        acquire(
            c,
            &s3,
            &r3,
            &t3,
            std::slice::from_ref(&l),
            opts(30_000, 10_000, true),
        )
        .await,
    );

    // The dead process's FINISH after recovery: "missing", nothing pushed, new holder intact.
    let dirty = JobFailure::new("RuntimeError", "late").record(
        &String::from_utf8_lossy(&j),
        worker,
        "q",
        SystemTime::now(),
    );
    assert!(
        !finish(
            c,
            &slot,
            &res,
            &token,
            std::slice::from_ref(&l),
            Finish::Failure(dirty)
        )
        .await
    );
    let failed: Vec<String> = rcmd!(c, "LRANGE", k.failed(), 0, -1);
    assert_eq!(failed.len(), 1);
    assert!(lrange(c, &k.queue("q")).await.is_empty());
    assert_eq!(get(c, &k.stat_processed()).await, None);
    assert_eq!(get(c, &k.stat_failed()).await, None);
    assert_holders(c, &k.lock("acct:42"), &[(t3, d3)], "the new holder").await;
}

// locking-semantics.md R-4 (running, requeue), max_recoveries, NEVER-2, NEVER-3, A-13 step 5
#[tokio::test]
async fn the_janitor_requeues_a_dead_process_running_job_to_the_tail_until_max_recoveries() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("on_worker_death = \"requeue\"\nmax_recoveries = 2");
    let j = payload("Crashy", json!(["same"]));
    let l = spec("crashy", 1);
    push(c, "q", &j).await;
    for cycle in 1..=3 {
        let process = format!("testhost:50{cycle}:cafe000{cycle}");
        let worker = format!("testhost:50{cycle}:q");
        register(c, &process, 0, &worker, Duration::from_millis(200)).await;
        let slot = Slot::new(format!("{process}:0"), worker.as_str());
        let res = reserve_job(c, &slot, &["q"]).await;
        assert_eq!(res.payload, j, "cycle {cycle}");
        let token = random_hex(16);
        started(
            acquire(
                c,
                &slot,
                &res,
                &token,
                std::slice::from_ref(&l),
                opts(30_000, 1000, true),
            )
            .await,
        );
        let filler = payload("Filler", json!([cycle]));
        push(c, "q", &filler).await;

        wait_dead(c, &process).await;
        let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await.unwrap();
        let expected = if cycle <= 2 {
            "requeued_running"
        } else {
            "recovered_running"
        };
        assert_eq!(
            report.recovered,
            vec![(format!("{process}:0"), expected.to_string())],
            "cycle {cycle}"
        );
        assert!(
            !exists(c, &k.lock("crashy")).await,
            "cycle {cycle}: lock not released"
        );
        assert_unregistered(c, &worker).await;
        let failed = lrange(c, &k.failed()).await;
        if cycle <= 2 {
            assert_eq!(
                lrange(c, &k.queue("q")).await,
                vec![filler, j.clone()],
                "cycle {cycle}: not at the tail"
            );
            assert!(failed.is_empty());
            // The dead owner's late FINISH(requeue) pushes no second copy.
            assert!(
                !finish(
                    c,
                    &slot,
                    &res,
                    &token,
                    std::slice::from_ref(&l),
                    Finish::Requeue
                )
                .await
            );
            assert_eq!(
                lrange(c, &k.queue("q"))
                    .await
                    .iter()
                    .filter(|p| **p == j)
                    .count(),
                1
            );
            let _: Option<Vec<u8>> = rcmd!(c, "LPOP", k.queue("q")); // the filler
        } else {
            assert_eq!(lrange(c, &k.queue("q")).await, vec![filler]);
            assert_eq!(failed.len(), 1);
            let rec: Value = serde_json::from_slice(&failed[0]).unwrap();
            assert_eq!(rec["exception"], "Resque::DirtyExit");
            assert_eq!(rec["payload"], serde_json::from_slice::<Value>(&j).unwrap());
        }
    }
    let n: Option<String> = rcmd!(c, "HGET", k.recoveries(), sha256_hex(&j));
    assert_eq!(n.as_deref(), Some("3"));
    let ttl: i64 = rcmd!(c, "PTTL", k.recoveries());
    assert!(ttl > 0, "recoveries without expiry");
}

/// Runs the recover script the way the janitor does, with an rid read earlier.
#[allow(clippy::too_many_arguments)]
async fn replay_recover(
    conn: &mut Conn,
    process: &str,
    slot: &str,
    worker_id: &str,
    rid: &str,
    queue: &str,
    locks: &[String],
) -> String {
    let k = keys();
    let slot_key = format!("{process}:{slot}");
    let failure = JobFailure::new("Resque::DirtyExit", "replayed")
        .dirty()
        .record("{}", worker_id, queue, SystemTime::now());
    let mut inv = scripts().recover.prepare_invoke();
    inv.key(k.inflight(&slot_key))
        .key(k.alive(process))
        .key(k.queue(queue))
        .key(k.queues())
        .key(k.failed())
        .key(k.recoveries())
        .key(k.slots(process))
        .key(k.processes())
        .key(k.workers())
        .key(k.worker(worker_id))
        .key(k.worker_started(worker_id))
        .key(k.heartbeat())
        .key(k.stat_processed_by(worker_id))
        .key(k.stat_failed_by(worker_id))
        .key(k.locks());
    for id in locks {
        inv.key(k.lock(id))
            .key(k.lockinfo(id))
            .key(k.blocked_lock(id));
    }
    inv.arg(rid)
        .arg("fail")
        .arg(failure)
        .arg(3)
        .arg(worker_id)
        .arg(slot)
        .arg(process)
        .arg(k.counter_prefix());
    for id in locks {
        inv.arg(id);
    }
    inv.invoke_async(conn).await.expect("recover script")
}

// locking-semantics.md R-5, NEVER-3, NEVER-2, R-4
#[tokio::test]
async fn two_janitors_recovering_the_same_dead_process_never_push_a_payload_twice() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let cfg = janitor_config("");
    let process = "testhost:6060:f00dface";
    let (w0, w1) = ("testhost:6060:q#0", "testhost:6060:q#1");
    register(c, process, 0, w0, Duration::from_millis(300)).await;
    register(c, process, 1, w1, Duration::from_millis(300)).await;
    let jr = payload("Reserved", json!([1]));
    let jx = payload("Running", json!([2]));
    push(c, "q", &jr).await;
    push(c, "q", &jx).await;
    let s0 = Slot::new(format!("{process}:0"), w0);
    let s1 = Slot::new(format!("{process}:1"), w1);
    let r0 = reserve_job(c, &s0, &["q"]).await;
    let r1 = reserve_job(c, &s1, &["q"]).await;
    assert_eq!(
        (r0.payload.clone(), r1.payload.clone()),
        (jr.clone(), jx.clone())
    );
    let l = spec("L", 1);
    let t1 = random_hex(16);
    started(
        acquire(
            c,
            &s1,
            &r1,
            &t1,
            std::slice::from_ref(&l),
            opts(30_000, 1000, true),
        )
        .await,
    );

    wait_dead(c, process).await;
    let mut c1 = server.conn().await;
    let mut c2 = server.conn().await;
    let (a, b) = tokio::join!(
        janitor_pass(&mut c1, &k, &cfg, "janitor-token-one"),
        janitor_pass(&mut c2, &k, &cfg, "janitor-token-two"),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let third = janitor_pass(c, &k, &cfg, "janitor-token-three")
        .await
        .unwrap();
    let mut results: Vec<(String, String)> = a
        .recovered
        .iter()
        .chain(&b.recovered)
        .chain(&third.recovered)
        .cloned()
        .collect();
    results.sort();
    assert_eq!(
        results,
        vec![
            (format!("{process}:0"), "recovered_reserved".to_string()),
            (format!("{process}:1"), "recovered_running".to_string()),
        ]
    );

    // A janitor that read the records before the others recovered them acts on nothing.
    assert_eq!(
        replay_recover(c, process, "0", w0, &r0.rid, "q", &[]).await,
        "changed"
    );
    assert_eq!(
        replay_recover(c, process, "1", w1, &r1.rid, "q", &["L".to_string()]).await,
        "changed"
    );

    let queue = lrange(c, &k.queue("q")).await;
    assert_eq!(
        queue,
        vec![jr.clone()],
        "reserved payload copies in the queue"
    );
    let failed = lrange(c, &k.failed()).await;
    assert_eq!(failed.len(), 1, "failure records: {failed:?}");
    let rec: Value = serde_json::from_slice(&failed[0]).unwrap();
    assert_eq!(
        rec["payload"],
        serde_json::from_slice::<Value>(&jx).unwrap()
    );
    assert!(!exists(c, &k.lock("L")).await);
    assert!(!smembers(c, &k.processes()).await.contains(process));
    assert!(!exists(c, &k.slots(process)).await);
    // And the dead slots' own late FINISHes push nothing either.
    assert!(!finish(c, &s0, &r0, "", &[], Finish::Requeue).await);
    assert!(!finish(c, &s1, &r1, &t1, std::slice::from_ref(&l), Finish::Requeue).await);
    assert_eq!(lrange(c, &k.queue("q")).await, vec![jr]);
    assert_eq!(lrange(c, &k.failed()).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// NEVER-4 / NEVER-5
// ---------------------------------------------------------------------------------------------

// locking-semantics.md NEVER-4, L-1a
#[tokio::test]
async fn an_abandoned_lease_is_acquirable_by_another_token_once_its_ttl_passed_without_a_janitor() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 1);
    let ha = hold(c, "a", std::slice::from_ref(&l), 1000).await; // never finished, never extended
                                                                 // A's lease ends when its key's PX does, on the server's clock (L-1a).
    let a_ends = expire_at(c, &k.lock("L")).await as u64;
    assert_lease_near(a_ends, ha.deadline, "A's lease");
    push(c, "qb", &payload("J", json!(["b"]))).await;
    let sb = Slot::new("b:1:0", "testhost:2:qb");
    let rb = reserve_job(c, &sb, &["qb"]).await;
    let o = opts(5000, 1000, false);
    let deadline = Instant::now() + Duration::from_millis(2500);
    let (tb, sent, b_deadline) = loop {
        let t = random_hex(16);
        let sent = server_ms(c).await;
        match acquire(c, &sb, &rb, &t, std::slice::from_ref(&l), o).await {
            Acquired::Started { deadline_ms } => break (t, sent, deadline_ms),
            Acquired::Conflict { .. } => {
                assert!(
                    Instant::now() < deadline,
                    "lock still held long after its TTL"
                );
                assert!(
                    sent <= a_ends + 5,
                    "conflict at server time {sent}, after A's deadline {a_ends}"
                );
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            other => panic!("expected the lock or a conflict, got {other:?}"),
        }
    };
    // When B's lease began on the server: its key's expiry less the TTL.
    let b_ends = expire_at(c, &k.lock("L")).await as u64;
    assert_lease_near(b_ends, b_deadline, "B's lease");
    let acquired_at = b_ends - 5000;
    assert!(
        acquired_at + 1 >= a_ends,
        "B got in at {acquired_at}, before A's deadline {a_ends}"
    );
    assert!(sent <= a_ends + 1000, "B waited past TTL + 1 s");
    assert_eq!(zrange_scores(c, &k.lock("L")).await.len(), 1);
    assert!(zscore(c, &k.lock("L"), &tb).await.is_some());
    assert!(zscore(c, &k.lock("L"), &ha.token).await.is_none());
    // The holder's info (the key's value) is B's.
    let holders = store::holders(c, &k, "L").await.unwrap();
    assert_eq!(holders.len(), 1);
    let info = holders[0].info.clone().expect("holder info");
    assert_eq!(info["token"], tb.as_str());
    assert_eq!(info["resque_worker"], sb.worker_id.as_str());
}

// locking-semantics.md NEVER-4, L-1a, A-15, K-1
#[tokio::test]
async fn an_abandoned_lock_and_its_counters_are_physically_gone_a_second_after_the_deadline() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 1);
    let ha = hold(c, "a", std::slice::from_ref(&l), 1000).await; // abandoned: no janitor, no finish
    let (.., a) = try_job(
        c,
        "b",
        "qb",
        &payload("J", json!(["b"])),
        std::slice::from_ref(&l),
        opts(5000, 1000, true),
    )
    .await;
    assert!(matches!(a, Acquired::Conflict { requeued: true, .. }));
    // A limit-1 lock is one key that ends with its lease (L-1a): no lockinfo, no index entry.
    let at = expire_at(c, &k.lock("L")).await;
    assert!(at > 0, "lock:L expires at {at}");
    assert_lease_near(at as u64, ha.deadline, "lock:L's expiry");
    assert!(!exists(c, &k.lockinfo("L")).await);
    assert!(!exists(c, &k.locks()).await);
    for key in [k.counter("qb"), k.blocked_lock("L")] {
        let ttl: i64 = rcmd!(c, "PTTL", &key);
        assert!(ttl > 0 && ttl <= 1000, "{key}: PTTL {ttl}");
    }
    audit_locket_keys(c, "after the abandoned acquire").await;

    // INFO keyspace counts keys with an expiry that are still in memory (expired or not).
    let now = server_ms(c).await;
    let limit = Duration::from_millis((ha.deadline + 1000 + 800).saturating_sub(now));
    let probe = c.clone();
    wait_until_async(limit, "no volatile key left in memory", move || {
        let mut c = probe.clone();
        async move {
            let info: String = rcmd!(&mut c, "INFO", "keyspace");
            let expires = info
                .lines()
                .find_map(|l| l.strip_prefix("db0:"))
                .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix("expires=")))
                .map(|v| v.trim().parse::<u64>().unwrap())
                .unwrap_or(0);
            // The O-3 per-minute buckets live 8 h on purpose, and the test slots' process
            // leases (R-1) as long as their processes; nothing else may remain.
            let metrics: Vec<String> = rcmd!(&mut c, "KEYS", format!("{NS}:locket:metrics:*"));
            let leases: Vec<String> = rcmd!(&mut c, "KEYS", format!("{NS}:locket:alive:*"));
            expires == (metrics.len() + leases.len()) as u64
        }
    })
    .await;
    for key in [
        k.lock("L"),
        k.lockinfo("L"),
        k.counter("qb"),
        k.blocked_lock("L"),
    ] {
        assert!(!exists(c, &key).await, "{key} survived");
    }
    // What is left without an expiry is documented: the holder's inflight record (besides the
    // O-3 stats and the test slots' process leases); no purge has anything left to do.
    let no_stats = |left: BTreeSet<String>| -> BTreeSet<String> {
        left.into_iter()
            .filter(|n| {
                !n.starts_with("stat:") && !n.starts_with("metrics:") && !n.starts_with("alive:")
            })
            .collect()
    };
    let left = no_stats(audit_locket_keys(c, "after expiry").await);
    assert_eq!(left, set_of(["inflight:holder-a:0"]));
    assert_eq!(store::purge_expired(c, &k, 100).await.unwrap(), 0);
    assert_eq!(store::unblock_lapsed(c, &k, 10).await.unwrap(), 0);
    let left = no_stats(audit_locket_keys(c, "after the purges").await);
    assert_eq!(left, set_of(["inflight:holder-a:0"]));
}

// locking-semantics.md NEVER-5, L-1a, L-5, L-8, A-10
#[tokio::test]
async fn a_holder_whose_lease_lapsed_can_neither_extend_nor_release_the_new_holders_lease() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("L", 1);
    let ls = std::slice::from_ref(&l);
    let ha = hold(c, "a", ls, 1000).await;
    // A's lease lapses when its key's PX ends, on the server's clock (L-1a).
    let a_ends = expire_at(c, &k.lock("L")).await;
    assert_lease_near(a_ends as u64, ha.deadline, "A's lease");
    sleep_past_server_ms(c, a_ends as u64).await;
    let hb = hold(c, "b", ls, 5000).await;
    let members = vec![(hb.token.clone(), hb.deadline)];
    // B's lease: the key's value (its holder info) and PX (L-1a).
    let info = get(c, &k.lock("L")).await.expect("B's lock");
    let exp = expire_at(c, &k.lock("L")).await;
    assert_holders(c, &k.lock("L"), &members, "B holds L").await;

    let (_, lost) = store::extend(c, &k, &ha.token, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![true]);
    assert_holders(c, &k.lock("L"), &members, "after A's EXTEND").await;
    assert_eq!(get(c, &k.lock("L")).await.as_deref(), Some(info.as_str()));
    assert_near(expire_at(c, &k.lock("L")).await, exp, 3, "B's lock expiry");

    // A's FINISH (its own reservation still exists) releases only A's token: B is untouched.
    assert!(ha.finish(c).await);
    assert_holders(c, &k.lock("L"), &members, "after A's FINISH").await;
    assert_eq!(get(c, &k.lock("L")).await.as_deref(), Some(info.as_str()));
    assert_near(expire_at(c, &k.lock("L")).await, exp, 3, "B's lock expiry");
    let (_, lost) = store::extend(c, &k, &hb.token, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![false]);
}

// ---------------------------------------------------------------------------------------------
// NEVER-9 and key hygiene
// ---------------------------------------------------------------------------------------------

// locking-semantics.md NEVER-9, A-1, A-3, A-15, A-18
#[tokio::test]
async fn a_queue_whose_jobs_all_conflict_is_skipped_after_one_pass_and_retried_after_counter_ttl() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("shared", 1);
    let _h = hold(c, "h", std::slice::from_ref(&l), 30_000).await;
    let highs: Vec<Vec<u8>> = (1..=3).map(|i| payload("High", json!([i]))).collect();
    for p in &highs {
        push(c, "high", p).await;
    }
    for i in 1..=3 {
        push(c, "low", &payload("Low", json!([i]))).await;
    }
    let slot = Slot::new("p:1:0", "testhost:1:high,low");
    let o = opts(5000, 2000, true);
    let mut log = Vec::new();
    let mut first_conflict_at = None;
    let mut done = false;
    for _ in 0..20 {
        match reserve(c, &slot, &["high", "low"], false).await {
            Reserved::Job {
                queue,
                payload,
                rid,
                ..
            } => {
                let n = serde_json::from_slice::<Value>(&payload).unwrap()["args"][0].clone();
                let res = Res {
                    queue: queue.clone(),
                    payload,
                    rid,
                };
                if queue == "high" {
                    first_conflict_at.get_or_insert(server_ms(c).await);
                    let a =
                        acquire(c, &slot, &res, &random_hex(16), std::slice::from_ref(&l), o).await;
                    assert!(
                        matches!(a, Acquired::Conflict { requeued: true, .. }),
                        "{a:?}"
                    );
                    log.push(format!("high {n} conflict"));
                } else {
                    let locks = [spec(&format!("low:{n}"), 1)];
                    let t = random_hex(16);
                    started(acquire(c, &slot, &res, &t, &locks, o).await);
                    assert!(finish(c, &slot, &res, &t, &locks, Finish::Success).await);
                    log.push(format!("low {n} ran"));
                }
            }
            Reserved::Nothing { skipped, .. } => {
                assert_eq!(skipped, vec!["high".to_string()]);
                done = true;
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(done, "never ran out of work: {log:?}");
    assert_eq!(
        log,
        [
            "high 1 conflict",
            "high 2 conflict",
            "high 3 conflict",
            "low 1 ran",
            "low 2 ran",
            "low 3 ran"
        ]
    );
    assert_eq!(
        lrange(c, &k.queue("high")).await,
        highs,
        "order changed by requeues"
    );
    assert_eq!(get(c, &k.counter("high")).await.as_deref(), Some("3"));

    // After counter_ttl the skipped queue is tried again, from its head.
    let created = first_conflict_at.unwrap();
    let now = server_ms(c).await;
    wait_gone(
        c,
        k.counter("high"),
        Duration::from_millis((created + 2000 + 600).saturating_sub(now)),
        "the high counter to expire",
    )
    .await;
    let r = reserve_job(c, &slot, &["high", "low"]).await;
    assert_eq!((r.queue.as_str(), r.payload), ("high", highs[0].clone()));
}

// locking-semantics.md K-1, NEVER-4, A-14, A-8, L-5, L-7
#[tokio::test]
async fn a_full_reserve_acquire_finish_cycle_leaves_no_locket_keys_but_the_indexes() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("Cycle:1", 1);
    let ls = std::slice::from_ref(&l);
    let o = opts(5000, 5000, true);
    push(c, "q", &payload("Cycle", json!([1]))).await;
    push(c, "q2", &payload("Cycle", json!([1, "b"]))).await;
    let sa = Slot::new("p:1:0", "testhost:1:q");
    let sb = Slot::new("p:2:0", "testhost:2:q2");

    let ra = reserve_job(c, &sa, &["q"]).await;
    audit_locket_keys(c, "after RESERVE").await;
    let ta = random_hex(16);
    started(acquire(c, &sa, &ra, &ta, ls, o).await);
    audit_locket_keys(c, "after ACQUIRE").await;
    let rb = reserve_job(c, &sb, &["q2"]).await;
    let a = acquire(c, &sb, &rb, &random_hex(16), ls, o).await;
    assert!(matches!(a, Acquired::Conflict { requeued: true, .. }));
    let mid = audit_locket_keys(c, "after a conflict").await;
    assert!(
        mid.contains("counter:q2") && mid.contains("blocked:lock:Cycle:1"),
        "{mid:?}"
    );
    let (_, lost) = store::extend(c, &k, &ta, ls, Duration::from_millis(5000))
        .await
        .unwrap();
    assert_eq!(lost, vec![false]);
    audit_locket_keys(c, "after EXTEND").await;
    assert!(finish(c, &sa, &ra, &ta, ls, Finish::Success).await);
    audit_locket_keys(c, "after FINISH").await;

    let rb = reserve_job(c, &sb, &["q2"]).await;
    let tb = random_hex(16);
    started(acquire(c, &sb, &rb, &tb, ls, o).await);
    assert!(finish(c, &sb, &rb, &tb, ls, Finish::Success).await);
    assert_eq!(store::purge_expired(c, &k, 100).await.unwrap(), 0);

    let left = audit_locket_keys(c, "after the cycle").await;
    let allowed: BTreeSet<String> = set_of(["locks", "deps", "processes", "fence", "delayed"]);
    assert!(
        left.iter().all(|name| allowed.contains(name)
            || name.starts_with("stat:")
            || name.starts_with("metrics:")
            || name.starts_with("alive:")
            || name.starts_with("slots:")),
        "leftover locket keys: {left:?}"
    );
    assert_eq!(zscore(c, &k.locks(), &l.id).await, None);
}

/// A-6, R-6, E-3: ACQUIRE retried with the same rid and token after a lost reply (the first call
/// ran) answers as the first call did: the job stays started and is neither requeued against
/// its own lock nor counted as a conflict.
#[tokio::test]
async fn a_retried_acquire_of_a_started_attempt_is_answered_ok() {
    let server = RedisServer::start();
    let mut c = server.conn().await;
    let k = keys();
    let slot = Slot::new("h:1:abcd:0", "h:1:q");
    push(&mut c, "q", &payload("Retry", json!([1]))).await;
    let res = reserve_job(&mut c, &slot, &["q"]).await;
    let token = random_hex(16);
    let locks = [spec("Retry:1", 1)];
    let o = opts(5000, 1000, true);
    let first = started(acquire(&mut c, &slot, &res, &token, &locks, o).await);
    // The worker marks every attempt after the first as sent again.
    let resent = Opts { resent: true, ..o };
    let again = started(acquire(&mut c, &slot, &res, &token, &locks, resent).await);
    // A limit-1 lease's deadline is reported by the worker's clock (L-1a): the retry's is
    // the same lease, read a moment later.
    assert!(
        again >= first && again - first < 5000,
        "the retry reports the same lease: {first} then {again}"
    );
    assert_eq!(zcard(&mut c, &k.lock("Retry:1")).await, 1);
    assert_eq!(lrange(&mut c, &k.queue("q")).await.len(), 0, "not requeued");
    assert_eq!(
        get(&mut c, &k.counter("q")).await,
        None,
        "no conflict counted"
    );
    assert_eq!(
        hgetall(&mut c, &slot.inflight())
            .await
            .get("state")
            .map(String::as_str),
        Some("running")
    );
    // A different token for the same reservation is a real second attempt: it conflicts.
    let other = acquire(&mut c, &slot, &res, &random_hex(16), &locks, o).await;
    assert!(matches!(other, Acquired::Conflict { .. }), "{other:?}");
}

/// A-13 then A-1 in one round trip (FINISH+RESERVE): the finished job is recorded and its lock
/// released exactly as by FINISH alone, then the slot's next job is reserved; with nothing left
/// the reply is `nothing` and the finish still landed; a retry of a call whose reply was lost
/// finds the reservation gone (not recorded twice) and the slot busy with the job it reserved.
#[tokio::test]
async fn finish_and_reserve_records_the_job_then_reserves_the_next_in_one_call() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let c = &mut conn;
    let slot = Slot::new("h:1:a:0", "h:1:q");
    push(c, "q", &payload("Job", json!([1]))).await;
    push(c, "q", &payload("Job", json!([2]))).await;
    let locks = vec![spec("job:1", 1)];
    let first = reserve_job(c, &slot, &["q"]).await;
    started(acquire(c, &slot, &first, "tok1", &locks, opts(30_000, 10_000, true)).await);
    assert_eq!(zcard(c, &keys().lock("job:1")).await, 1);

    let outcome = Finish::Success;
    let req = finish_request(&first, "tok1", &locks, &outcome);
    let holds = NO_HOLDS;
    let queues = vec!["q".to_string()];
    let rid2 = random_hex(8);
    let (finished, next) =
        store::finish_and_reserve(c, &slot.r(), &req, &holds, &rid2, &queues, false)
            .await
            .expect("FINISH+RESERVE");
    let next = next.expect("RESERVE");
    assert!(finished);
    match &next {
        Reserved::Job {
            payload: p, rid, ..
        } => {
            assert_eq!(p, &payload("Job", json!([2])));
            assert_eq!(rid, &rid2);
        }
        other => panic!("expected the second job, got {other:?}"),
    }
    assert!(!exists(c, &keys().lock("job:1")).await, "lock released");
    assert_eq!(get(c, &keys().stat_processed()).await.as_deref(), Some("1"));
    assert!(!exists(c, &keys().worker(&slot.worker_id)).await);
    let rec = hgetall(c, &slot.inflight()).await;
    assert_eq!(rec.get("rid"), Some(&rid2));
    assert_eq!(rec.get("state").map(String::as_str), Some("reserved"));

    // The same call again, as after a lost reply (the worker marks it resent): nothing is
    // recorded twice, the slot is busy.
    let resent = store::FinishHolds {
        resent: true,
        ..NO_HOLDS
    };
    let (finished, again) =
        store::finish_and_reserve(c, &slot.r(), &req, &resent, &random_hex(8), &queues, false)
            .await
            .unwrap();
    let again = again.unwrap();
    assert!(!finished);
    assert!(matches!(again, Reserved::Busy), "{again:?}");
    assert_eq!(get(c, &keys().stat_processed()).await.as_deref(), Some("1"));

    // The second job ends and the queue is empty: `nothing`, with the finish applied.
    let second = Res {
        queue: "q".into(),
        payload: payload("Job", json!([2])),
        rid: rid2.clone(),
    };
    let locks2 = vec![spec("job:2", 1)];
    started(
        acquire(
            c,
            &slot,
            &second,
            "tok2",
            &locks2,
            opts(30_000, 10_000, true),
        )
        .await,
    );
    let req2 = finish_request(&second, "tok2", &locks2, &outcome);
    let (finished, next) =
        store::finish_and_reserve(c, &slot.r(), &req2, &holds, &random_hex(8), &queues, false)
            .await
            .unwrap();
    let next = next.unwrap();
    assert!(finished);
    assert!(matches!(next, Reserved::Nothing { .. }), "{next:?}");
    assert_eq!(get(c, &keys().stat_processed()).await.as_deref(), Some("2"));
    assert!(!exists(c, &slot.inflight()).await);
    assert!(!exists(c, &keys().lock("job:2")).await);
}

/// The reservation a RESERVE's reply holds; panics on any other reply.
fn as_res(r: &Reserved) -> Res {
    match r {
        Reserved::Job {
            queue,
            payload,
            rid,
            ..
        } => Res {
            queue: queue.clone(),
            payload: payload.clone(),
            rid: rid.clone(),
        },
        other => panic!("expected a job, got {other:?}"),
    }
}

/// The flags of a worker's FINISH+RESERVE that looked at the pause and cap keys' types less
/// than a second ago (A-20): it trusts its MGET.
const TRUSTING: store::ReserveFlags = store::ReserveFlags {
    clear_counters_when_idle: false,
    guard_types_seen: true,
};

/// A-20, A-22: a FINISH+RESERVE whose worker looked at the pause and cap keys' types less
/// than a second ago (`guard_types_seen`) leaves the EXISTS out and trusts its MGET: a pause
/// or a cap written as a string is honoured by it at once; a pause key of another type (by
/// hand) is not seen by it, but is by the next RESERVE that looks (the worker sends one at least
/// once a second), which passes the queue over.
#[tokio::test]
async fn a20_a_fused_reserve_that_trusts_its_mget_honours_string_pauses_and_caps() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let c = &mut conn;
    let k = keys();
    let slot = Slot::new("h:1:a:0", "h:1:q");
    for i in 1..=4 {
        push(c, "q", &payload("Job", json!([i]))).await;
    }
    let queues = vec!["q".to_string()];
    let nothing = |paused: Vec<String>, capped: Vec<String>| Reserved::Nothing {
        skipped: vec![],
        unreadable: vec![],
        paused,
        capped,
        refused: vec![],
    };
    // Runs the reserved job `res` (lock job:<n>) and ends it with a FINISH+RESERVE of `flags`.
    async fn end_and_reserve(
        c: &mut Conn,
        slot: &Slot,
        res: &Res,
        n: i64,
        queues: &[String],
        flags: store::ReserveFlags,
    ) -> Reserved {
        let locks = vec![spec(&format!("job:{n}"), 1)];
        let tok = random_hex(16);
        started(acquire(c, slot, res, &tok, &locks, opts(30_000, 10_000, true)).await);
        let req = finish_request(res, &tok, &locks, &Finish::Success);
        let (finished, next) =
            store::finish_and_reserve(c, &slot.r(), &req, &NO_HOLDS, &random_hex(8), queues, flags)
                .await
                .expect("FINISH+RESERVE");
        assert!(finished);
        next.expect("RESERVE")
    }

    // A string pause (resque-pause's, `locketd pause`'s) stops the trusting RESERVE at once.
    let first = reserve_job(c, &slot, &["q"]).await;
    let _: () = rcmd!(c, "SET", &k.pause_queue("q"), "true");
    let got = end_and_reserve(c, &slot, &first, 1, &queues, TRUSTING).await;
    assert_eq!(got, nothing(vec!["q".into()], vec![]));
    let _: i64 = rcmd!(c, "DEL", &k.pause_queue("q"));

    // So does a cap (a string) that is full: one unit, held by another reservation.
    let second = reserve_job(c, &slot, &["q"]).await;
    let _: () = rcmd!(c, "SET", &k.cap("q"), "1");
    let _: i64 = rcmd!(c, "SADD", &k.running("q"), "other-rid other-slot");
    let got = end_and_reserve(c, &slot, &second, 2, &queues, TRUSTING).await;
    assert_eq!(got, nothing(vec![], vec!["q".into()]));
    let _: i64 = rcmd!(c, "DEL", &k.cap("q"), &k.running("q"));

    // A pause key of another type: the trusting RESERVE cannot see it in its MGET and pops
    // (the window of at most a second)...
    let third = reserve_job(c, &slot, &["q"]).await;
    let _: i64 = rcmd!(c, "HSET", &k.pause_queue("q"), "by", "hand");
    let got = end_and_reserve(c, &slot, &third, 3, &queues, TRUSTING).await;
    let fourth = as_res(&got);
    assert_eq!(fourth.payload, payload("Job", json!([4])));
    // ... and the next look (a RESERVE that does not trust its MGET) passes the queue over.
    push(c, "q", &payload("Job", json!([5]))).await;
    let got = end_and_reserve(c, &slot, &fourth, 4, &queues, false.into()).await;
    assert_eq!(got, nothing(vec!["q".into()], vec![]));
    assert_eq!(lrange(c, &k.queue("q")).await.len(), 1, "nothing popped");
}

/// A-13, L-5, A-1, A-2: the plain FINISH+RESERVE (one limit-1 lock held unflagged, a success,
/// a trusting RESERVE over queues with no counter, cap or pause) lands what the full path
/// lands: the lock released, the job counted, the next job popped in priority order over
/// runs of empty queues, a queue of another type passed over and reported. What it does not
/// cover goes to the full path unchanged: a lock that another attempt holds now is left to
/// it, and a queue with a counter keeps the skip rule.
#[tokio::test]
async fn a13_a1_the_plain_finish_reserve_lands_what_the_full_path_lands() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let c = &mut conn;
    let k = keys();
    let slot = Slot::new("h:1:a:0", "h:1:*");
    let names: Vec<String> = (0..6).map(|i| format!("p{i}")).collect();
    let nothing = |skipped: Vec<String>| Reserved::Nothing {
        skipped,
        unreadable: vec!["p1".into()],
        paused: vec![],
        capped: vec![],
        refused: vec![],
    };
    // Starts `res` under lock `lock` (limit 1), lets `meddle` act on the lock's value, then
    // ends the job with a trusting FINISH+RESERVE over p0..p5; the FINISH must land.
    async fn run_then_end(
        c: &mut Conn,
        slot: &Slot,
        res: &Res,
        lock: &str,
        queues: &[String],
        flags: store::ReserveFlags,
        meddle: impl FnOnce(String, &str) -> Option<String>,
    ) -> Reserved {
        let locks = vec![spec(lock, 1)];
        let tok = random_hex(16);
        started(acquire(c, slot, res, &tok, &locks, opts(30_000, 10_000, true)).await);
        let value = get(c, &keys().lock(lock)).await.expect("lock value");
        if let Some(v) = meddle(value, &tok) {
            let _: () = rcmd!(c, "SET", keys().lock(lock), v);
        }
        let req = finish_request(res, &tok, &locks, &Finish::Success);
        let (finished, next) =
            store::finish_and_reserve(c, &slot.r(), &req, &NO_HOLDS, &random_hex(8), queues, flags)
                .await
                .expect("FINISH+RESERVE");
        assert!(finished, "the FINISH landed");
        next.expect("RESERVE")
    }
    let _: i64 = rcmd!(c, "HSET", k.queue("p1"), "written", "by hand");
    push(c, "p4", &payload("Job", json!([1]))).await;
    push(c, "p4", &payload("Job", json!([2]))).await;
    push(c, "p5", &payload("Job", json!([3]))).await;
    let first = reserve_job(c, &slot, &["p4"]).await;

    // Plain: released, counted, and the next job is p4's second (p1 passed over, p5 after).
    let got = run_then_end(c, &slot, &first, "job:1", &names, TRUSTING, |_, _| None).await;
    let second = as_res(&got);
    assert_eq!(
        (second.queue.as_str(), &second.payload),
        ("p4", &payload("Job", json!([2])))
    );
    assert!(!exists(c, &k.lock("job:1")).await, "lock released");
    assert!(!exists(c, &k.worker(&slot.worker_id)).await);
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("1"));
    let rec = hgetall(c, &slot.inflight()).await;
    assert_eq!(rec["rid"], second.rid);
    assert_eq!(rec["state"], "reserved");
    assert_eq!(rec["resque_worker"], slot.worker_id);

    // The lock lapsed and another attempt holds it now: it stays that attempt's; the job is
    // still recorded, and the queue left (p5) is reserved.
    let mut other = String::new();
    let got = run_then_end(c, &slot, &second, "job:2", &names, TRUSTING, |v, tok| {
        other = v.replace(tok, &"f".repeat(tok.len()));
        Some(other.clone())
    })
    .await;
    let third = as_res(&got);
    assert_eq!(third.queue, "p5");
    assert_eq!(get(c, &k.lock("job:2")).await, Some(other));
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("2"));

    // A counter as long as its queue (A-2): p4's new job is skipped, p1 reported.
    push(c, "p4", &payload("Job", json!([4]))).await;
    let _: () = rcmd!(c, "SET", k.counter("p4"), 1);
    let got = run_then_end(c, &slot, &third, "job:3", &names, TRUSTING, |_, _| None).await;
    assert_eq!(got, nothing(vec!["p4".into()]));
    assert!(!exists(c, &k.lock("job:3")).await, "lock released");
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("3"));
    assert!(!exists(c, &slot.inflight()).await);

    // Nothing left but p1's hash: `nothing`, p1 reported, by the plain path.
    let _: i64 = rcmd!(c, "DEL", k.counter("p4"), k.queue("p4"));
    push(c, "p5", &payload("Job", json!([5]))).await;
    let fifth = reserve_job(c, &slot, &["p5"]).await;
    let got = run_then_end(c, &slot, &fifth, "job:5", &names, TRUSTING, |_, _| None).await;
    assert_eq!(got, nothing(vec![]));
    assert!(!exists(c, &k.lock("job:5")).await, "lock released");
    assert_eq!(get(c, &k.stat_processed()).await.as_deref(), Some("4"));
    assert!(!exists(c, &slot.inflight()).await);
}

/// A-1 with many queues (RESERVE checks runs of empty queues with one EXISTS): priority order
/// holds across runs, a run that is empty but for one queue is still found, and the skip rule
/// still applies inside a run.
#[tokio::test]
async fn reserve_over_many_queues_keeps_priority_and_the_skip_rule() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let c = &mut conn;
    let slot = Slot::new("h:1:a:0", "h:1:*");
    let names: Vec<String> = (0..40).map(|i| format!("q{i:02}")).collect();
    let queues: Vec<&str> = names.iter().map(String::as_str).collect();
    for q in ["q39", "q20", "q05", "q17"] {
        push(c, q, &payload("Job", json!([q]))).await;
    }
    // q17's only job waits on a lock: counter >= length, so it is skipped.
    let _: () = rcmd!(c, "SET", keys().counter("q17"), 1);
    let mut order = Vec::new();
    for _ in 0..3 {
        let res = reserve_job(c, &slot, &queues).await;
        order.push(res.queue.clone());
        let _: i64 = rcmd!(c, "DEL", slot.inflight());
    }
    assert_eq!(order, ["q05", "q20", "q39"]);
    match reserve(c, &slot, &queues, false).await {
        Reserved::Nothing { skipped, .. } => assert_eq!(skipped, ["q17"]),
        other => panic!("expected nothing but q17 skipped, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// S-6: a step that cannot apply changes nothing (issue 11, findings 1, 2, 6, 7, 8)
// ---------------------------------------------------------------------------------------------

/// Every key of the test's own server with its type and a dump of its value, to compare the
/// whole state before and after a step that must change nothing.
async fn snapshot(conn: &mut Conn) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let names: Vec<String> = rcmd!(conn, "KEYS", "*");
    let mut out = std::collections::BTreeMap::new();
    for k in names {
        let t: String = rcmd!(conn, "TYPE", &k);
        let d: Vec<u8> = rcmd!(conn, "DUMP", &k);
        out.insert(k, (t, d));
    }
    out
}

// S-6, NEVER-2 (finding 1): RETURN of a reserved job whose queue key another tool made a
// string raises before its first write: the job stays in its inflight record.
#[tokio::test]
async fn s6_a_return_that_cannot_push_keeps_the_reservation() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let job = payload("J", json!([1]));
    push(c, "q", &job).await;
    let s = Slot::new("p:1:0", "testhost:1:q");
    let r = reserve_job(c, &s, &["q"]).await;
    let _: () = rcmd!(c, "SET", k.queue("q"), "not a list");
    let before = snapshot(c).await;
    let err = store::return_to_queue(c, &s.r(), &r.rid, "q")
        .await
        .expect_err("the push to a string raised");
    assert!(err.to_string().contains("LOCKET_STORE"), "{err}");
    assert_eq!(
        hget_bytes(c, &s.inflight(), "payload").await,
        Some(job),
        "the reservation was dropped"
    );
    assert_eq!(
        snapshot(c).await,
        before,
        "a failed RETURN changed the state"
    );
}

// S-6, NEVER-2 (finding 2): a delayed job whose target queue key is not a list stays in
// `delayed` instead of being removed before a push that raises; the other due jobs move.
#[tokio::test]
async fn s6_promote_keeps_a_delayed_job_whose_queue_is_not_a_list() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let bad = json!({"rid": "r1", "queue": "broken", "payload": "{\"class\":\"A\",\"args\":[]}",
        "reason": "lock", "resource": "x", "attempt": 1})
    .to_string();
    let good = json!({"rid": "r2", "queue": "fine", "payload": "{\"class\":\"B\",\"args\":[]}",
        "reason": "lock", "resource": "x", "attempt": 1})
    .to_string();
    let _: () = rcmd!(c, "SET", k.queue("broken"), "not a list");
    let _: i64 = rcmd!(c, "ZADD", k.delayed(), 1, &bad, 1, &good);
    let pushed = store::promote_delayed(c, &k, 100, None)
        .await
        .expect("PROMOTE passes over the bad member");
    assert_eq!(pushed, 1);
    assert_eq!(
        lrange(c, &k.queue("fine")).await,
        vec![b"{\"class\":\"B\",\"args\":[]}".to_vec()]
    );
    assert!(
        zscore(c, &k.delayed(), &bad).await.is_some(),
        "the delayed job whose queue is not a list was lost"
    );
    let t: String = rcmd!(c, "GET", k.queue("broken"));
    assert_eq!(t, "not a list");
}

// S-6, D-6, NEVER-6 (finding 6): FINISH of a failed job whose failure list another tool made
// a string raises before releasing anything: its lock and its holds stay, so a resend cannot
// release them twice, and the job stays in its inflight record.
#[tokio::test]
async fn s6_a_finish_that_cannot_record_releases_nothing() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let l = spec("acct:6", 1);
    let h = hold(c, "f6", std::slice::from_ref(&l), 20_000).await;
    // Two holds of "dep-6" by the job's digest: a release would take one.
    for _ in 0..2 {
        store::enqueue(
            c,
            &k,
            "other",
            "{}",
            "d6",
            &["dep-6".to_string()],
            Duration::from_secs(60),
        )
        .await
        .expect("ENQUEUE");
    }
    let _: () = rcmd!(c, "SET", k.failed(), "not a list");
    let before = snapshot(c).await;
    let outcome = Finish::Failure("{\"exception\":\"E\"}".into());
    let req = finish_request(&h.res, &h.token, &h.locks, &outcome);
    let release = vec!["dep-6".to_string()];
    let holds = store::FinishHolds {
        class: "Holder",
        digest: "d6",
        release: &release,
        resent: false,
        unique: "",
    };
    for _ in 0..3 {
        let err = store::finish_with(c, &h.slot.r(), &req, &holds)
            .await
            .expect_err("the failure record could not be pushed");
        assert!(err.to_string().contains("LOCKET_STORE"), "{err}");
    }
    assert_eq!(
        live_holders(c, &k.lock("acct:6")).await,
        1,
        "the lock was released"
    );
    assert_eq!(
        snapshot(c).await,
        before,
        "a failed FINISH changed the state"
    );
}

// S-6, D-1 (finding 7): a hold name with more expired fields than Lua can unpack at once
// (about 8,000) is purged in chunks: the enqueue succeeds with its hold, and nothing raises.
#[tokio::test]
async fn s6_a_hold_name_with_ten_thousand_expired_fields_is_purged_in_chunks() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let key = format!("{}dep:big", k.locket_prefix());
    for chunk in 0..10 {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(&key);
        for i in 0..1000 {
            cmd.arg(format!("old{}", chunk * 1000 + i)).arg("1:1");
        }
        let _: i64 = cmd.query_async(c).await.expect("HSET");
    }
    store::enqueue(
        c,
        &k,
        "q",
        "{\"class\":\"A\",\"args\":[]}",
        "d7",
        &["big".to_string()],
        Duration::from_secs(60),
    )
    .await
    .expect("ENQUEUE with a hold over 10,000 expired fields");
    let fields = hgetall(c, &key).await;
    assert_eq!(fields.len(), 1, "expired fields left: {}", fields.len());
    assert!(fields.contains_key("d7"));
    assert_eq!(lrange(c, &k.queue("q")).await.len(), 1);
}

// S-6, D-3 (finding 8): an enqueue whose queue key is not a list adds no hold: a failed
// enqueue leaves nothing behind, and retrying it does not add one hold per try.
#[tokio::test]
async fn s6_an_enqueue_that_cannot_push_adds_no_hold() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _: () = rcmd!(c, "SET", k.queue("q"), "not a list");
    let before = snapshot(c).await;
    for _ in 0..2 {
        let err = store::enqueue(
            c,
            &k,
            "q",
            "{\"class\":\"A\",\"args\":[]}",
            "d8",
            &["h8".to_string()],
            Duration::from_secs(60),
        )
        .await
        .expect_err("the push to a string raised");
        assert!(err.to_string().contains("LOCKET_STORE"), "{err}");
    }
    assert_eq!(
        snapshot(c).await,
        before,
        "a failed ENQUEUE left holds behind"
    );
}

// S-6, O-3 (issue 11, smaller): a Resque stat counter another tool set to a non-integer does
// not fail the FINISH that has already written: the job ends, the counter is passed over.
#[tokio::test]
async fn s6_a_non_integer_stat_counter_does_not_fail_finish() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let h = hold(c, "f9", &[spec("acct:9", 1)], 20_000).await;
    let _: () = rcmd!(c, "SET", format!("{}:stat:processed", NS), "abc");
    assert!(h.finish(c).await, "FINISH of a success");
    assert!(!exists(c, &h.slot.inflight()).await);
    assert_eq!(live_holders(c, &k.lock("acct:9")).await, 0);
    assert_eq!(
        get(c, &format!("{}:stat:processed", NS)).await.as_deref(),
        Some("abc")
    );
}

// R-3 step 4, S-6 (issue 11, smaller): dead processes whose recovery always raises (their
// job's queue key is a string) do not use up the janitor's ten recoveries a pass: a
// recoverable dead process listed among sixty of them is recovered in the first pass.
#[tokio::test]
async fn r3_unrecoverable_dead_processes_do_not_hide_a_recoverable_one() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let ttl = Duration::from_millis(300);
    for i in 0..60 {
        let process = format!("bad:{i}:aaaa");
        register(c, &process, 0, &format!("testhost:{i}:broken"), ttl).await;
        push(c, "broken", &payload("B", json!([i]))).await;
        reserve_job(c, &Slot::new(format!("{process}:0"), "w"), &["broken"]).await;
    }
    let good = "good:1:bbbb";
    register(c, good, 0, "testhost:1000:fine", ttl).await;
    let job = payload("G", json!([1]));
    push(c, "fine", &job).await;
    reserve_job(c, &Slot::new(format!("{good}:0"), "w"), &["fine"]).await;
    let _: () = rcmd!(c, "SET", k.queue("broken"), "not a list");
    wait_dead(c, good).await;
    for i in 0..60 {
        wait_dead(c, &format!("bad:{i}:aaaa")).await;
    }
    let cfg = janitor_config("");
    let report = janitor_pass(c, &k, &cfg, &random_hex(16)).await;
    assert!(report.is_err(), "the unrecoverable ones are reported");
    assert_eq!(
        lrange(c, &k.queue("fine")).await,
        vec![job],
        "the recoverable dead process's job was not returned"
    );
    let left: Vec<String> = rcmd!(c, "KEYS", format!("{NS}:locket:inflight:bad:*"));
    assert_eq!(
        left.len(),
        60,
        "an unrecoverable job left its inflight record"
    );
}
