//! S-6 and NEVER-2 swept over the steps that push to keys other tools may write (issue 11
//! item 2): for every (step, key) of [`STEPS`], the key is given a wrong type (a string, then
//! a hash), and separately Redis is full (`maxmemory` reached, `noeviction`); the step must
//! then either have changed nothing (and answered an error) or have applied, and in both cases
//! the job must be visible in exactly one place (a queue, an inflight record, `delayed`, or
//! `<ns>:failed`). A new step is covered by adding a row. The scheduler's scripts (DELIVER,
//! FIRE, the lock's) and PARK are rows too (issue 23 item 3).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use locketd::config::Config;
use locketd::locks::LockSpec;
use locketd::resque::failure::working_on;
use locketd::resque::failure::FailureBackend;
use locketd::resque::keys::Keys;
use locketd::store::random_hex;
use locketd::store::{self, AcquireRequest, Finish, FinishRequest, Reserved, SlotRef};
use locketd::worker::{recover_process, JanitorReport};
use redis::aio::MultiplexedConnection as Conn;

use crate::support::RedisServer;

const NS: &str = "resque";
const PAYLOAD: &str = r#"{"class":"Sweep","args":["s6"]}"#;

/// The steps under test.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// RETURN of a reserved job (R-8).
    Return,
    /// ENQUEUE with a hold (D-3).
    Enqueue,
    /// PUSH of a class whose published plan places a hold and a unique key (D-3a, U-1).
    Push,
    /// PUSH_AT of that class (D-3b): the delayed layout, the hold and the unique key.
    PushAt,
    /// FINISH of a failed job: a failure record.
    FinishFailure,
    /// FINISH of a rescheduled job: back to its queue.
    FinishRequeue,
    /// ACQUIRE whose lock is held elsewhere, requeue fallback (P-1).
    AcquireRequeue,
    /// PROMOTE of a due delayed job (P-4).
    Promote,
    /// RECOVER of a dead process's running job (R-4, `on_worker_death = "fail"`).
    RecoverRunning,
    /// RECOVER of a dead process's reserved job.
    RecoverReserved,
    /// DELIVER of a due resque-scheduler item (SC-4, SC-5).
    Deliver,
    /// FIRE of a recurring schedule's tick (SC-12).
    Fire,
    /// The scheduler's lock taken (SC-8).
    LockAcquire,
    /// The scheduler's lock renewed (SC-8).
    LockRenew,
    /// The scheduler's lock released (SC-8).
    LockRelease,
    /// PARK of a slot whose FINISH was refused (E-3).
    Park,
    // -- parked waits (issue 25): every step that parks or wakes --
    /// ACQUIRE whose lock is held elsewhere, park fallback (PK-1).
    AcquirePark,
    /// FINISH (a failure) of the holder of a lock another job is parked on: the wake (PK-2).
    FinishWake,
    /// The janitor's wake of a job parked on a lock whose holder lapsed (PK-4).
    WakeDue,
    /// `locketd unpark` of a parked job (PK-9).
    Unpark,
    /// The janitor's purge of an expired hold, which wakes the job parked on it (PK-2).
    PurgeHoldWake,
    // -- operator controls (issue 27) --
    /// `locketd pause q2 q` (A-20): every key checked before the first write.
    Pause,
    /// RESERVE of a queue whose pause key another tool wrote (A-20): passed over.
    ReservePaused,
    /// RESERVE of a capped queue (A-22): the running set read before the pop.
    ReserveCapped,
    /// FINISH (a failure) of a capped queue's job (A-22): its unit freed.
    FinishCapped,
}

/// The due bucket of [`Step::Deliver`] and its item, in the gem's format (SC-1).
const TS: &str = "100";
const ITEM: &str = r#"{"class":"Sweep","args":["s6"],"queue":"q"}"#;
/// The scheduler's lock key (SC-6), without the namespace's first `resque:`.
const LOCK: &str = "resque:resque_scheduler_master_lock";
const LOCK_VALUE: &str = "locketd-sweep:1";

