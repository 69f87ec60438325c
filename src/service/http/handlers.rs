//! `/metrics`' persistent handler families (issue 13 item 4; H-18 for threads).
//!
//! Labels are a slot's `worker` id and the `handler` name, as they always were: both bounded
//! by the configuration, where a handler pid would make new series at every recycle. Per slot:
//! readiness, pid, jobs served, boots, restarts, and with threads the thread of its running
//! job. Per process, on the lowest of the slots it serves (one slot with `threads = 1`, so
//! the series are the slots' own as before): its memory and jobs, and with threads its
//! threads total and busy. Summing a per-process family over `worker` so counts each process
//! once.

use super::{as_i64, counter_family, gauge_family, l, Labels};
use crate::metrics::processes::{processes, HandlerProcess};
use crate::metrics::HandlerStats;
use prometheus_client::encoding::DescriptorEncoder;

fn of(h: &HandlerStats) -> Labels {
    l(&[("worker", &h.worker), ("handler", &h.name)])
}

/// Writes the families; nothing without persistent handlers, and the thread families only
/// when a process runs several jobs at once.
pub(super) fn encode(enc: &mut DescriptorEncoder, handlers: &[HandlerStats]) -> std::fmt::Result {
    if handlers.is_empty() {
        return Ok(());
    }
    let rows = |f: &dyn Fn(&HandlerStats) -> i64| -> Vec<(Labels, i64)> {
        handlers.iter().map(|h| (of(h), f(h))).collect()
    };
    let procs = processes(handlers);
    let per_process = |f: &dyn Fn(&HandlerProcess<'_>) -> i64| -> Vec<(Labels, i64)> {
        procs.iter().map(|p| (of(p.lead()), f(p))).collect()
    };
    gauge_family(
        enc,
        "locketd_handler_ready",
        "1 when the slot's persistent handler sent ready and is alive.",
        &rows(&|h| i64::from(h.ready)),
    )?;
    gauge_family(
        enc,
        "locketd_handler_pid",
        "The pid of the slot's persistent handler (0: none running).",
        &rows(&|h| i64::from(h.pid.unwrap_or(0))),
    )?;
    gauge_family(
        enc,
        "locketd_handler_rss_bytes",
        "The handler's memory after its last job (RSS; PSS in fork mode); a process that serves several slots (threads) once, on the lowest of them.",
        &per_process(&|p| as_i64(p.rss_bytes().unwrap_or(0))),
    )?;
    gauge_family(
        enc,
        "locketd_handler_jobs",
        "Jobs served by the live handler process; a process that serves several slots (threads) once, on the lowest of them.",
        &per_process(&|p| as_i64(p.jobs())),
    )?;
    let threaded: Vec<&HandlerProcess<'_>> = procs.iter().filter(|p| p.threaded()).collect();
    if !threaded.is_empty() {
        let of_threaded = |f: &dyn Fn(&HandlerProcess<'_>) -> i64| -> Vec<(Labels, i64)> {
            threaded.iter().map(|p| (of(p.lead()), f(p))).collect()
        };
        gauge_family(
            enc,
            "locketd_handler_threads",
            "Jobs a handler process with threads above 1 may run at once, on the lowest of the slots it serves.",
            &of_threaded(&|p| i64::from(p.threads())),
        )?;
        gauge_family(
            enc,
            "locketd_handler_threads_busy",
            "Jobs a handler process with threads above 1 runs now, on the lowest of the slots it serves.",
            &of_threaded(&|p| i64::from(p.busy())),
        )?;
        let slots: Vec<(Labels, i64)> = threaded
            .iter()
            .flat_map(|p| &p.slots)
            .map(|h| (of(h), h.thread.map_or(-1, i64::from)))
            .collect();
        gauge_family(
            enc,
            "locketd_handler_thread",
            "The thread (0-based, in its handler process) of the slot's running job; -1: none. Slots of processes with threads above 1.",
            &slots,
        )?;
    }
    let counters = |f: &dyn Fn(&HandlerStats) -> u64| -> Vec<(Labels, u64)> {
        handlers.iter().map(|h| (of(h), f(h))).collect()
    };
    counter_family(
        enc,
        "locketd_handler_jobs_served",
        "Jobs served by the slot's persistent handler processes.",
        &counters(&|h| h.jobs_total),
    )?;
    counter_family(
        enc,
        "locketd_handler_boots",
        "Persistent handler processes started.",
        &counters(&|h| h.boots),
    )?;
    let restarts: Vec<(Labels, u64)> = handlers
        .iter()
        .flat_map(|h| {
            h.restarts.iter().map(move |(reason, n)| {
                (
                    l(&[
                        ("worker", &h.worker),
                        ("handler", &h.name),
                        ("reason", reason),
                    ]),
                    *n,
                )
            })
        })
        .collect();
    counter_family(
        enc,
        "locketd_handler_restarts",
        "Persistent handler processes ended and replaced, by reason.",
        &restarts,
    )
}

