//! The class plans in Redis (locking-semantics.md D-3a): a daemon publishes its own at start
//! and on HUP, PUSH (push.lua) reads them, and `check-config` compares a file with them.
//!
//! One hash, `<ns>:locket:plans`, field = class (src/config/published.rs). Daemons of one
//! namespace are expected to agree; when they do not (a rolling deploy, a forgotten host), the
//! last one to publish wins the field, and says at warn which plans it replaced, so the
//! difference is seen where it starts rather than in a job that waited for a hold nobody placed.
//! Fields of classes a daemon does not configure are left as they are: another daemon may run
//! them. `check-config` lists those too.

use super::fcall::Mode;
use crate::config::plans::Plans;
use crate::config::published::{digest_of, publish_all};
use crate::resque::keys::Keys;
use redis::aio::ConnectionLike;
use redis::RedisResult;
use std::collections::HashMap;

/// How the published plan of one class differs from a configuration's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// Both have the class, with different settings (digests).
    Differs {
        /// The class (`*`, or `""` for the `[locket]` defaults).
        class: String,
        /// The digest in Redis.
        published: String,
        /// The configuration's digest.
        ours: String,
    },
    /// The configuration has the class; Redis has no plan for it.
    NotPublished {
        /// The class.
        class: String,
    },
    /// Redis has a plan for a class this configuration does not name.
    OnlyPublished {
        /// The class.
        class: String,
    },
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = |c: &str| {
            if c.is_empty() {
                "the [locket] defaults".to_string()
            } else {
                format!("class {c:?}")
            }
        };
        match self {
            Difference::Differs {
                class,
                published,
                ours,
            } => write!(
                f,
                "{}: the plan published in Redis (digest {}) differs from this configuration's \
                 ({}): pushes place the published plan's enqueue-time holds",
                name(class),
                &published[..published.len().min(12)],
                &ours[..ours.len().min(12)]
            ),
            Difference::NotPublished { class } => {
                write!(f, "{}: no plan published in Redis yet", name(class))
            }
            Difference::OnlyPublished { class } => write!(
                f,
                "{}: a plan is published in Redis (by another daemon) but this configuration has \
                 no table for it",
                name(class)
            ),
        }
    }
}

/// The digests published now, field → digest (`""` for a field that is not a plan).
async fn published<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> RedisResult<HashMap<String, String>> {
    let all: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.plans())
        .query_async(conn)
        .await?;
    Ok(all
        .into_iter()
        .map(|(k, v)| {
            let d = digest_of(&v).unwrap_or_default();
            (k, d)
        })
        .collect())
}

/// Compares `plans` with what Redis holds (for `check-config` and [`publish`]).
pub async fn compare<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    plans: &Plans,
) -> RedisResult<Vec<Difference>> {
    let there = published(conn, keys).await?;
    let ours = publish_all(plans);
    let mut out = Vec::new();
    for p in &ours {
        match there.get(&p.field) {
            None => out.push(Difference::NotPublished {
                class: p.field.clone(),
            }),
            Some(d) if *d != p.digest => out.push(Difference::Differs {
                class: p.field.clone(),
                published: d.clone(),
                ours: p.digest.clone(),
            }),
            Some(_) => {}
        }
    }
    let mut extra: Vec<&String> = there
        .keys()
        .filter(|k| !ours.iter().any(|p| &p.field == *k))
        .collect();
    extra.sort();
    for class in extra {
        out.push(Difference::OnlyPublished {
            class: class.clone(),
        });
    }
    Ok(out)
}

