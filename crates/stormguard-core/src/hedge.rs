//! When to send a hedge: a latency percentile over a rolling window.
//!
//! A hedged request is sent a second time when the first copy has taken longer than
//! most requests do. "Most" is a percentile (the 95th by default) of the latencies of
//! recent successful responses. [`LatencyEstimator`] keeps those latencies and answers
//! [`delay`](LatencyEstimator::delay): the percentile, never below a floor, or `None`
//! while the window holds fewer than `min_samples` latencies (too few to say what is
//! slow, so nothing is hedged yet).
//!
//! # How latencies are kept
//!
//! Two histograms take turns: the window is cut into halves, the current half records
//! and the previous half is still counted, and at each turn the older half is cleared.
//! So the estimate always covers between half a window and a whole window of history,
//! and forgets a slow spell within one window.
//!
//! Each histogram is log-bucketed: microseconds, 8 buckets per power of two (496
//! counters cover every `u64`), so a latency is placed within 12.5% of its value and a
//! percentile is reported as the upper end of its bucket (a hedge is never sent before
//! the percentile, at most 12.5% after it). This is a few lines instead of
//! `hdrhistogram`'s configurable precision and auto-resizing, which a hedge delay does
//! not need, and it keeps the core free of dependencies beyond `http` and `rand`.
//!
//! # Cost
//!
//! [`record`](LatencyEstimator::record) and [`delay`](LatencyEstimator::delay) take one
//! short lock (a `std::sync::Mutex`, uncontended in the common case: a few tens of
//! nanoseconds) and do O(1) work; the percentile itself is recomputed (a scan of 2 x 496
//! counters, about a microsecond) only after every 32 new latencies or when the window
//! turns, and cached in between. Memory is fixed: [`LatencyEstimator::STATE_BYTES`].
//!
//! ```
//! use std::time::{Duration, Instant};
//! use stormguard_core::hedge::LatencyEstimator;
//!
//! let estimator = LatencyEstimator::builder().percentile(0.9).min_samples(10).build()?;
//! let now = Instant::now();
//! assert_eq!(estimator.delay(now), None); // nothing known yet: no hedging
//! for ms in 1..=10 {
//!     estimator.record(Duration::from_millis(ms), now);
//! }
//! let delay = estimator.delay(now).expect("ten samples");
//! assert!(delay >= Duration::from_millis(9) && delay <= Duration::from_millis(9) * 9 / 8);
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::ConfigError;

/// Sub-buckets per power of two, as a power of two: 2^3 = 8, so 12.5% resolution.
const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;
/// Buckets covering every `u64` microsecond value.
const BUCKETS: usize = (SUB + (64 - SUB_BITS as u64) * SUB) as usize;
/// Latencies recorded between two recomputations of the cached percentile.
const REFRESH_EVERY: u32 = 32;

/// The bucket of a value (in microseconds).
fn bucket_of(micros: u64) -> usize {
    if micros < SUB {
        return micros as usize;
    }
    let exp = 63 - micros.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    let sub = (micros >> shift) & (SUB - 1);
    (SUB + u64::from(shift) * SUB + sub) as usize
}

/// The largest value (in microseconds) that falls in `bucket`.
fn bucket_upper(bucket: usize) -> u64 {
    let bucket = bucket as u64;
    if bucket < SUB {
        return bucket;
    }
    let shift = (bucket - SUB) / SUB;
    let sub = (bucket - SUB) % SUB;
    let lower = (SUB + sub) << shift;
    lower.saturating_add((1u64 << shift) - 1)
}

struct Histogram {
    counts: [u32; BUCKETS],
    total: u64,
}

impl Histogram {
    fn new() -> Self {
        Histogram {
            counts: [0; BUCKETS],
            total: 0,
        }
    }

    fn clear(&mut self) {
        if self.total > 0 {
            self.counts = [0; BUCKETS];
            self.total = 0;
        }
    }
}

