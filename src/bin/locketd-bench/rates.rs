//! `rates`: rate-limits.md §4. Accuracy: two daemons share one key of 20 starts a second, 600
//! jobs (≤ 31.5 s, no sliding second over 20 by Redis's clock). Independence: 300 jobs for the
//! limited key and 3,000 free `probe` jobs in one queue: the free jobs as fast as alone
//! (within 1.2x), Redis commands per job ≤ 15.

use super::{row, Ctx, Opts, Row};
use crate::procs::check_interrupt;
use crate::stats;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

const CLASSES: &str = "[classes.Lim]\nbuiltin = \"noop\"\nlock = false\n\
                       rate = { key = \"api:{args[0]}\", limit = 20, period = \"1s\" }\n\n\
                       [classes.Probe]\nbuiltin = \"probe\"\n";
const FREE: usize = 3000;
const LIMITED: usize = 300;
const ACCURACY: usize = 600;

fn free_payloads(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| {
        format!(
            r#"{{"class":"Probe","args":[{{"enqueued_at_us":{}}},{i}]}}"#,
            super::now_us()
        )
    })
}

fn limited_payloads(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| format!(r#"{{"class":"Lim","args":[1,{i}]}}"#))
}

/// The most starts in any half-open window of `ms`, from sorted stamps.
fn most_in_window(stamps: &[u64], ms: u64) -> usize {
    let (mut lo, mut most) = (0, 0);
    for hi in 0..stamps.len() {
        while stamps[hi] - stamps[lo] >= ms {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

pub(crate) fn scenario_rates(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    // Accuracy: two daemons, one key.
    let mut ctx = Ctx::new(opts, exe)?;
    let config = ctx.config(&["q".into()], CLASSES);
    ctx.push("q", limited_payloads(ACCURACY))?;
    let t0 = Instant::now();
    let mut a = ctx.start_daemon(&config, workers)?;
    let mut b = ctx.start_daemon(&config, workers)?;
    // Every start by Redis's clock: each read of the key's log (20 starts, a second at least)
    // is merged in, a start time as often as one read holds it.
    let mut seen = BTreeMap::<u64, usize>::new();
    loop {
        check_interrupt()?;
        let log: Option<Vec<u8>> = redis::cmd("GET")
            .arg("resque:locket:ratelog:api:1")
            .query(&mut ctx.conn)?;
        let mut now = BTreeMap::<u64, usize>::new();
        for s in log
            .as_deref()
            .and_then(locketd::store::RateLog::parse)
            .unwrap_or_default()
            .starts
        {
            *now.entry(s).or_default() += 1;
        }
        for (s, n) in now {
            let e = seen.entry(s).or_default();
            *e = (*e).max(n);
        }
        if ctx.processed()? >= ACCURACY as u64 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("rates: accuracy drain timed out");
        }
        a.check_alive()?;
        b.check_alive()?;
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = t0.elapsed();
    a.stop(Duration::from_secs(30));
    b.stop(Duration::from_secs(30));
    let stamps: Vec<u64> = seen
        .iter()
        .flat_map(|(s, n)| std::iter::repeat_n(*s, *n))
        .collect();
    let most = most_in_window(&stamps, 1000);
    let span = stamps.last().unwrap_or(&0) - stamps.first().unwrap_or(&0);
    println!(
        "rates accuracy: {ACCURACY} jobs, 2 daemons: {:.2} s from start-up, first to last start \
         {:.2} s (ideal 29.0), most starts in a sliding second {most}, starts seen {}",
        took.as_secs_f64(),
        span as f64 / 1000.0,
        stamps.len()
    );
    rows.push(row(
        "rates: 600 jobs at 20/s, 2 daemons, done in",
        format!(
            "{:.2} s (first to last start {:.2} s)",
            took.as_secs_f64(),
            span as f64 / 1000.0
        ),
        "≤ 31.5 s",
        Some(took.as_secs_f64() <= 31.5),
    ));
    rows.push(row(
        "rates: most starts in any sliding second",
        most.to_string(),
        "≤ 20",
        Some(most <= 20),
    ));

    // Independence: the free jobs alone, then mixed with the limited ones, three times each,
    // alternating; the medians are compared. The first mixed drain runs to its end (15 s: the
    // limited jobs at 20/s) for the commands per job; the other two stop once the free jobs
    // have started.
    let mut alone = Vec::new();
    let mut with = Vec::new();
    let mut delta = None;
    for round in 0..3 {
        ctx.flush()?;
        ctx.push("q", free_payloads(FREE))?;
        let (t, _) = independence_drain(&mut ctx, &config, workers, FREE, false)?;
        alone.push(t);
        ctx.flush()?;
        let mut mixed = Vec::new();
        let mut f = free_payloads(FREE);
        let mut l = limited_payloads(LIMITED);
        // One limited job every ten free ones, in one queue.
        for i in 0..FREE + LIMITED {
            let next = if i % 11 == 0 { l.next() } else { f.next() };
            if let Some(p) = next.or_else(|| f.next()).or_else(|| l.next()) {
                mixed.push(p);
            }
        }
        ctx.push("q", mixed.into_iter())?;
        let (t, d) = independence_drain(&mut ctx, &config, workers, FREE + LIMITED, round == 0)?;
        with.push(t);
        if round == 0 {
            delta = d;
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let pairs: Vec<String> = alone
        .iter()
        .zip(&with)
        .map(|(a, w)| format!("{w:.2}/{a:.2} s"))
        .collect();
    let (alone, free_wall) = (median(&mut alone), median(&mut with));
    let delta = delta.ok_or_else(|| anyhow::anyhow!("rates: no full mixed drain"))?;
    let per_job = delta.total_calls() as f64 / (FREE + LIMITED) as f64;
    println!(
        "rates independence: the free jobs' time from the first completion to the last free \
         start, with {LIMITED} limited ones / alone: {} (medians {free_wall:.2} / {alone:.2} s, \
         {:.2}x); {per_job:.1} Redis commands per job; {}",
        pairs.join(", "),
        free_wall / alone.max(1e-6),
        delta.breakdown((FREE + LIMITED) as u64, 14)
    );
    rows.push(row(
        "rates: free jobs with 300 limited ones vs alone (medians of 3)",
        format!(
            "{free_wall:.2} s vs {alone:.2} s ({:.2}x)",
            free_wall / alone.max(1e-6)
        ),
        "≤ 1.2x",
        Some(free_wall / alone.max(1e-6) <= 1.2),
    ));
    rows.push(row(
        "rates: Redis commands per job (mixed)",
        format!("{per_job:.1}"),
        "≤ 15",
        Some(per_job <= 15.0),
    ));
    Ok(())
}

/// Drains the queue (`total` jobs, of which the first FREE `probe` lines are the free jobs')
/// with one daemon: the seconds from its first completion to its last free job's start line,
/// and, when `to_the_end`, the Redis commands of the whole drain (else it stops once the free
/// jobs have started). The log is read as it grows, each byte once.
fn independence_drain(
    ctx: &mut Ctx,
    config: &str,
    workers: usize,
    total: usize,
    to_the_end: bool,
) -> Result<(f64, Option<stats::Delta>)> {
    let s0 = stats::snapshot(&mut ctx.conn)?;
    let t0 = Instant::now();
    let mut daemon = ctx.start_daemon(config, workers)?;
    let mut probes = crate::hotkey::ProbeCount::default();
    let (mut first, mut free_done) = (None, None);
    let mut gets = 0u64;
    loop {
        check_interrupt()?;
        let p = ctx.processed()?;
        gets += 1;
        let now = Instant::now();
        if p > 0 && first.is_none() {
            first = Some(now);
        }
        if free_done.is_none() && probes.count(&daemon.log) >= FREE {
            free_done = Some(now);
        }
        // The log is written after the job's end reaches Redis: a drain whose count is in
        // may still owe its last probe lines, so both are waited for.
        if free_done.is_some() && (p >= total as u64 || !to_the_end) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("rates: independence drain timed out ({p} of {total})");
        }
        daemon.check_alive()?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let delta = if to_the_end {
        let s1 = stats::snapshot(&mut ctx.conn)?;
        Some(stats::Delta::between(&s0, &s1, &[("get", gets)]))
    } else {
        None
    };
    daemon.stop(Duration::from_secs(30));
    let (Some(first), Some(done)) = (first, free_done) else {
        bail!("rates: the free jobs did not all start");
    };
    Ok((done.duration_since(first).as_secs_f64(), delta))
}
