//! locketd: a Resque-compatible job worker that takes an expiring, token-owned lock before each
//! job and never lets a queue full of locked jobs starve the queues below it.
//!
//! Apps push jobs with any Resque client (`{"class":…,"args":[…]}` RPUSHed to
//! `<ns>:queue:<name>`); locketd reserves them in priority order, runs each through the handler
//! configured for its class, and keeps Resque's Redis layout exactly, so resque-web and every
//! Resque client see its workers, stats and failures.
//!
//! # Layout
//! - [`config`]: the TOML configuration and its start-up check.
//! - [`resque`]: Resque's wire format only: key names, payloads, registry, failure records,
//!   time formats, queue patterns.
//! - [`lock`]: the locket scripts (RESERVE, ACQUIRE, EXTEND, FINISH, recovery) behind a typed API,
//!   and canonical JSON for lock ids.
//! - [`worker`]: one worker process: the locket loop, job supervision, heartbeats, the janitor.
//! - [`handler`]: the [`handler::Handler`] trait and the command handler.
//! - [`master`]: the master process: N worker processes, restarts, crash recovery, signals,
//!   reload.
//! - [`shutdown`]: signals to [`worker::Control`] in a worker process.
//! - [`metrics`]: job counters recorded per process, merged, served as Prometheus text.
//! - [`notify`], [`service`]: sd_notify and the side-cars (notify, `/metrics`) of a daemon.
//! - [`ops`]: the operator commands `locketd status` and `locketd failed`.
//! - [`proctitle`], [`host`]: the process title Resque's pruning looks for; host facts.
//!
//! # Running a worker with in-process handlers
//! ```no_run
//! # async fn demo() -> locketd::Result<()> {
//! use locketd::{config::Config, handler::Handlers, worker::{Control, Worker}};
//! let config = Config::parse("queues = \"high,low\"", "inline")?;
//! let mut handlers = Handlers::new();
//! handlers.insert("Greet", |job: locketd::handler::JobContext| async move {
//!     println!("hello {}", job.args_raw);
//!     Ok(())
//! });
//! let worker = Worker::start(config, handlers).await?;
//! worker.run(Control::default()).await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod client;
pub mod config;
pub mod conn;
pub mod error;
pub mod handler;
pub mod host;
pub mod locks;
pub mod logsink;
pub mod master;
pub mod metrics;
pub mod notify;
pub mod ops;
pub mod process;
pub mod proctitle;
pub mod resque;
pub mod service;
pub mod store;
pub mod watchdog;
pub mod worker;

pub use error::{Error, Result};
