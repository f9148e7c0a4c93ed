//! [`RetryBudget`] for tower users who write their own retry policies.

use stormguard_core::RetryBudget;
use tower::retry::budget::Budget;

/// A [`RetryBudget`] as a [`tower::retry::budget::Budget`], reading tokio's clock (so
/// `tokio::time::pause()` applies).
///
/// Use it in place of tower's `TpsBudget` in a hand-written `tower::retry::Policy`.
/// tower's `Budget` never learns how a request ended, so every retry is charged when
/// it is granted ([`RetryBudget::try_withdraw`], the pessimistic form: a retry that
/// succeeds costs as much as one that fails), and the allowance is spent first. The
/// ratio is exact fixed point, no lock per call (one
/// roll-over per tenth of the window takes one) and no catch-up
/// work after idle periods. Rust's orphan rule keeps the `Budget` impl off
/// `RetryBudget` itself, which lives in the runtime-free core crate.
///
/// # Clone
///
/// Clones share one budget, as do `TowerBudget`s made from clones of one `RetryBudget`.
///
/// ```
/// use stormguard::{RetryBudget, retry::TowerBudget};
/// use tower::retry::budget::Budget;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), stormguard::ConfigError> {
/// let budget = TowerBudget::from(RetryBudget::builder().ratio(0.5).allowance(0).build()?);
/// budget.deposit();
/// budget.deposit();
/// assert!(budget.withdraw());
/// assert!(!budget.withdraw());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct TowerBudget(RetryBudget);

impl TowerBudget {
    /// Wraps `budget`; the result shares its state.
    pub fn new(budget: RetryBudget) -> Self {
        TowerBudget(budget)
    }

    /// The budget inside.
    pub fn budget(&self) -> &RetryBudget {
        &self.0
    }
}

impl From<RetryBudget> for TowerBudget {
    fn from(budget: RetryBudget) -> Self {
        TowerBudget(budget)
    }
}

impl Budget for TowerBudget {
    fn deposit(&self) {
        self.0.deposit(tokio::time::Instant::now().into_std());
    }

    fn withdraw(&self) -> bool {
        self.0.try_withdraw(tokio::time::Instant::now().into_std())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn follows_tokio_time() {
        let budget = TowerBudget::new(
            RetryBudget::builder()
                .ratio(0.1)
                .allowance(0)
                .build()
                .expect("budget"),
        );
        for _ in 0..100 {
            budget.deposit();
        }
        let clone = budget.clone();
        assert_eq!((0..20).filter(|_| clone.withdraw()).count(), 10);
        tokio::time::advance(Duration::from_secs(11)).await;
        for _ in 0..10 {
            budget.deposit();
        }
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }
}
