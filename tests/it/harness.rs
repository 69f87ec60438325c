//! Tests of the test harness itself (tests/it/support).

use std::time::Duration;

use serde_json::json;

use crate::support::{
    pid_alive, run_node_json, wait_until, wait_until_async, write_script, Daemon, RedisServer,
};

fn ping(conn: &mut redis::Connection) -> String {
    redis::cmd("PING").query(conn).expect("PING")
}

#[test]
fn server_answers_ping_on_a_private_port() {
    let redis = RedisServer::start();
    assert_ne!(redis.port(), 6379);
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}/0", redis.port()));
    assert_eq!(ping(&mut redis.sync_conn()), "PONG");
    let dir: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("dir")
        .query(&mut redis.sync_conn())
        .expect("CONFIG GET dir");
    assert_eq!(
        std::path::Path::new(&dir[1]).canonicalize().unwrap(),
        redis.dir().canonicalize().unwrap()
    );
    assert!(
        redis.log().contains("Ready to accept connections"),
        "{}",
        redis.log()
    );
}

#[tokio::test]
async fn async_connection_works() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    // A blocking command longer than redis-rs' default 500 ms response timeout.
    let popped: Option<(String, String)> = redis::cmd("BLPOP")
        .arg("nothing")
        .arg(1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(popped, None);
    let mut probe = redis.conn().await;
    wait_until_async(Duration::from_secs(5), "k is set", || {
        let mut c = probe.clone();
        async move {
            let v: Option<String> = redis::cmd("GET")
                .arg("k")
                .query_async(&mut c)
                .await
                .unwrap();
            v.as_deref() == Some("v")
        }
    })
    .await;
    let _: () = redis::cmd("PING").query_async(&mut probe).await.unwrap();
}

#[test]
fn two_servers_get_different_ports_and_dirs() {
    let a = RedisServer::start();
    let b = RedisServer::start();
    assert_ne!(a.port(), b.port());
    assert_ne!(a.dir(), b.dir());
    let () = redis::cmd("SET")
        .arg("only")
        .arg("a")
        .query(&mut a.sync_conn())
        .unwrap();
    let on_b: Option<String> = redis::cmd("GET")
        .arg("only")
        .query(&mut b.sync_conn())
        .unwrap();
    assert_eq!(on_b, None);
}

#[test]
fn drop_stops_the_server_and_removes_its_dir() {
    let redis = RedisServer::start();
    let pid = redis.pid().expect("running");
    let port = redis.port();
    let dir = redis.dir().to_path_buf();
    assert!(pid_alive(pid));
    drop(redis);
    assert!(!pid_alive(pid), "redis-server {pid} still alive after drop");
    assert!(!dir.exists(), "{} still exists", dir.display());
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn restart_keeps_aof_data() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let port = redis.port();
    let () = redis::cmd("SET")
        .arg("survives")
        .arg("yes")
        .query(&mut redis.sync_conn())
        .unwrap();
    let first_pid = redis.pid().unwrap();

    redis.stop();
    assert!(!redis.is_running());
    assert!(!pid_alive(first_pid));
    assert!(redis
        .client()
        .get_connection_with_timeout(Duration::from_millis(300))
        .is_err());

    redis.restart();
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid().unwrap(), first_pid);
    let got: Option<String> = redis::cmd("GET")
        .arg("survives")
        .query(&mut redis.sync_conn())
        .unwrap();
    assert_eq!(got.as_deref(), Some("yes"));
}

#[test]
fn without_aof_restart_starts_empty() {
    let mut redis = RedisServer::start();
    let () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query(&mut redis.sync_conn())
        .unwrap();
    redis.restart();
    let got: Option<String> = redis::cmd("GET")
        .arg("k")
        .query(&mut redis.sync_conn())
        .unwrap();
    assert_eq!(got, None);
}

#[test]
fn extra_args_override_defaults() {
    let redis = RedisServer::start_with(&["--appendonly", "yes", "--maxmemory", "12mb"]);
    let aof: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendonly")
        .query(&mut redis.sync_conn())
        .unwrap();
    assert_eq!(aof, vec!["appendonly", "yes"]);
    let mm: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory")
        .query(&mut redis.sync_conn())
        .unwrap();
    assert_eq!(
        mm,
        vec!["maxmemory", (12 * 1024 * 1024).to_string().as_str()]
    );
}

#[test]
#[should_panic(expected = "timed out after")]
fn wait_until_panics_on_timeout() {
    wait_until(Duration::from_millis(100), "never", || false);
}

#[test]
fn write_script_is_executable() {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), "hello.sh", "echo \"hello $1\"\n");
    let out = std::process::Command::new(&script)
        .arg("world")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello world\n");
}

