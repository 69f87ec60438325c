//! `locketd-bench`: drives the real `locketd` binary against a private redis-server and prints
//! jobs/s, Redis commands and Redis CPU per job, enqueue-to-start latency and peak RSS
//! (issue 6; docs/dev/performance-log.md explains every figure and how it is taken).
//!
//! ```sh
//! cargo run --profile dist --bin locketd-bench -- all            # every scenario, one Markdown table
//! cargo run --profile dist --bin locketd-bench -- noop --jobs 20000 --workers 1
//! cargo run --profile dist --bin locketd-bench -- ruby             # Ruby adapter vs Sidekiq (bench/README.md)
//! ```

mod delayed;
mod floor;
mod hotkey;
mod idle;
mod peers;
mod persistent;
mod procs;
mod rates;
mod rubyfloor;
mod scenarios;
mod sidekiq;
mod spawn;
mod stats;
mod threads;
mod why;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use peers::scenario_peers;
use procs::{check_interrupt, sleep, Daemon, RedisServer, RssPeaks, ScratchDir};
use scenarios::{
    attempt, probe_latencies, scenario_command, scenario_idle, scenario_noop, scenario_queues,
    scenario_starvation,
};
use stats::{Delta, Snapshot};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// In-process no-op handler, locks on, 1 queue.
    Noop,
    /// `/bin/true` command handler.
    Command,
    /// `/bin/true` spawned and reaped in a loop by N threads, no Redis: the command's ceiling.
    SpawnCeiling,
    /// The prefork model's floor: W threads, one job at a time each, making only the job
    /// path's Redis calls (2 round trips per job, then 1), no locketd.
    Floor,
    /// A high queue whose jobs all wait on one held lock, above a low queue.
    Starvation,
    /// 100 configured queues, jobs only in the last.
    Queues,
    /// Pickup latency on the first and last of 16 queues, Redis load and connections of an
    /// idle `--workers 2` daemon.
    Idle,
    /// The same noop queue drained by locketd, node-resque (Worker + JobLock, MultiWorker(10))
    /// and Sidekiq 6.4 (-c 10), with the ratios.
    Peers,
    /// Ruby `Noop` through the persistent Ruby adapter, beside Sidekiq 6.4 and exec-per-job Ruby.
    Ruby,
    /// The Ruby path's floor: W threads, each feeding its own persistent Ruby handlers
    /// (the real adapter, `Noop`) with the floor's 2 round trips, the `job` frame, and the
    /// `started` and `done` frames, no locketd; beside Sidekiq 6.4 with one process per core.
    RubyFloor,
    /// Python `Noop` through the persistent Python adapter, beside exec-per-job Python.
    Python,
    /// p50 enqueue-to-start latency of a persistent handler's `Probe` vs the `probe` builtin.
    HandlerLatency,
    /// resque-scheduler delayed items (100,000 over 1,000 timestamps) delivered by the scheduler.
    Delayed,
    /// parked-waits.md §1: N jobs for one user (limit 1, 20 ms) before 2,000 free jobs,
    /// `--workers 2`: a hot job's Redis cost against a free job's, and the wall times
    /// (N = 200 and 2,000, or `--jobs N`).
    HotKey,
    /// rate-limits.md §4: 600 jobs at 20/s on one key by two daemons; 300 limited jobs among
    /// 3,000 free ones in one queue (the free jobs' time against alone, commands per job).
    Rates,
    /// Jobs that wait (issue 38): N jobs of 50 ms at concurrency 25 and 100 (`--slots C` for
    /// one), the same Ruby app (ActiveSupport + ActiveJob, ~60 MB retained) under Sidekiq
    /// `-c C` and locketd `--workers 1 --slots C` at `threads = C` and `threads = 1`, then a
    /// Node and a Python app: jobs/s and the summed PSS of each process tree half-way. Not in
    /// `all` (minutes, and gigabytes at `threads = 1`).
    Threads,
    /// `locketd why QUEUE CLASS ARGS` for a job 10 from the tail of a queue of 1,000,000
    /// (`--jobs N`), its lock held: time per answer in process and through the binary. Not in
    /// `all`.
    Why,
    /// Everything above except `threads` and `why`, then one Markdown table against the issue's targets (ruby, python and
    /// handler-latency only when their interpreters are installed).
    All,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "locketd-bench",
    about = "Benchmarks the real locketd binary against its own redis-server"
)]
struct Opts {
    /// What to run.
    #[arg(value_enum)]
    scenario: Scenario,
    /// Jobs per drain (default: noop 200000, command 20000, starvation 50000 low jobs,
    /// queues 50000, peers 20000, ruby and python 20000, handler-latency 10000, threads 2000; the
    /// exec-per-job baselines run min(100, N)).
    #[arg(long)]
    jobs: Option<usize>,
    /// Passed to locketd as `--workers N` when above 1 (multi-process mode, issue 3; default 1,
    /// 2 for peers, ruby, python and handler-latency).
    #[arg(long)]
    workers: Option<usize>,
    /// Passed to locketd as `--slots K` (multi-slot mode).
    #[arg(long)]
    slots: Option<usize>,
    /// locketd's `interval` in seconds (default: locketd's own default).
    #[arg(long)]
    interval: Option<f64>,
    /// locketd's `log_level` (probe latency lines are kept whatever the level).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// The locketd binary (default: `locketd` next to this program, rebuilt first
    /// with this program's own profile unless --no-build).
    #[arg(long)]
    locketd: Option<PathBuf>,
    /// Do not run `cargo build` for the default binary.
    #[arg(long)]
    no_build: bool,
    /// Upper bound for one drain, in seconds (default: 60 + jobs/250).
    #[arg(long)]
    timeout: Option<u64>,
    /// Paced probe jobs per second for the latency phase (default: 25% of the drain rate).
    #[arg(long)]
    latency_rate: Option<f64>,
    /// Seconds of the latency phase (0 = skip it).
    #[arg(long, default_value_t = 2.0)]
    latency_secs: f64,
    /// Jobs pushed one at a time to an idle worker (`idle`).
    #[arg(long, default_value_t = 20)]
    pushes: usize,
    /// Seconds an idle worker is watched for its Redis commands (`idle`).
    #[arg(long, default_value_t = 15.0)]
    idle_secs: f64,
    /// The apps of `threads` (ruby, node, python; default all three).
    #[arg(long, value_delimiter = ',')]
    langs: Vec<String>,
    /// Keep every CPU busy with lowest-priority (nice 19) spinning threads, so idle vCPUs do
    /// not halt between round trips (docs/dev/performance-log.md, "Idle CPUs").
    #[arg(long)]
    spin: bool,
    /// The `Noop` class's lock template in `noop` and the adapters' (`ruby`, ...) (default: the class default,
    /// `{class}:{args_digest}`), e.g. `{class}:{args[0]}`: TAKE (A-7a) takes a class in one
    /// call only when its lock ids need no digest.
    #[arg(long)]
    lock: Option<String>,
    /// Settings of locketd's `[locket]` section, added to every config the bench writes, e.g.
    /// `one_call_take = false` (the two calls of the binaries before TAKE, A-7a).
    #[arg(long)]
    locket: Vec<String>,
}

