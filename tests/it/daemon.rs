//! End-to-end tests of the real `locketd` binary: several daemons against one private
//! `redis-server`, shell-script command handlers, signals, crashes, bad input and bad config.
//!
//! Rule ids are those of `locking-semantics.md` (A-*, E-*, R-*, NEVER-*) and the checklist items
//! of `resque-protocol.md` §13 ("checklist N").
//! Run: `cargo test --test it -- daemon:: node_interop::`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;

use crate::support::{
    pid_alive, proc_stat, process_group_members, read_lossy, wait_until, write_script, Daemon,
    RedisServer,
};

/// The namespace every test here uses (Resque's default).
pub(crate) const NS: &str = "resque";

/// Generous bound for things that take a few hundred milliseconds.
pub(crate) const SHORT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A daemon config with the short timings of these tests; locket settings can be replaced.
#[derive(Clone)]
pub(crate) struct Cfg {
    queues: String,
    top: Vec<String>,
    locket: BTreeMap<&'static str, String>,
    classes: Vec<String>,
}

/// `queues = "<queues>"`, `interval = 0.1` and short locket timings.
pub(crate) fn cfg(queues: &str) -> Cfg {
    let locket = [
        ("lock_ttl", "\"2s\""),
        ("heartbeat_interval", "\"500ms\""),
        ("counter_ttl", "\"1s\""),
        ("process_heartbeat", "\"200ms\""),
        ("process_ttl", "\"2s\""),
        ("janitor_interval", "\"200ms\""),
        ("kill_grace", "\"1s\""),
        ("shutdown_timeout", "\"5s\""),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_string()))
    .collect();
    Cfg {
        queues: queues.to_string(),
        top: Vec::new(),
        locket,
        classes: Vec::new(),
    }
}

impl Cfg {
    /// One more top-level line (before any table).
    pub(crate) fn top(mut self, line: &str) -> Cfg {
        self.top.push(line.to_string());
        self
    }

    /// Sets `[locket] key = value` (`value` is a TOML literal).
    pub(crate) fn locket(mut self, key: &'static str, value: &str) -> Cfg {
        self.locket.insert(key, value.to_string());
        self
    }

    /// `[classes."name"]` running `command`, plus `extra` lines.
    pub(crate) fn class(mut self, name: &str, command: &Path, extra: &str) -> Cfg {
        self.classes.push(format!(
            "[classes.\"{name}\"]\ncommand = [\"{}\"]\n{extra}\n",
            command.display()
        ));
        self
    }

    pub(crate) fn render(&self) -> String {
        let mut s = format!("queues = \"{}\"\ninterval = 0.1\n", self.queues);
        for line in &self.top {
            s.push_str(line);
            s.push('\n');
        }
        s.push_str("\n[locket]\n");
        for (k, v) in &self.locket {
            s.push_str(&format!("{k} = {v}\n"));
        }
        for c in &self.classes {
            s.push('\n');
            s.push_str(c);
        }
        s
    }
}

/// A blocking connection to a test server, with the few commands these tests need.
pub(crate) struct R(pub(crate) redis::Connection);

impl R {
    pub(crate) fn new(redis: &RedisServer) -> R {
        R(redis.sync_conn())
    }

    /// Runs one command; panics on a Redis error.
    pub(crate) fn cmd<T: redis::FromRedisValue>(&mut self, args: &[&str]) -> T {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut self.0)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// The tokens holding lock key `key` (either kind, support::LOCK_HOLDERS_LUA).
    pub(crate) fn lock_holders(&mut self, key: &str) -> Vec<String> {
        let flat: Vec<String> = self.cmd(&["EVAL", crate::support::LOCK_HOLDERS_LUA, "1", key]);
        flat.chunks(2).map(|c| c[0].clone()).collect()
    }

    /// `GET` as an integer; a missing key reads as 0 (as Resque reads stats).
    pub(crate) fn int(&mut self, key: &str) -> i64 {
        let v: Option<String> = self.cmd(&["GET", key]);
        v.map(|s| s.parse().expect("integer")).unwrap_or_default()
    }

    pub(crate) fn exists(&mut self, key: &str) -> bool {
        let n: i64 = self.cmd(&["EXISTS", key]);
        n == 1
    }

    pub(crate) fn llen(&mut self, key: &str) -> usize {
        self.cmd(&["LLEN", key])
    }

    /// What Resque's `push` does: `SADD queues q` and `RPUSH queue:q payload`.
    pub(crate) fn push(&mut self, queue: &str, payload: &str) {
        let _: i64 = self.cmd(&["SADD", &format!("{NS}:queues"), queue]);
        let _: i64 = self.cmd(&["RPUSH", &format!("{NS}:queue:{queue}"), payload]);
    }

    /// Every record of `<ns>:failed`, parsed.
    pub(crate) fn failures(&mut self) -> Vec<Value> {
        let raw: Vec<String> = self.cmd(&["LRANGE", &format!("{NS}:failed"), "0", "-1"]);
        raw.iter()
            .map(|r| serde_json::from_str(r).unwrap_or_else(|e| panic!("failure {r}: {e}")))
            .collect()
    }

    pub(crate) fn workers(&mut self) -> Vec<String> {
        self.cmd(&["SMEMBERS", &format!("{NS}:workers")])
    }

    pub(crate) fn keys(&mut self, pattern: &str) -> Vec<String> {
        let mut k: Vec<String> = self.cmd(&["KEYS", pattern]);
        k.sort();
        k
    }

    pub(crate) fn processed(&mut self) -> i64 {
        self.int(&format!("{NS}:stat:processed"))
    }

    pub(crate) fn failed_stat(&mut self) -> i64 {
        self.int(&format!("{NS}:stat:failed"))
    }
}

/// The host name as gethostname(2) gives it (what Resque puts in worker ids).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(rc, 0, "gethostname");
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Lowercase hex SHA-256.
fn sha256_hex(text: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The default lock id (T-4): `Class:<sha256 of the canonical JSON of args>`; the caller writes
/// `canonical_args` in canonical form (T-2).
pub(crate) fn default_lock_id(class: &str, canonical_args: &str) -> String {
    format!("{class}:{}", sha256_hex(canonical_args))
}

pub(crate) fn workdir() -> TempDir {
    tempfile::Builder::new()
        .prefix("locketd-daemon-test-")
        .tempdir()
        .expect("temp dir")
}

/// Waits for a handler's pid file (written by the handler script) and returns the pid.
pub(crate) fn wait_pid(path: &Path, timeout: Duration) -> i32 {
    let mut pid = 0;
    wait_until(timeout, &format!("pid file {}", path.display()), || {
        pid = read_lossy(path).trim().parse().unwrap_or(0);
        pid > 0
    });
    pid
}

/// A handler script that ignores SIGTERM, writes its pid and sleeps 60 s; its pid file; and
/// the [`Reaper`] that kills it if the test fails first.
pub(crate) fn stubborn_handler(dir: &Path) -> (PathBuf, PathBuf, Reaper) {
    let pid_file = dir.join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let script = write_script(
        dir,
        "stubborn.sh",
        &format!("trap '' TERM\necho $$ > {}\nsleep 60\n", pid_file.display()),
    );
    (script, pid_file, reaper)
}

/// Kills, on drop, the processes whose pids tests' handlers wrote to these files (the whole
/// group when the process leads its own group, as a handler does), so a failing test leaks no
/// handler.
#[derive(Default)]
pub(crate) struct Reaper(Vec<PathBuf>);

impl Reaper {
    pub(crate) fn watch(&mut self, pid_file: &Path) {
        self.0.push(pid_file.to_path_buf());
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for f in &self.0 {
            let Ok(pid) = read_lossy(f).trim().parse::<i32>() else {
                continue;
            };
            match proc_stat(pid) {
                // SAFETY: kill(2) of a process group led by a handler this test started.
                Some((_, _, pgrp)) if pgrp == pid => unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                },
                // SAFETY: kill(2) of a process a handler of this test started.
                Some(_) => unsafe {
                    libc::kill(pid, libc::SIGKILL);
                },
                None => {}
            }
        }
    }
}

/// The exit code of a daemon that must have exited within `timeout`.
pub(crate) fn exit_code(d: &mut Daemon, timeout: Duration) -> Option<i32> {
    match d.wait_exit(timeout) {
        Some(status) => status.code(),
        None => panic!(
            "locketd did not exit within {timeout:?}\n{}",
            crate::support::tail(&d.log(), 80)
        ),
    }
}

