//! A budget for tests whose subject is not the budget.

use stormguard::RetryBudget;

/// Grants every retry or hedge these tests make: savings of a thousand retries.
pub(crate) fn roomy() -> RetryBudget {
    RetryBudget::builder()
        .allowance(1_000)
        .build()
        .expect("valid budget")
}
