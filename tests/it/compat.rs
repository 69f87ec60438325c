//! Resque wire compatibility of the worker side (resque-protocol.md §13 items 1-24).
//!
//! Every test runs against its own `redis-server` and drives locketd either as the real binary
//! (`Daemon`, command handlers written by [`Work`]) or in-process (`Worker` with closures).
//! Observations are made the way Resque's own tools make them: raw Redis reads of the Resque
//! keys, `/proc/<pid>/cmdline`, and what a handler saw on stdin and in its environment.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tempfile::TempDir;

use crate::support::{pid_alive, read_lossy, wait_until, write_script, Daemon, RedisServer};

/// Upper bound of every wait for something the daemon is expected to do promptly.
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// Redis helpers

/// Runs one command on a blocking connection; panics with the command on error.
fn q<T: redis::FromRedisValue>(c: &mut redis::Connection, args: &[&str]) -> T {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(c)
        .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
}

/// Runs one command and ignores its reply.
fn run(c: &mut redis::Connection, args: &[&str]) {
    let _: redis::Value = q(c, args);
}

/// Enqueues like Ruby's `Resque.push`: `SADD queues q` and `RPUSH queue:q payload`.
fn push(c: &mut redis::Connection, ns: &str, queue: &str, payload: &str) {
    run(c, &["SADD", &format!("{ns}:queues"), queue]);
    run(c, &["RPUSH", &format!("{ns}:queue:{queue}"), payload]);
}

fn lrange(c: &mut redis::Connection, key: &str) -> Vec<String> {
    q(c, &["LRANGE", key, "0", "-1"])
}

fn smembers(c: &mut redis::Connection, key: &str) -> BTreeSet<String> {
    q(c, &["SMEMBERS", key])
}

fn get(c: &mut redis::Connection, key: &str) -> Option<String> {
    q(c, &["GET", key])
}

fn exists(c: &mut redis::Connection, key: &str) -> bool {
    q::<i64>(c, &["EXISTS", key]) == 1
}

fn get_int(c: &mut redis::Connection, key: &str) -> i64 {
    get(c, key).map_or(0, |v| v.parse().expect("integer stat"))
}

/// Redis server time, whole seconds.
fn redis_time(c: &mut redis::Connection) -> i64 {
    let (secs, _micros): (i64, i64) = q(c, &["TIME"]);
    secs
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

// ---------------------------------------------------------------------------------------------
// Host, process and time helpers (written independently of locketd's own code)

/// gethostname(2), as the kernel reports it.
fn hostname() -> String {
    let name = fs::read_to_string("/proc/sys/kernel/hostname").expect("read hostname");
    let name = name.trim().to_string();
    assert_eq!(name, locketd::host::hostname(), "hostname sources disagree");
    name
}

/// `/proc/<pid>/cmdline` as `ps -o command` shows it.
fn cmdline(pid: i32) -> String {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw)
        .replace('\0', " ")
        .trim_end()
        .to_string()
}

/// Ruby's prune grep: `grep -E "[r]esque:work|[r]esque: Starting|[r]esque-[0-9]" | grep -v resque-web`.
fn ruby_grep_keeps(cmd: &str) -> bool {
    let b = cmd.as_bytes();
    let resque_digit = (0..b.len().saturating_sub(7))
        .any(|i| &b[i..i + 7] == b"resque-" && b[i + 7].is_ascii_digit());
    !cmd.contains("resque-web")
        && (resque_digit || cmd.contains("resque:work") || cmd.contains("resque: Starting"))
}

fn title_prefix() -> String {
    format!("resque-{}-locketd", env!("CARGO_PKG_VERSION"))
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// (year, month, day, hour, minute, second) of epoch seconds.
fn civil(epoch: i64) -> (i64, i64, i64, i64, i64, i64) {
    let days = epoch.div_euclid(86_400);
    let rem = epoch.rem_euclid(86_400);
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Ruby `Time#iso8601` of `epoch` shown in a zone `offset_min` minutes east of UTC.
fn iso8601(epoch: i64, offset_min: i64) -> String {
    let (y, mo, d, h, mi, s) = civil(epoch + offset_min * 60);
    let sign = if offset_min < 0 { '-' } else { '+' };
    let off = offset_min.abs();
    format!(
        "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}{sign}{:02}:{:02}",
        off / 60,
        off % 60
    )
}

/// `Time.now.utc.strftime("%Y/%m/%d %H:%M:%S %Z")`.
fn failed_at_text(epoch: i64) -> String {
    let (y, mo, d, h, mi, s) = civil(epoch);
    format!("{y:04}/{mo:02}/{d:02} {h:02}:{mi:02}:{s:02} UTC")
}

/// Checks `text` against `mask` (`d` = ASCII digit, `~` = `+` or `-`, anything else literal)
/// and returns the epoch of the date and time in bytes 0..19 (zone not applied).
fn civil_fields(text: &str, mask: &str) -> Option<i64> {
    if text.len() != mask.len() {
        return None;
    }
    let shape_ok = text.bytes().zip(mask.bytes()).all(|(c, m)| match m {
        b'd' => c.is_ascii_digit(),
        b'~' => c == b'+' || c == b'-',
        _ => c == m,
    });
    if !shape_ok {
        return None;
    }
    let n = |r: std::ops::Range<usize>| -> i64 { text[r].parse().expect("digits") };
    let (y, mo, d, h, mi, s) = (n(0..4), n(5..7), n(8..10), n(11..13), n(14..16), n(17..19));
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    Some(days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + s)
}

fn zone_secs(sign: &str, hh: &str, mm: &str) -> i64 {
    let secs = hh.parse::<i64>().expect("hh") * 3600 + mm.parse::<i64>().expect("mm") * 60;
    if sign == "-" {
        -secs
    } else {
        secs
    }
}

/// `workers:heartbeat` values: Ruby `Time#iso8601`, `2026-11-21T12:18:29+00:00`.
fn parse_heartbeat(text: &str) -> Option<i64> {
    let local = civil_fields(text, "dddd-dd-ddTdd:dd:dd~dd:dd")?;
    Some(local - zone_secs(&text[19..20], &text[20..22], &text[23..25]))
}

/// `worker:<id>:started`: Ruby `Time#to_s`, `2026-11-21 12:18:29 +0000`.
fn parse_started(text: &str) -> Option<i64> {
    let local = civil_fields(text, "dddd-dd-dd dd:dd:dd ~dddd")?;
    Some(local - zone_secs(&text[20..21], &text[21..23], &text[23..25]))
}

/// `failed_at`: `2026/11/21 12:18:24 UTC`.
fn parse_failed_at(text: &str) -> Option<i64> {
    civil_fields(text, "dddd/dd/dd dd:dd:dd UTC")
}

/// `run_at` inside `worker:<id>`: `2026-11-21T12:18:29Z`.
fn parse_run_at(text: &str) -> Option<i64> {
    civil_fields(text, "dddd-dd-ddTdd:dd:ddZ")
}

#[track_caller]
fn assert_near(what: &str, got: i64, want: i64, slack: i64) {
    assert!(
        (got - want).abs() <= slack,
        "{what}: {got} is not within {slack}s of {want}"
    );
}

/// Top-level keys of a JSON object, in the order they are written.
fn json_keys(text: &str) -> Vec<String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Keys, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some(k) = map.next_key::<String>()? {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    serde_json::from_str::<Keys>(text)
        .unwrap_or_else(|e| panic!("not a JSON object ({e}): {text}"))
        .0
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("invalid JSON ({e}): {text}"))
}

/// Ruby's failure record keys, in Ruby's order.
const RECORD_KEYS: [&str; 7] = [
    "failed_at",
    "payload",
    "exception",
    "error",
    "backtrace",
    "worker",
    "queue",
];

/// Asserts the Resque shape of one failure record (checklist 21) and returns it parsed.
#[track_caller]
fn assert_record_shape(text: &str) -> Value {
    let keys = json_keys(text);
    assert!(
        keys.len() >= RECORD_KEYS.len() && keys[..RECORD_KEYS.len()] == RECORD_KEYS,
        "record keys {keys:?} do not start with Resque's {RECORD_KEYS:?}: {text}"
    );
    let v = json(text);
    let at = v["failed_at"].as_str().expect("failed_at string");
    let at = parse_failed_at(at).unwrap_or_else(|| panic!("failed_at format: {text}"));
    assert_near("failed_at", at, now_secs(), 60);
    assert!(
        v["exception"].as_str().is_some_and(|e| !e.is_empty()),
        "exception: {text}"
    );
    assert!(v["error"].is_string(), "error: {text}");
    let bt = v["backtrace"].as_array().expect("backtrace array");
    assert!(bt.iter().all(Value::is_string), "backtrace strings: {text}");
    assert!(v["worker"].is_string(), "worker: {text}");
    assert!(v["queue"].is_string(), "queue: {text}");
    v
}

// ---------------------------------------------------------------------------------------------
// Daemon helpers

/// A scratch dir with one command handler script, shared by every class of a test.
///
/// The handler appends its stdin (one line per job) to `stdin.log`, then
/// `<queue>\t<class>\t<LOCKETD_ARGS>\t<LOCKETD_WORKER>` to `jobs.log`, then by class:
/// `Fail` writes two stderr lines and exits 3; `Kill` SIGKILLs itself (pid in `kill.pid`);
/// `Block`/`Slow` wait for the file `go` (at most 20 s) and exit with the code written in it;
/// `Flaky` fails the first time and succeeds afterwards; anything else exits 0.
struct Work {
    dir: TempDir,
    script: PathBuf,
}

impl Work {
    fn new() -> Work {
        let dir = tempfile::Builder::new()
            .prefix("locketd-compat-")
            .tempdir()
            .expect("work dir");
        let d = dir.path().display().to_string();
        let body = format!(
            r#"d='{d}'
cat >> "$d/stdin.log"
echo >> "$d/stdin.log"
printf '%s\t%s\t%s\t%s\n' "$LOCKETD_QUEUE" "$LOCKETD_CLASS" "$LOCKETD_ARGS" "$LOCKETD_WORKER" >> "$d/jobs.log"
case "$LOCKETD_CLASS" in
  Fail)
    echo "step one failed" >&2
    echo "boom: bad thing 7" >&2
    exit 3 ;;
  Kill)
    echo $$ > "$d/kill.pid"
    echo "about to die" >&2
    kill -9 $$ ;;
  Block|Slow)
    i=0
    while [ ! -f "$d/go" ]; do
      i=$((i+1))
      if [ $i -gt 400 ]; then exit 99; fi
      sleep 0.05
    done
    exit "$(cat "$d/go")" ;;
  Flaky)
    if [ -f "$d/flaky.done" ]; then exit 0; fi
    : > "$d/flaky.done"
    echo "flaky first attempt" >&2
    exit 1 ;;
