//! `spawn-ceiling`: how many `/bin/true` processes this machine starts and reaps per second with
//! the command scenario's parallelism, without Redis or locketd (issue 15, item 3). Each of N
//! threads spawns `/bin/true` and waits for it, in a loop, until N jobs are done in all. The
//! spawn is std's `Command` (`posix_spawn`, a `clone(CLONE_VM|CLONE_VFORK)` in glibc, with
//! stdin, stdout and stderr on `/dev/null`): the cheapest ordinary way to start a program, so
//! the command scenario's jobs/s can be read as a share of it.

use super::*;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The last ceiling measured in this run: (threads, spawns/s). The command scenario compares
/// against it when it was taken with its own parallelism.
static LAST: Mutex<Option<(usize, f64)>> = Mutex::new(None);

/// What one ceiling run measured.
pub(crate) struct Ceiling {
    pub(crate) spawns: usize,
    pub(crate) rate: f64,
    /// CPU of this process and its reaped children per spawn (user + system).
    pub(crate) cpu_us: f64,
}

/// CPU seconds (user + system) of `who` (`RUSAGE_SELF` or `RUSAGE_CHILDREN`).
fn cpu_secs(who: libc::c_int) -> f64 {
    // SAFETY: getrusage writes into the zeroed struct it is given; no other memory is touched.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn total_cpu() -> f64 {
    cpu_secs(libc::RUSAGE_SELF) + cpu_secs(libc::RUSAGE_CHILDREN)
}

/// Spawns and reaps `/bin/true` `n` times over `threads` threads.
pub(crate) fn measure(threads: usize, n: usize) -> Result<Ceiling> {
    let threads = threads.max(1);
    let next = AtomicUsize::new(0);
    let cpu0 = total_cpu();
    let t0 = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    while next.fetch_add(1, Ordering::Relaxed) < n {
                        check_interrupt()?;
                        let status = Command::new("/bin/true")
                            .stdin(Stdio::null())
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .status()
                            .context("spawning /bin/true")?;
                        if !status.success() {
                            bail!("/bin/true exited with {status}");
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow!("a spawning thread panicked"))??;
        }
        Ok(())
    })?;
    let secs = t0.elapsed().as_secs_f64().max(1e-6);
    let cpu = total_cpu() - cpu0;
    Ok(Ceiling {
        spawns: n,
        rate: n as f64 / secs,
        cpu_us: cpu * 1e6 / n.max(1) as f64,
    })
}

/// The ceiling for `threads` measured earlier in this run, if any.
pub(crate) fn last_for(threads: usize) -> Option<f64> {
    let last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    last.filter(|(t, _)| *t == threads).map(|(_, r)| r)
}

/// Measures the ceiling, prints it and remembers it for the command scenario.
pub(crate) fn ceiling(threads: usize, n: usize) -> Result<Ceiling> {
    let c = measure(threads, n)?;
    println!(
        "spawn-ceiling /bin/true --workers {threads}: {} spawns at {} spawns/s; CPU {:.0} us/spawn (this process and its children)",
        c.spawns,
        fmt_int(c.rate),
        c.cpu_us
    );
    *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some((threads, c.rate));
    Ok(c)
}

pub(crate) fn scenario_spawn_ceiling(opts: &Opts, rows: &mut Vec<Row>) -> Result<()> {
    let threads = opts.workers.unwrap_or(4);
    let n = opts.jobs.unwrap_or(20_000).max(1);
    let c = ceiling(threads, n)?;
    rows.push(row(
        format!("spawn-ceiling /bin/true --workers {threads}: spawns/s"),
        format!("{} ({:.0} us CPU/spawn)", fmt_int(c.rate), c.cpu_us),
        "",
        None,
    ));
    Ok(())
}
