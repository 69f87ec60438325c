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
    // node-resque files a job under the record's `worker` field: locketd's worker by its
    // host:pid, with its job (never "started" beside an "undefined" key).
    let working = seen["allWorkingOn"]
        .as_object()
        .expect("allWorkingOn object");
    assert_eq!(working.keys().collect::<Vec<_>>(), [&host_pid], "{seen}");
    let job = &working[&host_pid];
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

/// node-resque's stuck-worker cleanup against busy locketd workers. `allWorkingOn()` shows each
/// busy worker under its `host:pid` with its own job. `cleanOldWorkers(age)`, given jobs that
/// have run longer than `age`, does to each locketd worker what it does to one of its own:
/// a `Worker Timeout (killed manually)` failure naming the worker, its queue and its payload,
/// one `stat:failed` each, and the worker's id removed from `workers` (never `undefined`).
/// node-resque stops no process: the locketd jobs run on under their locks and their ends are
/// recorded as usual (so a job node-resque filed as stuck also counts as processed), and the
/// workers then stop cleanly, leaving none of their keys behind.
#[test]
fn node_resque_cleans_old_locketd_workers_by_their_ids() {
    node_resque_dir();
    let redis = crate::support::RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let w = work.path().display().to_string();
    let mut reaper = Reaper::default();
    let slow = write_script(
        work.path(),
        "slow.sh",
        &format!(
            r#"tag=$(echo "$LOCKETD_ARGS" | tr -dc 'a-z')
echo $$ > {w}/pid.$tag
i=0
while [ ! -e {w}/release ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done
"#
        ),
    );
    let config = cfg("nq").class("NodeSlow", &slow, "").render();
    let mut d = Daemon::start(&redis, &config, &["--workers", "2"]);
    wait_until(SHORT, "two locketd workers registered", || {
        r.workers().len() == 2
    });
    let ids = r.workers();
    let names: Vec<String> = ids
        .iter()
        .map(|id| id.splitn(3, ':').take(2).collect::<Vec<_>>().join(":"))
        .collect();
    for tag in ["a", "b"] {
        reaper.watch(&work.path().join(format!("pid.{tag}")));
    }
    enqueue(
        redis.port(),
        json!([
            {"queue": "nq", "class": "NodeSlow", "args": ["a"]},
            {"queue": "nq", "class": "NodeSlow", "args": ["b"]}
        ]),
    );
    let started = std::time::Instant::now();
    for tag in ["a", "b"] {
        wait_pid(&work.path().join(format!("pid.{tag}")), SHORT);
    }
    // run_at has whole seconds: past one second, every job is older than age_ms = 1.
    std::thread::sleep(Duration::from_millis(1100).saturating_sub(started.elapsed()));

    let out = run_node_json(
        "clean.js",
        &json!({"port": redis.port(), "namespace": NS, "age_ms": 1}),
        NODE_TIMEOUT,
    );
    let working = out["allWorkingOn"].as_object().expect("allWorkingOn");
    let mut keys: Vec<&String> = working.keys().collect();
    keys.sort();
    let mut want: Vec<&String> = names.iter().collect();
    want.sort();
    assert_eq!(keys, want, "{out}");
    let mut args: Vec<String> = working
        .values()
        .map(|job| {
            assert_eq!(job["queue"], "nq", "{out}");
            job["payload"]["args"][0]
                .as_str()
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    args.sort();
    assert_eq!(args, ["a", "b"], "{out}");

    assert_eq!(out["errors"], json!([]), "{out}");
    let cleaned = out["cleaned"].as_object().expect("cleaned");
    let mut cleaned_keys: Vec<&String> = cleaned.keys().collect();
    cleaned_keys.sort();
    assert_eq!(cleaned_keys, want, "{out}");
    let failed = out["failed"].as_array().expect("failed");
    assert_eq!(failed.len(), 2, "{out}");
    for f in failed {
        assert_eq!(f["exception"], "Worker Timeout (killed manually)", "{f}");
        assert_eq!(f["queue"], "nq", "{f}");
        assert_eq!(f["payload"]["class"], "NodeSlow", "{f}");
        assert!(names.iter().any(|n| f["worker"] == n.as_str()), "{f}");
        let id = ids
            .iter()
            .find(|id| id.starts_with(&format!("{}:", f["worker"].as_str().unwrap())))
            .unwrap();
        // The record is the job the worker was running.
        let record: Option<String> = r.cmd(&["GET", &format!("{NS}:worker:{id}")]);
        let record: Value = serde_json::from_str(&record.expect("the job still runs")).unwrap();
        assert_eq!(f["payload"], record["payload"], "{f}");
    }
    assert_eq!(r.failed_stat(), 2);
    assert_eq!(out["workers"], json!({}), "{out}");
    assert!(r.workers().is_empty(), "{:?}", r.workers());
    assert!(r.keys(&format!("{NS}:*undefined*")).is_empty());

    // The locketd jobs were not stopped: they finish and are recorded as processed.
    fs::write(work.path().join("release"), "").unwrap();
    wait_until(SHORT, "both jobs finished under locketd", || {
        r.processed() == 2
    });
    assert_eq!(r.failed_stat(), 2);
    assert_eq!(d.terminate(SHORT).code(), Some(0));
    for id in &ids {
        assert!(!r.exists(&format!("{NS}:worker:{id}")), "{id}");
        assert!(!r.exists(&format!("{NS}:worker:{id}:started")), "{id}");
    }
    let beats: Vec<String> = r.cmd(&["HKEYS", &format!("{NS}:workers:heartbeat")]);
    assert!(beats.is_empty(), "{beats:?}");
    assert!(r.workers().is_empty());
}
