//! The breaker's settings and their builder, validated when built.

use std::time::Duration;

use crate::ConfigError;

/// The largest number of probes a half-open circuit may admit.
const MAX_PROBES: u32 = u16::MAX as u32;

/// The settings of a circuit breaker. `BreakerConfig::default()` gives the defaults
/// listed on each builder method.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::breaker::BreakerConfig;
///
/// let config = BreakerConfig::builder()
///     // Longer only for a client too quiet to finish `min_throughput` calls in 2 s.
///     .window(Duration::from_secs(2))
///     // `None` leaves the ratio alone to trip it; lower trips on partial outages.
///     .consecutive_failures(50)
///     // Longer only where a probe is expensive: the client is blind for the break.
///     .break_duration(Duration::from_millis(25))
///     .build()?;
/// assert_eq!(config, BreakerConfig::default());
/// assert_eq!(config.probes(), 1);
///
/// let err = BreakerConfig::builder().failure_ratio(1.5).build().unwrap_err();
/// assert_eq!(err.to_string(), "invalid failure_ratio: 1.5 (allowed: greater than 0 and at most 1)");
/// # Ok::<(), stormguard_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    pub(super) window: Duration,
    pub(super) min_throughput: u32,
    pub(super) failure_ratio: f64,
    pub(super) consecutive_failures: Option<u32>,
    pub(super) break_duration: Duration,
    pub(super) max_break_duration: Duration,
    pub(super) probes: u32,
    pub(super) jitter: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window: Duration::from_secs(2),
            min_throughput: 20,
            failure_ratio: 0.95,
            consecutive_failures: Some(50),
            break_duration: Duration::from_millis(25),
            max_break_duration: Duration::from_millis(25),
            probes: 1,
            jitter: 0.2,
        }
    }
}

impl BreakerConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> BreakerConfigBuilder {
        BreakerConfigBuilder {
            config: BreakerConfig::default(),
            max_break_set: false,
        }
    }

    /// The span of the sliding window over which the failure ratio is measured.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// How many calls the window must hold before the ratio can open the circuit.
    pub fn min_throughput(&self) -> u32 {
        self.min_throughput
    }

    /// The share of failures over the window that opens the circuit.
    pub fn failure_ratio(&self) -> f64 {
        self.failure_ratio
    }

    /// How many failures in a row open the circuit, if that rule is on.
    pub fn consecutive_failures(&self) -> Option<u32> {
        self.consecutive_failures
    }

    /// The length of the first break.
    pub fn break_duration(&self) -> Duration {
        self.break_duration
    }

    /// The longest break, however many probes failed (before jitter).
    pub fn max_break_duration(&self) -> Duration {
        self.max_break_duration
    }

    /// How many probe calls a half-open circuit admits at once, all of which must
    /// succeed to close it.
    pub fn probes(&self) -> u32 {
        self.probes
    }

    /// The most a break is stretched by, as a fraction of its length.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }
}

/// Builds a [`BreakerConfig`]; every value is checked in [`build`](Self::build).
#[derive(Debug, Clone)]
#[must_use]
pub struct BreakerConfigBuilder {
    config: BreakerConfig,
    /// Whether `max_break_duration` was given; if not, it follows `break_duration`.
    max_break_set: bool,
}

impl From<BreakerConfig> for BreakerConfigBuilder {
    /// A builder holding every setting of `config`, to change some of them.
    fn from(config: BreakerConfig) -> Self {
        BreakerConfigBuilder {
            config,
            max_break_set: true,
        }
    }
}

impl BreakerConfigBuilder {
    /// The span of the sliding window (default 2 s), from 10 ms to 365 days. It is kept
    /// as ten buckets, so outcomes leave the window a tenth of it at a time.
    pub fn window(mut self, window: Duration) -> Self {
        self.config.window = window;
        self
    }

    /// How many calls (successes and failures; ignored outcomes do not count) the window
    /// must hold before the failure ratio can open the circuit (default 20), at least 1.
    pub fn min_throughput(mut self, calls: u32) -> Self {
        self.config.min_throughput = calls;
        self
    }

    /// The share of failures over the window that opens the circuit (default 0.95),
    /// greater than 0 and at most 1.
    pub fn failure_ratio(mut self, ratio: f64) -> Self {
        self.config.failure_ratio = ratio;
        self
    }

    /// Also open the circuit after this many failures in a row, whatever the window holds
    /// (default 50). Takes a `u32` or an `Option<u32>`; `None` turns the rule off, 0 is
    /// rejected.
    pub fn consecutive_failures(mut self, failures: impl Into<Option<u32>>) -> Self {
        self.config.consecutive_failures = failures.into();
        self
    }

    /// The length of the first break (default 25 ms), more than zero.
    pub fn break_duration(mut self, duration: Duration) -> Self {
        self.config.break_duration = duration;
        self
    }

    /// The longest break (default: the same as `break_duration`, whatever that is set
    /// to), at least `break_duration`. Each failed probe doubles the break up to this.
    pub fn max_break_duration(mut self, duration: Duration) -> Self {
        self.config.max_break_duration = duration;
        self.max_break_set = true;
        self
    }

    /// How many probe calls a half-open circuit admits at once (default 1), from 1 to
    /// 65535. All of them must succeed to close the circuit.
    pub fn probes(mut self, probes: u32) -> Self {
        self.config.probes = probes;
        self
    }

    /// How much each break is stretched, at random, as a fraction of its length (default
    /// 0.2), from 0 to 1: a break of `d` lasts `d × U[1, 1 + jitter]`, so it can exceed
    /// `max_break_duration` by up to that fraction. Clients that tripped together then do
    /// not probe again in lockstep. 0 makes breaks exact.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.config.jitter = jitter;
        self
    }

    /// Checks every setting and returns the configuration, or an error naming the first
    /// setting that is out of range.
    pub fn build(self) -> Result<BreakerConfig, ConfigError> {
        let mut c = self.config;
        if !self.max_break_set {
            c.max_break_duration = c.break_duration;
        }
        if c.window < Duration::from_millis(10) || c.window > Duration::from_secs(365 * 86_400) {
            return Err(ConfigError::invalid(
                "window",
                c.window,
                "from 10ms to 365 days",
            ));
        }
        if c.min_throughput == 0 {
            return Err(ConfigError::invalid(
                "min_throughput",
                c.min_throughput,
                "at least 1",
            ));
        }
        if !(c.failure_ratio > 0.0 && c.failure_ratio <= 1.0) {
            return Err(ConfigError::invalid(
                "failure_ratio",
                c.failure_ratio,
                "greater than 0 and at most 1",
            ));
        }
        if c.consecutive_failures == Some(0) {
            return Err(ConfigError::invalid(
                "consecutive_failures",
                0,
                "at least 1, or None to turn the rule off",
            ));
        }
        if c.break_duration.is_zero() {
            return Err(ConfigError::invalid(
                "break_duration",
                c.break_duration,
                "more than zero",
            ));
        }
        if c.max_break_duration < c.break_duration {
            return Err(ConfigError::invalid(
                "max_break_duration",
                c.max_break_duration,
                format!("at least break_duration, {:?}", c.break_duration),
            ));
        }
        if c.probes == 0 || c.probes > MAX_PROBES {
            return Err(ConfigError::invalid(
                "probes",
                c.probes,
                format!("from 1 to {MAX_PROBES}"),
            ));
        }
        if !(0.0..=1.0).contains(&c.jitter) {
            return Err(ConfigError::invalid("jitter", c.jitter, "from 0 to 1"));
        }
        Ok(c)
    }
}
