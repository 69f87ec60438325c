//! Supervising one running job: lock heartbeats, the local deadline (L-9), lost locks
//! the runtime limit and shutdown; and the process heartbeat.

use crate::config::OnLockLost;
use crate::conn::Manager;
use crate::handler::{Handler, HandlerResult, JobContext};
use crate::locks::LockSpec;
use crate::resque::failure::JobFailure;
use crate::resque::keys::Keys;
use crate::store;
use crate::store::registry;
use crate::watchdog::Watch;
use futures::future::{BoxFuture, Fuse, FusedFuture, FutureExt};
use redis::RedisResult;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::Control;

/// How a supervised run ended.
#[derive(Debug)]
pub(super) enum RunEnd {
    /// The handler returned.
    Finished(HandlerResult),
    /// A lock was lost and the handler was stopped.
    LockLost,
    /// `timeout` passed and the handler was stopped.
    TimedOut(Duration),
    /// Stopped by a shutdown (TERM, or QUIT's `shutdown_timeout` ran out). `killed`: it did not
    /// stop within `term_timeout` of the polite stop (or a second TERM asked for SIGKILL).
    Terminated {
        /// SIGKILLed rather than stopped politely.
        killed: bool,
    },
    /// USR1: killed at once; the worker keeps working.
    KilledByUsr1,
    /// The process lease lapsed.
    PresumedDead,
    /// An operator cancelled the job (A-21: `locketd cancel`, the page) and the handler was
    /// stopped as for a lost lock.
    Cancelled(super::cancel::Request),
}

impl RunEnd {
    /// Why the handler is asked to stop, as a handler is told (a persistent handler's
    /// `stop` frame).
    fn stop_reason(&self) -> &'static str {
        match self {
            RunEnd::TimedOut(_) => "timeout",
            RunEnd::LockLost => "lock_lost",
            RunEnd::KilledByUsr1 => "usr1",
            RunEnd::PresumedDead => "presumed_dead",
            RunEnd::Cancelled(_) => "cancelled",
            RunEnd::Terminated { .. } | RunEnd::Finished(_) => "shutdown",
        }
    }

    /// Whether this end kills the handler's group at once, with no polite stop (USR1, a second
    /// TERM), as Resque's `kill_child` SIGKILLs its child.
    fn kills_at_once(&self) -> bool {
        matches!(
            self,
            RunEnd::KilledByUsr1 | RunEnd::Terminated { killed: true }
        )
    }

    /// Whether this end puts the job back in its queue (A-11's `requeue`) rather than
    /// recording it. Known before the handler is asked to stop, so that it can be told.
    pub(super) fn requeues(&self, on_lost: OnLockLost) -> bool {
        (matches!(self, RunEnd::LockLost) && on_lost == OnLockLost::Requeue)
            || matches!(self, RunEnd::Cancelled(c) if c.requeue)
    }

    /// The job's result as Resque records it, for each way a supervised run ends.
    pub(super) fn into_result(self, locks: &[LockSpec]) -> HandlerResult {
        match self {
            RunEnd::Finished(r) => r,
            RunEnd::LockLost => Err(JobFailure::new(
                "Locket::LockLost",
                format!(
                    "lost the job lock {} while the job ran; it was stopped",
                    locks.first().map(|l| l.id.as_str()).unwrap_or("")
                ),
            )),
            RunEnd::TimedOut(limit) => Err(JobFailure::new(
                "Locket::Timeout",
                format!(
                    "job ran longer than its timeout of {}s and was stopped",
                    limit.as_secs_f64()
                ),
            )),
            RunEnd::Terminated { killed: false } => {
                Err(JobFailure::new("Resque::TermException", "SIGTERM"))
            }
            RunEnd::Terminated { killed: true } => Err(JobFailure::new(
                "Resque::DirtyExit",
                "Child process received unhandled signal SIGKILL (signal 9): stopped by a shutdown",
            )
            .dirty()),
            RunEnd::KilledByUsr1 => Err(JobFailure::new(
                "Resque::DirtyExit",
                "Child process received unhandled signal SIGKILL (signal 9): killed by USR1",
            )
            .dirty()),
            RunEnd::Cancelled(c) => Err(JobFailure::new(
                "Locket::Cancelled",
                format!("cancelled by an operator: {}", c.by),
            )),
            RunEnd::PresumedDead => Err(JobFailure::new(
                "Resque::DirtyExit",
                "locketd process was presumed dead and stopped the job",
            )
            .dirty()),
        }
    }

    /// A shutdown's stop that ended in SIGKILL (for other ends the kill changes nothing).
    fn mark_killed(&mut self) {
        if let RunEnd::Terminated { killed } = self {
            *killed = true;
        }
    }
}

