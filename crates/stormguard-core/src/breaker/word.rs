//! The circuit word: the state, the half-open bookkeeping and a generation in one atomic.

use super::CircuitState;

// The circuit word: state, half-open bookkeeping and a generation, in one `AtomicU64`
// so that a probe slot is taken or given back with a single compare-and-swap.
//
//   bits 0..2    state
//   bits 2..18   probes in flight
//   bits 18..34  probes that succeeded
//   bits 34..64  generation, bumped on every transition (wraps)
//
// A permit carries the generation it was issued in; an outcome reported in a later
// generation (the circuit has moved on since) is ignored.
pub(super) const STATE_MASK: u64 = 0b11;
pub(super) const IN_FLIGHT_ONE: u64 = 1 << 2;
pub(super) const SUCCESS_ONE: u64 = 1 << 18;
const GENERATION_SHIFT: u32 = 34;
pub(super) const GENERATION_MASK: u64 = (1 << (64 - GENERATION_SHIFT)) - 1;
const FIELD_MASK: u64 = 0xFFFF;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Word(pub(super) u64);

impl Word {
    pub(super) fn new(state: CircuitState, generation: u64) -> Self {
        Word(((generation & GENERATION_MASK) << GENERATION_SHIFT) | state.bits())
    }

    pub(super) fn state(self) -> CircuitState {
        CircuitState::from_bits(self.0)
    }

    pub(super) fn in_flight(self) -> u32 {
        ((self.0 >> 2) & FIELD_MASK) as u32
    }

    pub(super) fn successes(self) -> u32 {
        ((self.0 >> 18) & FIELD_MASK) as u32
    }

    pub(super) fn generation(self) -> u64 {
        self.0 >> GENERATION_SHIFT
    }

    pub(super) fn is(self, state: CircuitState, generation: u64) -> bool {
        self.state() == state && self.generation() == generation
    }
}
