//! The text log's event formatter: the lines tracing-subscriber's `Full` format writes (no
//! ANSI colours), byte for byte, in a fifth of the instructions for the usual events.
//!
//! A worker at `info` writes two lines per job ("job started", "job finished"). Through
//! tracing-subscriber's formatter they cost about 18,000 instructions a job (issue 40;
//! `LOG_LEVEL=info bench/callgrind-per-job.sh`): each field goes through three nested
//! `write!`s, two of them for ANSI styles that are off, and the message through an escaping
//! writer called once per character. [`TextFormat`] writes the same text directly for an event
//! outside any span with no `log` crate record behind it and no error-typed field; any other
//! event (and any value whose formatting fails) is handed to tracing-subscriber's own `Full`
//! format, so every line is the one that format writes.
//!
//! It also keeps every event on one line of its own: queue and class names come from job
//! producers and are logged as given, so a newline in one would start a line of its own (a
//! forged `ERROR` line, say); inside an event, newlines and carriage returns are written as
//! `\n` and `\r`. (The JSON format escapes them already.)

use crate::logsink::LogClock;
use std::cell::RefCell;
use std::fmt::{self, Write as _};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent};
use tracing_subscriber::registry::LookupSpan;

/// The text format: tracing-subscriber's `Full` format with timer `T`, without ANSI colours and
/// with its escaping of control characters in messages, one line per event. Pair it with
/// tracing-subscriber's `DefaultFields` (the builder's default) and `with_ansi(false)`.
#[derive(Debug)]
pub struct TextFormat<T = LogClock> {
    timer: T,
    /// What writes the events the direct path leaves alone.
    stock: Format<Full, T>,
}

impl Default for TextFormat<LogClock> {
    fn default() -> Self {
        TextFormat::with_timer(LogClock)
    }
}

impl<T: FormatTime + Clone> TextFormat<T> {
    /// The text format with timestamps from `timer`.
    pub fn with_timer(timer: T) -> Self {
        TextFormat {
            stock: Format::default().with_timer(timer.clone()),
            timer,
        }
    }
}

thread_local! {
    /// The line being formatted, kept per thread so that its buffer is reused.
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
}

impl<S, T> FormatEvent<S, DefaultFields> for TextFormat<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    T: FormatTime,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, DefaultFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        LINE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut line) => self.format_line(&mut line, ctx, &mut writer, event),
            // An event logged while this thread formats one (by a field's Display, say).
            Err(_) => self.format_line(&mut String::new(), ctx, &mut writer, event),
        })
    }
}

impl<T: FormatTime> TextFormat<T> {
    fn format_line<S>(
        &self,
        line: &mut String,
        ctx: &FmtContext<'_, S, DefaultFields>,
        writer: &mut Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        line.clear();
        // Spans are written with their fields (formatted by N, kept in the span); a `log`
        // record's target is the one it carries ("log" is tracing-log's own).
        let direct = ctx.event_scope().is_none()
            && event.metadata().target() != "log"
            && self.write_direct(line, event).is_ok();
        if !direct {
            line.clear();
            self.stock.format_event(ctx, Writer::new(line), event)?;
        }
        write_one_line(line, writer)
    }

    /// What `Format<Full, T>` writes for an event outside spans, without ANSI: timestamp, level,
    /// target, fields. Err: leave the event to `Format<Full, T>` (an error-typed field, or a
    /// value whose formatting failed, which fails there too and drops the event).
    fn write_direct(&self, line: &mut String, event: &Event<'_>) -> Result<(), Unusual> {
        let meta = event.metadata();
        if self.timer.format_time(&mut Writer::new(line)).is_err() {
            line.push_str("<unknown time>");
        }
        line.push_str(match *meta.level() {
            Level::TRACE => " TRACE ",
            Level::DEBUG => " DEBUG ",
            Level::INFO => "  INFO ",
            Level::WARN => "  WARN ",
            Level::ERROR => " ERROR ",
        });
        line.push_str(meta.target());
        line.push_str(": ");
        let mut fields = Fields {
            line,
            empty: true,
            unusual: false,
        };
        event.record(&mut fields);
        if fields.unusual {
            return Err(Unusual);
        }
        line.push('\n');
        Ok(())
    }
}

/// The event needs tracing-subscriber's own formatter.
struct Unusual;

