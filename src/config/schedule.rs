//! The `[scheduler]` table and the `[schedule.<name>]` tables (scheduler-protocol.md SC-8,
//! SC-10, SC-11, SC-13, SC-14), and each schedule compiled into its ticks.
//!
//! Cron expressions are parsed by `croner` and time zones come from `chrono-tz`. Against SC-11:
//! `croner` takes 5 fields or 6 with leading seconds, the `@yearly`…`@hourly` aliases, month and
//! weekday names, ranges, lists and steps, `L` for the last day of the month, ORs day-of-month
//! and day-of-week when both are restricted (Vixie cron), and fires a fixed-time job that falls
//! in a DST gap once, right after the gap, and once only in a DST overlap. `cron` has no `L`,
//! always wants the seconds field and ANDs the two day fields; `saffron` has no seconds field
//! and no aliases; `jiff` is a time library with no cron grammar. Only `@midnight` is missing
//! from `croner`; it is `@daily` by definition and is spelled so before parsing.
//!
//! A tick is a Unix second. `every` ticks are the multiples of the period since the Unix
//! epoch, so every daemon of a fleet computes the same ticks (SC-12's record compares them).

use super::Secs;
use chrono::{DateTime, TimeZone};
use croner::Cron;
use serde::Deserialize;
use std::fmt;
use std::str::FromStr;

/// The `[scheduler]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Run the scheduler in the master (delayed delivery and `[schedule.*]`).
    #[serde(default = "super::yes")]
    pub enabled: bool,
    /// The master lock key; default `<ns>:<ns>:resque_scheduler_master_lock`, the gem's (SC-6).
    #[serde(default)]
    pub lock_key: Option<String>,
    /// The lock's TTL (the gem's is 180 s).
    #[serde(default = "d180s")]
    pub lock_ttl: Secs,
    /// A missed tick younger than this is fired once (SC-13); 0 fires no missed tick.
    #[serde(default = "d60s")]
    pub misfire_grace: Secs,
    /// Publish the schedules into `persistent_schedules` (SC-14).
    #[serde(default)]
    pub publish: bool,
}

fn d180s() -> Secs {
    Secs(std::time::Duration::from_secs(180))
}
fn d60s() -> Secs {
    Secs(std::time::Duration::from_secs(60))
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            enabled: true,
            lock_key: None,
            lock_ttl: d180s(),
            misfire_grace: d60s(),
            publish: false,
        }
    }
}

impl SchedulerConfig {
    /// The lock key under namespace `ns` (SC-6).
    pub fn lock_key(&self, ns: &str) -> String {
        self.lock_key
            .clone()
            .unwrap_or_else(|| format!("{ns}:{ns}:resque_scheduler_master_lock"))
    }
}

/// One `[schedule.<name>]` table (SC-10).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// The job class.
    pub class: String,
    /// The queue it is pushed to.
    pub queue: String,
    /// The job's args: an array as is, anything else wrapped in one (absent: `[]`).
    #[serde(default)]
    pub args: Option<toml::Value>,
    /// A cron expression (SC-11).
    #[serde(default)]
    pub cron: Option<String>,
    /// A period: `30s`, `5m`, `1h30m`, `1d`, `PT1H`, a bare number of seconds.
    #[serde(default)]
    pub every: Option<String>,
    /// Free text, shown by `locketd schedule`.
    #[serde(default)]
    pub description: Option<String>,
    /// IANA zone of the cron expression; absent: UTC, on every host (never `TZ` or the
    /// system's zone, which may differ between the daemons of a fleet).
    #[serde(default)]
    pub tz: Option<String>,
}

/// When a schedule ticks.
#[derive(Debug, Clone)]
pub enum Timing {
    /// A cron expression in a zone.
    Cron(Box<Cron>, Zone),
    /// Every so many seconds, aligned on the Unix epoch.
    Every(u64),
}

/// A cron expression's zone: the schedule's `tz`, else UTC. Never the host's: the daemons of
/// a fleet may run in different zones and must name the same ticks (SC-11, SC-12).
#[derive(Debug, Clone, Copy)]
pub enum Zone {
    /// A named IANA zone.
    Named(chrono_tz::Tz),
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Zone::Named(tz) => write!(f, "{}", tz.name()),
        }
    }
}

/// A schedule, checked and ready to tick.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Its name (the table's key).
    pub name: String,
    /// The job class.
    pub class: String,
    /// The queue.
    pub queue: String,
    /// The args as JSON text (always an array).
    pub args_json: String,
    /// When it ticks.
    pub timing: Timing,
    /// The config as written.
    pub config: ScheduleConfig,
}

