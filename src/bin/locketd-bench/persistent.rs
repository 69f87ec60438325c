//! The persistent-handler scenarios (issue 13 item 6): `ruby` and `python` drain no-op jobs
//! through the language adapters (`mode = "persistent"`, docs/persistent-handlers.md), beside
//! Sidekiq and the exec-per-job baseline; `handler-latency` compares the enqueue-to-start
//! latency of the in-process `probe` builtin with a `Probe` class in a persistent handler.

use super::*;
use scenarios::NOOP_CLASSES;
use sidekiq::{sidekiq_drain, PeerDrain};

/// Jobs of the exec-per-job baseline: at 10–40 jobs/s a short run says enough.
const EXEC_JOBS: usize = 100;

/// The absolute target for an adapter on `--workers 2`.
const ADAPTER_TARGET: f64 = 1_500.0;

/// The target for the Ruby adapter against exec-per-job Ruby.
const EXEC_RATIO_TARGET: f64 = 50.0;

/// The target for what a persistent handler adds to the p50 enqueue-to-start latency.
const ADDED_P50_TARGET_MS: f64 = 0.3;

/// A file of the source tree, as an absolute path (the daemon runs elsewhere).
pub(crate) fn repo_file(rel: &str) -> Result<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if !p.is_file() {
        bail!(
            "{} is missing (this scenario needs the source tree)",
            p.display()
        );
    }
    Ok(p)
}

pub(crate) fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Whether `all` runs the Ruby scenarios: `ruby` and `sidekiq` on PATH.
pub(crate) fn ruby_installed() -> bool {
    procs::on_path("ruby").is_some() && procs::on_path("sidekiq").is_some()
}

/// Whether `all` runs the Python scenario: `python3` on PATH.
pub(crate) fn python_installed() -> bool {
    procs::on_path("python3").is_some()
}

/// `[adapters/ruby/locketd-ruby, APP_FILE]`, once `ruby` is on PATH (the adapter's `#!`).
pub(crate) fn ruby_command(app: &str) -> Result<Vec<String>> {
    if procs::on_path("ruby").is_none() {
        bail!("ruby is not installed (apt-get install ruby; see bench/README.md)");
    }
    let adapter = repo_file("adapters/ruby/locketd-ruby")?;
    Ok(vec![path_str(&adapter), path_str(&repo_file(app)?)])
}

