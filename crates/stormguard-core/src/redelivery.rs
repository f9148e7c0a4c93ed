//! What a queue consumer tells its broker after handling one delivery.
//!
//! A worker that sleeps through its backoff holds the message's lease, a thread and a
//! connection for the whole wait, and a crash loses the wait. A queue consumer does
//! better to let the broker hold the backoff: hand the message back with a delay (a NATS
//! JetStream `Nak` with a delay, an SQS visibility timeout) and take the next one. The
//! broker counts the deliveries, so the delivery count is the attempt number, and the
//! broker's maximum deliveries bounds the attempts without a counter of the worker's.
//! The stormguard crate re-exports this module as `stormguard::redelivery`.
//!
//! [`Redelivery::decide`] turns the [`Class`] of the handler's outcome and the
//! message's delivery count into a [`Decision`]:
//!
//! | outcome | decision |
//! |---|---|
//! | [`Class::Success`] | [`Decision::Ack`] |
//! | [`Class::Permanent`], [`Class::DontRetry`] | [`Decision::DeadLetter`] at once, with the [`Reason`] |
//! | [`Class::Retryable`], delivery `n` < max deliveries | [`Decision::RetryAfter`] the backoff's delay for retry `n - 1`, never shorter than a server's `after` |
//! | [`Class::Retryable`], delivery `n` >= max deliveries | [`Decision::DeadLetter`] ([`Reason::Exhausted`]) |
//!
//! With the default full jitter the delay after delivery `n` is drawn from
//! `U[0, min(cap, base * 2^(n-1)))`. The decision is pure: the randomness comes in as an
//! `rng` ([`Redelivery::decide`]) or a seed ([`Redelivery::decide_seeded`], for example the
//! message's stream sequence, so a run can be replayed exactly). Nothing here sleeps,
//! reads a clock or talks to a broker.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::redelivery::{Decision, Reason, Redelivery};
//! use stormguard_core::{Backoff, Class, Jitter};
//!
//! fn main() -> Result<(), stormguard_core::ConfigError> {
//!     // The defaults, the same as `Redelivery::default()`.
//!     let redelivery = Redelivery::builder()
//!         // Full jitter under min(cap, base * 2^(n-1)) after the n-th delivery: under 400 ms
//!         // after the second, doubling up to 20 s. The broker holds the wait, so a larger
//!         // base or cap costs the worker nothing: raise them when the failures you
//!         // redeliver for outlast those waits.
//!         .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(20), Jitter::Full)?)
//!         // The first delivery included; set the consumer's max_deliver from
//!         // redelivery.max_deliveries(). More deliveries ride out a longer failure before
//!         // a message is dead-lettered.
//!         .max_deliveries(5)
//!         .build()?;
//!     // Per message: the outcome, the delivery count from the broker, a seed (its sequence).
//!     match redelivery.decide_seeded(Class::Retryable { after: None }, 2, 42) {
//!         Decision::Ack => { /* ack */ }
//!         Decision::RetryAfter(delay) => assert!(delay < Duration::from_millis(400)), // Nak(delay)
//!         Decision::DeadLetter(reason) => println!("dead-letter: {reason}"), // publish, then Term
//!     }
//!
//!     assert_eq!(redelivery.decide_seeded(Class::Success, 1, 7), Decision::Ack);
//!     assert_eq!(
//!         redelivery.decide_seeded(Class::Retryable { after: None }, 5, 7),
//!         Decision::DeadLetter(Reason::Exhausted { deliveries: 5 })
//!     );
//!     assert_eq!(
//!         redelivery.decide_seeded(Class::Permanent, 1, 7),
//!         Decision::DeadLetter(Reason::Permanent)
//!     );
//!     Ok(())
//! }
//! ```
//!
//! # With NATS JetStream
//!
//! `examples/nats_worker` in the repository runs it against NATS JetStream (`nats-server`
//! from the distribution's packages; the example starts its own on 127.0.0.1 and stops
//! it): a work-queue stream, a pull consumer with `max_deliver` from the same limit, `Nak`
//! with the core's delay for transient failures, and a dead-letter stream that gets
//! permanent failures with the reason in headers
//! (`Stormguard-Dead-Letter-Reason: permanent`,
//! `Stormguard-Dead-Letter-Detail: permanent failure: 400 Bad Request`) before the message
//! is terminated. `cargo run --example nats_worker` runs a mix of good jobs, permanently
//! bad ones and ones that fail a few times before they succeed, and prints how many were
//! acked, dead-lettered, lost or processed twice.
//!
//! `tests/nats.rs`, also in the repository (ignored unless asked for:
//! `cargo test --all-features --test nats -- --ignored`), runs the same worker against a
//! real server and checks each job's deliveries, the dead-letter stream's contents, and
//! that every redelivery came no sooner than the delay asked for and under the jitter
//! ceiling (on the worker's clock: JetStream's message info carries the publish time, not
//! the delivery time). `examples/queue_redelivery` shows the same decisions on an
//! in-memory stand-in with SQS-like whole-second delays.

