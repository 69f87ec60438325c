//! `hot-key`: parked-waits.md §1's shape. One queue; N jobs for one user behind a limit-1
//! lock (`sleep` 20 ms each), then 2,000 free `probe` jobs (uncontended locks), drained by
//! `--workers 2` with the default configuration (`on_conflict = "park"`). A free job's cost is
//! measured first on free jobs alone, in the same run; a hot job's cost is then
//! (all Redis commands − a free job's × the free jobs) / N.

use super::{fmt_int, now_us, row, Ctx, Opts, Row};
use crate::procs::check_interrupt;
use crate::stats;
use anyhow::{bail, Result};
use std::path::Path;
use std::time::{Duration, Instant};

/// Free jobs per run.
const FREE: usize = 2000;
/// A hot job's handler time.
const HOT_MS: f64 = 20.0;

const CLASSES: &str = "[classes.Hot]\nbuiltin = \"sleep\"\nlock = \"user:{args[1]}\"\n\n\
                       [classes.Probe]\nbuiltin = \"probe\"\n";

/// What one size measured.
struct HotRun {
    n: usize,
    /// A free job's Redis commands and CPU (µs), free jobs alone.
    free_cmds: f64,
    free_cpu_us: f64,
    /// A hot job's.
    hot_cmds: f64,
    hot_cpu_us: f64,
    /// All commands and CPU per job (hot and free together).
    all_cmds: f64,
    /// The user's jobs' wall time, and the free jobs', from the daemon's first completion.
    hot_wall: Duration,
    free_wall: Duration,
    /// When the first free job started, from the daemon's first completion: the time its
    /// worker spent parking the backlog in front of the free jobs.
    free_start: Duration,
    /// The 2,000 free jobs alone, on the two workers and on one (with the user's jobs, the
    /// other one runs their chain), first to last completion.
    free_two_workers: Duration,
    free_one_worker: Duration,
    requeued: u64,
    parked: u64,
}

fn free_payloads(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| {
        format!(
            r#"{{"class":"Probe","args":[{{"enqueued_at_us":{}}},{i}]}}"#,
            now_us()
        )
    })
}

/// Counts the `probe` lines of a daemon's log as it grows, reading each byte once (a re-read of
/// the whole log every 10 ms would take the daemon's CPU on a small machine).
#[derive(Default)]
pub(crate) struct ProbeCount {
    /// Bytes of the log counted so far (up to the end of the last whole line).
    offset: u64,
    n: usize,
}

impl ProbeCount {
    pub(crate) fn count(&mut self, log: &Path) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(log) else {
            return self.n;
        };
        let mut buf = Vec::new();
        if f.seek(SeekFrom::Start(self.offset)).is_err() || f.read_to_end(&mut buf).is_err() {
            return self.n;
        }
        let Some(end) = buf.iter().rposition(|&b| b == b'\n') else {
            return self.n;
        };
        let text = String::from_utf8_lossy(&buf[..=end]);
        self.n += text.matches("probe job started").count();
        self.offset += end as u64 + 1;
        self.n
    }
}

fn stat(ctx: &mut Ctx, event: &str) -> Result<u64> {
    let v: Option<u64> = redis::cmd("GET")
        .arg(format!("resque:locket:stat:{event}"))
        .query(&mut ctx.conn)?;
    Ok(v.unwrap_or(0))
}

