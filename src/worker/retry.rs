//! How the worker waits: Redis steps retried with backoff until a refusal (E-3), and sleeps
//! that end on the stop signals.

use super::Control;
use crate::store::batch::Conn;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::worker";

/// Why [`retry`] ended without a reply.
pub(super) enum GaveUp {
    /// Redis stayed away until the control asked to stop, or for ten minutes.
    Away,
    /// Redis refused the call in a way a resend cannot change ([`crate::conn::is_refusal`]); logged.
    /// The refusal's text.
    Refused(String),
}

/// Retries a Redis step with capped backoff (E-3) until it succeeds, the control asks to stop,
/// or ten minutes pass. A refusal ([`crate::conn::is_refusal`]: a key of another type, a
/// Lua error) is logged once and ends it at once: the same call is never resent in a loop.
pub(super) async fn retry<T, F, Fut>(
    conn: &mut Conn,
    what: &str,
    control: &Control,
    mut f: F,
) -> std::result::Result<T, GaveUp>
where
    F: FnMut(Conn) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut delay = Duration::from_millis(50);
    let mut logged = false;
    loop {
        match f(conn.clone()).await {
            Ok(v) => {
                if logged {
                    info!(target: LOG_TARGET, step = what, "redis reachable again");
                }
                return Ok(v);
            }
            Err(e) if crate::conn::is_refusal(&e) => {
                error!(target: LOG_TARGET, step = what, error = %e, "redis refused the step; not sending it again");
                return Err(GaveUp::Refused(e.to_string()));
            }
            Err(e) => {
                if !logged {
                    if crate::conn::classify(&e) == crate::conn::Failure::Unknown {
                        error!(target: LOG_TARGET, step = what, error = %e, "unreadable reply from redis: the step may have run; sending it again as a resend, with backoff");
                    } else {
                        error!(target: LOG_TARGET, step = what, error = %e, "redis error; retrying with backoff");
                    }
                    logged = true;
                }
                if Instant::now() + delay > deadline || control.kill.is_cancelled() {
                    return Err(GaveUp::Away);
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = control.kill.cancelled() => return Err(GaveUp::Away),
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Sleeps `d` unless told to stop (or paused) first. True when the sleep ran to its end.
pub(super) async fn sleep_or_stop(
    d: Duration,
    control: &Control,
    dead: &CancellationToken,
) -> bool {
    let mut paused = control.paused.subscribe();
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = control.quit.cancelled() => false,
        _ = control.term.cancelled() => false,
        _ = dead.cancelled() => false,
        _ = paused.wait_for(|p| *p) => false,
    }
}

/// Sleeps `d` unless told to stop first; a pause does not end it. True when the sleep ran to
/// its end.
pub(super) async fn sleep_unless_stopped(
    d: Duration,
    control: &Control,
    dead: &CancellationToken,
) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = control.quit.cancelled() => false,
        _ = control.term.cancelled() => false,
        _ = dead.cancelled() => false,
    }
}

/// Waits while paused, until CONT or a stop. Bounded by the stop signals it listens for.
pub(super) async fn wait_unpaused(control: &Control, dead: &CancellationToken) {
    let mut paused = control.paused.subscribe();
    tokio::select! {
        _ = paused.wait_for(|p| !*p) => {}
        _ = control.quit.cancelled() => {}
        _ = control.term.cancelled() => {}
        _ = dead.cancelled() => {}
    }
}
