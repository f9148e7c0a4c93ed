//! One configuration per dependency: [`Config`] (feature `serde`).
//!
//! A service with five dependencies has five answers to "how hard may I retry this?",
//! and they belong in a file its operators can read and review, not in five
//! `ServiceBuilder` chains. [`Config`] reads that file (TOML, JSON, or the gRPC service
//! config a tonic user already has), checks every value, and hands back each
//! dependency's parts ready for a `ServiceBuilder`: its retry policy, its one shared
//! budget, its breaker and its hedge policy.
//!
//! The file's shape, every key and its default are in [`stormguard_core::config`], and
//! `examples/stormguard.toml` in the repository documents each of them. A key the reader
//! does not know is an error, so a typo never leaves a default in place silently, and
//! every error names the path and the rule (the end of the example below shows one). A
//! few of the keys:
//!
//! ```toml
//! # Each value shown is its default [in brackets]; the comments say when to change it.
//! [dependencies.payments.retry]
//! max_attempts = 3                             # [3] more (or a larger base) rides out longer
//!                                              # blips; the budget still bounds what they spend
//! backoff = { base = "200ms", cap = "20s" }    # [200ms, 20s] durations: "250us", "200ms", "1.5s", "2m"
//!
//! [dependencies.payments.breaker]              # the breaker is on unless `enabled = false`
//! consecutive_failures = 50                    # [50] lower trips on heavy partial outages and
//!                                              # serves less than no retries: do not lower it
//!
//! [dependencies.search.hedging]                # hedging is off unless the section is there
//! percentile = 0.95                            # [0.95] lower hedges more requests, at more load
//! ```
//!
//! ```rust
//! # #[cfg(feature = "serde")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), stormguard::BoxError> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use stormguard::{CircuitBreakerLayer, Config, HedgeLayer, RetryLayer};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! let config = Config::from_toml(include_str!("../../examples/stormguard.toml"))?;
//! let payments = config.dependency("payments")?;
//! let breaker = payments.breaker_or_off()?;
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new(payments.retry))
//!     .option_layer(payments.hedge.map(HedgeLayer::new))
//!     .layer(CircuitBreakerLayer::new(breaker))
//!     // Per attempt: set it above the dependency's slowest healthy answer; a timed-out
//!     // attempt is charged two wasted retries.
//!     .timeout(Duration::from_secs(2))
//!     .service(service_fn(|_req: http::Request<Full<Bytes>>| async {
//!         Ok::<_, stormguard::BoxError>(http::Response::new(String::from("paid")))
//!     }));
//!
//! let response = client.oneshot(http::Request::new(Full::from("order 7"))).await?;
//! assert_eq!(response.into_body().into_inner(), "paid");
//!
//! let err = Config::from_toml("[dependencies.payments.retry]\nmax_attempts = 0").unwrap_err();
//! assert_eq!(err.to_string(), "dependencies.payments.retry.max_attempts: 0 is not in 1..=100");
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "serde"))]
//! # fn main() {}
//! ```
//!
//! # One budget per dependency
//!
//! The parts are made once, when the file is read; [`Config::dependency`] hands out
//! clones, which share their state. However many clients are built for `payments`,
//! their retries draw from one budget, one breaker counts their calls and one set of
//! counters (and metrics, under the dependency's name) reports them. Read the file
//! once per process and keep the `Config`. A `[defaults]` table of the same shape is laid
//! under every dependency.
//!
//! # gRPC service configs
//!
//! [`Config::from_grpc_service_config`] reads gRFC A6's JSON as one dependency named
//! `"default"`: each call's `methodConfig` is found by its `:path`
//! (`/package.Service/Method`, then the service's entry, then the `{}` entry); a
//! `retryPolicy` bounds its retries, a `hedgingPolicy` makes the dependency's
//! [`hedge`](Dependency::hedge) hedge it, a method with neither (or with no entry at all)
//! is not retried, and `retryThrottling` throttles every retry as A6 does, on top of the
//! budget. The lookup happens only when a call fails. The backoff is A6's,
//! `U[0, min(initialBackoff × backoffMultiplier^n, maxBackoff))`
//! ([`Backoff::with_multiplier`](crate::Backoff::with_multiplier)). A6's validation rules
//! apply (`maxAttempts` at least 2 and read as 5 above it, backoffs greater than zero, a
//! non-empty list of codes, never both policies on one method). A method config's
//! `timeout` is the call's [`Deadline`](crate::Deadline) when it has none of its own
//! (the earlier of the two otherwise; see
//! [`RetryPolicyBuilder::grpc_timeouts`](crate::retry::RetryPolicyBuilder::grpc_timeouts)):
//! no retry is scheduled past it. The fields gRPC defines that this crate reads past
//! without using are `waitForReady`, `maxRequestMessageBytes`,
//! `maxResponseMessageBytes`, `loadBalancingConfig`, `loadBalancingPolicy` and
//! `healthCheckConfig` (and any field it does not know), as gRPC ignores fields it does
//! not know.
//!
//! In a TOML file, a dependency's `grpc_service_config` key takes the same JSON (as text,
//! or as TOML tables), next to its own budget and breaker sections; its requests that are
//! not gRPC keep the dependency's `retry` settings.
//!
//! # The example, and the simulator
//!
//! `cargo run --example config --features serde` reads `examples/stormguard.toml` and the
//! A6 service config in `examples/grpc_service_config.json` (both in the repository),
//! prints each dependency's settings and each gRPC method's config, then drives the
//! `payments` stack against a server on 127.0.0.1 that fails its first requests.
//!
//! The simulator reads the same file:
//! `stormguard-sim fleet --config FILE [--dependency NAME]` adds a row per dependency next
//! to `none` and the library defaults (hedging and per-method settings are not simulated,
//! and a dependency's `retry_throttling` is simulated as its budget alone); the simulator
//! page of the guide (docs/simulator.md in the repository) describes it.