/// One line of the summary table.
struct Row {
    what: String,
    value: String,
    target: String,
    ok: Option<bool>,
}

fn row(
    what: impl Into<String>,
    value: impl Into<String>,
    target: impl Into<String>,
    ok: Option<bool>,
) -> Row {
    Row {
        what: what.into(),
        value: value.into(),
        target: target.into(),
        ok,
    }
}

fn print_table(rows: &[Row]) {
    println!("\n| figure | locketd | target | |");
    println!("| --- | --- | --- | --- |");
    for r in rows {
        let mark = match r.ok {
            Some(true) => "met",
            Some(false) => "**not met**",
            None => "",
        };
        println!("| {} | {} | {} | {} |", r.what, r.value, r.target, mark);
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn fmt_int(x: f64) -> String {
    let n = x.round() as i64;
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The locketd binary to run: `--locketd`, else `locketd` next to this program (built first).
fn locketd_exe(opts: &Opts) -> Result<PathBuf> {
    if let Some(p) = &opts.locketd {
        if !p.is_file() {
            bail!("--locketd {}: no such file", p.display());
        }
        return Ok(p.clone());
    }
    let me = std::env::current_exe()?;
    let dir = me
        .parent()
        .ok_or_else(|| anyhow!("no directory for {}", me.display()))?;
    let exe = dir.join("locketd");
    // The profile this program was built with (its directory's name): `dist` is the measured
    // build, `release` is close to it, anything else is not representative.
    let profile = dir
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| ["dist", "release"].contains(n))
        .map(str::to_owned);
    if !opts.no_build {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        if manifest.is_file() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "--bin", "locketd", "--manifest-path"])
                .arg(&manifest);
            // `cargo run` hands this program the package's CARGO_PKG_* variables and a
            // LD_LIBRARY_PATH; build scripts that watch them would rebuild (ring does).
            for (k, _) in std::env::vars_os() {
                let k = k.to_string_lossy();
                if k.starts_with("CARGO_PKG_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_PRIMARY_PACKAGE",
                    ]
                    .contains(&k.as_ref())
                    || k == "LD_LIBRARY_PATH"
                {
                    cmd.env_remove(k.as_ref());
                }
            }
            if let Some(p) = &profile {
                cmd.args(["--profile", p]);
            }
            eprintln!(
                "locketd-bench: building locketd ({})",
                profile.as_deref().unwrap_or("debug")
            );
            let status = cmd.status().context("running cargo build for locketd")?;
            if !status.success() {
                bail!("cargo build --bin locketd failed ({status})");
            }
        }
    }
    if !exe.is_file() {
        bail!(
            "no locketd binary at {}: build it with `cargo build --profile dist --bin locketd`, or pass --locketd PATH",
            exe.display()
        );
    }
    if profile.is_none() {
        eprintln!(
            "locketd-bench: warning: {} is not a dist or release build; figures are not representative",
            exe.display()
        );
    }
    Ok(exe)
}

