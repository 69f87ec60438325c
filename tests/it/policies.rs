//! Conflict policies, per-key limits, fencing and locket stats at the script level
//! (locking-semantics.md §6 P-1..P-6, §7 L-10/L-11, §10 O-3), against a real redis-server.
//! Each test names the rules it covers. Helpers here are shared with `holds.rs`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use locketd::locks::canonical::digest as payload_digest;
use locketd::locks::LockSpec;
use locketd::locks::{DelaySettings, Policy};
use locketd::resque::failure::FailureBackend;
use locketd::resque::failure::{working_on, JobFailure};
use locketd::resque::keys::Keys;
use locketd::store::random_hex;
use locketd::store::{
    self, AcquireOptions, AcquireOutcome, AcquireRequest, ConflictKind, Finish, FinishHolds,
    FinishRequest, Reserved, Settled, SlotRef,
};
use redis::aio::MultiplexedConnection as Conn;
use serde_json::{json, Value};

use crate::support::RedisServer;

pub(crate) const NS: &str = "resque";

pub(crate) fn keys() -> Keys {
    Keys::new(NS)
}

pub(crate) async fn cmd<T: redis::FromRedisValue>(c: &mut Conn, args: &[&str]) -> T {
    let mut q = redis::cmd(args[0]);
    for a in &args[1..] {
        q.arg(*a);
    }
    q.query_async(c)
        .await
        .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
}

pub(crate) async fn server_ms(c: &mut Conn) -> u64 {
    let (s, us): (u64, u64) = cmd(c, &["TIME"]).await;
    s * 1000 + us / 1000
}

pub(crate) async fn int(c: &mut Conn, key: &str) -> i64 {
    let v: Option<i64> = cmd(c, &["GET", key]).await;
    v.unwrap_or(0)
}

pub(crate) async fn stat(c: &mut Conn, event: &str) -> i64 {
    int(c, &keys().stat(event)).await
}

pub(crate) fn spec(id: &str, limit: u32) -> LockSpec {
    LockSpec {
        id: id.to_string(),
        limit,
    }
}

/// A job reserved on its own slot: what the supervisor holds between RESERVE and FINISH.
pub(crate) struct Job {
    pub keys: Keys,
    pub slot_key: String,
    pub worker_id: String,
    pub queue: String,
    pub payload: String,
    pub class: String,
    pub digest: String,
    pub rid: String,
    pub token: String,
}

impl Job {
    pub fn slot(&self) -> SlotRef<'_> {
        SlotRef {
            keys: &self.keys,
            slot_key: &self.slot_key,
            worker_id: &self.worker_id,
        }
    }

    pub fn inflight(&self) -> String {
        self.keys.inflight(&self.slot_key)
    }

    /// ACQUIRE with options (a fresh token each call, as each attempt gets one).
    pub async fn acquire(
        &mut self,
        c: &mut Conn,
        locks: &[LockSpec],
        opts: &AcquireOptions<'_>,
    ) -> AcquireOutcome {
        self.acquire_as(c, locks, opts, false).await
    }

    /// [`acquire`](Self::acquire), sent again after an attempt whose reply was lost when
    /// `resent` (its rid is then checked even while the process lease is held, A-6 step 1).
    pub async fn acquire_as(
        &mut self,
        c: &mut Conn,
        locks: &[LockSpec],
        opts: &AcquireOptions<'_>,
        resent: bool,
    ) -> AcquireOutcome {
        self.token = random_hex(16);
        let working = working_on(
            &self.payload,
            &self.queue,
            SystemTime::now(),
            &self.worker_id,
        );
        let info = json!({"process": self.slot_key, "slot": 0, "resque_worker": self.worker_id,
                          "queue": self.queue, "class": self.class, "digest": self.digest})
        .to_string();
        let req = AcquireRequest {
            rid: &self.rid,
            token: &self.token,
            queue: &self.queue,
            class: &self.class,
            digest: &self.digest,
            locks,
            lock_ttl: Duration::from_secs(10),
            counter_ttl: Duration::from_secs(5),
            requeue_on_conflict: true,
            working_on: &working,
            lockinfo: &info,
            resent,
        };
        store::acquire_with(c, &self.slot(), &req, Some(opts))
            .await
            .expect("ACQUIRE")
    }

    /// FINISH with the given hold releases.
    pub async fn finish(
        &self,
        c: &mut Conn,
        locks: &[LockSpec],
        outcome: Finish,
        release: &[String],
    ) -> bool {
        self.finish_as(c, locks, outcome, release, false).await
    }

    /// [`finish`](Self::finish), sent again after an attempt whose reply was lost when
    /// `resent`.
    pub async fn finish_as(
        &self,
        c: &mut Conn,
        locks: &[LockSpec],
        outcome: Finish,
        release: &[String],
        resent: bool,
    ) -> bool {
        let req = FinishRequest {
            rid: &self.rid,
            token: &self.token,
            queue: &self.queue,
            locks,
            outcome: &outcome,
            backend: FailureBackend::Redis,
        };
        let holds = FinishHolds {
            class: &self.class,
            digest: &self.digest,
            release,
            resent,
            unique: "",
        };
        store::finish_with(c, &self.slot(), &req, &holds)
            .await
            .expect("FINISH")
    }
}

