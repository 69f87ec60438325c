//! `locketd failed`: list, show, retry, remove and clear Resque failure records, exactly as
//! resque-web and `Resque::Failure` do (resque-protocol.md §6).
//!
//! Indexes are Resque's: position in the list, 0 = oldest (records are `RPUSH`ed). `list` shows
//! the newest first. Nothing here reorders or trims the list beyond what Resque's own tools do:
//!
//! - retry `i`: add `retried_at` to the record in place (`LSET i`), then `SADD queues q` and
//!   `RPUSH queue:q {"class":…,"args":…}` (Resque's `Job.create`, no hooks);
//! - remove `i`: `LSET i <sentinel>` then `LREM 1 <sentinel>` (Resque uses `""` as sentinel; here
//!   both steps run in one script with a unique sentinel, so no other `""` element can be hit);
//! - clear: `DEL`.
//!
//! Each retry and remove is one Lua script that first checks the element at `i` is still the
//! record that was read, so a concurrent remove elsewhere never makes it touch the wrong record.
//!
//! With `failure_backend = "redis_multi_queue"` the records live in `<q>_failed` lists named in
//! `failed_queues`; `--failed-queue Q` picks one list, and `list` without it shows them all.

mod cli;

pub use cli::{render, run_cli, FailedAction, FailedArgs};

use crate::config::Config;
use crate::resque::failure::FailureBackend;
use crate::resque::keys::Keys;
use crate::resque::time;
use redis::aio::ConnectionLike;
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use std::fmt;
use std::fmt::Write as _;
use std::time::SystemTime;

/// One failure list: its key, its display name and how its `retried_at` is written.
#[derive(Debug, Clone)]
pub struct FailedList {
    /// Full key, e.g. `resque:failed` or `resque:low_failed`.
    pub key: String,
    /// Name without the namespace, e.g. `failed`, `low_failed`.
    pub name: String,
    /// RedisMultiQueue writes `retried_at` without the zone.
    pub multi_queue: bool,
}

impl FailedList {
    /// The `failed` list of the `redis` backend.
    pub fn main(keys: &Keys) -> FailedList {
        FailedList {
            key: keys.failed(),
            name: "failed".into(),
            multi_queue: false,
        }
    }

    /// The `<queue>_failed` list of the `redis_multi_queue` backend.
    pub fn for_queue(keys: &Keys, queue: &str) -> FailedList {
        FailedList {
            key: keys.queue_failed(queue),
            name: format!("{queue}_failed"),
            multi_queue: true,
        }
    }

    fn retried_at(&self, now: SystemTime) -> String {
        let s = time::failed_at(now);
        if self.multi_queue {
            s.trim_end_matches(" UTC").to_string()
        } else {
            s
        }
    }
}

/// A JSON object read with its keys in their original order and every value verbatim.
#[derive(Debug, Clone)]
pub struct Ordered(pub Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Ordered, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Box<RawValue>>()? {
                    v.push((k, val));
                }
                Ok(Ordered(v))
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for Ordered {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl Ordered {
    fn get(&self, key: &str) -> Option<&RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| &**v)
    }

    fn str(&self, key: &str) -> Option<String> {
        self.get(key)
            .and_then(|v| serde_json::from_str::<String>(v.get()).ok())
    }

    /// Sets `key` in place, or appends it (as Ruby's Hash#[]= does).
    fn set(&mut self, key: &str, value: Box<RawValue>) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key.to_string(), value)),
        }
    }
}

/// A failure record, as `list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Resque's index (0 = oldest).
    pub index: u64,
    /// The list it is in.
    pub list: String,
    /// `failed_at`.
    pub failed_at: Option<String>,
    /// `queue`.
    pub queue: Option<String>,
    /// `payload.class`.
    pub class: Option<String>,
    /// `exception`.
    pub exception: Option<String>,
    /// `error`.
    pub error: Option<String>,
    /// `worker`.
    pub worker: Option<String>,
    /// `retried_at`, when retried.
    pub retried_at: Option<String>,
}

fn summary(list: &FailedList, index: u64, text: &str) -> Summary {
    let rec: Option<Ordered> = serde_json::from_str(text).ok();
    let s = |k: &str| rec.as_ref().and_then(|r| r.str(k));
    let class = rec.as_ref().and_then(|r| {
        let p: serde_json::Value = serde_json::from_str(r.get("payload")?.get()).ok()?;
        p.get("class")?.as_str().map(str::to_string)
    });
    Summary {
        index,
        list: list.name.clone(),
        failed_at: s("failed_at"),
        queue: s("queue"),
        class,
        exception: s("exception"),
        error: if rec.is_none() {
            Some(format!("(not a JSON object: {})", clip(text, 60)))
        } else {
            s("error")
        },
        worker: s("worker"),
        retried_at: s("retried_at"),
    }
}