fn one_size(opts: &Opts, exe: &Path, n: usize) -> Result<HotRun> {
    let workers = opts.workers.unwrap_or(2);
    let mut ctx = Ctx::new(opts, exe)?;
    let config = ctx.config(&["q".into()], CLASSES);

    // A free job's cost, free jobs alone.
    ctx.push("q", free_payloads(FREE))?;
    let (free, daemon) = ctx.drain(&config, workers, FREE)?;
    daemon.stop(Duration::from_secs(30));
    free.report("hot-key: free jobs alone");
    let free_cmds = free.cmds_per_job();
    let free_cpu_us = free.cpu_us_per_job();

    // The free jobs alone on one worker: what they can reach while the other worker carries
    // the user's jobs one after the other (their lock is held all the time, so one of the two
    // workers always runs one of them).
    ctx.flush()?;
    ctx.push("q", free_payloads(FREE))?;
    let (one, daemon) = ctx.drain(&config, 1, FREE)?;
    daemon.stop(Duration::from_secs(30));
    one.report("hot-key: free jobs alone, one worker");
    let free_one_worker = Duration::from_secs_f64(one.jobs as f64 / one.rate.max(1e-9));
    let free_two_workers = Duration::from_secs_f64(free.jobs as f64 / free.rate.max(1e-9));

    // N hot jobs first (the backlog in the way), then the free jobs.
    ctx.flush()?;
    ctx.push(
        "q",
        (0..n).map(|i| format!(r#"{{"class":"Hot","args":[{},"u1",{i}]}}"#, HOT_MS / 1000.0)),
    )?;
    ctx.push("q", free_payloads(FREE))?;
    let total = n + FREE;
    let s0 = stats::snapshot(&mut ctx.conn)?;
    let t0 = Instant::now();
    let mut daemon = ctx.start_daemon(&config, workers)?;
    let limit = Duration::from_secs(
        opts.timeout
            .unwrap_or(120 + (n as f64 * HOT_MS / 500.0) as u64),
    );
    let mut first: Option<Instant> = None;
    let mut free_first: Option<Instant> = None;
    let mut free_done: Option<Instant> = None;
    let mut probes = ProbeCount::default();
    let mut gets = 0u64;
    let hot_done = loop {
        check_interrupt()?;
        let p = ctx.processed()?;
        gets += 1;
        let now = Instant::now();
        if p > 0 && first.is_none() {
            first = Some(now);
        }
        if free_done.is_none() {
            let n = probes.count(&daemon.log);
            if n > 0 && free_first.is_none() {
                free_first = Some(now);
            }
            if n >= FREE {
                free_done = Some(now);
            }
        }
        if p >= total as u64 {
            break now;
        }
        if t0.elapsed() > limit {
            bail!("hot-key drain timed out: {p} of {total} jobs after {limit:?}");
        }
        daemon.check_alive()?;
        std::thread::sleep(Duration::from_millis(10));
    };
    let s1 = stats::snapshot(&mut ctx.conn)?;
    daemon.stop(Duration::from_secs(30));
    let delta = stats::Delta::between(&s0, &s1, &[("get", gets)]);
    println!(
        "  commands (per job, hot and free): {}",
        delta.breakdown(total as u64, 14)
    );
    let all = delta.total_calls() as f64;
    let start = first.unwrap_or(t0);
    let run = HotRun {
        n,
        free_cmds,
        free_cpu_us,
        hot_cmds: (all - free_cmds * FREE as f64) / n as f64,
        hot_cpu_us: (delta.cpu_s * 1e6 - free_cpu_us * FREE as f64) / n as f64,
        all_cmds: all / total as f64,
        hot_wall: hot_done.duration_since(start),
        free_wall: free_done.unwrap_or(hot_done).duration_since(start),
        free_start: free_first
            .unwrap_or(hot_done)
            .saturating_duration_since(start),
        free_two_workers,
        free_one_worker,
        requeued: stat(&mut ctx, "requeued")?,
        parked: stat(&mut ctx, "parked")?,
    };
    let ideal = Duration::from_secs_f64(n as f64 * HOT_MS / 1000.0);
    println!(
        "hot-key N={n}: {:.1} commands/job overall; a hot job {:.1} commands, {:.0} us Redis CPU; \
         a free job {:.1} commands, {:.0} us; the user's jobs {:.2} s ({:.3}x of N x 20 ms), the \
         free jobs {:.2} s (the first started after {:.2} s; alone they take {:.2} s on two workers, {:.2} s on \
         one); \
         parked {}, requeued {}",
        run.all_cmds,
        run.hot_cmds,
        run.hot_cpu_us,
        run.free_cmds,
        run.free_cpu_us,
        run.hot_wall.as_secs_f64(),
        run.hot_wall.as_secs_f64() / ideal.as_secs_f64(),
        run.free_wall.as_secs_f64(),
        run.free_start.as_secs_f64(),
        run.free_two_workers.as_secs_f64(),
        run.free_one_worker.as_secs_f64(),
        fmt_int(run.parked as f64),
        fmt_int(run.requeued as f64),
    );
    Ok(run)
}

/// `hot-key`: N = 200 and 2,000 (or `--jobs N` alone), with parked-waits.md §3's targets.
pub(crate) fn scenario_hot_key(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let sizes: Vec<usize> = match opts.jobs {
        Some(n) => vec![n],
        None => vec![200, 2000],
    };
    let mut runs = Vec::new();
    for n in sizes {
        runs.push(one_size(opts, exe, n)?);
    }
    for r in &runs {
        let ideal = r.n as f64 * HOT_MS / 1000.0;
        let ratio = r.hot_cmds / r.free_cmds;
        rows.push(row(
            format!("hot-key N={}: a hot job's commands vs a free job's", r.n),
            format!("{:.1} vs {:.1} ({ratio:.2}x)", r.hot_cmds, r.free_cmds),
            "≤ 2.5x",
            Some(ratio <= 2.5),
        ));
        rows.push(row(
            format!("hot-key N={}: Redis CPU per hot / free job", r.n),
            format!("{:.0} / {:.0} us", r.hot_cpu_us, r.free_cpu_us),
            "",
            None,
        ));
        let wall = r.hot_wall.as_secs_f64() / ideal;
        rows.push(row(
            format!("hot-key N={}: the user's jobs, wall / (N x 20 ms)", r.n),
            format!("{wall:.3}x ({:.2} s)", r.hot_wall.as_secs_f64()),
            "≤ 1.15x",
            Some(wall <= 1.15),
        ));
        rows.push(row(
            format!("hot-key N={}: the free jobs finish", r.n),
            format!("{:.2} s", r.free_wall.as_secs_f64()),
            format!("< {:.2} s", ideal / 10.0),
            Some(r.free_wall.as_secs_f64() < ideal / 10.0),
        ));
        rows.push(row(
            format!(
                "hot-key N={}: the first free job starts / free jobs alone, 2 / 1 workers",
                r.n
            ),
            format!(
                "{:.2} s / {:.2} s, {:.2} s",
                r.free_start.as_secs_f64(),
                r.free_two_workers.as_secs_f64(),
                r.free_one_worker.as_secs_f64()
            ),
            "",
            None,
        ));
        rows.push(row(
            format!("hot-key N={}: requeues / parks", r.n),
            format!(
                "{} / {}",
                fmt_int(r.requeued as f64),
                fmt_int(r.parked as f64)
            ),
            "0 requeues",
            Some(r.requeued == 0),
        ));
    }
    if let (Some(a), Some(b)) = (
        runs.iter().find(|r| r.n == 200),
        runs.iter().find(|r| r.n == 2000),
    ) {
        let growth = b.hot_cmds / a.hot_cmds;
        rows.push(row(
            "hot-key: a hot job's cost, N=2,000 vs N=200",
            format!("{growth:.2}x"),
            "≤ 1.3x",
            Some(growth <= 1.3),
        ));
    }
    Ok(())
}
