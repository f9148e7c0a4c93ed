//! The circuit breaker's state machine, with time passed in.
//!
//! A retry helps when a failure is a blip. When a dependency is down, or drowning, every
//! retry and every new call only adds to its load, and every caller waits for a timeout
//! it could have been spared. A circuit breaker watches the outcomes of recent calls and,
//! once too many fail, stops sending for a while: calls fail fast instead, the dependency
//! gets room to recover, and after a pause a few probe calls find out whether it has.
//!
//! ```text
//!              ratio or streak reached                 break over
//!   Closed ──────────────────────────────▶ Open ─────────────────────▶ HalfOpen
//!     ▲                                     ▲      a probe failed         │
//!     │                                     └─────────────────────────────┤
//!     │                    every probe succeeded                          │
//!     └───────────────────────────────────────────────────────────────────┘
//!
//!   Isolated: forced open by `isolate()` until `reset()`, which forces Closed.
//! ```
//!
//! - **Closed**: calls flow. Outcomes are counted over a sliding window (default 2 s)
//!   kept as ten time buckets. The circuit opens when, over the window, at least
//!   `min_throughput` (default 20) calls finished and at least `failure_ratio` (default
//!   0.95) of them failed, or after `consecutive_failures` failures in a row (default 50;
//!   `None` turns that rule off). The window is evaluated when a failure is recorded (a success
//!   cannot be the call that makes the ratio worse), so the success path only adds to a
//!   counter.
//! - **Open**: calls are rejected at once with the time left in the break. The first
//!   break lasts `break_duration` (default 25 ms); every failed probe doubles it, up to
//!   `max_break_duration` (default: `break_duration`, so no doubling); a successful close
//!   brings it back to the base.
//! - **HalfOpen**: when the break is over (noticed lazily by the next call or query),
//!   exactly `probes` (default 1) calls are let through, however many callers race for them;
//!   the others are rejected. When all of them succeed the circuit closes with an empty
//!   window; when one fails it opens again for a longer break.
//! - **Isolated**: forced open by an operator until `reset()`.
//!
//! # Why these defaults
//!
//! They were chosen by measurement (the `storm` example's scenarios over real sockets,
//! and `stormguard-sim defaults`), not copied from peers; the figures are in the defaults
//! page of the guide (docs/defaults.md in the repository). A long window full of healthy
//! calls needs seconds of failures to reach its ratio, and a long break outlasts the
//! outage it was meant to ride out.
//!
//! - *Trip on a streak, not only a ratio.* 50 failures in a row come at once when the
//!   dependency is down, and seldom while most calls fail at random: a total outage (or
//!   a brownout whose calls all time out) trips at once, a partial one does not, and
//!   partial outages are where a breaker on every call sheds first tries that would have
//!   succeeded (worse than not retrying at all).
//! - *A ratio of 0.95 over 2 s* is the backstop for clients too slow to make a streak
//!   quickly; so high a ratio stays clear of a heavy partial outage's noise.
//! - *Short, constant breaks.* A break is the longest the client can be blind to the
//!   dependency's return: with 25 ms, a probe every break finds it back within that,
//!   and a probe is one fast-failing call, cheap next to the traffic it spares. Longer
//!   or doubling breaks trade recovery time for fewer probes; choose them when probes are
//!   expensive. Each break is stretched by a random factor in `[1, 1 + jitter]` (default
//!   0.2), so that many clients which tripped together do not all probe again in the
//!   same instant.
//!
//! Outcomes are [`Outcome::Success`], [`Outcome::Failure`] or [`Outcome::Ignored`]; an
//! ignored outcome (say an HTTP 404, the caller's own fault) is not counted at all, so
//! it neither dilutes nor worsens the failure ratio, but it frees a probe slot.
//!
//! The [`Breaker`] reads no clock: every method that depends on time takes `now`. The
//! window is measured from the first `now` it is given.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use stormguard_core::breaker::{Breaker, BreakerConfig, CircuitState, Outcome};
//!
//! // The defaults (95% of at least 20 calls over 2 s, or 50 in a row; 25 ms breaks),
//! // without the break's jitter so that the times below are exact.
//! let config = BreakerConfig::builder().jitter(0.0).build()?;
//! let breaker = Breaker::new(config);
//! let t0 = Instant::now();
//!
//! for _ in 0..20 {
//!     let permit = breaker.try_acquire(t0).expect("closed");
//!     breaker.record(permit, Outcome::Failure, t0);
//! }
//! assert_eq!(breaker.state(t0), CircuitState::Open);
//! let rejected = breaker.try_acquire(t0 + Duration::from_millis(10)).unwrap_err();
//! assert_eq!(rejected.remaining, Duration::from_millis(15));
//!
//! // After the break, one probe goes through; its success closes the circuit.
//! let later = t0 + Duration::from_millis(25);
//! let probe = breaker.try_acquire(later).expect("probe");
//! assert!(probe.is_probe());
//! assert!(breaker.try_acquire(later).is_err(), "only one probe at a time");
//! breaker.record(probe, Outcome::Success, later);
//! assert_eq!(breaker.state(later), CircuitState::Closed);
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```
//!
//! # Concurrency
//!
//! A [`Breaker`] is used through `&self` from any number of threads (share it in an
//! `Arc`). Asking for admission and recording an outcome are O(1) and use atomics only
//! while the circuit is closed: a success is a few atomic loads and one atomic add, a
//! failure adds one sum over the ten buckets. Probe slots in the half-open state are
//! taken and given back with compare-and-swap on one word, so exactly `probes` callers
//! win. A `Mutex` is taken only to change state (trip, half-open, close, re-open,
//! isolate, reset), which keeps transitions and the break length consistent.
//! Memory is constant, and a call after a year of silence costs what it costs after a
//! second: stale buckets are recognised by their epoch, not emptied one by one.

mod config;
mod machine;
mod window;
mod word;

use std::fmt;
use std::time::Duration;

use word::STATE_MASK;

pub use config::{BreakerConfig, BreakerConfigBuilder};
pub use machine::Breaker;

/// The state of a circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CircuitState {
    /// Calls flow and their outcomes are counted.
    Closed,
    /// Calls are rejected until the break is over.
    Open,
    /// A limited number of probe calls decide whether to close or open again.
    HalfOpen,
    /// Forced open by [`Breaker::isolate`] until [`Breaker::reset`].
    Isolated,
}

impl CircuitState {
    fn from_bits(bits: u64) -> Self {
        match bits & STATE_MASK {
            0 => CircuitState::Closed,
            1 => CircuitState::Open,
            2 => CircuitState::HalfOpen,
            _ => CircuitState::Isolated,
        }
    }

    const fn bits(self) -> u64 {
        match self {
            CircuitState::Closed => 0,
            CircuitState::Open => 1,
            CircuitState::HalfOpen => 2,
            CircuitState::Isolated => 3,
        }
    }

    /// The lower-case name used in logs: `closed`, `open`, `half-open`, `isolated`.
    pub const fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half-open",
            CircuitState::Isolated => "isolated",
        }
    }
}

impl fmt::Display for CircuitState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change of state, returned by the call that caused it so the caller can log it or
/// tell someone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transition {
    /// The state the circuit left.
    pub from: CircuitState,
    /// The state the circuit entered.
    pub to: CircuitState,
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.from, self.to)
    }
}

/// What became of a call, as far as the breaker is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The dependency did its job.
    Success,
    /// The dependency failed (a 5xx, a timeout, a refused connection...).
    Failure,
    /// The call says nothing about the dependency's health (a 4xx: the caller's fault).
    /// It is not counted, but it frees a probe slot.
    Ignored,
    /// The dependency turned the call away before doing any work for it: an HTTP/2
    /// `REFUSED_STREAM`, a GOAWAY that the call's stream was above. One refusal says
    /// little (a graceful drain refuses the few calls in flight on the connection it
    /// closes, while every other call, and the refused ones sent again, succeed), but a
    /// dependency that refuses every call is down. So a refusal counts toward the
    /// failures *in a row* ([`consecutive_failures`](BreakerConfigBuilder::consecutive_failures)),
    /// which a success ends, and not in the window's ratio; a refused probe is a failed
    /// probe. Without the rule of failures in a row, refusals are not counted.
    Refused,
}

/// Leave to make one call, from [`Breaker::try_acquire`].
///
/// Hand it back with [`Breaker::record`] once the outcome is known, or with
/// [`Breaker::release`] if the call was abandoned. A probe permit that is simply dropped
/// keeps its half-open slot taken until the circuit changes state, so callers that can
/// be cancelled should release it from a `Drop` guard (the Tower layer does).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "report the outcome with Breaker::record, or give the permit back with Breaker::release"]
pub struct Permit {
    probe: bool,
    generation: u64,
    transition: Option<Transition>,
}

impl Permit {
    /// Whether this is one of the half-open probes whose outcome decides the circuit.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// The transition that taking this permit caused, if any (Open to HalfOpen, when
    /// this call was the first after the break).
    pub fn transition(&self) -> Option<Transition> {
        self.transition
    }
}

/// Why [`Breaker::try_acquire`] refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected {
    /// How long until the break is over: zero when the circuit is isolated (it stays
    /// open until reset) or half-open with every probe slot taken (a slot may free up
    /// at any moment).
    pub remaining: Duration,
    /// The state that refused the call: `Open`, `HalfOpen` or `Isolated`.
    pub state: CircuitState,
    /// The transition that this attempt caused, if any (Open to HalfOpen, when other
    /// callers then took every probe slot first).
    pub transition: Option<Transition>,
    /// How long the circuit has been away from Closed (open, or half-open between
    /// breaks): the age of the backlog of calls it has refused. Zero when isolated.
    /// The retry ([`crate::retry`]) spreads the calls sent again over a span that grows
    /// with it.
    pub open_for: Duration,
    /// How long the dependency has been failing, as the breaker saw it: `open_for`
    /// plus the run of failures in a row that opened the circuit (from the first of
    /// them), if a run opened it. Zero when isolated. Past [`FAIL_FAST_AFTER`], the
    /// retry ([`crate::retry`]) no longer rides the refusal out.
    pub failing_for: Duration,
}

/// How long a dependency may have been failing ([`Rejected::failing_for`]: from the
/// first of the failures in a row that opened its circuit) before the calls the
/// circuit refuses fail at once (the fail-fast horizon): the retry layer rides out a
/// refusal younger than this with a backlog wait (about four times the circuit's age),
/// and fails an older one with `CircuitOpen` after at most a short wait for a break's
/// probe (its rest and up to two breaks).
///
/// Why 350 ms: a blip of up to about 300 ms (a restart, a leader election, a full GC;
/// the storm's blips) is over, and its circuit closed by the probe after it, within the
/// horizon, so its refused calls are still ridden out; past it, waiting is what holds a
/// caller's requests, memory and connections for as long as the outage lasts, which is
/// how an outage climbs a call chain. It counts from the trouble's start, not the
/// circuit's opening, because the opening comes later the fewer calls a client makes
/// (fifty failures in a row take four times as long at a quarter of the calls): every
/// call made before the horizon is held until about then, so a caller's peak in an
/// outage is about its rate times the horizon, whatever its rate; a little more than
/// the same stack holds with a breaker that never opens, whose calls are held by their
/// backoffs until the retry budget runs out (`tests/outage_stack.rs`). linkerd fails
/// fast after 3 s; Polly's and resilience4j's
/// breakers at once. The caller can fall back at once: `CircuitOpen::remaining` says
/// when the next probe is due.
pub const FAIL_FAST_AFTER: Duration = Duration::from_millis(350);

/// How much longer than the circuit has been open the calls it refused wait, after the
/// break, before they are sent again: see [`backlog_wait`].
pub(crate) const BACKLOG_SPREAD: f64 = 4.0;

/// How far a refused call's spread may fall either side of [`BACKLOG_SPREAD`] times
/// the circuit's age, as a share of it: see [`backlog_wait`].
const BACKLOG_BAND: f64 = 0.25;

/// How long a call the circuit refused waits before it is sent again: its `backoff`,
/// or, if later, the end of the break plus [`BACKLOG_SPREAD`] times
/// [`Rejected::open_for`], give or take a quarter of it (`draw`, in `[0, 1]`, places
/// it in that band). Where that would outlast `limit` (the backoff's cap, or the time
/// the request's deadline leaves, if sooner), the wait is a uniform share of the span
/// up to the limit instead.
///
/// Every call a circuit refuses while it is open is a call its callers still want, and
/// the moment the circuit closes they all want it at once. Sent after their backoffs
/// alone, a break's backlog comes back within a backoff of the close, on top of the
/// traffic of the moment: a 300 ms blip at 520 calls/s defers about 156 calls, and
/// within 200 ms of backoff they come back at 1.5 times the healthy rate on top of it,
/// which a dependency at two thirds of its capacity cannot serve within a 100 ms
/// timeout. Its timeouts trip the circuit again and spend the retry budget the next
/// blip needed.
///
/// A call refused at age `a` comes back at about `5a`; one that comes back while the
/// circuit is still open is refused again, at its new age, and so on. The calls
/// refused over an open span `A` thus come back over `[A, 5A]` after it at a quarter
/// of the rate they were refused at, evenly (a call refused at `a` last comes back at
/// `5^k a` for the `k` that first passes `A`; the rates of the `k`s sum to a quarter),
/// which a dependency serving up to 80% of its capacity has room for. A wait drawn
/// uniformly from the whole span instead, from the break's end to `5a`, brings most
/// of the backlog back in the first moments after the close (the calls refused early
/// come back early), at up to three quarters of the rate it built up at: in the
/// storm's blips, a queue that met its attempt timeout. The wait grows only with the
/// circuit's own age: a short break costs a short wait. A span cut by the limit is
/// drawn from uniformly, so no share of the backlog piles up at the limit; a wait cut
/// to the deadline is still a wait the request can use.
pub(crate) fn backlog_wait(
    backoff: Duration,
    remaining: Duration,
    open_for: Duration,
    limit: Duration,
    draw: f64,
) -> Duration {
    let share = if draw.is_finite() {
        draw.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let room = limit.saturating_sub(remaining);
    let span = open_for.as_secs_f64() * BACKLOG_SPREAD;
    let seconds = if span * (1.0 + BACKLOG_BAND) <= room.as_secs_f64() {
        span * (1.0 - BACKLOG_BAND + 2.0 * BACKLOG_BAND * share)
    } else {
        span.min(room.as_secs_f64()) * share
    };
    let spread = Duration::try_from_secs_f64(seconds).map_or(room, |spread| spread.min(room));
    backoff.max(remaining.saturating_add(spread))
}

/// How long a **first** call refused at the end of a break waits before it asks the
/// circuit again (the retry decision asks once, and again while the call meets a
/// probe still deciding), or `None` if it should not wait: the rest of the break plus a
/// uniform share (`draw()`, in `[0, 1]`, drawn only if the call waits) of one
/// `break_duration`, so that it asks again
/// once the probe the break's end lets through has had time to decide, and a break's
/// refused calls come back spread over a break, at the rate they were refused. Only a
/// wait that cannot outlast `ceiling` (what the call's earlier waits for a probe left
/// of its first backoff at its longest) is taken: behind a breaker with long breaks,
/// first calls fail fast.
/// The wait costs the dependency nothing (the call never left the client).
///
/// Why: the last break of an outage or a brownout ends after the dependency has come
/// back, and the calls made during it, or while its probe is deciding, are the
/// first calls of the recovery. Refused at once, they are retried on a retry budget
/// the incident has spent, and fail: about 2% of the first second after a 5 s outage
/// (25 ms breaks plus a probe's round trip at 520 calls a second), and 4–10% after a
/// brownout, whose probes take up to an attempt's timeout to decide. Waiting out one
/// break, most are served; a call that comes back while the probe is still in flight
/// has not had its verdict, and waits again rather than fail a recovery's first
/// call on the last probe of the outage (its waits together within `ceiling`). A call
/// refused after a probe's failure is handled as before (retried on the budget,
/// spread by [`backlog_wait`], or failed past the horizon), so in a long outage this
/// only delays a fast failure by about a break and a probe's round trip.
pub(crate) fn probe_wait(
    remaining: Duration,
    break_duration: Duration,
    ceiling: Duration,
    draw: impl FnOnce() -> f64,
) -> Option<Duration> {
    if break_duration.is_zero() || remaining.saturating_add(break_duration) > ceiling {
        return None;
    }
    let draw = draw();
    let share = if draw.is_finite() {
        draw.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let spread =
        Duration::try_from_secs_f64(break_duration.as_secs_f64() * share).unwrap_or(break_duration);
    Some(remaining.saturating_add(spread))
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.state {
            CircuitState::Open => write!(f, "circuit open for another {:?}", self.remaining),
            CircuitState::HalfOpen => f.write_str("circuit half-open and every probe slot taken"),
            CircuitState::Isolated => f.write_str("circuit isolated"),
            CircuitState::Closed => f.write_str("circuit closed"),
        }
    }
}

impl std::error::Error for Rejected {}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests take their time zero from the clock
mod tests {
    use std::time::Duration;

    #[test]
    fn the_documented_waits() {
        let ms = Duration::from_millis;
        let cap = Duration::from_secs(20);
        // A circuit open for 300 ms: the call comes back 0.9 to 1.5 s after the break.
        assert_eq!(
            super::backlog_wait(ms(50), ms(10), ms(300), cap, 0.5),
            ms(1210)
        );
        // A backoff longer than that is kept.
        assert_eq!(
            super::backlog_wait(ms(1600), ms(10), ms(300), cap, 0.0),
            ms(1600)
        );
        // A deadline 510 ms away cuts the span to 500 ms after the break.
        assert_eq!(
            super::backlog_wait(ms(50), ms(10), ms(300), ms(510), 0.5),
            ms(260)
        );

        let first_backoff = ms(200);
        // 10 ms of a 25 ms break left: asked again 10 to 35 ms from now.
        assert_eq!(
            super::probe_wait(ms(10), ms(25), first_backoff, || 0.0),
            Some(ms(10))
        );
        assert_eq!(
            super::probe_wait(ms(10), ms(25), first_backoff, || 0.4),
            Some(ms(20))
        );
        // Half-open, its probe deciding: within a break.
        assert_eq!(
            super::probe_wait(Duration::ZERO, ms(25), first_backoff, || 1.0),
            Some(ms(25))
        );
        // Breaks of a second: no wait (and no draw), the call fails fast.
        assert_eq!(
            super::probe_wait(ms(10), ms(1000), first_backoff, || unreachable!()),
            None
        );
    }

    use super::*;
    use std::sync::{Arc, Barrier};
    use std::time::Instant;

    const SEC: Duration = Duration::from_secs(1);

    fn config() -> BreakerConfigBuilder {
        BreakerConfig::builder()
            .min_throughput(10)
            .failure_ratio(0.5)
            .window(Duration::from_secs(10))
            .break_duration(Duration::from_secs(5))
            .max_break_duration(Duration::from_secs(30))
            .consecutive_failures(None)
            .jitter(0.0)
    }

    fn breaker(builder: BreakerConfigBuilder) -> Breaker {
        Breaker::with_seed(builder.build().expect("valid config"), 7)
    }

    /// Makes one call with `outcome`; returns the transition it caused.
    fn call(b: &Breaker, outcome: Outcome, now: Instant) -> Option<Transition> {
        let permit = b.try_acquire(now).expect("admitted");
        b.record(permit, outcome, now)
    }

    /// Trips a fresh breaker from `config()` at `now`.
    fn tripped(b: &Breaker, now: Instant) {
        for _ in 0..10 {
            call(b, Outcome::Failure, now);
        }
        assert_eq!(b.state(now), CircuitState::Open);
    }

    fn t(from: CircuitState, to: CircuitState) -> Option<Transition> {
        Some(Transition { from, to })
    }

    use CircuitState::{Closed, HalfOpen, Isolated, Open};

    #[test]
    fn a_refusal_tells_how_long_the_circuit_has_been_away_from_closed() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let at = |d: Duration| b.try_acquire(t0 + d).expect_err("refused");
        assert_eq!(at(SEC).open_for, SEC);
        assert_eq!(
            b.check(t0 + 2 * SEC).expect_err("refused").open_for,
            2 * SEC
        );
        // The probe at 5 s holds the only slot: a half-open refusal counts from the trip.
        let probe = b.try_acquire(t0 + 5 * SEC).expect("probe");
        assert_eq!(at(6 * SEC).open_for, 6 * SEC);
        assert_eq!(at(6 * SEC).state, HalfOpen);
        assert_eq!(
            b.check(t0 + 6 * SEC).expect_err("refused").open_for,
            6 * SEC
        );
        // A failed probe opens it again for 10 s: the age still counts from the trip.
        b.record(probe, Outcome::Failure, t0 + 7 * SEC);
        assert_eq!(at(8 * SEC).open_for, 8 * SEC);
        // Closed at 17 s and tripped again at 20 s: the age starts over.
        let probe = b.try_acquire(t0 + 17 * SEC).expect("probe");
        b.record(probe, Outcome::Success, t0 + 17 * SEC);
        tripped(&b, t0 + 20 * SEC);
        assert_eq!(at(21 * SEC).open_for, SEC);
        // Isolated: it stays open until reset, whatever its age.
        b.isolate();
        assert_eq!(at(22 * SEC).open_for, Duration::ZERO);
        assert_eq!(
            b.check(t0 + 22 * SEC).expect_err("refused").open_for,
            Duration::ZERO
        );
    }

    #[test]
    fn a_refusal_tells_how_long_the_dependency_has_been_failing() {
        let ms = Duration::from_millis;
        let b = breaker(config().consecutive_failures(5));
        let t0 = Instant::now();
        // A failure, a success, then five failures in a row 100 ms apart from 200 ms:
        // open at 600 ms, failing since 200 ms (the success ended the first run).
        call(&b, Outcome::Failure, t0 + ms(100));
        call(&b, Outcome::Success, t0 + ms(150));
        for i in 2..=6 {
            call(&b, Outcome::Failure, t0 + ms(100 * i));
        }
        let refused = b.try_acquire(t0 + ms(700)).expect_err("refused");
        assert_eq!((refused.open_for, refused.failing_for), (ms(100), ms(500)));
        let checked = b.check(t0 + ms(700)).expect_err("refused");
        assert_eq!(checked.failing_for, ms(500));
        // A failed probe keeps both ages; a close and a new trip start them over.
        let probe = b.try_acquire(t0 + ms(5600)).expect("probe");
        b.record(probe, Outcome::Failure, t0 + ms(5600));
        let refused = b.try_acquire(t0 + ms(5700)).expect_err("refused");
        assert_eq!(
            (refused.open_for, refused.failing_for),
            (ms(5100), ms(5500))
        );
        let probe = b.try_acquire(t0 + ms(16_000)).expect("probe");
        b.record(probe, Outcome::Success, t0 + ms(16_000));
        for i in 0..5 {
            call(&b, Outcome::Failure, t0 + ms(20_000 + 10 * i));
        }
        let refused = b.try_acquire(t0 + ms(20_100)).expect_err("refused");
        assert_eq!((refused.open_for, refused.failing_for), (ms(60), ms(100)));
        // Opened by the ratio, on a run of one failure: the run is the opening.
        let b = breaker(config());
        for i in 0..10 {
            let outcome = if i % 2 == 0 {
                Outcome::Success
            } else {
                Outcome::Failure
            };
            call(&b, outcome, t0 + ms(10 * i));
        }
        let refused = b.try_acquire(t0 + ms(190)).expect_err("refused");
        assert_eq!((refused.open_for, refused.failing_for), (ms(100), ms(100)));
        // Isolated: zero, as its age.
        b.isolate();
        assert_eq!(
            b.check(t0 + ms(200)).expect_err("refused").failing_for,
            Duration::ZERO
        );
    }

    #[test]
    fn a_backlog_is_spread_over_four_times_its_age_after_the_break() {
        let ms = Duration::from_millis;
        let cap = Duration::from_secs(20);
        // After the break's end, four times the age, give or take a quarter of it.
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, 0.0), ms(920));
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, 1.0), ms(1520));
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, 0.25), ms(1070));
        // The backoff, when it is the longer wait.
        assert_eq!(backlog_wait(ms(700), ms(20), ms(100), cap, 0.5), ms(700));
        assert_eq!(backlog_wait(ms(700), ms(20), ms(300), cap, 0.75), ms(1370));
        // A circuit just opened adds nothing; draws outside [0, 1] are clamped, a NaN
        // or an infinite draw adds nothing.
        assert_eq!(
            backlog_wait(ms(50), ms(25), Duration::ZERO, cap, 1.0),
            ms(50)
        );
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, 7.0), ms(1520));
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, -1.0), ms(920));
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), cap, f64::NAN), ms(920));
        assert_eq!(
            backlog_wait(ms(0), ms(20), ms(300), cap, f64::INFINITY),
            ms(920)
        );
        // The limit cuts the span, not the draw: a circuit open for a minute spreads
        // its backlog evenly up to the limit, none of it piled at the limit.
        let minute = Duration::from_secs(60);
        assert_eq!(backlog_wait(ms(0), ms(20), minute, cap, 0.5), ms(10_010));
        assert_eq!(backlog_wait(ms(0), ms(20), minute, cap, 1.0), cap);
        // A limit shorter than the break leaves the break; the backoff still counts.
        assert_eq!(backlog_wait(ms(0), ms(20), ms(300), ms(10), 1.0), ms(20));
        assert_eq!(backlog_wait(ms(30), ms(20), ms(300), ms(10), 1.0), ms(30));
        // No overflow, however old the circuit or far the limit.
        assert_eq!(
            backlog_wait(ms(0), Duration::MAX, Duration::MAX, Duration::MAX, 1.0),
            Duration::MAX
        );
        let huge = backlog_wait(ms(0), ms(0), Duration::MAX, Duration::MAX, 1.0);
        assert!(huge >= Duration::from_secs(u64::MAX / 2), "{huge:?}");
    }

    #[test]
    fn a_blips_backlog_comes_back_evenly_at_a_quarter_of_its_rate() {
        use rand::rngs::SmallRng;
        use rand::{RngExt, SeedableRng};

        // A circuit open for 250 ms in 25 ms breaks refuses a call every millisecond;
        // each comes back after its wait, and one that comes back while the circuit is
        // still open is refused again at its new age. After the close, they come back
        // over about a second at a quarter of the rate they were refused at, in every
        // 50 ms: no rush at the close. (A wait drawn uniformly from the whole span
        // brought back about three quarters of the rate in the first 50 ms.)
        let ms = Duration::from_millis;
        let open = ms(250);
        let cap = Duration::from_secs(20);
        let mut rng = SmallRng::seed_from_u64(7);
        let mut buckets = [0u32; 40];
        for refused in 0..250u64 {
            let mut age = ms(refused) + Duration::from_micros(rng.random_range(0..1000));
            while age < open {
                let remaining = ms(25) - Duration::from_nanos((age.as_nanos() % 25_000_000) as u64);
                age += backlog_wait(ms(0), remaining, age, cap, rng.random());
            }
            let bucket = ((age - open).as_millis() / 50) as usize;
            buckets[bucket.min(buckets.len() - 1)] += 1;
        }
        // 50 refused in 50 ms; a quarter of that is 12.5.
        let rush = buckets.iter().max().copied().unwrap_or(0);
        assert!(rush <= 20, "{buckets:?}");
        let within = buckets[..26].iter().sum::<u32>();
        assert_eq!(
            within, 250,
            "all back within 1.3 s of the close: {buckets:?}"
        );
    }

    #[test]
    fn a_first_call_at_a_breaks_end_waits_the_rest_of_it_and_up_to_one_more() {
        let ms = Duration::from_millis;
        let wait = |remaining, brk, draw: f64| probe_wait(ms(remaining), ms(brk), ms(200), || draw);
        assert_eq!(wait(10, 25, 0.0), Some(ms(10)));
        assert_eq!(wait(10, 25, 1.0), Some(ms(35)));
        assert_eq!(wait(10, 40, 0.25), Some(ms(20)));
        // Draws outside [0, 1] are clamped; a NaN or an infinite one adds nothing.
        assert_eq!(wait(10, 25, 3.0), Some(ms(35)));
        assert_eq!(wait(10, 25, -3.0), Some(ms(10)));
        assert_eq!(wait(10, 25, f64::NAN), Some(ms(10)));
        assert_eq!(wait(10, 25, f64::INFINITY), Some(ms(10)));
        // Only a wait that cannot outlast the first backoff's ceiling: at it, not past.
        assert_eq!(wait(100, 100, 1.0), Some(ms(200)));
        assert_eq!(wait(101, 100, 0.0), None);
        assert_eq!(wait(0, 201, 0.0), None);
        // No break known: no wait.
        assert_eq!(wait(10, 0, 1.0), None);
        // No overflow: a sum past `Duration::MAX` saturates.
        assert_eq!(
            probe_wait(Duration::MAX, Duration::MAX, Duration::MAX, || 1.0),
            Some(Duration::MAX)
        );
        assert_eq!(probe_wait(Duration::MAX, ms(1), ms(200), || 0.0), None);
        assert_eq!(
            probe_wait(ms(1), Duration::MAX - ms(1), Duration::MAX, || 1.0),
            Some(Duration::MAX)
        );
    }

    #[test]
    fn defaults() {
        let c = BreakerConfig::default();
        assert_eq!(c, BreakerConfig::builder().build().expect("defaults"));
        assert_eq!(c.window(), Duration::from_secs(2));
        assert_eq!(c.min_throughput(), 20);
        assert_eq!(c.failure_ratio(), 0.95);
        assert_eq!(c.consecutive_failures(), Some(50));
        assert_eq!(c.break_duration(), Duration::from_millis(25));
        assert_eq!(c.max_break_duration(), Duration::from_millis(25));
        assert_eq!(c.probes(), 1);
        assert_eq!(c.jitter(), 0.2);
    }

    #[test]
    fn refusals_count_in_a_row_only() {
        let now = Instant::now();
        // Refusals in a row trip the circuit like failures in a row...
        let b = breaker(config().consecutive_failures(5));
        for _ in 0..4 {
            assert_eq!(call(&b, Outcome::Refused, now), None);
        }
        assert_eq!(call(&b, Outcome::Refused, now), t(Closed, Open));
        // ...and they mix with failures in one run.
        let b = breaker(config().consecutive_failures(5).min_throughput(100));
        for outcome in [Outcome::Failure, Outcome::Refused].iter().cycle().take(4) {
            assert_eq!(call(&b, *outcome, now), None);
        }
        assert_eq!(call(&b, Outcome::Refused, now), t(Closed, Open));
        // A success ends the run: a drain's refusals between successes never trip it.
        let b = breaker(config().consecutive_failures(5));
        for _ in 0..100 {
            for _ in 0..4 {
                call(&b, Outcome::Refused, now);
            }
            call(&b, Outcome::Success, now);
        }
        assert_eq!(b.state(now), Closed);
        // They are not in the window's ratio: 100 refusals among 10 calls' window.
        let b = breaker(config());
        for _ in 0..100 {
            call(&b, Outcome::Refused, now);
        }
        assert_eq!(b.state(now), Closed);
        for _ in 0..9 {
            call(&b, Outcome::Success, now);
        }
        call(&b, Outcome::Failure, now);
        assert_eq!(b.state(now), Closed);
    }

    #[test]
    fn a_refused_probe_is_a_failed_probe() {
        let now = Instant::now();
        let b = breaker(config());
        tripped(&b, now);
        let later = now + 5 * SEC;
        let probe = b.try_acquire(later).expect("the probe");
        assert!(probe.is_probe());
        assert_eq!(b.record(probe, Outcome::Refused, later), t(HalfOpen, Open));
    }

    #[test]
    fn builder_rejects_out_of_range_values() {
        let b = BreakerConfig::builder;
        let cases = [
            (b().window(Duration::from_millis(9)), "window"),
            (b().window(Duration::from_secs(366 * 86_400)), "window"),
            (b().min_throughput(0), "min_throughput"),
            (b().failure_ratio(0.0), "failure_ratio"),
            (b().failure_ratio(1.01), "failure_ratio"),
            (b().failure_ratio(f64::NAN), "failure_ratio"),
            (b().failure_ratio(f64::INFINITY), "failure_ratio"),
            (b().consecutive_failures(0), "consecutive_failures"),
            (b().break_duration(Duration::ZERO), "break_duration"),
            (
                b().break_duration(SEC * 10).max_break_duration(SEC * 9),
                "max_break_duration",
            ),
            (b().probes(0), "probes"),
            (b().probes(65_536), "probes"),
            (b().jitter(-0.1), "jitter"),
            (b().jitter(1.5), "jitter"),
            (b().jitter(f64::NAN), "jitter"),
        ];
        for (builder, field) in cases {
            let err = builder.build().expect_err(field);
            assert_eq!(err.field(), field, "{err}");
        }
        assert_eq!(
            b().probes(0).build().expect_err("probes").to_string(),
            "invalid probes: 0 (allowed: from 1 to 65535)"
        );
        assert_eq!(
            b().break_duration(SEC * 10)
                .max_break_duration(SEC)
                .build()
                .expect_err("max")
                .to_string(),
            "invalid max_break_duration: 1s (allowed: at least break_duration, 10s)"
        );
        // The edges are accepted.
        let ok = b()
            .failure_ratio(1.0)
            .consecutive_failures(None)
            .consecutive_failures(1)
            .probes(65_535)
            .jitter(1.0)
            .window(Duration::from_millis(10))
            .break_duration(SEC)
            .max_break_duration(SEC)
            .build()
            .expect("edges are valid");
        assert_eq!(ok.consecutive_failures(), Some(1));
    }

    #[test]
    fn stays_closed_below_min_throughput() {
        let b = breaker(config());
        let now = Instant::now();
        for _ in 0..9 {
            assert_eq!(call(&b, Outcome::Failure, now), None);
        }
        assert_eq!(b.state(now), Closed);
        assert_eq!(call(&b, Outcome::Failure, now), t(Closed, Open));
    }

    #[test]
    fn opens_when_the_failure_ratio_is_reached() {
        let b = breaker(config());
        let now = Instant::now();
        for _ in 0..5 {
            call(&b, Outcome::Success, now);
        }
        for _ in 0..4 {
            assert_eq!(call(&b, Outcome::Failure, now), None);
        }
        // 9 calls: below min throughput. The tenth, a failure, makes 5/10 = 0.5.
        assert_eq!(call(&b, Outcome::Failure, now), t(Closed, Open));
    }

    #[test]
    fn stays_closed_below_the_ratio() {
        let b = breaker(config().failure_ratio(0.6));
        let now = Instant::now();
        for i in 0..100 {
            let outcome = if i % 2 == 0 {
                Outcome::Failure
            } else {
                Outcome::Success
            };
            assert_eq!(call(&b, outcome, now), None);
        }
        assert_eq!(b.state(now), Closed);
    }

    #[test]
    fn ignored_outcomes_are_not_counted() {
        let b = breaker(config());
        let now = Instant::now();
        for _ in 0..100 {
            call(&b, Outcome::Ignored, now);
        }
        for _ in 0..9 {
            call(&b, Outcome::Failure, now);
        }
        // 100 ignored calls neither count towards min throughput nor dilute the ratio.
        assert_eq!(b.state(now), Closed);
        assert_eq!(call(&b, Outcome::Failure, now), t(Closed, Open));
    }

    #[test]
    fn consecutive_failures_open_regardless_of_throughput() {
        let b = breaker(config().min_throughput(1000).consecutive_failures(3));
        let now = Instant::now();
        call(&b, Outcome::Failure, now);
        call(&b, Outcome::Failure, now);
        call(&b, Outcome::Success, now);
        call(&b, Outcome::Failure, now);
        assert_eq!(call(&b, Outcome::Failure, now), None);
        assert_eq!(call(&b, Outcome::Failure, now), t(Closed, Open));
    }

    #[test]
    fn outcomes_leave_the_window() {
        let b = breaker(config());
        let t0 = Instant::now();
        for _ in 0..9 {
            call(&b, Outcome::Failure, t0);
        }
        // Ten seconds later the first bucket has left the ten-second window.
        let later = t0 + SEC * 10;
        assert_eq!(call(&b, Outcome::Failure, later), None);
        assert_eq!(b.state(later), Closed);
        // Half the window later, failures still count.
        let b = breaker(config());
        for _ in 0..9 {
            call(&b, Outcome::Failure, t0);
        }
        assert_eq!(call(&b, Outcome::Failure, t0 + SEC * 9), t(Closed, Open));
    }

    #[test]
    fn open_fails_fast_with_the_time_left() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let rejected = b.try_acquire(t0 + SEC * 2).expect_err("open");
        assert_eq!(rejected.remaining, SEC * 3);
        assert_eq!(rejected.state, Open);
        assert_eq!(rejected.transition, None);
        assert!(rejected.to_string().contains("open"));
        assert_eq!(b.check(t0 + SEC).expect_err("open").remaining, SEC * 4);
        let just_before = t0 + SEC * 5 - Duration::from_nanos(1);
        assert_eq!(b.state(just_before), Open);
        assert!(b.try_acquire(just_before).is_err());
    }

    #[test]
    fn half_open_after_the_break_admits_one_probe() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let after = t0 + SEC * 5;
        assert_eq!(b.state(after), HalfOpen, "lazily half-open");
        assert_eq!(b.check(after), Ok(()));
        let probe = b.try_acquire(after).expect("probe");
        assert!(probe.is_probe());
        assert_eq!(probe.transition(), t(Open, HalfOpen));
        let rejected = b.try_acquire(after).expect_err("one probe only");
        assert_eq!(rejected.state, HalfOpen);
        assert_eq!(rejected.remaining, Duration::ZERO);
        assert!(b.check(after).is_err());
        assert_eq!(
            b.record(probe, Outcome::Success, after),
            t(HalfOpen, Closed)
        );
        assert_eq!(b.state(after), Closed);
    }

    #[test]
    fn closing_clears_the_window() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let after = t0 + SEC * 5;
        let probe = b.try_acquire(after).expect("probe");
        b.record(probe, Outcome::Success, after);
        // The ten failures before the trip are forgotten: nine more do not trip it.
        for _ in 0..9 {
            assert_eq!(call(&b, Outcome::Failure, after), None);
        }
        assert_eq!(call(&b, Outcome::Failure, after), t(Closed, Open));
    }

    #[test]
    fn failed_probes_double_the_break_up_to_the_max() {
        let b = breaker(config());
        let mut now = Instant::now();
        tripped(&b, now);
        let mut expected = Vec::new();
        let mut observed = Vec::new();
        for length in [5, 10, 20, 30, 30] {
            expected.push(SEC * length);
            // Still open one nanosecond before the end, half-open at the end.
            let end = now + SEC * length;
            assert_eq!(b.state(end - Duration::from_nanos(1)), Open);
            let rejected = b.try_acquire(now).expect_err("open");
            observed.push(rejected.remaining);
            let probe = b.try_acquire(end).expect("probe");
            assert_eq!(b.record(probe, Outcome::Failure, end), t(HalfOpen, Open));
            now = end;
        }
        assert_eq!(observed, expected);
    }

    #[test]
    fn a_close_resets_the_break_to_base() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let t1 = t0 + SEC * 5;
        let probe = b.try_acquire(t1).expect("probe");
        b.record(probe, Outcome::Failure, t1); // break now 10 s
        let t2 = t1 + SEC * 10;
        let probe = b.try_acquire(t2).expect("probe");
        b.record(probe, Outcome::Success, t2);
        tripped(&b, t2);
        assert_eq!(b.try_acquire(t2).expect_err("open").remaining, SEC * 5);
    }

    #[test]
    fn all_probes_must_succeed() {
        let b = breaker(config().probes(3));
        let t0 = Instant::now();
        tripped(&b, t0);
        let now = t0 + SEC * 5;
        let p1 = b.try_acquire(now).expect("probe 1");
        let p2 = b.try_acquire(now).expect("probe 2");
        let p3 = b.try_acquire(now).expect("probe 3");
        assert!(b.try_acquire(now).is_err());
        assert_eq!(b.record(p1, Outcome::Success, now), None);
        // A success keeps its slot: still only three probes per half-open period.
        assert!(b.try_acquire(now).is_err());
        assert_eq!(b.record(p2, Outcome::Success, now), None);
        assert_eq!(b.state(now), HalfOpen);
        assert_eq!(b.record(p3, Outcome::Success, now), t(HalfOpen, Closed));

        // One failure among the probes re-opens, and later outcomes of the same
        // half-open period are ignored.
        tripped(&b, now);
        let later = now + SEC * 5;
        let p1 = b.try_acquire(later).expect("probe 1");
        let p2 = b.try_acquire(later).expect("probe 2");
        assert_eq!(b.record(p1, Outcome::Failure, later), t(HalfOpen, Open));
        assert_eq!(b.record(p2, Outcome::Success, later), None);
        assert_eq!(b.state(later), Open);
    }

    #[test]
    fn ignored_or_released_probes_free_their_slot() {
        let b = breaker(config());
        let t0 = Instant::now();
        tripped(&b, t0);
        let now = t0 + SEC * 5;
        let probe = b.try_acquire(now).expect("probe");
        assert_eq!(b.record(probe, Outcome::Ignored, now), None);
        assert_eq!(b.state(now), HalfOpen);
        let probe = b
            .try_acquire(now)
            .expect("slot freed by an ignored outcome");
        b.release(probe);
        let probe = b.try_acquire(now).expect("slot freed by release");
        assert_eq!(b.record(probe, Outcome::Success, now), t(HalfOpen, Closed));
    }

    #[test]
    fn outcomes_from_an_earlier_period_are_ignored() {
        let b = breaker(config());
        let t0 = Instant::now();
        let slow = b.try_acquire(t0).expect("closed");
        tripped(&b, t0);
        // A call started while closed fails after the trip: it changes nothing.
        assert_eq!(b.record(slow, Outcome::Failure, t0), None);
        let now = t0 + SEC * 5;
        let slow = b.try_acquire(t0).expect_err("open");
        assert_eq!(slow.state, Open);
        let probe = b.try_acquire(now).expect("probe");
        b.reset();
        // A probe from before a reset neither closes nor opens the new period.
        assert_eq!(b.record(probe, Outcome::Failure, now), None);
        assert_eq!(b.state(now), Closed);
        // Releasing a normal permit is a no-op.
        let permit = b.try_acquire(now).expect("closed");
        b.release(permit);
    }

    #[test]
    fn isolate_and_reset() {
        let b = breaker(config());
        let now = Instant::now();
        assert_eq!(b.reset(), None);
        assert_eq!(b.isolate(), t(Closed, Isolated));
        assert_eq!(b.isolate(), None);
        let rejected = b.try_acquire(now + SEC * 1000).expect_err("isolated");
        assert_eq!(rejected.state, Isolated);
        assert_eq!(rejected.remaining, Duration::ZERO);
        assert_eq!(b.state(now + SEC * 1000), Isolated);
        assert_eq!(b.reset(), t(Isolated, Closed));
        assert!(b.try_acquire(now).is_ok_and(|p| !p.is_probe()));

        // Reset from open empties the window and restores the base break.
        tripped(&b, now);
        let probe = b.try_acquire(now + SEC * 5).expect("probe");
        b.record(probe, Outcome::Failure, now + SEC * 5);
        assert_eq!(b.reset(), t(Open, Closed));
        tripped(&b, now + SEC * 6);
        assert_eq!(
            b.try_acquire(now + SEC * 6).expect_err("open").remaining,
            SEC * 5
        );
        // Isolate from half-open.
        assert!(b.try_acquire(now + SEC * 11).is_ok_and(|p| p.is_probe()));
        assert_eq!(b.isolate(), t(HalfOpen, Isolated));
    }

    #[test]
    fn jitter_stretches_breaks_within_bounds_and_is_seeded() {
        let lengths = |seed| {
            let b = Breaker::with_seed(config().jitter(0.2).build().expect("valid"), seed);
            let mut now = Instant::now();
            tripped(&b, now);
            let mut lengths = vec![b.try_acquire(now).expect_err("open").remaining];
            for _ in 0..6 {
                now += lengths.last().copied().unwrap_or_default();
                let probe = b.try_acquire(now).expect("probe");
                b.record(probe, Outcome::Failure, now);
                lengths.push(b.try_acquire(now).expect_err("open").remaining);
            }
            lengths
        };
        let a = lengths(1);
        assert_eq!(a, lengths(1), "same seed, same breaks");
        assert_ne!(a, lengths(2), "different seeds, different breaks");
        for (length, base) in a.iter().zip([5, 10, 20, 30, 30, 30, 30]) {
            let base = SEC * base;
            assert!(
                *length >= base && *length <= base.mul_f64(1.2),
                "{length:?} vs {base:?}"
            );
        }
    }

    #[test]
    fn a_year_of_silence_costs_nothing_special() {
        let b = breaker(config());
        let t0 = Instant::now();
        for _ in 0..9 {
            call(&b, Outcome::Failure, t0);
        }
        let year = t0 + SEC * 365 * 86_400;
        // The old failures are out of the window, even after 2^20+ epochs.
        for _ in 0..9 {
            assert_eq!(call(&b, Outcome::Failure, year), None);
        }
        assert_eq!(call(&b, Outcome::Failure, year), t(Closed, Open));
        let rejected = b.try_acquire(year + SEC).expect_err("open");
        assert_eq!(rejected.remaining, SEC * 4);
    }

    #[test]
    fn counts_from_a_lap_long_ago_are_not_mistaken_for_current_ones() {
        // Bucket tags wrap every 2^20 epochs; ten buckets make the same slot and tag
        // come back after 5 × 2^20 epochs (one-second buckets here).
        let b = breaker(config());
        let t0 = Instant::now();
        for _ in 0..9 {
            call(&b, Outcome::Failure, t0);
        }
        let lap = t0 + SEC * 5 * (1 << 20);
        for _ in 0..9 {
            assert_eq!(call(&b, Outcome::Failure, lap), None);
        }
        assert_eq!(b.window.sum(0), (9, 9));
    }

    #[test]
    fn a_clock_going_backwards_is_harmless() {
        let b = breaker(config());
        let t0 = Instant::now() + SEC * 100;
        call(&b, Outcome::Success, t0);
        for i in 0..9u32 {
            call(&b, Outcome::Failure, t0 - SEC * i);
        }
        // Counted in the newest bucket: 10 calls, 9 failures.
        assert_eq!(b.state(t0), Open);
        // A time before the origin is read as the origin.
        let b = breaker(config());
        call(&b, Outcome::Success, t0);
        assert!(b.try_acquire(t0 - SEC * 50).is_ok());
    }

    #[test]
    fn names_settings_and_debug_read_back() {
        let names = [Closed, Open, HalfOpen, Isolated].map(|s| (s.as_str(), s.to_string()));
        assert_eq!(
            names.map(|(name, shown)| {
                assert_eq!(name, shown);
                name
            }),
            ["closed", "open", "half-open", "isolated"]
        );
        assert_eq!(
            Transition {
                from: HalfOpen,
                to: Closed
            }
            .to_string(),
            "half-open -> closed"
        );
        let b = breaker(config().probes(3));
        assert_eq!(b.config().probes(), 3);
        assert_eq!(b.config(), &config().probes(3).build().expect("valid"));
        let shown = format!("{b:?}");
        assert!(
            shown.starts_with("Breaker { state: Closed, probes_in_flight: 0, config: ")
                && shown.contains("probes: 3"),
            "{shown}"
        );
    }

    #[test]
    fn the_window_may_be_up_to_365_days_inclusive() {
        let year = Duration::from_secs(365 * 86_400);
        assert!(BreakerConfig::builder().window(year).build().is_ok());
        assert!(BreakerConfig::builder()
            .window(year + Duration::from_nanos(1))
            .build()
            .is_err());
    }

    #[test]
    fn an_outcome_on_the_edge_of_a_bucket_counts_in_the_later_one() {
        // One-second buckets: a failure at exactly 1 s is in the second bucket, so it is
        // still in the window 10 s after the origin, when the first bucket has left it.
        let w = window::Window::new(Duration::from_secs(10));
        w.record(0, true);
        w.record(SEC.as_nanos() as u64, true);
        assert_eq!(w.sum(9), (2, 2));
        assert_eq!(w.sum(10), (1, 1));
        assert_eq!(w.sum(11), (0, 0));
    }

    #[test]
    fn an_outcome_from_behind_the_newest_bucket_counts_in_it() {
        // After a call at 5 s, one reported at 3 s (a slow clock read, say) is counted
        // with the newest bucket and leaves the window with it.
        let w = window::Window::new(Duration::from_secs(10));
        w.record(5 * SEC.as_nanos() as u64, false);
        w.record(3 * SEC.as_nanos() as u64, true);
        assert_eq!(w.sum(5), (2, 1));
        assert_eq!(w.sum(14), (2, 1));
        assert_eq!(w.sum(15), (0, 0));
    }

    #[test]
    fn a_bucket_stops_counting_at_its_cap_and_keeps_its_ratio() {
        let w = window::Window::new(Duration::from_secs(10));
        let cap = 1u64 << 21;
        for i in 0..cap + 5 {
            w.record(0, i % 2 == 0);
        }
        assert_eq!(w.sum(0), (cap, cap / 2));
    }

    #[test]
    fn calls_from_a_closed_period_are_ignored_after_the_circuit_closes_again() {
        // Ten calls start while closed and end, failed, only after the circuit has
        // tripped and closed twice: the new closed period ignores them.
        let b = breaker(config());
        let mut now = Instant::now();
        let stale: Vec<Permit> = (0..10)
            .map(|_| b.try_acquire(now).expect("closed"))
            .collect();
        for _ in 0..2 {
            tripped(&b, now);
            now += SEC * 5;
            let probe = b.try_acquire(now).expect("probe");
            assert_eq!(b.record(probe, Outcome::Success, now), t(HalfOpen, Closed));
        }
        for permit in stale {
            assert_eq!(b.record(permit, Outcome::Failure, now), None);
        }
        assert_eq!(b.state(now), Closed);
        assert_eq!(b.window.sum(0), (0, 0));
    }

    #[test]
    fn probes_of_an_earlier_half_open_period_take_no_slot_and_close_nothing() {
        let b = breaker(config().probes(3));
        let t0 = Instant::now();
        tripped(&b, t0);
        let now = t0 + SEC * 5;
        let old_ignored = b.try_acquire(now).expect("probe");
        let old_success = b.try_acquire(now).expect("probe");
        let failed = b.try_acquire(now).expect("probe");
        assert_eq!(b.record(failed, Outcome::Failure, now), t(HalfOpen, Open));
        // The failed probe doubled the break.
        let later = now + SEC * 10;
        let p1 = b.try_acquire(later).expect("probe");
        let p2 = b.try_acquire(later).expect("probe");
        assert!(b.check(later).is_ok(), "a third slot is free");
        let p3 = b.try_acquire(later).expect("probe");
        assert!(b.check(later).is_err());
        // The earlier period's probes end now: neither frees a slot of this one, nor
        // counts toward closing it.
        assert_eq!(b.record(old_ignored, Outcome::Ignored, later), None);
        assert!(b.try_acquire(later).is_err(), "no slot freed");
        assert_eq!(b.record(old_success, Outcome::Success, later), None);
        assert_eq!(b.record(p1, Outcome::Success, later), None);
        // A success keeps its slot.
        assert!(b.check(later).is_err());
        assert!(b.try_acquire(later).is_err());
        assert_eq!(b.record(p2, Outcome::Success, later), None);
        assert_eq!(b.state(later), HalfOpen);
        assert_eq!(b.record(p3, Outcome::Success, later), t(HalfOpen, Closed));
    }

    #[test]
    fn each_break_draws_its_own_stretch() {
        // Breaks of a fixed 5 s (the cap is the base): what differs between them is the
        // jitter alone, drawn afresh for each.
        let b = Breaker::with_seed(
            config()
                .jitter(0.2)
                .max_break_duration(SEC * 5)
                .build()
                .expect("valid"),
            1,
        );
        let mut now = Instant::now();
        tripped(&b, now);
        let mut breaks = Vec::new();
        for _ in 0..8 {
            let remaining = b.try_acquire(now).expect_err("open").remaining;
            assert!(remaining >= SEC * 5 && remaining <= (SEC * 5).mul_f64(1.2));
            breaks.push(remaining);
            now += remaining;
            let probe = b.try_acquire(now).expect("probe");
            assert_eq!(b.record(probe, Outcome::Failure, now), t(HalfOpen, Open));
        }
        let mut distinct = breaks.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), breaks.len(), "{breaks:?}");
    }

    #[test]
    fn concurrent_callers_race_for_exactly_the_probe_slots() {
        for probes in [1, 3, 7] {
            let b = Arc::new(breaker(config().probes(probes)));
            let t0 = Instant::now();
            tripped(&b, t0);
            let now = t0 + SEC * 5;
            let barrier = Arc::new(Barrier::new(100));
            let admitted: u32 = std::thread::scope(|s| {
                let handles: Vec<_> = (0..100)
                    .map(|_| {
                        let (b, barrier) = (&b, &barrier);
                        s.spawn(move || {
                            barrier.wait();
                            match b.try_acquire(now) {
                                // Never recorded nor released: the slot stays taken.
                                Ok(permit) => u32::from(permit.is_probe()),
                                Err(rejected) => {
                                    assert_eq!(rejected.state, HalfOpen);
                                    0
                                }
                            }
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("thread")).sum()
            });
            assert_eq!(admitted, probes);
        }
    }

    #[test]
    fn concurrent_outcomes_are_all_counted() {
        let b = Arc::new(breaker(
            config().min_throughput(8 * 1000 + 1).failure_ratio(0.5),
        ));
        let now = Instant::now();
        std::thread::scope(|s| {
            for i in 0..8 {
                let b = &b;
                s.spawn(move || {
                    for _ in 0..1000 {
                        let outcome = if i % 2 == 0 {
                            Outcome::Success
                        } else {
                            Outcome::Failure
                        };
                        call(b, outcome, now);
                    }
                });
            }
        });
        assert_eq!(b.window.sum(0), (8000, 4000));
        assert_eq!(b.state(now), Closed);
        assert_eq!(call(&b, Outcome::Failure, now), t(Closed, Open));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Acquire,
            Record(usize, Outcome),
            Release(usize),
            Advance(u64),
            Isolate,
            Reset,
        }

        fn op() -> impl Strategy<Value = Op> {
            let outcome = prop_oneof![
                Just(Outcome::Success),
                Just(Outcome::Failure),
                Just(Outcome::Ignored)
            ];
            prop_oneof![
                8 => Just(Op::Acquire),
                8 => (any::<usize>(), outcome).prop_map(|(i, o)| Op::Record(i, o)),
                2 => any::<usize>().prop_map(Op::Release),
                4 => (0u64..8_000).prop_map(Op::Advance),
                1 => Just(Op::Isolate),
                1 => Just(Op::Reset),
            ]
        }

        /// Checks a reported transition against the last known state, and moves on.
        fn seen(
            t: Option<Transition>,
            by_reset: bool,
            period: &mut u32,
            stored: &mut CircuitState,
        ) -> Result<(), TestCaseError> {
            if let Some(t) = t {
                prop_assert_eq!(t.from, *stored, "transitions chain");
                prop_assert_ne!(t.from, t.to);
                if t.from == Open && t.to == Closed {
                    prop_assert!(by_reset, "Open -> Closed only by reset");
                }
                if t.from == Isolated {
                    prop_assert!(by_reset, "Isolated is left only by reset");
                }
                if t.from == Closed {
                    prop_assert!(t.to == Open || t.to == Isolated);
                }
                if t.to == HalfOpen {
                    prop_assert_eq!(t.from, Open);
                }
                *stored = t.to;
                *period += 1;
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            #[test]
            fn probes_are_bounded_and_open_never_closes_directly(
                ops in proptest::collection::vec(op(), 1..200),
                probes in 1u32..4,
                streak in proptest::option::of(1u32..4),
                seed in any::<u64>(),
            ) {
                let config = BreakerConfig::builder()
                    .min_throughput(3)
                    .failure_ratio(0.5)
                    .consecutive_failures(streak)
                    .window(Duration::from_secs(4))
                    .break_duration(Duration::from_secs(1))
                    .max_break_duration(Duration::from_secs(4))
                    .probes(probes)
                    .jitter(0.2)
                    .build()
                    .expect("valid");
                let b = Breaker::with_seed(config, seed);
                let mut now = Instant::now();
                // Outstanding permits, with the period (count of transitions) they
                // were issued in.
                let mut permits: Vec<(Permit, u32)> = Vec::new();
                let mut period = 0u32;
                let mut stored = Closed;
                for op in ops {
                    match op {
                        Op::Acquire => match b.try_acquire(now) {
                            Ok(permit) => {
                                seen(permit.transition(), false, &mut period, &mut stored)?;
                                prop_assert_eq!(permit.is_probe(), stored == HalfOpen);
                                permits.push((permit, period));
                            }
                            Err(rejected) => {
                                seen(rejected.transition, false, &mut period, &mut stored)?;
                                prop_assert_eq!(rejected.state, stored);
                                prop_assert_ne!(stored, Closed);
                            }
                        },
                        Op::Record(i, outcome) if !permits.is_empty() => {
                            let (permit, _) = permits.swap_remove(i % permits.len());
                            let t = b.record(permit, outcome, now);
                            seen(t, false, &mut period, &mut stored)?;
                        }
                        Op::Release(i) if !permits.is_empty() => {
                            let (permit, _) = permits.swap_remove(i % permits.len());
                            b.release(permit);
                        }
                        Op::Record(..) | Op::Release(_) => {}
                        Op::Advance(ms) => now += Duration::from_millis(ms),
                        Op::Isolate => seen(b.isolate(), false, &mut period, &mut stored)?,
                        Op::Reset => seen(b.reset(), true, &mut period, &mut stored)?,
                    }
                    if stored == HalfOpen {
                        let outstanding = permits
                            .iter()
                            .filter(|(p, issued)| p.is_probe() && *issued == period)
                            .count();
                        prop_assert!(outstanding as u32 <= probes, "{} probes out", outstanding);
                    }
                    let state = b.state(now);
                    if stored == Open {
                        prop_assert!(state == Open || state == HalfOpen);
                    } else {
                        prop_assert_eq!(state, stored);
                    }
                }
                // Liveness: with every permit handed back and the longest break over,
                // a caller gets through unless the circuit is isolated.
                for (permit, _) in permits.drain(..) {
                    b.release(permit);
                }
                now += Duration::from_secs(5);
                match b.try_acquire(now) {
                    Ok(permit) => b.release(permit),
                    Err(rejected) => prop_assert_eq!(rejected.state, Isolated),
                }
            }
        }
    }
}
