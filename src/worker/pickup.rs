//! The worker's end of the pickup link: a Unix stream socket the master hands every worker at
//! spawn (`LOCKETD_PICKUP_FD`), over which an idle worker asks to be woken when a job is pushed
//! to one of its queues (`master/pickup.rs` does the watching).
//!
//! One JSON line per message from the worker ([`Report`]), one `wake <seq>` line per wake-up
//! from the master. Each `wait` carries a new sequence number and a wake-up names the `wait` it
//! answers, so a wake-up that crossed a `leave` on the socket is recognised as stale and
//! ignored. The link carries no job: the worker still reserves with RESERVE.

use serde::{Deserialize, Serialize};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// The longest line either side accepts (a `wait` naming its queue keys).
pub const MAX_LINE: usize = 1 << 20;

/// What a worker process tells the master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "m", rename_all = "lowercase")]
pub enum Report {
    /// A RESERVE pass found nothing: wake me (`wake <seq>`) when a job is pushed to one of
    /// `keys` (the queue keys that were empty, in priority order) or, with `glob`, when the set
    /// of known queues changes (a queue a pattern may match appeared).
    Wait {
        /// Names this wait; the wake-up repeats it.
        seq: u64,
        /// The queue keys to watch.
        keys: Vec<String>,
        /// The queue list has patterns (`*`, `foo*`, `!skip`).
        glob: bool,
    },
    /// The first pass after a wake-up reserved a job.
    Busy,
    /// The wait ended without a wake-up (its interval ran out, or a stop).
    Leave,
    /// A running job's handler group and the local end of its lease (CLOCK_MONOTONIC ns;
    /// none: it runs on without its lock), on every change: the master kills the group then
    /// if it still lives (`watchdog.rs`).
    Lease {
        /// The run's number in this process.
        serial: u64,
        /// The handler's process group.
        pgid: i32,
        /// The lease's local end.
        until_ns: Option<u64>,
    },
    /// H-18: run `serial`'s job started process group `pgid` of its own: the master kills it
    /// with the handler's group, before it.
    Group {
        /// The run's number in this process.
        serial: u64,
        /// The job's process group.
        pgid: i32,
    },
    /// Run `serial` is over: the master forgets its group.
    Forget {
        /// The run's number in this process.
        serial: u64,
    },
}

impl From<crate::watchdog::LeaseNote> for Report {
    fn from(n: crate::watchdog::LeaseNote) -> Report {
        use crate::watchdog::LeaseNote;
        match n {
            LeaseNote::Lease {
                serial,
                pgid,
                until_ns,
            } => Report::Lease {
                serial,
                pgid,
                until_ns,
            },
            LeaseNote::Group { serial, pgid } => Report::Group { serial, pgid },
            LeaseNote::Forget { serial } => Report::Forget { serial },
        }
    }
}

/// The worker's writing end (shared by the slots of a process).
#[derive(Debug)]
pub(super) struct Writer(OwnedWriteHalf);

/// The worker's reading end (held by the slot that waits for the process).
#[derive(Debug)]
pub(super) struct Reader {
    half: OwnedReadHalf,
    /// Bytes received that do not make a whole line yet.
    buf: Vec<u8>,
}

/// The link named by `LOCKETD_PICKUP_FD`, if the master gave one (a worker started by hand
/// has none and waits on its own BLMOVE).
pub(super) fn from_env() -> Option<(Reader, Writer)> {
    let fd: i32 = std::env::var(crate::process::PICKUP_FD_ENV)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if fd < 0 {
        return None;
    }
    // Handlers must not inherit it.
    // SAFETY: fcntl on a descriptor number; an invalid one just fails.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: the master passed this descriptor for this purpose alone; we own it from here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let std = std::os::unix::net::UnixStream::from(owned);
    std.set_nonblocking(true).ok()?;
    let stream = tokio::net::UnixStream::from_std(std).ok()?;
    let (half, write) = stream.into_split();
    Some((
        Reader {
            half,
            buf: Vec::new(),
        },
        Writer(write),
    ))
}

impl Writer {
    /// Sends one report (bounded: a master that reads nothing for a second breaks the link).
    pub(super) async fn send(&mut self, report: &Report) -> io::Result<()> {
        self.send_all(std::slice::from_ref(report)).await
    }

