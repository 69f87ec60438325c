//! The scheduler (scheduler-protocol.md): run by the master only (SC-8), it holds the gem's
//! master lock (SC-6 … SC-9), delivers resque-scheduler's due delayed items (SC-4, SC-5) and
//! fires the `[schedule.<name>]` tables (SC-10 … SC-14), only while it holds the lock.
//!
//! It goes by Redis's clock (`TIME`, read every [`CLOCK_READ_EVERY`] and carried forward on
//! this host's monotonic clock in between), not the host's wall clock (SC-4, SC-12). Its cost
//! when nothing is due: one `ZRANGEBYSCORE … LIMIT` a second, a `TIME` every 30 s and a lock
//! renewal every few seconds (a standby: one `sched_lock.lua` acquire a second).

pub mod deliver;
pub mod ops;

use crate::config::{Config, Schedule};
use crate::conn::Manager;
use crate::resque::keys::Keys;
use crate::store::schedule as st;
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// A tick this young is fired even with `misfire_grace = 0`: it is on time, not missed.
const ON_TIME: i64 = 5;

/// How long a lock key Redis refuses (another type: E-3, S-6) is left alone before the next
/// try: it is reported once, not resent in a loop.
const LOCK_REFUSED_RETRY: Duration = Duration::from_secs(60);

/// The value locketd writes into the lock key: never a Ruby process's `<host>:<pid>` (SC-8).
pub fn lock_value() -> String {
    format!("locketd-{}:{}", crate::host::hostname(), std::process::id())
}

/// Unix seconds now, by this host's clock (the scheduler itself goes by Redis's clock).
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The work payload of a schedule's job: `{"class":…,"args":…}`.
pub fn payload(s: &Schedule) -> String {
    format!(
        "{{\"class\":{},\"args\":{}}}",
        serde_json::Value::String(s.class.clone()),
        s.args_json
    )
}

/// The running scheduler task: give it new configs (HUP), stop it with the master's token.
pub struct Handle {
    tx: watch::Sender<Config>,
    join: tokio::task::JoinHandle<()>,
}

impl Handle {
    /// A reloaded config: its schedules, lock settings and `enabled` take effect at once.
    pub fn reload(&self, config: &Config) {
        let _ = self.tx.send(config.clone());
    }

    /// Waits until the task released its lock and ended (after `stop` was cancelled).
    pub async fn join(self) {
        let _ = self.join.await;
    }
}

/// Starts the scheduler task; it ends (releasing its lock) when `stop` is cancelled.
pub fn spawn(config: &Config, stop: CancellationToken) -> Handle {
    let (tx, rx) = watch::channel(config.clone());
    let join = tokio::spawn(async move {
        let mut s = Scheduler::new(rx, stop);
        s.run().await;
    });
    Handle { tx, join }
}

struct Held {
    /// Past this instant the lock may have expired: stop delivering (SC-9).
    deadline: Instant,
    next_renew: Instant,
}

struct Scheduler {
    rx: watch::Receiver<Config>,
    stop: CancellationToken,
    config: Config,
    schedules: Vec<Schedule>,
    conn: Option<(String, Manager)>,
    value: String,
    held: Option<Held>,
    next_acquire: Instant,
    /// Per schedule: the next tick to fire.
    next: HashMap<String, i64>,
    delivery: deliver::State,
    last_error: Option<(String, Instant)>,
    /// A new config arrived (HUP) and is not applied yet.
    reload_pending: bool,
    /// The next read of the delayed queue (just after the next whole second).
    next_poll: Instant,
    /// Redis refuses the lock's commands (its key of another type): the refusal, logged once.
    lock_refused: Option<String>,
    /// Redis's clock minus this host's, in milliseconds, as last read (`TIME`).
    offset_ms: i64,
    /// The last read of Redis's clock: when (this host's monotonic clock) and what it said
    /// (Unix ms).
    clock: Option<(Instant, i64)>,
}

/// How long a read of Redis's clock is carried forward on the monotonic clock before it is
/// read again: a jump of this host's wall clock changes nothing, and an idle scheduler does
/// not spend a command a second on it.
const CLOCK_READ_EVERY: Duration = Duration::from_secs(30);

