//! The HTTP listener (issue 23): `/metrics` ([`super::http`]) and the web page ([`crate::web`])
//! over hyper's HTTP/1.1 server, with the limits that keep one client from taking it:
//!
//! - at most [`MAX_CONNECTIONS`] connections; when full, a new connection closes the oldest one
//!   whose request is not all in yet (its head, or the body its head announced; else the
//!   oldest one), so a client holding or reopening idle sockets, or heads whose bodies never
//!   come, cannot keep `/metrics` from its scraper, and the master's file descriptors stay
//!   bounded;
//! - a request's head must arrive within [`HEAD_TIMEOUT`] of the connection (hyper's header
//!   read timeout), its body within [`BODY_TIMEOUT`] of the head, at most [`MAX_HEAD`] and
//!   [`MAX_BODY`] bytes; a connection lives at most [`CONNECTION_TIMEOUT`];
//! - one request per connection (`Connection: close`), as before;
//! - a request whose `Host` the listener does not answer for (see [`crate::config::hosts`])
//!   gets 421 with no data, one without a `Host` (HTTP/1.1) or with a garbled one 400; a
//!   request other than GET/HEAD whose `Origin` is not such a host gets 403 (a cross-site
//!   POST to the token-guarded actions).
//!
//! Every route, the admin token and the bodies are [`crate::web::handle`]'s, unchanged.

use super::http::{read_redis, render, SharedSource};
use crate::config::hosts::{self, HostPort};
use crate::config::Config;
use crate::metrics::Aggregate;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// As in [`super::http`]: the listener's log lines keep their target.
const LOG_TARGET: &str = "locketd::metrics::http";

/// Most connections held at once; one more closes the oldest idle one.
pub const MAX_CONNECTIONS: usize = 128;

/// A request's head must be in within this long of the connection.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(3);

/// A request's body must be in within this long of its head.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest life of a connection (its one request, read, answered and written).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest request head (hyper answers 431 past it).
pub const MAX_HEAD: usize = 16 * 1024;

/// Longest request body (the page's actions send a small JSON object).
pub const MAX_BODY: usize = 64 * 1024;

/// The open connections by accept order (oldest first).
#[derive(Default)]
struct Pool {
    next: u64,
    open: BTreeMap<u64, Held>,
}

/// One open connection as the pool sees it.
struct Held {
    /// Set once its request is in, head and body: it is being answered. A connection whose
    /// head is in but whose body is still awaited is not busy: a client that sends heads and
    /// holds back their bodies must not make the scraper's fresh connection the only one the
    /// pool can close.
    busy: Arc<AtomicBool>,
    /// Closes it.
    cut: CancellationToken,
}

impl Pool {
    /// Takes in a new connection; when full, first closes the oldest one still waiting for its
    /// request (head or body), else the oldest one.
    fn admit(&mut self) -> (u64, Arc<AtomicBool>, CancellationToken) {
        if self.open.len() >= MAX_CONNECTIONS {
            let victim = self
                .open
                .iter()
                .find(|(_, h)| !h.busy.load(Ordering::Relaxed))
                .or_else(|| self.open.iter().next())
                .map(|(id, h)| (*id, h.busy.load(Ordering::Relaxed)));
            if let Some((id, busy)) = victim {
                if let Some(h) = self.open.remove(&id) {
                    h.cut.cancel();
                }
                debug!(target: LOG_TARGET, busy, "http: listener full, closed its oldest connection");
            }
        }
        let id = self.next;
        self.next += 1;
        let (busy, cut) = (Arc::new(AtomicBool::new(false)), CancellationToken::new());
        self.open.insert(
            id,
            Held {
                busy: busy.clone(),
                cut: cut.clone(),
            },
        );
        (id, busy, cut)
    }
}

fn lock(pool: &Mutex<Pool>) -> std::sync::MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes a connection out of the pool when its task ends, however it ends.
struct Leave {
    pool: Arc<Mutex<Pool>>,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        lock(&self.pool).open.remove(&self.id);
    }
}

/// What a connection's requests are answered with.
struct Ctx {
    aggregate: Arc<Mutex<Aggregate>>,
    source: SharedSource,
    minutes: Arc<crate::web::minutes::Minutes>,
    peer: SocketAddr,
    /// The address the client reached (on a listener bound to 0.0.0.0, the interface's).
    local: SocketAddr,
    hostname: Arc<str>,
    busy: Arc<AtomicBool>,
}