use std::fmt;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::{Backoff, Class, ConfigError, Jitter};

/// What to tell the broker about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Done: acknowledge the message so it is never delivered again.
    Ack,
    /// Hand the message back; the broker delivers it again after this delay.
    RetryAfter(Duration),
    /// Publish the message to the dead-letter queue with this reason, then acknowledge
    /// (or terminate) it so the broker stops delivering it.
    DeadLetter(Reason),
}

/// Why a message was dead-lettered.
///
/// [`Display`](fmt::Display) gives a sentence for a person;
/// [`as_str`](Reason::as_str) a short stable token for a header or a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The handler's failure will repeat on every delivery ([`Class::Permanent`]).
    Permanent,
    /// The downstream asked not to be retried ([`Class::DontRetry`]).
    DontRetry,
    /// Still failing on the last delivery allowed.
    Exhausted {
        /// The deliveries made, the last one included.
        deliveries: u32,
    },
}

impl Reason {
    /// A short stable token: `permanent`, `dont-retry` or `exhausted`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Permanent => "permanent",
            Reason::DontRetry => "dont-retry",
            Reason::Exhausted { .. } => "exhausted",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Permanent => f.write_str("permanent failure"),
            Reason::DontRetry => f.write_str("the downstream asked not to be retried"),
            Reason::Exhausted { deliveries } => {
                write!(f, "still failing after {deliveries} deliveries")
            }
        }
    }
}

/// Redelivery decisions for a queue consumer: a [`Backoff`] and a maximum number of
/// deliveries.
///
/// `Redelivery::default()` is the default [`Backoff`] (200 ms base, 20 s cap, full
/// jitter), 5 deliveries and no rounding. Configure the broker's own limit (JetStream's
/// `max_deliver`, SQS's `maxReceiveCount`) from
/// [`max_deliveries`](Redelivery::max_deliveries) so the two agree; the broker's limit is
/// then only a backstop, since the worker dead-letters on the last delivery itself.
///
/// `Copy` and immutable: share it by copying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redelivery {
    backoff: Backoff,
    max_deliveries: u32,
    resolution: Duration,
}

impl Default for Redelivery {
    fn default() -> Self {
        Redelivery {
            backoff: Backoff::default(),
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            resolution: Duration::from_nanos(1),
        }
    }
}

const DEFAULT_MAX_DELIVERIES: u32 = 5;

impl Redelivery {
    /// A builder starting from the defaults.
    pub fn builder() -> RedeliveryBuilder {
        RedeliveryBuilder {
            config: Redelivery::default(),
        }
    }

    /// The backoff the delays are drawn from.
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// The deliveries allowed, the first one included. Default 5.
    pub fn max_deliveries(&self) -> u32 {
        self.max_deliveries
    }

    /// Delays are rounded up to a whole multiple of this. Default 1 ns (no rounding).
    pub fn resolution(&self) -> Duration {
        self.resolution
    }