/// Everything the supervisor needs besides the handler.
pub(super) struct Supervision {
    pub conn: Manager,
    pub keys: Keys,
    pub token: String,
    pub locks: Vec<LockSpec>,
    pub lock_ttl: Duration,
    pub heartbeat_interval: Duration,
    /// Monotonic time just before the ACQUIRE that succeeded was sent (L-9).
    pub sent_at: std::time::Instant,
    pub max_runtime: Option<Duration>,
    pub kill_grace: Duration,
    pub shutdown_timeout: Duration,
    pub term_timeout: Duration,
    pub on_lock_lost: OnLockLost,
    /// The job's reservation id: what a cancel request names.
    pub rid: String,
}

/// How long after the hard stop's latest time (the local deadline) the watchdog thread kills
/// a handler that this task (stalled) did not stop.
const WATCHDOG_MARGIN: Duration = Duration::from_secs(1);

/// The master's backstop kills a handler group this long (at most; half of kill_grace when
/// that is shorter) before the lease's local end, so that the group is dead, not just
/// signalled, by then, even on a loaded host (finding #8, L-9).
const MASTER_MARGIN: Duration = Duration::from_millis(250);

/// A lease end this far away is no lease end (unlocked, or kept running after a loss).
const NO_LEASE: Duration = Duration::from_secs(86400 * 30);

/// L-9: the local deadline never falls after the server's.
fn local_deadline(t: Instant, ttl: Duration) -> Instant {
    t + ttl.saturating_sub(ttl / 100 + Duration::from_millis(2))
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400 * 365)
}

/// One lock extension on the wire: when it was sent, and EXTEND's answer.
type Extension = Fuse<BoxFuture<'static, (Instant, RedisResult<(u64, Vec<bool>)>)>>;

/// A supervised run in progress: the handler's future and what the supervisor tracks beside it.
struct Running {
    fut: BoxFuture<'static, HandlerResult>,
    /// Asks the handler to stop politely.
    stop: CancellationToken,
    /// L-9's local deadline (far in the future when unlocked, or once a lost lock is kept
    /// running under `on_lock_lost = "continue"`).
    lease_end: Instant,
    next_extend: Instant,
    /// The extension in flight runs beside the other branches: a Redis that is slow to answer
    /// (up to the 30 s response timeout) must not hold up the lease end, the signals or the
    /// handler's exit (NEVER-1).
    extension: Extension,
    /// The lease's backstops: the thread of this process, armed [`WATCHDOG_MARGIN`] after
    /// `lease_end`, and the master, told `lease_end` less `master_margin` (watchdog.rs).
    watch: Watch,
    /// How long before `lease_end` the master kills.
    master_margin: Duration,
    kills: tokio::sync::watch::Receiver<u64>,
    /// the process's cancel requests (subscribing makes the process read them).
    cancels: tokio::sync::watch::Receiver<super::cancel::Requests>,
}

impl Running {
    /// Moves the backstops to the lease's current end: the watchdog thread's a margin after
    /// it, the master's a margin before it (L-9).
    fn arm(&self) {
        let end = self.lease_end.into_std();
        self.watch.kill_at(end + WATCHDOG_MARGIN);
        let known = self.lease_end < Instant::now() + NO_LEASE;
        self.watch
            .lease_ends(known.then(|| end.checked_sub(self.master_margin).unwrap_or(end)));
    }
}

