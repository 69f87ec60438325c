//! Unique entries under chaos (locking-semantics.md U-2..U-4, the peers' stranded-entry
//! complaint): three daemons take duplicate-prone jobs of both policies, plain and behind
//! locks (parks, delays), while worker processes and whole daemons are SIGKILLed mid-job and
//! failed jobs are removed as resque-web does; then every daemon runs, the fleet drains, and
//! no unique entry is left whose job is gone.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::daemon::{cfg, workdir, NS, R};
use crate::support::{wait_until, write_script, Daemon, RedisServer};
use crate::unique::entries;

/// One atomic look at the store (a test's script, so KEYS is fine here): every unique entry
/// with its value, and the payload of every job that waits or runs (queued, delayed, parked or
/// in an inflight record).
const SNAPSHOT_LUA: &str = r#"
local ns = ARGV[1]
local entries, payloads = {}, {}
for _, k in ipairs(redis.call('KEYS', ns .. ':locket:unique:*')) do
  entries[#entries + 1] = k
  entries[#entries + 1] = redis.call('GET', k)
end
for _, q in ipairs(redis.call('KEYS', ns .. ':queue:*')) do
  for _, p in ipairs(redis.call('LRANGE', q, 0, -1)) do payloads[#payloads + 1] = p end
end
local function wrapped(m)
  local ok, v = pcall(cjson.decode, m)
  if ok and type(v) == 'table' and type(v['payload']) == 'string' then
    payloads[#payloads + 1] = v['payload']
  end
end
for _, m in ipairs(redis.call('ZRANGE', ns .. ':locket:delayed', 0, -1)) do wrapped(m) end
for _, l in ipairs(redis.call('KEYS', ns .. ':locket:parked:*')) do
  for _, m in ipairs(redis.call('LRANGE', l, 0, -1)) do wrapped(m) end
end
for _, rec in ipairs(redis.call('KEYS', ns .. ':locket:inflight:*')) do
  local p = redis.call('HGET', rec, 'payload')
  if p then payloads[#payloads + 1] = p end
end
return {entries, payloads}
"#;

/// The unique entries whose job is gone: their value (the digest of the job that placed
/// them, locks::canonical::digest) is the digest of no job that waits or runs.
pub(crate) fn stranded(r: &mut R) -> Vec<String> {
    let (entries, payloads): (Vec<String>, Vec<String>) = r.cmd(&["EVAL", SNAPSHOT_LUA, "0", NS]);
    let live: HashSet<String> = payloads
        .iter()
        .filter_map(|p| {
            let v: serde_json::Value = serde_json::from_str(p).ok()?;
            Some(locketd::locks::canonical::digest(
                v["class"].as_str()?,
                &v["args"],
            ))
        })
        .collect();
    entries
        .chunks(2)
        .filter(|kv| !live.contains(&kv[1]))
        .map(|kv| format!("{} = {}", kv[0], kv[1]))
        .collect()
}

fn config(dir: &Path, death: &str) -> String {
    let d = dir.display();
    let handler = write_script(
        dir,
        "chaos.sh",
        &format!(
            "cat >/dev/null\nr=$(od -An -N1 -tu1 /dev/urandom | tr -d ' ')\n\
             echo \"$LOCKETD_ARGS\" >> {d}/runs\n\
             sleep $(awk \"BEGIN {{ print $r / 1000 }}\")\n\
             [ $((r % 5)) -eq 0 ] && exit 1\nexit 0\n"
        ),
    );
    let key = "unique_key = \"{class}:{args[0]}\"";
    cfg("q")
        .top("workers = 2")
        .locket("on_worker_death", &format!("\"{death}\""))
        .class(
            "Ing",
            &handler,
            &format!("unique = \"until_executing\"\n{key}"),
        )
        .class(
            "Ed",
            &handler,
            &format!("unique = \"until_executed\"\n{key}"),
        )
        .class(
            "IngL",
            &handler,
            &format!("unique = \"until_executing\"\n{key}\nlock = \"k:{{args[0]}}\""),
        )
        .class(
            "EdD",
            &handler,
            &format!(
                "unique = \"until_executed\"\n{key}\nlock = \"k:{{args[0]}}\"\n\
                 on_conflict = \"delay\"\ndelay_base = \"100ms\"\ndelay_max = \"400ms\""
            ),
        )
        .render()
}

/// PUSH through the library's function, as any client can.
fn push(r: &mut R, function: &str, class: &str, n: u32) -> bool {
    let reply: Vec<String> = redis::cmd("FCALL")
        .arg(function)
        .arg(3)
        .arg(format!("{NS}:queue:q"))
        .arg(format!("{NS}:queues"))
        .arg(format!("{NS}:locket:plans"))
        .arg("q")
        .arg(format!("{{\"class\":\"{class}\",\"args\":[{n}]}}"))
        .arg(format!("{NS}:locket:"))
        .query(&mut r.0)
        .expect("FCALL push");
    reply[0] == "1"
}

fn drained(r: &mut R) -> bool {
    r.llen(&format!("{NS}:queue:q")) == 0
        && r.keys(&format!("{NS}:locket:inflight:*")).is_empty()
        && r.cmd::<i64>(&["ZCARD", &format!("{NS}:locket:delayed")]) == 0
        && r.cmd::<i64>(&["ZCARD", &format!("{NS}:locket:parked")]) == 0
}

/// 15 s of chaos over three daemons of two workers (two recover dead workers' jobs by
/// requeueing them, one by failing them): about 40 pushes a second over 4 classes × 12 keys, a
/// worker SIGKILLed every 0.2–0.6 s, a whole daemon every 2–4 s (started again 0.5–1.5 s
/// later), the failed list emptied or one record removed every second. At every pause and at
/// the end no entry is stranded; once drained, no entry is left at all. Prints the figures.
#[test]
fn chaos_leaves_no_unique_entry_without_its_job() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let dir = work.path();
    let configs = [
        config(dir, "requeue"),
        config(dir, "requeue"),
        config(dir, "fail"),
    ];
    let mut daemons: Vec<Option<Daemon>> = configs
        .iter()
        .map(|c| Some(Daemon::start(&redis, c, &[])))
        .collect();
    wait_until(Duration::from_secs(20), "workers up", || {
        daemons
            .iter()
            .all(|d| d.as_ref().is_some_and(|d| d.worker_pids().len() == 2))
    });
    let lib = &locketd::store::scripts::scripts().library;
    let function = lib.function("push");
    wait_until(Duration::from_secs(10), "the library loaded", || {
        let f: redis::RedisResult<redis::Value> =
            redis::cmd("FUNCTION").arg("LIST").query(&mut r.0);
        format!("{f:?}").contains(&lib.name)
    });

    let mut rng = rand::rng();
    let classes = ["Ing", "Ed", "IngL", "EdD"];
    let (mut pushed, mut refused) = (0u32, 0u32);
    let (mut worker_kills, mut daemon_kills, mut failed_removed) = (0u32, 0u32, 0i64);
    let start = Instant::now();
    let end = start + Duration::from_secs(15);
    let mut next_worker_kill = start + Duration::from_millis(300);
    let mut next_daemon_kill = start + Duration::from_secs(2);
    let mut next_failed = start + Duration::from_secs(1);
    let mut restart_at: Option<(usize, Instant)> = None;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(25));
        let class = classes[rng.random_range(0..classes.len())];
        if push(&mut r, &function, class, rng.random_range(0..12)) {
            pushed += 1;
        } else {
            refused += 1;
        }
        let now = Instant::now();
        if now >= next_worker_kill {
            let workers: Vec<i32> = daemons
                .iter()
                .flatten()
                .flat_map(|d| d.worker_pids())
                .collect();
            if !workers.is_empty() {
                let victim = workers[rng.random_range(0..workers.len())];
                // SAFETY: kill(2) of one of the daemons' worker processes.
                unsafe { libc::kill(victim, libc::SIGKILL) };
                worker_kills += 1;
            }
            next_worker_kill = now + Duration::from_millis(rng.random_range(200..600));
        }
        if now >= next_daemon_kill && restart_at.is_none() {
            let i = rng.random_range(0..daemons.len());
            if let Some(mut d) = daemons[i].take() {
                d.kill_master_and_workers();
                d.wait_exit(Duration::from_secs(10)).expect("daemon killed");
                daemon_kills += 1;
            }
            restart_at = Some((i, now + Duration::from_millis(rng.random_range(500..1500))));
            next_daemon_kill = now + Duration::from_secs(rng.random_range(2..4));
        }
        if let Some((i, at)) = restart_at {
            if now >= at {
                daemons[i] = Some(Daemon::start(&redis, &configs[i], &[]));
                restart_at = None;
            }
        }
        if now >= next_failed {
            let failed = format!("{NS}:failed");
            if rng.random_bool(0.5) {
                // resque-web's "clear failed"
                failed_removed += r.cmd::<i64>(&["LLEN", &failed]);
                let _: i64 = r.cmd(&["DEL", &failed]);
            } else {
                // one record removed, as Resque::Failure.remove does (LSET then LREM)
                let n: i64 = r.cmd(&["LLEN", &failed]);
                if n > 0 {
                    let i = rng.random_range(0..n).to_string();
                    let _: String = r.cmd(&["LSET", &failed, &i, "__removed__"]);
                    failed_removed += r.cmd::<i64>(&["LREM", &failed, "1", "__removed__"]);
                }
            }
            next_failed = now + Duration::from_secs(1);
            let left = stranded(&mut r);
            assert!(left.is_empty(), "stranded mid-chaos: {left:?}");
        }
    }
    if let Some((i, _)) = restart_at {
        daemons[i] = Some(Daemon::start(&redis, &configs[i], &[]));
    }
    wait_until(Duration::from_secs(40), "the fleet drained", || {
        drained(&mut r)
    });
    let left = entries(&mut r);
    let runs = std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0);
    eprintln!(
        "unique chaos: pushed {pushed}, refused {refused}, runs {runs}, worker kills \
         {worker_kills}, daemon kills {daemon_kills}, failed records removed \
         {failed_removed}, entries left {}",
        left.len()
    );
    assert!(left.is_empty(), "entries left after the drain: {left:?}");
    assert!(
        worker_kills >= 15 && daemon_kills >= 3 && refused > 0 && pushed > 50,
        "too little chaos"
    );
    for d in daemons.iter_mut().flatten() {
        assert_eq!(d.terminate(Duration::from_secs(30)).code(), Some(0));
    }
}
