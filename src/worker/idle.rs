//! Waiting for work without polling, when a RESERVE pass found nothing.
//!
//! **With a master** (every daemon: `--workers N` runs N worker processes under one), the slot
//! that waits for the process sends the master a `wait` over the pickup link (`pickup.rs`)
//! naming every queue key that was empty (not merely skipped by the counter rule, not a key of
//! another type), and whether the queue list has patterns. The master blocks on those queues
//! for all its workers (`master/pickup.rs`) and writes a wake-up as soon as a job is pushed to
//! any of them, or, for a list with patterns, as soon as a new queue appears. The wait is bounded
//! by `interval` all the same: when the master cannot watch (Redis away, BLMOVE refused), the
//! worker's own pass every `interval` finds the job, as Resque's polling would.
//!
//! **Without a master** (a worker process started by hand, or a link that broke), the slot
//! blocks on `BLMOVE q q RIGHT RIGHT <interval>` itself, for the highest-priority queue that was
//! empty. It returns as soon as a job is pushed there and moves the tail element onto the tail
//! of the same list, so the queue is left exactly as it was: nothing is taken, nothing lives
//! only in memory, and the real reservation is still the RESERVE script. Jobs pushed to other
//! queues are then found at the next pass, at most `interval` later. A server without BLMOVE
//! (Redis < 6.2) or one whose ACL denies it falls back to sleeping. Any other error (OOM on a
//! full Redis, MISCONF, LOADING, READONLY after a failover, a dropped connection) waits out the
//! interval and tries again on a new connection: never a tight loop.
//!
//! Either way the other slots of a multi-slot process wait on the waiting slot's wake-up, and
//! a wake-up whose pass found nothing is counted: past [`MAX_FRUITLESS`] in a second, each
//! further `wait` of that second is held back by [`FRUITLESS_PAUSE`], so no wake-up can turn
//! into a loop (at most about 150 passes a second). Most fruitless wake-ups are a busy sibling
//! that took the pushed job first (under load, at any push rate), so the pause is short: holding
//! the rest of the second back, as a first version did, left jobs waiting up to a second at
//! 25% load (p50 pickup 509 ms at 1,485 paced jobs/s, `locketd-bench noop --workers 2`).

use super::pickup::{self, Report};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Wake-ups a second whose pass reserved nothing, before the next waits are held back.
pub(super) const MAX_FRUITLESS: u32 = 50;
/// How long a wait past [`MAX_FRUITLESS`] is held back.
pub(super) const FRUITLESS_PAUSE: Duration = Duration::from_millis(10);

/// Shared by the slots of one worker process.
#[derive(Debug, Default)]
pub(super) struct Idle {
    /// What the waiting slot holds: its BLMOVE connection, or the link's reading end.
    blocker: Mutex<Blocker>,
    /// The link's writing end (a `busy` is sent by whichever slot reserved the job).
    writer: Option<Mutex<pickup::Writer>>,
    /// Wakes the slots waiting beside the blocker.
    wake: Notify,
    /// BLMOVE is refused for good (an unknown command before Redis 6.2, or an ACL that denies
    /// it): idle slots sleep instead.
    unsupported: AtomicBool,
    /// The last BLMOVE failed (logged once until one succeeds).
    failing: AtomicBool,
    /// The last wait ended with a wake-up and no job has been reserved since.
    awaiting: AtomicBool,
    /// Fruitless wake-ups in the current second: (the second's start, how many).
    fruitless: std::sync::Mutex<Option<(Instant, u32)>>,
}

#[derive(Debug, Default)]
struct Blocker {
    /// The blocking connection (blocking commands must not share the multiplexed one).
    conn: Option<redis::aio::MultiplexedConnection>,
    /// The pickup link's reading end; `None` without a master, or once the link broke.
    reader: Option<pickup::Reader>,
    /// The last `wait`'s sequence number.
    seq: u64,
    /// A sentinel URL's failovers (F-2 (5)): the blocking connection moves at once.
    moves: Option<crate::conn::Moves>,
}

impl Idle {
    /// The idle waiter of a process, linked to its master when `LOCKETD_PICKUP_FD` names a
    /// link.
    pub(super) fn new() -> Idle {
        let (reader, writer) = match pickup::from_env() {
            Some((r, w)) => (Some(r), Some(Mutex::new(w))),
            None => (None, None),
        };
        Idle {
            blocker: Mutex::new(Blocker {
                reader,
                ..Blocker::default()
            }),
            writer,
            ..Idle::default()
        }
    }

