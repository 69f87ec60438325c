//! Issue 3 end to end: the master and its worker processes, Resque's signals, crash recovery,
//! config reload, Redis outages and a chaos run, all against the real binary and a private
//! `redis-server`.
//!
//! Rule ids are those of `locking-semantics.md` (R-*, NEVER-*); signals are those of
//! `resque-protocol.md` §7. Run: `cargo test --test it supervision::`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::daemon::{assert_unregistered, cfg, exit_code, workdir, Reaper, NS, R, SHORT};
use crate::support::{pid_alive, read_lossy, tail, wait_until, write_script, Daemon, RedisServer};

fn cmdline(pid: i32) -> String {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw)
        .trim_end_matches(['\0', ' '])
        .replace('\0', " ")
        .trim_end()
        .to_string()
}

/// The registered Resque worker ids of a daemon's worker processes, waiting until there are `n`.
fn wait_workers(r: &mut R, d: &Daemon, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    wait_until(SHORT, &format!("{n} registered workers"), || {
        let pids = d.worker_pids();
        ids = r
            .workers()
            .into_iter()
            .filter(|w| pids.iter().any(|p| w.contains(&format!(":{p}:"))))
            .collect();
        ids.sort();
        pids.len() == n && ids.len() == n
    });
    ids
}

fn pid_of(worker_id: &str) -> i32 {
    worker_id.split(':').nth(1).unwrap().parse().unwrap()
}

/// A handler that writes `<worker id>` to `<dir>/worker.<tag>`, its pid to `<dir>/pid.<tag>`,
/// starts a child (`sleep`) whose pid goes to `<dir>/child.<tag>`, and waits for it.
fn long_handler(dir: &Path) -> std::path::PathBuf {
    write_script(
        dir,
        "long.sh",
        &format!(
            r#"tag=$(echo "$LOCKETD_ARGS" | tr -dc 'a-z0-9')
echo "$LOCKETD_WORKER" > {d}/worker.$tag
echo $$ > {d}/pid.$tag
sleep 30 &
echo $! > {d}/child.$tag
wait
"#,
            d = dir.display()
        ),
    )
}

fn wait_file(path: &Path) -> String {
    let mut text = String::new();
    wait_until(SHORT, &format!("{}", path.display()), || {
        text = read_lossy(path).trim().to_string();
        !text.is_empty()
    });
    text
}

