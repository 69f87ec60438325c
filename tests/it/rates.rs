//! Keyed rate limits (rate-limits.md RL-1..RL-6): the rate check inside ACQUIRE at the script
//! level, and through the real daemon (fleet-wide accuracy, a lock and a rate on one class,
//! wrong-typed rate keys), against a real redis-server.

use std::time::Duration;

use locketd::locks::{Policy, RateSpec};
use locketd::store::{
    self, AcquireOptions, AcquireOutcome, ConflictKind, Finish, RateLog, Settled,
};
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

/// The log of rate key `key` (rate.lua): its starts and close; the default when there is
/// none.
async fn log_of(c: &mut Conn, key: &str) -> RateLog {
    let v: Option<Vec<u8>> = cmd(c, &["GET", &keys().locket(&format!("ratelog:{key}"))]).await;
    v.map(|v| RateLog::parse(&v).expect("a rate log"))
        .unwrap_or_default()
}

/// ACQUIRE of `j` (reserved from its queue) with `locks` and `rates`, which Redis must refuse
/// (S-6: a rate log of another type): the error it raised.
async fn acquire_refused(
    c: &mut Conn,
    j: &crate::policies::Job,
    locks: &[locketd::locks::LockSpec],
    rates: &[RateSpec],
) -> redis::RedisError {
    let req = store::AcquireRequest {
        rid: &j.rid,
        token: "00112233445566778899aabbccddeeff",
        queue: &j.queue,
        class: "Call",
        digest: &j.digest,
        locks,
        lock_ttl: Duration::from_secs(10),
        counter_ttl: Duration::from_secs(5),
        requeue_on_conflict: true,
        working_on: "{}",
        lockinfo: "{}",
        resent: false,
    };
    store::acquire_with(c, &j.slot(), &req, Some(&with_rates(rates)))
        .await
        .unwrap_err()
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
    let log = k.locket("ratelog:api:7");
    let starts = log_of(&mut c, "api:7").await.starts;
    assert_eq!(starts.len(), 2);
    let oldest = starts[0];
    assert!(
        oldest >= before && starts[1] >= oldest,
        "Redis's clock, in order"
    );
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
        log_of(&mut c, "api:7").await.starts,
        starts,
        "a refused job records no start"
    );
    assert!(!exists(&mut c, &third.inflight()).await);
    let limited: Option<i64> = cmd(
        &mut c,
        &["HGET", &k.locket("rate_stats"), "rate_limited|Call"],
    )
    .await;
    assert_eq!(limited, Some(1), "counted for /metrics");
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
    assert_eq!(log_of(&mut c, "api:8").await.starts.len(), 2);
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
        !exists(&mut c, &k.locket("ratelog:api:9")).await,
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

