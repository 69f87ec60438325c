//! The Sidekiq peer of the `ruby` scenario: Sidekiq 6.4 (Debian `ruby-sidekiq`) draining the
//! same no-op class body (`bench/sidekiq/job.rb`) from a redis-server of its own.
//!
//! Sidekiq writes `stat:processed` only at its 5 s heartbeat (and at exit), so, as
//! `../shared/bench/peers/sidekiq/run.sh` does, the queue is the clock: from the first time
//! `LLEN queue:default` drops below N to the time it reaches 0.

use super::*;
use procs::{cpu_ticks, on_path, Spawned};

/// What one Sidekiq drain measured.
pub(crate) struct PeerDrain {
    /// Jobs pushed.
    pub n: u64,
    /// Jobs taken between the first drop of the queue and its end (the rate's numerator).
    pub jobs: u64,
    pub rate: f64,
    /// Spawn to the first job taken.
    pub startup: Duration,
    /// CPU of the Sidekiq process per job: boot included, and over the drain window only.
    pub cpu_us_per_job: f64,
    pub window_cpu_us_per_job: f64,
    /// `stat:processed` after Sidekiq exited (it flushes its counters at exit).
    pub processed: u64,
    pub delta: Delta,
    /// The summed PSS of the Sidekiq processes when half the queue was taken, when asked for.
    pub mid_pss: Option<procs::TreePss>,
}

/// What Sidekiq runs: the file it requires (`-r`, relative to the source tree), the class
/// `bench/sidekiq/enqueue.rb` pushes, and whether to sample the processes' PSS half-way.
pub(crate) struct SidekiqJob {
    pub require: &'static str,
    pub class: &'static str,
    pub sample_pss: bool,
}

/// The no-op peer of `ruby`, `ruby-floor` and `peers`.
pub(crate) const NOOP_JOB: SidekiqJob = SidekiqJob {
    require: "bench/sidekiq/job.rb",
    class: "NoopJob",
    sample_pss: false,
};

impl PeerDrain {
    pub(crate) fn cmds_per_job(&self) -> f64 {
        self.delta.total_calls() as f64 / self.n.max(1) as f64
    }

    pub(crate) fn report(&self, label: &str) {
        println!(
            "{label}: {} jobs ({} timed by the queue) at {} jobs/s (start-up {:.2} s); Redis: {:.1} commands/job, \
             CPU {:.1} us/job; Sidekiq CPU {:.1} us/job ({:.1} us/job in the drain window); stat:processed {}",
            self.n,
            self.jobs,
            fmt_int(self.rate),
            self.startup.as_secs_f64(),
            self.cmds_per_job(),
            self.delta.cpu_s * 1e6 / self.n.max(1) as f64,
            self.cpu_us_per_job,
            self.window_cpu_us_per_job,
            self.processed
        );
        println!("  commands: {}", self.delta.breakdown(self.n, usize::MAX));
    }
}

fn bench_file(rel: &str) -> Result<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if !p.is_file() {
        bail!(
            "{} is missing (this scenario needs the source tree)",
            p.display()
        );
    }
    Ok(p)
}

/// Pushes `n` jobs with Sidekiq's own client into a private redis-server, runs `processes`
/// processes of `sidekiq -c concurrency` (one per core is how Ruby shops deploy it) until the
/// queue is empty, stops them and returns the figures (CPU: all of them together).
pub(crate) fn sidekiq_drain(
    ctx: &Ctx,
    n: usize,
    concurrency: usize,
    processes: usize,
) -> Result<PeerDrain> {
    sidekiq_drain_job(ctx, &NOOP_JOB, n, concurrency, processes)
}

