//! resque-scheduler's keys (scheduler-protocol.md): the delayed queue's due timestamps, the
//! delivery of one batch (`deliver.lua`), one tick of a recurring schedule (`fire.lua`), and
//! the master lock (`sched_lock.lua`).

use super::scripts::scripts;
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};

/// What one DELIVER call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Items pushed to their queues.
    pub delivered: u64,
    /// Items now kept back at the head of the bucket (the offset of the next batch).
    pub kept: u64,
    /// Items left in the bucket; -1 when the bucket is not a list.
    pub left: i64,
    /// Each item this batch kept: its index in the bucket (-1: the bucket itself) and why.
    pub problems: Vec<(i64, String)>,
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

/// Redis's clock (`TIME`), in Unix milliseconds: the one clock of the fleet's schedulers.
pub async fn redis_time_ms<C: ConnectionLike + Send>(conn: &mut C) -> RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// Due members of `delayed_queue_schedule` (score ≤ `now`), with their scores, `limit` from
/// `offset` in score order: one command.
pub async fn due_timestamps<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    now: i64,
    offset: usize,
    limit: usize,
) -> RedisResult<Vec<(String, f64)>> {
    redis::cmd("ZRANGEBYSCORE")
        .arg(keys.delayed_schedule())
        .arg("-inf")
        .arg(now)
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(offset)
        .arg(limit)
        .query_async(conn)
        .await
}

/// The bytes of items one DELIVER call reads at most (plus the one item that crosses it):
/// a batch of 100 items of several MB each would hold Redis for seconds.
pub const BATCH_BYTES: usize = 1 << 20;

/// Delivers one batch (at most 100 items from `offset`, at most [`BATCH_BYTES`] of them plus
/// one item) of the bucket of `ts` (SC-4, SC-5).
pub async fn deliver_batch<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    ts: &str,
    offset: u64,
    batch: usize,
) -> RedisResult<Delivered> {
    let reply: Vec<Value> = scripts()
        .deliver
        .key(keys.delayed_schedule())
        .key(keys.queues())
        .key(keys.delayed_bucket(ts))
        .arg(format!("{}:", keys.ns()))
        .arg(ts)
        .arg(offset)
        .arg(batch.clamp(1, 100))
        .arg(BATCH_BYTES)
        .invoke_async(conn)
        .await?;
    let mut out = Delivered {
        delivered: reply.first().map_or(0, int).max(0) as u64,
        kept: reply.get(1).map_or(0, int).max(0) as u64,
        left: reply.get(2).map_or(0, int),
        problems: Vec::new(),
    };
    for pair in reply.get(3..).unwrap_or_default().chunks(2) {
        if let [i, why] = pair {
            out.problems.push((int(i), text(why)));
        }
    }
    Ok(out)
}

/// How many seconds a tick may be ahead of Redis's clock (SC-12): the scheduler reads the time
/// from Redis, so a tick is at most a round trip ahead of it; a larger lead is a clock that
/// jumped ahead.
pub const TICK_AHEAD: i64 = 5;

/// What FIRE did with a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fired {
    /// Enqueued (and recorded).
    Yes,
    /// Not later than the recorded tick: fired already.
    Already,
    /// Later than Redis's clock by more than [`TICK_AHEAD`]: neither enqueued nor recorded.
    AheadOfRedis,
}

/// One tick of schedule `name` (SC-12): `payload` pushed to `queue` unless `tick` is not later
/// than the recorded one, or ahead of Redis's clock. `tick` None: a manual run, not recorded.
#[allow(clippy::too_many_arguments)]
pub async fn fire<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    name: &str,
    tick: Option<i64>,
    queue: &str,
    payload: &str,
    ruby_now: &str,
) -> RedisResult<Fired> {
    let n: i64 = scripts()
        .fire
        .key(keys.schedule_last())
        .key(keys.queues())
        .key(keys.queue(queue))
        .key(keys.last_enqueued_at())
        .arg(name)
        .arg(tick.map(|t| t.to_string()).unwrap_or_default())
        .arg(queue)
        .arg(payload)
        .arg(ruby_now)
        .arg(TICK_AHEAD)
        .invoke_async(conn)
        .await?;
    Ok(match n {
        1 => Fired::Yes,
        0 => Fired::Already,
        _ => Fired::AheadOfRedis,
    })
}

/// Takes the master lock if free, or if it still holds `value` (SC-8, SC-9): `SET EX` in
/// `sched_lock.lua`. True when taken.
pub async fn lock_acquire<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    value: &str,
    ttl_secs: u64,
) -> RedisResult<bool> {
    let n: i64 = scripts()
        .sched_lock
        .key(key)
        .arg("acquire")
        .arg(value)
        .arg(ttl_secs.max(1))
        .invoke_async(conn)
        .await?;
    Ok(n == 1)
}

/// What a renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// The key was ours: its TTL is reset.
    Ours,
    /// Another value holds the key.
    Other,
    /// There is no key (it expired, or Redis restarted without it).
    Gone,
}

/// Renews the lock if it is still ours (compare-and-expire).
pub async fn lock_renew<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    value: &str,
    ttl_secs: u64,
) -> RedisResult<Renewed> {
    let n: i64 = scripts()
        .sched_lock
        .key(key)
        .arg("renew")
        .arg(value)
        .arg(ttl_secs.max(1))
        .invoke_async(conn)
        .await?;
    Ok(match n {
        1 => Renewed::Ours,
        0 => Renewed::Other,
        _ => Renewed::Gone,
    })
}

/// Releases the lock if it is ours (compare-and-delete). True when deleted.
pub async fn lock_release<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    value: &str,
) -> RedisResult<bool> {
    let n: i64 = scripts()
        .sched_lock
        .key(key)
        .arg("release")
        .arg(value)
        .arg(0)
        .invoke_async(conn)
        .await?;
    Ok(n == 1)
}
