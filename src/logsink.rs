//! The log writer: logging never blocks the daemon (issue 11, finding 5).
//!
//! tracing's writer used to be stderr itself, so when whatever reads the daemon's stderr
//! stopped reading (a journald stall, Docker's blocking log mode, a full pipe), the next log
//! line blocked the worker's only runtime thread: lock extensions (A-10), the local lock
//! deadline (L-9) and the process lease all froze while the handler ran on, and a second
//! holder could start beside it. Here every line is appended to a bounded queue and written by
//! a thread of its own; when the queue is full the line is dropped and counted, and the next
//! line the queue takes is preceded by one notice with the number dropped. At exit
//! [`LogSink::flush`] waits, bounded, for the queue to drain.
//!
//! The queue is one byte buffer under a mutex, which the writer thread swaps for an empty one:
//! a line costs a copy into it, not an allocation and a channel message of its own (a worker
//! at `info` logs two lines per job; the channel and the allocator were about 900 of their
//! instructions a job).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Lines queued at most while the sink does not take them (a few MiB of typical lines).
pub const QUEUE_LINES: usize = 8192;

/// What the daemon has handed over and the writer thread has not taken yet.
#[derive(Default)]
struct Queue {
    /// Whole lines, in order.
    bytes: Vec<u8>,
    lines: usize,
    /// Lines dropped since the last notice was queued.
    unreported: u64,
    /// Flushes waiting for the lines queued before them.
    flushes: Vec<SyncSender<()>>,
    /// The writer thread waits on [`Shared::wake`] for a line (whoever queues one wakes it).
    idle: bool,
    /// False when there is no writer thread: lines are dropped at once, uncounted.
    running: bool,
    /// Every [`LogSink`] is gone: the thread writes what is left and ends.
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    dropped: AtomicU64,
    json: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Nothing panics while holding it; a poisoned queue is still a queue.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The last [`LogSink`] clone to go tells the thread to finish.
struct Handle(Arc<Shared>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.wake.notify_one();
    }
}

/// The queue and its writer thread. Also tracing's `MakeWriter`: one [`SinkWriter`] per event.
#[derive(Clone)]
pub struct LogSink(Arc<Handle>);