#[cfg(test)]
mod tests {
    use super::super::{render, RedisGauges};
    use crate::metrics::{HandlerStats, Snapshot};

    fn slot(worker: &str, pid: u32, threads: u32, busy: u32, thread: Option<u32>) -> HandlerStats {
        HandlerStats {
            worker: worker.into(),
            name: "t".into(),
            pid: Some(pid),
            ready: true,
            jobs: 12,
            jobs_total: 4,
            rss_bytes: Some(1000),
            boots: 1,
            threads,
            threads_busy: busy,
            thread,
            ..HandlerStats::default()
        }
    }

    fn scrape(handlers: Vec<HandlerStats>) -> String {
        render(
            Snapshot {
                handlers,
                ..Snapshot::default()
            },
            RedisGauges::default(),
        )
    }

    fn lines<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
        let prefix = format!("{family}{{");
        text.lines().filter(|l| l.starts_with(&prefix)).collect()
    }

    // H-18: three slots sharing a threads = 4 process: memory, jobs, threads and busy once,
    // on the lowest slot; each slot its thread (-1 idle); the per-slot families stay per slot.
    #[test]
    fn a_shared_process_is_counted_once_and_each_slot_names_its_thread() {
        let text = scrape(vec![
            slot("vm:10+1:q", 42, 4, 2, Some(1)),
            slot("vm:10+2:q", 42, 4, 2, None),
            slot("vm:10+3:q", 42, 4, 2, Some(0)),
        ]);
        let lead = r#"{worker="vm:10+1:q",handler="t"}"#;
        assert_eq!(
            lines(&text, "locketd_handler_rss_bytes"),
            [format!("locketd_handler_rss_bytes{lead} 1000")],
            "{text}"
        );
        assert_eq!(
            lines(&text, "locketd_handler_jobs"),
            [format!("locketd_handler_jobs{lead} 12")]
        );
        assert_eq!(
            lines(&text, "locketd_handler_threads"),
            [format!("locketd_handler_threads{lead} 4")]
        );
        assert_eq!(
            lines(&text, "locketd_handler_threads_busy"),
            [format!("locketd_handler_threads_busy{lead} 2")]
        );
        assert_eq!(
            lines(&text, "locketd_handler_thread"),
            [
                format!("locketd_handler_thread{lead} 1"),
                r#"locketd_handler_thread{worker="vm:10+2:q",handler="t"} -1"#.to_string(),
                r#"locketd_handler_thread{worker="vm:10+3:q",handler="t"} 0"#.to_string(),
            ]
        );
        assert_eq!(lines(&text, "locketd_handler_pid").len(), 3, "{text}");
        assert_eq!(lines(&text, "locketd_handler_ready").len(), 3, "{text}");
    }

    // threads = 1: a series per slot as before threads, and no thread families at all.
    #[test]
    fn one_job_per_process_adds_no_series() {
        let text = scrape(vec![
            slot("vm:10+1:q", 42, 1, 0, None),
            slot("vm:10+2:q", 43, 1, 0, None),
        ]);
        assert_eq!(lines(&text, "locketd_handler_rss_bytes").len(), 2, "{text}");
        assert_eq!(lines(&text, "locketd_handler_jobs").len(), 2, "{text}");
        assert!(!text.contains("locketd_handler_thread"), "{text}");
    }
}
