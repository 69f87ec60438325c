//! Job metrics: recorded in the worker process, merged and served (Prometheus text) by whichever
//! process serves `--metrics`.
//!
//! - [`Metrics`]: the in-process recorder the worker loop calls: a few cheap calls per job
//!   (an uncontended mutex and atomics), never a Redis command.
//! - [`Snapshot`]: its cumulative values, serde, one JSON line per report.
//! - [`Aggregate`]: the latest snapshot per worker pid plus the totals of workers that are gone,
//!   so merged counters never go down.
//! - [`spawn_reporter`] writes a snapshot line every second to the descriptor named by
//!   `LOCKETD_METRICS_FD`; [`read_reports`] reads such a stream into an [`Aggregate`].
//! - The `/metrics` endpoint (`service::http`) serves them, with queue lengths, lock counters
//!   and totals read from Redis at scrape time.
//!
//! A single-process daemon records into its own [`Metrics`] and serves
//! `Aggregate::single(metrics)`. A master with N worker processes gives each worker a pipe as
//! `LOCKETD_METRICS_FD`, runs [`read_reports`] on the read end per worker pid, and serves the
//! shared [`Aggregate`].

pub mod processes;

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the job duration histogram buckets; `+Inf` is implied.
pub const DURATION_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Environment variable naming the descriptor a worker writes its snapshots to.
pub const METRICS_FD_ENV: &str = "LOCKETD_METRICS_FD";

/// Lock-conflict outcomes always exported (at 0 when they never happened).
pub const CONFLICT_ACTIONS: [&str; 4] = ["requeue", "discard", "delay", "wait"];

/// How one job ended, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Ran and succeeded.
    Succeeded,
    /// Recorded as a failure counted in `stat:failed`.
    Failed,
    /// Recorded as a failure not counted in `stat:failed` (killed, `Resque::DirtyExit`).
    Killed,
    /// Put back in its queue (lock lost with `on_lock_lost = "requeue"`, or rescheduled by the
    /// handler's exit 75).
    Requeued,
}

impl Outcome {
    /// From the `outcome` field of the "job finished" log line.
    pub fn from_label(label: &str) -> Outcome {
        match label {
            "success" => Outcome::Succeeded,
            "killed" => Outcome::Killed,
            "requeued" | "rescheduled" | "throttled" => Outcome::Requeued,
            _ => Outcome::Failed,
        }
    }
}

/// A histogram's counts: per bucket (not cumulative; one more than [`DURATION_BUCKETS`] for
/// `+Inf`), their sum and count.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// Observations per bucket, the last one being `+Inf`.
    pub buckets: Vec<u64>,
    /// Sum of observations, seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        if self.buckets.len() != DURATION_BUCKETS.len() + 1 {
            self.buckets.resize(DURATION_BUCKETS.len() + 1, 0);
        }
        let i = DURATION_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(DURATION_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    fn add(&mut self, other: &Histogram) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum += other.sum;
        self.count += other.count;
    }

    /// `(upper bound, count in that bucket alone)` pairs ending with `+Inf`: what
    /// prometheus-client's encoder takes (it accumulates them itself).
    pub fn per_bucket(&self) -> Vec<(f64, u64)> {
        DURATION_BUCKETS
            .iter()
            .copied()
            // prometheus-client writes `le="+Inf"` for f64::MAX.
            .chain([f64::MAX])
            .enumerate()
            .map(|(i, le)| (le, self.buckets.get(i).copied().unwrap_or(0)))
            .collect()
    }

    /// `(upper bound, cumulative count)` pairs ending with `+Inf`, as Prometheus shows them.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(DURATION_BUCKETS.len() + 1);
        for (i, le) in DURATION_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .enumerate()
        {
            acc += self.buckets.get(i).copied().unwrap_or(0);
            out.push((le, acc));
        }
        out
    }
}

/// Counters of one (queue, class).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobCounts {
    /// Queue.
    pub queue: String,
    /// Job class.
    pub class: String,
    /// Jobs whose handler started.
    pub started: u64,
    /// Jobs that succeeded.
    pub succeeded: u64,
    /// Failure records counted in `stat:failed` (including jobs that could not start).
    pub failed: u64,
    /// Failure records not counted in `stat:failed` (killed).
    pub killed: u64,
    /// Jobs put back after a lost lock.
    pub requeued: u64,
    /// Run time of every finished job, seconds.
    pub duration: Histogram,
}

