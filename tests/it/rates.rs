//! Keyed rate limits (rate-limits.md RL-1..RL-6): the rate check inside ACQUIRE at the script
//! level, and through the real daemon (fleet-wide accuracy, a lock and a rate on one class,
//! wrong-typed rate keys), against a real redis-server.

use std::time::Duration;

use locketd::locks::{Policy, RateSpec};
use locketd::store::{self, AcquireOptions, AcquireOutcome, ConflictKind, Finish, Settled};
use redis::aio::MultiplexedConnection as Conn;
use serde_json::json;

use crate::policies::{cmd, exists, keys, lrange, reserve_next, reserved, server_ms, spec};
use crate::support::RedisServer;

fn rate(key: &str, limit: u32, period_ms: u64, spread: bool) -> RateSpec {
    RateSpec {
        key: key.to_string(),
        limit,
        period: Duration::from_millis(period_ms),
        spread,
    }
}

fn with_rates(rates: &[RateSpec]) -> AcquireOptions<'_> {
    AcquireOptions {
        on_lock_conflict: Policy::Park,
        rates,
        ..AcquireOptions::default()
    }
}

async fn zcard(c: &mut Conn, key: &str) -> i64 {
    cmd(c, &["ZCARD", key]).await
}

async fn llen(c: &mut Conn, key: &str) -> i64 {
    cmd(c, &["LLEN", key]).await
}

fn started(o: &AcquireOutcome) -> bool {
    matches!(o, AcquireOutcome::Started { .. })
}

