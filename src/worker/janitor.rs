//! The janitor (locking-semantics.md R-3, R-4, R-5): whichever process holds the `janitor`
//! mutex promotes due delayed jobs, purges expired lock holders and dependency holds, and
//! recovers the slots of dead processes.

use crate::config::{Config, OnWorkerDeath};
use crate::resque::failure::FailureBackend;
use crate::resque::failure::JobFailure;
use crate::resque::keys::Keys;
use crate::store::{self, scripts::scripts};
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::HashMap;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// What one janitor pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JanitorReport {
    /// Whether this pass held the mutex.
    pub ran: bool,
    /// Expired lock holders removed.
    pub expired: u64,
    /// Delayed jobs moved back to their queues (P-4).
    pub promoted: u64,
    /// Expired dependency hold fields dropped (D-1).
    pub holds_expired: u64,
    /// Per recovered slot: (slot key, result of the recover script).
    pub recovered: Vec<(String, String)>,
    /// Parked jobs woken because their resource had a free unit (PK-4).
    pub woken: u64,
    /// Whether anything is parked anywhere (the `parked` index is not empty), as the pass's
    /// wake found it.
    pub parked: bool,
    /// How soon the earliest parked resource is due, as the pass's wake found it (RL-3).
    pub parked_next_in: Option<Duration>,
}

const RELEASE_MUTEX: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// One janitor pass, if the mutex can be had.
pub async fn janitor_pass<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    token: &str,
) -> RedisResult<JanitorReport> {
    let interval = config.locket.janitor_interval.get();
    let got: Option<String> = redis::cmd("SET")
        .arg(keys.janitor())
        .arg(token)
        .arg("NX")
        .arg("PX")
        .arg(u64::try_from((interval * 2).as_millis()).unwrap_or(10_000))
        .query_async(conn)
        .await?;
    if got.is_none() {
        return Ok(JanitorReport::default());
    }
    let mut report = JanitorReport {
        ran: true,
        ..JanitorReport::default()
    };
    // Each step runs whatever the others did: one that fails for good (a queue key of the
    // wrong type, say) must not stop the rest, pass after pass. The first error is returned.
    let mut first_error = None;
    report.promoted = keep_first(
        &mut first_error,
        store::promote_delayed(conn, keys, 100, None).await,
    )
    .unwrap_or(0);
    report.expired = keep_first(
        &mut first_error,
        store::purge_expired(conn, keys, 100).await,
    )
    .unwrap_or(0);
    report.holds_expired =
        keep_first(&mut first_error, store::purge_holds(conn, keys, 100).await).unwrap_or(0);
    keep_first(
        &mut first_error,
        store::unblock_lapsed(conn, keys, 10).await,
    );
    let wake = keep_first(&mut first_error, wake_parked(conn, keys, config).await);
    report.woken = wake.as_ref().map_or(0, |w| w.woken);
    report.parked = wake.as_ref().is_none_or(|w| w.pending);
    report.parked_next_in = wake.as_ref().filter(|w| w.pending).map(|w| w.next_in);
    // A-22: the caps as this config sets them, and the units of reservations that ended
    // without a FINISH.
    let caps = config.queue_caps();
    keep_first(
        &mut first_error,
        store::publish_caps(conn, keys, &caps).await,
    );
    for (q, _) in &caps {
        keep_first(
            &mut first_error,
            store::free_lapsed_units(conn, keys, q).await,
        );
    }
    keep_first(
        &mut first_error,
        recover_dead(conn, keys, config, &mut report).await,
    );
    let _: RedisResult<i64> = redis::Script::new(RELEASE_MUTEX)
        .key(keys.janitor())
        .arg(token)
        .invoke_async(conn)
        .await;
    match first_error {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// The value of `r`, or `None` with its error kept in `first` unless an earlier one is there:
/// for runs of steps that go on past a failure and report the first.
fn keep_first<T>(first: &mut Option<redis::RedisError>, r: RedisResult<T>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            first.get_or_insert(e);
            None
        }
    }
}

