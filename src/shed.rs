//! [`Shed`], the load control's refusal: a leaf that the load control, which raises it,
//! and the error classification, which recognises it wherever it sits in an error's
//! `source()` chain, both import (re-exported as `stormguard::load::Shed`).

use std::fmt;

/// The error for a call the load control shed: the calls in flight were at the limit
/// and no room came within the wait allowed. The call was never sent. Find it with
/// `err.downcast_ref::<Shed>()`; it is distinct from
/// [`CircuitOpen`](crate::CircuitOpen) (the dependency is busy, not down).
///
/// ```
/// use stormguard::load::Shed;
///
/// let err: stormguard::BoxError = Box::new(Shed::new(12, 12));
/// let shed = err.downcast_ref::<Shed>().expect("a Shed");
/// assert_eq!(shed.limit(), 12);
/// assert_eq!(err.to_string(), "load shed: 12 calls in flight at a limit of 12");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shed {
    limit: u32,
    in_flight: u32,
}

impl Shed {
    /// A call shed with `in_flight` calls in flight at a limit of `limit`.
    pub fn new(limit: u32, in_flight: u32) -> Self {
        Shed { limit, in_flight }
    }

    /// The limit when the call was shed.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The calls in flight then.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }
}

impl fmt::Display for Shed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "load shed: {} calls in flight at a limit of {}",
            self.in_flight, self.limit
        )
    }
}

impl std::error::Error for Shed {}
