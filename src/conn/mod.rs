//! Connecting to Redis: the client (TCP_NODELAY), the first connection with its bounded wait,
//! the eviction check (S-7), `EVALSHA` with its NOSCRIPT retry (S-1), and which errors are
//! refusals rather than outages (E-3, [`classify`]: the one place that decides). Nothing here
//! knows a locket key.

mod plain;
mod sentinel;
mod url;

pub use plain::Plain;

pub use sentinel::{is_sentinel, parse as parse_sentinel, Moves, SentinelUrl};
pub use url::redact;

use crate::error::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, RedisFuture, RedisResult, Value};
use std::sync::Arc;
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

/// Checks that `url` is a Redis URL locketd can connect with, without connecting.
pub fn check_url(url: &str) -> RedisResult<()> {
    if is_sentinel(url) {
        sentinel::parse(url).map(drop)
    } else {
        redis::Client::open(url).map(drop)
    }
}

/// A client for the server `url` names, RESP3 if `resp3`: for a `redis+sentinel://` URL, the
/// primary this process's [`Manager`]s for it use now, or without one the primary the sentinels
/// name now (so a caller that connects again after an error or a [`Moves`] finds the new
/// primary); else [`client`]'s or [`client_resp3`]'s.
pub async fn primary_client(url: &str, resp3: bool) -> RedisResult<redis::Client> {
    if is_sentinel(url) {
        sentinel::primary_client(&sentinel::parse(url)?, resp3).await
    } else if resp3 {
        client_resp3(url)
    } else {
        client(url)
    }
}

/// For a `redis+sentinel://` URL, the `host:port` of the primary its sentinels name now (after
/// checking that it answers as one); `None` for another URL.
pub async fn sentinel_primary(url: &str) -> Option<RedisResult<String>> {
    if !is_sentinel(url) {
        return None;
    }
    Some(
        primary_client(url, false)
            .await
            .map(|c| sentinel::address(&c)),
    )
}

/// A connection to Redis that reconnects by itself (a `ConnectionManager`; clones share it)
/// and, for a `redis+sentinel://` URL, follows the primary (locking-semantics.md F-2): to the
/// replica a sentinel begins promoting, to the primary a `+switch-master` names, or, after a
/// connection error or a `READONLY`/`MASTERDOWN`/`UNBLOCKED`/`NOREPLICAS` reply, to the one the
/// sentinels name when asked again (in the background); every clone sends its next call there.
/// The call that failed is not sent again here: its caller decides (E-3, [`classify`]: these
/// errors are outages, resent after a wait). For a plain URL it adds nothing to a call, not
/// even an allocation.
#[derive(Clone)]
pub struct Manager {
    conn: ConnectionManager,
    generation: u64,
    failover: Option<Arc<sentinel::Failover>>,
}

impl Manager {
    /// `host:port` of the primary the sentinels named last, for a `redis+sentinel://` URL.
    pub fn primary(&self) -> Option<String> {
        self.failover.as_ref().map(|f| f.current().2)
    }

    /// Takes the shared connection to the new primary if there is one.
    fn follow(&mut self) {
        if let Some(f) = &self.failover {
            if f.generation() != self.generation {
                let (conn, generation, _) = f.current();
                self.conn = conn;
                self.generation = generation;
            }
        }
    }

    fn after(&self, e: &redis::RedisError) {
        if let Some(f) = &self.failover {
            if sentinel::may_have_moved(e) {
                f.recheck("a call failed");
            }
        }
    }
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("primary", &self.primary())
            .finish_non_exhaustive()
    }
}

impl From<ConnectionManager> for Manager {
    /// A connection to one server, as [`connect`] makes for a URL that is not a sentinel's.
    fn from(conn: ConnectionManager) -> Manager {
        Manager {
            conn,
            generation: 0,
            failover: None,
        }
    }
}