/// Each step with the keys, written by other tools too, that it pushes to.
const STEPS: &[(Step, &[&str])] = &[
    (Step::Return, &["queue:q", "queues"]),
    (Step::Enqueue, &["queue:q", "queues"]),
    (Step::Push, &["queue:q", "queues"]),
    (
        Step::PushAt,
        &[
            "delayed:100",
            r#"timestamps:{"class":"Sweep","args":["s6"],"queue":"q"}"#,
            "delayed_queue_schedule",
        ],
    ),
    (Step::FinishFailure, &["failed"]),
    (Step::FinishRequeue, &["queue:q", "queues"]),
    (Step::AcquireRequeue, &["queue:q", "queues"]),
    (Step::Promote, &["queue:q", "queues"]),
    (Step::RecoverRunning, &["failed"]),
    (Step::RecoverReserved, &["queue:q", "queues"]),
    (
        Step::Deliver,
        &[
            "queue:q",
            "queues",
            "delayed_queue_schedule",
            r#"timestamps:{"class":"Sweep","args":["s6"],"queue":"q"}"#,
        ],
    ),
    (
        Step::Fire,
        &["queue:q", "queues", "delayed:last_enqueued_at"],
    ),
    (Step::LockAcquire, &[LOCK]),
    (Step::LockRenew, &[LOCK]),
    (Step::LockRelease, &[LOCK]),
    // Its one key is the job's inflight record: `park_on_a_record_of_another_type_changes_nothing`.
    (Step::Park, &[]),
    (Step::FinishWake, &["queue:q2", "queues", "failed"]),
    (Step::WakeDue, &["queue:q2", "queues"]),
    (Step::Unpark, &["queue:q2", "queues"]),
    (Step::PurgeHoldWake, &["queue:q2", "queues"]),
    (Step::Pause, &["pause:queue:q"]),
    (Step::ReservePaused, &["pause:queue:q", "pause:all"]),
    // The cap key is locketd's own (K-1) but read as S-6 reads another tool's: RESERVE
    // refuses its queue rather than reading it as "no cap" (A-22).
    (Step::ReserveCapped, &["locket:running:q", "locket:cap:q"]),
    (
        Step::FinishCapped,
        &["locket:running:q", "failed", "locket:cap:q"],
    ),
];

/// Each step with locketd's own keys (K-1: no other tool writes them) that it reads or
/// writes. S-6's checks do not cover these (a `TYPE` per lock on every job's path would be
/// the price), so a step may half-apply when one is spoiled by hand; what must still hold is
/// NEVER-2: the job stays visible, in as many places as before.
const OWN_KEYS: &[(Step, &[&str])] = &[
    (Step::Return, &["locket:counter:q"]),
    (Step::Enqueue, &["locket:deps", "locket:dep:h"]),
    // Their unique key (`locket:unique:u:s6`) is not in these rows: taken, by a value of any
    // type, it refuses the push as a duplicate (nothing written, U-1).
    (Step::Push, &["locket:deps", "locket:dep:h"]),
    (Step::PushAt, &["locket:deps", "locket:dep:h"]),
    (
        Step::FinishFailure,
        &[
            "locket:lock:L",
            "locket:lockinfo:L",
            "locket:blocked:lock:L",
            "locket:locks",
            "worker:sweep:1:q",
        ],
    ),
    (
        Step::FinishRequeue,
        &["locket:lock:L", "locket:locks", "locket:counter:q"],
    ),
    (
        Step::AcquireRequeue,
        &[
            "locket:lock:L",
            "locket:locks",
            "locket:counter:q",
            "locket:blocked:lock:L",
            "locket:attempts",
        ],
    ),
    (Step::Promote, &["locket:counter:q"]),
    (
        Step::RecoverRunning,
        &[
            "locket:lock:L",
            "locket:locks",
            "locket:processes",
            "locket:slots:sweep:1:aaaaaaaa",
            "locket:recoveries",
        ],
    ),
    (
        Step::RecoverReserved,
        &["locket:processes", "locket:slots:sweep:1:aaaaaaaa"],
    ),
    (Step::Fire, &["locket:schedule:last"]),
    (
        Step::AcquirePark,
        &[
            "locket:lock:L",
            "locket:parked:lock:L",
            "locket:parked",
            "locket:parked_queues",
        ],
    ),
    (
        Step::FinishWake,
        &["locket:lock:L", "locket:parked", "locket:parked_queues"],
    ),
    (
        Step::WakeDue,
        &["locket:lock:L", "locket:parked", "locket:parked_queues"],
    ),
    (Step::Unpark, &["locket:parked", "locket:parked_queues"]),
    (
        Step::PurgeHoldWake,
        &[
            "locket:dep:h",
            "locket:deps",
            "locket:parked",
            "locket:parked_queues",
        ],
    ),
];

