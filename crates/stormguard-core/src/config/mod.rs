//! Settings for every dependency, read from a TOML or JSON file or a gRPC service config
//! (feature `serde`).
//!
//! [`Settings`] is the checked content of a file; it holds values and builders, not
//! live state. `stormguard::Config` turns each dependency's settings into the policy,
//! budget, breaker and hedge a `ServiceBuilder` takes, and the simulator reads the same
//! file to replay a fleet with them.
//!
//! # The file
//!
//! One table per dependency under `dependencies`, each with up to five sections:
//! `retry`, `budget`, `breaker`, `hedging` and `retry_throttling`, and a gRPC service
//! config (`grpc_service_config`: its JSON text, or the same as TOML tables) whose
//! `methodConfig` and `retryThrottling` then apply to the dependency's gRPC calls. A `defaults` table of
//! the same shape is laid under every dependency, key by key. Every key is optional and
//! takes the library's default; a key this reader does not know is an error, so a typo
//! cannot silently leave a default in place. Durations are strings with a unit:
//! `"200ms"`, `"1.5s"`, `"2m"`.
//!
//! ```toml
//! [defaults.retry]
//! max_attempts = 3                       # 1..=100, the first attempt included [3]
//! backoff = { base = "200ms", cap = "20s", jitter = "full", multiplier = 2.0 }
//! retryable_statuses = [408, 429, 500, 502, 503, 504]
//! retryable_grpc_codes = ["UNAVAILABLE"]
//! max_retry_after = "20s"                # [the backoff cap]
//! max_replay_bytes = 65536               # [64 KiB]
//!
//! [dependencies.payments.budget]
//! ratio = 0.1                            # wasted retries per request [0.1]
//! window = "10s"                         # [10s]
//! allowance = 1                          # savings carried over [1]
//!
//! [dependencies.payments.breaker]        # on by default; enabled = false turns it off
//! window = "2s"
//! consecutive_failures = 50              # or false
//! break_duration = "25ms"
//!
//! [dependencies.payments.load_control]  # on by default; enabled = false turns it off
//! max = 64                               # never more calls in flight than this [1000]
//! max_wait = "50ms"                      # wait for room, then shed [100ms]
//! tolerance = 1.25                       # latency over its floor read as a queue [1.25]
//!
//! [dependencies.search.hedging]          # off unless the section is present
//! max_attempts = 2
//! percentile = 0.95                      # or delay = "30ms" for a fixed delay
//! ```
//!
//! Errors name the path and the rule:
//!
//! ```
//! use stormguard_core::config::Settings;
//!
//! let err = Settings::from_toml("[dependencies.payments.retry]\nmax_attempts = 0\n").unwrap_err();
//! assert_eq!(err.to_string(), "dependencies.payments.retry.max_attempts: 0 is not in 1..=100");
//!
//! let err = Settings::from_toml("[dependencies.payments.retry]\nmax_attempt = 3\n").unwrap_err();
//! assert!(err.to_string().starts_with("dependencies.payments.retry.max_attempt: unknown field"));
//! ```

mod grpc;
mod read;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

pub use crate::methods::{GrpcHedgePolicy, GrpcRetryPolicy, MethodPolicy, MethodTable};
pub use read::parse_duration;

use crate::breaker::BreakerConfig;
use crate::classify::{GrpcCodeSet, Rules, StatusSet};
use crate::hedge::LatencyEstimatorBuilder;
use crate::limit::{LoadLimit, LoadLimitConfig};
use crate::throttle::{RetryThrottle, RetryThrottleBuilder};
use crate::{Backoff, ConfigError, Jitter, RetryBudget, RetryBudgetBuilder};
use read::Table;

/// The checked settings of every dependency in a configuration file.
///
/// ```
/// use stormguard_core::config::Settings;
///
/// let settings = Settings::from_toml(r#"
///     [dependencies.payments.retry]
///     max_attempts = 2
///     backoff = { base = "50ms", cap = "2s" }
/// "#)?;
/// let payments = settings.dependency("payments").expect("in the file");
/// assert_eq!(payments.retry.max_attempts, 2);
/// assert_eq!(payments.retry.backoff.cap(), std::time::Duration::from_secs(2));
/// # Ok::<(), stormguard_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Settings {
    dependencies: BTreeMap<String, DependencySettings>,
}