impl Scheduler {
    fn new(rx: watch::Receiver<Config>, stop: CancellationToken) -> Scheduler {
        let config = rx.borrow().clone();
        let schedules = config.schedules().unwrap_or_default();
        Scheduler {
            rx,
            stop,
            config,
            schedules,
            conn: None,
            value: lock_value(),
            held: None,
            next_acquire: Instant::now(),
            next: HashMap::new(),
            delivery: deliver::State::default(),
            last_error: None,
            reload_pending: false,
            next_poll: Instant::now(),
            lock_refused: None,
            offset_ms: 0,
            clock: None,
        }
    }

    fn keys(&self) -> Keys {
        Keys::new(&self.config.namespace)
    }

    fn lock_key(&self) -> String {
        self.config.scheduler.lock_key(&self.config.namespace)
    }

    fn ttl(&self) -> Duration {
        self.config.scheduler.lock_ttl.get()
    }

    /// Logs a Redis error: one line per outage (then at most one a minute while it lasts),
    /// not one per retry.
    fn error(&mut self, what: &str, e: &dyn std::fmt::Display) {
        let text = format!("{what}: {e}");
        let repeat = self
            .last_error
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() < Duration::from_secs(60));
        if !repeat {
            warn!(target: "locketd::scheduler", "{text}; retrying every second");
            self.last_error = Some((text, Instant::now()));
        } else {
            debug!(target: "locketd::scheduler", "{text}");
        }
    }

    /// Redis answered the lock's command: an outage logged by `error` is over.
    fn answered(&mut self) {
        if self.last_error.take().is_some() {
            info!(target: "locketd::scheduler", "Redis answers the scheduler again");
        }
    }

    async fn connection(&mut self) -> Option<Manager> {
        let url = self.config.redis.clone();
        if let Some((u, c)) = &self.conn {
            if *u == url {
                return Some(c.clone());
            }
        }
        match crate::conn::connect(&url, Duration::from_secs(5)).await {
            Ok(c) => {
                self.conn = Some((url, c.clone()));
                Some(c)
            }
            Err(e) => {
                self.error("scheduler: connecting to Redis", &e);
                None
            }
        }
    }

    async fn run(&mut self) {
        info!(target: "locketd::scheduler", enabled = self.config.scheduler.enabled,
            schedules = self.schedules.len(), lock = %self.lock_key(), "scheduler started");
        note_utc_default(&self.schedules);
        loop {
            if self.stop.is_cancelled() {
                break;
            }
            if std::mem::take(&mut self.reload_pending) || self.rx.has_changed().unwrap_or(false) {
                self.reload().await;
            }
            if self.config.scheduler.enabled {
                self.step().await;
            } else if self.held.is_some() {
                self.release().await;
            }
            let wake = self.wake_at();
            tokio::select! {
                _ = self.stop.cancelled() => break,
                r = self.rx.changed() => {
                    if r.is_err() {
                        break;
                    }
                    self.reload_pending = true;
                }
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
        }
        self.release().await;
        info!(target: "locketd::scheduler", "scheduler stopped");
    }

    async fn reload(&mut self) {
        let new = self.rx.borrow_and_update().clone();
        let lock_moved = new.scheduler.lock_key(&new.namespace) != self.lock_key()
            || new.redis != self.config.redis;
        if lock_moved {
            self.release().await;
        }
        self.config = new;
        match self.config.schedules() {
            Ok(s) => self.schedules = s,
            Err(e) => warn!(target: "locketd::scheduler", error = %e, "HUP: schedules kept"),
        }
        self.next.clear();
        info!(target: "locketd::scheduler", schedules = self.schedules.len(),
            enabled = self.config.scheduler.enabled, "HUP: schedules reloaded");
        note_utc_default(&self.schedules);
        if self.held.is_some() {
            self.on_became_master().await;
        }
    }

    /// The next instant to look: the next whole second (a due item waits at most that long),
    /// earlier for a renewal.
    fn wake_at(&self) -> Instant {
        let mut wake = Instant::now() + to_next_second(self.offset_ms);
        if let Some(h) = &self.held {
            wake = wake.min(h.next_renew.max(Instant::now()));
        }
        wake
    }

    async fn step(&mut self) {
        let Some(mut conn) = self.connection().await else {
            return;
        };
        self.keep_lock(&mut conn).await;
        if self.held.is_none() {
            return;
        }
        // A wake-up for a renewal only renews: the delayed queue is read once a second.
        if Instant::now() + Duration::from_millis(100) < self.next_poll {
            return;
        }
        self.next_poll = Instant::now() + to_next_second(self.offset_ms);
        let Some(now) = self.redis_now(&mut conn).await else {
            return;
        };
        let keys = self.keys();
        // A long drain stops for the next renewal (SC-8) and goes on after it.
        let until = self
            .held
            .as_ref()
            .map_or_else(Instant::now, |h| h.deadline.min(h.next_renew));
        if let Err(e) = self.delivery.pass(&mut conn, &keys, now, until).await {
            self.error("scheduler: delivering delayed items", &e);
        }
        if self
            .held
            .as_ref()
            .is_some_and(|h| Instant::now() < h.deadline)
        {
            self.fire_due(&mut conn, now).await;
        }
    }

    /// Redis's clock in Unix seconds (SC-12): every scheduler of the fleet goes by it, so a
    /// host whose clock is off (or jumped) neither fires ticks early nor delivers items early.
    /// None when Redis did not answer.
    async fn redis_now(&mut self, conn: &mut Manager) -> Option<i64> {
        if let Some((at, ms)) = self.clock {
            let since = at.elapsed();
            if since < CLOCK_READ_EVERY {
                let ms = ms + i64::try_from(since.as_millis()).unwrap_or(i64::MAX / 2);
                return Some(ms.div_euclid(1000));
            }
        }
        let sent = local_ms();
        let sent_at = Instant::now();
        match st::redis_time_ms(conn).await {
            Ok(ms) => {
                let back = local_ms();
                self.offset_ms = ms - (sent + back) / 2;
                // Carried forward from the moment half way through the round trip.
                self.clock = Some((sent_at + sent_at.elapsed() / 2, ms));
                Some(ms.div_euclid(1000))
            }
            Err(e) => {
                self.clock = None;
                self.error("scheduler: reading Redis's clock", &e);
                None
            }
        }
    }

    /// SC-8, SC-9: take the lock when free, renew it well inside its TTL, and give it up
    /// locally once a renewal has not succeeded for two thirds of the TTL.
    async fn keep_lock(&mut self, conn: &mut Manager) {
        let key = self.lock_key();
        let ttl = self.ttl();
        let secs = ttl.as_secs().max(1);
        let now = Instant::now();
        if let Some(h) = &self.held {
            if now >= h.deadline {
                warn!(target: "locketd::scheduler", lock = %key,
                    "scheduler lock not renewed in time: stopped delivering and firing (SC-9)");
                self.held = None;
            } else if now >= h.next_renew {
                let started = Instant::now();
                match st::lock_renew(conn, &key, &self.value, secs).await {
                    Ok(st::Renewed::Ours) => {
                        self.answered();
                        self.held = Some(Held {
                            deadline: started + ttl * 2 / 3,
                            next_renew: started + renew_every(ttl),
                        })
                    }
                    Ok(st::Renewed::Other) => {
                        self.answered();
                        warn!(target: "locketd::scheduler", lock = %key,
                            "scheduler lock lost to another holder: now a standby");
                        self.held = None;
                    }
                    Ok(st::Renewed::Gone) => {
                        self.answered();
                        info!(target: "locketd::scheduler", lock = %key,
                            "scheduler lock key gone (expired, or Redis restarted): taking it again");
                        self.held = None;
                    }
                    Err(e) if crate::conn::is_refusal(&e) => {
                        self.lock_refused(&key, &e);
                        self.held = None;
                    }
                    Err(e) => {
                        self.error("scheduler: renewing the lock", &e);
                        if let Some(h) = self.held.as_mut() {
                            h.next_renew = Instant::now() + Duration::from_millis(500);
                        }
                    }
                }
            }
        }
        if self.held.is_none() && now >= self.next_acquire {
            self.next_acquire = now + Duration::from_secs(1);
            let started = Instant::now();
            let got = st::lock_acquire(conn, &key, &self.value, secs).await;
            if got.is_ok() {
                self.answered();
                if self.lock_refused.take().is_some() {
                    info!(target: "locketd::scheduler", lock = %key, "the scheduler lock key is usable again");
                }
            }
            match got {
                Ok(true) => {
                    info!(target: "locketd::scheduler", lock = %key, value = %self.value,
                        "scheduler lock taken: this daemon delivers and fires schedules");
                    self.held = Some(Held {
                        deadline: started + ttl * 2 / 3,
                        next_renew: started + renew_every(ttl),
                    });
                    self.next.clear();
                    self.on_became_master().await;
                }
                Ok(false) => {
                    debug!(target: "locketd::scheduler", lock = %key, "lock held elsewhere")
                }
                Err(e) if crate::conn::is_refusal(&e) => self.lock_refused(&key, &e),
                Err(e) => self.error("scheduler: taking the lock", &e),
            }
        }
    }

    /// Redis refused the lock's script (a key of another type, S-6): logged once, tried
    /// again in a minute, not a scheduler meanwhile.
    fn lock_refused(&mut self, key: &str, e: &redis::RedisError) {
        let text = e.to_string();
        if self.lock_refused.as_deref() != Some(text.as_str()) {
            warn!(target: "locketd::scheduler", lock = %key, error = %text,
                "Redis refused the scheduler lock's script: no delivery or firing by this daemon until the key is mended; tried again every minute");
            self.lock_refused = Some(text);
        }
        self.next_acquire = Instant::now() + LOCK_REFUSED_RETRY;
    }

    async fn release(&mut self) {
        if self.held.take().is_none() {
            return;
        }
        let key = self.lock_key();
        if let Some((_, mut c)) = self.conn.clone() {
            match tokio::time::timeout(
                Duration::from_secs(3),
                st::lock_release(&mut c, &key, &self.value),
            )
            .await
            {
                Ok(Ok(true)) => {
                    info!(target: "locketd::scheduler", lock = %key, "scheduler lock released")
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    warn!(target: "locketd::scheduler", error = %e, "releasing the scheduler lock")
                }
                Err(_) => {
                    warn!(target: "locketd::scheduler", "releasing the scheduler lock: timed out")
                }
            }
        }
    }

    /// On taking the lock (or a reload while holding it): publish (SC-14), then fire each
    /// schedule's latest tick if younger than `misfire_grace` (SC-13) and plan the next.
    async fn on_became_master(&mut self) {
        let Some(mut conn) = self.connection().await else {
            return;
        };
        if self.config.scheduler.publish {
            if let Err(e) = ops::publish(&mut conn, &self.keys(), &self.schedules).await {
                self.error("scheduler: publishing schedules", &e);
            }
        }
        let Some(now) = self.redis_now(&mut conn).await else {
            return;
        };
        let grace = self.grace();
        for s in self.schedules.clone() {
            if let Some(prev) = s.prev_tick(now) {
                if now - prev <= grace {
                    if self.fire(&mut conn, &s, prev).await == Fire::Again {
                        // Redis could not take it now: tried again by `fire_due`, while it is
                        // younger than the grace.
                        self.next.insert(s.name.clone(), prev);
                        continue;
                    }
                } else {
                    debug!(target: "locketd::scheduler", schedule = %s.name, tick = prev,
                        "the latest tick is older than misfire_grace: not fired");
                }
            }
            if let Some(n) = s.next_tick(now) {
                self.next.insert(s.name.clone(), n);
            }
        }
    }

    fn grace(&self) -> i64 {
        (self.config.scheduler.misfire_grace.get().as_secs() as i64).max(ON_TIME)
    }

    async fn fire_due(&mut self, conn: &mut Manager, now: i64) {
        let grace = self.grace();
        for s in self.schedules.clone() {
            let next = match self.next.get(&s.name) {
                Some(n) => *n,
                None => match s.next_tick(now) {
                    Some(n) => {
                        self.next.insert(s.name.clone(), n);
                        n
                    }
                    None => continue,
                },
            };
            if next > now {
                continue;
            }
            // The most recent tick that is due: one fire, never a burst (SC-13).
            let tick = s.prev_tick(now).unwrap_or(next).max(next);
            if tick > next {
                info!(target: "locketd::scheduler", schedule = %s.name, from = next, to = tick,
                    "ticks missed (the scheduler was busy or paused): firing only the latest");
            }
            if now - tick <= grace {
                if self.fire(conn, &s, tick).await == Fire::Again {
                    // Redis could not take it now: the tick is tried again at the next look,
                    // while it is younger than the grace.
                    continue;
                }
            } else {
                warn!(target: "locketd::scheduler", schedule = %s.name, tick,
                    "tick older than misfire_grace: skipped");
            }
            match s.next_tick(now) {
                Some(n) => self.next.insert(s.name.clone(), n),
                None => self.next.remove(&s.name),
            };
        }
    }

    /// Fires `tick` of `s`; [`Fire::Again`] when Redis could not take it now (an outage,
    /// [`crate::conn::classify`]). A refusal is logged and counts as done: it is not retried
    /// in a loop.
    async fn fire(&mut self, conn: &mut Manager, s: &Schedule, tick: i64) -> Fire {
        let keys = self.keys();
        let at = UNIX_EPOCH + Duration::from_millis((local_ms() + self.offset_ms).max(0) as u64);
        let stamp = crate::resque::time::started_at(at);
        match st::fire(
            conn,
            &keys,
            &s.name,
            Some(tick),
            &s.queue,
            &payload(s),
            &stamp,
        )
        .await
        {
            Ok(st::Fired::Yes) => {
                info!(target: "locketd::scheduler", schedule = %s.name, tick,
                    queue = %s.queue, class = %s.class, "schedule fired");
                Fire::Done
            }
            Ok(st::Fired::Already) => {
                debug!(target: "locketd::scheduler", schedule = %s.name, tick,
                    "tick fired already");
                Fire::Done
            }
            Ok(st::Fired::AheadOfRedis) => {
                // This scheduler reads Redis's clock each second, so only a clock read before
                // Redis's own jumped back gets here: the tick is looked at again.
                self.error(
                    &format!("scheduler: firing {:?}", s.name),
                    &format!("tick {tick} is ahead of Redis's clock: not fired (SC-12)"),
                );
                Fire::Again
            }
            Err(e) => {
                self.error(&format!("scheduler: firing {:?}", s.name), &e);
                // A refusal (a key of another type, S-6) is deterministic: not retried. An
                // outage (the connection, READONLY after a failover, LOADING, OOM, ...) is:
                // the tick is tried again at the next look, while younger than the grace.
                if crate::conn::is_refusal(&e) {
                    Fire::Done
                } else {
                    Fire::Again
                }
            }
        }
    }
}

