//! node-resque 9.7.1 (pinned in `tests/node`) and locketd on one Redis: jobs enqueued by
//! node-resque run under locketd, and node-resque's Queue API reads locketd's workers,
//! "working on" records, failures and stats (resque-protocol.md §11, §13 items 2, 3, 15, 19-21,
//! 32).

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, hostname, wait_pid, workdir, Reaper, NS, R};
use crate::support::{
    node_resque_dir, read_lossy, run_node_json, wait_until, write_script, Daemon,
};

const NODE_TIMEOUT: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_secs(10);

fn enqueue(port: u16, jobs: Value) {
    let out = run_node_json(
        "enqueue.js",
        &json!({"port": port, "namespace": NS, "jobs": jobs}),
        NODE_TIMEOUT,
    );
    assert_eq!(out["ok"], json!(true), "{out}");
}

fn inspect(port: u16) -> Value {
    run_node_json(
        "inspect.js",
        &json!({"port": port, "namespace": NS, "queues": ["nq"]}),
        NODE_TIMEOUT,
    )
}

/// Checklist 2 and 3: a job enqueued by node-resque (`{"class","queue","args"}`) is found and
/// run by locketd; the handler gets the payload byte for byte (node's extra `queue` key
/// included) and the args exactly as node wrote them.
#[test]
fn a_job_enqueued_by_node_resque_runs_under_locketd() {
    node_resque_dir();
    let redis = crate::support::RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let w = work.path().display().to_string();
    let script = write_script(
        work.path(),
        "record.sh",
        &format!(
            r#"cat > {w}/stdin.tmp
printf '%s' "$LOCKETD_ARGS" > {w}/args
printf '%s' "$LOCKETD_QUEUE" > {w}/queue
mv {w}/stdin.tmp {w}/stdin
"#
        ),
    );
    let config = cfg("nq").class("NodeJob", &script, "").render();
    let mut d = Daemon::start(&redis, &config, &[]);
    enqueue(
        redis.port(),
        json!([{"queue": "nq", "class": "NodeJob", "args": [1, "two", {"three": 3}]}]),
    );
    let stdin = work.path().join("stdin");
    wait_until(SHORT, "the node-resque job ran", || {
        stdin.exists() && r.processed() == 1
    });
    let payload: Value = serde_json::from_str(&read_lossy(&stdin)).expect("payload is JSON");
    assert_eq!(
        payload,
        json!({"class": "NodeJob", "queue": "nq", "args": [1, "two", {"three": 3}]})
    );
    assert_eq!(
        read_lossy(&work.path().join("args")),
        r#"[1,"two",{"three":3}]"#
    );
    assert_eq!(read_lossy(&work.path().join("queue")), "nq");
    assert!(r.failures().is_empty(), "{:?}", r.failures());
    assert_eq!(d.terminate(SHORT).code(), Some(0));
}

/// Checklist 15, 19-21, 32 through node-resque's API: while a job runs, `workers()` lists
/// locketd's worker as `host:pid` with its queues and `allWorkingOn()` shows the job; after a
/// failing job `failed()` reads locketd's record (exception, error, payload, queue, worker) and
/// `failedCount()` matches; `stats()` shows processed and failed; after shutdown the worker is
/// gone.
#[test]
fn node_resque_reads_locketd_workers_jobs_failures_and_stats() {
    node_resque_dir();
    let redis = crate::support::RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let w = work.path().display().to_string();
    let pid_file = work.path().join("slow.pid");
    let mut reaper = Reaper::default();
    reaper.watch(&pid_file);
    let slow = write_script(
        work.path(),
        "slow.sh",
        &format!(
            r#"echo $$ > {pid}
i=0
while [ ! -e {w}/release ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done
"#,
            pid = pid_file.display()
        ),
    );
    let fail = write_script(
        work.path(),
        "fail.sh",
        "echo 'first line' >&2\necho 'something broke' >&2\nexit 3\n",
    );
    let config = cfg("nq")
        .class("NodeSlow", &slow, "")
        .class("NodeFail", &fail, "")
        .render();
    let mut d = Daemon::start(&redis, &config, &[]);
    d.wait_for_log("worker registered", SHORT);
    let host_pid = format!("{}:{}", hostname(), d.worker_pid());
    let worker = format!("{host_pid}:nq");

    enqueue(
        redis.port(),
        json!([{"queue": "nq", "class": "NodeSlow", "args": ["s", 2]}]),
    );
    wait_pid(&pid_file, SHORT);
    let seen = inspect(redis.port());
    assert_eq!(
        seen["workers"],
        json!({ host_pid.as_str(): "nq" }),
        "{seen}"
    );
    // node-resque files a job under the record's `worker` field, which Resque's (and so
    // locketd's) `worker:<id>` record does not have: look the job up by value.
    let working = seen["allWorkingOn"]
        .as_object()
        .expect("allWorkingOn object");
    assert!(working.contains_key(&host_pid), "{seen}");
    let job = working
        .values()
        .find(|v| v.is_object())
        .unwrap_or_else(|| panic!("no job in allWorkingOn: {seen}"));
    assert_eq!(job["queue"], "nq", "{job}");
    assert_eq!(
        job["payload"],
        json!({"class": "NodeSlow", "queue": "nq", "args": ["s", 2]})
    );
    assert!(
        job["run_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{job}"
    );
    fs::write(work.path().join("release"), "").unwrap();
    wait_until(SHORT, "the slow job finished", || r.processed() == 1);

    enqueue(
        redis.port(),
        json!([{"queue": "nq", "class": "NodeFail", "args": ["boom"]}]),
    );
    wait_until(SHORT, "the failing job was recorded", || {
        r.failures().len() == 1 && r.processed() == 2
    });
    let seen = inspect(redis.port());
    assert_eq!(seen["failedCount"], json!(1), "{seen}");
    let f = &seen["failed"][0];
    assert_eq!(f["exception"], "Locket::CommandFailed", "{f}");
    let error = f["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("status 3") && error.contains("something broke"),
        "{f}"
    );
    assert_eq!(
        f["backtrace"],
        json!(["first line", "something broke"]),
        "{f}"
    );
    assert_eq!(f["payload"]["class"], "NodeFail");
    assert_eq!(f["payload"]["args"], json!(["boom"]));
    assert_eq!(f["payload"]["queue"], "nq");
    assert_eq!(f["queue"], "nq");
    assert_eq!(f["worker"], worker.as_str());
    assert!(
        f["failed_at"].as_str().is_some_and(|t| t.ends_with(" UTC")),
        "{f}"
    );
    let stats = &seen["stats"];
    assert_eq!(stats["processed"], "2", "{seen}");
    assert_eq!(stats["failed"], "1", "{seen}");
    assert_eq!(stats[format!("processed:{worker}")], "2", "{seen}");
    assert_eq!(stats[format!("failed:{worker}")], "1", "{seen}");
    assert_eq!(seen["lengths"]["nq"], json!(0), "{seen}");

    assert_eq!(d.terminate(SHORT).code(), Some(0));
    let seen = inspect(redis.port());
    assert_eq!(seen["workers"], json!({}), "{seen}");
    assert_eq!(seen["stats"]["processed"], "2", "{seen}");
}