/// R-4, NEVER-1, issue 3 "crash recovery": a worker SIGKILLed mid-job is noticed at once: its
/// handler and the handler's own child die, its job is recorded once as `Resque::DirtyExit`,
/// its lock is free long before the 35 s lease would lapse, its Resque registration is gone,
/// and the master starts a replacement that works the next job of the same lock key.
#[test]
fn a_sigkilled_worker_is_recovered_at_once_and_replaced() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let mut reaper = Reaper::default();
    for f in ["pid.a", "child.a", "pid.b", "child.b"] {
        reaper.watch(&dir.join(f));
    }
    let script = long_handler(dir);
    let config = cfg("q")
        .top("workers = 2")
        .class("Long", &script, "")
        .render();
    let d = Daemon::start(&redis, &config, &[]);
    let before = wait_workers(&mut r, &d, 2);

    r.push("q", r#"{"class":"Long","args":["a"]}"#);
    let victim = wait_file(&dir.join("worker.a"));
    let handler: i32 = wait_file(&dir.join("pid.a")).parse().unwrap();
    let child: i32 = wait_file(&dir.join("child.a")).parse().unwrap();
    let lock_keys = r.keys(&format!("{NS}:locket:lock:*"));
    assert_eq!(lock_keys.len(), 1, "{lock_keys:?}");
    let lock_key = lock_keys[0].clone();

    let killed_at = Instant::now();
    // SAFETY: kill(2) of the daemon's worker process.
    unsafe { libc::kill(pid_of(&victim), libc::SIGKILL) };

    wait_until(SHORT, "the lock is released", || {
        let n = r.lock_holders(&lock_key).len() as i64;
        n == 0
    });
    let released_after = killed_at.elapsed();
    assert!(
        released_after < Duration::from_secs(10),
        "lock released only after {released_after:?}"
    );
    assert!(!pid_alive(handler), "the handler outlived its worker");
    assert!(!pid_alive(child), "the handler's child outlived its worker");
    wait_until(SHORT, "the job is recorded", || r.failures().len() == 1);
    let f = &r.failures()[0];
    assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
    assert_eq!(f["worker"], victim.as_str(), "{f}");
    let error = f["error"].as_str().unwrap();
    assert!(error.starts_with("Job still being processed"), "{f}");
    assert!(error.contains("died (killed by SIGKILL (signal 9))"), "{f}");
    assert_eq!(f["payload"]["args"][0], "a");
    assert!(!r.workers().contains(&victim));
    assert!(!r.exists(&format!("{NS}:worker:{victim}")));
    let beat: Option<String> = r.cmd(&["HGET", &format!("{NS}:workers:heartbeat"), &victim]);
    assert_eq!(beat, None);

    let after = wait_workers(&mut r, &d, 2);
    assert_ne!(before, after, "no replacement worker");
    assert!(after.iter().all(|w| *w != victim));
    wait_until(SHORT, "the death logged", || {
        d.log().contains("worker died: killed by SIGKILL")
    });

    // The same lock key runs again right away, on a live worker.
    r.push("q", r#"{"class":"Long","args":["a"]}"#);
    wait_until(SHORT, "the job of the same key runs again", || {
        let n = r.lock_holders(&lock_key).len() as i64;
        n == 1
    });
    assert_eq!(r.failures().len(), 1, "recorded once");
}

/// resque-protocol §7: USR1 kills the running job (recorded as `Resque::DirtyExit`) and the
/// worker keeps working: the next job runs and succeeds.
#[test]
fn usr1_kills_the_running_job_and_the_worker_keeps_working() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let mut reaper = Reaper::default();
    reaper.watch(&dir.join("pid.a"));
    reaper.watch(&dir.join("child.a"));
    // A handler that would note a polite stop: USR1 gives none (Resque's kill_child).
    let script = long_handler(dir);
    let trapping = write_script(
        dir,
        "trapping.sh",
        &format!(
            "trap 'echo term >> {}/term; exit 1' TERM\n. {}\n",
            dir.display(),
            script.display()
        ),
    );
    let quick = write_script(
        dir,
        "quick.sh",
        &format!("echo ok >> {}/quick\n", dir.display()),
    );
    let config = cfg("q")
        .class("Long", &trapping, "")
        .class("Quick", &quick, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let ids = wait_workers(&mut r, &d, 1);
    r.push("q", r#"{"class":"Long","args":["a"]}"#);
    let handler: i32 = wait_file(&dir.join("pid.a")).parse().unwrap();
    let child: i32 = wait_file(&dir.join("child.a")).parse().unwrap();
    r.push("q", r#"{"class":"Quick","args":[]}"#);
    d.signal(libc::SIGUSR1);
    wait_until(SHORT, "the next job ran", || {
        read_lossy(&dir.join("quick")) == "ok\n"
    });
    assert!(!pid_alive(handler) && !pid_alive(child));
    assert_eq!(read_lossy(&dir.join("term")), "", "USR1 sent no SIGTERM");
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    assert!(failures[0]["error"]
        .as_str()
        .unwrap()
        .contains("SIGKILL (signal 9)"));
    assert_eq!(
        wait_workers(&mut r, &d, 1),
        ids,
        "the same worker kept working"
    );
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// resque-protocol §7: USR2 pauses every worker (titles say `Paused`, nothing is reserved);
/// CONT resumes them and the waiting job runs.
#[test]
fn usr2_pauses_every_worker_and_cont_resumes() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let quick = write_script(
        dir,
        "quick.sh",
        &format!("echo ok >> {}/quick\n", dir.display()),
    );
    let config = cfg("q")
        .top("workers = 2")
        .class("Quick", &quick, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_workers(&mut r, &d, 2);
    d.signal(libc::SIGUSR2);
    let paused = "resque-0.1.0-locketd: Paused";
    wait_until(SHORT, "both titles say Paused", || {
        d.worker_pids().iter().all(|p| cmdline(*p) == paused)
    });
    // A worker that dies while the master is paused is replaced by a paused one.
    let before = d.worker_pids();
    // SAFETY: kill(2) of one of the daemon's worker processes.
    unsafe { libc::kill(before[0], libc::SIGKILL) };
    wait_until(SHORT, "the replacement runs, paused", || {
        let now = d.worker_pids();
        now.len() == 2 && !now.contains(&before[0]) && now.iter().all(|p| cmdline(*p) == paused)
    });
    r.push("q", r#"{"class":"Quick","args":[]}"#);
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(
        r.llen(&format!("{NS}:queue:q")),
        1,
        "a paused worker reserved"
    );
    assert_eq!(read_lossy(&dir.join("quick")), "");
    d.signal(libc::SIGCONT);
    wait_until(SHORT, "the job ran after CONT", || {
        read_lossy(&dir.join("quick")) == "ok\n"
    });
    wait_until(SHORT, "titles say Waiting again", || {
        d.worker_pids()
            .iter()
            .all(|p| cmdline(*p) == "resque-0.1.0-locketd: Waiting for q")
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A worker that does not stop by the stop deadline is SIGKILLed, and the master recovers its
/// job (R-4) before it exits, rather than leaving it to a janitor that may never come. A HUP
/// during the stop is ignored: new workers then would take new jobs and get no stop signal.
#[test]
fn a_worker_killed_at_the_stop_deadline_is_recovered_before_the_master_exits() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let started = work.path().join("started");
    let long = write_script(
        work.path(),
        "long.sh",
        &format!("echo ok > {}\nsleep 60\n", started.display()),
    );
    let config = cfg("q")
        .top("term_timeout = \"1s\"")
        .class("Long", &long, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_workers(&mut r, &d, 1);
    let worker = d.worker_pid();
    r.push("q", r#"{"class":"Long","args":[]}"#);
    // The handler itself must have started: a worker frozen between RESERVE and ACQUIRE
    // holds a job that never ran, which R-4 requeues rather than fails.
    wait_until(SHORT, "the job runs", || read_lossy(&started) == "ok\n");
    // A worker that cannot stop: frozen, it ignores the TERM the master forwards.
    // SAFETY: kill(2) of the daemon's worker process.
    unsafe { libc::kill(worker, libc::SIGSTOP) };
    d.signal(libc::SIGTERM);
    d.wait_for_log("stopping: forwarding to every worker", SHORT);
    d.signal(libc::SIGHUP);
    d.wait_for_log("HUP while stopping: ignored", SHORT);
    assert_eq!(d.worker_pids(), vec![worker], "a HUP started workers");
    // term_timeout (1 s) + 15 s, then SIGKILL and the recovery.
    let status = d
        .wait_exit(Duration::from_secs(40))
        .expect("the master exits");
    assert_eq!(status.code(), Some(0), "{}", d.log());
    assert!(r.keys(&format!("{NS}:locket:inflight:*")).is_empty());
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Resque::DirtyExit");
    assert!(r.workers().is_empty(), "{:?}", r.workers());
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:locket:processes")]);
    assert!(processes.is_empty(), "{processes:?}");
}

/// R-8 with several workers: QUIT stops every worker; each unregisters and the master exits 0.
#[test]
fn quit_stops_every_worker_and_the_master_exits_0() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let config = cfg("q").top("workers = 3").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    let ids = wait_workers(&mut r, &d, 3);
    let pids = d.worker_pids();
    assert!(cmdline(d.pid()).starts_with("locketd master: 3 workers for q"));
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    for id in &ids {
        assert_unregistered(&mut r, id);
    }
    assert!(pids.iter().all(|p| !pid_alive(*p)));
}

/// Issue 3 "HUP": a good new config replaces the workers gracefully (a running job finishes,
/// new workers serve the new queues); a bad one is refused and the running workers stay.
#[test]
fn hup_reloads_a_good_config_gracefully_and_refuses_a_bad_one() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let slow = write_script(
        dir,
        "slow.sh",
        &format!(
            "echo ok > {0}/started\nsleep 1\necho \"$LOCKETD_QUEUE\" >> {0}/done\n",
            dir.display()
        ),
    );
    let config = |queues: &str| {
        cfg(queues)
            .top("workers = 2")
            .class("Slow", &slow, "")
            .render()
    };
    let d = Daemon::start(&redis, &config("q"), &[]);
    let old = wait_workers(&mut r, &d, 2);
    let old_pids = d.worker_pids();
    r.push("q", r#"{"class":"Slow","args":[]}"#);
    // The handler itself: a QUIT that reaches a worker between RESERVE and ACQUIRE returns
    // the job to q, which the new workers do not serve.
    wait_until(SHORT, "the job started", || {
        read_lossy(&dir.join("started")) == "ok\n"
    });

    fs::write(d.config_path(), config("q2")).unwrap();
    d.signal(libc::SIGHUP);
    let mut new = Vec::new();
    wait_until(SHORT, "two workers on q2 and none on q", || {
        new = r.workers();
        new.iter().filter(|w| w.ends_with(":q2")).count() == 2
            && !new.iter().any(|w| w.ends_with(":q"))
    });
    assert_eq!(
        read_lossy(&dir.join("done")),
        "q\n",
        "the running job finished"
    );
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert!(old.iter().all(|w| !new.contains(w)));
    wait_until(SHORT, "the old workers exited", || {
        old_pids.iter().all(|p| !pid_alive(*p))
    });

    let pids = d.worker_pids();
    fs::write(d.config_path(), "queues = \"q3\"\nworkers = 0\n").unwrap();
    d.signal(libc::SIGHUP);
    d.wait_for_log("HUP: the new config is refused", SHORT);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        d.worker_pids(),
        pids,
        "workers were replaced after a bad config"
    );
    r.push("q2", r#"{"class":"Slow","args":[]}"#);
    wait_until(SHORT, "a q2 job ran", || {
        read_lossy(&dir.join("done")) == "q\nq2\n"
    });
}

/// A HUP that moves the daemon to another namespace leaves the old workers' jobs where they
/// live: an old worker, still running its job after the QUIT the HUP sent it, that then dies
/// is recovered in the old namespace (its job recorded once as `Resque::DirtyExit` in the old
/// `failed` list, its in-flight record, lock and registration gone), not looked for in the new
/// one, where nothing would ever find it (no worker of the old namespace is left to run its
/// janitor). The new workers serve the new namespace.
#[test]
fn a_worker_dying_after_a_namespace_changing_hup_is_recovered_in_its_old_namespace() {
    let (old, new) = ("locket-old", "locket-new");
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let mut reaper = Reaper::default();
    reaper.watch(&dir.join("pid"));
    let started = dir.join("started");
    let long = write_script(
        dir,
        "long.sh",
        &format!(
            "echo $$ > {d}/pid\necho ok > {d}/started\nexec sleep 60\n",
            d = dir.display()
        ),
    );
    // A shutdown_timeout longer than the test: the old worker, told to QUIT, never stops its
    // job itself.
    let config = |ns: &str| {
        cfg("q")
            .top(&format!("namespace = \"{ns}\""))
            .locket("shutdown_timeout", "\"60s\"")
            .class("Long", &long, "")
            .render()
    };
    let workers_in =
        |r: &mut R, ns: &str| -> Vec<String> { r.cmd(&["SMEMBERS", &format!("{ns}:workers")]) };
    let mut d = Daemon::start(&redis, &config(old), &[]);
    let mut victim = String::new();
    wait_until(SHORT, "a worker registered in the old namespace", || {
        let pids = d.worker_pids();
        victim = workers_in(&mut r, old).pop().unwrap_or_default();
        pids.len() == 1 && victim.contains(&format!(":{}:", pids[0]))
    });
    let victim_pid = pid_of(&victim);
    let _: i64 = r.cmd(&["SADD", &format!("{old}:queues"), "q"]);
    let _: i64 = r.cmd(&[
        "RPUSH",
        &format!("{old}:queue:q"),
        r#"{"class":"Long","args":[]}"#,
    ]);
    // The handler itself: a worker between RESERVE and ACQUIRE holds a job that never ran,
    // which R-4 requeues rather than fails.
    wait_until(SHORT, "the job runs", || read_lossy(&started) == "ok\n");
    let handler: i32 = read_lossy(&dir.join("pid")).trim().parse().unwrap();

    fs::write(d.config_path(), config(new)).unwrap();
    d.signal(libc::SIGHUP);
    d.wait_for_log("HUP: config reloaded; replacing workers gracefully", SHORT);
    d.wait_for_log("shutting down: waiting for the running job", SHORT);
    wait_until(
        SHORT,
        "a new worker registered in the new namespace",
        || {
            let ids = workers_in(&mut r, new);
            ids.len() == 1 && pid_of(&ids[0]) != victim_pid
        },
    );
    assert!(
        pid_alive(handler),
        "the old worker's job stopped after QUIT"
    );
    assert_eq!(workers_in(&mut r, old), vec![victim.clone()]);

    // SAFETY: kill(2) of the daemon's old worker process.
    unsafe { libc::kill(victim_pid, libc::SIGKILL) };
    let failed = format!("{old}:failed");
    wait_until(
        SHORT,
        "a DirtyExit in the old namespace's failed list",
        || r.llen(&failed) == 1,
    );
    wait_until(
        SHORT,
        "the old worker's in-flight record and registration gone",
        || {
            r.keys(&format!("{old}:locket:inflight:*")).is_empty()
                && workers_in(&mut r, old).is_empty()
        },
    );
    let raw: Vec<String> = r.cmd(&["LRANGE", &failed, "0", "-1"]);
    let f: serde_json::Value = serde_json::from_str(&raw[0]).unwrap();
    assert_eq!(f["exception"], "Resque::DirtyExit", "{f}");
    assert_eq!(f["worker"], victim.as_str(), "{f}");
    assert_eq!(f["payload"]["class"], "Long", "{f}");
    assert!(
        f["error"]
            .as_str()
            .unwrap()
            .contains("died (killed by SIGKILL (signal 9))"),
        "{f}"
    );
    assert!(!pid_alive(handler), "the dead worker's handler still runs");
    assert!(r.keys(&format!("{old}:locket:lock:*")).is_empty());
    assert!(!r.exists(&format!("{old}:worker:{victim}")));
    let processes: Vec<String> = r.cmd(&["SMEMBERS", &format!("{old}:locket:processes")]);
    assert!(processes.is_empty(), "{processes:?}");
    assert_eq!(r.llen(&format!("{new}:failed")), 0);
    assert!(r.keys(&format!("{new}:locket:inflight:*")).is_empty());
    // The retiring worker is not replaced: the new namespace's worker is the only one.
    let ids = workers_in(&mut r, new);
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(d.worker_pids(), vec![pid_of(&ids[0])]);

    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0), "{}", d.log());
    assert!(workers_in(&mut r, new).is_empty());
}

/// S-7: a Redis with an evicting `maxmemory-policy` is refused at start (exit 78) unless
/// `allow_evicting_redis` is set.
#[test]
fn an_evicting_redis_is_refused_at_start_unless_allowed() {
    let redis =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]);
    let mut d = Daemon::start(&redis, &cfg("q").render(), &[]);
    assert_eq!(exit_code(&mut d, SHORT), Some(78));
    assert!(d.log().contains("allkeys-lru"), "{}", d.log());
    let mut r = R::new(&redis);
    let d = Daemon::start(
        &redis,
        &cfg("q").locket("allow_evicting_redis", "true").render(),
        &[],
    );
    wait_workers(&mut r, &d, 1);
}

/// Lines `start <tag> <key>`, `end <tag>` and `overlap <tag> <key>` a tagging handler writes.
#[derive(Default)]
pub(crate) struct Runs {
    pub(crate) starts: HashMap<u32, usize>,
    pub(crate) ends: HashMap<u32, usize>,
    pub(crate) overlaps: Vec<String>,
}

/// The `start TAG`, `end TAG` and `overlap ...` lines of a runs file, counted.
pub(crate) fn parse_runs(text: &str) -> Runs {
    let mut runs = Runs::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["start", tag, ..] => *runs.starts.entry(tag.parse().unwrap()).or_default() += 1,
            ["end", tag, ..] => *runs.ends.entry(tag.parse().unwrap()).or_default() += 1,
            ["overlap", ..] => runs.overlaps.push(line.to_string()),
            _ => {}
        }
    }
    runs
}

/// A handler for jobs `{"class":"Tag","args":[key],"tag":N,"ms":M}` (the lock key is over the
/// args, so jobs of one key lock each other while tags stay unique): it takes a non-blocking
/// flock on `<dir>/<key>.lk` for its whole run (inherited by its `sleep` child, released by
/// the kernel when every holder is dead) and writes `overlap` if another live process holds
/// it: two live handlers under one lock key (NEVER-1), including an orphan, are caught.
fn tagging_handler(dir: &Path) -> std::path::PathBuf {
    write_script(
        dir,
        "tag.sh",
        &format!(
            r#"p=$(cat)
tag=$(echo "$p" | sed 's/.*"tag":\([0-9]*\).*/\1/')
ms=$(echo "$p" | sed 's/.*"ms":\([0-9]*\).*/\1/')
key=$(echo "$LOCKETD_ARGS" | tr -d '[]" ')
exec 9>>{d}/$key.lk
if ! flock -n 9; then echo "overlap $tag $key" >> {d}/runs; fi
echo "start $tag $key" >> {d}/runs
sleep $(printf '0.%03d' $ms)
echo "end $tag" >> {d}/runs
"#,
            d = dir.display()
        ),
    )
}

/// A tagged job's payload.
fn tagged(tag: u32, key: &str, ms: u32) -> String {
    format!(r#"{{"class":"Tag","args":["{key}"],"tag":{tag},"ms":{ms}}}"#)
}

/// Failed tags (from `args[0]` of each failure record), with their counts.
fn failed_tags(r: &mut R) -> BTreeMap<u32, usize> {
    let mut m = BTreeMap::new();
    for f in r.failures() {
        let tag = f["payload"]["tag"].as_u64().expect("tag") as u32;
        *m.entry(tag).or_default() += 1;
    }
    m
}

/// Checks the outcome of `n` tagged jobs: each ran at most once, ended exactly once as a
/// success or was recorded exactly once as a failure (never both), and no lock key ever had
/// two live handlers. Returns (completed, failed).
fn assert_each_tag_once(r: &mut R, runs: &Runs, n: u32) -> (usize, usize) {
    let failed = failed_tags(r);
    let (mut completed, mut failures) = (0, 0);
    for tag in 0..n {
        let starts = runs.starts.get(&tag).copied().unwrap_or(0);
        let ends = runs.ends.get(&tag).copied().unwrap_or(0);
        let f = failed.get(&tag).copied().unwrap_or(0);
        assert!(starts <= 1, "tag {tag} started {starts} times");
        assert!(f <= 1, "tag {tag} recorded as failed {f} times");
        if f == 1 {
            failures += 1;
        } else {
            assert_eq!(ends, 1, "tag {tag}: neither completed nor recorded (lost)");
            completed += 1;
        }
    }
    assert!(runs.overlaps.is_empty(), "overlaps: {:?}", runs.overlaps);
    assert!(
        completed >= n as usize / 2,
        "only {completed} of {n} completed: {:?}",
        r.failures().first()
    );
    (completed, failures)
}

fn push_tagged(r: &mut R, n: u32, keys: u32, max_ms: u32) {
    let mut rng = rand::rng();
    let mut pipe = redis::pipe();
    pipe.sadd(format!("{NS}:queues"), "q").ignore();
    for tag in 0..n {
        let key = format!("k{}", tag % keys);
        let ms = rng.random_range(1..=max_ms);
        pipe.rpush(format!("{NS}:queue:q"), tagged(tag, &key, ms))
            .ignore();
    }
    let () = pipe.query(&mut r.0).expect("push jobs");
}

/// Queue `q` is empty and no job is in flight.
pub(crate) fn settled(r: &mut R) -> bool {
    r.llen(&format!("{NS}:queue:q")) == 0 && r.keys(&format!("{NS}:locket:inflight:*")).is_empty()
}

/// Issue 3 "Redis outages", E-3: Redis (AOF, `appendfsync always`) stopped for 10 s mid-run
/// and restarted on the same port: the daemon neither crashes nor loses or repeats a job, jobs
/// that ended during the outage are recorded once Redis is back, and the outage is logged a few
/// times, not once per retry.
#[test]
fn a_ten_second_redis_outage_loses_and_repeats_nothing() {
    outage_run(&["workers = 2"], 8);
}

/// The same outage with two processes of four slots, whose job-path scripts go out in
/// batches: a batch that fails fails each of its calls, and each slot retries its own.
#[test]
fn a_redis_outage_under_batched_slots_loses_and_repeats_nothing() {
    outage_run(&["workers = 2", "slots = 4"], 16);
}

/// Runs 300 tagged jobs through a 10 s Redis outage with the given top-level config lines;
/// at most `max_noisy` warning/error lines may be logged for it.
fn outage_run(top: &[&str], max_noisy: usize) {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let script = tagging_handler(dir);
    let n = 300;
    push_tagged(&mut r, n, 50, 40);
    // Production-like leases: a 10 s outage is shorter than both, so nothing is presumed dead.
    let mut config = cfg("q");
    for line in top {
        config = config.top(line);
    }
    let config = config
        .locket("lock_ttl", "\"35s\"")
        .locket("heartbeat_interval", "\"5s\"")
        .locket("process_heartbeat", "\"1s\"")
        .locket("process_ttl", "\"60s\"")
        .class("Tag", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(SHORT, "some jobs ran", || {
        parse_runs(&read_lossy(&dir.join("runs"))).ends.len() >= 20
    });
    redis.stop();
    std::thread::sleep(Duration::from_secs(10));
    assert!(d.is_running(), "the daemon died while Redis was away");
    redis.restart();
    let mut r = R::new(&redis);
    wait_until(Duration::from_secs(120), "every job settled", || {
        settled(&mut r)
    });
    let runs = parse_runs(&read_lossy(&dir.join("runs")));
    let (completed, failed) = assert_each_tag_once(&mut r, &runs, n);
    // Jobs that ended during the outage were recorded as successes once Redis was back.
    assert_eq!((completed, failed), (n as usize, 0), "{:?}", r.failures());
    assert_eq!(r.processed(), i64::from(n));
    assert!(d.is_running());
    // One outage is logged a few times per process (each activity that met it), not once
    // per retry.
    let log = d.log();
    let noisy: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" ERROR ") || l.contains(" WARN "))
        .collect();
    eprintln!(
        "outage: {} warning/error lines:\n{}",
        noisy.len(),
        noisy.join("\n")
    );
    assert!(
        noisy.len() <= max_noisy,
        "{} warning/error lines for one 10 s outage:\n{log}",
        noisy.len()
    );
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    assert!(r.workers().is_empty(), "{:?}", r.workers());
}

/// Issue 3 chaos test: for a bounded time, worker processes are SIGKILLed at random and Redis
/// is restarted while 2,000 uniquely tagged jobs over 40 lock keys run through 4 workers.
/// Afterwards every tag completed or failed exactly once, and no two handlers of one lock key
/// ever ran at once (NEVER-1..3). Prints the figures.
#[test]
fn chaos_kills_and_redis_restarts_lose_repeat_and_overlap_nothing() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let script = tagging_handler(dir);
    let n = 2000;
    push_tagged(&mut r, n, 40, 30);
    let config = cfg("q")
        .top("workers = 4")
        .locket("process_heartbeat", "\"500ms\"")
        .locket("process_ttl", "\"3s\"")
        .locket("janitor_interval", "\"500ms\"")
        .class("Tag", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(SHORT, "workers up", || d.worker_pids().len() == 4);

    let mut rng = rand::rng();
    let (mut kills, mut restarts) = (0, 0);
    let chaos_end = Instant::now() + Duration::from_secs(20);
    let mut next_restart = Instant::now() + Duration::from_secs(4);
    while Instant::now() < chaos_end {
        std::thread::sleep(Duration::from_millis(rng.random_range(200..700)));
        let pids = d.worker_pids();
        if !pids.is_empty() {
            let victim = pids[rng.random_range(0..pids.len())];
            // SAFETY: kill(2) of one of the daemon's worker processes.
            unsafe { libc::kill(victim, libc::SIGKILL) };
            kills += 1;
        }
        if Instant::now() >= next_restart {
            redis.stop();
            std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
            redis.restart();
            restarts += 1;
            next_restart = Instant::now() + Duration::from_secs(rng.random_range(3..6));
        }
    }
    let mut r = R::new(&redis);
    wait_until(Duration::from_secs(180), "every job settled", || {
        settled(&mut r)
    });
    let runs = parse_runs(&read_lossy(&dir.join("runs")));
    let (completed, failed) = assert_each_tag_once(&mut r, &runs, n);
    let started: BTreeSet<u32> = runs.starts.keys().copied().collect();
    eprintln!(
        "chaos: jobs {n}, worker kills {kills}, redis restarts {restarts}, completed {completed}, \
         failed {failed} (DirtyExit of killed jobs), started {}, lost 0, duplicated 0, overlaps {}",
        started.len(),
        runs.overlaps.len()
    );
    assert_eq!(completed + failed, n as usize);
    assert!(
        kills > 10 && restarts >= 2,
        "too little chaos: {kills} kills, {restarts} restarts"
    );
    assert!(d.is_running(), "the master died");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, Duration::from_secs(30)), Some(0));
    wait_until(SHORT, "no registration left", || r.workers().is_empty());
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
}