/// The one Resque worker id registered, once a daemon has registered.
pub(crate) fn wait_registered(r: &mut R, d: &Daemon) -> String {
    d.wait_for_log("worker registered", SHORT);
    let pid = format!(":{}:", d.worker_pid());
    let mut id = String::new();
    wait_until(SHORT, "the daemon's worker id in <ns>:workers", || match r
        .workers()
        .into_iter()
        .find(|w| w.contains(&pid))
    {
        Some(w) => {
            id = w;
            true
        }
        None => false,
    });
    id
}

/// Asserts every Resque and locket registration of a worker is gone (checklist 16, R-8).
pub(crate) fn assert_unregistered(r: &mut R, worker: &str) {
    assert!(
        !r.workers().contains(&worker.to_string()),
        "{worker} still in workers"
    );
    assert!(!r.exists(&format!("{NS}:worker:{worker}")));
    assert!(!r.exists(&format!("{NS}:worker:{worker}:started")));
    let beat: Option<String> = r.cmd(&["HGET", &format!("{NS}:workers:heartbeat"), worker]);
    assert_eq!(beat, None, "heartbeat of {worker} left behind");
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:processes")]);
    assert!(processes.is_empty(), "locket processes left: {processes:?}");
    assert!(
        r.keys(&format!("{NS}:locket:inflight:*")).is_empty(),
        "inflight records left behind"
    );
    assert!(r.keys(&format!("{NS}:locket:alive:*")).is_empty());
    assert!(r.keys(&format!("{NS}:locket:slots:*")).is_empty());
}