/// The interpreter behind `python3` on PATH (`sys.executable`), so a pyenv-style shim does not
/// add its own start-up to every exec-per-job run.
pub(crate) fn python_exe(scratch: &Path) -> Result<String> {
    if procs::on_path("python3").is_none() {
        bail!("python3 is not installed (apt-get install python3; see bench/README.md)");
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-c", "import sys; print(sys.executable)"]);
    let (status, out, err) =
        procs::run_bounded(cmd, Duration::from_secs(30), scratch, "python3-exe")?;
    let exe = out.trim();
    if !status.success() || exe.is_empty() {
        bail!("python3 -c 'print(sys.executable)' failed ({status}):\n{err}");
    }
    Ok(exe.to_string())
}

/// `[PYTHON, adapters/python/locketd_handler.py, MODULE]`.
pub(crate) fn python_command(python: &str, module: &str) -> Result<Vec<String>> {
    let adapter = repo_file("adapters/python/locketd_handler.py")?;
    Ok(vec![
        python.to_string(),
        path_str(&adapter),
        path_str(&repo_file(module)?),
    ])
}

/// Every class goes to one persistent handler, `app`, started with its slot.
fn persistent_classes(command: &[String]) -> String {
    format!(
        "[handlers.app]\nmode = \"persistent\"\ncommand = {}\npreload = true\n\n[classes.\"*\"]\nhandler = \"app\"\n",
        serde_json::to_string(command).unwrap_or_default()
    )
}

/// A class `Exec` whose handler runs `argv` once per job (exec mode, the default).
fn exec_classes(argv: &[String]) -> String {
    format!(
        "[classes.Exec]\ncommand = {}\n",
        serde_json::to_string(argv).unwrap_or_default()
    )
}

/// Flushes, pushes `n` jobs of `class` to `bench` and drains them with `classes`.
fn drain_fresh(
    ctx: &mut Ctx,
    classes: &str,
    class: &str,
    workers: usize,
    n: usize,
) -> Result<(Drain, Daemon)> {
    ctx.flush()?;
    ctx.push_noop("bench", class, n)?;
    let config = ctx.config(&["bench".into()], classes);
    ctx.drain(&config, workers, n)
}

/// Prints the handler processes' share of a persistent drain.
fn report_handlers(d: &Drain) {
    println!(
        "  handler processes: {} seen, CPU {:.1} us/job (boot included), largest peak RSS {}",
        d.rss.handlers_kib.len(),
        handler_cpu_us_per_job(d),
        mib(d.rss.max_handler_kib().unwrap_or(0))
    );
}

fn handler_cpu_us_per_job(d: &Drain) -> f64 {
    d.rss.handler_cpu_secs() * 1e6 / d.jobs.max(1) as f64
}

/// Drains `n` Noop jobs through the persistent handler `command` and adds its rows.
fn adapter_drain(
    ctx: &mut Ctx,
    command: &[String],
    workers: usize,
    n: usize,
    label: &str,
    rows: &mut Vec<Row>,
) -> Result<Drain> {
    let mut classes = persistent_classes(command);
    // `--lock`: the `*` table (the last one) gets the template.
    if let Some(t) = &ctx.opts.lock {
        classes.push_str(&format!("lock = {}\n", toml::Value::from(t.as_str())));
    }
    let (mut d, daemon) = drain_fresh(ctx, &classes, "Noop", workers, n)?;
    // One more sample: a process counts from its second sighting, and a short drain may end
    // before the handlers (children of workers, themselves counted from their second) had two.
    daemon.peak_rss(&mut d.rss);
    daemon.stop(Duration::from_secs(30));
    d.report(label);
    report_handlers(&d);
    rows.push(row(
        format!("{label}: jobs/s"),
        fmt_int(d.rate),
        format!("≥ {}", fmt_int(ADAPTER_TARGET)),
        Some(d.rate >= ADAPTER_TARGET),
    ));
    rows.push(row(
        format!("{label}: Redis commands/job (incl. in scripts)"),
        format!("{:.1}", d.cmds_per_job()),
        "",
        None,
    ));
    rows.push(row(
        format!("{label}: CPU/job, locketd + handlers (boot included)"),
        format!(
            "{:.1} + {:.1} us",
            d.daemon_cpu_us_per_job(),
            handler_cpu_us_per_job(&d)
        ),
        "",
        None,
    ));
    rows.push(row(
        format!("{label}: peak RSS, largest handler"),
        mib(d.rss.max_handler_kib().unwrap_or(0)),
        "",
        None,
    ));
    Ok(d)
}

/// The exec-per-job baseline: `argv` once per job, `EXEC_JOBS` jobs.
fn exec_drain(ctx: &mut Ctx, argv: &[String], workers: usize, label: &str) -> Result<Drain> {
    let n = EXEC_JOBS.min(ctx.jobs(EXEC_JOBS));
    let (d, daemon) = drain_fresh(ctx, &exec_classes(argv), "Exec", workers, n)?;
    daemon.stop(Duration::from_secs(30));
    d.report(label);
    Ok(d)
}

/// `a / b` as `1.23× (a vs b jobs/s)`.
fn ratio_text(a: f64, b: f64) -> String {
    format!("{:.2}× ({} vs {} jobs/s)", a / b, fmt_int(a), fmt_int(b))
}

/// The rows comparing an adapter with the exec-per-job baseline of its language.
fn exec_rows(
    rows: &mut Vec<Row>,
    label: &str,
    adapter: f64,
    exec: Result<Drain>,
    target: Option<f64>,
) {
    match exec {
        Ok(e) => {
            println!(
                "{label} / exec-per-job = {:.1}× ({} vs {} jobs/s)",
                adapter / e.rate,
                fmt_int(adapter),
                fmt_int(e.rate)
            );
            rows.push(row(
                format!("{label} / exec-per-job ({} jobs)", e.jobs),
                ratio_text(adapter, e.rate),
                target.map(|t| format!("≥ {t:.0}×")).unwrap_or_default(),
                target.map(|t| adapter / e.rate >= t),
            ));
        }
        Err(e) => {
            eprintln!("locketd-bench: {label}: exec-per-job baseline: {e:#}");
            rows.push(row(
                format!("{label} / exec-per-job"),
                format!("n/a: {}", first_line(&e)),
                "",
                None,
            ));
        }
    }
}

pub(crate) fn first_line(e: &anyhow::Error) -> String {
    format!("{e:#}").lines().next().unwrap_or("").to_string()
}

/// `ruby`: the example app's `Noop` through the Ruby adapter, then Sidekiq on the same class
/// body, then `ruby noop_job.rb` per job.
pub(crate) fn scenario_ruby(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    let command = ruby_command("examples/ruby-app/app.rb")?;
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    let label = format!("ruby adapter --workers {workers}");
    let d = adapter_drain(&mut ctx, &command, workers, n, &label, rows)?;

    let concurrency = 10;
    let peer: Result<PeerDrain> = sidekiq_drain(&ctx, n, concurrency, 1).inspect(|s| {
        s.report(&format!("sidekiq 6.4 -c {concurrency}"));
    });
    match peer {
        Ok(s) => {
            println!(
                "ruby adapter / Sidekiq -c {concurrency} = {:.2}; CPU/job: locketd + Ruby {:.1} us vs Sidekiq {:.1} us (boot included)",
                d.rate / s.rate,
                d.daemon_cpu_us_per_job() + handler_cpu_us_per_job(&d),
                s.cpu_us_per_job
            );
            rows.push(row(
                format!("sidekiq 6.4 -c {concurrency}: Redis commands/job"),
                format!("{:.1}", s.cmds_per_job()),
                "",
                None,
            ));
            rows.push(row(
                format!("{label} / Sidekiq 6.4 -c {concurrency}"),
                ratio_text(d.rate, s.rate),
                "≥ 1.0×",
                Some(d.rate >= s.rate),
            ));
        }
        Err(e) => {
            eprintln!("locketd-bench: sidekiq: {e:#}");
            rows.push(row(
                format!("{label} / Sidekiq 6.4 -c {concurrency}"),
                format!("n/a: {}", first_line(&e)),
                "≥ 1.0×",
                None,
            ));
        }
    }

    let argv = vec![
        "ruby".to_string(),
        path_str(&repo_file("bench/ruby/noop_job.rb")?),
    ];
    let exec = exec_drain(
        &mut ctx,
        &argv,
        workers,
        &format!("exec-per-job `ruby noop_job.rb` --workers {workers}"),
    );
    exec_rows(rows, &label, d.rate, exec, Some(EXEC_RATIO_TARGET));
    Ok(())
}

/// The module for the Python adapter: the example app's when it is there, else the harness's.
fn python_module() -> &'static str {
    let example = "examples/python-app/jobs.py";
    if Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(example)
        .is_file()
    {
        example
    } else {
        "bench/python/probe_jobs.py"
    }
}

