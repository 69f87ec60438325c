//! Instant pickup on every queue: the master watches the queues of its idle workers and wakes
//! one as soon as a job is pushed to any of them.
//!
//! Each worker process gets a pickup link at spawn (a socket pair, `worker/pickup.rs`). When a
//! RESERVE pass finds nothing, the worker sends `wait` with the queue keys that were empty and
//! waits for a wake-up, `interval` at most. For every key some waiting worker names, the master
//! holds one blocking connection issuing `BLMOVE key key RIGHT RIGHT 30`: it returns as soon as
//! the list is not empty, and moves its tail element onto its own tail, so the queue is left as
//! it was (nothing is taken, nothing lives only in memory; RESERVE still reserves). The master
//! then wakes the worker that has waited longest among those that named the key, and issues
//! no BLMOVE on that key until the woken worker answers (`busy`: it reserved a job; a new
//! `wait`: it found nothing; `leave`; or a second without an answer). One push wakes one worker,
//! and a queue that is not empty never makes BLMOVE return in a loop: a key is watched only
//! while a worker waits on it, and a worker waits again only after a pass of its own (whose
//! fruitless wake-ups are capped, `worker/idle.rs`).
//!
//! Queues matched by patterns (`*`, `mail*`, `!skip`) appear as jobs are pushed to them: a
//! Resque client adds each new queue to `<ns>:queues` before its first job. The master follows
//! that set with server-assisted client tracking (`CLIENT TRACKING ON BCAST PREFIX
//! <ns>:queues`, on a RESP3 connection: one connection, no command while idle, no server-wide
//! setting changed, unlike keyspace notifications, which need CONFIG SET and cost every client's
//! writes) and wakes the waiting workers with patterns when it changes: their next pass expands
//! the patterns again and names the new queue in their next `wait`. Where tracking is refused
//! (Redis < 6.0, an ACL, a proxy), it reads `SMEMBERS <ns>:queues` once a second instead, only
//! while such a worker waits.
//!
//! The same link carries the lease backstop of finding #8 (`watchdog.rs`): a worker reports each
//! locked job's handler group and the local end of its lease on every change, and the run's
//! end; the master keeps a watchdog entry per run in its own process and kills the group when
//! that end passes, so a frozen worker's handler never outlives its lease.
//!
//! Cost while idle: a BLMOVE per watched queue every 30 s, and a worker's own pass every
//! `interval`; connections: one per watched queue (at most [`MAX_WATCHED`]) and one for the
//! tracking. Errors (Redis away, OOM, a failover) back off from 1 s to 30 s per connection; a
//! BLMOVE the server refuses for good (NOPERM, Redis < 6.2) is tried again after 5 minutes.
//! Each is logged once, not once per queue; the workers' `interval` is the fallback meanwhile.

use crate::worker::pickup::{wake_line, Report, MAX_LINE};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

mod tracking;
use tracking::track_queue_set;

/// The target of this file's log lines.
const LOG_TARGET: &str = "locketd::pickup";
/// BLMOVE's own timeout (seconds): one command per watched queue per this while idle.
const BLOCK_SECS: u64 = 30;
/// The most queue keys watched at once; waiting workers' other queues wait for `interval`.
pub(super) const MAX_WATCHED: usize = 64;
/// How long a woken worker has to answer before its key is watched again for the others.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);
/// A watcher no worker has wanted for this long closes its connection.
const UNWANTED_FOR: Duration = Duration::from_secs(60);
/// Wake-ups for changes of the queue set: at most this many a second; a change past them is
/// answered at the second's end (so a churning set never wakes workers in a loop).
const CHANGES_PER_SECOND: u32 = 10;
const SECOND: Duration = Duration::from_secs(1);
/// The backoff of a failing connection.
const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Where the watched queues live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Settings {
    /// The Redis URL.
    pub redis: String,
    /// The namespace (`<ns>:queues`).
    pub namespace: String,
    /// The queue list has patterns: follow `<ns>:queues`.
    pub glob: bool,
}