/// One dependency's settings. Fields hold the library's defaults where the file is
/// silent.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DependencySettings {
    /// The `retry` section.
    pub retry: RetrySettings,
    /// The `budget` section, as a builder (checked: its `build` succeeds). Build it once
    /// per dependency and share the budget.
    pub budget: RetryBudgetBuilder,
    /// The `breaker` section; `None` when it says `enabled = false`.
    pub breaker: Option<BreakerSettings>,
    /// The `load_control` section; `None` when it says `enabled = false`.
    pub load_control: Option<LoadLimitConfig>,
    /// The `hedging` section; `None` when there is none or it says `enabled = false`.
    pub hedging: Option<HedgeSettings>,
    /// The `retry_throttling` section (gRFC A6's `retryThrottling`), if any.
    pub throttle: Option<RetryThrottleBuilder>,
    /// Per-method policies, from a gRPC service config's `methodConfig`.
    pub methods: Option<MethodTable<MethodPolicy>>,
    /// Per-method timeouts, from a gRPC service config's `methodConfig.timeout`
    /// (`None` for a method whose config has none): the call's deadline when the request
    /// has none of its own, the earlier of the two otherwise.
    pub method_timeouts: Option<MethodTable<Option<Duration>>>,
}

impl Default for DependencySettings {
    fn default() -> Self {
        DependencySettings {
            retry: RetrySettings::default(),
            budget: RetryBudget::builder(),
            breaker: Some(BreakerSettings::default()),
            load_control: Some(LoadLimitConfig::default()),
            hedging: None,
            throttle: None,
            methods: None,
            method_timeouts: None,
        }
    }
}

/// The `retry` section.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetrySettings {
    /// `max_attempts`: attempts per request, the first included, 1..=100 \[3\].
    pub max_attempts: u32,
    /// `backoff = { base, cap, jitter, multiplier }` \[200ms, 20s, full, 2\].
    pub backoff: Backoff,
    /// `retryable_statuses` and `retryable_grpc_codes` \[408, 429, 500, 502, 503, 504;
    /// UNAVAILABLE\].
    pub rules: Rules,
    /// `max_retry_after`: the longest server-asked wait honoured \[the backoff cap\].
    pub max_retry_after: Option<Duration>,
    /// `max_replay_bytes`: the most bytes of a streaming body kept for replay \[the
    /// layer's default, 64 KiB\].
    pub max_replay_bytes: Option<usize>,
}

impl Default for RetrySettings {
    fn default() -> Self {
        RetrySettings {
            max_attempts: 3,
            backoff: Backoff::default(),
            rules: Rules::default(),
            max_retry_after: None,
            max_replay_bytes: None,
        }
    }
}

/// The `breaker` section.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BreakerSettings {
    /// The state machine's settings: `window`, `min_throughput`, `failure_ratio`,
    /// `consecutive_failures`, `break_duration`, `max_break_duration`, `probes`,
    /// `jitter` (see [`BreakerConfig`]).
    pub config: BreakerConfig,
    /// `failure_statuses` \[408, 429, every 5xx\].
    pub failure_statuses: StatusSet,
    /// `failure_grpc_codes` \[UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL,
    /// UNAVAILABLE, DATA_LOSS\].
    pub failure_grpc_codes: GrpcCodeSet,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            config: BreakerConfig::default(),
            failure_statuses: StatusSet::breaker_default(),
            failure_grpc_codes: GrpcCodeSet::breaker_default(),
        }
    }
}

/// The `hedging` section.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HedgeSettings {
    /// `max_attempts`: copies per request, the original included, 1..=5 \[2\].
    pub max_attempts: u32,
    /// `delay`: a fixed hedge delay, instead of the percentile estimate.
    pub delay: Option<Duration>,
    /// `percentile`, `window`, `min_samples`, `floor`: the estimate \[p95 over 10 s,
    /// after 50 latencies, at least 1 ms\]; checked.
    pub estimator: LatencyEstimatorBuilder,
    /// `non_fatal_statuses` and `non_fatal_grpc_codes` \[the retryable ones\].
    pub non_fatal: Rules,
}

impl Default for HedgeSettings {
    fn default() -> Self {
        HedgeSettings {
            max_attempts: 2,
            delay: None,
            estimator: LatencyEstimatorBuilder::default(),
            non_fatal: Rules::default(),
        }
    }
}

