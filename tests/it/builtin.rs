//! Built-in in-process handlers (`[classes.X] builtin = "noop"`) through the real binary.
//! Run: `cargo test --test it builtin::`.

use std::time::Duration;

use crate::support::{wait_until, Daemon, RedisServer};

#[test]
fn a_builtin_noop_job_runs_to_success_without_a_command() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    let mut daemon = Daemon::start(
        &redis,
        "queues = \"q\"\ninterval = 0.1\n[classes.Noop]\nbuiltin = \"noop\"\n\
         [classes.Probe]\nbuiltin = \"probe\"\n",
        &[],
    );
    let _: () = redis::cmd("RPUSH")
        .arg("resque:queue:q")
        .arg(r#"{"class":"Noop","args":[1]}"#)
        .arg(r#"{"class":"Probe","args":[{"enqueued_at_us":1}]}"#)
        .query(&mut conn)
        .unwrap();
    wait_until(Duration::from_secs(10), "two jobs processed", || {
        let n: Option<u64> = redis::cmd("GET")
            .arg("resque:stat:processed")
            .query(&mut conn)
            .unwrap();
        n == Some(2)
    });
    let failed: Option<u64> = redis::cmd("GET")
        .arg("resque:stat:failed")
        .query(&mut conn)
        .unwrap();
    assert_eq!(failed.unwrap_or(0), 0, "{}", daemon.log());
    let failures: u64 = redis::cmd("LLEN")
        .arg("resque:failed")
        .query(&mut conn)
        .unwrap();
    assert_eq!(failures, 0);
    // The probe logs its enqueue-to-start latency (huge here: enqueued at the epoch's start).
    daemon.wait_for_log("latency_us=", Duration::from_secs(5));
    assert!(daemon.terminate(Duration::from_secs(10)).success());
}

#[test]
fn an_unknown_builtin_is_a_config_error_naming_it() {
    let redis = RedisServer::start();
    let mut daemon = Daemon::start(
        &redis,
        "queues = \"q\"\n[classes.Noop]\nbuiltin = \"teleport\"\n",
        &[],
    );
    let status = daemon
        .wait_exit(Duration::from_secs(10))
        .expect("locketd exits on a bad builtin");
    assert_eq!(status.code(), Some(78), "{}", daemon.log());
    let log = daemon.log();
    assert!(log.contains("builtin") && log.contains("teleport"), "{log}");
}
