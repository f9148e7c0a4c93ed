//! How long to wait before the next attempt.
//!
//! Fixed-interval retries stay in lockstep: everything that failed at the same moment
//! retries at the same moment, so load arrives in spikes exactly while the dependency
//! is trying to recover. Exponential backoff spreads attempts apart in time; jitter
//! spreads them apart from each other. Without the random part, exponential backoff
//! only rebuilds the thundering herd with longer gaps between stampedes.
//!
//! The ceiling for retry `n` (0 is the first retry) is `min(cap, base * 2^n)`, computed
//! with saturating arithmetic so that `n = u32::MAX` gives `cap`; another growth factor
//! than 2 can be set ([`Backoff::with_multiplier`], gRFC A6's `backoffMultiplier`). Each [`Jitter`] draws
//! the actual delay under that ceiling:
//!
//! | jitter | delay for retry `n` |
//! |---|---|
//! | [`Full`](Jitter::Full) (default) | `U[0, ceiling(n))`, the spread AWS measured as doing the least work |
//! | [`Equal`](Jitter::Equal) | `ceiling(n)/2 + U[0, ceiling(n)/2)`, never much shorter than the exponential |
//! | [`Decorrelated`](Jitter::Decorrelated) | `U[base, min(cap, 3 * previous)]`, starting from `previous = base` |
//! | [`None`](Jitter::None) | `ceiling(n)`, for tests and for dependencies with a fixed rate limit |
//!
//! Every delay is at most `cap`. Each request draws from its own random stream
//! ([`Backoff::schedule`]), so two requests that failed together do not retry together.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use crate::ConfigError;

/// How the delay is spread under the exponential ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Jitter {
    /// No randomness: the delay is the ceiling itself.
    None,
    /// `U[0, ceiling)`: the default.
    #[default]
    Full,
    /// `ceiling/2 + U[0, ceiling/2)`.
    Equal,
    /// `U[base, min(cap, 3 * previous delay)]`.
    Decorrelated,
}

/// Exponential backoff with jitter: a base, a cap and a [`Jitter`].
///
/// `Backoff::default()` is 200 ms base, 20 s cap, full jitter.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::{Backoff, Jitter};
///
/// let backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(20), Jitter::Full)?;
/// assert_eq!(backoff.ceiling(0), Duration::from_millis(200));
/// assert_eq!(backoff.ceiling(3), Duration::from_millis(1600));
/// assert_eq!(backoff.ceiling(u32::MAX), Duration::from_secs(20));
///
/// let delays: Vec<Duration> = backoff.schedule_seeded(42).take(3).collect();
/// assert!(delays.iter().zip(0..).all(|(d, n)| *d < backoff.ceiling(n)));
/// # Ok::<(), stormguard_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    /// The growth factor in thousandths (2000 is doubling).
    multiplier_milli: u32,
}

/// Doubling, in thousandths.
const DOUBLING: u32 = 2000;

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(200),
            cap: Duration::from_secs(20),
            jitter: Jitter::Full,
            multiplier_milli: DOUBLING,
        }
    }
}

/// The largest cap: delays are drawn in nanoseconds as `u64` (about 584 years).
const MAX_CAP: Duration = Duration::from_nanos(u64::MAX);

impl Backoff {
    /// A backoff starting at `base` and never exceeding `cap`.
    ///
    /// Fails when `base` is zero or `cap` is below `base` or above `u64::MAX`
    /// nanoseconds.
    pub fn new(base: Duration, cap: Duration, jitter: Jitter) -> Result<Self, ConfigError> {
        if base.is_zero() {
            return Err(ConfigError::invalid(
                "backoff base",
                base,
                "greater than zero",
            ));
        }
        if cap < base {
            return Err(ConfigError::invalid(
                "backoff cap",
                cap,
                format!("at least the base, {base:?}"),
            ));
        }
        if cap > MAX_CAP {
            return Err(ConfigError::invalid(
                "backoff cap",
                cap,
                format!("at most {MAX_CAP:?} (2^64 - 1 ns)"),
            ));
        }
        Ok(Backoff {
            base,
            cap,
            jitter,
            multiplier_milli: DOUBLING,
        })
    }

