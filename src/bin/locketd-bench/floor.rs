//! `floor`: the most a prefork worker can do on this machine, whatever its own code costs.
//!
//! W threads (`--workers`, default 2) stand for W worker processes, each running one job at a
//! time over its own blocking connection, as a Resque worker does. Each job makes the Redis
//! calls locketd's prefork path makes, with nothing else around them: no runtime, no logging,
//! no lock templates, just the payload parsed and its args digested (the lock id).
//!
//! - **2 round trips** (A-7a): FINISH of the last job with RESERVE of the next (`MGET`, `DEL`,
//!   two `INCRBY`, `LPOP`, `HSET`), then ACQUIRE+START (`MGET`, `SET NX PX`, `HSET`, `SET`):
//!   the same 10 commands in 2 scripts as the job path.
//! - **1 round trip**: all of it in one script, the lock id made in Lua from the popped
//!   payload (what fusing RESERVE and ACQUIRE would allow): 8 commands in 1 script.
//!
//! The figures bound the prefork ratios from above (docs/dev/performance-log.md, "The prefork floor"):
//! a target above the floor cannot be met by any worker that keeps one job per process and the
//! job path's Redis work, however lean its own code.

use super::*;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicU64, Ordering};

/// The reads, FINISH (when `ARGV[1]` is "1") and the pop, which both variants start with.
/// KEYS: inflight, Resque's "working on", stat:processed, the worker's stat, the queue, the
/// last job's lock, the pause flag, the lease, the counter. ARGV: finish flag, rid, queue
/// name, worker id, now.
macro_rules! finish_and_pop {
    () => {
        r#"
redis.call('MGET', KEYS[7], KEYS[8], KEYS[9])
if ARGV[1] == '1' then
  redis.call('DEL', KEYS[6], KEYS[1], KEYS[2])
  redis.call('INCRBY', KEYS[3], 1)
  redis.call('INCRBY', KEYS[4], 1)
end
local job = redis.call('LPOP', KEYS[5])
if not job then return false end
"#
    };
}

/// FINISH and RESERVE: the pop, then the inflight record.
const FINISH_RESERVE: &str = concat!(
    finish_and_pop!(),
    r#"
redis.call('HSET', KEYS[1], 'rid', ARGV[2], 'queue', ARGV[3], 'payload', job,
  'reserved_at', ARGV[5], 'state', 'reserved', 'resque_worker', ARGV[4])
return job
"#
);

/// ACQUIRE+START. KEYS: the lock, inflight, Resque's "working on", the lease, the counter.
/// ARGV: token, the "working on" value.
const ACQUIRE_START: &str = r#"
redis.call('MGET', KEYS[4], KEYS[5])
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 35000) then return 0 end
redis.call('HSET', KEYS[2], 'state', 'running')
redis.call('SET', KEYS[3], ARGV[2])
return 1
"#;

/// Both in one script; the lock id is the SHA1 of the payload, made here. KEYS and ARGV as
/// FINISH_RESERVE's, then ARGV[6] the lock prefix and ARGV[7] the token.
const FUSED: &str = concat!(
    finish_and_pop!(),
    r#"
local lock = ARGV[6] .. redis.sha1hex(job)
redis.call('SET', lock, ARGV[7], 'NX', 'PX', 35000)
redis.call('HSET', KEYS[1], 'rid', ARGV[2], 'queue', ARGV[3], 'payload', job,
  'reserved_at', ARGV[5], 'state', 'running', 'resque_worker', ARGV[4])
redis.call('SET', KEYS[2], '{"queue":"' .. ARGV[3] .. '","payload":' .. job .. '}')
return {job, lock}
"#
);

/// The floor's lock keys: `<prefix><class>:<digest>`, or `<prefix><sha1>` when fused.
const LOCK_PREFIX: &str = "resque:floor:lock:";

/// What one floor drain measured.
struct FloorRun {
    rate: f64,
    redis_us: f64,
    /// Commands per job inside the scripts.
    cmds: f64,
    /// Script calls per job.
    scripts: f64,
}

