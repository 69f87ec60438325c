//! The daemon's service side-cars, kept apart from the worker loop so whichever process faces
//! systemd and Prometheus (today the single worker process; with `--workers N`, the master)
//! starts them with one call:
//!
//! - sd_notify ([`crate::notify`]): `READY=1` at start, `STATUS=` lines, `WATCHDOG=1` from a
//!   health loop (Redis answers `PING` and `workers_alive()`), `STOPPING=1` when `stopping`
//!   fires;
//! - `/metrics` ([`crate::metrics::http`]) when `metrics` is configured.

use crate::config::Config;
use crate::error::Result;
use crate::metrics::{http, Aggregate};
use crate::notify::{self, Notifier};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Running side-cars; [`Sidecars::stop`] ends them.
#[derive(Debug)]
pub struct Sidecars {
    done: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    /// The address `/metrics` is served on, when it is.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// Starts the side-cars. Call it once Redis answered and the workers are registered: it sends
/// `READY=1` right away. `status` gives the `STATUS=` line; `workers_alive` is part of the
/// watchdog's health check; `stopping` is the graceful-stop token (QUIT/TERM/INT).
pub async fn start<S, W>(
    config: &Config,
    aggregate: Arc<Mutex<Aggregate>>,
    status: S,
    workers_alive: W,
    stopping: CancellationToken,
) -> Result<Sidecars>
where
    S: FnMut() -> String + Send + 'static,
    W: Fn() -> bool + Send + Sync + 'static,
{
    let conn = crate::worker::connect(&config.redis, config.redis_connect_timeout.get()).await?;
    let done = CancellationToken::new();
    let mut tasks = Vec::new();
    let mut metrics_addr = None;
    if let Some(addr) = &config.metrics {
        let (task, local) = http::serve(addr, aggregate, conn.clone(), config.clone())
            .await
            .map_err(|e| {
                crate::Error::Config(crate::config::ConfigError::Invalid {
                    setting: "metrics".into(),
                    message: format!("cannot listen on {addr}: {e}"),
                })
            })?;
        metrics_addr = Some(local);
        tasks.push(task);
    }
    let health_conn = conn.clone();
    let alive = Arc::new(workers_alive);
    tasks.push(tokio::spawn(notify::supervise(
        Notifier::from_env(),
        stopping,
        done.clone(),
        move || {
            let mut c = health_conn.clone();
            let alive = alive.clone();
            async move {
                let ping = tokio::time::timeout(
                    Duration::from_secs(2),
                    redis::cmd("PING").query_async::<String>(&mut c),
                )
                .await;
                matches!(ping, Ok(Ok(_))) && alive()
            }
        },
        status,
    )));
    Ok(Sidecars {
        done,
        tasks,
        metrics_addr,
    })
}

impl Sidecars {
    /// Stops every side-car and waits for them.
    pub async fn stop(self) {
        self.done.cancel();
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Logs and otherwise ignores SIGHUP until `until` fires: `systemctl reload` sends HUP, which a
/// single worker process has nothing to reload for (the master of `--workers` handles it), and
/// HUP's default action would kill the worker mid-job.
pub fn ignore_hup(until: CancellationToken) {
    use futures::StreamExt;
    let Ok(mut hups) = signal_hook_tokio::Signals::new([signal_hook::consts::signal::SIGHUP])
    else {
        return;
    };
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = until.cancelled() => return,
                s = hups.next() => match s {
                    Some(_) => tracing::warn!("SIGHUP: nothing to reload in a single worker process; restart the service to apply config changes"),
                    None => return,
                },
            }
        }
    });
}
