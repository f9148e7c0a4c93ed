//! gRFC A6's service config: `methodConfig` with `retryPolicy` or `hedgingPolicy`, and
//! `retryThrottling`.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::read::{join, parse_duration, wrong, Table};
use super::{codes, grpc_code, locate, DependencySettings};
use crate::methods::{GrpcHedgePolicy, GrpcRetryPolicy, MethodPolicy, MethodTable};
use crate::throttle::{RetryThrottle, RetryThrottleBuilder};
use crate::{Backoff, ConfigError, Jitter};

/// What a service config gives a dependency.
pub(super) struct ServiceConfig {
    pub(super) methods: MethodTable<MethodPolicy>,
    /// `methodConfig.timeout`, by method (`None`: the method's config has none), found
    /// as its policy is: a call's deadline when it has none of its own.
    pub(super) timeouts: MethodTable<Option<Duration>>,
    pub(super) throttle: Option<RetryThrottleBuilder>,
}

/// Reads a service config's JSON text into a dependency's settings.
pub(super) fn read(json: &str) -> Result<DependencySettings, ConfigError> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| ConfigError::at("", format!("not valid JSON: {e}")))?;
    let config = read_value("", &value)?;
    Ok(DependencySettings {
        methods: Some(config.methods),
        method_timeouts: Some(config.timeouts),
        throttle: config.throttle,
        ..DependencySettings::default()
    })
}

/// Reads a service config found at `path`. Fields this library does not use
/// (`waitForReady`, `maxRequestMessageBytes`, `maxResponseMessageBytes`,
/// `loadBalancingConfig`, `loadBalancingPolicy`, `healthCheckConfig`, and any other) are
/// ignored, as gRPC ignores fields it does not
/// know, so a tonic user's file reads as it is.
pub(super) fn read_value(path: &str, value: &Value) -> Result<ServiceConfig, ConfigError> {
    let value = canonical_keys(path, value)?;
    let mut top = Table::new(path, &value)?;
    let mut table = MethodTable::default();
    let mut timeouts = MethodTable::default();
    let mut first_seen: HashMap<String, String> = HashMap::new();
    if let Some(configs) = top.list("methodConfig", |path, v| Ok((path.to_owned(), v)))? {
        for (path, config) in configs {
            let mut t = Table::new(path.clone(), config)?;
            let names = t
                .list("name", |path, v| Ok((path.to_owned(), v)))?
                .unwrap_or_default();
            // A method config that names no method applies to none: grpc-go and
            // grpc-java skip it, unread, and so does this reader.
            if names.is_empty() {
                continue;
            }
            let policy = read_method(&mut t)?;
            let timeout = timeout(&mut t)?;
            for (name_path, name) in names {
                let key = read_name(&name_path, name)?;
                if let Some(first) = first_seen.insert(key.display(), name_path.clone()) {
                    return Err(ConfigError::at(
                        name_path,
                        format!("{} is named twice (first at {first})", key.display()),
                    ));
                }
                match key {
                    Name::Method(m) => {
                        timeouts.insert_method(m.clone(), timeout);
                        table.insert_method(m, policy)
                    }
                    Name::Service(s) => {
                        timeouts.insert_service(s.clone(), timeout);
                        table.insert_service(s, policy)
                    }
                    Name::Default => {
                        timeouts.set_default(timeout);
                        table.set_default(policy)
                    }
                }
            }
        }
    }
    let mut throttle = None;
    if let Some(mut t) = top.table("retryThrottling")? {
        let max_tokens = required(&mut t, "maxTokens")?;
        let token_ratio = required(&mut t, "tokenRatio")?;
        let builder = RetryThrottle::builder()
            .max_tokens(max_tokens)
            .token_ratio(token_ratio);
        let keys = [("max_tokens", "maxTokens"), ("token_ratio", "tokenRatio")];
        builder.clone().build().map_err(|e| locate(&t, e, &keys))?;
        throttle = Some(builder);
    }
    Ok(ServiceConfig {
        methods: table,
        timeouts,
        throttle,
    })
}

/// A method config's `timeout`, if it has one: greater than zero.
fn timeout(t: &mut Table<'_>) -> Result<Option<Duration>, ConfigError> {
    let path = t.path_of("timeout");
    let Some(v) = t.value("timeout") else {
        return Ok(None);
    };
    let d = proto_duration(&path, v)?;
    if d.is_zero() {
        return Err(ConfigError::at(path, "0s is not greater than 0"));
    }
    Ok(Some(d))
}

