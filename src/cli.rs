//! The command line of the `locketd` binary (clap), in the library so that tests can parse the
//! command lines the documentation shows with the real parser (`Cli::try_parse_from`).

use crate::config::LogFormat;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// The command line: the daemon's flags, and a subcommand for the operator commands.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "locketd",
    bin_name = "locketd",
    version,
    about = "Resque-compatible job worker with locket job locks"
)]
pub struct Cli {
    /// Config file (default /etc/locketd/locketd.toml when present).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Redis URL: redis://[:password@]host:port/db, rediss:// for TLS.
    #[arg(long, global = true, env = "REDIS_URL", value_name = "URL")]
    pub redis: Option<String>,
    /// Where `redis` came from, when it did: "given by --redis" or "given by REDIS_URL".
    #[arg(skip)]
    pub redis_given: Option<&'static str>,
    /// Resque namespace (key prefix).
    #[arg(long, global = true, value_name = "NS")]
    pub namespace: Option<String>,
    /// Queues in priority order, Resque's syntax: "high,low", "*", "critical,*,!low" (also
    /// the queues `status` shows).
    #[arg(long, global = true, env = "QUEUES", value_name = "LIST")]
    pub queues: Option<String>,
    /// Seconds to sleep when no job was found (Resque's INTERVAL); 0 drains and exits.
    #[arg(long, env = "INTERVAL", value_name = "SECS", value_parser = seconds)]
    pub interval: Option<f64>,
    /// Log format.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Worker processes (each one Resque worker); the master supervises them.
    #[arg(long, value_name = "N")]
    pub workers: Option<u32>,
    /// Concurrent jobs per worker process, each slot its own Resque worker (host:pid+k:queues).
    #[arg(long, value_name = "K")]
    pub slots: Option<u32>,
    /// TERM behaves like QUIT (Resque's GRACEFUL_TERM; the variable counts when non-empty).
    #[arg(long)]
    pub graceful_term: bool,
    /// Seconds between the polite stop and SIGKILL of a running handler on TERM/INT.
    #[arg(long, env = "RESQUE_TERM_TIMEOUT", value_name = "SECS", value_parser = seconds)]
    pub term_timeout: Option<f64>,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 127.0.0.1:9187).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Serve /metrics, the web page (/) and its JSON API (/api/) on ADDR: the same listener as
    /// --metrics, under a clearer name. A bare port means 127.0.0.1:PORT.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<String>,
    /// The subcommand; none runs the daemon.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands; without one, `locketd` runs the daemon.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Validate a config file and exit (non-zero with a message naming the bad setting).
    CheckConfig {
        /// The file (default: --config, then /etc/locketd/locketd.toml).
        file: Option<PathBuf>,
    },
    /// Show queues, workers, locks and failures, read from Redis (no daemon needed).
    Status {
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
        /// Refresh every SECS seconds until Ctrl-C.
        #[arg(long, value_name = "SECS")]
        watch: Option<f64>,
        /// With --watch: stop after N screens.
        #[arg(long, value_name = "N", requires = "watch")]
        count: Option<u64>,
    },
    /// List, show, retry, remove or clear Resque failures (as resque-web does).
    Failed(crate::ops::failed::FailedArgs),
    /// The configuration's settings: `config reference` prints each one's type, default and
    /// meaning.
    #[command(subcommand)]
    Config(crate::config::reference::ConfigCommand),
    /// Why a job is not running: where it is (queued at position N, parked, delayed, reserved,
    /// running, failed) and every reason it waits, with its owner and when it can change.
    Why(crate::admin::why::WhyArgs),
    /// Operator commands: enqueue, locks, counters, holds, delayed, stats, schedule (src/admin/).
    #[command(flatten)]
    Admin(crate::admin::AdminCommand),
}

/// A number of seconds for `--interval` and `--term-timeout` (and their environment
/// variables): finite, 0 or more, and at most a year. Anything else is a usage error, not a
/// value quietly ignored.
fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if v.is_finite() && (0.0..=31_536_000.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s:?} must be from 0 to 31536000 seconds"))
    }
}
