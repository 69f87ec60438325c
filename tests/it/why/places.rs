//! `locketd why` for the places a job can be besides its queue and a parked list: reserved by
//! a slot, delayed, failed, nowhere (and a job named wrongly).

use locketd::admin::why::Place;
use serde_json::{json, Value};

use super::{cli, payload, register, rid, stdout, why};
use crate::policies::{cmd, keys, payload_of, reserved, server_ms};
use crate::support::RedisServer;

#[tokio::test]
async fn a_reserved_job_that_has_not_started_names_its_slot() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let j = reserved(&mut c, "pr", "q", "Plain", json!([9])).await;
    register(&mut c, &j).await;
    let w = why(&mut c, rid(&j.rid)).await;
    assert!(
        matches!(&w.place, Place::Reserved { step, worker, host, .. }
                 if step == "reserved" && *worker == j.worker_id && host == "testhost"),
        "{w:?}"
    );
}

#[tokio::test]
async fn a_delayed_job_gives_its_time_by_rid_and_by_payload() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let p = payload_of("Hot", &json!([3]));
    let member = json!({"rid": "00000000000000d1", "queue": "q", "payload": p,
                        "reason": "lock", "resource": "user:3", "attempt": 2})
    .to_string();
    let due = server_ms(&mut c).await + 30_000;
    let _: i64 = cmd(
        &mut c,
        &["ZADD", &keys().delayed(), &due.to_string(), &member],
    )
    .await;
    for t in [rid("00000000000000d1"), payload("q", "Hot", &["3"])] {
        let w = why(&mut c, t).await;
        assert!(
            matches!(&w.place, Place::Delayed { until_ms, resource, .. }
                     if *until_ms == due && resource == "user:3"),
            "{w:?}"
        );
    }
    let text = stdout(&cli(&r, &["00000000000000d1"]));
    assert!(text.contains("delayed until"), "{text}");
    assert!(text.contains("attempt 2"), "{text}");
}

#[tokio::test]
async fn a_failed_job_is_found_in_the_failure_list() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let record = json!({"failed_at": "2026/11/28 12:00:00 UTC",
                        "payload": {"class": "Plain", "args": [5]},
                        "exception": "RuntimeError", "error": "boom",
                        "backtrace": [], "worker": "h:1:q", "queue": "q"})
    .to_string();
    let other = record.replace("[5]", "[6]");
    for rec in [&record, &other] {
        let _: i64 = cmd(&mut c, &["RPUSH", &keys().failed(), rec]).await;
    }
    let w = why(&mut c, payload("q", "Plain", &["5"])).await;
    assert!(
        matches!(&w.place, Place::Failed { index: 0, exception, .. } if exception == "RuntimeError"),
        "{w:?}"
    );
    let text = stdout(&cli(&r, &["q", "Plain", "5"]));
    assert!(
        text.contains("failed at 2026/11/28 12:00:00 UTC on h:1:q: RuntimeError: boom"),
        "{text}"
    );
}

#[tokio::test]
async fn a_job_found_nowhere_exits_1_and_bad_arguments_exit_64() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let w = why(&mut c, rid("0123456789abcdef")).await;
    assert!(matches!(w.place, Place::NotFound { .. }), "{w:?}");
    assert!(w.job.is_none());
    let o = cli(&r, &["0123456789abcdef"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(stdout(&o).contains("not found"));
    let o = cli(&r, &["q", "Plain", "7", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["place"]["state"], "not_found");
    let o = cli(&r, &["q", "Plain", "not json"]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("argument 1 is not JSON"), "{err}");
}
