//! Shared test support: real processes, no mocks.
//!
//! * [`RedisServer`]: a private `redis-server` on a free loopback port with
//!   its own temporary directory, killed on drop.
//! * [`Daemon`]: the real `locketd` binary in its own process group; the
//!   whole group is killed on drop.
//! * [`ReplyProxy`]: a proxy between the daemon and a `redis-server` that tampers with the
//!   reply to a matching command.
//! * [`wait_until`] / [`wait_until_async`]: bounded polling.
//! * [`write_script`]: executable shell scripts for command handlers.
//! * [`node_resque_dir`] / [`run_node`] / [`run_node_json`]: node-resque
//!   interop scripts in `tests/node`.
#![allow(dead_code, unused_imports)]

mod daemon;
mod node;
pub mod panic_echo;
mod redis_server;
mod reply_proxy;
mod sentinel;

pub use daemon::{Daemon, DaemonBuilder};
pub use node::{node_dir, node_resque_dir, run_bounded, run_node, run_node_json};
pub use redis_server::RedisServer;
pub use reply_proxy::{is_fcall_of, ReplyProxy, Tamper};
pub use sentinel::{SentinelSetup, SERVICE as SENTINEL_SERVICE};

use std::fs;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Blocks SIGCHLD in the calling thread (and so in the threads it starts) and has one idle
/// thread take it instead. The harness's blocking Redis connections have read and write
/// timeouts, and a socket call with a timeout fails with EINTR when a signal handler runs on
/// its thread, whatever SA_RESTART says (signal(7)); tokio's child reaping, used in process by
/// some tests, installs a SIGCHLD handler, and every child of this process (redis-server, a
/// daemon, a client script) sends SIGCHLD when it ends. Seen as "Interrupted system call" from
/// a test's Redis call. Children start with an empty mask (std's `Command` resets it).
pub fn calm_sigchld() {
    fn set(how: libc::c_int) {
        // SAFETY: a sigset_t filled by sigemptyset/sigaddset, then pthread_sigmask on the
        // calling thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            libc::pthread_sigmask(how, &set, std::ptr::null_mut());
        }
    }
    static SINK: std::sync::Once = std::sync::Once::new();
    SINK.call_once(|| {
        std::thread::Builder::new()
            .name("sigchld-sink".into())
            .spawn(|| {
                set(libc::SIG_UNBLOCK);
                loop {
                    std::thread::park();
                }
            })
            .expect("spawn the SIGCHLD thread");
    });
    set(libc::SIG_BLOCK);
}

/// Polling interval of [`wait_until`] and [`wait_until_async`].
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The crate root (`CARGO_MANIFEST_DIR`).
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Polls `f` every 20 ms until it returns true; panics with `what` once
/// `timeout` has passed. `f` is always tried at least once, and once more
/// right at the deadline.
#[track_caller]
pub fn wait_until(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return;
        }
        let now = Instant::now();
        if now >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        std::thread::sleep(POLL_INTERVAL.min(deadline - now));
    }
}

/// Async variant of [`wait_until`] (needs a tokio runtime with timers).
/// Each call of `f` is itself bounded by the remaining time.
pub async fn wait_until_async<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        // A probe that hangs past the deadline counts as "not yet".
        let ok = tokio::time::timeout(remaining.max(POLL_INTERVAL), f())
            .await
            .unwrap_or(false);
        if ok {
            return;
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(POLL_INTERVAL.min(deadline - now)).await;
    }
}

/// Writes an executable (0755) shell script `dir/name` and returns its path.
/// A `#!/bin/sh` line is added unless `body` starts with `#!`.
pub fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("create script dir");
    }
    let mut text = String::new();
    if !body.starts_with("#!") {
        text.push_str("#!/bin/sh\n");
    }
    text.push_str(body);
    if !text.ends_with('\n') {
        text.push('\n');
    }
    // This process must never hold a writable descriptor of the final
    // file: another thread's fork (any Command::spawn) would inherit it
    // until its exec, and executing the script meanwhile fails with
    // ETXTBSY ("Text file busy"). So write a temporary file here and let a
    // `cp` child process create the final one.
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let file_name = path.file_name().expect("script name").to_string_lossy();
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_file_name(format!(".{file_name}.{}.{seq}.tmp", std::process::id()));
    fs::write(&tmp, text).expect("write script");
    let status = Command::new("cp")
        .arg("--")
        .arg(&tmp)
        .arg(&path)
        .stdin(Stdio::null())
        .status()
        .expect("spawn cp");
    assert!(
        status.success(),
        "cp {} {}: {status}",
        tmp.display(),
        path.display()
    );
    let _ = fs::remove_file(&tmp);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod script");
    path
}

