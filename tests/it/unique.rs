//! Unique jobs that follow their job (locking-semantics.md U-2..U-4): `unique =
//! "until_executing"` and `"until_executed"`. Each duplicate window is shown from both sides of
//! its boundary (start, success, failure, expiry), with the job's own requeues, parks, delays,
//! recoveries and an operator's cancel. The chaos run is in `unique_chaos.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::admin::cli;
use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{wait_until, write_script, Daemon, RedisServer};

pub(crate) const LONG: Duration = Duration::from_secs(30);

/// A handler that records its run (`<dir>/ran-<n>`, one line per run, n = the digits of its
/// args) and waits for `<dir>/go-<n>` or `<dir>/go-all` (at most 60 s), then fails when
/// `<dir>/fail-<n>` exists, else succeeds.
pub(crate) fn gate(dir: &Path) -> PathBuf {
    let d = dir.display();
    write_script(
        dir,
        "gate.sh",
        &format!(
            "cat >/dev/null\nn=$(printf %s \"$LOCKETD_ARGS\" | tr -dc 0-9)\n\
             echo run >> {d}/ran-$n\ni=0\n\
             while [ ! -e {d}/go-$n ] && [ ! -e {d}/go-all ]; do\n\
               sleep 0.05; i=$((i+1)); [ $i -gt 1200 ] && exit 3\n\
             done\n\
             [ -e {d}/fail-$n ] && exit 1\nexit 0\n"
        ),
    )
}

fn touch(dir: &Path, name: &str) {
    std::fs::write(dir.join(name), "").unwrap();
}

