//! The time stamps Resque writes, always rendered in UTC (resque-protocol.md §4, §6).
//!
//! ```text
//! redis> HGET resque:workers:heartbeat vm:9454:slow,high
//! "2026-11-21T12:18:29+00:00"                      heartbeat()   Ruby Time#iso8601
//! redis> GET resque:worker:vm:9454:slow,high:started
//! "2026-11-21 12:18:29 +0000"                      started_at()  Ruby Time#to_s
//! redis> GET resque:worker:vm:9454:slow,high
//! {"queue":"slow","run_at":"2026-11-21T12:18:29Z",...}        run_at()
//! redis> LINDEX resque:failed 0
//! {"failed_at":"2026/11/21 12:18:24 UTC",...}                  failed_at()
//! ```
//!
//! Ruby writes the worker host's local time; locketd always writes UTC, which every reader
//! accepts. The calendar conversion is Howard Hinnant's `civil_from_days` /
//! `days_from_civil` (proleptic Gregorian), so no time-zone crate is needed.

use std::time::{SystemTime, UNIX_EPOCH};

const SECS_PER_DAY: i64 = 86_400;

/// A UTC calendar date and time of day, to the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilTime {
    /// Proleptic Gregorian year (may be zero or negative for times before year 1).
    pub year: i64,
    /// Month, 1..=12.
    pub month: u32,
    /// Day of month, 1..=31.
    pub day: u32,
    /// Hour, 0..=23.
    pub hour: u32,
    /// Minute, 0..=59.
    pub minute: u32,
    /// Second, 0..=59.
    pub second: u32,
}

/// Converts seconds since the Unix epoch to the UTC calendar date and time.
/// Defined for every `i64` (negative values are before 1970).
pub fn civil_from_epoch(secs: i64) -> CivilTime {
    let days = secs.div_euclid(SECS_PER_DAY);
    let rem = secs.rem_euclid(SECS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    // rem is in 0..86400, so these casts are lossless.
    let rem = rem as u32;
    CivilTime {
        year,
        month,
        day,
        hour: rem / 3600,
        minute: rem / 60 % 60,
        second: rem % 60,
    }
}

/// Converts a day count since 1970-01-01 to `(year, month, day)` in the proleptic Gregorian
/// calendar.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // 0..=365, March-based
    let mp = (5 * doy + 2) / 153; // 0..=11, March = 0
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Converts a proleptic Gregorian date to the day count since 1970-01-01. The month must be
/// in 1..=12; the day is not range-checked (day 0 is the last day of the previous month).
pub fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Whole seconds since the Unix epoch, rounded down (so 0.5 s before the epoch is -1).
/// Saturates at the `i64` range.
pub fn epoch_secs(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => {
            let d = e.duration();
            let whole = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            if d.subsec_nanos() > 0 {
                whole.saturating_neg().saturating_sub(1)
            } else {
                -whole
            }
        }
    }
}

/// Ruby `%Y`: at least four digits, with a sign for years before 0.
fn year_text(year: i64) -> String {
    if year < 0 {
        format!("-{:04}", year.unsigned_abs())
    } else {
        format!("{year:04}")
    }
}

/// `failed_at` / `retried_at` of a failure record: `2026/11/21 12:18:24 UTC`
/// (Ruby `strftime("%Y/%m/%d %H:%M:%S %Z")` on a UTC host).
pub fn failed_at(t: SystemTime) -> String {
    stamp(epoch_secs(t), '/', ' ', " UTC")
}

/// `run_at` inside `worker:<id>`: `2026-11-21T12:18:29Z`.
pub fn run_at(t: SystemTime) -> String {
    with_iso_second(epoch_secs(t), |text| {
        let mut out = String::with_capacity(text.len() + 1);
        out.push_str(text);
        out.push('Z');
        out
    })
}

/// Hands `f` the UTC `2026-11-21T12:18:29` of `secs`. [`run_at`] and the log's timestamps
/// (src/logsink.rs) ask for it on every job, so the text of the last second asked for is kept
/// per thread and handed out again within that second.
pub fn with_iso_second<R>(secs: i64, f: impl FnOnce(&str) -> R) -> R {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(i64, String)>> = const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((s, text)) if *s == secs => f(text),
        _ => f(&last.insert((secs, stamp(secs, '-', 'T', ""))).1),
    })
}

/// The value of `worker:<id>:started`: `2026-11-21 12:18:29 +0000` (Ruby `Time#to_s` of a
/// local time on a UTC host).
pub fn started_at(t: SystemTime) -> String {
    stamp(epoch_secs(t), '-', ' ', " +0000")
}

/// A `workers:heartbeat` value from Redis `TIME` seconds: `2026-11-21T12:18:29+00:00`
/// (Ruby `Time#iso8601`, numeric offset, no fraction).
pub fn heartbeat(epoch_secs: u64) -> String {
    stamp(
        i64::try_from(epoch_secs).unwrap_or(i64::MAX),
        '-',
        'T',
        "+00:00",
    )
}

