//! Redis Sentinel (issue 29 item 2, locking-semantics.md §9a): the `redis+sentinel://` URL,
//! asking the sentinels for the current primary (through the redis crate's `SentinelClient`),
//! and the one place that follows a failover: [`Failover`], shared by every clone of a
//! [`super::Manager`], with one [`Watch`] of the sentinels' messages per URL and process.
//!
//! The URL: `redis+sentinel://[[user]:password@]host1[:26379],host2[:26379]/service[/db]`. The
//! user and password are the data nodes' (the primary's); the sentinels are asked without
//! one. `rediss+sentinel://` (TLS) is refused, not guessed at.

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, ErrorKind, RedisError, RedisResult};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// The sentinels' channel that names a new primary.
const SWITCH: &str = "+switch-master";

/// The sentinels' channel that names the replica a failover is promoting, as it begins.
const PROMOTING: &str = "+failover-state-send-slaveof-noone";

/// How long after a promotion began the sentinels naming the old primary is not believed:
/// long enough for the promotion to end (`+switch-master`), short enough that a failover that
/// failed is left for the primary the sentinels still name.
const PROMOTION_BOUND: Duration = Duration::from_secs(15);

/// The port a sentinel listens on when the URL names none.
const SENTINEL_PORT: u16 = 26379;

/// How long one round of questions to the sentinels (and the role check of the primary they
/// name) may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// The least time between two rounds of questions caused by errors: a dead primary makes every
/// call fail, and one round for all of them is enough.
const MIN_INTERVAL: Duration = Duration::from_millis(250);

/// A parsed `redis+sentinel://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// The sentinels' addresses, in the URL's order.
    pub sentinels: Vec<(String, u16)>,
    /// The name the sentinels monitor the primary by (`sentinel monitor <name> ...`).
    pub service: String,
    /// The database on the primary.
    pub db: i64,
    /// The primary's ACL user.
    pub username: Option<String>,
    /// The primary's password.
    pub password: Option<String>,
}

fn bad(detail: impl Into<String>) -> RedisError {
    RedisError::from((
        ErrorKind::InvalidClientConfig,
        "bad redis+sentinel URL",
        detail.into(),
    ))
}

/// Whether `url` names its Redis through sentinels (`redis+sentinel://`, or the refused
/// `rediss+sentinel://`).
pub fn is_sentinel(url: &str) -> bool {
    let scheme = url.split("://").next().unwrap_or("");
    scheme.eq_ignore_ascii_case("redis+sentinel") || scheme.eq_ignore_ascii_case("rediss+sentinel")
}

/// `%XX` escapes decoded, as in the user-info of any Redis URL.
fn percent_decode(s: &str) -> RedisResult<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    bad("a % in the user or password is not followed by two hex digits")
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad("the user or password is not UTF-8"))
}

