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
/// The rate a dependency's throttled retries are let through at, once one of them was
/// throttled again, unless the server accepted more answers than that in the last
/// second: a start the gate leaves within a few answers (cut by [`GATE_CUT`] by each
/// throttled one, a tenth more for each accepted one).
pub const GATE_START: u32 = 10;
/// What a retry throttled again leaves of the gate's rate: the AWS SDKs' adaptive retry
/// mode's β (its CUBIC rate limiter's multiplicative decrease).
pub const GATE_CUT: f64 = 0.7;
/// The answers accepted in a second from which their rate is known: fewer say too
/// little of it (a burst's one accepted call is not a rate of one a second).
pub const KNOWN: u64 = 5;
/// A closed gate that let nothing through for this long starts over from what is known
/// of the server's rate.
const IDLE: u64 = SECOND;
/// The slowest the gate lets throttled retries through, per second.
const GATE_MIN: u64 = 1;
/// The fastest, per second.
const GATE_MAX: u64 = 1_000_000;
/// Rates are kept in thousandths of a call a second.
const MILLI: u64 = 1000;

/// The gate of a dependency's throttled retries: a retry of a throttling answer (429,
/// `RESOURCE_EXHAUSTED`) waits its `Retry-After` (or [`THROTTLE_BASE`]), spread over up
/// to as much again, and is then let through at the rate the server accepts them, or
/// not at all: a retry that finds no free slot within one more of the server's wait is
/// not sent (the request gives up with [`GiveUp::Throttled`](super::GiveUp::Throttled)).
/// Shared by reference; lock-free.
///
/// When the server has not accepted [`KNOWN`] answers a second lately, the gate is open
/// until a retry sent through it is throttled again: a rate limiter that lets a burst's
/// retries through after its `Retry-After` (a window that resets) sees them as they
/// come. From then on, or from the throttling answer when the server's rate is known,
/// it lets retries through one per slot, at a rate that starts at that of the answers
/// the server accepted lately (at least [`GATE_START`] a second once a retry was
/// throttled again), is cut by [`GATE_CUT`] by a retry throttled again (once per slot)
/// and grows by a tenth with each one accepted: the rate the limiter accepts, found as
/// TCP finds a path's. A gate that let nothing through for a second starts over at the
/// next throttling answer; it opens [`ARMED_FOR`] after the last one. A retry that
/// finds the next slot taken waits for it, its wait spread over the queue of retries
/// waiting (so that about one asks per slot), and asks again: a rate that grows
/// shortens every wait at once.
///
/// Why: a rate limiter refuses the calls of a burst at one instant and asks them all
/// to come back after the same `Retry-After`; sent back together, or at any rate above
/// the limiter's, they meet the same limit and are refused again, every attempt spent
/// on nothing, and a client that always has more to send keeps the limiter refusing.
/// `tests/rate_limited.rs` in the repository shows it against nginx `limit_req`: 100
/// GETs at once, answered on every attempt, made 2.8 attempts a request; through the
/// gate, at most 1.5.
///
/// ```
/// use std::time::{Duration, Instant};
/// use stormguard_core::retry::{Gate, ThrottlePace};
///
/// let pace = ThrottlePace::new();
/// let t0 = Instant::now();
/// let ms = Duration::from_millis;
/// pace.arm(t0);
/// // Open: a throttled retry goes when its wait is over.
/// let mut queued = false;
/// assert_eq!(pace.release(t0, t0 + ms(1000), &mut queued, 0.5), Gate::Go);
/// // It was throttled again: the gate closes, to 10 a second.
/// pace.answered(t0, true);
/// // The next slot is 100 ms away: wait for it (alone in the queue), and ask again.
/// assert_eq!(pace.release(t0, t0 + ms(1000), &mut queued, 0.5), Gate::Wait(ms(150)));
/// assert!(queued);
/// assert_eq!(pace.release(t0 + ms(150), t0 + ms(1000), &mut queued, 0.5), Gate::Go);
/// // A retry that finds no slot before it stops waiting is not sent.
/// let mut other = false;
/// assert_eq!(pace.release(t0 + ms(200), t0 + ms(200), &mut other, 0.5), Gate::Closed);
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
    /// Until when the gate is armed: accepted answers are counted and, once closed, it
    /// stays closed (nanoseconds from the origin, plus one; zero: never armed): for
    /// [`ARMED_FOR`] after a throttling answer, so that a dependency that never
    /// throttles costs its successes one load, not a count.
    armed_until: AtomicU64,
    /// The rate retries are let through at, in thousandths a second; zero: open.
    rate: AtomicU64,
    /// When the rate was last cut.
    cut_at: AtomicU64,
    /// The retries waiting for a slot.
    waiting: AtomicU64,
}