/// Issue 6 multi-slot mode: `--slots 4` runs four jobs at once in one worker process, each
/// slot registered as its own Resque worker `host:pid+k:queues`; jobs of one lock key still
/// never overlap (NEVER-1); a SIGKILL of the process recovers every slot at once; QUIT
/// unregisters all four.
#[test]
fn slots_run_jobs_concurrently_as_separate_resque_workers() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let script = tagging_handler(dir);
    let config = cfg("q").class("Tag", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &["--slots", "4"]);
    let pid = d.worker_pid();
    let host = crate::daemon::hostname();
    let want: BTreeSet<String> = (1..=4).map(|k| format!("{host}:{pid}+{k}:q")).collect();
    wait_until(SHORT, "four slot workers registered", || {
        r.workers().into_iter().collect::<BTreeSet<_>>() == want
    });
    assert_eq!(
        cmdline(pid),
        "resque-0.1.0-locketd: 4 slots for q",
        "one process title for the slots"
    );

    // 8 distinct keys of 400 ms each, plus 8 jobs of one key of 50 ms each.
    let mut pipe = redis::pipe();
    for tag in 0..8u32 {
        pipe.rpush(
            format!("{NS}:queue:q"),
            tagged(tag, &format!("d{tag}"), 400),
        )
        .ignore();
    }
    for tag in 8..16u32 {
        pipe.rpush(format!("{NS}:queue:q"), tagged(tag, "same", 50))
            .ignore();
    }
    let () = pipe.query(&mut r.0).unwrap();
    wait_until(SHORT, "all 16 jobs ran", || r.processed() == 16);
    let log = read_lossy(&dir.join("runs"));
    let runs = parse_runs(&log);
    assert_each_tag_once(&mut r, &runs, 16);
    // The process's name (`ps -o comm`, `pgrep locketd`) is set once and stays through jobs.
    let comm = read_lossy(Path::new(&format!("/proc/{pid}/comm")));
    assert_eq!(comm.trim_end(), "locketd", "process name after 16 jobs");
    // Concurrency from the handlers' own log (not from a duration, which a loaded machine
    // stretches): with one slot at a time, no start would come before the previous end.
    let most = crate::support::most_at_once(&log);
    assert!(
        most >= 2,
        "slots did not run jobs concurrently: at most {most} at once\n{log}"
    );
    let stats: Vec<i64> = want
        .iter()
        .map(|w| r.int(&format!("{NS}:stat:processed:{w}")))
        .collect();
    assert_eq!(stats.iter().sum::<i64>(), 16);
    assert!(
        stats.iter().filter(|n| **n > 0).count() >= 2,
        "per-slot stats {stats:?}"
    );

    // A SIGKILL of the process recovers every slot, and a replacement registers four new ones.
    r.push("q", &tagged(100, "x", 999));
    r.push("q", &tagged(101, "y", 999));
    // Both acquired (state `running`): a slot killed between RESERVE and ACQUIRE holds a job
    // that never ran, which R-4 requeues instead of recording a failure.
    wait_until(SHORT, "two long jobs running", || {
        let keys = r.keys(&format!("{NS}:locket:inflight:*"));
        keys.len() == 2
            && keys.iter().all(|k| {
                let s: Option<String> = r.cmd(&["HGET", k, "state"]);
                s.as_deref() == Some("running")
            })
    });
    // SAFETY: kill(2) of the daemon's worker process.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until(SHORT, "both slots' jobs recorded", || {
        r.failures().len() == 2
    });
    wait_until(SHORT, "the replacement's four slots", || {
        let ws = r.workers();
        ws.len() == 4 && ws.iter().all(|w| !w.contains(&format!(":{pid}+")))
    });
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
    let ids = r.workers();
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    for id in &ids {
        assert_unregistered(&mut r, id);
    }
}

