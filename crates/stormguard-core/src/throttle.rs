//! gRPC retry throttling (gRFC A6 `retryThrottling`), exactly as specified.
//!
//! A budget counts requests over a time window; A6's throttle counts outcomes instead and
//! needs no clock at all. Each client keeps a `token_count` per server, starting full at
//! `maxTokens`:
//!
//! - every failed attempt takes one token away (never below zero);
//! - every successful attempt gives `tokenRatio` back (never above `maxTokens`);
//! - a retry (or a hedged attempt) is allowed only while `token_count > maxTokens / 2`.
//!
//! So when more than about `tokenRatio / (1 + tokenRatio)` of attempts fail for long
//! enough, the count sinks to half and the client stops retrying until successes refill
//! it. `maxTokens` must be in `(0, 1000]` and `tokenRatio` greater than zero; both are kept
//! to three decimal places, as A6 says ("3 decimal places are supported; additional
//! precision is ignored").
//!
//! The count is one atomic integer of thousandths of a token, changed by
//! compare-and-swap, so a throttle is shared between threads and requests by `Clone`
//! without a lock.
//!
//! ```
//! use stormguard_core::throttle::RetryThrottle;
//!
//! // A6's example: maxTokens 10, tokenRatio 0.1.
//! let throttle = RetryThrottle::builder().max_tokens(10.0).token_ratio(0.1).build()?;
//! assert!(throttle.allows_retry());
//! for _ in 0..5 {
//!     throttle.record_failure();
//! }
//! // 5 tokens left: not more than half of 10, so no more retries...
//! assert!(!throttle.allows_retry());
//! // ...until successes bring it back above 5 (one success adds 0.1).
//! throttle.record_success();
//! assert!(throttle.allows_retry());
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::ConfigError;

/// Thousandths of a token in one token.
const MILLI: u32 = 1000;
/// The largest `maxTokens` A6 allows.
const MAX_TOKENS: f64 = 1000.0;

/// gRFC A6 retry throttling: a token count that failures drain and successes refill,
/// allowing retries only while it is above half of `max_tokens`.
///
/// There are no defaults in A6 (throttling is off unless the service config sets it);
/// the builder starts from A6's example, `maxTokens` 10 and `tokenRatio` 0.1.
///
/// # Clone
///
/// Clones share one count (an `Arc`): A6 keeps one throttle per server, shared by every
/// method and every request of the channel.
#[derive(Clone)]
pub struct RetryThrottle {
    state: Arc<State>,
}

struct State {
    /// Thousandths of a token, in `0..=max`.
    tokens: AtomicU32,
    max: u32,
    ratio: u32,
}

impl RetryThrottle {
    /// A builder with A6's example settings: `max_tokens` 10, `token_ratio` 0.1.
    pub fn builder() -> RetryThrottleBuilder {
        RetryThrottleBuilder::default()
    }

    /// Records a failed attempt: the count loses one token, down to zero.
    pub fn record_failure(&self) {
        self.update(|t| t.saturating_sub(MILLI));
    }

    /// Records a successful attempt: the count gains `token_ratio`, up to `max_tokens`.
    pub fn record_success(&self) {
        let (max, ratio) = (self.state.max, self.state.ratio);
        self.update(|t| t.saturating_add(ratio).min(max));
    }

    /// Whether a retry may be made now: `token_count > max_tokens / 2`.
    pub fn allows_retry(&self) -> bool {
        // Compared doubled, so that an odd number of thousandths is not rounded.
        u64::from(self.state.tokens.load(Ordering::Acquire)) * 2 > u64::from(self.state.max)
    }

    /// The current count, in tokens (to three decimal places).
    pub fn tokens(&self) -> f64 {
        f64::from(self.state.tokens.load(Ordering::Acquire)) / f64::from(MILLI)
    }

    /// `maxTokens`, as kept (three decimal places).
    pub fn max_tokens(&self) -> f64 {
        f64::from(self.state.max) / f64::from(MILLI)
    }

    /// `tokenRatio`, as kept (three decimal places).
    pub fn token_ratio(&self) -> f64 {
        f64::from(self.state.ratio) / f64::from(MILLI)
    }

    fn update(&self, f: impl Fn(u32) -> u32) {
        // The closure never returns None, so this cannot fail; the result is ignored.
        let _ = self
            .state
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| Some(f(t)));
    }
}

impl fmt::Debug for RetryThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryThrottle")
            .field("tokens", &self.tokens())
            .field("max_tokens", &self.max_tokens())
            .field("token_ratio", &self.token_ratio())
            .finish()
    }
}

/// Builds a [`RetryThrottle`]; see its docs for the rules.
#[derive(Debug, Clone)]
pub struct RetryThrottleBuilder {
    max_tokens: f64,
    token_ratio: f64,
}

impl Default for RetryThrottleBuilder {
    fn default() -> Self {
        RetryThrottleBuilder {
            max_tokens: 10.0,
            token_ratio: 0.1,
        }
    }
}

impl RetryThrottleBuilder {
    /// A6 `maxTokens`: the count's ceiling and starting value, in `(0, 1000]`, kept to
    /// three decimal places \[10\].
    pub fn max_tokens(mut self, max_tokens: f64) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    /// A6 `tokenRatio`: tokens a success gives back, greater than zero, kept to three
    /// decimal places (so at least 0.001) \[0.1\].
    pub fn token_ratio(mut self, token_ratio: f64) -> Self {
        self.token_ratio = token_ratio;
        self
    }

