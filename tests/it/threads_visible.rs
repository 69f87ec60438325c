//! Threaded persistent handlers (H-18, issue 38 item 6) as an operator sees them: `status`
//! (text and `--json`), `/metrics` and the web page show one process for the slots that share
//! it, with its threads busy / total, jobs and memory, and each running job's slot and thread.
//! The real `locketd` binary, a private redis-server and the Ruby adapter with `threads = 4`.
//! Run: `cargo test --test it -- threads_visible:: --include-ignored`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{cfg, workdir, R};
use crate::support::{manifest_dir, wait_until, Daemon, RedisServer};

/// Long enough for a Ruby boot on a loaded 2-core machine, many times over.
const LONG: Duration = Duration::from_secs(30);

/// A Resque class whose jobs wait until the file `gate` exists (at most 60 s).
const APP: &str = r#"
class Wait
  @queue = :q
  def self.perform(gate, _n)
    deadline = Time.now + 60
    sleep 0.05 until File.exist?(gate) || Time.now > deadline
  end
end
"#;

/// A daemon of one worker process with 4 slots and one `[handlers.app]` of `threads = 4`
/// running `app` through the Ruby adapter, serving the page and `/metrics`.
fn start(redis: &RedisServer, dir: &Path) -> (Daemon, String) {
    let app = dir.join("app.rb");
    std::fs::write(&app, APP).expect("write the app");
    let config = format!(
        "{}\n[handlers.app]\nmode = \"persistent\"\ncommand = [\"{}\", \"{}\"]\n\
         boot_timeout = \"60s\"\npreload = true\nthreads = 4\n\n[classes.\"*\"]\nhandler = \"app\"\n",
        cfg("q").top("slots = 4").render(),
        manifest_dir().join("adapters/ruby/locketd-ruby").display(),
        app.display(),
    );
    let d = Daemon::builder(redis)
        .config(&config)
        .args(["--http", "127.0.0.1:0"])
        .start();
    let addr = crate::service::metrics_addr(&d);
    (d, addr)
}

fn status_json(redis: &RedisServer) -> Value {
    let out = crate::ops::locketd(redis, &["--queues", "q", "status", "--json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// `GET path` on `addr`: the body, or empty.
fn get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

fn samples<'a>(body: &'a str, family: &str) -> Vec<&'a str> {
    let prefix = format!("{family}{{");
    body.lines().filter(|l| l.starts_with(&prefix)).collect()
}

/// H-18 visible: four jobs waiting in one threads = 4 process read as one process with 4/4
/// threads busy in `status --json` (each slot's job with its own thread), in the text table
/// (one row, THREADS `4/4`, each worker's job naming its thread), in `/metrics` (threads and
/// busy once, memory once, a thread per slot) and on the page; once they end, 0/4.
///
/// Needs the daemon side of H-18 (the thr-core branch: slots sharing a process fill
/// `threads`, `threads_busy`, `thread`) and the Ruby adapter's threaded mode (thr-ruby).
#[test]
fn a_threaded_process_shows_its_threads_busy_and_each_jobs_thread() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let gate = work.path().join("gate");
    let (d, addr) = start(&redis, work.path());
    for n in 0..4 {
        let payload = json!({"class": "Wait", "args": [gate.display().to_string(), n]});
        r.push("q", &payload.to_string());
    }

    // status --json: one process of the four slots, every thread busy, one thread per job.
    let mut procs = Value::Null;
    wait_until(
        LONG,
        "status shows one process with 4/4 threads busy",
        || {
            procs = status_json(&redis)["handler_processes"].clone();
            procs.as_array().is_some_and(|p| {
                p.len() == 1
                    && p[0]["threads_busy"] == 4
                    && p[0]["running"].as_array().map(Vec::len) == Some(4)
            })
        },
    );
    let p = &procs[0];
    assert_eq!(
        (p["handler"].as_str(), p["threads"].as_u64()),
        (Some("app"), Some(4)),
        "{p}"
    );
    assert_eq!(p["slots"].as_array().map(Vec::len), Some(4), "{p}");
    assert!(p["ready"] == true && p["pid"].as_u64().is_some(), "{p}");
    let threads: BTreeSet<u64> = p["running"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["thread"].as_u64())
        .collect();
    assert_eq!(threads, (0..4).collect(), "{p}");
    let status = status_json(&redis);
    let pids: BTreeSet<Option<u64>> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["handlers"][0]["pid"].as_u64())
        .collect();
    assert_eq!(
        pids,
        [p["pid"].as_u64()].into(),
        "every slot's job in one process: {status}"
    );

    // The text screen: one handler row with 4/4, and each busy worker names its thread.
    let text = crate::ops::stdout_ok(&crate::ops::locketd(&redis, &["--queues", "q", "status"]));
    assert!(text.contains("THREADS") && text.contains("4/4"), "{text}");
    assert!(text.contains("+3 slots"), "{text}");
    assert_eq!(text.matches(" thread ").count(), 4, "{text}");

    // /metrics (workers report once a second): the process once, each slot's thread.
    let mut body = String::new();
    wait_until(LONG, "/metrics shows 4 of 4 threads busy", || {
        body = get(&addr, "/metrics");
        let busy = samples(&body, "locketd_handler_threads_busy");
        busy.len() == 1 && busy[0].ends_with(" 4")
    });
    let threads = samples(&body, "locketd_handler_threads");
    assert!(threads.len() == 1 && threads[0].ends_with(" 4"), "{body}");
    assert_eq!(
        samples(&body, "locketd_handler_rss_bytes").len(),
        1,
        "{body}"
    );
    let per_slot = samples(&body, "locketd_handler_thread");
    assert_eq!(per_slot.len(), 4, "{body}");
    assert!(per_slot.iter().all(|l| !l.ends_with(" -1")), "{body}");

    // The page: each slot's handler cell names its thread and the process's 4/4.
    let page = get(&addr, "/");
    assert_eq!(page.matches("4/4 busy").count(), 4, "{page}");
    assert!(page.contains(", thread 3 ("), "{page}");
    // The script's refresh (page.js) writes the same cells.
    if let Some(bin) = crate::web::browser::chromium() {
        let url = format!("http://{addr}/");
        let dom = crate::web::browser::run_chromium(
            &bin,
            &url,
            &["--virtual-time-budget=5000", "--dump-dom"],
        );
        let (refreshed, _) = crate::web::browser::element(&dom, "refreshed");
        assert!(refreshed.starts_with("refreshed at 20"), "{refreshed}");
        assert_eq!(dom.matches("4/4 busy").count(), 4, "{dom}");
    }

    // The jobs end: the process stays, none of its threads busy.
    std::fs::write(&gate, "").unwrap();
    wait_until(LONG, "four jobs processed", || r.processed() == 4);
    wait_until(LONG, "status shows 0/4 threads busy", || {
        let p = status_json(&redis)["handler_processes"].clone();
        p.as_array()
            .is_some_and(|p| p.len() == 1 && p[0]["threads_busy"] == 0 && p[0]["jobs"] == 4)
    });
    drop(d);
}