/// Parses a `redis+sentinel://` URL.
pub fn parse(url: &str) -> RedisResult<SentinelUrl> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    if scheme.eq_ignore_ascii_case("rediss+sentinel") {
        return Err(bad(
            "rediss+sentinel:// (TLS through sentinels) is not supported; use redis+sentinel:// \
             on a trusted network, or rediss:// to one server",
        ));
    }
    if !scheme.eq_ignore_ascii_case("redis+sentinel") {
        return Err(bad(format!("the scheme is {scheme:?}, not redis+sentinel")));
    }
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    // The user-info ends at the last `@`, so that a raw `@` or `/` in a password stays in it.
    let (creds, rest) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (username, password) = match creds {
        None => (None, None),
        Some(c) => {
            let (u, p) = match c.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => ("", Some(c)),
            };
            let u = (!u.is_empty()).then(|| percent_decode(u)).transpose()?;
            let p = p
                .filter(|p| !p.is_empty())
                .map(percent_decode)
                .transpose()?;
            (u, p)
        }
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut sentinels = Vec::new();
    for h in hosts.split(',').filter(|h| !h.is_empty()) {
        let (host, port) = if let Some(v6) = h.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| bad(format!("{h:?}: no ] after an IPv6 address")))?;
            (host, after.strip_prefix(':'))
        } else {
            match h.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (h, None),
            }
        };
        if host.is_empty() {
            return Err(bad(format!("{h:?}: no host")));
        }
        let port = match port {
            None => SENTINEL_PORT,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad(format!("{h:?}: {p:?} is not a port")))?,
        };
        sentinels.push((host.to_string(), port));
    }
    if sentinels.is_empty() {
        return Err(bad(
            "no sentinel host (redis+sentinel://host1:26379,host2:26379/mymaster/0)",
        ));
    }
    let mut parts = path.split('/').filter(|p| !p.is_empty());
    let service = parts
        .next()
        .ok_or_else(|| bad("no service name after the hosts (…/mymaster/0)"))?
        .to_string();
    let db = match parts.next() {
        None => 0,
        Some(d) => d
            .parse::<i64>()
            .ok()
            .filter(|d| *d >= 0)
            .ok_or_else(|| bad(format!("{d:?} is not a database number")))?,
    };
    if let Some(extra) = parts.next() {
        return Err(bad(format!("{extra:?} after the database number")));
    }
    Ok(SentinelUrl {
        sentinels,
        service,
        db,
        username,
        password,
    })
}

impl SentinelUrl {
    /// A client that asks these sentinels for the primary and connects to it with the URL's
    /// database and credentials, `TCP_NODELAY` set (as [`super::client`]'s) and `protocol`.
    fn sentinel_client(&self, protocol: redis::ProtocolVersion) -> RedisResult<SentinelClient> {
        let addrs = self
            .sentinels
            .iter()
            .map(|(h, p)| ConnectionAddr::Tcp(h.clone(), *p));
        let mut b = SentinelClientBuilder::new(addrs, &self.service, SentinelServerType::Master)?
            .set_client_to_redis_db(self.db)
            .set_client_to_redis_protocol(protocol)
            .set_client_to_redis_tcp_settings(
                redis::io::tcp::TcpSettings::default().set_nodelay(true),
            )
            .set_client_to_sentinel_tcp_settings(
                redis::io::tcp::TcpSettings::default().set_nodelay(true),
            );
        if let Some(u) = &self.username {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = &self.password {
            b = b.set_client_to_redis_password(p);
        }
        b.build()
    }
}

/// A client (RESP3 if `resp3`) for the primary this process's connections for `url` use now,
/// or, with none open, for the primary the sentinels name (checked to answer as one).
pub(super) async fn primary_client(url: &SentinelUrl, resp3: bool) -> RedisResult<redis::Client> {
    let protocol = if resp3 {
        redis::ProtocolVersion::RESP3
    } else {
        redis::ProtocolVersion::RESP2
    };
    let known = WATCHES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(u, _)| u == url)
        .and_then(|(_, w)| w.upgrade())
        .and_then(|w| w.current_info());
    if let Some(info) = known {
        // Where this process's other connections went (F-2): the sentinels may still
        // disagree, and an old primary that is up still says it is one.
        let settings = info.redis_settings().clone().set_protocol(protocol);
        return redis::Client::open(info.set_redis_settings(settings));
    }
    let mut sentinels = url.sentinel_client(protocol)?;
    ask(&mut sentinels).await
}

/// Where a sentinel URL's primary moves, for a connection that does not go through a
/// [`super::Manager`] (a blocking or tracking one): [`Moves::moved`] returns when this
/// process's connections for the URL move to another primary, and the caller connects again
/// (with [`super::primary_client`], which goes where they went).
pub struct Moves(Option<(Arc<Watch>, tokio::sync::watch::Receiver<u64>)>);

impl std::fmt::Debug for Moves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Moves(sentinel)"
        } else {
            "Moves(none)"
        })
    }
}