    /// Sends `reports` in order, in one write (one wake-up of the master).
    pub(super) async fn send_all(&mut self, reports: &[Report]) -> io::Result<()> {
        let mut line = Vec::new();
        for report in reports {
            serde_json::to_writer(&mut line, report).map_err(io::Error::other)?;
            line.push(b'\n');
        }
        match tokio::time::timeout(Duration::from_secs(1), self.0.write_all(&line)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the master reads nothing",
            )),
        }
    }
}

impl Reader {
    /// Returns once `wake <seq>` arrives; wake-ups for other sequence numbers are stale and
    /// passed over. Cancel-safe: bytes read stay in the buffer. An error means the link is
    /// gone (the master exited).
    pub(super) async fn woken(&mut self, seq: u64) -> io::Result<()> {
        loop {
            while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                if parse_wake(&line[..end]) == Some(seq) {
                    return Ok(());
                }
            }
            if self.buf.len() > MAX_LINE {
                return Err(io::Error::other("an overlong line from the master"));
            }
            let mut chunk = [0u8; 512];
            let n = self.half.read(&mut chunk).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// How near the end of the lease the master holds for a handler group the notes held back
/// against it may come before they go: at least the time a note takes to reach the master
/// and be read, with room for a busy runtime.
pub(super) const HOLD_MARGIN: Duration = Duration::from_secs(5);

/// The lease notes on their way to the master (`watchdog.rs`), in order, held back while
/// holding them changes nothing the master does, so that a stream of jobs through one
/// persistent handler costs the master a wake-up every lease or so, not one a job.
///
/// The master kills a reported run's group at the lease end it was told, unless told the run
/// ended ([`Report::Forget`]). A run's end is held back while that lease end is more than
/// [`HOLD_MARGIN`] away: the group is the handler's and outlives the run, and the master's
/// guard over it fires no sooner than it would have. The next run's lease on the same group,
/// and a lease extension, are held back while the master guards the group with an end no
/// later than theirs and more than [`HOLD_MARGIN`] away: its guard then kills the group no
/// later than their own leases end (NEVER-1 holds), and no sooner than [`HOLD_MARGIN`] before
/// the held notes go. A run that ends before its lease went is never reported. Everything held
/// goes in one write when that margin is reached ([`LeaseBatch::due`]), or with the first note
/// that cannot wait: a lease without an end, a new group, an end near its lease's, a job's own
/// group (H-18). A worker whose runtime stalls longer than the margin may see the master kill
/// the handler of a job whose lease is still good, which is the backstop erring early.
#[derive(Debug, Default)]
pub(super) struct LeaseBatch {
    /// The runs the master guards (their lease sent, their end not): the group and the latest
    /// lease end it was told (CLOCK_MONOTONIC ns; `None`: no end).
    told: std::collections::HashMap<u64, (i32, Option<u64>)>,
    held: Vec<Report>,
    /// When the held reports must go.
    due: Option<tokio::time::Instant>,
}

impl LeaseBatch {
    /// Takes `note` (at CLOCK_MONOTONIC `now_ns`) and returns what must be sent now, in order:
    /// nothing while it is held.
    pub(super) fn take(
        &mut self,
        note: crate::watchdog::LeaseNote,
        now_ns: u64,
        now: tokio::time::Instant,
    ) -> Vec<Report> {
        use crate::watchdog::LeaseNote;
        let margin = u64::try_from(HOLD_MARGIN.as_nanos()).unwrap_or(u64::MAX);
        let holds_until = |end: u64| end > now_ns.saturating_add(margin);
        let report: Report = note.into();
        let cover = match note {
            LeaseNote::Lease {
                pgid,
                until_ns: Some(until),
                ..
            } => self.guard_end(pgid, until).filter(|e| holds_until(*e)),
            LeaseNote::Lease { .. } | LeaseNote::Group { .. } => None,
            LeaseNote::Forget { serial } => {
                // Its lease still held: the master never heard of the run, nothing goes.
                if !self.told.contains_key(&serial) && self.drop_held_lease(serial) {
                    return Vec::new();
                }
                match self.told.get(&serial) {
                    Some((_, Some(end))) if holds_until(*end) => Some(*end),
                    _ => None,
                }
            }
        };
        let Some(end) = cover else {
            self.held.push(report);
            return self.flush();
        };
        // A later lease of a run held already replaces it.
        if let Report::Lease { serial, .. } = &report {
            self.drop_held_lease(*serial);
        }
        self.held.push(report);
        let at = now + Duration::from_nanos(end - margin - now_ns);
        self.due = Some(self.due.map_or(at, |d| d.min(at)));
        Vec::new()
    }

    /// The earliest lease end the master holds for group `pgid`, if it holds one and none of
    /// them ends after `until` (nor has no end).
    fn guard_end(&self, pgid: i32, until: u64) -> Option<u64> {
        self.told
            .values()
            .filter(|(g, _)| *g == pgid)
            .try_fold(None, |min: Option<u64>, (_, end)| match end {
                Some(e) if *e <= until => Some(Some(min.map_or(*e, |m| m.min(*e)))),
                _ => None,
            })
            .flatten()
    }

    /// Drops run `serial`'s held lease; whether there was one.
    fn drop_held_lease(&mut self, serial: u64) -> bool {
        let before = self.held.len();
        self.held
            .retain(|r| !matches!(r, Report::Lease { serial: s, .. } if *s == serial));
        self.held.len() < before
    }

    /// When the held reports must go, if any are held.
    pub(super) fn due(&self) -> Option<tokio::time::Instant> {
        self.due
    }

    /// Everything held, in order; what the master guards from then on is noted.
    pub(super) fn flush(&mut self) -> Vec<Report> {
        self.due = None;
        let out = std::mem::take(&mut self.held);
        for r in &out {
            match r {
                Report::Lease {
                    serial,
                    pgid,
                    until_ns,
                } => {
                    // The master's end only moves later (`kill_later`).
                    let e = self.told.entry(*serial).or_insert((*pgid, *until_ns));
                    e.0 = *pgid;
                    e.1 = match (e.1, *until_ns) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
                Report::Forget { serial } => {
                    self.told.remove(serial);
                }
                _ => {}
            }
        }
        out
    }
}

/// The master's wake-up line for `seq`.
pub fn wake_line(seq: u64) -> String {
    format!("wake {seq}\n")
}

fn parse_wake(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line)
        .ok()?
        .strip_prefix("wake ")?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watchdog::LeaseNote;

    const S: u64 = 1_000_000_000;

    fn lease(serial: u64, pgid: i32, until: u64) -> LeaseNote {
        LeaseNote::Lease {
            serial,
            pgid,
            until_ns: Some(until),
        }
    }

    // A stream of runs through one persistent handler: the first lease goes; the runs after
    // it, ends and leases, are held while the master's guard (run 1's end, 45 s) is more than
    // HOLD_MARGIN away, and go in one write when it is near: run 1's end and the run still
    // going, whose lease ends no sooner than the guard. A run that ended unreported is never
    // reported.
    #[tokio::test]
    async fn a_stream_of_runs_on_one_handler_goes_to_the_master_once_a_lease() {
        let mut b = LeaseBatch::default();
        let now = tokio::time::Instant::now();
        assert_eq!(
            b.take(lease(1, 42, 45 * S), 10 * S, now),
            vec![lease(1, 42, 45 * S).into()]
        );
        assert!(b
            .take(LeaseNote::Forget { serial: 1 }, 11 * S, now)
            .is_empty());
        assert_eq!(b.due(), Some(now + Duration::from_secs(45 - 5 - 11)));
        for serial in 2..=100 {
            let t = 11 * S + serial * S / 10;
            assert!(b.take(lease(serial, 42, t + 35 * S), t, now).is_empty());
            if serial < 100 {
                assert!(b.take(LeaseNote::Forget { serial }, t, now).is_empty());
            }
        }
        // Run 100's lease extended: held as well, in place of the first.
        assert!(b.take(lease(100, 42, 60 * S), 25 * S, now).is_empty());
        assert_eq!(
            b.flush(),
            vec![Report::Forget { serial: 1 }, lease(100, 42, 60 * S).into()]
        );
        assert_eq!(b.due(), None);
        // The master now guards run 100 (to 60 s): its end is held against that.
        assert!(b
            .take(LeaseNote::Forget { serial: 100 }, 26 * S, now)
            .is_empty());
        assert_eq!(b.flush(), vec![Report::Forget { serial: 100 }]);
        // Nothing guarded: the next lease goes at once.
        assert_eq!(
            b.take(lease(101, 42, 70 * S), 27 * S, now),
            vec![lease(101, 42, 70 * S).into()]
        );
    }

    // What cannot wait goes at once, with everything held before it, in order: a lease of
    // another group, a lease without an end, a lease that ends before the master's guard
    // (the master would kill later than it), a job's own group, and a run's end or a lease
    // within HOLD_MARGIN of the guard's end.
    #[test]
    fn what_cannot_wait_goes_at_once_with_what_was_held() {
        let now = tokio::time::Instant::now();
        let started = |b: &mut LeaseBatch| {
            b.take(lease(1, 7, 50 * S), 10 * S, now);
            assert!(b
                .take(LeaseNote::Forget { serial: 1 }, 11 * S, now)
                .is_empty());
        };
        let cases: Vec<(LeaseNote, u64)> = vec![
            (lease(2, 8, 50 * S), 11 * S),
            (
                LeaseNote::Lease {
                    serial: 2,
                    pgid: 7,
                    until_ns: None,
                },
                11 * S,
            ),
            (lease(2, 7, 40 * S), 11 * S),
            (LeaseNote::Group { serial: 2, pgid: 9 }, 11 * S),
            // Within the margin of run 1's end: 50 - 5 = 45 s.
            (lease(2, 7, 80 * S), 46 * S),
        ];
        for (note, at) in cases {
            let mut b = LeaseBatch::default();
            started(&mut b);
            assert_eq!(
                b.take(note, at, now),
                vec![Report::Forget { serial: 1 }, note.into()],
                "{note:?}"
            );
            assert_eq!(b.due(), None);
        }
        // A run's end near its lease's end goes at once.
        let mut b = LeaseBatch::default();
        b.take(lease(1, 7, 14 * S), 10 * S, now);
        assert_eq!(
            b.take(LeaseNote::Forget { serial: 1 }, 10 * S, now),
            vec![Report::Forget { serial: 1 }]
        );
    }

    #[test]
    fn reports_are_one_json_line_each() {
        let r = Report::Wait {
            seq: 7,
            keys: vec!["resque:queue:a b".into()],
            glob: true,
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"m":"wait","seq":7,"keys":["resque:queue:a b"],"glob":true}"#
        );
        assert_eq!(serde_json::from_str::<Report>(&text).unwrap(), r);
        assert_eq!(
            serde_json::from_str::<Report>(r#"{"m":"busy"}"#).unwrap(),
            Report::Busy
        );
    }

    #[test]
    fn lease_reports_round_trip() {
        for r in [
            Report::Lease {
                serial: 3,
                pgid: 77,
                until_ns: Some(123_456_789),
            },
            Report::Lease {
                serial: 4,
                pgid: 78,
                until_ns: None,
            },
            Report::Group {
                serial: 4,
                pgid: 79,
            },
            Report::Forget { serial: 3 },
        ] {
            let text = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Report>(&text).unwrap(), r, "{text}");
        }
    }

    #[test]
    fn wake_lines_round_trip() {
        let line = wake_line(42);
        assert_eq!(parse_wake(line.trim_end().as_bytes()), Some(42));
        assert_eq!(parse_wake(b"wake x"), None);
        assert_eq!(parse_wake(b"nope 1"), None);
    }

    #[tokio::test]
    async fn a_stale_wake_is_passed_over() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (half, _w) = a.into_split();
        let mut reader = Reader {
            half,
            buf: Vec::new(),
        };
        let (_r, mut master) = b.into_split();
        master
            .write_all(format!("{}{}", wake_line(1), wake_line(2)).as_bytes())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), reader.woken(2))
            .await
            .expect("woken by its own seq")
            .unwrap();
        drop(master);
        let r = tokio::time::timeout(Duration::from_secs(5), reader.woken(3)).await;
        assert!(r.expect("EOF ends the wait").is_err());
    }
}
