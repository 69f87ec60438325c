//! The `[handlers.<name>]` tables: named handlers that classes point at with
//! `handler = "<name>"` (persistent-handlers.md §2).

use super::{d10s, d60s, yes, Secs};
use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// How a named handler runs its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandlerMode {
    /// One process per job, as a class's `command` (the default).
    #[default]
    Exec,
    /// One long-lived process per worker slot that loads the app once and runs one job at a
    /// time over pipes on fds 3 and 4 (persistent-handlers.md H-1..H-14).
    Persistent,
}

impl<'de> Deserialize<'de> for HandlerMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HandlerMode, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "exec" => Ok(HandlerMode::Exec),
            "persistent" => Ok(HandlerMode::Persistent),
            other => Err(de::Error::custom(format!(
                "unknown handler mode {other:?} (known: exec, persistent)"
            ))),
        }
    }
}

/// A byte count written as `"768MiB"`, `"512MB"`, `"64KiB"`, `"1GiB"` or a bare number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Bytes(pub u64);

/// Parses `"768MiB"`, `"1.5GiB"`, `"512MB"`, `"4096"` (bytes).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let (value, unit) = super::values::number_and_unit(text)
        .ok_or_else(|| format!("invalid size {text:?} (use e.g. \"768MiB\", \"2GiB\")"))?;
    let scale: f64 = match unit {
        "" | "B" | "b" => 1.0,
        "KiB" | "K" | "k" => 1024.0,
        "MiB" | "M" => 1024.0 * 1024.0,
        "GiB" | "G" => 1024.0 * 1024.0 * 1024.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        other => return Err(format!("invalid size unit {other:?} in {text:?}")),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || !(0.0..=1.0e15).contains(&bytes) {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(bytes as u64)
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        super::from_text(d, "a size such as \"768MiB\" or a number of bytes", |t| {
            parse_bytes(t).map(Bytes)
        })
    }
}

/// One `[handlers.<name>]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerConfig {
    /// `exec` (one process per job) or `persistent`.
    #[serde(default)]
    pub mode: HandlerMode,
    /// The command as argv (no shell).
    #[serde(default)]
    pub command: Vec<String>,
    /// Working directory of the command.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Extra environment for the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Persistent: longest time from spawn to the handler's `ready` (H-8).
    #[serde(default = "d60s")]
    pub boot_timeout: Secs,
    /// Persistent: longest time from a `job` frame to the handler's `started` (H-9).
    #[serde(default = "d10s")]
    pub start_timeout: Secs,
    /// Persistent: recycle after this many jobs, plus a random 0..=`max_jobs_jitter` drawn
    /// per incarnation (H-13). 0: never.
    #[serde(default)]
    pub max_jobs: u64,
    /// Persistent: the jitter added to `max_jobs`.
    #[serde(default)]
    pub max_jobs_jitter: u64,
    /// Persistent: recycle after the job that left the handler above this resident size.
    #[serde(default)]
    pub max_rss: Option<Bytes>,
    /// Persistent: recycle, between jobs, a handler older than this.
    #[serde(default)]
    pub max_lifetime: Option<Secs>,
    /// Persistent: a handler idle this long exits; the next job starts it again.
    #[serde(default)]
    pub idle_timeout: Option<Secs>,
    /// Persistent: start the handler with its worker slot instead of at the first job.
    #[serde(default)]
    pub preload: bool,
    /// Persistent: the longest frame read from the handler (H-5). Default: max(1 MiB,
    /// 2 × `max_payload_bytes`).
    #[serde(default)]
    pub max_frame_bytes: Option<Bytes>,
    /// Persistent: after a kill, the fresh handler runs the job's `on_failure` hooks (H-14).
    #[serde(default = "yes")]
    pub failure_hooks_after_kill: bool,
    /// Persistent: how many jobs one handler process runs at once (H-18). 1, the default, is
    /// one job per process; above 1 a worker's slots share processes, `threads` slots each,
    /// when the adapter says `threads` in its `ready` features.
    #[serde(default = "one_thread")]
    pub threads: u32,
}

fn one_thread() -> u32 {
    1
}

/// The most `threads` a handler may have: past this a process is better split.
pub(crate) const MAX_THREADS: u32 = 1024;