impl ConnectionLike for Manager {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        if self.failover.is_none() {
            return self.conn.req_packed_command(cmd);
        }
        Box::pin(async move {
            self.follow();
            let reply = self.conn.req_packed_command(cmd).await;
            if let Err(e) = &reply {
                self.after(e);
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        if self.failover.is_none() {
            return self.conn.req_packed_commands(cmd, offset, count);
        }
        Box::pin(async move {
            self.follow();
            let reply = self.conn.req_packed_commands(cmd, offset, count).await;
            match &reply {
                Err(e) => self.after(e),
                // A pipeline's replies may hold a READONLY each (ignore_errors).
                Ok(values) => {
                    if let Some(Err(e)) = values
                        .iter()
                        .find(|v| matches!(v, Value::ServerError(_)))
                        .map(|v| v.clone().extract_error())
                    {
                        self.after(&e);
                    }
                }
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// Connects to Redis with reconnects, waiting up to `wait` for the first answer.
pub async fn connect(url: &str, wait: Duration) -> Result<Manager> {
    connect_from(url, None, wait).await
}

/// [`connect`] for the daemon's start, which knows where `url` came from (`from`: "given by
/// --redis", "given by REDIS_URL", "set by `redis` in <file>", the default). At the first attempt that
/// finds no Redis there it says so, once, with that origin and the two ways out (issue 29
/// item 5); the error it returns names the origin too.
pub async fn connect_from(url: &str, from: Option<&str>, wait: Duration) -> Result<Manager> {
    let target = if is_sentinel(url) {
        Ok(sentinel::parse(url)?)
    } else {
        Err(client(url)?)
    };
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(30)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(2));
    let started = Instant::now();
    let mut delay = Duration::from_millis(100);
    let mut hinted = false;
    loop {
        let attempt = async {
            let mut conn = match &target {
                Ok(sentinels) => {
                    let failover = sentinel::Failover::connect(sentinels, cfg.clone()).await?;
                    let (conn, generation, _) = failover.current();
                    Manager {
                        conn,
                        generation,
                        failover: Some(failover),
                    }
                }
                Err(client) => Manager::from(
                    ConnectionManager::new_with_config(client.clone(), cfg.clone()).await?,
                ),
            };
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        };
        match attempt.await {
            Ok(conn) => return Ok(conn),
            // A wrong password or a bad TLS setting will not fix itself: report it at once.
            Err(e) if started.elapsed() + delay < wait && !refused_at_once(&e) => {
                if let Some(from) = from.filter(|_| !hinted && nobody_there(&e) && target.is_ok()) {
                    hinted = true;
                    warn!(
                        target: LOG_TARGET,
                        "no sentinel of {} ({from}) names a primary that answers: start the \
                         sentinels and the primary they monitor, or point REDIS_URL or --redis \
                         at your Redis; retrying for {}s",
                        redact(url),
                        wait.as_secs()
                    );
                } else if let Some(from) = from.filter(|_| !hinted && nobody_there(&e)) {
                    hinted = true;
                    warn!(
                        target: LOG_TARGET,
                        "no redis answers at {} ({from}): start one \
                         (redis-server, or systemctl start redis-server), or point REDIS_URL \
                         or --redis at your Redis; retrying for {}s",
                        redact(url),
                        wait.as_secs()
                    );
                }
                warn!(target: LOG_TARGET, error = %e, "redis not answering yet, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(source) => {
                return Err(Error::Unreachable {
                    url: redact(url),
                    from: from.map(str::to_string),
                    secs: wait.as_secs(),
                    refused: refused_at_once(&source),
                    source,
                })
            }
        }
    }
}

/// No server at the address: refused, reset, timed out, an unknown host or socket file (not a
/// server that answered with an error, such as `LOADING`).
fn nobody_there(e: &redis::RedisError) -> bool {
    e.is_connection_refusal() || e.is_io_error() || e.is_timeout()
}

/// A connection error that retrying cannot fix: a wrong or missing password, an ACL that
/// denies the first PING, a bad TLS setting.
fn refused_at_once(e: &redis::RedisError) -> bool {
    auth_refused(e)
        || e.kind() == redis::ErrorKind::InvalidClientConfig
        || e.code() == Some("NOPERM")
}

/// Redis did not accept this client's credentials: a wrong password (the redis crate's
/// `AuthenticationFailed`, or `WRONGPASS`), or none given to a server that requires one
/// (`NOAUTH`, on the first call of a connection that sent no AUTH).
pub fn auth_refused(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// S-7: refuse a Redis that may evict keys, unless allowed. A server that forbids CONFIG is
/// trusted.
pub async fn check_eviction(conn: &mut Manager, allow: bool) -> Result<()> {
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

/// What a Redis error means for the call that got it (E-3). Every caller that decides between
/// sending a call again and giving it up asks [`classify`]: this is the one place that knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Redis cannot take the call now but may in a moment: the connection (dropped, refused,
    /// timed out), a server loading its data (`LOADING`), running a long script (`BUSY`),
    /// demoted to a replica by a failover (`READONLY`, a blocked call's `UNBLOCKED`), without
    /// its master or enough replicas (`MASTERDOWN`, `NOREPLICAS`), full (`OOM`: memory is freed
    /// by consumers and by expiring keys), unable to persist (`MISCONF`), a cluster moving or
    /// down (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`), a script unknown before its load
    /// (`NOSCRIPT`), too many clients. Sent again after a wait. A script refused for any of
    /// these has written nothing: each is raised at its first write (S-6).
    Outage,
    /// A reply that sending the same call again cannot change: a key of another type
    /// (`WRONGTYPE`, or a script's own `LOCKET_STORE` check), `ERR` and Lua errors, an ACL that
    /// denies the call (`NOPERM`). Reported once, never resent in a loop.
    Refusal,
    /// Redis may have run the call, but its reply could not be read: not RESP, a type the
    /// caller does not expect (a RESP3 reply, a script's reply of another shape), bytes no
    /// call asked for, a reply nested too deep. The connection it came on is dropped (plain.rs;
    /// the redis crate drops its own on a parse error). Nothing says the call wrote nothing, so
    /// it is handled as a call whose connection dropped before its reply came: sent again
    /// where an outage's call is, marked as a resend where the step has such a mark.
    Unknown,
}

/// Classifies `e` by the redis crate's error kind, and for the server's error codes the crate
/// has no kind for, by that code (the reply's first word), never by the message's text. The
/// one exception is `ERR max number of clients reached`, which Redis sends with no code of its
/// own.
pub fn classify(e: &redis::RedisError) -> Failure {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    match e.kind() {
        K::Server(
            S::BusyLoading
            | S::TryAgain
            | S::ClusterDown
            | S::MasterDown
            | S::ReadOnly
            | S::Moved
            | S::Ask
            | S::NoScript,
        ) => Failure::Outage,
        K::Server(S::ResponseError) => {
            if e.detail()
                .is_some_and(|d| d.starts_with("max number of clients"))
            {
                Failure::Outage
            } else {
                Failure::Refusal
            }
        }
        K::Server(_) => Failure::Refusal,
        // Credentials refused on a reconnect (a Redis restarted with another password, or
        // with one where it had none), a wrong password and a missing one alike, on the
        // manager and on the job path's own connection: an outage, waited out until an
        // operator mends one side. At the start they end the daemon at once instead
        // ([`connect_from`]).
        _ if auth_refused(e) => Failure::Outage,
        K::Extension => match e.code() {
            Some("OOM" | "BUSY" | "NOREPLICAS" | "MISCONF" | "UNBLOCKED") => Failure::Outage,
            _ => Failure::Refusal,
        },
        // Redis sent a reply this client cannot read: the call may have run (issue 37).
        K::UnexpectedReturnType | K::Parse => Failure::Unknown,
        // Refused by this client before anything was sent.
        K::RESP3NotSupported => Failure::Refusal,
        // The connection and its setup (I/O, a sentinel or a cluster node not found): Redis
        // away, not this call refused.
        _ => Failure::Outage,
    }
}

/// Whether `e` is a [`Failure::Refusal`]: reported once, not sent again in a loop.
pub fn is_refusal(e: &redis::RedisError) -> bool {
    classify(e) == Failure::Refusal
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The error Redis's reply `line` (without its leading `-`) becomes.
    fn reply(line: &str) -> redis::RedisError {
        let wire = format!("-{line}\r\n");
        match redis::parse_redis_value(wire.as_bytes()).and_then(redis::Value::extract_error) {
            Err(e) => e,
            Ok(v) => panic!("{line}: not an error: {v:?}"),
        }
    }

    // E-3, issue 23 finding 3: what waiting can change is an outage, whatever its kind in the
    // redis crate (a known kind, or a code it has none for).
    #[test]
    fn errors_that_waiting_can_change_are_outages() {
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script.",
            "READONLY You can't write against a read only replica.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "NOREPLICAS Not enough good replicas to write.",
            "MISCONF Redis is configured to save RDB snapshots, but it's unable to persist",
            "NOSCRIPT No matching script.",
            "UNBLOCKED force unblock from blocking operation, instance state changed",
            "MOVED 3999 127.0.0.1:6381",
            "ERR max number of clients reached",
        ] {
            assert_eq!(classify(&reply(line)), Failure::Outage, "{line}");
        }
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify(&io), Failure::Outage);
    }

    // E-3: what a resend cannot change is a refusal, reported once.
    #[test]
    fn errors_that_waiting_cannot_change_are_refusals() {
        for line in [
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "LOCKET_STORE fire: WRONGTYPE resque:queues holds a string, not a set; nothing was changed",
            "ERR user_script:1: Script attempted to access nonexistent global variable 'x'",
            "NOPERM this user has no permissions to run the 'fcall' command",
            "ERR unknown command 'FUNCTION'",
            "EXECABORT Transaction discarded because of previous errors.",
        ] {
            assert_eq!(classify(&reply(line)), Failure::Refusal, "{line}");
        }
    }

    // Issue 37 finding 3: a reply that cannot be read says nothing about what the call did.
    // It is neither a refusal (which would assume nothing was written) nor retried blind: it
    // takes the path of a call whose connection dropped.
    #[test]
    fn an_unreadable_reply_leaves_the_outcome_unknown() {
        let shape = redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "shape"));
        assert_eq!(classify(&shape), Failure::Unknown);
        assert!(!is_refusal(&shape));
        let garbage = redis::parse_redis_value(b"?garbage\r\n").unwrap_err();
        assert_eq!(classify(&garbage), Failure::Unknown);
        // A RESP3 reply the caller cannot convert (the crate's conversion errors are Parse).
        let map = redis::parse_redis_value(b"%1\r\n+a\r\n:1\r\n").unwrap();
        let e = redis::RedisError::from(redis::from_redis_value::<Vec<String>>(map).unwrap_err());
        assert_eq!(classify(&e), Failure::Unknown, "{e:?}");
    }

    // Issue 37 finding 5: the manager's parser (the redis crate's) has a depth bound of its
    // own; a reply nested a million deep is a parse error there too, not a stack overflow.
    #[test]
    fn the_redis_crates_parser_bounds_the_nesting_too() {
        let mut deep = b"*1\r\n".repeat(1_000_000);
        deep.extend_from_slice(b":1\r\n");
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let e = redis::parse_redis_value(&deep).unwrap_err();
                assert_eq!(classify(&e), Failure::Unknown);
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
    }

    // Issue 37 finding 9: credentials refused are a configuration error at the start (exit 78,
    // not 30 s of retries), a missing password as a wrong one; on a reconnect both are waited
    // out as an outage, on either connection (plain.rs reports a refused AUTH as the crate
    // does).
    #[test]
    fn a_missing_password_is_refused_as_a_wrong_one() {
        for line in [
            "NOAUTH Authentication required.",
            "WRONGPASS invalid username-password pair or user is disabled.",
            "NOPERM this user has no permissions to run the 'ping' command",
        ] {
            assert!(refused_at_once(&reply(line)), "{line}");
        }
        let wrong = redis::RedisError::from((redis::ErrorKind::AuthenticationFailed, "auth"));
        assert!(refused_at_once(&wrong));
        for e in [
            wrong,
            reply("NOAUTH Authentication required."),
            reply("WRONGPASS invalid username-password pair or user is disabled."),
        ] {
            assert_eq!(classify(&e), Failure::Outage, "{e}");
        }
        assert!(!refused_at_once(&reply(
            "LOADING Redis is loading the dataset in memory"
        )));
    }
}
