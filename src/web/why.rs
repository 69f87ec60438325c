//! `locketd why` on the web: `GET /api/why?rid=RID` or `?queue=Q&class=C&args=[...]` (the
//! JSON of `locketd why --json`), and `GET /why?...` (the same as a page of its own: the job,
//! where it is, and each reason with its owner and when it can change).

use super::escape::{html, push_html};
use super::Response;
use crate::admin::why::{explain, text, Place, Target, WhyError};
use crate::config::Config;
use redis::aio::ConnectionLike;
use serde_json::json;
use std::fmt::Write as _;

/// `%XX` and `+` of a query component, decoded (bytes that are not UTF-8 are replaced).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of `name` in a query string.
fn param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

/// The job a query names: `rid`, or `queue`, `class` and `args` (a JSON array, default `[]`).
pub fn target(query: Option<&str>) -> Result<Target, String> {
    let q = query.unwrap_or("");
    if let Some(rid) = param(q, "rid").filter(|r| !r.is_empty()) {
        return Ok(Target::Rid(rid));
    }
    let (Some(queue), Some(class)) = (param(q, "queue"), param(q, "class")) else {
        return Err("name the job: ?rid=RID, or ?queue=Q&class=C&args=[JSON,...]".into());
    };
    if queue.is_empty() {
        return Err("a queue name cannot be empty".into());
    }
    let args_text = param(q, "args").unwrap_or_else(|| "[]".into());
    let raw: Vec<Box<serde_json::value::RawValue>> = serde_json::from_str(&args_text)
        .map_err(|e| format!("args must be a JSON array ({e}): {args_text}"))?;
    Ok(Target::Payload {
        queue,
        class,
        args: raw.iter().map(|r| r.get().to_string()).collect(),
    })
}

/// `GET /api/why` and `GET /why`.
pub async fn handle<C: ConnectionLike + Send>(
    query: Option<&str>,
    page: bool,
    conn: &mut C,
    config: &Config,
) -> Response {
    let target = match target(query) {
        Ok(t) => t,
        Err(e) => return Response::error("400 Bad Request", e),
    };
    match explain(conn, config, &target).await {
        Ok(why) if page => {
            Response::new("200 OK", "text/html; charset=utf-8", render(&why, config))
        }
        Ok(why) => {
            let status = if matches!(why.place, Place::NotFound { .. }) {
                "404 Not Found"
            } else {
                "200 OK"
            };
            Response::json(status, &serde_json::to_value(&why).unwrap_or_default())
        }
        Err(WhyError::BadInput(e)) => Response::error("400 Bad Request", e),
        Err(WhyError::Redis(e)) => Response::json(
            "503 Service Unavailable",
            &json!({"error": format!("redis: {}", crate::ops::unreadable::error_text(&e))}),
        ),
    }
}

/// The job view: the same lines as the CLI's text, each escaped.
pub fn render(why: &crate::admin::why::Why, config: &Config) -> String {
    let mut out = String::with_capacity(4096);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>locketd · why</title><link rel=\"stylesheet\" href=\"/assets/page.css\"></head>\n<body><header><h1>locketd · why</h1><p class=\"where\">namespace ");
    push_html(&mut out, &config.namespace);
    out.push_str(" · <a href=\"/\">back to the page</a></p></header>\n<main><section id=\"why\">");
    if let Some(j) = &why.job {
        let _ = write!(
            out,
            "<h2>{} {} <span class=\"count\">queue {}{}</span></h2>",
            html(&j.class),
            html(&j.args.to_string()),
            html(&j.queue),
            j.rid
                .as_deref()
                .map_or(String::new(), |r| format!(" · rid {}", html(r)))
        );
    } else {
        out.push_str("<h2>job</h2>");
    }
    let _ = write!(
        out,
        "<p id=\"why-place\" data-state=\"{}\">{}</p>",
        html(place_state(&why.place)),
        html(&text::place_line(why))
    );
    if let Place::NotFound { searched } = &why.place {
        out.push_str("<ul>");
        for s in searched {
            let _ = write!(out, "<li>looked in {}</li>", html(s));
        }
        out.push_str("</ul>");
    }
    if !why.reasons.is_empty() {
        out.push_str("<h3>waiting because</h3><ul id=\"why-reasons\">");
        for r in &why.reasons {
            let kind = serde_json::to_value(r).unwrap_or_default()["kind"].clone();
            let lines = text::reason_lines(r, why.now_ms);
            let _ = write!(
                out,
                "<li data-kind=\"{}\">{}",
                html(kind.as_str().unwrap_or("")),
                html(lines.first().map_or("", String::as_str))
            );
            if lines.len() > 1 {
                out.push_str("<ul>");
                for l in &lines[1..] {
                    let _ = write!(out, "<li>{}</li>", html(l.trim()));
                }
                out.push_str("</ul>");
            }
            out.push_str("</li>");
        }
        out.push_str("</ul>");
    }
    for n in &why.notes {
        let _ = write!(out, "<p class=\"note\">{}</p>", html(n));
    }
    out.push_str("</section></main></body></html>\n");
    out
}

fn place_state(p: &Place) -> &'static str {
    match p {
        Place::Queued { .. } => "queued",
        Place::Delayed { .. } => "delayed",
        Place::Parked { .. } => "parked",
        Place::Reserved { .. } => "reserved",
        Place::Running { .. } => "running",
        Place::Failed { .. } => "failed",
        Place::NotFound { .. } => "not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_names_a_rid_or_a_payload() {
        assert_eq!(
            target(Some("rid=0123456789abcdef")).unwrap(),
            Target::Rid("0123456789abcdef".into())
        );
        assert_eq!(
            target(Some(
                "queue=mail&class=Mailer&args=%5B7%2C%20%22a+b%22%2C%7B%22k%22%3A1%7D%5D"
            ))
            .unwrap(),
            Target::Payload {
                queue: "mail".into(),
                class: "Mailer".into(),
                args: vec!["7".into(), "\"a b\"".into(), "{\"k\":1}".into()],
            }
        );
        assert!(target(Some("queue=mail")).is_err());
        assert!(target(Some("queue=mail&class=M&args=7")).is_err());
        assert!(target(None).is_err());
        assert_eq!(decode("%zz%4"), "%zz%4");
    }
}
