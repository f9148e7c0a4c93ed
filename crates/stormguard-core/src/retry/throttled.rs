//! The pace of throttled retries: a burst that a rate limiter refused (429,
//! `RESOURCE_EXHAUSTED`) is sent again at the rate the server accepts, not all at once.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::sync::AtomicU64;

/// How long a retry of a throttled call waits at least, when the server said nothing
/// of when to come back: the AWS SDKs' base for throttling errors (a 5xx's is 50 ms
/// there, 200 ms here).
pub const THROTTLE_BASE: Duration = Duration::from_secs(1);

/// A second, in nanoseconds.
const SECOND: u64 = 1_000_000_000;
/// The answers accepted in a second from which their rate paces throttled retries:
/// fewer say too little of the rate (a burst's one accepted call is not a rate of one
/// a second).
pub const KNOWN: u64 = 5;

/// The slots of a dependency's throttled retries, one every `1 / rate` seconds, where
/// the rate is the answers the server accepted in the last whole second: a retry of a
/// 429 waits its `Retry-After` (or [`THROTTLE_BASE`]), spread over up to as much again,
/// and then for the next free slot. Shared by reference; lock-free.
///
/// Why: a rate limiter refuses the calls of a burst at one instant and asks them all
/// to come back after the same `Retry-After`; sent back together, they meet the same
/// limit and are refused again, every attempt spent on nothing (`tests/rate_limited.rs`
/// in the repository shows it against nginx `limit_req`). Spaced at the rate the server
/// accepts, each retry lands on a slot the limiter has.
///
/// ```
/// use std::time::{Duration, Instant};
/// use stormguard_core::retry::ThrottlePace;
///
/// let pace = ThrottlePace::new();
/// let t0 = Instant::now();
/// let ms = Duration::from_millis;
/// // Nothing accepted yet: the rate is not known, a retry goes when it may. (A
/// // throttled retry arms the count of accepted answers.)
/// assert_eq!(pace.slot(t0, t0 + ms(1000)), t0 + ms(1000));
/// // Ten accepted in a second: one retry every 100 ms.
/// for i in 0..10 {
///     pace.accepted(t0 + ms(100 * i));
/// }
/// let t1 = t0 + ms(1000);
/// assert_eq!(pace.slot(t1, t1 + ms(1000)), t1 + ms(1000));
/// assert_eq!(pace.slot(t1, t1 + ms(1000)), t1 + ms(1100));
/// ```
#[derive(Debug, Default)]
pub struct ThrottlePace {
    origin: OnceLock<Instant>,
    /// The second being counted (high 32 bits) and the answers accepted in it.
    current: AtomicU64,
    /// The answers accepted in the whole second before it.
    last: AtomicU64,
    /// The next free slot, in nanoseconds from the origin.
    next: AtomicU64,
    /// Until when accepted answers are counted (nanoseconds from the origin, plus one;
    /// zero: never armed): for [`ARMED_FOR`] after a throttling answer, so that a
    /// dependency that never throttles costs its successes one load, not a count.
    armed_until: AtomicU64,
}

/// How long after a throttling answer the answers the server accepts are counted.
pub const ARMED_FOR: Duration = Duration::from_secs(60);

impl ThrottlePace {
    /// A pace that has seen nothing.
    pub fn new() -> Self {
        ThrottlePace::default()
    }

    fn nanos(&self, at: Instant) -> u64 {
        let origin = *self.origin.get_or_init(|| at);
        u64::try_from(at.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX / 2)
    }

    /// Counts an answer the server accepted at `now`, while armed by a throttling
    /// answer in the last [`ARMED_FOR`].
    pub fn accepted(&self, now: Instant) {
        self.accepted_with(|| now);
    }