/// resque-protocol.md §13 item 18 with slots: a locketd worker that starts on the same host and
/// queues prunes by Resque's host-local rule, and must read a slot id `host:pid+k:queues` as
/// pid `pid`: the slot workers of a running multi-slot process stay registered, and the job
/// one of them runs is not recorded as failed.
#[test]
fn a_starting_worker_leaves_a_running_multi_slot_process_registered() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let slow = write_script(work.path(), "slow.sh", "sleep 2\n");
    let config = cfg("q").class("Slow", &slow, "").render();
    let a = Daemon::start(&redis, &config, &["--slots", "2"]);
    let pid = a.worker_pid();
    let host = crate::daemon::hostname();
    let slots: BTreeSet<String> = (1..=2).map(|k| format!("{host}:{pid}+{k}:q")).collect();
    wait_until(SHORT, "two slot workers registered", || {
        r.workers().into_iter().collect::<BTreeSet<_>>() == slots
    });
    r.push("q", r#"{"class":"Slow","args":[]}"#);
    wait_until(SHORT, "the job running", || {
        slots.iter().any(|w| r.exists(&format!("{NS}:worker:{w}")))
    });
    // The pruning mutex the first process took lasts 60 s: lift it, as time would.
    let pruning = format!("{NS}:pruning_dead_workers_in_progress");
    let _: i64 = r.cmd(&["DEL", &pruning]);
    let b = Daemon::start(&redis, &config, &[]);
    let own = format!("{host}:{}:q", b.worker_pid());
    wait_until(SHORT, "the second process registered", || {
        r.workers().contains(&own)
    });
    let holder: Option<String> = r.cmd(&["GET", &pruning]);
    assert_eq!(
        holder.as_deref(),
        Some(own.as_str()),
        "the new worker pruned"
    );
    let workers: BTreeSet<String> = r.workers().into_iter().collect();
    assert!(
        workers.is_superset(&slots),
        "slot workers pruned: {workers:?}"
    );
    wait_until(SHORT, "the job finished", || r.processed() == 1);
    assert!(r.failures().is_empty(), "{:?}", r.failures());
}