impl JobCounts {
    fn add(&mut self, o: &JobCounts) {
        self.started += o.started;
        self.succeeded += o.succeeded;
        self.failed += o.failed;
        self.killed += o.killed;
        self.requeued += o.requeued;
        self.duration.add(&o.duration);
    }

    fn total(&self) -> u64 {
        self.started + self.succeeded + self.failed + self.killed + self.requeued
    }
}

/// The cumulative values of one process's [`Metrics`] (or of several, merged).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The reporting process.
    pub pid: u32,
    /// Per (queue, class), sorted.
    pub jobs: Vec<JobCounts>,
    /// Lock conflicts by what was done with the job (`requeue`, `discard`, `delay`, `wait`).
    pub lock_conflicts: BTreeMap<String, u64>,
    /// Reserved jobs by how their locks were taken (A-7a): `one_call` (TAKE locked and
    /// started them in the call that reserved them), else why the worker's own ACQUIRE did
    /// (`no_plan`, `class`, `digest`, `size`, `payload`, `render`, `error`, `started`, `off`:
    /// TAKE not sent then, for a handler not ready).
    #[serde(default)]
    pub takes: BTreeMap<String, u64>,
    /// Locks lost while a job ran.
    pub locks_lost: u64,
    /// RESERVE passes that skipped a queue because every job in it waited on a lock, by queue.
    pub queue_skips: BTreeMap<String, u64>,
    /// Worker slots in this process.
    pub workers: u64,
    /// Of which running a job now.
    pub busy: u64,
    /// Redis errors seen by the worker loop.
    pub redis_errors: u64,
    /// Times Redis answered again after errors.
    pub redis_reconnects: u64,
    /// Persistent handler processes, one entry per slot and handler (gauges: the master
    /// keeps only live workers' entries).
    #[serde(default)]
    pub handlers: Vec<HandlerStats>,
}

/// A worker slot's persistent handler process (persistent-handlers.md H-8), as `status` and
/// `/metrics` show it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HandlerStats {
    /// The slot's Resque worker id.
    pub worker: String,
    /// The `[handlers.<name>]` table.
    pub name: String,
    /// The live process, if any.
    pub pid: Option<u32>,
    /// It sent `ready` and is alive.
    pub ready: bool,
    /// Jobs served by the live process.
    pub jobs: u64,
    /// Jobs served by every process of this slot.
    pub jobs_total: u64,
    /// Its memory after its last job (RSS, or PSS in fork mode), bytes.
    pub rss_bytes: Option<u64>,
    /// Processes started.
    pub boots: u64,
    /// Processes ended and replaced, by reason.
    pub restarts: BTreeMap<String, u64>,
    /// Milliseconds left of a boot backoff when this was read (0: none).
    pub backoff_ms: u64,
    /// The last boot failure or death, for the operator.
    pub last_error: String,
    /// Jobs its process may run at once (`threads`, H-18; 1: one job per process, and also
    /// when the adapter did not say `threads` in `ready`).
    #[serde(default)]
    pub threads: u32,
    /// Jobs its process is running now, this slot's and the other slots' that share it.
    #[serde(default)]
    pub threads_busy: u32,
    /// The thread (0-based, within its process) of this slot's running job, if any.
    #[serde(default)]
    pub thread: Option<u32>,
    /// Its process takes no new jobs: it retires once its running jobs end (H-13, H-18).
    #[serde(default)]
    pub retiring: bool,
}

/// Most `(queue, class)` series (and `queue` series of skips) one recorder, or the master's sum,
/// keeps: queue and class names come from job producers, and each series lives as long as the
/// daemon. Further ones are counted under [`OTHER`].
pub const MAX_SERIES: usize = 1000;
/// The queue and class label of the series past [`MAX_SERIES`].
pub const OTHER: &str = "(other)";

/// `key`, or the [`OTHER`] key (`other()`) when `len` series exist already and `key` is not
/// one of them (`has`). Below the bound, the common case, it looks nothing up.
fn capped<K>(len: usize, has: impl FnOnce(&K) -> bool, key: K, other: impl FnOnce() -> K) -> K {
    if len < MAX_SERIES || has(&key) {
        key
    } else {
        other()
    }
}