/// What the gate says to a throttled retry whose wait is over
/// ([`ThrottlePace::release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Send it now: the slot is its own.
    Go,
    /// Wait this long and ask again.
    Wait(Duration),
    /// No slot came before it stopped waiting: do not send it.
    Closed,
}

/// How long after a throttling answer the gate stays armed.
pub const ARMED_FOR: Duration = Duration::from_secs(60);

impl ThrottlePace {
    /// A gate that has seen nothing.
    pub fn new() -> Self {
        ThrottlePace::default()
    }

    fn nanos(&self, at: Instant) -> u64 {
        let origin = *self.origin.get_or_init(|| at);
        u64::try_from(at.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX / 2)
    }

    /// Arms the gate for [`ARMED_FOR`] from `now`: a throttling answer was decided on.
    pub fn arm(&self, now: Instant) {
        let at = self.nanos(now);
        let armed = at
            .saturating_add(u64::try_from(ARMED_FOR.as_nanos()).unwrap_or(u64::MAX))
            .saturating_add(1);
        let before = self.armed_until.fetch_max(armed, Ordering::AcqRel);
        if before != 0 && before <= at {
            // Armed again after it lapsed: what it learnt is stale.
            self.rate.store(0, Ordering::Release);
        }
        self.restart_if_idle(at);
    }

    /// Starts an open gate, or one that let nothing through for [`IDLE`], over from
    /// what is known as a throttling answer comes: closed at the rate the server
    /// accepted lately if it is known, else open.
    fn restart_if_idle(&self, at: u64) {
        let milli = self.rate.load(Ordering::Acquire);
        let next = self.next.load(Ordering::Acquire);
        if milli != 0 && next.saturating_add(IDLE) >= at {
            return;
        }
        let measured = self.measured(at);
        let start = if measured >= KNOWN {
            measured * MILLI
        } else {
            0
        };
        if self
            .rate
            .compare_exchange(milli, start, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.next.fetch_max(at, Ordering::AcqRel);
        }
    }

    /// The closed gate's rate at `at` (nanoseconds from the origin), in thousandths of
    /// a call a second: `None` while it is open, or no longer armed.
    fn closed_rate(&self, at: u64) -> Option<u64> {
        let milli = self.rate.load(Ordering::Acquire);
        (milli != 0 && at < self.armed_until.load(Ordering::Acquire)).then_some(milli)
    }

    /// Counts an answer the server accepted at `now`, while armed.
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

    /// The answers accepted in the second up to `at`: this second's so far, and the
    /// share of the last whole second's that falls within it (a sliding window). Not
    /// the count over both seconds divided by their span: a rate that began within the
    /// last second would be averaged with the silence before it and read as half.
    fn measured(&self, at: u64) -> u64 {
        let (second, into) = (at / SECOND, (at % SECOND) as f64 / SECOND as f64);
        let word = self.current.load(Ordering::Acquire);
        let (counted, count) = (word >> 32, word & 0xFFFF_FFFF);
        let (last, current) = if counted == second {
            (self.last.load(Ordering::Acquire), count)
        } else if counted + 1 == second {
            (count, 0)
        } else {
            (0, 0)
        };
        (last as f64 * (1.0 - into) + current as f64).round() as u64
    }

    /// The rate the gate lets retries through at, in calls a second (`None`: open).
    pub fn rate(&self, now: Instant) -> Option<f64> {
        self.closed_rate(self.nanos(now))
            .map(|milli| milli as f64 / MILLI as f64)
    }

