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

/// Reference figures from the issue (docs/peer-bench.md), used when no peer ran in this run.
pub(crate) const NODE_WORKER_JOBLOCK: f64 = 1_727.0;
pub(crate) const RUBY_FORK: f64 = 287.0;

fn noop_run(
    opts: &Opts,
    exe: &Path,
    workers: usize,
    rows: &mut Vec<Row>,
    label: &str,
    target_rate: f64,
    target_text: &str,
) -> Result<f64> {
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(200_000);
    ctx.push_noop("bench", "Noop", n)?;
    let config = ctx.config(&["bench".into()], NOOP_CLASSES);
    let (d, mut daemon) = ctx.drain(&config, workers, n)?;
    d.report(label);
    rows.push(row(
        format!("{label}: jobs/s"),
        fmt_int(d.rate),
        target_text,
        Some(d.rate >= target_rate),
    ));
    rows.push(row(
        format!("{label}: Redis commands/job (incl. in scripts)"),
        format!("{:.1}", d.cmds_per_job()),
        "",
        None,
    ));
    rows.push(row(
        format!("{label}: script calls/job"),
        format!("{:.2}", d.scripts_per_job()),
        "",
        None,
    ));
    rows.push(row(
        format!("{label}: Redis CPU/job"),
        format!("{:.1} us", d.cpu_us_per_job()),
        "",
        None,
    ));
    rows.push(row(
        format!("{label}: locketd CPU/job (master + workers)"),
        format!("{:.1} us", d.daemon_cpu_us_per_job()),
        "",
        None,
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

pub(crate) fn scenario_noop(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<f64> {
    let workers = opts.workers.unwrap_or(1);
    let label = match opts.slots {
        Some(k) => format!("noop --workers {workers} --slots {k}"),
        None => format!("noop --workers {workers}"),
    };
    let (target, text) = match (workers, opts.slots) {
        (_, Some(_)) => (
            40_000.0,
            "≥ 40,000 (workers 2, slots 32; Redis CPU ≤ 15 us/job)".to_string(),
        ),
        (1, None) => (
            2.0 * NODE_WORKER_JOBLOCK,
            format!(
                "≥ {} (2× node-resque Worker+JobLock {})",
                fmt_int(2.0 * NODE_WORKER_JOBLOCK),
                fmt_int(NODE_WORKER_JOBLOCK)
            ),
        ),
        _ => (10_000.0, "≥ 10,000 (workers 8)".to_string()),
    };
    noop_run(opts, exe, workers, rows, &label, target, &text)
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
    let target = 10.0 * RUBY_FORK;
    rows.push(row(
        format!("{label}: jobs/s"),
        fmt_int(d.rate),
        format!(
            "≥ {} (10× Ruby Resque fork-per-job {})",
            fmt_int(target),
            fmt_int(RUBY_FORK)
        ),
        Some(d.rate >= target),
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

/// `bench/node` with node-resque installed (`npm ci` the first time).
fn node_dir(scratch: &Path) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/node");
    if !dir.join("package.json").is_file() {
        bail!(
            "{} is missing (the peers scenario needs the source tree)",
            dir.display()
        );
    }
    if !dir.join("node_modules/node-resque/package.json").is_file() {
        eprintln!("locketd-bench: npm ci in {}", dir.display());
        let mut cmd = Command::new("npm");
        cmd.args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir);
        let (status, _, err) =
            procs::run_bounded(cmd, Duration::from_secs(300), scratch, "npm-ci")?;
        if !status.success() {
            bail!("npm ci in {} failed ({status}):\n{err}", dir.display());
        }
    }
    Ok(dir)
}

fn node_drain(ctx: &mut Ctx, node: &Path, n: usize, mode: &[&str]) -> Result<(f64, Delta)> {
    ctx.flush()?;
    ctx.push_noop("bench", "Noop", n)?;
    let s0 = stats::snapshot(&mut ctx.conn)?;
    let mut cmd = Command::new("node");
    cmd.arg(node.join("drain.js"))
        .args(["--port", &ctx.redis.port.to_string(), "--n", &n.to_string()])
        .args(mode)
        .current_dir(node);
    let limit = Duration::from_secs(ctx.opts.timeout.unwrap_or(60 + n as u64 / 100));
    let (status, out, err) = procs::run_bounded(cmd, limit, ctx.dir.path(), "node-drain")?;
    let s1 = stats::snapshot(&mut ctx.conn)?;
    if !status.success() {
        bail!("node drain.js {mode:?} failed ({status}):\n{err}");
    }
    let line = out.lines().last().unwrap_or("");
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("node output: {out}"))?;
    let rate = v["jobsPerS"]
        .as_f64()
        .ok_or_else(|| anyhow!("no jobsPerS in {line}"))?;
    Ok((rate, Delta::between(&s0, &s1, &[])))
}

pub(crate) fn scenario_peers(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(1);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    let node = node_dir(ctx.dir.path())?;
    ctx.push_noop("bench", "Noop", n)?;
    let config = ctx.config(&["bench".into()], NOOP_CLASSES);
    let (d, daemon) = ctx.drain(&config, workers, n)?;
    daemon.stop(Duration::from_secs(30));
    d.report(&format!("peers: locketd noop --workers {workers}"));
    let (multi, md) = node_drain(&mut ctx, &node, n, &["--mode", "multi", "--max", "10"])?;
    println!(
        "peers: node-resque MultiWorker (10): {} jobs/s, Redis {:.1} commands/job, CPU {:.1} us/job",
        fmt_int(multi),
        md.total_calls() as f64 / n as f64,
        md.cpu_s * 1e6 / n as f64
    );
    let (single, sd) = node_drain(&mut ctx, &node, n, &["--mode", "worker", "--joblock"])?;
    println!(
        "peers: node-resque Worker + JobLock: {} jobs/s, Redis {:.1} commands/job, CPU {:.1} us/job",
        fmt_int(single),
        sd.total_calls() as f64 / n as f64,
        sd.cpu_s * 1e6 / n as f64
    );
    println!(
        "peers: locketd / node-resque MultiWorker = {:.2}; locketd / node-resque Worker+JobLock = {:.2}",
        d.rate / multi,
        d.rate / single
    );
    rows.push(row(
        format!("peers: locketd (--workers {workers}) / node-resque MultiWorker(10)"),
        format!(
            "{:.2} ({} vs {} jobs/s)",
            d.rate / multi,
            fmt_int(d.rate),
            fmt_int(multi)
        ),
        "",
        None,
    ));
    rows.push(row(
        format!("peers: locketd (--workers {workers}) / node-resque Worker+JobLock"),
        format!(
            "{:.2} ({} vs {} jobs/s)",
            d.rate / single,
            fmt_int(d.rate),
            fmt_int(single)
        ),
        if workers == 1 { "≥ 2.0" } else { "" },
        (workers == 1).then_some(d.rate / single >= 2.0),
    ));
    Ok(())
}

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