impl Supervision {
    pub(super) async fn run(
        self,
        handler: Arc<dyn Handler>,
        mut ctx: JobContext,
        control: &Control,
        dead: &CancellationToken,
    ) -> RunEnd {
        let locked = !self.locks.is_empty();
        // The backstops of the deadline below: a thread no I/O of this one can block, and the
        // master, which no stall of this process can hold up (watchdog.rs). They follow
        // `lease_end` (the thread a margin after it, so that this task acts first whenever it
        // runs at all).
        let watch = if locked {
            Watch::new()
        } else {
            Watch::default()
        };
        ctx.watch = watch.clone();
        let stop = CancellationToken::new();
        let note = ctx.stop_reason.clone();
        let sent_at = Instant::from_std(self.sent_at);
        let mut kills = control.kills.subscribe();
        kills.mark_unchanged();
        let mut r = Running {
            fut: handler.perform(ctx, stop.clone()),
            stop,
            lease_end: if locked {
                local_deadline(sent_at, self.lock_ttl)
            } else {
                far_future()
            },
            next_extend: if locked {
                sent_at + self.heartbeat_interval
            } else {
                far_future()
            },
            extension: Fuse::terminated(),
            watch,
            master_margin: (self.kill_grace / 2).min(MASTER_MARGIN),
            kills,
            cancels: control.cancels.subscribe(),
        };
        let end = match self.until_end(&mut r, control, dead).await {
            Ok(result) => return RunEnd::Finished(result),
            Err(end) => end,
        };
        note.set(
            end.stop_reason(),
            end.requeues(self.on_lock_lost),
            end.kills_at_once(),
        );
        let (end, returned) = self.stop_handler(&mut r, end, locked, control).await;
        drop(r);
        // A shutdown's polite stop is the handler's to answer, as a Ruby job may rescue
        // Resque::TermException: one that still finished its work (returned Ok, exit 0) counts
        // as a success, and one that asks to run again (exit 75) is rescheduled. Anything else
        // stays the shutdown's TermException. (A timeout or a lost lock decides by itself.)
        if let (RunEnd::Terminated { killed: false }, Some(r)) = (&end, returned) {
            match r {
                Ok(()) => return RunEnd::Finished(Ok(())),
                Err(f)
                    if f.exception == crate::handler::RESCHEDULE
                        || f.exception == crate::handler::THROTTLED =>
                {
                    return RunEnd::Finished(Err(f))
                }
                Err(_) => {}
            }
        }
        end
    }

