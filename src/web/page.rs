//! The page's HTML, rendered from the same JSON the API returns ([`super::data`]), so the
//! script's refresh (`page.js`, the same cells from the same rows) and the first render agree.
//! Every text goes through [`html`].

use super::data::{has_data, PageData, MAX_ROWS, SECTIONS, SERIES};
use super::escape::{html, push_html};
use crate::admin::human_ms;
use crate::config::Config;
use crate::resque::time;
use serde_json::Value;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

fn s(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn ms(v: &Value) -> String {
    v.as_i64().map_or("-".into(), human_ms)
}

fn secs(v: &Value) -> String {
    v.as_i64().map_or("-".into(), |s| human_ms(s * 1000))
}

/// `12:00:03.250` (UTC) for epoch ms, as `locketd limits` prints it.
fn clock(ms: u64) -> String {
    crate::admin::clock_ms(ms)
}

fn at(epoch_secs: u64) -> String {
    time::run_at(SystemTime::UNIX_EPOCH + Duration::from_secs(epoch_secs))
}

/// A section's title and column heads.
pub fn heads(name: &str) -> (&'static str, &'static [&'static str]) {
    match name {
        "queues" => (
            "Queues",
            &[
                "queue",
                "length",
                "parked",
                "lock counter",
                "state",
                "head job",
                "oldest job",
                "",
            ],
        ),
        "workers" => (
            "Workers and slots",
            &[
                "worker", "kind", "queues", "state", "class", "since", "running", "handler", "",
            ],
        ),
        "locks" => (
            "Locks",
            &[
                "lock",
                "token",
                "worker",
                "class",
                "held for",
                "time left",
                "limit",
                "fence",
                "waiting",
                "",
            ],
        ),
        "holds" => (
            "Holds",
            &["hold", "digest", "count", "time left", "blocking"],
        ),
        "rates" => (
            "Rate limits",
            &[
                "rate key",
                "limit",
                "period",
                "in window",
                "allowed now",
                "next start",
                "closed until",
                "parked",
            ],
        ),
        "delayed" => (
            "Delayed jobs",
            &["rid", "queue", "class", "waits on", "attempt", "due in"],
        ),
        "schedules" => (
            "Schedules",
            &[
                "schedule",
                "when",
                "class",
                "queue",
                "next",
                "last enqueued",
                "",
            ],
        ),
        "failures" => (
            "Failures",
            &[
                "failed at",
                "list",
                "queue",
                "class",
                "exception",
                "error",
                "",
            ],
        ),
        _ => ("Jobs per minute, last hour", &[]),
    }
}

/// An action button: its endpoint and JSON body, run by the script with the token.
fn button(label: &str, endpoint: &str, body: &Value) -> String {
    format!(
        "<button type=\"button\" class=\"act\" data-endpoint=\"{}\" data-body=\"{}\">{}</button>",
        html(endpoint),
        html(&body.to_string()),
        html(label)
    )
}

/// The cells of one row of a section (text, already escaped, or a button).
pub fn rows(name: &str, v: &Value, actions: bool) -> Vec<Vec<String>> {
    let list = v["rows"].as_array().cloned().unwrap_or_default();
    let t = |x: &Value| html(&s(x));
    match name {
        "queues" => list
            .iter()
            .map(|q| {
                let counter = q["counter"].as_u64().unwrap_or(0);
                let state = if q["paused"] == "all" {
                    "paused (every queue)".to_string()
                } else if q["paused"] == "queue" {
                    "paused".to_string()
                } else if q["skipped"] == true {
                    "skipped (every job waits on a lock)".to_string()
                } else if q["length"] == 0 {
                    "empty".to_string()
                } else if counter > 0 {
                    format!("draining ({counter} of {} wait on a lock)", s(&q["length"]))
                } else {
                    "ok".to_string()
                };
                let state = if q["configured"] == false {
                    format!("{state}; not worked here")
                } else {
                    state.to_string()
                };
                let reset = if actions && !q["counter"].is_null() {
                    button(
                        "reset counter",
                        "/api/counters/reset",
                        &serde_json::json!({"queue": q["name"]}),
                    )
                } else {
                    String::new()
                };
                // A-20: pause or resume the queue (resque-pause's key; `pause:all` is the
                // CLI's, `locketd resume --all`).
                let pause = if !actions {
                    String::new()
                } else if q["paused"] == "queue" {
                    button(
                        "resume",
                        "/api/queues/resume",
                        &serde_json::json!({"queue": q["name"]}),
                    )
                } else if q["paused"] == "running" {
                    button(
                        "pause",
                        "/api/queues/pause",
                        &serde_json::json!({"queue": q["name"]}),
                    )
                } else {
                    String::new()
                };
                let reset = format!("{reset}{pause}");
                vec![
                    t(&q["name"]),
                    t(&q["length"]),
                    html(&q["parked_jobs"].as_u64().unwrap_or(0).to_string()),
                    if q["counter"].is_null() {
                        "-".into()
                    } else {
                        t(&q["counter"])
                    },
                    html(&state),
                    t(&q["head_class"]),
                    secs(&q["oldest_age_secs"]),
                    reset,
                ]
            })
            .collect(),
        "workers" => list
            .iter()
            .map(|w| {
                let job = &w["job"];
                let state = if !w["parked"].is_null() {
                    format!("parked: {}", s(&w["parked"]["why"]))
                } else if job.is_null() {
                    "idle".into()
                } else {
                    "busy".into()
                };
                let handlers: Vec<String> = w["handlers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(super::handler_cell::handler_cell)
                    .collect();
                vec![
                    t(&w["id"]),
                    t(&w["kind"]),
                    t(&w["queues"]),
                    html(&state),
                    t(&job["class"]),
                    t(&job["run_at"]),
                    secs(&job["running_secs"]),
                    html(&handlers.join("; ")),
                    // A-21: cancel the slot's running job.
                    if actions && w["kind"] == "locketd" && !job.is_null() {
                        button(
                            "cancel",
                            "/api/jobs/cancel",
                            &serde_json::json!({"target": w["id"]}),
                        )
                    } else {
                        String::new()
                    },
                ]
            })
            .collect(),
        "locks" => {
            let mut out = Vec::new();
            for l in &list {
                let waiting = {
                    let w = &l["waiting"];
                    let mut parts = Vec::new();
                    if !w.is_null() {
                        parts.push(format!(
                            "{} on {} (attempt {}, due in {})",
                            s(&w["class"]),
                            s(&w["queue"]),
                            s(&w["attempt"]),
                            ms(&w["due_in_ms"])
                        ));
                    }
                    let q: Vec<String> = l["blocked_queues"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(s)
                        .collect();
                    if !q.is_empty() {
                        parts.push(format!("queues skipping: {}", q.join(", ")));
                    }
                    parts.join("; ")
                };
                for h in l["holders"].as_array().into_iter().flatten() {
                    let release = if actions {
                        button(
                            "release",
                            "/api/locks/release",
                            &serde_json::json!({"lock_id": l["lock_id"], "token": h["token"]}),
                        )
                    } else {
                        String::new()
                    };
                    out.push(vec![
                        t(&l["lock_id"]),
                        html(&s(&h["token"]).chars().take(8).collect::<String>()),
                        t(&h["resque_worker"]),
                        t(&h["class"]),
                        ms(&h["age_ms"]),
                        ms(&h["left_ms"]),
                        t(&h["limit"]),
                        t(&h["fence"]),
                        html(&waiting),
                        release,
                    ]);
                }
            }
            out
        }
        "holds" => list
            .iter()
            .map(|h| {
                let q: Vec<String> = h["blocked_queues"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(s)
                    .collect();
                vec![
                    t(&h["name"]),
                    html(&s(&h["digest"]).chars().take(12).collect::<String>()),
                    t(&h["count"]),
                    ms(&h["left_ms"]),
                    if q.is_empty() {
                        String::new()
                    } else {
                        html(&format!("queues skipping: {}", q.join(", ")))
                    },
                ]
            })
            .collect(),
        "rates" => {
            let now = v["now_ms"].as_u64().unwrap_or(0);
            list.iter()
                .map(|r| {
                    let known = !r["template"].is_null();
                    let or_unknown = |x: &Value, f: &dyn Fn(&Value) -> String| {
                        if known {
                            f(x)
                        } else {
                            "?".to_string()
                        }
                    };
                    let next = r["next_allowed_ms"].as_u64().unwrap_or(0);
                    vec![
                        t(&r["key"]),
                        or_unknown(&r["limit"], &|x| html(&s(x))),
                        or_unknown(&r["period_ms"], &|x| ms(x)),
                        t(&r["used"]),
                        or_unknown(&r["allowed_now"], &|x| html(&s(x))),
                        if next > now {
                            html(&clock(next))
                        } else {
                            "now".into()
                        },
                        r["closed_until_ms"]
                            .as_u64()
                            .map_or("-".into(), |c| html(&clock(c))),
                        t(&r["parked"]),
                    ]
                })
                .collect()
        }
        "delayed" => {
            let mut out: Vec<Vec<String>> = list
                .iter()
                .map(|d| {
                    vec![
                        t(&d["rid"]),
                        t(&d["queue"]),
                        t(&d["class"]),
                        html(&format!("{} {}", s(&d["reason"]), s(&d["resource"]))),
                        t(&d["attempt"]),
                        ms(&d["due_in_ms"]),
                    ]
                })
                .collect();
            for d in v["scheduler"]["rows"].as_array().into_iter().flatten() {
                out.push(vec![
                    "resque-scheduler".into(),
                    t(&d["queue"]),
                    t(&d["class"]),
                    html(&format!("args {}", s(&d["args"]))),
                    "-".into(),
                    d["at"].as_u64().map_or("-".into(), |a| html(&at(a))),
                ]);
            }
            out
        }
        "schedules" => list
            .iter()
            .map(|r| {
                let c = &r["config"];
                let when = if !c["when"].is_null() {
                    s(&c["when"])
                } else if !c["cron"].is_null() {
                    format!("cron {}", s(&c["cron"]))
                } else if !c["every"].is_null() {
                    format!("every {}", s(&c["every"]))
                } else {
                    String::new()
                };
                let next = r["next"].as_u64().map_or_else(|| "-".to_string(), at);
                let run = if actions && r["source"] == "locketd" {
                    button(
                        "run now",
                        "/api/schedules/run",
                        &serde_json::json!({"name": r["name"]}),
                    )
                } else {
                    String::new()
                };
                vec![
                    t(&r["name"]),
                    html(&when),
                    t(&c["class"]),
                    t(&c["queue"]),
                    html(&next),
                    t(&r["last_enqueued_at"]),
                    run,
                ]
            })
            .collect(),
        "failures" => list
            .iter()
            .map(|f| {
                let body = serde_json::json!({"list": f["list"], "index": f["index"]});
                vec![
                    t(&f["failed_at"]),
                    t(&f["list"]),
                    t(&f["queue"]),
                    t(&f["class"]),
                    t(&f["exception"]),
                    t(&f["error"]),
                    if actions {
                        format!(
                            "{} {}",
                            button("retry", "/api/failures/retry", &body),
                            button("remove", "/api/failures/remove", &body)
                        )
                    } else {
                        String::new()
                    },
                ]
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The colours of the chart's series, in [`SERIES`] order.
pub const COLOURS: &[&str] = &[
    "#2f855a", "#c53030", "#2b6cb0", "#c05621", "#b83280", "#6b46c1",
];

/// The chart as inline SVG: one polyline per series over the last hour's minutes.
pub fn chart(v: &Value) -> String {
    let (w, h, pad) = (900.0f64, 180.0f64, 24.0f64);
    let series = &v["series"];
    let points = |ev: &str| -> Vec<i64> {
        series[ev]["points"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| p.as_i64().unwrap_or(0))
            .collect()
    };
    let max = SERIES
        .iter()
        .flat_map(|(ev, _)| points(ev))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut out = format!(
        "<svg id=\"chart-svg\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {}\" role=\"img\" aria-label=\"jobs per minute\">",
        h + 2.0 * pad + 16.0
    );
    let _ = write!(
        out,
        "<line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" class=\"axis\"/><text x=\"2\" y=\"{}\" class=\"tick\">{max}</text><text x=\"2\" y=\"{}\" class=\"tick\">0</text><text x=\"{pad}\" y=\"{}\" class=\"tick\">60 min ago</text><text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"end\">now</text>",
        h + pad,
        w - pad,
        h + pad,
        pad + 4.0,
        h + pad,
        h + pad + 13.0,
        w - pad,
        h + pad + 13.0
    );
    for (i, (ev, label)) in SERIES.iter().enumerate() {
        let p = points(ev);
        let n = p.len().max(2) as f64 - 1.0;
        let coords: Vec<String> = p
            .iter()
            .enumerate()
            .map(|(x, y)| {
                format!(
                    "{:.1},{:.1}",
                    pad + (w - 2.0 * pad) * x as f64 / n,
                    pad + h - h * (*y as f64) / max as f64
                )
            })
            .collect();
        let total: i64 = p.iter().sum();
        let _ = write!(
            out,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/><text x=\"{}\" y=\"{}\" fill=\"{c}\" class=\"legend\">{} ({total})</text>",
            coords.join(" "),
            pad + 145.0 * i as f64,
            h + 2.0 * pad + 12.0,
            html(label),
            c = COLOURS[i % COLOURS.len()],
        );
    }
    out.push_str("</svg>");
    out
}

/// The totals of the page's status line (`/api/page`'s `summary`): `status` without its
/// unbounded lists.
pub fn summary(st: &crate::ops::status::Status) -> Value {
    serde_json::json!({
        "redis": st.redis,
        "namespace": st.namespace,
        "now": st.now,
        "paused": st.paused,
        "processed": st.processed,
        "failed": st.failed,
        "failures_listed": st.failures_listed,
        "locks_held": st.locks_held,
        "workers": st.workers.len(),
        "busy": st.workers.iter().filter(|w| w.job.is_some()).count(),
        "unreadable": st.unreadable,
    })
}

/// The text naming the keys a section (or the status line) could not read, `""` for none.
pub fn unreadable_text(list: &Value) -> String {
    let lines: Vec<String> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|u| format!("{}: {}", s(&u["key"]), s(&u["error"])))
        .collect();
    if lines.is_empty() {
        String::new()
    } else {
        format!("could not read {}", lines.join("; "))
    }
}

/// `<p class="unreadable" id="{id}">` with `text`, hidden when there is none (the script
/// fills it on refresh).
fn unreadable_p(out: &mut String, id: &str, text: &str) {
    let _ = write!(
        out,
        "<p class=\"unreadable\" id=\"{id}\"{}>{}</p>",
        if text.is_empty() { " hidden" } else { "" },
        html(text)
    );
}

/// The whole page.
pub fn render(d: &PageData, config: &Config) -> String {
    let st = &d.status;
    let actions = config.http_admin_token.is_some();
    let mut out = String::with_capacity(64 * 1024);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>locketd · ");
    push_html(&mut out, &st.namespace);
    out.push_str("</title><link rel=\"stylesheet\" href=\"/assets/page.css\"></head>\n");
    let _ = write!(
        out,
        "<body data-actions=\"{}\"><header><h1>locketd</h1><p class=\"where\">redis {} · namespace {} · <span id=\"refreshed\" data-refreshes=\"0\">rendered at {}</span></p>",
        if actions { "on" } else { "off" },
        html(&st.redis),
        html(&st.namespace),
        html(&at(st.now))
    );
    let busy = st.workers.iter().filter(|w| w.job.is_some()).count();
    let _ = write!(
        out,
        "<p id=\"summary\">processed <b id=\"s-processed\" data-rendered=\"{0}\">{0}</b> · failed <b id=\"s-failed\">{1}</b> · failures listed <b id=\"s-failures\">{2}</b> · locks held <b id=\"s-locks\">{3}</b> · workers <b id=\"s-workers\">{4}</b> (<span id=\"s-busy\">{busy}</span> busy){5}</p>",
        st.processed,
        st.failed,
        st.failures_listed,
        st.locks_held,
        st.workers.len(),
        if st.paused { " · <b>PAUSED</b>" } else { "" }
    );
    let status_unreadable = serde_json::to_value(&st.unreadable).unwrap_or_default();
    unreadable_p(
        &mut out,
        "s-unreadable",
        &unreadable_text(&status_unreadable),
    );
    if actions {
        out.push_str("<form id=\"token-form\" hidden><label>admin token <input id=\"token\" type=\"password\" autocomplete=\"off\"></label> <span id=\"action-result\" role=\"status\"></span></form>");
    }
    out.push_str("</header>\n<main>\n");
    for name in SECTIONS {
        let v = &d.sections[name];
        let (title, cols) = heads(name);
        let _ = write!(
            out,
            "<section id=\"{name}\"{}><h2>{title} <span class=\"count\">{}</span></h2>",
            if has_data(name, v) { "" } else { " hidden" },
            html(&count_text(name, v))
        );
        unreadable_p(
            &mut out,
            &format!("{name}-unreadable"),
            &unreadable_text(&v["unreadable"]),
        );
        if *name == "chart" {
            out.push_str("<div id=\"chart-box\">");
            out.push_str(&chart(v));
            let _ = write!(out, "</div><p class=\"note\">{}</p>", html(&s(&v["note"])));
        } else {
            if *name == "failures" {
                out.push_str("<table class=\"by-class\"><thead><tr><th>class</th><th>exception</th><th>count</th></tr></thead><tbody>");
                for b in v["by_class"].as_array().into_iter().flatten() {
                    let _ = write!(
                        out,
                        "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                        html(&s(&b["class"])),
                        html(&s(&b["exception"])),
                        html(&s(&b["count"]))
                    );
                }
                out.push_str("</tbody></table>");
                let url = v["resque_web_url"]
                    .as_str()
                    .filter(|u| u.starts_with("http://") || u.starts_with("https://"));
                if let Some(url) = url {
                    let _ = write!(
                        out,
                        "<p><a href=\"{}/failed\" rel=\"noreferrer\">resque-web's failures</a></p>",
                        html(url.trim_end_matches('/'))
                    );
                }
            }
            if *name == "schedules" {
                let l = &v["master_lock"];
                let _ = write!(
                    out,
                    "<p id=\"master-lock\">scheduler lock: {}</p>",
                    if l.is_null() {
                        "not held".to_string()
                    } else {
                        html(&format!(
                            "held by {} ({}s left)",
                            s(&l["holder"]),
                            s(&l["ttl_secs"])
                        ))
                    }
                );
            }
            out.push_str("<table><thead><tr>");
            for c in cols {
                let _ = write!(out, "<th>{c}</th>");
            }
            let _ = write!(out, "</tr></thead><tbody id=\"{name}-rows\">");
            for r in rows(name, v, actions) {
                out.push_str("<tr>");
                for c in r {
                    let _ = write!(out, "<td>{c}</td>");
                }
                out.push_str("</tr>");
            }
            out.push_str("</tbody></table>");
        }
        out.push_str("</section>\n");
    }
    out.push_str("</main><footer>refreshes every 2 s with scripts on · JSON: <a href=\"/api/status\">/api/status</a>, <a href=\"/api/page\">/api/page</a> · <a href=\"/metrics\">/metrics</a></footer>\n<script src=\"/assets/page.js\"></script></body></html>\n");
    out
}

/// "12", or "500 of 10000" for a section cut at [`MAX_ROWS`].
pub fn count_text(name: &str, v: &Value) -> String {
    if name == "chart" {
        return String::new();
    }
    let total = v["total"].as_u64().unwrap_or(0);
    let shown = v["rows"].as_array().map_or(0, Vec::len) as u64;
    let mut t = if total > shown && shown >= MAX_ROWS as u64 {
        format!("{shown} of {total}")
    } else {
        total.to_string()
    };
    if name == "delayed" {
        let sch = v["scheduler"]["total"].as_u64().unwrap_or(0);
        if sch > 0 {
            let _ = write!(t, " + {sch} resque-scheduler");
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each row has one cell per column head, in every section (with and without actions).
    #[test]
    fn rows_match_their_heads() {
        let sections = [
            (
                "queues",
                json!({"total": 1, "rows": [{"name": "q", "length": 1, "counter": 1,
                "skipped": true, "configured": true, "head_class": "C", "oldest_age_secs": 3}]}),
            ),
            (
                "workers",
                json!({"total": 1, "rows": [{"id": "h:1:q", "kind": "locketd",
                "queues": "q", "job": {"class": "C", "run_at": "x", "running_secs": 1},
                "handlers": [{"name": "ruby", "pid": 7, "ready": true}]}]}),
            ),
            (
                "locks",
                json!({"total": 1, "rows": [{"lock_id": "l", "blocked_queues": ["q"],
                "waiting": null, "holders": [{"token": "t", "age_ms": 1, "left_ms": 2}]}]}),
            ),
            (
                "holds",
                json!({"total": 1, "rows": [{"name": "n", "digest": "d", "count": 1,
                "left_ms": 1, "blocked_queues": ["q"]}]}),
            ),
            (
                "delayed",
                json!({"total": 1, "rows": [{"rid": "r", "due_in_ms": 1}],
                "scheduler": {"total": 1, "rows": [{"at": 1, "class": "C"}]}}),
            ),
            (
                "schedules",
                json!({"total": 1, "rows": [{"name": "n", "config": {"every": "1m"}}]}),
            ),
            (
                "rates",
                json!({"total": 2, "now_ms": 1000, "rows": [{"key": "api:1", "template": "api:{args[0]}",
                "limit": 5, "period_ms": 1000, "used": 5, "allowed_now": 0, "next_allowed_ms": 1500,
                "closed_until_ms": 1500, "parked": 3}, {"key": "old", "template": null}]}),
            ),
            (
                "failures",
                json!({"total": 1, "rows": [{"list": "failed", "index": 0}]}),
            ),
        ];
        for (name, v) in sections {
            for actions in [false, true] {
                let r = rows(name, &v, actions);
                assert!(!r.is_empty(), "{name}");
                for row in r {
                    assert_eq!(row.len(), heads(name).1.len(), "{name}: {row:?}");
                }
            }
        }
    }

    /// RL-5: a rate key's row as the CLI's table has it: clock times, "?" for a key no class
    /// renders.
    #[test]
    fn a_rate_row_shows_its_times_and_an_unknown_key_its_question_marks() {
        let v = json!({"total": 2, "now_ms": 1000, "rows": [
            {"key": "api:1", "template": "api:{args[0]}", "limit": 5, "period_ms": 1000,
             "used": 5, "allowed_now": 0, "next_allowed_ms": 1500, "closed_until_ms": 1500,
             "parked": 3},
            {"key": "old", "template": null, "limit": 0, "period_ms": 0, "used": 2,
             "allowed_now": 0, "next_allowed_ms": 1000, "closed_until_ms": null, "parked": 0}]});
        let r = rows("rates", &v, false);
        assert_eq!(
            r[0],
            [
                "api:1",
                "5",
                "1.0s",
                "5",
                "0",
                "00:00:01.500",
                "00:00:01.500",
                "3"
            ]
        );
        assert_eq!(r[1], ["old", "?", "?", "2", "?", "now", "-", "0"]);
    }

    #[test]
    fn a_cut_section_says_how_many_there_are() {
        let rows: Vec<Value> = (0..MAX_ROWS).map(|i| json!({"name": i})).collect();
        assert_eq!(
            count_text("locks", &json!({"total": 10_000, "rows": rows})),
            "500 of 10000"
        );
        assert_eq!(
            count_text("locks", &json!({"total": 3, "rows": [1, 2, 3]})),
            "3"
        );
    }
}
