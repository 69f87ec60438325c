//! Cancel requests (locking-semantics.md A-21): `locketd cancel` (or the page) writes a field
//! `rid → request` into `<ns>:locket:cancel:<process id>`; this process reads that one key once
//! a second while one of its slots runs a job (one command per process and second, none per
//! job, nothing while idle) and hands the requests to the supervisors, which stop their job's
//! handler as for a lost lock.

use crate::conn::Manager;
use crate::resque::keys::Keys;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// How often the process reads its cancel requests while a job runs.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// One cancel request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct Request {
    /// Who asked, from which host.
    #[serde(default)]
    pub by: String,
    /// Back to the tail of its queue rather than a failure.
    #[serde(default)]
    pub requeue: bool,
}

/// The process's cancel requests by rid.
pub(crate) type Requests = HashMap<String, Request>;

/// Reads `<ns>:locket:cancel:<process id>` every [`CHECK_EVERY`] while some supervisor
/// listens (a job runs), until `stop`.
pub(super) async fn watch_requests(
    mut conn: Manager,
    key: String,
    tx: Arc<watch::Sender<Requests>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CHECK_EVERY) => {}
            _ = stop.cancelled() => return,
        }
        if tx.receiver_count() == 0 {
            continue;
        }
        let read: redis::RedisResult<HashMap<String, String>> =
            redis::cmd("HGETALL").arg(&key).query_async(&mut conn).await;
        let fields = match read {
            Ok(f) => f,
            Err(e) => {
                debug!(error = %e, "reading the cancel requests failed");
                continue;
            }
        };
        let now: Requests = fields
            .into_iter()
            .filter_map(|(rid, v)| Some((rid, serde_json::from_str(&v).ok()?)))
            .collect();
        tx.send_if_modified(|r| {
            if *r == now {
                false
            } else {
                *r = now;
                true
            }
        });
    }
}

/// Forgets the request for `rid` once its job has ended.
pub(super) async fn forget(conn: &mut Manager, keys: &Keys, process: &str, rid: &str) {
    let r: redis::RedisResult<i64> = redis::cmd("HDEL")
        .arg(keys.cancel(process))
        .arg(rid)
        .query_async(conn)
        .await;
    if let Err(e) = r {
        debug!(error = %e, "forgetting a cancel request failed (it expires by itself)");
    }
}
