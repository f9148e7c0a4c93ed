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
    /// A setting read from a configuration file (TOML, JSON, a gRPC service config) is
    /// missing, unknown, of the wrong type or out of range.
    At {
        /// Where, as a dotted path: `dependencies.payments.retry.max_attempts`; empty
        /// when the text as a whole could not be read.
        path: String,
        /// What is wrong: `0 is not in 1..=100`.
        message: String,
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

    /// An error at `path` in a configuration file, saying what is wrong.
    pub fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::At {
            path: path.into(),
            message: message.into(),
        }
    }

    /// The setting that was rejected, as a builder names it; `"configuration"` for an
    /// error in a file (see [`path`](Self::path)).
    pub fn field(&self) -> &'static str {
        match self {
            ConfigError::Invalid { field, .. } => field,
            ConfigError::At { .. } => "configuration",
        }
    }

    /// Where in a configuration file the error is, for errors read from one.
    pub fn path(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { .. } => None,
            ConfigError::At { path, .. } => Some(path),
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
            ConfigError::At { path, message } if path.is_empty() => f.write_str(message),
            ConfigError::At { path, message } => write!(f, "{path}: {message}"),
        }
    }
}

impl std::error::Error for ConfigError {}
