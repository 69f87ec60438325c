//! `locketd why` on the web page: `/api/why` answers what `locketd why --json` answers, and
//! `/why` shows it as a page, escaped.

use locketd::locks::Policy;
use serde_json::{json, Value};

use super::{cli_json, running_holder};
use crate::policies::{opts, reserved, spec};
use crate::support::RedisServer;

#[tokio::test]
async fn the_web_api_and_job_view_show_the_same_answer() {
    let r = RedisServer::start();
    let mut c = r.conn().await;
    let a = running_holder(&mut c).await;
    let mut b = reserved(&mut c, "pb", "q", "Hot", json!([1, "<b>"])).await;
    let lock = [spec("user:1", 1)];
    b.acquire(&mut c, &lock, &opts(Policy::Park)).await;
    // A daemon of another queue serves the page; its class Hot renders the same lock.
    let cfg = crate::daemon::cfg("web_worked").class(
        "Hot",
        std::path::Path::new("/bin/true"),
        "lock = \"user:{args[0]}\"",
    );
    let d = crate::support::Daemon::builder(&r)
        .config(&cfg.render())
        .args(["--http", "127.0.0.1:0"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    let cli_answer = cli_json(&r, &[&b.rid]);
    let (code, body) = get(&addr, &format!("/api/why?rid={}", b.rid));
    assert_eq!(code, 200, "{body}");
    let mut api: Value = serde_json::from_str(&body).unwrap();
    let mut cli_answer = cli_answer;
    api["now_ms"] = json!(0);
    cli_answer["now_ms"] = json!(0);
    assert_eq!(api, cli_answer);
    assert_eq!(api["place"]["state"], "parked");
    assert_eq!(
        api["reasons"][0]["holders"][0]["worker"],
        json!(a.worker_id)
    );
    // By payload: args as a JSON array, URL-encoded.
    let (code, body) = get(
        &addr,
        "/api/why?queue=q&class=Hot&args=%5B1%2C%22%3Cb%3E%22%5D",
    );
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["job"]["rid"], json!(b.rid));
    // The job view: escaped, with its place and reason.
    let (code, html) = get(&addr, &format!("/why?rid={}", b.rid));
    assert_eq!(code, 200);
    assert!(html.contains("data-state=\"parked\""), "{html}");
    assert!(html.contains("data-kind=\"lock\""), "{html}");
    assert!(html.contains("&lt;b&gt;"), "{html}");
    assert!(!html.contains("<b>\""), "{html}");
    let (code, _) = get(&addr, "/api/why?rid=0123456789abcdef");
    assert_eq!(code, 404);
    let (code, body) = get(&addr, "/api/why?queue=q");
    assert_eq!(code, 400, "{body}");
}

/// `GET path` on the listener: (status, body).
fn get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}
