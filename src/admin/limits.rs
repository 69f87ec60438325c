//! `locketd limits` (rate-limits.md RL-5): the keyed rate limits in use, with their limit and
//! period (from this configuration's `rate`/`rates` templates), the starts allowed now, the
//! next allowed start, a handler's back-off close (RL-4) and the jobs parked on each.

use super::{human_ms, now_ms, print_json, table, Admin};
use crate::config::Config;
use crate::store;
use clap::Args;
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

/// `locketd limits [--json]`.
#[derive(Args, Debug, Clone)]
pub struct LimitsArgs {
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// A rate setting of the configuration: (template text, limit, period, spread).
type Setting = (String, u32, Duration, bool);

/// Every class's rate settings.
fn settings(config: &Config) -> Vec<Setting> {
    let mut out = Vec::new();
    for (name, class) in &config.classes {
        if let Ok(rates) =
            crate::config::rates::compile(name, class.rate.as_ref(), class.rates.as_deref())
        {
            for r in rates {
                out.push((r.key.source().to_string(), r.limit, r.period, r.spread));
            }
        }
    }
    out
}

/// The setting whose template renders keys like `key`: the same text without placeholders,
/// else the longest literal prefix before the first placeholder.
fn setting_for<'a>(all: &'a [Setting], key: &str) -> Option<&'a Setting> {
    all.iter()
        .filter(|(t, ..)| match t.find('{') {
            None => t == key,
            Some(i) => key.starts_with(&t[..i]),
        })
        .max_by_key(|(t, ..)| t.find('{').unwrap_or(usize::MAX))
}

/// `12:00:03.250` (UTC) for epoch ms.
pub fn clock(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_else(|| ms.to_string())
}

/// The rate keys in use as `locketd limits --json` lists them (and the web page's rates
/// section): at most `max` rows, each with its key, the template it matched (null when no
/// class of `config` renders it), limit, period, spread, starts in the window now, starts
/// allowed now, next allowed start, closed-until (RL-4) and parked jobs; `total` is every key
/// found. `now` is the Redis clock (ms).
pub async fn read_limits<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    keys: &crate::resque::keys::Keys,
    config: &Config,
    now: u64,
    max: usize,
) -> redis::RedisResult<super::Listing> {
    let all = settings(config);
    let found = store::rate_keys(conn, keys).await?;
    let mut rows = Vec::new();
    for key in found.iter().take(max) {
        let s = setting_for(&all, key);
        let (limit, period, spread) = s.map_or((0, Duration::ZERO, false), |s| (s.1, s.2, s.3));
        let st = store::rate_state(
            conn,
            keys,
            key,
            limit,
            period.as_millis() as u64,
            spread,
            now,
        )
        .await?;
        rows.push(json!({
            "key": st.key,
            "template": s.map(|s| s.0.clone()),
            "limit": limit,
            "period_ms": period.as_millis() as u64,
            "spread": spread,
            "used": st.used,
            "allowed_now": st.allowed_now,
            "next_allowed_ms": st.next_allowed_ms,
            "closed_until_ms": st.closed_until_ms,
            "parked": st.parked,
        }));
    }
    Ok(super::Listing {
        total: found.len() as u64,
        rows,
    })
}

impl Admin {
    pub(super) async fn limits(
        &mut self,
        a: &LimitsArgs,
        config: &Config,
    ) -> anyhow::Result<ExitCode> {
        let now = now_ms(&mut self.conn).await.unwrap_or(0).max(0) as u64;
        let rows = read_limits(&mut self.conn, &self.keys, config, now, usize::MAX)
            .await?
            .rows;
        if a.json {
            print_json(&json!({"now_ms": now, "keys": rows}));
            return Ok(ExitCode::SUCCESS);
        }
        if rows.is_empty() {
            println!("no rate keys in use");
            return Ok(ExitCode::SUCCESS);
        }
        let text: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                let known = !r["template"].is_null();
                let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
                let unknown = || "?".to_string();
                vec![
                    r["key"].as_str().unwrap_or_default().to_string(),
                    if known {
                        n(&r["limit"]).to_string()
                    } else {
                        unknown()
                    },
                    if known {
                        human_ms(n(&r["period_ms"]) as i64)
                    } else {
                        unknown()
                    },
                    if known {
                        n(&r["allowed_now"]).to_string()
                    } else {
                        unknown()
                    },
                    if n(&r["next_allowed_ms"]) > now {
                        clock(n(&r["next_allowed_ms"]))
                    } else {
                        "now".into()
                    },
                    r["closed_until_ms"].as_u64().map_or("-".into(), clock),
                    n(&r["parked"]).to_string(),
                ]
            })
            .collect();
        table(
            &[
                "KEY",
                "LIMIT",
                "PERIOD",
                "ALLOWED NOW",
                "NEXT START",
                "CLOSED UNTIL",
                "PARKED",
            ],
            &text,
        );
        Ok(ExitCode::SUCCESS)
    }
}

/// The reason `locketd parked` shows for a resource: `rate gh-api:42 until 12:00:03.250`.
pub(super) fn parked_reason(resource: &str, due_ms: Option<u64>) -> String {
    match (resource.strip_prefix("rate:"), due_ms) {
        (Some(key), Some(due)) => format!("rate {key} until {}", clock(due)),
        (Some(key), None) => format!("rate {key}"),
        _ => match resource.split_once(':') {
            Some(("lock", id)) => format!("lock {id} held"),
            Some(("dep", name)) => format!("hold {name} live"),
            _ => resource.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_matched_to_their_template() {
        let all = vec![
            ("smtp".to_string(), 100, Duration::from_secs(1), false),
            (
                "gh-api:{args[1]}".to_string(),
                5000,
                Duration::from_secs(3600),
                false,
            ),
            ("gh:{args[0]}".to_string(), 1, Duration::from_secs(1), false),
        ];
        assert_eq!(setting_for(&all, "smtp").unwrap().1, 100);
        assert_eq!(setting_for(&all, "gh-api:42").unwrap().1, 5000);
        assert_eq!(setting_for(&all, "gh:7").unwrap().1, 1);
        assert!(setting_for(&all, "other").is_none());
        assert_eq!(
            parked_reason("rate:gh-api:42", Some(43_203_250)),
            "rate gh-api:42 until 12:00:03.250"
        );
    }
}