impl Settings {
    /// Reads a TOML document.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            ConfigError::at("", format!("not valid TOML: {}", e.to_string().trim_end()))
        })?;
        let value = serde_json::to_value(table)
            .map_err(|e| ConfigError::at("", format!("cannot read the TOML document: {e}")))?;
        Self::from_value(&value)
    }

    /// Reads a JSON document of the same shape as the TOML one.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::at("", format!("not valid JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Reads gRFC A6's service config JSON as one dependency named `"default"`: see
    /// [`MethodTable`] for how a request's method config is found.
    pub fn from_grpc_service_config(json: &str) -> Result<Self, ConfigError> {
        let dependency = grpc::read(json)?;
        Ok(Settings {
            dependencies: BTreeMap::from([(String::from("default"), dependency)]),
        })
    }

    /// The settings of the dependency called `name`.
    pub fn dependency(&self, name: &str) -> Option<&DependencySettings> {
        self.dependencies.get(name)
    }

    /// Every dependency, by name in alphabetical order.
    pub fn dependencies(&self) -> impl Iterator<Item = (&str, &DependencySettings)> {
        self.dependencies.iter().map(|(k, v)| (k.as_str(), v))
    }

    fn from_value(value: &Value) -> Result<Self, ConfigError> {
        let mut top = Table::new("", value)?;
        let defaults = top.value("defaults");
        if let Some(defaults) = defaults {
            // Checked on its own, so that its errors name it.
            read_dependency("defaults", defaults)?;
        }
        let mut dependencies = BTreeMap::new();
        if let Some(deps) = top.table("dependencies")? {
            for (name, section) in deps.entries() {
                let path = deps.path_of(name);
                if name.trim().is_empty() {
                    return Err(ConfigError::at(path, "a dependency needs a name"));
                }
                let merged = match defaults {
                    Some(defaults) => under(defaults, section),
                    None => section.clone(),
                };
                dependencies.insert(name.clone(), read_dependency(&path, &merged)?);
            }
        }
        top.finish()?;
        Ok(Settings { dependencies })
    }
}

/// `over` laid on `base`, key by key through nested tables.
fn under(base: &Value, over: &Value) -> Value {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            let mut merged = base.clone();
            for (key, value) in over {
                let value = match base.get(key) {
                    Some(below) => under(below, value),
                    None => value.clone(),
                };
                merged.insert(key.clone(), value);
            }
            Value::Object(merged)
        }
        (_, over) => over.clone(),
    }
}

fn read_dependency(path: &str, value: &Value) -> Result<DependencySettings, ConfigError> {
    let mut t = Table::new(path, value)?;
    let mut dependency = DependencySettings::default();
    if let Some(section) = t.table("retry")? {
        dependency.retry = read_retry(section)?;
    }
    if let Some(section) = t.table("budget")? {
        dependency.budget = read_budget(section)?;
    }
    if let Some(section) = t.table("breaker")? {
        dependency.breaker = read_breaker(section)?;
    }
    if let Some(section) = t.table("load_control")? {
        dependency.load_control = read_load_control(section)?;
    }
    if let Some(section) = t.table("hedging")? {
        dependency.hedging = read_hedging(section)?;
    }
    if let Some(section) = t.table("retry_throttling")? {
        dependency.throttle = Some(read_throttle(section)?);
    }
    let key = "grpc_service_config";
    let path = t.path_of(key);
    let service_config = match t.value(key) {
        None => None,
        // The JSON text as it is, or the same written as TOML tables.
        Some(Value::String(json)) => {
            let value: Value = serde_json::from_str(json)
                .map_err(|e| ConfigError::at(path.clone(), format!("not valid JSON: {e}")))?;
            Some(grpc::read_value(&path, &value)?)
        }
        Some(v @ Value::Object(_)) => Some(grpc::read_value(&path, v)?),
        Some(other) => {
            return Err(read::wrong(
                path,
                "a service config, as JSON text or a table",
                other,
            ))
        }
    };
    if let Some(config) = service_config {
        if config.throttle.is_some() && dependency.throttle.is_some() {
            return Err(ConfigError::at(
                format!("{path}.retryThrottling"),
                format!(
                    "throttling is also set by {}",
                    t.path_of("retry_throttling")
                ),
            ));
        }
        dependency.methods = Some(config.methods);
        dependency.method_timeouts = Some(config.timeouts);
        dependency.throttle = dependency.throttle.or(config.throttle);
    }
    t.finish()?;
    Ok(dependency)
}