impl Settings {
    pub(super) fn of(config: &crate::config::Config) -> Settings {
        Settings {
            redis: config.redis.clone(),
            namespace: config.namespace.clone(),
            glob: crate::resque::patterns::QueueSpec::from_list(&config.queues.0)
                .is_ok_and(|s| s.is_dynamic()),
        }
    }
}

/// The master's pickup task; dropped (or [`Pickup::stop`]ped), it closes every connection.
pub(super) struct Pickup {
    tx: mpsc::UnboundedSender<Ev>,
    _task: Task,
}

enum Ev {
    Attach {
        pid: u32,
        writer: OwnedWriteHalf,
    },
    Report {
        pid: u32,
        report: Report,
    },
    Gone {
        pid: u32,
    },
    Pushed {
        key: String,
    },
    QueuesChanged,
    /// A pause key (`<ns>:pause:*`, A-20) was set or deleted: every waiting worker passes
    /// again, so a resumed queue's jobs start at once.
    PauseChanged,
    Reload(Settings),
}

impl Pickup {
    pub(super) fn start(settings: Settings) -> Pickup {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = State::new(settings, tx.clone());
        Pickup {
            tx,
            _task: Task(tokio::spawn(state.run(rx))),
        }
    }

    /// Takes the master's end of a new worker's link.
    pub(super) fn attach(&self, pid: u32, stream: tokio::net::UnixStream) {
        let (read, writer) = stream.into_split();
        let _ = self.tx.send(Ev::Attach { pid, writer });
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.len() > MAX_LINE {
                    continue;
                }
                match serde_json::from_str::<Report>(&line) {
                    Ok(report) => {
                        if tx.send(Ev::Report { pid, report }).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        debug!(target: LOG_TARGET, pid, error = %e, "unreadable pickup report")
                    }
                }
            }
            let _ = tx.send(Ev::Gone { pid });
        });
    }

    /// A HUP's new Redis, namespace or queue list.
    pub(super) fn reload(&self, settings: Settings) {
        let _ = self.tx.send(Ev::Reload(settings));
    }
}

/// A task aborted when dropped.
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Proc {
    writer: OwnedWriteHalf,
    waiting: Option<Waiting>,
}

struct Waiting {
    seq: u64,
    keys: Vec<String>,
    glob: bool,
    since: Instant,
}

/// What the master tells a key's watcher: watch (`on`), and how many of its elements the
/// master has handled (a watcher that saw one waits until it is handled before blocking
/// again, so one push is never reported twice).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Want {
    on: bool,
    acked: u64,
}

struct Watcher {
    want: watch::Sender<Want>,
    unwanted_since: Option<Instant>,
    _task: Task,
}

struct State {
    settings: Settings,
    tx: mpsc::UnboundedSender<Ev>,
    procs: BTreeMap<u32, Proc>,
    watchers: HashMap<String, Watcher>,
    /// Keys whose woken worker has not answered yet: the worker and the answer's deadline.
    pending: HashMap<String, (u32, Instant)>,
    /// Some worker with patterns waits (the tracker's SMEMBERS fallback polls only then).
    glob_wanted: watch::Sender<bool>,
    tracker: Option<Task>,
    /// Wake-ups for changes of the queue set in the current second (its start, how many),
    /// and whether one more is due at its end (and for every waiting worker: a pause change).
    changes: Option<(Instant, u32)>,
    changed_due: bool,
    changed_all: bool,
    /// Shared by the watchers: one log line per outage, not one per queue.
    failing: Arc<AtomicBool>,
    refused: Arc<AtomicBool>,
    full_warned: bool,
    /// The lease backstops of running jobs, per worker pid and run number.
    leases: HashMap<(u32, u64), crate::watchdog::Watch>,
}

