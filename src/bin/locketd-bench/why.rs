//! The `why` scenario: `locketd why QUEUE CLASS ARGS` on a queue of 1,000,000 jobs (`--jobs N`)
//! whose target sits 10 from the tail, its lock held by another job, so every read runs: the
//! queue's `LPOS` over nearly the whole list, the lock's holder, the queue's pause, cap and
//! counter, and the fleet (no worker here: a reason too). Timed in process (the library's
//! `explain`, one connection kept) and end to end (the binary: start, connect, answer).
//! Target: under 100 ms in process.

use crate::{fmt_int, row, Ctx, Opts, Row};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const QUEUE: &str = "why_bench";
const TARGET_MS: f64 = 100.0;
/// Answers timed each way.
const RUNS: usize = 20;

fn median_max(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(*v.last().unwrap_or(&Duration::ZERO)))
}

pub(crate) fn scenario_why(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(1_000_000);
    let target = n.saturating_sub(10);
    let key = format!("resque:queue:{QUEUE}");
    let t0 = Instant::now();
    let mut pipe = redis::pipe();
    for start in (0..n).step_by(1000) {
        let mut cmd = redis::cmd("RPUSH");
        cmd.arg(&key);
        for i in start..(start + 1000).min(n) {
            cmd.arg(format!(r#"{{"class":"Noop","args":[{i}]}}"#));
        }
        pipe.add_command(cmd).ignore();
        if start % 50_000 == 49_000 || start + 1000 >= n {
            pipe.query::<()>(&mut ctx.conn)?;
            pipe = redis::pipe();
        }
    }
    // The target's lock, held by another job for 10 minutes.
    let holder = serde_json::json!({"blocked": 0, "token": "0123456789abcdef0123456789abcdef",
        "process": "bench:1:aaaaaaaa", "resque_worker": "bench:1:why_bench", "queue": QUEUE,
        "class": "Noop", "acquired_at": 0, "limit": 1});
    redis::cmd("SET")
        .arg(format!("resque:locket:lock:k:{target}"))
        .arg(holder.to_string())
        .arg("PX")
        .arg(600_000)
        .query::<()>(&mut ctx.conn)?;
    println!(
        "why: {} jobs pushed in {:.1} s; target at position {target}",
        fmt_int(n as f64),
        t0.elapsed().as_secs_f64()
    );
    let config = format!(
        "redis = \"{}\"\nqueues = \"{QUEUE}\"\n\n[classes.Noop]\nlock = \"k:{{args[0]}}\"\n",
        ctx.redis.url()
    );
    let path = ctx.dir.path().join("why.toml");
    std::fs::write(&path, &config)?;
    let cfg = locketd::config::Config::parse(&config, "why.toml")?;
    let what = locketd::admin::why::Target::Payload {
        queue: QUEUE.into(),
        class: "Noop".into(),
        args: vec![target.to_string()],
    };
    // In process: one connection, RUNS answers.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let inner = rt.block_on(async {
        let mut conn = locketd::conn::connect(&cfg.redis, Duration::ZERO).await?;
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let t = Instant::now();
            let why = locketd::admin::why::explain(&mut conn, &cfg, &what).await?;
            times.push(t.elapsed());
            let place = serde_json::to_value(&why.place)?;
            anyhow::ensure!(
                place["position"] == target && why.reasons.len() == 2,
                "unexpected answer: {place} {:?}",
                why.reasons
            );
        }
        anyhow::Ok(times)
    })?;
    // End to end: the binary.
    let mut outer = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        let out = Command::new(exe)
            .arg("--config")
            .arg(&path)
            .args(["why", QUEUE, "Noop", &target.to_string(), "--json"])
            .output()
            .context("running locketd why")?;
        outer.push(t.elapsed());
        anyhow::ensure!(out.status.success(), "locketd why: {out:?}");
    }
    let (p50, max) = median_max(inner);
    let (c50, cmax) = median_max(outer);
    println!(
        "why: in process p50 {p50:.1} ms, max {max:.1} ms; the binary p50 {c50:.1} ms, max \
         {cmax:.1} ms ({RUNS} each)"
    );
    rows.push(row(
        format!(
            "why on a queue of {} (near the tail), in process, p50",
            fmt_int(n as f64)
        ),
        format!("{p50:.1} ms (max {max:.1})"),
        format!("< {TARGET_MS} ms"),
        Some(p50 < TARGET_MS),
    ));
    rows.push(row(
        "the same through the binary (start, connect, answer), p50",
        format!("{c50:.1} ms (max {cmax:.1})"),
        "",
        None,
    ));
    Ok(())
}