fn read_retry(mut t: Table<'_>) -> Result<RetrySettings, ConfigError> {
    let mut retry = RetrySettings::default();
    if let Some(n) = t.u32_in("max_attempts", 1, 100)? {
        retry.max_attempts = n;
    }
    if let Some(section) = t.table("backoff")? {
        retry.backoff = read_backoff(section)?;
    }
    if let Some(set) = t.list("retryable_statuses", status)? {
        retry.rules.retryable_statuses = set.into_iter().collect();
    }
    if let Some(set) = t.list("retryable_grpc_codes", grpc_code)? {
        retry.rules.retryable_grpc_codes = codes(set);
    }
    retry.max_retry_after = t.duration("max_retry_after")?;
    retry.max_replay_bytes = t.bytes("max_replay_bytes")?;
    t.finish()?;
    Ok(retry)
}

fn read_backoff(mut t: Table<'_>) -> Result<Backoff, ConfigError> {
    let defaults = Backoff::default();
    let base = t.duration("base")?.unwrap_or(defaults.base());
    let cap = t.duration("cap")?.unwrap_or(defaults.cap());
    let jitter = match t.str("jitter")? {
        None => defaults.jitter(),
        Some("full") => Jitter::Full,
        Some("equal") => Jitter::Equal,
        Some("decorrelated") => Jitter::Decorrelated,
        Some("none") => Jitter::None,
        Some(other) => {
            return Err(ConfigError::at(
                t.path_of("jitter"),
                format!("{other:?} is not one of \"full\", \"equal\", \"decorrelated\", \"none\""),
            ))
        }
    };
    let multiplier = t.f64("multiplier")?;
    let keys = [
        ("backoff base", "base"),
        ("backoff cap", "cap"),
        ("backoff multiplier", "multiplier"),
    ];
    let backoff = Backoff::new(base, cap, jitter)
        .and_then(|b| match multiplier {
            Some(m) => b.with_multiplier(m),
            None => Ok(b),
        })
        .map_err(|e| locate(&t, e, &keys))?;
    t.finish()?;
    Ok(backoff)
}

fn read_budget(mut t: Table<'_>) -> Result<RetryBudgetBuilder, ConfigError> {
    let mut budget = RetryBudget::builder();
    if let Some(ratio) = t.f64("ratio")? {
        budget = budget.ratio(ratio);
    }
    if let Some(window) = t.duration("window")? {
        budget = budget.window(window);
    }
    if let Some(n) = t.u32_in("allowance", 0, u32::MAX)? {
        budget = budget.allowance(n);
    }
    let keys = [("budget ratio", "ratio"), ("budget window", "window")];
    budget.clone().build().map_err(|e| locate(&t, e, &keys))?;
    t.finish()?;
    Ok(budget)
}

fn read_breaker(mut t: Table<'_>) -> Result<Option<BreakerSettings>, ConfigError> {
    let enabled = t.bool("enabled")?.unwrap_or(true);
    let mut b = BreakerConfig::builder();
    if let Some(d) = t.duration("window")? {
        b = b.window(d);
    }
    if let Some(n) = t.u32_in("min_throughput", 1, u32::MAX)? {
        b = b.min_throughput(n);
    }
    if let Some(r) = t.f64("failure_ratio")? {
        b = b.failure_ratio(r);
    }
    match t.value("consecutive_failures") {
        None => {}
        Some(Value::Bool(false)) => b = b.consecutive_failures(None),
        Some(v) => {
            let path = t.path_of("consecutive_failures");
            let n = read::whole(&path, v)
                .map_err(|_| read::wrong(path.clone(), "a whole number or false", v))?;
            match u32::try_from(n) {
                Ok(n) if n >= 1 => b = b.consecutive_failures(n),
                _ => {
                    return Err(ConfigError::at(
                        path,
                        format!("{n} is not in 1..={} (false turns the rule off)", u32::MAX),
                    ))
                }
            }
        }
    }
    if let Some(d) = t.duration("break_duration")? {
        b = b.break_duration(d);
    }
    if let Some(d) = t.duration("max_break_duration")? {
        b = b.max_break_duration(d);
    }
    if let Some(n) = t.u32_in("probes", 1, 65_535)? {
        b = b.probes(n);
    }
    if let Some(j) = t.f64("jitter")? {
        b = b.jitter(j);
    }
    let mut breaker = BreakerSettings::default();
    if let Some(set) = t.list("failure_statuses", status)? {
        breaker.failure_statuses = set.into_iter().collect();
    }
    if let Some(set) = t.list("failure_grpc_codes", grpc_code)? {
        breaker.failure_grpc_codes = codes(set);
    }
    let keys = [
        ("window", "window"),
        ("failure_ratio", "failure_ratio"),
        ("break_duration", "break_duration"),
        ("max_break_duration", "max_break_duration"),
        ("jitter", "jitter"),
    ];
    breaker.config = b.build().map_err(|e| locate(&t, e, &keys))?;
    t.finish()?;
    Ok(enabled.then_some(breaker))
}