fn count(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

// ---------------------------------------------------------------------------------------------
// 1. Mutual exclusion across processes
// ---------------------------------------------------------------------------------------------

/// NEVER-1, A-6, P-1 (and checklist 19): two locketd processes draining one queue never run
/// two jobs with the same lock key at once, and every job runs exactly once. Tags live in an
/// extra payload key, which is not part of the lock key (class + args).
#[test]
fn two_daemons_never_overlap_jobs_with_the_same_lock_key() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let runs = work.path().join("runs.log");
    let script = write_script(
        work.path(),
        "job.sh",
        &format!(
            r#"payload=$(cat)
tag=$(printf '%s' "$payload" | sed -n 's/.*"tag":\([0-9][0-9]*\).*/\1/p')
echo "start $(date +%s%N) $$ $tag $LOCKETD_LOCK_KEYS $LOCKETD_WORKER" >> {runs}
sleep 0.05
echo "end $(date +%s%N) $tag" >> {runs}
"#,
            runs = runs.display()
        ),
    );
    let config = cfg("q")
        .class("Same", &script, "")
        .class("Other", &script, "")
        .render();
    let mut a = Daemon::start(&redis, &config, &[]);
    let mut b = Daemon::start(&redis, &config, &[]);
    let wa = wait_registered(&mut r, &a);
    let wb = wait_registered(&mut r, &b);

    let same_key = default_lock_id("Same", r#"["k",1]"#);
    let mut expected = BTreeSet::new();
    let mut pipe = redis::pipe();
    pipe.sadd(format!("{NS}:queues"), "q").ignore();
    for tag in 0..30u32 {
        pipe.rpush(
            format!("{NS}:queue:q"),
            format!(r#"{{"class":"Same","args":["k",1],"tag":{tag}}}"#),
        )
        .ignore();
        expected.insert(tag);
        if tag % 6 == 5 {
            let other = 100 + tag;
            pipe.rpush(
                format!("{NS}:queue:q"),
                format!(r#"{{"class":"Other","args":[{other}],"tag":{other}}}"#),
            )
            .ignore();
            expected.insert(other);
        }
    }
    let () = pipe.query(&mut r.0).expect("push jobs");
    let total = expected.len();

    let lock_key = format!("{NS}:locket:lock:{same_key}");
    let mut max_holders = 0usize;
    wait_until(Duration::from_secs(60), "every job ran", || {
        let holders = r.lock_holders(&lock_key).len();
        max_holders = max_holders.max(holders);
        count(&read_lossy(&runs), "end ") == total && r.processed() == total as i64
    });
    assert!(
        max_holders <= 1,
        "lock {same_key} had {max_holders} holders"
    );

    // Parse: start <ns> <pid> <tag> <lock keys> <worker> / end <ns> <tag>.
    let text = read_lossy(&runs);
    let mut starts: HashMap<u32, Vec<(u128, String, String)>> = HashMap::new();
    let mut ends: HashMap<u32, Vec<u128>> = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first() {
            Some(&"start") => starts.entry(f[3].parse().expect("tag")).or_default().push((
                f[1].parse().expect("ns"),
                f[4].to_string(),
                f[5].to_string(),
            )),
            Some(&"end") => ends
                .entry(f[2].parse().expect("tag"))
                .or_default()
                .push(f[1].parse().expect("ns")),
            _ => panic!("bad line {line:?}"),
        }
    }
    let got: BTreeSet<u32> = starts.keys().copied().collect();
    assert_eq!(got, expected, "tags that ran");
    for tag in &expected {
        assert_eq!(starts[tag].len(), 1, "tag {tag} started {:?}", starts[tag]);
        assert_eq!(ends[tag].len(), 1, "tag {tag} ended {:?}", ends[tag]);
    }

    // No two intervals of jobs with one class + args (one lock key) overlap.
    let mut by_key: HashMap<String, Vec<(u128, u128, u32)>> = HashMap::new();
    let mut by_worker: HashMap<String, usize> = HashMap::new();
    for tag in &expected {
        let (start, keys, worker) = &starts[tag][0];
        let key = if *tag < 30 {
            assert_eq!(*keys, format!("[\"{same_key}\"]"), "lock keys of job {tag}");
            same_key.clone()
        } else {
            format!("Other:{tag}")
        };
        by_key
            .entry(key)
            .or_default()
            .push((*start, ends[tag][0], *tag));
        *by_worker.entry(worker.clone()).or_default() += 1;
    }
    for (key, mut spans) in by_key {
        spans.sort();
        for w in spans.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "jobs {} and {} of lock {key} overlapped: {:?} / {:?}",
                w[0].2,
                w[1].2,
                w[0],
                w[1]
            );
        }
    }
    // The test only means something if both processes competed for the key.
    assert!(
        by_worker.contains_key(&wa) && by_worker.contains_key(&wb),
        "both daemons should have run jobs: {by_worker:?}"
    );
    let conflicts = count(&a.log(), "lock conflict") + count(&b.log(), "lock conflict");
    assert!(conflicts > 0, "no lock conflict happened at all");

    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    // NEVER-10: conflicts are not Resque work.
    assert_eq!(r.processed(), total as i64);
    assert_eq!(a.terminate(SHORT).code(), Some(0));
    assert_eq!(b.terminate(SHORT).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 2. Starvation
// ---------------------------------------------------------------------------------------------

/// NEVER-9, A-1, A-15, A-19/NEVER-10: a `high` queue saturated with jobs blocked on one lock
/// (held by a long job in another process) does not starve `low`: `low` drains while the holder
/// still runs; `high` is retried once per `counter_ttl` (its counter never outgrows the queue
/// and is never extended), so conflicts stay bounded by one pass over `high` per `counter_ttl`;
/// conflicts neither count as processed nor show as "working on".
#[test]
fn a_saturated_high_queue_does_not_starve_the_low_queue() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let runs = work.path().join("runs.log");
    // The holder keeps its lock until the test writes this file (at most 60 s), not for a
    // fixed time that a slow machine could outlast while low drains.
    let release = work.path().join("release");
    let hold = write_script(
        work.path(),
        "hold.sh",
        &format!(
            r#"tag=$(sed -n 's/.*"tag":\([0-9][0-9]*\).*/\1/p')
echo "hold-start $tag" >> {runs}
if [ "$tag" = 0 ]; then
  i=0
  while [ ! -e {release} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
fi
echo "hold-end $tag" >> {runs}
"#,
            runs = runs.display(),
            release = release.display()
        ),
    );
    let quick = write_script(
        work.path(),
        "quick.sh",
        // Each low job takes >= 50 ms, so draining low spans more than one counter_ttl.
        &format!(
            "sleep 0.05\necho \"low $LOCKETD_ARGS\" >> {}\n",
            runs.display()
        ),
    );
    // The skip rule (A-2) is the requeue policy's: set it, as park is the default.
    let classes = |c: Cfg| {
        c.class("Hold", &hold, "on_conflict = \"requeue\"")
            .class("Quick", &quick, "")
    };

    // Process A takes the holder job and keeps its lock until released.
    let mut a = Daemon::start(&redis, &classes(cfg("high")).render(), &[]);
    let wa = wait_registered(&mut r, &a);
    r.push("high", r#"{"class":"Hold","args":["k"],"tag":0}"#);
    wait_until(SHORT, "the holder started", || {
        read_lossy(&runs).contains("hold-start 0")
    });

    for tag in 1..=20 {
        r.push(
            "high",
            &format!(r#"{{"class":"Hold","args":["k"],"tag":{tag}}}"#),
        );
    }
    for i in 0..30 {
        r.push("low", &format!(r#"{{"class":"Quick","args":[{i}]}}"#));
    }
    let t0 = Instant::now();
    let mut b = Daemon::start(&redis, &classes(cfg("high,low")).render(), &[]);
    let wb = wait_registered(&mut r, &b);

    let mut b_working_on_hold = None;
    let (mut max_counter, mut max_pttl) = (0i64, -2i64);
    let counter_key = format!("{NS}:locket:counter:high");
    wait_until(Duration::from_secs(20), "low drained", || {
        let w: Option<String> = r.cmd(&["GET", &format!("{NS}:worker:{wb}")]);
        if let Some(w) = w.filter(|w| w.contains("Hold")) {
            b_working_on_hold = Some(w);
        }
        max_counter = max_counter.max(r.int(&counter_key));
        max_pttl = max_pttl.max(r.cmd(&["PTTL", &counter_key]));
        count(&read_lossy(&runs), "low ") == 30
            && r.llen(&format!("{NS}:queue:low")) == 0
            && r.processed() == 30
    });
    let elapsed = t0.elapsed();
    let conflicts = count(&b.log(), "lock conflict");
    let runs_text = read_lossy(&runs);
    assert!(
        !runs_text.contains("hold-end 0") && r.exists(&format!("{NS}:worker:{wa}")),
        "low should drain while the holder still runs (took {elapsed:?})\n{runs_text}"
    );
    assert_eq!(count(&runs_text, "hold-start"), 1, "{runs_text}");
    // NEVER-10 / A-19: conflicts are not processed jobs and never "working on".
    assert_eq!(r.processed(), 30);
    assert_eq!(b_working_on_hold, None);
    // All 20 wait in high. B tries one again each time the counter lapses (1 s), and holds it
    // for that one step before requeueing it: a look at that moment sees 19.
    wait_until(SHORT, "the 20 waiting jobs in high", || {
        r.llen(&format!("{NS}:queue:high")) == 20
    });
    // A-15: the counter never exceeds the queue's length and is never extended past
    // counter_ttl (1 s).
    assert!(
        (1..=20).contains(&max_counter),
        "counter reached {max_counter}"
    );
    assert!(max_pttl <= 1000, "counter PTTL {max_pttl} ms > counter_ttl");
    // Every high job was tried once before low was served (the counter reached the queue's
    // length); low took more than counter_ttl to drain, so the counter expired and high was
    // retried (one more pass) at least once; and at most one pass per counter_ttl happened.
    eprintln!("low drained in {elapsed:?} with {conflicts} lock conflicts on high");
    let passes = elapsed.as_secs_f64().ceil() as usize + 1;
    assert!(
        (40..=20 * passes).contains(&conflicts),
        "{conflicts} conflicts in {elapsed:?} (expected 40..={})",
        20 * passes
    );

    // Once the holder ends, every high job runs exactly once.
    fs::write(&release, "").unwrap();
    wait_until(Duration::from_secs(30), "every high job ran", || {
        count(&read_lossy(&runs), "hold-end") == 21 && r.processed() == 51
    });
    let runs_text = read_lossy(&runs);
    for tag in 0..=20 {
        let line = format!("hold-start {tag}");
        let n = runs_text.lines().filter(|l| *l == line).count();
        assert_eq!(n, 1, "high job {tag} ran {n} times\n{runs_text}");
    }
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(a.terminate(SHORT).code(), Some(0));
    assert_eq!(b.terminate(SHORT).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 3. SIGKILL mid-job
// ---------------------------------------------------------------------------------------------

/// Finds the one locket process of a daemon through `<ns>:locket:processes` and its
/// `slots:<process id>` hash; returns (process id, Resque worker id of slot 0).
fn locket_process(r: &mut R, daemon_pid: i32) -> (String, String) {
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:processes")]);
    let needle = format!(":{daemon_pid}:");
    let process = processes
        .into_iter()
        .find(|p| p.contains(&needle))
        .expect("the daemon's process id in <ns>:locket:processes");
    let slots: HashMap<String, String> =
        r.cmd(&["HGETALL", &format!("{NS}:locket:slots:{process}")]);
    let worker = slots.get("0").cloned().expect("slot 0 of the process");
    (process, worker)
}

/// NEVER-4, PR_SET_PDEATHSIG, NEVER-2, R-4, checklist 16/20: a daemon SIGKILLed mid-job takes
/// its handler with it; with no janitor around its lock lapses within TTL + 1 s while its
/// inflight record stays; a second daemon's janitor then records the job as
/// `Resque::DirtyExit` (not counted in `stat:failed`) and removes the dead registration.
#[test]
fn sigkill_mid_job_lapses_the_lock_and_a_janitor_records_a_dirty_exit() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let script = write_script(
        work.path(),
        "sleepy.sh",
        &format!("echo $$ > {}\nexec sleep 30\n", pid_file.display()),
    );
    let config = cfg("q").class("Sleepy", &script, "").render();
    let mut d1 = Daemon::start(&redis, &config, &[]);
    let worker1 = wait_registered(&mut r, &d1);
    let payload = r#"{"class":"Sleepy","args":["s"],"extra":{"kept":true}}"#;
    r.push("q", payload);
    let handler = wait_pid(&pid_file, SHORT);

    let (process, worker) = locket_process(&mut r, d1.worker_pid());
    assert_eq!(worker, worker1);
    let inflight_key = format!("{NS}:locket:inflight:{process}:0");
    let inflight: HashMap<String, String> = r.cmd(&["HGETALL", &inflight_key]);
    assert_eq!(inflight.get("state").map(String::as_str), Some("running"));
    assert_eq!(inflight.get("payload").map(String::as_str), Some(payload));
    let lock_id = default_lock_id("Sleepy", r#"["s"]"#);
    let lock_key = format!("{NS}:locket:lock:{lock_id}");
    let token = inflight.get("token").cloned().unwrap_or_default();
    assert!(
        r.lock_holders(&lock_key).contains(&token),
        "token {token} does not hold {lock_key}"
    );

    d1.kill_master_and_workers();
    let killed_at = Instant::now();
    let status = d1.wait_exit(SHORT).expect("daemon killed");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    wait_until(SHORT, "the handler died with its daemon", || {
        !pid_alive(handler)
    });

    // NEVER-4: gone within lock_ttl (2 s) + 1 s of the last extension, with no janitor.
    let bound = Duration::from_secs(3) + Duration::from_millis(700);
    wait_until(
        bound.saturating_sub(killed_at.elapsed()),
        "the dead daemon's lock key expired",
        || !r.exists(&lock_key),
    );
    // Nobody recovered anything: the inflight record and the process entry stay (R-4 has
    // not run), only the process lease has lapsed.
    assert!(
        r.exists(&inflight_key),
        "inflight record vanished without a janitor"
    );
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:processes")]);
    assert!(processes.contains(&process));
    assert!(!r.exists(&format!("{NS}:locket:alive:{process}")));
    assert!(r.failures().is_empty());

    let mut d2 = Daemon::start(&redis, &config, &[]);
    wait_until(SHORT, "the janitor recorded the dead job", || {
        !r.failures().is_empty() && !r.exists(&inflight_key)
    });
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    assert_eq!(f["exception"], "Resque::DirtyExit");
    assert_eq!(
        f["payload"],
        serde_json::from_str::<Value>(payload).unwrap()
    );
    assert_eq!(f["worker"], worker1.as_str());
    assert_eq!(f["queue"], "q");
    assert!(f["error"].as_str().unwrap_or("").contains(&process), "{f}");
    assert_eq!(
        r.failed_stat(),
        0,
        "a DirtyExit is not counted in stat:failed"
    );
    // The dead process's registrations are gone; the new daemon is registered.
    assert!(!r.workers().contains(&worker1));
    assert!(!r.exists(&format!("{NS}:worker:{worker1}")));
    assert!(!r.exists(&format!("{NS}:worker:{worker1}:started")));
    let beat: Option<String> = r.cmd(&["HGET", &format!("{NS}:workers:heartbeat"), &worker1]);
    assert_eq!(beat, None);
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:processes")]);
    assert!(!processes.contains(&process), "{processes:?}");
    assert!(!r.exists(&format!("{NS}:locket:slots:{process}")));
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    wait_registered(&mut r, &d2);
    assert_eq!(d2.terminate(SHORT).code(), Some(0));
}

/// README "Handler contract" ("Handlers also die with locketd, so none outlives its lock"),
/// NEVER-8: processes a handler started die with a SIGKILLed daemon too, not only the handler.
///
/// A SIGKILLed master: each worker gets TERM (its PR_SET_PDEATHSIG) and stops its handler's
/// whole process group, so even a shell handler's own children die with the daemon.
#[test]
fn a_sigkilled_master_takes_the_handlers_children_with_it() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let child_file = work.path().join("child.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    reaper.watch(&child_file);
    let script = write_script(
        work.path(),
        "parent.sh",
        &format!(
            "echo $$ > {}
sleep 30 &
echo $! > {}
wait
",
            pid_file.display(),
            child_file.display()
        ),
    );
    let mut d = Daemon::start(&redis, &cfg("q").class("P", &script, "").render(), &[]);
    wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"P","args":[]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    let child = wait_pid(&child_file, SHORT);
    d.signal(libc::SIGKILL);
    d.wait_exit(SHORT).expect("daemon killed");
    wait_until(SHORT, "the handler died with its daemon", || {
        !pid_alive(handler)
    });
    wait_until(
        Duration::from_secs(3),
        "the handler's child died too",
        || !pid_alive(child),
    );
}

/// R-4 with `on_worker_death = "requeue"`, NEVER-2/NEVER-3: the job of a SIGKILLed daemon is
/// put back once by the second daemon's janitor and runs there; nothing is recorded as failed
/// (Resque's own pruning leaves locket-owned workers to the janitor).
#[test]
fn with_requeue_on_worker_death_a_killed_daemons_job_runs_again_elsewhere() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let script = write_script(
        work.path(),
        "once.sh",
        &format!(
            r#"cat > /dev/null
if [ -e {w}/first ]; then echo "second $LOCKETD_WORKER" >> {w}/runs; exit 0; fi
touch {w}/first
echo $$ > {pid}
exec sleep 30
"#,
            w = work.path().display(),
            pid = pid_file.display()
        ),
    );
    let config = cfg("q")
        .locket("on_worker_death", "\"requeue\"")
        .class("Once", &script, "")
        .render();
    let mut d1 = Daemon::start(&redis, &config, &[]);
    let worker1 = wait_registered(&mut r, &d1);
    r.push("q", r#"{"class":"Once","args":[7]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    d1.kill_master_and_workers();
    d1.wait_exit(SHORT).expect("daemon killed");
    wait_until(SHORT, "the handler died with its daemon", || {
        !pid_alive(handler)
    });

    let mut d2 = Daemon::start(&redis, &config, &[]);
    let worker2 = wait_registered(&mut r, &d2);
    let runs = work.path().join("runs");
    wait_until(SHORT, "the requeued job ran in the second daemon", || {
        read_lossy(&runs).contains("second") && r.processed() == 1
    });
    assert_eq!(read_lossy(&runs).trim(), format!("second {worker2}"));
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert!(!r.workers().contains(&worker1));
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    assert_eq!(d2.terminate(SHORT).code(), Some(0));
    assert_eq!(read_lossy(&runs).lines().count(), 1);
}

// ---------------------------------------------------------------------------------------------
// 4. Bad input
// ---------------------------------------------------------------------------------------------

/// E-1, A-4, checklist 9/21/24: payloads that cannot run are recorded as failures (raw text
/// kept), never dropped, and the daemon goes on with the next job: malformed JSON, no class,
/// non-array args, oversized payload, JSON that is not an object → `Locket::BadPayload`; a
/// command that cannot be started → `Locket::HandlerError`; an unknown class (no `*` fallback)
/// → `NameError` naming it.
#[test]
fn bad_jobs_are_recorded_as_failures_and_the_daemon_runs_the_next_job() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let out = work.path().join("good.log");
    let good = write_script(
        work.path(),
        "good.sh",
        &format!("echo \"$LOCKETD_ARGS\" >> {}\n", out.display()),
    );
    let missing = work.path().join("no-such-dir/handler");
    let config = cfg("in")
        .top("max_payload_bytes = 200")
        .class("Good", &good, "")
        .class("Broken", &missing, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let worker = wait_registered(&mut r, &d);

    let oversized = format!(r#"{{"class":"Good","args":["{}"]}}"#, "x".repeat(250));
    let bad: Vec<(&str, String)> = vec![
        (
            "Locket::BadPayload",
            r#"{"class":"Good","args":[1"#.to_string(),
        ),
        (
            "Locket::BadPayload",
            r#"{"args":[2],"queue":"in"}"#.to_string(),
        ),
        (
            "Locket::BadPayload",
            r#"{"class":"Good","args":{"a":3}}"#.to_string(),
        ),
        ("Locket::BadPayload", oversized),
        (
            "Locket::HandlerError",
            r#"{"class":"Broken","args":[5]}"#.to_string(),
        ),
        (
            "NameError",
            r#"{"class":"Nope::Missing","args":[6]}"#.to_string(),
        ),
        ("Locket::BadPayload", "[1,2]".to_string()),
    ];
    for (i, (_, payload)) in bad.iter().enumerate() {
        r.push("in", payload);
        r.push("in", &format!(r#"{{"class":"Good","args":["after-{i}"]}}"#));
    }
    wait_until(SHORT, "every good job ran and every bad one failed", || {
        read_lossy(&out).lines().count() == bad.len() && r.failures().len() == bad.len()
    });
    let good_runs: Vec<String> = read_lossy(&out).lines().map(str::to_string).collect();
    let expected: Vec<String> = (0..bad.len())
        .map(|i| format!(r#"["after-{i}"]"#))
        .collect();
    assert_eq!(good_runs, expected);

    let failures = r.failures();
    for (f, (exception, payload)) in failures.iter().zip(&bad) {
        assert_eq!(f["exception"], *exception, "{f}");
        assert_eq!(f["queue"], "in", "{f}");
        assert_eq!(f["worker"], worker.as_str(), "{f}");
        assert!(
            f["failed_at"].is_string() && f["backtrace"].is_array(),
            "{f}"
        );
        assert!(!f["error"].as_str().unwrap_or("").is_empty(), "{f}");
        match serde_json::from_str::<Value>(payload) {
            // A JSON object is kept as the payload itself.
            Ok(v) if v.is_object() => assert_eq!(f["payload"], v, "{f}"),
            // Invalid JSON, or JSON resque-web cannot read `class` from: payload null, raw
            // text kept.
            _ => {
                assert!(f["payload"].is_null(), "{f}");
                assert_eq!(f["raw_payload"], payload.as_str(), "{f}");
            }
        }
    }
    assert!(
        failures[4]["error"]
            .as_str()
            .unwrap()
            .contains(&missing.display().to_string()),
        "{}",
        failures[4]
    );
    assert!(
        failures[5]["error"]
            .as_str()
            .unwrap()
            .contains("uninitialized constant Nope::Missing"),
        "{}",
        failures[5]
    );
    assert_eq!(r.failed_stat(), bad.len() as i64);
    assert_eq!(r.llen(&format!("{NS}:queue:in")), 0);
    assert!(d.is_running());
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 5. Graceful stop
// ---------------------------------------------------------------------------------------------

/// Runs a job that ends when the test says so, sends `sig` while it runs, and checks R-8 /
/// checklist 25: the job finishes successfully, nothing new is reserved, the worker unregisters
/// and exits 0.
fn stop_signal_lets_the_running_job_finish(sig: i32, graceful_term: bool) {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let done = work.path().join("done");
    let go = work.path().join("go");
    // It runs until `go` exists (at most 60 s), so the signal surely lands while it runs.
    let script = write_script(
        work.path(),
        "second.sh",
        &format!(
            "echo $$ > {}\ni=0\nwhile [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
             echo \"done $LOCKETD_ARGS\" >> {}\n",
            pid_file.display(),
            done.display(),
            go = go.display()
        ),
    );
    let config = cfg("q")
        .top(&format!("graceful_term = {graceful_term}"))
        .class("Job", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let worker = wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Job","args":[1]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    r.push("q", r#"{"class":"Job","args":[2]}"#);
    d.signal(sig);
    // The worker has taken the signal (it logs this just before it stops reserving).
    d.wait_for_log("reserving nothing new", SHORT);
    fs::write(&go, "").unwrap();
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    assert_eq!(read_lossy(&done), "done [1]\n");
    assert_eq!(r.processed(), 1);
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    // The second job was never reserved.
    let left: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:q"), "0", "-1"]);
    assert_eq!(left, vec![r#"{"class":"Job","args":[2]}"#.to_string()]);
    assert_unregistered(&mut r, &worker);
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
    assert!(process_group_members(handler).is_empty());
}

/// R-8, checklist 25, resque-protocol §7: QUIT lets the running job finish.
#[test]
fn quit_lets_the_running_job_finish_then_unregisters_and_exits_0() {
    stop_signal_lets_the_running_job_finish(libc::SIGQUIT, false);
}

/// resque-protocol §7 (`GRACEFUL_TERM`): with `graceful_term`, TERM behaves like QUIT.
#[test]
fn term_with_graceful_term_lets_the_running_job_finish() {
    stop_signal_lets_the_running_job_finish(libc::SIGTERM, true);
}

/// Starts a 30 s job and returns (daemon, worker id, handler pid, reaper). With
/// `ignore_term` the handler ignores SIGTERM (only SIGKILL stops it).
fn start_long_job_with(
    redis: &RedisServer,
    r: &mut R,
    work: &Path,
    c: Cfg,
    ignore_term: bool,
) -> (Daemon, String, i32, Reaper) {
    let pid_file = work.join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let script = write_script(
        work,
        "long.sh",
        &format!(
            "{}echo $$ > {}\nsleep 30\necho done >> {}/done\n",
            if ignore_term { "trap '' TERM\n" } else { "" },
            pid_file.display(),
            work.display()
        ),
    );
    let d = Daemon::start(redis, &c.class("Long", &script, "").render(), &[]);
    let worker = wait_registered(r, &d);
    r.push("q", r#"{"class":"Long","args":["l"]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    wait_until(SHORT, "the job is marked as running", || {
        r.exists(&format!("{NS}:worker:{worker}"))
    });
    (d, worker, handler, reaper)
}

/// Checks the failure record of a stopped long job and the cleanup after it
/// (R-8, checklist 16/20/24): `Resque::TermException` / `SIGTERM` (counted in `stat:failed`)
/// when the handler stopped on the polite stop, `Resque::DirtyExit` / SIGKILL (not counted)
/// when it had to be killed.
fn assert_stopped_as(r: &mut R, work: &Path, worker: &str, handler: i32, killed: bool) {
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    if killed {
        assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
        assert!(
            f["error"]
                .as_str()
                .unwrap()
                .starts_with("Child process received unhandled signal SIGKILL (signal 9)"),
            "{f}"
        );
        assert_eq!(r.failed_stat(), 0);
    } else {
        assert_eq!(f["exception"], "Resque::TermException", "{f}");
        assert_eq!(f["error"], "SIGTERM", "{f}");
        assert_eq!(r.failed_stat(), 1);
    }
    assert_eq!(f["payload"], json!({"class":"Long","args":["l"]}));
    assert_eq!(f["worker"], worker, "{f}");
    assert_eq!(f["queue"], "q");
    assert_eq!(r.processed(), 1);
    assert!(!work.join("done").exists(), "the job ran to its end");
    assert!(!pid_alive(handler));
    assert!(
        process_group_members(handler).is_empty(),
        "handler processes left"
    );
    assert_unregistered(r, worker);
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
}

/// Starts a long job under `c`, sends `sig`, and checks that the daemon exits 0 and the job
/// was recorded as stopped politely (`killed == false`) or killed. Returns the time from the
/// signal to the exit.
fn stop_long_job(c: Cfg, ignore_term: bool, sig: i32, killed: bool) -> Duration {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let (mut d, worker, handler, _reaper) =
        start_long_job_with(&redis, &mut r, work.path(), c, ignore_term);
    let sent = Instant::now();
    d.signal(sig);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    let took = sent.elapsed();
    assert_stopped_as(&mut r, work.path(), &worker, handler, killed);
    took
}

/// resque-protocol §7 (`shutdown!` with `TERM_CHILD`): TERM stops the running job now; a
/// handler that stops on SIGTERM is recorded as `Resque::TermException`; exit 0.
#[test]
fn term_stops_the_running_job_as_term_exception_and_exits_0() {
    let c = cfg("q").locket("shutdown_timeout", "\"20s\"");
    let took = stop_long_job(c, false, libc::SIGTERM, false);
    assert!(took < Duration::from_secs(5), "TERM waited {took:?}");
}

/// resque-protocol §7: INT always stops now, even with `graceful_term`.
#[test]
fn int_stops_the_running_job_even_with_graceful_term() {
    stop_long_job(
        cfg("q").top("graceful_term = true"),
        false,
        libc::SIGINT,
        false,
    );
}

/// resque-protocol §7 (`RESQUE_TERM_TIMEOUT`): a handler ignoring SIGTERM is SIGKILLed
/// `term_timeout` after TERM and recorded as `Resque::DirtyExit`, as Resque records a child
/// it had to kill.
#[test]
fn a_handler_ignoring_term_is_killed_after_term_timeout_as_dirty_exit() {
    let c = cfg("q").top("term_timeout = \"1s\"");
    let took = stop_long_job(c, true, libc::SIGTERM, true);
    assert!(
        took >= Duration::from_millis(900),
        "killed before term_timeout"
    );
}

/// resque-protocol §7, issue 3: a second TERM kills the running job at once (no
/// `term_timeout` wait); the worker still records it, unregisters and exits 0.
#[test]
fn a_second_term_kills_the_running_job_at_once_and_exits_0() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let (mut d, worker, handler, _reaper) = start_long_job_with(
        &redis,
        &mut r,
        work.path(),
        cfg("q").top("term_timeout = \"60s\""),
        true,
    );
    d.signal(libc::SIGTERM);
    d.wait_for_log("stopping now: the running job gets term_timeout", SHORT);
    assert!(d.is_running());
    d.signal(libc::SIGTERM);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    assert_stopped_as(&mut r, work.path(), &worker, handler, true);
}

/// resque-protocol §7 with the handler contract: TERM's polite stop is the handler's to answer,
/// as a Ruby job may rescue Resque::TermException. A handler that finishes cleanly on SIGTERM
/// (exit 0) is a success, and one that asks to run again (exit 75) is rescheduled: neither is
/// recorded as a TermException (before, both were, and a retry ran finished work again).
#[test]
fn a_handler_that_answers_term_decides_how_its_job_ends() {
    for (code, class) in [(0, "Clean"), (75, "Again")] {
        let redis = RedisServer::start();
        let mut r = R::new(&redis);
        let work = workdir();
        let pid_file = work.path().join("handler.pid");
        let mut reaper = Reaper::default();
        reaper.watch(&pid_file);
        // `sleep & wait`, so the trap runs as soon as SIGTERM arrives.
        let script = write_script(
            work.path(),
            "polite.sh",
            &format!(
                "trap 'exit {code}' TERM\necho $$ > {}\nsleep 30 &\nwait $!\n",
                pid_file.display()
            ),
        );
        let config = cfg("q").class(class, &script, "").render();
        let mut d = Daemon::start(&redis, &config, &[]);
        let worker = wait_registered(&mut r, &d);
        let payload = format!(r#"{{"class":"{class}","args":[1]}}"#);
        r.push("q", &payload);
        wait_pid(&pid_file, SHORT);
        wait_until(SHORT, "the job is marked as running", || {
            r.exists(&format!("{NS}:worker:{worker}"))
        });
        d.signal(libc::SIGTERM);
        assert_eq!(exit_code(&mut d, SHORT), Some(0), "{}", d.log());
        assert!(r.failures().is_empty(), "exit {code}: {:?}", r.failures());
        assert_eq!(r.failed_stat(), 0);
        let left: Vec<String> = r.cmd(&["LRANGE", &format!("{NS}:queue:q"), "0", "-1"]);
        if code == 0 {
            assert_eq!(r.processed(), 1);
            assert!(left.is_empty(), "{left:?}");
        } else {
            assert_eq!(left, vec![payload.clone()], "rescheduled");
        }
        assert_unregistered(&mut r, &worker);
    }
}

/// README "Signals": a TERM cuts a stop's grace to `term_timeout`, also while a job is already
/// being stopped for another reason. Here a handler that ignores SIGTERM runs past its class
/// `timeout` (1 s) into `kill_grace = 60s`; a TERM during that grace kills it after
/// term_timeout (1 s), and the job is recorded as the Locket::Timeout it was. Before, the TERM
/// was not looked at: the master SIGKILLed the whole worker at its own deadline (term_timeout
/// + 15 s) and the job became a Resque::DirtyExit.
#[test]
fn a_term_during_a_timeouts_kill_grace_cuts_it_to_term_timeout() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let (script, pid_file, _reaper) = stubborn_handler(work.path());
    // Unlocked: a locked job's hard stop comes by its lease's end whatever kill_grace says
    // (L-9), and check-config refuses a kill_grace that long for a locked class.
    let config = cfg("q")
        .top("term_timeout = \"1s\"")
        .class(
            "Slow",
            &script,
            "timeout = \"1s\"\nlock = false\nkill_grace = \"60s\"",
        )
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Slow","args":[1]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    // Past the timeout: the handler got its SIGTERM, ignored it, and is in its kill_grace.
    std::thread::sleep(Duration::from_millis(1800));
    assert!(
        pid_alive(handler),
        "the handler should still be in its kill_grace"
    );
    d.signal(libc::SIGTERM);
    assert_eq!(exit_code(&mut d, SHORT), Some(0), "{}", d.log());
    assert!(!pid_alive(handler));
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Locket::Timeout", "{failures:?}");
}

/// R-8: a job still running when QUIT's `shutdown_timeout` ends is stopped and recorded as
/// `Resque::TermException`; the daemon exits 0.
#[test]
fn a_job_outliving_shutdown_timeout_is_recorded_as_term_exception() {
    let c = cfg("q").locket("shutdown_timeout", "\"1s\"");
    stop_long_job(c, false, libc::SIGQUIT, false);
}

// ---------------------------------------------------------------------------------------------
// 6. Bad config
// ---------------------------------------------------------------------------------------------

fn locketd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_locketd"));
    c.env_remove("QUEUES")
        .env_remove("QUEUE")
        .env_remove("REDIS_URL")
        .env_remove("INTERVAL");
    c
}

/// C-1, README "Command line": `check-config` exits 78 naming the bad setting (heartbeat not
/// below the TTL, an unknown key) and 0 for the shipped reference config; the daemon itself
/// exits 78 on a bad config and when no queues are given.
#[test]
fn bad_configs_exit_78_naming_the_setting_and_the_reference_config_checks() {
    let work = workdir();
    let cases = [
        (
            "heartbeat.toml",
            "queues = \"q\"\n[locket]\nlock_ttl = \"2s\"\nheartbeat_interval = \"2s\"\n",
            "locket.heartbeat_interval",
        ),
        // Issue 23: the hard stop could not land before the lease ends.
        (
            "grace.toml",
            "queues = \"q\"\n[locket]\nlock_ttl = \"2s\"\nheartbeat_interval = \"500ms\"\nkill_grace = \"2s\"\n",
            "locket.kill_grace",
        ),
        (
            "unknown.toml",
            "queues = \"q\"\n[locket]\nlock_ttl = \"2s\"\nno_such_setting = 1\n",
            "no_such_setting",
        ),
    ];
    for (name, text, setting) in cases {
        let path = work.path().join(name);
        fs::write(&path, text).unwrap();
        let out = locketd().arg("check-config").arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{name}: {stderr}");
        assert!(stderr.contains(setting), "{name}: {stderr}");
    }
    let out = locketd()
        .args(["check-config", "config/locketd.toml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The daemon refuses the same configs before touching Redis.
    let redis = RedisServer::start();
    let mut d = Daemon::builder(&redis)
        .config(cases[0].1)
        .env_remove("QUEUES")
        .env_remove("QUEUE")
        .start();
    assert_eq!(exit_code(&mut d, SHORT), Some(78));
    assert!(d.log().contains("locket.heartbeat_interval"), "{}", d.log());
    let mut d = Daemon::builder(&redis)
        .config("interval = 0.1\n")
        .env_remove("QUEUES")
        .env_remove("QUEUE")
        .start();
    assert_eq!(exit_code(&mut d, SHORT), Some(78));
    assert!(d.log().contains("queues"), "{}", d.log());
    let keys: Vec<String> = R::new(&redis).keys("*");
    assert!(keys.is_empty(), "a refused daemon wrote {keys:?}");
}

/// README "Command line": a Redis that does not answer within `redis_connect_timeout` at start
/// makes the daemon exit 69 (EX_UNAVAILABLE, which the systemd unit's `Restart=on-failure`
/// retries; 78 would be final) after retrying, not at the first refusal, and without starting
/// a worker meanwhile.
#[test]
fn an_unreachable_redis_makes_the_daemon_exit_69() {
    let mut redis = RedisServer::start();
    redis.stop(); // its port is now closed
    let config = cfg("q").top("redis_connect_timeout = \"2s\"").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    assert_eq!(
        exit_code(&mut d, Duration::from_secs(20)),
        Some(69),
        "{}",
        d.log()
    );
    assert!(
        count(&d.log(), "redis not answering yet") >= 2,
        "it should retry before giving up: {}",
        d.log()
    );
    assert!(
        d.log().contains(&format!("127.0.0.1:{}", redis.port())),
        "{}",
        d.log()
    );
    assert!(!d.log().contains("worker started"), "{}", d.log());
}

/// A daemon started while Redis is still coming up waits for it and then works.
#[test]
fn a_daemon_started_before_redis_waits_for_it() {
    let mut redis = RedisServer::start();
    redis.stop();
    let config = cfg("q")
        .top("redis_connect_timeout = \"30s\"")
        .class("Ok", Path::new("/bin/true"), "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    d.wait_for_log("redis not answering yet", SHORT);
    redis.restart();
    let mut r = R::new(&redis);
    let worker = wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Ok","args":[]}"#);
    wait_until(SHORT, "the job ran", || r.processed() == 1);
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0), "{}", d.log());
    assert_unregistered(&mut r, &worker);
}

/// Issue: "one event when a job starts and one when it ends (queue, class, worker, elapsed,
/// outcome) ... text or JSON lines": with `--log-format json` every line is a JSON object and
/// the two job events carry those fields.
#[test]
fn json_logs_carry_the_job_fields() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    r.push("q", r#"{"class":"Ok","args":[7]}"#);
    let config = cfg("q").class("Ok", Path::new("/bin/true"), "").render();
    let mut d = Daemon::builder(&redis)
        .config(&config)
        .args(["--log-format", "json", "--interval", "0"])
        .env("RUST_LOG", "locketd=info")
        .start();
    assert_eq!(exit_code(&mut d, SHORT), Some(0), "{}", d.log());
    let events: Vec<serde_json::Value> = d
        .log()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let find = |msg: &str| {
        events
            .iter()
            .find(|e| e["message"] == msg)
            .unwrap_or_else(|| panic!("no {msg:?} event in {events:?}"))
            .clone()
    };
    let started = find("job started");
    assert_eq!(started["queue"], "q");
    assert_eq!(started["class"], "Ok");
    assert!(started["worker"].as_str().unwrap().ends_with(":q"));
    let finished = find("job finished");
    assert_eq!(finished["outcome"], "success");
    assert_eq!(finished["class"], "Ok");
    assert!(finished["elapsed"].as_f64().unwrap() >= 0.0);
    assert_eq!(finished["level"], "INFO");
}

// ---------------------------------------------------------------------------------------------
// 7. Lost lock
// ---------------------------------------------------------------------------------------------

/// A-11, NEVER-8, checklist 21: when a running job's lock disappears, the next heartbeat finds
/// it lost; the handler (which ignores SIGTERM) is killed after `kill_grace` and the job is
/// recorded as `Locket::LockLost`; the daemon goes on with the next job.
#[test]
fn a_lost_lock_stops_the_handler_and_records_lock_lost() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let runs = work.path().join("runs");
    let script = write_script(
        work.path(),
        "stubborn.sh",
        &format!(
            r#"if [ "$LOCKETD_ARGS" = '["next"]' ]; then echo next >> {runs}; exit 0; fi
trap '' TERM
echo $$ > {pid}
sleep 30
echo done >> {runs}
"#,
            runs = runs.display(),
            pid = pid_file.display()
        ),
    );
    let config = cfg("q").class("Stubborn", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let worker = wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Stubborn","args":["lost"]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    let lock_key = format!(
        "{NS}:locket:lock:{}",
        default_lock_id("Stubborn", r#"["lost"]"#)
    );
    wait_until(SHORT, "the lock is held", || r.exists(&lock_key));
    let _: i64 = r.cmd(&["DEL", &lock_key]);
    let deleted = Instant::now();

    // About heartbeat_interval (0.5 s) + kill_grace (1 s); the bound only catches a handler
    // that is never stopped (it would run 30 s), with room for a slow machine.
    wait_until(
        SHORT,
        "the handler was stopped and LockLost recorded",
        || !pid_alive(handler) && !r.failures().is_empty(),
    );
    let stopped_after = deleted.elapsed();
    // The group was sent SIGKILL before the failure was written; on a loaded machine its
    // last member may take a moment to be scheduled and exit. One that was never signalled
    // would sleep on for 30 s.
    wait_until(Duration::from_secs(3), "no handler process left", || {
        process_group_members(handler).is_empty()
    });
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    assert_eq!(f["exception"], "Locket::LockLost", "{f}");
    assert_eq!(f["payload"], json!({"class":"Stubborn","args":["lost"]}));
    assert_eq!(f["worker"], worker.as_str());
    assert_eq!(r.failed_stat(), 1);
    assert!(!read_lossy(&runs).contains("done"));
    // Log lines go through the log thread's queue (logsink.rs): written soon, not at once.
    wait_until(SHORT, "the lost lock logged", || {
        d.log().contains("job lock lost")
    });
    assert!(!r.exists(&format!("{NS}:worker:{worker}")));

    r.push("q", r#"{"class":"Stubborn","args":["next"]}"#);
    wait_until(SHORT, "the next job ran", || {
        read_lossy(&runs).contains("next")
    });
    assert!(d.is_running());
    assert_eq!(d.terminate(SHORT).code(), Some(0));
    eprintln!("handler stopped {stopped_after:?} after the lock was deleted");
}

/// Handler contract (CommandFailed's error names the last stderr line): a handler that leaves
/// a process of its own session (setsid) holding its stdout and stderr still has its failure
/// recorded with the reason it wrote. Before, the stderr reader was still waiting on the pipe
/// when it was given up, and the tail it held was dropped with it.
#[test]
fn a_handler_leaving_a_setsid_process_on_its_pipes_keeps_its_failure_reason() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("escaped.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let script = write_script(
        work.path(),
        "escape.sh",
        &format!(
            "setsid -f sh -c 'echo $$ > {0}; exec sleep 30'\n\
             i=0\nwhile [ ! -s {0} ] && [ $i -lt 200 ]; do sleep 0.01; i=$((i+1)); done\n\
             echo 'boom: real reason' >&2\nexit 1\n",
            pid_file.display()
        ),
    );
    let config = cfg("q").class("Escape", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Escape","args":[]}"#);
    wait_until(SHORT, "the failure recorded", || !r.failures().is_empty());
    wait_pid(&pid_file, SHORT);
    let f = &r.failures()[0];
    assert_eq!(f["exception"], "Locket::CommandFailed", "{f}");
    assert!(
        f["error"]
            .as_str()
            .unwrap()
            .ends_with("exited with status 1: boom: real reason"),
        "{f}"
    );
    assert_eq!(f["backtrace"], json!(["boom: real reason"]), "{f}");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// Handler contract: args too large for the environment (Linux refuses one environment string
/// over 128 KiB, so exec failed with E2BIG and the job could never run) are left out of
/// LOCKETD_ARGS, with LOCKETD_ARGS_OMITTED=1, and the job runs with its whole payload on stdin.
#[test]
fn a_job_with_args_too_large_for_the_environment_runs_with_them_on_stdin() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let runs = work.path().join("runs");
    // One line per run: LOCKETD_ARGS_OMITTED, the length of LOCKETD_ARGS, the stdin bytes.
    let script = write_script(
        work.path(),
        "big.sh",
        &format!(
            "n=$(wc -c)\nprintf '%s|%s|%s\\n' \"${{LOCKETD_ARGS_OMITTED-unset}}\" \"${{#LOCKETD_ARGS}}\" \"$n\" >> {}\n",
            runs.display()
        ),
    );
    let config = cfg("q").class("Big", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    let big = "a".repeat(200 * 1024);
    let payload = format!(r#"{{"class":"Big","args":["{big}"]}}"#);
    r.push("q", &payload);
    r.push("q", r#"{"class":"Big","args":["small"]}"#);
    wait_until(SHORT, "both jobs ran", || r.processed() == 2);
    let failures: Vec<String> = r
        .failures()
        .iter()
        .map(|f| f["error"].to_string())
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
    let lines: Vec<String> = read_lossy(&runs).lines().map(str::to_string).collect();
    assert_eq!(
        lines,
        vec![
            format!("1|0|{}", payload.len()),
            format!("unset|9|{}", r#"{"class":"Big","args":["small"]}"#.len()),
        ]
    );
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A handler may print anything: a line of bytes that are not UTF-8 is logged with U+FFFD and
/// the rest of its output is still read, so it runs to its end and succeeds. Before, the
/// reader stopped at that line and closed the pipe, and the handler's next write killed it with
/// SIGPIPE (recorded as Resque::DirtyExit).
#[test]
fn a_handler_printing_bytes_that_are_not_utf8_runs_to_its_end() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let script = write_script(
        work.path(),
        "binary.sh",
        "printf '\\377\\376\\n'\nfor i in $(seq 1 200); do echo \"line $i\"; done\necho done >&2\n",
    );
    let config = cfg("q").class("Binary", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Binary","args":[]}"#);
    wait_until(SHORT, "the job ended", || {
        r.processed() == 1 || !r.failures().is_empty()
    });
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    d.wait_for_log("line 200", SHORT);
    assert!(
        d.log().contains('\u{fffd}'),
        "the bad bytes were not logged"
    );
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

/// README's `[classes."*"]` is the fallback for every class without a table of its own, for
/// its lock settings and limits as well as its handler: a job of an unlisted class runs with
/// "*"'s `timeout` and `lock = false`. A class with its own table takes nothing from "*".
#[test]
fn the_star_table_is_the_whole_fallback_for_unlisted_classes() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let slow = write_script(work.path(), "slow.sh", "sleep 4\n");
    let quick = write_script(work.path(), "quick.sh", "exit 0\n");
    let config = cfg("q")
        .class("*", &slow, "timeout = \"1s\"\nlock = false")
        .class("Own", &quick, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    let acquired = format!("{NS}:locket:stat:acquired");
    r.push("q", r#"{"class":"Anything","args":[1]}"#);
    wait_until(SHORT, "the unlisted class timed out", || {
        !r.failures().is_empty()
    });
    assert_eq!(r.failures()[0]["exception"], "Locket::Timeout");
    // The job's counts are written within a second (O-3): its start is, and no acquisition.
    let started = format!("{NS}:locket:stat:started");
    wait_until(SHORT, "the start is counted", || r.exists(&started));
    assert!(
        !r.exists(&acquired),
        "a lock was taken despite lock = false"
    );

    r.push("q", r#"{"class":"Own","args":[1]}"#);
    wait_until(SHORT, "the listed class ran", || r.processed() == 2);
    assert_eq!(r.failures().len(), 1);
    // Counted within a second (O-3).
    wait_until(SHORT, "Own keeps the default lock", || {
        r.int(&acquired) == 1
    });
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

/// NEVER-1, L-9, A-10: a lock extension that Redis does not answer must not hold up the job's
/// lease. `CLIENT PAUSE 30000 WRITE` holds the EXTEND script (and every write) for 30 s; the
/// local deadline (lock_ttl 2 s) passes meanwhile, so the handler, which ignores SIGTERM, is
/// killed after kill_grace (1 s), while Redis is still paused, and the job is recorded as
/// `Locket::LockLost` once Redis answers again (the test unpauses it then). Before, the worker waited for the extension's
/// answer and only then looked at the deadline: the job outlived its lock by the whole pause.
#[test]
fn a_stalled_lock_extension_does_not_outlast_the_lease() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let (script, pid_file, _reaper) = stubborn_handler(work.path());
    // A long process lease, so that a worker which cannot renew it for the pause does not
    // presume itself dead (that too would stop the job, for another reason).
    let config = cfg("q")
        .locket("process_ttl", "\"30s\"")
        .class("Stubborn", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    r.push("q", r#"{"class":"Stubborn","args":[1]}"#);
    let handler = wait_pid(&pid_file, SHORT);
    let paused = Instant::now();
    let _: () = r.cmd(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    // lock_ttl (2 s) + kill_grace (1 s) at most, well inside the 30 s pause.
    wait_until(Duration::from_secs(25), "the handler was killed", || {
        !pid_alive(handler)
    });
    let killed_after = paused.elapsed();
    assert!(
        killed_after < Duration::from_secs(20),
        "the handler outlived its lease by the pause: killed {killed_after:?} after it began"
    );
    let _: () = r.cmd(&["CLIENT", "UNPAUSE"]);
    wait_until(Duration::from_secs(20), "LockLost recorded", || {
        !r.failures().is_empty()
    });
    assert_eq!(r.failures()[0]["exception"], "Locket::LockLost");
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

/// A-11 with the per-class `on_lock_lost = "requeue"`: the stopped job goes back to its queue
/// (same bytes) instead of the failed list, and runs again.
#[test]
fn with_requeue_on_lock_lost_the_job_goes_back_to_its_queue() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let pid_file = work.path().join("handler.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let w = work.path().display().to_string();
    let script = write_script(
        work.path(),
        "twice.sh",
        &format!(
            r#"if [ -e {w}/first ]; then cat > {w}/stdin2; echo second >> {w}/runs; exit 0; fi
touch {w}/first
echo $$ > {pid}
exec sleep 30
"#,
            pid = pid_file.display()
        ),
    );
    let config = cfg("q")
        .class("Twice", &script, "on_lock_lost = \"requeue\"")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_registered(&mut r, &d);
    let payload = r#"{"class":"Twice", "args":[ "r" ], "id":"abc"}"#;
    r.push("q", payload);
    let handler = wait_pid(&pid_file, SHORT);
    let lock_key = format!("{NS}:locket:lock:{}", default_lock_id("Twice", r#"["r"]"#));
    wait_until(SHORT, "the lock is held", || r.exists(&lock_key));
    let _: i64 = r.cmd(&["DEL", &lock_key]);
    wait_until(SHORT, "the requeued job ran again", || {
        read_lossy(&work.path().join("runs")).contains("second") && r.processed() == 1
    });
    assert!(!pid_alive(handler));
    assert_eq!(read_lossy(&work.path().join("stdin2")), payload);
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(r.failed_stat(), 0);
    assert_eq!(r.llen(&format!("{NS}:queue:q")), 0);
    wait_until(SHORT, "the lost lock logged", || {
        d.log().contains("job lock lost")
    });
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 8. Handler environment
// ---------------------------------------------------------------------------------------------

/// README "Handler contract", A-9, T-2/T-4, A-5: a command handler gets the payload on stdin
/// and LOCKETD_CLASS/QUEUE/ARGS/WORKER/LOCK_KEYS/LOCK_TOKEN (plus the class's `env`, and none of
/// the master's own variables for its workers); the token
/// is the lease member of the default lock `Class:<sha256 of canonical args>`; a `lock = false`
/// class and a queue outside `lock_queues` run unlocked (`[]`, empty token).
#[test]
fn handlers_get_the_payload_and_the_documented_environment() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let script = write_script(
        work.path(),
        "env.sh",
        &format!(
            r#"d={out}/run-$$
mkdir -p "$d"
printf '%s' "$LOCKETD_CLASS" > "$d/class"
printf '%s' "$LOCKETD_QUEUE" > "$d/queue"
printf '%s' "$LOCKETD_ARGS" > "$d/args"
printf '%s' "$LOCKETD_WORKER" > "$d/worker"
printf '%s' "$LOCKETD_LOCK_KEYS" > "$d/lock_keys"
printf '%s' "${{LOCKETD_LOCK_TOKEN-unset}}" > "$d/lock_token"
printf '%s' "${{CLASS_ENV-unset}}" > "$d/class_env"
printf '%s' "${{LOCKETD_ROLE-unset}} ${{LOCKETD_PAUSED-unset}} ${{LOCKETD_WORKER_INDEX-unset}}" > "$d/internal"
cat > "$d/stdin"
case "$LOCKETD_ARGS" in
  *hold*)
    touch "$d/holding"
    i=0
    while [ ! -e {out}/release ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
    ;;
esac
touch "$d/complete"
"#,
            out = out.display()
        ),
    );
    let config = cfg("main,other")
        .locket("lock_queues", "[\"main\"]")
        .class(
            "Env::Dump",
            &script,
            "env = { CLASS_ENV = \"from config\" }",
        )
        .class("Env::Unlocked", &script, "lock = false")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let worker = wait_registered(&mut r, &d);
    assert_eq!(
        worker,
        format!("{}:{}:main,other", hostname(), d.worker_pid())
    );

    let locked = r#"{"class":"Env::Dump","args":[1.0, "hold", {"b":2,"a":1}],"extra":"kept"}"#;
    let no_args = r#"{"class":"Env::Dump"}"#;
    let unlocked_class = r#"{"class":"Env::Unlocked","args":["u"]}"#;
    let other_queue = r#"{"class":"Env::Dump","args":["o"]}"#;
    r.push("main", locked);
    r.push("main", no_args);
    r.push("main", unlocked_class);
    r.push("other", other_queue);

    let read_runs = || -> Vec<HashMap<String, String>> {
        let mut runs = Vec::new();
        for entry in fs::read_dir(&out).unwrap() {
            let dir = entry.unwrap().path();
            if !dir.is_dir() {
                continue;
            }
            let mut m = HashMap::new();
            for f in fs::read_dir(&dir).unwrap() {
                let f = f.unwrap().path();
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                m.insert(name, read_lossy(&f));
            }
            runs.push(m);
        }
        runs
    };

    // While the locked job runs, its token is the live member of its lock (A-9).
    let mut holding = HashMap::new();
    wait_until(SHORT, "the locked job is running", || {
        match read_runs().into_iter().find(|m| m.contains_key("holding")) {
            Some(m) => {
                holding = m;
                true
            }
            None => false,
        }
    });
    let lock_id = default_lock_id("Env::Dump", r#"[1,"hold",{"a":1,"b":2}]"#);
    assert_eq!(holding["lock_keys"], format!("[\"{lock_id}\"]"));
    // The master's variables for its workers are not the handler's: a handler that runs
    // locketd must not start as a worker reading its config from stdin.
    assert_eq!(holding["internal"], "unset unset unset");
    let token = holding["lock_token"].clone();
    assert!(
        token.len() == 32
            && token
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "token {token:?}"
    );
    assert!(
        r.lock_holders(&format!("{NS}:locket:lock:{lock_id}"))
            .contains(&token.to_string()),
        "the handler's token does not hold {lock_id}"
    );
    fs::write(out.join("release"), "").unwrap();

    wait_until(SHORT, "every job ran", || {
        read_runs()
            .iter()
            .filter(|m| m.contains_key("complete"))
            .count()
            == 4
            && r.processed() == 4
    });
    let runs = read_runs();
    let by_stdin = |payload: &str| -> HashMap<String, String> {
        runs.iter()
            .find(|m| m.get("stdin").map(String::as_str) == Some(payload))
            .unwrap_or_else(|| panic!("no run got {payload} on stdin: {runs:?}"))
            .clone()
    };

    let m = by_stdin(locked);
    assert_eq!(m["class"], "Env::Dump");
    assert_eq!(m["queue"], "main");
    assert_eq!(
        m["args"], r#"[1.0, "hold", {"b":2,"a":1}]"#,
        "args exactly as enqueued"
    );
    assert_eq!(m["worker"], worker);
    assert_eq!(m["lock_keys"], format!("[\"{lock_id}\"]"));
    assert_eq!(m["lock_token"], token);
    assert_eq!(m["class_env"], "from config");

    let m = by_stdin(no_args);
    assert_eq!(m["args"], "[]");
    assert_eq!(
        m["lock_keys"],
        format!("[\"{}\"]", default_lock_id("Env::Dump", "[]"))
    );
    assert_eq!(m["lock_token"].len(), 32);
    assert_ne!(m["lock_token"], token, "a token is never reused (L-3)");

    let m = by_stdin(unlocked_class);
    assert_eq!(m["class"], "Env::Unlocked");
    assert_eq!(m["lock_keys"], "[]");
    assert_eq!(m["lock_token"], "");
    assert_eq!(m["class_env"], "unset", "env is per class");

    let m = by_stdin(other_queue);
    assert_eq!(m["queue"], "other");
    assert_eq!(
        m["lock_keys"], "[]",
        "queue outside lock_queues is unlocked"
    );
    assert_eq!(m["lock_token"], "");

    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 9. Redis restart
// ---------------------------------------------------------------------------------------------

/// E-3, S-3: Redis going away while the daemon idles is logged, does not crash it, and jobs
/// pushed once Redis is back (with its AOF data) are processed.
#[test]
fn the_daemon_survives_a_redis_restart_and_runs_jobs_pushed_afterwards() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let work = workdir();
    let runs = work.path().join("runs");
    let script = write_script(
        work.path(),
        "job.sh",
        &format!("echo \"ran $LOCKETD_ARGS\" >> {}\n", runs.display()),
    );
    // The outage must stay shorter than process_ttl, or the daemon rightly presumes itself
    // dead (R-2) once Redis is back.
    let config = cfg("q")
        .locket("process_ttl", "\"15s\"")
        .class("Job", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    {
        let mut r = R::new(&redis);
        wait_registered(&mut r, &d);
        r.push("q", r#"{"class":"Job","args":["before"]}"#);
        wait_until(SHORT, "the first job ran", || {
            read_lossy(&runs).contains("before") && r.processed() == 1
        });
    }

    redis.stop();
    d.wait_for_log("redis unavailable", SHORT);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(d.is_running(), "locketd died with Redis\n{}", d.log());
    redis.restart();

    let mut r = R::new(&redis);
    r.push("q", r#"{"class":"Job","args":["after"]}"#);
    wait_until(
        Duration::from_secs(20),
        "the job pushed after the restart ran",
        || read_lossy(&runs).contains("after") && r.processed() == 2,
    );
    assert_eq!(read_lossy(&runs), "ran [\"before\"]\nran [\"after\"]\n");
    wait_until(SHORT, "the reconnection logged", || {
        d.log().contains("reachable again")
    });
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}
