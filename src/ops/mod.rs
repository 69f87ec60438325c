//! Operator commands that only read (or, for `failed`, edit as Resque's own tools do) Redis:
//! `locketd status` and `locketd failed`. Neither needs a running daemon.

pub mod failed;
pub mod handler_procs;
pub mod status;
pub mod unreadable;

use crate::config::Config;
use crate::conn::Manager;
use crate::error::Result;
use std::time::Duration;

/// Connects for a one-shot command: waits at most 5 s (or `redis_connect_timeout`, if shorter).
pub async fn connect(config: &Config) -> Result<Manager> {
    let wait = config
        .redis_connect_timeout
        .get()
        .min(Duration::from_secs(5));
    crate::conn::connect(&config.redis, wait).await
}

/// [`connect`] for the CLI: prints why on failure and gives the exit status: 69
/// (EX_UNAVAILABLE) for a Redis that did not answer, 78 (EX_CONFIG) for one that refused us (a
/// wrong password or TLS setting), as the daemon does.
pub(crate) async fn connect_or_report(
    config: &Config,
) -> std::result::Result<Manager, std::process::ExitCode> {
    match connect(config).await {
        Ok(c) => Ok(c),
        Err(e) => {
            let code = match &e {
                // The redis error once (the alternate chain repeats its io cause).
                crate::Error::Unreachable {
                    source, refused, ..
                } => {
                    eprintln!("locketd: {e}: {source}");
                    if *refused {
                        78
                    } else {
                        69
                    }
                }
                _ => {
                    eprintln!("locketd: {:#}", anyhow::Error::from(e));
                    69
                }
            };
            Err(std::process::ExitCode::from(code))
        }
    }
}

/// The value parser of every operator command's queue name: an empty name would address
/// `<ns>:queue:` or `<ns>:pause:queue:`, which no worker reads, so it is refused up front.
pub fn queue_name(s: &str) -> std::result::Result<String, String> {
    if s.is_empty() {
        return Err("a queue name cannot be empty".into());
    }
    Ok(s.to_string())
}

/// `LLEN` and the lock counter of each queue, in one round trip. A queue key of the wrong type
/// (another tool's) reads as empty instead of failing the whole read; a counter that is not a
/// number reads as none.
pub async fn queue_lengths<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    keys: &crate::resque::keys::Keys,
    names: &[String],
) -> redis::RedisResult<Vec<(u64, Option<u64>)>> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for q in names {
        pipe.llen(keys.queue(q)).get(keys.counter(q));
    }
    let flat: Vec<redis::Value> = pipe.ignore_errors().query_async(conn).await?;
    Ok(flat
        .chunks(2)
        .map(|c| {
            let len = redis::from_redis_value::<u64>(c[0].clone()).unwrap_or(0);
            let counter = c
                .get(1)
                .and_then(|v| redis::from_redis_value::<Option<String>>(v.clone()).ok())
                .flatten()
                .and_then(|t| t.trim().parse::<u64>().ok());
            (len, counter)
        })
        .collect())
}
