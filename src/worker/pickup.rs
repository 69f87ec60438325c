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

/// How long the end of a run is held back for the next run's lease, so that the two reach the
/// master in one write: a busy worker's runs follow each other within a millisecond or two.
pub(super) const FORGET_HOLD: Duration = Duration::from_millis(50);
/// A run whose lease ends sooner than this is forgotten at once: the master must not kill its
/// group (a persistent handler's, which outlives the run) while the end waits.
const FORGET_NOW_WITHIN: Duration = Duration::from_secs(1);

/// The lease notes on their way to the master (`watchdog.rs`), in order: a run's end
/// ([`Report::Forget`]) waits up to [`FORGET_HOLD`] for the next note and goes in the same
/// write with it, which halves the master's wake-ups in a stream of jobs. A lease change goes
/// at once. The master kills a group only at its lease's end, at least [`FORGET_NOW_WITHIN`]
/// after a held end, so holding it back changes nothing it does.
#[derive(Debug, Default)]
pub(super) struct LeaseBatch {
    /// Each reported run's lease end (CLOCK_MONOTONIC ns; `None`: no end).
    ends: std::collections::HashMap<u64, Option<u64>>,
    held: Vec<Report>,
    /// When the first held report must go.
    due: Option<tokio::time::Instant>,
}

impl LeaseBatch {
    /// Takes `note` (at CLOCK_MONOTONIC `now_ns`) and returns what must be sent now, in order:
    /// nothing while a run's end is held.
    pub(super) fn take(
        &mut self,
        note: crate::watchdog::LeaseNote,
        now_ns: u64,
        now: tokio::time::Instant,
    ) -> Vec<Report> {
        use crate::watchdog::LeaseNote;
        match note {
            LeaseNote::Lease {
                serial, until_ns, ..
            } => {
                self.ends.insert(serial, until_ns);
                self.held.push(note.into());
                self.flush()
            }
            LeaseNote::Group { .. } => {
                self.held.push(note.into());
                self.flush()
            }
            LeaseNote::Forget { serial } => {
                let end = self.ends.remove(&serial).flatten();
                self.held.push(note.into());
                let near = u64::try_from(FORGET_NOW_WITHIN.as_nanos()).unwrap_or(u64::MAX);
                if end.is_some_and(|e| e <= now_ns.saturating_add(near)) {
                    return self.flush();
                }
                self.due.get_or_insert(now + FORGET_HOLD);
                Vec::new()
            }
        }
    }

    /// When the held reports must go, if any are held.
    pub(super) fn due(&self) -> Option<tokio::time::Instant> {
        self.due
    }

    /// Everything held, in order.
    pub(super) fn flush(&mut self) -> Vec<Report> {
        self.due = None;
        std::mem::take(&mut self.held)
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

    // A run's end waits for the next run's lease and goes with it, in order, in one batch; a
    // lease change goes at once; the hold ends at FORGET_HOLD.
    #[tokio::test]
    async fn a_runs_end_goes_with_the_next_runs_lease() {
        let mut b = LeaseBatch::default();
        let now = tokio::time::Instant::now();
        let lease = |serial, until| LeaseNote::Lease {
            serial,
            pgid: 42,
            until_ns: Some(until),
        };
        assert_eq!(
            b.take(lease(1, 100 * S), 10 * S, now),
            vec![lease(1, 100 * S).into()]
        );
        assert!(b
            .take(LeaseNote::Forget { serial: 1 }, 11 * S, now)
            .is_empty());
        assert_eq!(b.due(), Some(now + FORGET_HOLD));
        assert_eq!(
            b.take(lease(2, 110 * S), 11 * S, now),
            vec![Report::Forget { serial: 1 }, lease(2, 110 * S).into()]
        );
        assert_eq!(b.due(), None);
        // Alone, it goes when the hold ends.
        assert!(b
            .take(LeaseNote::Forget { serial: 2 }, 12 * S, now)
            .is_empty());
        assert_eq!(b.flush(), vec![Report::Forget { serial: 2 }]);
        assert!(b.flush().is_empty());
    }

    // A run whose lease ends within FORGET_NOW_WITHIN is forgotten at once, with what was held.
    #[test]
    fn a_run_whose_lease_ends_soon_is_forgotten_at_once() {
        let mut b = LeaseBatch::default();
        let now = tokio::time::Instant::now();
        for (serial, until) in [(1, 50 * S), (2, 10 * S + S / 2)] {
            b.take(
                LeaseNote::Lease {
                    serial,
                    pgid: 7,
                    until_ns: Some(until),
                },
                10 * S,
                now,
            );
        }
        assert!(b
            .take(LeaseNote::Forget { serial: 1 }, 10 * S, now)
            .is_empty());
        assert_eq!(
            b.take(LeaseNote::Forget { serial: 2 }, 10 * S, now),
            vec![Report::Forget { serial: 1 }, Report::Forget { serial: 2 }]
        );
        assert_eq!(b.due(), None);
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
