//! `GET /metrics` in Prometheus text format.
//!
//! The registry and the encoding are prometheus-client's; the listener that serves it, with
//! the web page, is [`super::listener`]. Each scrape merges the [`crate::metrics::Aggregate`] and reads from Redis, bounded by a 2 s timeout
//! and at most [`MAX_QUEUES`] queues: queue lengths and lock counters of the configured queues,
//! locks held, failures listed, Resque's processed/failed totals and registered workers.

use crate::config::Config;
use crate::conn::Manager;
use crate::metrics::{JobCounts, Snapshot, CONFLICT_ACTIONS};
use crate::resque::keys::Keys;
use crate::resque::patterns::QueueSpec;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tracing::debug;

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::metrics::http";

mod handlers;

/// Most queues read per scrape.
pub const MAX_QUEUES: usize = 500;

/// What Redis said at scrape time.
#[derive(Debug, Clone, Default)]
pub struct RedisGauges {
    /// Whether Redis answered.
    pub up: bool,
    /// (queue, length, lock counter).
    pub queues: Vec<(String, u64, u64)>,
    /// Locks with a live holder.
    pub locks_held: u64,
    /// Records in the failure list(s).
    pub failures_listed: u64,
    /// `stat:processed`.
    pub processed: u64,
    /// `stat:failed`.
    pub failed: u64,
    /// `SCARD workers`.
    pub workers_registered: u64,
    /// resque-scheduler's delayed queue (SC-3 readers' numbers).
    pub delayed: crate::scheduler::ops::DelayedCounts,
    /// Parked waits (PK-8): jobs parked per queue, and the fleet's parks and wakes
    /// (`stat:parked`, `stat:woken`).
    pub parked: ParkedGauges,
    /// The queues of `queues` an operator paused (A-20).
    pub paused: std::collections::BTreeSet<String>,
    /// Keys this scrape could not read as it needs them (a key another tool gave another
    /// type, a set member that is no UTF-8 name), with Redis's reply: their gauges read 0 and
    /// the rest stay, since Redis answered (`up`).
    pub unreadable: Vec<(String, String)>,
}

/// A gauge's read that one key refused: its value reads as the default and the key is noted
/// in `u`; only Redis not answering fails the whole Redis part of the scrape.
fn soft<T: Default>(
    r: redis::RedisResult<T>,
    key: String,
    u: &mut Vec<(String, String)>,
) -> redis::RedisResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(e) if crate::ops::unreadable::is_connection(&e) => Err(e),
        Err(e) => {
            u.push((key, crate::ops::unreadable::error_text(&e)));
            Ok(T::default())
        }
    }
}

/// Parked waits' numbers at scrape time (PK-8).
#[derive(Debug, Clone, Default)]
pub struct ParkedGauges {
    /// Jobs parked per queue.
    pub per_queue: std::collections::BTreeMap<String, u64>,
    /// Parks so far (`stat:parked`).
    pub parks: u64,
    /// Wakes so far (`stat:woken`).
    pub wakes: u64,
    /// Keyed rate limits (RL-5): (class, jobs a rate refused) and (class, throttled runs).
    pub rate_limited: Vec<(String, u64)>,
    /// Runs throttled by the remote side, per class (RL-4).
    pub throttled: Vec<(String, u64)>,
}

/// Reads the scrape-time gauges (bounded: a handful of commands plus two per queue).
pub async fn read_redis(conn: &mut Manager, config: &Config) -> RedisGauges {
    match tokio::time::timeout(Duration::from_secs(2), read_redis_inner(conn, config)).await {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => {
            debug!(target: LOG_TARGET, error = %e, "metrics: redis read failed");
            RedisGauges::default()
        }
        Err(_) => RedisGauges::default(),
    }
}

