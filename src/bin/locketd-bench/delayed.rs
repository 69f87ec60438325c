//! The `delayed` scenario (issue 14): resque-scheduler's delayed items, written as the gem
//! writes them (SC-2: RPUSH delayed:<ts>, SADD timestamps:<item>, ZADD), all due, delivered by
//! locketd's scheduler. Target: 100,000 items over 1,000 timestamps at ≥ 20,000 items/s.

use crate::procs::sleep;
use crate::{row, Ctx, Opts, Row};
use anyhow::{bail, Result};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const TIMESTAMPS: usize = 1_000;
const TARGET: f64 = 20_000.0;

pub(crate) fn scenario_delayed(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let mut ctx = Ctx::new(opts, exe)?;
    let items = ctx.jobs(100_000);
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    // All due: the timestamps of the last 1,000 seconds but one.
    let first = now - 1 - TIMESTAMPS as i64;
    let mut p = redis::pipe();
    for i in 0..items {
        let ts = (first + (i % TIMESTAMPS) as i64).to_string();
        let item =
            format!(r#"{{"class":"Noop","args":[{i},{{"k":"v"}}],"queue":"delayed_bench"}}"#);
        p.cmd("RPUSH")
            .arg(format!("resque:delayed:{ts}"))
            .arg(&item)
            .ignore()
            .cmd("SADD")
            .arg(format!("resque:timestamps:{item}"))
            .arg(format!("delayed:{ts}"))
            .ignore()
            .cmd("ZADD")
            .arg("resque:delayed_queue_schedule")
            .arg(&ts)
            .arg(&ts)
            .ignore();
        if i % 1000 == 999 {
            p.query::<()>(&mut ctx.conn)?;
            p = redis::pipe();
        }
    }
    if items % 1000 != 0 {
        p.query::<()>(&mut ctx.conn)?;
    }
    // The workers watch another queue: only the scheduler runs.
    let config = ctx.config(&["idle".into()], "");
    let mut daemon = ctx.start_daemon(&config, 1)?;
    let deadline = Instant::now() + Duration::from_secs(60 + items as u64 / 1000);
    // From the lock taken (delivery starts at once) to the last item in its queue.
    let t0 = loop {
        let v: Option<String> = redis::cmd("GET")
            .arg("resque:resque:resque_scheduler_master_lock")
            .query(&mut ctx.conn)?;
        if v.is_some_and(|v| v.starts_with("locketd-")) {
            break Instant::now();
        }
        if Instant::now() > deadline {
            bail!("the scheduler never took its lock");
        }
        daemon.check_alive()?;
        sleep(Duration::from_millis(2))?;
    };
    loop {
        let (len, left): (usize, usize) = redis::pipe()
            .cmd("LLEN")
            .arg("resque:queue:delayed_bench")
            .cmd("ZCARD")
            .arg("resque:delayed_queue_schedule")
            .query(&mut ctx.conn)?;
        if len >= items && left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("{len} of {items} delivered before the deadline");
        }
        daemon.check_alive()?;
        sleep(Duration::from_millis(5))?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let rate = items as f64 / secs;
    let index_left: usize = redis::cmd("EXISTS")
        .arg(r#"resque:timestamps:{"class":"Noop","args":[0,{"k":"v"}],"queue":"delayed_bench"}"#)
        .query(&mut ctx.conn)?;
    println!(
        "delayed: {items} items over {TIMESTAMPS} timestamps delivered in {secs:.2} s: {rate:.0} items/s (index left: {index_left})"
    );
    let lat = latency(&mut ctx, &mut daemon)?;
    daemon.stop(Duration::from_secs(10));
    rows.push(row(
        format!("delayed: {items} items over {TIMESTAMPS} timestamps"),
        format!("{rate:.0} items/s"),
        format!("≥ {TARGET:.0} items/s"),
        Some(rate >= TARGET && index_left == 0),
    ));
    rows.push(row(
        "delayed: due item to its queue, p99",
        format!("{:.0} ms", lat * 1e3),
        "≤ 1000 ms",
        Some(lat <= 1.0),
    ));
    Ok(())
}

/// Items due at the next 5 whole seconds, 2 a second: the p99 (here the max) of the time from
/// an item's timestamp to its arrival in its queue, in seconds.
fn latency(ctx: &mut Ctx, daemon: &mut crate::procs::Daemon) -> Result<f64> {
    const SECONDS: i64 = 5;
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    let mut due = Vec::new();
    for k in 0..SECONDS * 2 {
        let ts = now + 1 + k / 2;
        let item = format!(r#"{{"class":"Noop","args":["lat",{k}],"queue":"delayed_lat"}}"#);
        redis::pipe()
            .atomic()
            .cmd("RPUSH")
            .arg(format!("resque:delayed:{ts}"))
            .arg(&item)
            .cmd("SADD")
            .arg(format!("resque:timestamps:{item}"))
            .arg(format!("delayed:{ts}"))
            .cmd("ZADD")
            .arg("resque:delayed_queue_schedule")
            .arg(ts)
            .arg(ts)
            .query::<()>(&mut ctx.conn)?;
        due.push(ts);
    }
    let mut worst = 0.0f64;
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(SECONDS as u64 + 10);
    while seen < due.len() {
        let len: usize = redis::cmd("LLEN")
            .arg("resque:queue:delayed_lat")
            .query(&mut ctx.conn)?;
        let t = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        while seen < len.min(due.len()) {
            worst = worst.max(t - due[seen] as f64);
            seen += 1;
        }
        if Instant::now() > deadline {
            bail!("{seen} of {} latency items delivered", due.len());
        }
        daemon.check_alive()?;
        sleep(Duration::from_millis(2))?;
    }
    println!(
        "delayed: {} items due over {SECONDS} s reached their queue at most {:.0} ms after their timestamp",
        due.len(),
        worst * 1e3
    );
    Ok(worst)
}