/// One scenario's world: a scratch dir, a private Redis and the binary.
struct Ctx {
    opts: Opts,
    exe: PathBuf,
    dir: ScratchDir,
    redis: RedisServer,
    conn: redis::Connection,
    seq: usize,
}

/// What one drain measured.
struct Drain {
    jobs: u64,
    /// Jobs/s from the first to the last completion seen (start-up excluded).
    rate: f64,
    /// Spawn to first completion.
    startup: Duration,
    delta: Delta,
    rss: RssPeaks,
}

impl Drain {
    fn cmds_per_job(&self) -> f64 {
        self.delta.total_calls() as f64 / self.jobs.max(1) as f64
    }
    fn scripts_per_job(&self) -> f64 {
        self.delta.script_calls() as f64 / self.jobs.max(1) as f64
    }
    fn cpu_us_per_job(&self) -> f64 {
        self.delta.cpu_s * 1e6 / self.jobs.max(1) as f64
    }
    /// locketd's own CPU (master and workers, start-up included) per job.
    fn daemon_cpu_us_per_job(&self) -> f64 {
        self.rss.cpu_secs() * 1e6 / self.jobs.max(1) as f64
    }
    fn report(&self, label: &str) {
        println!(
            "{label}: {} jobs at {} jobs/s (start-up {:.2} s); Redis: {:.1} commands/job incl. inside scripts, \
             {:.2} script calls/job, CPU {:.1} us/job; locketd CPU {:.1} us/job; peak RSS: daemon {}{}",
            self.jobs,
            fmt_int(self.rate),
            self.startup.as_secs_f64(),
            self.cmds_per_job(),
            self.scripts_per_job(),
            self.cpu_us_per_job(),
            self.daemon_cpu_us_per_job(),
            mib(self.rss.master_kib),
            match self.rss.max_worker_kib() {
                Some(k) => format!(", {} worker processes, largest {}", self.rss.workers_kib.len(), mib(k)),
                None => String::new(),
            }
        );
        println!(
            "  commands: {}",
            self.delta.breakdown(self.jobs, usize::MAX)
        );
    }
}

impl Ctx {
    fn new(opts: &Opts, exe: &Path) -> Result<Ctx> {
        let dir = ScratchDir::new()?;
        let redis = RedisServer::start(dir.path())?;
        let conn = redis.conn()?;
        Ok(Ctx {
            opts: opts.clone(),
            exe: exe.to_path_buf(),
            dir,
            redis,
            conn,
            seq: 0,
        })
    }