/// The Daemon guard, exercised with a stand-in program: arguments, env,
/// log capture, signals, exit status and process-group cleanup.
#[test]
fn daemon_guard_runs_program_and_kills_its_group() {
    let redis = RedisServer::start();
    let builder = Daemon::builder(&redis).config("answer = 42\n");
    let fake = write_script(
        builder.dir(),
        "fake-locketd.sh",
        r#"echo "args: $*"
echo "rust_log=$RUST_LOG extra=$EXTRA cwd=$(pwd)"
cat "$2"
sleep 300 &
echo "child=$!"
trap 'echo got-usr1' USR1
trap 'echo got-term; exit 7' TERM
echo ready >&2
while :; do sleep 0.05; done
"#,
    );
    let mut daemon = builder
        .program(&fake)
        .env("EXTRA", "x1")
        .args(["--foo", "bar"])
        .start();
    daemon.wait_for_log("ready", Duration::from_secs(10));
    let log = daemon.log();
    let config = daemon.config_path().display().to_string();
    assert!(
        log.contains(&format!(
            "args: --config {config} --redis {} --foo bar",
            redis.url()
        )),
        "{log}"
    );
    let dir = daemon.dir().canonicalize().unwrap();
    assert!(
        log.contains(&format!(
            "rust_log=locketd=debug extra=x1 cwd={}",
            dir.display()
        )),
        "{log}"
    );
    assert!(log.contains("answer = 42"), "{log}");

    let sleeper: i32 = log
        .lines()
        .find_map(|l| l.strip_prefix("child="))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(pid_alive(sleeper));
    assert!(daemon.group_pids().contains(&daemon.pid()));
    assert!(daemon.group_pids().contains(&sleeper));

    daemon.signal(libc::SIGUSR1);
    daemon.wait_for_log("got-usr1", Duration::from_secs(10));
    assert!(daemon.is_running());

    let status = daemon.terminate(Duration::from_secs(10));
    assert_eq!(status.code(), Some(7));
    // The exit is observed without reaping; the orphaned child lives on...
    assert!(pid_alive(sleeper));
    assert_eq!(daemon.group_pids(), vec![sleeper]);
    // ...until the guard is dropped.
    let pid = daemon.pid();
    drop(daemon);
    assert!(!pid_alive(sleeper), "group member {sleeper} survived drop");
    assert!(!pid_alive(pid));
}

#[test]
fn daemon_drop_kills_a_running_daemon() {
    let redis = RedisServer::start();
    let builder = Daemon::builder(&redis);
    let fake = write_script(
        builder.dir(),
        "fake.sh",
        "trap '' TERM\nsleep 300 &\nwait\n",
    );
    let mut daemon = builder.program(&fake).env("RUST_LOG", "trace").start();
    assert!(daemon.wait_exit(Duration::from_millis(200)).is_none());
    wait_until(Duration::from_secs(10), "sleep child started", || {
        daemon.group_pids().len() == 2
    });
    let pids = daemon.group_pids();
    drop(daemon);
    for pid in pids {
        assert!(!pid_alive(pid), "{pid} survived drop");
    }
}

#[test]
fn real_locketd_binary_is_spawned() {
    let redis = RedisServer::start();
    let mut daemon = Daemon::start(&redis, "", &[]);
    assert!(daemon.pid() > 0);
    assert!(daemon.config_path().exists());
    // Whatever the binary does with the (empty) config, the guard cleans up.
    daemon.kill();
    assert!(!daemon.is_running());
    assert!(daemon.wait_exit(Duration::from_millis(10)).is_some());
}

#[test]
fn node_resque_enqueue_and_inspect_round_trip() {
    let redis = RedisServer::start();
    let ns = "resque";
    let out = run_node_json(
        "enqueue.js",
        &json!({
            "port": redis.port(),
            "namespace": ns,
            "jobs": [
                {"queue": "q1", "class": "Echo", "args": [1, "two", {"three": 3}]},
                {"queue": "q1", "class": "Echo", "args": []},
                {"queue": "q2", "class": "Other", "args": ["x"]},
            ],
        }),
        Duration::from_secs(60),
    );
    assert_eq!(out["ok"], json!(true));

    let mut conn = redis.sync_conn();
    let raw: Vec<String> = redis::cmd("LRANGE")
        .arg("resque:queue:q1")
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .unwrap();
    assert_eq!(raw.len(), 2);
    let first: serde_json::Value = serde_json::from_str(&raw[0]).unwrap();
    assert_eq!(
        first,
        json!({"class": "Echo", "queue": "q1", "args": [1, "two", {"three": 3}]})
    );

    let () = redis::cmd("RPUSH")
        .arg("resque:failed")
        .arg(
            json!({"worker": "h:1:q1", "queue": "q1", "payload": {"class": "Echo", "args": []},
                    "exception": "RuntimeError", "error": "boom", "backtrace": [],
                    "failed_at": "2024/01/01 00:00:00 UTC"})
            .to_string(),
        )
        .query(&mut conn)
        .unwrap();
    let () = redis::cmd("SET")
        .arg("resque:stat:processed")
        .arg(5)
        .query(&mut conn)
        .unwrap();

    let seen = run_node_json(
        "inspect.js",
        &json!({"port": redis.port(), "namespace": ns, "queues": ["q3"]}),
        Duration::from_secs(60),
    );
    assert_eq!(seen["queues"], json!(["q1", "q2"]));
    assert_eq!(seen["lengths"], json!({"q1": 2, "q2": 1, "q3": 0}));
    assert_eq!(seen["failedCount"], json!(1));
    assert_eq!(seen["failed"][0]["error"], json!("boom"));
    assert_eq!(seen["stats"]["processed"], json!("5"));
    assert_eq!(seen["workers"], json!({}));
}

#[test]
fn guards_clean_up_when_a_test_panics() {
    let mut pids = Vec::new();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let redis = RedisServer::start();
        pids.push(redis.pid().unwrap());
        let builder = Daemon::builder(&redis);
        let fake = write_script(builder.dir(), "fake.sh", "sleep 300 &\nwait\n");
        let daemon = builder.program(&fake).start();
        pids.push(daemon.pid());
        wait_until(Duration::from_secs(10), "sleep child started", || {
            daemon.group_pids().len() == 2
        });
        pids.extend(daemon.group_pids());
        panic!("deliberate test failure");
    }));
    assert!(result.is_err());
    assert_eq!(pids.len(), 4, "{pids:?}");
    for pid in pids {
        assert!(!pid_alive(pid), "{pid} survived the panic");
    }
}

#[test]
#[should_panic(expected = "was taken meanwhile")]
fn restart_reports_a_taken_port() {
    let mut redis = RedisServer::start();
    redis.stop();
    let _squatter = std::net::TcpListener::bind(("127.0.0.1", redis.port())).unwrap();
    redis.restart();
}
