//! Job handlers: the configured command per class, or an in-process [`Handler`] registered by a
//! program that uses locketd as a library.
//!
//! The command contract (README "Handler contract"): argv without a shell, the payload on stdin,
//! `LOCKETD_CLASS`, `LOCKETD_QUEUE`, `LOCKETD_ARGS` (JSON), `LOCKETD_WORKER`, `LOCKETD_LOCK_KEYS`
//! (JSON array) and `LOCKETD_LOCK_TOKEN` in the environment; exit 0 is success; a polite stop is
//! SIGTERM to the handler's process group, a hard stop SIGKILL.

pub mod builtin;
mod command;

pub use command::CommandHandler;

use crate::config::Config;
use crate::resque::failure::JobFailure;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// What a handler sees of one job.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// Job class.
    pub class: String,
    /// Queue it was reserved from.
    pub queue: String,
    /// The payload exactly as enqueued.
    pub payload: String,
    /// `args` as decoded (exact number text).
    pub args: serde_json::Value,
    /// `args` exactly as enqueued.
    pub args_raw: String,
    /// The Resque worker id running it.
    pub worker: String,
    /// Ids of the locks held for it.
    pub lock_keys: Vec<String>,
    /// The attempt's lock token (empty when unlocked).
    pub lock_token: String,
    /// Fencing number per lock, in `lock_keys` order (empty without `fencing`, L-10).
    pub lock_fences: Vec<u64>,
    /// The run's entry on the lease watchdog: a handler that starts a process group attaches
    /// it, so the group is killed at the lock's deadline even if the worker stalls.
    pub watch: crate::watchdog::Watch,
}

/// The exception of a run that asks to be rescheduled: the command exited 75 (EX_TEMPFAIL), or
/// an in-process handler returned [`reschedule`]. FINISH releases the locks and pushes the
/// payload back to the tail of its queue in one step; no failure is recorded.
pub const RESCHEDULE: &str = "Locket::Reschedule";

/// The result an in-process handler returns to be run again later (like exit status 75).
pub fn reschedule() -> JobFailure {
    JobFailure::new(RESCHEDULE, "rescheduled by the handler")
}

/// The longest args JSON handed to a command handler in `LOCKETD_ARGS`. Linux refuses an
/// environment string over 128 KiB; longer args are left out (`LOCKETD_ARGS_OMITTED=1`) and
/// read from the payload on stdin.
pub const ARGS_ENV_LIMIT: usize = 64 * 1024;

/// sysexits EX_TEMPFAIL: a command handler exiting with it is rescheduled.
pub const EX_TEMPFAIL: i32 = 75;

/// The result of one run: `Ok` is success; `Err` becomes a Resque failure record.
pub type HandlerResult = Result<(), JobFailure>;

/// Runs jobs of one class.
///
/// `stop` is cancelled when the supervisor asks the job to stop politely (lost lock, timeout,
/// shutdown); if the future has not completed `kill_grace` (`term_timeout` for a shutdown)
/// later it is dropped. After a shutdown's stop, what the future returns still counts: `Ok`
/// (the work got done) is a success and [`reschedule`] puts the job back in its queue; any
/// other error is recorded as `Resque::TermException`. A lost lock or a timeout records its own
/// failure whatever the future returns.
pub trait Handler: Send + Sync {
    /// Runs one job.
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult>;
}

impl<F, Fut> Handler for F
where
    F: Fn(JobContext) -> Fut + Send + Sync,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    fn perform(
        &self,
        job: JobContext,
        _stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        Box::pin(self(job))
    }
}

/// Class name → handler, with the `"*"` fallback.
#[derive(Clone, Default)]
pub struct Handlers {
    by_class: HashMap<String, Arc<dyn Handler>>,
    fallback: Option<Arc<dyn Handler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("classes", &self.by_class.keys().collect::<Vec<_>>())
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}

impl Handlers {
    /// No handlers.
    pub fn new() -> Handlers {
        Handlers::default()
    }

    /// The command and builtin handlers of a config's `[classes]`.
    pub fn from_config(config: &Config) -> Handlers {
        let mut h = Handlers::new();
        for (name, class) in &config.classes {
            if let Some(b) = class
                .builtin
                .as_deref()
                .and_then(crate::config::Builtin::from_name)
            {
                h.insert(name, b);
            } else if class.command.is_some() {
                h.insert(name, CommandHandler::new(class));
            }
        }
        h
    }

    /// Registers a handler for `class` (`"*"` for the fallback), replacing any before it.
    pub fn insert(&mut self, class: &str, handler: impl Handler + 'static) -> &mut Handlers {
        let handler: Arc<dyn Handler> = Arc::new(handler);
        if class == "*" {
            self.fallback = Some(handler);
        } else {
            self.by_class.insert(class.to_string(), handler);
        }
        self
    }

    /// The handler for `class`, or the fallback.
    pub fn get(&self, class: &str) -> Option<Arc<dyn Handler>> {
        self.by_class.get(class).or(self.fallback.as_ref()).cloned()
    }
}