fn read_load_control(mut t: Table<'_>) -> Result<Option<LoadLimitConfig>, ConfigError> {
    let enabled = t.bool("enabled")?.unwrap_or(true);
    let mut b = LoadLimit::builder();
    if let Some(n) = t.u32_in("initial", 1, u32::MAX)? {
        b = b.initial(n);
    }
    if let Some(n) = t.u32_in("min", 1, u32::MAX)? {
        b = b.min(n);
    }
    if let Some(n) = t.u32_in("max", 1, u32::MAX)? {
        b = b.max(n);
    }
    if let Some(r) = t.f64("tolerance")? {
        b = b.tolerance(r);
    }
    if let Some(d) = t.duration("max_wait")? {
        b = b.max_wait(d);
    }
    let keys = [
        ("initial", "initial"),
        ("min", "min"),
        ("max", "max"),
        ("tolerance", "tolerance"),
    ];
    let config = b.config().map_err(|e| locate(&t, e, &keys))?;
    t.finish()?;
    Ok(enabled.then_some(config))
}

fn read_hedging(mut t: Table<'_>) -> Result<Option<HedgeSettings>, ConfigError> {
    let enabled = t.bool("enabled")?.unwrap_or(true);
    let mut hedging = HedgeSettings::default();
    if let Some(n) = t.u32_in("max_attempts", 1, 5)? {
        hedging.max_attempts = n;
    }
    hedging.delay = t.duration("delay")?;
    if let Some(delay) = hedging.delay {
        if delay < Duration::from_millis(1) || delay > Duration::from_secs(3600) {
            return Err(ConfigError::at(
                t.path_of("delay"),
                format!("{delay:?} is not from 1ms to 1h"),
            ));
        }
    }
    let mut e = LatencyEstimatorBuilder::default();
    if let Some(p) = t.f64("percentile")? {
        e = e.percentile(p);
    }
    if let Some(d) = t.duration("window")? {
        e = e.window(d);
    }
    if let Some(n) = t.u32_in("min_samples", 1, 1_000_000)? {
        e = e.min_samples(n);
    }
    if let Some(d) = t.duration("floor")? {
        e = e.floor(d);
    }
    let keys = [
        ("hedge percentile", "percentile"),
        ("hedge window", "window"),
        ("hedge floor", "floor"),
    ];
    e.clone().build().map_err(|err| locate(&t, err, &keys))?;
    hedging.estimator = e;
    if let Some(set) = t.list("non_fatal_statuses", status)? {
        hedging.non_fatal.retryable_statuses = set.into_iter().collect();
    }
    if let Some(set) = t.list("non_fatal_grpc_codes", grpc_code)? {
        hedging.non_fatal.retryable_grpc_codes = codes(set);
    }
    t.finish()?;
    Ok(enabled.then_some(hedging))
}

fn read_throttle(mut t: Table<'_>) -> Result<RetryThrottleBuilder, ConfigError> {
    let mut throttle = RetryThrottle::builder();
    if let Some(n) = t.f64("max_tokens")? {
        throttle = throttle.max_tokens(n);
    }
    if let Some(r) = t.f64("token_ratio")? {
        throttle = throttle.token_ratio(r);
    }
    let keys = [("max_tokens", "max_tokens"), ("token_ratio", "token_ratio")];
    throttle.clone().build().map_err(|e| locate(&t, e, &keys))?;
    t.finish()?;
    Ok(throttle)
}

