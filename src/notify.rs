//! systemd's notify protocol (`sd_notify(3)`), without libsystemd: datagrams to the Unix socket
//! named by `NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace).
//!
//! [`supervise`] is the whole service-manager side of the daemon: `READY=1` (call it once Redis
//! answered and the workers are registered), `STATUS=` lines when they change, `WATCHDOG=1` at
//! half the watchdog interval while the health check passes, and `STOPPING=1` when the stop
//! token fires. Without `NOTIFY_SOCKET` every call is a no-op.

use std::future::Future;
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A handle on the service manager's notification socket.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    target: Option<String>,
    watchdog: Option<Duration>,
}

fn parse_watchdog(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    if let Some(p) = pid {
        if p.trim().parse::<u32>().ok()? != own_pid {
            return None;
        }
    }
    let us: u64 = usec?.trim().parse().ok()?;
    (us > 0).then(|| Duration::from_micros(us))
}

impl Notifier {
    /// From `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` (the watchdog is ours only if
    /// `WATCHDOG_PID` is unset or is our pid). The variables are left in place; command handlers
    /// do not get them (see `handler`).
    pub fn from_env() -> Notifier {
        let target = std::env::var("NOTIFY_SOCKET")
            .ok()
            .filter(|s| !s.is_empty());
        let watchdog = parse_watchdog(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        );
        Notifier { target, watchdog }
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// `WatchdogSec=` as given to us, when the watchdog is on and ours.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    fn address(target: &str) -> io::Result<SocketAddr> {
        if let Some(name) = target.strip_prefix('@') {
            #[cfg(target_os = "linux")]
            {
                use std::os::linux::net::SocketAddrExt;
                return SocketAddr::from_abstract_name(name.as_bytes());
            }
            #[cfg(not(target_os = "linux"))]
            {
                let _ = name;
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "abstract sockets need Linux",
                ));
            }
        }
        SocketAddr::from_pathname(target)
    }

    /// Sends raw `KEY=VALUE` lines. Ok(false) when there is no socket.
    pub fn send(&self, message: &str) -> io::Result<bool> {
        let Some(target) = &self.target else {
            return Ok(false);
        };
        let addr = Self::address(target)?;
        let sock = UnixDatagram::unbound()?;
        sock.send_to_addr(message.as_bytes(), &addr)?;
        Ok(true)
    }

    fn send_logged(&self, message: &str) {
        match self.send(message) {
            Ok(true) => debug!(message = %message.replace('\n', " "), "sd_notify"),
            Ok(false) => {}
            Err(e) => warn!(error = %e, "sd_notify failed"),
        }
    }

    /// `READY=1`.
    pub fn ready(&self) {
        self.send_logged("READY=1");
    }

    /// `STATUS=<text>` (one line).
    pub fn status(&self, text: &str) {
        self.send_logged(&format!("STATUS={}", text.replace('\n', " ")));
    }

    /// `STOPPING=1`.
    pub fn stopping(&self) {
        self.send_logged("STOPPING=1");
    }

    /// `WATCHDOG=1`.
    pub fn watchdog(&self) {
        self.send_logged("WATCHDOG=1");
    }
}

/// Runs the notify side of a service until `done` fires: sends `READY=1` and the first status
/// at once, then `STATUS=` every second when `status()` changed, `WATCHDOG=1` every half
/// watchdog interval when `healthy().await` is true, and `STOPPING=1` once `stopping` fires
/// (the watchdog keeps going while the workers finish their jobs).
pub async fn supervise<H, F, S>(
    notifier: Notifier,
    stopping: CancellationToken,
    done: CancellationToken,
    mut healthy: H,
    mut status: S,
) where
    H: FnMut() -> F,
    F: Future<Output = bool>,
    S: FnMut() -> String,
{
    if !notifier.enabled() {
        done.cancelled().await;
        return;
    }
    let mut last = status();
    notifier.send_logged(&format!("READY=1\nSTATUS={last}"));
    let mut status_tick = tokio::time::interval(Duration::from_secs(1));
    status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let dog_every = notifier
        .watchdog_interval()
        .map(|d| (d / 2).max(Duration::from_millis(10)))
        .unwrap_or(Duration::from_secs(86400 * 365));
    let mut dog_tick = tokio::time::interval(dog_every);
    // A slow health check must not be followed by a burst of pings.
    dog_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopped = false;
    loop {
        tokio::select! {
            // A stop is announced before anything else, and even when the daemon is done at
            // once (no worker was running): the service manager must see STOPPING=1.
            biased;
            _ = stopping.cancelled(), if !stopped => {
                stopped = true;
                notifier.stopping();
                notifier.status("stopping: waiting for running jobs");
            }
            _ = done.cancelled() => return,
            _ = status_tick.tick(), if !stopped => {
                let now = status();
                if now != last {
                    notifier.status(&now);
                    last = now;
                }
            }
            _ = dog_tick.tick(), if notifier.watchdog_interval().is_some() => {
                // A health check against an unreachable Redis takes up to 2 s; a stop does not
                // wait for it.
                let ok = tokio::select! {
                    ok = healthy() => ok,
                    _ = stopping.cancelled(), if !stopped => continue,
                    _ = done.cancelled() => continue,
                };
                if ok {
                    notifier.watchdog();
                } else {
                    warn!("health check failed: withholding the watchdog ping");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_is_ours_only_for_our_pid() {
        assert_eq!(
            parse_watchdog(Some("4000000"), None, 7),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            parse_watchdog(Some("4000000"), Some("7"), 7),
            Some(Duration::from_secs(4))
        );
        assert_eq!(parse_watchdog(Some("4000000"), Some("8"), 7), None);
        assert_eq!(parse_watchdog(Some("0"), None, 7), None);
        assert_eq!(parse_watchdog(None, None, 7), None);
    }

    #[test]
    fn datagrams_reach_path_and_abstract_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        let n = Notifier {
            target: Some(path.display().to_string()),
            watchdog: None,
        };
        n.ready();
        let mut buf = [0u8; 256];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1");

        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            let name = format!("locketd-test-{}", std::process::id());
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let rx = UnixDatagram::bind_addr(&addr).unwrap();
            let n = Notifier {
                target: Some(format!("@{name}")),
                watchdog: None,
            };
            n.status("idle");
            let len = rx.recv(&mut buf).unwrap();
            assert_eq!(&buf[..len], b"STATUS=idle");
        }
        assert!(!Notifier::default().send("READY=1").unwrap());
    }

    // A daemon with no running job is done the moment it is told to stop: STOPPING=1 must
    // still go out, even while a health check hangs on an unreachable Redis.
    #[tokio::test]
    async fn a_stop_and_done_at_once_still_announce_stopping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let n = Notifier {
            target: Some(path.display().to_string()),
            watchdog: Some(Duration::from_millis(20)),
        };
        let (stopping, done) = (CancellationToken::new(), CancellationToken::new());
        let task = tokio::spawn(supervise(
            n,
            stopping.clone(),
            done.clone(),
            // A health check that never answers.
            futures::future::pending::<bool>,
            || "idle".to_string(),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        stopping.cancel();
        done.cancel();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("supervise returns once done")
            .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(len) = rx.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..len]).into_owned();
            let last = m == "STOPPING=1";
            seen.push(m);
            if last {
                break;
            }
        }
        assert_eq!(seen.first().map(|m| &m[..7]), Some("READY=1"), "{seen:?}");
        assert_eq!(
            seen.last().map(String::as_str),
            Some("STOPPING=1"),
            "{seen:?}"
        );
    }
}