/// Binds `addr` (so a bad address fails at start) and serves `/metrics`, the web page and its
/// API until the task is dropped. Each scrape merges `aggregate` and reads Redis as `source`
/// says at that moment.
pub async fn serve(
    addr: &str,
    aggregate: Arc<Mutex<Aggregate>>,
    source: SharedSource,
    minutes: Arc<crate::web::minutes::Minutes>,
) -> std::io::Result<(tokio::task::JoinHandle<()>, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let bound: SocketAddr = listener.local_addr()?;
    info!(target: LOG_TARGET, addr = %bound, "serving metrics on /metrics");
    info!(target: LOG_TARGET, addr = %bound, "serving the web page on / and its API on /api/");
    let hostname: Arc<str> = crate::host::hostname().to_ascii_lowercase().into();
    let pool = Arc::new(Mutex::new(Pool::default()));
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .keep_alive(false)
        .max_buf_size(MAX_HEAD)
        // Header names on the wire as before (`Content-Type`), for clients that match them
        // by case.
        .title_case_headers(true);
    let task = tokio::spawn(async move {
        // The web page's processed and failed per minute: Resque's totals, read every 10 s
        // (each read its own short task, so a slow Redis never holds up accepting).
        let mut sample = tokio::time::interval(crate::web::minutes::EVERY);
        sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = sample.tick() => {
                    let (src, minutes) = (
                        source.read().unwrap_or_else(|p| p.into_inner()).clone(),
                        minutes.clone(),
                    );
                    tokio::spawn(async move {
                        minutes.sample(&mut src.conn.clone(), &src.config).await;
                    });
                    continue;
                }
            };
            let (sock, peer) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    warn!(target: LOG_TARGET, error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (id, busy, cut) = lock(&pool).admit();
            let leave = Leave {
                pool: pool.clone(),
                id,
            };
            let ctx = Arc::new(Ctx {
                aggregate: aggregate.clone(),
                source: source.clone(),
                minutes: minutes.clone(),
                peer,
                local: sock.local_addr().unwrap_or(bound),
                hostname: hostname.clone(),
                busy,
            });
            tokio::spawn(connection(sock, http1.clone(), ctx, cut, leave));
        }
    });
    Ok((task, bound))
}

/// Serves one connection until it is done, past [`CONNECTION_TIMEOUT`], or cut by the pool.
async fn connection(
    sock: TcpStream,
    http1: hyper::server::conn::http1::Builder,
    ctx: Arc<Ctx>,
    cut: CancellationToken,
    _leave: Leave,
) {
    let service = hyper::service::service_fn(move |req| {
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(answer(req, &ctx).await) }
    });
    let conn = http1.serve_connection(TokioIo::new(sock), service);
    tokio::select! {
        _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn) => {}
        () = cut.cancelled() => {}
    }
}

type Answer = Response<Full<Bytes>>;

/// Answers one request: the `Host` and `Origin` checks, the body, then `/metrics` or the web.
async fn answer(req: Request<Incoming>, ctx: &Ctx) -> Answer {
    let src = ctx.source.read().unwrap_or_else(|p| p.into_inner()).clone();
    if let Err(refused) = check_host(&req, ctx, &src.config) {
        return *refused;
    }
    let (parts, body) = req.into_parts();
    let (method, path) = (parts.method.as_str(), parts.uri.path());
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(refused) => return *refused,
    };
    // Busy only now: while its body was awaited, the pool could close it like any idle one.
    ctx.busy.store(true, Ordering::Relaxed);
    if path == "/metrics" {
        if parts.method != Method::GET && parts.method != Method::HEAD {
            return respond("405", "text/plain", "GET only\n".into(), false);
        }
        let snap = ctx
            .aggregate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .merged();
        let redis = read_redis(&mut src.conn.clone(), &src.config).await;
        return respond(
            "200",
            "text/plain; version=0.0.4; charset=utf-8",
            render(snap, redis),
            false,
        );
    }
    let header = |name: header::HeaderName| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let req = crate::web::Request {
        method,
        path,
        query: parts.uri.query(),
        authorization: header(header::AUTHORIZATION),
        body: &body,
        peer: Some(ctx.peer),
    };
    let r = crate::web::handle(&req, &mut src.conn.clone(), &src.config, &ctx.minutes).await;
    respond(r.status, r.content_type, r.body, true)
}