struct Windows {
    /// The instant epochs are counted from: the first `now` ever seen.
    origin: Option<Instant>,
    /// The newest half-window seen; time never runs backwards here.
    epoch: u64,
    halves: [Histogram; 2],
    /// The percentile of the last computation, and whether it is stale.
    cached: Option<Duration>,
    since_refresh: u32,
    stale: bool,
}

/// Recent successful latencies and the hedge delay they give: a percentile over a
/// rolling window, with a floor and a minimum sample count.
///
/// Defaults (`LatencyEstimator::builder().build()` or `default()`): the 95th
/// percentile, a 10 s window, at least 50 latencies before any delay is given, a 1 ms
/// floor.
///
/// The estimator is `Sync`; share it behind an `Arc` (stormguard's `HedgePolicy` does).
pub struct LatencyEstimator {
    percentile: f64,
    window: Duration,
    half_nanos: u64,
    min_samples: u32,
    floor: Duration,
    state: Mutex<Windows>,
}

impl LatencyEstimator {
    /// The size of one estimator's state in bytes, whatever the request rate.
    pub const STATE_BYTES: usize = std::mem::size_of::<LatencyEstimator>();

    /// A builder with the defaults.
    pub fn builder() -> LatencyEstimatorBuilder {
        LatencyEstimatorBuilder::default()
    }

    /// Records the latency of a successful response that arrived at `now`.
    pub fn record(&self, latency: Duration, now: Instant) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let mut state = self.lock();
        self.advance(&mut state, now);
        let half = (state.epoch % 2) as usize;
        let histogram = &mut state.halves[half];
        let count = &mut histogram.counts[bucket_of(micros)];
        if *count < u32::MAX {
            *count += 1;
            histogram.total += 1;
        }
        state.since_refresh += 1;
        if state.since_refresh >= REFRESH_EVERY {
            state.stale = true;
        }
    }

    /// The hedge delay at `now`: the percentile of the latencies in the window, at
    /// least the floor, or `None` while the window holds fewer than `min_samples`.
    pub fn delay(&self, now: Instant) -> Option<Duration> {
        let mut state = self.lock();
        self.advance(&mut state, now);
        if state.stale || (state.cached.is_none() && state.since_refresh > 0) {
            state.cached = self.compute(&state);
            state.stale = false;
            state.since_refresh = 0;
        }
        state.cached
    }

    /// How many latencies the window holds at `now`.
    pub fn samples(&self, now: Instant) -> u64 {
        let mut state = self.lock();
        self.advance(&mut state, now);
        state.halves[0].total + state.halves[1].total
    }

    /// The percentile the delay is taken at, as a fraction (0.95 is p95).
    pub fn percentile(&self) -> f64 {
        self.percentile
    }

    /// The rolling window latencies are kept for.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Latencies needed in the window before a delay is given.
    pub fn min_samples(&self) -> u32 {
        self.min_samples
    }

    /// The shortest delay given.
    pub fn floor(&self) -> Duration {
        self.floor
    }

    fn lock(&self) -> MutexGuard<'_, Windows> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the window on to `now`: clears the halves that have aged out.
    fn advance(&self, state: &mut Windows, now: Instant) {
        let origin = *state.origin.get_or_insert(now);
        let elapsed = now.checked_duration_since(origin).unwrap_or_default();
        let epoch =
            u64::try_from(elapsed.as_nanos() / u128::from(self.half_nanos)).unwrap_or(u64::MAX);
        if epoch <= state.epoch {
            return;
        }
        if epoch == state.epoch + 1 {
            state.halves[(epoch % 2) as usize].clear();
        } else {
            state.halves[0].clear();
            state.halves[1].clear();
        }
        state.epoch = epoch;
        state.stale = true;
    }

    fn compute(&self, state: &Windows) -> Option<Duration> {
        let [a, b] = &state.halves;
        let total = a.total + b.total;
        if total < u64::from(self.min_samples) || total == 0 {
            return None;
        }
        // The smallest value with at least `percentile` of the samples at or below it.
        let rank = ((self.percentile * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0u64;
        for (bucket, (x, y)) in a.counts.iter().zip(&b.counts).enumerate() {
            seen += u64::from(*x) + u64::from(*y);
            if seen >= rank {
                let delay = Duration::from_micros(bucket_upper(bucket));
                return Some(delay.max(self.floor));
            }
        }
        None
    }
}

impl Default for LatencyEstimator {
    fn default() -> Self {
        LatencyEstimatorBuilder::default().make()
    }
}

impl fmt::Debug for LatencyEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("LatencyEstimator")
            .field("percentile", &self.percentile)
            .field("window", &self.window)
            .field("min_samples", &self.min_samples)
            .field("floor", &self.floor)
            .field("samples", &(state.halves[0].total + state.halves[1].total))
            .field("delay", &state.cached)
            .finish()
    }
}

