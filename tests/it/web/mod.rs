//! The web page of issue 16 through the real binary and a real redis-server: a known state
//! seeded in Redis (a held lock with a job waiting on it, a skipped queue, a hold, delayed jobs
//! of locket and of resque-scheduler, a schedule, a failure, per-minute counts), read back from
//! the JSON API and the HTML; escaping; the token-guarded actions; the listener's address; and
//! (`browser.rs`) the page in headless Chromium and its CPU cost. Run: `cargo test --test it -- web::`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, R};
use crate::support::{Daemon, RedisServer};

pub(crate) mod browser;

const SHORT: Duration = Duration::from_secs(10);
const TOKEN: &str = "s3cret-token-0123456789";

/// A class name and a queue name that would break out of HTML if not escaped.
const EVIL_CLASS: &str = "<script>alert(1)</script>";
const EVIL_QUEUE: &str = "q\"uo'te";

/// One HTTP exchange: (status code, head, body). The `Host` is `addr` unless `headers` give
/// one.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the listener");
    s.set_read_timeout(Some(SHORT)).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, head.to_string(), body.to_string())
}

fn get_json(addr: &str, path: &str) -> Value {
    let (code, _, body) = http(addr, "GET", path, &[], "");
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

fn now_ms(r: &mut R) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut r.0).unwrap();
    s * 1000 + us / 1000
}

/// The known state. `class` and `queue` name the held lock's job and the skipped queue.
fn seed(r: &mut R, class: &str, queue: &str) {
    let now = now_ms(r);
    let far = now + 600_000;
    let payload = json!({"class": class, "args": [7]}).to_string();
    let c = &mut r.0;
    let run = |c: &mut redis::Connection, args: &[&str]| {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        let _: redis::Value = cmd.query(c).unwrap();
    };
    // A skipped queue: two jobs, both counted as waiting on a lock.
    run(c, &["SADD", "resque:queues", queue]);
    run(
        c,
        &[
            "RPUSH",
            &format!("resque:queue:{queue}"),
            &payload,
            &payload,
        ],
    );
    run(c, &["SET", &format!("resque:locket:counter:{queue}"), "2"]);
    // A queue being drained: one of its three jobs waits on a lock.
    run(c, &["SADD", "resque:queues", "mixed"]);
    run(
        c,
        &["RPUSH", "resque:queue:mixed", &payload, &payload, &payload],
    );
    run(c, &["SET", "resque:locket:counter:mixed", "1"]);
    // A held lock, with a holder's info as ACQUIRE writes it, that made the queue skip.
    let info = json!({"process": "web-host:4242:abcd", "resque_worker": "web-host:4242:busy",
                      "class": class, "queue": queue, "digest": "d1d1d1d1", "limit": 1,
                      "fence": 3, "acquired_at": now - 5000});
    run(
        c,
        &[
            "ZADD",
            "resque:locket:lock:acct:7",
            &far.to_string(),
            "tok-aaaa1111",
        ],
    );
    run(
        c,
        &[
            "HSET",
            "resque:locket:lockinfo:acct:7",
            "tok-aaaa1111",
            &info.to_string(),
        ],
    );
    run(
        c,
        &["ZADD", "resque:locket:locks", &far.to_string(), "acct:7"],
    );
    run(c, &["SADD", "resque:locket:blocked:lock:acct:7", queue]);
    // A job delayed because of that lock (P-4), its second attempt.
    let member = json!({"rid": "rid-1", "queue": queue, "payload": payload,
                        "reason": "lock", "resource": "acct:7", "attempt": 2});
    run(
        c,
        &[
            "ZADD",
            "resque:locket:delayed",
            &(now + 300_000).to_string(),
            &member.to_string(),
        ],
    );
    // A hold.
    run(
        c,
        &[
            "ZADD",
            "resque:locket:deps",
            &far.to_string(),
            "report:2026",
        ],
    );
    run(
        c,
        &[
            "HSET",
            "resque:locket:dep:report:2026",
            "abcdef0123456789",
            &format!("1:{far}"),
        ],
    );
    run(
        c,
        &["SADD", "resque:locket:blocked:dep:report:2026", "mixed"],
    );
    // A failure.
    let failure = json!({"failed_at": "2026/11/25 02:00:00 UTC", "payload": {"class": class, "args": [7]},
                         "exception": "RuntimeError", "error": "boom", "backtrace": [],
                         "worker": "web-host:4242:busy", "queue": queue});
    run(c, &["RPUSH", "resque:failed", &failure.to_string()]);
    // resque-scheduler's delayed job, schedule and master lock.
    let ts = (now / 1000 + 3600).to_string();
    run(c, &["ZADD", "resque:delayed_queue_schedule", &ts, &ts]);
    run(
        c,
        &[
            "RPUSH",
            &format!("resque:delayed:{ts}"),
            r#"{"class":"SendEmail","args":[42],"queue":"mailers"}"#,
        ],
    );
    run(
        c,
        &[
            "HSET",
            "resque:persistent_schedules",
            "nightly",
            r#"{"class":"Report","cron":"0 3 * * *","queue":"low"}"#,
        ],
    );
    run(
        c,
        &[
            "HSET",
            "resque:delayed:last_enqueued_at",
            "nightly",
            "2026-11-25 03:00:00 +0000",
        ],
    );
    run(
        c,
        &[
            "SET",
            "resque:resque:resque_scheduler_master_lock",
            "sched-host:99",
            "EX",
            "180",
        ],
    );
    // RL-5: a rate key with two starts in its window, closed by a handler's back-off (RL-4)
    // and two jobs parked on it, looked at again in ten minutes (the daemon's janitor leaves
    // them be meanwhile).
    let log = locketd::store::RateLog {
        closed_until_ms: far as u64,
        starts: vec![now as u64 - 100, now as u64 - 50],
    };
    let _: () = redis::cmd("SET")
        .arg("resque:locket:ratelog:api:7")
        .arg(log.encode())
        .arg("PX")
        .arg(600_000)
        .query(c)
        .unwrap();
    let entry = json!({"rid": "rid-r", "queue": "mailers", "payload": payload, "parked_at": now,
                       "class": "Api::Call", "digest": "d2", "attempt": 1, "ttl": 0,
                       "limit": 5, "period": 3_600_000, "spread": 0})
    .to_string();
    run(
        c,
        &["RPUSH", "resque:locket:parked:rate:api:7", &entry, &entry],
    );
    run(
        c,
        &[
            "ZADD",
            "resque:locket:parked",
            &far.to_string(),
            "rate:api:7",
        ],
    );
    // Per-minute counts of this minute.
    let minute = (now / 60_000).to_string();
    run(
        c,
        &[
            "HSET",
            &format!("resque:locket:metrics:{minute}"),
            "started",
            "5",
            "conflict",
            "2",
            "queue_skipped",
            "3",
        ],
    );
}

