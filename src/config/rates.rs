//! Keyed rate limits (rate-limits.md §2, RL-1): the TOML shape of `rate = {...}` and
//! `rates = [...]`, compiled with their key templates parsed and every mistake named.

use super::{ConfigError, Secs};
use crate::locks::template::{RenderError, RenderInput, Template};
use crate::locks::RateSpec;
use serde::Deserialize;
use std::time::Duration;

/// The largest `limit` a rate may have: its sliding log keeps one entry per start of the
/// last period (RL-1's bounded memory); larger limits are refused by `check-config`.
pub const MAX_RATE_LIMIT: u32 = 10_000;

/// The largest limit whose starts the scripts keep in the key's string log; a larger one's
/// are in a ZSET, `rate:<key>` (rate.lua). Two classes sharing a key must sit on one side
/// of it (plans.rs), since the two logs do not see each other.
pub const RATE_STRING_MAX: u32 = 256;

/// One entry of `rate = {...}` / `rates = [...]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateEntry {
    /// Key template (as a lock id: `"gh-api:{args[1]}"`).
    pub key: String,
    /// Most starts of one key in any sliding window of `period`.
    pub limit: u32,
    /// The window.
    pub period: Secs,
    /// Also space the starts at least `period / limit` apart (GCRA with burst 1).
    #[serde(default)]
    pub spread: bool,
}

/// One rate of a class, template parsed.
#[derive(Debug, Clone)]
pub struct RatePlan {
    /// Key template.
    pub key: Template,
    /// Most starts per period.
    pub limit: u32,
    /// The window.
    pub period: Duration,
    /// Spaced starts.
    pub spread: bool,
}

impl RatePlan {
    /// The rate for one payload.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<RateSpec, RenderError> {
        Ok(RateSpec {
            key: self.key.render(input)?.id,
            limit: self.limit,
            period: self.period,
            spread: self.spread,
        })
    }
}

fn invalid(setting: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting: setting.to_string(),
        message: message.into(),
    }
}

/// Compiles a class's `rate` / `rates` (both given is a mistake), naming the entry of every
/// mistake: a bad template, a zero limit or period, a limit above [`MAX_RATE_LIMIT`].
pub fn compile(
    setting: &str,
    rate: Option<&RateEntry>,
    rates: Option<&[RateEntry]>,
) -> Result<Vec<RatePlan>, ConfigError> {
    let entries: Vec<(String, &RateEntry)> = match (rate, rates) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                &format!("{setting}.rates"),
                "give either `rate = {...}` or `rates = [...]`, not both",
            ))
        }
        (Some(r), None) => vec![(format!("{setting}.rate"), r)],
        (None, Some(list)) => list
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("{setting}.rates[{i}]"), r))
            .collect(),
        (None, None) => Vec::new(),
    };
    let mut out = Vec::new();
    for (s, e) in entries {
        let key = Template::parse(&e.key)
            .map_err(|err| invalid(&s, format!("template {:?}: {err}", e.key)))?;
        if e.limit == 0 {
            return Err(invalid(&s, "limit must be at least 1"));
        }
        if e.limit > MAX_RATE_LIMIT {
            return Err(invalid(
                &s,
                format!(
                    "limit must be at most {MAX_RATE_LIMIT} per period (use a shorter period: \
                     e.g. 10000 per 1h as 2500 per 15m)"
                ),
            ));
        }
        let period = e.period.get();
        if period < Duration::from_millis(1) {
            return Err(invalid(&s, "period must be at least 1ms"));
        }
        out.push(RatePlan {
            key,
            limit: e.limit,
            period,
            spread: e.spread,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::config::plans::Plans;
    use crate::config::Config;

    fn plans(text: &str) -> Result<Plans, crate::config::ConfigError> {
        Plans::compile(&Config::parse(&format!("queues = \"q\"\n{text}"), "t").unwrap())
    }

    // rate-limits.md §2: check-config names a bad template, a zero limit or period, both keys.
    #[test]
    fn bad_rate_settings_are_rejected_by_name() {
        for (text, name) in [
            (
                "[classes.A]\nrate = { key = \"{nope}\", limit = 1, period = \"1s\" }",
                "classes.\"A\".rate",
            ),
            (
                "[classes.A]\nrate = { key = \"k\", limit = 0, period = \"1s\" }",
                "limit must be at least 1",
            ),
            (
                "[classes.A]\nrates = [{ key = \"k\", limit = 1, period = \"1s\" }, \
                 { key = \"j\", limit = 1, period = \"0s\" }]",
                "classes.\"A\".rates[1]",
            ),
            (
                "[classes.A]\nrate = { key = \"k\", limit = 10001, period = \"1h\" }",
                "at most 10000",
            ),
            (
                "[classes.A]\nrate = { key = \"k\", limit = 1, period = \"1s\" }\n\
                 rates = [{ key = \"k\", limit = 1, period = \"1s\" }]",
                "not both",
            ),
        ] {
            let err = plans(text).unwrap_err().to_string();
            assert!(err.contains(name), "{text}: {err}");
        }
        let err = Config::parse(
            "queues=\"q\"\n[classes.A]\nrate = { key = \"k\", limit = 1, period = \"1s\", x = 1 }",
            "t",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains('x'), "{err}");
    }

    // RL-1 across classes: one key template with two periods would let the shorter one's
    // starts trim the longer one's log (rate.lua), and limits on both sides of 256 use two
    // logs; both are refused by name. One key with two limits (same side) and one period is
    // fine: each class's check sees every start in its window.
    #[test]
    fn one_rate_key_with_two_periods_or_two_logs_is_rejected() {
        let two = |a: &str, b: &str| {
            plans(&format!(
                "[classes.A]\nrate = {{ key = \"api:{{args[0]}}\", {a} }}\n\
                 [classes.B]\nrates = [{{ key = \"other\", limit = 1, period = \"1s\" }}, \
                 {{ key = \"api:{{args[0]}}\", {b} }}]\n"
            ))
        };
        let err = two("limit = 10, period = \"1h\"", "limit = 10, period = \"1s\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("classes.\"B\"") && err.contains("class \"A\"") && err.contains("period"),
            "{err}"
        );
        let err = two(
            "limit = 100, period = \"1m\"",
            "limit = 300, period = \"1m\"",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("two logs"), "{err}");
        two("limit = 100, period = \"1m\"", "limit = 5, period = \"1m\"").unwrap();
    }

    #[test]
    fn rates_compile_in_order() {
        let p = plans(
            "[classes.A]\nrates = [{ key = \"smtp\", limit = 100, period = \"1s\" }, \
             { key = \"to:{args[0]}\", limit = 3, period = \"1m\", spread = true }]\n",
        )
        .unwrap();
        let a = p.get("A");
        assert_eq!(a.rates.len(), 2);
        assert_eq!(a.rates[1].key.source(), "to:{args[0]}");
        assert_eq!(a.rates[1].period.as_secs(), 60);
        assert!(a.rates[1].spread && !a.rates[0].spread);
        assert!(p.get("Other").rates.is_empty());
    }
}