/// The `(queue, class)` key past [`MAX_SERIES`].
fn other_job() -> (String, String) {
    (OTHER.to_string(), OTHER.to_string())
}

/// The counts of one `(queue, class)` key, created with its labels.
fn job_counts(key: &(String, String)) -> JobCounts {
    JobCounts {
        queue: key.0.clone(),
        class: key.1.clone(),
        ..JobCounts::default()
    }
}

impl Snapshot {
    /// Adds `other`'s counters (and gauges) to these.
    pub fn add(&mut self, other: &Snapshot) {
        let mut jobs: BTreeMap<(String, String), JobCounts> = self
            .jobs
            .drain(..)
            .map(|j| ((j.queue.clone(), j.class.clone()), j))
            .collect();
        for j in &other.jobs {
            let key = (j.queue.clone(), j.class.clone());
            let key = capped(jobs.len(), |k| jobs.contains_key(k), key, other_job);
            jobs.entry(key).or_insert_with_key(job_counts).add(j);
        }
        self.jobs = jobs.into_values().collect();
        for (k, v) in &other.lock_conflicts {
            *self.lock_conflicts.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.takes {
            *self.takes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.queue_skips {
            let skips = &self.queue_skips;
            let k = capped(
                skips.len(),
                |k| skips.contains_key(k),
                k.clone(),
                || OTHER.to_string(),
            );
            *self.queue_skips.entry(k).or_default() += v;
        }
        self.locks_lost += other.locks_lost;
        self.workers += other.workers;
        self.busy += other.busy;
        self.redis_errors += other.redis_errors;
        self.redis_reconnects += other.redis_reconnects;
        self.handlers.extend(other.handlers.iter().cloned());
    }

    fn total(&self) -> u64 {
        self.jobs.iter().map(JobCounts::total).sum::<u64>()
            + self.lock_conflicts.values().sum::<u64>()
            + self.queue_skips.values().sum::<u64>()
            + self.locks_lost
            + self.redis_errors
    }

    /// Jobs finished (succeeded, failed or killed).
    pub fn jobs_done(&self) -> u64 {
        self.jobs
            .iter()
            .map(|j| j.succeeded + j.failed + j.killed)
            .sum()
    }
}

#[derive(Debug, Default)]
struct Labelled {
    jobs: HashMap<(String, String), JobCounts>,
    lock_conflicts: BTreeMap<String, u64>,
    takes: BTreeMap<String, u64>,
    queue_skips: BTreeMap<String, u64>,
    current: Option<(String, String, Instant)>,
}

/// Reads a slot's handler processes when a snapshot is taken.
pub type HandlerSource = Box<dyn Fn() -> Vec<HandlerStats> + Send + Sync>;

#[derive(Default)]
struct Inner {
    handlers: Mutex<Option<HandlerSource>>,
    labelled: Mutex<Labelled>,
    locks_lost: AtomicU64,
    redis_errors: AtomicU64,
    redis_reconnects: AtomicU64,
}

/// The in-process recorder. Cloning shares it.
#[derive(Clone, Default)]
pub struct Metrics(Arc<Inner>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Where snapshots read the slot's handler processes from.
    pub fn set_handler_source(&self, source: HandlerSource) {
        *self.0.handlers.lock().unwrap_or_else(|p| p.into_inner()) = Some(source);
    }

    /// The slot's handler processes now.
    pub fn handlers(&self) -> Vec<HandlerStats> {
        let source = self.0.handlers.lock().unwrap_or_else(|p| p.into_inner());
        source.as_ref().map(|f| f()).unwrap_or_default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut Labelled) -> T) -> T {
        let mut g = self
            .0
            .labelled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut g)
    }

