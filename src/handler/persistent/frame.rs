//! The frames a persistent handler writes on fd 4 (persistent-handlers.md §4, H-4, H-5): one
//! compact JSON object per line, read with a bounded line reader.

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// How much of a bad frame a failure record quotes (H-5).
const QUOTE_BYTES: usize = 200;

/// One frame from the handler.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Frame {
    /// The app is loaded.
    Ready {
        pid: Option<u64>,
        adapter: String,
        features: Vec<String>,
    },
    /// The job's code is about to run.
    Started { id: String, child_pid: Option<u64> },
    /// The job's outcome. `recorded`: the app recorded the failure through its own failure
    /// backend (H-17), so locketd writes no record of its own.
    Done {
        id: String,
        outcome: Done,
        recorded: bool,
    },
    /// The handler exits after its last `done`.
    Bye { reason: String },
    /// H-18: the adapter started a subprocess for job `id` in process group `pgid` of the
    /// job's own (threaded mode).
    Group { id: String, pgid: i32 },
}

/// A `done` frame's outcome (H-7).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Done {
    /// `ok`; `performed: false` is a job its hooks skipped (still processed).
    Ok { performed: bool },
    /// `failed`, with Resque's three failure fields.
    Failed {
        exception: String,
        error: String,
        backtrace: Vec<String>,
    },
    /// `reschedule`: like exit status 75.
    Reschedule,
    /// `throttled` (rate-limits.md RL-4), with `retry_after` seconds when given: like exit
    /// status 76.
    Throttled { retry_after: Option<f64> },
}

/// A frame that breaks the protocol (H-5): what was wrong and the frame's first bytes.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ProtocolError {
    pub(super) what: String,
    pub(super) quote: String,
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.quote.is_empty() {
            f.write_str(&self.what)
        } else {
            write!(f, "{}: {}", self.what, self.quote)
        }
    }
}

fn quote(bytes: &[u8]) -> String {
    let mut end = bytes.len().min(QUOTE_BYTES);
    // Cut on a character boundary when the text is UTF-8; lossy otherwise.
    while end > 0 && end < bytes.len() && std::str::from_utf8(&bytes[..end]).is_err() {
        end -= 1;
        if bytes.len() - end > 4 {
            break;
        }
    }
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

fn bad(what: impl Into<String>, bytes: &[u8]) -> ProtocolError {
    ProtocolError {
        what: what.into(),
        quote: quote(bytes),
    }
}

fn text(v: &Value, field: &str) -> Option<String> {
    match v.get(field)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn number(v: &Value, field: &str) -> Option<u64> {
    v.get(field).and_then(Value::as_u64)
}

fn strings(v: &Value, field: &str) -> Vec<String> {
    match v.get(field) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect(),
        Some(Value::String(s)) => s.lines().map(str::to_string).collect(),
        _ => Vec::new(),
    }
}

/// The fields of the two frames nearly every job sends, `started` and an ok `done`, read in
/// place (see [`parse_common`]).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Common<'a> {
    t: &'a str,
    id: &'a str,
    #[serde(default)]
    child_pid: Option<u64>,
    #[serde(default)]
    status: Option<&'a str>,
    #[serde(default)]
    performed: Option<bool>,
    #[serde(default)]
    recorded: Option<bool>,
}

/// `started` and an ok `done` without building a [`Value`] (with serde_json's
/// `arbitrary_precision` and `preserve_order`, a `Value` costs a map and a string per field):
/// about a fifth of the instructions. `None` for any other frame and for anything unusual in
/// these (a field more, a duplicate, an escape in a string, a value of another type, not an
/// object), which [`parse_value`] then reads as it always did: whatever this accepts,
/// `parse_value` reads as the same frame (a unit test compares them).
fn parse_common(line: &str) -> Option<Frame> {
    if !line.trim_start().starts_with('{') {
        return None;
    }
    let c: Common = serde_json::from_str(line).ok()?;
    match (c.t, c.status) {
        ("started", None) if c.performed.is_none() && c.recorded.is_none() => {
            Some(Frame::Started {
                id: c.id.to_string(),
                child_pid: c.child_pid,
            })
        }
        ("done", Some("ok")) if c.child_pid.is_none() => Some(Frame::Done {
            id: c.id.to_string(),
            outcome: Done::Ok {
                performed: c.performed.unwrap_or(true),
            },
            recorded: c.recorded.unwrap_or(false),
        }),
        _ => None,
    }
}