pub(crate) fn payload_of(class: &str, args: &Value) -> String {
    json!({"class": class, "args": args}).to_string()
}

/// Pushes `class(args)` to `queue` and reserves it on slot `slot`.
pub(crate) async fn reserved(
    c: &mut Conn,
    slot: &str,
    queue: &str,
    class: &str,
    args: Value,
) -> Job {
    let k = keys();
    let payload = payload_of(class, &args);
    let _: i64 = cmd(c, &["RPUSH", &k.queue(queue), &payload]).await;
    let _: i64 = cmd(c, &["SADD", &k.queues(), queue]).await;
    reserve_next(c, slot, queue).await
}

/// Reserves the head of `queue` on slot `slot`.
pub(crate) async fn reserve_next(c: &mut Conn, slot: &str, queue: &str) -> Job {
    let k = keys();
    let slot_key = format!("{slot}:0");
    let worker_id = format!("testhost:{slot}:{queue}");
    let sref = SlotRef {
        keys: &k,
        slot_key: &slot_key,
        worker_id: &worker_id,
    };
    crate::lock::mark_alive(c, &slot_key).await;
    match store::reserve(c, &sref, &random_hex(8), &[queue.to_string()], false)
        .await
        .expect("RESERVE")
    {
        Reserved::Job {
            queue,
            payload,
            rid,
            ..
        } => {
            let payload = String::from_utf8(payload).unwrap();
            let v: Value = serde_json::from_str(&payload).unwrap();
            let class = v["class"].as_str().unwrap().to_string();
            let digest = payload_digest(&class, &v["args"]);
            Job {
                keys: k.clone(),
                slot_key,
                worker_id,
                queue,
                payload,
                class,
                digest,
                rid,
                token: String::new(),
            }
        }
        other => panic!("expected a job from {queue}, got {other:?}"),
    }
}

pub(crate) fn opts(policy: Policy) -> AcquireOptions<'static> {
    AcquireOptions {
        on_lock_conflict: policy,
        ..AcquireOptions::default()
    }
}

pub(crate) async fn lrange(c: &mut Conn, key: &str) -> Vec<String> {
    cmd(c, &["LRANGE", key, "0", "-1"]).await
}

pub(crate) async fn failures(c: &mut Conn) -> Vec<Value> {
    lrange(c, &keys().failed())
        .await
        .iter()
        .map(|r| serde_json::from_str(r).unwrap())
        .collect()
}

pub(crate) async fn exists(c: &mut Conn, key: &str) -> bool {
    let n: i64 = cmd(c, &["EXISTS", key]).await;
    n == 1
}

async fn started(c: &mut Conn, slot: &str, queue: &str, id: &str, limit: u32) -> Job {
    let mut j = reserved(c, slot, queue, "Holder", json!([slot])).await;
    let out = j
        .acquire(c, &[spec(id, limit)], &opts(Policy::Requeue))
        .await;
    assert!(matches!(out, AcquireOutcome::Started { .. }), "{out:?}");
    j
}