esac
exit 0
"#
        );
        let script = write_script(dir.path(), "handler.sh", &body);
        Work { dir, script }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `[classes."<name>"]` running the handler script, plus `extra` lines.
    fn class(&self, name: &str, extra: &str) -> String {
        format!(
            "[classes.{name:?}]\ncommand = [{:?}]\n{extra}\n",
            self.script.display().to_string()
        )
    }

    /// The `"*"` fallback running the handler script.
    fn fallback(&self) -> String {
        self.class("*", "")
    }

    /// Lines of `jobs.log`, split into their tab-separated fields.
    fn jobs(&self) -> Vec<Vec<String>> {
        read_lossy(&self.path("jobs.log"))
            .lines()
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect()
    }

    /// Class and args of each job run so far.
    fn class_args(&self) -> Vec<(String, String)> {
        self.jobs()
            .into_iter()
            .map(|f| (f[1].clone(), f[2].clone()))
            .collect()
    }

    fn stdin_lines(&self) -> Vec<String> {
        read_lossy(&self.path("stdin.log"))
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[track_caller]
    fn wait_jobs(&self, n: usize) {
        wait_until(WAIT, &format!("{n} job(s) started"), || {
            self.jobs().len() >= n
        });
    }

    /// Lets every `Block`/`Slow` job end, with exit `code`.
    fn go(&self, code: i32) {
        let tmp = self.path("go.tmp");
        fs::write(&tmp, code.to_string()).expect("write go");
        fs::rename(&tmp, self.path("go")).expect("rename go");
    }
}

/// A config with `queues`, `interval = 0.1`, `top` lines, a `[locket]` table with a 1 s
/// kill grace plus `locket` lines, then `classes`.
fn config(queues: &str, top: &str, locket: &str, classes: &str) -> String {
    format!(
        "queues = {queues:?}\ninterval = 0.1\n{top}\n[locket]\nkill_grace = \"1s\"\n{locket}\n{classes}"
    )
}

/// Waits until the daemon has registered and returns its Resque worker id.
#[track_caller]
fn wait_registered(c: &mut redis::Connection, ns: &str, d: &Daemon) -> String {
    let prefix = format!("{}:{}:", hostname(), d.worker_pid());
    let key = format!("{ns}:workers");
    let mut found = None;
    wait_until(WAIT, &format!("a worker {prefix}* in {key}"), || {
        found = smembers(c, &key)
            .into_iter()
            .find(|w| w.starts_with(&prefix));
        found.is_some()
    });
    found.expect("registered")
}

/// QUIT, then the exit status (panics with the log when it does not exit in time).
#[track_caller]
fn quit(d: &mut Daemon) -> ExitStatus {
    d.signal(libc::SIGQUIT);
    d.wait_exit(WAIT).unwrap_or_else(|| {
        panic!("locketd did not exit after QUIT\n{}", d.log());
    })
}

#[track_caller]
fn wait_exit_ok(d: &mut Daemon) {
    let status = d
        .wait_exit(WAIT)
        .unwrap_or_else(|| panic!("locketd did not exit\n{}", d.log()));
    assert_eq!(
        status.code(),
        Some(0),
        "exit status {status:?}\n{}",
        d.log()
    );
}

/// A child process killed and reaped on drop.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pid that belonged to a process that has exited and been reaped.
fn dead_pid() -> i32 {
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let pid = child.id() as i32;
    child.wait().expect("reap true");
    assert!(!pid_alive(pid));
    pid
}

// ---------------------------------------------------------------------------------------------
// Keys and payloads

/// Every key written on a server while it runs, from keyspace notifications (`KA`), so that
/// keys that exist only for a moment (mutexes, in-flight records) are seen too.
struct KeyWatch {
    keys: Arc<Mutex<BTreeSet<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A key nobody else writes: publishing on its keyspace channel ends the watch.
const WATCH_STOP: &str = "compat-test-keywatch-stop";

impl KeyWatch {
    fn start(redis: &RedisServer) -> KeyWatch {
        run(
            &mut redis.sync_conn(),
            &["CONFIG", "SET", "notify-keyspace-events", "KA"],
        );
        let keys = Arc::new(Mutex::new(BTreeSet::new()));
        let (ready, subscribed) = std::sync::mpsc::channel();
        let (seen, mut conn) = (keys.clone(), redis.sync_conn());
        let thread = std::thread::spawn(move || {
            let mut sub = conn.as_pubsub();
            sub.psubscribe("__keyspace@0__:*").expect("psubscribe");
            let _ = ready.send(());
            // Bounded by the connection's 30 s read timeout.
            while let Ok(msg) = sub.get_message() {
                let channel = msg.get_channel_name();
                let key = channel.strip_prefix("__keyspace@0__:").unwrap_or(channel);
                if key == WATCH_STOP {
                    return;
                }
                seen.lock().unwrap().insert(key.to_string());
            }
        });
        subscribed
            .recv_timeout(WAIT)
            .expect("keyspace subscription");
        KeyWatch {
            keys,
            thread: Some(thread),
        }
    }

