//! Dependency holds and `locked_by` at the script level (locking-semantics.md §8 D-1..D-10,
//! NEVER-6, A-14), against a real redis-server. Each test names the rules it covers.

use std::collections::HashMap;
use std::time::Duration;

use locketd::locks::{DelaySettings, Policy};
use locketd::store::{self, AcquireOptions, AcquireOutcome, ConflictKind, Finish, Settled};
use redis::aio::MultiplexedConnection as Conn;
use serde_json::json;

use crate::policies::{
    cmd, exists, int, keys, lrange, payload_of, reserve_next, reserved, server_ms, stat, Job,
};
use crate::support::RedisServer;

/// `dep:<name>` as digest → (count, deadline).
async fn hold_fields(c: &mut Conn, name: &str) -> HashMap<String, (i64, u64)> {
    let raw: HashMap<String, String> = cmd(c, &["HGETALL", &keys().dep(name)]).await;
    raw.into_iter()
        .map(|(d, v)| {
            let (n, t) = v.split_once(':').unwrap();
            (d, (n.parse().unwrap(), t.parse().unwrap()))
        })
        .collect()
}

/// ENQUEUE `class(args)` to `queue` with holds, as `locketd enqueue` does.
async fn enqueue(
    c: &mut Conn,
    queue: &str,
    class: &str,
    args: serde_json::Value,
    holds: &[&str],
    ttl: Duration,
) {
    let payload = payload_of(class, &args);
    let digest = locketd::locks::canonical::digest(class, &args);
    let holds: Vec<String> = holds.iter().map(|s| s.to_string()).collect();
    store::enqueue(c, &keys(), queue, &payload, &digest, &holds, ttl)
        .await
        .expect("ENQUEUE");
}

fn dep_opts<'a>(locked_by: &'a [String], policy: Policy) -> AcquireOptions<'a> {
    AcquireOptions {
        on_dep_conflict: policy,
        locked_by,
        delay: Some((
            DelaySettings {
                base: Duration::from_secs(5),
                max: Duration::from_secs(60),
                jitter: 0.0,
                max_delays: 0,
            },
            0.0,
        )),
        ..AcquireOptions::default()
    }
}

async fn start_a(c: &mut Conn, slot: &str, enqueue_holds: &[String]) -> Job {
    let mut a = reserve_next(c, slot, "a").await;
    let o = AcquireOptions {
        enqueue_holds,
        ..AcquireOptions::default()
    };
    assert!(matches!(
        a.acquire(c, &[], &o).await,
        AcquireOutcome::Started { .. }
    ));
    a
}

// locking-semantics.md D-2, D-3, NEVER-6: ENQUEUE pushes and adds its holds in one step; the
// hold expires at the latest field deadline and is indexed by the earliest.
#[tokio::test]
async fn d3_enqueue_pushes_the_payload_and_adds_its_holds_in_one_step() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let before = server_ms(c).await;
    enqueue(
        c,
        "a",
        "Hook",
        json!([7]),
        &["order:7", "any"],
        Duration::from_secs(60),
    )
    .await;
    let after = server_ms(c).await;
    assert_eq!(
        lrange(c, &k.queue("a")).await,
        vec![payload_of("Hook", &json!([7]))]
    );
    let qs: Vec<String> = cmd(c, &["SMEMBERS", &k.queues()]).await;
    assert_eq!(qs, ["a"]);
    let digest = locketd::locks::canonical::digest("Hook", &json!([7]));
    for name in ["order:7", "any"] {
        let f = hold_fields(c, name).await;
        let (n, deadline) = f[&digest];
        assert_eq!(n, 1);
        assert!(deadline >= before + 60_000 && deadline <= after + 60_000);
        let score: f64 = cmd(c, &["ZSCORE", &k.deps(), name]).await;
        assert_eq!(score as u64, deadline);
        let pttl: i64 = cmd(c, &["PTTL", &k.dep(name)]).await;
        assert!(pttl > 55_000 && pttl <= 60_000, "{pttl}");
    }
    assert_eq!(stat(c, "holds_added").await, 2);
}