    /// The decision for a delivery whose handler's outcome was `class`, the
    /// `delivery_count`-th delivery of the message (1 is the first; 0 is read as 1),
    /// drawing the jitter from `rng`.
    pub fn decide<R: rand::Rng + ?Sized>(
        &self,
        class: Class,
        delivery_count: u32,
        rng: &mut R,
    ) -> Decision {
        let delivery_count = delivery_count.max(1);
        match class {
            Class::Success => Decision::Ack,
            Class::Permanent => Decision::DeadLetter(Reason::Permanent),
            Class::DontRetry => Decision::DeadLetter(Reason::DontRetry),
            Class::Retryable { .. } if delivery_count >= self.max_deliveries => {
                Decision::DeadLetter(Reason::Exhausted {
                    deliveries: delivery_count,
                })
            }
            Class::Retryable { after } => {
                // `previous` only matters to decorrelated jitter, which the builder refuses.
                let retry = delivery_count - 1;
                let drawn = self.backoff.delay(retry, self.backoff.base(), rng);
                let delay = drawn.max(after.unwrap_or_default());
                Decision::RetryAfter(round_up(delay, self.resolution))
            }
        }
    }

    /// [`decide`](Self::decide) with the jitter drawn from a stream determined by `seed`
    /// and the delivery count.
    ///
    /// Pass something that identifies the message (its stream sequence, a hash of its
    /// id): each message then gets its own delays, each delivery a fresh draw, and a run
    /// can be replayed exactly.
    pub fn decide_seeded(&self, class: Class, delivery_count: u32, seed: u64) -> Decision {
        // Mix the delivery count in so that one message's successive draws are
        // independent of each other, not the same fraction of a doubling ceiling.
        let mixed = seed ^ u64::from(delivery_count).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.decide(class, delivery_count, &mut SmallRng::seed_from_u64(mixed))
    }

    /// The largest delay [`decide`](Self::decide) can give after delivery
    /// `delivery_count` when the outcome carries no `after` hint: the backoff's ceiling
    /// for retry `delivery_count - 1`, rounded up to the resolution. Full jitter draws
    /// strictly below it (before rounding).
    pub fn ceiling(&self, delivery_count: u32) -> Duration {
        let retry = delivery_count.max(1) - 1;
        round_up(self.backoff.ceiling(retry), self.resolution)
    }
}

/// `delay` rounded up to a whole multiple of `resolution` (nonzero), saturating.
fn round_up(delay: Duration, resolution: Duration) -> Duration {
    let step = resolution.as_nanos().max(1);
    let steps = delay.as_nanos().div_ceil(step);
    let nanos = steps.saturating_mul(step);
    let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
    Duration::new(secs, (nanos % 1_000_000_000) as u32)
}

/// Builds a [`Redelivery`]; made by [`Redelivery::builder`].
#[derive(Debug, Clone)]
pub struct RedeliveryBuilder {
    config: Redelivery,
}

