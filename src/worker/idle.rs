//! Waiting for work without polling: when a pass reserved nothing, one slot per process blocks
//! on `BLMOVE q q RIGHT RIGHT <interval>` for the highest-priority queue that was empty. It
//! returns as soon as a job is pushed there and moves the tail element onto the tail of the same
//! list, so the queue is left exactly as it was: nothing is taken, nothing lives only in memory,
//! and the real reservation is still the RESERVE script. An idle worker then costs Redis one
//! command per `interval` instead of a poll loop, and picks a new job up within milliseconds.
//!
//! Jobs pushed to other (lower) queues are found at the next pass, at most `interval` later,
//! as Resque's polling would. The other slots of the process wait on the waiter's wake-up.
//! A server without BLMOVE (Redis < 6.2) or one that refuses it falls back to sleeping.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, Notify};
use tracing::debug;

/// Shared by the slots of one worker process.
#[derive(Debug, Default)]
pub(super) struct Idle {
    /// The blocking connection (blocking commands must not share the multiplexed one).
    blocker: Mutex<Option<redis::aio::MultiplexedConnection>>,
    /// Wakes the slots waiting beside the blocker.
    wake: Notify,
    /// BLMOVE failed with an error that will not go away.
    unsupported: AtomicBool,
}

impl Idle {
    /// Waits up to `interval` for a push to `queue_key` (or the interval, or `stop`).
    pub(super) async fn wait<F>(
        &self,
        url: &str,
        queue_key: Option<&str>,
        interval: Duration,
        stop: F,
    ) where
        F: std::future::Future<Output = ()>,
    {
        tokio::pin!(stop);
        let Some(key) = queue_key.filter(|_| !self.unsupported.load(Ordering::Relaxed)) else {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = &mut stop => {}
            }
            return;
        };
        let Ok(mut guard) = self.blocker.try_lock() else {
            // Another slot blocks for the process: wait for its wake-up.
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(interval) => {}
                _ = &mut stop => {}
            }
            return;
        };
        if guard.is_none() {
            *guard = connect(url, interval).await;
        }
        let Some(conn) = guard.as_mut() else {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = &mut stop => {}
            }
            return;
        };
        // BLMOVE's timeout is in seconds (a double since Redis 6.0); 0 would block forever.
        let secs = interval.as_secs_f64().max(0.01);
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(key).arg(key).arg("RIGHT").arg("RIGHT").arg(secs);
        let blmove = cmd.query_async::<Option<redis::Value>>(conn);
        tokio::select! {
            r = blmove => match r {
                Ok(Some(_)) => self.wake.notify_waiters(),
                Ok(None) => {}
                Err(e) => {
                    if matches!(e.kind(), redis::ErrorKind::Server(_)) {
                        debug!(error = %e, "BLMOVE refused; idle slots poll every interval");
                        self.unsupported.store(true, Ordering::Relaxed);
                    }
                    *guard = None;
                }
            },
            _ = &mut stop => {
                // The blocked command cannot be taken back: drop its connection.
                *guard = None;
            }
        }
    }
}

async fn connect(url: &str, interval: Duration) -> Option<redis::aio::MultiplexedConnection> {
    let client = super::client(url).ok()?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(interval + Duration::from_secs(10)));
    match client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
    {
        Ok(c) => Some(c),
        Err(e) => {
            debug!(error = %e, "no blocking connection; sleeping instead");
            None
        }
    }
}