// RL-1 + S-6: a rate log of another type stops ACQUIRE having changed nothing: the job stays
// reserved (in exactly one place), no lock is taken, nothing is parked, and the job's other
// rate logs are as they were. A string that is no log is refused as it is read; a key of
// another type (MGET reads it as nil) when its SET NX refuses, which undoes the writes before
// it (the other logs, the limit-1 lock taken).
#[tokio::test]
async fn rl1_a_wrong_typed_rate_key_refuses_acquire_having_changed_nothing() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    for (n, spoil) in [(10, "SET"), (11, "RPUSH")] {
        let bad = format!("api:{n}");
        let _: () = cmd(
            &mut c,
            &[spoil, &k.locket(&format!("ratelog:{bad}")), "spoiled"],
        )
        .await;
        // A log with a start in it (written back as it was) and one not there yet (deleted).
        let (fine, new) = (format!("fine:{n}"), format!("new:{n}"));
        let mut other = reserved(&mut c, &format!("o{n}"), "q0", "Call", json!([0])).await;
        assert!(started(
            &other
                .acquire(&mut c, &[], &with_rates(&[rate(&fine, 5, 60_000, false)]))
                .await
        ));
        let fine_log: Vec<u8> = cmd(&mut c, &["GET", &k.locket(&format!("ratelog:{fine}"))]).await;
        let rates = [
            rate(&fine, 5, 60_000, false),
            rate(&new, 5, 60_000, false),
            rate(&bad, 5, 1000, false),
        ];
        let lock = [spec(&format!("user:{n}"), 1), spec("pool", 3)];
        let j = reserved(&mut c, &format!("a{n}"), "q", "Call", json!([n])).await;
        let err = acquire_refused(&mut c, &j, &lock, &rates).await;
        assert!(err.to_string().contains("WRONGTYPE"), "{spoil}: {err}");
        let state: Option<String> = cmd(&mut c, &["HGET", &j.inflight(), "state"]).await;
        assert_eq!(
            state.as_deref(),
            Some("reserved"),
            "{spoil}: still reserved, nowhere else"
        );
        assert!(
            !exists(&mut c, &k.lock(&format!("user:{n}"))).await,
            "{spoil}"
        );
        assert!(!exists(&mut c, &k.lock("pool")).await, "{spoil}");
        assert_eq!(llen(&mut c, &k.queue("q")).await, 0);
        assert!(!exists(&mut c, &k.locket(&format!("parked:rate:{bad}"))).await);
        let after: Vec<u8> = cmd(&mut c, &["GET", &k.locket(&format!("ratelog:{fine}"))]).await;
        assert_eq!(after, fine_log, "{spoil}: the other log as it was");
        let ttl: i64 = cmd(&mut c, &["PTTL", &k.locket(&format!("ratelog:{fine}"))]).await;
        assert!(ttl > 50_000, "{spoil}: with its expiry: {ttl}");
        assert!(
            !exists(&mut c, &k.locket(&format!("ratelog:{new}"))).await,
            "{spoil}: no log left where there was none"
        );
        let kind: String = cmd(&mut c, &["TYPE", &k.locket(&format!("ratelog:{bad}"))]).await;
        assert_eq!(kind, if spoil == "SET" { "string" } else { "list" });
    }
}

// RL-1 above RATE_STRING_MAX: a limit of 300 keeps its starts in a ZSET (a string of
// thousands of starts costs more Redis CPU than the ZSET's commands): the limit passes, the
// next start waits for the oldest to be a period old, `rate_state` reads the ZSET, and a
// job with a string log of another type beside it changes neither (the ZSET is written after
// every string log).
#[tokio::test]
async fn rl1_a_limit_above_the_string_log_keeps_its_exact_bound_in_a_zset() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let k = keys();
    let limit = store::RATE_STRING_MAX + 44;
    let big = [rate("big:1", limit, 60_000, false)];
    for i in 0..limit {
        let mut j = reserved(&mut c, &format!("s{i}"), "q", "Call", json!([1, i])).await;
        assert!(
            started(&j.acquire(&mut c, &[], &with_rates(&big)).await),
            "{i}"
        );
    }
    let zset = k.locket("rate:big:1");
    let n: i64 = cmd(&mut c, &["ZCARD", &zset]).await;
    assert_eq!(n, i64::from(limit));
    assert!(!exists(&mut c, &k.locket("ratelog:big:1")).await);
    let oldest: Vec<String> = cmd(&mut c, &["ZRANGE", &zset, "0", "0", "WITHSCORES"]).await;
    let oldest: u64 = oldest[1].parse().unwrap();
    let mut next = reserved(&mut c, "n", "q", "Call", json!([1, "n"])).await;
    match next.acquire(&mut c, &[], &with_rates(&big)).await {
        AcquireOutcome::Conflict { action, conflicts } => {
            assert_eq!(action, Settled::Parked);
            assert_eq!(conflicts[0].kind, ConflictKind::Rate);
            assert_eq!(conflicts[0].earliest_deadline_ms, oldest + 60_000);
        }
        other => panic!("{other:?}"),
    }
    let now = server_ms(&mut c).await;
    let st = store::rate_state(&mut c, &k, "big:1", limit, 60_000, false, now)
        .await
        .unwrap();
    assert_eq!(
        (st.used, st.allowed_now, st.next_allowed_ms, st.parked),
        (u64::from(limit), 0, oldest + 60_000, 1)
    );
    // A string log of another type beside the ZSET: refused, the ZSET as it was.
    let other = [
        rate("big:2", limit, 60_000, false),
        rate("small:2", 5, 1000, false),
    ];
    let _: i64 = cmd(&mut c, &["RPUSH", &k.locket("ratelog:small:2"), "x"]).await;
    let j = reserved(&mut c, "w", "q2", "Call", json!([2])).await;
    let mut first = reserved(&mut c, "f", "q3", "Call", json!([2, "f"])).await;
    assert!(started(
        &first.acquire(&mut c, &[], &with_rates(&other[..1])).await
    ));
    let before: Vec<String> = cmd(&mut c, &["ZRANGE", &k.locket("rate:big:2"), "0", "-1"]).await;
    let err = acquire_refused(&mut c, &j, &[], &other).await;
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    let after: Vec<String> = cmd(&mut c, &["ZRANGE", &k.locket("rate:big:2"), "0", "-1"]).await;
    assert_eq!(after, before, "no start recorded in the ZSET");
    let state: Option<String> = cmd(&mut c, &["HGET", &j.inflight(), "state"]).await;
    assert_eq!(state.as_deref(), Some("reserved"));
}

