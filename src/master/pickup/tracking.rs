//! The master's watch over the set of known queues (`<ns>:queues`) and the pause keys, for the
//! pickup (`master/pickup.rs`): server-assisted client tracking on one RESP3 connection, else
//! `SMEMBERS` once a second while a worker with patterns waits.

use super::{blocking_connection, Ev, Settings, LOG_TARGET, MAX_BACKOFF, MIN_BACKOFF};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

/// Follows `<ns>:queues` for the workers with patterns: client tracking, else SMEMBERS once
/// a second while such a worker waits.
pub(super) async fn track_queue_set(
    settings: Settings,
    mut wanted: watch::Receiver<bool>,
    tx: mpsc::UnboundedSender<Ev>,
) {
    let keys = crate::resque::keys::Keys::new(&settings.namespace);
    let set = keys.queues();
    let pause = keys.pause_prefix();
    let mut backoff = MIN_BACKOFF;
    let mut logged = false;
    loop {
        match track(&settings.redis, &set, &pause, &tx).await {
            Tracking::Refused(e) => {
                info!(target: LOG_TARGET, error = %e, "no client tracking: new queues are looked for once a second while a worker with patterns waits; a resumed queue is found at the next interval");
                if settings.glob {
                    poll_queue_set(&settings.redis, &set, &mut wanted, &tx).await;
                }
                return;
            }
            Tracking::Lost(e) => {
                if !std::mem::replace(&mut logged, true) {
                    warn!(target: LOG_TARGET, error = %e, "following the queue set failed; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

enum Tracking {
    /// The server refuses RESP3 or client tracking: poll instead.
    Refused(redis::RedisError),
    /// The connection broke: try again.
    Lost(redis::RedisError),
}

async fn track(url: &str, set: &str, pause: &str, tx: &mpsc::UnboundedSender<Ev>) -> Tracking {
    // A server that refuses RESP3 or tracking, not one loading or failing over (E-3). One
    // whose reply cannot be read is not trusted with pushes either: polling needs none, and
    // cannot loop on a reply that stays unreadable.
    let classify = |e: redis::RedisError| match crate::conn::classify(&e) {
        crate::conn::Failure::Refusal | crate::conn::Failure::Unknown => Tracking::Refused(e),
        crate::conn::Failure::Outage => Tracking::Lost(e),
    };
    let client = match crate::conn::primary_client(url, true).await {
        Ok(c) => c,
        // The sentinels not answering, or naming no primary yet: a failover.
        Err(e) if crate::conn::is_sentinel(url) => return Tracking::Lost(e),
        Err(e) => return Tracking::Refused(e),
    };
    let (push_tx, mut pushes) = mpsc::unbounded_channel();
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(10)))
        .set_push_sender(push_tx);
    let mut conn = match client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
    {
        Ok(c) => c,
        Err(e) => return classify(e),
    };
    let on: redis::RedisResult<()> = redis::cmd("CLIENT")
        .arg(&["TRACKING", "ON", "BCAST", "PREFIX", set, "PREFIX", pause][..])
        .query_async(&mut conn)
        .await;
    if let Err(e) = on {
        return classify(e);
    }
    debug!(target: LOG_TARGET, key = set, "following the queue set with client tracking");
    // A change while this connection was not there is not reported: assume one.
    let _ = tx.send(Ev::QueuesChanged);
    let _ = tx.send(Ev::PauseChanged);
    // F-2 (5): a failover moves tracking to the new primary at once.
    let mut moves = crate::conn::Moves::of(url);
    loop {
        tokio::select! {
            _ = moves.moved() => {
                return Tracking::Lost(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "the redis primary moved (sentinel failover)",
                )));
            }
            p = pushes.recv() => match p {
                Some(p) if p.kind == redis::PushKind::Invalidate => {
                    let (queues, paused) = invalidated(&p.data, pause);
                    if queues {
                        let _ = tx.send(Ev::QueuesChanged);
                    }
                    if paused {
                        let _ = tx.send(Ev::PauseChanged);
                    }
                }
                Some(p) if p.kind == redis::PushKind::Disconnection => {
                    return Tracking::Lost(redis::RedisError::from(std::io::Error::from(
                        std::io::ErrorKind::ConnectionReset,
                    )));
                }
                Some(_) => {}
                None => {
                    return Tracking::Lost(redis::RedisError::from(std::io::Error::from(
                        std::io::ErrorKind::ConnectionReset,
                    )));
                }
            },
            // A connection cut without a reset is found by a PING now and then.
            _ = tokio::time::sleep(Duration::from_secs(60)) => {
                if let Err(e) = redis::cmd("PING").query_async::<()>(&mut conn).await {
                    return Tracking::Lost(e);
                }
            }
        }
    }
}

/// Which of the followed prefixes an invalidation names: (the queue set, a pause key). A
/// flush (no keys) names both.
fn invalidated(data: &[redis::Value], pause: &str) -> (bool, bool) {
    let keys: Vec<String> = match data.first() {
        Some(redis::Value::Array(keys)) => keys
            .iter()
            .filter_map(|k| match k {
                redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect(),
        _ => return (true, true),
    };
    if keys.is_empty() {
        return (true, true);
    }
    let paused = keys.iter().any(|k| k.starts_with(pause));
    (keys.iter().any(|k| !k.starts_with(pause)), paused)
}

async fn poll_queue_set(
    url: &str,
    set: &str,
    wanted: &mut watch::Receiver<bool>,
    tx: &mpsc::UnboundedSender<Ev>,
) {
    let mut last: Option<Vec<String>> = None;
    let mut conn = None;
    let mut backoff = MIN_BACKOFF;
    loop {
        if wanted.wait_for(|w| *w).await.is_err() {
            return;
        }
        if conn.is_none() {
            conn = blocking_connection(url).await;
        }
        let Some(c) = conn.as_mut() else {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            continue;
        };
        match redis::cmd("SMEMBERS")
            .arg(set)
            .query_async::<Vec<String>>(c)
            .await
        {
            Ok(mut now) => {
                backoff = MIN_BACKOFF;
                now.sort();
                if last.as_ref().is_some_and(|l| *l != now) {
                    let _ = tx.send(Ev::QueuesChanged);
                }
                last = Some(now);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                debug!(target: LOG_TARGET, error = %e, "SMEMBERS of the queue set failed");
                conn = None;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
