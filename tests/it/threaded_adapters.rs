//! The Node and Python adapters in threaded mode (issue 38, H-16, H-18), at the protocol
//! level: `tests/adapters/drive.py` starts an adapter as locketd does, with
//! `LOCKETD_THREADS` (`--threads`), writes several `job` frames at once (`--concurrent`) and
//! soft stops (`--stop-after`), and notes after each `done` which announced job process
//! groups still live. The jobs meet through files in a temp dir (`$RDV`), so what the tests
//! assert is an order of events, never a duration: every wait in a job is bounded (10 s), so
//! an adapter that runs jobs one at a time fails the test instead of hanging it.
//! Run: `cargo test --test it -- threaded_adapters::`.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::daemon::workdir;
use crate::support::manifest_dir;

/// An adapter and the jobs module the tests give it.
struct Lang {
    interpreter: &'static str,
    adapter: &'static str,
    file: &'static str,
    module: &'static str,
}

const NODE: Lang = Lang {
    interpreter: "node",
    adapter: "adapters/node/locketd-handler.js",
    file: "jobs.js",
    module: NODE_JOBS,
};

const PYTHON: Lang = Lang {
    interpreter: "python3",
    adapter: "adapters/python/locketd_handler.py",
    file: "jobs.py",
    module: PYTHON_JOBS,
};

/// Meet(me, other): says `me` (with its pid), waits for `other`. Looping: runs until its
/// signal aborts it (or 20 s), its onFailure says `failed-<id>`. AfterFailed: waits for
/// `failed-<arg>`. Spawner(me, other, first): starts `sleep 60`, says `<me>.child` (its pid),
/// waits for the other's child; the second then waits until the first's child is gone and
/// says in `<me>.own` whether its own child is alive.
const NODE_JOBS: &str = r#""use strict";
const fs = require("fs");
const path = require("path");
const { spawn } = require("child_process");
const locketd = require(process.env.ADAPTER);
const dir = process.env.RDV;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// Whole or not at all: written aside, then renamed.
function say(name, text) {
  fs.writeFileSync(path.join(dir, `.${name}`), String(text));
  fs.renameSync(path.join(dir, `.${name}`), path.join(dir, name));
}
const has = (name) => fs.existsSync(path.join(dir, name));
const read = (name) => fs.readFileSync(path.join(dir, name), "utf8");
function gone(pid) {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat[stat.lastIndexOf(")") + 2] === "Z";
  } catch (_) {
    return true;
  }
}
async function waitFor(test, what) {
  for (let i = 0; i < 200; i++) {
    if (test()) return;
    await sleep(50);
  }
  throw new Error(`waited 10 s for ${what}`);
}
module.exports.jobs = {
  Meet: {
    perform: async (me, other) => {
      say(me, process.pid);
      await waitFor(() => has(other), other);
    },
  },
  Looping: {
    perform: async function () {
      const signal = this.signal;
      for (let i = 0; i < 400 && !signal.aborted; i++) await sleep(50);
      if (signal.aborted) throw signal.reason;
    },
    onFailure: async function (error) {
      say(`failed-${locketd.current.id}`, `${error.name}: ${error.message}`);
    },
  },
  AfterFailed: {
    perform: async (id) => { await waitFor(() => has(`failed-${id}`), `failed-${id}`); },
  },
  Lingering: {
    perform: async function () {
      const signal = this.signal;
      await waitFor(() => signal.aborted, "its stop");
      await sleep(300);
      spawn("sleep", ["60"], { stdio: "ignore" });
      await sleep(300);
    },
  },
  Spawner: {
    perform: async (me, other, first) => {
      const child = spawn("sleep", ["60"], { stdio: "ignore" });
      say(`${me}.child`, child.pid);
      await waitFor(() => has(`${other}.child`), `${other}.child`);
      if (first) return;
      await waitFor(() => gone(Number(read(`${other}.child`))), `${other}'s child gone`);
      say(`${me}.own`, gone(child.pid) ? "dead" : "alive");
    },
  },
};
"#;

const PYTHON_JOBS: &str = r#"import os
import subprocess
import time

import locketd_handler

DIR = os.environ["RDV"]


