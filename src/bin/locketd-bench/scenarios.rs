//! The scenarios: each drains a queue (or idles) against its own redis-server and adds its
//! figures to the table.

use super::*;

/// Every `latency_us=N` the probe builtin logged, sorted.
pub(crate) fn probe_latencies(log: &str) -> Vec<u64> {
    let mut v: Vec<u64> = log
        .lines()
        .filter_map(|l| l.split("latency_us=").nth(1))
        .filter_map(|rest| {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            digits.parse().ok()
        })
        .collect();
    v.sort_unstable();
    v
}

pub(crate) const NOOP_CLASSES: &str =
    "[classes.Noop]\nbuiltin = \"noop\"\n\n[classes.Probe]\nbuiltin = \"probe\"\n";

/// Issue 15's targets for Redis commands per job (commands run inside scripts counted):
/// 12 with one job per process, 8 in slots mode.
const CMDS_PREFORK: f64 = 12.0;
const CMDS_SLOTS: f64 = 8.0;
/// Issue 15's CPU targets per job for `--workers 2 --slots 32`, Redis and locketd each.
const SLOTS_CPU_US: f64 = 40.0;

/// `Some(x <= limit)` when `limit` is there, with its text.
fn at_most(x: f64, limit: Option<f64>, unit: &str) -> (String, Option<bool>) {
    match limit {
        Some(l) => (format!("≤ {l}{unit}"), Some(x <= l)),
        None => (String::new(), None),
    }
}

fn noop_run(
    opts: &Opts,
    exe: &Path,
    workers: usize,
    rows: &mut Vec<Row>,
    label: &str,
) -> Result<f64> {
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(200_000);
    ctx.push_noop("bench", "Noop", n)?;
    let classes = match &opts.lock {
        Some(t) => NOOP_CLASSES.replacen(
            "builtin = \"noop\"\n",
            &format!(
                "builtin = \"noop\"\nlock = {}\n",
                toml::Value::from(t.as_str())
            ),
            1,
        ),
        None => NOOP_CLASSES.to_string(),
    };
    let config = ctx.config(&["bench".into()], &classes);
    let (d, mut daemon) = ctx.drain(&config, workers, n)?;
    d.report(label);
    rows.push(row(
        format!("{label}: jobs/s"),
        fmt_int(d.rate),
        "peer ratios: `peers`, `all`",
        None,
    ));
    let cmds_limit = Some(if opts.slots.is_some() {
        CMDS_SLOTS
    } else {
        CMDS_PREFORK
    });
    let scripts = d.scripts_per_job();
    let inside = d.cmds_per_job() - scripts;
    let (target, ok) = at_most(inside, cmds_limit, "");
    rows.push(row(
        format!("{label}: Redis commands/job, inside scripts and out (EVALSHA calls not counted)"),
        format!("{inside:.1}"),
        target,
        ok,
    ));
    let (target, ok) = at_most(d.cmds_per_job(), cmds_limit, "");
    rows.push(row(
        format!("{label}: Redis commands/job with the EVALSHA calls"),
        format!("{:.1} ({scripts:.2} script calls)", d.cmds_per_job()),
        target,
        ok,
    ));
    // The CPU targets are set for the issue's slots configuration only.
    let cpu_limit = (workers == 2 && opts.slots == Some(32)).then_some(SLOTS_CPU_US);
    let (target, ok) = at_most(d.cpu_us_per_job(), cpu_limit, " us");
    rows.push(row(
        format!("{label}: Redis CPU/job"),
        format!("{:.1} us", d.cpu_us_per_job()),
        target,
        ok,
    ));
    let (target, ok) = at_most(d.daemon_cpu_us_per_job(), cpu_limit, " us");
    rows.push(row(
        format!("{label}: locketd CPU/job (master + workers)"),
        format!("{:.1} us", d.daemon_cpu_us_per_job()),
        target,
        ok,
    ));
    rows.push(row(
        format!("{label}: peak RSS"),
        match d.rss.max_worker_kib() {
            Some(k) => format!("master {}, worker max {}", mib(d.rss.master_kib), mib(k)),
            None => format!("{} (single process)", mib(d.rss.master_kib)),
        },
        "< 16 MiB",
        Some(d.rss.master_kib < 16 * 1024 && d.rss.max_worker_kib().unwrap_or(0) < 16 * 1024),
    ));
    if opts.latency_secs > 0.0 {
        let rate = opts
            .latency_rate
            .unwrap_or((d.rate * 0.25).clamp(50.0, 5_000.0));
        let lat = ctx.paced_latency(&mut daemon, "bench", rate, opts.latency_secs)?;
        if lat.is_empty() {
            println!("  latency: no probe lines in the log");
        } else {
            let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
            println!(
                "  enqueue-to-start latency at a steady {} jobs/s for {:.0} s ({} jobs): p50 {:.2} ms, p99 {:.2} ms",
                fmt_int(rate),
                opts.latency_secs,
                lat.len(),
                p50 as f64 / 1e3,
                p99 as f64 / 1e3
            );
            rows.push(row(
                format!(
                    "{label}: enqueue-to-start p50 / p99 at {} jobs/s",
                    fmt_int(rate)
                ),
                format!("{:.1} / {:.1} ms", p50 as f64 / 1e3, p99 as f64 / 1e3),
                "",
                None,
            ));
        }
    }
    daemon.stop(Duration::from_secs(30));
    Ok(d.rate)
}

