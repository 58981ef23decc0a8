//! Time, injected: the admission logic never reads a clock itself.
//!
//! A [`Timestamp`] is microseconds since the UNIX epoch (UTC). Calendar budgets are computed
//! from it, so a clock must be a wall clock, not a monotonic one.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds since the UNIX epoch, UTC.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The timestamp `micros` microseconds after the epoch.
    pub const fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// Microseconds since the epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// This instant plus `d` (saturating).
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(
            self.0
                .saturating_add(d.as_micros().min(u64::MAX as u128) as u64),
        )
    }

    /// RFC 3339 text in UTC with second precision, e.g. `2026-05-22T15:00:00Z` (its
    /// [`Display`](fmt::Display)).
    pub fn to_rfc3339(self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Timestamp {
    /// RFC 3339 in UTC with second precision, written digit by digit (a refusal's body
    /// carries one: no formatting machinery, no allocation).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0 / 1_000_000;
        let (days, rem) = (secs / 86_400, secs % 86_400);
        let (y, m, d) = civil_from_days(days as i64);
        let (h, min, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
        if y > 9999 {
            return write!(f, "{y}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}Z");
        }
        let mut text = *b"0000-00-00T00:00:00Z";
        let fields = [(0..4, y as u64), (5..7, m.into()), (8..10, d.into())];
        for (at, n) in fields
            .into_iter()
            .chain([(11..13, h), (14..16, min), (17..19, s)])
        {
            decimal(&mut text[at], n);
        }
        f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
    }
}

/// Writes `n` in decimal into `digits`, zero-padded on the left (its low digits if longer).
fn decimal(digits: &mut [u8], mut n: u64) {
    for b in digits.iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day). H. Hinnant's algorithm;
/// the Redis script carries the same arithmetic.
pub(crate) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) to days since 1970-01-01.
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A source of the current time.
///
/// Implemented by [`SystemClock`] for production and [`ManualClock`] for tests and
/// simulations. Create a clock once and share it: clocks are cheap to clone.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system wall clock.
///
/// The process reads the wall clock at most once every [`SystemClock::RESYNC`] and counts the
/// time in between on a monotonic clock, which is cheaper to read. With the `quanta` feature
/// (off by default: it adds five crates to the build) that is the CPU's time-stamp counter,
/// calibrated against the operating system's monotonic clock once per process (well under a
/// millisecond, at the first read): a read costs a few nanoseconds instead of a system clock
/// call. Without it, std's `Instant`. Every thread counts from the same reading of the wall
/// clock, so two threads reading at the same moment read the same time. A step of the wall
/// clock (set by hand, or a large correction) shows within [`SystemClock::RESYNC`]. On this
/// crate's hot path the clock is read once a decision.
#[derive(Copy, Clone, Debug, Default)]
pub struct SystemClock;

impl SystemClock {
    /// How long the process counts on the monotonic clock before it reads the wall clock
    /// again.
    pub const RESYNC: Duration = Duration::from_secs(1);
}

/// The monotonic clock counted between reads of the wall clock, and the time it was first read.
/// With `quanta`, the time-stamp counter read raw and scaled by its calibration (no check of a
/// per-thread mock clock, as `quanta::Instant::now` makes); without, std's `Instant`.
#[cfg(feature = "quanta")]
struct Mono {
    clock: quanta::Clock,
    /// The counter's reading when the clock was first read.
    base: u64,
    /// Microseconds per count, times 2⁴⁰ (the counter's calibration, taken once).
    scale: u64,
}
#[cfg(not(feature = "quanta"))]
struct Mono(std::time::Instant);

impl Mono {
    #[cfg(feature = "quanta")]
    fn start() -> Self {
        let clock = quanta::Clock::new();
        let scale = clock.delta_as_nanos(0, 1 << 40) / 1_000;
        let base = clock.raw();
        Mono { clock, base, scale }
    }

    #[cfg(not(feature = "quanta"))]
    fn start() -> Self {
        Mono(std::time::Instant::now())
    }

    /// Microseconds since the clock was first read.
    #[cfg(feature = "quanta")]
    #[inline]
    fn micros(&self) -> u64 {
        let counts = self.clock.raw().saturating_sub(self.base);
        ((u128::from(counts) * u128::from(self.scale)) >> 40) as u64
    }

    /// Microseconds since the clock was first read.
    #[cfg(not(feature = "quanta"))]
    #[inline]
    fn micros(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }
}

/// The process's count of the wall clock: the wall clock's time minus the monotonic clock's
/// (µs since the process's first read) at the last reading of the wall clock, and the
/// monotonic time at which to read it again. On cache lines of its own: read by every
/// decision, written once a second.
#[repr(align(128))]
struct Anchor {
    base: std::sync::OnceLock<Mono>,
    offset: AtomicU64,
    next: AtomicU64,
}