/// A builder's error, moved to the key of `t` it is about (or to `t` itself).
fn locate(t: &Table<'_>, err: ConfigError, keys: &[(&str, &str)]) -> ConfigError {
    match err {
        ConfigError::Invalid {
            field,
            value,
            allowed,
        } => {
            let path = match keys.iter().find(|(f, _)| *f == field) {
                Some((_, key)) => t.path_of(key),
                None => t.path().to_owned(),
            };
            ConfigError::at(path, format!("{value} is not {allowed}"))
        }
        other => other,
    }
}

/// An HTTP status code, 100..=999.
fn status(path: &str, v: &Value) -> Result<http::StatusCode, ConfigError> {
    let n = read::whole(path, v)?;
    u16::try_from(n)
        .ok()
        .and_then(|n| http::StatusCode::from_u16(n).ok())
        .ok_or_else(|| ConfigError::at(path, format!("{n} is not in 100..=999")))
}

/// The gRPC status codes by name, in code order.
const GRPC_CODE_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// A gRPC status code given by name (`"UNAVAILABLE"`, any case) or number (14); OK is
/// not a failure and is refused.
fn grpc_code(path: &str, v: &Value) -> Result<i32, ConfigError> {
    let code = match v {
        Value::String(name) => GRPC_CODE_NAMES
            .iter()
            .position(|known| known.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                ConfigError::at(
                    path,
                    format!("{name:?} is not a gRPC status code name such as \"UNAVAILABLE\""),
                )
            })?,
        other => {
            let n = read::whole(path, other).map_err(|_| {
                read::wrong(path.to_owned(), "a gRPC status code name or number", other)
            })?;
            usize::try_from(n)
                .ok()
                .filter(|n| *n < GRPC_CODE_NAMES.len())
                .ok_or_else(|| ConfigError::at(path, format!("{n} is not in 0..=16")))?
        }
    };
    if code == 0 {
        return Err(ConfigError::at(path, "OK is not a failure"));
    }
    Ok(code as i32)
}