fn failure_record(j: &Job) -> String {
    JobFailure::new("Locket::LockConflict", "__LOCKET_CONFLICT__").record(
        &j.payload,
        &j.worker_id,
        &j.queue,
        SystemTime::now(),
    )
}

// ---------------------------------------------------------------------------------------------

// locking-semantics.md P-1, A-6 step 4, L-4: every conflicting lock is reported and every one
// of them records the queue in its blocked set.
#[tokio::test]
async fn p1_requeue_reports_every_conflicting_lock_and_marks_each_blocked_set() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _a = started(c, "ha", "hq", "X", 1).await;
    let _b = started(c, "hb", "hq", "Y", 1).await;
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    let out = j
        .acquire(
            c,
            &[spec("X", 1), spec("free", 1), spec("Y", 1)],
            &opts(Policy::Requeue),
        )
        .await;
    let AcquireOutcome::Conflict { action, conflicts } = out else {
        panic!("{out:?}")
    };
    assert_eq!(action, Settled::Requeued);
    let ids: Vec<&str> = conflicts.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["X", "Y"]);
    assert!(conflicts
        .iter()
        .all(|c| c.kind == ConflictKind::Lock && c.holders == 1 && c.limit == 1));
    assert_eq!(lrange(c, &k.queue("q")).await, vec![j.payload.clone()]);
    assert_eq!(int(c, &k.counter("q")).await, 1);
    for id in ["X", "Y"] {
        let members: Vec<String> = cmd(c, &["SMEMBERS", &k.blocked_lock(id)]).await;
        assert_eq!(members, ["q"], "blocked set of {id}");
    }
    assert!(!exists(c, &k.lock("free")).await, "no lock taken");
    assert_eq!(stat(c, "requeued").await, 1);
    assert_eq!(stat(c, "conflict").await, 1);
}

// locking-semantics.md P-2, A-17, NEVER-2, NEVER-10: discard drops the job on purpose, counts it,
// records no failure, leaves no counter and no Resque stat.
#[tokio::test]
async fn p2_discard_drops_the_job_counts_it_and_records_no_failure() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "user:1", 1).await;
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    let out = j
        .acquire(c, &[spec("user:1", 1)], &opts(Policy::Discard))
        .await;
    assert!(
        matches!(&out, AcquireOutcome::Conflict { action: Settled::Discarded, conflicts } if conflicts[0].id == "user:1"),
        "{out:?}"
    );
    assert!(!exists(c, &j.inflight()).await);
    assert_eq!(lrange(c, &k.queue("q")).await, Vec::<String>::new());
    assert!(failures(c).await.is_empty());
    assert!(!exists(c, &k.counter("q")).await);
    assert_eq!(stat(c, "discarded").await, 1);
    assert_eq!(int(c, &k.stat_processed()).await, 0);
    assert_eq!(int(c, &k.stat_failed()).await, 0);
    assert!(
        !exists(c, &k.worker(&j.worker_id)).await,
        "no working-on record"
    );
}