/// Parses a cron expression with SC-11's grammar.
pub fn parse_cron(expr: &str) -> Result<Cron, String> {
    let t = expr.trim();
    let t = if t.eq_ignore_ascii_case("@midnight") {
        "@daily"
    } else {
        t
    };
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build()
        .parse(t)
        .map_err(|e| format!("invalid cron {expr:?}: {e}"))
}

/// Parses an `every` period (SC-11) into whole seconds (at least 1).
pub fn parse_every(text: &str) -> Result<u64, String> {
    let bad = || {
        format!("invalid duration {text:?} (use e.g. \"30s\", \"5m\", \"1h30m\", \"1d\", \"PT1H\")")
    };
    let t = text.trim();
    let (body, iso) = match t.strip_prefix("PT").or_else(|| t.strip_prefix("pt")) {
        Some(rest) => (rest, true),
        None => (t, false),
    };
    if body.is_empty() {
        return Err(bad());
    }
    if !iso && body.chars().all(|c| c.is_ascii_digit()) {
        let n: u64 = body.parse().map_err(|_| bad())?;
        return if n == 0 { Err(bad()) } else { Ok(n) };
    }
    let mut total: u64 = 0;
    let mut num = String::new();
    for c in body.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let scale = match c.to_ascii_lowercase() {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' if !iso => 86_400,
            'w' if !iso => 604_800,
            _ => return Err(bad()),
        };
        let n: u64 = num.parse().map_err(|_| bad())?;
        num.clear();
        total = n
            .checked_mul(scale)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    if !num.is_empty() || total == 0 || total > 366 * 86_400 {
        return Err(bad());
    }
    Ok(total)
}

/// The zone named `tz`, else UTC (not `TZ`, not the system's: see [`Zone`]).
pub fn parse_zone(tz: Option<&str>) -> Result<Zone, String> {
    match tz {
        Some(name) => chrono_tz::Tz::from_str(name.trim())
            .map(Zone::Named)
            .map_err(|_| {
                format!("unknown time zone {name:?} (use an IANA name such as \"Europe/Berlin\")")
            }),
        None => Ok(Zone::Named(chrono_tz::UTC)),
    }
}

/// SC-10's args normalisation, as JSON text: an array as is, a scalar or table in `[ ]`.
fn args_json(args: Option<&toml::Value>) -> Result<String, String> {
    let v = match args {
        None => serde_json::Value::Array(Vec::new()),
        Some(a) => {
            let j = serde_json::to_value(a).map_err(|e| format!("args: {e}"))?;
            if j.is_array() {
                j
            } else {
                serde_json::Value::Array(vec![j])
            }
        }
    };
    serde_json::to_string(&v).map_err(|e| format!("args: {e}"))
}

impl Schedule {
    /// Checks and compiles `[schedule.<name>]`; the error names what is wrong.
    pub fn compile(name: &str, c: &ScheduleConfig) -> Result<Schedule, String> {
        if c.class.trim().is_empty() {
            return Err("class must be non-empty".into());
        }
        if c.queue.trim().is_empty() || c.queue.contains(char::is_whitespace) {
            return Err("queue must be non-empty, without spaces".into());
        }
        let timing = match (&c.cron, &c.every) {
            (Some(_), Some(_)) | (None, None) => {
                return Err("needs exactly one of cron or every".into())
            }
            (Some(expr), None) => {
                let cron = parse_cron(expr)?;
                Timing::Cron(Box::new(cron), parse_zone(c.tz.as_deref())?)
            }
            (None, Some(every)) => {
                if let Some(tz) = &c.tz {
                    parse_zone(Some(tz))?;
                }
                Timing::Every(parse_every(every)?)
            }
        };
        Ok(Schedule {
            name: name.to_string(),
            class: c.class.clone(),
            queue: c.queue.clone(),
            args_json: args_json(c.args.as_ref())?,
            timing,
            config: c.clone(),
        })
    }

    /// The latest tick at or before `now` (Unix seconds).
    pub fn prev_tick(&self, now: i64) -> Option<i64> {
        match &self.timing {
            Timing::Every(p) => Some(now.div_euclid(*p as i64) * *p as i64),
            Timing::Cron(cron, Zone::Named(tz)) => cron_prev(cron, tz, now),
        }
    }