async fn read_redis_inner(conn: &mut Manager, config: &Config) -> redis::RedisResult<RedisGauges> {
    let k = Keys::new(&config.namespace);
    let (now, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let spec = QueueSpec::from_list(&config.queues.0).ok();
    let mut unreadable = Vec::new();
    let known: Vec<String> = match &spec {
        Some(s) if !s.is_dynamic() => Vec::new(),
        _ => {
            let raw: Vec<Vec<u8>> = soft(
                redis::cmd("SMEMBERS")
                    .arg(k.queues())
                    .query_async(conn)
                    .await,
                k.queues(),
                &mut unreadable,
            )?;
            let (names, left_out) = crate::ops::unreadable::utf8_names(raw);
            if let Some(why) = left_out {
                unreadable.push((k.queues(), why));
            }
            names
        }
    };
    let mut names = match &spec {
        Some(s) => s.expand(&known),
        None => {
            let mut k = known.clone();
            k.sort();
            k
        }
    };
    names.truncate(MAX_QUEUES);
    let per = soft(
        crate::ops::queue_lengths(conn, &k, &names).await,
        "the queues' lists and lock counters".to_string(),
        &mut unreadable,
    )?;
    let paused = crate::store::pause_states(conn, &k, &names)
        .await
        .map(|s| {
            names
                .iter()
                .zip(s)
                .filter(|(_, s)| s.is_paused())
                .map(|(q, _)| q.clone())
                .collect()
        })
        .unwrap_or_default();
    let (failed_key_len, refused_lists) = soft(
        crate::ops::failed::listed_counts(conn, config, MAX_QUEUES).await,
        "the failure lists".to_string(),
        &mut unreadable,
    )?;
    unreadable.extend(refused_lists);
    let (processed, failed, workers_registered): (Option<u64>, Option<u64>, u64) = soft(
        redis::pipe()
            .get(k.stat_processed())
            .get(k.stat_failed())
            .scard(k.workers())
            .query_async(conn)
            .await,
        format!(
            "{}, {}, {}",
            k.stat_processed(),
            k.stat_failed(),
            k.workers()
        ),
        &mut unreadable,
    )?;
    let locks_held = soft(
        crate::store::locks_held(conn, &k, now.saturating_mul(1000)).await,
        k.locket("locks"),
        &mut unreadable,
    )?;
    let delayed = crate::scheduler::ops::delayed_counts(conn, &k, now as i64)
        .await
        .unwrap_or_default();
    // Parked waits (PK-8): the per-queue counts the park and wake steps keep, and the totals.
    let (parks, wakes): (Option<u64>, Option<u64>) = redis::pipe()
        .get(k.stat("parked"))
        .get(k.stat("woken"))
        .query_async(conn)
        .await
        .unwrap_or_default();
    // RL-5: the rate paths' per-class counts (`<ns>:locket:rate_stats`, "event|class").
    let rate_stats: Vec<(String, u64)> = redis::cmd("HGETALL")
        .arg(k.locket("rate_stats"))
        .query_async(conn)
        .await
        .unwrap_or_default();
    let per_class = |event: &str| -> Vec<(String, u64)> {
        rate_stats
            .iter()
            .filter_map(|(f, n)| {
                let (e, class) = f.split_once('|')?;
                (e == event).then(|| (class.to_string(), *n))
            })
            .collect()
    };
    let parked = ParkedGauges {
        rate_limited: per_class("rate_limited"),
        throttled: per_class("throttled"),
        per_queue: crate::store::parked_per_queue(conn, &k)
            .await
            .unwrap_or_default(),
        parks: parks.unwrap_or(0),
        wakes: wakes.unwrap_or(0),
    };
    Ok(RedisGauges {
        unreadable,
        paused,
        parked,
        delayed,
        up: true,
        queues: names
            .into_iter()
            .zip(per)
            .map(|(q, (len, ctr))| (q, len, ctr.unwrap_or(0)))
            .collect(),
        locks_held,
        failures_listed: failed_key_len,
        processed: processed.unwrap_or(0),
        failed: failed.unwrap_or(0),
        workers_registered,
    })
}

#[derive(Debug)]
struct Scrape {
    jobs: Snapshot,
    redis: RedisGauges,
}

type Labels = Vec<(String, String)>;

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), label_value(v)))
        .collect()
}

/// Longest label value written, in bytes; a longer one is cut and ends in `…`.
const MAX_LABEL_BYTES: usize = 200;

