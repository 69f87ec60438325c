//! Handler processes, as `status`, `/metrics` and the page show them (H-18).
//!
//! Each worker slot reports its persistent handler as a [`HandlerStats`]. With `threads = 1`
//! a process serves one slot; with `threads` above 1 the slots of one worker process share
//! processes and report the same pid. Grouped by (worker process, handler, pid), the slots
//! give one [`HandlerProcess`] each: its threads busy / total, jobs served and memory, and per
//! running job the slot and the thread it runs in. A slot with no process (not started,
//! backing off) stays a process entry of its own, as before threads.

use super::HandlerStats;
use std::collections::BTreeMap;

/// One handler process and the slots it serves (the slots' reports, lowest slot first).
#[derive(Debug, Clone)]
pub struct HandlerProcess<'a> {
    /// The reports of the slots it serves, lowest slot first (never empty).
    pub slots: Vec<&'a HandlerStats>,
}

/// `host:pid` of the worker process a slot id (`host:pid+k:queues` or `host:pid:queues`)
/// belongs to, and the slot number `k` (0 without `+k`).
pub fn worker_process(worker: &str) -> (&str, u32) {
    let mut parts = worker.splitn(3, ':');
    let host = parts.next().unwrap_or("");
    let pid = parts.next().unwrap_or("");
    let (pid, slot) = match pid.split_once('+') {
        Some((p, k)) => (p, k.parse().unwrap_or(0)),
        None => (pid, 0),
    };
    let end = (host.len() + 1 + pid.len()).min(worker.len());
    (&worker[..end], slot)
}

/// (worker process, handler, pid, or the slot's id when it has no process).
type GroupKey<'a> = (&'a str, &'a str, Result<u32, &'a str>);

/// The slots' reports grouped into processes: by (worker process, handler, pid) when a slot
/// has a process; a slot with none is one entry. In the order of each process's lowest slot.
pub fn processes<'a>(
    handlers: impl IntoIterator<Item = &'a HandlerStats>,
) -> Vec<HandlerProcess<'a>> {
    let mut groups: BTreeMap<GroupKey<'a>, Vec<&HandlerStats>> = BTreeMap::new();
    for h in handlers {
        let (process, _) = worker_process(&h.worker);
        let key = (process, h.name.as_str(), h.pid.ok_or(h.worker.as_str()));
        groups.entry(key).or_default().push(h);
    }
    let mut out: Vec<HandlerProcess<'a>> = groups
        .into_values()
        .map(|mut slots| {
            slots.sort_by_key(|h| worker_process(&h.worker).1);
            HandlerProcess { slots }
        })
        .collect();
    out.sort_by(|a, b| {
        let (pa, sa) = worker_process(&a.lead().worker);
        let (pb, sb) = worker_process(&b.lead().worker);
        (pa, sa, &a.lead().name).cmp(&(pb, sb, &b.lead().name))
    });
    out
}