/// What became of a tick sent to FIRE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fire {
    /// Fired, fired already, or refused for good (reported): the next tick is planned.
    Done,
    /// Redis could not take it now: tried again at the next look, within the grace.
    Again,
}

/// On a host whose zone is not UTC, names the cron schedules without `tz`: they are read in
/// UTC (SC-11), which a user who meant the host's zone wants to know.
fn note_utc_default(schedules: &[Schedule]) {
    let offset = chrono::Local::now().offset().local_minus_utc();
    if offset == 0 {
        return;
    }
    let names: Vec<&str> = schedules
        .iter()
        .filter(|s| s.config.cron.is_some() && s.config.tz.is_none())
        .map(|s| s.name.as_str())
        .collect();
    if !names.is_empty() {
        warn!(target: "locketd::scheduler", schedules = ?names, host_utc_offset_secs = offset,
            "cron schedules without tz are read in UTC, not this host's zone: set tz to keep local times");
    }
}

/// This host's clock in Unix milliseconds.
fn local_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// From now to just after the next whole second of Redis's clock (this host's plus
/// `offset_ms`): an item due at second T is looked for a few milliseconds after T.
fn to_next_second(offset_ms: i64) -> Duration {
    let into = (local_ms() + offset_ms).rem_euclid(1000) as u64;
    Duration::from_millis(1000 - into + 5)
}

/// How often a held lock is renewed: every sixth of its TTL, at most every 5 s (the gem's
/// loop), at least every 250 ms.
fn renew_every(ttl: Duration) -> Duration {
    (ttl / 6).clamp(Duration::from_millis(250), Duration::from_secs(5))
}
