//! Issue 29 item 5: a first run without a usable Redis says what to do. At the first attempt
//! that finds nothing at the URL, once: which URL, where it came from (`--redis`, `REDIS_URL`,
//! the config, the default) and the two ways out; a wrong password is not retried and exits
//! 78 with the reason. Run: `cargo test --test it first_run::`.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use crate::support::{Daemon, RedisServer};

/// A loopback TCP port bound by this test but not listening: a connection to it is refused,
/// and no other test's server can take the port while the descriptor lives (a port freed by a
/// stopped server can be).
struct ClosedPort {
    _fd: OwnedFd,
    port: u16,
}

fn closed_port() -> ClosedPort {
    // SAFETY: plain socket calls on a descriptor this function owns; `addr` and `len` are
    // valid for the calls that read or write them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let owned = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let rc = libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len);
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let mut got: libc::sockaddr_in = std::mem::zeroed();
        let mut got_len = len;
        let rc = libc::getsockname(fd, &mut got as *mut _ as *mut libc::sockaddr, &mut got_len);
        assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
        ClosedPort {
            _fd: owned,
            port: u16::from_be(got.sin_port),
        }
    }
}

const CONFIG: &str = "queues = \"q\"\nredis_connect_timeout = \"3s\"\n";

/// How many times `needle` is in `text`.
fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

/// Runs a daemon that finds no Redis and returns its log, after asserting it exits 69.
fn log_of_a_run_without_redis(
    build: impl FnOnce(crate::support::DaemonBuilder) -> crate::support::DaemonBuilder,
) -> String {
    // Only for the builder: the daemon is pointed elsewhere.
    let redis = RedisServer::start();
    let builder = Daemon::builder(&redis)
        .env_remove("REDIS_URL")
        .env_remove("QUEUES");
    let mut d = build(builder).start();
    let status = d
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("still running without redis:\n{}", d.log()));
    assert_eq!(status.code(), Some(69), "{}", d.log());
    d.log()
}

/// Asserts the one-time hint: the URL, its origin, both ways out; said once however many
/// times the connection is retried.
fn assert_hint(log: &str, url: &str, origin: &str) {
    let hint = format!("no redis answers at {url} ({origin}): start one (redis-server");
    assert_eq!(count(log, &hint), 1, "want one {hint:?} in:\n{log}");
    assert_eq!(count(log, "no redis answers at"), 1, "{log}");
    assert!(
        log.contains("or point REDIS_URL or --redis at your Redis"),
        "{log}"
    );
    assert!(
        count(log, "redis not answering yet") >= 2,
        "the hint comes once, the retries go on: {log}"
    );
    // The final error names the origin too.
    assert!(
        log.contains(&format!(
            "redis at {url} ({origin}) did not answer within 3s"
        )),
        "{log}"
    );
}

#[test]
fn a_first_run_without_redis_names_the_url_its_origin_and_the_ways_out() {
    let closed = closed_port();
    let url = format!("redis://127.0.0.1:{}/0", closed.port);

    let log = log_of_a_run_without_redis(|b| b.config(CONFIG).redis_url(&url));
    assert_hint(&log, &url, "given by --redis");

    let log =
        log_of_a_run_without_redis(|b| b.config(CONFIG).no_redis_arg().env("REDIS_URL", &url));
    assert_hint(&log, &url, "given by REDIS_URL");

    let mut path = None;
    let log = log_of_a_run_without_redis(|b| {
        path = Some(b.config_path());
        b.config(&format!("{CONFIG}redis = \"{url}\"\n"))
            .no_redis_arg()
    });
    let path = path.unwrap();
    assert_hint(&log, &url, &format!("set by `redis` in {}", path.display()));
}

#[test]
fn a_wrong_password_exits_78_at_once_with_the_reason() {
    let redis = RedisServer::start();
    // The test's own connection was opened before the password, so it stays authenticated.
    let mut conn = redis.require_password("s3cret");
    let url = format!("redis://:wrong@127.0.0.1:{}/0", redis.port());
    let mut d = Daemon::builder(&redis)
        .config("queues = \"q\"\nredis_connect_timeout = \"30s\"\n")
        .no_redis_arg()
        .env("REDIS_URL", &url)
        .start();
    // Not retried for redis_connect_timeout (30 s): at once.
    let status = d
        .wait_exit(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("a wrong password was retried:\n{}", d.log()));
    let log = d.log();
    assert_eq!(status.code(), Some(78), "{log}");
    let want = format!(
        "redis at redis://:***@127.0.0.1:{}/0 (given by REDIS_URL) refused the connection",
        redis.port()
    );
    assert!(log.contains(&want), "want {want:?} in:\n{log}");
    // The reason.
    assert!(log.contains("Password authentication failed"), "{log}");
    assert_eq!(count(&log, "redis not answering yet"), 0, "{log}");
    assert!(!log.contains("wrong@"), "the password was logged: {log}");
    // Nothing was started or written.
    assert!(!log.contains("worker started"), "{log}");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

// The operator commands answer a wrong password the same way: 78 with the reason, at once.
#[test]
fn status_and_admin_commands_exit_78_on_a_wrong_password() {
    let redis = RedisServer::start();
    // The operator commands below connect with a wrong password.
    let _conn = redis.require_password("s3cret");
    let url = format!("redis://:wrong@127.0.0.1:{}/0", redis.port());
    for cmd in [&["status"][..], &["failed", "list"], &["locks"]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_locketd"))
            .args(["--config", "/dev/null", "--redis", &url, "--queues", "q"])
            .args(cmd)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{cmd:?}: {out:?}");
        assert!(
            err.contains("Password authentication failed"),
            "{cmd:?}: {err}"
        );
        assert!(
            !err.contains(":wrong@"),
            "{cmd:?}: the password was printed: {err}"
        );
    }
}