/// `python`: `Noop` through the Python adapter, then `python3 noop_job.py` per job.
pub(crate) fn scenario_python(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    let mut ctx = Ctx::new(opts, exe)?;
    let python = python_exe(ctx.dir.path())?;
    let module = python_module();
    let command = python_command(&python, module)?;
    let n = ctx.jobs(20_000);
    let label = format!("python adapter --workers {workers}");
    println!("python: {python}, module {module}");
    let d = adapter_drain(&mut ctx, &command, workers, n, &label, rows)?;
    let argv = vec![python, path_str(&repo_file("bench/python/noop_job.py")?)];
    let exec = exec_drain(
        &mut ctx,
        &argv,
        workers,
        &format!("exec-per-job `python3 noop_job.py` --workers {workers}"),
    );
    exec_rows(rows, &label, d.rate, exec, None);
    Ok(())
}

/// p50 and p99 of a latency sample, in ms.
fn p50_p99_ms(lat: &[u64]) -> (f64, f64) {
    (
        percentile(lat, 0.5) as f64 / 1e3,
        percentile(lat, 0.99) as f64 / 1e3,
    )
}

/// One handler's latency run: drains `n` Noop jobs (its capacity, and warm handlers), then
/// paces Probe jobs at `rate` (default: 25% of that capacity). Returns drain rate, pace and
/// the sorted latencies (us).
fn latency_run(
    ctx: &mut Ctx,
    classes: &str,
    workers: usize,
    n: usize,
    rate: Option<f64>,
    secs: f64,
    label: &str,
) -> Result<(f64, f64, Vec<u64>)> {
    let (d, mut daemon) = drain_fresh(ctx, classes, "Noop", workers, n)?;
    d.report(&format!("{label}: drain"));
    let rate = rate.unwrap_or((d.rate * 0.25).clamp(50.0, 5_000.0));
    let lat = ctx.paced_latency(&mut daemon, "bench", rate, secs)?;
    daemon.stop(Duration::from_secs(30));
    if lat.is_empty() {
        bail!("{label}: no latency_us lines in the daemon's log");
    }
    let (p50, p99) = p50_p99_ms(&lat);
    println!(
        "{label}: enqueue-to-start at a steady {} jobs/s ({:.0}% of its drain rate) for {secs:.0} s ({} jobs): p50 {p50:.3} ms, p99 {p99:.2} ms",
        fmt_int(rate),
        rate / d.rate * 100.0,
        lat.len()
    );
    Ok((d.rate, rate, lat))
}

