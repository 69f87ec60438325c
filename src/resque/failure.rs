//! Failure records in Ruby Resque's exact shape (resque-protocol.md §6, checklist 21):
//!
//! ```text
//! 127.0.0.1:6379> LINDEX resque:failed 0
//! "{\"failed_at\":\"2026/11/21 12:18:24 UTC\",\"payload\":{\"class\":\"BoomJob\",\"args\":[7]},
//!   \"exception\":\"ArgumentError\",\"error\":\"bad thing 7\",\"backtrace\":[],
//!   \"worker\":\"vm:9397:high,low\",\"queue\":\"low\"}"
//! ```
//!
//! Fields in that order; `payload` is the popped payload embedded verbatim, or `null` with the
//! raw text in an extra `raw_payload` field when it is not a JSON object (locketd's choice; Ruby
//! loses such jobs).

use crate::resque::payload::raw_json;
use crate::resque::time;
use serde::Serialize;
use serde_json::value::RawValue;
use std::time::SystemTime;

/// Where failure records go (resque-protocol.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureBackend {
    /// `RPUSH <ns>:failed` (Resque's default).
    #[default]
    Redis,
    /// `RPUSH <ns>:<q>_failed` and `SADD <ns>:failed_queues <q>_failed`.
    RedisMultiQueue,
}

/// What went wrong with a job, before it is placed in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFailure {
    /// Exception class name, e.g. `Locket::CommandFailed`, `Resque::DirtyExit`.
    pub exception: String,
    /// The message.
    pub error: String,
    /// Lines of context (for command handlers, the tail of stderr).
    pub backtrace: Vec<String>,
    /// When true the job was killed rather than failing by itself: Resque records it but does
    /// not count it in `stat:failed` (resque-protocol.md §5).
    pub dirty: bool,
    /// The app recorded it through its own failure backend (a persistent Ruby handler's
    /// `Resque::Failure.create`, H-17): FINISH pushes no record, and counts the stats as for
    /// any failure.
    pub recorded: bool,
}

impl JobFailure {
    /// A failure that counts in `stat:failed`.
    pub fn new(exception: impl Into<String>, error: impl Into<String>) -> JobFailure {
        JobFailure {
            exception: exception.into(),
            error: error.into(),
            backtrace: Vec::new(),
            dirty: false,
            recorded: false,
        }
    }

    /// The same, with a backtrace.
    pub fn with_backtrace(mut self, backtrace: Vec<String>) -> JobFailure {
        self.backtrace = backtrace;
        self
    }

    /// Marks the failure as a kill (`Resque::DirtyExit`-like: not counted in `stat:failed`).
    pub fn dirty(mut self) -> JobFailure {
        self.dirty = true;
        self
    }

    /// The record's JSON text for a payload popped from `queue` by `worker`.
    pub fn record(&self, payload: &str, worker: &str, queue: &str, at: SystemTime) -> String {
        let json = raw_json(payload);
        let record = Record {
            failed_at: time::failed_at(at),
            payload: json.as_deref(),
            exception: if self.exception.is_empty() {
                "Exception"
            } else {
                &self.exception
            },
            error: &self.error,
            backtrace: &self.backtrace,
            worker,
            queue,
            raw_payload: if json.is_none() { Some(payload) } else { None },
        };
        // Serializing borrowed strings and a RawValue cannot fail.
        serde_json::to_string(&record).unwrap_or_default()
    }
}

#[derive(Serialize)]
struct Record<'a> {
    failed_at: String,
    payload: Option<&'a RawValue>,
    exception: &'a str,
    error: &'a str,
    backtrace: &'a [String],
    worker: &'a str,
    queue: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    raw_payload: Option<&'a str>,
}