/// 400 without a `Host` (HTTP/1.1; a 1.0 client may send none, and no browser is one) or
/// with a garbled one, or with two; 421 for a host the listener does not answer for (in the
/// `Host` or an absolute request target); 403 for a request other than GET/HEAD whose
/// `Origin` is not such a host. All with a short text and no data.
fn check_host(req: &Request<Incoming>, ctx: &Ctx, config: &Config) -> Result<(), Box<Answer>> {
    let allowed = hosts::parse_list(&config.http_allowed_hosts);
    let ok = |h: &HostPort| h.is_allowed(ctx.local.ip(), Some(&ctx.hostname), &allowed);
    let bad = |why: &str| {
        debug!(target: LOG_TARGET, peer = %ctx.peer, why, "http: request refused");
        Box::new(respond(
            "400",
            "text/plain; charset=utf-8",
            format!("{why}\n"),
            true,
        ))
    };
    let mut given = req.headers().get_all(header::HOST).iter();
    let host = given.next();
    if given.next().is_some() {
        return Err(bad("more than one Host header"));
    }
    let mut names = Vec::with_capacity(2);
    if let Some(h) = host {
        names.push(h.to_str().unwrap_or("\u{0}").trim());
    }
    if let Some(a) = req.uri().authority() {
        names.push(a.as_str());
    }
    if names.is_empty() && req.version() != Version::HTTP_10 {
        return Err(bad("a Host header is required"));
    }
    for name in names {
        let Ok(h) = HostPort::parse(name) else {
            return Err(bad("the Host is not a host name or address"));
        };
        if !ok(&h) {
            debug!(target: LOG_TARGET, peer = %ctx.peer, host = name,
                   "http: request for another host refused (421)");
            return Err(Box::new(respond(
                "421",
                "text/plain; charset=utf-8",
                "misdirected request: this listener answers only for its own address, \
                 localhost and the names of http_allowed_hosts\n"
                    .into(),
                true,
            )));
        }
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        if let Some(origin) = req.headers().get(header::ORIGIN) {
            let from = origin.to_str().ok().and_then(HostPort::from_origin);
            if !from.is_some_and(|h| ok(&h)) {
                warn!(target: LOG_TARGET, peer = %ctx.peer, path = req.uri().path(),
                      origin = %String::from_utf8_lossy(origin.as_bytes()),
                      "web: action refused: cross-site request");
                return Err(Box::new(json_error(
                    "403",
                    "cross-site request refused: its Origin is not a host this listener answers for",
                )));
            }
        }
    }
    Ok(())
}

/// A JSON error like the web API's.
fn json_error(status: &str, message: &str) -> Answer {
    let body = format!("{}\n", serde_json::json!({ "error": message }));
    respond(status, "application/json", body, true)
}

/// The body, at most [`MAX_BODY`] bytes within [`BODY_TIMEOUT`]: 413 past the size (at once
/// when `Content-Length` says so), 408 past the time, 400 when it breaks off.
async fn read_body(body: Incoming) -> Result<Bytes, Box<Answer>> {
    let too_large = || Box::new(respond("413", "text/plain", "too large\n".into(), false));
    if body.size_hint().lower() > MAX_BODY as u64 {
        return Err(too_large());
    }
    match tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(_)) => Err(Box::new(respond(
            "400",
            "text/plain",
            "the body broke off\n".into(),
            false,
        ))),
        Err(_) => Err(Box::new(respond(
            "408",
            "text/plain",
            "the body did not arrive in time\n".into(),
            false,
        ))),
    }
}

/// An answer with `status` (`"200 OK"` or just `"200"`), its type, and the web page's
/// security headers when `secure`.
fn respond(status: &str, content_type: &'static str, body: String, secure: bool) -> Answer {
    let code = status
        .get(..3)
        .and_then(|c| c.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if secure {
        for line in crate::web::SECURITY_HEADERS.split("\r\n") {
            if let Some((k, v)) = line.split_once(": ") {
                if let (Ok(k), Ok(v)) = (
                    HeaderName::from_bytes(k.as_bytes()),
                    HeaderValue::from_str(v),
                ) {
                    h.insert(k, v);
                }
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_pool_closes_its_oldest_idle_connection_first() {
        let mut pool = Pool::default();
        let mut held: Vec<_> = (0..MAX_CONNECTIONS).map(|_| pool.admit()).collect();
        // The two oldest are being answered.
        held[0].1.store(true, Ordering::Relaxed);
        held[1].1.store(true, Ordering::Relaxed);
        let (new, _, _) = pool.admit();
        assert_eq!(pool.open.len(), MAX_CONNECTIONS);
        assert!(held[2].2.is_cancelled(), "the oldest idle one is closed");
        assert!(
            !held[0].2.is_cancelled() && !held[1].2.is_cancelled() && !held[3].2.is_cancelled()
        );
        assert!(pool.open.contains_key(&new));
        // All busy: the oldest goes.
        for h in &held {
            h.1.store(true, Ordering::Relaxed);
        }
        for (id, h) in &pool.open {
            if *id == new {
                h.busy.store(true, Ordering::Relaxed);
            }
        }
        pool.admit();
        assert!(held[0].2.is_cancelled());
        assert_eq!(pool.open.len(), MAX_CONNECTIONS);
        held.clear();
    }

    #[test]
    fn answers_carry_their_status_and_the_security_headers() {
        let r = respond("421 Misdirected Request", "text/plain", "x".into(), true);
        assert_eq!(r.status(), StatusCode::MISDIRECTED_REQUEST);
        assert_eq!(r.headers()["x-frame-options"], "DENY");
        assert!(r.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("frame-ancestors 'none'"));
        let r = respond("200 OK", "text/plain", String::new(), false);
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().get("x-frame-options").is_none());
    }
}