/// The multi-slot mode batches the job-path scripts of a process's slots (src/store/batch.rs):
/// two processes of eight slots on 900 jobs over 12 keys, so batches mix starts, conflicts
/// (parks and wakes) and finishes. Every job runs exactly once, no two jobs of a key overlap
/// (NEVER-1), and the counts each script summed and wrote once per batch add up: Resque's
/// processed total and per-slot totals, and the locket O-3 totals (`started`, `acquired`,
/// `released`; every reservation either started or was parked, and every park woken).
#[test]
fn batched_slots_run_each_job_once_and_keep_every_count() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let script = tagging_handler(dir);
    let n = 900;
    push_tagged(&mut r, n, 12, 15);
    let config = cfg("q")
        .top("workers = 2")
        .top("slots = 8")
        .class("Tag", &script, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(Duration::from_secs(120), "every job ran", || {
        r.processed() == i64::from(n) && settled(&mut r)
    });
    let runs = parse_runs(&read_lossy(&dir.join("runs")));
    let (completed, failed) = assert_each_tag_once(&mut r, &runs, n);
    assert_eq!((completed, failed), (n as usize, 0));
    let workers = r.workers();
    assert_eq!(
        workers.len(),
        16,
        "two processes of eight slots: {workers:?}"
    );
    let per_slot: i64 = workers
        .iter()
        .map(|w| r.int(&format!("{NS}:stat:processed:{w}")))
        .sum();
    assert_eq!(per_slot, i64::from(n), "per-slot processed totals");
    assert_eq!(r.int(&format!("{NS}:stat:failed")), 0);
    // The locket counts are written at most once per second and at stop (O-3): stop first.
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
    let stat = |r: &mut R, event: &str| r.int(&format!("{NS}:locket:stat:{event}"));
    assert_eq!(stat(&mut r, "started"), i64::from(n));
    assert_eq!(stat(&mut r, "acquired"), i64::from(n));
    assert_eq!(stat(&mut r, "released"), i64::from(n));
    // Every conflict requeued or parked its job, and each was reserved once more (PK-2).
    let requeued = stat(&mut r, "requeued");
    let parked = stat(&mut r, "parked");
    assert_eq!(stat(&mut r, "reserved"), i64::from(n) + requeued + parked);
    assert_eq!(stat(&mut r, "conflict"), requeued + parked);
    assert_eq!(stat(&mut r, "woken"), parked);
    // The per-minute buckets hold the same totals, per event and per event and class.
    let mut bucket_started = 0;
    let mut bucket_class = 0;
    for b in r.keys(&format!("{NS}:locket:metrics:*")) {
        let h: HashMap<String, i64> = r.cmd(&["HGETALL", &b]);
        bucket_started += h.get("started").copied().unwrap_or(0);
        bucket_class += h.get("started|Tag").copied().unwrap_or(0);
        let ttl: i64 = r.cmd(&["PTTL", &b]);
        assert!(ttl > 0, "bucket {b} has no expiry");
    }
    assert_eq!((bucket_started, bucket_class), (i64::from(n), i64::from(n)));
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
    // Batches did form: one at a time, the job path alone costs two script calls per job and
    // two per requeue or park (ACQUIRE, then a plain RESERVE); heartbeats add a few more.
    let info: String = r.cmd(&["INFO", "commandstats"]);
    let evalsha = crate::support::script_calls(&info);
    eprintln!(
        "batched slots: {n} jobs, {requeued} requeued, {parked} parked, {evalsha} script calls"
    );
    let one_at_a_time = 2 * (i64::from(n) + requeued + parked);
    assert!(
        evalsha * 10 < one_at_a_time * 9,
        "{evalsha} script calls for {n} jobs, {requeued} requeues and {parked} parks: no batching"
    );
}