def say(name, text):
    """Whole or not at all: written aside, then renamed."""
    with open(os.path.join(DIR, "." + name), "w") as f:
        f.write(str(text))
    os.rename(os.path.join(DIR, "." + name), os.path.join(DIR, name))


def has(name):
    return os.path.exists(os.path.join(DIR, name))


def read(name):
    with open(os.path.join(DIR, name)) as f:
        return f.read()


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def wait_for(test, what):
    for _ in range(200):
        if test():
            return
        time.sleep(0.05)
    raise TimeoutError(f"waited 10 s for {what}")


class Meet:
    @staticmethod
    def perform(me, other):
        say(me, os.getpid())
        wait_for(lambda: has(other), other)


class Looping:
    @staticmethod
    def perform():
        for _ in range(400):  # Python code between short sleeps: the stop lands at once
            time.sleep(0.05)

    @staticmethod
    def on_failure_note(exc):
        say(f"failed-{locketd_handler.current['id']}", f"{type(exc).__name__}: {exc}")


class AfterFailed:
    @staticmethod
    def perform(job_id):
        wait_for(lambda: has(f"failed-{job_id}"), f"failed-{job_id}")


class Spawner:
    @staticmethod
    def perform(me, other, first):
        child = subprocess.Popen(["sleep", "60"])
        say(f"{me}.child", child.pid)
        wait_for(lambda: has(f"{other}.child"), f"{other}.child")
        if not first:
            pid = int(read(f"{other}.child"))
            wait_for(lambda: gone(pid), f"{other}'s child gone")
            say(f"{me}.own", "dead" if gone(child.pid) else "alive")
"#;

/// The frames and notes `drive.py` printed for `steps` against `lang`'s adapter, each line
/// parsed; None (said on stderr) when the interpreter is missing.
fn drive(lang: &Lang, dir: &Path, steps: &[&str]) -> Option<Vec<Value>> {
    for program in ["python3", lang.interpreter] {
        let there = Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !there {
            eprintln!("{program} is not installed: skipped (.ci/run installs it)");
            return None;
        }
    }
    let jobs = dir.join(lang.file);
    std::fs::write(&jobs, lang.module).unwrap();
    let rdv = dir.join("rdv");
    std::fs::create_dir_all(&rdv).unwrap();
    // drive.py bounds every wait itself: 15 s per reply, 10 s for the exit.
    let out = Command::new("python3")
        .arg("tests/adapters/drive.py")
        .args(["--timeout", "15", "--capture"])
        .args(steps)
        .arg("--")
        .args([lang.interpreter, lang.adapter])
        .arg(&jobs)
        .env("RDV", &rdv)
        .env("ADAPTER", manifest_dir().join(lang.adapter))
        .current_dir(manifest_dir())
        .output()
        .expect("run drive.py");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{text}")))
        .collect();
    Some(lines)
}

/// The adapter's frames of type `t`.
fn frames<'a>(out: &'a [Value], t: &str) -> Vec<&'a Value> {
    out.iter().filter(|v| v["t"] == t).collect()
}

fn done<'a>(out: &'a [Value], id: &str) -> &'a Value {
    let dones: Vec<_> = frames(out, "done")
        .into_iter()
        .filter(|v| v["id"] == id)
        .collect();
    assert_eq!(dones.len(), 1, "one done for {id}: {out:#?}");
    dones[0]
}

/// The driver's note of type `event` whose `key` is `value`.
fn note<'a>(out: &'a [Value], event: &str, key: &str, value: &str) -> &'a Value {
    out.iter()
        .find(|v| v["driver"] == event && v[key] == value)
        .unwrap_or_else(|| panic!("no {event} note with {key} = {value}: {out:#?}"))
}

