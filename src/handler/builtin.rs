//! Built-in in-process handlers, chosen per class with `builtin = "<name>"` in the config
//! (`[classes.Noop] builtin = "noop"`). They run inside the worker, without a process per job,
//! and exist for benchmarks, smoke tests and demos:
//!
//! - `noop`: succeeds at once.
//! - `probe`: succeeds at once; when the job's first argument is an object with a numeric
//!   `enqueued_at_us` (epoch microseconds, written by whoever enqueued it), logs the
//!   enqueue-to-start latency at `info` with target `locketd::probe` and the field
//!   `latency_us`. The benchmark harness reads those lines.
//! - `sleep`: sleeps for its first argument in seconds (a number, default 1), and returns as
//!   soon as the job is asked to stop.

use super::{Handler, HandlerResult, JobContext};
pub use crate::config::{Builtin, BUILTIN_NAMES as NAMES};
use futures::future::BoxFuture;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// Longest `sleep` a job can ask for (a day); longer values are capped.
const MAX_SLEEP: Duration = Duration::from_secs(86_400);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The enqueue-to-start latency in microseconds of a job carrying
/// `[{"enqueued_at_us": N}, ...]`, against `now_us`; `None` for any other job.
pub fn probe_latency_us(args: &serde_json::Value, now_us: u64) -> Option<u64> {
    let t = args.get(0)?.get("enqueued_at_us")?;
    // arbitrary_precision keeps the number as text; as_f64 still reads it.
    let t = t.as_u64().or_else(|| t.as_f64().map(|f| f as u64))?;
    Some(now_us.saturating_sub(t))
}

/// How long a `sleep` job sleeps: `args[0]` seconds, 1 s when absent or not a number.
pub fn sleep_duration(args: &serde_json::Value) -> Duration {
    let secs = args.get(0).and_then(|v| v.as_f64()).unwrap_or(1.0);
    if secs.is_finite() && secs > 0.0 {
        // Capped before the conversion, which panics on values past u64 seconds (1e20).
        Duration::from_secs_f64(secs.min(MAX_SLEEP.as_secs_f64()))
    } else {
        Duration::ZERO
    }
}

impl Handler for Builtin {
    fn perform(
        &self,
        job: JobContext,
        stop: CancellationToken,
    ) -> BoxFuture<'static, HandlerResult> {
        match self {
            Builtin::Noop => Box::pin(std::future::ready(Ok(()))),
            Builtin::Probe => {
                if let Some(latency_us) = probe_latency_us(&job.args, now_us()) {
                    tracing::info!(target: "locketd::probe", latency_us, queue = %job.queue, "probe job started");
                }
                Box::pin(std::future::ready(Ok(())))
            }
            Builtin::Sleep => {
                let d = sleep_duration(&job.args);
                Box::pin(async move {
                    tokio::select! {
                        _ = tokio::time::sleep(d) => Ok(()),
                        // Stopped before its end: it did not finish (a shutdown records the
                        // TermException; a timeout or a lost lock its own failure).
                        _ = stop.cancelled() => Err(crate::resque::failure::JobFailure::new(
                            "Resque::TermException",
                            "SIGTERM",
                        )),
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx(args: serde_json::Value) -> JobContext {
        JobContext {
            class: "C".into(),
            queue: "q".into(),
            payload: String::new(),
            args_raw: args.to_string(),
            args,
            worker: "w".into(),
            lock_keys: vec![],
            lock_token: String::new(),
            lock_fences: vec![],
            watch: Default::default(),
            id: String::new(),
            timeout: None,
            stop_reason: Default::default(),
            recorded: Default::default(),
        }
    }

    #[test]
    fn names_resolve_and_unknown_ones_do_not() {
        for n in NAMES {
            assert!(Builtin::from_name(n).is_some(), "{n}");
        }
        assert_eq!(Builtin::from_name("noop"), Some(Builtin::Noop));
        assert_eq!(Builtin::from_name("Noop"), None);
        assert_eq!(Builtin::from_name("true"), None);
    }

    #[test]
    fn probe_reads_the_enqueue_time_only_when_present() {
        let args = json!([{"enqueued_at_us": 1_000_000u64}, 7]);
        assert_eq!(probe_latency_us(&args, 1_000_250), Some(250));
        // A clock step backwards reads as zero, not as a huge number.
        assert_eq!(probe_latency_us(&args, 10), Some(0));
        assert_eq!(probe_latency_us(&json!([1, 2]), 5), None);
        assert_eq!(probe_latency_us(&json!([{"other": 1}]), 5), None);
        assert_eq!(probe_latency_us(&json!([]), 5), None);
    }

    #[test]
    fn sleep_takes_its_first_argument_in_seconds() {
        assert_eq!(sleep_duration(&json!([0.25])), Duration::from_millis(250));
        assert_eq!(sleep_duration(&json!([])), Duration::from_secs(1));
        assert_eq!(sleep_duration(&json!(["x"])), Duration::from_secs(1));
        assert_eq!(sleep_duration(&json!([-3])), Duration::ZERO);
        assert_eq!(sleep_duration(&json!([1e12])), MAX_SLEEP);
        // Past u64 seconds: Duration::from_secs_f64 would panic (and take the worker down).
        assert_eq!(sleep_duration(&json!([1e20])), MAX_SLEEP);
    }

    #[tokio::test]
    async fn handlers_succeed_and_a_stopped_sleep_is_not_a_success() {
        let stop = CancellationToken::new();
        assert!(Builtin::Noop
            .perform(ctx(json!([])), stop.clone())
            .await
            .is_ok());
        assert!(Builtin::Probe
            .perform(ctx(json!([{"enqueued_at_us": 1}])), stop.clone())
            .await
            .is_ok());
        let fut = Builtin::Sleep.perform(ctx(json!([3600])), stop.clone());
        stop.cancel();
        let done = tokio::time::timeout(Duration::from_secs(5), fut).await;
        // Stopped early, it did not finish its work: not a success.
        let Ok(Err(f)) = done else { panic!("{done:?}") };
        assert_eq!(f.exception, "Resque::TermException");
    }
}
