//! Connecting to Redis: the client (TCP_NODELAY), the first connection with its bounded wait,
//! the eviction check (S-7), `EVALSHA` with its NOSCRIPT retry (S-1), and which errors are
//! refusals rather than outages (E-3). Nothing here knows a locket key.

mod url;

pub use url::redact;

use crate::error::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, RedisResult};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::worker";

/// A client for `url` whose TCP connections set `TCP_NODELAY`, as Redis itself does: a small
/// request written while an earlier one is unacknowledged (slots, batches, the heartbeat beside
/// a job) must not wait for the ACK.
pub fn client(url: &str) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()?
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    redis::Client::open(info)
}

/// A client like [`client`]'s that speaks RESP3 (for push messages: client tracking).
pub fn client_resp3(url: &str) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info()?;
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(redis::ProtocolVersion::RESP3);
    let info = info
        .set_redis_settings(settings)
        .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    redis::Client::open(info)
}

/// Connects to Redis with reconnects, waiting up to `wait` for the first answer.
pub async fn connect(url: &str, wait: Duration) -> Result<ConnectionManager> {
    let client = client(url)?;
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(30)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(2));
    let started = Instant::now();
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut conn = ConnectionManager::new_with_config(client.clone(), cfg.clone()).await?;
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        };
        match attempt.await {
            Ok(conn) => return Ok(conn),
            // A wrong password or a bad TLS setting will not fix itself: report it at once.
            Err(e) if started.elapsed() + delay < wait && !refused_at_once(&e) => {
                warn!(target: LOG_TARGET, error = %e, "redis not answering yet, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(source) => {
                return Err(Error::Unreachable {
                    url: redact(url),
                    secs: wait.as_secs(),
                    refused: refused_at_once(&source),
                    source,
                })
            }
        }
    }
}

/// A connection error that retrying cannot fix: a wrong password, a bad TLS setting.
fn refused_at_once(e: &redis::RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::InvalidClientConfig
    )
}

/// S-7: refuse a Redis that may evict keys, unless allowed. A server that forbids CONFIG is
/// trusted.
pub async fn check_eviction(conn: &mut ConnectionManager, allow: bool) -> Result<()> {
    let reply: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    let policy = match reply {
        Ok(v) => v.get(1).cloned().unwrap_or_default(),
        Err(e) => {
            debug!(target: LOG_TARGET, error = %e, "cannot read maxmemory-policy; assuming noeviction");
            return Ok(());
        }
    };
    if policy.is_empty() || policy == "noeviction" {
        return Ok(());
    }
    if allow {
        warn!(target: LOG_TARGET, policy = %policy, "redis may evict keys; running anyway (allow_evicting_redis)");
        return Ok(());
    }
    Err(Error::EvictingRedis(policy))
}

/// `EVALSHA <script> <numkeys> ...` with the keys and arguments `fill` writes, and, when the
/// server does not know the script (a restart, SCRIPT FLUSH), one SCRIPT LOAD and a second
/// try (S-1). Building the command directly spares the per-argument buffers of a
/// `ScriptInvocation` on the job path.
pub async fn evalsha<C, T>(
    conn: &mut C,
    script: &redis::Script,
    numkeys: usize,
    fill: impl FnOnce(&mut Cmd),
) -> RedisResult<T>
where
    C: ConnectionLike + Send,
    T: redis::FromRedisValue,
{
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(numkeys);
    fill(&mut cmd);
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

/// Whether Redis refused a call in a way that sending it again cannot change (E-3): a key of
/// another type (`WRONGTYPE`, or a script's own `LOCKET_STORE` check), a full Redis (`OOM`), a
/// Lua error, a reply of an unexpected shape. Such a call is reported once and not resent in a
/// loop. Everything else (the connection, `LOADING`, `BUSY`, `READONLY`, `MASTERDOWN`,
/// `TRYAGAIN`, `MISCONF`, `NOSCRIPT` before its EVAL fallback) is an outage, retried with backoff.
pub fn is_refusal(e: &redis::RedisError) -> bool {
    match e.code() {
        None => matches!(
            e.kind(),
            redis::ErrorKind::UnexpectedReturnType | redis::ErrorKind::Parse
        ),
        Some(
            "LOADING" | "BUSY" | "READONLY" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "MISCONF"
            | "NOSCRIPT" | "MOVED" | "ASK" | "NOREPLICAS" | "NOAUTH",
        ) => false,
        Some("ERR") => !e
            .detail()
            .is_some_and(|d| d.contains("max number of clients")),
        Some(_) => true,
    }
}

/// Whether a command is refused by this server for good, so that it is not worth sending
/// again before a restart or a reload: an unknown command (BLMOVE before Redis 6.2, CLIENT
/// TRACKING before 6.0), wrong arguments, or an ACL that denies it (`NOPERM`).
pub fn unavailable_command(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or("").to_ascii_lowercase();
    match e.code() {
        Some("NOPERM") => true,
        Some("ERR") => {
            detail.contains("unknown command")
                || detail.contains("unknown subcommand")
                || detail.contains("wrong number of arguments")
        }
        _ => false,
    }
}