    /// Runs the handler with its lock heartbeat until it returns (`Ok`) or something ends the
    /// run (`Err`): the lease, the runtime limit, a shutdown, USR1, presumed death.
    async fn until_end(
        &self,
        r: &mut Running,
        control: &Control,
        dead: &CancellationToken,
    ) -> Result<HandlerResult, RunEnd> {
        let runtime_end = self
            .max_runtime
            .map(|d| Instant::now() + d)
            .unwrap_or_else(far_future);
        let mut shutdown_end = far_future();
        let mut quitting = false;
        let mut extend_failing = false;
        // a request read before this run subscribed counts too.
        if let Some(c) = r.cancels.borrow_and_update().get(&self.rid).cloned() {
            return Err(self.cancelled(c));
        }
        loop {
            r.arm();
            // L-9, issue 23: while no EXTEND succeeds, the polite stop begins kill_grace before
            // the local deadline, so that the hard stop lands by it (a class that keeps
            // running after a loss renews until the deadline itself).
            let give_up = match self.on_lock_lost {
                OnLockLost::Continue => r.lease_end,
                OnLockLost::Kill | OnLockLost::Requeue => r
                    .lease_end
                    .checked_sub(self.kill_grace)
                    .unwrap_or_else(Instant::now),
            };
            tokio::select! {
                result = &mut r.fut => return Ok(result),
                Ok(()) = r.cancels.changed() => {
                    if let Some(c) = r.cancels.borrow_and_update().get(&self.rid).cloned() {
                        return Err(self.cancelled(c));
                    }
                }
                _ = sleep_until(r.next_extend), if r.extension.is_terminated() => {
                    r.extension = self.extend();
                }
                (t, extended) = &mut r.extension => {
                    if let Some(end) = self.extended(r, t, extended, &mut extend_failing) {
                        return Err(end);
                    }
                }
                _ = sleep_until(give_up) => {
                    error!(token = %&self.token[..8.min(self.token.len())], kill_grace = self.kill_grace.as_secs_f64(), "no lock extension succeeded and the lease ends within kill_grace: stopping the job");
                    if let Some(end) = self.lost() { return Err(end); }
                    r.lease_end = far_future();
                    r.next_extend = far_future();
                }
                _ = sleep_until(runtime_end) => {
                    return Err(RunEnd::TimedOut(self.max_runtime.unwrap_or_default()));
                }
                _ = control.quit.cancelled(), if !quitting => {
                    quitting = true;
                    info!(timeout = self.shutdown_timeout.as_secs_f64(), "shutting down: waiting for the running job");
                    shutdown_end = Instant::now() + self.shutdown_timeout;
                }
                _ = sleep_until(shutdown_end) => return Err(RunEnd::Terminated { killed: false }),
                _ = control.term.cancelled() => {
                    info!(term_timeout = self.term_timeout.as_secs_f64(), "TERM: stopping the running job");
                    return Err(RunEnd::Terminated { killed: false });
                }
                _ = control.kill.cancelled() => return Err(RunEnd::Terminated { killed: true }),
                Ok(()) = r.kills.changed() => {
                    info!("USR1: killing the running job");
                    return Err(RunEnd::KilledByUsr1);
                }
                _ = dead.cancelled() => return Err(RunEnd::PresumedDead),
            }
        }
    }

    /// An EXTEND's answer while the job runs: the lease moves, a failure is
    /// retried within the interval, a lost lock ends the run unless the class keeps running.
    fn extended(
        &self,
        r: &mut Running,
        t: Instant,
        extended: RedisResult<(u64, Vec<bool>)>,
        failing: &mut bool,
    ) -> Option<RunEnd> {
        match extended {
            Ok((_, lost)) if lost.iter().any(|l| *l) => {
                let end = self.lost();
                if end.is_none() {
                    r.lease_end = far_future();
                    r.next_extend = far_future();
                }
                return end;
            }
            Ok(_) => {
                if *failing {
                    info!("lock extension succeeded again");
                    *failing = false;
                }
                debug!(token = %&self.token[..8], "job lock extended");
                r.lease_end = local_deadline(t, self.lock_ttl);
                r.next_extend = t + self.heartbeat_interval;
            }
            Err(e) => {
                // retry within the interval until the stop begins; one warning per
                // outage.
                if *failing {
                    debug!(error = %e, "lock extension failed again");
                } else {
                    warn!(error = %e, retry_ms = u64::try_from(self.retry_after().as_millis()).unwrap_or(u64::MAX), "lock extension failed; retrying");
                    *failing = true;
                }
                r.next_extend = Instant::now() + self.retry_after();
            }
        }
        None
    }

