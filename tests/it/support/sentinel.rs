//! A private Sentinel setup per test: one primary, one replica and three sentinels, all on
//! free loopback ports with their own temp dirs, all killed (SIGKILL) and reaped on drop.

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::redis_server::free_port;
use super::{read_lossy, tail, RedisServer};

/// The service name the sentinels monitor.
pub const SERVICE: &str = "mymaster";

/// How long the setup may take to be ready (sentinels finding each other and the replica).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// `$LOCKETD_REDIS_SENTINEL`, or `redis-sentinel` from PATH (Debian's `redis-sentinel`).
pub fn redis_sentinel_bin() -> String {
    std::env::var("LOCKETD_REDIS_SENTINEL")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "redis-sentinel".to_string())
}

/// One `redis-sentinel` process.
pub struct SentinelProcess {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
}

impl SentinelProcess {
    fn start(primary_port: u16, down_after_ms: u64) -> SentinelProcess {
        let dir = tempfile::Builder::new()
            .prefix("locketd-sentinel-")
            .tempdir()
            .expect("create sentinel temp dir");
        let mut s = SentinelProcess {
            child: None,
            port: 0,
            dir,
        };
        let mut last = String::new();
        for _ in 0..3 {
            s.port = free_port();
            let conf = s.dir.path().join("sentinel.conf");
            // Sentinel rewrites its config file: a fresh one at every start.
            fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
                     sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n\
                     sentinel failover-timeout {SERVICE} 10000\n\
                     sentinel parallel-syncs {SERVICE} 1\n",
                    port = s.port,
                    dir = s.dir.path().display(),
                    log = s.log_path().display(),
                ),
            )
            .expect("write sentinel.conf");
            let out = File::create(s.dir.path().join("sentinel.stdout")).expect("stdout file");
            let err = out.try_clone().expect("clone stdout file");
            let child = Command::new(redis_sentinel_bin())
                .arg(&conf)
                .current_dir(s.dir.path())
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "spawn {}: {e} (install redis-sentinel or set LOCKETD_REDIS_SENTINEL)",
                        redis_sentinel_bin()
                    )
                });
            s.child = Some(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(status) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                    s.child = None;
                    last = format!("exited with {status}: {}", tail(&s.log(), 10));
                    break;
                }
                if s.ping() {
                    return s;
                }
                if Instant::now() >= deadline {
                    last = format!("no PING answer: {}", tail(&s.log(), 10));
                    s.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-sentinel did not start: {last}");
    }

    fn ping(&self) -> bool {
        let Ok(mut c) = self.sync_conn() else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut c).is_ok()
    }

    /// A blocking connection to this sentinel.
    pub fn sync_conn(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port))?;
        let c = client.get_connection_with_timeout(Duration::from_millis(500))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(c)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn log(&self) -> String {
        read_lossy(&self.dir.path().join("sentinel.log"))
            + &read_lossy(&self.dir.path().join("sentinel.stdout"))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("sentinel.log")
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A primary, its replica and three sentinels (quorum 2) watching it as [`SERVICE`].
pub struct SentinelSetup {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<SentinelProcess>,
    pub down_after: Duration,
}

impl SentinelSetup {
    /// Starts everything and waits (bounded) until the replica is in sync and every sentinel
    /// knows the replica and the two other sentinels, so that a failover can happen.
    pub fn start(down_after: Duration) -> SentinelSetup {
        let primary = RedisServer::start();
        let port = primary.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let sentinels: Vec<_> = (0..3)
            .map(|_| SentinelProcess::start(primary.port(), down_after.as_millis() as u64))
            .collect();
        let setup = SentinelSetup {
            primary,
            replica,
            sentinels,
            down_after,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if setup.ready() {
                return setup;
            }
            if Instant::now() >= deadline {
                panic!(
                    "the sentinel setup was not ready within {READY_TIMEOUT:?}\n{}",
                    setup.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn ready(&self) -> bool {
        let Ok(mut r) = self.replica.client().get_connection() else {
            return false;
        };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut r)
            .unwrap_or_default();
        if !info.contains("master_link_status:up") {
            return false;
        }
        self.sentinels.iter().all(|s| {
            let Ok(mut c) = s.sync_conn() else {
                return false;
            };
            let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                .arg("replicas")
                .arg(SERVICE)
                .query(&mut c)
                .unwrap_or_default();
            let others: Vec<redis::Value> = redis::cmd("SENTINEL")
                .arg("sentinels")
                .arg(SERVICE)
                .query(&mut c)
                .unwrap_or_default();
            replicas.len() == 1 && others.len() == 2
        })
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster/0`
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{SERVICE}/0", hosts.join(","))
    }

    /// The port of the primary the first sentinel that answers names.
    pub fn named_primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let mut c = s.sync_conn().ok()?;
            let (_, port): (String, u16) = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(SERVICE)
                .query(&mut c)
                .ok()?;
            Some(port)
        })
    }

    /// The sentinels' logs, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for s in &self.sentinels {
            out.push_str(&format!(
                "--- sentinel {} ({}) ---\n{}\n",
                s.port(),
                s.log_path().display(),
                tail(&s.log(), 15)
            ));
        }
        out.push_str(&format!(
            "--- replica {} ---\n{}\n",
            self.replica.port(),
            tail(&self.replica.log(), 15)
        ));
        out
    }
}