    /// The first tick after `after` (Unix seconds).
    pub fn next_tick(&self, after: i64) -> Option<i64> {
        match &self.timing {
            Timing::Every(p) => Some((after.div_euclid(*p as i64) + 1) * *p as i64),
            Timing::Cron(cron, Zone::Named(tz)) => cron_next(cron, tz, after),
        }
    }

    /// The entry SC-14 publishes into `persistent_schedules`: class, queue, args, and a
    /// `cron` (with its zone) or an `every` in seconds, both forms the gem parses.
    pub fn published_json(&self) -> String {
        let mut m = serde_json::Map::new();
        m.insert("class".into(), self.class.clone().into());
        m.insert("queue".into(), self.queue.clone().into());
        let args: serde_json::Value =
            serde_json::from_str(&self.args_json).unwrap_or(serde_json::Value::Null);
        m.insert("args".into(), args);
        match &self.timing {
            Timing::Every(p) => {
                m.insert("every".into(), format!("{p}s").into());
            }
            Timing::Cron(_, zone) => {
                let expr = self.config.cron.clone().unwrap_or_default();
                let Zone::Named(tz) = zone;
                let expr = format!("{expr} {}", tz.name());
                m.insert("cron".into(), expr.into());
            }
        }
        if let Some(d) = &self.config.description {
            m.insert("description".into(), d.clone().into());
        }
        serde_json::Value::Object(m).to_string()
    }
}

fn cron_prev<Tz: TimeZone>(cron: &Cron, tz: &Tz, now: i64) -> Option<i64> {
    let t: DateTime<Tz> = tz.timestamp_opt(now, 0).single()?;
    cron.find_previous_occurrence(&t, true)
        .ok()
        .map(|d| d.timestamp())
}