impl Moves {
    /// For `url`; never returns for a URL that is not a sentinel's. Needs a Tokio runtime.
    pub fn of(url: &str) -> Moves {
        let watch = is_sentinel(url)
            .then(|| parse(url).ok())
            .flatten()
            .map(|u| Watch::for_url(&u));
        Moves(watch.map(|w| {
            let rx = w.moves.subscribe();
            (w, rx)
        }))
    }

    /// Returns at the next move (not at one before this call or the last return).
    pub async fn moved(&mut self) {
        match &mut self.0 {
            Some((_, rx)) => {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }
}

async fn ask(sentinels: &mut SentinelClient) -> RedisResult<redis::Client> {
    match tokio::time::timeout(ASK_TIMEOUT, sentinels.async_get_client()).await {
        Ok(r) => r,
        Err(_) => Err(RedisError::from((
            ErrorKind::Io,
            "no sentinel named a primary in time",
        ))),
    }
}

/// `host:port` of the server `client` connects to.
pub(super) fn address(client: &redis::Client) -> String {
    client.get_connection_info().addr().to_string()
}

/// Whether `e` may mean that the primary has moved: the connection failed or was dropped, the
/// server answered as a replica (`READONLY`, `MASTERDOWN`, a blocked call's `UNBLOCKED`), or as
/// a primary cut off from its replicas (`NOREPLICAS`, with `min-replicas-to-write`).
pub(super) fn may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown
            )
        )
        || matches!(e.code(), Some("UNBLOCKED" | "NOREPLICAS"))
}

/// What all clones of one sentinel-backed [`super::Manager`] share: the connection to the
/// current primary, its generation, and the sentinels to ask again. The one place where a
/// failover is followed.
///
/// Three ways lead to another primary (locking-semantics.md F-2). A sentinel beginning to
/// promote a replica (`+failover-state-send-slaveof-noone`, from any of the sentinels, see
/// [`Watch`]) moves us to it at once, so that nothing more is written to the old primary after
/// the replica stopped copying it. A `+switch-master` moves us to the primary it names once
/// that answers as one. An error that may mean a move ([`may_have_moved`]) makes us ask the
/// sentinels, and the primary they name is taken only if the current one no longer answers as a
/// primary: during a failover the sentinels disagree for a while (each learns the new
/// configuration up to a couple of seconds after the one that did it), and the old primary, if
/// alive, still says it is one until it is turned into a replica, so a late sentinel's word must
/// not send us back to it.
pub(super) struct Failover {
    sentinels: tokio::sync::Mutex<SentinelClient>,
    cfg: ConnectionManagerConfig,
    /// The connection to the primary last found, its address, and its settings.
    current: Mutex<Current>,
    /// Bumped at every change of `current`: a clone compares it with its own before each call.
    generation: AtomicU64,
    /// A round of questions is under way (at most one at a time).
    asking: AtomicBool,
    last_asked: Mutex<Option<Instant>>,
    /// Serialises the changes of `current`.
    switching: tokio::sync::Mutex<()>,
    /// Set when a sentinel began promoting a replica and we moved to it: the primary we left,
    /// and until when the sentinels' naming it again is not believed (they name it until the
    /// promotion ends).
    left: Mutex<Option<(String, Instant)>>,
    _watch: Arc<Watch>,
}

struct Current {
    conn: ConnectionManager,
    addr: String,
    info: redis::ConnectionInfo,
}

