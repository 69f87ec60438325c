//! The web page in headless Chromium (its rendered DOM after a refresh, a screenshot) and the
//! daemon's CPU per render with 10,000 locks and 1,000 queues.

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{daemon, get_json, http, now_ms, rate_row, seed, TOKEN};
use crate::daemon::R;
use crate::support::{manifest_dir, RedisServer};

/// Headless Chromium: `LOCKETD_CHROMIUM`, else `chromium` on the PATH. None when there is none
/// and `CI` is not set (the test then says it skipped); CI installs it (`.ci/run`).
pub(crate) fn chromium() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LOCKETD_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    for name in ["chromium", "chromium-browser"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
        if found.is_some() {
            return found;
        }
    }
    if std::env::var_os("CI").is_some() {
        panic!("chromium not found: CI must have it (.ci/run installs Debian's chromium)");
    }
    None
}

/// Runs headless Chromium on `url` with `extra` flags (bounded at 60 s); its stdout.
pub(crate) fn run_chromium(bin: &PathBuf, url: &str, extra: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start chromium");
    let mut out = String::new();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let _ = stdout.read_to_string(&mut out);
        out
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap()
}

/// The text of the element with `id` in a dumped DOM, and its `data-rendered` value if any.
pub(crate) fn element(dom: &str, id: &str) -> (String, Option<String>) {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in\n{dom}"));
    let tag_end = at + dom[at..].find('>').unwrap();
    let attrs = &dom[at..tag_end];
    let rendered = attrs.find("data-rendered=\"").map(|i| {
        let v = &attrs[i + 15..];
        v[..v.find('"').unwrap()].to_string()
    });
    let text = &dom[tag_end + 1..];
    (text[..text.find('<').unwrap()].to_string(), rendered)
}