fn clip(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        let mut t: String = one_line.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// Why a command could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum FailedError {
    /// Redis said no.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// No record at that index.
    #[error("no failure at index {index} in {list} (it holds {len})")]
    NoSuchIndex {
        /// The index asked for.
        index: u64,
        /// The list.
        list: String,
        /// Its length.
        len: u64,
    },
    /// The record cannot be requeued (Resque would fail the same way).
    #[error("failure {index} cannot be retried: {why}")]
    NotRetryable {
        /// The index.
        index: u64,
        /// What is missing.
        why: String,
    },
    /// The element at the index changed while we worked on it.
    #[error("failure {0} changed while it was being handled (someone else edited the list); nothing done, try again")]
    Changed(u64),
}

/// Records `start..end` of the list, as bytes: a record another client wrote need not be
/// UTF-8, and must not break the command reading it.
async fn records<C: ConnectionLike + Send>(
    conn: &mut C,
    list: &FailedList,
    start: u64,
    end: u64,
) -> redis::RedisResult<Vec<Vec<u8>>> {
    redis::cmd("LRANGE")
        .arg(&list.key)
        .arg(start)
        .arg(end - 1)
        .query_async(conn)
        .await
}

/// Newest first, at most `limit` records (0 = all).
pub async fn list<C: ConnectionLike + Send>(
    conn: &mut C,
    list: &FailedList,
    limit: u64,
) -> Result<(u64, Vec<Summary>), FailedError> {
    let len: u64 = redis::cmd("LLEN").arg(&list.key).query_async(conn).await?;
    let want = if limit == 0 { len } else { limit.min(len) };
    let mut out = Vec::with_capacity(want as usize);
    let mut end = len; // exclusive
    while (out.len() as u64) < want && end > 0 {
        let start = end.saturating_sub(200);
        let items = records(conn, list, start, end).await?;
        for (i, raw) in items.iter().enumerate().rev() {
            if out.len() as u64 >= want {
                break;
            }
            out.push(summary(
                list,
                start + i as u64,
                &String::from_utf8_lossy(raw),
            ));
        }
        end = start;
    }
    Ok((len, out))
}

/// The record at `index`, verbatim (its bytes: it need not be UTF-8).
pub async fn show<C: ConnectionLike + Send>(
    conn: &mut C,
    list: &FailedList,
    index: u64,
) -> Result<Vec<u8>, FailedError> {
    // Redis takes indexes up to i64::MAX; a larger one names no record either.
    let Ok(at) = i64::try_from(index) else {
        let len: u64 = redis::cmd("LLEN").arg(&list.key).query_async(conn).await?;
        return Err(FailedError::NoSuchIndex {
            index,
            list: list.name.clone(),
            len,
        });
    };
    let text: Option<Vec<u8>> = redis::cmd("LINDEX")
        .arg(&list.key)
        .arg(at)
        .query_async(conn)
        .await?;
    match text {
        Some(t) => Ok(t),
        None => {
            let len: u64 = redis::cmd("LLEN").arg(&list.key).query_async(conn).await?;
            Err(FailedError::NoSuchIndex {
                index,
                list: list.name.clone(),
                len,
            })
        }
    }
}