// (A step that wakes a job finds it in its parked list, so that list is spoiled only where
// the job parks: spoiling it by hand where a job is parked would be deleting the job by hand.)

/// A second job, parked on lock L by a job of queue q2 (parked-waits.md: the entry's shape).
const PARKED_PAYLOAD: &str = r#"{"class":"Sweep","args":["parked"]}"#;

async fn park_second_job(c: &mut Conn, k: &Keys) {
    let entry = serde_json::json!({"rid": "rb", "queue": "q2", "payload": PARKED_PAYLOAD,
        "parked_at": 1, "class": "Sweep", "attempt": 1, "ttl": 30000, "limit": 1})
    .to_string();
    cmd(c, &["RPUSH", &k.locket("parked:lock:L"), &entry]).await;
    cmd(c, &["ZADD", &k.locket("parked"), "0", "lock:L"]).await;
    cmd(c, &["HSET", &k.locket("parked_queues"), "q2", "1"]).await;
}

/// Sets the parked bit of lock L's limit-1 holder (lib.lua), as a park on it does.
async fn mark_parked(c: &mut Conn, k: &Keys) {
    let v: Option<String> = redis::cmd("GET")
        .arg(k.lock("L"))
        .query_async(c)
        .await
        .unwrap();
    let v = v.expect("lock L held");
    let marked = format!("{}2{}", &v[..11], &v[12..]);
    cmd(c, &["SET", &k.lock("L"), &marked, "KEEPTTL"]).await;
}

fn keys() -> Keys {
    Keys::new(NS)
}

const PROCESS: &str = "sweep:1:aaaaaaaa";
const SLOT: &str = "sweep:1:aaaaaaaa:0";
const WORKER: &str = "sweep:1:q";

fn slot(k: &Keys) -> SlotRef<'_> {
    SlotRef {
        keys: k,
        slot_key: SLOT,
        worker_id: WORKER,
    }
}