// locking-semantics.md P-3: a wait keeps the reservation (state "waiting", counted once), then
// the last try settles it by wait_then in the same script and counts wait_timeout.
#[tokio::test]
async fn p3_wait_keeps_the_reservation_and_the_last_try_applies_wait_then() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "L", 1).await;
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    for _ in 0..3 {
        let out = j.acquire(c, &[spec("L", 1)], &opts(Policy::Wait)).await;
        assert!(
            matches!(
                out,
                AcquireOutcome::Conflict {
                    action: Settled::None,
                    ..
                }
            ),
            "{out:?}"
        );
        let state: String = cmd(c, &["HGET", &j.inflight(), "state"]).await;
        assert_eq!(state, "waiting");
    }
    assert_eq!(stat(c, "waited").await, 1, "counted once per reservation");
    assert!(!exists(c, &k.counter("q")).await, "A-17: waits never count");
    let mut last = opts(Policy::Fail);
    last.last_wait = true;
    let rec = failure_record(&j);
    last.failure_record = Some(&rec);
    let out = j.acquire(c, &[spec("L", 1)], &last).await;
    assert!(
        matches!(
            out,
            AcquireOutcome::Conflict {
                action: Settled::Failed { attempt: 0 },
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(stat(c, "wait_timeout").await, 1);
    assert_eq!(failures(c).await.len(), 1);
}

// locking-semantics.md P-4: min(base × 2^(attempt−1), max) × (1 + r), jitter after the cap; the
// member carries rid, queue, payload, reason, resource and attempt; no counter is touched.
#[tokio::test]
async fn p4_delay_backoff_grows_and_is_capped() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "L", 1).await;
    let d = DelaySettings {
        base: Duration::from_millis(1000),
        max: Duration::from_millis(4000),
        jitter: 0.5,
        max_delays: 0,
    };
    let mut seen = Vec::new();
    for attempt in 1..=5u64 {
        let mut j = reserved(c, "s1", "q", "J", json!([7])).await;
        let r = 0.25;
        let mut o = opts(Policy::Delay);
        o.delay = Some((d, r));
        let before = server_ms(c).await;
        let out = j.acquire(c, &[spec("L", 1)], &o).await;
        let after = server_ms(c).await;
        let AcquireOutcome::Conflict {
            action: Settled::Delayed { due_ms, attempt: a },
            ..
        } = out
        else {
            panic!("{out:?}")
        };
        assert_eq!(a, attempt);
        let expect = d.delay(attempt as u32, r).as_millis() as u64;
        assert!(
            due_ms >= before + expect && due_ms <= after + expect,
            "attempt {attempt}: due {due_ms} not in [{before}+{expect}, {after}+{expect}]"
        );
        seen.push(expect);
        assert!(!exists(c, &j.inflight()).await);
        // The member, as the janitor and `locketd delayed` read it.
        let members: Vec<(String, f64)> =
            cmd(c, &["ZRANGE", &k.delayed(), "0", "-1", "WITHSCORES"]).await;
        let (m, score) = members.last().unwrap().clone();
        let v: Value = serde_json::from_str(&m).unwrap();
        assert_eq!(v["rid"], j.rid.as_str());
        assert_eq!(v["queue"], "q");
        assert_eq!(v["payload"], j.payload.as_str());
        assert_eq!(v["reason"], "lock");
        assert_eq!(v["resource"], "L");
        assert_eq!(v["attempt"], attempt);
        assert_eq!(score as u64, due_ms);
        // Take it out again for the next round.
        let _: i64 = cmd(c, &["ZREM", &k.delayed(), &m]).await;
    }
    assert_eq!(
        seen,
        [1250, 2500, 5000, 5000, 5000],
        "doubling, capped at 4s × 1.25"
    );
    assert!(
        !exists(c, &k.counter("q")).await,
        "A-17: delays never count"
    );
    assert_eq!(stat(c, "delayed").await, 5);
    let ttl: i64 = cmd(c, &["PTTL", &k.attempts()]).await;
    assert!(ttl > 0 && ttl <= 7 * 86_400_000, "attempts PTTL {ttl}");
}

// locking-semantics.md P-4, P-5, NEVER-10: after max_delays the job fails as
// Locket::LockConflict with a message saying how many delays; Resque counts a failure but not a
// processed job; the attempt count is cleared.
#[tokio::test]
async fn p4_max_delays_then_fails_as_lock_conflict() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "L", 1).await;
    let d = DelaySettings {
        base: Duration::from_millis(100),
        max: Duration::from_millis(100),
        jitter: 0.0,
        max_delays: 2,
    };
    for attempt in 1..=3u64 {
        let mut j = reserved(c, "s1", "q", "J", json!(["x"])).await;
        let rec = failure_record(&j);
        let mut o = opts(Policy::Delay);
        o.delay = Some((d, 0.0));
        o.failure_record = Some(&rec);
        let out = j.acquire(c, &[spec("L", 1)], &o).await;
        match attempt {
            1 | 2 => assert!(
                matches!(out, AcquireOutcome::Conflict { action: Settled::Delayed { attempt: a, .. }, .. } if a == attempt),
                "{out:?}"
            ),
            _ => assert!(
                matches!(
                    out,
                    AcquireOutcome::Conflict {
                        action: Settled::Failed { attempt: 3 },
                        ..
                    }
                ),
                "{out:?}"
            ),
        }
        assert!(!exists(c, &j.inflight()).await);
    }
    let f = failures(c).await;
    assert_eq!(f.len(), 1);
    assert_eq!(f[0]["exception"], "Locket::LockConflict");
    let msg = f[0]["error"].as_str().unwrap();
    assert!(msg.contains("2 delays") && msg.contains("lock L"), "{msg}");
    assert_eq!(f[0]["payload"]["args"], json!(["x"]));
    assert_eq!(int(c, &k.stat_failed()).await, 1);
    assert_eq!(int(c, &k.stat_processed()).await, 0);
    let left: Option<String> = cmd(
        c,
        &["HGET", &k.attempts(), &payload_digest("J", &json!(["x"]))],
    )
    .await;
    assert_eq!(left, None);
    assert_eq!(stat(c, "conflict_failed").await, 1);
}

