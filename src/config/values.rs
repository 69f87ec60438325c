//! The value types settings are written in: durations (`"35s"`, `"250ms"`, a number of
//! seconds) and lists (a TOML array or one comma-separated string).

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::fmt;
use std::time::Duration;

/// A duration written as `"35s"`, `"100ms"`, `"5m"`, `"1h"`, `"1d"`, or a number of seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Secs(pub Duration);

impl Secs {
    /// The duration.
    pub fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

/// Splits `" 1.5 GiB "` into the number and its unit (trimmed; empty when there is none).
pub(crate) fn number_and_unit(text: &str) -> Option<(f64, &str)> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    Some((num.parse().ok()?, unit.trim()))
}

/// Parses `"35s"`, `"250ms"`, `"1.5s"`, `"5m"`, `"2h"`, `"1d"` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let (value, unit) = number_and_unit(text).ok_or_else(|| {
        format!("invalid duration {text:?} (use e.g. \"35s\", \"250ms\", \"5m\")")
    })?;
    let scale = match unit {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 0.001,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => return Err(format!("invalid duration unit {other:?} in {text:?}")),
    };
    let secs = value * scale;
    if !secs.is_finite() || !(0.0..=1.0e9).contains(&secs) {
        return Err(format!("duration {text:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl<'de> Deserialize<'de> for Secs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secs, D::Error> {
        from_text(
            d,
            "a duration such as \"35s\", \"250ms\" or a number of seconds",
            |t| parse_duration(t).map(Secs),
        )
    }
}

/// Deserializes a setting written as a string or a bare number, through `parse` of its text:
/// a number takes the same checks as every other form (a duration past them would overflow
/// `Instant + Duration` where it is used).
pub(super) fn from_text<'de, D: Deserializer<'de>, T>(
    d: D,
    expecting: &'static str,
    parse: fn(&str) -> Result<T, String>,
) -> Result<T, D::Error> {
    struct V<T> {
        expecting: &'static str,
        parse: fn(&str) -> Result<T, String>,
    }
    impl<T> de::Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            (self.parse)(v).map_err(E::custom)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
            (self.parse)(&v.to_string()).map_err(E::custom)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
            (self.parse)(&v.to_string()).map_err(E::custom)
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
            (self.parse)(&v.to_string()).map_err(E::custom)
        }
    }
    d.deserialize_any(V { expecting, parse })
}

/// A list written either as a TOML array or as one comma-separated string.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct List(pub Vec<String>);

impl<'de> Deserialize<'de> for List {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<List, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            One(String),
            Many(Vec<String>),
        }
        Ok(match Either::deserialize(d)? {
            Either::One(s) => List(
                s.split(',')
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect(),
            ),
            Either::Many(v) => List(v),
        })
    }
}
