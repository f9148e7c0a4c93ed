//! The state machine: admission, outcomes and transitions.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use super::config::BreakerConfig;
use super::window::Window;
use super::word::{Word, GENERATION_MASK, IN_FLIGHT_ONE, SUCCESS_ONE};
use super::{CircuitState, Outcome, Permit, Rejected, Transition};
use crate::sync::{AtomicU32, AtomicU64, Mutex, MutexGuard};

/// Re-trips beyond this many no longer change the break (it is capped long before).
const MAX_RETRIPS: u32 = 64;

/// What the transition lock guards.
#[derive(Debug)]
struct Breaks {
    /// Failed probes since the circuit last closed: the break is `base × 2^retrips`.
    retrips: u32,
}

/// The circuit-breaker state machine. See the [module docs](crate::breaker) for the rules.
///
/// All methods take `&self`; share a `Breaker` between threads in an `Arc`.
/// [`try_acquire`](Self::try_acquire) and [`record`](Self::record) are O(1); in the
/// closed state they use atomics only, and a `Mutex` is taken only to change state.
pub struct Breaker {
    config: BreakerConfig,
    word: AtomicU64,
    /// When the current break ends, in nanoseconds since the origin. Written before the
    /// Open word is published, under the lock.
    open_until: AtomicU64,
    /// When the circuit last left Closed, in nanoseconds since the origin. Written
    /// before the Open word is published, under the lock; failed probes keep it.
    opened_at: AtomicU64,
    /// When the trouble that opened the circuit began: the first of the failures in a
    /// row that ended in its opening, or the opening itself. Written with `opened_at`.
    troubled_at: AtomicU64,
    /// Failures in a row while Closed (whether or not `consecutive_failures` is on).
    consecutive: AtomicU32,
    /// When the current run of failures in a row began (while `consecutive` is not 0).
    failing_since: AtomicU64,
    pub(super) window: Window,
    origin: OnceLock<Instant>,
    seed: u64,
    breaks: Mutex<Breaks>,
}