/// [`sidekiq_drain`] of `job`'s class, required from `job`'s file.
pub(crate) fn sidekiq_drain_job(
    ctx: &Ctx,
    job: &SidekiqJob,
    n: usize,
    concurrency: usize,
    processes: usize,
) -> Result<PeerDrain> {
    let sidekiq = on_path("sidekiq").ok_or_else(|| {
        anyhow!("sidekiq is not installed (apt-get install ruby-sidekiq; see bench/README.md)")
    })?;
    let class = job.class;
    let sample_pss = job.sample_pss;
    let job = bench_file(job.require)?;
    let enqueue = bench_file("bench/sidekiq/enqueue.rb")?;
    // A redis-server of its own, in a directory of its own, flushed by enqueue.rb.
    let dir = ctx.dir.path().join("sidekiq");
    std::fs::create_dir_all(&dir)?;
    let redis = RedisServer::start(&dir)?;
    let mut conn = redis.conn()?;

    let mut cmd = Command::new("ruby");
    cmd.arg(&enqueue)
        .args([redis.url(), n.to_string(), class.to_string()])
        .env("RUBYOPT", "-W0");
    let (status, out, err) =
        procs::run_bounded(cmd, Duration::from_secs(120), &dir, "sidekiq-enqueue")?;
    if !status.success() {
        bail!("ruby {} failed ({status}):\n{err}", enqueue.display());
    }
    let queued: u64 = out.trim().parse().unwrap_or(0);
    if queued != n as u64 {
        bail!("enqueue.rb left {queued} jobs in queue:default, not {n}:\n{out}{err}");
    }

    let llen = |conn: &mut redis::Connection| -> Result<u64> {
        Ok(redis::cmd("LLEN").arg("queue:default").query(conn)?)
    };
    let s0 = stats::snapshot(&mut conn)?;
    let t_spawn = Instant::now();
    let mut peers = Vec::new();
    for i in 0..processes.max(1) {
        let mut cmd = Command::new(&sidekiq);
        cmd.arg("-r")
            .arg(&job)
            .args(["-c", &concurrency.to_string(), "-q", "default"])
            .env("REDIS_URL", redis.url())
            .current_dir(&dir);
        peers.push(Spawned::start(cmd, &dir, &format!("sidekiq-{i}"))?);
    }
    let cpu = |peers: &[Spawned]| -> u64 { peers.iter().filter_map(|p| cpu_ticks(p.pid)).sum() };
    let check = |peers: &mut [Spawned]| -> Result<()> {
        peers.iter_mut().try_for_each(|p| p.check_alive())
    };
    let limit = Duration::from_secs(ctx.opts.timeout.unwrap_or(60 + n as u64 / 250));
    let mut llens = 0u64;
    let mut last_check = Instant::now();
    // Phase 1: until the first job is taken (polled every 2 ms: t0 is the clock's start).
    let (t0, n0, cpu0) = loop {
        check_interrupt()?;
        let len = llen(&mut conn)?;
        llens += 1;
        if len < n as u64 {
            break (Instant::now(), len, cpu(&peers));
        }
        if last_check.elapsed() >= Duration::from_millis(200) {
            check(&mut peers)?;
            last_check = Instant::now();
        }
        if t_spawn.elapsed() > limit {
            bail!("sidekiq took no job within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // Phase 2: until the queue is empty; the PSS when half of it is taken.
    let mut mid_pss = None;
    let (t1, cpu1) = loop {
        check_interrupt()?;
        let len = llen(&mut conn)?;
        llens += 1;
        if sample_pss && mid_pss.is_none() && len <= n as u64 / 2 {
            let pids: Vec<i32> = peers.iter().map(|p| p.pid).collect();
            mid_pss = Some(procs::tree_pss(&pids));
        }
        if len == 0 {
            break (Instant::now(), cpu(&peers));
        }
        if last_check.elapsed() >= Duration::from_millis(200) {
            check(&mut peers)?;
            last_check = Instant::now();
        }
        if t_spawn.elapsed() > limit {
            bail!(
                "sidekiq drain timed out: {len} of {n} jobs left after {limit:?} (raise --timeout)"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let s1 = stats::snapshot(&mut conn)?;
    // Up to `concurrency` jobs may still be running when the list is empty; a moment lets them finish
    // before the TERM (Sidekiq's own shutdown would wait for them too).
    sleep(Duration::from_millis(100))?;
    let cpu_end = cpu(&peers).max(cpu1);
    // TERM: Sidekiq stops its processors (each may sit in a 2 s BRPOP) and flushes its stats
    // at exit. All at once, so their shutdowns overlap.
    std::thread::scope(|s| {
        for p in peers {
            s.spawn(move || p.stop(Duration::from_secs(30)));
        }
    });
    let processed: Option<u64> = redis::cmd("GET").arg("stat:processed").query(&mut conn)?;
    let processed = processed.unwrap_or(0);
    if processed < n as u64 {
        eprintln!(
            "locketd-bench: warning: sidekiq's stat:processed is {processed} after its exit, not {n}"
        );
    }
    let span = t1.duration_since(t0).as_secs_f64().max(1e-6);
    let hz = procs::clk_tck();
    Ok(PeerDrain {
        n: n as u64,
        jobs: n0,
        rate: n0 as f64 / span,
        startup: t0.duration_since(t_spawn),
        cpu_us_per_job: cpu_end as f64 / hz * 1e6 / n as f64,
        window_cpu_us_per_job: cpu1.saturating_sub(cpu0) as f64 / hz * 1e6 / n0.max(1) as f64,
        processed,
        delta: Delta::between(&s0, &s1, &[("llen", llens)]),
        mid_pss,
    })
}