// locking-semantics.md D-5, D-10, P-4: a live hold blocks a locked_by job; the default dependency
// policy delays it, with reason "dep" and the hold name as resource.
#[tokio::test]
async fn d5_a_live_hold_blocks_locked_by_and_the_default_policy_delays() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    enqueue(
        c,
        "a",
        "A",
        json!([7]),
        &["order:7"],
        Duration::from_secs(60),
    )
    .await;
    let lb = vec!["order:7".to_string()];
    let mut b = reserved(c, "sb", "b", "B", json!([7])).await;
    let o = dep_opts(&lb, AcquireOptions::default().on_dep_conflict);
    let out = b.acquire(c, &[], &o).await;
    let AcquireOutcome::Conflict { action, conflicts } = out else {
        panic!("{out:?}")
    };
    assert!(
        matches!(action, Settled::Delayed { attempt: 1, .. }),
        "{action:?}"
    );
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].kind, ConflictKind::Dependency);
    assert_eq!(conflicts[0].id, "order:7");
    assert_eq!(conflicts[0].holders, 1);
    let members: Vec<String> = cmd(c, &["ZRANGE", &k.delayed(), "0", "-1"]).await;
    let v: serde_json::Value = serde_json::from_str(&members[0]).unwrap();
    assert_eq!(v["reason"], "dep");
    assert_eq!(v["resource"], "order:7");
    // A name nobody holds does not block.
    let other = vec!["order:8".to_string()];
    let mut b8 = reserved(c, "sb", "b", "B", json!([8])).await;
    assert!(matches!(
        b8.acquire(c, &[], &dep_opts(&other, Policy::Delay)).await,
        AcquireOutcome::Started { .. }
    ));
}

// locking-semantics.md §6: when a lock and a dependency conflict at once, the dependency policy
// applies (and both are reported).
#[tokio::test]
async fn a_job_meeting_both_conflict_kinds_gets_the_dependency_policy() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    let _a = start_a(c, "sa", &[]).await;
    let mut holder = reserved(c, "sh", "hq", "Holder", json!([])).await;
    assert!(matches!(
        holder
            .acquire(
                c,
                &[crate::policies::spec("L", 1)],
                &AcquireOptions::default()
            )
            .await,
        AcquireOutcome::Started { .. }
    ));
    let lb = vec!["h".to_string()];
    let mut b = reserved(c, "sb", "b", "B", json!([1])).await;
    let mut o = dep_opts(&lb, Policy::Discard);
    o.on_lock_conflict = Policy::Requeue;
    let out = b.acquire(c, &[crate::policies::spec("L", 1)], &o).await;
    let AcquireOutcome::Conflict { action, conflicts } = out else {
        panic!("{out:?}")
    };
    assert_eq!(action, Settled::Discarded);
    let kinds: Vec<ConflictKind> = conflicts.iter().map(|c| c.kind).collect();
    assert_eq!(kinds, [ConflictKind::Lock, ConflictKind::Dependency]);
    assert!(!exists(c, &keys().counter("b")).await);
}

// locking-semantics.md D-5: a job does not block on its own enqueue-time hold (its digest counts
// one less), but a second identical payload's hold still blocks it.
#[tokio::test]
async fn d5_a_job_is_not_blocked_by_its_own_enqueue_hold() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["feed:1".to_string()];
    enqueue(
        c,
        "a",
        "Feed",
        json!([1]),
        &["feed:1"],
        Duration::from_secs(60),
    )
    .await;
    let mut j = reserve_next(c, "s1", "a").await;
    let o = AcquireOptions {
        enqueue_holds: &names,
        ..dep_opts(&names, Policy::Wait)
    };
    assert!(matches!(
        j.acquire(c, &[], &o).await,
        AcquireOutcome::Started { .. }
    ));
    assert!(j.finish(c, &[], Finish::Success, &names).await);
    assert!(!exists(c, &keys().dep("feed:1")).await);
    // Two identical payloads: the first one sees the second's hold.
    enqueue(
        c,
        "a",
        "Feed",
        json!([1]),
        &["feed:1"],
        Duration::from_secs(60),
    )
    .await;
    enqueue(
        c,
        "a",
        "Feed",
        json!([1]),
        &["feed:1"],
        Duration::from_secs(60),
    )
    .await;
    let mut j = reserve_next(c, "s1", "a").await;
    let out = j.acquire(c, &[], &o).await;
    assert!(
        matches!(&out, AcquireOutcome::Conflict { action: Settled::None, conflicts } if conflicts[0].holders == 1),
        "{out:?}"
    );
}