impl Failover {
    /// Asks the sentinels for the primary and connects to it. `Err` if no sentinel answers
    /// with a primary that can be reached.
    pub(super) async fn connect(
        url: &SentinelUrl,
        cfg: ConnectionManagerConfig,
    ) -> RedisResult<Arc<Failover>> {
        let mut sentinels = url.sentinel_client(redis::ProtocolVersion::RESP2)?;
        let client = ask(&mut sentinels).await?;
        let addr = address(&client);
        let info = client.get_connection_info().clone();
        let conn = ConnectionManager::new_with_config(client, cfg.clone()).await?;
        let watch = Watch::for_url(url);
        let failover = Arc::new(Failover {
            sentinels: tokio::sync::Mutex::new(sentinels),
            cfg,
            current: Mutex::new(Current { conn, addr, info }),
            generation: AtomicU64::new(0),
            asking: AtomicBool::new(false),
            last_asked: Mutex::new(None),
            switching: tokio::sync::Mutex::new(()),
            left: Mutex::new(None),
            _watch: Arc::clone(&watch),
        });
        let mut all = watch.failovers.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|f| f.strong_count() > 0);
        all.push(Arc::downgrade(&failover));
        drop(all);
        Ok(failover)
    }

    /// The connection to the current primary, its generation, and its address.
    pub(super) fn current(&self) -> (ConnectionManager, u64, String) {
        let cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (
            cur.conn.clone(),
            self.generation.load(Ordering::Acquire),
            cur.addr.clone(),
        )
    }

    /// The generation of the current connection.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Asks the sentinels again in the background, unless a round is under way or one started
    /// less than [`MIN_INTERVAL`] ago; the calls that follow go to the primary it finds.
    pub(super) fn recheck(self: &Arc<Self>, why: &str) {
        {
            let mut last = self.last_asked.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
                return;
            }
            if self.asking.swap(true, Ordering::AcqRel) {
                return;
            }
            *last = Some(Instant::now());
        }
        debug!(target: super::LOG_TARGET, why, "asking the sentinels for the redis primary");
        let this = Arc::clone(self);
        tokio::spawn(async move {
            this.ask_again().await;
            this.asking.store(false, Ordering::Release);
        });
    }

    async fn ask_again(&self) {
        let client = {
            let mut sentinels = self.sentinels.lock().await;
            match ask(&mut sentinels).await {
                Ok(c) => c,
                Err(e) => {
                    debug!(target: super::LOG_TARGET, error = %e, "no primary from the sentinels yet");
                    return;
                }
            }
        };
        let _one = self.switching.lock().await;
        let (mut conn, _, old) = self.current();
        let named = address(&client);
        let left = self.left.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some((left, until)) = left {
            if named == left && Instant::now() < until {
                return;
            }
        }
        if named == old || is_primary(&mut conn).await {
            return;
        }
        self.switch(client, true, "the sentinels name another")
            .await;
    }

    /// A sentinel named `host:port` in a `+switch-master` (`promoted` false: go there once it
    /// answers as a primary) or as the replica it is promoting (`promoted` true: go there at
    /// once, so that no write lands on the old primary after the replica stopped copying it;
    /// until the promotion ends, writes are refused with READONLY, an outage that callers wait
    /// out).
    fn switched(self: &Arc<Self>, host: String, port: u16, promoting: bool) {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let _one = this.switching.lock().await;
            let info = {
                let cur = this.current.lock().unwrap_or_else(|e| e.into_inner());
                cur.info.clone().set_addr(ConnectionAddr::Tcp(host, port))
            };
            let Ok(client) = redis::Client::open(info) else {
                return;
            };
            let old = this.current().2;
            if address(&client) == old {
                return;
            }
            if promoting {
                *this.left.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((old, Instant::now() + PROMOTION_BOUND));
                this.switch(client, false, "+failover-state-send-slaveof-noone")
                    .await;
            } else {
                this.switch(client, true, "+switch-master").await;
            }
        });
    }

    /// Connects to `client`'s server and, if it answers as a primary (or `check` is false),
    /// makes it the current one.
    async fn switch(&self, client: redis::Client, check: bool, why: &str) {
        let addr = address(&client);
        let info = client.get_connection_info().clone();
        let mut conn = match ConnectionManager::new_with_config(client, self.cfg.clone()).await {
            Ok(conn) => conn,
            Err(e) => {
                debug!(target: super::LOG_TARGET, error = %e, primary = %addr, "cannot connect to the new primary yet");
                return;
            }
        };
        if check && !is_primary(&mut conn).await {
            debug!(target: super::LOG_TARGET, primary = %addr, "the new primary does not answer as one yet");
            return;
        }
        let old = {
            let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
            let old = std::mem::replace(&mut cur.addr, addr.clone());
            cur.conn = conn;
            cur.info = info;
            old
        };
        self.generation.fetch_add(1, Ordering::AcqRel);
        self._watch.moves.send_modify(|n| *n += 1);
        warn!(target: super::LOG_TARGET, from = %old, to = %addr, why, "redis primary changed (sentinel failover)");
    }
}

