//! Reading a parsed document by hand, keeping the path of every value for the errors.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::ConfigError;

/// A table of the document being read: takes its keys one by one, then complains about
/// the keys nobody took.
pub(super) struct Table<'a> {
    path: String,
    map: &'a Map<String, Value>,
    taken: Vec<&'static str>,
}

/// `parent.key`, or `key` at the top.
pub(super) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

impl<'a> Table<'a> {
    /// `value` read as a table found at `path`.
    pub(super) fn new(path: impl Into<String>, value: &'a Value) -> Result<Self, ConfigError> {
        let path = path.into();
        match value {
            Value::Object(map) => Ok(Table {
                path,
                map,
                taken: Vec::new(),
            }),
            other => Err(ConfigError::at(
                path,
                format!("expected a table, found {}", kind(other)),
            )),
        }
    }

    pub(super) fn path(&self) -> &str {
        &self.path
    }

    /// The path of `key` in this table.
    pub(super) fn path_of(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// The value of `key`, if the document has it.
    pub(super) fn value(&mut self, key: &'static str) -> Option<&'a Value> {
        self.taken.push(key);
        self.map.get(key)
    }

    /// The sub-table `key`, if present.
    pub(super) fn table(&mut self, key: &'static str) -> Result<Option<Table<'a>>, ConfigError> {
        let path = self.path_of(key);
        self.value(key).map(|v| Table::new(path, v)).transpose()
    }

    /// Every entry of this table, for tables whose keys are names (dependencies).
    pub(super) fn entries(&self) -> impl Iterator<Item = (&'a String, &'a Value)> {
        self.map.iter()
    }

    pub(super) fn bool(&mut self, key: &'static str) -> Result<Option<bool>, ConfigError> {
        let path = self.path_of(key);
        self.value(key)
            .map(|v| v.as_bool().ok_or_else(|| wrong(path, "true or false", v)))
            .transpose()
    }

    pub(super) fn f64(&mut self, key: &'static str) -> Result<Option<f64>, ConfigError> {
        let path = self.path_of(key);
        self.value(key)
            .map(|v| v.as_f64().ok_or_else(|| wrong(path, "a number", v)))
            .transpose()
    }

    /// A whole number in `min..=max`.
    pub(super) fn u32_in(
        &mut self,
        key: &'static str,
        min: u32,
        max: u32,
    ) -> Result<Option<u32>, ConfigError> {
        let path = self.path_of(key);
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let n = whole(&path, v)?;
        match u32::try_from(n) {
            Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ConfigError::at(
                path,
                format!("{n} is not in {min}..={max}"),
            )),
        }
    }

    /// A whole number of bytes, or `None` when absent.
    pub(super) fn bytes(&mut self, key: &'static str) -> Result<Option<usize>, ConfigError> {
        let path = self.path_of(key);
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let n = whole(&path, v)?;
        usize::try_from(n)
            .map(Some)
            .map_err(|_| ConfigError::at(path, format!("{n} is not a size in bytes")))
    }

    pub(super) fn str(&mut self, key: &'static str) -> Result<Option<&'a str>, ConfigError> {
        let path = self.path_of(key);
        self.value(key)
            .map(|v| v.as_str().ok_or_else(|| wrong(path, "a string", v)))
            .transpose()
    }

    /// A duration written as a string: `"200ms"`, `"1.5s"`, `"2m"`.
    pub(super) fn duration(&mut self, key: &'static str) -> Result<Option<Duration>, ConfigError> {
        let path = self.path_of(key);
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let text = v
            .as_str()
            .ok_or_else(|| wrong(path.clone(), "a duration such as \"200ms\"", v))?;
        parse_duration(text).map(Some).ok_or_else(|| {
            ConfigError::at(
                path,
                format!("{text:?} is not a duration such as \"200ms\", \"1.5s\" or \"2m\""),
            )
        })
    }

    /// A list, each item read by `item` with its own path.
    pub(super) fn list<T>(
        &mut self,
        key: &'static str,
        mut item: impl FnMut(&str, &'a Value) -> Result<T, ConfigError>,
    ) -> Result<Option<Vec<T>>, ConfigError> {
        let path = self.path_of(key);
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let items = v
            .as_array()
            .ok_or_else(|| wrong(path.clone(), "a list", v))?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| item(&format!("{path}[{i}]"), v))
            .collect::<Result<Vec<T>, _>>()
            .map(Some)
    }

    /// Fails on the first key that was not taken, naming the keys that would have been.
    pub(super) fn finish(self) -> Result<(), ConfigError> {
        let Some(unknown) = self.map.keys().find(|k| !self.taken.contains(&k.as_str())) else {
            return Ok(());
        };
        let mut known = self.taken.clone();
        known.sort_unstable();
        known.dedup();
        Err(ConfigError::at(
            join(&self.path, unknown),
            format!("unknown field (expected one of: {})", known.join(", ")),
        ))
    }
}

/// An error for a value of the wrong type.
pub(super) fn wrong(path: String, expected: &str, found: &Value) -> ConfigError {
    ConfigError::at(path, format!("expected {expected}, found {}", kind(found)))
}

/// A whole number, negative or not.
pub(super) fn whole(path: &str, v: &Value) -> Result<i128, ConfigError> {
    if let Some(n) = v.as_i64() {
        return Ok(i128::from(n));
    }
    if let Some(n) = v.as_u64() {
        return Ok(i128::from(n));
    }
    Err(wrong(path.to_owned(), "a whole number", v))
}

fn kind(v: &Value) -> String {
    match v {
        // TOML has no null: there it is a nan or an infinity, which JSON cannot hold.
        Value::Null => "null, nan or inf".to_owned(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".to_owned(),
        Value::Object(_) => "a table".to_owned(),
    }
}

/// `"200ms"`, `"1.5s"`, `".1s"` (protobuf JSON's form, which gRPC service configs use),
/// `"2m"`, `"1h"`, `"500us"`, `"10ns"`: one decimal number and one unit. `None` for
/// anything else, a negative number, or more than `u64::MAX` seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let nanos_per_unit: u128 = match unit.trim_start() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return None,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !digits(fraction) || fraction.len() > 9 {
        return None;
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let scale = 10u128.pow(fraction.len() as u32);
    let fraction: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().ok()?
    };
    let nanos = whole
        .checked_mul(nanos_per_unit)?
        .checked_add(fraction * nanos_per_unit / scale)?;
    let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
    Some(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let ms = Duration::from_millis;
        assert_eq!(parse_duration("200ms"), Some(ms(200)));
        assert_eq!(parse_duration("20s"), Some(ms(20_000)));
        assert_eq!(parse_duration("1.5s"), Some(ms(1_500)));
        assert_eq!(parse_duration(".1s"), Some(ms(100)));
        assert_eq!(
            parse_duration("0.000000001s"),
            Some(Duration::from_nanos(1))
        );
        assert_eq!(parse_duration("2m"), Some(ms(120_000)));
        assert_eq!(parse_duration("1h"), Some(ms(3_600_000)));
        assert_eq!(parse_duration("250us"), Some(Duration::from_micros(250)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        assert_eq!(parse_duration(" 5 ms "), Some(ms(5)));
        for bad in [
            "",
            "ms",
            "5",
            "-1s",
            "1.2.3s",
            "1e3ms",
            "5 seconds",
            ".s",
            "1.0000000001s",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        assert_eq!(parse_duration("99999999999999999999999h"), None);
    }
}