// locking-semantics.md D-6, D-8, NEVER-6: N adds need N releases, a release only touches its
// own digest, and counts never go below zero.
#[tokio::test]
async fn d8_counted_holds_need_as_many_releases_and_never_go_negative() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["order:7".to_string()];
    let other = locketd::locks::canonical::digest("Other", &json!([7]));
    for _ in 0..3 {
        enqueue(
            c,
            "a",
            "A",
            json!([7]),
            &["order:7"],
            Duration::from_secs(60),
        )
        .await;
    }
    enqueue(
        c,
        "o",
        "Other",
        json!([7]),
        &["order:7"],
        Duration::from_secs(60),
    )
    .await;
    let digest = locketd::locks::canonical::digest("A", &json!([7]));
    assert_eq!(hold_fields(c, "order:7").await[&digest].0, 3);
    let mut last = 3;
    for i in 0..5 {
        let a = start_a(c, &format!("s{i}"), &names).await;
        assert!(a.finish(c, &[], Finish::Success, &names).await);
        let f = hold_fields(c, "order:7").await;
        last = (last - 1).max(0);
        assert_eq!(
            f.get(&digest).map(|v| v.0).unwrap_or(0),
            last,
            "after release {i}"
        );
        assert_eq!(f[&other].0, 1, "another digest's hold is untouched");
        assert!(
            f.values().all(|(n, _)| *n > 0),
            "no zero or negative field: {f:?}"
        );
        if i == 2 {
            // Two more A payloads without holds (plain pushes) for the remaining rounds: their
            // start ensures a hold (D-4) that their success releases again.
            for _ in 0..2 {
                let _: i64 = cmd(
                    c,
                    &["RPUSH", &keys().queue("a"), &payload_of("A", &json!([7]))],
                )
                .await;
            }
        }
    }
    assert_eq!(stat(c, "holds_released").await, 5);
}

// locking-semantics.md D-7: a failed holder keeps its hold (release_on = success); the retry's
// success releases it; release_on = completion releases on any outcome.
#[tokio::test]
async fn d7_failure_keeps_the_hold_and_completion_holds_go_on_any_outcome() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["h".to_string()];
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    let a = start_a(c, "s1", &names).await;
    // The worker releases success-only holds on success only: a failure releases nothing.
    assert!(a.finish(c, &[], Finish::Failure("{}".into()), &[]).await);
    assert_eq!(hold_fields(c, "h").await.len(), 1, "kept after the failure");
    // A retry (same class and args, so same digest) succeeds and releases it.
    let _: i64 = cmd(
        c,
        &["RPUSH", &keys().queue("a"), &payload_of("A", &json!([1]))],
    )
    .await;
    let a = start_a(c, "s1", &names).await;
    assert_eq!(
        hold_fields(c, "h").await.values().next().unwrap().0,
        1,
        "D-4 ensured, not added"
    );
    assert!(a.finish(c, &[], Finish::Success, &names).await);
    assert!(hold_fields(c, "h").await.is_empty());
    // Completion: released even though the job failed.
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    let a = start_a(c, "s1", &names).await;
    assert!(a.finish(c, &[], Finish::Failure("{}".into()), &names).await);
    assert!(hold_fields(c, "h").await.is_empty());
}

