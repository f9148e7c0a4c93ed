//! Why the retry layer gave up: decided in `stormguard_core::retry`, shared by the retry
//! layer, its metrics and the signals.

pub use stormguard_core::retry::GiveUp;