// ---------------------------------------------------------------------------------------------
// Through the daemon
// ---------------------------------------------------------------------------------------------

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon};
use std::path::{Path, PathBuf};
use std::time::Instant;

const LONG: Duration = Duration::from_secs(60);

/// A handler that logs `start <epoch ms> <args>` and `end <epoch ms> <args>` around `body`.
fn stamped(dir: &Path, name: &str, log: &Path, body: &str) -> PathBuf {
    write_script(
        dir,
        name,
        &format!(
            "cat >/dev/null\necho \"start $(date +%s%3N) $LOCKETD_ARGS\" >> {log}\n{body}\n\
             rc=$?\necho \"end $(date +%s%3N) $LOCKETD_ARGS\" >> {log}\nexit $rc\n",
            log = log.display()
        ),
    )
}

/// The start stamps (epoch ms) of a handler log, sorted.
fn starts(log: &Path) -> Vec<u64> {
    let mut out: Vec<u64> = read_lossy(log)
        .lines()
        .filter_map(|l| l.strip_prefix("start "))
        .filter_map(|l| l.split(' ').next()?.parse().ok())
        .collect();
    out.sort();
    out
}

/// The most starts in any window of `window_ms` (half-open: a start exactly a window after
/// another is in the next one), from sorted stamps.
fn most_in_window(stamps: &[u64], window_ms: u64) -> usize {
    let (mut lo, mut most) = (0, 0);
    for hi in 0..stamps.len() {
        while stamps[hi] - stamps[lo] >= window_ms {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

fn max_running(log: &Path) -> usize {
    crate::support::most_at_once(&read_lossy(log))
}

/// A field of `rate_stats` (RL-5: what /metrics reads for its per-class counts).
fn rate_stat(r: &mut R, field: &str) -> i64 {
    let v: Option<i64> = r.cmd(&["HGET", &format!("{NS}:locket:rate_stats"), field]);
    v.unwrap_or(0)
}

fn stat(r: &mut R, event: &str) -> i64 {
    r.int(&format!("{NS}:locket:stat:{event}"))
}

/// The daemons' `job started` stamps (epoch ms) of `class`, sorted: each worker logs it as
/// ACQUIRE's reply comes back, before the handler is spawned (a spawn on a busy machine lags
/// by hundreds of milliseconds, so the handler's own clock cannot show a one-second bound).
fn job_starts(daemons: &[&Daemon], class: &str) -> Vec<u64> {
    let needle = "job started queue=";
    let class_field = format!("class={class} ");
    let mut out: Vec<u64> = daemons
        .iter()
        .flat_map(|d| {
            d.log()
                .lines()
                .filter(|l| l.contains(needle) && l.contains(&class_field))
                .filter_map(|l| {
                    let t = chrono::DateTime::parse_from_rfc3339(l.split_whitespace().next()?);
                    t.ok().map(|t| t.timestamp_millis() as u64)
                })
                .collect::<Vec<_>>()
        })
        .collect();
    out.sort();
    out
}

/// Every start of a rate key by Redis's clock, from reads of its log every few tens of
/// milliseconds (it keeps each start a period, until `limit` newer ones came). The log holds
/// start times, not jobs: a time counts as often as one read holds it.
#[derive(Default)]
struct Seen(std::collections::BTreeMap<u64, usize>);

impl Seen {
    fn read(&mut self, r: &mut R, key: &str) {
        let mut now = std::collections::BTreeMap::<u64, usize>::new();
        for s in logged_starts(r, key) {
            *now.entry(s).or_default() += 1;
        }
        for (s, n) in now {
            let e = self.0.entry(s).or_default();
            *e = (*e).max(n);
        }
    }

    /// The starts seen, in order.
    fn starts(&self) -> Vec<u64> {
        self.0
            .iter()
            .flat_map(|(s, n)| std::iter::repeat_n(*s, *n))
            .collect()
    }
}

/// The stamps' allowance: a `job started` line is written a little after the ACQUIRE that
/// counted the start, and not always equally soon (the worker's task is scheduled on a busy
/// machine). A window this much shorter than the period is what the stamps can show.
const STAMP_SKEW_MS: u64 = 150;

// RL-1, §4 accuracy (the suite's shorter variant of the benchmark): two daemons with four
// slots each share one key of 20 starts a second; 200 jobs never put more than 20 starts in
// any sliding second, nothing fails, nothing is left parked, and the whole run keeps close to
// the allowed rate (the benchmark, `locketd-bench rates`, reports the exact figure).
#[test]
fn rl1_two_daemons_never_exceed_the_rate_of_one_key() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    // In-process jobs: nothing but the daemons competes for the CPU with the stamps.
    let config = cfg("api")
        .top(
            "[classes.Call]\nbuiltin = \"noop\"\nlock = false\n\
             rate = { key = \"api:{args[0]}\", limit = 20, period = \"1s\" }",
        )
        .render();
    drop(work);
    let n = 200;
    for i in 0..n {
        r.push("api", &format!(r#"{{"class":"Call","args":[1,{i}]}}"#));
    }
    let t0 = Instant::now();
    let mut a = Daemon::start(&redis, &config, &["--workers", "2", "--slots", "4"]);
    let mut b = Daemon::start(&redis, &config, &["--workers", "2", "--slots", "4"]);
    // Every start by Redis's clock: the key's log keeps each start until 20 newer ones came
    // (a second at least), so reading it every few tens of milliseconds sees them all.
    let mut seen = Seen::default();
    wait_until(LONG, "every job ran", || {
        seen.read(&mut r, "api:1");
        job_starts(&[&a, &b], "Call").len() == n
    });
    let took = t0.elapsed();
    seen.read(&mut r, "api:1");
    let by_redis = seen.starts();
    assert_eq!(by_redis.len(), n, "each start seen in the log once");
    let most = most_in_window(&by_redis, 1000);
    assert!(
        most <= 20,
        "{most} starts within one sliding second (Redis clock)"
    );
    // The jobs' own stamps (the workers' `job started` lines) agree, within their lag.
    let stamps = job_starts(&[&a, &b], "Call");
    assert_eq!(stamps.len(), n);
    let most = most_in_window(&stamps, 1000 - STAMP_SKEW_MS);
    assert!(
        most <= 20,
        "{most} starts within one sliding second (job stamps)"
    );
    // The ideal: 20 at once, then 20 more each second: (200 - 20) / 20 = 9 s from first to last.
    let span = stamps[n - 1] - stamps[0];
    eprintln!("rates accuracy: {n} starts over {span} ms (ideal 9000 ms), {took:?} in all");
    assert!(
        span >= 9000 - STAMP_SKEW_MS,
        "faster than the rate: {span} ms"
    );
    assert!(
        span <= 10_500,
        "the parked jobs woke late: {span} ms for an ideal 9000"
    );
    assert_eq!(a.terminate(LONG).code(), Some(0));
    assert_eq!(b.terminate(LONG).code(), Some(0));
    assert_eq!(r.failed_stat(), 0);
    assert_eq!(r.llen(&format!("{NS}:locket:parked:rate:api:1")), 0);
    let limited = stat(&mut r, "rate_limited");
    assert!(limited > 0);
    // RL-5: /metrics's per-class count, from the workers' tallies.
    assert_eq!(rate_stat(&mut r, "rate_limited|Call"), limited);
    assert_eq!(
        stat(&mut r, "requeued"),
        0,
        "refused jobs parked, never cycled"
    );
}

// §4: a lock and a rate on one class: never two holders of a user's lock, never over the rate
// of the API key, every job runs once.
#[test]
fn rl2_a_lock_and_a_rate_on_one_class_never_exceed_either() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = stamped(work.path(), "sync.sh", &log, "sleep 0.05");
    let config = cfg("sync")
        .class(
            "Sync",
            &h,
            "lock = \"user:{args[0]}\"\nrate = { key = \"gh-api:{args[1]}\", limit = 10, period = \"1s\" }",
        )
        .render();
    // 40 jobs: 4 users, one API key; each user's jobs are pushed together.
    let n = 40;
    for u in 0..4 {
        for i in 0..10 {
            r.push(
                "sync",
                &format!(r#"{{"class":"Sync","args":[{u},"k",{i}]}}"#),
            );
        }
    }
    let mut d = Daemon::start(&redis, &config, &["--workers", "2", "--slots", "4"]);
    let mut seen = Seen::default();
    wait_until(LONG, "every job ran", || {
        seen.read(&mut r, "gh-api:k");
        read_lossy(&log)
            .lines()
            .filter(|l| l.starts_with("end "))
            .count()
            == n
    });
    assert_eq!(starts(&log).len(), n, "each job ran once");
    let by_redis = seen.starts();
    assert_eq!(by_redis.len(), n, "each start in the rate's log");
    let most = most_in_window(&by_redis, 1000);
    assert!(most <= 10, "{most} starts within one sliding second");
    // Per user: never two at once.
    for u in 0..4 {
        let prefix = format!("[{u},");
        let mut cur = 0i64;
        for l in read_lossy(&log).lines() {
            let args = l.splitn(3, ' ').nth(2).unwrap_or("");
            if !args.starts_with(&prefix) {
                continue;
            }
            if l.starts_with("start ") {
                cur += 1;
            } else if l.starts_with("end ") {
                cur -= 1;
            }
            assert!(cur <= 1, "two holders of user:{u}'s lock");
        }
    }
    assert!(max_running(&log) <= 4);
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(r.failed_stat(), 0);
}

// RL-1 + S-6 through the daemon: a wrong-typed rate log makes ACQUIRE refuse before its first
// write; the job is recorded as failed once (E-3), and is nowhere else.
#[test]
fn rl1_a_wrong_typed_rate_key_fails_the_job_once_and_it_is_nowhere_else() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let h = stamped(work.path(), "call.sh", &log, "");
    let config = cfg("api")
        .class(
            "Call",
            &h,
            "lock = \"user:{args[0]}\"\nrate = { key = \"api:{args[0]}\", limit = 5, period = \"1s\" }",
        )
        .render();
    let _: () = r.cmd(&["HSET", &format!("{NS}:locket:ratelog:api:3"), "x", "1"]);
    r.push("api", r#"{"class":"Call","args":[3]}"#);
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "the job is failed", || r.failures().len() == 1);
    // A while for anything else to happen to it.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(d.terminate(LONG).code(), Some(0));
    let f = r.failures();
    assert_eq!(f.len(), 1, "reported once: {f:?}");
    assert!(
        f[0]["error"].as_str().unwrap_or("").contains("WRONGTYPE"),
        "{f:?}"
    );
    assert_eq!(r.llen(&format!("{NS}:queue:api")), 0);
    assert!(!r.exists(&format!("{NS}:locket:parked:rate:api:3")));
    assert!(!r.exists(&format!("{NS}:locket:lock:user:3")));
    assert_eq!(starts(&log).len(), 0, "never ran");
    let inflight: Vec<String> = r.keys(&format!("{NS}:locket:inflight:*"));
    assert!(inflight.is_empty(), "{inflight:?}");
}

/// The log of rate key `key` (the default when there is none).
fn read_log(r: &mut R, key: &str) -> RateLog {
    let v: Option<Vec<u8>> = r.cmd(&["GET", &format!("{NS}:locket:ratelog:{key}")]);
    v.map(|v| RateLog::parse(&v).expect("a rate log"))
        .unwrap_or_default()
}

/// The starts of rate key `key` by Redis's clock (the log keeps up to `limit` of them, none
/// a period old).
fn logged_starts(r: &mut R, key: &str) -> Vec<u64> {
    read_log(r, key).starts
}

/// How long after a close ends the first held job may start here. Alone it starts within a
/// few milliseconds (the janitor sleeps until the close ends); the full suite's parallel
/// daemons on a shared machine were seen to delay it by 300 ms, so the bound is loose: the
/// spec's ±0.2 s is a target for an unloaded host, not a property a test here can hold.
const WAKE_SLACK_MS: u64 = 1_000;

/// The close of `key` (RL-4) in its log and how long it has left by Redis's clock, read
/// together.
fn read_close(r: &mut R, key: &str) -> (u64, i64) {
    let (v, (s, us)): (Option<Vec<u8>>, (i64, i64)) = redis::pipe()
        .cmd("GET")
        .arg(format!("{NS}:locket:ratelog:{key}"))
        .cmd("TIME")
        .query(&mut r.0)
        .unwrap();
    let until = v
        .and_then(|v| RateLog::parse(&v))
        .unwrap_or_default()
        .closed_until_ms;
    (until, until as i64 - (s * 1000 + us / 1000))
}

/// RL-4: after a throttled run closed `key` for 3 s (`pttl` left of it when read), every later
/// start of the key waits until the close ends and comes soon after; nothing is failed.
fn assert_held_back(
    r: &mut R,
    key: &str,
    throttled_at: u64,
    (until, pttl): (u64, i64),
    runs: usize,
) {
    assert!(
        until >= throttled_at + 3_000 && pttl > 0 && pttl <= 3_000,
        "closed for 3 s after the run that started at {throttled_at}: until {until}, {pttl} ms left"
    );
    let later: Vec<u64> = logged_starts(r, key)
        .into_iter()
        .filter(|s| *s > throttled_at)
        .collect();
    assert_eq!(
        later.len(),
        runs,
        "every held job ran after the close: {later:?}"
    );
    assert!(
        later[0] >= until,
        "a start {} ms before the close ended",
        until - later[0]
    );
    eprintln!(
        "RL-4: the first held start came {} ms after the close ended",
        later[0] - until
    );
    assert!(
        later[0] <= until + WAKE_SLACK_MS,
        "the first start came {} ms after the close ended",
        later[0] - until
    );
    assert_eq!(r.failed_stat(), 0);
    assert!(r.failures().is_empty());
}

// RL-4: a command handler exiting 76 with `retry-after: 3` on its last stdout line closes its
// rate key for 3 s: it and every other job of the key wait, then run; nothing is failed.
#[test]
fn rl4_exit_76_with_retry_after_holds_every_job_of_the_key_back() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let mark = work.path().join("throttled-once");
    let h = stamped(
        work.path(),
        "call.sh",
        &log,
        &format!(
            "case \"$LOCKETD_ARGS\" in *'\"t\"'*) if [ ! -f {m} ]; then touch {m}; \
             echo working; echo 'retry-after: 3'; exit 76; fi;; esac; true",
            m = mark.display()
        ),
    );
    let config = cfg("api")
        .class(
            "Call",
            &h,
            "lock = false\nrate = { key = \"api:{args[0]}\", limit = 100, period = \"10s\" }",
        )
        .render();
    let mut d = Daemon::start(
        &redis,
        &config,
        &["--workers", "2", "--metrics", "127.0.0.1:0"],
    );
    r.push("api", r#"{"class":"Call","args":[5,"t"]}"#);
    wait_until(LONG, "the key is closed", || {
        read_close(&mut r, "api:5").0 > 0
    });
    let close = read_close(&mut r, "api:5");
    let throttled_at = logged_starts(&mut r, "api:5")[0];
    for i in 0..5 {
        r.push("api", &format!(r#"{{"class":"Call","args":[5,{i}]}}"#));
    }
    // Six ends: the throttled run exits before its own `end` line, then runs again.
    wait_until(LONG, "every job ran", || {
        read_lossy(&log)
            .lines()
            .filter(|l| l.starts_with("end "))
            .count()
            == 6
    });
    assert_held_back(&mut r, "api:5", throttled_at, close, 6);
    // RL-5: /metrics counts them per class, from the same fleet-wide counts (written within a
    // second): the throttled run, and the jobs the closed key refused.
    let addr = crate::service::metrics_addr(&d);
    wait_until(LONG, "the counts in /metrics", || {
        let body = crate::service::scrape(&addr).unwrap_or_default();
        let limited = rate_stat(&mut r, "rate_limited|Call");
        limited > 0
            && body.contains("locketd_throttled_total{class=\"Call\"} 1\n")
            && body.contains(&format!(
                "locketd_rate_limited_total{{class=\"Call\"}} {limited}\n"
            ))
    });
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(stat(&mut r, "throttled"), 1);
    assert_eq!(rate_stat(&mut r, "throttled|Call"), 1);
    assert_eq!(r.llen(&format!("{NS}:locket:parked:rate:api:5")), 0);
}

/// RL-4 through a persistent adapter: `job_file` (written to the work directory) raises the
/// adapter's throttle once for the job with args `[6, "t"]`; its on-failure hook would log.
fn check_adapter_throttle(program: &str, adapter: &str, job_name: &str, job_file: &str) {
    if std::process::Command::new(program)
        .arg("--version")
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        eprintln!("{program} is not installed: skipped (.ci/run installs it)");
        return;
    }
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let jobs = work.path().join(job_name);
    std::fs::write(&jobs, job_file).unwrap();
    let (mark, hooks) = (work.path().join("mark"), work.path().join("hooks.log"));
    let adapter = crate::support::manifest_dir().join(adapter);
    let config = format!(
        "{}\n[handlers.app]\nmode = \"persistent\"\ncommand = [\"{program}\", \"{}\", \"{}\"]\n\
         boot_timeout = \"60s\"\nenv = {{ MARK = \"{}\", HOOK_LOG = \"{}\" }}\n\n\
         [classes.Hit]\nhandler = \"app\"\nlock = false\n\
         rate = {{ key = \"api:{{args[0]}}\", limit = 100, period = \"10s\" }}\n",
        cfg("api").render(),
        adapter.display(),
        jobs.display(),
        mark.display(),
        hooks.display(),
    );
    let mut d = Daemon::start(&redis, &config, &["--workers", "2"]);
    r.push("api", r#"{"class":"Hit","args":[6,"t"]}"#);
    wait_until(LONG, "the key is closed", || {
        read_close(&mut r, "api:6").0 > 0
    });
    let close = read_close(&mut r, "api:6");
    let throttled_at = logged_starts(&mut r, "api:6")[0];
    for i in 0..3 {
        r.push("api", &format!(r#"{{"class":"Hit","args":[6,{i}]}}"#));
    }
    wait_until(LONG, "every job ran", || r.processed() == 4);
    assert_held_back(&mut r, "api:6", throttled_at, close, 4);
    assert_eq!(d.terminate(LONG).code(), Some(0));
    assert_eq!(read_lossy(&hooks), "", "no failure hook ran");
    assert_eq!(stat(&mut r, "throttled"), 1);
}

// RL-4: `raise Locket::Throttled.new(retry_after: 3)` in a Ruby job, through the adapter.
#[test]
fn rl4_ruby_locket_throttled_holds_the_key_back() {
    check_adapter_throttle(
        "ruby",
        "adapters/ruby/locketd-ruby",
        "jobs.rb",
        r#"class Hit
  def self.perform(*args)
    if args[1] == "t" && !File.exist?(ENV["MARK"])
      File.write(ENV["MARK"], "")
      raise Locket::Throttled.new(retry_after: 3)
    end
  end

  def self.on_failure_log(exception, *args)
    File.open(ENV["HOOK_LOG"], "a") { |f| f.puts("on_failure #{exception.class}") }
  end
end
"#,
    );
}

// RL-4: `raise locketd_handler.Throttled(retry_after=3)` in a Python job.
#[test]
fn rl4_python_throttled_holds_the_key_back() {
    check_adapter_throttle(
        "python3",
        "adapters/python/locketd_handler.py",
        "jobs.py",
        r#"import os
from locketd_handler import Throttled


class Hit:
    @staticmethod
    def perform(*args):
        if len(args) > 1 and args[1] == "t" and not os.path.exists(os.environ["MARK"]):
            open(os.environ["MARK"], "w").close()
            raise Throttled(retry_after=3)

    @staticmethod
    def on_failure_log(exception, *args):
        with open(os.environ["HOOK_LOG"], "a") as f:
            f.write("on_failure\n")
"#,
    );
}

// RL-4: a Node job rejecting with an error that carries `retryAfter`.
#[test]
fn rl4_node_retry_after_error_holds_the_key_back() {
    check_adapter_throttle(
        "node",
        "adapters/node/locketd-handler.js",
        "jobs.js",
        r#""use strict";
const fs = require("fs");
module.exports.jobs = {
  Hit: {
    perform: async (...args) => {
      if (args[1] === "t" && !fs.existsSync(process.env.MARK)) {
        fs.writeFileSync(process.env.MARK, "");
        const e = new Error("HTTP 429");
        e.retryAfter = 3;
        throw e;
      }
    },
    onFailure: async () => { fs.appendFileSync(process.env.HOOK_LOG, "on_failure\n"); },
  },
};
"#,
    );
}

fn cli(redis: &RedisServer, config: &Path, args: &[&str]) -> serde_json::Value {
    let out = crate::admin::cli(redis, config, args);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

// RL-5: `locketd limits --json` lists the key in use with its limit, period, the starts
// allowed now, the next allowed start and its parked jobs; `locketd parked` says why
// (`rate <key> until <time>`).
#[tokio::test]
async fn rl5_limits_and_parked_show_a_rate_key_and_why_its_jobs_wait() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let work = workdir();
    let config = work.path().join("locketd.toml");
    std::fs::write(
        &config,
        "queues = \"q\"\n[classes.Call]\ncommand = [\"true\"]\n\
         rate = { key = \"api:{args[0]}\", limit = 2, period = \"1m\" }\n",
    )
    .unwrap();
    let rates = [rate("api:4", 2, 60_000, false)];
    for i in 0..3 {
        let mut j = reserved(&mut c, &format!("s{i}"), "q", "Call", json!([4, i])).await;
        j.acquire(&mut c, &[], &with_rates(&rates)).await;
    }
    let now = server_ms(&mut c).await;
    let limits = cli(&r, &config, &["limits", "--json"]);
    let k = &limits["keys"][0];
    assert_eq!(k["key"], "api:4", "{limits}");
    assert_eq!(k["limit"], 2);
    assert_eq!(k["period_ms"], 60_000);
    assert_eq!(k["used"], 2);
    assert_eq!(k["allowed_now"], 0);
    assert_eq!(k["parked"], 1);
    let next = k["next_allowed_ms"].as_u64().unwrap();
    assert!(
        next > now + 59_000 && next <= now + 60_000,
        "{next} vs {now}"
    );
    let parked = cli(&r, &config, &["parked", "--json"]);
    let why = parked["resources"][0]["why"].as_str().unwrap();
    assert!(why.starts_with("rate api:4 until "), "{parked}");
}
