//! [`CircuitOpen`], the breaker's refusal: a leaf that the breaker, which raises it, and
//! the error classification, which recognises it wherever it sits in an error's
//! `source()` chain, both import (re-exported as `stormguard::breaker::CircuitOpen`).

use std::fmt;
use std::time::Duration;

use stormguard_core::breaker::CircuitState;

/// The error returned, boxed in a [`BoxError`](crate::BoxError), for a call the circuit breaker refused
/// without calling the inner service.
///
/// Find it with `err.downcast_ref::<CircuitOpen>()`. The retry layer waits out a break
/// that ends before the backoff's next wait: a refused retry without counting it as an
/// attempt, up to as many refusals as the request has retries, a refused first call as
/// a retry the budget admits; either is sent again about four times the circuit's age
/// later ([`open_for`](Self::open_for)). Before that, a first call refused within a break of
/// the break's end waits for the probe's verdict, free: once, and again each time it
/// then meets a probe still deciding, up to a [`break_duration`](Self::break_duration)
/// each time and all within its first backoff's ceiling. Otherwise, and for an
/// isolated circuit, it gives up (`GiveUp::CircuitOpen`); see the [`retry` module](crate::retry#an-open-circuit-below).
///
/// ```
/// use std::time::Duration;
/// use stormguard::CircuitOpen;
///
/// let err: Box<dyn std::error::Error + Send + Sync> =
///     Box::new(CircuitOpen::new(Duration::from_secs(3)));
/// let open = err.downcast_ref::<CircuitOpen>().expect("a CircuitOpen");
/// assert_eq!(open.remaining(), Duration::from_secs(3));
/// assert_eq!(err.to_string(), "circuit breaker open: next probe in 3s");
/// assert_eq!(open.open_for(), Duration::ZERO);
/// assert_eq!(open.failing_for(), Duration::ZERO);
/// assert_eq!(open.break_duration(), Duration::ZERO);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CircuitOpen {
    pub(crate) remaining: Duration,
    pub(crate) state: CircuitState,
    pub(crate) open_for: Duration,
    pub(crate) failing_for: Duration,
    pub(crate) break_duration: Duration,
}

impl CircuitOpen {
    /// A refusal by an open circuit whose break ends in `remaining`.
    pub fn new(remaining: Duration) -> Self {
        CircuitOpen {
            remaining,
            state: CircuitState::Open,
            open_for: Duration::ZERO,
            failing_for: Duration::ZERO,
            break_duration: Duration::ZERO,
        }
    }

    /// The refusing breaker's configured break (zero if not known): a first call
    /// refused at the end of a break waits out the rest of it plus up to one of these
    /// for the probe's verdict (see [`sans_io::retry`](crate::sans_io::retry)).
    pub fn break_duration(&self) -> Duration {
        self.break_duration
    }

    /// How long the circuit had been away from Closed when it refused the call: the
    /// age of its backlog, over which the retry layer spreads the refused calls it sends
    /// again (see [`sans_io::retry`](crate::sans_io::retry)).
    pub fn open_for(&self) -> Duration {
        self.open_for
    }

    /// How long the dependency had been failing when the circuit refused the call, as
    /// the breaker saw it: [`open_for`](Self::open_for) plus the run of failures in a
    /// row that opened the circuit. Past
    /// [`FAIL_FAST_AFTER`](crate::sans_io::breaker::FAIL_FAST_AFTER) the retry layer
    /// fails the call instead of riding the refusal out (see
    /// [`sans_io::retry`](crate::sans_io::retry)). Zero if not known.
    pub fn failing_for(&self) -> Duration {
        self.failing_for
    }

    /// How long until the break is over and a probe may go through. Zero when the
    /// circuit is isolated, or half-open with every probe slot taken.
    pub fn remaining(&self) -> Duration {
        self.remaining
    }

    /// The state that refused the call: `Open`, `HalfOpen` (every probe slot taken) or
    /// `Isolated`.
    pub fn state(&self) -> CircuitState {
        self.state
    }
}

impl fmt::Display for CircuitOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.state {
            CircuitState::HalfOpen => {
                f.write_str("circuit breaker half-open: every probe slot is taken")
            }
            CircuitState::Isolated => f.write_str("circuit breaker isolated"),
            _ => write!(
                f,
                "circuit breaker open: next probe in {:?}",
                self.remaining
            ),
        }
    }
}

impl std::error::Error for CircuitOpen {}