/// Reads a file as (lossy) UTF-8; a missing file reads as "".
pub fn read_lossy(path: &Path) -> String {
    match fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    }
}

/// The most runs at once in a handler log whose lines `start ...` and `end ...` were appended
/// in the order they happened.
pub fn most_at_once(log: &str) -> usize {
    let (mut cur, mut max) = (0i64, 0i64);
    for l in log.lines() {
        if l.starts_with("start ") {
            cur += 1;
        } else if l.starts_with("end ") {
            cur -= 1;
        }
        max = max.max(cur);
    }
    max as usize
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// State letter, parent pid and process group of a live process, read from
/// `/proc/<pid>/stat`; `None` if there is no such process.
pub fn proc_stat(pid: i32) -> Option<(char, i32, i32)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid pgrp ..." — comm may contain spaces and ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, ppid, pgrp))
}

/// True if `pid` exists, is not a zombie and is not already doomed by a pending SIGKILL.
pub fn pid_alive(pid: i32) -> bool {
    matches!(proc_stat(pid), Some((state, _, _)) if state != 'Z' && state != 'X')
        && !sigkill_pending(pid)
}

/// Whether a SIGKILL is pending for `pid` (its own or its thread group's). Such a process
/// runs no more of its own code: it is only waiting for the CPU to finish its exit, which on
/// a loaded machine can take a while after the killer moved on.
pub fn sigkill_pending(pid: i32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status.lines().any(|l| {
        let mask = l
            .strip_prefix("SigPnd:")
            .or_else(|| l.strip_prefix("ShdPnd:"));
        mask.and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & (1 << (libc::SIGKILL - 1)) != 0)
    })
}

/// Live processes (not zombies, not doomed by a pending SIGKILL) whose process group is `pgid`, sorted.
pub fn process_group_members(pgid: i32) -> Vec<i32> {
    let mut pids: Vec<i32> = fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&pid| {
                    matches!(proc_stat(pid), Some((state, _, pgrp))
                        if pgrp == pgid && state != 'Z' && state != 'X')
                        && !sigkill_pending(pid)
                })
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids
}

/// Live (non-zombie) direct children of `pid`, sorted.
pub fn child_pids(pid: i32) -> Vec<i32> {
    let mut pids: Vec<i32> = fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&p| {
                    matches!(proc_stat(p), Some((state, ppid, _))
                        if ppid == pid && state != 'Z' && state != 'X')
                })
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids
}

/// How many children of `pid` are zombies (exited, not reaped by it).
pub fn zombie_children(pid: i32) -> usize {
    fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&p| matches!(proc_stat(p), Some(('Z', ppid, _)) if ppid == pid))
                .count()
        })
        .unwrap_or_default()
}

/// `calls=` of `cmdstat_<command>` in an `INFO commandstats` reply (0 when absent).
pub fn command_calls(info: &str, command: &str) -> i64 {
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// How many script calls the server ran, by `EVALSHA` or by `FCALL` of the job-path library
/// (src/store/fcall.rs), from an `INFO commandstats` reply.
pub fn script_calls(info: &str) -> i64 {
    let n = command_calls(info, "evalsha") + command_calls(info, "fcall");
    assert!(n > 0, "no script calls in INFO commandstats:\n{info}");
    n
}

/// A lock's holders as a flat list token, deadline (ms), whatever its kind
/// (locking-semantics.md L-1, L-1a): the one holder of a limit-1 lock, a STRING holding its
/// info (deadline = server now + PTTL), or a larger lock's ZSET members. Run with
/// `EVAL LOCK_HOLDERS_LUA 1 <lock key>`.
pub const LOCK_HOLDERS_LUA: &str = r"if redis.call('TYPE', KEYS[1])['ok'] == 'string' then
  local info = cjson.decode(redis.call('GET', KEYS[1]))
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return {info['token'], tostring(now + redis.call('PTTL', KEYS[1]))}
end
return redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')";

/// A holder's info JSON: a limit-1 lock's own value, or its `lockinfo` field. Run with
/// `EVAL LOCK_INFO_LUA 2 <lock key> <lockinfo key> <token>`.
pub const LOCK_INFO_LUA: &str = r"if redis.call('TYPE', KEYS[1])['ok'] == 'string' then
  return redis.call('GET', KEYS[1])
end
return redis.call('HGET', KEYS[2], ARGV[1])";