use crate::load::LoadControl;
use std::collections::BTreeMap;
use std::fmt;

use stormguard_core::breaker::BreakerConfig;
use stormguard_core::config::{DependencySettings, Settings};
use stormguard_core::methods::MethodPolicy;

use crate::retry::RetryPolicyBuilder;
use crate::{CircuitBreaker, ConfigError, HedgePolicy, RetryBudget, RetryPolicy};

/// Every dependency's ready parts, read from one configuration; see the
/// [module docs](self).
///
/// # Clone
///
/// Clones share the parts, as [`Config::dependency`]'s results do.
#[derive(Clone)]
pub struct Config {
    settings: Settings,
    dependencies: BTreeMap<String, Dependency>,
}

/// One dependency's parts, for a `ServiceBuilder`.
///
/// Layer them outermost first: `RetryLayer::new(retry)`, then
/// `HedgeLayer::new(hedge)` if there is one, then the breaker
/// (`CircuitBreakerLayer::new(breaker_or_off()?)`), then the per-attempt timeout (see
/// the crate docs for why that order).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Dependency {
    /// The retry policy, named after the dependency, drawing from [`budget`](Self::budget).
    pub retry: RetryPolicy,
    /// The dependency's one retry budget, named after it, shared by the retry and hedge
    /// policies.
    pub budget: RetryBudget,
    /// The circuit breaker, named after the dependency; `None` when the file turns it
    /// off.
    pub breaker: Option<CircuitBreaker>,
    /// The hedge policy when the file has a `hedging` section or the service config a
    /// `hedgingPolicy`, sharing the budget.
    pub hedge: Option<HedgePolicy>,
    /// The load control, named after the dependency; `None` when the file turns it off.
    pub load: Option<LoadControl>,
}

impl Dependency {
    /// The load control whatever the file says: [`load`](Self::load), or, when the file
    /// turns it off, one that never limits (its limit fixed at `u32::MAX`).
    pub fn load_or_off(&self) -> Result<LoadControl, ConfigError> {
        match &self.load {
            Some(load) => Ok(load.clone()),
            None => LoadControl::builder()
                .name(self.retry.name())
                .min(u32::MAX)
                .max(u32::MAX)
                .build(),
        }
    }

    /// The circuit breaker whatever the file says: [`breaker`](Self::breaker), or, when
    /// the file turns it off, one that never opens (named after the dependency, its
    /// calls still counted in its stats and metrics). For a stack whose type must not
    /// depend on the file: a `ServiceBuilder::option_layer` of the breaker does not
    /// compile, since the breaker's responses have a body type of their own
    /// ([`breaker::ResponseBody`](crate::breaker::ResponseBody)) and the two arms of
    /// the `Either` would differ.
    pub fn breaker_or_off(&self) -> Result<CircuitBreaker, ConfigError> {
        match &self.breaker {
            Some(breaker) => Ok(breaker.clone()),
            None => CircuitBreaker::builder()
                .config(
                    BreakerConfig::builder()
                        .consecutive_failures(None)
                        .min_throughput(u32::MAX),
                )
                .name(self.retry.name())
                .build(),
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("dependencies", &self.dependencies.keys())
            .finish_non_exhaustive()
    }
}

impl Config {
    /// Reads a TOML document of the shape [`stormguard_core::config`] describes.
    ///
    /// ```
    /// let err = stormguard::Config::from_toml("[dependencies.payments.retry]\nmax_attempts = 0").unwrap_err();
    /// assert_eq!(err.to_string(), "dependencies.payments.retry.max_attempts: 0 is not in 1..=100");
    /// ```
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::assemble(Settings::from_toml(text)?)
    }