/// The args' digest, as a lock id is made from them (class + SHA-256 of the args' JSON).
/// Returns the class too.
fn lock_id(payload: &str) -> Result<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(payload)?;
    let class = v.get("class").and_then(|c| c.as_str()).unwrap_or("");
    let args = v.get("args").map(|a| a.to_string()).unwrap_or_default();
    let lock = format!(
        "{LOCK_PREFIX}{class}:{}",
        hex::encode(Sha256::digest(args.as_bytes()))
    );
    Ok((class.to_string(), lock))
}

/// A job reserved and locked by [`FloorWorker::next`].
pub(crate) struct Reserved {
    /// The reservation id (also the lock token).
    pub rid: String,
    pub payload: String,
    pub class: String,
    pub lock: String,
}

/// One floor worker's Redis side: its blocking connection, its keys, the scripts and the
/// last job's lock (released by the FINISH that comes with the next RESERVE).
pub(crate) struct FloorWorker {
    conn: redis::Connection,
    /// `floor:<pid>:<w>`, the worker id in its keys.
    pub wid: String,
    inflight: String,
    worker_key: String,
    processed_w: String,
    lease: String,
    fr: redis::Script,
    acq: redis::Script,
    both: redis::Script,
    prev_lock: String,
    finish: bool,
    jobs: u64,
}

impl FloorWorker {
    /// Worker `w`'s connection and keys.
    pub(crate) fn new(url: &str, w: usize) -> Result<FloorWorker> {
        let conn = redis::Client::open(url)?.get_connection()?;
        let wid = format!("floor:{}:{w}", std::process::id());
        Ok(FloorWorker {
            conn,
            inflight: format!("resque:floor:inflight:{wid}"),
            worker_key: format!("resque:worker:{wid}"),
            processed_w: format!("resque:stat:processed:{wid}"),
            lease: format!("resque:floor:alive:{wid}"),
            wid,
            fr: redis::Script::new(FINISH_RESERVE),
            acq: redis::Script::new(ACQUIRE_START),
            both: redis::Script::new(FUSED),
            prev_lock: String::from("resque:floor:none"),
            finish: false,
            jobs: 0,
        })
    }