/// Builds a [`LatencyEstimator`]; every setting has a default.
#[derive(Debug, Clone)]
pub struct LatencyEstimatorBuilder {
    percentile: f64,
    window: Duration,
    min_samples: u32,
    floor: Duration,
}

impl Default for LatencyEstimatorBuilder {
    fn default() -> Self {
        LatencyEstimatorBuilder {
            percentile: 0.95,
            window: Duration::from_secs(10),
            min_samples: 50,
            floor: Duration::from_millis(1),
        }
    }
}

impl LatencyEstimatorBuilder {
    /// The percentile the delay is taken at, as a fraction strictly between 0 and 1
    /// \[0.95\].
    pub fn percentile(mut self, percentile: f64) -> Self {
        self.percentile = percentile;
        self
    }

    /// How long latencies are remembered, from 10 ms to 1 hour \[10 s\]; the estimate
    /// covers between half of it and all of it.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Latencies needed in the window before any delay is given, from 1 to 1,000,000
    /// \[50\].
    pub fn min_samples(mut self, samples: u32) -> Self {
        self.min_samples = samples;
        self
    }

    /// The shortest delay given, at most 1 hour \[1 ms\].
    pub fn floor(mut self, floor: Duration) -> Self {
        self.floor = floor;
        self
    }

    /// Checks the settings and makes the estimator.
    pub fn build(self) -> Result<LatencyEstimator, ConfigError> {
        if !(self.percentile > 0.0 && self.percentile < 1.0) {
            return Err(ConfigError::invalid(
                "hedge percentile",
                self.percentile,
                "greater than 0.0 and less than 1.0 (0.95 is p95)",
            ));
        }
        let hour = Duration::from_secs(3600);
        if self.window < Duration::from_millis(10) || self.window > hour {
            return Err(ConfigError::invalid(
                "hedge window",
                self.window,
                "from 10ms to 1h",
            ));
        }
        if !(1..=1_000_000).contains(&self.min_samples) {
            return Err(ConfigError::invalid(
                "hedge min_samples",
                self.min_samples,
                "from 1 to 1000000",
            ));
        }
        if self.floor > hour {
            return Err(ConfigError::invalid(
                "hedge floor",
                self.floor,
                "at most 1h",
            ));
        }
        Ok(self.make())
    }

    fn make(self) -> LatencyEstimator {
        let half_nanos = u64::try_from((self.window / 2).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        LatencyEstimator {
            percentile: self.percentile,
            window: self.window,
            half_nanos,
            min_samples: self.min_samples,
            floor: self.floor,
            state: Mutex::new(Windows {
                origin: None,
                epoch: 0,
                halves: [Histogram::new(), Histogram::new()],
                cached: None,
                since_refresh: 0,
                stale: false,
            }),
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests take their time zero from the clock
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn buckets_are_ordered_and_tight() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(7), 7);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket_upper(BUCKETS - 1), u64::MAX);
        for b in 1..BUCKETS {
            assert!(bucket_upper(b) > bucket_upper(b - 1), "{b}");
            assert_eq!(bucket_of(bucket_upper(b)), b);
            assert_eq!(bucket_of(bucket_upper(b - 1) + 1), b);
        }
    }