/// The seed's rate key as a row of the page, closed until `closed` (epoch ms).
fn rate_row(closed: u64) -> String {
    let c = locketd::admin::clock_ms(closed);
    format!("<td>api:7</td><td>5</td><td>1h00m</td><td>2</td><td>0</td><td>{c}</td><td>{c}</td><td>2</td>")
}

/// A daemon working another queue, serving on `--http 127.0.0.1:0`, with `extra` config lines.
fn daemon(redis: &RedisServer, extra: &str) -> (Daemon, String) {
    let mut c = cfg("web_worked");
    for l in extra.lines() {
        c = c.top(l);
    }
    // The seed's rate key is this class's (RL-5: its limit and period come from here).
    c = c.class(
        "Api::Call",
        std::path::Path::new("/bin/true"),
        "rate = { key = \"api:{args[0]}\", limit = 5, period = \"1h\" }",
    );
    let d = Daemon::builder(redis)
        .config(&c.render())
        .args(["--http", "127.0.0.1:0"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    (d, addr)
}

#[test]
fn the_api_and_the_page_show_a_known_state() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (d, addr) = daemon(
        &redis,
        "resque_web_url = \"http://resque-web.example:5678/\"",
    );

    let status = get_json(&addr, "/api/status");
    assert_eq!(status["namespace"], "resque");
    assert_eq!(status["locks_held"], 1);
    assert_eq!(status["failures_listed"], 1);

    let queues = get_json(&addr, "/api/queues");
    let busy = queues["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "busy")
        .expect("queue busy");
    assert_eq!(busy["length"], 2);
    assert_eq!(busy["counter"], 2);
    assert_eq!(busy["skipped"], true);
    assert_eq!(busy["configured"], false);
    assert_eq!(busy["head_class"], "Acct::Sync");

    let locks = get_json(&addr, "/api/locks");
    assert_eq!(locks["total"], 1);
    let l = &locks["rows"][0];
    assert_eq!(l["lock_id"], "acct:7");
    assert_eq!(l["blocked_queues"], json!(["busy"]));
    let h = &l["holders"][0];
    assert_eq!(
        (
            &h["token"],
            &h["class"],
            &h["queue"],
            &h["resque_worker"],
            &h["fence"],
            &h["limit"]
        ),
        (
            // O-1: the first 8 characters of the token.
            &json!("tok-aaaa"),
            &json!("Acct::Sync"),
            &json!("busy"),
            &json!("web-host:4242:busy"),
            &json!(3),
            &json!(1)
        )
    );
    let age = h["age_ms"].as_i64().unwrap();
    assert!((5000..60_000).contains(&age), "{age}");
    let left = h["left_ms"].as_i64().unwrap();
    assert!(left > 500_000 && left <= 600_000, "{left}");
    assert_eq!(l["waiting"]["rid"], "rid-1");
    assert_eq!(l["waiting"]["attempt"], 2);
    assert_eq!(l["waiting"]["class"], "Acct::Sync");

    let holds = get_json(&addr, "/api/holds");
    assert_eq!(holds["total"], 1);
    assert_eq!(holds["rows"][0]["name"], "report:2026");
    assert_eq!(holds["rows"][0]["digest"], "abcdef0123456789");
    assert_eq!(holds["rows"][0]["count"], 1);

    let delayed = get_json(&addr, "/api/delayed");
    assert_eq!(delayed["total"], 1);
    let d0 = &delayed["rows"][0];
    assert_eq!(
        (
            &d0["rid"],
            &d0["queue"],
            &d0["class"],
            &d0["reason"],
            &d0["resource"]
        ),
        (
            &json!("rid-1"),
            &json!("busy"),
            &json!("Acct::Sync"),
            &json!("lock"),
            &json!("acct:7")
        )
    );
    assert_eq!(delayed["scheduler"]["total"], 1);
    assert_eq!(delayed["scheduler"]["rows"][0]["class"], "SendEmail");
    assert_eq!(delayed["scheduler"]["rows"][0]["queue"], "mailers");
    assert_eq!(delayed["scheduler"]["rows"][0]["args"], json!([42]));

    let schedules = get_json(&addr, "/api/schedules");
    assert_eq!(schedules["total"], 1);
    assert_eq!(schedules["rows"][0]["name"], "nightly");
    assert_eq!(schedules["rows"][0]["config"]["cron"], "0 3 * * *");
    assert_eq!(
        schedules["rows"][0]["last_enqueued_at"],
        "2026-11-25 03:00:00 +0000"
    );
    assert_eq!(schedules["master_lock"]["holder"], "sched-host:99");

    let failures = get_json(&addr, "/api/failures");
    assert_eq!(failures["total"], 1);
    assert_eq!(
        failures["by_class"],
        json!([{"class": "Acct::Sync", "exception": "RuntimeError", "count": 1}])
    );
    assert_eq!(failures["rows"][0]["error"], "boom");
    assert_eq!(
        failures["resque_web_url"],
        "http://resque-web.example:5678/"
    );

    let chart = get_json(&addr, "/api/chart");
    assert_eq!(
        chart["series"]["started"]["points"]
            .as_array()
            .unwrap()
            .len(),
        60
    );
    let sum = |ev: &str| {
        chart["series"][ev]["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_i64().unwrap())
            .sum::<i64>()
    };
    // The daemon's own idle worker counts nothing: its queue is empty.
    assert!(sum("started") >= 5 && sum("conflict") >= 2 && sum("queue_skipped") >= 3);

    // The CLI's --json rows are the API's rows.
    let cli = |args: &[&str]| -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
            .args(["--redis", &redis.url()])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mut from_cli = cli(&["holds", "--json"]);
    let mut from_api = holds["rows"].clone();
    for v in [&mut from_cli[0], &mut from_api[0]] {
        v["left_ms"] = json!(0);
    }
    assert_eq!(from_cli, from_api);
    // RL-5: the rates section is `locketd limits --json`'s keys.
    let rates = get_json(&addr, "/api/rates");
    assert_eq!(rates["total"], 1);
    let k = &rates["rows"][0];
    assert_eq!(
        (
            &k["key"],
            &k["template"],
            &k["limit"],
            &k["period_ms"],
            &k["parked"]
        ),
        (
            &json!("api:7"),
            &json!("api:{args[0]}"),
            &json!(5),
            &json!(3_600_000),
            &json!(2)
        )
    );
    assert_eq!((&k["used"], &k["allowed_now"]), (&json!(2), &json!(0)));
    let closed = k["closed_until_ms"].as_u64().unwrap();
    assert_eq!(k["next_allowed_ms"], closed);
    assert!(closed > now_ms(&mut r) as u64 + 500_000, "{k}");
    let config = d.config_path().display().to_string();
    let from_cli = cli(&["--config", &config, "limits", "--json"]);
    let mut from_api = rates["rows"].clone();
    let mut from_cli_keys = from_cli["keys"].clone();
    for v in [&mut from_cli_keys[0], &mut from_api[0]] {
        v["next_allowed_ms"] = json!(0);
    }
    assert_eq!(from_cli_keys, from_api);
    let mut from_cli = cli(&["locks", "--json"]);
    let mut from_api = locks["rows"].clone();
    for v in [&mut from_cli[0], &mut from_api[0]] {
        let h = &mut v["holders"][0];
        h["age_ms"] = json!(0);
        h["left_ms"] = json!(0);
        v.as_object_mut().unwrap().remove("waiting");
    }
    assert_eq!(from_cli, from_api);

    // Every section has its own endpoint; an unknown one is a 404 that lists them.
    for s in [
        "queues",
        "workers",
        "locks",
        "holds",
        "rates",
        "delayed",
        "schedules",
        "failures",
        "chart",
    ] {
        get_json(&addr, &format!("/api/{s}"));
    }
    let (code, _, body) = http(&addr, "GET", "/api/nope", &[], "");
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("/api/locks"), "{body}");

    // The HTML holds the same state, server-rendered.
    let rate_row = rate_row(closed);
    let (code, head, page) = http(&addr, "GET", "/", &[], "");
    assert_eq!(code, 200);
    assert!(head.contains("text/html"), "{head}");
    assert!(
        head.contains("Content-Security-Policy: default-src 'none'; script-src 'self'"),
        "{head}"
    );
    for needle in [
        "<section id=\"locks\">",
        "acct:7",
        "<td>tok-aaaa</td>",
        "Acct::Sync on busy (attempt 2",
        "queues skipping: busy",
        "<section id=\"queues\">",
        "skipped (every job waits on a lock)",
        "draining (1 of 3 wait on a lock)",
        "<section id=\"holds\">",
        "report:2026",
        "abcdef012345",
        "queues skipping: mixed",
        "<section id=\"rates\">",
        &rate_row,
        "<section id=\"delayed\">",
        "rid-1",
        "SendEmail",
        "mailers",
        "<section id=\"schedules\">",
        "cron 0 3 * * *",
        "sched-host:99",
        "<section id=\"failures\">",
        "RuntimeError",
        "boom",
        "http://resque-web.example:5678/failed",
        "<svg id=\"chart-svg\"",
        "started (5)",
        "<script src=\"/assets/page.js\"></script>",
    ] {
        assert!(page.contains(needle), "{needle} missing in\n{page}");
    }
    // No token set: no action buttons.
    assert!(!page.contains("data-endpoint"), "{page}");
    let (code, head, js) = http(&addr, "GET", "/assets/page.js", &[], "");
    assert_eq!(code, 200);
    assert!(
        head.contains("text/javascript") && js.contains("/api/page"),
        "{head}"
    );
    // /metrics is still there.
    let (code, _, metrics) = http(&addr, "GET", "/metrics", &[], "");
    assert_eq!(code, 200);
    assert!(metrics.contains("locketd_locks_held 1"), "{metrics}");
}

/// Sections without data are left out (hidden) of the page.
#[test]
fn sections_appear_only_with_their_data() {
    let redis = RedisServer::start();
    // Without its scheduler: the scheduler lock it would hold is data of the schedules section.
    let (_d, addr) = daemon(&redis, "[scheduler]\nenabled = false");
    let (_, _, page) = http(&addr, "GET", "/", &[], "");
    for s in [
        "locks",
        "holds",
        "rates",
        "delayed",
        "schedules",
        "failures",
    ] {
        assert!(
            page.contains(&format!("<section id=\"{s}\" hidden>")),
            "{s} shown in\n{page}"
        );
    }
    for s in ["queues", "workers", "chart"] {
        assert!(
            page.contains(&format!("<section id=\"{s}\">")),
            "{s} hidden in\n{page}"
        );
    }
}

#[test]
fn names_from_redis_are_escaped_in_the_html() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, EVIL_CLASS, EVIL_QUEUE);
    let (_d, addr) = daemon(&redis, &format!("http_admin_token = \"{TOKEN}\""));
    let (_, _, page) = http(&addr, "GET", "/", &[], "");
    assert!(!page.contains("<script>alert"), "raw class in\n{page}");
    assert!(!page.contains(EVIL_QUEUE), "raw queue in\n{page}");
    assert!(
        page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{page}"
    );
    assert!(page.contains("q&quot;uo&#39;te"), "{page}");
    // Also inside the action buttons' attributes.
    assert!(
        page.contains("data-body=\"{&quot;queue&quot;:&quot;q\\&quot;uo&#39;te&quot;}\""),
        "{page}"
    );
    // The only script is the page's own.
    assert_eq!(page.matches("<script").count(), 1, "{page}");
    // The API gives the names as they are.
    let q = get_json(&addr, "/api/queues");
    assert!(q["rows"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["name"] == EVIL_QUEUE && r["head_class"] == EVIL_CLASS));
}

