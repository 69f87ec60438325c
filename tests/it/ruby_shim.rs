//! The Ruby shim (clients/ruby/locketd_resque.rb): PUSH and PUSH_AT from Ruby (D-3a, D-3b).
//!
//! `ruby_pusher_*` run everywhere, CI included: the shim's `Locketd::Pusher` on a redis-rb
//! client (Debian's ruby-redis), no Resque. The tests with real Resque need its sources, which
//! no registry CI reaches: they run when `LOCKETD_RESQUE_LIB` names resque's `lib` directory
//! (and, for `enqueue_at`, `LOCKETD_RESQUE_SCHEDULER_LIB` resque-scheduler's), with resque's
//! runtime dependencies installed (ruby-redis-namespace, ruby-mono-logger, ruby-multi-json,
//! ruby-rufus-scheduler; ruby-activejob for the adapter). Without the variables they print why
//! they skipped and pass, under `CI=true` too.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{workdir, NS, R};
use crate::shims::{delayed_story, seed_001_story, REDIS_6};
use crate::support::{manifest_dir, run_bounded, wait_until, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(60);

/// Runs `ruby <-I dirs> tests/ruby/<script> '<config>'` and returns the JSON object of its last
/// stdout line (asserting `ok`).
fn ruby(script: &str, libs: &[PathBuf], config: &Value) -> Value {
    let mut cmd = Command::new("ruby");
    for lib in libs {
        cmd.arg("-I").arg(lib);
    }
    cmd.arg(manifest_dir().join("tests/ruby").join(script))
        .arg(config.to_string());
    let (status, stdout, stderr) = run_bounded(&mut cmd, LONG);
    assert!(status.success(), "ruby {script}: {stdout}\n{stderr}");
    let out: Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("ruby {script} printed no JSON ({e}): {stdout}\n{stderr}"));
    assert_eq!(out["ok"], json!(true), "{out}");
    out
}

fn pusher_enqueue(port: u16, jobs: &Value) -> Vec<bool> {
    let out = ruby(
        "pusher_enqueue.rb",
        &[],
        &json!({"port": port, "namespace": NS, "jobs": jobs}),
    );
    serde_json::from_value(out["pushed"].clone()).unwrap()
}

/// Seed 001 through `Locketd::Pusher` (holds placed with the push; after FUNCTION FLUSH and
/// SCRIPT FLUSH it re-reads the entry once and loads the script; a duplicate returns false; no
/// published entry: the caller's plain push), then the same on a Redis without FUNCTION.
#[test]
fn ruby_pusher_places_holds_refuses_duplicates_and_falls_back_to_evalsha() {
    seed_001_story(&pusher_enqueue, &[]);
    seed_001_story(&pusher_enqueue, REDIS_6);
}

/// PUSH_AT through `Locketd::Pusher`: holds placed when scheduled, B waits for A; then the
/// same on a Redis without FUNCTION.
#[test]
fn ruby_pusher_push_at_places_holds_when_scheduled() {
    delayed_story(&pusher_enqueue, &[]);
    delayed_story(&pusher_enqueue, REDIS_6);
}

/// resque's lib dir (and resque-scheduler's with `scheduler`), or None (said on stderr).
fn resque_libs(scheduler: bool) -> Option<Vec<PathBuf>> {
    let mut libs = Vec::new();
    let mut vars = vec!["LOCKETD_RESQUE_LIB"];
    if scheduler {
        vars.push("LOCKETD_RESQUE_SCHEDULER_LIB");
    }
    for var in vars {
        match std::env::var_os(var) {
            Some(dir) if PathBuf::from(&dir).is_dir() => libs.push(PathBuf::from(dir)),
            _ => {
                eprintln!(
                    "{var} does not name a directory: skipped (resque is in no registry CI \
                     reaches; point it at a checkout's lib/ to run this test)"
                );
                return None;
            }
        }
    }
    Some(libs)
}