    proptest! {
        #[test]
        fn a_value_is_reported_within_an_eighth(v in any::<u64>()) {
            let upper = bucket_upper(bucket_of(v));
            prop_assert!(upper >= v);
            prop_assert!(upper - v <= v / 8);
        }
    }

    #[test]
    fn no_delay_before_min_samples() {
        let e = LatencyEstimator::builder()
            .min_samples(20)
            .build()
            .expect("valid");
        let now = Instant::now();
        for _ in 0..19 {
            e.record(ms(5), now);
        }
        assert_eq!(e.delay(now), None);
        e.record(ms(5), now);
        let d = e.delay(now).expect("20 samples");
        assert!(d >= ms(5) && d <= ms(5) * 9 / 8, "{d:?}");
    }

    #[test]
    fn percentile_of_a_known_distribution() {
        let e = LatencyEstimator::builder()
            .percentile(0.95)
            .min_samples(1)
            .build()
            .expect("valid");
        let now = Instant::now();
        // 95 fast (3 ms), 5 slow (300 ms): p95 is the slowest fast one.
        for i in 0..100 {
            e.record(if i % 20 == 0 { ms(300) } else { ms(3) }, now);
        }
        let d = e.delay(now).expect("samples");
        assert!(d >= ms(3) && d < ms(4), "{d:?}");
        // Four more slow ones: now more than 5% are slow and p95 is slow.
        for _ in 0..4 {
            e.record(ms(300), now);
        }
        // The cached delay is recomputed only every 32 records.
        let d = e.delay(now).expect("samples");
        assert!(d < ms(4), "cached until refresh: {d:?}");
        for _ in 0..32 {
            e.record(ms(300), now);
        }
        let d = e.delay(now).expect("samples");
        assert!(d >= ms(300) && d <= ms(300) * 9 / 8, "{d:?}");
    }

    #[test]
    fn floor_applies() {
        let e = LatencyEstimator::builder()
            .min_samples(1)
            .floor(ms(10))
            .build()
            .expect("valid");
        let now = Instant::now();
        e.record(Duration::from_micros(100), now);
        assert_eq!(e.delay(now), Some(ms(10)));
    }

    #[test]
    fn old_latencies_leave_the_window() {
        let e = LatencyEstimator::builder()
            .window(Duration::from_secs(10))
            .min_samples(10)
            .build()
            .expect("valid");
        let t0 = Instant::now();
        for _ in 0..10 {
            e.record(ms(200), t0);
        }
        assert!(e.delay(t0).is_some());
        // Still counted during the next half window.
        assert_eq!(e.samples(t0 + Duration::from_secs(9)), 10);
        // Gone once two halves have turned.
        assert_eq!(e.samples(t0 + Duration::from_secs(10)), 0);
        assert_eq!(e.delay(t0 + Duration::from_secs(10)), None);
        // New latencies give a new delay.
        let t1 = t0 + Duration::from_secs(11);
        for _ in 0..10 {
            e.record(ms(2), t1);
        }
        let d = e.delay(t1).expect("fresh samples");
        assert!(d < ms(3), "{d:?}");
        // A clock running backwards is treated as the newest time seen.
        e.record(ms(2), t0);
        assert_eq!(e.samples(t1), 11);
    }