async fn recover_dead<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    report: &mut JanitorReport,
) -> RedisResult<()> {
    let processes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.processes())
        .query_async(conn)
        .await?;
    // R-3 step 4: at most 10 recoveries a pass. A recovery that fails (a key of another type,
    // S-6) does not count toward them, so dead processes that cannot be recovered never hide
    // the others; they are bounded on their own.
    let (mut recovered_processes, mut failed_processes) = (0, 0);
    let mut first_error = None;
    for process in processes {
        if recovered_processes >= 10 || failed_processes >= 100 {
            break;
        }
        let alive: bool = redis::cmd("EXISTS")
            .arg(keys.alive(&process))
            .query_async(conn)
            .await?;
        if alive {
            continue;
        }
        // One process that cannot be recovered must not hold up the ones listed after it.
        let r = recover_process(conn, keys, config, &process, "stopped heartbeating", report).await;
        match &r {
            Ok(()) => recovered_processes += 1,
            Err(e) => {
                failed_processes += 1;
                debug!(process = %process, error = %e, "recovering a dead process failed");
            }
        }
        keep_first(&mut first_error, r);
    }
    first_error.map_or(Ok(()), Err)
}

/// Recovers every slot of one process whose `alive:` lease is gone (R-4): used by the janitor,
/// and by the master right after it reaped a dead worker (after deleting the lease, since the
/// process is known dead). Each slot's script re-checks the lease and the rid (R-5). `why`
/// completes the failure message `locketd process <id> <why> while running <Class>`.
pub async fn recover_process<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    process: &str,
    why: &str,
    report: &mut JanitorReport,
) -> RedisResult<()> {
    let slots: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.slots(process))
        .query_async(conn)
        .await?;
    if slots.is_empty() {
        let _: () = redis::cmd("SREM")
            .arg(keys.processes())
            .arg(process)
            .query_async(conn)
            .await?;
        return Ok(());
    }
    let mut first_error = None;
    for (slot, worker_id) in slots {
        let r = recover_slot(conn, keys, config, process, &slot, &worker_id, why).await;
        if let Err(e) = &r {
            debug!(process = %process, slot = %slot, error = %e, "recovering a slot failed");
        }
        if let Some(result) = keep_first(&mut first_error, r) {
            info!(process = %process, slot = %slot, worker = %worker_id, result = %result, "recovered a dead process's slot");
            report.recovered.push((format!("{process}:{slot}"), result));
        }
    }
    first_error.map_or(Ok(()), Err)
}

