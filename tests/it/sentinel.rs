//! Redis Sentinel (issue 29 items 2-3): `redis+sentinel://` URLs, `check-config` and `status`
//! naming the primary, and a failover under load (docs/spec/redis-connection.md, "Failover").
//! Every test starts its own primary, replica and three `redis-sentinel`s on free loopback
//! ports. Run: `cargo test --test it sentinel::`.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::daemon::{cfg, NS};
use crate::support::{read_lossy, tail, wait_until, write_script, Daemon, SentinelSetup};

/// The locks of the `Fenced` jobs.
const LOCKS: u64 = 8;

/// The sentinels' `down-after-milliseconds` in these tests.
const DOWN_AFTER: Duration = Duration::from_millis(1000);

fn locketd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_locketd"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("REDIS_URL")
        .env_remove("QUEUES")
        .env_remove("QUEUE")
        .output()
        .expect("run locketd")
}

fn text(out: &Output) -> String {
    format!(
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Issue 29 item 2: "`check-config` and `status` show the resolved primary", for the URL in
/// the TOML file, in `--redis` and in `REDIS_URL`; a `rediss+sentinel://` URL is refused.
#[test]
fn check_config_and_status_name_the_primary() {
    let setup = SentinelSetup::start(DOWN_AFTER);
    let url = setup.url();
    let primary = format!("127.0.0.1:{}", setup.primary.port());
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("locketd.toml");
    std::fs::write(
        &file,
        format!("redis = \"{url}\"\nqueues = \"q\"\n[classes.\"*\"]\ncommand = [\"/bin/true\"]\n"),
    )
    .unwrap();
    let file = file.to_str().unwrap();

    let out = locketd(&["check-config", file]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("name the primary {primary}")),
        "{}",
        text(&out)
    );

    // status, with the URL from the file, then from REDIS_URL.
    let out = locketd(&["--config", file, "status"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("(primary {primary})")),
        "{}",
        text(&out)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .args(["status", "--json"])
        .env("REDIS_URL", &url)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(json["primary"], primary.as_str(), "{}", text(&out));

    // Refused clearly: TLS through sentinels, and a URL without a service name.
    for bad in [
        url.replacen("redis+sentinel", "rediss+sentinel", 1),
        url.trim_end_matches("/mymaster/0").to_string(),
    ] {
        std::fs::write(
            dir.path().join("bad.toml"),
            format!("redis = \"{bad}\"\nqueues = \"q\"\n"),
        )
        .unwrap();
        let out = locketd(&[
            "check-config",
            dir.path().join("bad.toml").to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(78), "{bad}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("redis+sentinel"),
            "{}",
            text(&out)
        );
    }
}

/// One line of the handler log: the job's number, its lock (Fenced jobs) and its fence.
struct Run {
    job: u64,
    lock: Option<u64>,
    fence: Option<u64>,
}

fn runs(log: &str) -> Vec<Run> {
    log.lines()
        .filter_map(|l| {
            // `<class> <args JSON> <fences JSON>`, e.g. `Fenced [7,3] [12]`.
            let mut parts = l.split(' ');
            let _class = parts.next()?;
            let args: Vec<u64> = serde_json::from_str(parts.next()?).ok()?;
            let fences: Vec<u64> = serde_json::from_str(parts.next()?).ok()?;
            Some(Run {
                job: *args.first()?,
                lock: args.get(1).copied(),
                fence: fences.first().copied(),
            })
        })
        .collect()
}

/// The jobs run more than once, and for each lock, the fencing numbers (in the order the jobs
/// started: one holder at a time) that were not above every number handed out before them.
fn duplicates_and_repeated_fences(all: &[Run]) -> (Vec<u64>, Vec<String>) {
    let mut times: BTreeMap<u64, usize> = BTreeMap::new();
    let mut highest: BTreeMap<u64, u64> = BTreeMap::new();
    let mut repeated = Vec::new();
    for r in all {
        *times.entry(r.job).or_default() += 1;
        if let (Some(lock), Some(fence)) = (r.lock, r.fence) {
            match highest.get(&lock) {
                Some(h) if fence <= *h => repeated.push(format!("f:{lock}: {fence} after {h}")),
                _ => {
                    highest.insert(lock, fence);
                }
            }
        }
    }
    let twice = times
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(j, _)| j)
        .collect();
    (twice, repeated)
}

/// Every value under the namespace on `conn`'s server, as one text (queues, failures, parked
/// and inflight records), to find a job's payload in.
fn everything(conn: &mut redis::Connection) -> String {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{NS}:*"))
        .query(conn)
        .unwrap_or_default();
    let mut out = String::new();
    for k in keys {
        let kind: String = redis::cmd("TYPE").arg(&k).query(conn).unwrap_or_default();
        let values: Vec<String> = match kind.as_str() {
            "string" => redis::cmd("GET")
                .arg(&k)
                .query(conn)
                .map(|v: String| vec![v]),
            "list" => redis::cmd("LRANGE").arg(&k).arg(0).arg(-1).query(conn),
            "set" => redis::cmd("SMEMBERS").arg(&k).query(conn),
            "zset" => redis::cmd("ZRANGE").arg(&k).arg(0).arg(-1).query(conn),
            "hash" => redis::cmd("HGETALL").arg(&k).query(conn),
            _ => Ok(Vec::new()),
        }
        .unwrap_or_default();
        for v in values {
            out.push_str(&v);
            out.push('\n');
        }
    }
    out
}

/// Pushes `jobs` jobs to queue `q` of the primary, every fifth `Fenced` (args `[i, i % 8]`, a
/// fenced lock of 8), the rest `Plain` (args `[i]`), and waits until the replica has them.
fn enqueue(setup: &SentinelSetup, jobs: u64) {
    let mut c = setup.primary.sync_conn();
    let mut pipe = redis::pipe();
    pipe.cmd("SADD")
        .arg(format!("{NS}:queues"))
        .arg("q")
        .ignore();
    for i in 0..jobs {
        let payload = if i % 5 == 0 {
            format!(r#"{{"class":"Fenced","args":[{i},{}]}}"#, i % LOCKS)
        } else {
            format!(r#"{{"class":"Plain","args":[{i}]}}"#)
        };
        pipe.cmd("RPUSH")
            .arg(format!("{NS}:queue:q"))
            .arg(payload)
            .ignore();
    }
    let () = pipe.query(&mut c).expect("enqueue");
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut c).unwrap();
    assert_eq!(acked, 1, "the replica did not acknowledge the jobs");
}

/// A daemon on the sentinel URL, 4 workers of one slot, whose handler appends
/// `<class> <args> <fences>` to the returned log file for every job it starts.
fn start_daemon(setup: &SentinelSetup) -> (tempfile::TempDir, std::path::PathBuf, Daemon) {
    let work = tempfile::tempdir().expect("temp dir");
    let log = work.path().join("runs.log");
    let handler = write_script(
        work.path(),
        "record.sh",
        &format!(
            "echo \"$LOCKETD_CLASS $LOCKETD_ARGS $LOCKETD_LOCK_FENCES\" >> {}\n",
            log.display()
        ),
    );
    // Leases longer than the outage (as the defaults are: 35 s and 60 s), so that the
    // processes ride through it rather than presume themselves dead.
    let config = cfg("q")
        .locket("lock_ttl", "\"10s\"")
        .locket("process_ttl", "\"10s\"")
        .top("workers = 4")
        .top("slots = 1")
        .top("redis_connect_timeout = \"30s\"")
        .class("Plain", &handler, "")
        .class("Fenced", &handler, "lock = \"f:{args[1]}\"\nfencing = true")
        .render();
    let d = Daemon::builder(&setup.primary)
        .redis_url(&setup.url())
        .config(&config)
        .start();
    (work, log, d)
}

/// Issue 29 item 3: 2,000 jobs draining, the primary SIGKILLed mid-run, the sentinels promote
/// the replica. locketd resumes on the new primary within `down-after` + 5 s; every job ran or
/// is still in a queue, failure, parked or inflight record; the jobs run twice (the
/// replication gap) and the fencing numbers seen across the failover are reported, and checked
/// to grow per lock on each side of it (the spec's "Failover" says why not across it).
#[test]
fn a_failover_mid_run_loses_no_job() {
    const JOBS: u64 = 2000;
    let mut setup = SentinelSetup::start(DOWN_AFTER);
    let old_port = setup.primary.port();
    let new_port = setup.replica.port();

    enqueue(&setup, JOBS);
    let (_work, log, mut d) = start_daemon(&setup);

    // Mid-run: a fifth of the jobs started.
    wait_until(Duration::from_secs(60), "400 jobs started", || {
        read_lossy(&log).lines().count() >= 400
    });
    setup.primary.stop(); // SIGKILL
    let killed = Instant::now();
    let started_before = read_lossy(&log).lines().count();

    // The sentinels promote the replica, and jobs start again: more than could have been taken
    // before the kill (4 workers of 1 slot each), so they were taken from the new primary. Both
    // watched from the kill on, every 20 ms.
    let bound = DOWN_AFTER + Duration::from_secs(5);
    let (mut promoted, mut resumed) = (None, None);
    while killed.elapsed() < bound + Duration::from_secs(30)
        && (promoted.is_none() || resumed.is_none())
    {
        if resumed.is_none() && read_lossy(&log).lines().count() >= started_before + 10 {
            resumed = Some(killed.elapsed());
        }
        if promoted.is_none() && setup.named_primary_port() == Some(new_port) {
            promoted = Some(killed.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (Some(promoted), Some(resumed)) = (promoted, resumed) else {
        panic!(
            "within {:?} of the kill: promoted {promoted:?}, jobs started again {resumed:?}\n{}\n{}",
            bound + Duration::from_secs(30),
            tail(&d.log(), 60),
            setup.logs()
        )
    };

    // Drained: every job ran once at least (bounded).
    let all_ran = || {
        let ran: BTreeSet<u64> = runs(&read_lossy(&log)).iter().map(|r| r.job).collect();
        ran.len() as u64 == JOBS
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !all_ran() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // A moment for the last acknowledgements, then stop the daemon.
    std::thread::sleep(Duration::from_millis(500));
    d.signal(libc::SIGQUIT);
    d.wait_exit(Duration::from_secs(20));
    let daemon_log = d.log();
    drop(d);

    // Accounting.
    let all = runs(&read_lossy(&log));
    let mut times: BTreeMap<u64, usize> = BTreeMap::new();
    for r in &all {
        *times.entry(r.job).or_default() += 1;
    }
    let twice: Vec<u64> = times
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(j, _)| *j)
        .collect();
    let mut new_primary = setup.replica.sync_conn();
    let stored = everything(&mut new_primary);
    let missing: Vec<u64> = (0..JOBS)
        .filter(|j| !times.contains_key(j))
        .filter(|j| {
            !stored.contains(&format!("\"args\":[{j}]"))
                && !stored.contains(&format!("\"args\":[{j},"))
        })
        .collect();
    let not_run = (0..JOBS).filter(|j| !times.contains_key(j)).count();

    // Fencing numbers per lock, in the order the jobs started (one holder at a time).
    let mut before: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut after: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (i, r) in all.iter().enumerate() {
        if let (Some(lock), Some(fence)) = (r.lock, r.fence) {
            let side = if i < started_before {
                &mut before
            } else {
                &mut after
            };
            side.entry(lock).or_default().push(fence);
        }
    }
    let mut regressions = Vec::new();
    for lock in 0..LOCKS {
        let (b, a) = (before.get(&lock), after.get(&lock));
        for (side, seq) in [("before", b), ("after", a)] {
            if let Some(seq) = seq {
                assert!(
                    seq.windows(2).all(|w| w[0] < w[1]),
                    "lock f:{lock}: fences not increasing {side} the failover: {seq:?}"
                );
            }
        }
        if let (Some(last), Some(first)) = (b.and_then(|b| b.last()), a.and_then(|a| a.first())) {
            if first <= last {
                regressions.push(format!("f:{lock}: {last} then {first}"));
            }
        }
    }

    let switches = daemon_log.matches("redis primary changed").count();
    let presumed_dead = daemon_log.matches("presumed dead").count();
    let respawns = daemon_log.matches("worker exited unexpectedly").count();
    eprintln!(
        "failover figures: down-after {DOWN_AFTER:?}; primary {old_port} killed after {started_before} \
         job starts; replica {new_port} named primary after {promoted:?}; jobs started again after \
         {resumed:?}; {switches} connections switched, {presumed_dead} 'presumed dead' lines, \
         {respawns} workers respawned; {} runs of {JOBS} jobs; {} jobs ran twice or more {:?}; {not_run} never ran \
         ({} of them found in Redis); fencing: {} of {LOCKS} locks gave a number not above the \
         last one before the failover {regressions:?}",
        all.len(),
        twice.len(),
        &twice[..twice.len().min(20)],
        not_run - missing.len(),
        regressions.len(),
    );
    assert!(
        resumed <= bound,
        "jobs started again {resumed:?} after the kill, more than {bound:?}\n{}",
        tail(&daemon_log, 60)
    );
    assert!(
        missing.is_empty(),
        "jobs neither run nor in Redis: {missing:?}\n{}",
        tail(&daemon_log, 60)
    );
    assert!(
        daemon_log.contains("redis primary changed"),
        "{}",
        tail(&daemon_log, 60)
    );
}

/// Issue 29 item 2: "re-resolves after READONLY ... or a `+switch-master`": a failover asked of
/// the sentinels (`SENTINEL FAILOVER`) while the old primary stays up. The old primary accepts
/// writes until the sentinels turn it into a replica (seconds after the promotion), and every
/// write it takes after the replica stopped copying it is lost: the daemon moves to the replica
/// as the sentinel begins promoting it (`+failover-state-send-slaveof-noone`), follows it, and
/// the jobs all run. The jobs run twice and the fencing numbers repeated are reported (with the
/// move at `+switch-master` only, a run here had 315 of 1,000 jobs run twice).
#[test]
fn a_requested_failover_is_followed() {
    const JOBS: u64 = 1000;
    let setup = SentinelSetup::start(DOWN_AFTER);
    let new_port = setup.replica.port();
    enqueue(&setup, JOBS);
    let (_work, log, mut d) = start_daemon(&setup);
    wait_until(Duration::from_secs(60), "100 jobs started", || {
        read_lossy(&log).lines().count() >= 100
    });
    let mut sentinel = setup.sentinels[0].sync_conn().expect("sentinel connection");
    let asked = Instant::now();
    let () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(crate::support::SENTINEL_SERVICE)
        .query(&mut sentinel)
        .expect("SENTINEL FAILOVER");
    wait_until(
        Duration::from_secs(30),
        "the sentinels name the replica as primary",
        || setup.named_primary_port() == Some(new_port),
    );
    let promoted = asked.elapsed();
    let all_ran = || {
        let ran: BTreeSet<u64> = runs(&read_lossy(&log)).iter().map(|r| r.job).collect();
        ran.len() as u64 == JOBS
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !all_ran() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let drained = asked.elapsed();
    d.signal(libc::SIGQUIT);
    d.wait_exit(Duration::from_secs(20));
    let daemon_log = d.log();
    let all = runs(&read_lossy(&log));
    let (twice, repeated) = duplicates_and_repeated_fences(&all);
    eprintln!(
        "requested failover: replica named primary after {promoted:?}; all {JOBS} jobs started \
         {drained:?} after the request; {} runs, {} jobs ran twice or more {:?}; {} fencing \
         numbers not above an earlier one of their lock {:?}",
        all.len(),
        twice.len(),
        &twice[..twice.len().min(20)],
        repeated.len(),
        &repeated[..repeated.len().min(10)],
    );
    if let Ok(dir) = std::env::var("LOCKETD_KEEP_LOGS") {
        std::fs::write(format!("{dir}/daemon.log"), &daemon_log).unwrap();
        std::fs::write(format!("{dir}/sentinels.log"), setup.logs()).unwrap();
        std::fs::write(format!("{dir}/runs.log"), read_lossy(&log)).unwrap();
    }
    assert!(all_ran(), "not every job ran\n{}", tail(&daemon_log, 60));
    assert!(
        daemon_log.contains("redis primary changed"),
        "{}",
        tail(&daemon_log, 60)
    );
}

/// README "Command line", issue 29 item 5 for Sentinel: sentinels that do not answer make the
/// daemon retry for `redis_connect_timeout`, say once which URL it tried and where it came from,
/// and exit 69.
#[test]
fn unreachable_sentinels_make_the_daemon_exit_69_naming_them() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("local addr").port()
    };
    let url = format!("redis+sentinel://:secret@127.0.0.1:{port}/mymaster/0");
    let unused = crate::support::RedisServer::start();
    let config = cfg("q").top("redis_connect_timeout = \"2s\"").render();
    let mut d = Daemon::builder(&unused)
        .redis_url(&url)
        .config(&config)
        .start();
    assert_eq!(
        crate::daemon::exit_code(&mut d, Duration::from_secs(30)),
        Some(69),
        "{}",
        d.log()
    );
    let log = d.log();
    assert!(
        log.contains(&format!(
            "no sentinel of redis+sentinel://:***@127.0.0.1:{port}/mymaster/0 (given by --redis)"
        )),
        "{log}"
    );
    assert!(!log.contains("secret"), "{log}");
}
