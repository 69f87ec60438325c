//! E-3 and S-6 through the real binary (issue 11 item 3): a step that Redis refuses in a way a
//! resend cannot change (a key another tool made a string, here `<ns>:failed`) is logged once
//! and not resent in a loop; the job stays visible (its inflight record), the worker neither
//! exits nor wedges, and the step lands once the operator has mended the key.

use std::time::Duration;

use crate::daemon::{cfg, workdir, NS, R};
use crate::ops::{locketd, stdout_ok};
use std::process::{Command, Stdio};

use crate::support::{wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(20);
/// The parked slot's retry period (PARK_RETRY, 30 s) and some slack.
const PARKED: Duration = Duration::from_secs(45);

/// How many script calls carrying `marker` among their arguments the server ran in `window`
/// (MONITOR through redis-cli; the janitor's and heartbeat's calls do not carry it).
fn calls_with(redis: &RedisServer, marker: &str, window: Duration) -> usize {
    let mut mon = Command::new("redis-cli")
        .args(["-p", &redis.port().to_string(), "monitor"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli monitor");
    std::thread::sleep(window);
    let _ = mon.kill();
    let out = mon.wait_with_output().expect("monitor output");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("\"evalsha\"") && l.contains(marker))
        .count()
}

/// Waits, then asserts that the daemon is parked: one refusal line in the log, its worker
/// still the same process, the job in an inflight record, and no resend in a loop (the old
/// code resent it with a backoff capped at 2 s, for ten minutes).
fn assert_parked(redis: &RedisServer, r: &mut R, d: &Daemon, needle: &str, marker: &str) -> i32 {
    d.wait_for_log(needle, LONG);
    let worker = d.worker_pid();
    let sent = calls_with(redis, marker, Duration::from_secs(5));
    assert_eq!(sent, 0, "the refused step was sent {sent} times in 5 s");
    assert_eq!(d.worker_pid(), worker, "the worker exited:\n{}", d.log());
    assert_eq!(d.log().matches(needle).count(), 1, "{}", d.log());
    assert_eq!(
        r.keys(&format!("{NS}:locket:inflight:*")).len(),
        1,
        "the job is not in its inflight record"
    );
    // E-3: `status` shows the parked slot and the refusal (issue 11 item 3).
    let parked = parked_in_status(redis);
    assert_eq!(parked.len(), 1, "{parked:?}");
    let why = parked[0]["why"].as_str().unwrap_or_default();
    assert!(why.contains("WRONGTYPE"), "{why}");
    let text = stdout_ok(&locketd(redis, &["--queues", "q", "status"]));
    assert!(text.contains("PARKED since "), "{text}");
    worker
}

/// The `parked` marks of the workers `locketd status --json` lists.
fn parked_in_status(redis: &RedisServer) -> Vec<serde_json::Value> {
    let out = stdout_ok(&locketd(redis, &["--queues", "q", "status", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("status json");
    v["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .filter(|w| !w["parked"].is_null())
        .map(|w| w["parked"].clone())
        .collect()
}

// E-3, S-6, D-6 (finding 6): a failed job whose failure list another tool made a string.
#[test]
fn a_refused_finish_parks_the_slot_and_lands_once_the_key_is_mended() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = write_script(
        work.path(),
        "fail.sh",
        "cat >/dev/null\necho boom >&2\nexit 3\n",
    );
    let config = cfg("q").class("Boom", &h, "lock = \"boom\"").render();
    let _: () = r.cmd(&["SET", &format!("{NS}:failed"), "not a list"]);
    let mut d = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Boom","args":[1]}"#);
    let worker = assert_parked(
        &redis,
        &mut r,
        &d,
        "the job's end was refused by Redis",
        "Locket::CommandFailed",
    );
    let _: () = r.cmd(&["DEL", &format!("{NS}:failed")]);
    wait_until(PARKED, "the failure record landed", || {
        r.llen(&format!("{NS}:failed")) == 1
    });
    assert!(r.keys(&format!("{NS}:locket:inflight:*")).is_empty());
    assert!(parked_in_status(&redis).is_empty());
    assert_eq!(d.worker_pid(), worker);
    assert_eq!(d.terminate(LONG).code(), Some(0));
}

// E-3, S-6 (finding 7's wedge): ACQUIRE refused (its `fail` fallback cannot push to the
// failure list) is not resent for minutes: the job is failed as Locket::StoreError, which
// lands once the failure list is mended.
#[test]
fn a_refused_acquire_fails_the_job_as_a_store_error() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let h = write_script(work.path(), "ok.sh", "cat >/dev/null\n");
    let config = cfg("q")
        .class("Held", &h, "lock = \"taken\"\non_conflict = \"fail\"")
        .render();
    // Another holder has the lock until long after the test.
    let _: () = r.cmd(&[
        "ZADD",
        &format!("{NS}:locket:lock:taken"),
        "99999999999999",
        "foreign",
    ]);
    let _: () = r.cmd(&["SET", &format!("{NS}:failed"), "not a list"]);
    let mut d = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Held","args":[1]}"#);
    d.wait_for_log("redis refused the step", LONG);
    assert_parked(
        &redis,
        &mut r,
        &d,
        "the job's end was refused by Redis",
        "Locket::StoreError",
    );
    assert_eq!(
        d.log().matches("redis refused the step").count(),
        2,
        "{}",
        d.log()
    );
    let _: () = r.cmd(&["DEL", &format!("{NS}:failed")]);
    wait_until(PARKED, "the failure record landed", || {
        r.llen(&format!("{NS}:failed")) == 1
    });
    let f = &r.failures()[0];
    assert_eq!(f["exception"], "Locket::StoreError", "{f}");
    // The failure says what Redis refused, where Resque users read it.
    assert!(
        f["error"]
            .as_str()
            .unwrap_or_default()
            .contains("WRONGTYPE"),
        "{f}"
    );
    assert_eq!(f["payload"]["class"], "Held");
    assert_eq!(d.terminate(LONG).code(), Some(0));
}