/// Parses one line (without its `\n`).
pub(super) fn parse(line: &[u8]) -> Result<Frame, ProtocolError> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Ok(text) = std::str::from_utf8(line) else {
        return Err(bad("a frame that is not UTF-8", line));
    };
    match parse_common(text) {
        Some(frame) => Ok(frame),
        None => parse_value(line),
    }
}

/// Parses one UTF-8 line (without its `\n` and `\r`) through a [`Value`]: every frame type,
/// lenient about the types of optional fields.
fn parse_value(line: &[u8]) -> Result<Frame, ProtocolError> {
    let v: Value = serde_json::from_slice(line)
        .map_err(|e| bad(format!("a frame that is not JSON ({e})"), line))?;
    if !v.is_object() {
        return Err(bad("a frame that is not a JSON object", line));
    }
    let id = || text(&v, "id").ok_or_else(|| bad("a frame without an id", line));
    match v.get("t").and_then(Value::as_str) {
        Some("ready") => Ok(Frame::Ready {
            pid: number(&v, "pid"),
            adapter: text(&v, "adapter").unwrap_or_default(),
            features: strings(&v, "features"),
        }),
        Some("started") => Ok(Frame::Started {
            id: id()?,
            child_pid: number(&v, "child_pid"),
        }),
        Some("done") => {
            // RL-4 names the field `result`; the protocol's is `status`: either is read.
            let status = v.get("status").or_else(|| v.get("result"));
            let outcome = match status.and_then(Value::as_str) {
                Some("ok") => Done::Ok {
                    performed: v.get("performed").and_then(Value::as_bool).unwrap_or(true),
                },
                Some("failed") => Done::Failed {
                    exception: text(&v, "exception")
                        .filter(|e| !e.is_empty())
                        .unwrap_or_else(|| "Locket::HandlerError".to_string()),
                    error: text(&v, "error").unwrap_or_default(),
                    backtrace: strings(&v, "backtrace"),
                },
                Some("reschedule") => Done::Reschedule,
                Some("throttled") => Done::Throttled {
                    retry_after: v
                        .get("retry_after")
                        .and_then(Value::as_f64)
                        .filter(|s| s.is_finite() && *s >= 0.0),
                },
                _ => return Err(bad("a done frame with an unknown status", line)),
            };
            Ok(Frame::Done {
                id: id()?,
                outcome,
                recorded: v.get("recorded").and_then(Value::as_bool).unwrap_or(false),
            })
        }
        Some("group") => Ok(Frame::Group {
            id: id()?,
            pgid: v
                .get("pgid")
                .and_then(Value::as_i64)
                .and_then(|p| i32::try_from(p).ok())
                .filter(|p| *p > 1)
                .ok_or_else(|| bad("a group frame without a valid pgid", line))?,
        }),
        Some("bye") => Ok(Frame::Bye {
            reason: text(&v, "reason").unwrap_or_default(),
        }),
        Some(_) => Err(bad("a frame of an unknown type", line)),
        None => Err(bad("a frame without a type \"t\"", line)),
    }
}

/// How reading one line ended.
enum Line {
    /// A whole line (without its `\n`) is in the buffer.
    Whole,
    /// The line passed `max`: the protocol error, quoting its start.
    TooLong(ProtocolError),
    /// The end of fd 4 (or a read error); the buffer holds what came before it.
    End,
}