/// The fields of a service config this reader uses, spelled as gRPC's JSON spells them.
const FIELDS: [&str; 17] = [
    "methodConfig",
    "timeout",
    "name",
    "service",
    "method",
    "retryPolicy",
    "hedgingPolicy",
    "maxAttempts",
    "initialBackoff",
    "maxBackoff",
    "backoffMultiplier",
    "retryableStatusCodes",
    "hedgingDelay",
    "nonFatalStatusCodes",
    "retryThrottling",
    "maxTokens",
    "tokenRatio",
];

/// `value` with each key that names one of [`FIELDS`], however it is written, spelled
/// as there: grpc-go reads a service config's keys without regard to case (its own
/// examples write `MaxAttempts`), and protobuf's JSON readers take the proto field
/// names too (`max_attempts`). A field given twice is an error.
fn canonical_keys(path: &str, value: &Value) -> Result<Value, ConfigError> {
    match value {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (key, v) in map {
                let field = FIELDS
                    .into_iter()
                    .find(|field| same_field(field, key))
                    .unwrap_or(key);
                let at = join(path, key);
                let v = canonical_keys(&at, v)?;
                if out.insert(field.to_owned(), v).is_some() {
                    return Err(ConfigError::at(
                        at,
                        format!("{field} is given twice, spelled differently"),
                    ));
                }
            }
            Ok(Value::Object(out))
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| canonical_keys(&format!("{path}[{i}]"), v))
            .collect::<Result<_, _>>()
            .map(Value::Array),
        other => Ok(other.clone()),
    }
}

/// Whether `key` is `field` written in another case, or with underscores.
fn same_field(field: &str, key: &str) -> bool {
    let key = key.bytes().filter(|&b| b != b'_');
    key.map(|b| b.to_ascii_lowercase())
        .eq(field.bytes().map(|b| b.to_ascii_lowercase()))
}

enum Name {
    Method(String),
    Service(String),
    Default,
}

impl Name {
    fn display(&self) -> String {
        match self {
            Name::Method(m) => format!("method {m:?}"),
            Name::Service(s) => format!("service {s:?}"),
            Name::Default => "the default ({})".to_owned(),
        }
    }
}

fn read_name(path: &str, value: &Value) -> Result<Name, ConfigError> {
    let mut t = Table::new(path, value)?;
    let service = t.str("service")?.unwrap_or("");
    let method = t.str("method")?.unwrap_or("");
    match (service, method) {
        ("", "") => Ok(Name::Default),
        ("", _) => Err(ConfigError::at(
            t.path_of("method"),
            "a method name needs its service",
        )),
        (s, "") => Ok(Name::Service(s.to_owned())),
        (s, m) => Ok(Name::Method(format!("/{s}/{m}"))),
    }
}

fn read_method(t: &mut Table<'_>) -> Result<MethodPolicy, ConfigError> {
    let retry = t.table("retryPolicy")?;
    let hedge = t.table("hedgingPolicy")?;
    match (retry, hedge) {
        (Some(_), Some(_)) => Err(ConfigError::at(
            t.path(),
            "retryPolicy and hedgingPolicy cannot both be set (gRFC A6)",
        )),
        (Some(mut r), None) => {
            let max_attempts = attempts(&mut r)?;
            let initial = seconds(&mut r, "initialBackoff")?;
            let max = seconds(&mut r, "maxBackoff")?;
            let multiplier = required(&mut r, "backoffMultiplier")?;
            if multiplier <= 0.0 {
                return Err(ConfigError::at(
                    r.path_of("backoffMultiplier"),
                    format!("{multiplier} is not greater than 0"),
                ));
            }
            // A6's ceiling is min(initial * multiplier^n, max), so an initial backoff
            // above the maximum is the maximum.
            let keys = [
                ("backoff cap", "maxBackoff"),
                ("backoff multiplier", "backoffMultiplier"),
            ];
            let backoff = Backoff::new(initial.min(max), max, Jitter::Full)
                .and_then(|b| b.with_multiplier(multiplier))
                .map_err(|e| locate(&r, e, &keys))?;
            let path = r.path_of("retryableStatusCodes");
            let list = r
                .list("retryableStatusCodes", grpc_code)?
                .ok_or_else(|| ConfigError::at(path.clone(), "is required"))?;
            if list.is_empty() {
                return Err(ConfigError::at(path, "must not be empty (gRFC A6)"));
            }
            let policy = GrpcRetryPolicy::new(max_attempts, backoff, codes(list))
                .map_err(|e| locate(&r, e, &[("maxAttempts", "maxAttempts")]))?;
            Ok(MethodPolicy::Retry(policy))
        }
        (None, Some(mut h)) => {
            let max_attempts = attempts(&mut h)?;
            let delay = match h.value("hedgingDelay") {
                None => Duration::ZERO,
                Some(v) => proto_duration(&h.path_of("hedgingDelay"), v)?,
            };
            let list = h
                .list("nonFatalStatusCodes", grpc_code)?
                .unwrap_or_default();
            let keys = [
                ("maxAttempts", "maxAttempts"),
                ("hedgingDelay", "hedgingDelay"),
            ];
            let policy = GrpcHedgePolicy::new(max_attempts, delay, codes(list))
                .map_err(|e| locate(&h, e, &keys))?;
            Ok(MethodPolicy::Hedge(policy))
        }
        (None, None) => Ok(MethodPolicy::Neither),
    }
}