    /// Polite stop, then hard stop after the grace (A-11: kill_grace; shutdowns:
    /// term_timeout; USR1 and a second TERM: none). The lock heartbeat keeps going meanwhile
    /// so the lease does not lapse under a job that is still stopping. Returns the end (marked
    /// killed when it came to SIGKILL) and what the handler returned, if it did in time.
    async fn stop_handler(
        &self,
        r: &mut Running,
        mut end: RunEnd,
        locked: bool,
        control: &Control,
    ) -> (RunEnd, Option<HandlerResult>) {
        let grace = match end {
            _ if end.kills_at_once() => Duration::ZERO,
            RunEnd::Terminated { .. } => self.term_timeout,
            _ => self.kill_grace,
        };
        r.stop.cancel();
        let mut grace_end = Instant::now() + grace;
        // The lease is renewed while the job stops, except after a loss; either way the hard
        // stop lands by the local deadline of the last renewal (L-9, NEVER-1).
        let lease_counts = locked && !matches!(end, RunEnd::LockLost);
        // A TERM during another stop's grace (a timeout's or a lost lock's kill_grace) shortens
        // it to term_timeout; a second TERM or a USR1 ends it at once, as they would a run.
        let mut term_seen = matches!(end, RunEnd::Terminated { .. });
        loop {
            r.arm();
            tokio::select! {
                biased;
                // NEVER-1: a lease that runs out while the job is stopping ends the grace.
                _ = sleep_until(r.lease_end), if locked => {
                    warn!("the job lock's lease ends: killing the stopping job");
                    break;
                }
                _ = sleep_until(grace_end) => {
                    if !grace.is_zero() {
                        warn!(grace = grace.as_secs_f64(), "handler did not stop in time; killing it");
                    }
                    break;
                }
                _ = control.kill.cancelled() => {
                    info!("second stop signal: killing the stopping job now");
                    break;
                }
                Ok(()) = r.kills.changed() => {
                    info!("USR1: killing the stopping job now");
                    break;
                }
                _ = control.term.cancelled(), if !term_seen => {
                    term_seen = true;
                    grace_end = grace_end.min(Instant::now() + self.term_timeout);
                }
                result = &mut r.fut => {
                    debug!(result = ?result.as_ref().err().map(|f| &f.exception), "handler stopped");
                    return (end, Some(result));
                }
                _ = sleep_until(r.next_extend), if lease_counts && r.extension.is_terminated() => {
                    r.extension = self.extend();
                }
                (t, extended) = &mut r.extension => {
                    match extended {
                        Ok((_, lost)) if lost.iter().any(|l| *l) => {
                            warn!("job lock lost while the job was stopping; killing it");
                            break;
                        }
                        Ok(_) => {
                            r.lease_end = local_deadline(t, self.lock_ttl);
                            r.next_extend = t + self.heartbeat_interval;
                        }
                        Err(_) => r.next_extend = Instant::now() + self.retry_after(),
                    }
                }
            }
        }
        end.mark_killed();
        (end, None)
    }

    /// Sends one EXTEND of the job's locks, to be polled beside everything else.
    fn extend(&self) -> Extension {
        let (mut conn, keys, token, locks, ttl) = (
            self.conn.clone(),
            self.keys.clone(),
            self.token.clone(),
            self.locks.clone(),
            self.lock_ttl,
        );
        // An attempt that gets no answer within the interval is given up and sent again
        // a Redis that stopped answering must not leave one EXTEND hanging until the
        // stop. A late answer to it only lengthens the lease in Redis, never the local one.
        let within = self.heartbeat_interval;
        async move {
            let t = Instant::now();
            let r =
                tokio::time::timeout(within, store::extend(&mut conn, &keys, &token, &locks, ttl))
                    .await
                    .unwrap_or_else(|_| {
                        Err(redis::RedisError::from((
                            redis::ErrorKind::Io,
                            "no answer within heartbeat_interval",
                        )))
                    });
            (t, r)
        }
        .boxed()
        .fuse()
    }

    /// How soon a failed EXTEND is sent again: a quarter of the interval, at most a second,
    /// so that several attempts fit before the stop.
    fn retry_after(&self) -> Duration {
        (self.heartbeat_interval / 4).clamp(Duration::from_millis(25), Duration::from_secs(1))
    }

    /// an operator's cancel: logged, then the run stops as for a lost lock.
    fn cancelled(&self, c: super::cancel::Request) -> RunEnd {
        warn!(rid = %self.rid, by = %c.by, requeue = c.requeue, "job cancelled by an operator: stopping it");
        RunEnd::Cancelled(c)
    }

    /// what a lost lock means for this class. `None` means keep running (`continue`).
    fn lost(&self) -> Option<RunEnd> {
        match self.on_lock_lost {
            OnLockLost::Continue => {
                error!(token = %&self.token[..8.min(self.token.len())], "job lock lost; continuing without exclusivity (on_lock_lost = continue)");
                None
            }
            OnLockLost::Kill | OnLockLost::Requeue => Some(RunEnd::LockLost),
        }
    }
}