async fn cmd(c: &mut Conn, args: &[&str]) -> redis::Value {
    let mut q = redis::cmd(args[0]);
    for a in &args[1..] {
        q.arg(*a);
    }
    q.query_async(c)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// What a step needs to be sent: the reservation and token of its job.
#[derive(Default)]
struct Prepared {
    rid: String,
    token: String,
}

async fn reserve(c: &mut Conn, k: &Keys) -> String {
    cmd(c, &["SET", &k.alive(PROCESS), "{}", "PX", "600000"]).await;
    match store::reserve(c, &slot(k), &random_hex(8), &["q".to_string()], false)
        .await
        .expect("RESERVE")
    {
        Reserved::Job { rid, .. } => rid,
        other => panic!("no job reserved: {other:?}"),
    }
}

async fn acquire(
    c: &mut Conn,
    k: &Keys,
    rid: &str,
    token: &str,
    requeue: bool,
) -> redis::RedisResult<store::Acquired> {
    let locks = [LockSpec {
        id: "L".into(),
        limit: 1,
    }];
    let working = working_on(PAYLOAD, "q", SystemTime::now(), "vm:1:q");
    let req = AcquireRequest {
        rid,
        token,
        queue: "q",
        class: "Sweep",
        digest: "d",
        locks: &locks,
        lock_ttl: Duration::from_secs(30),
        counter_ttl: Duration::from_secs(10),
        requeue_on_conflict: requeue,
        working_on: &working,
        lockinfo: "{}",
        resent: false,
    };
    store::acquire(c, &slot(k), &req).await
}

/// Builds the state in which `step` writes (a job reserved, started, delayed or orphaned).
async fn prepare(c: &mut Conn, k: &Keys, step: Step) -> Prepared {
    let push = |c: &mut Conn| {
        let mut c = c.clone();
        async move {
            cmd(&mut c, &["RPUSH", &keys().queue("q"), PAYLOAD]).await;
            cmd(&mut c, &["SADD", &keys().queues(), "q"]).await;
        }
    };
    match step {
        Step::Enqueue | Step::Fire | Step::LockAcquire => Prepared::default(),
        Step::Push | Step::PushAt => {
            let config = Config::parse(
                "queues = \"q\"\n[classes.\"Sweep\"]\ncommand = [\"/bin/true\"]\n\
                 holds = [ { name = \"h\", when = \"enqueue\" } ]\n\
                 unique = \"until_expired\"\nunique_ttl = \"60s\"\nunique_key = \"u:{args[0]}\"\n",
                "sweep",
            )
            .unwrap();
            let plans = locketd::config::plans::Plans::compile(&config).unwrap();
            store::plans::publish(c, k, &plans).await.unwrap();
            Prepared::default()
        }
        Step::Deliver => {
            cmd(c, &["RPUSH", &k.delayed_bucket(TS), ITEM]).await;
            cmd(
                c,
                &["SADD", &k.delayed_index(ITEM), &format!("delayed:{TS}")],
            )
            .await;
            cmd(c, &["ZADD", &k.delayed_schedule(), TS, TS]).await;
            Prepared::default()
        }
        Step::LockRenew | Step::LockRelease => {
            cmd(c, &["SET", &format!("{NS}:{LOCK}"), LOCK_VALUE, "EX", "60"]).await;
            Prepared::default()
        }
        Step::Park => {
            push(c).await;
            let rid = reserve(c, k).await;
            Prepared {
                rid,
                token: String::new(),
            }
        }
        Step::Promote => {
            let member = serde_json::json!({"rid": "r1", "queue": "q", "payload": PAYLOAD,
                "reason": "lock", "resource": "L", "attempt": 1})
            .to_string();
            cmd(c, &["ZADD", &k.delayed(), "1", &member]).await;
            Prepared::default()
        }
        Step::Pause | Step::ReservePaused => {
            push(c).await;
            cmd(c, &["SET", &k.alive(PROCESS), "{}", "PX", "600000"]).await;
            Prepared::default()
        }
        Step::ReserveCapped => {
            push(c).await;
            cmd(c, &["SET", &k.alive(PROCESS), "{}", "PX", "600000"]).await;
            cmd(c, &["SET", &k.cap("q"), "3"]).await;
            Prepared::default()
        }
        Step::FinishCapped => {
            push(c).await;
            cmd(c, &["SET", &k.cap("q"), "3"]).await;
            let rid = reserve(c, k).await;
            let token = random_hex(16);
            let a = acquire(c, k, &rid, &token, false).await.expect("ACQUIRE");
            assert!(matches!(a, store::Acquired::Started { .. }), "{a:?}");
            Prepared { rid, token }
        }
        Step::Return | Step::RecoverReserved => {
            push(c).await;
            let rid = reserve(c, k).await;
            Prepared {
                rid,
                token: String::new(),
            }
        }
        Step::FinishFailure | Step::FinishRequeue | Step::RecoverRunning => {
            push(c).await;
            let rid = reserve(c, k).await;
            let token = random_hex(16);
            let a = acquire(c, k, &rid, &token, false).await.expect("ACQUIRE");
            assert!(matches!(a, store::Acquired::Started { .. }), "{a:?}");
            Prepared { rid, token }
        }
        Step::AcquireRequeue => {
            // Another holder has lock L.
            cmd(c, &["ZADD", &k.lock("L"), "99999999999999", "other"]).await;
            push(c).await;
            let rid = reserve(c, k).await;
            Prepared {
                rid,
                token: random_hex(16),
            }
        }
        Step::AcquirePark => {
            // Another limit-1 holder has lock L (lib.lua's value).
            let v = r#"{"blocked":0,"token":"other","queue":"q"}"#;
            cmd(c, &["SET", &k.lock("L"), v, "PX", "600000"]).await;
            push(c).await;
            let rid = reserve(c, k).await;
            Prepared {
                rid,
                token: random_hex(16),
            }
        }
        Step::FinishWake => {
            push(c).await;
            let rid = reserve(c, k).await;
            let token = random_hex(16);
            let a = acquire(c, k, &rid, &token, false).await.expect("ACQUIRE");
            assert!(matches!(a, store::Acquired::Started { .. }), "{a:?}");
            park_second_job(c, k).await;
            mark_parked(c, k).await;
            Prepared { rid, token }
        }
        Step::WakeDue | Step::Unpark => {
            park_second_job(c, k).await;
            Prepared::default()
        }
        Step::PurgeHoldWake => {
            // Hold h lapsed (deadline 1 ms after the epoch); a job is parked on it.
            cmd(c, &["HSET", &k.dep("h"), "d", "1:1"]).await;
            cmd(c, &["ZADD", &k.deps(), "1", "h"]).await;
            let entry = serde_json::json!({"rid": "rb", "queue": "q2",
                "payload": PARKED_PAYLOAD, "parked_at": 1, "class": "Sweep", "attempt": 1,
                "ttl": 30000, "limit": 0})
            .to_string();
            cmd(c, &["RPUSH", &k.locket("parked:dep:h"), &entry]).await;
            cmd(c, &["ZADD", &k.locket("parked"), "0", "dep:h"]).await;
            Prepared::default()
        }
    }
}

/// Sends `step`; its error, if any, as text.
async fn run(c: &mut Conn, k: &Keys, step: Step, p: &Prepared) -> Result<(), String> {
    let locks = [LockSpec {
        id: "L".into(),
        limit: 1,
    }];
    let finish = |outcome: Finish| {
        let mut c = c.clone();
        let (rid, token) = (p.rid.clone(), p.token.clone());
        async move {
            let req = FinishRequest {
                rid: &rid,
                token: &token,
                queue: "q",
                locks: &locks,
                outcome: &outcome,
                backend: FailureBackend::Redis,
            };
            store::finish(&mut c, &slot(&keys()), &req).await.map(drop)
        }
    };
    let r = match step {
        Step::Return => store::return_to_queue(c, &slot(k), &p.rid, "q")
            .await
            .map(drop),
        Step::Enqueue => store::enqueue(
            c,
            k,
            "q",
            PAYLOAD,
            "d",
            &["h".to_string()],
            Duration::from_secs(60),
        )
        .await
        .map(drop),
        // The scripts a client sends by EVALSHA (D-3a, D-3b).
        Step::Push => store::scripts::scripts()
            .push
            .key(k.queue("q"))
            .key(k.queues())
            .key(k.plans())
            .arg("q")
            .arg(PAYLOAD)
            .arg(k.locket_prefix())
            .invoke_async::<redis::Value>(c)
            .await
            .map(drop),
        Step::PushAt => store::scripts::scripts()
            .push_at
            .key(k.delayed_bucket(TS))
            .key(k.delayed_index(ITEM))
            .key(k.delayed_schedule())
            .key(k.plans())
            .arg("q")
            .arg(ITEM)
            .arg(TS)
            .arg(k.locket_prefix())
            .invoke_async::<redis::Value>(c)
            .await
            .map(drop),
        Step::FinishFailure => {
            let record = format!("{{\"exception\":\"E\",\"payload\":{PAYLOAD}}}");
            finish(Finish::Failure(record)).await
        }
        Step::FinishRequeue => finish(Finish::Requeue).await,
        Step::AcquireRequeue => acquire(c, k, &p.rid, &p.token, true).await.map(|a| {
            assert!(matches!(a, store::Acquired::Conflict { .. }), "{a:?}");
        }),
        Step::Promote => store::promote_delayed(c, k, 100, None).await.map(drop),
        Step::Deliver => {
            let d = store::schedule::deliver_batch(c, k, TS, 0, 100).await;
            // An item kept back (its queue of another type) is left in place, untouched.
            d.map(drop)
        }
        Step::Fire => store::schedule::fire(
            c,
            k,
            "sweep",
            Some(100),
            "q",
            PAYLOAD,
            "2026-11-23 20:33:03 +0000",
        )
        .await
        .map(drop),
        Step::LockAcquire => {
            store::schedule::lock_acquire(c, &format!("{NS}:{LOCK}"), LOCK_VALUE, 60)
                .await
                .map(drop)
        }
        Step::LockRenew => store::schedule::lock_renew(c, &format!("{NS}:{LOCK}"), LOCK_VALUE, 60)
            .await
            .map(drop),
        Step::LockRelease => store::schedule::lock_release(c, &format!("{NS}:{LOCK}"), LOCK_VALUE)
            .await
            .map(drop),
        Step::Park => store::park(c, &slot(k), &p.rid, "now", "WRONGTYPE")
            .await
            .map(drop),
        Step::AcquirePark => {
            let locks = [LockSpec {
                id: "L".into(),
                limit: 1,
            }];
            let working = working_on(PAYLOAD, "q", SystemTime::now(), "vm:1:q");
            let req = AcquireRequest {
                rid: &p.rid,
                token: &p.token,
                queue: "q",
                class: "Sweep",
                digest: "d",
                locks: &locks,
                lock_ttl: Duration::from_secs(30),
                counter_ttl: Duration::from_secs(10),
                requeue_on_conflict: false,
                working_on: &working,
                lockinfo: "{}",
                resent: false,
            };
            let o = store::AcquireOptions {
                on_lock_conflict: locketd::locks::Policy::Park,
                ..store::AcquireOptions::default()
            };
            store::acquire_with(c, &slot(k), &req, Some(&o))
                .await
                .map(|a| {
                    assert!(matches!(a, store::AcquireOutcome::Conflict { .. }), "{a:?}");
                })
        }
        Step::FinishWake => {
            let record = format!("{{\"exception\":\"E\",\"payload\":{PAYLOAD}}}");
            finish(Finish::Failure(record)).await
        }
        Step::WakeDue => store::wake_due(c, k, 100, Duration::from_secs(1))
            .await
            .map(drop),
        Step::PurgeHoldWake => store::purge_holds(c, k, 100).await.map(drop),
        Step::Pause => store::set_paused(c, k, Some(&["q2".to_string(), "q".to_string()]), true)
            .await
            .map(drop),
        Step::ReservePaused | Step::ReserveCapped => {
            store::reserve(c, &slot(k), &random_hex(8), &["q".to_string()], false)
                .await
                .map(drop)
        }
        Step::FinishCapped => {
            let record = format!("{{\"exception\":\"E\",\"payload\":{PAYLOAD}}}");
            finish(Finish::Failure(record)).await
        }
        Step::Unpark => store::unpark(c, k, &["lock:L".to_string()], None)
            .await
            .map(drop),
        Step::RecoverRunning | Step::RecoverReserved => {
            let _: redis::Value = redis::cmd("DEL")
                .arg(k.alive(PROCESS))
                .query_async(c)
                .await
                .unwrap();
            let config = Config::parse("queues = \"q\"\n", "sweep").unwrap();
            let mut report = JanitorReport::default();
            recover_process(c, k, &config, PROCESS, "died", &mut report).await
        }
    };
    r.map_err(|e| e.to_string())
}

/// Every key of the test's server: its type and a dump of its value.
async fn snapshot(c: &mut Conn) -> BTreeMap<String, (String, Vec<u8>)> {
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query_async(c).await.unwrap();
    let mut out = BTreeMap::new();
    for name in names {
        let t: String = redis::cmd("TYPE").arg(&name).query_async(c).await.unwrap();
        let d: Vec<u8> = redis::cmd("DUMP").arg(&name).query_async(c).await.unwrap();
        out.insert(name, (t, d));
    }
    out
}

/// How many places hold the job: list elements, hash fields and zset members whose text
/// contains the payload (inflight records, queues, `delayed`, failure records).
async fn places(c: &mut Conn) -> usize {
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query_async(c).await.unwrap();
    let mut n = 0;
    let marker = "Sweep";
    for name in names {
        let t: String = redis::cmd("TYPE").arg(&name).query_async(c).await.unwrap();
        let values: Vec<String> = match t.as_str() {
            "list" | "zset" => redis::cmd(if t == "list" { "LRANGE" } else { "ZRANGE" })
                .arg(&name)
                .arg(0)
                .arg(-1)
                .query_async(c)
                .await
                .unwrap(),
            "hash" if name.contains(":locket:inflight:") => redis::cmd("HGET")
                .arg(&name)
                .arg("payload")
                .query_async::<Option<String>>(c)
                .await
                .unwrap()
                .into_iter()
                .collect(),
            _ => Vec::new(),
        };
        n += values.iter().filter(|v| v.contains(marker)).count();
    }
    n
}

/// Runs `step` against `spoil` (applied after the step's state is built) and checks S-6 and
/// NEVER-2. `what` names the case in failures.
async fn check(step: Step, what: &str, spoil: impl AsyncFnOnce(&mut Conn)) {
    check_with(step, what, true, spoil).await
}

/// [`check`]; `atomic: false` checks NEVER-2 alone (for locketd's own keys).
async fn check_with(step: Step, what: &str, atomic: bool, spoil: impl AsyncFnOnce(&mut Conn)) {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let p = prepare(c, &k, step).await;
    let visible_before = places(c).await;
    spoil(c).await;
    let before = snapshot(c).await;
    let result = run(c, &k, step, &p).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(c)
        .await
        .unwrap();
    if let (Err(e), true) = (&result, atomic) {
        assert_eq!(
            snapshot(c).await,
            before,
            "{step:?} with {what}: it raised ({e}) after writing"
        );
    }
    let visible = places(c).await;
    // Enqueue, Push, PushAt and Fire have no job before they run; every other step keeps its one job (or,
    // the lock's steps, none) visible.
    let want = if matches!(step, Step::Enqueue | Step::Push | Step::PushAt | Step::Fire) {
        usize::from(result.is_ok())
    } else {
        visible_before
    };
    assert_eq!(
        visible, want,
        "{step:?} with {what} ({result:?}): the job is in {visible} places"
    );
}

// S-6, NEVER-2: a key of another type than the step expects.
#[tokio::test]
async fn s6_every_step_with_a_key_of_the_wrong_type_applies_or_changes_nothing() {
    for (step, names) in STEPS {
        for name in *names {
            let key = format!("{NS}:{name}");
            let k2 = key.clone();
            check(
                *step,
                &format!("{key} a string"),
                async move |c: &mut Conn| {
                    cmd(c, &["DEL", &k2]).await;
                    cmd(c, &["SET", &k2, "another tool's"]).await;
                },
            )
            .await;
            let k2 = key.clone();
            check(
                *step,
                &format!("{key} a hash"),
                async move |c: &mut Conn| {
                    cmd(c, &["DEL", &k2]).await;
                    cmd(c, &["HSET", &k2, "f", "v"]).await;
                },
            )
            .await;
        }
    }
}

// NEVER-2, K-1: one of locketd's own keys spoiled by hand (a string, then a list): whatever
// the step did, the job is still in as many places as before.
#[tokio::test]
async fn never2_every_step_with_an_own_key_of_the_wrong_type_keeps_the_job_visible() {
    for (step, names) in OWN_KEYS {
        for name in *names {
            for (kind, value) in [("a string", None), ("a list", Some("x"))] {
                let key = format!("{NS}:{name}");
                let k2 = key.clone();
                check_with(
                    *step,
                    &format!("{key} {kind}"),
                    false,
                    async move |c: &mut Conn| {
                        cmd(c, &["DEL", &k2]).await;
                        match value {
                            None => cmd(c, &["SET", &k2, "spoiled"]).await,
                            Some(v) => cmd(c, &["RPUSH", &k2, v]).await,
                        };
                    },
                )
                .await;
            }
        }
    }
}

// S-6, NEVER-2: Redis full (maxmemory reached, noeviction): the first write of a step is
// refused, so a refused step has written nothing.
#[tokio::test]
async fn s6_every_step_on_a_full_redis_applies_or_changes_nothing() {
    for (step, _) in STEPS {
        check(*step, "maxmemory reached", async |c: &mut Conn| {
            cmd(c, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).await;
            cmd(c, &["CONFIG", "SET", "maxmemory", "1"]).await;
        })
        .await;
    }
}

// S-6, E-3: PARK's one key is the job's inflight record: spoiled (another type), PARK raises
// and has written nothing.
#[tokio::test]
async fn park_on_a_record_of_another_type_changes_nothing() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let p = prepare(c, &k, Step::Park).await;
    let record = k.inflight(SLOT);
    for spoil in [
        &["SET", record.as_str(), "x"][..],
        &["RPUSH", record.as_str(), "x"],
    ] {
        cmd(c, &["DEL", &record]).await;
        cmd(c, spoil).await;
        let before = snapshot(c).await;
        let r = run(c, &k, Step::Park, &p).await;
        assert!(r.is_err(), "{spoil:?}: {r:?}");
        assert_eq!(
            snapshot(c).await,
            before,
            "{spoil:?}: PARK wrote before raising"
        );
    }
}