impl LogSink {
    /// Starts the writer thread over `out`. `json`: the dropped-lines notice is written as a
    /// JSON object, like the other lines, instead of text.
    pub fn start<W: Write + Send + 'static>(out: W, json: bool) -> LogSink {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                running: true,
                ..Queue::default()
            }),
            wake: Condvar::new(),
            dropped: AtomicU64::new(0),
            json,
        });
        let theirs = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("locketd-log".into())
            .spawn(move || write_lines(out, &theirs));
        if let Err(e) = spawned {
            // No thread: every line is dropped, the daemon still runs.
            eprintln!("locketd: cannot start the log writer thread: {e}");
            shared.lock().running = false;
        }
        LogSink(Arc::new(Handle(shared)))
    }

    fn shared(&self) -> &Shared {
        &(self.0).0
    }

    /// A writer for one event.
    pub fn writer(&self) -> SinkWriter<'_> {
        SinkWriter(self)
    }

    /// Log lines dropped so far because the sink did not take them.
    pub fn dropped(&self) -> u64 {
        self.shared().dropped.load(Ordering::Relaxed)
    }

    /// Queues `line` (one event) without waiting, or drops and counts it when the queue is full.
    fn push(&self, line: &[u8]) {
        let shared = self.shared();
        let mut q = shared.lock();
        if !q.running {
            return;
        }
        if q.lines >= QUEUE_LINES {
            q.unreported += 1;
            drop(q);
            shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if q.unreported > 0 {
            let text = notice(q.unreported, shared.json);
            q.bytes.extend_from_slice(text.as_bytes());
            q.unreported = 0;
        }
        q.bytes.extend_from_slice(line);
        q.lines += 1;
        let wake = std::mem::take(&mut q.idle);
        drop(q);
        if wake {
            shared.wake.notify_one();
        }
    }

    /// Waits until every line queued before this call is written, at most `timeout`. False
    /// when the sink did not take them in time (those lines are then lost at exit).
    pub fn flush(&self, timeout: Duration) -> bool {
        let shared = self.shared();
        let (done_tx, done_rx) = sync_channel(1);
        {
            let mut q = shared.lock();
            if !q.running {
                return false;
            }
            q.flushes.push(done_tx);
            q.idle = false;
        }
        shared.wake.notify_one();
        done_rx.recv_timeout(timeout).is_ok()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = SinkWriter<'a>;

    fn make_writer(&'a self) -> SinkWriter<'a> {
        SinkWriter(self)
    }
}

/// One event's writer: hands the formatted event to the queue without waiting (tracing's fmt
/// layer writes an event with one `write_all`).
pub struct SinkWriter<'a>(&'a LogSink);

impl Write for SinkWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How long the writer thread naps between batches while lines keep coming.
const NAP: Duration = Duration::from_millis(10);
/// Empty naps in a row before it blocks until the next line.
const IDLE_NAPS: u32 = 2;
/// A batch buffer grown past this by a burst is given back after it is written.
const KEEP_BYTES: usize = 256 * 1024;

/// The writer thread. Under load it takes the queued lines as one batch, one write per batch,
/// and naps [`NAP`] between batches, so that a busy daemon does not wake it once per line (a
/// futex wake and a context switch per line cost more than the line); after [`IDLE_NAPS`]
/// empty naps it blocks until the next line, so that an idle daemon costs nothing. A line
/// reaches stderr at most one nap after it was logged, and every queued line before the
/// process exits ([`LogSink::flush`]). The nap was 1 ms: a prefork worker's log thread then took
/// 7% of the worker's CPU samples, two thirds of it in `clock_nanosleep`
/// (docs/dev/performance-log.md). The queue's lock is never held while writing.
fn write_lines<W: Write>(mut out: W, shared: &Shared) {
    let mut batch: Vec<u8> = Vec::new();
    let mut idle_naps = 0;
    loop {
        let (flushes, closed) = {
            let mut q = shared.lock();
            std::mem::swap(&mut q.bytes, &mut batch);
            q.lines = 0;
            (std::mem::take(&mut q.flushes), q.closed)
        };
        if !batch.is_empty() {
            idle_naps = 0;
            // A sink that fails (a reader gone for good) loses the lines; nothing panics.
            let _ = out.write_all(&batch);
            batch.clear();
            if batch.capacity() > KEEP_BYTES {
                batch = Vec::new();
            }
        }
        if !flushes.is_empty() {
            let _ = out.flush();
            for done in flushes {
                let _ = done.send(());
            }
        }
        if closed {
            return;
        }
        if idle_naps < IDLE_NAPS {
            idle_naps += 1;
            std::thread::sleep(NAP);
            continue;
        }
        let mut q = shared.lock();
        while q.bytes.is_empty() && q.flushes.is_empty() && !q.closed {
            q.idle = true;
            q = shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
        q.idle = false;
    }
}

fn notice(n: u64, json: bool) -> String {
    if json {
        format!(
            "{{\"level\":\"WARN\",\"target\":\"locketd\",\"message\":\"log lines were dropped: stderr was not being read\",\"dropped\":{n}}}\n"
        )
    } else {
        format!(" WARN locketd: {n} log lines were dropped: stderr was not being read\n")
    }
}

/// The text log's timestamp, `2026-11-27T02:16:30.351529Z`, as tracing-subscriber's own
/// `SystemTime` timer writes it, with the text of the current second kept per thread: every
/// job logs two lines, and formatting the date and time anew for each was a fifth of their
/// cost. Years outside 0..=9999 are left to tracing-subscriber's timer.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogClock;

impl tracing_subscriber::fmt::time::FormatTime for LogClock {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let now = std::time::SystemTime::now();
        match now.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) if d.as_secs() < YEAR_10000 => write_stamp(d.as_secs(), d.subsec_micros(), w),
            _ => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// 10000-01-01T00:00:00Z in seconds since the epoch.
const YEAR_10000: u64 = 253_402_300_800;

/// `YYYY-MM-DDTHH:MM:SS.uuuuuuZ` of `secs` (before year 10000) and `micros`.
fn write_stamp(secs: u64, micros: u32, w: &mut impl std::fmt::Write) -> std::fmt::Result {
    crate::resque::time::with_iso_second(secs as i64, |text| w.write_str(text))?;
    let mut digits = *b".000000Z";
    let mut m = micros.min(999_999);
    for d in digits[1..7].iter_mut().rev() {
        *d = b'0' + (m % 10) as u8;
        m /= 10;
    }
    w.write_str(std::str::from_utf8(&digits).expect("ASCII digits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A sink that blocks until told to go, then records what it was given.
    #[derive(Clone)]
    struct Gate(Arc<(Mutex<bool>, std::sync::Condvar)>, Arc<Mutex<Vec<u8>>>);

    impl Write for Gate {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let (open, cv) = &*self.0;
            let mut o = open.lock().unwrap();
            while !*o {
                o = cv.wait(o).unwrap();
            }
            self.1.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // Issue 11, finding 5: a sink that takes nothing never blocks the writer; what does not
    // fit is dropped, counted, and reported once the sink takes lines again.
    #[test]
    fn a_stalled_sink_drops_and_counts_lines_and_never_blocks() {
        let gate = Gate(Arc::default(), Arc::default());
        let sink = LogSink::start(gate.clone(), false);
        let started = Instant::now();
        let mut w = sink.writer();
        // The writer thread holds at most one batch of QUEUE_LINES lines and the queue
        // QUEUE_LINES more: of four times QUEUE_LINES, at least QUEUE_LINES are dropped.
        for i in 0..(4 * QUEUE_LINES) {
            w.write_all(format!("line {i}\n").as_bytes()).unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer blocked"
        );
        assert!(
            sink.dropped() >= QUEUE_LINES as u64,
            "dropped {}",
            sink.dropped()
        );
        assert!(
            !sink.flush(Duration::from_millis(50)),
            "a stalled sink flushed"
        );
        *gate.0 .0.lock().unwrap() = true;
        gate.0 .1.notify_all();
        assert!(
            sink.flush(Duration::from_secs(5)),
            "the queue did not drain"
        );
        w.write_all(b"after\n").unwrap();
        assert!(sink.flush(Duration::from_secs(5)));
        let text = String::from_utf8(gate.1.lock().unwrap().clone()).unwrap();
        // Each notice comes with the first line taken after drops, and counts the drops since
        // the last one: "after", or a line of the burst when the writer thread freed room
        // during it (under load, it may). Together they count every line dropped.
        let notice = " log lines were dropped: stderr was not being read\n";
        assert!(
            text.ends_with("after\n"),
            "{}",
            &text[text.len().saturating_sub(200)..]
        );
        let counts: Vec<u64> = text
            .match_indices(notice)
            .map(|(at, _)| {
                text[..at]
                    .rsplit([' ', '\n'])
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("the notice names a count")
            })
            .collect();
        assert!(!counts.is_empty(), "the drops are reported");
        assert_eq!(counts.iter().sum::<u64>(), sink.dropped(), "{counts:?}");
    }

    // The thread writes what is left once the last sink is gone, and ends.
    #[test]
    fn the_last_lines_are_written_when_the_sink_goes() {
        let gate = Gate(Arc::default(), Arc::default());
        *gate.0 .0.lock().unwrap() = true;
        let sink = LogSink::start(gate.clone(), false);
        let shared = sink.0 .0.clone();
        sink.writer().write_all(b"one\n").unwrap();
        sink.writer().write_all(b"two\n").unwrap();
        drop(sink);
        let deadline = Instant::now() + Duration::from_secs(5);
        // The thread holds the last other reference to the queue until it ends.
        while Arc::strong_count(&shared) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(Arc::strong_count(&shared), 1, "the thread did not end");
        assert_eq!(gate.1.lock().unwrap().as_slice(), b"one\ntwo\n");
    }

    #[test]
    fn the_log_clock_writes_what_tracing_subscribers_timer_writes() {
        use tracing_subscriber::fmt::format::Writer;
        use tracing_subscriber::fmt::time::FormatTime;
        let mut text = String::new();
        write_stamp(1_795_746_990, 351_529, &mut text).unwrap();
        assert_eq!(text, "2026-11-27T02:36:30.351529Z");
        // The kept second is not handed out for another one, nor for a leap day.
        text.clear();
        write_stamp(1_795_746_991, 7, &mut text).unwrap();
        assert_eq!(text, "2026-11-27T02:36:31.000007Z");
        text.clear();
        write_stamp(951_782_400, 0, &mut text).unwrap();
        assert_eq!(text, "2000-02-29T00:00:00.000000Z");
        // Against tracing-subscriber's own, now: the same layout, and a time between two of
        // its readings (text of this layout sorts as the times do).
        let theirs = || {
            let mut t = String::new();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut t))
                .unwrap();
            t
        };
        let before = theirs();
        let mut ours = String::new();
        LogClock.format_time(&mut Writer::new(&mut ours)).unwrap();
        let after = theirs();
        let shape = |s: &str| -> String {
            s.chars()
                .map(|c| if c.is_ascii_digit() { '9' } else { c })
                .collect()
        };
        assert_eq!(shape(&ours), shape(&before), "{ours} vs {before}");
        assert!(
            before <= ours && ours <= after,
            "{before} <= {ours} <= {after}"
        );
    }
}