    /// Whether a throttled retry whose wait is over at `now` goes: at once while the
    /// gate is open or its next slot is free (the retry takes it), else after a wait
    /// for the slot, spread by `draw` (in `[0, 1]`) over the queue of retries waiting
    /// (or none, for one that would stop waiting within it), to ask again; not at all
    /// once `until` has come. `queued` says whether the
    /// retry is counted in the queue (false for a retry not yet waiting): kept by the
    /// gate, and by [`leave`](Self::leave) if it is given up on.
    pub fn release(&self, now: Instant, until: Instant, queued: &mut bool, draw: f64) -> Gate {
        let at = self.nanos(now);
        let Some(milli) = self.closed_rate(at) else {
            self.leave(queued);
            return Gate::Go;
        };
        let gap = gap(milli);
        let mut next = self.next.load(Ordering::Acquire);
        while next <= at {
            match self.next.compare_exchange_weak(
                next,
                at.saturating_add(gap),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.leave(queued);
                    return Gate::Go;
                }
                Err(seen) => next = seen,
            }
        }
        let until = self.nanos(until);
        if at >= until {
            self.leave(queued);
            return Gate::Closed;
        }
        if !*queued {
            *queued = true;
            self.waiting.fetch_add(1, Ordering::AcqRel);
        }
        let draw = if draw.is_finite() {
            draw.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let queue = self.waiting.load(Ordering::Acquire).max(1) as f64;
        let spread = (gap as f64 * queue * draw) as u64;
        // One that would stop waiting within its share of the queue asks at the slot.
        let wake = match next.checked_add(spread) {
            Some(wake) if wake < until => wake,
            _ => next.min(until),
        };
        Gate::Wait(Duration::from_nanos(wake - at))
    }

