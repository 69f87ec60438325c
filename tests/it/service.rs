//! The service side of the real binary: sd_notify (READY, STATUS, WATCHDOG, STOPPING) read from
//! a socket the test binds, Prometheus `/metrics`, and the metrics reporter pipe a master reads.
//! Run: `cargo test --test it service::`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::daemon::{cfg, NS, R};
use crate::support::{wait_until, write_script, Daemon, RedisServer};

const SHORT: Duration = Duration::from_secs(10);

/// The service manager's end of NOTIFY_SOCKET: every datagram received, in order.
struct NotifySocket {
    sock: UnixDatagram,
    seen: Vec<String>,
}

impl NotifySocket {
    fn bind(path: &Path) -> NotifySocket {
        let sock = UnixDatagram::bind(path).expect("bind notify socket");
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        NotifySocket {
            sock,
            seen: Vec::new(),
        }
    }

    /// Receives until a message satisfies `pred` (bounded); returns it.
    fn wait_for(&mut self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.seen.push(msg.clone());
                if pred(&msg) {
                    return msg;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {timeout:?}; got {:?}",
                self.seen
            );
        }
    }

    /// Every message received during `d`.
    fn collect(&mut self, d: Duration) -> Vec<String> {
        let end = Instant::now() + d;
        let mut buf = [0u8; 4096];
        let mut out = Vec::new();
        while Instant::now() < end {
            if let Ok(n) = self.sock.recv(&mut buf) {
                out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        self.seen.extend(out.clone());
        out
    }
}

#[test]
fn notify_ready_after_registration_watchdog_while_healthy_stopping_on_quit() {
    let mut redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let sock_path = builder.dir().join("notify.sock");
    let mut notify = NotifySocket::bind(&sock_path);
    let job = write_script(builder.dir(), "job.sh", "sleep 2\n");
    let config = cfg("q").class("Work", &job, "").render();
    let mut daemon = builder
        .config(&config)
        .env("NOTIFY_SOCKET", &sock_path)
        .env("WATCHDOG_USEC", "400000")
        .start();

    let ready = notify.wait_for("READY=1", SHORT, |m| m.lines().any(|l| l == "READY=1"));
    // READY comes after registration: the worker is already visible to Resque.
    let pid = daemon.worker_pid().to_string();
    assert!(
        r.workers()
            .iter()
            .any(|w| w.split(':').nth(1) == Some(pid.as_str())),
        "READY before registration: {:?}",
        r.workers()
    );
    assert!(ready.contains("STATUS=0 busy, 1 idle"), "{ready}");
    assert!(
        !notify.seen[..notify.seen.len() - 1]
            .iter()
            .any(|m| m.contains("WATCHDOG")),
        "nothing before READY: {:?}",
        notify.seen
    );

    // Pings at half the interval while healthy.
    let msgs = notify.collect(Duration::from_millis(1000));
    let pings = msgs.iter().filter(|m| *m == "WATCHDOG=1").count();
    assert!(pings >= 3, "expected ~5 pings in 1s, got {msgs:?}");

    // STATUS follows the work.
    r.push("q", r#"{"class":"Work","args":[1]}"#);
    notify.wait_for("busy status", SHORT, |m| {
        m.starts_with("STATUS=1 busy, 0 idle")
    });
    notify.wait_for("done status", SHORT, |m| {
        m == "STATUS=0 busy, 1 idle; 1 jobs done, 0 failed"
    });

    // No ping while Redis is away; pings again once it is back.
    redis.stop();
    notify.collect(Duration::from_millis(2500));
    let quiet = notify.collect(Duration::from_millis(1500));
    assert!(
        !quiet.iter().any(|m| m == "WATCHDOG=1"),
        "pinged while Redis was down: {quiet:?}"
    );
    redis.restart();
    notify.wait_for("WATCHDOG=1 after Redis came back", SHORT, |m| {
        m == "WATCHDOG=1"
    });

    daemon.signal(libc::SIGQUIT);
    notify.wait_for("STOPPING=1", SHORT, |m| m == "STOPPING=1");
    let status = daemon.wait_exit(SHORT).expect("daemon exits after QUIT");
    assert!(status.success(), "{status:?}");
}

#[test]
fn notify_reaches_an_abstract_socket() {
    let redis = RedisServer::start();
    let name = format!("locketd-it-{}-{}", std::process::id(), line!());
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            name.as_bytes(),
        )
        .unwrap();
    let sock = UnixDatagram::bind_addr(&addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut notify = NotifySocket {
        sock,
        seen: Vec::new(),
    };
    let mut daemon = Daemon::builder(&redis)
        .config(&cfg("q").render())
        .env("NOTIFY_SOCKET", format!("@{name}"))
        .start();
    notify.wait_for("READY=1", SHORT, |m| m.starts_with("READY=1"));
    daemon.terminate(SHORT);
    notify.wait_for("STOPPING=1", SHORT, |m| m == "STOPPING=1");
}

/// `GET path` on `addr`; returns (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(SHORT)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("http response");
    (head.lines().next().unwrap().to_string(), body.to_string())
}

pub(crate) fn metrics_addr(daemon: &Daemon) -> String {
    daemon.wait_for_log("serving metrics", SHORT);
    let log = daemon.log();
    let line = log.lines().find(|l| l.contains("serving metrics")).unwrap();
    let at = line.find("addr=").expect("addr field") + 5;
    line[at..].split_whitespace().next().unwrap().to_string()
}

/// The value of the sample `name{labels}` (exact text before the value).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn metrics_endpoint_counts_the_jobs_that_ran() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let builder = Daemon::builder(&redis);
    let ok = write_script(builder.dir(), "ok.sh", "exit 0\n");
    let bad = write_script(builder.dir(), "bad.sh", "echo no >&2; exit 2\n");
    // Exit 75 (reschedule) once, then success: a requeue, not a failure.
    let again = write_script(
        builder.dir(),
        "again.sh",
        &format!(
            "if [ -e {0}/again-ran ]; then exit 0; fi\ntouch {0}/again-ran\nexit 75\n",
            builder.dir().display()
        ),
    );
    let config = cfg("q,other")
        .top("metrics = \"127.0.0.1:0\"")
        .class("Good", &ok, "")
        .class("Bad", &bad, "")
        .class("Again", &again, "")
        .render();
    let mut daemon = builder.config(&config).start();
    let addr = metrics_addr(&daemon);
    for i in 0..3 {
        r.push("q", &format!(r#"{{"class":"Good","args":[{i}]}}"#));
    }
    for i in 0..2 {
        r.push("q", &format!(r#"{{"class":"Bad","args":[{i}]}}"#));
    }
    r.push("q", r#"{"class":"Again","args":[]}"#);
    wait_until(SHORT, "all six jobs ran", || r.processed() == 6);
    // Work waiting in a queue the daemon does not reach yet is a gauge read at scrape time.
    let _: i64 = r.cmd(&["SADD", &format!("{NS}:queues"), "other"]);

    let good = r#"{queue="q",class="Good"}"#;
    let badl = r#"{queue="q",class="Bad"}"#;
    let againl = r#"{queue="q",class="Again"}"#;
    // Workers report to the master once a second: wait for the report after the last job.
    let (mut status, mut body) = (String::new(), String::new());
    wait_until(SHORT, "the master's metrics show the six jobs", || {
        (status, body) = http_get(&addr, "/metrics");
        sample(&body, &format!("locketd_jobs_succeeded_total{good}")) == Some(3.0)
            && sample(&body, &format!("locketd_jobs_failed_total{badl}")) == Some(2.0)
            && sample(&body, &format!("locketd_jobs_succeeded_total{againl}")) == Some(1.0)
    });
    // A reschedule (exit 75) is a requeue, as `stat:failed` and the failed list say.
    assert_eq!(
        sample(&body, &format!("locketd_jobs_requeued_total{againl}")),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, &format!("locketd_jobs_failed_total{againl}")),
        Some(0.0),
        "{body}"
    );
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        sample(&body, &format!("locketd_jobs_succeeded_total{good}")),
        Some(3.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, &format!("locketd_jobs_started_total{good}")),
        Some(3.0)
    );
    assert_eq!(
        sample(&body, &format!("locketd_jobs_failed_total{badl}")),
        Some(2.0)
    );
    assert_eq!(
        sample(&body, &format!("locketd_jobs_succeeded_total{badl}")),
        Some(0.0)
    );
    assert_eq!(
        sample(&body, &format!("locketd_job_duration_seconds_count{good}")),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &body,
            r#"locketd_job_duration_seconds_bucket{le="+Inf",queue="q",class="Bad"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(&body, r#"locketd_queue_length{queue="q"}"#),
        Some(0.0)
    );
    assert_eq!(sample(&body, r#"locketd_workers{state="idle"}"#), Some(1.0));
    assert_eq!(sample(&body, r#"locketd_workers{state="busy"}"#), Some(0.0));
    assert_eq!(sample(&body, "locketd_resque_processed"), Some(6.0));
    assert_eq!(sample(&body, "locketd_resque_failed"), Some(2.0));
    assert_eq!(sample(&body, "locketd_failures_listed"), Some(2.0));
    assert_eq!(sample(&body, "locketd_redis_up"), Some(1.0));
    assert_eq!(
        sample(&body, r#"locketd_lock_conflicts_total{action="requeue"}"#),
        Some(0.0)
    );
    assert!(body.trim_end().ends_with("# EOF"), "{body}");

    let (status, _) = http_get(&addr, "/nope");
    assert!(status.contains("404"), "{status}");
    daemon.terminate(SHORT);
}

#[test]
fn metrics_flag_is_checked_and_overrides_the_file() {
    let redis = RedisServer::start();
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .args([
            "--redis",
            &redis.url(),
            "--queues",
            "q",
            "--metrics",
            "nonsense",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics"));
    let mut daemon = Daemon::builder(&redis)
        .config(&cfg("q").top("metrics = \"bad\"").render())
        .args(["--metrics", "127.0.0.1:0"])
        .start();
    let addr = metrics_addr(&daemon);
    let (status, body) = http_get(&addr, "/metrics");
    assert!(
        status.contains("200") && body.contains("locketd_redis_up 1"),
        "{body}"
    );
    daemon.terminate(SHORT);

    // An address that cannot be bound: exit 78, and the worker does not stay registered.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let mut daemon = Daemon::builder(&redis)
        .config(&cfg("q").render())
        .args(["--metrics", taken_addr.as_str()])
        .start();
    let status = daemon
        .wait_exit(SHORT)
        .expect("exits when the port is taken");
    assert_eq!(status.code(), Some(78), "{}", daemon.log());
    assert!(
        daemon.log().contains("cannot listen on"),
        "{}",
        daemon.log()
    );
    assert!(R::new(&redis).workers().is_empty());
}

/// The body of `GET /metrics` on `addr`, or `None` when nothing serves there.
pub(crate) fn scrape(addr: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(SHORT)).ok()?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    Some(resp.split_once("\r\n\r\n")?.1.to_string())
}

fn queue_gauge(body: &str, queue: &str) -> Option<f64> {
    sample(body, &format!("locketd_queue_length{{queue=\"{queue}\"}}"))
}

// A HUP reloads the side-cars with the config: /metrics reads the new queues at once (same
// address, same socket), moves to a new address (the old one closes), and a config whose
// address cannot be bound is refused as a whole: workers and endpoint stay as they were.
#[test]
fn hup_moves_metrics_with_the_config_and_refuses_an_address_it_cannot_bind() {
    let redis = RedisServer::start();
    let config =
        |queues: &str, listen: &str| cfg(queues).top(&format!("metrics = \"{listen}\"")).render();
    let d = Daemon::start(&redis, &config("a", "127.0.0.1:0"), &[]);
    let first = metrics_addr(&d);
    let body = scrape(&first).expect("metrics served");
    assert_eq!(queue_gauge(&body, "a"), Some(0.0), "{body}");
    assert_eq!(queue_gauge(&body, "b"), None, "{body}");

    std::fs::write(d.config_path(), config("b", "127.0.0.1:0")).unwrap();
    d.signal(libc::SIGHUP);
    wait_until(SHORT, "the same endpoint reports queue b, not a", || {
        scrape(&first)
            .is_some_and(|b| queue_gauge(&b, "b") == Some(0.0) && queue_gauge(&b, "a").is_none())
    });

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let second = format!("127.0.0.1:{port}");
    let before = d.worker_pids();
    std::fs::write(d.config_path(), config("b", &second)).unwrap();
    d.signal(libc::SIGHUP);
    wait_until(SHORT, "metrics served on the new address", || {
        scrape(&second).is_some_and(|b| queue_gauge(&b, "b") == Some(0.0))
    });
    wait_until(SHORT, "the old address closed", || {
        TcpStream::connect(&first).is_err()
    });

    // A good HUP replaces the workers: wait until only the new one is left, or the set read
    // below could still hold an old worker that exits later.
    let mut workers = Vec::new();
    wait_until(SHORT, "the old worker replaced", || {
        workers = d.worker_pids();
        workers.len() == 1 && !before.contains(&workers[0])
    });
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    std::fs::write(d.config_path(), config("c", &taken_addr)).unwrap();
    d.signal(libc::SIGHUP);
    d.wait_for_log("HUP: the new config is refused", SHORT);
    let log = d.log();
    let refused = log
        .lines()
        .find(|l| l.contains("HUP: the new config is refused"))
        .unwrap();
    assert!(refused.contains("cannot listen on"), "{refused}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(d.worker_pids(), workers, "the workers were replaced");
    let body = scrape(&second).expect("the endpoint stayed");
    assert_eq!(queue_gauge(&body, "b"), Some(0.0), "{body}");
    assert_eq!(queue_gauge(&body, "c"), None, "{body}");
    drop(taken);
}

/// Kills the process group of a child on drop.
struct Group(std::process::Child);
impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our child's process group.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

#[test]
fn worker_reports_snapshots_on_locketd_metrics_fd() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = tempfile::tempdir().unwrap();
    let ok = write_script(dir.path(), "ok.sh", "exit 0\n");
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, cfg("q").class("Good", &ok, "").render()).unwrap();
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) with a valid two-int array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (rd, wr) = (fds[0], fds[1]);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_locketd"));
    // A worker process as the master starts it: config text on stdin, the pipe on fd 3.
    cmd.args(["--redis", &redis.url()])
        .env("LOCKETD_ROLE", "worker")
        .env("LOCKETD_METRICS_FD", "3")
        .env("RUST_LOG", "locketd=debug")
        .stdin(std::fs::File::open(&conf).unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(wr, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(rd);
            Ok(())
        });
    }
    let child = Group(cmd.spawn().unwrap());
    // SAFETY: closing our copy of the write end, so EOF comes when the worker exits.
    unsafe { libc::close(wr) };
    // SAFETY: we own the read end.
    let reader = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(rd) };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    for i in 0..4 {
        r.push("q", &format!(r#"{{"class":"Good","args":[{i}]}}"#));
    }
    wait_until(SHORT, "jobs ran", || r.processed() == 4);
    let mut lines = Vec::new();
    let deadline = Instant::now() + SHORT;
    let counted = |l: &str| {
        serde_json::from_str::<locketd::metrics::Snapshot>(l)
            .ok()
            .and_then(|s| s.jobs.first().map(|j| j.succeeded))
    };
    while lines.last().and_then(|l: &String| counted(l)) != Some(4) {
        assert!(
            Instant::now() < deadline,
            "no snapshot with 4 jobs: {lines:?}"
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            lines.push(l);
        }
    }
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGQUIT) };
    // EOF once the worker is gone: the master's reader would mark it exited, keeping its totals.
    let deadline = Instant::now() + SHORT;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => lines.push(l),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(_) => assert!(Instant::now() < deadline, "no EOF after QUIT"),
        }
    }
    let mut agg = locketd::metrics::Aggregate::default();
    for l in &lines {
        agg.update(serde_json::from_str(l).unwrap());
    }
    agg.worker_exited(child.0.id());
    let merged = agg.merged();
    assert_eq!(merged.jobs[0].succeeded, 4);
    assert_eq!(merged.busy, 0);
    assert!(
        lines.len() >= 2,
        "one line per second plus a final one: {lines:?}"
    );
}

#[test]
fn metrics_count_lock_conflicts_and_queue_skips() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let holder_b = Daemon::builder(&redis);
    // The holder keeps its lock until `holder.kill()` at the end, however slow the machine.
    let slow = write_script(holder_b.dir(), "slow.sh", "sleep 60\n");
    // The counter and the skip rule are the requeue policy's (park is the default).
    let config = cfg("q")
        .class("Sync", &slow, "on_conflict = \"requeue\"")
        .render();
    let mut holder = holder_b.config(&config).start();
    r.push("q", r#"{"class":"Sync","args":[1]}"#);
    wait_until(SHORT, "the first job holds its lock", || {
        !r.keys(&format!("{NS}:locket:lock:*")).is_empty()
    });
    // Same class and args: the second daemon finds the lock held and requeues it.
    r.push("q", r#"{"class":"Sync","args":[1]}"#);
    let mut second = Daemon::builder(&redis)
        .config(
            &cfg("q")
                .top("metrics = \"127.0.0.1:0\"")
                // Workers report once a second: the counter must outlive the report.
                .locket("counter_ttl", "\"10s\"")
                .class("Sync", &slow, "on_conflict = \"requeue\"")
                .render(),
        )
        .start();
    let addr = metrics_addr(&second);
    let mut body = String::new();
    wait_until(SHORT, "a conflict and a skip are counted", || {
        body = http_get(&addr, "/metrics").1;
        sample(&body, r#"locketd_lock_conflicts_total{action="requeue"}"#).unwrap_or(0.0) >= 1.0
            && sample(&body, r#"locketd_queue_skips_total{queue="q"}"#).unwrap_or(0.0) >= 1.0
    });
    assert_eq!(sample(&body, "locketd_locks_held"), Some(1.0), "{body}");
    assert!(sample(&body, r#"locketd_queue_lock_counter{queue="q"}"#).unwrap() >= 1.0);
    second.terminate(SHORT);

    // P-3: a job of a wait class counts `wait` when it starts waiting, and then how its wait
    // ended (here discarded after wait_timeout).
    let mut third = Daemon::builder(&redis)
        .config(
            &cfg("w")
                .top("metrics = \"127.0.0.1:0\"")
                .class(
                    "Sync",
                    &slow,
                    "on_conflict = \"wait\"\nwait_timeout = \"300ms\"\nwait_then = \"discard\"",
                )
                .render(),
        )
        .start();
    let addr = metrics_addr(&third);
    r.push("w", r#"{"class":"Sync","args":[1]}"#);
    wait_until(SHORT, "the wait and its end are counted", || {
        body = http_get(&addr, "/metrics").1;
        sample(&body, r#"locketd_lock_conflicts_total{action="discard"}"#) == Some(1.0)
    });
    assert_eq!(
        sample(&body, r#"locketd_lock_conflicts_total{action="wait"}"#),
        Some(1.0),
        "{body}"
    );
    third.terminate(SHORT);
    holder.kill();
}

/// A daemon whose stderr is a pipe nobody reads any more (a dead log shipper, `| head`) still
/// stops cleanly on TERM: log lines it cannot write are dropped. Before, tracing reported the
/// failed write with eprintln!, which panicked on the same broken pipe: the master exited 101
/// and left its worker running unsupervised, ignoring TERM.
#[test]
fn a_daemon_whose_stderr_reader_is_gone_stops_cleanly_on_term() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("c.toml");
    std::fs::write(&conf, cfg("q").render()).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_locketd"));
    cmd.args(["--redis", &redis.url()])
        .arg("--config")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = Group(cmd.spawn().unwrap());
    // The reader goes away.
    drop(child.0.stderr.take());
    wait_until(SHORT, "a worker registered", || r.workers().len() == 1);
    // SAFETY: kill(2) of our child, the master.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let mut status = None;
    wait_until(SHORT, "the master exits", || {
        status = child.0.try_wait().unwrap();
        status.is_some()
    });
    assert_eq!(status.unwrap().code(), Some(0), "{status:?}");
    wait_until(SHORT, "the worker unregistered", || r.workers().is_empty());
}

/// The metrics endpoint holds at most 128 connections (past that the oldest idle one is
/// closed), and one that sends no request within 3 s gives its place back: idle clients cannot
/// use up the master's file descriptors (which it needs to restart workers).
#[test]
fn idle_metrics_connections_are_bounded_and_released() {
    let redis = RedisServer::start();
    let config = cfg("q").top("metrics = \"127.0.0.1:0\"").render();
    let d = Daemon::start(&redis, &config, &[]);
    let addr = metrics_addr(&d);
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
            .unwrap()
            .count()
    };
    let before = fds();
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = fds();
    assert!(
        during <= before + 128 + 8,
        "200 idle connections took {} descriptors",
        during - before
    );
    wait_until(SHORT, "the idle connections closed", || fds() <= before + 2);
    // Past the 3 s for a request, the idle ones are closed and a scrape is served again.
    wait_until(SHORT, "a scrape is served", || {
        TcpStream::connect(&addr).is_ok_and(|mut s| {
            s.set_read_timeout(Some(SHORT)).unwrap();
            let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n");
            let mut resp = String::new();
            let _ = s.read_to_string(&mut resp);
            resp.starts_with("HTTP/1.1 200")
        })
    });
    drop(idle);
}

/// One `GET /metrics` on a new connection, bounded by [`SHORT`]; its status line.
fn scrape_status(addr: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return "connect failed".into();
    };
    s.set_read_timeout(Some(SHORT)).unwrap();
    let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let resp = String::from_utf8_lossy(&resp);
    resp.lines().next().unwrap_or("nothing").to_string()
}

/// Issue 23 #5: one client holding 200 idle connections (some with half a request) cannot
/// keep /metrics from its scraper: a new connection is served at once, again and again while
/// the client opens more, because a full listener closes its oldest idle connection first.
#[test]
fn metrics_answer_while_200_idle_connections_are_held() {
    let redis = RedisServer::start();
    let config = cfg("q").top("metrics = \"127.0.0.1:0\"").render();
    let d = Daemon::start(&redis, &config, &[]);
    let addr = metrics_addr(&d);
    let open = |n: usize| -> Vec<TcpStream> {
        (0..n)
            .map(|i| {
                let mut s = TcpStream::connect(&addr).unwrap();
                if i % 2 == 0 {
                    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.");
                }
                s
            })
            .collect()
    };
    let mut held = open(200);
    for round in 0..3 {
        let status = scrape_status(&addr);
        assert!(
            status.starts_with("HTTP/1.1 200"),
            "round {round}: {status} with {} connections held",
            held.len()
        );
        held.extend(open(50));
    }
    drop(held);
}

/// Issue 23 #5: slow-loris clients that trickle their request a byte a second are cut off by
/// the header deadline (3 s) without a response, and take /metrics away from nobody while
/// they last.
#[test]
fn slow_loris_clients_are_cut_off_by_the_header_deadline() {
    let redis = RedisServer::start();
    let config = cfg("q").top("metrics = \"127.0.0.1:0\"").render();
    let d = Daemon::start(&redis, &config, &[]);
    let addr = metrics_addr(&d);
    let head = format!(
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(40)
    );
    let mut slow: Vec<Option<TcpStream>> = (0..40)
        .map(|_| {
            let s = TcpStream::connect(&addr).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            Some(s)
        })
        .collect();
    let start = Instant::now();
    let mut cut = Vec::new();
    let mut scrapes = Vec::new();
    for (sent, byte) in head.bytes().enumerate() {
        if slow.iter().all(Option::is_none) || start.elapsed() > Duration::from_secs(20) {
            break;
        }
        for slot in slow.iter_mut() {
            let Some(s) = slot else { continue };
            let mut buf = [0u8; 256];
            let gone = match s.read(&mut buf) {
                Ok(0) => true,
                Ok(n) => panic!("answered a request it never got: {:?}", &buf[..n]),
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            } || s.write_all(&[byte]).is_err();
            if gone {
                cut.push((sent, start.elapsed()));
                *slot = None;
            }
        }
        if sent == 1 {
            scrapes.push(scrape_status(&addr));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert_eq!(cut.len(), 40, "not every slow client was cut off: {cut:?}");
    assert!(
        cut.iter()
            .all(|(sent, t)| *sent < head.len() && *t < Duration::from_secs(10)),
        "{cut:?}"
    );
    assert!(
        scrapes.iter().all(|s| s.starts_with("HTTP/1.1 200")),
        "{scrapes:?}"
    );
}

/// A client that sends POST heads announcing a 60,000-byte body and never sends the body cannot
/// keep /metrics from its scraper: a connection still waiting on its body is not being
/// answered, so a full listener closes it (the oldest first) before the scraper's fresh one.
/// Before, a connection counted as busy from its head on, and once the listener was full of
/// such heads the scraper's connection, not yet past its own head, was the only one the pool
/// could close: the next connection of the client closed it, and the scrape got no reply.
#[test]
fn metrics_answer_while_heads_hold_back_their_bodies() {
    let redis = RedisServer::start();
    let config = cfg("q").top("metrics = \"127.0.0.1:0\"").render();
    let d = Daemon::start(&redis, &config, &[]);
    let addr = metrics_addr(&d);
    let head = format!(
        "POST /api/locks/release HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 60000\r\n\r\n"
    );
    let hold = |n: usize| -> Vec<TcpStream> {
        (0..n)
            .filter_map(|_| {
                let mut s = TcpStream::connect(&addr).ok()?;
                s.write_all(head.as_bytes()).ok()?;
                Some(s)
            })
            .collect()
    };
    let mut statuses = Vec::new();
    for _ in 0..5 {
        // More heads than the listener holds (128), each waiting on its body for up to 3 s.
        let mut held = hold(140);
        // A moment for the listener to read those heads (this only sets the scene the old
        // listener failed in; the outcome asserted does not depend on it).
        std::thread::sleep(Duration::from_millis(500));
        // The scraper connects; before its head is in, the client opens 10 more.
        let mut scraper = TcpStream::connect(&addr).unwrap();
        scraper.set_read_timeout(Some(SHORT)).unwrap();
        held.extend(hold(10));
        let _ = write!(scraper, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        let mut resp = Vec::new();
        let _ = scraper.read_to_end(&mut resp);
        let resp = String::from_utf8_lossy(&resp);
        statuses.push(resp.lines().next().unwrap_or("nothing").to_string());
        drop(held);
    }
    assert!(
        statuses.iter().all(|s| s.starts_with("HTTP/1.1 200")),
        "scrapes while heads held back their bodies: {statuses:?}"
    );
    // And a scrape with no one holding anything.
    assert!(scrape_status(&addr).starts_with("HTTP/1.1 200"));
}