#[test]
fn actions_are_off_without_the_token_setting() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (_d, addr) = daemon(&redis, "");
    let auth = format!("Bearer {TOKEN}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/locks/release",
        &[("Authorization", &auth)],
        r#"{"lock_id":"acct:7","force":true}"#,
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains("actions are off: set http_admin_token"),
        "{body}"
    );
    assert!(r.exists("resque:locket:lock:acct:7"));
}

#[test]
fn actions_need_the_right_token_and_are_logged() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (d, addr) = daemon(&redis, &format!("http_admin_token = \"{TOKEN}\""));
    let release = r#"{"lock_id":"acct:7","token":"tok-aaaa1111"}"#;

    let (code, _, body) = http(&addr, "POST", "/api/locks/release", &[], release);
    assert_eq!(code, 401, "{body}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/locks/release",
        &[("Authorization", "Bearer wrong-token-0123456789")],
        release,
    );
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("wrong admin token"), "{body}");
    d.wait_for_log("web: action refused: wrong token", SHORT);
    d.wait_for_log("web: action refused: no token", SHORT);
    assert!(
        r.exists("resque:locket:lock:acct:7"),
        "released without the token"
    );
    // A GET is not an action.
    let (code, _, _) = http(&addr, "GET", "/api/locks/release", &[], "");
    assert_eq!(code, 405);
    assert!(!d.log().contains(TOKEN), "the token reached the log");

    let auth = format!("Bearer {TOKEN}");
    let ok = |path: &str, body: &str| -> Value {
        let (code, _, out) = http(
            &addr,
            "POST",
            path,
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json"),
            ],
            body,
        );
        assert_eq!(code, 200, "{path}: {out}");
        serde_json::from_str(&out).unwrap()
    };
    // The page offers the actions once the token is set.
    let (_, _, page) = http(&addr, "GET", "/", &[], "");
    assert!(
        page.contains("data-endpoint=\"/api/locks/release\""),
        "{page}"
    );

    assert_eq!(ok("/api/locks/release", release)["released"], 1);
    assert!(!r.exists("resque:locket:lock:acct:7"));
    d.wait_for_log("web: lock holder released by an operator", SHORT);
    // Releasing the lock reset the counters of the queues it blocked (as the CLI's release).
    assert!(!r.exists("resque:locket:counter:busy"));

    r.cmd::<()>(&["SET", "resque:locket:counter:busy", "2"]);
    assert_eq!(
        ok("/api/counters/reset", r#"{"queue":"busy"}"#)["was_set"],
        true
    );
    assert!(!r.exists("resque:locket:counter:busy"));
    d.wait_for_log("web: lock counter reset by an operator", SHORT);

    // A-20: pause and resume a queue from the page; `/metrics` shows the worked queue's pause.
    assert_eq!(ok("/api/queues/pause", r#"{"queue":"busy"}"#)["changed"], 1);
    ok("/api/queues/pause", r#"{"queue":"web_worked"}"#);
    assert!(r.exists("resque:pause:queue:busy"));
    d.wait_for_log("web: queue paused by an operator", SHORT);
    let (_, _, page) = http(&addr, "GET", "/", &[], "");
    assert!(
        page.contains("data-endpoint=\"/api/queues/resume\""),
        "{page}"
    );
    let (_, _, metrics) = http(&addr, "GET", "/metrics", &[], "");
    assert!(
        metrics.contains("locketd_queue_paused{queue=\"web_worked\"} 1"),
        "{metrics}"
    );
    assert_eq!(
        ok("/api/queues/resume", r#"{"queue":"busy"}"#)["changed"],
        1
    );
    ok("/api/queues/resume", r#"{"queue":"web_worked"}"#);
    assert!(!r.exists("resque:pause:queue:busy"));
    r.cmd::<()>(&["HSET", "resque:pause:queue:busy", "by", "hand"]);
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/queues/pause",
        &[("Authorization", &auth)],
        r#"{"queue":"busy"}"#,
    );
    assert_eq!(code, 409, "{body}");
    r.cmd::<()>(&["DEL", "resque:pause:queue:busy"]);
    // A-21: a cancel of a job that runs nowhere does nothing and says so.
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/jobs/cancel",
        &[("Authorization", &auth)],
        r#"{"target":"0123456789abcdef"}"#,
    );
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("nothing done"), "{body}");

    let before = r.llen("resque:queue:busy");
    let retried = ok("/api/failures/retry", r#"{"list":"failed","index":0}"#);
    assert_eq!(retried["retried"]["class"], "Acct::Sync");
    assert_eq!(r.llen("resque:queue:busy"), before + 1);
    d.wait_for_log("web: failure retried by an operator", SHORT);
    ok("/api/failures/remove", r#"{"list":"failed","index":0}"#);
    assert_eq!(r.llen("resque:failed"), 0);
    d.wait_for_log("web: failure removed by an operator", SHORT);
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/failures/remove",
        &[("Authorization", &auth)],
        r#"{"list":"failed","index":0}"#,
    );
    assert_eq!(code, 404, "{body}");
}

#[test]
fn the_listener_binds_loopback_unless_told_otherwise() {
    let redis = RedisServer::start();
    // A bare port is a loopback address.
    let d = Daemon::builder(&redis)
        .config(&cfg("web_worked").render())
        .args(["--http", "0"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    assert!(!d.log().contains("not a loopback address"));
    let (code, _, _) = http(&addr, "GET", "/", &[], "");
    assert_eq!(code, 200);
    drop(d);
    // Another address is taken as told, with a warning.
    let d = Daemon::builder(&redis)
        .config(&cfg("web_worked").render())
        .args(["--http", "0.0.0.0:0"])
        .start();
    d.wait_for_log("is not a loopback address", SHORT);
    drop(d);
    // --metrics is the same listener: the page is there too.
    let d = Daemon::builder(&redis)
        .config(&cfg("web_worked").render())
        .args(["--metrics", "127.0.0.1:0"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    let (code, _, page) = http(&addr, "GET", "/", &[], "");
    assert_eq!(code, 200);
    assert!(page.contains("<h1>locketd</h1>"));
}

/// The daemon's own `[schedule.<name>]` tables are listed with their next tick, and an
/// operator with the token runs one now: one job enqueued, logged at warn; an unknown name is
/// 404 and enqueues nothing.
#[test]
fn schedules_show_their_next_tick_and_run_now_with_the_token() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let tables = format!(
        "http_admin_token = \"{TOKEN}\"\n[schedule.nightly]\ncron = \"0 3 * * *\"\nclass = \"Report\"\nqueue = \"low\"\nargs = [\"x\"]\n"
    );
    let (d, addr) = daemon(&redis, &tables);
    let v = get_json(&addr, "/api/schedules");
    let row = v["rows"]
        .as_array()
        .and_then(|rows| rows.iter().find(|x| x["name"] == "nightly"))
        .cloned()
        .unwrap_or_else(|| panic!("no nightly row: {v}"));
    assert_eq!(row["source"], "locketd", "{row}");
    assert_eq!(row["config"]["class"], "Report", "{row}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let next = row["next"].as_u64().expect("a next tick");
    assert!(next > now && next <= now + 86_400, "{row}");
    let (_, _, page) = http(&addr, "GET", "/", &[], "");
    assert!(page.contains("run now"), "the page offers the action");

    let auth = format!("Bearer {TOKEN}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/schedules/run",
        &[("Authorization", &auth)],
        r#"{"name":"nope"}"#,
    );
    assert_eq!(code, 404, "{body}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/schedules/run",
        &[("Authorization", &auth)],
        r#"{"name":"nightly"}"#,
    );
    assert_eq!(code, 200, "{body}");
    let jobs: Vec<String> = r.cmd(&["LRANGE", "resque:queue:low", "0", "-1"]);
    assert_eq!(jobs, [r#"{"class":"Report","args":["x"]}"#]);
    d.wait_for_log("web: schedule run now by an operator", SHORT);
}

/// Issue 23 #6: a DNS-rebinding page reaches the listener under the attacker's name. A request
/// whose `Host` is not the listener's (its address, `localhost`, a name of
/// `http_allowed_hosts`) gets 421 and none of the page's data, on every route; the known
/// names still work.
#[test]
fn a_foreign_host_gets_421_and_no_data() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (_d, addr) = daemon(
        &redis,
        &format!("http_admin_token = \"{TOKEN}\"\nhttp_allowed_hosts = [\"metrics.example\"]"),
    );
    let port = addr.rsplit_once(':').unwrap().1;
    // What a rebinding page is after: lock tokens, a delayed job's args, failure messages.
    let secrets = ["tok-aaaa", "SendEmail", "Acct::Sync", "boom", "acct:7"];
    let (code, _, locks) = http(&addr, "GET", "/api/locks", &[], "");
    assert_eq!(code, 200, "{locks}");
    assert!(locks.contains("\"tok-aaaa\""), "the seed is there: {locks}");

    for host in [
        "evil.example".to_string(),
        format!("evil.example:{port}"),
        format!("localhost.evil.example:{port}"),
        format!("metrics.example.evil.example:{port}"),
    ] {
        for path in [
            "/",
            "/api/page",
            "/api/locks",
            "/api/delayed",
            "/api/failures",
            "/api/status",
            "/metrics",
            "/assets/page.js",
            "/nope",
        ] {
            let (code, head, body) = http(&addr, "GET", path, &[("Host", &host)], "");
            assert_eq!(code, 421, "{host} {path}: {head}\n{body}");
            for s in secrets {
                assert!(!body.contains(s), "{host} {path}: {s} in {body}");
            }
        }
        // Nor an action, with the right token.
        let (code, _, body) = http(
            &addr,
            "POST",
            "/api/locks/release",
            &[
                ("Host", &host),
                ("Authorization", &format!("Bearer {TOKEN}")),
            ],
            r#"{"lock_id":"acct:7","force":true}"#,
        );
        assert_eq!(code, 421, "{body}");
        assert!(r.exists("resque:locket:lock:acct:7"));
    }
    // A request without a Host is refused too (HTTP/1.1 requires it).
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(SHORT)).unwrap();
    s.write_all(b"GET /api/locks HTTP/1.1\r\n\r\n").unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(!resp.contains("tok-aaaa"), "{resp}");

    for host in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_string(),
        format!("localhost:{port}"),
        "localhost:8080".to_string(),
        format!("metrics.example:{port}"),
        "Metrics.Example".to_string(),
    ] {
        let (code, _, body) = http(&addr, "GET", "/api/locks", &[("Host", &host)], "");
        assert_eq!(code, 200, "{host}: {body}");
        assert!(body.contains("\"tok-aaaa\""), "{host}: {body}");
        let (code, _, _) = http(&addr, "GET", "/metrics", &[("Host", &host)], "");
        assert_eq!(code, 200, "{host}");
    }
}

/// Issue 23 #6: an action posted from another site's page (its `Origin` not a host the
/// listener answers for) is refused with 403 even with the token; the page's own origin and a
/// client that sends no `Origin` (curl) are served.
#[test]
fn a_cross_site_post_to_an_action_is_refused() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (d, addr) = daemon(&redis, &format!("http_admin_token = \"{TOKEN}\""));
    let auth = format!("Bearer {TOKEN}");
    let release = r#"{"lock_id":"acct:7","token":"tok-aaaa1111"}"#;
    for origin in [
        "http://evil.example".to_string(),
        format!("http://evil.example:{}", addr.rsplit_once(':').unwrap().1),
        "null".to_string(),
    ] {
        let (code, _, body) = http(
            &addr,
            "POST",
            "/api/locks/release",
            &[("Authorization", &auth), ("Origin", &origin)],
            release,
        );
        assert_eq!(code, 403, "{origin}: {body}");
        assert!(
            r.exists("resque:locket:lock:acct:7"),
            "released from {origin}"
        );
    }
    assert!(!d.log().contains("web: lock holder released"));
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/counters/reset",
        &[
            ("Authorization", &auth),
            ("Origin", &format!("http://{addr}")),
        ],
        r#"{"queue":"busy"}"#,
    );
    assert_eq!(code, 200, "{body}");
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/locks/release",
        &[("Authorization", &auth)],
        release,
    );
    assert_eq!(code, 200, "{body}");
    assert!(!r.exists("resque:locket:lock:acct:7"));
}

/// Issue 23 #6: a listener bound to 0.0.0.0 answers for the address the client reached (here
/// 127.0.0.2, which no fixed rule names), not for another address of the machine.
#[test]
fn a_listener_on_all_addresses_answers_for_the_address_reached() {
    let redis = RedisServer::start();
    let d = Daemon::builder(&redis)
        .config(&cfg("web_worked").render())
        .args(["--http", "0.0.0.0:0"])
        .start();
    let bound = crate::service::metrics_addr(&d);
    let port = bound.rsplit_once(':').unwrap().1;
    let addr = format!("127.0.0.2:{port}");
    let (code, _, body) = http(&addr, "GET", "/api/status", &[], "");
    assert_eq!(code, 200, "{body}");
    let (code, _, body) = http(
        &addr,
        "GET",
        "/api/status",
        &[("Host", &format!("127.0.0.3:{port}"))],
        "",
    );
    assert_eq!(code, 421, "{body}");
    assert!(!body.contains("namespace"), "{body}");
}

/// The `Authorization` scheme's name is case-insensitive (RFC 9110): `bearer <token>` and
/// `BEARER <token>` are `Bearer <token>`; another scheme is still no token (401).
#[test]
fn the_bearer_scheme_is_taken_in_any_case() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let (_d, addr) = daemon(&redis, &format!("http_admin_token = \"{TOKEN}\""));
    for scheme in ["bearer", "BEARER", "Bearer"] {
        r.cmd::<()>(&["SET", "resque:locket:counter:busy", "2"]);
        let auth = format!("{scheme} {TOKEN}");
        let (code, _, body) = http(
            &addr,
            "POST",
            "/api/counters/reset",
            &[("Authorization", &auth)],
            r#"{"queue":"busy"}"#,
        );
        assert_eq!(code, 200, "{scheme}: {body}");
        assert!(!r.exists("resque:locket:counter:busy"), "{scheme}");
    }
    let (code, _, body) = http(
        &addr,
        "POST",
        "/api/counters/reset",
        &[("Authorization", &format!("Basic {TOKEN}"))],
        r#"{"queue":"busy"}"#,
    );
    assert_eq!(code, 401, "{body}");
}

/// O-1: a lock token is shown only as its first 8 characters: by `/api/locks`, `/api/page`,
/// `/api/status`, the page, `locks` and `status` (tables and `--json`), and in the log of a
/// release. The release takes the prefix shown (the page's and `locks release --token`, of a
/// limit-1 lock too); a prefix that names two holders is refused and releases nothing.
#[test]
fn lock_tokens_are_shown_as_prefixes_and_a_prefix_releases_its_holder() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = crate::daemon::workdir();
    let h = crate::support::write_script(dir.path(), "hold.sh", "exec sleep 60");
    let config = cfg("q")
        .top(&format!("http_admin_token = \"{TOKEN}\""))
        .class("Hold::Two", &h, "lock = \"acct:{args[0]}\"\nlimit = 2")
        .class("Hold::One", &h, "lock = \"solo:{args[0]}\"")
        .render();
    let d = Daemon::builder(&redis)
        .config(&config)
        .args(["--http", "127.0.0.1:0", "--workers", "3"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    for job in [
        r#"{"class":"Hold::Two","args":[9,"a"]}"#,
        r#"{"class":"Hold::Two","args":[9,"b"]}"#,
        r#"{"class":"Hold::One","args":[1]}"#,
    ] {
        r.push("q", job);
    }
    let (zset, solo) = ("resque:locket:lock:acct:9", "resque:locket:lock:solo:1");
    crate::support::wait_until(SHORT, "three holders", || {
        r.lock_holders(zset).len() == 2 && r.exists(solo)
    });
    let mut two: Vec<String> = r.cmd(&["ZRANGE", zset, "0", "-1"]);
    two.sort();
    let one: String = r.cmd(&["GET", solo]);
    let one: Value = serde_json::from_str(&one).unwrap();
    let one = one["token"].as_str().unwrap().to_string();
    let tokens = [two[0].clone(), two[1].clone(), one.clone()];
    for t in &tokens {
        assert_eq!(t.len(), 32, "{t}");
    }
    let leaks = |what: &str, text: &str| {
        for t in &tokens {
            assert!(
                !text.contains(t.as_str()),
                "{what} shows the full token {t}:\n{text}"
            );
        }
    };

    // The API, the page and status.
    let locks = get_json(&addr, "/api/locks");
    let mut shown: Vec<String> = locks["rows"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["holders"].as_array().unwrap().clone())
        .map(|h| h["token"].as_str().unwrap().to_string())
        .collect();
    shown.sort();
    let mut want: Vec<String> = tokens.iter().map(|t| t[..8].to_string()).collect();
    want.sort();
    assert_eq!(shown, want, "{locks}");
    for path in ["/api/locks", "/api/page", "/api/status", "/"] {
        let (code, _, body) = http(&addr, "GET", path, &[], "");
        assert_eq!(code, 200, "{path}: {body}");
        leaks(path, &body);
    }
    let cli = |args: &[&str]| -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_locketd"))
            .args(["--redis", &redis.url()])
            .args(args)
            .output()
            .unwrap()
    };
    for args in [
        &["locks"][..],
        &["locks", "--json"],
        &["status"],
        &["status", "--json"],
    ] {
        let out = cli(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        leaks(&format!("{args:?}"), &String::from_utf8_lossy(&out.stdout));
    }

    // A prefix that names two holders releases nothing, on the page and in the CLI.
    let twin = format!("{}{}", &two[1][..8], "0".repeat(24));
    r.cmd::<()>(&["ZADD", zset, "99999999999999", &twin]);
    let auth = format!("Bearer {TOKEN}");
    let release = |lock: &str, token: &str| {
        http(
            &addr,
            "POST",
            "/api/locks/release",
            &[("Authorization", &auth)],
            &json!({"lock_id": lock, "token": token}).to_string(),
        )
    };
    let (code, _, body) = release("acct:9", &two[1][..8]);
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("more than one"), "{body}");
    let out = cli(&["locks", "release", "acct:9", "--token", &two[1][..8]]);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("more than one"),
        "{out:?}"
    );
    assert_eq!(r.lock_holders(zset).len(), 3);
    r.cmd::<()>(&["ZREM", zset, &twin]);

    // The prefix shown releases its holder: on the page, and in the CLI for a limit-1 lock.
    let (code, _, body) = release("acct:9", &two[0][..8]);
    assert_eq!(code, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["released"], 1);
    assert_eq!(r.lock_holders(zset), vec![two[1].clone()]);
    d.wait_for_log("web: lock holder released by an operator", SHORT);
    let out = cli(&["locks", "release", "solo:1", "--token", &one[..8]]);
    assert!(out.status.success(), "{out:?}");
    assert!(!r.exists(solo) || !r.cmd::<String>(&["GET", solo]).contains(&one));
    leaks("the CLI's release", &String::from_utf8_lossy(&out.stderr));
    leaks("the CLI's release", &String::from_utf8_lossy(&out.stdout));
    leaks("the daemon's log", &d.log());
}

/// One key another tool gave another type (or a queue name that is not UTF-8) empties only
/// the part that reads it, which names the key: `/`, `/api/page`, `/api/status` and `locketd
/// status` still answer, every other section shows what it showed before, and `/metrics`
/// stays up. Before, any one of these answered `503 {"error":"redis: redis"}` for the whole
/// page and failed `status`.
#[test]
fn one_odd_key_empties_only_its_own_section_and_names_it() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    let (_d, addr) = daemon(&redis, "");
    let totals = |page: &Value| -> Vec<(String, Value)> {
        page["sections"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(name, v)| {
                let t = if name == "delayed" {
                    json!([v["total"], v["scheduler"]["total"]])
                } else {
                    v["total"].clone()
                };
                (name.clone(), t)
            })
            .collect()
    };
    let before = get_json(&addr, "/api/page");
    for name in [
        "locks",
        "holds",
        "delayed",
        "failures",
        "schedules",
        "rates",
    ] {
        assert!(
            before["sections"][name]["total"].as_u64() > Some(0),
            "{name}: {}",
            before["sections"][name]
        );
    }
    let odd_name = b"q\xff\xfe";
    // (the key, how it is made odd, the section that reads it, whether `status` reads it)
    let cases: [(&str, &[&str], &str, bool); 5] = [
        (
            "resque:failed",
            &["HSET", "resque:failed", "a", "b"],
            "failures",
            true,
        ),
        (
            "resque:locket:locks",
            &["SET", "resque:locket:locks", "x"],
            "locks",
            true,
        ),
        (
            "resque:delayed_queue_schedule",
            &["RPUSH", "resque:delayed_queue_schedule", "x"],
            "delayed",
            true,
        ),
        (
            "resque:locket:deps",
            &["SADD", "resque:locket:deps", "x"],
            "holds",
            false,
        ),
        ("resque:queues", &[], "queues", true),
    ];
    for (key, odd, section, in_status) in cases {
        let saved: Option<Vec<u8>> = redis::cmd("DUMP").arg(key).query(&mut r.0).unwrap();
        if odd.is_empty() {
            let _: () = redis::cmd("SADD")
                .arg(key)
                .arg(&odd_name[..])
                .query(&mut r.0)
                .unwrap();
        } else {
            r.cmd::<()>(&["DEL", key]);
            r.cmd::<()>(odd);
        }

        let (code, _, html) = http(&addr, "GET", "/", &[], "");
        assert_eq!(code, 200, "{key}: {html}");
        assert!(
            html.contains(&format!(
                "<p class=\"unreadable\" id=\"{section}-unreadable\">could not read {key}: "
            )),
            "{key}: the {section} section does not name it:\n{html}"
        );
        let page = get_json(&addr, "/api/page");
        let named = |v: &Value| {
            v.as_array()
                .into_iter()
                .flatten()
                .any(|u| u["key"] == key && u["error"].as_str().is_some_and(|e| !e.is_empty()))
        };
        assert!(
            named(&page["sections"][section]["unreadable"]),
            "{key}: {}",
            page["sections"][section]
        );
        for ((name, was), (_, now)) in totals(&before).into_iter().zip(totals(&page)) {
            if name == section {
                continue;
            }
            assert_eq!(
                now,
                was,
                "{key}: section {name} changed: {}",
                page["sections"][name.as_str()]
            );
            assert!(
                page["sections"][name.as_str()]["unreadable"].is_null(),
                "{key}: section {name}: {}",
                page["sections"][name.as_str()]
            );
        }
        if section == "queues" {
            let names: Vec<&str> = page["sections"]["queues"]["rows"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|q| q["name"].as_str())
                .collect();
            assert!(
                names.contains(&"busy") && names.contains(&"mixed"),
                "{names:?}"
            );
        }

        let status = get_json(&addr, "/api/status");
        let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
            .args(["--redis", &redis.url(), "status"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{key}: status failed: {out:?}");
        if in_status {
            assert!(named(&status["unreadable"]), "{key}: {status}");
            assert!(
                text.contains(&format!("UNREADABLE ({section}) {key}: ")),
                "{key}:\n{text}"
            );
            assert!(
                named(&page["summary"]["unreadable"]),
                "{key}: {}",
                page["summary"]
            );
        }
        assert!(text.contains("QUEUE"), "{key}:\n{text}");
        let (code, _, metrics) = http(&addr, "GET", "/metrics", &[], "");
        assert_eq!(code, 200, "{key}");
        assert!(metrics.contains("locketd_workers"), "{key}");
        // Redis answered: one odd key does not read as Redis down, nor drop the other gauges.
        assert!(metrics.contains("locketd_redis_up 1"), "{key}:\n{metrics}");
        assert!(
            metrics.contains("locketd_queue_length{queue=\"web_worked\"}"),
            "{key}:\n{metrics}"
        );
        if ["resque:failed", "resque:locket:locks"].contains(&key) {
            assert!(
                metrics.contains(&format!("locketd_redis_unreadable_keys{{key=\"{key}\"}} 1")),
                "{key}:\n{metrics}"
            );
        }

        if odd.is_empty() {
            let _: () = redis::cmd("SREM")
                .arg(key)
                .arg(&odd_name[..])
                .query(&mut r.0)
                .unwrap();
        } else {
            r.cmd::<()>(&["DEL", key]);
            if let Some(bytes) = saved {
                let _: () = redis::cmd("RESTORE")
                    .arg(key)
                    .arg(0)
                    .arg(bytes)
                    .query(&mut r.0)
                    .unwrap();
            }
        }
    }
    let after = get_json(&addr, "/api/page");
    assert_eq!(totals(&after), totals(&before));
}