    /// FINISH of the last job (if any) with the RESERVE of the next, then its ACQUIRE+START:
    /// 2 round trips, or 1 when `fused`. `None` once the queue is empty (the call that finds
    /// it so finished the last job).
    pub(crate) fn next(&mut self, fused: bool) -> Result<Option<Reserved>> {
        let now = now_us().to_string();
        let rid = format!("{:016x}", self.jobs);
        let keys = [
            self.inflight.as_str(),
            self.worker_key.as_str(),
            "resque:stat:processed",
            self.processed_w.as_str(),
            "resque:queue:bench",
            self.prev_lock.as_str(),
            "resque:pause-all-workers",
            self.lease.as_str(),
            "resque:floor:counter:bench",
        ];
        let mut inv = if fused { &self.both } else { &self.fr }.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        let finish = if self.finish { "1" } else { "0" };
        inv.arg(finish)
            .arg(&rid)
            .arg("bench")
            .arg(&self.wid)
            .arg(&now);
        let reserved = if fused {
            let r: Option<(String, String)> =
                inv.arg(LOCK_PREFIX).arg(&rid).invoke(&mut self.conn)?;
            let Some((payload, lock)) = r else {
                return Ok(None);
            };
            let v: serde_json::Value = serde_json::from_str(&payload)?;
            let class = v.get("class").and_then(|c| c.as_str()).unwrap_or("");
            let class = std::hint::black_box(class).to_string();
            Reserved {
                rid,
                payload,
                class,
                lock,
            }
        } else {
            let r: Option<String> = inv.invoke(&mut self.conn)?;
            let Some(payload) = r else {
                return Ok(None);
            };
            let (class, lock) = lock_id(&payload)?;
            let working = format!(r#"{{"queue":"bench","run_at":"{now}","payload":{payload}}}"#);
            let ok: i64 = self
                .acq
                .key(&lock)
                .key(&self.inflight)
                .key(&self.worker_key)
                .key(&self.lease)
                .key("resque:floor:counter:bench")
                .arg(&rid)
                .arg(working)
                .invoke(&mut self.conn)?;
            if ok != 1 {
                bail!("floor: lock {lock} was held (every job's args are distinct)");
            }
            Reserved {
                rid,
                payload,
                class,
                lock,
            }
        };
        self.prev_lock.clone_from(&reserved.lock);
        self.finish = true;
        self.jobs += 1;
        Ok(Some(reserved))
    }
}

/// One worker's loop until the queue is empty; returns its jobs.
fn work(url: &str, w: usize, fused: bool) -> Result<u64> {
    let mut fw = FloorWorker::new(url, w)?;
    let mut jobs = 0u64;
    while fw.next(fused)?.is_some() {
        jobs += 1;
    }
    // The last call finished the last job before it found the queue empty.
    Ok(jobs)
}

/// Drains `n` noop jobs with `workers` sequential workers, 2 or 1 round trips per job.
fn measure(ctx: &mut Ctx, workers: usize, n: usize, fused: bool) -> Result<FloorRun> {
    ctx.flush()?;
    ctx.push_noop("bench", "Noop", n)?;
    let url = ctx.redis.url();
    let s0 = stats::snapshot(&mut ctx.conn)?;
    let done = AtomicU64::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (url, done) = (&url, &done);
                s.spawn(move || -> Result<()> {
                    done.fetch_add(work(url, w, fused)?, Ordering::Relaxed);
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow!("a floor worker panicked"))??;
        }
        Ok(())
    })?;
    let secs = t0.elapsed().as_secs_f64().max(1e-6);
    let d = stats::Delta::between(&s0, &stats::snapshot(&mut ctx.conn)?, &[]);
    let jobs = done.load(Ordering::Relaxed);
    if jobs != n as u64 {
        bail!("floor: {jobs} jobs done of {n}");
    }
    Ok(FloorRun {
        rate: jobs as f64 / secs,
        redis_us: d.cpu_s * 1e6 / jobs.max(1) as f64,
        cmds: (d.total_calls() - d.script_calls()) as f64 / jobs.max(1) as f64,
        scripts: d.script_calls() as f64 / jobs.max(1) as f64,
    })
}

/// `floor`: both variants; returns the 2-round-trip rate (what A-7a allows).
pub(crate) fn scenario_floor(opts: &Opts, exe: &Path, rows: &mut Vec<Row>) -> Result<f64> {
    let workers = opts.workers.unwrap_or(2);
    let mut ctx = Ctx::new(opts, exe)?;
    let n = ctx.jobs(100_000);
    let mut two = 0.0;
    for (fused, what) in [(false, "2 round trips/job"), (true, "1 round trip/job")] {
        let r = measure(&mut ctx, workers, n, fused)?;
        println!(
            "floor: {workers} sequential workers, {what}: {n} jobs at {} jobs/s; Redis: {:.1} commands/job inside {:.2} script calls/job, CPU {:.1} us/job",
            fmt_int(r.rate),
            r.cmds,
            r.scripts,
            r.redis_us
        );
        rows.push(row(
            format!("floor: {workers} sequential workers, {what}, the job path's Redis work only: jobs/s"),
            format!("{} (Redis {:.1} us/job)", fmt_int(r.rate), r.redis_us),
            "",
            None,
        ));
        if !fused {
            two = r.rate;
        }
    }
    Ok(two)
}

/// The row that says how far the prefork Sidekiq ratio can go here: the 2-round-trip floor
/// over Sidekiq's rate of the same run.
pub(crate) fn ceiling_row(rows: &mut Vec<Row>, two_rt: f64, peers: &peers::Peers) {
    let value = match &peers.sidekiq {
        Ok(theirs) => format!(
            "{:.2}× ({} vs {} jobs/s)",
            two_rt / theirs,
            fmt_int(two_rt),
            fmt_int(*theirs)
        ),
        Err(why) => format!("n/a: {why}"),
    };
    rows.push(row(
        "floor, 2 round trips / Sidekiq 6.4 -c 10: the most noop --workers 2 / Sidekiq can reach here",
        value,
        "",
        None,
    ));
}
