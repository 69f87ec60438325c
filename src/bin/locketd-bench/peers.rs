//! The peers of the noop scenarios (issue 15 item 4): node-resque 9.7.1 (`Worker` + `JobLock`
//! and `MultiWorker` max 10, bench/node) and Sidekiq 6.4 with concurrency 10 (sidekiq.rs,
//! bench/sidekiq), each draining no-op jobs on this machine, and the rows that put locketd's
//! noop rates beside theirs against the issue's targets.

use super::*;
use persistent::{first_line, ruby_installed};
use procs::on_path;
use scenarios::{noop_label, NOOP_CLASSES};
use sidekiq::sidekiq_drain;

/// Sidekiq's concurrency in the comparison (the issue's "Sidekiq c=10").
const SIDEKIQ_CONCURRENCY: usize = 10;

const MULTI: &str = "node-resque MultiWorker(10)";
const JOBLOCK: &str = "node-resque Worker+JobLock";
const SIDEKIQ: &str = "Sidekiq 6.4 -c 10";

/// A peer's jobs/s in this run, or why it has none (one line).
type PeerRate = Result<f64, String>;

/// What the peers did in one run.
pub(crate) struct Peers {
    pub multi: PeerRate,
    pub joblock: PeerRate,
    pub sidekiq: PeerRate,
}

impl Peers {
    /// No peer ran, for `why`.
    pub(crate) fn none(why: &str) -> Peers {
        Peers {
            multi: Err(why.to_string()),
            joblock: Err(why.to_string()),
            sidekiq: Err(why.to_string()),
        }
    }
}

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

/// A peer step's outcome, its error as one line; an interrupt still ends the run.
fn settle<T>(name: &str, r: Result<T>) -> Result<Result<T, String>> {
    match r {
        Ok(x) => Ok(Ok(x)),
        Err(e) if procs::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) => Err(e),
        Err(e) => {
            eprintln!("locketd-bench: {name}: {e:#}");
            Ok(Err(first_line(&e)))
        }
    }
}

/// One node-resque drain: its line, its row.
fn node_peer(
    ctx: &mut Ctx,
    node: &Path,
    n: usize,
    name: &str,
    mode: &[&str],
    rows: &mut Vec<Row>,
) -> Result<PeerRate> {
    let r = node_drain(ctx, node, n, mode).map(|(rate, d)| {
        let (cmds, cpu) = (
            d.total_calls() as f64 / n as f64,
            d.cpu_s * 1e6 / n as f64,
        );
        println!(
            "peers: {name}: {n} jobs at {} jobs/s; Redis: {cmds:.1} commands/job, CPU {cpu:.1} us/job",
            fmt_int(rate)
        );
        println!("  commands: {}", d.breakdown(n as u64, usize::MAX));
        rows.push(row(
            format!("peers: {name}: jobs/s"),
            format!(
                "{} (Redis: {cmds:.1} commands, {cpu:.1} us CPU per job)",
                fmt_int(rate)
            ),
            "",
            None,
        ));
        rate
    });
    settle(name, r)
}

/// Sidekiq on its own redis-server, or a note saying how to install it.
fn sidekiq_peer(ctx: &Ctx, n: usize, rows: &mut Vec<Row>) -> Result<PeerRate> {
    if !ruby_installed() {
        println!(
            "locketd-bench: note: ruby or sidekiq is not installed: the Sidekiq peer is skipped \
             (`apt-get install ruby ruby-sidekiq`; bench/README.md)"
        );
        let why = "not installed: apt-get install ruby ruby-sidekiq (bench/README.md)";
        rows.push(row(
            format!("peers: {SIDEKIQ}: jobs/s"),
            format!("n/a: {why}"),
            "",
            None,
        ));
        return Ok(Err(why.to_string()));
    }
    let r = sidekiq_drain(ctx, n, SIDEKIQ_CONCURRENCY, 1).map(|s| {
        s.report(&format!("peers: {SIDEKIQ}"));
        rows.push(row(
            format!("peers: {SIDEKIQ}: jobs/s (timed by its queue)"),
            format!(
                "{} (Redis: {:.1} commands, {:.1} us CPU per job; Sidekiq {:.1} us CPU per job)",
                fmt_int(s.rate),
                s.cmds_per_job(),
                s.delta.cpu_s * 1e6 / s.n.max(1) as f64,
                s.window_cpu_us_per_job
            ),
            "",
            None,
        ));
        s.rate
    });
    settle(SIDEKIQ, r)
}