/// tracing-subscriber's `DefaultVisitor`, without ANSI and with its sanitizing of messages:
/// `message` first as given, then ` name=value` with the value's `Debug` (a `%` field's
/// `Display`), `r#` dropped from a name, `log.` fields left out.
struct Fields<'a> {
    line: &'a mut String,
    empty: bool,
    unusual: bool,
}

impl Fields<'_> {
    fn pad(&mut self) {
        if self.empty {
            self.empty = false;
        } else {
            self.line.push(' ');
        }
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.unusual {
            return;
        }
        if field.name() == "message" {
            // `Debug` of `format_args!("{}", value)` is the text itself.
            self.pad();
            push_sanitized(self.line, value);
        } else {
            self.record_debug(field, &value)
        }
    }

    fn record_error(&mut self, _field: &Field, _value: &(dyn std::error::Error + 'static)) {
        // Written with its chain of sources; rare enough to leave to tracing-subscriber.
        self.unusual = true;
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.unusual {
            return;
        }
        let name = field.name();
        if name.starts_with("log.") {
            return;
        }
        self.pad();
        if name == "message" {
            let start = self.line.len();
            if write!(self.line, "{value:?}").is_err() {
                self.unusual = true;
                return;
            }
            if needs_sanitizing(&self.line[start..]) {
                let text = self.line.split_off(start);
                push_sanitized(self.line, &text);
            }
            return;
        }
        self.line.push_str(name.strip_prefix("r#").unwrap_or(name));
        self.line.push('=');
        if write!(self.line, "{value:?}").is_err() {
            self.unusual = true;
        }
    }
}

/// Whether `text` holds a character tracing-subscriber escapes in messages: ESC, BEL, BS, FF,
/// DEL, or a C1 control (U+0080..U+009F, UTF-8 `C2 80`..`C2 9F`).
fn needs_sanitizing(text: &str) -> bool {
    text.bytes()
        .any(|b| matches!(b, 0x07 | 0x08 | 0x0c | 0x1b | 0x7f | 0xc2))
}

/// `text` as tracing-subscriber writes a message: the characters of [`needs_sanitizing`] as
/// `\x1b` (the C0 ones and DEL) and `\u{85}` (C1), the rest as they are.
fn push_sanitized(line: &mut String, text: &str) {
    if !needs_sanitizing(text) {
        line.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '\x07' | '\x08' | '\x0c' | '\x1b' | '\x7f' => {
                let _ = write!(line, "\\x{:02x}", c as u32);
            }
            '\u{80}'..='\u{9f}' => {
                let _ = write!(line, "\\u{{{:x}}}", c as u32);
            }
            c => line.push(c),
        }
    }
}