// locking-semantics.md D-6, NEVER-6: a FINISH sent again because its first attempt's reply was
// lost releases the job's holds once, not twice: with two identical holders (one counted hold
// of 2), a second release would let a dependent start while the other holder still runs.
#[tokio::test]
async fn d6_a_resent_finish_does_not_release_holds_twice() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["h".to_string()];
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    let count = |f: HashMap<String, (i64, u64)>| f.values().next().map(|v| v.0);
    assert_eq!(count(hold_fields(c, "h").await), Some(2));
    let a = start_a(c, "s1", &names).await;
    assert!(a.finish(c, &[], Finish::Success, &names).await);
    assert_eq!(count(hold_fields(c, "h").await), Some(1));
    // The same FINISH again, as the worker re-sends it after a lost reply: the reservation is
    // gone and the hold of the second holder stays.
    assert!(
        !a.finish_as(c, &[], Finish::Success, &names, true).await,
        "a resent FINISH finds its reservation gone"
    );
    assert_eq!(
        count(hold_fields(c, "h").await),
        Some(1),
        "the resend released a second hold"
    );
    assert_eq!(stat(c, "holds_released").await, 1);
    // A first FINISH that finds its reservation recovered elsewhere (the job did run to its
    // end) still releases as its outcome says. Recovery needs the process lease gone,
    // and without it FINISH reads the record.
    let _: i64 = cmd(c, &["DEL", &keys().alive("s1")]).await;
    assert!(!a.finish(c, &[], Finish::Success, &names).await);
    assert!(hold_fields(c, "h").await.is_empty());
}

// locking-semantics.md D-4: a job pushed by a client that knows nothing of holds still blocks
// its dependents while it runs.
#[tokio::test]
async fn d4_enqueue_holds_are_ensured_at_start() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["order:9".to_string()];
    let _: i64 = cmd(
        c,
        &["RPUSH", &keys().queue("a"), &payload_of("A", &json!([9]))],
    )
    .await;
    let a = start_a(c, "s1", &names).await;
    assert_eq!(hold_fields(c, "order:9").await[&a.digest].0, 1);
    let mut b = reserved(c, "sb", "b", "B", json!([9])).await;
    assert!(matches!(
        b.acquire(c, &[], &dep_opts(&names, Policy::Wait)).await,
        AcquireOutcome::Conflict { .. }
    ));
    assert!(a.finish(c, &[], Finish::Success, &names).await);
    assert!(matches!(
        b.acquire(c, &[], &dep_opts(&names, Policy::Wait)).await,
        AcquireOutcome::Started { .. }
    ));
}

// locking-semantics.md D-9: start-time holds are added after the locked_by check, so a job never
// blocks on a hold it adds in the same step; they block the next one.
#[tokio::test]
async fn d9_start_holds_are_added_after_the_check() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let names = vec!["batch".to_string()];
    let o = AcquireOptions {
        start_holds: &names,
        ..dep_opts(&names, Policy::Wait)
    };
    let mut j1 = reserved(c, "s1", "q", "Batch", json!([1])).await;
    assert!(matches!(
        j1.acquire(c, &[], &o).await,
        AcquireOutcome::Started { .. }
    ));
    let mut j2 = reserved(c, "s2", "q", "Batch", json!([2])).await;
    assert!(matches!(
        j2.acquire(c, &[], &o).await,
        AcquireOutcome::Conflict { .. }
    ));
    assert!(j1.finish(c, &[], Finish::Success, &names).await);
    assert!(matches!(
        j2.acquire(c, &[], &o).await,
        AcquireOutcome::Started { .. }
    ));
}

// locking-semantics.md D-1, D-2, R-3 step 3, NEVER-4: holds expire after hold_ttl (the key
// physically, the index entry with the janitor's purge) and then block nobody.
#[tokio::test]
async fn d1_holds_expire_after_hold_ttl() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_millis(1000)).await;
    let names = vec!["h".to_string()];
    let mut b = reserved(c, "sb", "b", "B", json!([1])).await;
    assert!(matches!(
        b.acquire(c, &[], &dep_opts(&names, Policy::Wait)).await,
        AcquireOutcome::Conflict { .. }
    ));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(!exists(c, &k.dep("h")).await, "key expired on its own");
    assert_eq!(store::purge_holds(c, &k, 100).await.unwrap(), 0);
    let n: i64 = cmd(c, &["ZCARD", &k.deps()]).await;
    assert_eq!(n, 0, "index cleaned by the purge");
    assert!(matches!(
        b.acquire(c, &[], &dep_opts(&names, Policy::Wait)).await,
        AcquireOutcome::Started { .. }
    ));
}

