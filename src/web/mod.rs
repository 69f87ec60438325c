//! The web page (issue 16): what resque-web cannot show (locks, counters, holds, delayed jobs,
//! schedules, live), served by the master on its HTTP listener beside `/metrics`.
//!
//! - `GET /`: one server-rendered page ([`page`]); a small script (`/assets/page.js`, embedded
//!   in the binary) refreshes its sections from `/api/page` every 2 s. Without scripts the page
//!   is the same, just not refreshed.
//! - `GET /api/status` (`locketd status --json`), `/api/<section>` for each of
//!   [`data::SECTIONS`], and `/api/page` (all of them at once, with the status line's totals
//!   as `summary` instead of the whole, unbounded status).
//! - `POST /api/locks/release`, `/api/counters/reset`, `/api/failures/retry`,
//!   `/api/failures/remove`, `/api/schedules/run`, `/api/queues/pause`, `/api/queues/resume`
//!   `/api/jobs/cancel`: off unless `http_admin_token` is set, then only with
//!   `Authorization: Bearer <token>`; each logged at warn with what it changed.
//!
//! Every name from Redis reaches the HTML through [`escape::html`] (the script sets only
//! `textContent`), and the page is served with a content security policy that runs no inline
//! script.

pub mod data;
pub mod escape;
pub mod handler_cell;
pub mod minutes;
pub mod page;
pub mod why;

use crate::config::Config;
use crate::ops::failed;
use crate::resque::keys::Keys;
use crate::store::{self, AdminRelease};
use redis::aio::ConnectionLike;
use serde_json::{json, Value};
use std::net::SocketAddr;
use tracing::warn;

/// The script of the page.
pub const PAGE_JS: &str = include_str!("page.js");
/// The style sheet of the page.
pub const PAGE_CSS: &str = include_str!("page.css");

/// Log lines of the page's actions and refusals.
const LOG_TARGET: &str = "locketd::web";

/// One HTTP request, as the listener read it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `GET`, `POST`, ...
    pub method: &'a str,
    /// The path, without the query.
    pub path: &'a str,
    /// The query (after `?`), if any.
    pub query: Option<&'a str>,
    /// The `Authorization` header's value.
    pub authorization: Option<&'a str>,
    /// The body (`POST`).
    pub body: &'a [u8],
    /// Who sent it.
    pub peer: Option<SocketAddr>,
}

/// One HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    /// `200 OK`, ...
    pub status: &'static str,
    /// The content type.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl Response {
    fn new(status: &'static str, content_type: &'static str, body: String) -> Response {
        Response {
            status,
            content_type,
            body,
        }
    }

    fn json(status: &'static str, v: &Value) -> Response {
        let mut body = serde_json::to_string(v).unwrap_or_default();
        body.push('\n');
        Response::new(status, "application/json", body)
    }

    fn error(status: &'static str, message: impl Into<String>) -> Response {
        Response::json(status, &json!({"error": message.into()}))
    }
}

/// The headers every answer of the page and its API carries: no inline script, no framing,
/// no content sniffing, nothing cached.
pub const SECURITY_HEADERS: &str = "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\nX-Content-Type-Options: nosniff\r\nX-Frame-Options: DENY\r\nReferrer-Policy: no-referrer\r\nCache-Control: no-store\r\n";