// locking-semantics.md P-4, R-3 step 1, NEVER-3: due members go back to the tail of their queue,
// each exactly once even when two promoters race; members not yet due stay.
#[tokio::test]
async fn p4_due_delayed_jobs_are_promoted_to_the_tail_exactly_once() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "L", 1).await;
    // Due 2 s after each is delayed: ample time for the "nothing due yet" check below even on
    // a stalled machine.
    let d = DelaySettings {
        base: Duration::from_secs(2),
        max: Duration::from_secs(2),
        jitter: 0.0,
        max_delays: 0,
    };
    let mut o = opts(Policy::Delay);
    o.delay = Some((d, 0.0));
    let mut payloads = Vec::new();
    for i in 0..5 {
        let mut j = reserved(c, "s1", "q", "J", json!([i])).await;
        payloads.push(j.payload.clone());
        assert!(matches!(
            j.acquire(c, &[spec("L", 1)], &o).await,
            AcquireOutcome::Conflict {
                action: Settled::Delayed { .. },
                ..
            }
        ));
    }
    // One far in the future.
    let mut late = o.clone();
    late.delay = Some((
        DelaySettings {
            base: Duration::from_secs(3600),
            max: Duration::from_secs(3600),
            ..d
        },
        0.0,
    ));
    let mut j = reserved(c, "s1", "q", "Late", json!([])).await;
    assert!(matches!(
        j.acquire(c, &[spec("L", 1)], &late).await,
        AcquireOutcome::Conflict { .. }
    ));
    let _: i64 = cmd(c, &["RPUSH", &k.queue("q"), "already-there"]).await;
    assert_eq!(
        store::promote_delayed(c, &k, 100, None).await.unwrap(),
        0,
        "nothing due yet"
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let mut c2 = server.conn().await;
    let k2 = k.clone();
    let (a, b) = tokio::join!(
        store::promote_delayed(c, &k, 100, None),
        store::promote_delayed(&mut c2, &k2, 100, None)
    );
    assert_eq!(a.unwrap() + b.unwrap(), 5);
    let mut expect = vec!["already-there".to_string()];
    expect.extend(payloads);
    assert_eq!(lrange(c, &k.queue("q")).await, expect, "tail, in due order");
    let n: i64 = cmd(c, &["ZCARD", &k.delayed()]).await;
    assert_eq!(n, 1, "the late one stays");
    assert_eq!(stat(c, "promoted").await, 5);
}

// locking-semantics.md A-8, P-4: a start of the digest clears its delay attempts.
#[tokio::test]
async fn p4_a_start_clears_the_digests_delay_attempts() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let h = started(c, "h", "hq", "L", 1).await;
    let d = DelaySettings {
        base: Duration::from_millis(100),
        max: Duration::from_millis(100),
        jitter: 0.0,
        max_delays: 0,
    };
    let mut o = opts(Policy::Delay);
    o.delay = Some((d, 0.0));
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    j.acquire(c, &[spec("L", 1)], &o).await;
    let n: Option<i64> = cmd(c, &["HGET", &k.attempts(), &j.digest]).await;
    assert_eq!(n, Some(1));
    assert!(h.finish(c, &[spec("L", 1)], Finish::Success, &[]).await);
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    assert!(matches!(
        j.acquire(c, &[spec("L", 1)], &o).await,
        AcquireOutcome::Started { .. }
    ));
    let n: Option<i64> = cmd(c, &["HGET", &k.attempts(), &j.digest]).await;
    assert_eq!(n, None);
}