impl RedeliveryBuilder {
    /// The backoff the delays are drawn from. Default [`Backoff::default()`].
    ///
    /// Any [`Jitter`] but [`Jitter::Decorrelated`], which grows from the previous delay,
    /// and a broker does not tell the consumer what that was.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.config.backoff = backoff;
        self
    }

    /// The deliveries allowed, the first one included: at least 1. Default 5.
    pub fn max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.config.max_deliveries = max_deliveries;
        self
    }

    /// Round every delay up to a whole multiple of `resolution`, for brokers that count
    /// delays in coarse units (SQS visibility timeouts are whole seconds), so the
    /// message never comes back sooner than the backoff asked. Nonzero. Default 1 ns.
    pub fn resolution(mut self, resolution: Duration) -> Self {
        self.config.resolution = resolution;
        self
    }

    /// The configuration, or a [`ConfigError`] naming the first invalid setting.
    pub fn build(self) -> Result<Redelivery, ConfigError> {
        let config = self.config;
        if config.max_deliveries == 0 {
            return Err(ConfigError::invalid(
                "max_deliveries",
                config.max_deliveries,
                "at least 1 (the first delivery counts)",
            ));
        }
        if config.backoff.jitter() == Jitter::Decorrelated {
            return Err(ConfigError::invalid(
                "redelivery backoff jitter",
                config.backoff.jitter(),
                "None, Full or Equal (decorrelated jitter needs the previous delay, which a broker does not report)",
            ));
        }
        if config.resolution.is_zero() {
            return Err(ConfigError::invalid(
                "redelivery resolution",
                config.resolution,
                "greater than zero",
            ));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);
    const RETRY: Class = Class::Retryable { after: None };

    fn redelivery(jitter: Jitter, max: u32) -> Redelivery {
        let backoff = Backoff::new(100 * MS, 1_000 * MS, jitter).expect("valid backoff");
        Redelivery::builder()
            .backoff(backoff)
            .max_deliveries(max)
            .build()
            .expect("valid redelivery")
    }

    #[test]
    fn defaults() {
        let r = Redelivery::default();
        assert_eq!(
            r,
            Redelivery::builder().build().expect("defaults are valid")
        );
        assert_eq!(r.backoff(), Backoff::default());
        assert_eq!(r.max_deliveries(), 5);
        assert_eq!(r.resolution(), Duration::from_nanos(1));
    }

    #[test]
    fn success_acks_and_permanent_failures_dead_letter_at_once() {
        let r = redelivery(Jitter::Full, 5);
        for count in [0, 1, 4, 5, 6, u32::MAX] {
            assert_eq!(r.decide_seeded(Class::Success, count, 1), Decision::Ack);
            assert_eq!(
                r.decide_seeded(Class::Permanent, count, 1),
                Decision::DeadLetter(Reason::Permanent)
            );
            assert_eq!(
                r.decide_seeded(Class::DontRetry, count, 1),
                Decision::DeadLetter(Reason::DontRetry)
            );
        }
    }

    #[test]
    fn transient_failures_back_off_by_delivery_count_until_the_last_delivery() {
        let r = redelivery(Jitter::None, 5);
        let decisions: Vec<_> = (1..=6).map(|n| r.decide_seeded(RETRY, n, 9)).collect();
        assert_eq!(
            decisions,
            [
                Decision::RetryAfter(100 * MS),
                Decision::RetryAfter(200 * MS),
                Decision::RetryAfter(400 * MS),
                Decision::RetryAfter(800 * MS),
                Decision::DeadLetter(Reason::Exhausted { deliveries: 5 }),
                Decision::DeadLetter(Reason::Exhausted { deliveries: 6 }),
            ]
        );
        // Delivery 0 (a broker that counts from zero, or garbage) is the first.
        assert_eq!(r.decide_seeded(RETRY, 0, 9), Decision::RetryAfter(100 * MS));
        // One delivery allowed: nothing is ever handed back.
        let once = redelivery(Jitter::Full, 1);
        assert_eq!(
            once.decide_seeded(RETRY, 1, 9),
            Decision::DeadLetter(Reason::Exhausted { deliveries: 1 })
        );
        // Huge counts under a huge limit: capped, no overflow.
        let many = redelivery(Jitter::None, u32::MAX);
        assert_eq!(
            many.decide_seeded(RETRY, u32::MAX - 1, 9),
            Decision::RetryAfter(1_000 * MS)
        );
    }

    #[test]
    fn a_server_hint_is_a_floor() {
        let r = redelivery(Jitter::Full, 5);
        let hinted = Class::Retryable {
            after: Some(Duration::from_secs(30)),
        };
        assert_eq!(
            r.decide_seeded(hinted, 1, 3),
            Decision::RetryAfter(Duration::from_secs(30))
        );
    }

    #[test]
    fn seeded_decisions_repeat_and_differ_between_messages_and_deliveries() {
        let r = redelivery(Jitter::Full, u32::MAX);
        let delays = |seed: u64| -> Vec<Decision> {
            (1..=12).map(|n| r.decide_seeded(RETRY, n, seed)).collect()
        };
        assert_eq!(delays(42), delays(42));
        assert_ne!(delays(42), delays(43));
        // Past the cap every ceiling is the same 1 s: the draws must still differ.
        let capped: Vec<_> = (6..=12).map(|n| r.decide_seeded(RETRY, n, 42)).collect();
        assert!(capped.windows(2).all(|w| w[0] != w[1]), "{capped:?}");
    }

    #[test]
    fn full_jitter_covers_the_range_under_the_ceiling() {
        // 2,000 messages' second delivery: every delay under 200 ms, each fifth of the
        // range hit roughly a fifth of the time.
        let r = redelivery(Jitter::Full, 5);
        let mut fifths = [0u32; 5];
        for seed in 0..2_000 {
            match r.decide_seeded(RETRY, 2, seed) {
                Decision::RetryAfter(d) => {
                    assert!(d < r.ceiling(2), "{d:?}");
                    fifths[(d.as_nanos() * 5 / r.ceiling(2).as_nanos()) as usize] += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(fifths.iter().all(|n| (340..460).contains(n)), "{fifths:?}");
    }

    #[test]
    fn resolution_rounds_up_never_down() {
        let backoff = Backoff::new(
            Duration::from_secs(2),
            Duration::from_secs(900),
            Jitter::Full,
        )
        .expect("valid");
        let r = Redelivery::builder()
            .backoff(backoff)
            .resolution(Duration::from_secs(1))
            .build()
            .expect("valid");
        for seed in 0..200 {
            let Decision::RetryAfter(d) = r.decide_seeded(RETRY, 3, seed) else {
                panic!("retry expected");
            };
            assert_eq!(d.subsec_nanos(), 0, "{d:?}");
            assert!(d <= r.ceiling(3) && r.ceiling(3) == Duration::from_secs(8));
        }
        assert_eq!(
            round_up(Duration::from_nanos(1), Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            round_up(Duration::ZERO, Duration::from_secs(1)),
            Duration::ZERO
        );
        assert_eq!(
            round_up(Duration::MAX, Duration::from_secs(7)).as_secs(),
            u64::MAX
        );
    }

    #[test]
    fn rejects_bad_configuration() {
        let err = Redelivery::builder().max_deliveries(0).build().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid max_deliveries: 0 (allowed: at least 1 (the first delivery counts))"
        );
        let decorrelated =
            Backoff::new(MS, Duration::from_secs(1), Jitter::Decorrelated).expect("valid");
        let err = Redelivery::builder()
            .backoff(decorrelated)
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "redelivery backoff jitter");
        assert!(err.to_string().contains("Decorrelated"), "{err}");
        let err = Redelivery::builder()
            .resolution(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid redelivery resolution: 0ns (allowed: greater than zero)"
        );
    }

    fn any_class() -> impl Strategy<Value = Class> {
        prop_oneof![
            Just(Class::Success),
            Just(Class::Permanent),
            Just(Class::DontRetry),
            Just(RETRY),
            (0u64..100_000).prop_map(|ms| Class::Retryable {
                after: Some(Duration::from_millis(ms))
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_decision_follows_the_table(
            class in any_class(),
            count in any::<u32>(),
            max in 1u32..=20,
            seed in any::<u64>(),
        ) {
            let r = redelivery(Jitter::Full, max);
            let decision = r.decide_seeded(class, count, seed);
            match (class, decision) {
                (Class::Success, Decision::Ack) => {}
                (Class::Permanent, Decision::DeadLetter(Reason::Permanent)) => {}
                (Class::DontRetry, Decision::DeadLetter(Reason::DontRetry)) => {}
                (Class::Retryable { .. }, Decision::DeadLetter(Reason::Exhausted { deliveries })) => {
                    prop_assert!(count.max(1) >= max);
                    prop_assert_eq!(deliveries, count.max(1));
                }
                (Class::Retryable { after }, Decision::RetryAfter(delay)) => {
                    prop_assert!(count.max(1) < max);
                    let floor = after.unwrap_or_default();
                    prop_assert!(delay >= floor);
                    prop_assert!(delay == floor || delay < r.ceiling(count));
                }
                (class, decision) => prop_assert!(false, "{:?} gave {:?}", class, decision),
            }
        }
    }
}