    /// Reads a JSON document of the same shape as the TOML one.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        Self::assemble(Settings::from_json(text)?)
    }

    /// Reads a gRPC service config (gRFC A6's JSON) as one dependency named
    /// `"default"`; see the [module docs](self#grpc-service-configs).
    ///
    /// ```
    /// let config = stormguard::Config::from_grpc_service_config(r#"{
    ///   "methodConfig": [{
    ///     "name": [{"service": "helloworld.Greeter"}],
    ///     "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
    ///                     "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    ///   }],
    ///   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
    /// }"#)?;
    /// let greeter = config.dependency("default")?;
    /// assert!(greeter.hedge.is_none());
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn from_grpc_service_config(json: &str) -> Result<Self, ConfigError> {
        Self::assemble(Settings::from_grpc_service_config(json)?)
    }

    /// The parts of the dependency called `name`: clones of the ones made when the file
    /// was read, so every stack built from them shares one budget, one breaker and one
    /// set of counters.
    pub fn dependency(&self, name: &str) -> Result<Dependency, ConfigError> {
        self.dependencies.get(name).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.dependencies.keys().map(String::as_str).collect();
            ConfigError::at(
                format!("dependencies.{name}"),
                format!(
                    "not in the configuration (it has: {})",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            )
        })
    }

    /// The names of the dependencies, in alphabetical order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.dependencies.keys().map(String::as_str)
    }

    /// The checked settings the parts were made from.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    fn assemble(settings: Settings) -> Result<Self, ConfigError> {
        let dependencies = settings
            .dependencies()
            .map(|(name, s)| {
                let parts = parts(name, s).map_err(|e| match e {
                    // Every value was checked when read; a builder refusing one now is
                    // still reported against the dependency rather than lost.
                    ConfigError::At { .. } => e,
                    other => ConfigError::at(format!("dependencies.{name}"), other.to_string()),
                })?;
                Ok((name.to_owned(), parts))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Config {
            settings,
            dependencies,
        })
    }
}

/// One dependency's parts from its settings.
fn parts(name: &str, s: &DependencySettings) -> Result<Dependency, ConfigError> {
    let budget = s.budget.clone().name(name).build()?;
    let retry = retry_policy(name, s, budget.clone())?;
    let breaker = match &s.breaker {
        Some(b) => Some(
            CircuitBreaker::builder()
                .name(name)
                .config(b.config.clone())
                .failure_statuses(b.failure_statuses)
                .failure_grpc_codes(b.failure_grpc_codes)
                .build()?,
        ),
        None => None,
    };
    let hedged_methods = s
        .methods
        .as_ref()
        .is_some_and(|m| m.values().any(|p| matches!(p, MethodPolicy::Hedge(_))));
    let hedge = if s.hedging.is_some() || hedged_methods {
        let mut builder = HedgePolicy::builder().share_retry_budget(&retry);
        match &s.hedging {
            Some(h) => {
                builder = builder
                    .max_attempts(h.max_attempts)
                    .estimator(h.estimator.clone())
                    .non_fatal_statuses(h.non_fatal.retryable_statuses)
                    .non_fatal_grpc_codes(h.non_fatal.retryable_grpc_codes);
                if let Some(delay) = h.delay {
                    builder = builder.delay(delay);
                }
            }
            // Only the service config's methods are hedged.
            None => builder = builder.max_attempts(1),
        }
        if let Some(methods) = &s.methods {
            builder = builder.grpc_methods(methods);
        }
        Some(builder.build()?)
    } else {
        None
    };
    let load = s
        .load_control
        .map(|config| LoadControl::with_config(name, config));
    Ok(Dependency {
        retry,
        budget,
        breaker,
        hedge,
        load,
    })
}

fn retry_policy(
    name: &str,
    s: &DependencySettings,
    budget: RetryBudget,
) -> Result<RetryPolicy, ConfigError> {
    let r = &s.retry;
    let mut builder: RetryPolicyBuilder = RetryPolicy::builder()
        .name(name)
        .max_attempts(r.max_attempts)
        .backoff(r.backoff)
        .budget(budget)
        .retryable_statuses(r.rules.retryable_statuses)
        .retryable_grpc_codes(r.rules.retryable_grpc_codes);
    if let Some(max) = r.max_retry_after {
        builder = builder.max_retry_after(max);
    }
    if let Some(bytes) = r.max_replay_bytes {
        builder = builder.max_replay_bytes(bytes);
    }
    if let Some(throttle) = &s.throttle {
        builder = builder.throttle(throttle.clone().build()?);
    }
    if let Some(methods) = &s.methods {
        builder = builder.grpc_methods(methods);
    }
    if let Some(timeouts) = &s.method_timeouts {
        builder = builder.grpc_timeouts(timeouts);
    }
    builder.build()
}