async fn recover_slot<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
    process: &str,
    slot: &str,
    worker_id: &str,
    why: &str,
) -> RedisResult<String> {
    let slot_key = format!("{process}:{slot}");
    // Bytes: a payload need not be UTF-8 (E-1), and one that is not must not stop the
    // recovery. The script moves the payload itself; only the failure record's copy is text.
    let record: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(keys.inflight(&slot_key))
        .query_async(conn)
        .await?;
    let field = |name: &str| {
        record
            .get(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    };
    let rid = field("rid");
    let queue = field("queue");
    let payload = field("payload");
    let class = field("class");
    let locks: Vec<String> = record
        .get("locks")
        .and_then(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    let failure = JobFailure::new(
        "Resque::DirtyExit",
        format!(
            "Job still being processed: locketd process {process} {why} while running {}",
            if class.is_empty() {
                "<Unknown Job>"
            } else {
                &class
            }
        ),
    )
    .dirty()
    .record(&payload, worker_id, &queue, SystemTime::now());
    let policy = match config.locket.on_worker_death {
        OnWorkerDeath::Fail => "fail",
        OnWorkerDeath::Requeue => "requeue",
    };
    let mut inv = scripts().recover.prepare_invoke();
    inv.key(keys.inflight(&slot_key))
        .key(keys.alive(process))
        .key(keys.queue(&queue))
        .key(keys.queues())
        .key(match config.failure_backend {
            FailureBackend::Redis => keys.failed(),
            FailureBackend::RedisMultiQueue => keys.queue_failed(&queue),
        })
        .key(keys.recoveries())
        .key(keys.slots(process))
        .key(keys.processes())
        .key(keys.workers())
        .key(keys.worker(worker_id))
        .key(keys.worker_started(worker_id))
        .key(keys.heartbeat())
        .key(keys.stat_processed_by(worker_id))
        .key(keys.stat_failed_by(worker_id))
        .key(keys.locks());
    store::lock_keys(&mut inv, keys, locks.iter().map(String::as_str));
    inv.arg(&rid)
        .arg(policy)
        .arg(failure)
        .arg(config.locket.max_recoveries)
        .arg(worker_id)
        .arg(slot)
        .arg(process)
        .arg(keys.counter_prefix());
    for id in &locks {
        inv.arg(id);
    }
    let result: String = inv.invoke_async(conn).await?;
    if result == "recovered_running" && config.failure_backend == FailureBackend::RedisMultiQueue {
        // Idempotent index of the per-queue lists, as Resque's RedisMultiQueue writes on every save.
        let _: () = redis::cmd("SADD")
            .arg(keys.failed_queues())
            .arg(format!("{queue}_failed"))
            .query_async(conn)
            .await?;
    }
    Ok(result)
}

/// PK-4: wakes the jobs parked on resources whose holder lapsed (the `parked` index, at most
/// 100 resources a call), and reports at error each resource whose jobs cannot move (PK-6:
/// the script makes such a resource due again a minute later, so once a minute).
pub(super) async fn wake_parked<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    config: &Config,
) -> RedisResult<store::WakeReport> {
    let every = config.locket.park_check_interval.get();
    let r = store::wake_due(conn, keys, 100, every).await?;
    for res in &r.stuck {
        tracing::error!(resource = %res, "parked jobs cannot go back to their queue: a key holds another type (its parked list, its lock or the queue); they stay parked until it is mended");
    }
    Ok(r)
}

/// Runs janitor passes every `janitor_interval` until `stop`, and the parked jobs' check
/// (PK-4) every `park_check_interval` between them.
pub(super) async fn janitor_loop<C: ConnectionLike + Send + Clone>(
    conn: C,
    keys: Keys,
    config: Config,
    stop: CancellationToken,
) {
    let token = crate::store::random_hex(16);
    let every = config.locket.janitor_interval.get();
    let park_every = config.locket.park_check_interval.get().min(every);
    // One warning per outage, not one per pass.
    let mut failing = false;
    // Whether anything was parked anywhere at the last look: only then does this process run
    // the parked check between its passes (PK-4), so an idle fleet with nothing parked pays
    // nothing for it. A job parked after a look that found none is seen by the next pass, so
    // a lapsed holder's jobs still wake within lock_ttl + janitor_interval +
    // park_check_interval (PK-4's bound).
    let mut parked = true;
    let mut next_pass = tokio::time::Instant::now() + every;
    // RL-3: a rate's parked jobs are due when its next start is allowed, which can come
    // sooner than park_check_interval; 5 ms at least between looks.
    let mut nap = park_every;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(nap) => {}
            _ = stop.cancelled() => return,
        }
        if tokio::time::Instant::now() < next_pass {
            if !parked {
                continue;
            }
            // PK-4 between passes: one script call, idempotent, so no mutex (two processes
            // that run it at once while the role changes hands find the second's resources
            // rescheduled by the first).
            nap = park_every;
            match wake_parked(&mut conn.clone(), &keys, &config).await {
                Ok(r) => {
                    parked = r.pending;
                    if r.pending {
                        nap = r.next_in.max(Duration::from_millis(5)).min(park_every);
                    }
                }
                Err(e) => debug!(error = %e, "parked check failed"),
            }
            continue;
        }
        next_pass = tokio::time::Instant::now() + every;
        let pass = janitor_pass(&mut conn.clone(), &keys, &config, &token).await;
        if let Ok(r) = &pass {
            // A pass that did not hold the mutex did not look.
            if r.ran {
                parked = r.parked;
            }
            nap = r.parked_next_in.map_or(park_every, |d| {
                d.max(Duration::from_millis(5)).min(park_every)
            });
        }
        match &pass {
            Ok(r)
                if r.ran
                    && (r.expired > 0
                        || r.promoted > 0
                        || r.holds_expired > 0
                        || r.woken > 0
                        || !r.recovered.is_empty()) =>
            {
                debug!(
                    expired = r.expired,
                    promoted = r.promoted,
                    holds_expired = r.holds_expired,
                    woken = r.woken,
                    recovered = r.recovered.len(),
                    "janitor pass"
                );
            }
            Ok(_) => {}
            Err(e) if !failing => {
                warn!(error = %e, "janitor pass failed; retrying every janitor_interval");
            }
            Err(e) => debug!(error = %e, "janitor pass failed again"),
        }
        failing = pass.is_err();
    }
}