/// `Y<d>MM<d>DD<t>HH:MM:SS<zone>` in UTC: the one layout behind every format above.
fn stamp(secs: i64, date_sep: char, time_sep: char, zone: &str) -> String {
    let c = civil_from_epoch(secs);
    format!(
        "{}{date_sep}{:02}{date_sep}{:02}{time_sep}{:02}:{:02}:{:02}{zone}",
        year_text(c.year),
        c.month,
        c.day,
        c.hour,
        c.minute,
        c.second
    )
}

/// Parses a `workers:heartbeat` value into seconds since the epoch, rounded down.
///
/// Accepts the ISO-8601 forms Resque and its peers write and Ruby `Time.parse` reads:
/// `YYYY-MM-DDTHH:MM:SS` (or `t` or a space instead of `T`), an optional fraction
/// (`.123456`), optional spaces, then a zone: `Z`, `z`, `UTC`, `+HH:MM`, `-HH:MM`,
/// `+HHMM` or `+HH`. Surrounding whitespace is ignored. Second 60 rolls over into the next
/// minute, as in Ruby.
///
/// Returns `None` for anything else: garbage, out-of-range fields, invalid dates, a time
/// before 1970, and a missing zone (Ruby would read that as the reader's local time, which
/// cannot be known here).
pub fn parse_heartbeat(s: &str) -> Option<u64> {
    let mut c = Cursor {
        b: s.trim().as_bytes(),
        i: 0,
    };
    let year = c.number(4, 9)?;
    c.eat(b'-')?;
    let month = c.number(2, 2)?;
    c.eat(b'-')?;
    let day = c.number(2, 2)?;
    match c.next()? {
        b'T' | b't' | b' ' => {}
        _ => return None,
    }
    let hour = c.number(2, 2)?;
    c.eat(b':')?;
    let minute = c.number(2, 2)?;
    c.eat(b':')?;
    let second = c.number(2, 2)?;
    if c.peek() == Some(b'.') || c.peek() == Some(b',') {
        c.i += 1;
        if c.skip_digits() == 0 {
            return None;
        }
    }
    while c.peek() == Some(b' ') {
        c.i += 1;
    }
    let offset = c.zone()?;
    if c.i != c.b.len() {
        return None;
    }

    let month = u32::try_from(month).ok()?;
    let day = u32::try_from(day).ok()?;
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let local =
        days_from_civil(year, month, day) * SECS_PER_DAY + hour * 3600 + minute * 60 + second;
    u64::try_from(local - offset).ok()
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// A byte cursor for [`parse_heartbeat`]; every method fails softly with `None`.
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    /// Reads `min..=max` ASCII digits (`max` ≤ 9, so no overflow) as a number.
    fn number(&mut self, min: usize, max: usize) -> Option<i64> {
        let start = self.i;
        let mut value = 0i64;
        while self.i - start < max {
            match self.peek() {
                Some(d @ b'0'..=b'9') => {
                    value = value * 10 + i64::from(d - b'0');
                    self.i += 1;
                }
                _ => break,
            }
        }
        (self.i - start >= min).then_some(value)
    }

    fn skip_digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        self.i - start
    }

    /// The zone designator as an offset east of UTC in seconds.
    fn zone(&mut self) -> Option<i64> {
        let rest = self.b.get(self.i..)?;
        if rest == b"UTC" {
            self.i += 3;
            return Some(0);
        }
        let sign = match self.next()? {
            b'Z' | b'z' => return Some(0),
            b'+' => 1,
            b'-' => -1,
            _ => return None,
        };
        let hours = self.number(2, 2)?;
        let minutes = if self.peek() == Some(b':') {
            self.i += 1;
            self.number(2, 2)?
        } else if self.peek().is_some() {
            self.number(2, 2)?
        } else {
            0
        };
        if hours > 23 || minutes > 59 {
            return None;
        }
        Some(sign * (hours * 3600 + minutes * 60))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    // resque-protocol.md §13 item 21
    #[test]
    fn failed_at_uses_slashes_and_utc() {
        assert_eq!(failed_at(at(1_795_263_504)), "2026/11/21 12:18:24 UTC");
        assert_eq!(failed_at(at(0)), "1970/01/01 00:00:00 UTC");
    }

    // resque-protocol.md §13 item 15
    #[test]
    fn run_at_is_iso8601_with_z() {
        assert_eq!(run_at(at(1_795_263_509)), "2026-11-21T12:18:29Z");
        assert_eq!(run_at(at(951_782_400)), "2000-02-29T00:00:00Z");
        // The kept text of the last second is handed out only within that second.
        assert_eq!(run_at(at(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(run_at(at(951_782_401)), "2000-02-29T00:00:01Z");
    }

    // resque-protocol.md §13 item 12
    #[test]
    fn started_at_is_ruby_time_to_s() {
        assert_eq!(started_at(at(1_795_263_509)), "2026-11-21 12:18:29 +0000");
    }

    // resque-protocol.md §13 item 12
    #[test]
    fn heartbeat_has_numeric_offset_and_no_fraction() {
        assert_eq!(heartbeat(1_795_263_509), "2026-11-21T12:18:29+00:00");
        assert_eq!(heartbeat(0), "1970-01-01T00:00:00+00:00");
    }

    #[test]
    fn civil_conversion_handles_leap_days_and_far_dates() {
        let c = civil_from_epoch(951_782_400);
        assert_eq!(
            (c.year, c.month, c.day, c.hour, c.minute, c.second),
            (2000, 2, 29, 0, 0, 0)
        );
        // 2100 is not a leap year: 2100-02-28 23:59:59 is followed by 2100-03-01.
        assert_eq!(heartbeat(4_107_542_399), "2100-02-28T23:59:59+00:00");
        assert_eq!(heartbeat(4_107_542_400), "2100-03-01T00:00:00+00:00");
        assert_eq!(heartbeat(253_402_300_799), "9999-12-31T23:59:59+00:00");
        assert_eq!(heartbeat(253_402_300_800), "10000-01-01T00:00:00+00:00");
        let before = civil_from_epoch(-1);
        assert_eq!(
            (before.year, before.month, before.day, before.hour),
            (1969, 12, 31, 23)
        );
        // Extremes do not overflow.
        let _ = civil_from_epoch(i64::MIN);
        let _ = civil_from_epoch(i64::MAX);
        let _ = heartbeat(u64::MAX);
    }

    #[test]
    fn days_round_trip_through_civil() {
        for days in (-800_000..800_000).step_by(97) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn times_before_the_epoch_round_down() {
        let t = UNIX_EPOCH - Duration::from_millis(500);
        assert_eq!(epoch_secs(t), -1);
        assert_eq!(run_at(t), "1969-12-31T23:59:59Z");
        assert_eq!(epoch_secs(UNIX_EPOCH - Duration::from_secs(2)), -2);
        assert_eq!(epoch_secs(at(5) + Duration::from_millis(999)), 5);
    }

    // resque-protocol.md §13 item 13
    #[test]
    fn heartbeat_round_trips_through_parse() {
        for secs in [
            0,
            951_782_400,
            1_795_263_509,
            4_107_542_400,
            253_402_300_800,
        ] {
            assert_eq!(parse_heartbeat(&heartbeat(secs)), Some(secs), "{secs}");
        }
    }

    // resque-protocol.md §4: Ruby Time.parse of other writers' heartbeats
    #[test]
    fn parse_applies_offsets_and_fractions() {
        let base = 1_795_263_509;
        assert_eq!(parse_heartbeat("2026-11-21T12:18:29Z"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21T13:18:29+01:00"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21T07:18:29-05:00"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21T17:48:29+05:30"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21T13:18:29+0100"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21T13:18:29+01"), Some(base));
        assert_eq!(
            parse_heartbeat("2026-11-21T12:18:29.987654321Z"),
            Some(base)
        );
        assert_eq!(parse_heartbeat("2026-11-21 12:18:29 +0000"), Some(base));
        assert_eq!(parse_heartbeat("2026-11-21 12:18:29 UTC"), Some(base));
        assert_eq!(parse_heartbeat(" 2026-11-21t12:18:29z\n"), Some(base));
        // Crossing midnight and a month end through the offset.
        assert_eq!(
            parse_heartbeat("2026-12-01T01:00:00+02:00"),
            parse_heartbeat("2026-11-30T23:00:00Z")
        );
        // A leap second rolls over.
        assert_eq!(parse_heartbeat("2026-11-21T12:18:60Z"), Some(base + 31));
    }

    #[test]
    fn parse_rejects_garbage_without_panicking() {
        for bad in [
            "",
            "garbage",
            "2026-11-21",
            "2026-11-21T12:18:29",
            "2026-11-21T12:18:29+",
            "2026-11-21T12:18:29+1",
            "2026-11-21T12:18:29+01:0",
            "2026-11-21T12:18:29+24:00",
            "2026-11-21T12:18:29.Z",
            "2026-11-21T12:18:29Zjunk",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-21T24:00:00Z",
            "2026-11-21T12:60:00Z",
            "1969-12-31T23:59:59Z",
            "1970-01-01T00:30:00+01:00",
            "2026-11-21T12:18:29+00:00é",
            "é026-11-21T12:18:29Z",
            "1700000000",
            "2026/11/21 12:18:24 UTC",
        ] {
            assert_eq!(parse_heartbeat(bad), None, "{bad:?}");
        }
        assert_eq!(parse_heartbeat("2024-02-29T00:00:00Z"), Some(1_709_164_800));
    }
}