/// `maxAttempts`: required, at least 2 (said here with the number as written; the
/// policy's constructor reads above 5 as 5).
fn attempts(t: &mut Table<'_>) -> Result<u32, ConfigError> {
    let path = t.path_of("maxAttempts");
    let v = t
        .value("maxAttempts")
        .ok_or_else(|| ConfigError::at(path.clone(), "is required"))?;
    // proto3 JSON writes a uint32 as a number, and readers take a string of one too.
    let n = match v {
        Value::String(text) => text
            .parse::<i128>()
            .map_err(|_| wrong(path.clone(), "a whole number", v))?,
        _ => super::read::whole(&path, v)?,
    };
    if n < 2 {
        return Err(ConfigError::at(
            path,
            format!("{n} is not at least 2 (gRFC A6)"),
        ));
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// A required number; proto3 JSON readers take it as a string too (`"0.1"`).
fn required(t: &mut Table<'_>, key: &'static str) -> Result<f64, ConfigError> {
    let path = t.path_of(key);
    let v = t
        .value(key)
        .ok_or_else(|| ConfigError::at(path.clone(), "is required"))?;
    v.as_f64()
        .or_else(|| v.as_str().and_then(|text| text.trim().parse::<f64>().ok()))
        .filter(|n| n.is_finite())
        .ok_or_else(|| wrong(path, "a number", v))
}

/// A required duration greater than zero.
fn seconds(t: &mut Table<'_>, key: &'static str) -> Result<Duration, ConfigError> {
    let path = t.path_of(key);
    let v = t
        .value(key)
        .ok_or_else(|| ConfigError::at(path.clone(), "is required"))?;
    let d = proto_duration(&path, v)?;
    if d.is_zero() {
        return Err(ConfigError::at(path, "0s is not greater than 0 (gRFC A6)"));
    }
    Ok(d)
}

/// A protobuf JSON duration: decimal seconds with an `s`, `"0.1s"` or `".1s"`.
fn proto_duration(path: &str, v: &Value) -> Result<Duration, ConfigError> {
    let text = v
        .as_str()
        .ok_or_else(|| wrong(path.to_owned(), "a duration such as \"0.1s\"", v))?;
    let seconds = text
        .strip_suffix('s')
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit() || b == b'.'));
    seconds.and_then(|_| parse_duration(text)).ok_or_else(|| {
        ConfigError::at(
            path,
            format!("{text:?} is not a duration in seconds such as \"0.1s\""),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn methods(json: &str) -> MethodTable<MethodPolicy> {
        let settings = Settings::from_grpc_service_config(json).expect("valid");
        let dependency = settings.dependency("default").expect("default");
        dependency.methods.clone().expect("methods")
    }

    fn err(json: &str) -> String {
        Settings::from_grpc_service_config(json)
            .unwrap_err()
            .to_string()
    }

    /// The retry policy and throttling of gRFC A6's examples.
    #[test]
    fn a6_retry_example() {
        let json = r#"{
          "loadBalancingConfig": [{"round_robin": {}}],
          "methodConfig": [{
            "name": [{"service": "grpc.testing.TestService"}],
            "timeout": "10s",
            "retryPolicy": {
              "maxAttempts": 4,
              "initialBackoff": "0.1s",
              "maxBackoff": "1s",
              "backoffMultiplier": 2,
              "retryableStatusCodes": ["UNAVAILABLE"]
            }
          }],
          "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
        }"#;
        let table = methods(json);
        let Some(MethodPolicy::Retry(retry)) = table.lookup("/grpc.testing.TestService/UnaryCall")
        else {
            panic!("a retry policy for the service's methods");
        };
        assert_eq!(retry.max_attempts, 4);
        assert_eq!(retry.backoff.ceiling(0), Duration::from_millis(100));
        assert_eq!(retry.backoff.ceiling(3), Duration::from_millis(800));
        assert_eq!(retry.backoff.ceiling(4), Duration::from_secs(1));
        assert!(retry.codes.contains(14) && !retry.codes.contains(13));
        let settings = Settings::from_grpc_service_config(json).expect("valid");
        let throttle = settings
            .dependency("default")
            .and_then(|d| d.throttle.clone());
        let throttle = throttle.expect("throttling").build().expect("checked");
        assert_eq!((throttle.max_tokens(), throttle.token_ratio()), (10.0, 0.1));
    }

    /// The hedging policy of gRFC A6's example.
    #[test]
    fn a6_hedging_example() {
        let table = methods(
            r#"{"methodConfig": [{
              "name": [{"service": "grpc.testing.TestService", "method": "UnaryCall"}],
              "hedgingPolicy": {
                "maxAttempts": 4,
                "hedgingDelay": "0.5s",
                "nonFatalStatusCodes": ["UNAVAILABLE", "INTERNAL", "ABORTED"]
              }
            }]}"#,
        );
        let hedge = GrpcHedgePolicy {
            max_attempts: 4,
            delay: Duration::from_millis(500),
            non_fatal_codes: codes(vec![14, 13, 10]),
        };
        assert_eq!(
            table.lookup("/grpc.testing.TestService/UnaryCall"),
            Some(&MethodPolicy::Hedge(hedge))
        );
        assert_eq!(table.lookup("/grpc.testing.TestService/Other"), None);
    }

    /// grpc-go reads keys in any case (its retry example writes `MaxAttempts`), and
    /// protobuf's JSON readers take proto field names (`max_attempts`).
    #[test]
    fn keys_as_grpc_go_and_protobuf_write_them() {
        let table = methods(
            r#"{"MethodConfig": [{
              "Name": [{"Service": "grpc.examples.echo.Echo"}],
              "RetryPolicy": {
                "MaxAttempts": 4,
                "InitialBackoff": ".01s",
                "MaxBackoff": ".01s",
                "BackoffMultiplier": 1.0,
                "RetryableStatusCodes": ["UNAVAILABLE"]
              }
            }, {
              "name": [{"service": "b.B"}],
              "hedging_policy": {"max_attempts": 3, "hedging_delay": "0.1s"}
            }]}"#,
        );
        assert!(matches!(
            table.lookup("/grpc.examples.echo.Echo/UnaryEcho"),
            Some(MethodPolicy::Retry(r)) if r.max_attempts == 4
        ));
        assert!(matches!(
            table.lookup("/b.B/M"),
            Some(MethodPolicy::Hedge(h)) if h.max_attempts == 3 && h.delay == Duration::from_millis(100)
        ));
        assert_eq!(
            err(r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "max_attempts": 3}}]}"#),
            "methodConfig[0].retryPolicy.max_attempts: maxAttempts is given twice, spelled differently"
        );
    }

    /// A method config that names no method applies to none: skipped unread (its
    /// policies are not checked either), as grpc-go and grpc-java skip it.
    #[test]
    fn a_method_config_without_names_is_skipped() {
        let table = methods(
            r#"{"methodConfig": [
              {"retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s",
                "backoffMultiplier": 1, "retryableStatusCodes": [14]}},
              {"name": [], "hedgingPolicy": {"maxAttempts": 1}},
              {"name": [{"service": "a.A"}], "hedgingPolicy": {"maxAttempts": 2}}
            ]}"#,
        );
        assert_eq!(table.lookup("/x.X/M"), None);
        assert!(matches!(
            table.lookup("/a.A/M"),
            Some(MethodPolicy::Hedge(_))
        ));
    }

    #[test]
    fn most_specific_name_wins_and_attempts_are_capped() {
        let policy = |n: u32| {
            format!(
                r#"{{"maxAttempts": {n}, "initialBackoff": ".1s", "maxBackoff": "1s",
                    "backoffMultiplier": 1.5, "retryableStatusCodes": [14]}}"#
            )
        };
        let table = methods(&format!(
            r#"{{"methodConfig": [
              {{"name": [{{}}], "retryPolicy": {}}},
              {{"name": [{{"service": "s.S"}}], "retryPolicy": {}}},
              {{"name": [{{"service": "s.S", "method": "M"}}], "retryPolicy": {}}}
            ]}}"#,
            policy(2),
            policy(3),
            policy(9)
        ));
        let attempts = |path| match table.lookup(path) {
            Some(MethodPolicy::Retry(r)) => r.max_attempts,
            _ => 0,
        };
        assert_eq!(attempts("/s.S/M"), 5, "9 is read as 5");
        assert_eq!(attempts("/s.S/N"), 3);
        assert_eq!(attempts("/t.T/M"), 2);
    }

    /// proto3 JSON lets numbers be strings; service configs written by a proto
    /// serializer, or by hand after one, read the same.
    #[test]
    fn numbers_as_strings_read_as_proto3_json_allows() {
        let table = methods(
            r#"{"methodConfig": [{"name": [{"service": "s.S"}],
              "retryPolicy": {"maxAttempts": "3", "initialBackoff": "0.25s",
                "maxBackoff": "2.5s", "backoffMultiplier": "1.5",
                "retryableStatusCodes": ["unavailable", 8]}}],
              "retryThrottling": {"maxTokens": "10", "tokenRatio": "0.5"}}"#,
        );
        let Some(MethodPolicy::Retry(retry)) = table.lookup("/s.S/M") else {
            panic!("a retry policy");
        };
        assert_eq!(retry.max_attempts, 3);
        assert_eq!(retry.backoff.ceiling(1), Duration::from_millis(375));
        assert!(retry.codes.contains(14) && retry.codes.contains(8));
        assert_eq!(
            err(r#"{"retryThrottling": {"maxTokens": "many", "tokenRatio": 0.1}}"#),
            "retryThrottling.maxTokens: expected a number, found the string \"many\""
        );
    }

    #[test]
    fn a6_validation() {
        let with = |policy: &str| {
            err(&format!(
                r#"{{"methodConfig": [{{"name": [{{"service": "s"}}], "retryPolicy": {policy}}}]}}"#
            ))
        };
        let base = r#""initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2"#;
        assert_eq!(
            with(&format!(
                r#"{{"maxAttempts": 1, {base}, "retryableStatusCodes": [14]}}"#
            )),
            "methodConfig[0].retryPolicy.maxAttempts: 1 is not at least 2 (gRFC A6)"
        );
        assert_eq!(
            with(&format!(
                r#"{{"maxAttempts": 3, {base}, "retryableStatusCodes": []}}"#
            )),
            "methodConfig[0].retryPolicy.retryableStatusCodes: must not be empty (gRFC A6)"
        );
        assert_eq!(
            with(&format!(r#"{{"maxAttempts": 3, {base}}}"#)),
            "methodConfig[0].retryPolicy.retryableStatusCodes: is required"
        );
        assert_eq!(
            with(
                r#"{"maxAttempts": 3, "initialBackoff": "0s", "maxBackoff": "1s",
                   "backoffMultiplier": 2, "retryableStatusCodes": [14]}"#
            ),
            "methodConfig[0].retryPolicy.initialBackoff: 0s is not greater than 0 (gRFC A6)"
        );
        assert_eq!(
            with(
                r#"{"maxAttempts": 3, "initialBackoff": "100ms", "maxBackoff": "1s",
                   "backoffMultiplier": 2, "retryableStatusCodes": [14]}"#
            ),
            "methodConfig[0].retryPolicy.initialBackoff: \"100ms\" is not a duration in seconds such as \"0.1s\""
        );
        assert_eq!(
            with(
                r#"{"maxAttempts": 3, "initialBackoff": "1s", "maxBackoff": "1s",
                   "backoffMultiplier": 0, "retryableStatusCodes": [14]}"#
            ),
            "methodConfig[0].retryPolicy.backoffMultiplier: 0 is not greater than 0"
        );
        assert_eq!(
            err(r#"{"methodConfig": [{"name": [{"method": "M"}]}]}"#),
            "methodConfig[0].name[0].method: a method name needs its service"
        );
        assert_eq!(
            err(r#"{"methodConfig": [{"name": [{"service": "s"}]}, {"name": [{"service": "s"}]}]}"#),
            "methodConfig[1].name[0]: service \"s\" is named twice (first at methodConfig[0].name[0])"
        );
        assert_eq!(
            err(r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#),
            "retryThrottling.maxTokens: 0.0 is not greater than 0 (at least 0.001) and at most 1000"
        );
        assert_eq!(
            err(r#"{"retryThrottling": {"maxTokens": 10}}"#),
            "retryThrottling.tokenRatio: is required"
        );
    }
}