#[test]
fn the_page_in_headless_chromium() {
    let Some(bin) = chromium() else {
        eprintln!("SKIPPED web::the_page_in_headless_chromium: no chromium (apt-get install -y chromium; CI installs it)");
        return;
    };
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    seed(&mut r, "Acct::Sync", "busy");
    r.cmd::<()>(&["SET", "resque:stat:processed", "1000"]);
    let (_d, addr) = daemon(&redis, &format!("http_admin_token = \"{TOKEN}\""));
    let url = format!("http://{addr}/");

    // Jobs keep being processed while the browser loads the page: after one refresh the page
    // shows a count the server did not render.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ticker = {
        let stop = stop.clone();
        let mut r = R::new(&redis);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                r.cmd::<i64>(&["INCR", "resque:stat:processed"]);
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let mut tries = 0;
    let dom = loop {
        tries += 1;
        let dom = run_chromium(&bin, &url, &["--virtual-time-budget=5000", "--dump-dom"]);
        let (shown, rendered) = element(&dom, "s-processed");
        let rendered = rendered.expect("data-rendered on #s-processed");
        if shown != rendered || tries == 3 {
            assert_ne!(
                shown, rendered,
                "no refresh changed the count in 3 tries:\n{dom}"
            );
            let (shown, rendered): (u64, u64) = (shown.parse().unwrap(), rendered.parse().unwrap());
            assert!(shown > rendered && rendered >= 1000, "{shown} {rendered}");
            break dom;
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    ticker.join().unwrap();

    // The script ran and refreshed from the API (the server renders "rendered at").
    let (refreshed, _) = element(&dom, "refreshed");
    assert!(refreshed.starts_with("refreshed at 20"), "{refreshed}");
    assert!(!dom.contains("refresh failed"), "{dom}");
    // The sections, as the script left them: its own rendering of the same rows.
    let closed = get_json(&addr, "/api/rates")["rows"][0]["closed_until_ms"]
        .as_u64()
        .expect("the seed's close");
    let rate_row = rate_row(closed);
    for (id, needle) in [
        ("queues", "draining (1 of 3 wait on a lock)"),
        ("locks", "Acct::Sync on busy (attempt 2"),
        ("holds", "queues skipping: mixed"),
        ("rates", rate_row.as_str()),
        ("delayed", "SendEmail"),
        ("schedules", "cron 0 3 * * *"),
        ("failures", "RuntimeError"),
        ("chart", "started (5)"),
    ] {
        let at = dom
            .find(&format!("<section id=\"{id}\">"))
            .unwrap_or_else(|| panic!("section {id} missing or hidden in\n{dom}"));
        let end = at + dom[at..].find("</section>").unwrap();
        assert!(
            dom[at..end].contains(needle),
            "{needle} missing in section {id}:\n{}",
            &dom[at..end]
        );
    }
    // The script's rows have one cell per column head, as the server's.
    let mut tables = 0;
    for (i, _) in dom.match_indices("<thead>") {
        let table = &dom[i..i + dom[i..].find("</table>").unwrap()];
        let heads = table[..table.find("</thead>").unwrap()]
            .matches("<th>")
            .count();
        for row in table.split("<tr>").skip(2) {
            assert_eq!(row.matches("<td>").count(), heads, "{table}");
        }
        tables += 1;
    }
    assert!(tables >= 7, "{tables} tables in\n{dom}");
    // The token field and the actions are there (the token is set).
    assert!(
        dom.contains("id=\"token-form\">") || dom.contains("id=\"token-form\" >"),
        "{dom}"
    );
    assert!(
        dom.contains("data-endpoint=\"/api/locks/release\""),
        "{dom}"
    );
    // The refreshed DOM holds no script but the page's own.
    assert_eq!(dom.matches("<script").count(), 1, "{dom}");

    // The screenshot, for review (target/tmp/web.png); with LOCKETD_UPDATE_SCREENSHOT=1 also
    // docs/web.png, the README's.
    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("web.png");
    let _ = std::fs::remove_file(&png);
    run_chromium(
        &bin,
        &url,
        &[
            "--virtual-time-budget=3000",
            "--window-size=1280,1600",
            &format!("--screenshot={}", png.display()),
        ],
    );
    let bytes = std::fs::read(&png).expect("the screenshot");
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{} bytes",
        bytes.len()
    );
    eprintln!("screenshot: {}", png.display());
    if std::env::var_os("LOCKETD_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(&png, manifest_dir().join("docs/web.png")).unwrap();
    }
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of proc(5), counted from the state (field 3).
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Issue 16 item 5: a page with 10,000 locks and 1,000 queues, rendered within 200 ms of the
/// daemon's CPU (the master serves it). The figure is printed; the bound is checked for an
/// optimised build only (`cargo test --release --test it -- web::browser::render_cpu`).
#[test]
fn render_cpu_with_10000_locks_and_1000_queues() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let far = now_ms(&mut r) + 3_600_000;
    let mut pipe = redis::pipe();
    for i in 0..10_000 {
        let (id, token) = (format!("acct:{i}"), format!("tok-{i:08}"));
        let info = json!({"process": "bench:1:x", "resque_worker": format!("bench:1+{}:q", i % 64),
                          "class": "Acct::Sync", "queue": format!("q{}", i % 1000), "limit": 1,
                          "fence": i, "acquired_at": far - 3_600_000});
        pipe.zadd(format!("resque:locket:lock:{id}"), &token, far)
            .hset(
                format!("resque:locket:lockinfo:{id}"),
                &token,
                info.to_string(),
            )
            .zadd("resque:locket:locks", &id, far)
            .ignore();
    }
    for i in 0..1000 {
        pipe.sadd("resque:queues", format!("q{i}"))
            .rpush(
                format!("resque:queue:q{i}"),
                r#"{"class":"Acct::Sync","args":[1]}"#,
            )
            .ignore();
    }
    let _: () = pipe.query(&mut r.0).unwrap();
    let (d, addr) = daemon(&redis, "");
    let (code, _, page) = http(&addr, "GET", "/", &[], "");
    assert_eq!(code, 200);
    assert!(
        page.contains("<span class=\"count\">500 of 10000</span>"),
        "locks not cut"
    );
    assert!(
        page.contains("<span class=\"count\">500 of 1001</span>"),
        "queues not cut"
    );
    let tick_ms = 1000.0 / 100.0; // USER_HZ
    let renders = 20;
    let before = cpu_ticks(d.pid());
    let started = Instant::now();
    for _ in 0..renders {
        let (code, _, _) = http(&addr, "GET", "/", &[], "");
        assert_eq!(code, 200);
    }
    let wall = started.elapsed().as_secs_f64() * 1000.0 / renders as f64;
    let cpu = (cpu_ticks(d.pid()) - before) as f64 * tick_ms / renders as f64;
    let (_, _, api) = http(&addr, "GET", "/api/page", &[], "");
    eprintln!(
        "web page with 10,000 locks and 1,000 queues: {cpu:.0} ms of daemon CPU per render, \
         {wall:.0} ms wall ({} build), page {} KiB, /api/page {} KiB",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        page.len() / 1024,
        api.len() / 1024
    );
    if !cfg!(debug_assertions) {
        assert!(cpu <= 200.0, "{cpu} ms of CPU per render");
    }
}
