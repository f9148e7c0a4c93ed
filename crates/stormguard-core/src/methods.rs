//! Per-method settings of gRPC calls, found by a request's `:path` as gRPC finds a
//! call's method config (gRFC A6's `methodConfig`).
//!
//! A [`MethodTable`] is usually read from a service config (feature `serde`,
//! `stormguard_core::config::Settings::from_grpc_service_config`), and can be built in
//! code:
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::methods::{GrpcRetryPolicy, MethodPolicy, MethodTable};
//! use stormguard_core::classify::GrpcCodeSet;
//! use stormguard_core::{Backoff, Jitter};
//!
//! let retry = GrpcRetryPolicy::new(
//!     4,
//!     Backoff::new(Duration::from_millis(100), Duration::from_secs(1), Jitter::Full)?,
//!     GrpcCodeSet::retryable_default(),
//! )?;
//! let mut table = MethodTable::new();
//! table.insert_service("echo.Echo", MethodPolicy::Retry(retry));
//! table.insert_method("/echo.Echo/Stream", MethodPolicy::Neither);
//! assert!(matches!(table.lookup("/echo.Echo/Say"), Some(MethodPolicy::Retry(_))));
//! assert_eq!(table.lookup("/echo.Echo/Stream"), Some(&MethodPolicy::Neither));
//! assert_eq!(table.lookup("/other.Other/Say"), None);
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```

use std::collections::HashMap;
use std::time::Duration;

use crate::classify::GrpcCodeSet;
use crate::{Backoff, ConfigError};

/// gRFC A6 caps `maxAttempts` of both policies at 5: a retry or hedging policy asking
/// for more gets 5.
pub const MAX_ATTEMPTS: u32 = 5;

/// What a gRPC method's config says: retry it, hedge it, or neither.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum MethodPolicy {
    /// `retryPolicy`.
    Retry(GrpcRetryPolicy),
    /// `hedgingPolicy`.
    Hedge(GrpcHedgePolicy),
    /// A method config with neither: the method is not retried (only transparent
    /// retries apply), whatever a less specific entry says.
    Neither,
}

/// A6's `retryPolicy`, checked: made by [`GrpcRetryPolicy::new`] or read from a
/// service config.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct GrpcRetryPolicy {
    /// `maxAttempts`, 2..=5 (larger values are read as 5).
    pub max_attempts: u32,
    /// `initialBackoff`, `maxBackoff`, `backoffMultiplier`, with full jitter as A6
    /// draws it: `U[0, min(initialBackoff * backoffMultiplier^n, maxBackoff))`.
    pub backoff: Backoff,
    /// `retryableStatusCodes`, not empty.
    pub codes: GrpcCodeSet,
}

/// A6's `hedgingPolicy`, checked: made by [`GrpcHedgePolicy::new`] or read from a
/// service config.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct GrpcHedgePolicy {
    /// `maxAttempts`, 2..=5 (larger values are read as 5).
    pub max_attempts: u32,
    /// `hedgingDelay` \[0s: every copy at once\].
    pub delay: Duration,
    /// `nonFatalStatusCodes` \[none\].
    pub non_fatal_codes: GrpcCodeSet,
}

/// Per-method values found by a request's `:path`, as gRPC finds a call's method config:
/// the entry naming the service and method (`/package.Service/Method`), else the
/// entry naming the service alone, else the default entry (a service config's `{}`
/// name), else nothing. See the [module docs](self) for an example.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodTable<T> {
    /// By `package.Service/Method`.
    methods: HashMap<String, T>,
    /// By `package.Service`.
    services: HashMap<String, T>,
    /// The `{}` entry.
    default: Option<T>,
}

/// `maxAttempts` as A6 reads it: at least 2, and 5 when above.
fn a6_attempts(max_attempts: u32) -> Result<u32, ConfigError> {
    if max_attempts < 2 {
        return Err(ConfigError::invalid(
            "maxAttempts",
            max_attempts,
            "at least 2 (gRFC A6)",
        ));
    }
    Ok(max_attempts.min(MAX_ATTEMPTS))
}

impl GrpcRetryPolicy {
    /// A retry policy of `max_attempts` (2 or more; above 5 is read as 5), `backoff`
    /// and the retryable `codes` (not empty).
    pub fn new(
        max_attempts: u32,
        backoff: Backoff,
        codes: GrpcCodeSet,
    ) -> Result<Self, ConfigError> {
        if codes == GrpcCodeSet::new() {
            return Err(ConfigError::invalid(
                "retryableStatusCodes",
                codes,
                "not empty (gRFC A6)",
            ));
        }
        Ok(GrpcRetryPolicy {
            max_attempts: a6_attempts(max_attempts)?,
            backoff,
            codes,
        })
    }
}

impl GrpcHedgePolicy {
    /// A hedging policy of `max_attempts` copies (2 or more; above 5 is read as 5), a
    /// `delay` between them (at most 1 h) and the `non_fatal_codes`.
    pub fn new(
        max_attempts: u32,
        delay: Duration,
        non_fatal_codes: GrpcCodeSet,
    ) -> Result<Self, ConfigError> {
        if delay > Duration::from_secs(3600) {
            return Err(ConfigError::invalid("hedgingDelay", delay, "from 0s to 1h"));
        }
        Ok(GrpcHedgePolicy {
            max_attempts: a6_attempts(max_attempts)?,
            delay,
            non_fatal_codes,
        })
    }
}

impl<T> Default for MethodTable<T> {
    fn default() -> Self {
        MethodTable {
            methods: HashMap::new(),
            services: HashMap::new(),
            default: None,
        }
    }
}

impl<T> MethodTable<T> {
    /// An empty table: every lookup finds nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the value for one method, named by its path: `/package.Service/Method`.
    pub fn insert_method(&mut self, path: impl Into<String>, value: T) {
        let path = path.into();
        let name = path.strip_prefix('/').map(str::to_owned).unwrap_or(path);
        self.methods.insert(name, value);
    }

    /// Sets the value for every method of `service` (`package.Service`) without one of
    /// its own.
    pub fn insert_service(&mut self, service: impl Into<String>, value: T) {
        self.services.insert(service.into(), value);
    }

    /// Sets the value for every method of every service without one of its own.
    pub fn set_default(&mut self, value: T) {
        self.default = Some(value);
    }

    /// The value for a request to `path` (`/package.Service/Method`).
    pub fn lookup(&self, path: &str) -> Option<&T> {
        let name = path.strip_prefix('/').unwrap_or(path);
        if let Some(found) = self.methods.get(name) {
            return Some(found);
        }
        let service = name.rsplit_once('/').map_or(name, |(service, _)| service);
        self.services.get(service).or(self.default.as_ref())
    }

    /// The same table with every value mapped by `f`.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> MethodTable<U> {
        let remap = |from: &HashMap<String, T>, f: &mut dyn FnMut(&T) -> U| {
            from.iter().map(|(k, v)| (k.clone(), f(v))).collect()
        };
        MethodTable {
            methods: remap(&self.methods, &mut f),
            services: remap(&self.services, &mut f),
            default: self.default.as_ref().map(&mut f),
        }
    }

    /// Every value in the table.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.methods
            .values()
            .chain(self.services.values())
            .chain(self.default.iter())
    }
}
