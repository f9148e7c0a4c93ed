//! Configuration errors.

use std::fmt;

/// A builder was given a value it cannot work with.
///
/// Every builder in stormguard validates its settings in `build()` and returns this
/// error instead of panicking. [`Display`](fmt::Display) names the field, the value
/// given and what is allowed, so the message can be shown to whoever wrote the
/// configuration as it is.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::{Backoff, Jitter};
///
/// let err = Backoff::new(Duration::from_secs(5), Duration::from_secs(1), Jitter::Full).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "invalid backoff cap: 1s (allowed: at least the base, 5s)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting is outside the range it may take.
    Invalid {
        /// The setting, as the builder method names it (`"max_attempts"`, `"budget ratio"`).
        field: &'static str,
        /// The value that was given, formatted for a person.
        value: String,
        /// What would have been accepted.
        allowed: String,
    },
}

impl ConfigError {
    /// An error for `field`, given `value`, when `allowed` says what fits.
    pub fn invalid(
        field: &'static str,
        value: impl fmt::Debug,
        allowed: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            field,
            value: format!("{value:?}"),
            allowed: allowed.into(),
        }
    }

    /// The setting that was rejected.
    pub fn field(&self) -> &'static str {
        match self {
            ConfigError::Invalid { field, .. } => field,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Invalid {
                field,
                value,
                allowed,
            } => write!(f, "invalid {field}: {value} (allowed: {allowed})"),
        }
    }
}

impl std::error::Error for ConfigError {}
