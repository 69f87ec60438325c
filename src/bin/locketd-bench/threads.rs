//! `threads` (issue 38 item 8): jobs that wait. N jobs that each sleep 50 ms, drained at
//! concurrency C (25 and 100) by Sidekiq `-c C` (one process) and by `locketd --workers 1
//! --slots C` with a persistent handler at `threads = C` and, for reference, `threads = 1`; the
//! same app in both (`bench/threads/app.rb`: ActiveSupport + ActiveJob and ~60 MB of retained
//! heap). Figures: jobs/s, and the summed PSS of each system's whole process tree (locketd:
//! master, worker, handlers) sampled once half-way through the drain, with its process count.
//! Then the same for a Node and a Python app of the same shape (locketd only, no bound).
//!
//! Both systems are timed by their queue, as the Sidekiq peer always is: from the first time
//! it is shorter than when first seen to the time it is empty, the rate being the length
//! at that first sight over that span. locketd's handlers have all said `ready` before the
//! jobs are pushed (Sidekiq, too, loads the app before it takes a job).

use super::*;
use persistent::{path_str, python_command, python_exe, repo_file, ruby_command};
use procs::{process_tree, tree_pss, TreePss};
use sidekiq::{sidekiq_drain_job, SidekiqJob};

/// The N.
const DEFAULT_JOBS: usize = 2_000;
/// The two concurrencies (`--slots C` runs one of them).
const CONCURRENCIES: [usize; 2] = [25, 100];
/// Targets (issue 38): locketd's PSS at `threads = C` at most 1.3× Sidekiq's, its jobs/s at
/// least Sidekiq's within 2%.
const PSS_RATIO_TARGET: f64 = 1.3;
const RATE_RATIO_TARGET: f64 = 0.98;
/// locketd's `interval` here, unless `--interval`: slots idle while the handlers boot and
/// must all be polling again within a fraction of a 50 ms job once the jobs are pushed.
const IDLE_INTERVAL: f64 = 0.02;
/// Booting up to 100 app processes on 2 shared cores takes minutes.
const BOOT_LIMIT: Duration = Duration::from_secs(900);

/// Sidekiq's side: the same app file, a `SleepJob` that calls the same job body.
const SIDEKIQ_SLEEP: SidekiqJob = SidekiqJob {
    require: "bench/threads/sidekiq_app.rb",
    class: "SleepJob",
    sample_pss: true,
};

/// The apps, by the name `--langs` takes.
const LANGS: [&str; 3] = ["ruby", "node", "python"];

/// One system's figures at one concurrency.
struct Figures {
    system: String,
    rate: f64,
    /// Jobs the rate was taken over (the queue's length when first seen shorter).
    timed: u64,
    pss: TreePss,
}

impl Figures {
    fn line(&self) -> String {
        format!(
            "{} jobs/s, PSS {} in {} process{}",
            fmt_int(self.rate),
            mib(self.pss.kib),
            self.pss.processes,
            if self.pss.processes == 1 { "" } else { "es" }
        )
    }
}

/// `[handlers.app]` at `threads`, every class on it, booted with the slots; boots may be slow
/// with C processes booting at once on two cores.
fn handler_classes(command: &[String], threads: usize) -> String {
    format!(
        "[handlers.app]\nmode = \"persistent\"\ncommand = {}\npreload = true\nthreads = {threads}\n\
         boot_timeout = \"{}s\"\n\n[classes.\"*\"]\nhandler = \"app\"\n",
        serde_json::to_string(command).unwrap_or_default(),
        BOOT_LIMIT.as_secs()
    )
}

/// The processes under `root` that do not run `exe` (the handlers).
fn handler_pids(root: i32, exe: &Path) -> Vec<i32> {
    process_tree(root)
        .into_iter()
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/exe"))
                .map(|e| e != exe)
                .unwrap_or(false)
        })
        .collect()
}

