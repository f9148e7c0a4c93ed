//! A budget for tests whose subject is not the budget.

use stormguard::RetryBudget;

/// Grants every retry or hedge these tests make: ten a second over the window, unpaced.
pub(crate) fn roomy() -> RetryBudget {
    RetryBudget::builder()
        .min_per_sec(10)
        .pace(None)
        .build()
        .expect("valid budget")
}