/// An idle worker is woken by a push instead of sleeping `interval`: a job pushed to its queue
/// runs long before the 30 s interval, and the queue keeps its order (the wait takes nothing
/// from it). Every queue is watched: `pickup.rs` pushes to the last of 16.
#[test]
fn an_idle_worker_wakes_on_a_push_and_keeps_the_queue_order() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let rec = write_script(
        dir,
        "rec.sh",
        &format!("echo \"$LOCKETD_ARGS\" >> {}/order\n", dir.display()),
    );
    let config = cfg("high,low").class("Rec", &rec, "").render();
    let mut d = Daemon::start(&redis, &config, &["--interval", "30"]);
    wait_workers(&mut r, &d, 1);
    // Let the first pass find nothing and the wait begin.
    std::thread::sleep(Duration::from_millis(500));
    let _: i64 = r.cmd(&[
        "RPUSH",
        &format!("{NS}:queue:high"),
        r#"{"class":"Rec","args":[1]}"#,
        r#"{"class":"Rec","args":[2]}"#,
        r#"{"class":"Rec","args":[3]}"#,
    ]);
    wait_until(SHORT, "the pushed jobs ran without waiting 30 s", || {
        read_lossy(&dir.join("order")) == "[1]\n[2]\n[3]\n"
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// An idle worker on a Redis that refuses commands for a while (here full: `maxmemory` 1 under
/// `noeviction`, so BLMOVE gets OOM) waits out its interval between tries instead of opening a
/// new connection and sending a new BLMOVE in a loop (measured before the fix: about 1,600
/// connections a second from one idle process), and picks jobs up again once Redis recovers.
#[test]
fn an_idle_worker_does_not_hammer_a_redis_that_refuses_commands() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let rec = write_script(dir, "rec.sh", &format!("echo ok > {}/ran\n", dir.display()));
    // A long lease: heartbeats fail too while Redis is full.
    let config = cfg("q")
        .top("slots = 2")
        .locket("process_ttl", "\"60s\"")
        .class("Rec", &rec, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &["--interval", "1"]);
    wait_until(SHORT, "two slot workers registered", || {
        r.workers().len() == 2
    });
    std::thread::sleep(Duration::from_millis(300));
    let connections = |r: &mut R| -> i64 {
        let info: String = r.cmd(&["INFO", "stats"]);
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("total_connections_received")
    };
    // A BLMOVE that blocked before Redis filled up is not refused: once the master's queue
    // watcher blocks, fill Redis and cut the watcher off, so that it comes back to a full Redis.
    let blocked = |r: &mut R| -> Vec<String> {
        let list: String = r.cmd(&["CLIENT", "LIST"]);
        list.lines()
            .filter(|l| l.contains(" cmd=blmove "))
            .filter_map(|l| l.strip_prefix("id="))
            .filter_map(|l| l.split(' ').next())
            .map(str::to_string)
            .collect()
    };
    wait_until(SHORT, "the idle wait blocks on BLMOVE", || {
        !blocked(&mut r).is_empty()
    });
    let _: () = r.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    for id in blocked(&mut r) {
        let _: i64 = r.cmd(&["CLIENT", "KILL", "ID", &id]);
    }
    let before = connections(&mut r);
    std::thread::sleep(Duration::from_secs(3));
    let opened = connections(&mut r) - before;
    let _: () = r.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    // A new blocking connection per interval (1 s) at most (the master's watcher backs off
    // from 1 s), plus our own INFO connection.
    assert!(
        opened <= 10,
        "{opened} connections in 3 s from one idle process\n{}",
        d.log()
    );
    // The master's queue watcher met the refusals (a worker without a master: its own BLMOVE).
    assert!(
        d.log().contains("watching the queues failed") || d.log().contains("BLMOVE failed"),
        "{}",
        d.log()
    );
    r.push("q", r#"{"class":"Rec","args":[]}"#);
    wait_until(SHORT, "a job runs once Redis has room again", || {
        read_lossy(&dir.join("ran")) == "ok\n"
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// R-1, R-2: one failed renewal of the process lease does not make a live worker presume
/// itself dead. At the tightest ratio allowed (process_ttl = 2 × process_heartbeat) the next
/// renewal used to come a whole period after the failed one, just as the lease ran out; it is
/// now retried within a quarter period. (Here every script is refused by an ACL until the
/// worker has logged one failed heartbeat.)
#[test]
fn one_failed_process_heartbeat_does_not_kill_a_live_worker() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let config = cfg("q")
        .locket("process_heartbeat", "\"1s\"")
        .locket("process_ttl", "\"2s\"")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_workers(&mut r, &d, 1);
    let worker = d.worker_pid();
    let _: () = r.cmd(&["ACL", "SETUSER", "default", "-evalsha", "-eval"]);
    d.wait_for_log("process heartbeat failed", SHORT);
    let _: () = r.cmd(&["ACL", "SETUSER", "default", "+@all"]);
    d.wait_for_log("process heartbeat resumed", SHORT);
    // Past the lease the failed renewal would have left.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(!d.log().contains("presumed dead"), "{}", d.log());
    assert_eq!(d.worker_pids(), vec![worker], "the worker was replaced");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// resque-protocol.md §13 item 18: pruning another host's dead worker whose `worker:<id>` is
/// not a string (another tool wrote a hash there) prunes it and starts normally. Before, the
/// WRONGTYPE error failed the worker's start: it died, and the next one skipped pruning (its
/// 60 s lock was held), so the dead worker stayed and the first start of every minute failed.
#[test]
fn a_dead_worker_record_of_the_wrong_type_is_pruned_without_failing_the_start() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dead = "otherhost:4242:q";
    let _: i64 = r.cmd(&["SADD", &format!("{NS}:workers"), dead]);
    let _: i64 = r.cmd(&["HSET", &format!("{NS}:worker:{dead}"), "f", "v"]);
    let _: i64 = r.cmd(&[
        "HSET",
        &format!("{NS}:workers:heartbeat"),
        dead,
        "2026-01-01T00:00:00+00:00",
    ]);
    let mut d = Daemon::start(&redis, &cfg("q").render(), &[]);
    wait_workers(&mut r, &d, 1);
    wait_until(SHORT, "the dead worker pruned", || {
        !r.workers().iter().any(|w| w == dead)
    });
    assert!(!d.log().contains("worker died"), "{}", d.log());
    wait_until(SHORT, "the prune logged", || {
        d.log().contains("pruned dead resque worker")
    });
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// Issue 3 "restarts with capped backoff": a worker that keeps dying right after it starts is
/// restarted after 1 s, then 2 s, then 4 s (doubling up to 30 s), and each death is logged
/// with its cause.
#[test]
fn a_worker_dying_again_and_again_is_restarted_with_growing_delays() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let mut d = Daemon::start(&redis, &cfg("q").render(), &[]);
    let mut last = 0;
    for _ in 0..3 {
        let mut pid = 0;
        wait_until(SHORT, "a new worker process", || {
            pid = d.worker_pids().first().copied().unwrap_or(0);
            pid != 0 && pid != last
        });
        // SAFETY: kill(2) of the daemon's worker process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        last = pid;
    }
    wait_until(SHORT, "a fourth worker registered", || {
        let pids = d.worker_pids();
        pids.len() == 1 && pids[0] != last && r.workers().len() == 1
    });
    let log = d.log();
    let delays: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("restarting the worker"))
        .filter_map(|l| l.split("delay_secs=").nth(1))
        .map(|v| v.split_whitespace().next().unwrap_or(""))
        .collect();
    assert_eq!(delays, ["1.0", "2.0", "4.0"], "{log}");
    assert_eq!(
        log.matches("worker died: killed by SIGKILL (signal 9)")
            .count(),
        3,
        "{log}"
    );
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, SHORT), Some(0));
}

/// A master SIGKILLed alone: its workers stop their jobs as a first TERM promises (README
/// "Crash recovery", signals table): each handler gets SIGTERM and `term_timeout`, and one that
/// answers it by exiting 0 is a success. The kernel may deliver the master's death more than
/// once (once per exiting thread of the master); it is one event, never a second TERM that
/// SIGKILLs the handler at once. Racy by nature: eight masters of three workers in a row (on
/// the code before the fix, about one worker in twenty counted the death twice).
#[test]
fn a_sigkilled_master_gives_its_workers_jobs_one_term_not_two() {
    const WORKERS: u32 = 3;
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let handler = write_script(
        work.path(),
        "trap.sh",
        &format!(
            r#"tag=$(echo "$LOCKETD_ARGS" | tr -dc '0-9')
trap 'echo TERM >> {d}/term.$tag; exit 0' TERM
echo $$ > {d}/pid.$tag
sleep 30 &
wait
echo "wait returned without TERM" >> {d}/term.$tag
exit 1
"#,
            d = work.path().display()
        ),
    );
    let config = cfg("q")
        .top("term_timeout = \"5s\"")
        .class("Trap", &handler, "")
        .render();
    let mut reaper = Reaper::default();
    for trial in 0..8u32 {
        let mut d = Daemon::start(&redis, &config, &["--workers", &WORKERS.to_string()]);
        let ids = wait_workers(&mut r, &d, WORKERS as usize);
        let workers = d.worker_pids();
        let pids_file = work.path().join(format!("workers.{trial}"));
        for (k, w) in workers.iter().enumerate() {
            let f = pids_file.with_extension(format!("{trial}.{k}"));
            fs::write(&f, w.to_string()).unwrap();
            reaper.watch(&f);
        }
        let tags: Vec<u32> = (0..WORKERS).map(|k| trial * 10 + k).collect();
        for tag in &tags {
            reaper.watch(&work.path().join(format!("pid.{tag}")));
            r.push("q", &format!(r#"{{"class":"Trap","args":[{tag}]}}"#));
        }
        for tag in &tags {
            wait_file(&work.path().join(format!("pid.{tag}")));
        }

        d.signal(libc::SIGKILL);
        d.wait_exit(SHORT).expect("the master was killed");
        wait_until(SHORT, "the orphaned workers stopped", || {
            workers.iter().all(|w| !pid_alive(*w))
        });
        let log = d.log();
        for tag in &tags {
            let term = read_lossy(&work.path().join(format!("term.{tag}")));
            assert_eq!(
                term.trim(),
                "TERM",
                "trial {trial}, job {tag}: the handler did not get (only) SIGTERM\n{}",
                tail(&log, 30)
            );
        }
        assert!(
            !log.contains("second stop signal"),
            "trial {trial}: the master's death counted twice\n{}",
            tail(&log, 30)
        );
        assert!(r.failures().is_empty(), "trial {trial}: {:?}", r.failures());
        assert_eq!(
            r.processed(),
            i64::from((trial + 1) * WORKERS),
            "trial {trial}"
        );
        for id in &ids {
            assert_unregistered(&mut r, id);
        }
    }
}