/// Whether the server behind `conn` answers `ROLE` as a primary, within a second.
async fn is_primary(conn: &mut ConnectionManager) -> bool {
    let cmd = redis::cmd("ROLE");
    let role = cmd.query_async::<Vec<redis::Value>>(conn);
    match tokio::time::timeout(Duration::from_secs(1), role).await {
        Ok(Ok(v)) => matches!(v.first(), Some(redis::Value::BulkString(b)) if b == b"master"),
        _ => false,
    }
}

/// One process's subscriptions to `+switch-master`, one per sentinel of a URL, shared by the
/// [`Failover`]s of that URL: every message for the URL's service is passed to each of them.
/// Held by the failovers; when the last one is dropped, the subscriptions end.
pub(super) struct Watch {
    failovers: Mutex<Vec<Weak<Failover>>>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Counts the moves of this process's connections for the URL ([`Moves`]).
    moves: tokio::sync::watch::Sender<u64>,
}

/// The process's watches, by URL.
static WATCHES: Mutex<Vec<(SentinelUrl, Weak<Watch>)>> = Mutex::new(Vec::new());

impl Watch {
    fn for_url(url: &SentinelUrl) -> Arc<Watch> {
        let mut all = WATCHES.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(w) = all
            .iter()
            .find(|(u, _)| u == url)
            .and_then(|(_, w)| w.upgrade())
        {
            return w;
        }
        let watch = Arc::new(Watch {
            failovers: Mutex::new(Vec::new()),
            tasks: Mutex::new(Vec::new()),
            moves: tokio::sync::watch::channel(0).0,
        });
        let tasks = url
            .sentinels
            .iter()
            .map(|(host, port)| {
                let sentinel = ConnectionAddr::Tcp(host.clone(), *port);
                tokio::spawn(subscribe(
                    sentinel,
                    url.service.clone(),
                    Arc::downgrade(&watch),
                ))
                .abort_handle()
            })
            .collect();
        *watch.tasks.lock().unwrap_or_else(|e| e.into_inner()) = tasks;
        all.push((url.clone(), Arc::downgrade(&watch)));
        watch
    }

    /// The settings of the primary this process's connections for the URL use now, if any
    /// is open.
    fn current_info(&self) -> Option<redis::ConnectionInfo> {
        let failovers = self.failovers.lock().unwrap_or_else(|e| e.into_inner());
        let f = failovers.iter().find_map(Weak::upgrade)?;
        let cur = f.current.lock().unwrap_or_else(|e| e.into_inner());
        Some(cur.info.clone())
    }

    fn switched(&self, host: &str, port: u16, promoting: bool) {
        let failovers = self.failovers.lock().unwrap_or_else(|e| e.into_inner());
        for f in failovers.iter().filter_map(Weak::upgrade) {
            f.switched(host.to_string(), port, promoting);
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            t.abort();
        }
    }
}