fn codes(list: Vec<i32>) -> GrpcCodeSet {
    list.into_iter().fold(GrpcCodeSet::new(), GrpcCodeSet::with)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(toml: &str) -> String {
        Settings::from_toml(toml).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_path_and_the_rule() {
        assert_eq!(
            err("[dependencies.payments.retry]\nmax_attempts = 0"),
            "dependencies.payments.retry.max_attempts: 0 is not in 1..=100"
        );
        assert_eq!(
            err("[dependencies.payments.budget]\nratio = 1.5"),
            "dependencies.payments.budget.ratio: 1.5 is not from 0.0 to 1.0"
        );
        assert_eq!(
            err("[dependencies.a.retry]\nbackoff = { base = \"5s\", cap = \"1s\" }"),
            "dependencies.a.retry.backoff.cap: 1s is not at least the base, 5s"
        );
        assert_eq!(
            err("[dependencies.a.retry]\nmax_retry_after = \"soon\""),
            "dependencies.a.retry.max_retry_after: \"soon\" is not a duration such as \"200ms\", \"1.5s\" or \"2m\""
        );
        assert_eq!(
            err("[dependencies.a.retry]\nretryable_grpc_codes = [\"UNAVAILABLE\", \"SLOW\"]"),
            "dependencies.a.retry.retryable_grpc_codes[1]: \"SLOW\" is not a gRPC status code name such as \"UNAVAILABLE\""
        );
        assert_eq!(
            err("[dependencies.a.retry]\nretryable_statuses = [503, 1000]"),
            "dependencies.a.retry.retryable_statuses[1]: 1000 is not in 100..=999"
        );
        assert_eq!(
            err("[dependencies.a.breaker]\nconsecutive_failures = 0"),
            "dependencies.a.breaker.consecutive_failures: 0 is not in 1..=4294967295 (false turns the rule off)"
        );
        assert_eq!(
            err("[dependencies.a.load_control]\ntolerance = 0.5"),
            "dependencies.a.load_control.tolerance: 0.5 is not above 1 and at most 10"
        );
        assert_eq!(
            err("[dependencies.a.load_control]\nmin = 8\nmax = 4"),
            "dependencies.a.load_control.max: 4 is not at least min, 8"
        );
        assert_eq!(
            err("[dependencies.a.load_control]\nmax_wait = \"soon\""),
            "dependencies.a.load_control.max_wait: \"soon\" is not a duration such as \"200ms\", \"1.5s\" or \"2m\""
        );
        assert_eq!(
            err("[dependencies.a.hedging]\nmax_attempts = \"two\""),
            "dependencies.a.hedging.max_attempts: expected a whole number, found the string \"two\""
        );
        assert_eq!(
            err("[defaults.budget]\nwindow = \"0s\""),
            "defaults.budget.window: 0ns is not from 1ms to 10 years"
        );
        assert_eq!(
            err("[dependencies.a]\nretries = 3"),
            "dependencies.a.retries: unknown field (expected one of: breaker, budget, grpc_service_config, hedging, load_control, retry, retry_throttling)"
        );
        assert_eq!(
            err("[dependency.a]"),
            "dependency: unknown field (expected one of: defaults, dependencies)"
        );
        assert!(err("[dependencies.a\n").starts_with("not valid TOML"));
    }

    #[test]
    fn hostile_values_are_errors_not_panics() {
        assert_eq!(
            err("[dependencies.a.budget]\nratio = nan"),
            "dependencies.a.budget.ratio: expected a number, found null, nan or inf"
        );
        for text in [
            "[dependencies.a.budget]\nratio = inf",
            "[dependencies.a.budget]\nratio = -inf",
            "[dependencies.a.retry]\nmax_attempts = 9223372036854775807",
            "[dependencies.a.retry]\nmax_attempts = -9223372036854775808",
            "[dependencies.a.retry]\nmax_replay_bytes = -1",
            "[dependencies.a.retry]\nmax_retry_after = \"-1s\"",
            "[dependencies.a.retry]\nmax_retry_after = \"99999999999999999999h\"",
            "[dependencies.a.retry]\nmax_retry_after = 1979-05-27T07:32:00Z",
            "[dependencies.a.retry]\nbackoff = { base = \"1ns\", cap = \"5124096h\" }",
            "[dependencies.a.retry]\nbackoff = { multiplier = 0.0 }",
            "[dependencies.a.retry]\nretryable_statuses = [99, 1000, -5]",
            "[dependencies.a.retry]\nretryable_grpc_codes = [17]",
            "[dependencies.a.retry]\nretryable_grpc_codes = [\"OK\"]",
            "[dependencies.a.breaker]\njitter = 2.0",
            "[dependencies.a.breaker]\nprobes = 0",
            "[dependencies.a.hedging]\npercentile = 1.0",
            "[dependencies.a.retry_throttling]\nmax_tokens = 1001",
            "[dependencies.a]\ngrpc_service_config = 5",
            "dependencies = 5",
            "[dependencies]\na = []",
            "[dependencies.\"\"]",
        ] {
            assert!(Settings::from_toml(text).is_err(), "{text}");
        }
        for text in [
            "",
            "[]",
            "null",
            "{\"dependencies\": null}",
            "{\"dependencies\": {\"a\": 1}}",
        ] {
            assert!(Settings::from_json(text).is_err(), "{text}");
        }
        for text in [
            "",
            "[]",
            "{\"methodConfig\": {}}",
            "{\"methodConfig\": [1]}",
            "{\"methodConfig\": [{\"name\": [{\"service\": 5}]}]}",
        ] {
            assert!(Settings::from_grpc_service_config(text).is_err(), "{text}");
        }
    }

    #[test]
    fn defaults_are_laid_under_every_dependency() {
        let settings = Settings::from_toml(
            r#"
            [defaults.retry]
            max_attempts = 4
            backoff = { base = "10ms", cap = "1s" }
            [dependencies.a.retry]
            backoff = { cap = "2s" }
            [dependencies.b]
            breaker = { enabled = false }
            "#,
        )
        .expect("valid");
        let a = settings.dependency("a").expect("a");
        assert_eq!(a.retry.max_attempts, 4);
        assert_eq!(a.retry.backoff.base(), Duration::from_millis(10));
        assert_eq!(a.retry.backoff.cap(), Duration::from_secs(2));
        assert!(a.breaker.is_some());
        let b = settings.dependency("b").expect("b");
        assert_eq!(b.retry.max_attempts, 4);
        assert!(b.breaker.is_none());
        assert!(b.hedging.is_none());
        assert_eq!(settings.dependencies().count(), 2);
    }

    #[test]
    fn a_method_configs_timeout_is_read_for_its_names() {
        let settings = Settings::from_grpc_service_config(
            r#"{"methodConfig": [
                {"name": [{"service": "a.A"}], "timeout": "2.5s"},
                {"name": [{"service": "a.A", "method": "Stream"}]},
                {"name": [{}], "timeout": "30s", "waitForReady": true}
            ]}"#,
        )
        .expect("valid");
        let dependency = settings.dependency("default").expect("default");
        let timeouts = dependency.method_timeouts.as_ref().expect("timeouts");
        let timeout = |path| timeouts.lookup(path).copied().flatten();
        assert_eq!(timeout("/a.A/Get"), Some(Duration::from_millis(2500)));
        // A method's own config without a timeout has none, whatever its service's says.
        assert_eq!(timeout("/a.A/Stream"), None);
        assert_eq!(timeout("/b.B/Get"), Some(Duration::from_secs(30)));
        for (bad, message) in [
            (
                r#""0s""#,
                "methodConfig[0].timeout: 0s is not greater than 0",
            ),
            ("5", "methodConfig[0].timeout"),
        ] {
            let json = format!(r#"{{"methodConfig": [{{"name": [{{}}], "timeout": {bad}}}]}}"#);
            let err = Settings::from_grpc_service_config(&json).expect_err("refused");
            assert!(err.to_string().starts_with(message), "{err}");
        }
    }

    #[test]
    fn a_dependency_takes_a_grpc_service_config_as_json_or_tables() {
        let policy = concat!(
            r#"{"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "#,
            r#""backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}"#
        );
        let settings = Settings::from_toml(&format!(
            r#"
            [dependencies.users]
            grpc_service_config = '{{"methodConfig": [{{"name": [{{"service": "u.Users"}}], "retryPolicy": {policy}}}]}}'
            [dependencies.users.budget]
            ratio = 0.2
            [dependencies.orders.grpc_service_config]
            retryThrottling = {{ maxTokens = 5, tokenRatio = 0.5 }}
            [[dependencies.orders.grpc_service_config.methodConfig]]
            name = [{{ service = "o.Orders", method = "Get" }}]
            hedgingPolicy = {{ maxAttempts = 2, hedgingDelay = "0.05s" }}
            "#
        ))
        .expect("valid");
        let users = settings.dependency("users").expect("users");
        let methods = users.methods.as_ref().expect("methods");
        assert!(
            matches!(methods.lookup("/u.Users/Find"), Some(MethodPolicy::Retry(r)) if r.max_attempts == 3)
        );
        let orders = settings.dependency("orders").expect("orders");
        let methods = orders.methods.as_ref().expect("methods");
        assert!(matches!(
            methods.lookup("/o.Orders/Get"),
            Some(MethodPolicy::Hedge(_))
        ));
        assert!(orders.throttle.is_some());

        assert_eq!(
            err("[dependencies.u]\ngrpc_service_config = '{\"methodConfig\": [{\"name\": [{\"method\": \"Get\"}]}]}'"),
            "dependencies.u.grpc_service_config.methodConfig[0].name[0].method: a method name needs its service"
        );
        assert_eq!(
            err("[dependencies.u]\nretry_throttling = { max_tokens = 1 }\ngrpc_service_config = { retryThrottling = { maxTokens = 2, tokenRatio = 0.1 } }"),
            "dependencies.u.grpc_service_config.retryThrottling: throttling is also set by dependencies.u.retry_throttling"
        );
        assert!(err("[dependencies.u]\ngrpc_service_config = '{'")
            .starts_with("dependencies.u.grpc_service_config: not valid JSON"));
    }

    #[test]
    fn json_reads_the_same_shape() {
        let settings = Settings::from_json(
            r#"{"dependencies": {"users": {"retry": {"max_attempts": 2},
                "hedging": {"delay": "30ms"}, "budget": {"allowance": 3}}}}"#,
        )
        .expect("valid");
        let users = settings.dependency("users").expect("users");
        assert_eq!(users.retry.max_attempts, 2);
        let hedging = users.hedging.as_ref().expect("hedging on");
        assert_eq!(hedging.delay, Some(Duration::from_millis(30)));
        let budget = users.budget.clone().build().expect("checked");
        assert_eq!(budget.allowance(), 3);
    }
}