    /// This backoff with ceilings growing by `multiplier` per retry instead of doubling:
    /// `min(cap, base * multiplier^n)`, gRFC A6's `backoffMultiplier`. Kept to three
    /// decimal places, from 0.001 to 1000 \[2\]; below 1 the ceilings shrink towards zero.
    /// [`Jitter::Decorrelated`] does not use it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard_core::{Backoff, Jitter};
    ///
    /// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), Jitter::None)?
    ///     .with_multiplier(1.5)?;
    /// assert_eq!(backoff.ceiling(2), Duration::from_millis(225));
    /// assert_eq!(backoff.ceiling(100), Duration::from_secs(1));
    /// # Ok::<(), stormguard_core::ConfigError>(())
    /// ```
    pub fn with_multiplier(mut self, multiplier: f64) -> Result<Self, ConfigError> {
        if !(0.001..=1000.0).contains(&multiplier) {
            return Err(ConfigError::invalid(
                "backoff multiplier",
                multiplier,
                "from 0.001 to 1000",
            ));
        }
        // In range, so the product fits; the hair keeps 1.1 (1.0999...) at 1100.
        self.multiplier_milli = (multiplier * 1000.0 + 1e-9).floor() as u32;
        Ok(self)
    }

    /// The growth factor of the ceilings per retry \[2\].
    pub fn multiplier(&self) -> f64 {
        f64::from(self.multiplier_milli) / 1000.0
    }

    /// The delay before the first retry, before jitter.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The longest delay this backoff ever gives.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The jitter in use.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// `min(cap, base * 2^retry)` (or the [multiplier](Self::with_multiplier)'s power),
    /// where retry 0 is the first retry. Never overflows.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let cap = self.cap.as_nanos();
        if self.multiplier_milli != DOUBLING {
            let factor = self.multiplier().powf(f64::from(retry));
            let grown = self.base.as_nanos() as f64 * factor;
            // NaN cannot arise (both factors are positive); infinity saturates to cap,
            // and a shrinking ceiling stops at 1 ns so that a delay can still be drawn.
            return nanos((grown.min(cap as f64) as u128).clamp(1, cap));
        }
        let grown = 1u128
            .checked_shl(retry)
            .and_then(|factor| self.base.as_nanos().checked_mul(factor))
            .unwrap_or(cap);
        nanos(grown.min(cap))
    }

    /// The delay for retry `retry`, given the delay drawn before it (`base` for the
    /// first retry; only [`Jitter::Decorrelated`] uses it), drawing from `rng`.
    pub fn delay<R: rand::Rng + ?Sized>(
        &self,
        retry: u32,
        previous: Duration,
        rng: &mut R,
    ) -> Duration {
        let ceiling = nanos_u64(self.ceiling(retry));
        match self.jitter {
            Jitter::None => nanos(ceiling.into()),
            Jitter::Full => nanos(rng.random_range(0..ceiling).into()),
            Jitter::Equal => {
                let half = ceiling / 2;
                nanos((half + rng.random_range(0..ceiling - half)).into())
            }
            Jitter::Decorrelated => {
                let base = nanos_u64(self.base);
                let upper = nanos_u64(previous)
                    .max(base)
                    .saturating_mul(3)
                    .min(nanos_u64(self.cap));
                nanos(rng.random_range(base..=upper).into())
            }
        }
    }

    /// The delays of one request, drawn from a fresh random stream of its own.
    ///
    /// Two schedules never share a sequence, so requests that failed together spread
    /// out. The iterator never ends; bound it with the attempt limit.
    pub fn schedule(&self) -> Schedule {
        self.schedule_from(SmallRng::from_rng(&mut rand::rng()))
    }

    /// The delays of one request, from a stream determined by `seed` (for tests and
    /// simulations that must be reproducible).
    pub fn schedule_seeded(&self, seed: u64) -> Schedule {
        self.schedule_from(SmallRng::seed_from_u64(seed))
    }

    fn schedule_from(&self, rng: SmallRng) -> Schedule {
        Schedule {
            backoff: *self,
            retry: 0,
            previous: self.base,
            rng,
        }
    }
}

fn nanos(n: u128) -> Duration {
    let secs = n / 1_000_000_000;
    let sub = (n % 1_000_000_000) as u32;
    Duration::new(u64::try_from(secs).unwrap_or(u64::MAX), sub)
}

