//! `ruby-floor`: the most the Ruby path can do on this machine, whatever locketd's own code
//! costs (issue 28: "a `ruby` floor scenario, the same frames and Redis calls with no locketd
//! logic around them").
//!
//! W threads (`--workers`, default: 2, then 4, then 2 with 4 handlers each) stand for W worker
//! processes. Each owns K (`--slots`, default 1) real persistent Ruby handlers, started as
//! locketd starts them (docs/spec/persistent-handlers.md H-3: no shell, a process group of
//! its own, `PR_SET_PDEATHSIG`, fd 0 `/dev/null`, fds 1 and 2 piped and drained, the request
//! pipe on fd 3 and the reply pipe on fd 4, `LOCKETD_PROTOCOL=1`), running `adapters/ruby`
//! with the example app's `Noop`, as the `ruby` scenario does. Per job a handler's driver
//! makes the floor's two round trips (floor.rs's [`FloorWorker`]: FINISH of the last job with
//! RESERVE of the next, then ACQUIRE+START), writes the `job` frame, and reads and parses the
//! `started` and `done` frames: nothing else (no master, no lease lines, no watchdog, no
//! `/proc` reads, no log). With K > 1, a thread serves its handlers as their frames come
//! (`poll`), one blocking Redis connection each, as a `--slots K` worker runs K jobs at once.
//!
//! Printed per variant: jobs/s, and the CPU per job of the bench process (the drivers), of
//! the Ruby handlers (boot excluded) and of Redis; then Sidekiq 6.4 `-c 10` with one process
//! per core in the same run, and the ratios.

use super::*;
use floor::{FloorWorker, Reserved};
use locketd::handler::persistent::{protocol_fds_in_child, JobFrame};
use serde::Deserialize;
use sidekiq::{sidekiq_drain, PeerDrain};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};

/// Sidekiq's concurrency (the issue's "-c 10").
const SIDEKIQ_CONCURRENCY: usize = 10;

/// The issue's target for the Ruby path against Sidekiq with one process per core.
const TARGET: f64 = 0.8;

