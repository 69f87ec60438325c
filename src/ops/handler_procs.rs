//! `locketd status`'s persistent handler processes (H-8, H-18): the slots' reports grouped
//! into processes ([`crate::metrics::processes`]), for the text table and `--json`.
//!
//! With `threads = 1` every process serves one slot and the table is the one it always was.
//! When a process runs several jobs at once, the table gains a THREADS column (busy / total;
//! `-` for a process of one slot), a shared process is one row, and the workers table names
//! the process and thread of each slot's running job.

use super::status::{table, WorkerStatus};
use crate::metrics::processes::{processes, HandlerProcess};
use crate::metrics::HandlerStats;
use serde::Serialize;
use std::collections::HashSet;

/// One handler process in `status --json`.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessStatus {
    /// `host:pid` of the locketd worker process whose slots it serves.
    pub worker_process: String,
    /// The `[handlers.<name>]` table.
    pub handler: String,
    /// Its pid (none: the slot has no process now).
    pub pid: Option<u32>,
    /// The Resque ids of the slots it serves, lowest slot first.
    pub slots: Vec<String>,
    /// It sent `ready` and is alive.
    pub ready: bool,
    /// It takes no new jobs and ends once its running jobs have.
    pub retiring: bool,
    /// Jobs it may run at once (`threads`; 1: one job per process).
    pub threads: u32,
    /// Jobs it runs now.
    pub threads_busy: u32,
    /// Jobs served by it.
    pub jobs: u64,
    /// Its memory after its last job, bytes.
    pub rss_bytes: Option<u64>,
    /// Its running jobs: each one's slot and thread.
    pub running: Vec<RunningJob>,
}

/// A job running in a handler process.
#[derive(Debug, Clone, Serialize)]
pub struct RunningJob {
    /// The slot's Resque worker id.
    pub slot: String,
    /// The thread (0-based, within the process) it runs in.
    pub thread: u32,
}

fn reports(workers: &[WorkerStatus]) -> Vec<&HandlerStats> {
    workers.iter().flat_map(|w| &w.handlers).collect()
}