static ANCHOR: Anchor = Anchor {
    base: std::sync::OnceLock::new(),
    offset: AtomicU64::new(0),
    next: AtomicU64::new(0),
};

/// The wall clock's time at monotonic time `mono` (µs), counted from the last reading
/// (`offset`), or `None` when it is time to read the wall clock again (`next`).
#[inline]
fn counted(mono: u64, offset: u64, next: u64) -> Option<u64> {
    (mono < next && offset != 0).then(|| mono.saturating_add(offset))
}

fn wall_micros() -> u64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    d.as_secs()
        .saturating_mul(1_000_000)
        .saturating_add(u64::from(d.subsec_micros()))
}

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let mono = ANCHOR.base.get_or_init(Mono::start).micros();
        let a = &ANCHOR;
        if let Some(t) = counted(mono, a.offset.load(Relaxed), a.next.load(Relaxed)) {
            return Timestamp(t);
        }
        // Time to read the wall clock (threads that race here each store a reading; any of
        // them is right).
        let wall = wall_micros();
        a.offset.store(wall.saturating_sub(mono).max(1), Relaxed);
        a.next.store(
            mono.saturating_add(Self::RESYNC.as_micros() as u64),
            Relaxed,
        );
        Timestamp(wall)
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tower_fairshare::{Clock, ManualClock, Timestamp};
///
/// let clock = ManualClock::new(Timestamp::from_micros(0));
/// let other = clock.clone();
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(other.now(), Timestamp::from_micros(2_000_000));
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            micros: Arc::new(AtomicU64::new(start.0)),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.micros
            .fetch_add(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `t` (it may go backwards; the stores tolerate that).
    pub fn set(&self, t: Timestamp) {
        self.micros.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.micros.load(Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Written digit by digit, an instant reads as the formatted fields do: every second
        /// from 1970 to past the year 10,000 (where the year takes five digits).
        #[test]
        fn rfc3339_text_is_the_formatted_fields(secs in 0u64..400_000_000_000) {
            let t = Timestamp(secs * 1_000_000 + secs % 1_000_000);
            let (y, m, d) = civil_from_days((secs / 86_400) as i64);
            let rem = secs % 86_400;
            let (h, min, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
            let formatted = format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}Z");
            proptest::prop_assert_eq!(t.to_rfc3339(), formatted);
        }
    }

    #[test]
    fn rfc3339_text_of_known_instants() {
        assert_eq!(Timestamp(0).to_rfc3339(), "1970-01-01T00:00:00Z");
        let t = Timestamp(1_779_462_000_999_999);
        assert_eq!(t.to_string(), "2026-05-22T15:00:00Z");
    }

    #[test]
    fn the_system_clock_counts_from_the_wall_clock_and_reads_it_again_each_second() {
        assert_eq!(counted(5, 1_000, 10), Some(1_005));
        assert_eq!(counted(10, 1_000, 10), None, "time to read the wall clock");
        assert_eq!(counted(5, 0, 10), None, "never read yet");
        // And what it reads is the wall clock's time, on every thread.
        let check = || {
            for _ in 0..1_000 {
                let before = wall_micros();
                let t = SystemClock.now().as_micros();
                let after = wall_micros();
                assert!(
                    t + 1_000 >= before && t <= after + 1_000,
                    "{before} {t} {after}"
                );
            }
        };
        std::thread::scope(|s| {
            s.spawn(check);
            s.spawn(check);
        });
    }

    /// The monotonic count runs at the operating system's rate (with `quanta`: the counter's
    /// scale is right). A real clock can only be checked against real time: this one spins
    /// for 20 ms of std's monotonic clock and compares.
    #[test]
    fn the_monotonic_count_runs_at_the_system_clocks_rate() {
        let mono = Mono::start();
        // Both clocks read together: a pair the thread was descheduled in the middle of is
        // read again.
        let pair = || loop {
            let (before, m, after) = (
                std::time::Instant::now(),
                mono.micros(),
                std::time::Instant::now(),
            );
            if after - before < Duration::from_micros(20) {
                return (before, m);
            }
        };
        let (start, a) = pair();
        while start.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let (end, b) = pair();
        let (counted, real) = ((b - a) as f64, (end - start).as_micros() as f64);
        assert!(
            (counted - real).abs() <= real * 0.02 + 50.0,
            "counted {counted} µs while {real} µs passed"
        );
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(Timestamp(0).to_rfc3339(), "1970-01-01T00:00:00Z");
        // 2026-05-22T15:00:00Z
        let days = days_from_civil(2026, 5, 22);
        let t = Timestamp(((days * 86_400 + 15 * 3600) as u64) * 1_000_000);
        assert_eq!(t.to_rfc3339(), "2026-05-22T15:00:00Z");
    }

    #[test]
    fn civil_round_trips_over_centuries() {
        for z in (-800_000i64..800_000).step_by(37) {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
    }
}
