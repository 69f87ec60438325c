//! The first step of a job's path: RESERVE in the worker's loop, fused with the last
//! job's FINISH when one is pending; and what the loop does when nothing was reserved (the
//! idle wait, a pause, a parked slot, presumed death).

use super::retry::{sleep_or_stop, wait_unpaused};
use super::take::Took;
use super::{Control, StopReason, Worker};
use crate::store::random_hex;
use crate::store::{self, ReserveFlags, Reserved};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::worker";

/// How long a look at the pause and cap keys' types lasts: a key of another type
/// written there is seen within this.
const GUARD_TYPES_EVERY: Duration = Duration::from_secs(1);

impl Worker {
    /// The worker's loop: RESERVE, then the job's path (`job.rs`), until a stop.
    pub(super) async fn work_loop(
        &mut self,
        control: &Control,
        dead: &CancellationToken,
    ) -> StopReason {
        let interval = self.config.interval.get();
        let waiting = format!("Waiting for {}", self.spec.id_part());
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.before_reserve(control, dead).await {
                Next::Go(()) => {}
                Next::Again => continue,
                Next::Stop(r) => return r,
            }
            let queues = match self.expand_queues().await {
                Ok(q) => q,
                Err(e) => {
                    self.redis_error("queues", &e);
                    sleep_or_stop(backoff, control, dead).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let (reserved, took) = match self.reserve_next(&queues).await {
                Next::Go(r) => r,
                Next::Again => continue,
                Next::Stop(r) => return r,
            };
            match reserved {
                Err(e) => {
                    self.redis_error("reserve", &e);
                    sleep_or_stop(backoff, control, dead).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Ok(Reserved::Job {
                    queue,
                    payload,
                    rid,
                    ..
                }) => {
                    self.redis_ok();
                    backoff = Duration::from_millis(100);
                    self.idle.took_job().await;
                    let job = self.process(queue, payload, rid, took, control, dead);
                    if let Some(reason) = job.await {
                        return reason;
                    }
                    self.title(&waiting);
                }
                Ok(Reserved::Nothing {
                    skipped,
                    unreadable,
                    mut paused,
                    capped,
                    refused,
                }) => {
                    // a capped queue is waited on as a paused one (its unit is freed by
                    // a FINISH, whose slot reserves again in the same step); so is a queue
                    // whose cap key is spoiled (reported once), until the next pass finds it
                    // mended.
                    self.caps_refused(&refused);
                    paused.extend(capped);
                    paused.extend(refused);
                    self.redis_ok();
                    self.title(&waiting);
                    if interval.is_zero() {
                        self.nothing_reserved(&skipped, &unreadable);
                        return StopReason::Drained;
                    }
                    self.idle_wait(&queues, &skipped, &unreadable, &paused, control, dead)
                        .await;
                }
                Ok(Reserved::Paused) => {
                    self.redis_ok();
                    self.title("Paused");
                    sleep_or_stop(interval.max(Duration::from_millis(100)), control, dead).await;
                }
                Ok(Reserved::Dead) => {
                    // the lease lapsed (a stall or a partition longer than process_ttl)
                    // and this process may have been recovered: it reserves nothing more.
                    error!(target: LOG_TARGET, process = %self.id.process_id, "process lease gone: presumed dead, reserving nothing");
                    dead.cancel();
                    return StopReason::PresumedDead;
                }
                Ok(Reserved::Busy) => {
                    // Only after a RESERVE whose reply was lost (connection dropped after the
                    // script ran): the job is safe in the inflight record and goes back to the
                    // head of its queue, where it was. The outage that lost the reply is
                    // logged already (as a warning, once); this is its expected mending.
                    info!(target: LOG_TARGET, slot = %self.id.slot_key, "slot already holds a reservation (a RESERVE whose reply was lost); returning it to its queue");
                    self.return_stale().await;
                    sleep_or_stop(backoff, control, dead).await;
                }
            }
        }
    }

    /// What comes before a RESERVE: a stop, a pause (USR2) or a parked slot (E-3) hold it up.
    async fn before_reserve(&mut self, control: &Control, dead: &CancellationToken) -> Next<()> {
        if dead.is_cancelled() {
            return Next::Stop(StopReason::PresumedDead);
        }
        if control.stopping() {
            return Next::Stop(StopReason::Shutdown);
        }
        if control.is_paused() {
            if let Some(r) = self.flush_pending().await {
                return Next::Stop(r);
            }
            self.title("Paused");
            info!(target: LOG_TARGET, "paused (USR2): reserving nothing until CONT");
            wait_unpaused(control, dead).await;
            if !control.is_paused() {
                info!(target: LOG_TARGET, "resumed (CONT)");
            }
            return Next::Again;
        }
        // H-8: a slot whose every class goes to one handler that is backing off after a
        // failed start reserves nothing until the backoff ends: its jobs wait in their queues.
        if let Some(until) = self.sole_handler.as_ref().and_then(|h| h.backing_off()) {
            if let Some(r) = self.flush_pending().await {
                return Next::Stop(r);
            }
            self.title("Waiting for its handler to start");
            let now = Instant::now();
            if now < until {
                sleep_or_stop(until - now, control, dead).await;
            }
            return Next::Again;
        }
        if let Some(until) = self.pending.as_ref().and_then(|p| p.parked_until) {
            self.title("Parked: Redis refused the end of its last job (see the log)");
            let now = Instant::now();
            if now < until && !sleep_or_stop(until - now, control, dead).await {
                return Next::Again;
            }
            if let Some(r) = self.flush_pending().await {
                return Next::Stop(r);
            }
            return Next::Again;
        }
        Next::Go(())
    }

    /// RESERVE from `queues`, carrying the last job's FINISH when one is pending; sent
    /// as TAKE (A-7a, `take.rs`) when it can be, with what TAKE did with the job.
    async fn reserve_next(
        &mut self,
        queues: &[String],
    ) -> Next<(redis::RedisResult<Reserved>, Option<Took>)> {
        let rid = random_hex(8);
        // at least once a second a RESERVE looks at the types of the pause and cap keys
        // (one EXISTS); the fused ones in between trust their MGET of them.
        let sent = Instant::now();
        let flags = ReserveFlags {
            clear_counters_when_idle: self.config.locket.clear_counters_when_idle,
            guard_types_seen: self
                .guard_types_seen
                .is_some_and(|t| sent.duration_since(t) < GUARD_TYPES_EVERY),
        };
        if queues.is_empty() {
            if let Some(r) = self.flush_pending().await {
                return Next::Stop(r);
            }
            return Next::Go((
                Ok(Reserved::Nothing {
                    skipped: vec![],
                    unreadable: vec![],
                    paused: vec![],
                    capped: vec![],
                    refused: vec![],
                }),
                None,
            ));
        }
        if let Some(next) = self.take_next(rid.clone(), queues, flags, sent).await {
            return next;
        }
        if self.take.is_some() {
            self.metrics.take("off");
        }
        let Some(mut p) = self.pending.take() else {
            let slot = self.slot();
            let reserved = store::reserve(&mut self.conn.clone(), &slot, &rid, queues, flags).await;
            self.note_guard_look(flags, sent, &reserved);
            return Next::Go((reserved, None));
        };
        // The last job's FINISH and this RESERVE in one round trip.
        let slot = self.slot();
        let fused = store::finish_and_reserve(
            &mut self.conn.clone(),
            &slot,
            &p.request(self.config.failure_backend),
            &p.holds(),
            &rid,
            queues,
            flags,
        )
        .await;
        match fused {
            // The FINISH landed; a RESERVE error is handled like any other.
            Ok((finished, reserved)) => {
                self.note_guard_look(flags, sent, &reserved);
                self.report_finish(&p, Some(finished), p.tried);
                Next::Go((reserved, None))
            }
            Err(e) if crate::conn::is_refusal(&e) => {
                // Refused before any write (S-6): not a resend. Flushed on its own, which
                // logs it once and parks the slot.
                self.pending = Some(p);
                match self.flush_pending().await {
                    Some(r) => Next::Stop(r),
                    None => Next::Again,
                }
            }
            // An outage, or a reply that could not be read (Failure::Unknown): the call may
            // have landed, FINISH and RESERVE both. The FINISH is sent again marked as a
            // resend (rid-checked, so it cannot end the slot's new reservation), and a
            // reservation it made is found by the next RESERVE (Reserved::Busy) and returned
            // to its queue.
            Err(e) => {
                p.tried = true;
                self.pending = Some(p);
                Next::Go((Err(e), None))
            }
        }
    }

    /// Remembers when a RESERVE that looked at the pause and cap keys' types found none of
    /// another type; one that found some (or reserved nothing: the idle path looks anyway)
    /// makes the next ones look too.
    pub(super) fn note_guard_look(
        &mut self,
        flags: ReserveFlags,
        sent: Instant,
        reserved: &redis::RedisResult<Reserved>,
    ) {
        match reserved {
            Ok(Reserved::Job { odd_guards, .. }) => {
                if *odd_guards {
                    self.guard_types_seen = None;
                } else if !flags.guard_types_seen {
                    self.guard_types_seen = Some(sent);
                }
            }
            _ => self.guard_types_seen = None,
        }
    }

    /// Counts and logs what RESERVE passed over: queues skipped by the counter rule and
    /// queue keys another tool made something other than a list (once per queue).
    fn nothing_reserved(&mut self, skipped: &[String], unreadable: &[String]) {
        self.metrics.queues_skipped(skipped);
        if !skipped.is_empty() {
            debug!(target: LOG_TARGET, skipped = ?skipped, "queues skipped: every job in them is locked");
        }
        for q in unreadable {
            if self.unreadable_warned.insert(q.clone()) {
                warn!(target: LOG_TARGET, queue = %q, key = %self.keys.queue(q), "queue key is not a list (another tool wrote it): passed over until it is one");
            }
        }
    }

    /// Logs, once per queue, a queue RESERVE refused because its cap key is spoiled (A-22, S-6).
    fn caps_refused(&mut self, refused: &[String]) {
        for q in refused {
            if self.cap_refused_warned.insert(q.clone()) {
                warn!(target: LOG_TARGET, queue = %q, key = %self.keys.cap(q), "queue cap key is not a number (written by hand?): the queue is passed over until it is mended");
            }
        }
    }

    /// Nothing reserved: waits up to `interval` for a push to a queue that was empty (not
    /// merely skipped, paused or a key of another type), for a new queue when the list has
    /// patterns, for a change of the pause keys when a queue was paused (A-20: the master
    /// wakes every waiting worker then), or for a stop or a pause.
    async fn idle_wait(
        &mut self,
        queues: &[String],
        skipped: &[String],
        unreadable: &[String],
        paused: &[String],
        control: &Control,
        dead: &CancellationToken,
    ) {
        self.nothing_reserved(skipped, unreadable);
        if !paused.is_empty() {
            debug!(target: LOG_TARGET, paused = ?paused, "queues paused: their jobs wait");
        }
        let keys: Vec<String> = queues
            .iter()
            .filter(|q| !skipped.contains(q) && !unreadable.contains(q) && !paused.contains(q))
            .map(|q| self.keys.queue(q))
            .collect();
        let follow = self.spec.is_dynamic() || !paused.is_empty();
        let mut paused = control.paused.subscribe();
        let stop = async {
            tokio::select! {
                _ = control.quit.cancelled() => {}
                _ = control.term.cancelled() => {}
                _ = dead.cancelled() => {}
                _ = paused.wait_for(|p| *p) => {}
            }
        };
        let interval = self.config.interval.get();
        self.idle
            .wait(&self.config.redis, &keys, follow, interval, stop)
            .await;
    }

    pub(super) async fn expand_queues(&mut self) -> redis::RedisResult<Vec<String>> {
        if !self.spec.is_dynamic() {
            return Ok(self.spec.expand(&[]));
        }
        let known: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.keys.queues())
            .query_async(&mut self.conn)
            .await?;
        Ok(self.spec.expand(&known))
    }

    pub(super) async fn return_stale(&mut self) {
        let fields: redis::RedisResult<(Option<String>, Option<String>)> = redis::cmd("HMGET")
            .arg(self.keys.inflight(&self.id.slot_key))
            .arg("rid")
            .arg("queue")
            .query_async(&mut self.conn)
            .await;
        if let Ok((Some(rid), Some(queue))) = fields {
            self.return_job(&rid, &queue).await;
        }
    }

    /// RETURN: a reservation that never started goes back to the head of its queue. If
    /// Redis refuses or is away, the job stays in its inflight record (S-6: RETURN changed
    /// nothing), where `status` shows it and recovery finds it; that is logged, once per job.
    /// A job an operator cancelled before it started is recorded as cancelled instead.
    pub(super) async fn return_job(&mut self, rid: &str, queue: &str) {
        let slot = self.slot();
        match store::move_back(&mut self.conn.clone(), &slot, rid, queue, None).await {
            Ok(store::MovedBack::Cancelled(request)) => {
                let started = std::time::Instant::now();
                let _ = self
                    .cancel_unstarted(rid, queue, None, started, &request)
                    .await;
            }
            Ok(_) => {}
            Err(e) => {
                error!(target: LOG_TARGET, step = "return", queue = %queue, slot = %self.id.slot_key, error = %e, "could not return an unstarted job to its queue; it stays in its inflight record for recovery");
            }
        }
    }
}

/// What the loop does next when a step, rather than Redis's answer, decides it.
pub(super) enum Next<T> {
    /// Go on with this.
    Go(T),
    /// Back to the top of the loop.
    Again,
    /// The worker stops.
    Stop(StopReason),
}