impl State {
    fn new(settings: Settings, tx: mpsc::UnboundedSender<Ev>) -> State {
        let mut s = State {
            settings,
            tx,
            procs: BTreeMap::new(),
            watchers: HashMap::new(),
            pending: HashMap::new(),
            glob_wanted: watch::Sender::new(false),
            tracker: None,
            changes: None,
            changed_due: false,
            changed_all: false,
            failing: Arc::default(),
            refused: Arc::default(),
            full_warned: false,
            leases: HashMap::new(),
        };
        s.start_tracker();
        s
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ev>) {
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => self.on(ev),
                    None => return,
                },
                _ = tokio::time::sleep_until(deadline) => {}
            }
            self.on_time();
            self.recompute();
        }
    }

    fn start_tracker(&mut self) {
        // Always: the pause keys are followed on the same connection.
        self.tracker = Some(Task(tokio::spawn(track_queue_set(
            self.settings.clone(),
            self.glob_wanted.subscribe(),
            self.tx.clone(),
        ))));
    }

    fn on(&mut self, ev: Ev) {
        match ev {
            Ev::Attach { pid, writer } => {
                self.procs.insert(
                    pid,
                    Proc {
                        writer,
                        waiting: None,
                    },
                );
            }
            Ev::Report {
                pid,
                report:
                    Report::Lease {
                        serial,
                        pgid,
                        until_ns,
                    },
            } => self.lease(pid, serial, pgid, until_ns),
            Ev::Report {
                pid,
                report: Report::Group { serial, pgid },
            } => {
                // H-18: a job group of a guarded run (none guarded: nothing to add it to).
                if let Some(w) = self.leases.get(&(pid, serial)) {
                    if !w.guard_job_group(pgid) {
                        debug!(target: LOG_TARGET, pid, pgid, "a reported job group is not the handler's child's (gone already?): not guarded");
                    }
                }
            }
            Ev::Report {
                pid,
                report: Report::Forget { serial },
            } => {
                self.leases.remove(&(pid, serial));
            }
            Ev::Report { pid, report } => {
                self.answered(pid);
                let Some(p) = self.procs.get_mut(&pid) else {
                    return;
                };
                match report {
                    Report::Wait { seq, keys, glob } => {
                        p.waiting = Some(Waiting {
                            seq,
                            keys,
                            glob,
                            since: Instant::now(),
                        });
                    }
                    Report::Busy
                    | Report::Lease { .. }
                    | Report::Group { .. }
                    | Report::Forget { .. } => {}
                    Report::Leave => p.waiting = None,
                }
            }
            Ev::Gone { pid } => {
                self.answered(pid);
                self.procs.remove(&pid);
                // The worker exited: its adopted handlers are killed by `kill_orphans`.
                self.leases.retain(|(p, _), _| *p != pid);
            }
            Ev::Pushed { key } => {
                if let Some(w) = self.watchers.get(&key) {
                    w.want.send_modify(|w| w.acked += 1);
                }
                if self.pending.contains_key(&key) {
                    return;
                }
                let first = self
                    .procs
                    .iter()
                    .filter_map(|(pid, p)| Some((*pid, p.waiting.as_ref()?)))
                    .filter(|(_, w)| w.keys.contains(&key))
                    .min_by_key(|(_, w)| w.since)
                    .map(|(pid, _)| pid);
                if let Some(pid) = first {
                    self.wake(pid);
                    self.pending
                        .insert(key, (pid, Instant::now() + ANSWER_WITHIN));
                }
            }
            Ev::QueuesChanged | Ev::PauseChanged => {
                let all = matches!(ev, Ev::PauseChanged);
                let now = Instant::now();
                match self.changes {
                    Some((start, n)) if now < start + SECOND && n >= CHANGES_PER_SECOND => {
                        self.changed_due = true;
                        self.changed_all |= all;
                    }
                    _ => self.wake_globs(now, all),
                }
            }
            Ev::Reload(settings) => {
                if settings != self.settings {
                    info!(target: LOG_TARGET, "HUP: the queue watchers follow the new config");
                    self.settings = settings;
                    self.watchers.clear();
                    self.pending.clear();
                    self.start_tracker();
                }
            }
        }
    }

    /// A worker's report of a locked run's group and lease end: the master's guard over it
    /// (kept only for a group that is the worker's handler's). The end only moves later: a
    /// report that crossed a newer one changes nothing.
    fn lease(&mut self, pid: u32, serial: u64, pgid: i32, until_ns: Option<u64>) {
        let watch = match self.leases.entry((pid, serial)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                match crate::watchdog::Watch::guard(pid, serial, pgid) {
                    Some(w) => v.insert(w),
                    None => {
                        debug!(target: LOG_TARGET, pid, pgid, "a reported handler group is not the worker's (gone already?): not guarded");
                        return;
                    }
                }
            }
        };
        match until_ns {
            Some(ns) => watch.kill_later(crate::watchdog::instant_of(ns)),
            None => watch.kill_later(std::time::Instant::now() + Duration::from_secs(86400 * 365)),
        }
    }

    /// The process answered a wake-up (or left): its keys are watched again for the others.
    fn answered(&mut self, pid: u32) {
        self.pending.retain(|_, (p, _)| *p != pid);
    }

    fn wake(&mut self, pid: u32) {
        let Some(p) = self.procs.get_mut(&pid) else {
            return;
        };
        let Some(w) = p.waiting.take() else {
            return;
        };
        let line = wake_line(w.seq);
        // Never blocks the task: a wake-up that does not fit is left to the worker's interval.
        match p.writer.try_write(line.as_bytes()) {
            Ok(n) if n == line.len() => {}
            other => debug!(target: LOG_TARGET, pid, result = ?other, "wake-up not written"),
        }
    }

    /// Wakes the waiting workers with patterns (`all`: every waiting worker).
    fn wake_globs(&mut self, now: Instant, all: bool) {
        self.changes = match self.changes {
            Some((start, n)) if now < start + SECOND => Some((start, n + 1)),
            _ => Some((now, 1)),
        };
        self.changed_due = false;
        self.changed_all = false;
        let pids: Vec<u32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.waiting.as_ref().is_some_and(|w| all || w.glob))
            .map(|(pid, _)| *pid)
            .collect();
        if !pids.is_empty() {
            debug!(target: LOG_TARGET, workers = pids.len(), "the queue set changed: waking the workers with patterns");
        }
        for pid in pids {
            self.wake(pid);
        }
    }

    fn next_deadline(&self) -> Instant {
        let mut next = Instant::now() + Duration::from_secs(3600);
        for (_, at) in self.pending.values() {
            next = next.min(*at);
        }
        if let (true, Some((start, _))) = (self.changed_due, self.changes) {
            next = next.min(start + SECOND);
        }
        for w in self.watchers.values() {
            if let Some(since) = w.unwanted_since {
                next = next.min(since + UNWANTED_FOR);
            }
        }
        next
    }

    fn on_time(&mut self) {
        let now = Instant::now();
        self.pending.retain(|_, (_, at)| *at > now);
        if let (true, Some((start, _))) = (self.changed_due, self.changes) {
            if now >= start + SECOND {
                self.wake_globs(now, self.changed_all);
            }
        }
        self.watchers
            .retain(|_, w| w.unwanted_since.is_none_or(|s| now < s + UNWANTED_FOR));
    }

    /// Watches exactly the keys some waiting worker names and no woken worker still holds.
    fn recompute(&mut self) {
        let mut wanted: Vec<&String> = Vec::new();
        let mut seen = HashSet::new();
        let mut glob = false;
        for w in self.procs.values().filter_map(|p| p.waiting.as_ref()) {
            glob |= w.glob;
            for k in &w.keys {
                if !self.pending.contains_key(k) && seen.insert(k) {
                    wanted.push(k);
                }
            }
        }
        if wanted.len() > MAX_WATCHED && !self.full_warned {
            self.full_warned = true;
            warn!(target: LOG_TARGET, queues = wanted.len(), max = MAX_WATCHED, "idle workers wait on more queues than are watched; the others are found at the next pass (interval)");
        }
        wanted.truncate(MAX_WATCHED);
        let wanted: HashSet<String> = wanted.into_iter().cloned().collect();
        let now = Instant::now();
        for (key, w) in &mut self.watchers {
            let on = wanted.contains(key);
            w.want
                .send_if_modified(|w| std::mem::replace(&mut w.on, on) != on);
            if on {
                w.unwanted_since = None;
            } else {
                w.unwanted_since.get_or_insert(now);
            }
        }
        for key in wanted {
            if !self.watchers.contains_key(&key) {
                let want = watch::Sender::new(Want { on: true, acked: 0 });
                let task = Task(tokio::spawn(watch_key(
                    self.settings.redis.clone(),
                    key.clone(),
                    want.subscribe(),
                    self.tx.clone(),
                    self.failing.clone(),
                    self.refused.clone(),
                )));
                self.watchers.insert(
                    key,
                    Watcher {
                        want,
                        unwanted_since: None,
                        _task: task,
                    },
                );
            }
        }
        self.glob_wanted
            .send_if_modified(|g| std::mem::replace(g, glob) != glob);
    }
}