/// Waits (bounded) until every handler process of `daemon` has said `ready` and no new one
/// came for a second. Returns how many there are and whether their adapter offered `threads`.
fn wait_booted(daemon: &mut Daemon, exe: &Path) -> Result<(usize, bool)> {
    let exe = std::fs::canonicalize(exe).unwrap_or_else(|_| exe.to_path_buf());
    let t0 = Instant::now();
    let mut last = (0usize, 0usize);
    let mut stable_since = Instant::now();
    loop {
        check_interrupt()?;
        daemon.check_alive()?;
        let log = daemon.log_text();
        let ready: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("handler ready"))
            .collect();
        let procs = handler_pids(daemon.pid, &exe).len();
        let now = (ready.len(), procs);
        if now != last {
            last = now;
            stable_since = Instant::now();
        } else if now.0 > 0 && now.0 >= now.1 && stable_since.elapsed() >= Duration::from_secs(1) {
            let threads = ready.iter().any(|l| l.contains("\"threads\""));
            return Ok((now.0, threads));
        }
        if t0.elapsed() > BOOT_LIMIT {
            bail!(
                "handlers did not boot within {BOOT_LIMIT:?}: {} of {} said ready",
                now.0,
                now.1
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One locketd drain: `--workers 1 --slots c`, the handler at `threads`, `n` Sleep jobs pushed
/// once every handler is ready; timed by the queue, the tree's PSS taken half-way.
fn locketd_run(
    ctx: &mut Ctx,
    command: &[String],
    threads: usize,
    c: usize,
    n: usize,
    system: String,
) -> Result<Figures> {
    ctx.flush()?;
    let config = ctx.config(&["bench".into()], &handler_classes(command, threads));
    ctx.seq += 1;
    let args: Vec<String> = ["--workers", "1", "--slots", &c.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let t_spawn = Instant::now();
    let mut daemon = Daemon::start(
        &ctx.exe,
        ctx.dir.path(),
        &format!("locketd-{}", ctx.seq),
        &config,
        &args,
    )?;
    let (handlers, offered) = wait_booted(&mut daemon, &ctx.exe)?;
    println!(
        "{system}: {handlers} handler process(es) ready after {:.1} s{}",
        t_spawn.elapsed().as_secs_f64(),
        if threads > 1 && !offered {
            " (the adapter did not offer \"threads\": one job per process)"
        } else {
            ""
        }
    );
    ctx.push_noop("bench", "Sleep", n)?;
    let key = "resque:queue:bench";
    let limit = Duration::from_secs(ctx.opts.timeout.unwrap_or(60 + n as u64 / 25));
    let t_push = Instant::now();
    let llen =
        |ctx: &mut Ctx| -> Result<u64> { Ok(redis::cmd("LLEN").arg(key).query(&mut ctx.conn)?) };
    // The clock starts at the first sighting of a queue shorter than pushed (the push itself
    // may overlap the first takes: the length then seen is what is left to time).
    let (t0, n0) = loop {
        check_interrupt()?;
        let len = llen(ctx)?;
        if len < n as u64 {
            break (Instant::now(), len);
        }
        daemon.check_alive()?;
        if t_push.elapsed() > limit {
            bail!("{system}: no job taken within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let mut mid = None;
    let t1 = loop {
        check_interrupt()?;
        let len = llen(ctx)?;
        if mid.is_none() && len <= n as u64 / 2 {
            mid = Some(tree_pss(&[daemon.pid]));
        }
        if len == 0 {
            break Instant::now();
        }
        if t_push.elapsed() > limit {
            bail!("{system}: {len} of {n} jobs still queued after {limit:?} (raise --timeout)");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // Every job done, none failed, before the figures count.
    loop {
        check_interrupt()?;
        if ctx.processed()? >= n as u64 {
            break;
        }
        daemon.check_alive()?;
        if t_push.elapsed() > limit {
            bail!("{system}: the jobs taken did not all finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let failed: Option<u64> = redis::cmd("GET")
        .arg("resque:stat:failed")
        .query(&mut ctx.conn)?;
    daemon.stop(Duration::from_secs(60));
    if let Some(f) = failed.filter(|f| *f > 0) {
        bail!("{system}: {f} of {n} jobs failed (see the daemon's log)");
    }
    let pss = mid.unwrap_or_default();
    let rate = n0 as f64 / t1.duration_since(t0).as_secs_f64().max(1e-6);
    let f = Figures {
        system,
        rate,
        timed: n0,
        pss,
    };
    println!(
        "{}: {} ({} jobs timed; PSS read in {} ms)",
        f.system,
        f.line(),
        f.timed,
        f.pss.took.as_millis()
    );
    Ok(f)
}

/// Sidekiq 6.4 `-c c`, one process, on the same app.
fn sidekiq_run(ctx: &Ctx, c: usize, n: usize) -> Result<Figures> {
    let system = format!("Sidekiq 6.4 `-c {c}`");
    let s = sidekiq_drain_job(ctx, &SIDEKIQ_SLEEP, n, c, 1)?;
    s.report(&system);
    let pss = s
        .mid_pss
        .ok_or_else(|| anyhow!("sidekiq's queue never reached half-way"))?;
    let f = Figures {
        system,
        rate: s.rate,
        timed: s.jobs,
        pss,
    };
    println!("{}: {}", f.system, f.line());
    Ok(f)
}

/// The handler command of `lang`'s app.
fn app_command(ctx: &Ctx, lang: &str) -> Result<Vec<String>> {
    match lang {
        "ruby" => ruby_command("bench/threads/app.rb"),
        "node" => {
            if procs::on_path("node").is_none() {
                bail!("node is not installed (apt-get install nodejs; see bench/README.md)");
            }
            Ok(vec![
                "node".to_string(),
                path_str(&repo_file("adapters/node/locketd-handler.js")?),
                path_str(&repo_file("bench/threads/app.js")?),
            ])
        }
        "python" => python_command(&python_exe(ctx.dir.path())?, "bench/threads/app.py"),
        other => bail!("no app for {other:?} (--langs takes {})", LANGS.join(",")),
    }
}

/// `a / b` with both.
fn ratio(a: f64, b: f64) -> f64 {
    a / b.max(1e-9)
}

/// The figures of one concurrency, as a Markdown table.
fn print_figures(n: usize, c: usize, all: &[Figures]) {
    println!("\nthreads: {n} jobs of 50 ms, concurrency {c}, PSS summed over each system's processes half-way through its drain\n");
    println!("| system | jobs/s | PSS | processes |");
    println!("| --- | --- | --- | --- |");
    for f in all {
        println!(
            "| {} | {} | {} | {} |",
            f.system,
            fmt_int(f.rate),
            mib(f.pss.kib),
            f.pss.processes
        );
    }
}

/// Records a run's figures as a summary row, or its error as an `n/a` row.
fn keep(rows: &mut Vec<Row>, what: &str, r: Result<Figures>, into: &mut Vec<Figures>) {
    match r {
        Ok(f) => {
            rows.push(row(format!("threads C={what}"), f.line(), "", None));
            into.push(f);
        }
        Err(e) if procs::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) => {
            eprintln!("locketd-bench: {what}: {e:#}");
        }
        Err(e) => {
            eprintln!("locketd-bench: {what}: {e:#}");
            rows.push(row(
                format!("threads C={what}"),
                format!("n/a: {}", persistent::first_line(&e)),
                "",
                None,
            ));
        }
    }
}

/// The two target rows: locketd at `threads = C` against Sidekiq `-c C`.
fn target_rows(rows: &mut Vec<Row>, c: usize, lk: &Figures, sk: &Figures) {
    let pss = ratio(lk.pss.kib as f64, sk.pss.kib as f64);
    let rate = ratio(lk.rate, sk.rate);
    println!(
        "threads C={c}: locketd threads={c} / Sidekiq -c {c}: PSS {pss:.2}× ({} vs {}), jobs/s {rate:.3}× ({} vs {})",
        mib(lk.pss.kib),
        mib(sk.pss.kib),
        fmt_int(lk.rate),
        fmt_int(sk.rate)
    );
    rows.push(row(
        format!("threads C={c}: ruby threads={c} PSS / Sidekiq -c {c} PSS"),
        format!("{pss:.2}× ({} vs {})", mib(lk.pss.kib), mib(sk.pss.kib)),
        format!("≤ {PSS_RATIO_TARGET}×"),
        Some(pss <= PSS_RATIO_TARGET),
    ));
    rows.push(row(
        format!("threads C={c}: ruby threads={c} jobs/s / Sidekiq -c {c} jobs/s"),
        format!("{rate:.3}× ({} vs {})", fmt_int(lk.rate), fmt_int(sk.rate)),
        format!("≥ {RATE_RATIO_TARGET}×"),
        Some(rate >= RATE_RATIO_TARGET),
    ));
}

/// `threads`: for each C (25 and 100, or `--slots C`), Sidekiq `-c C` and locketd with the
/// Ruby app at `threads = C` and `threads = 1`, then the Node and Python apps at both
/// (`--langs` picks the apps).
pub(crate) fn scenario_threads(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let concurrencies: Vec<usize> = match opts.slots {
        Some(c) => vec![c],
        None => CONCURRENCIES.to_vec(),
    };
    let langs: Vec<String> = if opts.langs.is_empty() {
        LANGS.iter().map(|s| s.to_string()).collect()
    } else {
        opts.langs.clone()
    };
    let with_interval = Opts {
        interval: opts.interval.or(Some(IDLE_INTERVAL)),
        ..opts.clone()
    };
    let mut ctx = Ctx::new(&with_interval, exe)?;
    let n = ctx.jobs(DEFAULT_JOBS);
    for &c in &concurrencies {
        let mut all = Vec::new();
        let mut sidekiq = None;
        let mut threaded = None;
        for lang in &langs {
            let command = match app_command(&ctx, lang) {
                Ok(cmd) => cmd,
                Err(e) => {
                    keep(rows, &format!("{c}: {lang}"), Err(e), &mut all);
                    continue;
                }
            };
            if lang == "ruby" {
                let r = sidekiq_run(&ctx, c, n);
                let before = all.len();
                keep(rows, &format!("{c}: Sidekiq 6.4 -c {c}"), r, &mut all);
                if all.len() > before {
                    sidekiq = Some(before);
                }
            }
            for threads in [c, 1] {
                let system =
                    format!("locketd `--workers 1 --slots {c}`, {lang}, threads = {threads}");
                let r = locketd_run(&mut ctx, &command, threads, c, n, system);
                let before = all.len();
                keep(rows, &format!("{c}: {lang} threads={threads}"), r, &mut all);
                if lang == "ruby" && threads == c && all.len() > before {
                    threaded = Some(before);
                }
            }
        }
        print_figures(n, c, &all);
        if let (Some(s), Some(t)) = (sidekiq, threaded) {
            target_rows(rows, c, &all[t], &all[s]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handler_table_is_toml_the_daemon_reads() {
        let cmd = vec!["/a b/locketd-ruby".to_string(), "/x/app.rb".to_string()];
        let v: toml::Value = toml::from_str(&handler_classes(&cmd, 25)).unwrap();
        let h = &v["handlers"]["app"];
        assert_eq!(h["threads"].as_integer(), Some(25));
        assert_eq!(h["preload"].as_bool(), Some(true));
        assert_eq!(h["command"][0].as_str(), Some("/a b/locketd-ruby"));
        assert_eq!(v["classes"]["*"]["handler"].as_str(), Some("app"));
    }

    #[test]
    fn a_process_tree_holds_this_process_and_its_pss_is_read() {
        let me = std::process::id() as i32;
        assert_eq!(process_tree(me)[0], me);
        let t = tree_pss(&[me]);
        assert!(t.processes >= 1 && t.kib > 0, "{t:?}");
    }
}