/// Answers one request for the page, its assets or its API (anything but `/metrics`).
pub async fn handle<C: ConnectionLike + Send>(
    req: &Request<'_>,
    conn: &mut C,
    config: &Config,
    minutes: &minutes::Minutes,
) -> Response {
    let get = matches!(req.method, "GET" | "HEAD");
    match (req.path, get) {
        ("/", true) => match data::page(conn, config, minutes).await {
            Ok(d) => Response::new(
                "200 OK",
                "text/html; charset=utf-8",
                page::render(&d, config),
            ),
            Err(e) => unavailable(&e),
        },
        ("/assets/page.js", true) => Response::new(
            "200 OK",
            "text/javascript; charset=utf-8",
            PAGE_JS.to_string(),
        ),
        ("/assets/page.css", true) => {
            Response::new("200 OK", "text/css; charset=utf-8", PAGE_CSS.to_string())
        }
        ("/api/status", true) => match crate::ops::status::collect(conn, config).await {
            Ok(s) => Response::json("200 OK", &serde_json::to_value(&s).unwrap_or_default()),
            Err(e) => unavailable(&e),
        },
        ("/api/why" | "/why", true) => {
            why::handle(req.query, req.path == "/why", conn, config).await
        }
        ("/api/page", true) => match data::page(conn, config, minutes).await {
            Ok(d) => Response::json(
                "200 OK",
                &json!({"summary": page::summary(&d.status), "sections": d.sections,
                        "actions": config.http_admin_token.is_some()}),
            ),
            Err(e) => unavailable(&e),
        },
        (p, _) if ACTIONS.contains(&p) => {
            if req.method != "POST" {
                return Response::error("405 Method Not Allowed", "POST only");
            }
            if let Err(refused) = authorize(req, config) {
                return refused;
            }
            act(req, conn, config).await
        }
        (p, true) if p.starts_with("/api/") => {
            let name = &p["/api/".len()..];
            match data::section(conn, config, minutes, name).await {
                Ok(Some(v)) => Response::json("200 OK", &v),
                Ok(None) => Response::error(
                    "404 Not Found",
                    format!(
                        "no section {name:?}: try /api/status, /api/page or /api/{}",
                        data::SECTIONS.join(", /api/")
                    ),
                ),
                Err(e) => unavailable(&e),
            }
        }
        (_, false) => Response::error("405 Method Not Allowed", "GET only"),
        _ => Response::new(
            "404 Not Found",
            "text/plain; charset=utf-8",
            "try / (the web page), /api/status or /metrics\n".into(),
        ),
    }
}

/// 503 for Redis not answering, with its reason (a key of another type does not get here:
/// its section names it, see [`data::page`]).
fn unavailable(e: &crate::Error) -> Response {
    let why = match e {
        crate::Error::Redis(r) => crate::ops::unreadable::error_text(r),
        other => other.to_string(),
    };
    Response::error("503 Service Unavailable", format!("redis: {why}"))
}

/// The action endpoints.
pub const ACTIONS: &[&str] = &[
    "/api/locks/release",
    "/api/counters/reset",
    "/api/failures/retry",
    "/api/failures/remove",
    "/api/schedules/run",
    "/api/queues/pause",
    "/api/queues/resume",
    "/api/jobs/cancel",
];

/// Equal without telling by its time where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The credentials of an `Authorization: Bearer <token>` header. The scheme's name is
/// case-insensitive (RFC 9110 §11.1: `bearer` and `BEARER` are `Bearer`), and one or more
/// spaces follow it.
fn bearer(header: &str) -> Option<&str> {
    let (scheme, rest) = header.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim_start_matches(' '))
}

/// Actions are off without `http_admin_token` (403), need `Authorization: Bearer <token>`
/// (401 without it, 403 with a wrong one; both logged at warn).
fn authorize(req: &Request<'_>, config: &Config) -> Result<(), Response> {
    let Some(token) = &config.http_admin_token else {
        return Err(Response::error(
            "403 Forbidden",
            "actions are off: set http_admin_token in the config to turn them on",
        ));
    };
    let peer = req.peer.map(|p| p.to_string()).unwrap_or_default();
    let Some(given) = req.authorization.and_then(bearer) else {
        warn!(target: LOG_TARGET, peer = %peer, path = req.path, "web: action refused: no token");
        return Err(Response::error(
            "401 Unauthorized",
            "send the admin token as Authorization: Bearer <http_admin_token>",
        ));
    };
    if !same(given.trim().as_bytes(), token.0.trim().as_bytes()) {
        warn!(target: LOG_TARGET, peer = %peer, path = req.path, "web: action refused: wrong token");
        return Err(Response::error("403 Forbidden", "wrong admin token"));
    }
    Ok(())
}

