//! How fast a retry budget's balance may be spent.
//!
//! A budget that has saved 10% of ten healthy seconds holds a second's worth of
//! traffic in retries, and at the onset of an outage nothing stops the clients from
//! spending it in a few hundred milliseconds: twice or three times the offered load,
//! just as the dependency falls over. The pace is a token bucket in front of the
//! budget: it refills at `ratio` times the recent rate of original requests (measured
//! by the budget's own deposit buckets) and holds at most a tenth of a second of that,
//! so retries never exceed that share of the request rate for long, whatever the
//! balance. The token is taken when the retry is decided, before its backoff: a burst
//! of failures beyond what the bucket holds has its excess refused, not delayed.
//!
//! The state is one `AtomicU64` (milliseconds since the budget's origin in the high 40
//! bits, the balance in hundredths of a retry in the low 24), changed by a
//! compare-and-swap on the retry path only: original requests never touch it.

use std::sync::atomic::Ordering;

use crate::sync::AtomicU64;

/// Hundredths of a retry in one retry.
const CENTI: u64 = 100;
const TOKEN_BITS: u32 = 24;
const TOKEN_MAX: u64 = (1 << TOKEN_BITS) - 1;
const TIME_MASK: u64 = (1 << (64 - TOKEN_BITS)) - 1;
/// How much of the refill rate the bucket holds: 100 ms of it.
const BURST_MS: u64 = 100;
/// The least it holds: one request's two retries, however slow the refill.
const MIN_BURST: u64 = 2 * CENTI;

/// A token bucket refilled at a rate the caller passes in at each take.
#[derive(Debug)]
pub(crate) struct Pace {
    word: AtomicU64,
}

impl Pace {
    /// A bucket holding the least burst, last refilled at time 0.
    pub(crate) fn new() -> Self {
        Pace {
            word: AtomicU64::new(MIN_BURST),
        }
    }

    /// Takes one retry at `now_ms` (milliseconds since the budget's origin) if the
    /// bucket, refilled at `per_sec` retries a second since its last take, holds one.
    /// The bucket holds at most 100 ms of `per_sec`, and never less than two retries.
    pub(crate) fn try_take(&self, now_ms: u64, per_sec: f64) -> bool {
        let cap = ((per_sec * BURST_MS as f64 / 1000.0 * CENTI as f64) as u64)
            .clamp(MIN_BURST, TOKEN_MAX);
        let now = now_ms & TIME_MASK;
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            let (then, tokens) = (word >> TOKEN_BITS, word & TOKEN_MAX);
            // Time moves forward only; a wrap (34 years) or an older `now` refills nothing.
            let elapsed = now.wrapping_sub(then) & TIME_MASK;
            let elapsed = if elapsed > TIME_MASK / 2 { 0 } else { elapsed };
            let refill = (per_sec * elapsed as f64 / 1000.0 * CENTI as f64) as u64;
            let tokens = tokens.saturating_add(refill).min(cap);
            if tokens < CENTI {
                return false;
            }
            // Keep the stamp when no whole hundredth was added, so that frequent takes
            // at a slow rate still accumulate their refill.
            let stamp = if refill == 0 { then } else { now.max(then) };
            let next = (stamp << TOKEN_BITS) | (tokens - CENTI);
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => word = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn takes(pace: &Pace, now_ms: u64, per_sec: f64) -> usize {
        (0..10_000)
            .take_while(|_| pace.try_take(now_ms, per_sec))
            .count()
    }

    #[test]
    fn holds_a_tenth_of_a_second_and_refills_at_the_rate() {
        let pace = Pace::new();
        // 100 retries/s: after a long quiet, ten at once, then one every 10 ms.
        assert_eq!(takes(&pace, 60_000, 100.0), 10);
        assert_eq!(takes(&pace, 60_005, 100.0), 0);
        assert_eq!(takes(&pace, 60_010, 100.0), 1);
        assert_eq!(takes(&pace, 60_050, 100.0), 4);
        // Over one second, a hundred and no more (plus the burst it started with).
        let pace = Pace::new();
        let granted: usize = (0..=1000).map(|ms| takes(&pace, 5_000 + ms, 100.0)).sum();
        assert!((100..=111).contains(&granted), "{granted}");
    }

    #[test]
    fn slow_rates_still_accumulate_and_never_hold_less_than_two() {
        let pace = Pace::new();
        assert_eq!(takes(&pace, 0, 0.1), 2);
        // 0.1/s: one retry every ten seconds, even when asked every millisecond.
        let granted: usize = (1..=20_000).map(|ms| takes(&pace, ms, 0.1)).sum();
        assert_eq!(granted, 2);
        // After a long quiet, two again: one request's worth.
        assert_eq!(takes(&pace, 100_000, 0.1), 2);
        // No rate at all: nothing after the first two.
        let pace = Pace::new();
        assert_eq!(takes(&pace, 0, 0.0), 2);
        assert_eq!(takes(&pace, 1_000_000, 0.0), 0);
    }

    #[test]
    fn time_going_backwards_refills_nothing() {
        let pace = Pace::new();
        assert_eq!(takes(&pace, 10_000, 10.0), 2);
        assert_eq!(takes(&pace, 5_000, 10.0), 0);
        assert_eq!(takes(&pace, 10_100, 10.0), 1);
    }

    #[test]
    fn huge_rates_saturate() {
        let pace = Pace::new();
        let granted = (0..1_000_000)
            .take_while(|_| pace.try_take(1_000, 1e12))
            .count();
        assert_eq!(granted, (TOKEN_MAX / CENTI) as usize);
    }
}