fn ready(out: &[Value]) -> &Value {
    frames(out, "ready")
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no ready: {out:#?}"))
}

/// The adapter exited 0 at EOF: one process served every job.
fn exited_cleanly(out: &[Value]) {
    let exit = note(out, "exit", "end", "close");
    assert_eq!(exit["exit"], 0, "{out:#?}");
    assert_eq!(
        out.iter().filter(|v| v["driver"] == "spawned").count(),
        1,
        "{out:#?}"
    );
}

fn read_pid(dir: &Path, name: &str) -> i64 {
    let text = std::fs::read_to_string(dir.join("rdv").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    text.trim().parse().unwrap()
}

/// `ready` says "threads" with LOCKETD_THREADS above 1 only.
fn check_ready_features(lang: &Lang) {
    let dir = workdir();
    for (threads, expected) in [(None, false), (Some("1"), false), (Some("4"), true)] {
        let mut steps = vec![];
        if let Some(n) = threads {
            steps.extend(["--threads", n]);
        }
        let Some(out) = drive(lang, dir.path(), &steps) else {
            return;
        };
        let features = ready(&out)["features"].as_array().cloned().unwrap();
        assert_eq!(
            features.iter().any(|f| f == "threads"),
            expected,
            "LOCKETD_THREADS={threads:?}: {out:#?}"
        );
        exited_cleanly(&out);
    }
}

/// Two jobs run at once in one adapter process: each waits until the other has begun.
fn check_two_jobs_at_once(lang: &Lang) {
    let dir = workdir();
    let steps = [
        "--threads",
        "2",
        "--concurrent",
        "2",
        "--id",
        "a",
        "--payload",
        r#"{"class":"Meet","args":["a","b"]}"#,
        "--id",
        "b",
        "--payload",
        r#"{"class":"Meet","args":["b","a"]}"#,
    ];
    let Some(out) = drive(lang, dir.path(), &steps) else {
        return;
    };
    for id in ["a", "b"] {
        assert_eq!(done(&out, id)["status"], "ok", "{out:#?}");
    }
    let pid = ready(&out)["pid"].as_i64().unwrap();
    assert_eq!(read_pid(dir.path(), "a"), pid, "job a ran in the adapter");
    assert_eq!(
        read_pid(dir.path(), "b"),
        pid,
        "job b ran in the same process"
    );
    exited_cleanly(&out);
}

/// A stop for one job ends that job alone, through its failure path; its sibling, still
/// running when the stop came (it waits for the stopped job's onFailure), ends ok in the
/// same process. A stop that says `requeue` (H-14) ends its job without the hook.
fn check_stop_ends_one_job(lang: &Lang) {
    let dir = workdir();
    let steps = [
        "--threads",
        "3",
        "--stop-after",
        "s:0.3",
        "--stop-after",
        "r:0.3:requeue",
        "--concurrent",
        "3",
        "--id",
        "s",
        "--payload",
        r#"{"class":"Looping","args":[]}"#,
        "--id",
        "sib",
        "--payload",
        r#"{"class":"AfterFailed","args":["s"]}"#,
        "--id",
        "r",
        "--payload",
        r#"{"class":"Looping","args":[]}"#,
    ];
    let Some(out) = drive(lang, dir.path(), &steps) else {
        return;
    };
    let stopped = done(&out, "s");
    assert_eq!(stopped["status"], "failed", "{out:#?}");
    assert_eq!(stopped["exception"], "Resque::TermException", "{out:#?}");
    let hook = std::fs::read_to_string(dir.path().join("rdv/failed-s")).unwrap();
    assert!(hook.contains("TermException"), "onFailure saw {hook:?}");
    assert_eq!(
        done(&out, "sib")["status"],
        "ok",
        "the sibling ran on: {out:#?}"
    );
    assert_eq!(done(&out, "r")["exception"], "Resque::TermException");
    assert!(
        !dir.path().join("rdv/failed-r").exists(),
        "a requeued stop runs no onFailure (it would run before the done)"
    );
    exited_cleanly(&out);
}

/// A job's child is in a process group of its own, announced, and dead after that job's
/// `done`, while a sibling's child lives on (the sibling sees its own child alive once the
/// first job's child is gone) until the sibling's `done`.
fn check_children_die_with_their_job(lang: &Lang) {
    let dir = workdir();
    let steps = [
        "--threads",
        "2",
        "--concurrent",
        "2",
        "--id",
        "a",
        "--payload",
        r#"{"class":"Spawner","args":["a","b",true]}"#,
        "--id",
        "b",
        "--payload",
        r#"{"class":"Spawner","args":["b","a",false]}"#,
    ];
    let Some(out) = drive(lang, dir.path(), &steps) else {
        return;
    };
    for id in ["a", "b"] {
        assert_eq!(done(&out, id)["status"], "ok", "{out:#?}");
    }
    let group_of = |id: &str| {
        let groups: Vec<i64> = frames(&out, "group")
            .into_iter()
            .filter(|g| g["id"] == id)
            .map(|g| g["pgid"].as_i64().unwrap())
            .collect();
        assert_eq!(groups.len(), 1, "one group for {id}: {out:#?}");
        groups[0]
    };
    let (ga, gb) = (group_of("a"), group_of("b"));
    assert_eq!(
        ga,
        read_pid(dir.path(), "a.child"),
        "a's child leads its group"
    );
    assert_eq!(
        gb,
        read_pid(dir.path(), "b.child"),
        "b's child leads its group"
    );
    let after_a = note(&out, "groups", "after_done", "a");
    assert!(
        after_a["dead"].as_array().unwrap().contains(&ga.into()),
        "a's group is dead once its done is read: {out:#?}"
    );
    let own = std::fs::read_to_string(dir.path().join("rdv/b.own")).unwrap();
    assert_eq!(
        own, "alive",
        "b's child lived on after a's child was killed"
    );
    let after_b = note(&out, "groups", "after_done", "b");
    assert_eq!(after_b["alive"], serde_json::json!([]), "{out:#?}");
    exited_cleanly(&out);
    assert!(
        !out.iter()
            .any(|v| v["driver"] == "job_group_leftovers_killed"),
        "{out:#?}"
    );
}

#[test]
fn h18_node_ready_says_threads_only_with_locketd_threads_above_1() {
    check_ready_features(&NODE);
}

#[test]
fn h18_python_ready_says_threads_only_with_locketd_threads_above_1() {
    check_ready_features(&PYTHON);
}

#[test]
fn h18_node_two_jobs_run_at_once_in_one_process() {
    check_two_jobs_at_once(&NODE);
}

#[test]
fn h18_python_two_jobs_run_at_once_in_one_process() {
    check_two_jobs_at_once(&PYTHON);
}

#[test]
fn h18_node_a_stop_aborts_one_job_and_its_sibling_finishes() {
    check_stop_ends_one_job(&NODE);
}

#[test]
fn h18_python_a_stop_raises_in_one_job_and_its_sibling_finishes() {
    check_stop_ends_one_job(&PYTHON);
}

/// H-18: a Node job that ignores its aborted signal keeps its `done` back until its promise
/// settled, so nothing it does after the stop (here: it starts a child) happens after the
/// `done` that lets locketd release its lock; the child it started meanwhile is killed.
#[test]
fn h18_node_a_stopped_jobs_done_waits_for_its_promise() {
    let dir = workdir();
    let steps = [
        "--threads",
        "2",
        "--stop-after",
        "l:0.2",
        "--concurrent",
        "1",
        "--id",
        "l",
        "--payload",
        r#"{"class":"Lingering","args":[]}"#,
    ];
    let Some(out) = drive(&NODE, dir.path(), &steps) else {
        return;
    };
    let at = |pred: &dyn Fn(&Value) -> bool| {
        out.iter()
            .position(pred)
            .unwrap_or_else(|| panic!("{out:#?}"))
    };
    let group = at(&|v| v["t"] == "group" && v["id"] == "l");
    let done_at = at(&|v| v["t"] == "done" && v["id"] == "l");
    assert!(
        group < done_at,
        "the child it started after its stop was announced before its done: {out:#?}"
    );
    assert_eq!(done(&out, "l")["exception"], "Resque::TermException");
    let pgid = out[group]["pgid"].clone();
    let after = note(&out, "groups", "after_done", "l");
    assert!(
        after["dead"].as_array().unwrap().contains(&pgid),
        "its child is dead once its done is read: {out:#?}"
    );
    exited_cleanly(&out);
}

#[test]
fn h18_node_a_jobs_children_die_at_its_done_and_a_siblings_live() {
    check_children_die_with_their_job(&NODE);
}

#[test]
fn h18_python_a_jobs_children_die_at_its_done_and_a_siblings_live() {
    check_children_die_with_their_job(&PYTHON);
}