    /// Sends the master every running job's handler group and lease end over the link
    /// (`watchdog.rs`), so that it can kill a group whose worker is frozen: a task that
    /// forwards the watchdog's notes, in order. Without a link, nothing.
    pub(super) fn report_leases(self: &std::sync::Arc<Self>) {
        if self.writer.is_none() {
            return;
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        crate::watchdog::set_reporter(tx);
        let me = self.clone();
        tokio::spawn(async move {
            let mut batch = pickup::LeaseBatch::default();
            loop {
                // A held end waits for the next note until it is due (or the channel closes).
                let note = match batch.due() {
                    None => rx.recv().await,
                    Some(due) => tokio::time::timeout_at(due, rx.recv())
                        .await
                        .unwrap_or(None),
                };
                let out = match note {
                    Some(note) => batch.take(
                        note,
                        crate::watchdog::monotonic_ns(std::time::Instant::now()),
                        Instant::now(),
                    ),
                    None if batch.due().is_some() => batch.flush(),
                    None => return,
                };
                if out.is_empty() {
                    continue;
                }
                let Some(w) = &me.writer else { return };
                if let Err(e) = w.lock().await.send_all(&out).await {
                    warn!(error = %e, "the master's link is gone: it no longer backs up the lock leases of this worker's jobs");
                    return;
                }
            }
        });
    }

    /// A pass reserved a job: the wake-up that led to it was not fruitless, and the master
    /// hears it at once (it watches the queue for the other idle workers again).
    pub(super) async fn took_job(&self) {
        if !self.awaiting.load(Ordering::Relaxed) || !self.awaiting.swap(false, Ordering::Relaxed) {
            return;
        }
        if let Some(w) = &self.writer {
            // A broken link is noticed (and logged) by the next wait.
            let _ = w.lock().await.send(&Report::Busy).await;
        }
    }

    /// Waits up to `interval` for a push to one of `keys` (the queue keys that were empty, in
    /// priority order), for a new queue when `glob`, or for `stop`.
    pub(super) async fn wait<F>(
        &self,
        url: &str,
        keys: &[String],
        glob: bool,
        interval: Duration,
        stop: F,
    ) where
        F: std::future::Future<Output = ()>,
    {
        tokio::pin!(stop);
        let until = Instant::now() + interval;
        if self.awaiting.swap(false, Ordering::Relaxed) {
            if let Some(end) = self.fruitless_wake() {
                debug!(
                    "more than {MAX_FRUITLESS} wake-ups in a second found nothing; holding the wait back"
                );
                sleep_until_or(end.min(until), &mut stop).await;
            }
        }
        // Registered before the lock is tried, so a wake-up sent between a failed try_lock
        // and the wait below is not missed.
        let woken = self.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let Ok(mut guard) = self.blocker.try_lock() else {
            // Another slot waits for the process: wait for its wake-up.
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep_until(until) => {}
                _ = &mut stop => {}
            }
            return;
        };
        if keys.is_empty() && !glob {
            // Every queue was skipped or unreadable: nothing a push could change.
            sleep_until_or(until, &mut stop).await;
            return;
        }
        if guard.reader.is_some() {
            self.wait_linked(&mut guard, keys, glob, until, &mut stop)
                .await;
        } else {
            self.wait_blmove(&mut guard, url, keys.first(), interval, until, &mut stop)
                .await;
        }
    }

    /// The wait with a master: `wait` over the link, then its wake-up, the interval or a stop.
    async fn wait_linked<F>(
        &self,
        guard: &mut Blocker,
        keys: &[String],
        glob: bool,
        until: Instant,
        stop: &mut std::pin::Pin<&mut F>,
    ) where
        F: std::future::Future<Output = ()>,
    {
        guard.seq += 1;
        let seq = guard.seq;
        let report = Report::Wait {
            seq,
            keys: keys.to_vec(),
            glob,
        };
        let sent = match &self.writer {
            Some(w) => w.lock().await.send(&report).await,
            None => Err(std::io::ErrorKind::NotConnected.into()),
        };
        if let Err(e) = sent {
            warn!(error = %e, "the master's pickup link is gone; idle slots wait on their own BLMOVE");
            guard.reader = None;
            sleep_until_or(until, stop).await;
            return;
        }
        let Some(reader) = guard.reader.as_mut() else {
            return;
        };
        let ended = tokio::select! {
            r = reader.woken(seq) => Some(r),
            _ = tokio::time::sleep_until(until) => None,
            _ = stop.as_mut() => None,
        };
        match ended {
            Some(Ok(())) => {
                self.awaiting.store(true, Ordering::Relaxed);
                self.wake.notify_waiters();
            }
            Some(Err(e)) => {
                warn!(error = %e, "the master's pickup link is gone; idle slots wait on their own BLMOVE");
                guard.reader = None;
                sleep_until_or(until, stop).await;
            }
            None => {
                if let Some(w) = &self.writer {
                    let _ = w.lock().await.send(&Report::Leave).await;
                }
            }
        }
    }