// locking-semantics.md P-5, NEVER-10: fail records Locket::LockConflict naming the resource,
// its holders and the limit; failure stats yes, processed no.
#[tokio::test]
async fn p5_fail_records_a_lock_conflict_naming_resource_holders_and_limit() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _a = started(c, "ha", "hq", "gpu", 2).await;
    let _b = started(c, "hb", "hq", "gpu", 2).await;
    let mut j = reserved(c, "s1", "q", "Render", json!([{"t": 1}])).await;
    let rec = failure_record(&j);
    let mut o = opts(Policy::Fail);
    o.failure_record = Some(&rec);
    let out = j.acquire(c, &[spec("gpu", 2)], &o).await;
    assert!(
        matches!(
            out,
            AcquireOutcome::Conflict {
                action: Settled::Failed { attempt: 0 },
                ..
            }
        ),
        "{out:?}"
    );
    let f = failures(c).await;
    assert_eq!(f.len(), 1);
    assert_eq!(f[0]["exception"], "Locket::LockConflict");
    assert_eq!(f[0]["error"], "lock gpu is held by 2 of limit 2");
    assert_eq!(f[0]["queue"], "q");
    assert_eq!(f[0]["worker"], j.worker_id.as_str());
    assert_eq!(int(c, &k.stat_failed()).await, 1);
    assert_eq!(int(c, &k.stat_failed_by(&j.worker_id)).await, 1);
    assert_eq!(int(c, &k.stat_processed()).await, 0);
    assert!(!exists(c, &j.inflight()).await);
    assert!(!exists(c, &k.counter("q")).await);
}

// locking-semantics.md P-6, R-6, A-6 step 1: no policy acts on a reservation that is no longer
// the slot's. The rid is read when the process lease is gone (as recovery requires, R-4) or the
// ACQUIRE is sent again after a lost reply; both are tried.
#[tokio::test]
async fn p6_every_policy_acts_only_if_the_rid_still_matches() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let _h = started(c, "h", "hq", "L", 1).await;
    let policies = [
        Policy::Requeue,
        Policy::Discard,
        Policy::Delay,
        Policy::Fail,
        Policy::Wait,
    ];
    for (policy, resent) in policies.into_iter().flat_map(|p| [(p, false), (p, true)]) {
        let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
        if !resent {
            let _: i64 = cmd(c, &["DEL", &k.alive("s1")]).await;
        }
        let real = j.rid.clone();
        j.rid = random_hex(8);
        let rec = failure_record(&j);
        let mut o = opts(policy);
        o.failure_record = Some(&rec);
        o.delay = Some((
            DelaySettings {
                base: Duration::from_secs(1),
                max: Duration::from_secs(1),
                jitter: 0.0,
                max_delays: 0,
            },
            0.0,
        ));
        assert_eq!(
            j.acquire_as(c, &[spec("L", 1)], &o, resent).await,
            AcquireOutcome::Missing,
            "{policy:?}, resent: {resent}"
        );
        let rid: String = cmd(c, &["HGET", &j.inflight(), "rid"]).await;
        assert_eq!(rid, real);
        let _: i64 = cmd(c, &["DEL", &j.inflight()]).await;
    }
    assert!(failures(c).await.is_empty());
    assert!(!exists(c, &k.delayed()).await);
    assert!(!exists(c, &k.counter("q")).await);
}