// locking-semantics.md A-14, D-6, D-10: a requeue because of a hold counts the queue; the
// release that brings the hold to zero resets that counter.
#[tokio::test]
async fn a14_a_hold_released_to_zero_resets_the_counters_it_blocked() {
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let names = vec!["h".to_string()];
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    enqueue(c, "a", "A", json!([2]), &["h"], Duration::from_secs(60)).await;
    let mut b = reserved(c, "sb", "b", "B", json!([1])).await;
    let out = b.acquire(c, &[], &dep_opts(&names, Policy::Requeue)).await;
    assert!(matches!(
        out,
        AcquireOutcome::Conflict {
            action: Settled::Requeued,
            ..
        }
    ));
    assert_eq!(int(c, &k.counter("b")).await, 1);
    let blocked: Vec<String> = cmd(c, &["SMEMBERS", &k.blocked_dep("h")]).await;
    assert_eq!(blocked, ["b"]);
    let a1 = start_a(c, "s1", &names).await;
    assert!(a1.finish(c, &[], Finish::Success, &names).await);
    assert_eq!(
        int(c, &k.counter("b")).await,
        1,
        "one hold left: still blocked"
    );
    let a2 = start_a(c, "s2", &names).await;
    assert!(a2.finish(c, &[], Finish::Success, &names).await);
    assert!(!exists(c, &k.counter("b")).await, "reset at zero");
    assert!(!exists(c, &k.blocked_dep("h")).await);
}

// locking-semantics.md O-2, NEVER-5, NEVER-6: operator releases: by token only that holder; force
// every holder (counted); a hold by digest one count; --all every count.
#[tokio::test]
async fn o2_admin_releases_of_locks_and_holds() {
    use store::AdminRelease;
    let server = RedisServer::start();
    let c = &mut server.conn().await;
    let k = keys();
    let locks = [crate::policies::spec("L", 2)];
    let mut h1 = reserved(c, "s1", "q", "H", json!([1])).await;
    h1.acquire(c, &locks, &AcquireOptions::default()).await;
    let mut h2 = reserved(c, "s2", "q", "H", json!([2])).await;
    h2.acquire(c, &locks, &AcquireOptions::default()).await;
    assert_eq!(
        store::admin_release(c, &k, &AdminRelease::LockToken("L", "nope"))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store::admin_release(c, &k, &AdminRelease::LockToken("L", &h1.token))
            .await
            .unwrap(),
        1
    );
    let left: Vec<String> = cmd(
        c,
        &["EVAL", crate::support::LOCK_HOLDERS_LUA, "1", &k.lock("L")],
    )
    .await;
    let left: Vec<String> = left.chunks(2).map(|c| c[0].clone()).collect();
    assert_eq!(left, [h2.token.clone()]);
    assert_eq!(
        store::admin_release(c, &k, &AdminRelease::LockForce("L"))
            .await
            .unwrap(),
        1
    );
    assert!(!exists(c, &k.lock("L")).await);
    assert_eq!(stat(c, "force_released").await, 1);
    let (_, lost) = store::extend(c, &k, &h2.token, &locks, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        lost,
        vec![true],
        "the holder finds out at its next heartbeat"
    );

    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    enqueue(c, "a", "A", json!([1]), &["h"], Duration::from_secs(60)).await;
    enqueue(c, "a", "A", json!([2]), &["h"], Duration::from_secs(60)).await;
    let d1 = locketd::locks::canonical::digest("A", &json!([1]));
    assert_eq!(
        store::admin_release(c, &k, &AdminRelease::HoldDigest("h", &d1))
            .await
            .unwrap(),
        1
    );
    assert_eq!(hold_fields(c, "h").await[&d1].0, 1);
    assert_eq!(
        store::admin_release(c, &k, &AdminRelease::HoldAll("h"))
            .await
            .unwrap(),
        2
    );
    assert!(!exists(c, &k.dep("h")).await);
    let n: i64 = cmd(c, &["ZCARD", &k.deps()]).await;
    assert_eq!(n, 0);
}