/// The fields of a reply frame that the driver checks.
#[derive(Deserialize)]
struct Reply {
    t: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    status: Option<String>,
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`; each is owned exactly once below.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: both descriptors were just created and are not owned elsewhere.
    unsafe { Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// Keeps the last lines of a handler's stdout or stderr (for an error message).
fn drain_lines(r: impl Read + Send + 'static, tail: Arc<Mutex<Vec<String>>>) {
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() >= 20 {
                t.remove(0);
            }
            t.push(line);
        }
    });
}

/// One persistent Ruby handler, spawned as locketd spawns it.
struct Handler {
    child: Child,
    pid: i32,
    requests: File,
    replies: File,
    /// Bytes read from fd 4 that do not yet end a line.
    buf: Vec<u8>,
    tail: Arc<Mutex<Vec<String>>>,
}

impl Handler {
    /// Spawns `argv` (not yet ready: see [`Handler::wait_ready`]). Call it from a thread that
    /// outlives the handler: `PR_SET_PDEATHSIG` fires when the spawning thread exits.
    fn spawn(argv: &[String]) -> Result<Handler> {
        let (req_r, req_w) = pipe_pair()?;
        let (rep_r, rep_w) = pipe_pair()?;
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env("LOCKETD_PROTOCOL", "1")
            .env("LOCKETD_PROTOCOL_FDS", "3,4")
            .env("LOCKETD_HANDLER", "app")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let (child_in, child_out) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
        // SAFETY: between fork and exec only prctl and locketd's own fd move run, all
        // async-signal-safe, on descriptors that exist in the child.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                protocol_fds_in_child(child_in, child_out)
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", argv.join(" ")))?;
        drop((req_r, rep_w));
        let tail = Arc::new(Mutex::new(Vec::new()));
        if let Some(out) = child.stdout.take() {
            drain_lines(out, tail.clone());
        }
        if let Some(err) = child.stderr.take() {
            drain_lines(err, tail.clone());
        }
        Ok(Handler {
            pid: child.id() as i32,
            child,
            requests: File::from(req_w),
            replies: File::from(rep_r),
            buf: Vec::with_capacity(4096),
            tail,
        })
    }

    fn why_gone(&mut self) -> anyhow::Error {
        let status = self.child.try_wait().ok().flatten();
        let tail = self.tail.lock().map(|t| t.join("\n")).unwrap_or_default();
        anyhow!(
            "the Ruby handler {} closed fd 4 (exit: {status:?}); its last lines:\n{tail}",
            self.pid
        )
    }

    /// One `read` of fd 4 into the buffer (blocks until something comes).
    fn fill(&mut self) -> Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.replies.read(&mut chunk)?;
        if n == 0 {
            return Err(self.why_gone());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// The next whole frame in the buffer, parsed.
    fn take_frame(&mut self) -> Result<Option<Reply>> {
        let Some(end) = self.buf.iter().position(|b| *b == b'\n') else {
            return Ok(None);
        };
        let reply: Reply = serde_json::from_slice(&self.buf[..end]).with_context(|| {
            format!(
                "a reply frame: {}",
                String::from_utf8_lossy(&self.buf[..end.min(200)])
            )
        })?;
        self.buf.drain(..=end);
        Ok(Some(reply))
    }

    /// Reads until `ready` (boot, bounded by the caller's patience: blocking).
    fn wait_ready(&mut self) -> Result<()> {
        loop {
            if let Some(f) = self.take_frame()? {
                if f.t == "ready" {
                    return Ok(());
                }
                bail!("handler {}: {:?} before ready", self.pid, f.t);
            }
            self.fill()?;
        }
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group of our own unreaped child.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A handler and the floor worker that feeds it, with the job it runs.
struct Slot {
    fw: FloorWorker,
    h: Handler,
    running: Option<Reserved>,
    started: bool,
    line: Vec<u8>,
}

impl Slot {
    /// Reserves and locks the next job and writes its frame; false when the queue is empty.
    fn start(&mut self) -> Result<bool> {
        let Some(job) = self.fw.next(false)? else {
            self.running = None;
            return Ok(false);
        };
        self.line.clear();
        serde_json::to_writer(
            &mut self.line,
            &JobFrame {
                t: "job",
                id: &job.rid,
                payload: &job.payload,
                queue: "bench",
                class: &job.class,
                worker: &self.fw.wid,
                lock_keys: std::slice::from_ref(&job.lock),
                lock_token: &job.rid,
                deadline_ms: Some(now_us() / 1000 + 30_000),
            },
        )?;
        self.line.push(b'\n');
        self.h.requests.write_all(&self.line)?;
        self.running = Some(job);
        self.started = false;
        Ok(true)
    }

    /// Takes the frames read so far; returns the jobs they ended (0 or 1).
    fn frames(&mut self) -> Result<u64> {
        let mut done = 0;
        while let Some(f) = self.h.take_frame()? {
            let Some(job) = &self.running else {
                bail!("handler {}: a {:?} frame while idle", self.h.pid, f.t);
            };
            if f.id.as_deref() != Some(job.rid.as_str()) {
                bail!(
                    "handler {}: a frame for {:?}, not {}",
                    self.h.pid,
                    f.id,
                    job.rid
                );
            }
            match f.t.as_str() {
                "started" if !self.started => self.started = true,
                "done" if self.started => {
                    if f.status.as_deref() != Some("ok") {
                        bail!("handler {}: a job ended {:?}", self.h.pid, f.status);
                    }
                    done += 1;
                    self.start()?;
                }
                t => bail!("handler {}: unexpected {t:?} frame", self.h.pid),
            }
        }
        Ok(done)
    }
}

/// One driver thread: its slots until the queue is empty; returns its jobs.
fn drive(slots: &mut [Slot]) -> Result<u64> {
    let mut jobs = 0u64;
    for s in slots.iter_mut() {
        s.start()?;
    }
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(slots.len());
    loop {
        check_interrupt()?;
        if slots.len() == 1 {
            // One handler: a blocking read, as a one-slot worker waits on its handler.
            let s = &mut slots[0];
            if s.running.is_none() {
                break;
            }
            s.h.fill()?;
            jobs += s.frames()?;
            continue;
        }
        fds.clear();
        let busy: Vec<usize> = (0..slots.len())
            .filter(|i| slots[*i].running.is_some())
            .collect();
        if busy.is_empty() {
            break;
        }
        fds.extend(busy.iter().map(|i| libc::pollfd {
            fd: slots[*i].h.replies.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `fds` is a valid array of fds.len() pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        for (k, i) in busy.iter().enumerate() {
            if fds[k].revents != 0 {
                let s = &mut slots[*i];
                s.h.fill()?;
                jobs += s.frames()?;
            }
        }
    }
    Ok(jobs)
}

/// CPU time, user and system, in seconds (or, divided, in us per job).
#[derive(Clone, Copy, Default)]
struct Cpu {
    user: f64,
    sys: f64,
}

impl Cpu {
    fn total(self) -> f64 {
        self.user + self.sys
    }

    /// `self - before`, per job, in us.
    fn per_job_us(self, before: Cpu, jobs: u64) -> Cpu {
        let k = 1e6 / jobs.max(1) as f64;
        Cpu {
            user: (self.user - before.user) * k,
            sys: (self.sys - before.sys) * k,
        }
    }

    /// `12.3 us (sys 4.5)`.
    fn text(self) -> String {
        format!("{:.1} us (sys {:.1})", self.total(), self.sys)
    }
}

/// The bench process's own CPU (all threads).
fn self_cpu() -> Cpu {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Cpu {
        user: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
    }
}

/// utime and stime of processes (fields 14 and 15 of `/proc/<pid>/stat`), summed.
fn procs_cpu(pids: impl Iterator<Item = i32>) -> Cpu {
    let hz = procs::clk_tck();
    let mut cpu = Cpu::default();
    for pid in pids {
        let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = s.rfind(')') else { continue };
        let mut rest = s[close + 1..].split_whitespace().skip(11);
        let mut next = || {
            rest.next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        cpu.user += next() / hz;
        cpu.sys += next() / hz;
    }
    cpu
}

/// Redis's CPU (`INFO cpu`: used_cpu_user, used_cpu_sys).
fn redis_cpu(conn: &mut redis::Connection) -> Result<Cpu> {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn)?;
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Ok(Cpu {
        user: field("used_cpu_user:"),
        sys: field("used_cpu_sys:"),
    })
}

/// What one variant measured.
struct FloorRun {
    workers: usize,
    slots: usize,
    rate: f64,
    /// CPU per job of the bench process, of the handlers (boot excluded) and of Redis.
    bench: Cpu,
    ruby: Cpu,
    redis: Cpu,
    /// The handlers' boot CPU, per handler (excluded from `ruby`).
    boot_ms: f64,
    cmds: f64,
}

impl FloorRun {
    fn label(&self) -> String {
        let threads = match self.workers {
            1 => "1 thread".to_string(),
            w => format!("{w} threads"),
        };
        if self.slots > 1 {
            format!("ruby-floor: {threads} x {} handlers", self.slots)
        } else {
            format!("ruby-floor: {threads}, 1 handler each")
        }
    }
}

/// Drains `n` Noop jobs with `workers` threads of `slots` handlers each.
fn measure(
    ctx: &mut Ctx,
    argv: &[String],
    workers: usize,
    slots: usize,
    n: usize,
) -> Result<FloorRun> {
    ctx.flush()?;
    ctx.push_noop("bench", "Noop", n)?;
    let url = ctx.redis.url();
    // Spawned here, in the thread that outlives them (PR_SET_PDEATHSIG), all booting at once.
    let mut handlers = (0..workers * slots)
        .map(|_| Handler::spawn(argv))
        .collect::<Result<Vec<_>>>()?;
    let boot = Instant::now();
    for h in &mut handlers {
        h.wait_ready()
            .with_context(|| format!("handler {} booting", h.pid))?;
    }
    let boot_secs = boot.elapsed().as_secs_f64();
    let mut groups: Vec<Vec<Slot>> = Vec::new();
    let mut it = handlers.into_iter();
    for w in 0..workers {
        let mut g = Vec::new();
        for k in 0..slots {
            g.push(Slot {
                fw: FloorWorker::new(&url, w * slots + k)?,
                h: it.next().ok_or_else(|| anyhow!("too few handlers"))?,
                running: None,
                started: false,
                line: Vec::with_capacity(512),
            });
        }
        groups.push(g);
    }
    let all_handlers = |gs: &[Vec<Slot>]| procs_cpu(gs.iter().flatten().map(|s| s.h.pid));
    let r0 = all_handlers(&groups);
    let s0 = stats::snapshot(&mut ctx.conn)?;
    let x0 = redis_cpu(&mut ctx.conn)?;
    let c0 = self_cpu();
    let t0 = Instant::now();
    let done = std::thread::scope(|s| -> Result<u64> {
        let handles: Vec<_> = groups
            .iter_mut()
            .map(|g| s.spawn(move || drive(g)))
            .collect();
        let mut jobs = 0;
        for h in handles {
            jobs += h
                .join()
                .map_err(|_| anyhow!("a ruby-floor driver panicked"))??;
        }
        Ok(jobs)
    })?;
    let secs = t0.elapsed().as_secs_f64().max(1e-6);
    let c1 = self_cpu();
    let x1 = redis_cpu(&mut ctx.conn)?;
    let d = stats::Delta::between(&s0, &stats::snapshot(&mut ctx.conn)?, &[]);
    let r1 = all_handlers(&groups);
    if done != n as u64 {
        bail!("ruby-floor: {done} jobs done of {n}");
    }
    let run = FloorRun {
        workers,
        slots,
        rate: done as f64 / secs,
        bench: c1.per_job_us(c0, done),
        ruby: r1.per_job_us(r0, done),
        redis: x1.per_job_us(x0, done),
        boot_ms: r0.total() * 1e3 / (workers * slots) as f64,
        cmds: d.total_calls() as f64 / done.max(1) as f64,
    };
    println!(
        "{}: {n} jobs at {} jobs/s; CPU/job: bench drivers {}, Ruby handlers {}, Redis {} \
         ({:.1} commands/job); handlers' boot {:.2} s wall, {:.0} ms CPU each",
        run.label(),
        fmt_int(run.rate),
        run.bench.text(),
        run.ruby.text(),
        run.redis.text(),
        run.cmds,
        boot_secs,
        run.boot_ms
    );
    println!("  commands: {}", d.breakdown(done, usize::MAX));
    Ok(run)
}

/// The variants: `--workers`/`--slots` when given, else W = 2, W = 4, and 2 x 4 handlers.
fn variants(opts: &Opts) -> Vec<(usize, usize)> {
    match (opts.workers, opts.slots) {
        (None, None) => vec![(2, 1), (4, 1), (2, 4)],
        (w, k) => vec![(w.unwrap_or(2).max(1), k.unwrap_or(1).max(1))],
    }
}

/// `ruby-floor`: the variants, then Sidekiq `-c 10` with one process per core.
pub(crate) fn scenario_ruby_floor(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let argv = persistent::ruby_command("examples/ruby-app/app.rb")?;
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    let mut runs = Vec::new();
    for (w, k) in variants(opts) {
        let r = measure(&mut ctx, &argv, w, k, n)?;
        rows.push(row(
            format!("{}: jobs/s", r.label()),
            fmt_int(r.rate),
            "",
            None,
        ));
        rows.push(row(
            format!("{}: CPU/job, bench + Ruby + Redis", r.label()),
            format!(
                "{:.1} + {:.1} + {:.1} us (sys {:.1} + {:.1} + {:.1})",
                r.bench.total(),
                r.ruby.total(),
                r.redis.total(),
                r.bench.sys,
                r.ruby.sys,
                r.redis.sys
            ),
            "",
            None,
        ));
        runs.push(r);
    }
    let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
    let peer: Result<PeerDrain> = sidekiq_drain(&ctx, n, SIDEKIQ_CONCURRENCY, cores)
        .inspect(|s| s.report(&format!("sidekiq 6.4 -c {SIDEKIQ_CONCURRENCY} x{cores}")));
    let what = format!("Sidekiq 6.4 -c {SIDEKIQ_CONCURRENCY} x{cores} (one process per core)");
    match peer {
        Ok(s) => {
            rows.push(row(
                format!("{what}: jobs/s, CPU/job Sidekiq + Redis"),
                format!(
                    "{} ({:.1} + {:.1} us, drain window)",
                    fmt_int(s.rate),
                    s.window_cpu_us_per_job,
                    s.delta.cpu_s * 1e6 / s.n.max(1) as f64
                ),
                "",
                None,
            ));
            for r in &runs {
                println!(
                    "{} / {what} = {:.2}× ({} vs {} jobs/s)",
                    r.label(),
                    r.rate / s.rate,
                    fmt_int(r.rate),
                    fmt_int(s.rate)
                );
                rows.push(row(
                    format!("{} / {what}", r.label()),
                    format!(
                        "{:.2}× ({} vs {} jobs/s)",
                        r.rate / s.rate,
                        fmt_int(r.rate),
                        fmt_int(s.rate)
                    ),
                    format!("the most the ruby adapter can reach (target {TARGET}×)"),
                    None,
                ));
            }
        }
        Err(e) => {
            eprintln!("locketd-bench: sidekiq x{cores}: {e:#}");
            rows.push(row(
                what,
                format!("n/a: {}", persistent::first_line(&e)),
                "",
                None,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_frame_has_locketd_s_fields() {
        let keys = vec!["resque:lock:x".to_string()];
        let v: serde_json::Value = serde_json::to_value(JobFrame {
            t: "job",
            id: "01",
            payload: r#"{"class":"Noop","args":[1]}"#,
            queue: "bench",
            class: "Noop",
            worker: "w",
            lock_keys: &keys,
            lock_token: "01",
            deadline_ms: Some(1),
        })
        .unwrap();
        let mut names: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "class",
                "deadline_ms",
                "id",
                "lock_keys",
                "lock_token",
                "payload",
                "queue",
                "t",
                "worker"
            ]
        );
        assert_eq!(
            v["payload"].as_str(),
            Some(r#"{"class":"Noop","args":[1]}"#)
        );
    }

    #[test]
    fn reply_frames_parse_with_and_without_status() {
        let r: Reply = serde_json::from_str(r#"{"t":"started","id":"a"}"#).unwrap();
        assert_eq!(
            (r.t.as_str(), r.id.as_deref(), r.status),
            ("started", Some("a"), None)
        );
        let r: Reply =
            serde_json::from_str(r#"{"t":"done","id":"a","status":"ok","performed":true}"#)
                .unwrap();
        assert_eq!(r.status.as_deref(), Some("ok"));
    }

    #[test]
    fn variants_default_to_two_four_and_two_by_four() {
        let opts = Opts::parse_from(["locketd-bench", "ruby-floor"]);
        assert_eq!(variants(&opts), vec![(2, 1), (4, 1), (2, 4)]);
        let opts = Opts::parse_from(["locketd-bench", "ruby-floor", "--slots", "3"]);
        assert_eq!(variants(&opts), vec![(2, 3)]);
    }
}