// locking-semantics.md L-10, T-5: fencing numbers grow per lock id, are stored in lockinfo and
// handed back; lockinfo keeps the full rendered text of a hashed id.
#[tokio::test]
async fn l10_fencing_numbers_grow_per_lock_id_and_lockinfo_keeps_the_source() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let long = format!("h:{}", "0".repeat(64));
    let sources = vec!["a".to_string(), "x".repeat(250)];
    let locks = [spec("a", 1), spec(&long, 1)];
    let mut seen = Vec::new();
    for i in 0..3 {
        let mut j = reserved(c, "s1", "q", "F", json!([i])).await;
        let o = AcquireOptions {
            fencing: true,
            sources: &sources,
            ..opts(Policy::Requeue)
        };
        let AcquireOutcome::Started { fences, .. } = j.acquire(c, &locks, &o).await else {
            panic!("not started")
        };
        let info: String = cmd(
            c,
            &[
                "EVAL",
                crate::support::LOCK_INFO_LUA,
                "2",
                &k.lock(&long),
                &k.lockinfo(&long),
                &j.token,
            ],
        )
        .await;
        let info: Value = serde_json::from_str(&info).unwrap();
        assert_eq!(info["fence"], fences[1]);
        assert_eq!(info["lock_id_source"], sources[1].as_str());
        assert_eq!(info["lock_id"], long.as_str());
        seen.push(fences);
        assert!(j.finish(c, &locks, Finish::Success, &[]).await);
    }
    assert_eq!(seen, vec![vec![1, 1], vec![2, 2], vec![3, 3]]);
    let f: HashMap<String, i64> = cmd(c, &["HGETALL", &k.fence()]).await;
    assert_eq!(f["a"], 3);
}

// locking-semantics.md L-11, C-3: a lower limit evicts nobody; new acquisitions wait until the
// live count is below it.
#[tokio::test]
async fn l11_lowering_a_limit_evicts_nobody() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let h1 = started(c, "h1", "hq", "L", 3).await;
    let h2 = started(c, "h2", "hq", "L", 3).await;
    let _h3 = started(c, "h3", "hq", "L", 3).await;
    let mut j = reserved(c, "s1", "q", "J", json!([1])).await;
    let out = j.acquire(c, &[spec("L", 2)], &opts(Policy::Wait)).await;
    assert!(
        matches!(&out, AcquireOutcome::Conflict { conflicts, .. } if conflicts[0].holders == 3 && conflicts[0].limit == 2),
        "{out:?}"
    );
    let n: i64 = cmd(c, &["ZCARD", &k.lock("L")]).await;
    assert_eq!(n, 3, "nobody evicted");
    assert!(h1.finish(c, &[spec("L", 3)], Finish::Success, &[]).await);
    assert!(matches!(
        j.acquire(c, &[spec("L", 2)], &opts(Policy::Wait)).await,
        AcquireOutcome::Conflict { .. }
    ));
    assert!(h2.finish(c, &[spec("L", 3)], Finish::Success, &[]).await);
    assert!(matches!(
        j.acquire(c, &[spec("L", 2)], &opts(Policy::Wait)).await,
        AcquireOutcome::Started { .. }
    ));
}

// locking-semantics.md O-3: events are counted inside the scripts, in stat:<event> and in the
// current minute bucket (with the class), which expires within 8 h.
#[tokio::test]
async fn o3_events_are_counted_in_totals_and_per_minute_buckets() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let mut j = reserved(c, "s1", "q", "Count::Me", json!([1])).await;
    let locks = [spec("c", 1)];
    assert!(matches!(
        j.acquire(c, &locks, &opts(Policy::Requeue)).await,
        AcquireOutcome::Started { .. }
    ));
    let (_, lost) = store::extend(c, &k, &j.token, &locks, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(lost, vec![false]);
    assert!(j.finish(c, &locks, Finish::Success, &[]).await);
    for (ev, n) in [
        ("reserved", 1),
        ("acquired", 1),
        ("started", 1),
        ("extended", 1),
        ("released", 1),
        ("conflict", 0),
    ] {
        assert_eq!(stat(c, ev).await, n, "stat:{ev}");
    }
    let minute = server_ms(c).await / 60_000;
    let mut bucket: HashMap<String, i64> = cmd(c, &["HGETALL", &k.metrics(minute)]).await;
    if bucket.is_empty() {
        bucket = cmd(c, &["HGETALL", &k.metrics(minute - 1)]).await;
    }
    assert_eq!(bucket.get("started"), Some(&1), "{bucket:?}");
    assert_eq!(bucket.get("started|Count::Me"), Some(&1), "{bucket:?}");
    assert_eq!(bucket.get("released|Count::Me"), Some(&1), "{bucket:?}");
    let ttl: i64 = cmd(c, &["PTTL", &k.metrics(minute)]).await;
    assert!(ttl == -2 || (ttl > 0 && ttl <= 8 * 3_600_000), "PTTL {ttl}");
}
