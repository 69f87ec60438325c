//! The library's error types: [`Error`], why a worker could not start or had to stop, and
//! [`ConfigError`], a bad configuration.

use crate::resque::patterns::QueueSpecError;
use std::path::PathBuf;

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
    /// wrong or missing password or a TLS setting, which retrying cannot fix).
    #[error("redis at {url}{} {}", from_why(.from.as_deref()), unreachable_why(*.refused, *.secs, .source))]
    Unreachable {
        /// The URL (password removed).
        url: String,
        /// Where the URL came from, when the caller knows ("given by --redis", "given by REDIS_URL").
        from: Option<String>,
        /// How long we tried.
        secs: u64,
        /// Refused at once rather than silent until `secs` ran out.
        refused: bool,
        /// The last error.
        #[source]
        source: redis::RedisError,
    },
}

/// A bad configuration: the message names the setting.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TOML did not parse or had an unknown key or a bad value.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file (or `<inline>`).
        path: String,
        /// toml's message, with line and key.
        message: String,
    },
    /// A value parsed but is not allowed.
    #[error("invalid setting {setting}: {message}")]
    Invalid {
        /// Dotted name, e.g. `locket.heartbeat_interval`.
        setting: String,
        /// What is wrong.
        message: String,
    },
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

fn from_why(from: Option<&str>) -> String {
    from.map(|f| format!(" ({f})")).unwrap_or_default()
}

fn unreachable_why(refused: bool, secs: u64, source: &redis::RedisError) -> String {
    if refused && source.code() == Some("NOAUTH") {
        "refused the connection: it requires a password and none was given (put it in the \
         URL, redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@... for an ACL user; \
         not retried: a missing password stays missing)"
            .to_string()
    } else if refused {
        "refused the connection (not retried: a wrong or missing password, an ACL that denies \
         it, or a TLS setting stays wrong)"
            .to_string()
    } else {
        format!("did not answer within {secs}s")
    }
}
