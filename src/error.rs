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
    /// Redis could not be reached at start within the allowed time.
    #[error("redis at {url} did not answer within {secs}s")]
    Unreachable {
        /// The URL (password removed).
        url: String,
        /// How long we tried.
        secs: u64,
        /// The last error.
        #[source]
        source: redis::RedisError,
    },
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