    /// Checks the settings and makes the throttle, full.
    pub fn build(self) -> Result<RetryThrottle, ConfigError> {
        let max = milli(self.max_tokens)
            .filter(|m| *m > 0 && self.max_tokens <= MAX_TOKENS)
            .ok_or_else(|| {
                ConfigError::invalid(
                    "max_tokens",
                    self.max_tokens,
                    "greater than 0 (at least 0.001) and at most 1000",
                )
            })?;
        let ratio = milli(self.token_ratio)
            .filter(|r| *r > 0 && self.token_ratio <= MAX_TOKENS)
            .ok_or_else(|| {
                ConfigError::invalid(
                    "token_ratio",
                    self.token_ratio,
                    "at least 0.001 and at most 1000",
                )
            })?;
        Ok(RetryThrottle {
            state: Arc::new(State {
                tokens: AtomicU32::new(max),
                max,
                ratio,
            }),
        })
    }
}

/// `value` in thousandths, truncated (A6 ignores precision past three decimals); `None`
/// for NaN, negatives and values too large to be valid.
fn milli(value: f64) -> Option<u32> {
    if !(0.0..=MAX_TOKENS).contains(&value) {
        return None;
    }
    // In range and not NaN: at most 1,000,000, which fits. Add a hair so that 0.1,
    // stored as 0.09999999999999999..., is 100 thousandths and not 99.
    Some(((value * f64::from(MILLI)) + 1e-9).floor() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle(max: f64, ratio: f64) -> RetryThrottle {
        RetryThrottle::builder()
            .max_tokens(max)
            .token_ratio(ratio)
            .build()
            .expect("valid throttle")
    }

    #[test]
    fn debug_shows_the_count_and_the_settings() {
        assert_eq!(
            format!("{:?}", throttle(10.0, 0.1)),
            "RetryThrottle { tokens: 10.0, max_tokens: 10.0, token_ratio: 0.1 }"
        );
    }

    #[test]
    fn starts_full_and_stops_at_half() {
        let t = throttle(10.0, 0.1);
        assert_eq!(t.tokens(), 10.0);
        for expected in [9.0, 8.0, 7.0, 6.0] {
            t.record_failure();
            assert_eq!(t.tokens(), expected);
            assert!(t.allows_retry(), "{expected} > 5");
        }
        t.record_failure();
        assert_eq!(t.tokens(), 5.0);
        assert!(!t.allows_retry(), "exactly half is not above half");
    }

    #[test]
    fn floor_is_zero_and_ceiling_is_max_tokens() {
        let t = throttle(3.0, 0.5);
        for _ in 0..10 {
            t.record_failure();
        }
        assert_eq!(t.tokens(), 0.0);
        for _ in 0..100 {
            t.record_success();
        }
        assert_eq!(t.tokens(), 3.0);
    }

    #[test]
    fn successes_refill_by_the_ratio() {
        let t = throttle(10.0, 0.1);
        for _ in 0..5 {
            t.record_failure();
        }
        assert!(!t.allows_retry());
        t.record_success();
        assert_eq!(t.tokens(), 5.1);
        assert!(t.allows_retry());
        // Ten successes are exactly one token: no drift from 0.1 in binary.
        for _ in 0..10 {
            t.record_success();
        }
        assert_eq!(t.tokens(), 6.1);
    }

    #[test]
    fn odd_thousandths_are_compared_exactly() {
        // max 0.003: half is 0.0015; 0.002 is above it, 0.001 is not.
        let t = throttle(0.003, 0.001);
        assert!(t.allows_retry());
        t.record_failure();
        assert_eq!(t.tokens(), 0.0);
        t.record_success();
        t.record_success();
        assert!(t.allows_retry(), "0.002 > 0.0015");
        t.record_failure();
        t.record_success();
        assert!(!t.allows_retry(), "0.001 <= 0.0015");
    }

    #[test]
    fn three_decimal_places_are_kept_and_more_ignored() {
        let t = throttle(7.12345, 0.0019);
        assert_eq!(t.max_tokens(), 7.123);
        assert_eq!(t.token_ratio(), 0.001);
    }

    #[test]
    fn clones_share_one_count() {
        let a = throttle(2.0, 1.0);
        let b = a.clone();
        a.record_failure();
        assert!(!b.allows_retry());
        b.record_success();
        assert!(a.allows_retry());
    }

    #[test]
    fn rejects_values_outside_a6_ranges() {
        for bad in [0.0, -1.0, 0.0004, 1000.5, f64::NAN, f64::INFINITY] {
            let err = RetryThrottle::builder()
                .max_tokens(bad)
                .build()
                .unwrap_err();
            assert_eq!(err.field(), "max_tokens", "{bad}");
        }
        let err = RetryThrottle::builder()
            .max_tokens(0.0)
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid max_tokens: 0.0 (allowed: greater than 0 (at least 0.001) and at most 1000)"
        );
        for bad in [0.0, -0.1, 0.0009, f64::NAN] {
            let err = RetryThrottle::builder()
                .token_ratio(bad)
                .build()
                .unwrap_err();
            assert_eq!(err.field(), "token_ratio", "{bad}");
        }
        assert!(RetryThrottle::builder().max_tokens(1000.0).build().is_ok());
        assert!(RetryThrottle::builder().max_tokens(0.001).build().is_ok());
    }

    #[test]
    fn concurrent_updates_are_not_lost() {
        let t = throttle(1000.0, 1.0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        t.record_failure();
                    }
                });
            }
        });
        assert_eq!(t.tokens(), 600.0);
    }
}