    /// [`accepted`](Self::accepted), reading the clock only when armed: what a success
    /// costs a dependency that never throttled is one load.
    pub fn accepted_with(&self, now: impl FnOnce() -> Instant) {
        let armed = self.armed_until.load(Ordering::Relaxed);
        if armed == 0 {
            return;
        }
        let at = self.nanos(now());
        if at >= armed {
            return;
        }
        let second = at / SECOND;
        let mut word = self.current.load(Ordering::Relaxed);
        loop {
            let (at, count) = (word >> 32, word & 0xFFFF_FFFF);
            let next = if at == second {
                (second << 32) | (count + 1).min(0xFFFF_FFFF)
            } else {
                (second << 32) | 1
            };
            match self.current.compare_exchange_weak(
                word,
                next,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    if at != second {
                        // The second before this one, if it was the one counted.
                        let whole = if at + 1 == second { count } else { 0 };
                        self.last.store(whole, Ordering::Release);
                    }
                    return;
                }
                Err(seen) => word = seen,
            }
        }
    }

    /// The answers accepted per second, as of `now`: the last whole second's and this
    /// one's so far, over the time they span; at least one.
    pub fn rate(&self, now: Instant) -> u64 {
        let at = self.nanos(now);
        let (second, into) = (at / SECOND, (at % SECOND) as f64 / SECOND as f64);
        let word = self.current.load(Ordering::Acquire);
        let (counted, count) = (word >> 32, word & 0xFFFF_FFFF);
        let seen = if counted == second {
            self.last.load(Ordering::Acquire) + count
        } else if counted + 1 == second {
            count
        } else {
            0
        };
        ((seen as f64 / (1.0 + into)) as u64).max(1)
    }

    /// The time a throttled retry that may go at `earliest` goes: `earliest`, or the
    /// next free slot if later; the slot after it is taken. Until the server has
    /// accepted [`KNOWN`] answers in a second, its rate is not known and the retry goes
    /// at `earliest`.
    pub fn slot(&self, now: Instant, earliest: Instant) -> Instant {
        let armed = self
            .nanos(now)
            .saturating_add(u64::try_from(ARMED_FOR.as_nanos()).unwrap_or(u64::MAX))
            .saturating_add(1);
        self.armed_until.fetch_max(armed, Ordering::Relaxed);
        let rate = self.rate(now);
        if rate < KNOWN {
            return earliest;
        }
        let gap = SECOND / rate;
        let from = self.nanos(earliest);
        let origin = *self.origin.get_or_init(|| now);
        let mut next = self.next.load(Ordering::Relaxed);
        loop {
            let slot = from.max(next);
            match self.next.compare_exchange_weak(
                next,
                slot.saturating_add(gap),
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return origin + Duration::from_nanos(slot),
                Err(seen) => next = seen,
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests take their time zero from the clock
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_rate_the_server_accepted_last_second() {
        let pace = ThrottlePace::new();
        let t0 = Instant::now();
        // Not counted before a throttling answer arms the count.
        pace.accepted(t0);
        assert_eq!(pace.slot(t0, t0), t0);
        for i in 0..20 {
            pace.accepted(t0 + Duration::from_millis(50 * i));
        }
        // 20 in the last whole second, none yet in this one, 1.1 s spanned: 18 a second.
        let t1 = t0 + Duration::from_millis(1_100);
        assert_eq!(pace.rate(t1), 18);
        let after = t1 + Duration::from_secs(1);
        let gap = Duration::from_nanos(SECOND / 18);
        let slots: Vec<_> = (0..4).map(|_| pace.slot(t1, after) - after).collect();
        assert_eq!(slots, [Duration::ZERO, gap, gap * 2, gap * 3]);
        let ms = Duration::from_millis;
        // A retry asked to wait longer than the queue of slots goes when asked.
        assert_eq!(pace.slot(t1, after + ms(500)), after + ms(500));
        // Two idle seconds later, the rate is not known any more.
        let t3 = t1 + Duration::from_secs(3);
        assert_eq!(pace.rate(t3), 1);
        assert_eq!(pace.slot(t3, t3), t3);
    }
}