    fn entry<'a>(l: &'a mut Labelled, queue: &str, class: &str) -> &'a mut JobCounts {
        let key = (queue.to_string(), class.to_string());
        let key = capped(l.jobs.len(), |k| l.jobs.contains_key(k), key, other_job);
        l.jobs.entry(key).or_insert_with_key(job_counts)
    }

    /// A job's handler starts; the worker is busy until [`Metrics::job_finished`].
    pub fn job_started(&self, queue: &str, class: &str) {
        self.with(|l| {
            Self::entry(l, queue, class).started += 1;
            l.current = Some((queue.to_string(), class.to_string(), Instant::now()));
        });
    }

    /// A job ended (also for jobs that never started: bad payload, no handler).
    pub fn job_finished(&self, queue: &str, class: &str, outcome: Outcome, elapsed: Duration) {
        self.with(|l| {
            let e = Self::entry(l, queue, class);
            match outcome {
                Outcome::Succeeded => e.succeeded += 1,
                Outcome::Failed => e.failed += 1,
                Outcome::Killed => e.killed += 1,
                Outcome::Requeued => e.requeued += 1,
            }
            e.duration.observe(elapsed.as_secs_f64());
            l.current = None;
        });
    }

    /// A lock was held elsewhere; `action` is what happened to the job (`requeue`, `discard`,
    /// `delay`, `wait`).
    pub fn lock_conflict(&self, action: &str) {
        self.with(|l| *l.lock_conflicts.entry(action.to_string()).or_default() += 1);
    }

    /// How a reserved job's locks were taken (A-7a): `one_call`, or why not.
    pub fn take(&self, path: &str) {
        self.with(|l| {
            if let Some(n) = l.takes.get_mut(path) {
                *n += 1;
            } else {
                l.takes.insert(path.to_string(), 1);
            }
        });
    }

    /// A running job's lock was lost.
    pub fn lock_lost(&self) {
        self.0.locks_lost.fetch_add(1, Ordering::Relaxed);
    }

    /// RESERVE skipped these queues (counter ≥ length).
    pub fn queues_skipped(&self, queues: &[String]) {
        if queues.is_empty() {
            return;
        }
        self.with(|l| {
            for q in queues {
                let skips = &l.queue_skips;
                let q = capped(
                    skips.len(),
                    |k| skips.contains_key(k),
                    q.clone(),
                    || OTHER.to_string(),
                );
                *l.queue_skips.entry(q).or_default() += 1;
            }
        });
    }

    /// A Redis command of the worker loop failed.
    pub fn redis_error(&self) {
        self.0.redis_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Redis answered again after errors.
    pub fn redis_reconnected(&self) {
        self.0.redis_reconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// The cumulative values now.
    pub fn snapshot(&self) -> Snapshot {
        let (mut jobs, lock_conflicts, takes, queue_skips, busy) = self.with(|l| {
            (
                l.jobs.values().cloned().collect::<Vec<_>>(),
                l.lock_conflicts.clone(),
                l.takes.clone(),
                l.queue_skips.clone(),
                u64::from(l.current.is_some()),
            )
        });
        jobs.sort_by(|a, b| (&a.queue, &a.class).cmp(&(&b.queue, &b.class)));
        Snapshot {
            pid: std::process::id(),
            jobs,
            lock_conflicts,
            takes,
            locks_lost: self.0.locks_lost.load(Ordering::Relaxed),
            queue_skips,
            workers: 1,
            busy,
            redis_errors: self.0.redis_errors.load(Ordering::Relaxed),
            redis_reconnects: self.0.redis_reconnects.load(Ordering::Relaxed),
            handlers: self.handlers(),
        }
    }

    /// The snapshot of several recorders of one process (its slots), summed.
    pub fn sum(all: &[Metrics]) -> Snapshot {
        let mut total = Snapshot {
            pid: std::process::id(),
            ..Snapshot::default()
        };
        for m in all {
            total.add(&m.snapshot());
        }
        total
    }

    /// A one-line state for systemd's `STATUS=`: busy or idle, and jobs done.
    pub fn status_line(&self) -> String {
        let s = self.snapshot();
        let failed: u64 = s.jobs.iter().map(|j| j.failed + j.killed).sum();
        let current = self.with(|l| l.current.clone());
        let done = format!("{} jobs done, {failed} failed", s.jobs_done());
        match current {
            Some((q, c, at)) => format!("busy: {c} on {q} for {}s; {done}", at.elapsed().as_secs()),
            None => format!("idle; {done}"),
        }
    }
}

/// Latest snapshot per live worker pid, plus the totals of workers that are gone.
#[derive(Debug, Clone, Default)]
pub struct Aggregate {
    live: BTreeMap<u32, Snapshot>,
    retired: Snapshot,
    local: Option<Metrics>,
}

impl Aggregate {
    /// An aggregate that reads one in-process recorder at each merge (the single-process
    /// daemon).
    pub fn single(metrics: Metrics) -> Aggregate {
        Aggregate {
            local: Some(metrics),
            ..Aggregate::default()
        }
    }

    /// Takes a worker's latest snapshot. A snapshot whose counters went down is a new process
    /// that reused the pid: the old one's totals are kept.
    pub fn update(&mut self, snap: Snapshot) {
        if let Some(prev) = self.live.get(&snap.pid) {
            if snap.total() < prev.total() {
                let prev = prev.clone();
                self.retire(prev);
            }
        }
        self.live.insert(snap.pid, snap);
    }

    fn retire(&mut self, mut snap: Snapshot) {
        snap.busy = 0;
        snap.workers = 0;
        snap.handlers.clear();
        self.retired.add(&snap);
    }

    /// The worker `pid` exited: its counters stay in the totals, its gauges go.
    pub fn worker_exited(&mut self, pid: u32) {
        if let Some(s) = self.live.remove(&pid) {
            self.retire(s);
        }
    }

    /// Pids with a live snapshot.
    pub fn live_pids(&self) -> Vec<u32> {
        self.live.keys().copied().collect()
    }

    /// Everything merged.
    pub fn merged(&self) -> Snapshot {
        let mut total = self.retired.clone();
        for s in self.live.values() {
            total.add(s);
        }
        if let Some(m) = &self.local {
            total.add(&m.snapshot());
        }
        total.pid = std::process::id();
        total
    }
}

/// Writes `metrics`' snapshot as one JSON line every `every` to the descriptor named by
/// `LOCKETD_METRICS_FD`, if set, from a thread of its own (a blocked pipe never stalls jobs).
/// Returns the handle that writes a final line on [`Reporter::flush`].
/// With several slots (`slots = K`) pass each slot's recorder: the line is their sum.
pub fn spawn_reporter(metrics: &[Metrics], every: Duration) -> Option<Reporter> {
    let fd: i32 = std::env::var(METRICS_FD_ENV).ok()?.trim().parse().ok()?;
    if fd < 0 {
        return None;
    }
    // Handlers must not inherit it: the reader's EOF means this process is gone.
    // SAFETY: fcntl on a descriptor number; an invalid one just fails.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: the descriptor was handed to us by the parent for this purpose; we own it now.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let out = Arc::new(Mutex::new(Some(file)));
    let reporter = Reporter {
        metrics: metrics.to_vec(),
        out: out.clone(),
    };
    let r = reporter.clone();
    std::thread::Builder::new()
        .name("locketd-metrics".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            if !r.flush() {
                return;
            }
        })
        .ok()?;
    Some(reporter)
}

