//! Connecting to Redis: `--redis`, `REDIS_URL`, passwords and TLS (`rediss://`).

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use crate::support::{Daemon, RedisServer};

const CONFIG: &str = r#"
queues = "q"
interval = 0
[classes."*"]
command = ["/bin/true"]
"#;

fn push_job(conn: &mut redis::Connection) {
    let _: () = redis::pipe()
        .cmd("SADD")
        .arg("resque:queues")
        .arg("q")
        .ignore()
        .cmd("RPUSH")
        .arg("resque:queue:q")
        .arg(r#"{"class":"Ping","args":[1]}"#)
        .ignore()
        .query(conn)
        .unwrap();
}

fn processed(conn: &mut redis::Connection) -> Option<String> {
    redis::cmd("GET")
        .arg("resque:stat:processed")
        .query(conn)
        .unwrap()
}

#[test]
fn password_in_the_url_authenticates() {
    let redis = RedisServer::start();
    // The test's own connection was opened before the password, so it stays authenticated.
    let mut conn = redis.require_password("s3cret");
    push_job(&mut conn);
    let url = format!("redis://:s3cret@127.0.0.1:{}/0", redis.port());
    let mut daemon = Daemon::builder(&redis)
        .config(CONFIG)
        .redis_url(&url)
        .start();
    let status = daemon
        .wait_exit(Duration::from_secs(20))
        .expect("drains and exits");
    assert!(status.success(), "{}", daemon.log());
    assert_eq!(processed(&mut conn).as_deref(), Some("1"));
    // The password never reaches the log.
    assert!(!daemon.log().contains("s3cret"), "{}", daemon.log());

    let bad = format!("redis://:wrong@127.0.0.1:{}/0", redis.port());
    let mut daemon = Daemon::builder(&redis)
        .config(CONFIG)
        .redis_url(&bad)
        .start();
    // A wrong password is reported at once, not retried for 30 s.
    let status = daemon
        .wait_exit(Duration::from_secs(10))
        .expect("exits on a wrong password");
    assert_eq!(status.code(), Some(78), "{}", daemon.log());
    assert!(
        daemon.log().to_lowercase().contains("auth"),
        "{}",
        daemon.log()
    );
    // Said as it is: refused at once, not "did not answer within 30s".
    assert!(
        daemon.log().contains("refused the connection"),
        "{}",
        daemon.log()
    );
}

#[test]
fn redis_url_comes_from_the_environment_when_no_flag_is_given() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    push_job(&mut conn);
    let mut daemon = Daemon::builder(&redis)
        .config(CONFIG)
        .no_redis_arg()
        .env("REDIS_URL", redis.url())
        .start();
    let status = daemon.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{}", daemon.log());
    assert_eq!(processed(&mut conn).as_deref(), Some("1"));
}

#[test]
fn rediss_url_connects_over_tls() {
    let redis = RedisServer::start();
    let dir = redis.dir().to_path_buf();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl is installed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tls_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut conn = redis.sync_conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("tls-cert-file")
        .arg(cert.to_str().unwrap())
        .arg("tls-key-file")
        .arg(key.to_str().unwrap())
        .arg("tls-auth-clients")
        .arg("no")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("tls-port")
        .arg(tls_port)
        .query(&mut conn)
        .unwrap();
    push_job(&mut conn);
    // `#insecure`: the test's certificate is self-signed.
    let url = format!("rediss://127.0.0.1:{tls_port}/0#insecure");
    let mut daemon = Daemon::builder(&redis)
        .config(CONFIG)
        .redis_url(&url)
        .start();
    let status = daemon.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{}", daemon.log());
    assert_eq!(processed(&mut conn).as_deref(), Some("1"));
}

// Issue 11, finding 9: a password given with --redis is not left in the world-readable
// /proc/<pid>/cmdline while the daemon connects (here to a port nobody listens on, so it
// keeps trying), nor in its log.
#[test]
fn a_redis_password_on_the_command_line_is_scrubbed_before_connecting() {
    let redis = RedisServer::start();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://:pw-on-argv@127.0.0.1:{port}/0");
    let mut daemon = Daemon::builder(&redis)
        .config(CONFIG)
        .redis_url(&url)
        .start();
    daemon.wait_for_log("redis not answering yet", Duration::from_secs(20));
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", daemon.pid())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(!cmdline.contains("pw-on-argv"), "{cmdline:?}");
    assert!(!daemon.log().contains("pw-on-argv"), "{}", daemon.log());
    daemon.kill();
}

/// A one-slot worker sends its job-path scripts on a connection of their own (src/conn/plain.rs):
/// it authenticates as the URL's ACL user, works in the URL's database, and comes back after
/// Redis drops every connection of the daemon.
#[test]
fn the_job_paths_own_connection_uses_the_urls_user_and_database_and_reconnects() {
    let redis = RedisServer::start();
    let url = format!("redis://jobs:pw3@127.0.0.1:{}/3", redis.port());
    own_connection_uses_user_database_and_reconnects(&redis, &url);
}