/// Resque's "working on" record, `worker:<id>` (checklist 15):
/// `{"queue":"<q>","run_at":"YYYY-MM-DDTHH:MM:SSZ","payload":{…},"worker":"<host:pid>"}`.
/// Resque writes the first three; `worker` is node-resque's own field, the worker's name as
/// node-resque's `queue.workers()` splits it off the id (`host:pid`, or `host:pid+k` for a
/// slot): its `allWorkingOn()` and `cleanOldWorkers()` file each job under it. Ruby Resque
/// and resque-web read the record as a hash and ignore the extra key.
pub fn working_on(payload: &str, queue: &str, at: SystemTime, worker_id: &str) -> String {
    #[derive(Serialize)]
    struct WorkingOn<'a> {
        queue: &'a str,
        run_at: String,
        payload: Option<&'a RawValue>,
        worker: &'a str,
    }
    let json = raw_json(payload);
    serde_json::to_string(&WorkingOn {
        queue,
        run_at: time::run_at(at),
        payload: json.as_deref(),
        worker: node_worker_name(worker_id),
    })
    .unwrap_or_default()
}

/// node-resque's name for a worker id: its first two `:`-separated parts (`host:pid`), as
/// `queue.workers()` splits `host:pid:queues`.
pub(crate) fn node_worker_name(worker_id: &str) -> &str {
    match worker_id.match_indices(':').nth(1) {
        Some((i, _)) => &worker_id[..i],
        None => worker_id,
    }
}

/// Text Ruby's `Process::Status#to_s` gives for a signalled child: `pid 9521 SIGKILL (signal 9)`.
pub fn signal_status_text(pid: u32, sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => "",
    };
    if name.is_empty() {
        format!("pid {pid} signal {sig}")
    } else {
        format!("pid {pid} {name} (signal {sig})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    // resque-protocol.md §13 items 3 and 21
    #[test]
    fn record_has_resque_fields_in_order_and_payload_verbatim() {
        let at = UNIX_EPOCH + Duration::from_secs(1795263504);
        let payload = r#"{"class": "B", "args": [1.0, 123456789012345678901], "extra":true}"#;
        let rec = JobFailure::new("ArgumentError", "bad")
            .with_backtrace(vec!["line".into()])
            .record(payload, "vm:1:q", "low", at);
        assert_eq!(
            rec,
            format!(
                r#"{{"failed_at":"{}","payload":{},"exception":"ArgumentError","error":"bad","backtrace":["line"],"worker":"vm:1:q","queue":"low"}}"#,
                time::failed_at(at),
                payload
            )
        );
    }

    // resque-protocol.md §13 item 9
    #[test]
    fn invalid_json_payload_is_kept_as_raw_text() {
        let rec = JobFailure::new("Locket::BadPayload", "x").record(
            "{oops",
            "vm:1:q",
            "q",
            SystemTime::now(),
        );
        let v: serde_json::Value = serde_json::from_str(&rec).unwrap();
        assert!(v["payload"].is_null());
        assert_eq!(v["raw_payload"], "{oops");
    }

    // resque-protocol.md §6: resque-web reads payload['class'], so only an object is embedded;
    // other JSON is kept as raw text like invalid JSON.
    #[test]
    fn json_that_is_not_an_object_is_kept_as_raw_text() {
        for raw in ["[1,2]", "42", "\"Job\"", "null", " [] "] {
            let rec = JobFailure::new("Locket::BadPayload", "x").record(
                raw,
                "vm:1:q",
                "q",
                SystemTime::now(),
            );
            let v: serde_json::Value = serde_json::from_str(&rec).unwrap();
            assert!(v["payload"].is_null(), "{raw}: {rec}");
            assert_eq!(v["raw_payload"], raw, "{raw}");
        }
    }

    #[test]
    fn working_on_record_matches_resque() {
        let at = UNIX_EPOCH + Duration::from_secs(1795263509);
        let w = working_on(r#"{"class":"S","args":[4]}"#, "slow", at, "vm:7:slow,fast");
        assert_eq!(
            w,
            format!(
                r#"{{"queue":"slow","run_at":"{}","payload":{{"class":"S","args":[4]}},"worker":"vm:7"}}"#,
                time::run_at(at)
            )
        );
        let slot = working_on("{}", "q", at, "vm:7+2:q:with:colons");
        assert!(slot.ends_with(r#""worker":"vm:7+2"}"#), "{slot}");
    }
}
