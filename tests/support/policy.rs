//! A retry policy for tests against real servers: short full-jitter waits, seeded.

use std::time::Duration;

use stormguard::{retry::RetryPolicyBuilder, Backoff, Jitter, RetryPolicy};

/// Waits of 5 to 50 ms, drawn from streams derived from `seed`, and a budget that
/// grants every retry these tests make (ten a second, unpaced): what is tested here is
/// the retry layer against real servers, not the budget's limits.
pub(crate) fn fast_policy(seed: u64) -> RetryPolicyBuilder {
    let backoff = Backoff::new(
        Duration::from_millis(5),
        Duration::from_millis(50),
        Jitter::Full,
    )
    .expect("valid backoff");
    RetryPolicy::builder()
        .backoff(backoff)
        .budget(super::budget::roomy())
        .seed(seed)
}
