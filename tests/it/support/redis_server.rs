//! A private `redis-server` per test.

use std::fs::{self, File};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::{read_lossy, tail};

/// How long a (re)started server may take to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How many fresh ports `start_with` tries when the chosen one was taken.
const PORT_ATTEMPTS: usize = 3;
/// Timeouts of the connections handed to tests.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// A `redis-server` on a free 127.0.0.1 port with its own temp dir
/// (`--dir`, log file). Killed (SIGKILL) and reaped on drop; the dir is
/// removed with it.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    args: Vec<String>,
    dir: TempDir,
}

enum Outcome {
    Ready,
    /// Our process exited because its port was already bound.
    PortTaken,
    Failed(String),
}

impl RedisServer {
    /// Starts a server with the default arguments.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Starts a server; `extra` redis-server arguments come after the
    /// defaults, so they override them (e.g.
    /// `&["--appendonly", "yes", "--appendfsync", "always"]`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        super::panic_echo::install();
        super::calm_sigchld();
        let dir = tempfile::Builder::new()
            .prefix("locketd-redis-")
            .tempdir()
            .expect("create redis temp dir");
        let mut server = RedisServer {
            child: None,
            port: 0,
            args: extra.iter().map(|s| s.to_string()).collect(),
            dir,
        };
        let mut last = String::new();
        for attempt in 1..=PORT_ATTEMPTS {
            server.port = free_port();
            match server.spawn_and_wait() {
                Outcome::Ready => return server,
                Outcome::PortTaken => {
                    last = format!(
                        "attempt {attempt}: port {} was taken\n{}",
                        server.port,
                        tail(&server.log(), 20)
                    );
                    server.kill_and_reap();
                }
                Outcome::Failed(why) => {
                    let log = server.log();
                    server.kill_and_reap();
                    panic!(
                        "redis-server ({}) on port {} did not start: {why}\n--- log ---\n{log}",
                        redis_server_bin(),
                        server.port
                    );
                }
            }
        }
        panic!("redis-server could not get a free port in {PORT_ATTEMPTS} attempts; last: {last}");
    }

    /// The TCP port (stays the same across `stop`/`restart`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/0`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The server's `--dir` (AOF/RDB files, `redis.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Pid of the running server process, if it is running.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// True while the server process runs (not stopped, not crashed).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis client")
    }

    /// A multiplexed async connection (connect timeout 5 s, response
    /// timeout 30 s, so blocking commands of a few seconds work).
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        self.client()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap_or_else(|e| panic!("async connect to {}: {e}", self.url()))
    }

    /// Makes the server require `password` and returns a blocking connection opened before
    /// it did, which stays authenticated.
    pub fn require_password(&self, password: &str) -> redis::Connection {
        let mut conn = self.sync_conn();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg(password)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("CONFIG SET requirepass: {e}"));
        conn
    }

    /// A blocking connection (connect timeout 5 s, read/write timeout 30 s).
    pub fn sync_conn(&self) -> redis::Connection {
        super::calm_sigchld();
        let conn = self
            .client()
            .get_connection_with_timeout(CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()));
        conn.set_read_timeout(Some(RESPONSE_TIMEOUT))
            .expect("set read timeout");
        conn.set_write_timeout(Some(RESPONSE_TIMEOUT))
            .expect("set write timeout");
        conn
    }

    /// Kills the server (SIGKILL) and reaps it; keeps port, args and dir so
    /// that [`restart`](Self::restart) can bring the same data back (use
    /// `--appendonly yes --appendfsync always` for nothing to be lost).
    pub fn stop(&mut self) {
        self.kill_and_reap();
    }

    /// Starts the server again on the same port, with the same args and
    /// dir (stopping it first if it still runs); waits up to 10 s for PING.
    pub fn restart(&mut self) {
        self.kill_and_reap();
        match self.spawn_and_wait() {
            Outcome::Ready => {}
            Outcome::PortTaken => {
                let log = self.log();
                self.kill_and_reap();
                panic!(
                    "redis-server restart: port {} was taken meanwhile\n--- log ---\n{log}",
                    self.port
                );
            }
            Outcome::Failed(why) => {
                let log = self.log();
                self.kill_and_reap();
                panic!(
                    "redis-server restart on port {} failed: {why}\n--- log ---\n{log}",
                    self.port
                );
            }
        }
    }

    /// The server's log file plus anything it printed on stdout/stderr.
    pub fn log(&self) -> String {
        let mut log = read_lossy(&self.log_path());
        let out = read_lossy(&self.stdio_path());
        if !out.trim().is_empty() {
            log.push_str("\n--- stdout/stderr ---\n");
            log.push_str(&out);
        }
        log
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn stdio_path(&self) -> PathBuf {
        self.dir.path().join("redis.stdout")
    }

    fn spawn_and_wait(&mut self) -> Outcome {
        let stdio = match File::options()
            .create(true)
            .append(true)
            .open(self.stdio_path())
        {
            Ok(f) => f,
            Err(e) => return Outcome::Failed(format!("open stdout file: {e}")),
        };
        let stderr = match stdio.try_clone() {
            Ok(f) => f,
            Err(e) => return Outcome::Failed(format!("clone stdout file: {e}")),
        };
        // Only complaints from *this* start decide whether the port was taken.
        let log_offset = fs::metadata(self.log_path()).map(|m| m.len()).unwrap_or(0);
        let dir = self
            .dir
            .path()
            .to_str()
            .expect("utf-8 temp dir")
            .to_string();
        let logfile = self.log_path().to_str().expect("utf-8 path").to_string();
        let port = self.port.to_string();
        let mut cmd = Command::new(redis_server_bin());
        cmd.args(["--port", &port, "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--dir", &dir, "--logfile", &logfile])
            .args(&self.args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(stdio)
            .stderr(stderr);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                return Outcome::Failed(format!(
                    "spawn {:?}: {e} (set LOCKETD_REDIS_SERVER or install redis-server)",
                    redis_server_bin()
                ))
            }
        };
        let pid = child.id();
        self.child = Some(child);

        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let fresh = read_lossy(&self.log_path())
                    .get(log_offset as usize..)
                    .unwrap_or_default()
                    .to_string()
                    + &read_lossy(&self.stdio_path());
                if fresh.contains("Address already in use") {
                    return Outcome::PortTaken;
                }
                return Outcome::Failed(format!("exited early with {status}"));
            }
            match self.probe() {
                Ok(server_pid) if server_pid == pid => return Outcome::Ready,
                // Someone else's server answers on "our" port; ours will
                // fail to bind (or already has).
                Ok(_) => {}
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                return Outcome::Failed(format!("no PING answer within {READY_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// PINGs the port and returns the answering server's process id.
    fn probe(&self) -> redis::RedisResult<u32> {
        let client = self.client();
        let mut conn = client.get_connection_with_timeout(Duration::from_millis(500))?;
        conn.set_read_timeout(Some(Duration::from_secs(1)))?;
        conn.set_write_timeout(Some(Duration::from_secs(1)))?;
        let pong: String = redis::cmd("PING").query(&mut conn)?;
        if pong != "PONG" {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "unexpected PING reply",
                pong,
            )));
        }
        let info: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Client, "no process_id in INFO"))
            })
    }

    fn kill_and_reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- redis-server on port {} (last lines of its log) ---\n{}",
                self.port,
                tail(&self.log(), 30)
            );
            if let Some(msg) = super::panic_echo::message() {
                eprintln!("--- the test failed: {msg} ---");
            }
        }
        self.kill_and_reap();
    }
}

/// `$LOCKETD_REDIS_SERVER`, or `redis-server` from PATH.
pub fn redis_server_bin() -> String {
    std::env::var("LOCKETD_REDIS_SERVER")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "redis-server".to_string())
}

/// A port that was free a moment ago (bind 127.0.0.1:0, read, drop).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}