    /// Ends the watch and returns every key written since it started.
    fn finish(mut self, c: &mut redis::Connection) -> BTreeSet<String> {
        run(
            c,
            &["PUBLISH", &format!("__keyspace@0__:{WATCH_STOP}"), "stop"],
        );
        if let Some(t) = self.thread.take() {
            t.join().expect("keyspace watch thread");
        }
        std::mem::take(&mut *self.keys.lock().unwrap())
    }
}

// resque-protocol.md §13 item 1
#[test]
fn every_key_stays_under_the_configured_namespace() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let classes = [
        work.class("Ok", ""),
        work.class("Fail", ""),
        work.class("Block", ""),
    ]
    .concat();
    let watch = KeyWatch::start(&redis);
    // success, failure, unknown class, not JSON, then a job held running (locks, worker:<id>).
    push(&mut c, "app", "q", r#"{"class":"Ok","args":[1]}"#);
    push(&mut c, "app", "q", r#"{"class":"Fail","args":[2]}"#);
    push(&mut c, "app", "q", r#"{"class":"Nope","args":[3]}"#);
    push(&mut c, "app", "q", r#"{"class":"Ok","args":"#);
    push(&mut c, "app", "q", r#"{"class":"Block","args":[4]}"#);
    let locket =
        "janitor_interval = \"200ms\"\nprocess_heartbeat = \"200ms\"\nprocess_ttl = \"2s\"\nlock_ttl = \"2s\"\nheartbeat_interval = \"500ms\"";
    let mut d = Daemon::start(
        &redis,
        &config("q", "namespace = \"app\"", locket, &classes),
        &[],
    );
    let id = wait_registered(&mut c, "app", &d);
    work.wait_jobs(3);
    wait_until(WAIT, "the Block job is running", || {
        exists(&mut c, &format!("app:worker:{id}"))
    });
    let outside = |c: &mut redis::Connection| -> Vec<String> {
        let keys: Vec<String> = q(c, &["KEYS", "*"]);
        keys.into_iter()
            .filter(|k| !k.starts_with("app:"))
            .collect()
    };
    assert_eq!(outside(&mut c), Vec::<String>::new(), "while a job runs");
    // Heartbeats and janitor passes happen meanwhile.
    std::thread::sleep(Duration::from_millis(500));
    work.go(0);
    wait_until(WAIT, "all five jobs processed", || {
        get_int(&mut c, "app:stat:processed") == 5
    });
    assert_eq!(q::<i64>(&mut c, &["LLEN", "app:failed"]), 3);
    assert_eq!(quit(&mut d).code(), Some(0));
    assert_eq!(outside(&mut c), Vec::<String>::new(), "after QUIT");

    let written = watch.finish(&mut c);
    for expected in [
        "app:queue:q".to_string(),
        "app:failed".to_string(),
        "app:workers".to_string(),
        "app:stat:processed".to_string(),
        format!("app:worker:{id}"),
    ] {
        assert!(
            written.contains(&expected),
            "{expected} not seen in {written:?}"
        );
    }
    let stray: Vec<&String> = written.iter().filter(|k| !k.starts_with("app:")).collect();
    assert!(
        stray.is_empty(),
        "keys written outside the namespace: {stray:?}"
    );
}

// resque-protocol.md §13 item 2
#[test]
fn payloads_from_every_resque_client_run_with_exact_stdin_and_args() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    // (queue, payload, expected LOCKETD_CLASS, expected LOCKETD_ARGS)
    let cases = [
        (
            "ruby",
            r#"{"class":"Archive","args":[44,"masterbrew",{"k":"v"},2.5,"ünï/☃",123456789012345678901234567890]}"#,
            "Archive",
            r#"[44,"masterbrew",{"k":"v"},2.5,"ünï/☃",123456789012345678901234567890]"#,
        ),
        (
            "activejob",
            r#"{"class":"ActiveJob::QueueAdapters::ResqueAdapter::JobWrapper","args":[{"job_class":"HelloJob","job_id":"3f1c2a9e-6a0b-4b1e-9f4e-2d7c8b5a1e00","provider_job_id":null,"queue_name":"default","priority":null,"arguments":["world",{"count":3,"_aj_symbol_keys":["count"]}],"executions":0,"exception_executions":{},"locale":"en","timezone":"UTC","enqueued_at":"2026-11-21T12:00:00.123456789Z","scheduled_at":null}]}"#,
            "ActiveJob::QueueAdapters::ResqueAdapter::JobWrapper",
            r#"[{"job_class":"HelloJob","job_id":"3f1c2a9e-6a0b-4b1e-9f4e-2d7c8b5a1e00","provider_job_id":null,"queue_name":"default","priority":null,"arguments":["world",{"count":3,"_aj_symbol_keys":["count"]}],"executions":0,"exception_executions":{},"locale":"en","timezone":"UTC","enqueued_at":"2026-11-21T12:00:00.123456789Z","scheduled_at":null}]"#,
        ),
        (
            "node",
            r#"{"class":"jobName","queue":"node","args":[1,"two",{"three":3}]}"#,
            "jobName",
            r#"[1,"two",{"three":3}]"#,
        ),
        (
            "php",
            r#"{"class":"My_Job","args":[{"name":"Chris","amount":1.50}],"id":"b1946ac92492d2347c6235b4d2611184","prefix":"","queue_time":1700000000.123}"#,
            "My_Job",
            r#"[{"name":"Chris","amount":1.50}]"#,
        ),
        (
            "pyres",
            r#"{"class": "module.Class", "args": [1, "two", {"x": [1.0, 2]}], "queue": "pyres", "first_attempt": 1700000000}"#,
            "module.Class",
            r#"[1, "two", {"x": [1.0, 2]}]"#,
        ),
        ("bare", r#"{"class":"NoArgs"}"#, "NoArgs", "[]"),
    ];
    for (queue, payload, _, _) in &cases {
        push(&mut c, "resque", queue, payload);
    }
    let mut d = Daemon::start(
        &redis,
        &config(
            "ruby,activejob,node,php,pyres,bare",
            "",
            "",
            &work.fallback(),
        ),
        &["--interval", "0"],
    );
    wait_exit_ok(&mut d);
    let jobs = work.jobs();
    let want: Vec<Vec<String>> = cases
        .iter()
        .map(|(q, _, class, args)| vec![q.to_string(), class.to_string(), args.to_string()])
        .collect();
    let got: Vec<Vec<String>> = jobs.iter().map(|f| f[..3].to_vec()).collect();
    assert_eq!(got, want, "queue, LOCKETD_CLASS, LOCKETD_ARGS per job");
    let payloads: Vec<String> = cases.iter().map(|(_, p, _, _)| p.to_string()).collect();
    assert_eq!(
        work.stdin_lines(),
        payloads,
        "stdin is the payload as enqueued"
    );
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 6);
    assert_eq!(q::<i64>(&mut c, &["LLEN", "resque:failed"]), 0);
}

// resque-protocol.md §13 items 3, 15 (and 21: the payload inside the failure record)
#[test]
fn running_job_is_published_in_worker_record_with_payload_bytes_unchanged() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let payload = r#"{"class":"Block", "args": [1.0, 12345678901234567890123, {"z":1,"a":[]}], "id":"abc/def", "note":"ünï"}"#;
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    let key = format!("resque:worker:{id}");
    assert_eq!(get(&mut c, &key), None, "idle worker has no worker:<id>");
    push(&mut c, "resque", "q", payload);
    work.wait_jobs(1);
    let record = get(&mut c, &key).expect("worker:<id> while the job runs");
    let head = r#"{"queue":"q","run_at":""#;
    assert!(record.starts_with(head), "{record}");
    let run_at = &record[head.len()..head.len() + 20];
    let at = parse_run_at(run_at).unwrap_or_else(|| panic!("run_at format: {record}"));
    assert_near("run_at", at, now_secs(), 30);
    // Resque's three keys, then node-resque's `worker` (host:pid): node-resque's
    // allWorkingOn files the job under it; Ruby ignores it.
    let host_pid = id.splitn(3, ':').take(2).collect::<Vec<_>>().join(":");
    assert_eq!(
        record,
        format!(r#"{head}{run_at}","payload":{payload},"worker":"{host_pid}"}}"#),
        "worker:<id> must embed the payload bytes verbatim"
    );
    assert_eq!(json_keys(&record), ["queue", "run_at", "payload", "worker"]);

    work.go(1);
    wait_until(WAIT, "the failure is recorded", || {
        q::<i64>(&mut c, &["LLEN", "resque:failed"]) == 1
    });
    assert_eq!(
        get(&mut c, &key),
        None,
        "worker:<id> is deleted after the job"
    );
    let failure: String = q(&mut c, &["LINDEX", "resque:failed", "0"]);
    assert_record_shape(&failure);
    assert!(
        failure.contains(&format!(r#","payload":{payload},"exception":"#)),
        "failure record must embed the payload bytes verbatim: {failure}"
    );
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 4
#[tokio::test]
async fn jobs_in_one_queue_run_in_fifo_order() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    for i in 1..=6 {
        push(
            &mut c,
            "resque",
            "fifo",
            &format!(r#"{{"class":"Job","args":[{i}]}}"#),
        );
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut handlers = locketd::handler::Handlers::new();
    let s = seen.clone();
    handlers.insert("Job", move |job: locketd::handler::JobContext| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(job.args_raw.clone());
            Ok(())
        }
    });
    let mut cfg = locketd::config::Config::parse("queues = \"fifo\"\ninterval = 0", "compat")
        .expect("config");
    cfg.redis = redis.url();
    let worker = locketd::worker::Worker::start(cfg, handlers)
        .await
        .expect("start");
    let reason = tokio::time::timeout(WAIT, worker.run(Default::default()))
        .await
        .expect("drained in time")
        .expect("run");
    assert_eq!(reason, locketd::worker::StopReason::Drained);
    let order: Vec<String> = (1..=6).map(|i| format!("[{i}]")).collect();
    assert_eq!(*seen.lock().unwrap(), order);
}

// resque-protocol.md §13 item 5
#[tokio::test]
async fn each_reservation_starts_again_at_the_first_queue() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    for name in ["L1", "L2", "L3"] {
        push(
            &mut c,
            "resque",
            "low",
            &format!(r#"{{"class":"Job","args":["{name}"]}}"#),
        );
    }
    push(&mut c, "resque", "high", r#"{"class":"Job","args":["H1"]}"#);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut handlers = locketd::handler::Handlers::new();
    let (s, client) = (seen.clone(), redis.client());
    handlers.insert("Job", move |job: locketd::handler::JobContext| {
        let (s, client) = (s.clone(), client.clone());
        async move {
            let name = job.args[0].as_str().unwrap_or_default().to_string();
            s.lock().unwrap().push(format!("{}:{name}", job.queue));
            if name == "L1" {
                // A producer enqueues to the high queue while a low job runs.
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let _: () = redis::pipe()
                    .sadd("resque:queues", "high")
                    .ignore()
                    .rpush("resque:queue:high", r#"{"class":"Job","args":["H2"]}"#)
                    .ignore()
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            Ok(())
        }
    });
    let mut cfg = locketd::config::Config::parse("queues = \"high,low\"\ninterval = 0", "compat")
        .expect("config");
    cfg.redis = redis.url();
    let worker = locketd::worker::Worker::start(cfg, handlers)
        .await
        .expect("start");
    let reason = tokio::time::timeout(WAIT, worker.run(Default::default()))
        .await
        .expect("drained in time")
        .expect("run");
    assert_eq!(reason, locketd::worker::StopReason::Drained);
    assert_eq!(
        *seen.lock().unwrap(),
        ["high:H1", "low:L1", "high:H2", "low:L2", "low:L3"]
    );
}

// resque-protocol.md §13 item 6 (and 11: the id carries the patterns without `!` entries)
#[test]
fn queue_patterns_expand_against_the_queues_set_like_resque() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let known = ["zeta", "alpha", "b1", ".hidden", "critical", "Beta"];
    let cases: [(&str, &str, &[&str]); 5] = [
        ("*", "*", &["Beta", "alpha", "b1", "critical", "zeta"]),
        (
            "critical,*",
            "critical,*",
            &["critical", "Beta", "alpha", "b1", "zeta"],
        ),
        ("*,!b*", "*", &["Beta", "alpha", "critical", "zeta"]),
        ("b?,[az]*", "b?,[az]*", &["b1", "alpha", "zeta"]),
        ("{alpha,zeta}", "{alpha,zeta}", &[]),
    ];
    // One namespace per pattern list on the same server, all run at once.
    let mut runs = Vec::new();
    for (i, (list, id_part, _)) in cases.iter().enumerate() {
        let ns = format!("g{i}");
        for queue in known {
            push(
                &mut c,
                &ns,
                queue,
                &format!(r#"{{"class":"Rec","args":["{queue}"]}}"#),
            );
        }
        let work = Work::new();
        let top = format!("namespace = {ns:?}");
        let d = Daemon::start(
            &redis,
            &config(list, &top, "", &work.fallback()),
            &["--interval", "0"],
        );
        runs.push((ns, work, d, *id_part));
    }
    for ((ns, work, mut d, id_part), (list, _, want)) in runs.into_iter().zip(cases) {
        wait_exit_ok(&mut d);
        let jobs = work.jobs();
        let order: Vec<&str> = jobs.iter().map(|f| f[0].as_str()).collect();
        assert_eq!(order, want, "QUEUES={list}");
        for f in &jobs {
            // The worker has exited (interval 0); its id is host:<worker pid>:<queues>.
            let host_prefix = format!("{}:", hostname());
            let pid_part = f[3]
                .strip_prefix(&host_prefix)
                .and_then(|rest| rest.strip_suffix(&format!(":{id_part}")))
                .unwrap_or_else(|| panic!("worker id {} for QUEUES={list}", f[3]));
            let pid: i32 = pid_part.parse().expect("pid in the worker id");
            assert_ne!(pid, d.pid(), "the master never works jobs");
        }
        // Never matched: the dot queue (and the excluded / unmatched ones) keep their job.
        for queue in known {
            let left = q::<i64>(&mut c, &["LLEN", &format!("{ns}:queue:{queue}")]);
            assert_eq!(
                left,
                i64::from(!want.contains(&queue)),
                "QUEUES={list} queue {queue}"
            );
        }
    }
}

// resque-protocol.md §13 item 7
#[test]
fn interval_zero_drains_the_queues_and_exits_zero() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    for i in 1..=3 {
        push(
            &mut c,
            "resque",
            "q",
            &format!(r#"{{"class":"Rec","args":[{i}]}}"#),
        );
    }
    let mut d = Daemon::start(
        &redis,
        &config("q", "", "", &work.fallback()),
        &["--interval", "0"],
    );
    wait_exit_ok(&mut d);
    assert_eq!(work.jobs().len(), 3);
    assert_eq!(q::<i64>(&mut c, &["LLEN", "resque:queue:q"]), 0);
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 3);
    assert_eq!(q::<i64>(&mut c, &["SCARD", "resque:workers"]), 0);
    assert_eq!(q::<i64>(&mut c, &["HLEN", "resque:workers:heartbeat"]), 0);

    // With a non-zero interval an empty poll just sleeps: the daemon stays up.
    let mut idle = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    wait_registered(&mut c, "resque", &idle);
    std::thread::sleep(Duration::from_millis(500));
    assert!(idle.is_running(), "interval 0.1 must not exit when idle");
    assert_eq!(quit(&mut idle).code(), Some(0));
}

// resque-protocol.md §13 item 8
#[test]
fn pause_all_workers_stops_reservations_until_the_key_is_deleted() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    run(&mut c, &["SET", "resque:pause-all-workers", " TRUE "]);
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":["p"]}"#);
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    wait_registered(&mut c, "resque", &d);
    let paused = format!("{}: Paused", title_prefix());
    wait_until(WAIT, "process title says Paused", || {
        cmdline(d.worker_pid()) == paused
    });
    // Several poll intervals pass while paused: nothing is reserved.
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(q::<i64>(&mut c, &["LLEN", "resque:queue:q"]), 1);
    assert!(work.jobs().is_empty());
    assert_eq!(get(&mut c, "resque:stat:processed"), None);
    assert!(d.is_running());

    run(&mut c, &["DEL", "resque:pause-all-workers"]);
    work.wait_jobs(1);
    wait_until(WAIT, "the job is processed", || {
        get_int(&mut c, "resque:stat:processed") == 1
    });
    assert_eq!(q::<i64>(&mut c, &["LLEN", "resque:queue:q"]), 0);
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 9
#[test]
fn invalid_json_is_recorded_as_a_failure_and_the_worker_keeps_running() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let bad = r#"{"class":"Rec","args":[1,"#;
    push(&mut c, "resque", "q", bad);
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":[2]}"#);
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    work.wait_jobs(1);
    assert_eq!(work.class_args(), [("Rec".to_string(), "[2]".to_string())]);
    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    let v = assert_record_shape(&failed[0]);
    assert!(v["payload"].is_null(), "{}", failed[0]);
    assert_eq!(v["raw_payload"], bad, "the raw text is kept");
    assert_eq!(v["worker"], id.as_str());
    assert_eq!(v["queue"], "q");
    // Still working: a later job runs too.
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":[3]}"#);
    work.wait_jobs(2);
    assert!(d.is_running());
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 10
#[test]
fn lock_conflict_requeue_pushes_the_original_payload_bytes_back() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    // The `requeue` policy (resque-locket's; the default is `park`). The default counter_ttl
    // (15 s) keeps the requeued copy from being popped again before the lock is released;
    // releasing it clears the counter at once (A-14).
    let cfg = config("q", "", "on_conflict = \"requeue\"", &work.fallback());
    // The same job twice, as two clients would write it: same class and arguments, different
    // bytes (spacing, key order, 1 vs 1.0, extra keys).
    let first = r#"{"class":"Block","args":[1,123456789012345678901234567890,{"b":1,"a":2}]}"#;
    let second = r#"{"args": [1.0, 123456789012345678901234567890, {"a": 2, "b": 1}], "class": "Block", "id": "php-7f3a", "queue_time": 1700000000.10}"#;
    let mut d1 = Daemon::start(&redis, &cfg, &[]);
    wait_registered(&mut c, "resque", &d1);
    push(&mut c, "resque", "q", first);
    work.wait_jobs(1);
    push(&mut c, "resque", "q", second);
    let mut d2 = Daemon::start(&redis, &cfg, &[]);
    d2.wait_for_log("lock conflict", WAIT);
    assert_eq!(
        lrange(&mut c, "resque:queue:q"),
        [second],
        "the requeued payload must be the popped bytes"
    );
    assert_eq!(work.jobs().len(), 1, "the conflicting copy did not run");

    work.go(0);
    work.wait_jobs(2);
    assert_eq!(work.stdin_lines(), [first, second]);
    wait_until(WAIT, "both jobs processed", || {
        get_int(&mut c, "resque:stat:processed") == 2
    });
    assert_eq!(quit(&mut d1).code(), Some(0));
    assert_eq!(quit(&mut d2).code(), Some(0));
}

// ---------------------------------------------------------------------------------------------
// Worker registry

// resque-protocol.md §13 items 11, 12
#[test]
fn registration_uses_resque_worker_id_and_key_formats() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let mut d = Daemon::start(&redis, &config("high,low", "", "", &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    assert_eq!(id, format!("{}:{}:high,low", hostname(), d.worker_pid()));
    assert_eq!(
        smembers(&mut c, "resque:workers"),
        BTreeSet::from([id.clone()])
    );

    let beats: BTreeMap<String, String> = q(&mut c, &["HGETALL", "resque:workers:heartbeat"]);
    assert_eq!(beats.keys().collect::<Vec<_>>(), [&id]);
    let beat = &beats[&id];
    let at = parse_heartbeat(beat).unwrap_or_else(|| panic!("heartbeat format: {beat:?}"));
    assert_near("heartbeat vs Redis TIME", at, redis_time(&mut c), 5);

    let started = get(&mut c, &format!("resque:worker:{id}:started")).expect("started key");
    let at = parse_started(&started).unwrap_or_else(|| panic!("started format: {started:?}"));
    assert_near("started", at, now_secs(), 10);
    assert!(!exists(&mut c, &format!("resque:worker:{id}")), "idle");
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 13
#[test]
fn heartbeat_is_rewritten_from_redis_time_also_during_a_long_job() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let locket = "process_heartbeat = \"200ms\"\nprocess_ttl = \"2s\"\nlock_ttl = \"2s\"\nheartbeat_interval = \"500ms\"";
    let mut d = Daemon::start(&redis, &config("q", "", locket, &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    let beat = |c: &mut redis::Connection| -> String {
        q::<Option<String>>(c, &["HGET", "resque:workers:heartbeat", &id]).expect("heartbeat")
    };
    let first = beat(&mut c);
    wait_until(WAIT, "heartbeat rewritten while idle", || {
        beat(&mut c) != first
    });
    let now = beat(&mut c);
    let at = parse_heartbeat(&now).unwrap_or_else(|| panic!("heartbeat format: {now:?}"));
    assert_near("heartbeat vs Redis TIME", at, redis_time(&mut c), 3);

    push(&mut c, "resque", "q", r#"{"class":"Block","args":[]}"#);
    work.wait_jobs(1);
    let during = beat(&mut c);
    wait_until(WAIT, "heartbeat rewritten during the job", || {
        beat(&mut c) != during
    });
    assert!(
        exists(&mut c, &format!("resque:worker:{id}")),
        "the job was still running"
    );
    let later = beat(&mut c);
    let at = parse_heartbeat(&later).unwrap_or_else(|| panic!("heartbeat format: {later:?}"));
    assert_near("heartbeat vs Redis TIME", at, redis_time(&mut c), 3);
    work.go(0);
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 14
#[test]
fn process_title_matches_resque_prune_greps_while_waiting_and_processing() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let mut d = Daemon::start(&redis, &config("high,low", "", "", &work.fallback()), &[]);
    wait_registered(&mut c, "resque", &d);
    let waiting = format!("{}: Waiting for high,low", title_prefix());
    wait_until(WAIT, "Waiting title", || cmdline(d.worker_pid()) == waiting);
    assert!(ruby_grep_keeps(&waiting) && waiting.contains("resque"));

    push(&mut c, "resque", "low", r#"{"class":"Block","args":[]}"#);
    work.wait_jobs(1);
    let head = format!("{}: Processing low since ", title_prefix());
    let mut title = String::new();
    wait_until(WAIT, "Processing title", || {
        title = cmdline(d.worker_pid());
        title.starts_with(&head)
    });
    let since = title[head.len()..]
        .strip_suffix(" [Block]")
        .unwrap_or_else(|| panic!("title {title:?} does not end with the class"));
    let since: i64 = since
        .parse()
        .unwrap_or_else(|_| panic!("epoch in {title:?}"));
    assert_near("Processing since", since, now_secs(), 30);
    assert!(ruby_grep_keeps(&title), "{title}");
    assert!(title.contains("resque"), "php-resque's grep: {title}");

    work.go(0);
    wait_until(WAIT, "Waiting title again", || {
        cmdline(d.worker_pid()) == waiting
    });
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 16
#[test]
fn quit_unregisters_every_key_after_recording_the_job_in_flight() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let locket = "shutdown_timeout = \"300ms\"";
    let mut d = Daemon::start(&redis, &config("q", "", locket, &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":[1]}"#);
    push(&mut c, "resque", "q", r#"{"class":"Fail","args":[2]}"#);
    let block = r#"{"class":"Block","args":[3]}"#;
    push(&mut c, "resque", "q", block);
    work.wait_jobs(3);
    let worker_keys = [
        format!("resque:worker:{id}"),
        format!("resque:worker:{id}:started"),
        format!("resque:stat:processed:{id}"),
        format!("resque:stat:failed:{id}"),
    ];
    wait_until(WAIT, "the Block job is running", || {
        worker_keys.iter().all(|k| exists(&mut c, k))
    });
    assert_eq!(get_int(&mut c, &worker_keys[2]), 2);
    assert_eq!(get_int(&mut c, &worker_keys[3]), 1);

    assert_eq!(quit(&mut d).code(), Some(0));
    for k in &worker_keys {
        assert!(!exists(&mut c, k), "{k} left after QUIT");
    }
    assert!(!smembers(&mut c, "resque:workers").contains(&id));
    let beat: Option<String> = q(&mut c, &["HGET", "resque:workers:heartbeat", &id]);
    assert_eq!(beat, None, "heartbeat field left after QUIT");
    // The job that was still running got its failure record before the keys went away.
    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 2, "{failed:?}");
    let v = assert_record_shape(&failed[1]);
    assert_eq!(v["exception"], "Resque::TermException");
    assert_eq!(v["worker"], id.as_str());
    assert!(failed[1].contains(&format!(r#""payload":{block},"#)));
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 3);
}

// resque-protocol.md §13 item 17
#[test]
fn startup_prunes_dead_workers_by_resque_rules_only() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let host = hostname();
    let work = Work::new();

    // A live locketd (on another server, so not one of this namespace's locket processes):
    // its pid is alive and its command line is a Resque worker's.
    let other_redis = RedisServer::start();
    let live = Daemon::start(&other_redis, &config("x", "", "", &work.fallback()), &[]);
    wait_registered(&mut other_redis.sync_conn(), "resque", &live);
    // A live process that does not look like a Resque worker: a pyres or node-resque worker
    // as far as the process table tells.
    let sleeper = ChildGuard(
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep"),
    );
    let dead = dead_pid();

    let now = redis_time(&mut c);
    let dead_payload = r#"{"class":"Dead::Job","args":[1], "extra":"x"}"#;
    let local_payload = r#"{"class":"Local::Job","args":[2]}"#;
    let working = |queue: &str, payload: &str| -> String {
        format!(r#"{{"queue":"{queue}","run_at":"2026-11-21T12:18:29Z","payload":{payload}}}"#)
    };
    let a = "deadhost:4242:q".to_string(); // heartbeat 400 s old, working
    let b = "ghost:77:q".to_string(); // heartbeat only, 400 s old
    let cc = format!("{host}:{dead}:r,q"); // same host, dead pid, same queue set, working
    let dd = format!("{host}:{dead}:q"); // same host, dead pid, other queues
    let e = "freshhost:99:q".to_string(); // other host, fresh heartbeat, working
    let f = format!("{host}:{}:q,r", live.worker_pid()); // same host, live Resque-looking pid
    let g = format!("{host}:{}:q,r", sleeper.0.id()); // same host, live non-Resque pid
    let g2 = format!("{host}:{}+1:r,q", sleeper.0.id()); // node-resque MultiWorker form
                                                         // Same host, live pid of a locketd process that is not a registered worker (the other
                                                         // daemon's master, `locketd master: …`): a leftover id whose pid was reused.
    let h = format!("{host}:{}:q,r", live.pid());
    let i = "otherhost:5:q,r".to_string(); // other host, no heartbeat
    for w in [&a, &cc, &dd, &e, &f, &g, &g2, &h, &i] {
        run(&mut c, &["SADD", "resque:workers", w]);
        run(
            &mut c,
            &[
                "SET",
                &format!("resque:worker:{w}:started"),
                "2026-11-21 12:18:29 +0000",
            ],
        );
    }
    let e_record = working("q", r#"{"class":"Fresh","args":[]}"#);
    run(
        &mut c,
        &[
            "SET",
            &format!("resque:worker:{a}"),
            &working("q", dead_payload),
        ],
    );
    run(
        &mut c,
        &[
            "SET",
            &format!("resque:worker:{cc}"),
            &working("r", local_payload),
        ],
    );
    run(&mut c, &["SET", &format!("resque:worker:{e}"), &e_record]);
    // Heartbeats in several zones; "now" is Redis TIME.
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            &a,
            &iso8601(now - 400, 120),
        ],
    );
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            &b,
            &iso8601(now - 400, 0),
        ],
    );
    run(
        &mut c,
        &["HSET", "resque:workers:heartbeat", &cc, &iso8601(now, 0)],
    );
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            &e,
            &iso8601(now - 10, -300),
        ],
    );

    let mut d = Daemon::start(&redis, &config("q,r", "", "", &work.fallback()), &[]);
    let own = wait_registered(&mut c, "resque", &d);

    // Resque's rules, except that the live non-Resque, non-locketd pid (g, g2) is spared.
    let want: BTreeSet<String> = [own.clone(), dd, e.clone(), f, g.clone(), g2.clone(), i].into();
    assert_eq!(smembers(&mut c, "resque:workers"), want);
    for kept in [&g, &g2] {
        assert!(
            exists(&mut c, &format!("resque:worker:{kept}:started")),
            "{kept}"
        );
    }
    let beats: BTreeSet<String> = q(&mut c, &["HKEYS", "resque:workers:heartbeat"]);
    assert_eq!(beats, BTreeSet::from([own.clone(), e.clone()]));
    for gone in [&a, &cc, &h] {
        assert!(!exists(&mut c, &format!("resque:worker:{gone}")), "{gone}");
        assert!(
            !exists(&mut c, &format!("resque:worker:{gone}:started")),
            "{gone}"
        );
    }
    assert_eq!(get(&mut c, &format!("resque:worker:{e}")), Some(e_record));

    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 2, "{failed:?}");
    let by_worker = |w: &str| -> (String, Value) {
        let text = failed
            .iter()
            .find(|r| json(r)["worker"] == w)
            .unwrap_or_else(|| panic!("no failure record for {w}: {failed:?}"))
            .clone();
        let v = assert_record_shape(&text);
        (text, v)
    };
    let (text, v) = by_worker(&a);
    assert_eq!(v["exception"], "Resque::PruneDeadWorkerDirtyExit");
    assert_eq!(
        v["error"],
        format!("Worker {a} did not gracefully exit while processing Dead::Job")
    );
    assert_eq!(v["queue"], "q");
    assert_eq!(v["backtrace"], serde_json::json!([]));
    assert!(
        text.contains(&format!(r#""payload":{dead_payload},"#)),
        "{text}"
    );
    let (_, v) = by_worker(&cc);
    assert_eq!(v["exception"], "Resque::DirtyExit");
    assert_eq!(v["error"], "Job still being processed");
    assert_eq!(v["queue"], "r");
    assert_eq!(
        get(&mut c, "resque:stat:failed"),
        None,
        "pruning is not a job failure"
    );

    // The pruning mutex: SET <own id> EX 60 NX.
    assert_eq!(
        get(&mut c, "resque:pruning_dead_workers_in_progress"),
        Some(own)
    );
    let ttl: i64 = q(&mut c, &["TTL", "resque:pruning_dead_workers_in_progress"]);
    assert!((1..=60).contains(&ttl), "pruning lock TTL {ttl}");
    assert_eq!(quit(&mut d).code(), Some(0));
    drop(live);
}

// resque-protocol.md §13 item 17
#[test]
fn pruning_is_skipped_while_another_worker_holds_the_pruning_lock() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let holder = "rubyhost:1:q";
    run(
        &mut c,
        &[
            "SET",
            "resque:pruning_dead_workers_in_progress",
            holder,
            "EX",
            "60",
        ],
    );
    let now = redis_time(&mut c);
    let dead = "deadhost:4242:q";
    let record = r#"{"queue":"q","run_at":"2026-11-21T12:18:29Z","payload":{"class":"Dead::Job","args":[1]}}"#;
    run(&mut c, &["SADD", "resque:workers", dead]);
    run(&mut c, &["SET", &format!("resque:worker:{dead}"), record]);
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            dead,
            &iso8601(now - 400, 0),
        ],
    );

    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let own = wait_registered(&mut c, "resque", &d);
    assert_eq!(
        smembers(&mut c, "resque:workers"),
        BTreeSet::from([own, dead.to_string()])
    );
    let beat: Option<String> = q(&mut c, &["HGET", "resque:workers:heartbeat", dead]);
    assert!(beat.is_some());
    assert_eq!(
        get(&mut c, &format!("resque:worker:{dead}")).as_deref(),
        Some(record)
    );
    assert_eq!(q::<i64>(&mut c, &["LLEN", "resque:failed"]), 0);
    assert_eq!(
        get(&mut c, "resque:pruning_dead_workers_in_progress").as_deref(),
        Some(holder)
    );
    assert_eq!(quit(&mut d).code(), Some(0));
}

/// Every key and its value, rendered comparably (sets and hashes sorted).
fn dump(c: &mut redis::Connection, keys: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for k in keys {
        let kind: String = q(c, &["TYPE", k]);
        let value = match kind.as_str() {
            "string" => get(c, k).unwrap_or_default(),
            "set" => format!("{:?}", smembers(c, k)),
            "hash" => format!("{:?}", q::<BTreeMap<String, String>>(c, &["HGETALL", k])),
            "list" => format!("{:?}", lrange(c, k)),
            other => other.to_string(),
        };
        out.insert(k.clone(), format!("{kind}: {value}"));
    }
    out
}

// resque-protocol.md §13 item 18
#[test]
fn foreign_worker_entries_neither_crash_locketd_nor_get_deleted() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let ids = [
        "nodehost:300+1:q",
        "gohost:301-0:q",
        "gohost:301-poller:q",
        "rubyhost:302:a:b",
        "shorthost:1",
        "emptyhost:2:",
    ];
    for id in ids {
        run(&mut c, &["SADD", "resque:workers", id]);
    }
    let strings = [
        (
            "resque:worker:ping:nodehost:300",
            r#"{"time":1795263564,"name":"nodehost:300","queues":"q"}"#,
        ),
        (
            "resque:worker:nodehost:300+1:q",
            r#"{"run_at":"Sat Nov 21 2026 12:19:23 GMT+0000 (Coordinated Universal Time)","worker":"nodehost:300","payload":{"class":"X","queue":"q","args":{}},"queue":"q"}"#,
        ),
        ("resque:worker:nodehost:300+1:q:started", "1795263564"),
        (
            "resque:worker:gohost:301-0:q",
            r#"{"queue":"q","run_at":"2026-11-21T12:19:25.123456789-08:00","payload":{"class":"G","args":[1]}}"#,
        ),
        (
            "resque:worker:gohost:301-0:q:started",
            "2026-11-21 12:19:25.1 -0800 PST m=+0.01",
        ),
        ("resque:stat:processed:gohost:301-0:q", "0"),
        ("resque:worker:rubyhost:302:a:b", "not json at all"),
    ];
    for (k, v) in strings {
        run(&mut c, &["SET", k, v]);
    }
    let now = redis_time(&mut c);
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            "rubyhost:302:a:b",
            &iso8601(now, 60),
        ],
    );
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            "junkhost:1:q",
            "not a time",
        ],
    );
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            "junkhost:2:q",
            "1795263564",
        ],
    );

    let mut keys: Vec<String> = q(&mut c, &["KEYS", "*"]);
    keys.sort();
    let before = dump(&mut c, &keys);

    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let own = wait_registered(&mut c, "resque", &d);
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":[1]}"#);
    wait_until(WAIT, "a job processed among foreign entries", || {
        get_int(&mut c, "resque:stat:processed") == 1
    });
    assert!(d.is_running());
    let during = smembers(&mut c, "resque:workers");
    assert!(during.contains(&own));
    assert_eq!(quit(&mut d).code(), Some(0));
    assert_eq!(dump(&mut c, &keys), before, "foreign entries changed");
}

// ---------------------------------------------------------------------------------------------
// Stats and failures

// resque-protocol.md §13 items 19, 20
#[test]
fn stats_count_success_failure_and_killed_jobs_like_resque() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    push(&mut c, "resque", "q", r#"{"class":"Rec","args":[1]}"#);
    push(&mut c, "resque", "q", r#"{"class":"Fail","args":[2]}"#);
    push(&mut c, "resque", "q", r#"{"class":"Kill","args":[3]}"#);
    wait_until(WAIT, "three jobs processed", || {
        get_int(&mut c, "resque:stat:processed") == 3
    });
    assert_eq!(
        get_int(&mut c, "resque:stat:failed"),
        1,
        "a killed job is not a failure"
    );
    assert_eq!(get_int(&mut c, &format!("resque:stat:processed:{id}")), 3);
    assert_eq!(get_int(&mut c, &format!("resque:stat:failed:{id}")), 1);

    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert_eq!(
        assert_record_shape(&failed[0])["exception"],
        "Locket::CommandFailed"
    );
    let v = assert_record_shape(&failed[1]);
    let pid = read_lossy(&work.path("kill.pid")).trim().to_string();
    assert_eq!(v["exception"], "Resque::DirtyExit");
    assert_eq!(
        v["error"],
        format!("Child process received unhandled signal pid {pid} SIGKILL (signal 9)")
    );
    // As Resque's: empty, even though the handler wrote to stderr before it died.
    assert_eq!(v["backtrace"], serde_json::json!([]));

    assert_eq!(quit(&mut d).code(), Some(0));
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 3);
    assert_eq!(get_int(&mut c, "resque:stat:failed"), 1);
    assert!(!exists(&mut c, &format!("resque:stat:processed:{id}")));
    assert!(!exists(&mut c, &format!("resque:stat:failed:{id}")));
}

// resque-protocol.md §13 items 21, 24 (a command that exits non-zero)
#[test]
fn failure_record_has_resque_fields_in_order_and_formats() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    let id = wait_registered(&mut c, "resque", &d);
    let payload = r#"{"class":"Fail","args":[7, 1.0],"id":"x"}"#;
    push(&mut c, "resque", "q", payload);
    wait_until(WAIT, "one failure", || {
        q::<i64>(&mut c, &["LLEN", "resque:failed"]) == 1
    });
    let text: String = q(&mut c, &["LINDEX", "resque:failed", "0"]);
    let v = assert_record_shape(&text);
    assert_eq!(
        json_keys(&text),
        RECORD_KEYS,
        "no extra fields for a JSON payload"
    );
    let error = v["error"].as_str().expect("error").to_string();
    assert!(
        error.contains("status 3"),
        "error names the exit status: {error}"
    );
    assert!(
        error.contains("boom: bad thing 7"),
        "error names the last stderr line: {error}"
    );
    let expected = format!(
        r#"{{"failed_at":{},"payload":{payload},"exception":"Locket::CommandFailed","error":{},"backtrace":["step one failed","boom: bad thing 7"],"worker":{},"queue":"q"}}"#,
        serde_json::to_string(&v["failed_at"]).unwrap(),
        serde_json::to_string(&error).unwrap(),
        serde_json::to_string(&id).unwrap(),
    );
    assert_eq!(text, expected);
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 22
#[test]
fn failures_are_only_appended_to_the_failed_list() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let existing = [
        r#"{"failed_at":"2026/11/21 12:18:24 UTC","payload":{"class":"BoomJob","args":[7]},"exception":"ArgumentError","error":"bad thing 7","backtrace":["/app/jobs.rb:5:in `perform'"],"worker":"vm:9397:high,low","queue":"low"}"#,
        r#"{"worker":"nodehost:300","queue":"q","payload":{"class":"X","queue":"q","args":[]},"exception":"TypeError","error":"x","backtrace":null,"failed_at":"Sat Nov 21 2026 12:19:23 GMT+0000 (Coordinated Universal Time)"}"#,
        "",
    ];
    for r in existing {
        run(&mut c, &["RPUSH", "resque:failed", r]);
    }
    push(&mut c, "resque", "q", r#"{"class":"Fail","args":[1]}"#);
    push(&mut c, "resque", "q", r#"{"class":"Nope","args":[2]}"#);
    let mut d = Daemon::start(
        &redis,
        &config("q", "", "", &work.class("Fail", "")),
        &["--interval", "0"],
    );
    wait_exit_ok(&mut d);
    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 5, "{failed:?}");
    assert_eq!(
        failed[..3],
        existing,
        "existing elements must stay as they were"
    );
    assert_eq!(
        assert_record_shape(&failed[3])["payload"]["args"],
        serde_json::json!([1])
    );
    assert_eq!(assert_record_shape(&failed[4])["exception"], "NameError");
    assert!(!exists(&mut c, "resque:failed_queues"));
}

// resque-protocol.md §13 items 22 (redis_multi_queue backend), 17 (pruned jobs go through the
// configured backend, as Ruby's `unregister_worker` -> `Failure.create` does)
#[test]
fn redis_multi_queue_backend_writes_per_queue_failed_lists() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let old = r#"{"failed_at":"2026/11/21 12:18:24 UTC","payload":{"class":"B","args":[]},"exception":"E","error":"e","backtrace":[],"worker":"h:1:q","queue":"q"}"#;
    run(&mut c, &["RPUSH", "resque:failed", old]);
    run(&mut c, &["RPUSH", "resque:mq_failed", old]);
    push(&mut c, "resque", "mq", r#"{"class":"Fail","args":[1]}"#);
    push(&mut c, "resque", "mq", r#"{"class":"Fail","args":[2]}"#);
    // A dead worker (heartbeat 400 s old) that was working on a job from queue "other".
    let dead = "deadhost:4242:other";
    let record = r#"{"queue":"other","run_at":"2026-11-21T12:18:29Z","payload":{"class":"Dead::Job","args":[9]}}"#;
    let now = redis_time(&mut c);
    run(&mut c, &["SADD", "resque:workers", dead]);
    run(&mut c, &["SET", &format!("resque:worker:{dead}"), record]);
    run(
        &mut c,
        &[
            "HSET",
            "resque:workers:heartbeat",
            dead,
            &iso8601(now - 400, 0),
        ],
    );
    let mut d = Daemon::start(
        &redis,
        &config(
            "mq",
            "failure_backend = \"redis_multi_queue\"",
            "",
            &work.fallback(),
        ),
        &["--interval", "0"],
    );
    wait_exit_ok(&mut d);
    let per_queue = lrange(&mut c, "resque:mq_failed");
    assert_eq!(per_queue.len(), 3, "{per_queue:?}");
    assert_eq!(per_queue[0], old);
    for (i, r) in per_queue[1..].iter().enumerate() {
        let v = assert_record_shape(r);
        assert_eq!(v["queue"], "mq");
        assert_eq!(v["payload"]["args"], serde_json::json!([i + 1]));
    }
    let pruned = lrange(&mut c, "resque:other_failed");
    assert_eq!(pruned.len(), 1, "the pruned worker's job: {pruned:?}");
    let v = assert_record_shape(&pruned[0]);
    assert_eq!(v["exception"], "Resque::PruneDeadWorkerDirtyExit");
    assert_eq!(v["worker"], dead);
    assert_eq!(
        smembers(&mut c, "resque:failed_queues"),
        BTreeSet::from(["mq_failed".to_string(), "other_failed".to_string()])
    );
    assert_eq!(
        lrange(&mut c, "resque:failed"),
        [old],
        "failed is not written"
    );
    assert_eq!(get_int(&mut c, "resque:stat:failed"), 2);
}

// resque-protocol.md §13 item 23
#[test]
fn resque_web_retry_of_a_locketd_failure_runs_the_job_again() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let mut d = Daemon::start(&redis, &config("q", "", "", &work.fallback()), &[]);
    wait_registered(&mut c, "resque", &d);
    push(
        &mut c,
        "resque",
        "q",
        r#"{"class":"Flaky","args":[5,"x",1.0],"id":"n1"}"#,
    );
    wait_until(WAIT, "the first attempt failed", || {
        q::<i64>(&mut c, &["LLEN", "resque:failed"]) == 1
    });

    // Resque::Failure::Redis.requeue(0), as resque-web's Retry does it.
    let record: String = q(&mut c, &["LINDEX", "resque:failed", "0"]);
    let v = json(&record);
    let retried = format!(
        r#"{},"retried_at":"{}"}}"#,
        record.strip_suffix('}').expect("object"),
        failed_at_text(now_secs())
    );
    run(&mut c, &["LSET", "resque:failed", "0", &retried]);
    let queue = v["queue"].as_str().expect("queue is a string");
    let class = v["payload"]["class"]
        .as_str()
        .expect("payload.class is a string");
    let args = v["payload"]["args"]
        .as_array()
        .expect("payload.args is an array");
    let again = format!(
        r#"{{"class":{},"args":{}}}"#,
        serde_json::to_string(class).unwrap(),
        serde_json::to_string(args).unwrap()
    );
    push(&mut c, "resque", queue, &again);

    work.wait_jobs(2);
    wait_until(WAIT, "the retried job processed", || {
        get_int(&mut c, "resque:stat:processed") == 2
    });
    assert_eq!(
        work.class_args()[1],
        ("Flaky".to_string(), r#"[5,"x",1.0]"#.to_string())
    );
    assert_eq!(work.stdin_lines()[1], again);
    assert_eq!(
        get_int(&mut c, "resque:stat:failed"),
        1,
        "the retry succeeded"
    );
    assert_eq!(
        lrange(&mut c, "resque:failed"),
        [retried],
        "record left as resque-web set it"
    );
    assert_eq!(quit(&mut d).code(), Some(0));
}

// resque-protocol.md §13 item 24
#[test]
fn unknown_class_timeout_and_unstartable_command_are_recorded_as_failures() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let work = Work::new();
    let classes = [
        work.class("Slow", "timeout = \"300ms\""),
        "[classes.\"Missing\"]\ncommand = [\"/nonexistent/locketd-handler\"]\n".to_string(),
    ]
    .concat();
    push(
        &mut c,
        "resque",
        "q",
        r#"{"class":"Nope::Missing","args":[1]}"#,
    );
    push(&mut c, "resque", "q", r#"{"class":"Slow","args":[]}"#);
    push(&mut c, "resque", "q", r#"{"class":"Missing","args":[]}"#);
    let mut d = Daemon::start(&redis, &config("q", "", "", &classes), &["--interval", "0"]);
    wait_exit_ok(&mut d);
    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 3, "{failed:?}");
    let v: Vec<Value> = failed.iter().map(|r| assert_record_shape(r)).collect();
    assert_eq!(v[0]["exception"], "NameError");
    let error = v[0]["error"].as_str().unwrap();
    assert!(
        error.contains("uninitialized constant Nope::Missing"),
        "{error}"
    );
    assert_eq!(
        v[0]["payload"],
        serde_json::json!({"class":"Nope::Missing","args":[1]})
    );
    assert_eq!(v[1]["exception"], "Locket::Timeout");
    assert_eq!(v[1]["payload"]["class"], "Slow");
    assert_eq!(v[2]["exception"], "Locket::HandlerError");
    assert_eq!(work.jobs().len(), 1, "only the Slow job reached a command");
    assert_eq!(get_int(&mut c, "resque:stat:failed"), 3);
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 3);
}

// resque-protocol.md §13 item 24 (an in-process handler's error)
#[tokio::test]
async fn in_process_handler_error_becomes_the_failure_exception_and_message() {
    let redis = RedisServer::start();
    let mut c = redis.sync_conn();
    let payload = r#"{"class":"BoomJob","args":[7]}"#;
    push(&mut c, "resque", "low", payload);
    let mut handlers = locketd::handler::Handlers::new();
    handlers.insert("BoomJob", |job: locketd::handler::JobContext| async move {
        Err(locketd::resque::failure::JobFailure::new(
            "ArgumentError",
            format!("bad thing {}", job.args[0]),
        )
        .with_backtrace(vec!["/app/jobs.rb:5:in `perform'".to_string()]))
    });
    let mut cfg = locketd::config::Config::parse("queues = \"high,low\"\ninterval = 0", "compat")
        .expect("config");
    cfg.redis = redis.url();
    let worker = locketd::worker::Worker::start(cfg, handlers)
        .await
        .expect("start");
    let id = worker.worker_id().to_string();
    let reason = tokio::time::timeout(WAIT, worker.run(Default::default()))
        .await
        .expect("drained in time")
        .expect("run");
    assert_eq!(reason, locketd::worker::StopReason::Drained);
    let failed = lrange(&mut c, "resque:failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    let v = assert_record_shape(&failed[0]);
    assert_eq!(
        failed[0],
        format!(
            r#"{{"failed_at":"{}","payload":{payload},"exception":"ArgumentError","error":"bad thing 7","backtrace":["/app/jobs.rb:5:in `perform'"],"worker":"{id}","queue":"low"}}"#,
            v["failed_at"].as_str().unwrap()
        )
    );
    assert_eq!(get_int(&mut c, "resque:stat:failed"), 1);
    assert_eq!(get_int(&mut c, "resque:stat:processed"), 1);
}