/// Writes snapshot lines to the reporting descriptor.
#[derive(Debug, Clone)]
pub struct Reporter {
    metrics: Vec<Metrics>,
    out: Arc<Mutex<Option<std::fs::File>>>,
}

impl Reporter {
    /// Writes one snapshot line now. False (and the descriptor closed) once the reader is gone.
    pub fn flush(&self) -> bool {
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let Some(f) = g.as_mut() else { return false };
        let mut line = serde_json::to_string(&Metrics::sum(&self.metrics)).unwrap_or_default();
        line.push('\n');
        if f.write_all(line.as_bytes()).is_err() {
            *g = None;
            return false;
        }
        true
    }
}

/// Reads snapshot lines of worker `pid` into `aggregate` until EOF, then marks it exited.
/// Lines that do not parse are skipped.
pub async fn read_reports<R>(reader: R, pid: u32, aggregate: Arc<Mutex<Aggregate>>)
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(reader).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Ok(mut snap) = serde_json::from_str::<Snapshot>(&line) {
            snap.pid = pid;
            aggregate
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .update(snap);
        }
    }
    aggregate
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .worker_exited(pid);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker_with(jobs: u64) -> Snapshot {
        let m = Metrics::default();
        for _ in 0..jobs {
            m.job_started("q", "C");
            m.job_finished("q", "C", Outcome::Succeeded, Duration::from_millis(30));
        }
        m.snapshot()
    }

    // Names come from job producers: the series kept are bounded, in a worker and in the
    // master's sum, and what is past the bound is still counted.
    #[test]
    fn series_are_capped_and_the_rest_counted_as_other() {
        let m = Metrics::default();
        for i in 0..MAX_SERIES + 50 {
            m.job_started("q", &format!("C{i}"));
            m.queues_skipped(&[format!("q{i}")]);
        }
        let s = m.snapshot();
        assert_eq!(s.jobs.len(), MAX_SERIES + 1);
        let other = s.jobs.iter().find(|j| j.class == OTHER).unwrap();
        assert_eq!((other.queue.as_str(), other.started), (OTHER, 50));
        assert_eq!(s.queue_skips.len(), MAX_SERIES + 1);
        assert_eq!(s.queue_skips[OTHER], 50);
        let mut sum = Snapshot::default();
        sum.add(&s);
        let more = Metrics::default();
        more.job_started("elsewhere", "New");
        sum.add(&more.snapshot());
        assert!(sum.jobs.len() <= MAX_SERIES + 1, "{}", sum.jobs.len());
        assert!(!sum.jobs.iter().any(|j| j.queue == "elsewhere"));
        // Nothing is lost on the way: every start is in some series.
        let started: u64 = sum.jobs.iter().map(|j| j.started).sum();
        assert_eq!(started, (MAX_SERIES + 51) as u64);
    }

    #[test]
    fn recorder_counts_and_histogram() {
        let m = Metrics::default();
        m.job_started("q", "A");
        assert_eq!(m.snapshot().busy, 1);
        assert!(m.status_line().starts_with("busy: A on q"));
        m.job_finished("q", "A", Outcome::Failed, Duration::from_millis(300));
        m.lock_conflict("requeue");
        m.queues_skipped(&["high".into()]);
        let s = m.snapshot();
        assert_eq!(s.busy, 0);
        assert_eq!(s.jobs[0].started, 1);
        assert_eq!(s.jobs[0].failed, 1);
        assert_eq!(s.jobs[0].duration.count, 1);
        let cum = s.jobs[0].duration.cumulative();
        assert_eq!(cum.iter().find(|(le, _)| *le == 0.25).unwrap().1, 0);
        assert_eq!(cum.iter().find(|(le, _)| *le == 0.5).unwrap().1, 1);
        assert_eq!(cum.last().unwrap().1, 1);
        assert_eq!(s.lock_conflicts["requeue"], 1);
        assert_eq!(s.queue_skips["high"], 1);
        assert_eq!(m.status_line(), "idle; 1 jobs done, 1 failed");
        let back: Snapshot = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn aggregate_keeps_totals_of_gone_workers() {
        let mut agg = Aggregate::default();
        let mut a = worker_with(3);
        a.pid = 10;
        let mut b = worker_with(2);
        b.pid = 11;
        agg.update(a.clone());
        agg.update(b);
        assert_eq!(agg.merged().jobs[0].succeeded, 5);
        assert_eq!(agg.merged().workers, 2);
        agg.worker_exited(11);
        assert_eq!(agg.merged().jobs[0].succeeded, 5, "counters never go down");
        assert_eq!(agg.merged().workers, 1);
        // pid 10 reused by a fresh process: the old totals stay.
        let mut fresh = worker_with(1);
        fresh.pid = 10;
        agg.update(fresh);
        assert_eq!(agg.merged().jobs[0].succeeded, 6);
        assert_eq!(agg.live_pids(), [10]);
    }

    #[tokio::test]
    async fn reports_are_read_into_the_aggregate() {
        let mut first = worker_with(1);
        first.busy = 1;
        let second = worker_with(4);
        let text = format!(
            "{}\nnot json\n{}\n",
            serde_json::to_string(&first).unwrap(),
            serde_json::to_string(&second).unwrap()
        );
        let agg = Arc::new(Mutex::new(Aggregate::default()));
        read_reports(text.as_bytes(), 77, agg.clone()).await;
        let merged = agg.lock().unwrap().merged();
        assert_eq!(merged.jobs[0].succeeded, 4);
        assert_eq!(merged.busy, 0, "an exited worker is not busy");
        assert!(agg.lock().unwrap().live_pids().is_empty());
    }
}