/// LSET `i` to the new record, `SADD queues q`, `RPUSH queue:q job`, only if element `i` is still
/// the record read. Returns 1 when done, 0 when the element changed.
const RETRY_LUA: &str = r"
if redis.call('LINDEX', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('LSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[5])
return 1
";

/// Resque's remove (LSET to a sentinel, LREM it), only if element `i` is still the record read.
const REMOVE_LUA: &str = r"
if redis.call('LINDEX', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('LSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('LREM', KEYS[1], 1, ARGV[3])
return 1
";

/// What one retry pushed.
#[derive(Debug, Clone, Serialize)]
pub struct Retried {
    /// Index of the record.
    pub index: u64,
    /// Queue it went back to.
    pub queue: String,
    /// Its class.
    pub class: String,
    /// The payload pushed.
    pub payload: String,
}

/// Resque's `Failure::Redis.requeue(index)`: marks `retried_at` and pushes `{class,args}` back.
pub async fn retry_one<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    list: &FailedList,
    index: u64,
) -> Result<Retried, FailedError> {
    let raw = show(conn, list, index).await?;
    let text = String::from_utf8(raw).map_err(|_| FailedError::NotRetryable {
        index,
        why: "the record is not UTF-8".to_string(),
    })?;
    retry_text(conn, keys, list, index, &text).await
}

async fn retry_text<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    list: &FailedList,
    index: u64,
    text: &str,
) -> Result<Retried, FailedError> {
    let bad = |why: &str| FailedError::NotRetryable {
        index,
        why: why.to_string(),
    };
    let mut rec: Ordered =
        serde_json::from_str(text).map_err(|_| bad("the record is not a JSON object"))?;
    let queue = rec
        .str("queue")
        .filter(|q| !q.is_empty())
        .ok_or_else(|| bad("its queue is not a string"))?;
    let payload: Ordered = rec
        .get("payload")
        .and_then(|p| serde_json::from_str(p.get()).ok())
        .ok_or_else(|| bad("its payload is not an object"))?;
    let class = payload
        .str("class")
        .ok_or_else(|| bad("payload.class is not a string"))?;
    // Ruby requeues with `*item['payload']['args']`: no args (or null) is no arguments.
    let no_args = RawValue::from_string("[]".to_string()).map_err(|e| bad(&e.to_string()))?;
    let args: &RawValue = match payload.get("args") {
        None => &no_args,
        Some(a) if a.get().trim() == "null" => &no_args,
        Some(a) if a.get().trim_start().starts_with('[') => a,
        Some(_) => return Err(bad("payload.args is not an array")),
    };
    #[derive(Serialize)]
    struct Job<'a> {
        class: &'a str,
        args: &'a RawValue,
    }
    let job = serde_json::to_string(&Job {
        class: &class,
        args,
    })
    .map_err(|e| bad(&e.to_string()))?;
    let stamp = serde_json::value::to_raw_value(&list.retried_at(SystemTime::now()))
        .map_err(|e| bad(&e.to_string()))?;
    rec.set("retried_at", stamp);
    let new = serde_json::to_string(&rec).map_err(|e| bad(&e.to_string()))?;
    let done: i64 = redis::Script::new(RETRY_LUA)
        .key(&list.key)
        .key(keys.queues())
        .key(keys.queue(&queue))
        .arg(index)
        .arg(text)
        .arg(&new)
        .arg(&queue)
        .arg(&job)
        .invoke_async(conn)
        .await?;
    if done != 1 {
        return Err(FailedError::Changed(index));
    }
    Ok(Retried {
        index,
        queue,
        class,
        payload: job,
    })
}

/// Which records a bulk retry takes.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this `payload.class`.
    pub class: Option<String>,
    /// Only this `queue`.
    pub queue: Option<String>,
}

/// Retries every record matching `filter` (all of them when it is empty), oldest first as
/// resque-web's "Retry all" does. Records that cannot be retried are reported, not touched.
pub async fn retry_matching<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    list: &FailedList,
    filter: &Filter,
) -> Result<(Vec<Retried>, Vec<FailedError>), FailedError> {
    let len: u64 = redis::cmd("LLEN").arg(&list.key).query_async(conn).await?;
    let mut done = Vec::new();
    let mut skipped = Vec::new();
    let mut start = 0u64;
    while start < len {
        let end = (start + 200).min(len);
        let items = records(conn, list, start, end).await?;
        for (i, raw) in items.iter().enumerate() {
            let index = start + i as u64;
            let s = summary(list, index, &String::from_utf8_lossy(raw));
            if filter
                .class
                .as_ref()
                .is_some_and(|c| s.class.as_ref() != Some(c))
                || filter
                    .queue
                    .as_ref()
                    .is_some_and(|q| s.queue.as_ref() != Some(q))
            {
                continue;
            }
            let Ok(text) = std::str::from_utf8(raw) else {
                skipped.push(FailedError::NotRetryable {
                    index,
                    why: "the record is not UTF-8".to_string(),
                });
                continue;
            };
            match retry_text(conn, keys, list, index, text).await {
                Ok(r) => done.push(r),
                Err(FailedError::Redis(e)) => return Err(FailedError::Redis(e)),
                Err(e) => skipped.push(e),
            }
        }
        start = end;
    }
    Ok((done, skipped))
}