    fn jobs(&self, default: usize) -> usize {
        self.opts.jobs.unwrap_or(default).max(1)
    }

    fn flush(&mut self) -> Result<()> {
        // Our own private server: nothing else lives in it.
        redis::cmd("FLUSHALL").query::<()>(&mut self.conn)?;
        Ok(())
    }

    fn processed(&mut self) -> Result<u64> {
        let n: Option<u64> = redis::cmd("GET")
            .arg("resque:stat:processed")
            .query(&mut self.conn)?;
        Ok(n.unwrap_or(0))
    }

    /// A config for queues and classes, with the harness's Redis, interval and log level.
    /// Probe lines (the builtin's, and a handler's stdout, where a persistent handler's `Probe`
    /// class prints them) are kept at info whatever the level.
    fn config(&self, queues: &[String], classes: &str) -> String {
        let mut c = format!(
            "redis = \"{}\"\nqueues = {}\nlog_level = \"{},locketd::probe=info,locketd::handler=info\"\n",
            self.redis.url(),
            serde_json::to_string(queues).unwrap_or_default(),
            self.opts.log_level
        );
        if let Some(i) = self.opts.interval {
            c.push_str(&format!("interval = {i}\n"));
        }
        c.push('\n');
        c.push_str(classes);
        if !self.opts.locket.is_empty() {
            c.push_str("\n[locket]\n");
            for l in &self.opts.locket {
                c.push_str(l);
                c.push('\n');
            }
        }
        c
    }

    fn daemon_args(&self, workers: usize) -> Vec<String> {
        let mut a = Vec::new();
        if workers > 1 {
            a.extend(["--workers".to_string(), workers.to_string()]);
        }
        if let Some(k) = self.opts.slots {
            a.extend(["--slots".to_string(), k.to_string()]);
        }
        a
    }

    fn start_daemon(&mut self, config: &str, workers: usize) -> Result<Daemon> {
        self.seq += 1;
        let args = self.daemon_args(workers);
        Daemon::start(
            &self.exe,
            self.dir.path(),
            &format!("locketd-{}", self.seq),
            config,
            &args,
        )
    }

    /// Pushes payloads to `queue` as Resque does (SADD queues + RPUSH), 1,000 per pipeline.
    fn push(&mut self, queue: &str, payloads: impl Iterator<Item = String>) -> Result<()> {
        let key = format!("resque:queue:{queue}");
        redis::cmd("SADD")
            .arg("resque:queues")
            .arg(queue)
            .query::<()>(&mut self.conn)?;
        let mut pipe = redis::pipe();
        let mut n = 0;
        for p in payloads {
            pipe.cmd("RPUSH").arg(&key).arg(p).ignore();
            n += 1;
            if n % 1000 == 0 {
                pipe.query::<()>(&mut self.conn)?;
                pipe = redis::pipe();
                check_interrupt()?;
            }
        }
        if n % 1000 != 0 {
            pipe.query::<()>(&mut self.conn)?;
        }
        Ok(())
    }