/// The handler processes of `workers`' slots.
pub fn list(workers: &[WorkerStatus]) -> Vec<ProcessStatus> {
    // A process of one job at a time is busy when its slot runs a job, whatever it reported.
    let working: HashSet<&str> = workers
        .iter()
        .filter(|w| w.job.is_some())
        .map(|w| w.id.as_str())
        .collect();
    processes(reports(workers))
        .iter()
        .map(|p| {
            let lead = p.lead();
            let mut busy = p.busy();
            if !p.threaded() && p.slots.iter().any(|h| working.contains(h.worker.as_str())) {
                busy = busy.max(1);
            }
            ProcessStatus {
                worker_process: crate::metrics::processes::worker_process(&lead.worker)
                    .0
                    .to_string(),
                handler: lead.name.clone(),
                pid: lead.pid,
                slots: p.slots.iter().map(|h| h.worker.clone()).collect(),
                ready: p.ready(),
                retiring: p.retiring(),
                threads: p.threads(),
                threads_busy: busy,
                jobs: p.jobs(),
                rss_bytes: p.rss_bytes(),
                running: p
                    .running()
                    .into_iter()
                    .map(|(slot, thread)| RunningJob {
                        slot: slot.to_string(),
                        thread,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The handler table of the text screen (nothing when no slot has a persistent handler).
pub(super) fn render(out: &mut String, workers: &[WorkerStatus]) {
    let all = reports(workers);
    if all.is_empty() {
        return;
    }
    let ps = processes(all);
    let threaded = ps.iter().any(HandlerProcess::threaded);
    let mut head = vec!["WORKER", "HANDLER", "PID", "STATE"];
    if threaded {
        head.push("THREADS");
    }
    head.extend(["JOBS", "RSS", "BOOTS", "RESTARTS"]);
    let rows: Vec<Vec<String>> = ps.iter().map(|p| row(p, threaded)).collect();
    out.push('\n');
    table(out, &head, &rows);
}

/// One process's row; with `threaded`, its THREADS cell too.
fn row(p: &HandlerProcess<'_>, threaded: bool) -> Vec<String> {
    let h = p.lead();
    let backing_off = p.slots.iter().find(|h| h.backoff_ms > 0);
    let state = if p.ready() && p.retiring() {
        "retiring".to_string()
    } else if p.ready() {
        "ready".to_string()
    } else if let Some(b) = backing_off {
        format!(
            "backing off ({}s): {}",
            b.backoff_ms.div_ceil(1000),
            b.last_error
        )
    } else {
        "not started".to_string()
    };
    let restarts = p.restarts();
    let restarts = if restarts.is_empty() {
        "-".to_string()
    } else {
        restarts
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let worker = match p.slots.len() {
        1 => h.worker.clone(),
        n => format!("{} +{} slots", h.worker, n - 1),
    };
    let mut row = vec![
        worker,
        h.name.clone(),
        h.pid.map_or("-".into(), |p| p.to_string()),
        state,
    ];
    if threaded {
        row.push(if p.threaded() {
            format!("{}/{}", p.busy(), p.threads())
        } else {
            "-".into()
        });
    }
    row.extend([
        format!("{} ({} total)", p.jobs(), p.jobs_total()),
        p.rss_bytes()
            .map_or("-".into(), |b| format!("{:.1}MiB", b as f64 / 1048576.0)),
        p.boots().to_string(),
        restarts,
    ]);
    row
}

/// For the workers table: where a slot's running job runs when its process runs several
/// (` in <handler> pid <pid> thread <k>`), else nothing.
pub(super) fn thread_note(w: &WorkerStatus) -> String {
    if w.job.is_none() {
        return String::new();
    }
    w.handlers
        .iter()
        .filter(|h| h.threads > 1)
        .find_map(|h| {
            let t = h.thread?;
            let pid = h.pid.map_or("-".into(), |p| p.to_string());
            Some(format!(" in {} pid {pid} thread {t}", h.name))
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, job: bool, handlers: Vec<HandlerStats>) -> WorkerStatus {
        let mut w = super::super::status::worker_status(id, None, None, None, &[], 0);
        if job {
            w.job = Some(super::super::status::JobStatus {
                queue: Some("q".into()),
                class: Some("Wait".into()),
                run_at: Some("2026-11-28T10:00:00Z".into()),
                running_secs: Some(3),
            });
        }
        w.handlers = handlers;
        w
    }

    fn report(
        worker: &str,
        pid: u32,
        threads: u32,
        busy: u32,
        thread: Option<u32>,
    ) -> HandlerStats {
        HandlerStats {
            worker: worker.into(),
            name: "t".into(),
            pid: Some(pid),
            ready: true,
            jobs: 12,
            jobs_total: 4,
            rss_bytes: Some(100 << 20),
            boots: 1,
            threads,
            threads_busy: busy,
            thread,
            ..HandlerStats::default()
        }
    }

    // H-18: four slots sharing one threads = 4 process are one row with 2/4 busy, the
    // process's jobs and memory once; each running job's slot names its thread.
    #[test]
    fn a_shared_process_is_one_row_with_its_threads_and_each_job_its_thread() {
        let ws = vec![
            worker(
                "vm:10+1:q",
                true,
                vec![report("vm:10+1:q", 42, 4, 2, Some(0))],
            ),
            worker(
                "vm:10+2:q",
                false,
                vec![report("vm:10+2:q", 42, 4, 2, None)],
            ),
            worker(
                "vm:10+3:q",
                true,
                vec![report("vm:10+3:q", 42, 4, 2, Some(1))],
            ),
            worker(
                "vm:10+4:q",
                false,
                vec![report("vm:10+4:q", 42, 4, 2, None)],
            ),
        ];
        let mut out = String::new();
        render(&mut out, &ws);
        let lines: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines[0].contains("THREADS"), "{out}");
        for cell in [
            "vm:10+1:q +3 slots",
            " 42 ",
            "ready",
            "2/4",
            "12 (16 total)",
            "100.0MiB",
        ] {
            assert!(lines[1].contains(cell), "{cell} in {out}");
        }
        assert_eq!(thread_note(&ws[2]), " in t pid 42 thread 1");
        assert_eq!(thread_note(&ws[1]), "");
        let l = list(&ws);
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].threads_busy, l[0].threads, l[0].jobs), (2, 4, 12));
        assert_eq!(l[0].worker_process, "vm:10");
        let running: Vec<(&str, u32)> = l[0]
            .running
            .iter()
            .map(|r| (r.slot.as_str(), r.thread))
            .collect();
        assert_eq!(running, [("vm:10+1:q", 0), ("vm:10+3:q", 1)]);
    }

    // threads = 1 everywhere: the table is today's (no THREADS column, a row per slot), the
    // workers table names no thread; a busy slot's process counts 1 busy in `--json` even
    // when its report says 0 (as one from before threads does).
    #[test]
    fn one_job_per_process_keeps_todays_table() {
        let ws = vec![
            worker("vm:10+1:q", true, vec![report("vm:10+1:q", 42, 1, 0, None)]),
            worker(
                "vm:10+2:q",
                false,
                vec![report("vm:10+2:q", 43, 1, 0, None)],
            ),
        ];
        let mut out = String::new();
        render(&mut out, &ws);
        assert!(out.contains("WORKER"), "{out}");
        assert!(!out.contains("THREADS") && !out.contains("slots"), "{out}");
        assert_eq!(
            out.lines().filter(|l| l.contains("ready")).count(),
            2,
            "{out}"
        );
        assert_eq!(thread_note(&ws[0]), "");
        let l = list(&ws);
        assert_eq!(
            l.iter()
                .map(|p| (p.threads_busy, p.threads))
                .collect::<Vec<_>>(),
            [(1, 1), (0, 1)]
        );
    }

    // A threaded process next to unthreaded ones: the column shows, `-` for the others.
    #[test]
    fn a_mixed_table_marks_unthreaded_processes_with_a_dash() {
        let ws = vec![
            worker(
                "vm:10+1:q",
                false,
                vec![report("vm:10+1:q", 42, 4, 0, None)],
            ),
            worker("vm:11:q", false, vec![report("vm:11:q", 50, 1, 0, None)]),
        ];
        let mut out = String::new();
        render(&mut out, &ws);
        // WORKER HANDLER PID STATE THREADS ...
        let threads_cell = |start: &str| {
            let row = out.lines().find(|l| l.starts_with(start)).unwrap();
            row.split_whitespace().nth(4).unwrap().to_string()
        };
        assert_eq!(threads_cell("vm:11:q"), "-", "{out}");
        assert_eq!(threads_cell("vm:10+1:q"), "0/4", "{out}");
    }
}
