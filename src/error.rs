//! The top-level error type of the library.

use crate::config::ConfigError;
use crate::resque::patterns::QueueSpecError;

/// Why a worker could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Bad queue list.
    #[error("invalid queues")]
    Queues(#[from] QueueSpecError),
    /// Redis failed in a way retrying did not fix.
    #[error("redis")]
    Redis(#[from] redis::RedisError),
    /// Redis may evict keys (S-7).
    #[error("redis maxmemory-policy is {0:?}, which may evict lock keys and queued jobs; set it to noeviction or set locket.allow_evicting_redis = true")]
    EvictingRedis(String),
    /// A job could not be enqueued (bad argument JSON, a hold template that cannot render).
    #[error("cannot enqueue: {0}")]
    Enqueue(String),
    /// Redis could not be reached at start within the allowed time, or refused us at once (a
    /// wrong password or TLS setting, which retrying cannot fix).
    #[error("redis at {url} {}", unreachable_why(*.refused, *.secs))]
    Unreachable {
        /// The URL (password removed).
        url: String,
        /// How long we tried.
        secs: u64,
        /// Refused at once rather than silent until `secs` ran out.
        refused: bool,
        /// The last error.
        #[source]
        source: redis::RedisError,
    },
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

fn unreachable_why(refused: bool, secs: u64) -> String {
    if refused {
        "refused the connection (not retried: a wrong password or TLS setting stays wrong)"
            .to_string()
    } else {
        format!("did not answer within {secs}s")
    }
}