    fn push_noop(&mut self, queue: &str, class: &str, n: usize) -> Result<()> {
        self.push(
            queue,
            (0..n).map(|i| format!(r#"{{"class":"{class}","args":[{i}]}}"#)),
        )
    }

    /// Starts a daemon and waits (bounded) until `n` more jobs are processed.
    fn drain(&mut self, config: &str, workers: usize, n: usize) -> Result<(Drain, Daemon)> {
        let p0 = self.processed()?;
        let s0 = stats::snapshot(&mut self.conn)?;
        let t_spawn = Instant::now();
        let mut daemon = self.start_daemon(config, workers)?;
        let limit = Duration::from_secs(self.opts.timeout.unwrap_or(60 + n as u64 / 250));
        let mut gets = 1u64;
        let mut first: Option<(Instant, u64)> = None;
        let mut rss = RssPeaks::default();
        let mut last_sample = Instant::now() - Duration::from_secs(1);
        let (t_end, p_end) = loop {
            check_interrupt()?;
            let p = self.processed()?;
            gets += 1;
            let now = Instant::now();
            if p > p0 && first.is_none() {
                first = Some((now, p));
            }
            if p - p0 >= n as u64 {
                break (now, p);
            }
            if now.duration_since(last_sample) >= Duration::from_millis(200) {
                daemon.check_alive()?;
                daemon.peak_rss(&mut rss);
                last_sample = now;
            }
            if t_spawn.elapsed() > limit {
                bail!(
                    "drain timed out: {} of {n} jobs processed after {limit:?} (raise --timeout)",
                    p - p0
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let s1 = stats::snapshot(&mut self.conn)?;
        daemon.peak_rss(&mut rss);
        let (t_first, p_first) = first.unwrap_or((t_end, p_end));
        let span = t_end.duration_since(t_first).as_secs_f64();
        let rate = if span > 0.0 && p_end > p_first {
            (p_end - p_first) as f64 / span
        } else {
            n as f64 / t_end.duration_since(t_spawn).as_secs_f64().max(1e-6)
        };
        Ok((
            Drain {
                jobs: n as u64,
                rate,
                startup: t_first.duration_since(t_spawn),
                delta: Delta::between(&s0, &s1, &[("get", gets)]),
                rss,
            },
            daemon,
        ))
    }

    /// Pushes probe jobs at `rate`/s for `secs`, waits for them and returns the latencies
    /// (microseconds, sorted) logged by the daemon's `probe` builtin.
    fn paced_latency(
        &mut self,
        daemon: &mut Daemon,
        queue: &str,
        rate: f64,
        secs: f64,
    ) -> Result<Vec<u64>> {
        let count = ((rate * secs).round() as usize).max(1);
        let p0 = self.processed()?;
        let key = format!("resque:queue:{queue}");
        let t0 = Instant::now();
        for i in 0..count {
            check_interrupt()?;
            let due = t0 + Duration::from_secs_f64(i as f64 / rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let payload = format!(
                r#"{{"class":"Probe","args":[{{"enqueued_at_us":{}}},{i}]}}"#,
                now_us()
            );
            redis::cmd("RPUSH")
                .arg(&key)
                .arg(payload)
                .query::<()>(&mut self.conn)?;
        }
        let interval = self.opts.interval.unwrap_or(5.0);
        let deadline = Instant::now() + Duration::from_secs_f64(30.0 + 2.0 * interval);
        while self.processed()? < p0 + count as u64 {
            check_interrupt()?;
            daemon.check_alive()?;
            if Instant::now() > deadline {
                bail!("probe jobs were not all processed in time");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // The log line may trail the stat by a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let lat = probe_latencies(&daemon.log_text());
            if lat.len() >= count || Instant::now() > deadline {
                return Ok(lat);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn run(opts: Opts) -> Result<()> {
    procs::install_interrupt()?;
    let _spinners = opts.spin.then(procs::Spinners::start);
    let exe = locketd_exe(&opts)?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "locketd-bench: {} with {} (load average {}){}",
        opts.scenario
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default(),
        exe.display(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        if opts.spin {
            "; nice-19 spinners on every CPU"
        } else {
            ""
        }
    );
    let mut rows = Vec::new();
    match opts.scenario {
        Scenario::Noop => {
            scenario_noop(&opts, &exe, &mut rows)?;
        }
        Scenario::Command => scenario_command(&opts, &exe, &mut rows)?,
        Scenario::SpawnCeiling => spawn::scenario_spawn_ceiling(&opts, &mut rows)?,
        Scenario::Floor => {
            floor::scenario_floor(&opts, &exe, &mut rows)?;
        }
        Scenario::Starvation => scenario_starvation(&opts, &exe, &mut rows)?,
        Scenario::Queues => scenario_queues(&opts, &exe, &mut rows)?,
        Scenario::Idle => scenario_idle(&opts, &exe, &mut rows)?,
        Scenario::Peers => scenario_peers(&opts, &exe, &mut rows)?,
        Scenario::Ruby => persistent::scenario_ruby(&opts, &exe, &mut rows)?,
        Scenario::RubyFloor => rubyfloor::scenario_ruby_floor(&opts, &exe, &mut rows)?,
        Scenario::Python => persistent::scenario_python(&opts, &exe, &mut rows)?,
        Scenario::HandlerLatency => persistent::scenario_handler_latency(&opts, &exe, &mut rows)?,
        Scenario::Delayed => delayed::scenario_delayed(&opts, &exe, &mut rows)?,
        Scenario::HotKey => hotkey::scenario_hot_key(&opts, &exe, &mut rows)?,
        Scenario::Rates => rates::scenario_rates(&opts, &exe, &mut rows)?,
        Scenario::Threads => threads::scenario_threads(&opts, &exe, &mut rows)?,
        Scenario::Why => why::scenario_why(&opts, &exe, &mut rows)?,
        Scenario::All => {
            let with = |workers: Option<usize>, slots: Option<usize>| Opts {
                workers,
                slots,
                ..opts.clone()
            };
            // The issue's two noop configurations, then their peers on the same machine, then
            // the ratios (issue 15: the `--workers 8` target is withdrawn).
            let mut prefork = None;
            attempt("noop --workers 2", &mut rows, |r| {
                prefork = Some(scenario_noop(&with(Some(2), None), &exe, r)?);
                Ok(())
            })?;
            let mut slots = None;
            attempt("noop --workers 2 --slots 32", &mut rows, |r| {
                slots = Some(scenario_noop(&with(Some(2), Some(32)), &exe, r)?);
                Ok(())
            })?;
            let mut peer_rates = None;
            attempt("peers", &mut rows, |r| {
                peer_rates = Some(peers::run_peers(&opts, &exe, r)?);
                Ok(())
            })?;
            let peer_rates = peer_rates.unwrap_or_else(|| peers::Peers::none("the peers failed"));
            peers::ratio_rows(&mut rows, 2, None, prefork, &peer_rates);
            peers::ratio_rows(&mut rows, 2, Some(32), slots, &peer_rates);
            attempt("floor --workers 2", &mut rows, |r| {
                let two = floor::scenario_floor(&with(Some(2), None), &exe, r)?;
                floor::ceiling_row(r, two, &peer_rates);
                Ok(())
            })?;
            attempt("spawn-ceiling --workers 4", &mut rows, |r| {
                spawn::scenario_spawn_ceiling(&with(Some(4), None), r)
            })?;
            attempt("command --workers 4", &mut rows, |r| {
                scenario_command(&with(Some(4), None), &exe, r)
            })?;
            if rows.last().is_some_and(|r| r.value.starts_with("n/a")) {
                attempt("command --workers 1", &mut rows, |r| {
                    scenario_command(&with(Some(1), None), &exe, r)
                })?;
            }
            attempt("starvation", &mut rows, |r| {
                scenario_starvation(&with(Some(1), None), &exe, r)
            })?;
            attempt("queues", &mut rows, |r| {
                scenario_queues(&with(Some(1), None), &exe, r)
            })?;
            attempt("idle", &mut rows, |r| {
                scenario_idle(&with(Some(2), None), &exe, r)
            })?;
            attempt("delayed", &mut rows, |r| {
                delayed::scenario_delayed(&with(Some(1), None), &exe, r)
            })?;
            if persistent::ruby_installed() {
                attempt("ruby --workers 2", &mut rows, |r| {
                    persistent::scenario_ruby(&with(Some(2), None), &exe, r)
                })?;
                attempt("ruby-floor", &mut rows, |r| {
                    rubyfloor::scenario_ruby_floor(&with(None, None), &exe, r)
                })?;
                attempt("handler-latency --workers 2", &mut rows, |r| {
                    persistent::scenario_handler_latency(&with(Some(2), None), &exe, r)
                })?;
            } else {
                println!(
                    "locketd-bench: note: ruby or sidekiq is not installed: the ruby and \
                     handler-latency scenarios are skipped (bench/README.md says how to install them)"
                );
            }
            if persistent::python_installed() {
                attempt("python --workers 2", &mut rows, |r| {
                    persistent::scenario_python(&with(Some(2), None), &exe, r)
                })?;
            } else {
                println!(
                    "locketd-bench: note: python3 is not installed: the python scenario is skipped"
                );
            }
        }
    }
    print_table(&rows);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let opts = Opts::parse();
    match run(opts) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("locketd-bench: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