/// `Resque.enqueue` (and `enqueue_at`) of each job through the shim; each after_enqueue
/// (after_schedule) hook ran exactly for the jobs pushed.
fn resque_enqueue(libs: Vec<PathBuf>, scheduler: bool) -> impl Fn(u16, &Value) -> Vec<bool> {
    move |port, jobs| {
        let calls: Vec<Value> = jobs
            .as_array()
            .unwrap()
            .iter()
            .map(|j| {
                let mut j = j.clone();
                let via = if j.get("at").is_some() {
                    "enqueue_at"
                } else {
                    "enqueue"
                };
                j["via"] = json!(via);
                j
            })
            .collect();
        let out = ruby(
            "resque_enqueue.rb",
            &libs,
            &json!({"port": port, "namespace": NS, "scheduler": scheduler, "jobs": calls}),
        );
        let pushed: Vec<bool> = serde_json::from_value(out["results"].clone()).unwrap();
        // enqueue_at runs after_schedule (and after_enqueue too for a time already past).
        let kind = if calls.iter().any(|c| c["via"] == "enqueue_at") {
            "after_schedule"
        } else {
            "after_enqueue"
        };
        let hooks: Vec<&Value> = out["hooks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| h[0] == kind)
            .collect();
        assert_eq!(
            hooks.len(),
            pushed.iter().filter(|p| **p).count(),
            "a hook after the push ran for a job not pushed, or none ran: {out}"
        );
        pushed
    }
}

/// Seed 001 with real `Resque.enqueue` through the shim (D-3, D-3a): the holds are placed with
/// the push, B never starts before A succeeded, a `unique` duplicate returns false (its
/// after_enqueue hooks do not run), and a push before any daemon published is Resque's own.
#[test]
fn resque_enqueue_through_the_shim_places_holds_and_refuses_duplicates() {
    let Some(libs) = resque_libs(false) else {
        return;
    };
    seed_001_story(&resque_enqueue(libs, false), &[]);
}

/// resque-scheduler's `Resque.enqueue_at` through the shim (D-3b): holds placed when the job
/// is scheduled, B waits for A (delivered by locketd's scheduler), a duplicate returns false;
/// `Resque.remove_delayed` still finds a scheduled item by its bytes.
#[test]
fn resque_enqueue_at_through_the_shim_places_holds_when_scheduled() {
    let Some(libs) = resque_libs(true) else {
        return;
    };
    delayed_story(&resque_enqueue(libs.clone(), true), &[]);
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = crate::support::write_script(work.path(), "h.sh", "cat >/dev/null");
    let config = crate::daemon::cfg("u")
        .class(
            "Sync",
            &h,
            "holds = [ { name = \"sync:{args[0]}\", when = \"enqueue\" } ]",
        )
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "plans published", || {
        crate::push::plans(&mut r).contains_key("Sync")
    });
    assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
    let at = 4_000_000_000u64;
    let out = ruby(
        "resque_enqueue.rb",
        &libs,
        &json!({"port": redis.port(), "namespace": NS, "scheduler": true, "jobs": [
            {"via": "enqueue_at", "queue": "u", "class": "Sync", "args": [7], "at": at},
            {"via": "remove_delayed", "queue": "u", "class": "Sync", "args": [7]},
        ]}),
    );
    assert_eq!(out["results"], json!([true, 1]), "{out}");
    assert!(r.exists(&format!("{NS}:locket:dep:sync:7")));
    assert_eq!(r.llen(&format!("{NS}:delayed:{at}")), 0);
}

/// ActiveJob's Resque adapter, unchanged, through the shim: its JobWrapper's `unique` key
/// (the job's first argument) refuses the second `perform_later(5)`.
#[test]
fn active_job_through_the_shim_applies_unique() {
    let Some(libs) = resque_libs(false) else {
        return;
    };
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = crate::support::write_script(work.path(), "h.sh", "cat >/dev/null");
    let config = crate::daemon::cfg("aj")
        .class(
            "ActiveJob::QueueAdapters::ResqueAdapter::JobWrapper",
            &h,
            "unique = \"until_expired\"\nunique_ttl = \"60s\"\n\
             unique_key = \"aj:{args[0].job_class}:{args[0].arguments[0]}\"",
        )
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "plans published", || {
        crate::push::plans(&mut r).len() > 1
    });
    assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
    let later = |k: u64| json!({"via": "perform_later", "queue": "aj", "args": [k]});
    ruby(
        "resque_enqueue.rb",
        &libs,
        &json!({"port": redis.port(), "namespace": NS, "jobs": [later(5), later(5), later(6)]}),
    );
    assert_eq!(r.llen(&format!("{NS}:queue:aj")), 2);
    assert!(r.exists(&format!("{NS}:locket:unique:aj:LocketdTestJob:5")));
}
