//! Issue 38 "Must hold": the chaos run of `supervision::` with a threaded Ruby handler
//! (`threads = 4`, H-18): worker processes and handler processes SIGKILLed at random, Redis
//! restarted, and now and then a job that ignores its stop, so that its process is killed
//! under its siblings. Nothing is lost, nothing runs twice to completion, no lock's limit is
//! exceeded. Run: `cargo test --test it -- threads_chaos:: --include-ignored`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::daemon::{cfg, exit_code, workdir, NS, R, SHORT};
use crate::supervision::{parse_runs, settled};
use crate::support::{manifest_dir, read_lossy, wait_until, Daemon, RedisServer};

/// `Tag` holds a non-blocking flock on its key's file while it runs (a second holder, in
/// another thread or another process, writes `overlap`) and writes `start`/`end` lines;
/// `Stubborn` does the same but sleeps through its stop (`Resque::TermException` rescued),
/// so that its timeout ends in its process's kill.
const APP: &str = r##"
module Runs
  DIR = ENV.fetch("RUNS_DIR")

  def self.line(text)
    File.open(File.join(DIR, "runs"), "a") { |f| f.write("#{text}\n") }
  end

  def self.hold(key, tag)
    File.open(File.join(DIR, "#{key}.lk"), File::WRONLY | File::APPEND | File::CREAT) do |f|
      line("overlap #{tag} #{key}") unless f.flock(File::LOCK_EX | File::LOCK_NB)
      line("start #{tag} #{key}")
      yield
      line("end #{tag}")
    end
  end
end

class Tag
  def self.perform(key, tag, ms)
    Runs.hold(key, tag) { sleep(ms / 1000.0) }
  end
end

class Stubborn
  def self.perform(key, tag, _ms)
    Runs.hold(key, tag) do
      begin
        sleep 30
      rescue Resque::TermException
        sleep 30
      end
    end
  end
end
"##;

/// Pushes `n` jobs over `keys` lock keys, args `[key, tag, ms]`; every `stubborn`-th one is a
/// `Stubborn`. Returns the stubborn tags.
fn push(r: &mut R, n: u32, keys: u32, stubborn: u32) -> BTreeSet<u32> {
    let mut rng = rand::rng();
    let mut pipe = redis::pipe();
    let mut stubborn_tags = BTreeSet::new();
    pipe.sadd(format!("{NS}:queues"), "q").ignore();
    for tag in 0..n {
        let class = if tag % stubborn == stubborn / 2 {
            stubborn_tags.insert(tag);
            "Stubborn"
        } else {
            "Tag"
        };
        let key = format!("k{}", tag % keys);
        let ms: u32 = rng.random_range(1..=40);
        let payload = format!(r#"{{"class":"{class}","args":["{key}",{tag},{ms}]}}"#);
        pipe.rpush(format!("{NS}:queue:q"), payload).ignore();
    }
    let () = pipe.query(&mut r.0).expect("push jobs");
    stubborn_tags
}

/// Failure records by tag (`args[1]`), with their exception classes.
fn failures(r: &mut R) -> BTreeMap<u32, Vec<String>> {
    let mut m: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for f in r.failures() {
        let tag = f["payload"]["args"][1].as_u64().expect("tag") as u32;
        let exception = f["exception"].as_str().unwrap_or("?").to_string();
        m.entry(tag).or_default().push(exception);
    }
    m
}

/// The pids of the processes whose parent is one of `parents` (the workers' handlers).
fn children_of(parents: &[i32]) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The parent pid is the 2nd field after the command's closing parenthesis.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
                .is_some_and(|ppid| parents.contains(&ppid))
        })
        .collect()
}

fn config(dir: &Path) -> String {
    let app = dir.join("app.rb");
    std::fs::write(&app, APP).expect("write the app");
    format!(
        "{}\n[handlers.app]\nmode = \"persistent\"\ncommand = [\"{}\", \"{}\"]\n\
         boot_timeout = \"60s\"\npreload = true\nthreads = 4\nenv = {{ RUNS_DIR = \"{}\" }}\n\n\
         [classes.\"Tag\"]\nhandler = \"app\"\nlock = \"k:{{args[0]}}\"\n\n\
         [classes.\"Stubborn\"]\nhandler = \"app\"\nlock = \"k:{{args[0]}}\"\ntimeout = \"1s\"\n",
        cfg("q")
            .top("workers = 2")
            .top("slots = 4")
            .locket("process_heartbeat", "\"500ms\"")
            .locket("process_ttl", "\"3s\"")
            .locket("janitor_interval", "\"500ms\"")
            .render(),
        manifest_dir().join("adapters/ruby/locketd-ruby").display(),
        app.display(),
        dir.display(),
    )
}

