//! A log sink that stops reading (issue 11, finding 5; A-10, L-9, NEVER-1): the daemon's
//! stderr is a FIFO that nobody reads. Logging must never block the runtime that extends the
//! job's lock, so the lock stays held while its job runs and a second job on the same lock,
//! in another daemon, starts only after the first ended.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::daemon::{cfg, workdir, R};
use crate::support::{read_lossy, wait_until, write_script, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(40);

/// `(args, start ns, end ns)` of each run in a handler log.
fn runs(log: &std::path::Path) -> Vec<(String, u128, Option<u128>)> {
    let mut out: Vec<(String, u128, Option<u128>)> = Vec::new();
    for line in read_lossy(log).lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["start", t, a] => out.push((a.to_string(), t.parse().unwrap(), None)),
            ["end", t, a] => {
                if let Some(r) = out.iter_mut().find(|r| r.0 == *a) {
                    r.2 = Some(t.parse().unwrap());
                }
            }
            _ => {}
        }
    }
    out
}

#[test]
fn a_stderr_nobody_reads_does_not_stop_the_lock_heartbeat() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    // The first job floods its stderr (which the daemon logs line by line, filling the FIFO),
    // then runs on for 5 s, well past lock_ttl (2 s).
    let h = write_script(
        work.path(),
        "job.sh",
        &format!(
            "cat >/dev/null\nA=$(echo \"$LOCKETD_ARGS\" | tr -d '[]\"')\n\
             echo \"start $(date +%s%N) $A\" >> {log}\n\
             if [ \"$A\" = first ]; then head -c 400000 /dev/zero | tr '\\0' x | fold -w 100 >&2; sleep 5; fi\n\
             echo \"end $(date +%s%N) $A\" >> {log}\n",
            log = log.display()
        ),
    );
    let config = cfg("q").class("Job", &h, "lock = \"L\"").render();
    let conf = work.path().join("stalled.toml");
    std::fs::write(&conf, &config).unwrap();
    let fifo = work.path().join("stderr.fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    // Opened for reading (so the daemon's open does not wait) and never read.
    let _reader = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let writer = File::options().write(true).open(&fifo).unwrap();
    let mut stalled = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .arg("--config")
        .arg(&conf)
        .arg("--redis")
        .arg(redis.url())
        .env("RUST_LOG", "locketd=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(writer)
        .process_group(0)
        .spawn()
        .unwrap();
    let group = stalled.id() as i32;
    r.push("q", r#"{"class":"Job","args":["first"]}"#);
    wait_until(LONG, "the first job started", || runs(&log).len() == 1);
    let mut other = Daemon::start(&redis, &config, &[]);
    r.push("q", r#"{"class":"Job","args":["second"]}"#);
    let ended = |log: &std::path::Path| {
        runs(log)
            .iter()
            .find(|r| r.0 == "second")
            .is_some_and(|r| r.2.is_some())
    };
    wait_until(LONG, "the second job ran", || ended(&log));
    let all = runs(&log);
    // SAFETY: plain kill(2) of the process group this test started.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let _ = stalled.wait();
    other.kill();
    let first = all.iter().find(|r| r.0 == "first").unwrap();
    let second = all.iter().find(|r| r.0 == "second").unwrap();
    let first_end = first.2.unwrap_or_else(|| {
        panic!("the second job started while the first still ran (its lock lapsed): {all:?}")
    });
    assert!(
        first_end <= second.1,
        "the two runs under lock L overlap: {all:?}"
    );
}
