//! The daemon's service side-cars, kept apart from the worker loop: the master, the process that
//! faces systemd and Prometheus, starts them with one call and reloads them on HUP:
//!
//! - sd_notify ([`crate::notify`]): `READY=1` at start, `STATUS=` lines, `WATCHDOG=1` from a
//!   health loop (Redis answers `PING` and `workers_alive()`), `STOPPING=1` when `stopping`
//!   fires;
//! - `/metrics` ([`http`]) and the web page, served by the HTTP listener ([`listener`]) when
//!   `http` or `metrics` is configured.

use crate::config::Config;
use crate::error::Result;
pub mod http;
pub mod listener;

use crate::metrics::Aggregate;
use crate::notify::{self, Notifier};
use http::{SharedSource, Source};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Running side-cars; [`Sidecars::reload`] applies a new config, [`Sidecars::stop`] ends them.
#[derive(Debug)]
pub struct Sidecars {
    done: CancellationToken,
    /// The metrics endpoint, if any: cut off at stop, moved by a reload.
    metrics: Option<Endpoint>,
    /// The config and Redis connection `/metrics` and the health check use.
    source: SharedSource,
    aggregate: Arc<Mutex<Aggregate>>,
    /// The web page's processed and failed per minute, kept across a moved listener.
    minutes: Arc<crate::web::minutes::Minutes>,
    /// The notify side-car: given a moment at stop to say STOPPING=1.
    notify: JoinHandle<()>,
}

/// `/metrics` served on `addr`, bound from the `metrics` setting `listen`.
#[derive(Debug)]
struct Endpoint {
    listen: String,
    addr: std::net::SocketAddr,
    task: JoinHandle<()>,
}

impl Endpoint {
    async fn start(
        listen: &str,
        aggregate: &Arc<Mutex<Aggregate>>,
        source: &SharedSource,
        minutes: &Arc<crate::web::minutes::Minutes>,
    ) -> std::io::Result<Endpoint> {
        let (task, addr) =
            listener::serve(listen, aggregate.clone(), source.clone(), minutes.clone()).await?;
        Ok(Endpoint {
            listen: listen.to_string(),
            addr,
            task,
        })
    }

    /// Stops serving; the listening socket is closed when this returns.
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// The error a `metrics` address that cannot be bound gives, at start and on HUP.
fn cannot_listen(addr: &str, e: &std::io::Error) -> crate::Error {
    crate::Error::Config(crate::config::ConfigError::Invalid {
        setting: "metrics".into(),
        message: format!("cannot listen on {addr}: {e}"),
    })
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
    let conn = crate::conn::connect(&config.redis, config.redis_connect_timeout.get()).await?;
    let source: SharedSource = Arc::new(RwLock::new(Arc::new(Source {
        conn,
        config: config.clone(),
    })));
    let done = CancellationToken::new();
    let minutes = Arc::new(crate::web::minutes::Minutes::default());
    let metrics = match &config.listen() {
        Some(listen) => Some(
            Endpoint::start(listen, &aggregate, &source, &minutes)
                .await
                .map_err(|e| cannot_listen(listen, &e))?,
        ),
        None => None,
    };
    let health_source = source.clone();
    let alive = Arc::new(workers_alive);
    let notify = tokio::spawn(notify::supervise(
        Notifier::from_env(),
        stopping,
        done.clone(),
        move || {
            let mut c = read_source(&health_source).conn.clone();
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
    ));
    Ok(Sidecars {
        done,
        metrics,
        source,
        aggregate,
        minutes,
        notify,
    })
}

fn read_source(source: &SharedSource) -> Arc<Source> {
    source.read().unwrap_or_else(|p| p.into_inner()).clone()
}

impl Sidecars {
    /// The address `/metrics` is served on, when it is.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr)
    }

    /// Applies a config reloaded on HUP, or refuses it (and changes nothing) when its Redis
    /// does not answer or its `metrics` address cannot be bound: the caller then keeps the
    /// running config, as for any bad config. On success `/metrics` and the health check read
    /// Redis as the new config says (its queues, namespace, server), and the endpoint has
    /// moved, started or stopped when the `metrics` setting changed.
    pub async fn reload(&mut self, config: &Config) -> Result<()> {
        let old = read_source(&self.source);
        let conn = if config.redis == old.config.redis {
            old.conn.clone()
        } else {
            // Bounded: the master handles no signal or exit meanwhile.
            let wait = config
                .redis_connect_timeout
                .get()
                .min(Duration::from_secs(5));
            crate::conn::connect(&config.redis, wait).await?
        };
        if config.listen() != self.metrics.as_ref().map(|m| m.listen.clone()) {
            self.move_endpoint(config.listen().as_deref()).await?;
        }
        *self.source.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Source {
            conn,
            config: config.clone(),
        });
        Ok(())
    }

    /// Serves `/metrics` on `listen` instead (nowhere for `None`). The new address is bound
    /// while the old one still serves; when that fails, it may be because the old socket holds
    /// the port (`0.0.0.0:9100` after `127.0.0.1:9100`), so the old endpoint is stopped and the
    /// bind tried once more. If that fails too, the old address is bound again and the error
    /// returned.
    async fn move_endpoint(&mut self, listen: Option<&str>) -> Result<()> {
        let Some(listen) = listen else {
            if let Some(old) = self.metrics.take() {
                old.stop().await;
                tracing::info!("no metrics setting any more: /metrics is no longer served");
            }
            return Ok(());
        };
        match Endpoint::start(listen, &self.aggregate, &self.source, &self.minutes).await {
            Ok(new) => {
                if let Some(old) = self.metrics.replace(new) {
                    old.stop().await;
                }
                return Ok(());
            }
            Err(e) if self.metrics.is_none() => return Err(cannot_listen(listen, &e)),
            Err(_) => {}
        }
        let old = self.metrics.take().expect("an endpoint, checked above");
        let old_listen = old.listen.clone();
        old.stop().await;
        match Endpoint::start(listen, &self.aggregate, &self.source, &self.minutes).await {
            Ok(new) => {
                self.metrics = Some(new);
                Ok(())
            }
            Err(e) => {
                match Endpoint::start(&old_listen, &self.aggregate, &self.source, &self.minutes)
                    .await
                {
                    Ok(back) => self.metrics = Some(back),
                    Err(e2) => tracing::error!(
                        error = %e2,
                        "cannot serve /metrics on {old_listen} again: no metrics endpoint until a HUP brings one"
                    ),
                }
                Err(cannot_listen(listen, &e))
            }
        }
    }

    /// Stops every side-car and waits for them.
    pub async fn stop(self) {
        self.done.cancel();
        // The notify side-car finishes what it has to say (STOPPING=1) before it is cut off.
        let mut notify = self.notify;
        if tokio::time::timeout(Duration::from_secs(1), &mut notify)
            .await
            .is_err()
        {
            notify.abort();
            let _ = notify.await;
        }
        if let Some(m) = self.metrics {
            m.stop().await;
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