fn cron_next<Tz: TimeZone>(cron: &Cron, tz: &Tz, after: i64) -> Option<i64> {
    let t: DateTime<Tz> = tz.timestamp_opt(after, 0).single()?;
    cron.find_next_occurrence(&t, false)
        .ok()
        .map(|d| d.timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(cron: &str, tz: &str) -> Schedule {
        Schedule::compile(
            "t",
            &ScheduleConfig {
                class: "C".into(),
                queue: "q".into(),
                args: None,
                cron: Some(cron.into()),
                every: None,
                description: None,
                tz: Some(tz.into()),
            },
        )
        .unwrap()
    }

    fn at(s: &str) -> i64 {
        DateTime::parse_from_rfc3339(s).unwrap().timestamp()
    }

    fn ticks(s: &Schedule, from: &str, to: &str) -> Vec<i64> {
        let (mut t, end) = (at(from), at(to));
        let mut out = Vec::new();
        while let Some(n) = s.next_tick(t) {
            if n > end {
                break;
            }
            out.push(n);
            t = n;
        }
        out
    }

    #[test]
    fn every_forms() {
        assert_eq!(parse_every("30s"), Ok(30));
        assert_eq!(parse_every("5m"), Ok(300));
        assert_eq!(parse_every("1h30m"), Ok(5400));
        assert_eq!(parse_every("1d"), Ok(86_400));
        assert_eq!(parse_every("PT1H"), Ok(3600));
        assert_eq!(parse_every("PT1M30S"), Ok(90));
        assert_eq!(parse_every("45"), Ok(45));
        for bad in ["", "0", "5x", "m", "1.5m", "PT", "PT1D", "-5s"] {
            assert!(parse_every(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_ticks_are_epoch_aligned() {
        let s = Schedule::compile(
            "e",
            &ScheduleConfig {
                class: "C".into(),
                queue: "q".into(),
                args: None,
                cron: None,
                every: Some("5m".into()),
                description: None,
                tz: None,
            },
        )
        .unwrap();
        assert_eq!(s.prev_tick(1_000_123), Some(999_900));
        assert_eq!(s.next_tick(999_900), Some(1_000_200));
        assert_eq!(s.prev_tick(999_900), Some(999_900));
    }

    // SC-11: every form of the grammar.
    #[test]
    fn cron_forms() {
        let utc = "UTC";
        let s = sched("*/15 * * * *", utc);
        assert_eq!(
            ticks(&s, "2026-01-01T00:00:00Z", "2026-01-01T00:46:00Z"),
            [
                at("2026-01-01T00:15:00Z"),
                at("2026-01-01T00:30:00Z"),
                at("2026-01-01T00:45:00Z")
            ]
        );
        let s = sched("30 */20 * * * *", utc); // six fields: seconds first
        assert_eq!(
            ticks(&s, "2026-01-01T00:00:00Z", "2026-01-01T00:41:00Z"),
            [
                at("2026-01-01T00:00:30Z"),
                at("2026-01-01T00:20:30Z"),
                at("2026-01-01T00:40:30Z")
            ]
        );
        for (alias, next) in [
            ("@hourly", "2026-01-01T01:00:00Z"),
            ("@daily", "2026-01-02T00:00:00Z"),
            ("@midnight", "2026-01-02T00:00:00Z"),
            ("@weekly", "2026-01-04T00:00:00Z"), // a Sunday
            ("@monthly", "2026-02-01T00:00:00Z"),
            ("@yearly", "2027-01-01T00:00:00Z"),
            ("@annually", "2027-01-01T00:00:00Z"),
        ] {
            assert_eq!(
                sched(alias, utc).next_tick(at("2026-01-01T00:00:00Z")),
                Some(at(next)),
                "{alias}"
            );
        }
        // Names, ranges and lists.
        let s = sched("0 9 * JAN-MAR MON,FRI", utc);
        assert_eq!(
            s.next_tick(at("2026-03-28T00:00:00Z")),
            Some(at("2026-03-30T09:00:00Z"))
        );
        assert_eq!(
            s.next_tick(at("2026-03-31T00:00:00Z")),
            Some(at("2027-01-01T09:00:00Z"))
        );
        // Day of month OR day of week when both are restricted: the 13th and every Friday.
        let s = sched("0 0 13 * FRI", utc);
        assert_eq!(
            ticks(&s, "2026-02-01T00:00:00Z", "2026-02-14T00:00:00Z"),
            [at("2026-02-06T00:00:00Z"), at("2026-02-13T00:00:00Z")]
        );
        let s = sched("0 0 13 * 5", utc);
        assert_eq!(
            s.next_tick(at("2026-02-07T00:00:00Z")),
            Some(at("2026-02-13T00:00:00Z"))
        );
        assert_eq!(
            s.next_tick(at("2026-02-13T00:00:00Z")),
            Some(at("2026-02-20T00:00:00Z"))
        );
        // L: the last day of the month.
        let s = sched("0 12 L * *", utc);
        assert_eq!(
            s.next_tick(at("2026-02-01T00:00:00Z")),
            Some(at("2026-02-28T12:00:00Z"))
        );
        assert_eq!(
            s.next_tick(at("2028-02-01T00:00:00Z")),
            Some(at("2028-02-29T12:00:00Z"))
        );
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "* * * * * * * *",
            "@every",
            "0 0 32 * *",
        ] {
            assert!(parse_cron(bad).is_err(), "{bad}");
        }
    }

    // SC-11: a DST gap fires once, an overlap once (Europe/Berlin, 2026-03-29 and 2026-10-25).
    #[test]
    fn berlin_dst_changes_fire_once() {
        let s = sched("30 2 * * *", "Europe/Berlin");
        // Spring: 02:00 → 03:00 local; 02:30 does not exist: fired once, right after the gap.
        let spring = ticks(&s, "2026-03-28T12:00:00Z", "2026-03-29T12:00:00Z");
        assert_eq!(spring, [at("2026-03-29T01:00:00Z")]); // 03:00 CEST
                                                          // Autumn: 03:00 → 02:00 local; 02:30 happens twice: fired once.
        let autumn = ticks(&s, "2026-10-24T12:00:00Z", "2026-10-25T12:00:00Z");
        assert_eq!(autumn, [at("2026-10-25T00:30:00Z")]);
        // An hourly job keeps one tick per real hour across both changes.
        let h = sched("0 * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&h, "2026-03-28T22:00:00Z", "2026-03-29T04:00:00Z").len(),
            6
        );
        assert_eq!(
            ticks(&h, "2026-10-24T22:00:00Z", "2026-10-25T04:00:00Z").len(),
            6
        );
    }

    #[test]
    fn compile_checks() {
        let mut c = ScheduleConfig {
            class: "C".into(),
            queue: "q".into(),
            args: Some(toml::Value::Integer(3)),
            cron: Some("* * * * *".into()),
            every: None,
            description: None,
            tz: Some("Mars/Olympus".into()),
        };
        assert!(Schedule::compile("x", &c)
            .unwrap_err()
            .contains("Mars/Olympus"));
        c.tz = None;
        assert_eq!(Schedule::compile("x", &c).unwrap().args_json, "[3]");
        c.every = Some("5m".into());
        assert!(Schedule::compile("x", &c)
            .unwrap_err()
            .contains("exactly one"));
    }
}