impl fmt::Debug for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = Word(self.word.load(Ordering::Acquire));
        f.debug_struct("Breaker")
            .field("state", &word.state())
            .field("probes_in_flight", &word.in_flight())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Breaker {
    /// A closed breaker with `config`, its break jitter seeded from the thread RNG.
    pub fn new(config: BreakerConfig) -> Self {
        Self::with_seed(config, rand::rng().random())
    }

    /// A closed breaker whose break jitter is drawn from `seed`: two breakers with the
    /// same seed and the same history have breaks of the same lengths.
    pub fn with_seed(config: BreakerConfig, seed: u64) -> Self {
        Breaker {
            window: Window::new(config.window),
            config,
            word: AtomicU64::new(Word::new(CircuitState::Closed, 0).0),
            open_until: AtomicU64::new(0),
            opened_at: AtomicU64::new(0),
            troubled_at: AtomicU64::new(0),
            consecutive: AtomicU32::new(0),
            failing_since: AtomicU64::new(0),
            origin: OnceLock::new(),
            seed,
            breaks: Mutex::new(Breaks { retrips: 0 }),
        }
    }

    /// The configuration this breaker was built with.
    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// The state at `now`. An Open circuit whose break has elapsed reads as
    /// `HalfOpen`; it becomes so for good with the next [`try_acquire`](Self::try_acquire).
    pub fn state(&self, now: Instant) -> CircuitState {
        let word = self.load();
        match word.state() {
            CircuitState::Open if self.remaining(now).is_zero() => CircuitState::HalfOpen,
            state => state,
        }
    }

    /// Asks to make one call at `now`.
    ///
    /// Closed: always a normal permit. Open: rejected with the time left in the break,
    /// or, once the break is over, the circuit turns HalfOpen and this is handled as
    /// such. HalfOpen: a probe permit while fewer than `probes` probes are in flight or
    /// have succeeded, else rejected. Isolated: rejected.
    pub fn try_acquire(&self, now: Instant) -> Result<Permit, Rejected> {
        self.try_acquire_with(|| now)
    }

    /// [`try_acquire`](Self::try_acquire), reading the time from `now` only when the
    /// state needs it: a Closed circuit admits without looking at the clock.
    pub fn try_acquire_with(&self, mut now: impl FnMut() -> Instant) -> Result<Permit, Rejected> {
        let mut transition = None;
        let mut word = self.load();
        loop {
            match word.state() {
                CircuitState::Closed => {
                    return Ok(Permit {
                        probe: false,
                        generation: word.generation(),
                        transition,
                    })
                }
                CircuitState::Isolated => {
                    return Err(Rejected {
                        remaining: Duration::ZERO,
                        state: CircuitState::Isolated,
                        transition,
                        open_for: Duration::ZERO,
                        failing_for: Duration::ZERO,
                    })
                }
                CircuitState::Open => {
                    let now = now();
                    let remaining = self.remaining(now);
                    if !remaining.is_zero() {
                        return Err(self.rejected(remaining, CircuitState::Open, transition, now));
                    }
                    if let Some(t) = self.half_open(word, now) {
                        transition = Some(t);
                    }
                    word = self.load();
                }
                CircuitState::HalfOpen => {
                    if word.in_flight() + word.successes() >= self.config.probes {
                        return Err(self.rejected(
                            Duration::ZERO,
                            CircuitState::HalfOpen,
                            transition,
                            now(),
                        ));
                    }
                    match self.word.compare_exchange_weak(
                        word.0,
                        word.0 + IN_FLIGHT_ONE,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => {
                            return Ok(Permit {
                                probe: true,
                                generation: word.generation(),
                                transition,
                            })
                        }
                        Err(actual) => word = Word(actual),
                    }
                }
            }
        }
    }

    /// What [`try_acquire`](Self::try_acquire) would answer at `now`, without taking a
    /// permit or changing state. Useful to wait for readiness.
    pub fn check(&self, now: Instant) -> Result<(), Rejected> {
        self.check_with(|| now)
    }

    /// [`check`](Self::check), reading the time from `now` only when the state needs
    /// it: a Closed circuit answers without looking at the clock.
    pub fn check_with(&self, now: impl FnOnce() -> Instant) -> Result<(), Rejected> {
        let word = self.load();
        match word.state() {
            CircuitState::Closed => Ok(()),
            CircuitState::Isolated => Err(Rejected {
                remaining: Duration::ZERO,
                state: CircuitState::Isolated,
                transition: None,
                open_for: Duration::ZERO,
                failing_for: Duration::ZERO,
            }),
            CircuitState::Open => {
                let now = now();
                match self.remaining(now) {
                    remaining if remaining.is_zero() => Ok(()),
                    remaining => Err(self.rejected(remaining, CircuitState::Open, None, now)),
                }
            }
            CircuitState::HalfOpen => {
                if word.in_flight() + word.successes() < self.config.probes {
                    Ok(())
                } else {
                    Err(self.rejected(Duration::ZERO, CircuitState::HalfOpen, None, now()))
                }
            }
        }
    }

    /// Reports the outcome of the call `permit` was issued for, finished at `now`, and
    /// returns the transition it caused, if any.
    ///
    /// A normal permit counts in the window if the circuit is still in the closed
    /// period it was issued in (outcomes of calls that started before the circuit
    /// opened are ignored). A probe permit decides the half-open circuit: a failure
    /// opens it again with a doubled break, the last of `probes` successes closes it,
    /// and an ignored outcome frees the slot for another caller.
    pub fn record(&self, permit: Permit, outcome: Outcome, now: Instant) -> Option<Transition> {
        if permit.probe {
            self.record_probe(permit.generation, outcome, now)
        } else {
            self.record_call(permit.generation, outcome, now)
        }
    }

    /// Gives back a permit whose call was abandoned (cancelled, dropped) before it had
    /// an outcome. For a probe this frees its half-open slot for the next caller; for a
    /// normal permit it does nothing.
    pub fn release(&self, permit: Permit) {
        if permit.probe {
            self.release_probe(permit.generation);
        }
    }

    /// Forces the circuit open until [`reset`](Self::reset), whatever the outcomes.
    /// Returns the transition, or `None` if it was already isolated.
    pub fn isolate(&self) -> Option<Transition> {
        let _guard = self.lock();
        let word = self.load();
        if word.state() == CircuitState::Isolated {
            return None;
        }
        self.publish(word, CircuitState::Isolated)
    }

    /// Forces the circuit closed, with an empty window and the break back to its base
    /// length. Returns the transition, or `None` if it was already closed (the window
    /// is emptied all the same).
    pub fn reset(&self) -> Option<Transition> {
        let mut breaks = self.lock();
        let word = self.load();
        self.forget(&mut breaks);
        if word.state() == CircuitState::Closed {
            return None;
        }
        self.publish(word, CircuitState::Closed)
    }

    fn record_call(&self, generation: u64, outcome: Outcome, now: Instant) -> Option<Transition> {
        if !self.load().is(CircuitState::Closed, generation) {
            return None;
        }
        match outcome {
            Outcome::Ignored => None,
            Outcome::Success => {
                self.window.record(self.nanos(now), false);
                if self.consecutive.load(Ordering::Relaxed) != 0 {
                    self.consecutive.store(0, Ordering::Relaxed);
                }
                None
            }
            // In the run of failures in a row only: see `Outcome::Refused`.
            Outcome::Refused => {
                let in_a_row = self.fail_in_a_row(self.nanos(now));
                match self.config.consecutive_failures {
                    Some(limit) if in_a_row >= limit => self.trip(generation, now),
                    _ => None,
                }
            }
            Outcome::Failure => {
                let at = self.nanos(now);
                let epoch = self.window.record(at, true);
                let in_a_row = self.fail_in_a_row(at);
                let streak = self
                    .config
                    .consecutive_failures
                    .is_some_and(|limit| in_a_row >= limit);
                if streak || self.ratio_reached(epoch) {
                    self.trip(generation, now)
                } else {
                    None
                }
            }
        }
    }

    /// Counts a failure at `at` in the run of failures in a row, noting when the run
    /// began; returns the run's length so far.
    fn fail_in_a_row(&self, at: u64) -> u32 {
        let before = self.consecutive.fetch_add(1, Ordering::Relaxed);
        if before == 0 {
            self.failing_since.store(at, Ordering::Relaxed);
        }
        before.saturating_add(1)
    }

    fn ratio_reached(&self, epoch: u64) -> bool {
        let (calls, failures) = self.window.sum(epoch);
        calls > 0
            && calls >= u64::from(self.config.min_throughput)
            && failures as f64 >= self.config.failure_ratio * calls as f64
    }

    fn record_probe(&self, generation: u64, outcome: Outcome, now: Instant) -> Option<Transition> {
        match outcome {
            Outcome::Ignored => {
                self.release_probe(generation);
                None
            }
            Outcome::Failure | Outcome::Refused => {
                let mut breaks = self.lock();
                let word = self.load();
                if !word.is(CircuitState::HalfOpen, generation) {
                    return None;
                }
                breaks.retrips = (breaks.retrips + 1).min(MAX_RETRIPS);
                self.open(word, &breaks, now)
            }
            Outcome::Success => {
                let mut word = self.load();
                loop {
                    if !word.is(CircuitState::HalfOpen, generation) || word.in_flight() == 0 {
                        return None;
                    }
                    if word.successes() + 1 >= self.config.probes {
                        return self.close(generation);
                    }
                    let next = word.0 - IN_FLIGHT_ONE + SUCCESS_ONE;
                    match self.word.compare_exchange_weak(
                        word.0,
                        next,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return None,
                        Err(actual) => word = Word(actual),
                    }
                }
            }
        }
    }

    fn release_probe(&self, generation: u64) {
        let mut word = self.load();
        while word.is(CircuitState::HalfOpen, generation) && word.in_flight() > 0 {
            match self.word.compare_exchange_weak(
                word.0,
                word.0 - IN_FLIGHT_ONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(actual) => word = Word(actual),
            }
        }
    }

    /// Closed to Open, if the circuit is still in the closed period `generation`.
    fn trip(&self, generation: u64, now: Instant) -> Option<Transition> {
        let breaks = self.lock();
        let word = self.load();
        if !word.is(CircuitState::Closed, generation) {
            return None;
        }
        self.open(word, &breaks, now)
    }

    /// Open to HalfOpen, if `seen` is still current and its break is over.
    fn half_open(&self, seen: Word, now: Instant) -> Option<Transition> {
        let _guard = self.lock();
        let word = self.load();
        if !word.is(CircuitState::Open, seen.generation()) || !self.remaining(now).is_zero() {
            return None;
        }
        self.publish(word, CircuitState::HalfOpen)
    }

    /// HalfOpen to Closed after the last probe succeeded.
    fn close(&self, generation: u64) -> Option<Transition> {
        let mut breaks = self.lock();
        let word = self.load();
        if !word.is(CircuitState::HalfOpen, generation) {
            return None;
        }
        self.forget(&mut breaks);
        self.publish(word, CircuitState::Closed)
    }

    /// Starts a break of `base × 2^retrips`, jittered; the caller holds the lock.
    fn open(&self, word: Word, breaks: &Breaks, now: Instant) -> Option<Transition> {
        let next_generation = (word.generation() + 1) & GENERATION_MASK;
        let length = self.break_length(breaks.retrips, next_generation);
        let at = self.nanos(now);
        if word.state() == CircuitState::Closed {
            let since = match self.consecutive.load(Ordering::Relaxed) {
                0 => at,
                _ => self.failing_since.load(Ordering::Relaxed).min(at),
            };
            self.troubled_at.store(since, Ordering::Release);
            self.opened_at.store(at, Ordering::Release);
        }
        self.open_until
            .store(at.saturating_add(length), Ordering::Release);
        self.consecutive.store(0, Ordering::Relaxed);
        self.publish(word, CircuitState::Open)
    }

    /// The break after `retrips` failed probes, in nanoseconds, jittered with a draw
    /// keyed by the seed and the generation of the Open period (no RNG state to lock).
    fn break_length(&self, retrips: u32, generation: u64) -> u64 {
        let base = self.config.break_duration.as_nanos();
        let max = self.config.max_break_duration.as_nanos();
        let doubled = match 1u128.checked_shl(retrips) {
            Some(factor) => base.saturating_mul(factor).min(max),
            None => max,
        };
        let doubled = u64::try_from(doubled).unwrap_or(u64::MAX);
        if self.config.jitter <= 0.0 {
            return doubled;
        }
        let mut rng =
            SmallRng::seed_from_u64(self.seed ^ generation.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let stretch: f64 = rng.random_range(0.0..=self.config.jitter);
        // Float-to-int casts saturate.
        doubled.saturating_add((doubled as f64 * stretch) as u64)
    }

    /// Empties the window and brings the break back to its base; the caller holds the lock.
    fn forget(&self, breaks: &mut Breaks) {
        breaks.retrips = 0;
        self.window.clear();
        self.consecutive.store(0, Ordering::Relaxed);
    }

    /// Moves from `seen` to `to` in the next generation, unless `seen`'s state or
    /// generation is gone. The caller holds the lock, so only probe bookkeeping can
    /// change the word meanwhile, and that is retried.
    fn publish(&self, mut seen: Word, to: CircuitState) -> Option<Transition> {
        loop {
            let next = Word::new(to, seen.generation() + 1);
            match self
                .word
                .compare_exchange(seen.0, next.0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Some(Transition {
                        from: seen.state(),
                        to,
                    })
                }
                Err(actual) => {
                    let actual = Word(actual);
                    if !actual.is(seen.state(), seen.generation()) {
                        return None;
                    }
                    seen = actual;
                }
            }
        }
    }

    /// Why a circuit away from Closed (Open or HalfOpen) refused a call at `now`.
    fn rejected(
        &self,
        remaining: Duration,
        state: CircuitState,
        transition: Option<Transition>,
        now: Instant,
    ) -> Rejected {
        let now = self.nanos(now);
        let since =
            |at: &AtomicU64| Duration::from_nanos(now.saturating_sub(at.load(Ordering::Acquire)));
        Rejected {
            remaining,
            state,
            transition,
            open_for: since(&self.opened_at),
            failing_for: since(&self.troubled_at),
        }
    }

    fn remaining(&self, now: Instant) -> Duration {
        let until = self.open_until.load(Ordering::Acquire);
        Duration::from_nanos(until.saturating_sub(self.nanos(now)))
    }

    fn load(&self) -> Word {
        Word(self.word.load(Ordering::Acquire))
    }

    fn lock(&self) -> MutexGuard<'_, Breaks> {
        // The guarded data is a counter that is always valid; a panic elsewhere while
        // holding the lock must not wedge the breaker.
        self.breaks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Nanoseconds from the origin (the first `now` this breaker saw) to `now`.
    fn nanos(&self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_init(|| now);
        u64::try_from(now.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX)
    }
}