    /// The wait without a master: BLMOVE on the first empty queue.
    async fn wait_blmove<F>(
        &self,
        guard: &mut Blocker,
        url: &str,
        key: Option<&String>,
        interval: Duration,
        until: Instant,
        stop: &mut std::pin::Pin<&mut F>,
    ) where
        F: std::future::Future<Output = ()>,
    {
        let Some(key) = key.filter(|_| !self.unsupported.load(Ordering::Relaxed)) else {
            sleep_until_or(until, stop).await;
            return;
        };
        if guard.conn.is_none() {
            tokio::select! {
                c = connect(url, interval) => guard.conn = c,
                _ = stop.as_mut() => return,
            }
        }
        let moves = guard
            .moves
            .get_or_insert_with(|| crate::conn::Moves::of(url));
        let Some(conn) = guard.conn.as_mut() else {
            sleep_until_or(until, stop).await;
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
                        self.awaiting.store(true, Ordering::Relaxed);
                        self.wake.notify_waiters();
                    }
                }
                Err(e) => {
                    if crate::conn::unavailable_command(&e) {
                        warn!(error = %e, "BLMOVE refused; idle slots poll every interval");
                        self.unsupported.store(true, Ordering::Relaxed);
                    } else if !self.failing.swap(true, Ordering::Relaxed) {
                        // OOM, MISCONF, LOADING, READONLY after a failover, a dropped
                        // connection...: passing, so the next wait tries again, on a new
                        // connection, after this one's interval has run out.
                        warn!(error = %e, "BLMOVE failed; idle slots poll every interval until it answers");
                    }
                    guard.conn = None;
                    // Never straight back: a Redis that fails every command at once (a full
                    // one) would otherwise get a new connection and a BLMOVE per RESERVE, in a
                    // loop. The lock is kept meanwhile, so the other slots wait too.
                    sleep_until_or(until, stop).await;
                }
            },
            _ = stop.as_mut() => {
                // The blocked command cannot be taken back: drop its connection.
                guard.conn = None;
            }
            _ = moves.moved() => {
                // Waiting on the old primary: the next wait connects to the new one, and the
                // slots look there now (anything pushed meanwhile was pushed there).
                guard.conn = None;
                self.awaiting.store(true, Ordering::Relaxed);
                self.wake.notify_waiters();
            }
        }
    }

    /// Counts a wake-up whose pass found nothing; past [`MAX_FRUITLESS`] in the current
    /// second, returns when the next wait may start ([`FRUITLESS_PAUSE`] from now).
    fn fruitless_wake(&self) -> Option<Instant> {
        let mut w = self.fruitless.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let second = Duration::from_secs(1);
        let (start, n) = match *w {
            Some((start, n)) if now < start + second => (start, n + 1),
            _ => (now, 1),
        };
        *w = Some((start, n));
        (n > MAX_FRUITLESS).then_some(now + FRUITLESS_PAUSE)
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

async fn connect(url: &str, interval: Duration) -> Option<redis::aio::MultiplexedConnection> {
    let client = crate::conn::primary_client(url, false).await.ok()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fruitless_wake_ups_are_held_back_past_the_limit() {
        let idle = Idle::default();
        for _ in 0..MAX_FRUITLESS {
            assert_eq!(idle.fruitless_wake(), None);
        }
        let end = idle.fruitless_wake().expect("held back past the limit");
        assert!(end > Instant::now() && end <= Instant::now() + FRUITLESS_PAUSE);
        // A second later the count starts afresh.
        let past = Instant::now() - Duration::from_secs(2);
        *idle.fruitless.lock().unwrap() = Some((past, 50));
        assert_eq!(idle.fruitless_wake(), None);
    }
}