// RL-1, RL-3: `limit` starts of a key pass; the next is parked on `rate:<key>` with the time
// its start is allowed (the oldest start + period) as its index score, and nothing else moves.
#[tokio::test]
async fn rl1_rl3_the_limit_passes_and_the_next_start_parks_until_its_allowed_time() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let rates = [rate("api:7", 2, 60_000, false)];
    let before = server_ms(&mut c).await;
    for (slot, arg) in [("ra", "a"), ("rb", "b")] {
        let mut j = reserved(&mut c, slot, "q", "Call", json!([7, arg])).await;
        assert!(started(&j.acquire(&mut c, &[], &with_rates(&rates)).await));
    }
    let log = k.locket("rate:api:7");
    assert_eq!(zcard(&mut c, &log).await, 2);
    let oldest: Vec<String> = cmd(&mut c, &["ZRANGE", &log, "0", "0", "WITHSCORES"]).await;
    let oldest: u64 = oldest[1].parse().unwrap();
    assert!(oldest >= before, "Redis's clock");
    let ttl: i64 = cmd(&mut c, &["PTTL", &log]).await;
    assert!(
        ttl > 59_000 && ttl <= 60_000,
        "a period after the last start: {ttl}"
    );
    let mut third = reserved(&mut c, "rc", "q", "Call", json!([7, "c"])).await;
    match third.acquire(&mut c, &[], &with_rates(&rates)).await {
        AcquireOutcome::Conflict { action, conflicts } => {
            assert_eq!(action, Settled::Parked);
            assert_eq!(conflicts[0].kind, ConflictKind::Rate);
            assert_eq!(conflicts[0].id, "api:7");
            assert_eq!(conflicts[0].earliest_deadline_ms, oldest + 60_000);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        zcard(&mut c, &log).await,
        2,
        "a refused job records no start"
    );
    assert!(!exists(&mut c, &third.inflight()).await);
    assert_eq!(llen(&mut c, &k.queue("q")).await, 0);
    assert_eq!(llen(&mut c, &k.locket("parked:rate:api:7")).await, 1);
    let score: Option<u64> = cmd(&mut c, &["ZSCORE", &k.locket("parked"), "rate:api:7"]).await;
    assert_eq!(score, Some(oldest + 60_000), "indexed at its allowed time");
    // Not due yet: the janitor's look wakes nobody.
    let w = store::wake_due(&mut c, &k, 100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(w.woken, 0);
    assert!(w.pending);
}

// RL-3: at the allowed time the janitor wakes as many parked jobs as the key then allows, to
// the heads of their queues; the others stay parked until the next allowed time.
#[tokio::test]
async fn rl3_the_janitor_wakes_as_many_as_the_key_allows() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let rates = [rate("api:8", 2, 300, false)];
    for i in 0..6 {
        let mut j = reserved(&mut c, &format!("s{i}"), "q", "Call", json!([8, i])).await;
        j.acquire(&mut c, &[], &with_rates(&rates)).await;
    }
    assert_eq!(zcard(&mut c, &k.locket("rate:api:8")).await, 2);
    assert_eq!(llen(&mut c, &k.locket("parked:rate:api:8")).await, 4);
    tokio::time::sleep(Duration::from_millis(350)).await;
    let w = store::wake_due(&mut c, &k, 100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(w.woken, 2, "{w:?}");
    let woken = lrange(&mut c, &k.queue("q")).await;
    assert_eq!(woken.len(), 2);
    assert!(
        woken[0].contains("[8,2]") && woken[1].contains("[8,3]"),
        "parking order: {woken:?}"
    );
    assert_eq!(llen(&mut c, &k.locket("parked:rate:api:8")).await, 2);
    // A second look before the woken jobs started wakes nobody more (due again shortly).
    let w = store::wake_due(&mut c, &k, 100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(w.woken, 0, "{w:?}");
    assert!(
        w.pending && w.next_in <= Duration::from_millis(100),
        "{w:?}"
    );
    // The woken jobs start; the log is full again, so the rest wait for the next period.
    for i in 0..2 {
        let mut j = reserve_next(&mut c, &format!("w{i}"), "q").await;
        assert!(started(&j.acquire(&mut c, &[], &with_rates(&rates)).await));
    }
}

// RL-2: all or nothing with locks. A job refused by its lock records no start; a job refused
// by its rate takes no lock.
#[tokio::test]
async fn rl2_a_lock_refusal_consumes_no_rate_and_a_rate_refusal_takes_no_lock() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let rates = [rate("api:9", 1, 60_000, false)];
    let lock = [spec("user:9", 1)];
    let mut holder = reserved(&mut c, "h", "q", "Other", json!([9])).await;
    assert!(started(
        &holder.acquire(&mut c, &lock, &with_rates(&[])).await
    ));
    let mut a = reserved(&mut c, "a", "q", "Call", json!([9, "a"])).await;
    match a.acquire(&mut c, &lock, &with_rates(&rates)).await {
        AcquireOutcome::Conflict { action, conflicts } => {
            assert_eq!(action, Settled::Parked);
            assert_eq!(conflicts[0].kind, ConflictKind::Lock, "parked on the lock");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !exists(&mut c, &k.locket("rate:api:9")).await,
        "no rate consumed"
    );
    assert!(holder.finish(&mut c, &lock, Finish::Success, &[]).await);
    // The rate is used up by another job of the key (no lock).
    let mut b = reserved(&mut c, "b", "q2", "Call", json!([9, "b"])).await;
    assert!(started(&b.acquire(&mut c, &[], &with_rates(&rates)).await));
    // a was woken with the lock handed to it; its rate refuses it now: no lock kept.
    let mut a2 = reserve_next(&mut c, "a", "q").await;
    assert_eq!(a2.payload, a.payload);
    match a2.acquire(&mut c, &lock, &with_rates(&rates)).await {
        AcquireOutcome::Conflict { action, conflicts } => {
            assert_eq!(action, Settled::Parked);
            assert_eq!(conflicts.len(), 1);
            assert_eq!(conflicts[0].kind, ConflictKind::Rate);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !exists(&mut c, &k.lock("user:9")).await,
        "the unit handed to it was freed, not kept"
    );
    assert_eq!(llen(&mut c, &k.locket("parked:rate:api:9")).await, 1);
}

// RL-1 spread: starts at least period / limit apart, even with the window free.
#[tokio::test]
async fn rl1_spread_spaces_the_starts() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let rates = [rate("smtp-to:x", 3, 60_000, true)];
    let mut a = reserved(&mut c, "a", "q", "Mail", json!(["x", 1])).await;
    assert!(started(&a.acquire(&mut c, &[], &with_rates(&rates)).await));
    let mut b = reserved(&mut c, "b", "q", "Mail", json!(["x", 2])).await;
    match b.acquire(&mut c, &[], &with_rates(&rates)).await {
        AcquireOutcome::Conflict { conflicts, .. } => {
            let now = server_ms(&mut c).await;
            let at = conflicts[0].earliest_deadline_ms;
            assert!(at > now + 19_000 && at <= now + 20_000, "{at} vs {now}");
        }
        other => panic!("{other:?}"),
    }
}

// RL-1 + S-6: a rate log of another type stops ACQUIRE before its first write: the job stays
// reserved (in exactly one place), no lock is taken, nothing is parked.
#[tokio::test]
async fn rl1_a_wrong_typed_rate_key_refuses_acquire_having_changed_nothing() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let log = k.locket("rate:api:10");
    let _: () = cmd(&mut c, &["SET", &log, "spoiled"]).await;
    let rates = [rate("api:10", 5, 1000, false)];
    let lock = [spec("user:10", 1), spec("pool", 3)];
    let j = reserved(&mut c, "a", "q", "Call", json!([10])).await;
    let working = "{}".to_string();
    let req = store::AcquireRequest {
        rid: &j.rid,
        token: "00112233445566778899aabbccddeeff",
        queue: "q",
        class: "Call",
        digest: &j.digest,
        locks: &lock,
        lock_ttl: Duration::from_secs(10),
        counter_ttl: Duration::from_secs(5),
        requeue_on_conflict: true,
        working_on: &working,
        lockinfo: "{}",
        resent: false,
    };
    let err = store::acquire_with(&mut c, &j.slot(), &req, Some(&with_rates(&rates)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    let state: Option<String> = cmd(&mut c, &["HGET", &j.inflight(), "state"]).await;
    assert_eq!(
        state.as_deref(),
        Some("reserved"),
        "still reserved, nowhere else"
    );
    assert!(!exists(&mut c, &k.lock("user:10")).await);
    assert!(!exists(&mut c, &k.lock("pool")).await);
    assert_eq!(llen(&mut c, &k.queue("q")).await, 0);
    assert!(!exists(&mut c, &k.locket("parked:rate:api:10")).await);
}
