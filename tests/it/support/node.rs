//! node-resque interop: the scripts in `tests/node`.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{manifest_dir, read_lossy, POLL_INTERVAL};

/// Upper bound for one `npm ci` / `npm install`.
const NPM_TIMEOUT: Duration = Duration::from_secs(300);
/// Upper bound for waiting on another installer holding the lock.
const LOCK_TIMEOUT: Duration = Duration::from_secs(360);

/// `tests/node`.
pub fn node_dir() -> PathBuf {
    manifest_dir().join("tests").join("node")
}

/// Returns `tests/node`, first installing its `node_modules` (npm ci, or
/// npm install without a lockfile) if node-resque is missing. Parallel
/// callers, in this process or others, serialize on a file lock so that
/// only one installs.
pub fn node_resque_dir() -> PathBuf {
    let dir = node_dir();
    if installed(&dir) {
        return dir;
    }
    // Outside node_modules: `npm ci` deletes that directory.
    let lock_path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("locketd-node-install.lock");
    let _lock = FileLock::acquire(&lock_path, LOCK_TIMEOUT);
    if installed(&dir) {
        return dir;
    }
    let subcommand: &[&str] = if dir.join("package-lock.json").exists() {
        &["ci", "--no-audit", "--no-fund"]
    } else {
        &["install", "--no-audit", "--no-fund"]
    };
    let out_path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("locketd-npm-install.log");
    let out = File::create(&out_path).expect("create npm log");
    let err = out.try_clone().expect("clone npm log");
    let mut child = Command::new("npm")
        .args(subcommand)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn npm (is npm installed?): {e}"));
    let status = wait_bounded(&mut child, NPM_TIMEOUT);
    let output = read_lossy(&out_path);
    match status {
        Some(s) if s.success() && installed(&dir) => dir,
        Some(s) => panic!(
            "npm {subcommand:?} in {} failed ({s}):\n{output}",
            dir.display()
        ),
        None => panic!(
            "npm {subcommand:?} in {} timed out after {NPM_TIMEOUT:?}:\n{output}",
            dir.display()
        ),
    }
}

fn installed(dir: &Path) -> bool {
    dir.join("node_modules/node-resque/package.json").is_file()
}

/// Runs `node tests/node/<script> <args>` (cwd `tests/node`, extra `env`),
/// returning status, stdout and stderr. Kills node and panics (with its
/// output so far) if it runs longer than `timeout`.
pub fn run_node(
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> (ExitStatus, String, String) {
    let dir = node_resque_dir();
    let mut cmd = Command::new("node");
    cmd.arg(dir.join(script))
        .args(args)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn node {script} (is node installed?): {e}"));
    let stdout = drain(child.stdout.take().expect("stdout pipe"));
    let stderr = drain(child.stderr.take().expect("stderr pipe"));
    let status = wait_bounded(&mut child, timeout);
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    match status {
        Some(status) => (status, stdout, stderr),
        None => panic!(
            "node {script} {args:?} timed out after {timeout:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        ),
    }
}

/// Runs `node tests/node/<script> '<config as JSON>'`, asserts it exited 0
/// and returns the JSON object on the last non-empty stdout line.
pub fn run_node_json(
    script: &str,
    config: &serde_json::Value,
    timeout: Duration,
) -> serde_json::Value {
    let arg = config.to_string();
    let (status, stdout, stderr) = run_node(script, &[&arg], &[], timeout);
    assert!(
        status.success(),
        "node {script} {arg} failed ({status})\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_else(|| panic!("node {script} printed nothing\n--- stderr ---\n{stderr}"));
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!("node {script} printed no JSON ({e}): {line}\n--- stderr ---\n{stderr}")
    })
}

/// Runs `cmd` (stdin closed, stdout and stderr captured) for at most `timeout`; panics, with
/// its output, when it runs longer (it is killed and reaped). For the other languages' client
/// tests (tests/it/ruby_shim.rs).
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> (ExitStatus, String, String) {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let stdout = drain(child.stdout.take().expect("stdout pipe"));
    let stderr = drain(child.stderr.take().expect("stderr pipe"));
    let status = wait_bounded(&mut child, timeout);
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    match status {
        Some(status) => (status, stdout, stderr),
        None => panic!(
            "{cmd:?} timed out after {timeout:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        ),
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Waits up to `timeout` for `child`; on timeout kills and reaps it and
/// returns `None`.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// An exclusive `flock` on a file, released on drop.
struct FileLock {
    file: File,
}

impl FileLock {
    fn acquire(path: &Path, timeout: Duration) -> FileLock {
        use std::os::fd::AsRawFd;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("create lock dir");
        }
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("open lock {}: {e}", path.display()));
        let deadline = Instant::now() + timeout;
        loop {
            // SAFETY: flock(2) on a descriptor we own.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return FileLock { file };
            }
            if Instant::now() >= deadline {
                panic!("could not lock {} within {timeout:?}", path.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: flock(2) on a descriptor we own.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}