/// Publishes every plan of `plans` (D-3a), marks in `holding_plans` those that hold at
/// enqueue and names this build's PUSH and PUSH_AT in `<ns>:locket:push` (their FCALL names
/// only where the library loads), in one atomic step, and returns the plans it replaced that
/// differed from its own (the caller logs them at warn).
pub async fn publish<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    plans: &Plans,
) -> RedisResult<Vec<Difference>> {
    let replaced: Vec<Difference> = compare(conn, keys, plans)
        .await?
        .into_iter()
        .filter(|d| matches!(d, Difference::Differs { .. }))
        .collect();
    let all = publish_all(plans);
    let mut hset = redis::cmd("HSET");
    hset.arg(keys.plans());
    for p in &all {
        hset.arg(&p.field).arg(&p.json);
    }
    let scripts = super::scripts::scripts();
    // The library loaded now, so a client's first FCALL finds it; a Redis without FUNCTION
    // (Redis 6) gets no function names: its clients go straight to EVALSHA.
    let functions = Mode::default().ensure_loaded(conn).await?;
    let mut pipe = redis::pipe();
    pipe.atomic().add_command(hset).ignore();
    // D-3a, D-3b: where clients outside locketd find PUSH and PUSH_AT (the shims under
    // clients/).
    pipe.cmd("HSET")
        .arg(keys.push_entry())
        .arg("sha1")
        .arg(scripts.push.get_hash())
        .arg("script")
        .arg(super::scripts::PUSH_SOURCE)
        .arg("sha1_at")
        .arg(scripts.push_at.get_hash())
        .arg("script_at")
        .arg(super::scripts::PUSH_AT_SOURCE)
        .ignore();
    if functions {
        pipe.cmd("HSET")
            .arg(keys.push_entry())
            .arg("function")
            .arg(scripts.library.function("push"))
            .arg("function_at")
            .arg(scripts.library.function("push_at"))
            .ignore();
    } else {
        pipe.cmd("HDEL")
            .arg(keys.push_entry())
            .arg("function")
            .arg("function_at")
            .ignore();
    }
    for p in &all {
        pipe.cmd(if p.holding { "SADD" } else { "SREM" })
            .arg(keys.holding_plans())
            .arg(&p.field)
            .ignore();
    }
    pipe.query_async::<()>(conn).await?;
    Ok(replaced)
}

/// What one PUSH did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// Whether the job was pushed.
    pub pushed: bool,
    /// The queue's length after the push.
    pub queue_length: u64,
    /// The hold names added with it (rendered in Redis).
    pub holds: Vec<String>,
}

/// PUSH (push.lua, D-3a): `payload` to the tail of `queue` with the enqueue-time holds its
/// class's published plan names, in one step, as FCALL of the library (EVALSHA without
/// FUNCTION). A payload or template the renderer refuses is an error and nothing is written.
pub(crate) async fn push<C: ConnectionLike + Send>(
    conn: &mut C,
    mode: &Mode,
    keys: &Keys,
    queue: &str,
    payload: &str,
) -> RedisResult<Pushed> {
    let reply = mode
        .call(conn, "push", |cmd| {
            cmd.arg(3)
                .arg(keys.queue(queue))
                .arg(keys.queues())
                .arg(keys.plans())
                .arg(queue)
                .arg(payload)
                .arg(keys.locket_prefix());
        })
        .await?;
    pushed_of(reply, "unexpected PUSH reply")
}

/// PUSH_AT (push_at.lua, D-3b): `item` (resque-scheduler's `{"class":…,"args":[…],"queue":…}`,
/// kept byte for byte) into the delayed queue at `ts` (Unix seconds) with the holds and
/// `unique` key its class's published plan names, placed now, in one step. The reply's length
/// is the bucket's (`delayed:<ts>`).
pub(crate) async fn push_at<C: ConnectionLike + Send>(
    conn: &mut C,
    mode: &Mode,
    keys: &Keys,
    queue: &str,
    item: &str,
    ts: i64,
) -> RedisResult<Pushed> {
    let t = ts.to_string();
    let reply = mode
        .call(conn, "push_at", |cmd| {
            cmd.arg(4)
                .arg(keys.delayed_bucket(&t))
                .arg(keys.delayed_index(item))
                .arg(keys.delayed_schedule())
                .arg(keys.plans())
                .arg(queue)
                .arg(item)
                .arg(&t)
                .arg(keys.locket_prefix());
        })
        .await?;
    pushed_of(reply, "unexpected PUSH_AT reply")
}

/// The reply of PUSH or PUSH_AT: `{pushed, length, hold...}`.
fn pushed_of(reply: redis::Value, what: &'static str) -> RedisResult<Pushed> {
    let items: Vec<String> = redis::from_redis_value(reply).map_err(|e| {
        redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, what, e.to_string()))
    })?;
    let mut it = items.into_iter();
    let pushed = it.next().is_some_and(|p| p == "1");
    let queue_length = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    let holds: Vec<String> = it.collect();
    Ok(Pushed {
        pushed,
        queue_length,
        holds,
    })
}
