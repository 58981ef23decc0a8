//! Durations written in policy files (`"1m"`, `"30s"`) and calendar budget periods.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

use crate::clock::{civil_from_days, days_from_civil, Timestamp};

/// A length of time written as a whole number and a unit: `500ms`, `30s`, `1m`, `1h`, `1d`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Period {
    micros: u64,
}

impl Period {
    /// Parses `"<number><unit>"` with unit `ms`, `s`, `m`, `h` or `d`.
    pub fn parse(text: &str) -> Result<Period, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let hint = || {
            format!("`{text}` is not a period: write a whole number and a unit (ms, s, m, h, d), e.g. \"1m\" or \"30s\"")
        };
        let scale: u64 = match unit.trim() {
            "ms" => 1_000,
            "s" | "sec" => 1_000_000,
            "m" | "min" => 60_000_000,
            "h" => 3_600_000_000,
            "d" => 86_400_000_000,
            _ => return Err(hint()),
        };
        let too_long = || {
            let days = u64::MAX / 86_400_000_000;
            format!("`{text}` is too long: a period is at most {days} days")
        };
        let n: u64 = num
            .parse()
            .map_err(|e: std::num::ParseIntError| match e.kind() {
                std::num::IntErrorKind::PosOverflow => too_long(),
                _ => hint(),
            })?;
        if n == 0 {
            return Err(format!(
                "`{text}` is zero: a period must be longer than nothing"
            ));
        }
        let micros = n.checked_mul(scale).ok_or_else(too_long)?;
        Ok(Period { micros })
    }

    /// A period of `micros` microseconds. Panics on zero.
    pub const fn from_micros(micros: u64) -> Period {
        assert!(micros > 0, "a period must be longer than nothing");
        Period { micros }
    }

    /// Microseconds.
    pub const fn as_micros(self) -> u64 {
        self.micros
    }

    /// As a [`Duration`].
    pub fn as_duration(self) -> Duration {
        Duration::from_micros(self.micros)
    }

    /// Whole seconds, rounded up (at least 1): the `w` of the RateLimit-Policy header.
    pub fn as_secs_ceil(self) -> u64 {
        self.micros.div_ceil(1_000_000).max(1)
    }
}

impl Period {
    /// The largest whole unit it is written in: (count, unit).
    fn parts(self) -> (u64, &'static str) {
        let m = self.micros;
        for (scale, unit) in [
            (86_400_000_000, "d"),
            (3_600_000_000, "h"),
            (60_000_000, "m"),
            (1_000_000, "s"),
            (1_000, "ms"),
        ] {
            if m.is_multiple_of(scale) {
                return (m / scale, unit);
            }
        }
        (m, "us")
    }

    /// As `to_string()`, without the formatting machinery (refusals name their window).
    pub(crate) fn label(self) -> String {
        let (n, unit) = self.parts();
        let mut b = itoa::Buffer::new();
        let n = b.format(n);
        let mut s = String::with_capacity(n.len() + unit.len());
        s.push_str(n);
        s.push_str(unit);
        s
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (n, unit) = self.parts();
        write!(f, "{n}{unit}")
    }
}

/// A UTC calendar window a budget counts over.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPeriod {
    /// From the top of each UTC hour.
    Hour,
    /// From 00:00 UTC each day.
    Day,
    /// From 00:00 UTC on the first of each month.
    Month,
}

impl BudgetPeriod {
    /// Every period, in order: `ALL[p.index()] == p` (for stores that write a period as a
    /// small number).
    pub(crate) const ALL: [BudgetPeriod; 3] =
        [BudgetPeriod::Hour, BudgetPeriod::Day, BudgetPeriod::Month];

    /// The period's place in [`ALL`](Self::ALL).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The name used in refusals and files.
    pub const fn as_str(self) -> &'static str {
        match self {
            BudgetPeriod::Hour => "hour",
            BudgetPeriod::Day => "day",
            BudgetPeriod::Month => "month",
        }
    }

    /// The end of the window that starts at `start` (a window's own start: no division for
    /// hours and days).
    pub(crate) fn end_of(self, start: Timestamp) -> Timestamp {
        match self {
            BudgetPeriod::Hour => Timestamp(start.as_micros() + 3_600_000_000),
            BudgetPeriod::Day => Timestamp(start.as_micros() + 86_400_000_000),
            BudgetPeriod::Month => self.window(start).1,
        }
    }

    /// The window containing `t`: (start, end), end exclusive.
    pub fn window(self, t: Timestamp) -> (Timestamp, Timestamp) {
        const HOUR: u64 = 3_600_000_000;
        const DAY: u64 = 86_400_000_000;
        let us = t.as_micros();
        match self {
            BudgetPeriod::Hour => {
                let s = us - us % HOUR;
                (Timestamp(s), Timestamp(s + HOUR))
            }
            BudgetPeriod::Day => {
                let s = us - us % DAY;
                (Timestamp(s), Timestamp(s + DAY))
            }
            BudgetPeriod::Month => {
                let days = (us / DAY) as i64;
                let (y, m, _) = civil_from_days(days);
                let start = days_from_civil(y, m, 1);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                let end = days_from_civil(ny, nm, 1);
                (Timestamp(start as u64 * DAY), Timestamp(end as u64 * DAY))
            }
        }
    }
}

impl fmt::Display for BudgetPeriod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_periods() {
        assert_eq!(Period::parse("1m").unwrap().as_micros(), 60_000_000);
        assert_eq!(Period::parse("30s").unwrap().as_micros(), 30_000_000);
        assert_eq!(Period::parse("500ms").unwrap().as_micros(), 500_000);
        assert_eq!(Period::parse("1h").unwrap().to_string(), "1h");
        for p in ["1h", "90s", "500ms", "2d", "1m"] {
            let p = Period::parse(p).unwrap();
            assert_eq!(p.label(), p.to_string());
        }
        assert!(Period::parse("1x").unwrap_err().contains("not a period"));
        assert!(Period::parse("0s").unwrap_err().contains("zero"));
        assert!(Period::parse("m").is_err());
        assert!(Period::parse("-1m").is_err());
        // A whole number and a unit, too many of them: said so, not "not a period".
        for long in ["99999999999999d", "99999999999999999999s"] {
            assert!(
                Period::parse(long).unwrap_err().contains("too long"),
                "{long}"
            );
        }
        assert!(Period::parse("99999999999999999999x")
            .unwrap_err()
            .contains("not a period"));
    }

    #[test]
    fn month_windows_follow_the_calendar() {
        let day = 86_400_000_000u64;
        // 2024-02-10 (leap year): window is Feb 1 .. Mar 1 = 29 days.
        let t = Timestamp(days_from_civil(2024, 2, 10) as u64 * day + 5);
        let (s, e) = BudgetPeriod::Month.window(t);
        assert_eq!(s.to_rfc3339(), "2024-02-01T00:00:00Z");
        assert_eq!(e.to_rfc3339(), "2024-03-01T00:00:00Z");
        let (s, e) = BudgetPeriod::Hour.window(Timestamp(3_600_000_000 * 5 + 17));
        assert_eq!((s.0, e.0), (3_600_000_000 * 5, 3_600_000_000 * 6));
        let (s, e) =
            BudgetPeriod::Month.window(Timestamp(days_from_civil(2026, 12, 31) as u64 * day));
        assert_eq!(
            (s.to_rfc3339().as_str(), e.to_rfc3339().as_str()),
            ("2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z")
        );
    }
}