/// 1,200 uniquely tagged jobs over 30 lock keys through 2 worker processes of 4 slots, one
/// Ruby process of `threads = 4` each, for 20 s of chaos: a worker or a handler process
/// SIGKILLed every 0.3–1 s (when one is up), Redis (AOF, `appendfsync always`) restarted
/// every 3–6 s, and one job in 100 a `Stubborn` one whose ignored timeout kills its process
/// under its siblings.
/// Afterwards every tag ended once (completed, or recorded as failed once: never both lost
/// and never two completions), every `Stubborn` tag is recorded as failed, and no two jobs of
/// one key ever ran at once (NEVER-1..3, H-18). Prints the figures.
#[test]
fn chaos_with_a_threaded_ruby_handler_loses_repeats_and_overlaps_nothing() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let n = 1200;
    let stubborn = push(&mut r, n, 30, 100);
    let mut d = Daemon::builder(&redis)
        .config(&config(dir))
        .current_dir(manifest_dir())
        .start();
    wait_until(SHORT, "workers up", || d.worker_pids().len() == 2);

    let mut rng = rand::rng();
    let (mut worker_kills, mut handler_kills, mut restarts) = (0, 0, 0);
    let chaos_end = Instant::now() + Duration::from_secs(20);
    let mut next_restart = Instant::now() + Duration::from_secs(4);
    let mut round = 0u32;
    while Instant::now() < chaos_end {
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1000)));
        round += 1;
        let workers = d.worker_pids();
        let handlers = children_of(&workers);
        // A handler process (every job it runs dies with it) or a worker, by turns.
        let (victims, count) = if round.is_multiple_of(2) && !handlers.is_empty() {
            (handlers, &mut handler_kills)
        } else {
            (workers, &mut worker_kills)
        };
        if !victims.is_empty() {
            let victim = victims[rng.random_range(0..victims.len())];
            // SAFETY: kill(2) of one of the daemon's worker or handler processes.
            unsafe { libc::kill(victim, libc::SIGKILL) };
            *count += 1;
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
    wait_until(Duration::from_secs(240), "every job settled", || {
        settled(&mut r)
    });
    let runs = parse_runs(&read_lossy(&dir.join("runs")));
    let failed = failures(&mut r);
    let (mut completed, mut failures_n, mut returned) = (0usize, 0usize, 0usize);
    for tag in 0..n {
        let starts = runs.starts.get(&tag).copied().unwrap_or(0);
        let ends = runs.ends.get(&tag).copied().unwrap_or(0);
        let f = failed.get(&tag).map_or(0, Vec::len);
        assert!(ends <= 1, "tag {tag} ran to completion {ends} times");
        assert!(
            f <= 1,
            "tag {tag} recorded as failed {f} times: {:?}",
            failed[&tag]
        );
        assert!(
            ends + f >= 1,
            "tag {tag}: neither completed nor recorded (lost)"
        );
        if stubborn.contains(&tag) {
            assert_eq!(f, 1, "stubborn tag {tag} not recorded as failed");
        }
        // A sibling sent back by its process's kill starts again, with no failure.
        returned += starts.saturating_sub(1);
        if f == 1 {
            failures_n += 1;
        } else {
            completed += 1;
        }
    }
    assert!(runs.overlaps.is_empty(), "overlaps: {:?}", runs.overlaps);
    eprintln!(
        "threads chaos: jobs {n}, worker kills {worker_kills}, handler kills {handler_kills}, \
         redis restarts {restarts}, completed {completed}, failed {failures_n}, extra starts \
         (returned siblings) {returned}, lost 0, completed twice 0, overlaps 0",
    );
    assert_eq!(completed + failures_n, n as usize);
    assert!(
        completed >= n as usize / 2,
        "only {completed} of {n} completed"
    );
    // A worker killed again and again comes back after growing delays (fewer victims than
    // the exec-mode run's 4 workers give): 6 kills is still a process lost every 3 s.
    assert!(
        worker_kills + handler_kills >= 6 && restarts >= 2,
        "too little chaos: {worker_kills} + {handler_kills} kills, {restarts} restarts"
    );
    assert!(d.is_running(), "the master died");
    d.signal(libc::SIGQUIT);
    assert_eq!(exit_code(&mut d, Duration::from_secs(30)), Some(0));
    wait_until(SHORT, "no registration left", || r.workers().is_empty());
    assert!(r.keys(&format!("{NS}:locket:lock:*")).is_empty());
}
