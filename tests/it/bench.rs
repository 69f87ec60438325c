//! The benchmark harness (`locketd-bench`) on a tiny N: it runs the real binary against its own
//! redis-server and prints figures. Speed itself is reported by the harness, never asserted here.
//! Run: `cargo test --test it bench::`.

use std::process::Command;
use std::time::Duration;

use crate::support::wait_until;

/// Runs the harness (debug build of both binaries) and returns its stdout; panics with its
/// output when it fails or runs longer than two minutes.
fn run_bench(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let err = dir.path().join("err");
    let mut child = Command::new(env!("CARGO_BIN_EXE_locketd-bench"))
        .args(args)
        .args(["--locketd", env!("CARGO_BIN_EXE_locketd")])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("spawn locketd-bench");
    let mut status = None;
    wait_until(Duration::from_secs(120), "locketd-bench to finish", || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let (stdout, stderr) = (
        std::fs::read_to_string(&out).unwrap(),
        std::fs::read_to_string(&err).unwrap(),
    );
    assert!(
        status.unwrap().success(),
        "locketd-bench {args:?} failed\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
    stdout
}

/// The number after `prefix` on the first line that has it.
fn figure(text: &str, prefix: &str) -> f64 {
    let rest = text
        .lines()
        .find_map(|l| l.split(prefix).nth(1))
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{text}"));
    let num: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ',')
        .filter(|c| *c != ',')
        .collect();
    num.parse()
        .unwrap_or_else(|_| panic!("no number after {prefix:?} in:\n{text}"))
}

#[test]
fn the_noop_scenario_drains_a_tiny_queue_and_prints_its_figures() {
    let out = run_bench(&[
        "noop",
        "--jobs",
        "300",
        "--interval",
        "0.1",
        "--latency-secs",
        "0.5",
        "--latency-rate",
        "40",
    ]);
    let rate = figure(&out, "300 jobs at");
    assert!(rate > 0.0, "{out}");
    // Every job runs three scripts (RESERVE, ACQUIRE+START, FINISH): a sane count is at
    // least that and far below a hundred.
    let cmds = figure(&out, "Redis:");
    assert!((3.0..100.0).contains(&cmds), "{out}");
    let scripts = figure(&out, "commands/job incl. inside scripts,");
    assert!((1.0..=4.0).contains(&scripts), "{out}");
    let rss = figure(&out, "peak RSS: daemon");
    assert!(rss > 0.5 && rss < 1024.0, "{out}");
    assert!(out.contains("enqueue-to-start latency"), "{out}");
    assert!(out.contains("| noop --workers 1: jobs/s |"), "{out}");
}

#[test]
fn the_floor_scenario_makes_the_job_paths_redis_calls_and_drains_every_job() {
    let out = run_bench(&["floor", "--jobs", "300"]);
    // Both variants drain all 300 jobs (the harness fails a variant that does not).
    let two = figure(&out, "2 round trips/job: 300 jobs at");
    let one = figure(&out, "1 round trip/job: 300 jobs at");
    assert!(two > 0.0 && one > 0.0, "{out}");
    // The prefork job path's 10 commands in 2 scripts, and 8 in 1 script when fused (plus
    // each worker's last call, which finds the queue empty).
    let line = |what: &str| {
        out.lines()
            .find(|l| l.contains(what) && l.contains("commands/job inside"))
            .unwrap_or_else(|| panic!("no {what} line in:\n{out}"))
            .to_string()
    };
    let cmds2 = figure(&line("2 round trips/job"), "Redis:");
    let cmds1 = figure(&line("1 round trip/job"), "Redis:");
    assert!((10.0..10.5).contains(&cmds2), "{out}");
    assert!((8.0..8.5).contains(&cmds1), "{out}");
    let calls2 = figure(&line("2 round trips/job"), "commands/job inside");
    assert!((2.0..2.2).contains(&calls2), "{out}");
}

#[test]
fn a_flag_the_binary_rejects_is_reported_clearly() {
    // Run against a program that rejects --workers as an older locketd would; the harness
    // must name the flag instead of waiting for a drain that never comes.
    let fake = tempfile::tempdir().unwrap();
    let script = crate::support::write_script(
        fake.path(),
        "old-locketd",
        "echo \"error: unexpected argument '--workers' found\" >&2; exit 2",
    );
    let output = Command::new(env!("CARGO_BIN_EXE_locketd-bench"))
        .args([
            "noop",
            "--jobs",
            "10",
            "--workers",
            "3",
            "--latency-secs",
            "0",
        ])
        .arg("--locketd")
        .arg(&script)
        .output()
        .expect("run locketd-bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("rejects --workers"), "{stderr}");
}

/// `ruby-floor`: real persistent Ruby handlers fed with the floor's two round trips and the
/// protocol's three frames, one handler per thread (blocking reads) and two per thread
/// (`poll`); every job drains (the harness fails a variant that does not). Sidekiq, when it
/// is not installed, is a row that says so.
#[test]
fn the_ruby_floor_scenario_runs_jobs_through_real_ruby_handlers() {
    let ruby = Command::new("ruby")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ruby {
        eprintln!("ruby is not installed: skipped (.ci/run installs it)");
        return;
    }
    for (flags, what) in [
        (
            &["--workers", "1"][..],
            "1 thread, 1 handler each: 200 jobs at",
        ),
        (
            &["--workers", "2", "--slots", "2"][..],
            "2 threads x 2 handlers: 200 jobs at",
        ),
    ] {
        let mut args = vec!["ruby-floor", "--jobs", "200", "--no-build"];
        args.extend_from_slice(flags);
        let out = run_bench(&args);
        assert!(figure(&out, what) > 0.0, "{out}");
        // The floor's 10 commands in 2 scripts, and the 2 script calls themselves (plus each
        // driver's last call, which finds the queue empty).
        let line = out.lines().find(|l| l.contains(what)).unwrap();
        let before = line.split(" commands/job").next().unwrap();
        let cmds: f64 = before.rsplit('(').next().unwrap().parse().unwrap();
        assert!((12.0..12.5).contains(&cmds), "{out}");
    }
}
