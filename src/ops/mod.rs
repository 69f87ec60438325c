//! Operator commands that only read (or, for `failed`, edit as Resque's own tools do) Redis:
//! `locketd status` and `locketd failed`. Neither needs a running daemon.

pub mod failed;
pub mod status;

use crate::config::Config;
use crate::error::Result;
use redis::aio::ConnectionManager;
use std::time::Duration;

/// Connects for a one-shot command: waits at most 5 s (or `redis_connect_timeout`, if shorter).
pub async fn connect(config: &Config) -> Result<ConnectionManager> {
    let wait = config
        .redis_connect_timeout
        .get()
        .min(Duration::from_secs(5));
    crate::worker::connect(&config.redis, wait).await
}

/// [`connect`] for the CLI: prints why on failure, and the caller exits 69 (EX_UNAVAILABLE).
pub(crate) async fn connect_or_report(config: &Config) -> Option<ConnectionManager> {
    match connect(config).await {
        Ok(c) => Some(c),
        Err(e) => {
            match &e {
                // The redis error once (the alternate chain repeats its io cause).
                crate::Error::Unreachable { source, .. } => eprintln!("locketd: {e}: {source}"),
                _ => eprintln!("locketd: {:#}", anyhow::Error::from(e)),
            }
            None
        }
    }
}