/// Reads one line into `line` (cleared by the caller), never holding more than `max` bytes
/// of it.
async fn read_line<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    line: &mut Vec<u8>,
    max: usize,
) -> Line {
    loop {
        let buf = match reader.fill_buf().await {
            Ok(b) if !b.is_empty() => b,
            _ => return Line::End,
        };
        let newline = buf.iter().position(|&b| b == b'\n');
        let chunk = &buf[..newline.unwrap_or(buf.len())];
        if line.len() + chunk.len() > max {
            line.extend_from_slice(
                &chunk[..QUOTE_BYTES.saturating_sub(line.len()).min(chunk.len())],
            );
            return Line::TooLong(bad(
                format!("a frame longer than max_frame_bytes ({max})"),
                line,
            ));
        }
        line.extend_from_slice(chunk);
        let used = newline.map_or(buf.len(), |i| i + 1);
        reader.consume(used);
        if newline.is_some() {
            return Line::Whole;
        }
    }
}

/// Reads frames from `r` into `tx` until its end, a read error, or the first protocol error
/// (sent, then the reader stops: the handler is killed for it). One frame at a time (H-5):
/// the next line is read only once the channel took the last frame out of the reader and
/// its taker received it (`tx` has room for one), so a handler writing frames nobody asked
/// for (while idle) costs at most one frame. A line longer than `max` is a protocol error as
/// soon as it passes `max`, so a handler writing without newlines costs bounded memory too.
/// `sent` runs after each frame is handed over.
pub(super) async fn read_frames<R: AsyncRead + Unpin>(
    r: R,
    max: usize,
    tx: tokio::sync::mpsc::Sender<Result<Frame, ProtocolError>>,
    sent: impl Fn(),
) {
    let mut reader = BufReader::with_capacity(64 * 1024, r);
    let mut line: Vec<u8> = Vec::new();
    loop {
        // Room for the next frame: the last one was received.
        let Ok(permit) = tx.reserve().await else {
            return;
        };
        let item = match read_line(&mut reader, &mut line, max).await {
            Line::Whole => parse(&line),
            Line::TooLong(e) => Err(e),
            Line::End if line.is_empty() => return,
            Line::End => Err(bad("a frame cut off by the end of fd 4", &line)),
        };
        // A big frame's buffer is not kept for the next one.
        if line.capacity() > 64 * 1024 {
            line = Vec::new();
        } else {
            line.clear();
        }
        let failed = item.is_err();
        permit.send(item);
        sent();
        if failed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_parse_and_bad_ones_are_protocol_errors() {
        assert_eq!(
            parse(br#"{"t":"ready","v":1,"pid":7,"adapter":"ruby","features":["fork"]}"#),
            Ok(Frame::Ready {
                pid: Some(7),
                adapter: "ruby".into(),
                features: vec!["fork".into()]
            })
        );
        assert_eq!(
            parse(br#"{"t":"done","id":"ab","status":"failed","exception":"E","error":"m","backtrace":["a","b"]}"#),
            Ok(Frame::Done {
                id: "ab".into(),
                outcome: Done::Failed {
                    exception: "E".into(),
                    error: "m".into(),
                    backtrace: vec!["a".into(), "b".into()]
                },
                recorded: false
            })
        );
        assert_eq!(
            parse(br#"{"t":"done","id":"ab","status":"ok","performed":false}"#),
            Ok(Frame::Done {
                id: "ab".into(),
                outcome: Done::Ok { performed: false },
                recorded: false
            })
        );
        assert_eq!(
            parse(br#"{"t":"done","id":"ab","status":"failed","exception":"E","recorded":true}"#),
            Ok(Frame::Done {
                id: "ab".into(),
                outcome: Done::Failed {
                    exception: "E".into(),
                    error: String::new(),
                    backtrace: Vec::new()
                },
                recorded: true
            })
        );
        assert_eq!(
            parse(br#"{"t":"group","id":"ab","pgid":4242}"#),
            Ok(Frame::Group {
                id: "ab".into(),
                pgid: 4242
            })
        );
        for bad in [
            &br#"{"t":"group","id":"ab"}"#[..],
            br#"{"t":"group","id":"ab","pgid":1}"#,
            b"hello",
            b"[1]",
            br#"{"t":"dance"}"#,
            br#"{"id":"x"}"#,
            br#"{"t":"done","id":"x","status":"meh"}"#,
            b"{\"t\":\"ready\",\"x\":\"\xff\"}",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let e = parse(&[b'x'; 1000]).unwrap_err();
        assert_eq!(e.quote.len(), QUOTE_BYTES);
    }

    #[test]
    fn the_common_frames_read_in_place_are_what_the_general_path_reads() {
        let common = [
            r#"{"t":"started","id":"cc07b475febe7ba1"}"#,
            r#"{"t":"started","id":"ab","child_pid":4242}"#,
            r#"{"t":"started","id":"ab","child_pid":null}"#,
            r#"{"t":"done","id":"ab","status":"ok","performed":true}"#,
            r#"{"t":"done","id":"ab","status":"ok","performed":false}"#,
            r#"{"t":"done","id":"ab","status":"ok"}"#,
            r#"{"t":"done","id":"ab","status":"ok","performed":null,"recorded":true}"#,
            r#" { "id" : "ab" , "status" : "ok" , "t" : "done" } "#,
        ];
        for line in common {
            let fast = parse_common(line).unwrap_or_else(|| panic!("not read in place: {line}"));
            assert_eq!(Ok(fast), parse_value(line.as_bytes()), "{line}");
            assert_eq!(
                parse(line.as_bytes()),
                parse_value(line.as_bytes()),
                "{line}"
            );
        }
        // Left to the general path, which reads each as it always did.
        let general = [
            r#"{"t":"started","id":"a\u0062"}"#,
            r#"{"t":"started","id":7}"#,
            r#"{"t":"started","id":"ab","child_pid":-1}"#,
            r#"{"t":"started","id":"ab","x":1}"#,
            r#"{"t":"started","t":"done","id":"ab","status":"ok"}"#,
            r#"{"t":"done","id":"ab","status":"ok","performed":"yes"}"#,
            r#"{"t":"done","id":"ab","result":"ok"}"#,
            r#"{"t":"done","id":"ab","status":"failed","exception":"E"}"#,
            r#"{"t":"done","id":"ab","status":"ok","child_pid":3}"#,
            r#"["started","ab"]"#,
            r#"{"t":"started","id":"ab"} x"#,
            r#"{"t":"bye","reason":"x"}"#,
        ];
        for line in general {
            assert_eq!(parse_common(line), None, "{line}");
            assert_eq!(
                parse(line.as_bytes()),
                parse_value(line.as_bytes()),
                "{line}"
            );
        }
        assert_eq!(
            parse(br#"{"t":"started","t":"done","id":"ab","status":"ok"}"#),
            Ok(Frame::Done {
                id: "ab".into(),
                outcome: Done::Ok { performed: true },
                recorded: false
            })
        );
        assert!(parse(br#"["started","ab"]"#).is_err());
    }

    #[tokio::test]
    async fn an_oversized_frame_stops_the_reader_with_a_protocol_error() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let mut input = br#"{"t":"bye","reason":"x"}"#.to_vec();
        input.push(b'\n');
        input.extend(std::iter::repeat_n(b'a', 10_000));
        input.extend(b"\n{\"t\":\"bye\"}\n");
        read_frames(&input[..], 4096, tx, || {}).await;
        assert_eq!(rx.recv().await, Some(Ok(Frame::Bye { reason: "x".into() })));
        let e = rx.recv().await.unwrap().unwrap_err();
        assert!(e.what.contains("longer than max_frame_bytes"), "{e}");
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn the_reader_reads_the_next_frame_only_once_the_last_was_taken() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let (mut w, r) = tokio::io::duplex(1 << 20);
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = sent.clone();
        let reader = tokio::spawn(read_frames(r, 1 << 16, tx, move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        let frame = b"{\"t\":\"bye\",\"reason\":\"x\"}\n";
        for _ in 0..3 {
            tokio::io::AsyncWriteExt::write_all(&mut w, frame)
                .await
                .unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(
            sent.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one frame, held"
        );
        assert!(rx.recv().await.is_some());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(sent.load(std::sync::atomic::Ordering::SeqCst), 2);
        drop(w);
        assert!(rx.recv().await.is_some());
        assert!(rx.recv().await.is_some());
        assert_eq!(rx.recv().await, None);
        reader.await.unwrap();
    }
}