/// Resque's `Failure::Redis.remove(index)`.
pub async fn remove<C: ConnectionLike + Send>(
    conn: &mut C,
    list: &FailedList,
    index: u64,
) -> Result<Vec<u8>, FailedError> {
    let text = show(conn, list, index).await?;
    let sentinel = format!("locketd-remove-{}", crate::store::random_hex(16));
    let done: i64 = redis::Script::new(REMOVE_LUA)
        .key(&list.key)
        .arg(index)
        .arg(&text)
        .arg(&sentinel)
        .invoke_async(conn)
        .await?;
    if done != 1 {
        return Err(FailedError::Changed(index));
    }
    Ok(text)
}

/// Resque's `Failure::Redis.clear`: `DEL`. Returns how many records there were.
pub async fn clear<C: ConnectionLike + Send>(
    conn: &mut C,
    list: &FailedList,
) -> Result<u64, FailedError> {
    let (len, _): (u64, i64) = redis::pipe()
        .atomic()
        .llen(&list.key)
        .del(&list.key)
        .query_async(conn)
        .await?;
    Ok(len)
}

/// The lists the configured backend uses: `failed`, or every `<q>_failed` in `failed_queues`
/// (one of them when `queue` is given).
pub async fn lists<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    queue: Option<&str>,
) -> redis::RedisResult<Vec<FailedList>> {
    let keys = Keys::new(&config.namespace);
    match (config.failure_backend, queue) {
        (FailureBackend::Redis, _) => Ok(vec![FailedList::main(&keys)]),
        (FailureBackend::RedisMultiQueue, Some(q)) => Ok(vec![FailedList::for_queue(&keys, q)]),
        (FailureBackend::RedisMultiQueue, None) => {
            let mut names: Vec<String> = redis::cmd("SMEMBERS")
                .arg(keys.failed_queues())
                .query_async(conn)
                .await?;
            names.sort();
            Ok(names
                .iter()
                .map(|n| FailedList {
                    key: format!("{}:{n}", keys.ns()),
                    name: n.clone(),
                    multi_queue: true,
                })
                .collect())
        }
    }
}

/// How many failure records the configured backend's lists hold in all (the first `max_lists`
/// lists of `failed_queues` with `redis_multi_queue`), read in one pipeline: what `status` and
/// `/metrics` report.
pub async fn listed_total<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    max_lists: usize,
) -> redis::RedisResult<u64> {
    Ok(listed_counts(conn, config, max_lists).await?.0)
}

/// [`listed_total`], with the lists it could not count: `(total, [(key, Redis's reply)])`.
pub async fn listed_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    config: &Config,
    max_lists: usize,
) -> redis::RedisResult<(u64, Vec<(String, String)>)> {
    let all = lists(conn, config, None).await?;
    if all.is_empty() {
        return Ok((0, Vec::new()));
    }
    let mut pipe = redis::pipe();
    for l in all.iter().take(max_lists) {
        pipe.llen(&l.key);
    }
    // A failure list another tool made a string or a hash answers WRONGTYPE: it counts as
    // empty rather than failing `status` and `/metrics`, which must show the parked slot it
    // causes (E-3).
    let lens: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
    let mut total = 0;
    let mut refused = Vec::new();
    for (l, v) in all.iter().zip(lens) {
        match crate::ops::unreadable::reply::<u64>(v) {
            Ok(n) => total += n,
            Err(why) => refused.push((l.key.clone(), why)),
        }
    }
    Ok((total, refused))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_keeps_key_order_and_values_verbatim() {
        let text = r#"{"failed_at":"x","payload":{"class":"C","args":[1.0, 123456789012345678901]},"queue":"q"}"#;
        let mut o: Ordered = serde_json::from_str(text).unwrap();
        o.set(
            "retried_at",
            serde_json::value::to_raw_value("2026/11/21 12:00:00 UTC").unwrap(),
        );
        assert_eq!(
            serde_json::to_string(&o).unwrap(),
            r#"{"failed_at":"x","payload":{"class":"C","args":[1.0, 123456789012345678901]},"queue":"q","retried_at":"2026/11/21 12:00:00 UTC"}"#
        );
        o.set("failed_at", serde_json::value::to_raw_value("y").unwrap());
        assert!(serde_json::to_string(&o)
            .unwrap()
            .starts_with(r#"{"failed_at":"y","#));
    }

    #[test]
    fn multi_queue_retried_at_has_no_zone() {
        let k = Keys::new("resque");
        let now = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1795263504);
        assert!(FailedList::main(&k).retried_at(now).ends_with(" UTC"));
        assert!(!FailedList::for_queue(&k, "q")
            .retried_at(now)
            .contains("UTC"));
    }
}