fn nanos_u64(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The delays before each retry of one request: an endless iterator.
///
/// Made by [`Backoff::schedule`] or [`Backoff::schedule_seeded`].
#[derive(Debug, Clone)]
pub struct Schedule {
    backoff: Backoff,
    retry: u32,
    previous: Duration,
    rng: SmallRng,
}

impl Schedule {
    /// How many delays have been drawn so far.
    pub fn retries(&self) -> u32 {
        self.retry
    }

    /// Starts the delays over from the first ceiling, keeping the random stream.
    ///
    /// gRFC A6: after a wait the server chose (`grpc-retry-pushback-ms`), "retry delay
    /// will reset to initial backoff".
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard_core::{Backoff, Jitter};
    ///
    /// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10), Jitter::None)?;
    /// let mut schedule = backoff.schedule_seeded(1);
    /// assert_eq!(schedule.next(), Some(Duration::from_millis(100)));
    /// assert_eq!(schedule.next(), Some(Duration::from_millis(200)));
    /// schedule.restart();
    /// assert_eq!(schedule.next(), Some(Duration::from_millis(100)));
    /// # Ok::<(), stormguard_core::ConfigError>(())
    /// ```
    pub fn restart(&mut self) {
        self.retry = 0;
        self.previous = self.backoff.base;
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.backoff.delay(self.retry, self.previous, &mut self.rng);
        self.retry = self.retry.saturating_add(1);
        self.previous = delay;
        Some(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    fn backoff(jitter: Jitter) -> Backoff {
        Backoff::new(200 * MS, 20_000 * MS, jitter).expect("valid backoff")
    }

    #[test]
    fn a_multiplier_grows_or_shrinks_the_ceilings_and_is_read_back_exactly() {
        let b = Backoff::new(100 * MS, 1_000 * MS, Jitter::None).expect("valid backoff");
        let grown = b.with_multiplier(1.5).expect("in range");
        assert_eq!(grown.multiplier(), 1.5);
        assert_eq!(
            [0, 1, 2, 100].map(|r| grown.ceiling(r)),
            [100 * MS, 150 * MS, 225 * MS, 1_000 * MS]
        );
        let shrunk = b.with_multiplier(0.5).expect("in range");
        assert_eq!(
            [0, 1, 2].map(|r| shrunk.ceiling(r)),
            [100 * MS, 50 * MS, 25 * MS]
        );
        // A shrinking ceiling stops at 1 ns, so that a delay can still be drawn.
        assert_eq!(shrunk.ceiling(1_000), Duration::from_nanos(1));
        // Both ends of the range, and decimals that binary floats hold just below.
        for m in [0.001, 1.1, 0.29, 1000.0] {
            assert_eq!(b.with_multiplier(m).expect("in range").multiplier(), m);
        }
        for m in [0.0, 0.000_9, 1000.5, -2.0, f64::NAN, f64::INFINITY] {
            assert!(b.with_multiplier(m).is_err(), "{m} accepted");
        }
        assert_eq!(b.multiplier(), 2.0, "doubling by default");
    }

    #[test]
    fn equal_jitter_draws_from_half_the_ceiling_to_the_ceiling() {
        let b = Backoff::new(1_000 * MS, 1_000 * MS, Jitter::Equal).expect("valid backoff");
        let delays: Vec<Duration> = b.schedule_seeded(7).take(1_000).collect();
        let (low, high) = (delays.iter().min(), delays.iter().max());
        assert!(
            low.is_some_and(|d| *d >= 500 * MS && *d < 550 * MS),
            "{low:?}"
        );
        assert!(
            high.is_some_and(|d| *d < 1_000 * MS && *d > 950 * MS),
            "{high:?}"
        );
    }

    #[test]
    fn a_schedule_counts_its_delays_and_restarts_from_the_first_ceiling() {
        let b = Backoff::new(100 * MS, 10_000 * MS, Jitter::None).expect("valid backoff");
        let mut schedule = b.schedule_seeded(1);
        assert_eq!(schedule.retries(), 0);
        let drawn: Vec<Duration> = schedule.by_ref().take(3).collect();
        assert_eq!(drawn, [100 * MS, 200 * MS, 400 * MS]);
        assert_eq!(schedule.retries(), 3);
        schedule.restart();
        assert_eq!(schedule.retries(), 0);
        assert_eq!(schedule.next(), Some(100 * MS));
    }

    #[test]
    fn defaults() {
        let b = Backoff::default();
        assert_eq!(
            (b.base(), b.cap(), b.jitter()),
            (200 * MS, 20_000 * MS, Jitter::Full)
        );
    }

    #[test]
    fn ceiling_doubles_then_caps() {
        let b = backoff(Jitter::None);
        let ceilings: Vec<_> = (0..9).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(
            ceilings,
            [200, 400, 800, 1600, 3200, 6400, 12800, 20000, 20000]
        );
        for n in [64, 127, 128, 10_000, u32::MAX] {
            assert_eq!(b.ceiling(n), 20_000 * MS);
        }
        // The largest base and cap allowed: base * 2^n overflows u128 nanoseconds for
        // large n, and the ceiling must still be the cap.
        let huge = Backoff::new(MAX_CAP, MAX_CAP, Jitter::Full).expect("largest backoff");
        for n in [0, 1, 63, 64, 100, u32::MAX] {
            assert_eq!(huge.ceiling(n), MAX_CAP);
        }
        let wide = Backoff::new(Duration::from_nanos(1), MAX_CAP, Jitter::Full).expect("wide");
        assert_eq!(wide.ceiling(10), Duration::from_nanos(1024));
        assert_eq!(wide.ceiling(63), Duration::from_nanos(1 << 63));
        assert_eq!(wide.ceiling(64), MAX_CAP);
        assert!(wide
            .schedule_seeded(1)
            .nth(200)
            .is_some_and(|d| d < MAX_CAP));
    }

    #[test]
    fn no_jitter_is_the_ceiling() {
        let delays: Vec<_> = backoff(Jitter::None).schedule().take(4).collect();
        assert_eq!(delays, [200 * MS, 400 * MS, 800 * MS, 1600 * MS]);
    }

    #[test]
    fn rejects_bad_configuration() {
        let err = Backoff::new(Duration::ZERO, MS, Jitter::Full).unwrap_err();
        assert_eq!(err.field(), "backoff base");
        assert_eq!(
            err.to_string(),
            "invalid backoff base: 0ns (allowed: greater than zero)"
        );
        let err = Backoff::new(2 * MS, MS, Jitter::Full).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid backoff cap: 1ms (allowed: at least the base, 2ms)"
        );
        let err = Backoff::new(MS, Duration::MAX, Jitter::Full).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        assert!(Backoff::new(MS, MS, Jitter::Full).is_ok());
    }

    #[test]
    fn seeded_schedules_repeat_and_unseeded_ones_differ() {
        let b = backoff(Jitter::Full);
        let a: Vec<_> = b.schedule_seeded(7).take(8).collect();
        assert_eq!(a, b.schedule_seeded(7).take(8).collect::<Vec<_>>());
        assert_ne!(a, b.schedule_seeded(8).take(8).collect::<Vec<_>>());
        // Independent streams: 8 draws at 20 s resolution in ns never collide by chance.
        let x: Vec<_> = b.schedule().skip(6).take(8).collect();
        let y: Vec<_> = b.schedule().skip(6).take(8).collect();
        assert_ne!(x, y);
    }

    #[test]
    fn full_jitter_spreads_over_the_whole_range() {
        // Of 10,000 first retries, each tenth of [0, 200 ms) gets roughly a tenth.
        let b = backoff(Jitter::Full);
        let mut deciles = [0u32; 10];
        for seed in 0..10_000 {
            let d = b.schedule_seeded(seed).next().unwrap_or_default();
            deciles[(d.as_nanos() * 10 / (200 * MS).as_nanos()) as usize] += 1;
        }
        assert!(
            deciles.iter().all(|n| (850..1150).contains(n)),
            "{deciles:?}"
        );
    }

    #[test]
    fn decorrelated_grows_from_the_previous_delay() {
        let b = backoff(Jitter::Decorrelated);
        let mut previous = b.base();
        for d in b.schedule_seeded(3).take(50) {
            assert!(
                d >= b.base() && d <= (previous * 3).min(b.cap()),
                "{d:?} after {previous:?}"
            );
            previous = d;
        }
    }

    fn any_jitter() -> impl Strategy<Value = Jitter> {
        prop_oneof![
            Just(Jitter::None),
            Just(Jitter::Full),
            Just(Jitter::Equal),
            Just(Jitter::Decorrelated)
        ]
    }

    proptest! {
        #[test]
        fn every_delay_is_within_its_jitter_bounds(
            base_ns in 1u64..=1_000_000_000_000,
            cap_factor in 1u64..=1_000_000,
            retry in any::<u32>(),
            previous_ns in any::<u64>(),
            jitter in any_jitter(),
            seed in any::<u64>(),
        ) {
            let base = Duration::from_nanos(base_ns);
            let cap = Duration::from_nanos(base_ns.saturating_mul(cap_factor));
            let b = Backoff::new(base, cap, jitter).expect("valid");
            let ceiling = b.ceiling(retry);
            prop_assert!(ceiling >= base && ceiling <= cap);
            let previous = Duration::from_nanos(previous_ns);
            let mut rng = SmallRng::seed_from_u64(seed);
            let d = b.delay(retry, previous, &mut rng);
            prop_assert!(d <= cap);
            match jitter {
                Jitter::None => prop_assert_eq!(d, ceiling),
                Jitter::Full => prop_assert!(d < ceiling),
                Jitter::Equal => prop_assert!(d >= ceiling / 2 && d < ceiling),
                Jitter::Decorrelated => {
                    prop_assert!(d >= base && d <= previous.max(base).saturating_mul(3).min(cap))
                }
            }
        }
    }
}
