//! `locketd cancel` of a job that has not started (locking-semantics.md A-21): waiting on its
//! lock (`on_conflict = "wait"`), parked, delayed, or reserved while its persistent handler
//! boots. Each cancel removes the job before any handler of it starts, records it as failed
//! with `Locket::Cancelled`, and the command says so (exit 0). The real binary, a real
//! redis-server. Run: `cargo test --test it cancel::`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::daemon::{cfg, workdir, NS, R, SHORT};
use crate::ops::locketd;
use crate::support::{manifest_dir, wait_until, write_script, Daemon, RedisServer};

/// Long enough for a job to be reserved, and for the worker to act, on a loaded machine.
const LONG: Duration = Duration::from_secs(30);

/// A daemon of two slots running `Holder`, which holds lock `k` until `release` exists, and
/// `Victim` (lock `k`, with `victim_extra`'s conflict policy), whose handler leaves
/// `victim.ran` behind: the proof that it started.
struct Setup {
    redis: RedisServer,
    r: R,
    d: Daemon,
    work: tempfile::TempDir,
}

impl Setup {
    fn new(victim_extra: &str) -> Setup {
        let redis = RedisServer::start();
        let mut r = R::new(&redis);
        let work = workdir();
        let holder = write_script(
            work.path(),
            "holder.sh",
            &format!(
                "cat >/dev/null\ntouch {started}\nn=0\nwhile [ ! -e {release} ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done\n",
                started = work.path().join("holder.started").display(),
                release = work.path().join("release").display(),
            ),
        );
        let victim = write_script(
            work.path(),
            "victim.sh",
            &format!(
                "cat >/dev/null\necho \"$LOCKETD_ARGS\" >> {}\n",
                work.path().join("victim.ran").display()
            ),
        );
        let config = cfg("q")
            .class("Holder", &holder, "lock = \"k\"")
            .class("Victim", &victim, &format!("lock = \"k\"\n{victim_extra}"))
            .render();
        let d = Daemon::start(&redis, &config, &["--workers", "2"]);
        wait_until(SHORT, "two workers registered", || r.workers().len() == 2);
        r.push("q", r#"{"class":"Holder","args":[1]}"#);
        let started = work.path().join("holder.started");
        wait_until(LONG, "the holder runs", || started.exists());
        Setup { redis, r, d, work }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.work.path().join(name)
    }

    fn push_victim(&mut self) {
        self.r.push("q", r#"{"class":"Victim","args":[2]}"#);
    }

    /// The rid of the slot record in `state`.
    fn rid_in_state(&mut self, state: &str) -> String {
        let mut found = String::new();
        let r = &mut self.r;
        wait_until(LONG, &format!("a job is {state}"), || {
            for k in r.keys(&format!("{NS}:locket:inflight:*")) {
                let v: Vec<Option<String>> = r.cmd(&["HMGET", &k, "rid", "state"]);
                if let [Some(rid), Some(s)] = v.as_slice() {
                    if s == state {
                        found = rid.clone();
                        return true;
                    }
                }
            }
            false
        });
        found
    }

    /// Runs `locketd cancel RID`: its exit code and stdout.
    fn cancel(&self, rid: &str) -> (Option<i32>, String) {
        let out = locketd(&self.redis, &["cancel", rid]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        eprintln!(
            "cancel: {:?} {text} {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    }

    /// Lets the holder finish, then waits until nothing is left that could run the victim:
    /// the holder processed, no job in the queue, none reserved, parked or delayed.
    fn release_and_drain(&mut self) {
        std::fs::write(self.path("release"), "").expect("release");
        let r = &mut self.r;
        wait_until(LONG, "the holder finished and nothing is left", || {
            r.processed() >= 1
                && r.llen(&format!("{NS}:queue:q")) == 0
                && r.keys(&format!("{NS}:locket:inflight:*")).iter().all(|k| {
                    let rid: Option<String> = r.cmd(&["HGET", k, "rid"]);
                    rid.is_none()
                })
                && r.keys(&format!("{NS}:locket:parked:*")).is_empty()
                && r.zcard(&format!("{NS}:locket:delayed")) == 0
        });
    }

    /// The victim never ran and is recorded once as `Locket::Cancelled`.
    fn assert_cancelled_unrun(&mut self, rid: &str) {
        assert!(
            !self.path("victim.ran").exists(),
            "the cancelled job's handler ran: {:?}",
            std::fs::read_to_string(self.path("victim.ran"))
        );
        let failures: Vec<Value> = self
            .r
            .failures()
            .into_iter()
            .filter(|f| f["payload"]["class"] == "Victim")
            .collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(
            failures[0]["exception"], "Locket::Cancelled",
            "{failures:?}"
        );
        let error = failures[0]["error"].as_str().unwrap_or("");
        assert!(error.contains("locketd cancel by"), "{error}");
        assert_eq!(self.r.failed_stat(), 1);
        assert!(
            !self.r.exists(&format!("{NS}:locket:cancel_start:{rid}")),
            "the request was left behind"
        );
    }

    fn stop(mut self) {
        assert_eq!(self.d.terminate(LONG).code(), Some(0));
    }
}

/// `ZCARD` through `R::int` would read a string; the delayed set's size.
trait Zcard {
    fn zcard(&mut self, key: &str) -> i64;
}

impl Zcard for R {
    fn zcard(&mut self, key: &str) -> i64 {
        self.cmd(&["ZCARD", key])
    }
}

/// A-21, P-3: a job waiting on its lock, whose wait would time out (`wait_timeout` 4 s, the
/// holder runs on), is cancelled: it is removed at its next try, never requeued and never run;
/// the command waits for that and says it was cancelled before its handler started.
#[test]
fn a_job_waiting_on_its_lock_is_cancelled_before_its_wait_times_out() {
    let mut s = Setup::new("on_conflict = \"wait\"\nwait_timeout = \"4s\"");
    s.push_victim();
    let rid = s.rid_in_state("waiting");
    let (code, out) = s.cancel(&rid);
    // Past the wait's timeout, with the holder still running: the job is not requeued.
    std::thread::sleep(Duration::from_secs(5));
    let queued = s.r.llen(&format!("{NS}:queue:q"));
    s.release_and_drain();
    s.assert_cancelled_unrun(&rid);
    assert_eq!(queued, 0, "the cancelled job went back to its queue");
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("cancelled before its handler started"),
        "{out}"
    );
    assert!(
        out.contains("recorded as failed with Locket::Cancelled"),
        "{out}"
    );
    s.stop();
}

/// A-21, P-3: a job waiting on its lock whose holder ends right after the cancel: the wait
/// would now succeed, but the step that would start the job takes the cancel instead, so its
/// handler never starts (no marker file), not even for a moment.
#[test]
fn a_job_waiting_on_its_lock_is_cancelled_and_never_starts_when_the_lock_frees() {
    let mut s = Setup::new("on_conflict = \"wait\"\nwait_timeout = \"60s\"");
    s.push_victim();
    let rid = s.rid_in_state("waiting");
    let (code, out) = s.cancel(&rid);
    // The lock frees at once: a job that is still waiting would start now.
    std::fs::write(s.path("release"), "").expect("release");
    s.release_and_drain();
    // Give a started handler time to leave its marker.
    std::thread::sleep(Duration::from_secs(1));
    s.assert_cancelled_unrun(&rid);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("cancelled before its handler started"),
        "{out}"
    );
    s.stop();
}

/// A-21, PK-1: a job parked on its lock (no worker holds it) is cancelled by its rid at once:
/// its entry leaves the parked list (and the per-queue count and index), the failure is
/// recorded, and when the lock frees nothing of it runs.
#[test]
fn a_parked_job_is_cancelled_by_its_rid() {
    let mut s = Setup::new("on_conflict = \"park\"");
    s.push_victim();
    let list = format!("{NS}:locket:parked:lock:k");
    let r = &mut s.r;
    wait_until(LONG, "the job parked", || r.llen(&list) == 1);
    let entries: Vec<String> = s.r.cmd(&["LRANGE", &list, "0", "-1"]);
    let entry: Value = serde_json::from_str(&entries[0]).expect("entry");
    let rid = entry["rid"].as_str().expect("rid").to_string();
    let (code, out) = s.cancel(&rid);
    let still_parked = s.r.exists(&list) || s.r.exists(&format!("{NS}:locket:parked"));
    let per_queue: Option<i64> =
        s.r.cmd(&["HGET", &format!("{NS}:locket:parked_queues"), "q"]);
    // A second cancel finds nothing and says so.
    let (code2, out2) = s.cancel(&rid);
    s.release_and_drain();
    std::thread::sleep(Duration::from_secs(1));
    s.assert_cancelled_unrun(&rid);
    assert!(!still_parked, "the cancelled job stayed parked");
    assert_eq!(per_queue.unwrap_or(0), 0);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("(parked on lock:k) cancelled"), "{out}");
    assert!(
        out.contains("recorded as failed with Locket::Cancelled"),
        "{out}"
    );
    assert_eq!(code2, Some(1), "{out2}");
    assert!(out2.contains("nothing done"), "{out2}");
    s.stop();
}

/// A-21, P-4: a job delayed by the `delay` policy (due in an hour) is cancelled by its rid at
/// once: it leaves the delayed set and is recorded; `--requeue` is not involved.
#[test]
fn a_delayed_job_is_cancelled_by_its_rid() {
    let mut s = Setup::new("on_conflict = \"delay\"\ndelay_base = \"1h\"\ndelay_max = \"1h\"");
    s.push_victim();
    let delayed = format!("{NS}:locket:delayed");
    let r = &mut s.r;
    wait_until(LONG, "the job is delayed", || r.zcard(&delayed) == 1);
    let members: Vec<String> = s.r.cmd(&["ZRANGE", &delayed, "0", "-1"]);
    let member: Value = serde_json::from_str(&members[0]).expect("member");
    let rid = member["rid"].as_str().expect("rid").to_string();
    let (code, out) = s.cancel(&rid);
    let still_delayed = s.r.zcard(&delayed);
    // Promoting it now (as an operator might, or its due time) finds nothing to run.
    let promoted = locketd(&s.redis, &["delayed", "promote", &rid]);
    eprintln!("promote: {:?}", promoted.status.code());
    s.release_and_drain();
    std::thread::sleep(Duration::from_secs(1));
    s.assert_cancelled_unrun(&rid);
    assert_eq!(still_delayed, 0, "the cancelled job stayed delayed");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("(delayed) cancelled"), "{out}");
    assert!(
        out.contains("recorded as failed with Locket::Cancelled"),
        "{out}"
    );
    s.stop();
}

fn fixture() -> PathBuf {
    manifest_dir().join("tests/it/fixtures/protocol_handler.py")
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A-21, H-8: a job reserved while its persistent handler boots (4 s, the job's state stays
/// `reserved`) is cancelled: when the handler is ready the job is not handed to it, and it is
/// recorded as cancelled; the next job runs on that handler as usual.
#[test]
fn a_reserved_job_is_cancelled_before_its_persistent_handler_is_ready() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let ev = work.path().join("events.jsonl");
    let config = format!(
        "{}\n[handlers.t]\nmode = \"persistent\"\ncommand = [\"{}\"]\nboot_timeout = \"20s\"\n\
         env = {{ EVENTS = \"{}\", BOOT = \"slow\", BOOT_SECS = \"4\" }}\n\n\
         [classes.\"*\"]\nhandler = \"t\"\n",
        cfg("q").render(),
        fixture().display(),
        ev.display(),
    );
    r.push("q", r#"{"class":"Ok","args":["cancelled"]}"#);
    let mut d = Daemon::start(&redis, &config, &[]);
    let mut rid = String::new();
    wait_until(LONG, "the job is reserved", || {
        for k in r.keys(&format!("{NS}:locket:inflight:*")) {
            let v: Vec<Option<String>> = r.cmd(&["HMGET", &k, "rid", "state"]);
            if let [Some(id), Some(s)] = v.as_slice() {
                if s == "reserved" {
                    rid = id.clone();
                    return true;
                }
            }
        }
        false
    });
    let out = locketd(&redis, &["cancel", &rid]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // The handler is ready and takes the next job; the cancelled one was never handed to it.
    r.push("q", r#"{"class":"Ok","args":["next"]}"#);
    wait_until(LONG, "the next job ran", || {
        events(&ev)
            .iter()
            .any(|e| e["event"] == "job" && e.to_string().contains("next"))
    });
    wait_until(SHORT, "both jobs ended", || r.processed() == 2);
    let jobs: Vec<Value> = events(&ev)
        .into_iter()
        .filter(|e| e["event"] == "job")
        .collect();
    assert!(
        jobs.iter().all(|j| !j.to_string().contains("cancelled")),
        "the cancelled job reached its handler: {jobs:?}"
    );
    let failures = r.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0]["exception"], "Locket::Cancelled");
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("(reserved)"), "{text}");
    assert!(
        text.contains("cancelled before its handler started"),
        "{text}"
    );
    assert_eq!(d.terminate(LONG).code(), Some(0));
}