/// renews the process lease and the Resque heartbeat every `every`; cancels `dead`
/// when the lease was found gone, or when renewals have failed for `ttl` since the last one
/// that was answered (a local deadline, like L-9's for locks: by then the lease has lapsed in
/// Redis whatever the renewals' fate, and the process may have been recovered, so it stops
/// reserving and stops its handlers). A renewal that fails (or gets no answer within `every`) is
/// retried after a quarter of `every` (at most 1 s), not a whole one: with `process_ttl` at
/// twice `every`, waiting a whole period after one failure would let the lease lapse and the
/// live process presume itself dead.
#[allow(clippy::too_many_arguments)]
pub(super) async fn process_heartbeat(
    mut conn: Manager,
    keys: Keys,
    process_id: String,
    worker_ids: Vec<String>,
    every: Duration,
    ttl: Duration,
    dead: CancellationToken,
    stop: CancellationToken,
) {
    let mut failing = false;
    let ids: Vec<&str> = worker_ids.iter().map(String::as_str).collect();
    let retry_after = (every / 4).clamp(Duration::from_millis(25), Duration::from_secs(1));
    let mut wait = every;
    // Registration set the lease just before this task started.
    let mut lease_end = tokio::time::Instant::now() + ttl;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return,
        }
        if tokio::time::Instant::now() >= lease_end {
            error!(process = %process_id, ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX), "process lease renewals failed for process_ttl: presumed dead and possibly recovered elsewhere; stopping");
            dead.cancel();
            return;
        }
        let sent = tokio::time::Instant::now();
        let beat = tokio::time::timeout(
            every.min(lease_end - sent),
            registry::heartbeat(&mut conn, &keys, &process_id, &ids, ttl),
        )
        .await
        .unwrap_or_else(|_| {
            Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer within process_heartbeat",
            )))
        });
        match beat {
            Ok(true) => {
                // The server set the lease after it was sent: it lasts at least until then.
                lease_end = sent + ttl;
                if failing {
                    info!("process heartbeat resumed");
                    failing = false;
                }
                wait = every;
            }
            Ok(false) => {
                error!(process = %process_id, "process lease was gone: presumed dead and possibly recovered elsewhere; stopping");
                dead.cancel();
                return;
            }
            Err(e) => {
                if !failing {
                    warn!(error = %e, "process heartbeat failed; retrying");
                    failing = true;
                }
                wait = retry_after
                    .min(lease_end.saturating_duration_since(tokio::time::Instant::now()));
            }
        }
    }
}

/// Issue 13 item 4: writes the process's persistent handler processes to `key` for
/// `locketd status`, at the process heartbeat's pace but only when they changed (or every
/// 30 minutes, the key lasting an hour), so an idle handler costs no Redis command. The key
/// goes when the worker stops.
pub(super) async fn report_handlers(
    mut conn: Manager,
    key: String,
    metrics: Vec<crate::metrics::Metrics>,
    every: Duration,
    stop: CancellationToken,
) {
    const KEEP: Duration = Duration::from_secs(3600);
    let mut last = String::new();
    let mut written = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => break,
        }
        let mut all: Vec<crate::metrics::HandlerStats> =
            metrics.iter().flat_map(|m| m.handlers()).collect();
        // The backoff left changes by itself; it is shown, not a reason to write.
        let text = serde_json::to_string(&all).unwrap_or_default();
        all.iter_mut().for_each(|h| h.backoff_ms = 0);
        let compare = serde_json::to_string(&all).unwrap_or_default();
        if compare == last && written.elapsed() < KEEP / 2 {
            continue;
        }
        let set: RedisResult<()> = redis::cmd("SET")
            .arg(&key)
            .arg(&text)
            .arg("PX")
            .arg(u64::try_from(KEEP.as_millis()).unwrap_or(u64::MAX))
            .query_async(&mut conn)
            .await;
        if set.is_ok() {
            last = compare;
            written = Instant::now();
        }
    }
    let _: RedisResult<()> = redis::cmd("DEL").arg(&key).query_async(&mut conn).await;
}