/// The same over a Unix socket's URL: the job path's own connection serves those too.
#[test]
fn the_job_paths_own_connection_over_a_unix_socket_uses_the_urls_user_and_database_and_reconnects()
{
    let sockets = tempfile::tempdir().unwrap();
    let sock = sockets.path().join("redis.sock");
    let sock_arg = sock.to_str().expect("a UTF-8 path");
    let redis = RedisServer::start_with(&["--unixsocket", sock_arg, "--unixsocketperm", "700"]);
    let url = format!("redis+unix://{sock_arg}?db=3&user=jobs&pass=pw3");
    own_connection_uses_user_database_and_reconnects(&redis, &url);
    // The connection itself: the socket, the URL's user and its database.
    let mut plain = locketd::conn::Plain::for_url(&url).expect("a socket URL gets one");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let info = match rt.block_on(plain.call(&redis::cmd("CLIENT").arg("INFO").clone())) {
        Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        other => panic!("CLIENT INFO: {other:?}"),
    };
    for part in [" db=3 ", " user=jobs ", &format!(" laddr={sock_arg}:0 ")] {
        assert!(info.contains(part), "{part:?} in {info}");
    }
}

/// `url` names the ACL user `jobs` (password `pw3`) and database 3 of `redis`, which this
/// creates (and turns the default user off): a job pushed there runs, and runs again after
/// Redis dropped every connection of the daemon.
fn own_connection_uses_user_database_and_reconnects(redis: &RedisServer, url: &str) {
    let mut admin = redis.sync_conn();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "jobs", "on", ">pw3", "~*", "&*", "+@all"])
        .query(&mut admin)
        .unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "off"])
        .query(&mut admin)
        .unwrap();
    let mut db3 = redis::Client::open(format!("redis://jobs:pw3@127.0.0.1:{}/3", redis.port()))
        .unwrap()
        .get_connection()
        .unwrap();
    push_job(&mut db3);
    let mut daemon = Daemon::builder(redis)
        .config(&CONFIG.replace("interval = 0", "interval = 1"))
        .redis_url(url)
        .start();
    let ran = |conn: &mut redis::Connection, n: &str| {
        crate::support::wait_until(Duration::from_secs(20), "the job ran", || {
            processed(conn).as_deref() == Some(n)
        })
    };
    ran(&mut db3, "1");
    // Database 3, not 0 (where the test's admin connection is).
    assert_eq!(processed(&mut admin), None, "{}", daemon.log());
    // Every connection but the killer's: the daemon's job path must connect again.
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut admin)
        .unwrap();
    let mut db3 = redis::Client::open(url).unwrap().get_connection().unwrap();
    push_job(&mut db3);
    ran(&mut db3, "2");
    let failed: i64 = redis::cmd("LLEN")
        .arg("resque:failed")
        .query(&mut db3)
        .unwrap();
    assert_eq!(failed, 0, "{}", daemon.log());
    daemon.terminate(Duration::from_secs(20));
}

/// A call of the job path's own connection that is dropped before its reply came (a timeout
/// around it, a select that took another branch) must not leave that reply to be read as the
/// next call's: the next call starts on a new connection.
#[tokio::test]
async fn a_plain_call_dropped_half_way_never_hands_its_reply_to_the_next_call() {
    let redis = RedisServer::start();
    let mut plain = locketd::conn::Plain::for_url(&redis.url()).expect("a TCP URL");
    let pong = plain.call(&redis::cmd("PING")).await.unwrap();
    assert_eq!(pong, redis::Value::SimpleString("PONG".into()));
    // BLPOP on an empty list answers nil after 1 s; give up on it after 100 ms.
    let mut blpop = redis::cmd("BLPOP");
    blpop.arg("nothing-here").arg(1);
    let gave_up = tokio::time::timeout(Duration::from_millis(100), plain.call(&blpop)).await;
    assert!(gave_up.is_err(), "BLPOP answered early: {gave_up:?}");
    // Wait past the BLPOP's answer: on the old connection it is now waiting to be read.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut echo = redis::cmd("ECHO");
    echo.arg("mine");
    let reply = plain.call(&echo).await.unwrap();
    assert_eq!(reply, redis::Value::BulkString(b"mine".to_vec()));
}

/// A Redis that requires a password, given none: a configuration error like a wrong password
/// (exit 78 with the reason, not retried), not "Redis is down" (retried for
/// `redis_connect_timeout`, then exit 69, which a service manager restarts in a loop). The
/// same for `status`.
#[test]
fn a_missing_password_is_a_config_error_not_an_outage() {
    let redis = RedisServer::start();
    let _authenticated = redis.require_password("s3cret");
    // Long enough that retrying it could not pass the bound below.
    let config = format!("redis_connect_timeout = \"600s\"\n{CONFIG}");
    let mut daemon = Daemon::builder(&redis).config(&config).start();
    let status = daemon
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("still retrying a missing password:\n{}", daemon.log()));
    let log = daemon.log();
    assert_eq!(status.code(), Some(78), "{log}");
    assert!(
        log.contains("requires a password and none was given"),
        "{log}"
    );
    assert!(log.contains("NOAUTH"), "{log}");
    assert!(!log.contains("retrying"), "{log}");
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .args(["--redis", &redis.url(), "--queues", "q", "status"])
        .env("NO_COLOR", "1")
        .output()
        .expect("run locketd status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("requires a password"), "{stderr}");
}
