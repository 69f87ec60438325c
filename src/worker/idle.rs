//! Waiting for work without polling: when a pass reserved nothing, one slot per process blocks
//! on `BLMOVE q q RIGHT RIGHT <interval>` for the highest-priority queue that was empty. It
//! returns as soon as a job is pushed there and moves the tail element onto the tail of the same
//! list, so the queue is left exactly as it was: nothing is taken, nothing lives only in memory,
//! and the real reservation is still the RESERVE script. An idle worker then costs Redis one
//! command per `interval` instead of a poll loop, and picks a new job up within milliseconds.
//!
//! Jobs pushed to other (lower) queues are found at the next pass, at most `interval` later,
//! as Resque's polling would. The other slots of the process wait on the waiter's wake-up.
//! A server without BLMOVE (Redis < 6.2) or one whose ACL denies it falls back to sleeping.
//! Any other error (OOM on a full Redis, MISCONF, LOADING, READONLY after a failover, a dropped
//! connection) waits out the interval and tries again on a new connection: never a tight loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Shared by the slots of one worker process.
#[derive(Debug, Default)]
pub(super) struct Idle {
    /// The blocking connection (blocking commands must not share the multiplexed one).
    blocker: Mutex<Option<redis::aio::MultiplexedConnection>>,
    /// Wakes the slots waiting beside the blocker.
    wake: Notify,
    /// BLMOVE is refused for good (an unknown command before Redis 6.2, or an ACL that denies
    /// it): idle slots sleep instead.
    unsupported: AtomicBool,
    /// The last BLMOVE failed (logged once until one succeeds).
    failing: AtomicBool,
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
        let until = Instant::now() + interval;
        let Some(key) = queue_key.filter(|_| !self.unsupported.load(Ordering::Relaxed)) else {
            sleep_until_or(until, &mut stop).await;
            return;
        };
        // Registered before the lock is tried, so a wake-up sent between a failed try_lock
        // and the wait below is not missed.
        let woken = self.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let Ok(mut guard) = self.blocker.try_lock() else {
            // Another slot blocks for the process: wait for its wake-up.
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep_until(until) => {}
                _ = &mut stop => {}
            }
            return;
        };
        if guard.is_none() {
            tokio::select! {
                c = connect(url, interval) => *guard = c,
                _ = &mut stop => return,
            }
        }
        let Some(conn) = guard.as_mut() else {
            sleep_until_or(until, &mut stop).await;
            return;
        };
        // BLMOVE's timeout is in seconds (a double since Redis 6.0); 0 would block forever.
        let secs = interval.as_secs_f64().max(0.01);
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(key).arg(key).arg("RIGHT").arg("RIGHT").arg(secs);
        let blmove = cmd.query_async::<Option<redis::Value>>(conn);
        tokio::select! {
            r = blmove => match r {
                Ok(found) => {
                    if self.failing.swap(false, Ordering::Relaxed) {
                        info!("BLMOVE answers again; idle slots wake on pushes");
                    }
                    if found.is_some() {
                        self.wake.notify_waiters();
                    }
                }
                Err(e) => {
                    if refused_for_good(&e) {
                        warn!(error = %e, "BLMOVE refused; idle slots poll every interval");
                        self.unsupported.store(true, Ordering::Relaxed);
                    } else if !self.failing.swap(true, Ordering::Relaxed) {
                        // OOM, MISCONF, LOADING, READONLY after a failover, a dropped
                        // connection...: passing, so the next wait tries again, on a new
                        // connection, after this one's interval has run out.
                        warn!(error = %e, "BLMOVE failed; idle slots poll every interval until it answers");
                    }
                    *guard = None;
                    // Never straight back: a Redis that fails every command at once (a full
                    // one) would otherwise get a new connection and a BLMOVE per RESERVE, in a
                    // loop. The lock is kept meanwhile, so the other slots wait too.
                    sleep_until_or(until, &mut stop).await;
                }
            },
            _ = &mut stop => {
                // The blocked command cannot be taken back: drop its connection.
                *guard = None;
            }
        }
    }
}

/// Sleeps until `until` unless `stop` completes first.
async fn sleep_until_or<F>(until: Instant, stop: &mut std::pin::Pin<&mut F>)
where
    F: std::future::Future<Output = ()>,
{
    tokio::select! {
        _ = tokio::time::sleep_until(until) => {}
        _ = stop.as_mut() => {}
    }
}

/// An error BLMOVE will keep giving on this server: an unknown command (Redis < 6.2), wrong
/// arguments, or an ACL that denies it.
fn refused_for_good(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or("").to_ascii_lowercase();
    match e.code() {
        Some("NOPERM") => true,
        Some("ERR") => {
            detail.contains("unknown command") || detail.contains("wrong number of arguments")
        }
        _ => false,
    }
}

async fn connect(url: &str, interval: Duration) -> Option<redis::aio::MultiplexedConnection> {
    let client = crate::conn::client(url).ok()?;
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