    #[test]
    fn the_settings_and_both_halves_of_the_window_read_back() {
        let e = LatencyEstimator::builder()
            .percentile(0.9)
            .window(Duration::from_secs(2))
            .min_samples(3)
            .floor(ms(5))
            .build()
            .expect("valid");
        assert_eq!(e.percentile(), 0.9);
        assert_eq!(e.window(), Duration::from_secs(2));
        assert_eq!(e.min_samples(), 3);
        assert_eq!(e.floor(), ms(5));
        let t0 = Instant::now();
        e.record(ms(10), t0);
        e.record(ms(20), t0 + Duration::from_secs(1));
        assert_eq!(e.samples(t0 + Duration::from_secs(1)), 2);
        assert_eq!(
            format!("{e:?}"),
            "LatencyEstimator { percentile: 0.9, window: 2s, min_samples: 3, floor: 5ms, \
             samples: 2, delay: None }"
        );
        // Later halves take turns in the same two histograms.
        // At 4 s both halves are stale and emptied; from then on each keeps one.
        for (secs, samples) in [(4, 1), (5, 2), (6, 2)] {
            let at = t0 + Duration::from_secs(secs);
            e.record(ms(30), at);
            assert_eq!(e.samples(at), samples, "at {secs} s");
        }
    }

    #[test]
    fn the_percentile_is_taken_over_both_halves_of_the_window() {
        // 60 latencies of 1 ms in one half-window, 40 of 4 ms in the next: of the 100, the
        // 95th percentile is 4 ms and the 50th 1 ms, in either order of the halves.
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let fed = |percentile: f64, halves: [(u32, Duration); 2]| {
            let e = LatencyEstimator::builder()
                .percentile(percentile)
                .window(Duration::from_secs(2))
                .min_samples(100)
                .floor(Duration::from_micros(1))
                .build()
                .expect("valid");
            for ((n, latency), at) in halves.into_iter().zip([t0, t1]) {
                for _ in 0..n {
                    e.record(latency, at);
                }
            }
            e
        };
        let upper = |micros: u64| Duration::from_micros(bucket_upper(bucket_of(micros)));
        for halves in [[(60, ms(1)), (40, ms(4))], [(40, ms(4)), (60, ms(1))]] {
            let p95 = fed(0.95, halves);
            assert_eq!(p95.samples(t1), 100);
            assert_eq!(p95.delay(t1), Some(upper(4_000)), "{halves:?}");
            assert_eq!(fed(0.5, halves).delay(t1), Some(upper(1_000)), "{halves:?}");
        }
    }

    #[test]
    fn the_window_and_the_floor_are_checked_at_their_edges() {
        let b = LatencyEstimator::builder;
        let hour = Duration::from_secs(3600);
        let tick = Duration::from_nanos(1);
        for ok in [ms(10), hour] {
            assert_eq!(b().window(ok).build().expect("in range").window(), ok);
        }
        for bad in [ms(10) - tick, hour + tick] {
            assert_eq!(b().window(bad).build().unwrap_err().field(), "hedge window");
        }
        assert_eq!(b().floor(hour).build().expect("in range").floor(), hour);
        assert_eq!(
            b().floor(hour + tick).build().unwrap_err().field(),
            "hedge floor"
        );
        assert!(b().min_samples(1_000_000).build().is_ok());
        assert!(b().min_samples(1_000_001).build().is_err());
    }

    #[test]
    fn bad_settings_are_errors() {
        let b = LatencyEstimator::builder;
        for p in [0.0, 1.0, -0.5, f64::NAN, 95.0] {
            let err = b().percentile(p).build().unwrap_err();
            assert_eq!(err.field(), "hedge percentile");
        }
        assert_eq!(
            b().window(ms(1)).build().unwrap_err().field(),
            "hedge window"
        );
        assert_eq!(
            b().min_samples(0).build().unwrap_err().field(),
            "hedge min_samples"
        );
        assert_eq!(
            b().floor(Duration::from_secs(7200))
                .build()
                .unwrap_err()
                .field(),
            "hedge floor"
        );
        assert_eq!(
            b().percentile(2.0).build().unwrap_err().to_string(),
            "invalid hedge percentile: 2.0 (allowed: greater than 0.0 and less than 1.0 (0.95 is p95))"
        );
    }
}