/// Drains N no-op jobs (`--jobs`, default 20,000) with each peer, one after the other: node-resque
/// MultiWorker(10) and Worker+JobLock on a redis-server of the harness's, Sidekiq on its own.
/// A peer that is missing or fails gets an `n/a` row; the others still run.
pub(crate) fn run_peers(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<Peers> {
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    let node = if on_path("node").is_none() || on_path("npm").is_none() {
        println!(
            "locketd-bench: note: node or npm is not installed: the node-resque peers are \
             skipped (bench/README.md)"
        );
        Err("node or npm is not installed (bench/README.md)".to_string())
    } else {
        settle("node-resque", node_dir(ctx.dir.path()))?
    };
    let (multi, joblock) = match &node {
        Ok(dir) => (
            node_peer(
                &mut ctx,
                dir,
                n,
                MULTI,
                &["--mode", "multi", "--max", "10"],
                rows,
            )?,
            node_peer(
                &mut ctx,
                dir,
                n,
                JOBLOCK,
                &["--mode", "worker", "--joblock"],
                rows,
            )?,
        ),
        Err(why) => {
            for name in [MULTI, JOBLOCK] {
                rows.push(row(
                    format!("peers: {name}: jobs/s"),
                    format!("n/a: {why}"),
                    "",
                    None,
                ));
            }
            (Err(why.clone()), Err(why.clone()))
        }
    };
    let sidekiq = sidekiq_peer(&ctx, n, rows)?;
    Ok(Peers {
        multi,
        joblock,
        sidekiq,
    })
}

/// The peers a noop configuration is compared with, and the issue's target for each ratio:
/// prefork `--workers 2` ≥ 2× Sidekiq c=10 and node-resque Worker+JobLock; `--workers 2
/// --slots 32` ≥ 5× Sidekiq c=10 and node-resque MultiWorker(10). Other configurations get
/// the same peers without a target.
fn compared_with(workers: usize, slots: Option<usize>) -> [(&'static str, Option<f64>); 2] {
    match (workers, slots) {
        (2, None) => [(SIDEKIQ, Some(2.0)), (JOBLOCK, Some(2.0))],
        (2, Some(32)) => [(SIDEKIQ, Some(5.0)), (MULTI, Some(5.0))],
        (_, None) => [(SIDEKIQ, None), (JOBLOCK, None)],
        (_, Some(_)) => [(SIDEKIQ, None), (MULTI, None)],
    }
}

/// The ratio rows of one noop configuration; `rate` is its jobs/s, `None` when its drain failed.
pub(crate) fn ratio_rows(
    rows: &mut Vec<Row>,
    workers: usize,
    slots: Option<usize>,
    rate: Option<f64>,
    peers: &Peers,
) {
    let label = noop_label(workers, slots);
    for (name, target) in compared_with(workers, slots) {
        let peer = match name {
            SIDEKIQ => &peers.sidekiq,
            MULTI => &peers.multi,
            _ => &peers.joblock,
        };
        let target_text = target.map(|t| format!("≥ {t}×")).unwrap_or_default();
        let (value, ok) = match (rate, peer) {
            (Some(ours), Ok(theirs)) => {
                let ratio = ours / theirs;
                (
                    format!(
                        "{ratio:.2}× ({} vs {} jobs/s)",
                        fmt_int(ours),
                        fmt_int(*theirs)
                    ),
                    target.map(|t| ratio >= t),
                )
            }
            (None, _) => ("n/a: the locketd drain failed".to_string(), None),
            (_, Err(why)) => (format!("n/a: {why}"), None),
        };
        rows.push(row(format!("{label} / {name}"), value, target_text, ok));
    }
}

/// `peers`: locketd's noop drain (`--workers`, default 2; `--slots` when given) of N jobs, then
/// the peers on the same N, then the ratios.
pub(crate) fn scenario_peers(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let workers = opts.workers.unwrap_or(2);
    let label = noop_label(workers, opts.slots);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(20_000);
    ctx.push_noop("bench", "Noop", n)?;
    let config = ctx.config(&["bench".into()], NOOP_CLASSES);
    let (d, daemon) = ctx.drain(&config, workers, n)?;
    daemon.stop(Duration::from_secs(30));
    d.report(&format!("peers: locketd {label}"));
    rows.push(row(
        format!("peers: locketd {label}: jobs/s"),
        fmt_int(d.rate),
        "",
        None,
    ));
    drop(ctx);
    let peers = run_peers(opts, exe, rows)?;
    ratio_rows(rows, workers, opts.slots, Some(d.rate), &peers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers() -> Peers {
        Peers {
            multi: Ok(2_000.0),
            joblock: Ok(1_000.0),
            sidekiq: Err("not installed: apt-get install ruby ruby-sidekiq".into()),
        }
    }

    #[test]
    fn each_configuration_of_the_issue_is_held_to_its_ratios() {
        let mut rows = Vec::new();
        ratio_rows(&mut rows, 2, None, Some(2_500.0), &peers());
        ratio_rows(&mut rows, 2, Some(32), Some(12_000.0), &peers());
        let got: Vec<_> = rows
            .iter()
            .map(|r| (r.what.as_str(), r.target.as_str(), r.ok))
            .collect();
        assert_eq!(
            got,
            [
                ("noop --workers 2 / Sidekiq 6.4 -c 10", "≥ 2×", None),
                (
                    "noop --workers 2 / node-resque Worker+JobLock",
                    "≥ 2×",
                    Some(true)
                ),
                (
                    "noop --workers 2 --slots 32 / Sidekiq 6.4 -c 10",
                    "≥ 5×",
                    None
                ),
                (
                    "noop --workers 2 --slots 32 / node-resque MultiWorker(10)",
                    "≥ 5×",
                    Some(true)
                ),
            ]
        );
        assert_eq!(rows[1].value, "2.50× (2,500 vs 1,000 jobs/s)");
        assert!(
            rows[0].value.starts_with("n/a: not installed"),
            "{}",
            rows[0].value
        );
    }

    #[test]
    fn a_failed_drain_or_another_configuration_has_no_mark() {
        let mut rows = Vec::new();
        ratio_rows(&mut rows, 2, None, None, &peers());
        ratio_rows(&mut rows, 1, None, Some(1_500.0), &peers());
        assert_eq!(rows[1].value, "n/a: the locketd drain failed");
        assert_eq!(rows[1].target, "≥ 2×");
        assert_eq!(
            rows[3].what,
            "noop --workers 1 / node-resque Worker+JobLock"
        );
        assert_eq!((rows[3].target.as_str(), rows[3].ok), ("", None));
        assert!(rows.iter().all(|r| r.ok.is_none()));
    }
}