/// Runs an authorized action with the functions the CLI uses.
async fn act<C: ConnectionLike + Send>(
    req: &Request<'_>,
    conn: &mut C,
    config: &Config,
) -> Response {
    let body: Value = match serde_json::from_slice(req.body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return Response::error("400 Bad Request", "the body must be a JSON object"),
    };
    let peer = req.peer.map(|p| p.to_string()).unwrap_or_default();
    let keys = Keys::new(&config.namespace);
    let s = |k: &str| body[k].as_str().map(str::to_string);
    match req.path {
        "/api/locks/release" => {
            let Some(lock_id) = s("lock_id") else {
                return Response::error("400 Bad Request", "lock_id missing");
            };
            let force = body["force"] == true;
            let mut token = s("token").unwrap_or_default();
            if !force && token.is_empty() {
                return Response::error("400 Bad Request", "token missing (or force: true)");
            }
            // The page shows a token's first 8 characters (O-1): a unique prefix names one.
            if !force {
                token = match crate::admin::holder_token(conn, &keys, &lock_id, &token).await {
                    Ok(Ok(full)) => full,
                    Ok(Err(ambiguous)) => return Response::error("409 Conflict", ambiguous),
                    Err(e) => {
                        return Response::error("503 Service Unavailable", format!("redis: {e}"))
                    }
                };
            }
            let what = if force {
                AdminRelease::LockForce(&lock_id)
            } else {
                AdminRelease::LockToken(&lock_id, &token)
            };
            match store::admin_release(conn, &keys, &what).await {
                Ok(n) => {
                    warn!(target: LOG_TARGET, peer = %peer, lock_id = %lock_id,
                          token = %crate::admin::token_prefix(&token), force, released = n,
                          "web: lock holder released by an operator");
                    Response::json("200 OK", &json!({"lock_id": lock_id, "released": n}))
                }
                Err(e) => Response::error("503 Service Unavailable", format!("redis: {e}")),
            }
        }
        "/api/schedules/run" => {
            let Some(name) = s("name") else {
                return Response::error("400 Bad Request", "name missing");
            };
            match crate::scheduler::ops::run_now(conn, config, &name).await {
                Ok(true) => {
                    warn!(target: LOG_TARGET, peer = %peer, schedule = %name,
                          "web: schedule run now by an operator (one job enqueued)");
                    Response::json("200 OK", &json!({"schedule": name, "enqueued": 1}))
                }
                Ok(false) => Response::error("404 Not Found", format!("no schedule {name:?}")),
                Err(e) => Response::error("503 Service Unavailable", format!("{e}")),
            }
        }
        "/api/counters/reset" => {
            let Some(queue) = s("queue") else {
                return Response::error("400 Bad Request", "queue missing");
            };
            match crate::admin::reset_counter(conn, &keys, &queue).await {
                Ok(was) => {
                    warn!(target: LOG_TARGET, peer = %peer, queue = %queue, was_set = was,
                          "web: lock counter reset by an operator");
                    Response::json("200 OK", &json!({"queue": queue, "was_set": was}))
                }
                Err(e) => Response::error("503 Service Unavailable", format!("redis: {e}")),
            }
        }
        "/api/queues/pause" | "/api/queues/resume" => {
            let Some(queue) = s("queue") else {
                return Response::error("400 Bad Request", "queue missing");
            };
            let on = req.path.ends_with("pause");
            let qs = [queue.clone()];
            match store::set_paused(conn, &keys, Some(&qs), on).await {
                Ok(n) => {
                    warn!(target: LOG_TARGET, peer = %peer, queue = %queue, changed = n,
                          "web: queue {} by an operator", if on { "paused" } else { "resumed" });
                    Response::json(
                        "200 OK",
                        &json!({"queue": queue, "paused": on, "changed": n}),
                    )
                }
                Err(e) if crate::conn::is_refusal(&e) => {
                    Response::error("409 Conflict", format!("redis: {e}"))
                }
                Err(e) => Response::error("503 Service Unavailable", format!("redis: {e}")),
            }
        }
        "/api/jobs/cancel" => {
            let Some(target) = s("target").or_else(|| s("rid")) else {
                return Response::error("400 Bad Request", "target (a rid or a worker id) missing");
            };
            let requeue = body["requeue"] == true;
            let by = format!("the web page, from {peer}");
            // a job a worker holds gets a request (the answer says so, and in which
            // state: not started, or running); a parked or delayed job is cancelled at once.
            match crate::admin::cancel_job(
                conn,
                &keys,
                &target,
                requeue,
                &by,
                config.failure_backend,
            )
            .await
            {
                Ok(crate::admin::Cancelled::Requested(r)) => {
                    warn!(target: LOG_TARGET, peer = %peer, rid = %r.rid, worker = %r.worker, state = %r.state, requeue,
                          "web: cancel requested by an operator");
                    Response::json(
                        "202 Accepted",
                        &json!({"rid": r.rid, "worker": r.worker, "state": r.state,
                                "requested": true, "cancelled": false}),
                    )
                }
                Ok(crate::admin::Cancelled::Done { rid, was }) => {
                    warn!(target: LOG_TARGET, peer = %peer, rid = %rid, was = %was, requeue,
                          "web: job cancelled by an operator");
                    Response::json(
                        "200 OK",
                        &json!({"rid": rid, "state": was, "requested": true, "cancelled": true}),
                    )
                }
                Ok(crate::admin::Cancelled::NotRunning) => Response::error(
                    "404 Not Found",
                    format!(
                        "no job {target:?} is reserved, running, parked or delayed; nothing done"
                    ),
                ),
                Err(e) if crate::conn::is_refusal(&e) => {
                    Response::error("409 Conflict", format!("redis: {e}"))
                }
                Err(e) => Response::error("503 Service Unavailable", format!("redis: {e}")),
            }
        }
        "/api/failures/retry" | "/api/failures/remove" => {
            let Some(index) = body["index"].as_u64() else {
                return Response::error("400 Bad Request", "index missing");
            };
            let name = s("list").unwrap_or_else(|| "failed".into());
            let lists = match failed::lists(conn, config, None).await {
                Ok(l) => l,
                Err(e) => return Response::error("503 Service Unavailable", format!("redis: {e}")),
            };
            let Some(list) = lists.into_iter().find(|l| l.name == name) else {
                return Response::error("404 Not Found", format!("no failure list {name:?}"));
            };
            if req.path.ends_with("retry") {
                match failed::retry_one(conn, &keys, &list, index).await {
                    Ok(r) => {
                        warn!(target: LOG_TARGET, peer = %peer, list = %list.name, index,
                              queue = %r.queue, class = %r.class,
                              "web: failure retried by an operator");
                        Response::json("200 OK", &json!({"retried": r}))
                    }
                    Err(e) => failed_error(&e),
                }
            } else {
                match failed::remove(conn, &list, index).await {
                    Ok(rec) => {
                        warn!(target: LOG_TARGET, peer = %peer, list = %list.name, index,
                              record = %String::from_utf8_lossy(&rec),
                              "web: failure removed by an operator");
                        Response::json("200 OK", &json!({"removed": index, "list": list.name}))
                    }
                    Err(e) => failed_error(&e),
                }
            }
        }
        _ => Response::error("404 Not Found", "no such action"),
    }
}

fn failed_error(e: &failed::FailedError) -> Response {
    let status = match e {
        failed::FailedError::Redis(_) => "503 Service Unavailable",
        failed::FailedError::NoSuchIndex { .. } => "404 Not Found",
        _ => "409 Conflict",
    };
    Response::error(status, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::same;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        use super::bearer;
        for h in ["Bearer abc", "bearer abc", "BEARER  abc", " bEaReR abc "] {
            assert_eq!(bearer(h), Some("abc"), "{h:?}");
        }
        for h in ["Basic abc", "Bearerabc", "abc", ""] {
            assert_eq!(bearer(h), None, "{h:?}");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
        assert!(!same(b"", b"a"));
    }
}