/// A label value as the text format wants it: `\`, `"` and newlines escaped (the encoder
/// writes values as given, and queue and class names come from job producers: one raw quote
/// or newline made the whole scrape unparseable), and at most [`MAX_LABEL_BYTES`] long.
fn label_value(v: &str) -> String {
    let mut end = v.len().min(MAX_LABEL_BYTES);
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + 8);
    for c in v[..end].chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    if end < v.len() {
        out.push('…');
    }
    out
}

fn counter_family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        if labels.is_empty() {
            m.encode_counter::<NoLabelSet, _, u64>(v, None)?;
        } else {
            m.encode_family(labels)?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
    }
    Ok(())
}

fn gauge_family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, i64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        if labels.is_empty() {
            m.encode_gauge(v)?;
        } else {
            m.encode_family(labels)?.encode_gauge(v)?;
        }
    }
    Ok(())
}

fn as_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.jobs;
        let per_job = |f: &dyn Fn(&JobCounts) -> u64| -> Vec<(Labels, u64)> {
            s.jobs
                .iter()
                .map(|j| (l(&[("queue", &j.queue), ("class", &j.class)]), f(j)))
                .collect()
        };
        counter_family(
            &mut enc,
            "locketd_jobs_started",
            "Jobs whose handler started.",
            &per_job(&|j| j.started),
        )?;
        counter_family(
            &mut enc,
            "locketd_jobs_succeeded",
            "Jobs that succeeded.",
            &per_job(&|j| j.succeeded),
        )?;
        counter_family(
            &mut enc,
            "locketd_jobs_failed",
            "Failure records written (counted in stat:failed), including jobs that could not start.",
            &per_job(&|j| j.failed),
        )?;
        counter_family(
            &mut enc,
            "locketd_jobs_killed",
            "Failure records for killed jobs (not counted in stat:failed).",
            &per_job(&|j| j.killed),
        )?;
        counter_family(
            &mut enc,
            "locketd_jobs_requeued",
            "Jobs put back in their queue after a lost lock.",
            &per_job(&|j| j.requeued),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "locketd_job_duration_seconds",
                "Run time of finished jobs.",
                None,
                MetricType::Histogram,
            )?;
            for j in &s.jobs {
                let labels = l(&[("queue", &j.queue), ("class", &j.class)]);
                m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                    j.duration.sum,
                    j.duration.count,
                    &j.duration.per_bucket(),
                    None,
                )?;
            }
        }
        let mut actions: Vec<(Labels, u64)> = CONFLICT_ACTIONS
            .iter()
            .map(|a| {
                (
                    l(&[("action", a)]),
                    s.lock_conflicts.get(*a).copied().unwrap_or(0),
                )
            })
            .collect();
        for (a, v) in &s.lock_conflicts {
            if !CONFLICT_ACTIONS.contains(&a.as_str()) {
                actions.push((l(&[("action", a)]), *v));
            }
        }
        counter_family(
            &mut enc,
            "locketd_lock_conflicts",
            "Jobs whose lock was held elsewhere, by what was done with them (requeue, discard, delay, wait).",
            &actions,
        )?;
        let takes: Vec<(Labels, u64)> = s
            .takes
            .iter()
            .map(|(p, v)| (l(&[("path", p)]), *v))
            .collect();
        counter_family(
            &mut enc,
            "locketd_takes",
            "Reserved jobs by how their locks were taken: one_call (in the call that reserved them), else why the worker's own ACQUIRE took them.",
            &takes,
        )?;
        counter_family(
            &mut enc,
            "locketd_locks_lost",
            "Locks lost while their job ran.",
            &[(Vec::new(), s.locks_lost)],
        )?;
        counter_family(
            &mut enc,
            "locketd_queue_skips",
            "Reserve passes that skipped the queue because every job in it waited on a lock.",
            &s.queue_skips
                .iter()
                .map(|(q, v)| (l(&[("queue", q)]), *v))
                .collect::<Vec<_>>(),
        )?;
        handlers::encode(&mut enc, &s.handlers)?;
        gauge_family(
            &mut enc,
            "locketd_workers",
            "This daemon's worker slots, by state.",
            &[
                (l(&[("state", "busy")]), as_i64(s.busy)),
                (
                    l(&[("state", "idle")]),
                    as_i64(s.workers.saturating_sub(s.busy)),
                ),
            ],
        )?;
        counter_family(
            &mut enc,
            "locketd_redis_errors",
            "Redis errors seen by the worker loop.",
            &[(Vec::new(), s.redis_errors)],
        )?;
        counter_family(
            &mut enc,
            "locketd_redis_reconnects",
            "Times Redis answered again after errors.",
            &[(Vec::new(), s.redis_reconnects)],
        )?;

        let r = &self.redis;
        gauge_family(
            &mut enc,
            "locketd_redis_up",
            "1 when Redis answered this scrape.",
            &[(Vec::new(), i64::from(r.up))],
        )?;
        if !r.unreadable.is_empty() {
            gauge_family(
                &mut enc,
                "locketd_redis_unreadable_keys",
                "Keys this scrape could not read as it needs them (another type, a name that is not UTF-8); their gauges read 0, and `locketd status` says why.",
                &r.unreadable
                    .iter()
                    .map(|(key, _)| key.as_str())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .map(|key| (l(&[("key", key)]), 1))
                    .collect::<Vec<_>>(),
            )?;
        }
        if r.up {
            gauge_family(
                &mut enc,
                "locketd_queue_length",
                "Jobs waiting in the queue (LLEN).",
                &r.queues
                    .iter()
                    .map(|(q, len, _)| (l(&[("queue", q)]), as_i64(*len)))
                    .collect::<Vec<_>>(),
            )?;
            gauge_family(
                &mut enc,
                "locketd_queue_lock_counter",
                "The queue's locket counter: jobs requeued because their lock was held (0 when unset).",
                &r.queues
                    .iter()
                    .map(|(q, _, c)| (l(&[("queue", q)]), as_i64(*c)))
                    .collect::<Vec<_>>(),
            )?;
            gauge_family(
                &mut enc,
                "locketd_queue_paused",
                "1 when an operator paused the queue (resque-pause's keys, A-20): its jobs wait.",
                &r.queues
                    .iter()
                    .map(|(q, _, _)| (l(&[("queue", q)]), i64::from(r.paused.contains(q))))
                    .collect::<Vec<_>>(),
            )?;
            // Parked waits (PK-8).
            gauge_family(
                &mut enc,
                "locketd_parked_jobs",
                "Jobs of the queue parked on a lock or hold (not in LLEN nor in Resque's queue sizes).",
                &r.parked
                    .per_queue
                    .iter()
                    .map(|(q, n)| (l(&[("queue", q)]), as_i64(*n)))
                    .collect::<Vec<_>>(),
            )?;
            counter_family(
                &mut enc,
                "locketd_parks",
                "Jobs parked on a lock or hold, fleet-wide (stat:parked).",
                &[(Vec::new(), r.parked.parks)],
            )?;
            counter_family(
                &mut enc,
                "locketd_wakes",
                "Parked jobs moved back to their queues, fleet-wide (stat:woken).",
                &[(Vec::new(), r.parked.wakes)],
            )?;
            // Keyed rate limits (RL-5), fleet-wide.
            let per_class = |rows: &[(String, u64)]| -> Vec<(Labels, u64)> {
                rows.iter().map(|(c, n)| (l(&[("class", c)]), *n)).collect()
            };
            counter_family(
                &mut enc,
                "locketd_rate_limited",
                "Jobs a keyed rate refused and parked until their start was allowed, per class.",
                &per_class(&r.parked.rate_limited),
            )?;
            counter_family(
                &mut enc,
                "locketd_throttled",
                "Runs the remote side throttled (exit 76, Throttled), per class: not failures.",
                &per_class(&r.parked.throttled),
            )?;
            let d = &r.delayed;
            gauge_family(
                &mut enc,
                "locketd_delayed_timestamps",
                "resque-scheduler timestamps scheduled (ZCARD delayed_queue_schedule).",
                &[(Vec::new(), as_i64(d.timestamps))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_delayed_due_items",
                "resque-scheduler delayed items due now and not delivered yet.",
                &[(Vec::new(), as_i64(d.due_items))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_delayed_oldest_overdue_seconds",
                "Age of the oldest due resque-scheduler timestamp (0: none due).",
                &[(Vec::new(), as_i64(d.oldest_overdue_secs))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_delayed_kept_items",
                "Delayed items the scheduler keeps back (no usable queue, wrong-typed key).",
                &[(Vec::new(), d.kept.len() as i64)],
            )?;
            gauge_family(
                &mut enc,
                "locketd_locks_held",
                "Locks with a live holder.",
                &[(Vec::new(), as_i64(r.locks_held))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_failures_listed",
                "Records in the Resque failure list(s).",
                &[(Vec::new(), as_i64(r.failures_listed))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_resque_processed",
                "Resque's stat:processed (all workers).",
                &[(Vec::new(), as_i64(r.processed))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_resque_failed",
                "Resque's stat:failed (all workers).",
                &[(Vec::new(), as_i64(r.failed))],
            )?;
            gauge_family(
                &mut enc,
                "locketd_resque_workers_registered",
                "Members of Resque's workers set (all implementations).",
                &[(Vec::new(), as_i64(r.workers_registered))],
            )?;
        }
        Ok(())
    }
}

/// Renders one scrape.
pub fn render(jobs: Snapshot, redis: RedisGauges) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape { jobs, redis }));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// What `/metrics` reads Redis with and for: the running config and a connection to its Redis.
/// The master replaces it on HUP ([`super::Sidecars::reload`]), so the gauges follow
/// the new queues, namespace and server without a restart.
#[derive(Debug)]
pub struct Source {
    /// A connection to `config.redis`.
    pub conn: Manager,
    /// The config the daemon runs with.
    pub config: Config,
}

/// The [`Source`] the endpoint reads at each scrape, shared with whoever replaces it.
pub type SharedSource = Arc<RwLock<Arc<Source>>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Metrics, Outcome};

    // Queue and class names come from job producers: a quote, a backslash or a newline must
    // not break the exposition text (one bad line fails the whole scrape), nor a huge name
    // make a huge one.
    #[test]
    fn label_values_from_producers_are_escaped_and_cut() {
        let m = Metrics::default();
        let odd = "Q\"uo\\te\nERROR forged";
        m.job_started("q", odd);
        m.job_started("q", &"é".repeat(1000));
        let text = render(m.snapshot(), RedisGauges::default());
        assert!(
            text.contains(
                r#"locketd_jobs_started_total{queue="q",class="Q\"uo\\te\nERROR forged"} 1"#
            ),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("ERROR")), "{text}");
        let long = text
            .lines()
            .find(|l| l.starts_with("locketd_jobs_started_total") && l.contains('é'))
            .unwrap();
        assert!(
            long.contains(&format!("class=\"{}…\"", "é".repeat(100))),
            "{long}"
        );
    }

    #[test]
    fn render_has_every_family() {
        let m = Metrics::default();
        m.job_started("q", "C");
        m.job_finished("q", "C", Outcome::Succeeded, Duration::from_millis(20));
        let text = render(
            m.snapshot(),
            RedisGauges {
                up: true,
                queues: vec![("q".into(), 3, 1)],
                paused: ["q".to_string()].into(),
                ..RedisGauges::default()
            },
        );
        for needle in [
            "locketd_jobs_succeeded_total{queue=\"q\",class=\"C\"} 1",
            "locketd_jobs_started_total{queue=\"q\",class=\"C\"} 1",
            "locketd_job_duration_seconds_bucket{le=\"0.025\",queue=\"q\",class=\"C\"} 1",
            "locketd_job_duration_seconds_count{queue=\"q\",class=\"C\"} 1",
            "locketd_job_duration_seconds_bucket{le=\"+Inf\",queue=\"q\",class=\"C\"} 1",
            "locketd_job_duration_seconds_bucket{le=\"0.01\",queue=\"q\",class=\"C\"} 0",
            "locketd_lock_conflicts_total{action=\"discard\"} 0",
            "locketd_workers{state=\"idle\"} 1",
            "locketd_queue_length{queue=\"q\"} 3",
            "locketd_queue_lock_counter{queue=\"q\"} 1",
            "locketd_queue_paused{queue=\"q\"} 1",
            "locketd_redis_up 1",
            "# EOF",
        ] {
            assert!(text.contains(needle), "{needle} missing in\n{text}");
        }
    }
}
