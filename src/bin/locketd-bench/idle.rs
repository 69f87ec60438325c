//! The `idle` scenario: a daemon (`--workers 2` unless told) with 16 empty queues. First its
//! cost while idle (Redis commands/s, connections), then its pickup latency: probe jobs pushed
//! one at a time, alternately to the first and to the last of the 16 queues, each at a random
//! moment (0–500 ms after the last pickup), timed from the push to the job's start by the
//! `probe` builtin's log line.

use crate::procs::{check_interrupt, sleep, Daemon, RssPeaks};
use crate::scenarios::NOOP_CLASSES;
use crate::stats::{self, Delta};
use crate::{mib, now_us, percentile, procs, row, Ctx, Opts, Row};
use anyhow::{bail, Result};
use std::path::Path;
use std::time::{Duration, Instant};

/// Queues the daemon works, in priority order.
const QUEUES: usize = 16;

pub(crate) fn scenario_idle(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    let mut ctx = Ctx::new(opts, exe)?;
    let queues: Vec<String> = (0..QUEUES).map(|i| format!("idle{i:02}")).collect();
    let config = ctx.config(&queues, NOOP_CLASSES);
    let mut daemon = ctx.start_daemon(&config, workers)?;
    daemon.wait_log("worker registered", Duration::from_secs(30))?;
    // Let start-up (janitor pass, pruning, registration, the first idle waits) settle.
    sleep(Duration::from_secs(2))?;
    let (conns, waiting) = connections(&mut ctx.conn)?;
    let s0: crate::Snapshot = stats::snapshot(&mut ctx.conn)?;
    let t0 = Instant::now();
    sleep(Duration::from_secs_f64(opts.idle_secs))?;
    let s1 = stats::snapshot(&mut ctx.conn)?;
    let secs = t0.elapsed().as_secs_f64();
    daemon.check_alive()?;
    let d = Delta::between(&s0, &s1, &[]);
    let per_host = d.total_calls() as f64 / secs;
    let mut rss = RssPeaks::default();
    daemon.peak_rss(&mut rss);
    let idle_rss = procs::vm_field(daemon.pid, "VmRSS:").unwrap_or(0);
    println!(
        "idle: {per_host:.1} Redis commands/s for {workers} idle workers on {QUEUES} queues over {secs:.0} s ({}), Redis CPU {:.2} ms/s; {conns} connections, {waiting} of them waiting (BLMOVE or tracking); RSS {} (peak {})",
        d.breakdown_per(secs, "s", 8),
        d.cpu_s * 1e3 / secs,
        mib(idle_rss),
        mib(rss.master_kib)
    );

    let pushes = opts.pushes.max(1);
    let mut first = Vec::new();
    let mut last = Vec::new();
    let mut seed = now_us() | 1;
    for i in 0..2 * pushes {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        sleep(Duration::from_millis(seed % 500))?;
        let (queue, into) = if i % 2 == 0 {
            (&queues[0], &mut first)
        } else {
            (&queues[QUEUES - 1], &mut last)
        };
        into.push(pickup(&mut ctx, &mut daemon, queue, i, false)?);
    }
    daemon.stop(Duration::from_secs(30));
    let fresh = new_queues(opts, &mut ctx, workers)?;
    first.sort_unstable();
    last.sort_unstable();
    let ms = |v: &[u64], p: f64| percentile(v, p) as f64 / 1e3;
    for (name, v) in [("first", &first), ("last", &last)] {
        println!(
            "idle: pickup on the {name} of {QUEUES} queues over {} pushes: median {:.1} ms, p90 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms, max {:.1} ms (interval {})",
            v.len(),
            ms(v, 0.5),
            ms(v, 0.9),
            ms(v, 0.95),
            ms(v, 0.99),
            ms(v, 1.0),
            opts.interval.map(|i| format!("{i} s")).unwrap_or_else(|| "default".into())
        );
    }
    println!(
        "idle: pickup on a queue new to `queues = [\"*\"]` over {} pushes: median {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        fresh.len(),
        ms(&fresh, 0.5),
        ms(&fresh, 0.9),
        ms(&fresh, 0.99),
        ms(&fresh, 1.0)
    );
    rows.push(row(
        "idle: p99 pickup on a new queue matching `*`",
        format!(
            "{:.0} ms (median {:.1} ms, {} pushes)",
            ms(&fresh, 0.99),
            ms(&fresh, 0.5),
            fresh.len()
        ),
        "≤ 50 ms",
        Some(ms(&fresh, 0.99) <= 50.0),
    ));
    for (name, v) in [("first", &first), ("last", &last)] {
        let p99 = ms(v, 0.99);
        rows.push(row(
            format!("idle: p99 pickup, {name} of {QUEUES} queues"),
            format!(
                "{p99:.0} ms (median {:.1} ms, {} pushes)",
                ms(v, 0.5),
                v.len()
            ),
            "≤ 50 ms",
            Some(p99 <= 50.0),
        ));
    }
    rows.push(row(
        format!("idle: Redis commands/s, {workers} idle workers"),
        format!(
            "{per_host:.1} ({:.1} per worker)",
            per_host / workers as f64
        ),
        "≤ 20",
        Some(per_host <= 20.0),
    ));
    rows.push(row(
        format!("idle: Redis connections, {workers} workers, K = {QUEUES} queues"),
        format!("{waiting} waiting ({conns} in all)"),
        format!("≤ K+2 = {} waiting", QUEUES + 2),
        Some(waiting <= QUEUES + 2),
    ));
    rows.push(row(
        "idle: RSS of the idle daemon",
        format!("{} (peak {})", mib(idle_rss), mib(rss.master_kib)),
        "< 16 MiB",
        Some(rss.master_kib < 16 * 1024),
    ));
    Ok(())
}