/// `handler-latency`: the p50 enqueue-to-start latency of a `Probe` class in the Ruby adapter
/// (and the Python one, when python3 is there), against the in-process `probe` builtin, all
/// paced at one rate: 25% of the Ruby adapter's drain rate (`--latency-rate` overrides).
pub(crate) fn scenario_handler_latency(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    let secs = if opts.latency_secs > 0.0 {
        opts.latency_secs
    } else {
        2.0
    };
    let ruby = ruby_command("bench/ruby/probe_app.rb")?;
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(10_000);

    let (ruby_drain, rate, ruby_lat) = latency_run(
        &mut ctx,
        &persistent_classes(&ruby),
        workers,
        n,
        opts.latency_rate,
        secs,
        "handler-latency: ruby adapter",
    )?;
    let (builtin_drain, _, builtin_lat) = latency_run(
        &mut ctx,
        NOOP_CLASSES,
        workers,
        n,
        Some(rate),
        secs,
        "handler-latency: probe builtin",
    )?;
    let (b50, b99) = p50_p99_ms(&builtin_lat);
    rows.push(row(
        format!(
            "handler-latency --workers {workers}: builtin probe p50 / p99 at {} jobs/s ({:.0}% load)",
            fmt_int(rate),
            rate / builtin_drain * 100.0
        ),
        format!("{b50:.2} / {b99:.1} ms"),
        "",
        None,
    ));
    let mut added = |name: &str, drain: f64, lat: &[u64]| {
        let (p50, p99) = p50_p99_ms(lat);
        let plus = p50 - b50;
        println!("handler-latency: the {name} adds {plus:+.3} ms at p50 over the probe builtin");
        rows.push(row(
            format!(
                "handler-latency: {name} Probe p50 / p99 ({:.0}% load)",
                rate / drain * 100.0
            ),
            format!("{p50:.2} / {p99:.1} ms"),
            "",
            None,
        ));
        rows.push(row(
            format!("handler-latency: {name} adds at p50"),
            format!("{plus:+.2} ms"),
            format!("≤ {ADDED_P50_TARGET_MS} ms"),
            Some(plus <= ADDED_P50_TARGET_MS),
        ));
    };
    added("ruby adapter", ruby_drain, &ruby_lat);

    if python_installed() {
        let run = python_exe(ctx.dir.path()).and_then(|py| {
            let command = python_command(&py, "bench/python/probe_jobs.py")?;
            latency_run(
                &mut ctx,
                &persistent_classes(&command),
                workers,
                n,
                Some(rate),
                secs,
                "handler-latency: python adapter",
            )
        });
        match run {
            Ok((drain, _, lat)) => added("python adapter", drain, &lat),
            Err(e) => {
                eprintln!("locketd-bench: handler-latency: python adapter: {e:#}");
                rows.push(row(
                    "handler-latency: python adapter",
                    format!("n/a: {}", first_line(&e)),
                    "",
                    None,
                ));
            }
        }
    } else {
        println!("handler-latency: python3 is not installed: the Python adapter is skipped");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_tables_are_toml_the_daemon_reads() {
        let cmd = vec!["/a b/locketd-ruby".to_string(), "/x/\"app\".rb".to_string()];
        let v: toml::Value = toml::from_str(&persistent_classes(&cmd)).unwrap();
        assert_eq!(v["handlers"]["app"]["mode"].as_str(), Some("persistent"));
        assert_eq!(
            v["handlers"]["app"]["command"][1].as_str(),
            Some("/x/\"app\".rb")
        );
        assert_eq!(v["classes"]["*"]["handler"].as_str(), Some("app"));
        let v: toml::Value = toml::from_str(&exec_classes(&cmd)).unwrap();
        assert_eq!(
            v["classes"]["Exec"]["command"][0].as_str(),
            Some("/a b/locketd-ruby")
        );
    }

    #[test]
    fn probe_lines_of_a_persistent_handler_are_read_like_the_builtin_s() {
        // locketd logs a handler's stdout line as the message of a locketd::handler event.
        let log = "2026-01-01T00:00:00Z  INFO locketd::handler: latency_us=412 class=Probe queue=bench stream=\"stdout\"\n\
                   2026-01-01T00:00:00Z  INFO locketd::probe: probe job started latency_us=97 queue=bench\n";
        assert_eq!(scenarios::probe_latencies(log), vec![97, 412]);
        assert_eq!(p50_p99_ms(&[100, 200, 300]), (0.2, 0.3));
    }
}