/// One queue key's watcher: BLMOVE on its own connection while wanted.
async fn watch_key(
    url: String,
    key: String,
    mut want: watch::Receiver<Want>,
    tx: mpsc::UnboundedSender<Ev>,
    failing: Arc<AtomicBool>,
    refused: Arc<AtomicBool>,
) {
    let mut conn = None;
    let mut backoff = MIN_BACKOFF;
    let mut seen = 0u64;
    // F-2 (5): a failover moves this watch to the new primary at once.
    let mut moves = crate::conn::Moves::of(&url);
    loop {
        if want.wait_for(|w| w.on && w.acked >= seen).await.is_err() {
            return;
        }
        if conn.is_none() {
            conn = blocking_connection(&url).await;
            if conn.is_none() {
                if !failing.swap(true, Ordering::Relaxed) {
                    warn!(target: LOG_TARGET, "cannot connect to watch the queues; idle workers poll every interval until Redis answers");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let mut cmd = redis::cmd("BLMOVE");
        cmd.arg(&key)
            .arg(&key)
            .arg("RIGHT")
            .arg("RIGHT")
            .arg(BLOCK_SECS);
        let r = tokio::select! {
            r = cmd.query_async::<Option<redis::Value>>(c) => Some(r),
            _ = moves.moved() => None,
        };
        let Some(r) = r else {
            conn = None;
            // Anything pushed meanwhile was pushed to the new primary: wake a worker to look
            // there (counted like a push, so the next BLMOVE waits for its answer).
            seen += 1;
            if tx.send(Ev::Pushed { key: key.clone() }).is_err() {
                return;
            }
            continue;
        };
        match r {
            Ok(found) => {
                backoff = MIN_BACKOFF;
                if failing.swap(false, Ordering::Relaxed) {
                    info!(target: LOG_TARGET, "watching the queues again: idle workers wake on pushes");
                }
                if found.is_some() {
                    seen += 1;
                    if tx.send(Ev::Pushed { key: key.clone() }).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                conn = None;
                if crate::conn::unavailable_command(&e) {
                    if !refused.swap(true, Ordering::Relaxed) {
                        warn!(target: LOG_TARGET, error = %e, "BLMOVE refused: idle workers poll every interval");
                    }
                    tokio::time::sleep(MAX_BACKOFF * 10).await;
                } else {
                    if !failing.swap(true, Ordering::Relaxed) {
                        warn!(target: LOG_TARGET, error = %e, "watching the queues failed; idle workers poll every interval until it answers");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

async fn blocking_connection(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = crate::conn::primary_client(url, false)
        .await
        .map_err(|e| debug!(target: LOG_TARGET, error = %e, "no primary to watch a queue on"))
        .ok()?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(BLOCK_SECS + 10)));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
        .map_err(|e| debug!(target: LOG_TARGET, error = %e, "no connection to watch a queue"))
        .ok()
}