impl<'a> HandlerProcess<'a> {
    /// The lowest slot's report: its worker id names the process in `/metrics`, a bounded
    /// label (slot ids), where a pid would make a new series at every restart.
    pub fn lead(&self) -> &'a HandlerStats {
        self.slots[0]
    }

    /// Jobs it may run at once (at least 1: a report written before threads says 0).
    pub fn threads(&self) -> u32 {
        self.slots
            .iter()
            .map(|h| h.threads)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// It runs several jobs at once (`threads` above 1, and the adapter said `threads`).
    pub fn threaded(&self) -> bool {
        self.threads() > 1
    }

    /// Jobs it runs now: what it reported, and at least its slots that name a thread.
    pub fn busy(&self) -> u32 {
        let reported = self.slots.iter().map(|h| h.threads_busy).max().unwrap_or(0);
        let named = self.slots.iter().filter(|h| h.thread.is_some()).count();
        reported.max(u32::try_from(named).unwrap_or(u32::MAX))
    }

    /// Its slots' running jobs: (slot's worker id, thread), lowest slot first.
    pub fn running(&self) -> Vec<(&'a str, u32)> {
        self.slots
            .iter()
            .filter_map(|h| h.thread.map(|t| (h.worker.as_str(), t)))
            .collect()
    }

    /// Jobs served by the process (each slot reports the process's count).
    pub fn jobs(&self) -> u64 {
        self.slots.iter().map(|h| h.jobs).max().unwrap_or(0)
    }

    /// Jobs served by every process of these slots.
    pub fn jobs_total(&self) -> u64 {
        self.slots.iter().map(|h| h.jobs_total).sum()
    }

    /// Its memory after its last job (each slot reports the process's).
    pub fn rss_bytes(&self) -> Option<u64> {
        self.slots.iter().filter_map(|h| h.rss_bytes).max()
    }

    /// Processes started by these slots.
    pub fn boots(&self) -> u64 {
        self.slots.iter().map(|h| h.boots).sum()
    }

    /// Processes ended and replaced, by reason, summed over these slots.
    pub fn restarts(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for h in &self.slots {
            for (r, n) in &h.restarts {
                *out.entry(r.clone()).or_default() += n;
            }
        }
        out
    }

    /// It sent `ready` and is alive.
    pub fn ready(&self) -> bool {
        self.slots.iter().any(|h| h.ready)
    }

    /// It takes no new jobs and ends once its running jobs have.
    pub fn retiring(&self) -> bool {
        self.slots.iter().any(|h| h.retiring)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(
        worker: &str,
        pid: Option<u32>,
        threads: u32,
        busy: u32,
        thread: Option<u32>,
    ) -> HandlerStats {
        HandlerStats {
            worker: worker.into(),
            name: "t".into(),
            pid,
            ready: pid.is_some(),
            jobs: 40,
            jobs_total: 10,
            rss_bytes: pid.map(|_| 200 << 20),
            boots: 1,
            threads,
            threads_busy: busy,
            thread,
            ..HandlerStats::default()
        }
    }

    #[test]
    fn a_worker_id_names_its_process_and_slot() {
        assert_eq!(worker_process("vm:10+12:a:b"), ("vm:10", 12));
        assert_eq!(worker_process("vm:10:a,b"), ("vm:10", 0));
        assert_eq!(worker_process("odd"), ("odd", 0));
    }

    // H-18: the slots of one worker process sharing a pid are one process, lowest slot
    // first (slot 10 after slot 2); the same pid number in another worker process (another
    // host) is another process; a slot with no process is one entry.
    #[test]
    fn slots_sharing_a_process_are_grouped_by_worker_process_and_pid() {
        let hs = [
            slot("vm:10+10:q", Some(7), 4, 2, Some(1)),
            slot("vm:10+2:q", Some(7), 4, 2, Some(0)),
            slot("vm:10+3:q", Some(7), 4, 2, None),
            slot("vm:10+4:q", Some(8), 4, 0, None),
            slot("other:10+1:q", Some(7), 4, 0, None),
            slot("vm:10+5:q", None, 4, 0, None),
            slot("vm:10+6:q", None, 4, 0, None),
        ];
        let ps = processes(&hs);
        let leads: Vec<(&str, usize)> = ps
            .iter()
            .map(|p| (p.lead().worker.as_str(), p.slots.len()))
            .collect();
        assert_eq!(
            leads,
            [
                ("other:10+1:q", 1),
                ("vm:10+2:q", 3),
                ("vm:10+4:q", 1),
                ("vm:10+5:q", 1),
                ("vm:10+6:q", 1)
            ]
        );
        let p = &ps[1];
        assert!(p.threaded());
        assert_eq!((p.busy(), p.threads()), (2, 4));
        assert_eq!(p.running(), [("vm:10+2:q", 0), ("vm:10+10:q", 1)]);
        // The process's own figures are not multiplied by its slots; the slots' counters add.
        assert_eq!(
            (p.jobs(), p.rss_bytes(), p.jobs_total()),
            (40, Some(200 << 20), 30)
        );
        assert_eq!(p.boots(), 3);
    }

    // A report from before threads (threads 0) or a threads = 1 process is one unthreaded
    // process per slot; its running job counts even if the report says 0 busy.
    #[test]
    fn an_unthreaded_slot_is_a_process_of_its_own() {
        let hs = [
            slot("vm:10+1:q", Some(7), 0, 0, None),
            slot("vm:10+2:q", Some(8), 1, 0, Some(0)),
        ];
        let ps = processes(&hs);
        assert_eq!(ps.len(), 2);
        assert!(ps.iter().all(|p| !p.threaded() && p.threads() == 1));
        assert_eq!(ps[1].busy(), 1);
    }
}