/// Listens on one sentinel, for as long as `watch` lives (connecting again a second after a
/// failure), to `+switch-master` (`<service> <old ip> <old port> <new ip> <new port>`) and to
/// `+failover-state-send-slaveof-noone` (`slave <name> <ip> <port> @ <service> <ip> <port>`,
/// sent by the sentinel that leads a failover as it makes the replica stop copying).
async fn subscribe(sentinel: ConnectionAddr, service: String, watch: Weak<Watch>) {
    use futures::StreamExt;
    loop {
        let pubsub = match redis::Client::open(sentinel.clone()) {
            Ok(c) => tokio::time::timeout(ASK_TIMEOUT, c.get_async_pubsub()).await,
            Err(_) => return,
        };
        if let Ok(Ok(mut pubsub)) = pubsub {
            if pubsub.subscribe(&[SWITCH, PROMOTING][..]).await.is_ok() {
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    let text: String = msg.get_payload().unwrap_or_default();
                    let words: Vec<&str> = text.split(' ').collect();
                    let target = match (msg.get_channel_name(), &words[..]) {
                        (SWITCH, [name, _, _, host, port]) => Some((*name, *host, *port, false)),
                        (PROMOTING, ["slave", _, host, port, "@", name, _, _]) => {
                            Some((*name, *host, *port, true))
                        }
                        _ => None,
                    };
                    if let Some((name, host, port, promoting)) = target {
                        if let (true, Ok(port)) = (name == service, port.parse::<u16>()) {
                            match watch.upgrade() {
                                Some(w) => w.switched(host, port, promoting),
                                None => return,
                            }
                        }
                    }
                }
            }
        }
        if watch.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_service_db_and_password() {
        let u = parse("redis+sentinel://:s%40cret@h1:26379,h2:26380,h3/mymaster/2").unwrap();
        assert_eq!(
            u.sentinels,
            vec![
                ("h1".to_string(), 26379),
                ("h2".to_string(), 26380),
                ("h3".to_string(), 26379)
            ]
        );
        assert_eq!(u.service, "mymaster");
        assert_eq!(u.db, 2);
        assert_eq!(u.username, None);
        assert_eq!(u.password.as_deref(), Some("s@cret"));
        let u = parse("redis+sentinel://app:pw@[::1]:5000/svc").unwrap();
        assert_eq!(u.sentinels, vec![("::1".to_string(), 5000)]);
        assert_eq!(
            (u.username.as_deref(), u.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        assert_eq!(u.db, 0);
        // A raw `@` and `/` in a password: the user-info ends at the last `@`.
        let u = parse("redis+sentinel://:a/b@c@h1/svc/1").unwrap();
        assert_eq!(u.password.as_deref(), Some("a/b@c"));
        assert_eq!(u.sentinels, vec![("h1".to_string(), 26379)]);
    }

    #[test]
    fn refuses_what_it_cannot_use() {
        for url in [
            "redis+sentinel://h1,h2",
            "redis+sentinel://h1:26379/",
            "redis+sentinel:///mymaster/0",
            "redis+sentinel://h1:x/mymaster",
            "redis+sentinel://h1/mymaster/zero",
            "redis+sentinel://h1/mymaster/0/extra",
            "rediss+sentinel://h1/mymaster/0",
            "redis+sentinel://:%zz@h1/mymaster",
        ] {
            let e = parse(url).expect_err(url);
            assert_eq!(e.kind(), ErrorKind::InvalidClientConfig, "{url}");
        }
        assert!(parse("rediss+sentinel://h/m")
            .unwrap_err()
            .to_string()
            .contains("not supported"));
        assert!(is_sentinel("redis+sentinel://h/m"));
        assert!(!is_sentinel("redis://h/0"));
    }

    #[test]
    fn moves_are_told_from_other_errors() {
        let readonly =
            redis::parse_redis_value(b"-READONLY You can't write against a read only replica.\r\n")
                .and_then(redis::Value::extract_error)
                .unwrap_err();
        assert!(may_have_moved(&readonly));
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(may_have_moved(&io));
        let wrongtype = redis::parse_redis_value(b"-WRONGTYPE Operation against a key\r\n")
            .and_then(redis::Value::extract_error)
            .unwrap_err();
        assert!(!may_have_moved(&wrongtype));
        let noreplicas =
            redis::parse_redis_value(b"-NOREPLICAS Not enough good replicas to write.\r\n")
                .and_then(redis::Value::extract_error)
                .unwrap_err();
        assert!(may_have_moved(&noreplicas));
    }
}