/// How many times job n started.
fn runs(dir: &Path, n: u32) -> usize {
    std::fs::read_to_string(dir.join(format!("ran-{n}")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// `locketd enqueue <queue> <class> <n>`: whether it was pushed.
fn enqueue(redis: &RedisServer, config: &Path, queue: &str, class: &str, n: u32) -> bool {
    let out = cli(
        redis,
        config,
        &["enqueue", queue, class, &n.to_string(), "--json"],
    );
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["pushed"].as_bool().expect("pushed")
}

fn key(class: &str, n: u32) -> String {
    format!("{NS}:locket:unique:{class}:{n}")
}

/// Every unique entry left.
pub(crate) fn entries(r: &mut R) -> Vec<String> {
    r.keys(&format!("{NS}:locket:unique:*"))
}

/// The unique settings of a class under `policy`.
fn unique(policy: &str) -> String {
    format!("unique = \"{policy}\"\nunique_key = \"{{class}}:{{args[0]}}\"")
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("locketd.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Waits until job n has started (at least once).
fn wait_started(dir: &Path, n: u32) {
    wait_until(LONG, &format!("job {n} started"), || runs(dir, n) >= 1);
}

fn wait_drained(r: &mut R) {
    wait_until(LONG, "every job ended", || {
        r.keys(&format!("{NS}:queue:*"))
            .iter()
            .all(|q| r.llen(q) == 0)
            && r.keys(&format!("{NS}:locket:inflight:*")).is_empty()
    });
}

/// U-2: an `until_executing` entry refuses a duplicate while the job is queued (just before
/// its start) and no longer once it started (just after); a duplicate pushed while it runs is
/// itself unique while it waits; a failed unstarted job (no handler) holds none.
#[test]
fn until_executing_refuses_until_the_job_starts() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let text = cfg("q")
        .class("U", &gate(dir), &unique("until_executing"))
        .render();
    let config = write_config(dir, &text);
    // Queued, no worker yet: the duplicate is refused, the entry has no expiry.
    assert!(enqueue(&redis, &config, "q", "U", 1));
    assert!(!enqueue(&redis, &config, "q", "U", 1));
    let ttl: i64 = r.cmd(&["PTTL", &key("U", 1)]);
    assert_eq!(ttl, -1);
    let mut d = Daemon::start(&redis, &text, &[]);
    wait_started(dir, 1);
    // Started: the entry is gone, a duplicate is pushed, and it is unique while it waits.
    assert!(!r.exists(&key("U", 1)));
    assert!(enqueue(&redis, &config, "q", "U", 1));
    assert!(!enqueue(&redis, &config, "q", "U", 1));
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 1);
    touch(dir, "go-1");
    wait_until(LONG, "both runs ended", || r.processed() == 2);
    assert_eq!(runs(dir, 1), 2);
    wait_drained(&mut r);
    assert!(entries(&mut r).is_empty(), "{:?}", entries(&mut r));
    assert_eq!(
        r.cmd::<i64>(&["GET", &format!("{NS}:locket:stat:unique_refused")]),
        2
    );
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

/// U-3: an `until_executed` entry refuses a duplicate while the job runs (just before its
/// end) and not after its success; a failure releases it too (the failed job can be retried
/// from the failed list, which locketd does not watch).
#[test]
fn until_executed_refuses_until_the_job_ended() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let text = cfg("q")
        .class("E", &gate(dir), &unique("until_executed"))
        .render();
    let config = write_config(dir, &text);
    let mut d = Daemon::start(&redis, &text, &[]);
    assert!(enqueue(&redis, &config, "q", "E", 1));
    wait_started(dir, 1);
    assert!(r.exists(&key("E", 1)));
    assert!(!enqueue(&redis, &config, "q", "E", 1));
    touch(dir, "go-1");
    wait_until(LONG, "job 1 succeeded", || r.processed() == 1);
    wait_until(LONG, "its entry is gone", || !r.exists(&key("E", 1)));
    assert!(enqueue(&redis, &config, "q", "E", 1));
    wait_until(LONG, "the duplicate ran", || r.processed() == 2);
    // A failure ends the window too.
    touch(dir, "fail-2");
    assert!(enqueue(&redis, &config, "q", "E", 2));
    wait_started(dir, 2);
    assert!(!enqueue(&redis, &config, "q", "E", 2));
    touch(dir, "go-2");
    wait_until(LONG, "job 2 failed", || r.failures().len() == 1);
    wait_until(LONG, "its entry is gone", || !r.exists(&key("E", 2)));
    assert!(enqueue(&redis, &config, "q", "E", 2));
    wait_until(LONG, "the retry ran", || runs(dir, 2) == 2);
    wait_drained(&mut r);
    assert!(entries(&mut r).is_empty(), "{:?}", entries(&mut r));
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

/// U-4 for both policies: a job that waits on a lock held by another job, parked, delayed or
/// requeued by ACQUIRE, keeps its entry (a duplicate is refused) and never collides with it
/// (it still runs, once); discard and fail release it at once.
#[test]
fn conflicts_keep_the_entry_and_never_refuse_the_job_itself() {
    for policy in ["until_executing", "until_executed"] {
        conflicts_keep_the_entry(policy);
    }
}

fn conflicts_keep_the_entry(policy: &str) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let g = gate(dir);
    let u = unique(policy);
    let text = cfg("q")
        .top("workers = 2")
        .class("H", &g, "lock = \"acct\"")
        .class("P", &g, &format!("lock = \"acct\"\n{u}"))
        .class(
            "D",
            &g,
            &format!("lock = \"acct\"\non_conflict = \"delay\"\ndelay_base = \"200ms\"\ndelay_max = \"1s\"\n{u}"),
        )
        .class("Q", &g, &format!("lock = \"acct\"\non_conflict = \"requeue\"\n{u}"))
        .class("X", &g, &format!("lock = \"acct\"\non_conflict = \"discard\"\n{u}"))
        .class("F", &g, &format!("lock = \"acct\"\non_conflict = \"fail\"\n{u}"))
        .render();
    let config = write_config(dir, &text);
    let mut d = Daemon::start(&redis, &text, &[]);
    assert!(enqueue(&redis, &config, "q", "H", 100));
    wait_started(dir, 100);
    // Parked behind H.
    assert!(enqueue(&redis, &config, "q", "P", 1));
    let parked = format!("{NS}:locket:parked:lock:acct");
    wait_until(LONG, "P parked", || r.llen(&parked) == 1);
    assert!(!enqueue(&redis, &config, "q", "P", 1), "{policy}: parked");
    // Delayed.
    assert!(enqueue(&redis, &config, "q", "D", 2));
    let delayed = format!("{NS}:locket:delayed");
    wait_until(LONG, "D delayed", || {
        r.cmd::<i64>(&["ZCARD", &delayed]) == 1
    });
    assert!(!enqueue(&redis, &config, "q", "D", 2), "{policy}: delayed");
    // Requeued by ACQUIRE again and again: refused each time a duplicate is pushed.
    assert!(enqueue(&redis, &config, "q", "Q", 3));
    wait_until(LONG, "Q requeued", || {
        r.int(&format!("{NS}:locket:stat:requeued")) >= 2
    });
    assert!(!enqueue(&redis, &config, "q", "Q", 3), "{policy}: requeued");
    // Discarded and failed: the entry goes with the job.
    assert!(enqueue(&redis, &config, "q", "X", 4));
    wait_until(LONG, "X discarded", || {
        r.int(&format!("{NS}:locket:stat:discarded")) == 1
    });
    assert!(!r.exists(&key("X", 4)), "{policy}: discarded");
    assert!(enqueue(&redis, &config, "q", "F", 5));
    wait_until(LONG, "F failed", || r.failures().len() == 1);
    assert!(!r.exists(&key("F", 5)), "{policy}: failed by conflict");
    assert_eq!(runs(dir, 4) + runs(dir, 5), 0);
    // The discarded one's duplicate is pushed (and discarded again while H holds the lock).
    assert!(enqueue(&redis, &config, "q", "X", 4));
    wait_until(LONG, "X discarded again", || {
        r.int(&format!("{NS}:locket:stat:discarded")) == 2
    });
    // H ends: every waiting job runs, each once.
    touch(dir, "go-all");
    wait_until(LONG, "P, D and Q ran", || {
        runs(dir, 1) == 1 && runs(dir, 2) == 1 && runs(dir, 3) == 1
    });
    wait_drained(&mut r);
    wait_until(LONG, "nothing delayed", || {
        r.cmd::<i64>(&["ZCARD", &delayed]) == 0
    });
    assert_eq!((runs(dir, 1), runs(dir, 2), runs(dir, 3)), (1, 1, 1));
    assert!(
        entries(&mut r).is_empty(),
        "{policy}: {:?}",
        entries(&mut r)
    );
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

/// U-4, R-4: a job whose daemon was SIGKILLed mid-run is recovered by another daemon (one
/// that serves another queue, so that the recovered job stays where recovery put it).
/// `on_worker_death = "fail"`: it is failed, and holds no entry (a duplicate is pushed).
/// `"requeue"`: it waits again with its entry (placed again for until_executing, whose entry
/// ended at the start), so a duplicate is refused; then it runs once more.
#[test]
fn a_dead_workers_job_is_recovered_per_policy() {
    for policy in ["until_executing", "until_executed"] {
        for death in ["fail", "requeue"] {
            recovered(policy, death);
        }
    }
}

fn recovered(policy: &str, death: &str) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let config_for = |queue: &str| {
        cfg(queue)
            .locket("on_worker_death", &format!("\"{death}\""))
            .class("K", &gate(dir), &unique(policy))
            .render()
    };
    let text = config_for("q");
    let config = write_config(dir, &text);
    let mut d1 = Daemon::start(&redis, &text, &[]);
    assert!(enqueue(&redis, &config, "q", "K", 1));
    wait_started(dir, 1);
    let what = format!("{policy}, on_worker_death {death}");
    if policy == "until_executing" {
        assert!(!r.exists(&key("K", 1)), "{what}: started");
    }
    d1.kill_master_and_workers();
    d1.wait_exit(LONG).expect("daemon killed");
    let mut d2 = Daemon::start(&redis, &config_for("other"), &[]);
    let queue = format!("{NS}:queue:q");
    if death == "fail" {
        wait_until(LONG, "the dead job failed", || r.failures().len() == 1);
        assert!(!r.exists(&key("K", 1)), "{what}");
        assert!(enqueue(&redis, &config, "q", "K", 1), "{what}");
    } else {
        wait_until(LONG, "the dead job was requeued", || r.llen(&queue) == 1);
        assert!(r.exists(&key("K", 1)), "{what}");
        assert!(!enqueue(&redis, &config, "q", "K", 1), "{what}");
    }
    assert_eq!(d2.terminate(LONG).code(), Some(0));
    touch(dir, "go-1");
    let mut d3 = Daemon::start(&redis, &text, &[]);
    wait_until(LONG, "the waiting job ran", || runs(dir, 1) == 2);
    wait_drained(&mut r);
    wait_until(LONG, "no entry left", || entries(&mut r).is_empty());
    assert_eq!(d3.terminate(LONG).code(), Some(0));
}

/// U-4: a job removed by a foreign tool (an LREM, as `Resque.dequeue` does) leaves its entry,
/// which only the `unique_ttl` backstop ends: refused just before it, pushed just after.
#[test]
fn the_ttl_backstop_ends_an_entry_whose_job_was_removed_by_hand() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let text = cfg("q")
        .class(
            "B",
            &gate(dir),
            &format!("{}\nunique_ttl = \"1s\"", unique("until_executed")),
        )
        .render();
    let config = write_config(dir, &text);
    assert!(enqueue(&redis, &config, "q", "B", 1));
    let queue = format!("{NS}:queue:q");
    let payload: String = r.cmd(&["LINDEX", &queue, "0"]);
    let removed: i64 = r.cmd(&["LREM", &queue, "0", &payload]);
    assert_eq!(removed, 1);
    assert!(!enqueue(&redis, &config, "q", "B", 1));
    let ttl: i64 = r.cmd(&["PTTL", &key("B", 1)]);
    assert!(ttl > 0 && ttl <= 1000, "{ttl}");
    wait_until(LONG, "the entry expired", || !r.exists(&key("B", 1)));
    assert!(enqueue(&redis, &config, "q", "B", 1));
}

/// U-3, A-21: an operator's cancel of a parked or delayed job records it as failed and ends its
/// entry; with `--requeue` the job waits again and keeps it.
#[test]
fn cancel_of_a_parked_job_releases_its_entry() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let g = gate(dir);
    let text = cfg("q")
        .top("workers = 2")
        .class("H", &g, "lock = \"acct\"")
        .class(
            "P",
            &g,
            &format!("lock = \"acct\"\n{}", unique("until_executing")),
        )
        .class(
            "D",
            &g,
            &format!(
                "lock = \"acct\"\non_conflict = \"delay\"\ndelay_base = \"60s\"\n{}",
                unique("until_executed")
            ),
        )
        .render();
    let config = write_config(dir, &text);
    let mut d = Daemon::start(&redis, &text, &[]);
    assert!(enqueue(&redis, &config, "q", "H", 100));
    wait_started(dir, 100);
    let parked = format!("{NS}:locket:parked:lock:acct");
    let parked_rid = |r: &mut R| -> String {
        let e: Vec<String> = r.cmd(&["LRANGE", &parked, "0", "0"]);
        let v: serde_json::Value = serde_json::from_str(&e[0]).unwrap();
        v["rid"].as_str().unwrap().to_string()
    };
    assert!(enqueue(&redis, &config, "q", "P", 1));
    wait_until(LONG, "P parked", || r.llen(&parked) == 1);
    let out = cli(
        &redis,
        &config,
        &["cancel", &parked_rid(&mut r), "--requeue"],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(r.exists(&key("P", 1)), "requeued: kept");
    wait_until(LONG, "P parked again", || r.llen(&parked) == 1);
    let out = cli(&redis, &config, &["cancel", &parked_rid(&mut r)]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(r.failures().len(), 1);
    assert!(!r.exists(&key("P", 1)), "cancelled: released");
    assert!(enqueue(&redis, &config, "q", "P", 1));
    // A delayed job the same way.
    assert!(enqueue(&redis, &config, "q", "D", 2));
    let delayed = format!("{NS}:locket:delayed");
    wait_until(LONG, "D delayed", || {
        r.cmd::<i64>(&["ZCARD", &delayed]) == 1
    });
    let members: Vec<String> = r.cmd(&["ZRANGE", &delayed, "0", "0"]);
    let v: serde_json::Value = serde_json::from_str(&members[0]).unwrap();
    let out = cli(&redis, &config, &["cancel", v["rid"].as_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(r.failures().len(), 2);
    assert!(!r.exists(&key("D", 2)), "cancelled while delayed: released");
    touch(dir, "go-all");
    wait_drained(&mut r);
    assert_eq!(runs(dir, 1), 1);
    assert!(entries(&mut r).is_empty(), "{:?}", entries(&mut r));
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

/// U-3: a job that fails without running its handler to the end holds no entry: one whose class
/// has no handler (NameError, never started), and an `until_executed` job still running when
/// its daemon's `shutdown_timeout` ends (`Resque::TermException`).
#[test]
fn jobs_failed_unstarted_or_at_shutdown_release_their_entry() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let text = format!(
        "{}\n[classes.\"NoHandler\"]\n{}\n",
        cfg("q")
            .locket("shutdown_timeout", "\"1s\"")
            .class("E", &gate(dir), &unique("until_executed"))
            .render(),
        unique("until_executing")
    );
    let config = write_config(dir, &text);
    assert!(enqueue(&redis, &config, "q", "NoHandler", 1));
    assert!(r.exists(&key("NoHandler", 1)));
    let mut d = Daemon::start(&redis, &text, &[]);
    wait_until(LONG, "the job without a handler failed", || {
        r.failures().len() == 1
    });
    assert_eq!(r.failures()[0]["exception"], "NameError");
    assert!(
        !r.exists(&key("NoHandler", 1)),
        "failed unstarted: released"
    );
    assert!(enqueue(&redis, &config, "q", "E", 2));
    wait_started(dir, 2);
    assert!(r.exists(&key("E", 2)));
    d.terminate(LONG);
    assert_eq!(r.failures().len(), 2);
    assert_eq!(r.failures()[1]["exception"], "Resque::TermException");
    assert!(!r.exists(&key("E", 2)), "failed at shutdown: released");
    assert!(entries(&mut r).is_empty(), "{:?}", entries(&mut r));
}