/// Writes `line` (ending in a newline) to `out` with the newlines and carriage returns before
/// its last character written as `\n` and `\r`.
fn write_one_line(line: &str, out: &mut Writer<'_>) -> fmt::Result {
    let body = line.strip_suffix('\n').unwrap_or(line);
    if memchr::memchr2(b'\n', b'\r', body.as_bytes()).is_none() {
        return out.write_str(line);
    }
    let mut rest = body;
    while let Some(i) = memchr::memchr2(b'\n', b'\r', rest.as_bytes()) {
        out.write_str(&rest[..i])?;
        out.write_str(if rest.as_bytes()[i] == b'\n' {
            "\\n"
        } else {
            "\\r"
        })?;
        rest = &rest[i + 1..];
    }
    out.write_str(rest)?;
    if body.len() < line.len() {
        out.write_str("\n")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing::{debug, error, info, info_span, trace, warn};
    use tracing_subscriber::fmt::MakeWriter;

    /// A fixed time, so that two formatters write the same stamp.
    #[derive(Clone, Copy)]
    struct Fixed;

    impl FormatTime for Fixed {
        fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
            w.write_str("2026-11-28T15:35:25.123456Z")
        }
    }

    /// What a subscriber wrote, one entry per event.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<String>>>);

    struct Entry(Lines, Vec<u8>);

    impl std::io::Write for Entry {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.1.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Drop for Entry {
        fn drop(&mut self) {
            let text = String::from_utf8(std::mem::take(&mut self.1)).unwrap();
            (self.0).0.lock().unwrap().push(text);
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Entry;
        fn make_writer(&'a self) -> Entry {
            Entry(self.clone(), Vec::new())
        }
    }

    #[derive(Debug)]
    struct Oops(Option<Box<Oops>>);

    impl fmt::Display for Oops {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(if self.0.is_some() { "outer" } else { "inner" })
        }
    }

    impl std::error::Error for Oops {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.0.as_deref().map(|e| e as _)
        }
    }

    /// A value whose `Display` fails: the event is dropped.
    struct Fails;

    impl fmt::Display for Fails {
        fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
            Err(fmt::Error)
        }
    }

    /// The events the daemon logs, and the odd ones, through `f`.
    fn events() {
        let queue = String::from("bench");
        let class = "Noop".to_string();
        let worker = "host:123:bench,other";
        info!(target: "locketd::worker", queue = %queue, class = %class, worker = %worker, "job started");
        info!(target: "locketd::worker", queue = %queue, class = %class, worker = %worker, elapsed = 0.000123_f64, outcome = "success", "job finished");
        info!(target: "locketd::worker", elapsed = 1e-7_f64, big = 1e17_f64, whole = 3.0_f64, n = 7u64, i = -3i64, b = true, "floats {} and {:?}", 1.5, "q");
        warn!(target: "locketd", class = %"A\nERROR forged\r", "no handler for {}", "it\n");
        error!(queue = ?"q\"x", r#type = "t", "message with \x1b[31m, \x07\u{85}\u{a0}é and \x7f");
        debug!(target: "locketd::x", "debug");
        trace!(target: "locketd::x", n = 1, "trace");
        info!(target: "locketd::x", n = 1);
        info!(target: "locketd::x", n = 1, message = "after a field");
        info!(target: "locketd::x", message = %"display message\x1b");
        info!(target: "locketd::x", message = ?"debug message");
        info!(target: "locketd::x", kept = 1, log.target = "x", "log. fields");
        info!(target: "locketd::x", "");
        let e = Oops(Some(Box::new(Oops(None))));
        error!(target: "locketd::x", error = &e as &(dyn std::error::Error + 'static), "an error");
        warn!(target: "locketd::x", q = %Fails, "dropped");
        warn!(target: "locketd::x", "after the dropped one");
        let span = info_span!("outer", id = 5);
        span.in_scope(|| info!(target: "locketd::x", n = 2, "in a span"));
        info!(target: "log", "a tracing event with target log");
    }

    fn capture<E>(format: E) -> Vec<String>
    where
        E: FormatEvent<tracing_subscriber::Registry, DefaultFields> + Send + Sync + 'static,
    {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(Level::TRACE)
            .with_ansi(false)
            .log_internal_errors(false)
            .with_writer(lines.clone())
            .event_format(format)
            .finish();
        tracing::subscriber::with_default(subscriber, events);
        let out = lines.0.lock().unwrap().clone();
        out
    }

    /// tracing-subscriber's `Full` text, each event on one line (as the log writes it).
    fn one_line(text: &str) -> String {
        let body = text.strip_suffix('\n').unwrap_or(text);
        let escaped = body.replace('\n', "\\n").replace('\r', "\\r");
        if body.len() < text.len() {
            escaped + "\n"
        } else {
            escaped
        }
    }

    #[test]
    fn lines_are_tracing_subscribers_full_format_byte_for_byte() {
        let ours = capture(TextFormat::with_timer(Fixed));
        let theirs = capture(Format::default().with_timer(Fixed));
        assert!(ours.len() >= 15, "{ours:#?}");
        assert_eq!(ours.len(), theirs.len());
        for (o, t) in ours.iter().zip(&theirs) {
            assert_eq!(o, &one_line(t));
        }
        assert_eq!(
            ours[0],
            "2026-11-28T15:35:25.123456Z  INFO locketd::worker: job started queue=bench class=Noop worker=host:123:bench,other\n"
        );
        // The forged line stays inside its event.
        assert!(
            ours.iter()
                .any(|l| l
                    .ends_with("WARN locketd: no handler for it\\n class=A\\nERROR forged\\r\n")),
            "{ours:#?}"
        );
        assert!(ours.iter().all(|l| l.matches('\n').count() == 1));
        // An event whose field cannot be formatted is dropped, as there.
        assert!(
            !ours.iter().any(|l| l.ends_with(": dropped\n")),
            "{ours:#?}"
        );
    }

    #[test]
    fn a_newline_before_the_end_is_escaped_and_the_last_kept() {
        let mut out = String::new();
        write_one_line("a\nb\r\n", &mut Writer::new(&mut out)).unwrap();
        write_one_line("plain\n", &mut Writer::new(&mut out)).unwrap();
        write_one_line("no end\r", &mut Writer::new(&mut out)).unwrap();
        assert_eq!(out, "a\\nb\\r\nplain\nno end\\r");
    }
}