/// `noop --workers N` or `noop --workers N --slots K`: the noop rows' label.
pub(crate) fn noop_label(workers: usize, slots: Option<usize>) -> String {
    match slots {
        Some(k) => format!("noop --workers {workers} --slots {k}"),
        None => format!("noop --workers {workers}"),
    }
}

/// Drains the noop queue; returns its jobs/s for the peer ratios.
pub(crate) fn scenario_noop(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<f64> {
    let workers = opts.workers.unwrap_or(1);
    let label = noop_label(workers, opts.slots);
    noop_run(opts, exe, workers, rows, &label)
}

pub(crate) fn scenario_command(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(4);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    ctx.push_noop("bench", "True", n)?;
    let config = ctx.config(
        &["bench".into()],
        "[classes.True]\ncommand = [\"/bin/true\"]\n",
    );
    let (d, daemon) = ctx.drain(&config, workers, n)?;
    let label = format!("command /bin/true --workers {workers}");
    d.report(&label);
    daemon.stop(Duration::from_secs(30));
    // The same run's spawn ceiling with this parallelism (taken now if `all` did not).
    let ceiling = match spawn::last_for(workers) {
        Some(c) => c,
        None => spawn::ceiling(workers, n)?.rate,
    };
    let share = d.rate / ceiling;
    println!(
        "  {:.0}% of the spawn ceiling ({} spawns/s)",
        share * 100.0,
        fmt_int(ceiling)
    );
    rows.push(row(
        format!("{label}: jobs/s"),
        format!(
            "{} ({:.0}% of spawn-ceiling {})",
            fmt_int(d.rate),
            share * 100.0,
            fmt_int(ceiling)
        ),
        "≥ 70% of spawn-ceiling",
        Some(share >= 0.7),
    ));
    rows.push(row(
        format!("{label}: Redis CPU/job"),
        format!("{:.1} us", d.cpu_us_per_job()),
        "",
        None,
    ));
    Ok(())
}

pub(crate) fn scenario_starvation(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(1);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(50_000);
    let hold = r#"{"class":"Hold","args":[3600]}"#;
    let classes = format!("{NOOP_CLASSES}\n[classes.Hold]\nbuiltin = \"sleep\"\n");
    let queues = vec!["high".to_string(), "low".to_string()];
    let config = ctx.config(&queues, &classes);

    // Baseline: high empty.
    ctx.push_noop("low", "Noop", n)?;
    let (base, daemon) = ctx.drain(&config, workers, n)?;
    daemon.stop(Duration::from_secs(30));
    base.report("starvation baseline (high empty)");

    // The holder: another locketd runs one Hold job (sleep 3600 s) and keeps its lock.
    ctx.flush()?;
    ctx.push("hold", std::iter::once(hold.to_string()))?;
    // The holder always logs at info: the harness waits for its "job started" line.
    let holder_cfg = ctx.config(&["hold".into()], &classes).replace(
        &format!("log_level = \"{},", ctx.opts.log_level),
        "log_level = \"info,",
    );
    let mut holder = ctx.start_daemon(&holder_cfg, 1)?;
    holder.wait_log("job started", Duration::from_secs(30))?;
    ctx.push("high", (0..1000).map(|_| hold.to_string()))?;
    ctx.push_noop("low", "Noop", n)?;
    let (run, daemon) = ctx.drain(&config, workers, n)?;
    let high_left: u64 = redis::cmd("LLEN")
        .arg("resque:queue:high")
        .query(&mut ctx.conn)?;
    daemon.stop(Duration::from_secs(30));
    holder.stop(Duration::from_secs(30));
    run.report("starvation (high: 1,000 jobs on one held lock)");
    let ratio = run.rate / base.rate;
    let extra = run.delta.total_calls() as f64 - base.delta.total_calls() as f64;
    println!(
        "  low drains at {:.0}% of its baseline; {} extra Redis commands ({:.2} per low job) went to high; high still holds {high_left} jobs",
        ratio * 100.0,
        fmt_int(extra),
        extra / n as f64
    );
    rows.push(row(
        "starvation: low rate vs high empty",
        format!(
            "{:.0}% ({} vs {} jobs/s)",
            ratio * 100.0,
            fmt_int(run.rate),
            fmt_int(base.rate)
        ),
        "≥ 80%",
        Some(ratio >= 0.8),
    ));
    rows.push(row(
        "starvation: Redis commands spent on high",
        format!("{} ({:.2} per low job)", fmt_int(extra), extra / n as f64),
        "",
        None,
    ));
    Ok(())
}

pub(crate) fn scenario_queues(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(1);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(50_000);
    let all: Vec<String> = (0..100).map(|i| format!("q{i:03}")).collect();
    let last = all[99].clone();

    ctx.push_noop(&last, "Noop", n)?;
    let config1 = ctx.config(std::slice::from_ref(&last), NOOP_CLASSES);
    let (one, daemon) = ctx.drain(&config1, workers, n)?;
    daemon.stop(Duration::from_secs(30));
    one.report("queues: 1 configured queue");

    ctx.flush()?;
    ctx.push_noop(&last, "Noop", n)?;
    let config100 = ctx.config(&all, NOOP_CLASSES);
    let (hundred, daemon) = ctx.drain(&config100, workers, n)?;
    daemon.stop(Duration::from_secs(30));
    hundred.report("queues: 100 configured queues, jobs in the last");
    let ratio = hundred.rate / one.rate;
    println!(
        "  100 queues run at {:.0}% of the 1-queue rate",
        ratio * 100.0
    );
    rows.push(row(
        "queues: 100 queues vs 1",
        format!(
            "{:.0}% ({} vs {} jobs/s)",
            ratio * 100.0,
            fmt_int(hundred.rate),
            fmt_int(one.rate)
        ),
        "≥ 70%",
        Some(ratio >= 0.7),
    ));
    rows.push(row(
        "queues: Redis CPU/job, 100 vs 1",
        format!(
            "{:.1} vs {:.1} us",
            hundred.cpu_us_per_job(),
            one.cpu_us_per_job()
        ),
        "",
        None,
    ));
    Ok(())
}

/// The `idle` scenario lives in `idle.rs`.
pub(crate) use crate::idle::scenario_idle;

/// Runs one scenario; an error becomes a table row instead of ending `all`.
pub(crate) fn attempt(
    name: &str,
    rows: &mut Vec<Row>,
    f: impl FnOnce(&mut Vec<Row>) -> Result<()>,
) -> Result<()> {
    match f(rows) {
        Ok(()) => Ok(()),
        Err(e) if procs::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) => Err(e),
        Err(e) => {
            eprintln!("locketd-bench: {name}: {e:#}");
            let first = format!("{e:#}");
            let first = first.lines().next().unwrap_or("").to_string();
            rows.push(row(name, format!("n/a: {first}"), "", None));
            Ok(())
        }
    }
}
