//! The synchronisation primitives the budget and the breaker share between threads:
//! std's, or loom's when the crate's unit tests are built with `--cfg loom` so that the
//! model in `loom_model` can explore every interleaving of them.

#[cfg(all(loom, test))]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
#[cfg(all(loom, test))]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::{Mutex, MutexGuard};
