//! locketd: a Resque-compatible job worker that takes an expiring, token-owned lock before each
//! job and never lets a queue full of locked jobs starve the queues below it.
//!
//! Apps push jobs with any Resque client (`{"class":…,"args":[…]}` RPUSHed to
//! `<ns>:queue:<name>`); locketd reserves them in priority order, runs each through the handler
//! configured for its class, and keeps Resque's Redis layout exactly, so resque-web and every
//! Resque client see its workers, stats and failures.
//!
//! # Layout
//! Layers, bottom to top; each uses only those below it (docs/dev/architecture.md, checked by
//! `tests/layers.rs`):
//! - [`resque`]: Resque's wire format only: key names, payloads, failure records, time formats,
//!   queue patterns.
//! - Leaves: [`host`], [`proctitle`], [`logsink`], [`notify`], [`process`] (the role variables
//!   and signal names), [`watchdog`] (the lease backstop), [`metrics`] (job counters).
//! - [`locks`]: the lock model without Redis: lock specs, key templates, canonical JSON,
//!   conflict policies.
//! - [`error`]: the error types.
//! - [`conn`]: connecting to Redis, URL redaction, `EVALSHA`, refusals.
//! - [`config`]: the TOML configuration, its start-up check, per-class lock plans.
//! - [`store`]: the locket scripts (RESERVE, ACQUIRE, EXTEND, FINISH, recovery, registry)
//!   behind a typed API.
//! - [`handler`]: the [`handler::Handler`] trait, the command handler, the builtins.
//! - [`worker`]: one worker process: the locket loop, a job's path, supervision, heartbeats,
//!   the janitor, signals.
//! - [`ops`], [`client`], [`admin`]: `locketd status`/`failed`, enqueueing, admin commands.
//! - [`service`]: the side-cars (notify, `/metrics`) of a daemon.
//! - [`master`]: the master process: N worker processes, restarts, crash recovery, signals,
//!   reload.
//! - [`cli`]: the command line of the `locketd` binary (clap).
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
pub mod cli;
pub mod client;
pub mod config;
pub mod conn;
pub mod error;
pub mod handler;
pub mod host;
pub mod locks;
pub mod logline;
pub mod logsink;
pub mod master;
pub mod metrics;
pub mod notify;
pub mod ops;
pub mod process;
pub mod proctitle;
pub mod resque;
pub mod scheduler;
pub mod service;
pub mod store;
pub mod watchdog;
pub mod web;
pub mod worker;

pub use error::{Error, Result};