    /// Takes a retry given up on while it waited for a slot out of the queue.
    pub fn leave(&self, queued: &mut bool) {
        if std::mem::take(queued) {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Learns from the answer, at `now`, to a retry the gate let through: `throttled`
    /// again (the gate closes, or its rate is cut by [`GATE_CUT`], at most once per
    /// slot), or accepted (a closed gate's rate grows by a tenth).
    pub fn answered(&self, now: Instant, throttled: bool) {
        let at = self.nanos(now);
        let milli = self.rate.load(Ordering::Acquire);
        if !throttled {
            if milli != 0 {
                let grown = (milli + milli / 10).min(GATE_MAX * MILLI);
                let _ =
                    self.rate
                        .compare_exchange(milli, grown, Ordering::AcqRel, Ordering::Relaxed);
            }
            return;
        }
        if self.closed_rate(at).is_none() {
            let start = self.measured(at).max(u64::from(GATE_START)) * MILLI;
            if self
                .rate
                .compare_exchange(milli, start, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.cut_at.store(at, Ordering::Release);
                let gap = gap(start);
                self.next
                    .fetch_max(at.saturating_add(gap), Ordering::AcqRel);
            }
            return;
        }
        let gap = gap(milli);
        let cut = self.cut_at.load(Ordering::Acquire);
        if at.saturating_sub(cut) < gap {
            return;
        }
        if self
            .cut_at
            .compare_exchange(cut, at, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let cut = ((milli as f64 * GATE_CUT) as u64).max(GATE_MIN * MILLI);
            let _ = self
                .rate
                .compare_exchange(milli, cut, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// The time between two slots at `milli` thousandths of a call a second, in
/// nanoseconds.
fn gap(milli: u64) -> u64 {
    SECOND.saturating_mul(MILLI) / milli.max(1)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests take their time zero from the clock
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A gate armed by a throttling answer at its time zero.
    fn armed() -> (ThrottlePace, Instant) {
        let pace = ThrottlePace::new();
        let t0 = Instant::now();
        pace.arm(t0);
        (pace, t0)
    }

    /// A gate closed at time zero by a retry throttled again, at 10 a second.
    fn closed() -> (ThrottlePace, Instant) {
        let (pace, t0) = armed();
        pace.answered(t0, true);
        (pace, t0)
    }

    #[test]
    fn the_gate_is_open_until_a_retry_it_let_through_is_throttled_again() {
        let (pace, t0) = armed();
        for i in 0..20 {
            let mut queued = false;
            let at = t0 + ms(i);
            assert_eq!(pace.release(at, at, &mut queued, 0.5), Gate::Go);
            pace.answered(at, false);
        }
        assert_eq!(pace.rate(t0), None);
        // Throttled again: closed at the start rate.
        pace.answered(t0 + ms(20), true);
        assert_eq!(pace.rate(t0 + ms(20)), Some(f64::from(GATE_START)));
    }

    #[test]
    fn the_gate_closes_at_the_rate_the_server_accepted_last_second_if_more() {
        let (pace, t0) = armed();
        for i in 0..40 {
            pace.accepted(t0 + ms(25 * i));
        }
        let t1 = t0 + ms(1_000);
        pace.answered(t1, true);
        assert_eq!(pace.rate(t1), Some(40.0));
    }

    #[test]
    fn a_rate_that_began_within_the_last_second_is_read_at_its_rate() {
        let (pace, t0) = armed();
        // Silence, then 20 a second from 900 ms in, for a second.
        for i in 0..20 {
            pace.accepted(t0 + ms(900 + 50 * i));
        }
        let t1 = t0 + ms(1_900);
        pace.answered(t1, true);
        // Over the two seconds' span it would read as 10 a second.
        let rate = pace.rate(t1).unwrap_or(0.0);
        assert!((18.0..=20.0).contains(&rate), "{rate}");
    }

    #[test]
    fn throttled_answers_cut_the_rate_once_per_slot_and_accepted_ones_grow_it() {
        let (pace, t0) = closed();
        // Within the slot (100 ms at 10 a second): no second cut.
        pace.answered(t0 + ms(50), true);
        assert_eq!(pace.rate(t0 + ms(50)), Some(10.0));
        pace.answered(t0 + ms(100), true);
        assert_eq!(pace.rate(t0 + ms(100)), Some(7.0));
        pace.answered(t0 + ms(150), false);
        assert_eq!(pace.rate(t0 + ms(150)), Some(7.7));
        // Never below one a second.
        for i in 0..20 {
            pace.answered(t0 + Duration::from_secs(2 + i), true);
        }
        assert_eq!(pace.rate(t0 + ms(22_000)), Some(1.0));
    }

    #[test]
    fn retries_go_one_per_slot_and_those_without_one_in_time_are_not_sent() {
        let (pace, t0) = closed();
        let until = t0 + ms(1_000);
        // Thirty retries at once, each asking again when told, at 10 a second (a rate
        // that moves on none of their answers here): one slot every 100 ms, from 100 ms.
        let mut asks: Vec<(Instant, bool)> = vec![(t0, false); 30];
        let (mut sent, mut closed, mut rounds) = (Vec::new(), 0, 0);
        while !asks.is_empty() && rounds < 10_000 {
            rounds += 1;
            asks.sort_by_key(|ask| ask.0);
            let (at, mut queued) = asks.remove(0);
            let draw = (rounds % 7) as f64 / 7.0;
            match pace.release(at, until, &mut queued, draw) {
                Gate::Go => sent.push(at),
                Gate::Wait(wait) => {
                    assert!(!wait.is_zero() && at + wait <= until);
                    asks.push((at + wait, queued));
                }
                Gate::Closed => closed += 1,
            }
        }
        // Ten slots at most in the 900 ms from the first (fewer when an ask comes late
        // to its slot); every other retry is not sent.
        assert!((8..=10).contains(&sent.len()), "{sent:?}");
        assert_eq!(sent.len() + closed, 30);
        // Never two within a slot.
        for pair in sent.windows(2) {
            assert!(pair[1] - pair[0] >= ms(100), "{sent:?}");
        }
        assert_eq!(pace.waiting.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_gate_opens_again_once_no_throttling_answer_came_for_a_while() {
        let (pace, t0) = closed();
        let later = t0 + ARMED_FOR + ms(1);
        assert_eq!(pace.rate(later), None);
        let mut queued = false;
        assert_eq!(pace.release(later, later, &mut queued, 0.5), Gate::Go);
        // Armed again, it starts open, not at what it learnt before.
        pace.arm(later);
        assert_eq!(pace.rate(later), None);
    }
}