/// A second daemon with `queues = ["*"]`: each probe goes to a queue that did not exist (SADD
/// to `queues`, then RPUSH, as a Resque client does). Returns the latencies, sorted.
fn new_queues(opts: &Opts, ctx: &mut Ctx, workers: usize) -> Result<Vec<u64>> {
    ctx.flush()?;
    let config = ctx.config(&["*".into()], NOOP_CLASSES);
    let mut daemon = ctx.start_daemon(&config, workers)?;
    daemon.wait_log("worker registered", Duration::from_secs(30))?;
    sleep(Duration::from_secs(2))?;
    let mut seed = now_us() | 1;
    let mut v = Vec::new();
    for i in 0..opts.pushes.max(1) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        sleep(Duration::from_millis(seed % 500))?;
        let queue = format!("new{i:03}");
        v.push(pickup(ctx, &mut daemon, &queue, i, true)?);
    }
    daemon.stop(Duration::from_secs(30));
    v.sort_unstable();
    Ok(v)
}

/// Pushes one probe job to `queue` (with `new`, in one pipeline after `SADD queues`, as a
/// Resque client pushes) and returns its pickup latency (µs), as the probe logged it.
fn pickup(ctx: &mut Ctx, daemon: &mut Daemon, queue: &str, i: usize, new: bool) -> Result<u64> {
    let p0 = ctx.processed()?;
    let payload = format!(
        r#"{{"class":"Probe","args":[{{"enqueued_at_us":{}}},{i}]}}"#,
        now_us()
    );
    let mut pipe = redis::pipe();
    if new {
        pipe.cmd("SADD").arg("resque:queues").arg(queue).ignore();
    }
    pipe.cmd("RPUSH")
        .arg(format!("resque:queue:{queue}"))
        .arg(payload)
        .ignore();
    pipe.query::<()>(&mut ctx.conn)?;
    let interval = ctx.opts.interval.unwrap_or(5.0);
    let deadline = Instant::now() + Duration::from_secs_f64(30.0 + 2.0 * interval);
    while ctx.processed()? <= p0 {
        check_interrupt()?;
        daemon.check_alive()?;
        if Instant::now() > deadline {
            bail!("idle: a job pushed to {queue} was not picked up in time");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // The log line may reach the file a little after the job's end (the log queue).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(us) = latencies(&daemon.log_text()).get(i) {
            return Ok(*us);
        }
        if Instant::now() > deadline {
            bail!("idle: the probe of push {i} logged no latency");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every `latency_us=N` the probe logged, in the log's order.
fn latencies(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| {
            let rest = l.split("latency_us=").nth(1)?;
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            digits.parse().ok()
        })
        .collect()
}

/// The daemon's connections (every client but this one) and those of them that wait for
/// pushes: blocked in BLMOVE, or tracking keys (flag `t`).
fn connections(conn: &mut redis::Connection) -> Result<(usize, usize)> {
    let me: i64 = redis::cmd("CLIENT").arg("ID").query(conn)?;
    let list: String = redis::cmd("CLIENT").arg("LIST").query(conn)?;
    let mut all = 0;
    let mut waiting = 0;
    for line in list.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|kv| kv.strip_prefix(name))
                .unwrap_or("")
        };
        if field("id=") == me.to_string() {
            continue;
        }
        all += 1;
        if field("cmd=") == "blmove" || field("flags=").contains('t') {
            waiting += 1;
        }
    }
    Ok((all, waiting))
}
