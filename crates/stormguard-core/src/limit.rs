//! Load control: how many calls a client keeps in flight to one dependency, adapted to
//! what the dependency serves in time.
//!
//! A retry budget bounds what a client *adds* when its dependency fails; it does not see
//! what its calls *cost*. A dependency that is slow, not broken (saturated, or serving at
//! a fraction of its capacity) answers later and later, its queue fills, the callers'
//! timeouts fire on answers still queued, and the dependency spends its capacity on work
//! nobody waits for. [`LoadLimit`] keeps the calls in flight near what the dependency
//! serves without a queue, by Little's law (calls in flight = throughput × latency), so
//! that a saturated dependency's latency stays near its floor and its capacity goes to
//! answers someone waits for. The calls past the limit wait for room or are shed: never
//! sent.
//!
//! # The signals, and why these
//!
//! Each call ends with one [`Load`]:
//!
//! - [`Load::Served`]: an answer of the dependency's usual work (a 2xx, a 4xx other than
//!   429): its latency is a sample.
//! - [`Load::Overloaded`]: an explicit overload answer (429, gRPC `RESOURCE_EXHAUSTED`,
//!   Envoy's `x-envoy-overloaded`, Finagle's nack) or an attempt that timed out.
//! - [`Load::Unrelated`]: anything else (a 5xx, a refused connection, an open circuit).
//!   A bare 5xx is not a load signal: a dependency that is down, or failing a share of
//!   its calls, answers with the same 503 as one whose queue is full, and throttling
//!   such a dependency loses the calls it would have served.
//!
//! The limit is adjusted once per sampling window (four times the latency floor, 10 ms
//! to 1 s, and at least a few calls), from the *shortest* latency of the window's first
//! eight calls: a queue in front of the dependency delays every call, the shortest
//! included, while a slow tail (a big response, a cold cache) does not move it, so the
//! minimum tells a queue from noise where a mean or a percentile would not. It is the
//! shortest of as many calls in every window, whatever the limit: the shortest of fewer
//! calls is longer, so a cut would otherwise read as a queue by itself.
//!
//! - **A queue** (the window's minimum above `tolerance` × the floor, in two windows in a
//!   row: where latencies have no floor, one window of a few calls often has no short
//!   one, by chance): the limit is cut in proportion (`limit × tolerance / ratio`, to a
//!   quarter at most), once per round trip and only while calls wait at the limit
//!   (another client's queue is not this one's to cut): until calls sent after a cut
//!   come back, it is not cut again. At the limit's minimum no cut is left to tell a
//!   queue from the dependency's latency: the floor moves up to the window's minimum.
//! - **The dependency's own latency** (after a cut, the calls sent under the lower limit
//!   take as long as before): the latency is the dependency's, not a queue's, so the
//!   floor moves up to it. This is what keeps a brownout (every call 2.5 times as long)
//!   from being read as a queue and throttled to nothing; it is the step Vegas and
//!   Gradient lack, which is why they need a long-term average or a periodic probe at a
//!   low limit (Envoy's minRTT window), which queues a healthy client's calls (the probe
//!   below is only for a limit calls have waited at for long). Such a cut
//!   was wrong, and is undone. If, besides, the latency that read as a queue is gone
//!   after the cut, the shortest calls of a window were long by chance (a dependency
//!   without a floor: exponential service, cache hits beside database reads): the ratio
//!   that misled becomes the tolerance, up to 10, so that the spread of the dependency's
//!   own latencies is not read as a queue again. Where the latency has no floor to read
//!   a queue against, the overload answers and timeouts below still cut.
//! - **Overload answers or timeouts** (at least one in twenty of a window's calls): the
//!   limit is cut by a quarter.
//! - **Room** (no queue, and the window's calls in flight reached half the limit): the
//!   limit grows by its square root, so that a client whose demand rises is not held
//!   back and the limit stays about twice what a healthy dependency's calls need. Until
//!   the first cut by a queue it doubles while calls wait at it (a slow start, as
//!   TCP's), so that a new client with a burst is not held back by a limit it has not
//!   yet learnt. After it, calls waiting at the limit with the latency at its floor grow
//!   it by one a window, and after eight such windows in a row by twice as much each
//!   window, up to its square root: held near a dependency's capacity, a queue shows
//!   and cuts within a few windows; past them the dependency has room again (it scaled
//!   out, the incident is over), and demand above the limit reaches it within a couple
//!   of seconds, not a call a window. (After four windows, a spread dependency's
//!   overload in the simulator grew a queue that its first second after paid for.)
//! - **A probe**: after 25 windows in a row with calls waiting at the limit and the
//!   latency within the tolerance of its floor, the limit is halved for a round trip, so
//!   that a floor measured behind a standing queue shows; it comes back with the next
//!   window of calls sent after it (or is cut from, if those are overload answers). A
//!   limit at the `max` set is not probed: it sheds what the user capped, no more.
//!
//! - **Letting go**: after 25 windows in a row that measured calls served with room to
//!   spare (none waited at the limit) and saw no queue nor overload, a limit that a
//!   queue or overload answers cut is a new client's guess again: no lower than its
//!   initial limit, doubling while calls wait at it. Otherwise a limit learnt in an
//!   incident since over would shed the demand that grew meanwhile (a client calling
//!   once every 50 ms after an overload never uses more than 4 calls in flight, so its
//!   limit would stay at 4 before a burst of 500).
//!
//! While the limit is a guess (until the first cut by a queue or overload answers, and
//! again once it has let go: [`LoadLimit::learning`]), a call past it waits for room
//! longer than `max_wait` ([`LoadLimit::wait_for_room`]: sixteen latency floors, the
//! time the limit takes to double four times): a new client's burst to a healthy
//! dependency slower than the wait for room (a thousand calls at once, answered in
//! 50 ms) would otherwise be shed while the limit doubles towards it, though nothing
//! but the guess held it back. A window that reads a queue, or a cut, ends the guess.
//!
//! The floor is the shortest latency seen in two windows in a row (not one lucky call's),
//! until a cut shows the dependency slower.
//!
//! # The state
//!
//! One `LoadLimit` per dependency, shared by `Clone` (an `Arc`), lock-free: admission is
//! one compare-and-swap on the count in flight; a sample is a few atomic adds; the thread
//! whose sample ends a window (one compare-and-swap on its start) adjusts the limit. A
//! [`LimitPermit`] gives its place back when dropped, so a call whose future is dropped
//! or whose service panics does not leak a place.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use stormguard_core::limit::{Load, LoadLimit};
//!
//! let limit = LoadLimit::builder().min(1).initial(2).build()?;
//! let t0 = Instant::now();
//! let a = limit.try_acquire(t0).expect("room");
//! let _b = limit.try_acquire(t0).expect("room");
//! // Two in flight at a limit of two: the third is refused (its caller waits or sheds).
//! assert!(limit.try_acquire(t0).is_err());
//! a.complete(Load::Served, t0 + Duration::from_millis(10));
//! assert!(limit.try_acquire(t0 + Duration::from_millis(10)).is_ok());
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::sync::{AtomicBool, AtomicU32, AtomicU64};
use crate::ConfigError;

/// The limit a new `LoadLimit` starts at.
pub const DEFAULT_INITIAL: u32 = 100;
/// The lowest the limit goes.
pub const DEFAULT_MIN: u32 = 4;
/// The highest the limit goes.
pub const DEFAULT_MAX: u32 = 1000;
/// How far above its floor a window's shortest latency may be before it counts as a
/// queue.
pub const DEFAULT_TOLERANCE: f64 = 1.25;
/// How long a call may wait for room before it is shed.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(100);

/// A window is at least this long...
const MIN_WINDOW: Duration = Duration::from_millis(10);
/// ...and at most this long...
const MAX_WINDOW: Duration = Duration::from_secs(1);
/// ...this many floors long between the two...
const WINDOW_FLOORS: u32 = 4;
/// ...and holds at least this many calls, unless it reached `MAX_WINDOW`.
const MIN_CALLS: u32 = 4;
/// The share of a window's calls that must be overload answers or timeouts to cut.
const DROPS_PER_CUT: u32 = 20;
/// After this many windows in a row with calls waiting at the limit, the limit is
/// halved for a round trip to see the latency floor again.
const PROBE_AFTER: u32 = 25;
/// How many latency floors a call past a limit still learning may wait for room.
const LEARNING_FLOORS: u32 = 16;
/// How long a call past a limit still learning may wait while nothing has been served.
const FIRST_ANSWERS_WAIT: Duration = Duration::from_secs(2);
/// After this many windows in a row that held nothing back and saw no queue nor
/// overload, a limit that was cut lets go: it is a guess again.
const LET_GO_AFTER: u32 = 25;
/// A latency cut keeps at least this share of the limit.
const MAX_CUT: f64 = 0.25;
/// Windows in a row of calls waiting at a limit with the latency at its floor that
/// grow it by one each, before each grows it by twice the last (up to the limit's
/// square root).
const GROW_AFTER: u32 = 8;
/// The cut after overload answers or timeouts.
const DROP_CUT: f64 = 0.75;
/// The calls of a window whose shortest latency is its sample: the same count in every
/// window, as the shortest of more calls is shorter, and a cut, which makes a window's
/// calls fewer, would read as a queue by itself.
const SAMPLED: u32 = 8;
/// The most a wrong cut raises the tolerance to (the setting's own bound).
const MAX_TOLERANCE: f64 = 10.0;
/// Nothing measured yet.
const UNKNOWN: u64 = u64::MAX;

/// How a call ended, as the load control reads it: see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// The dependency did its usual work: the call's latency is a sample.
    Served,
    /// An explicit overload answer (429, `RESOURCE_EXHAUSTED`, a proxy's or Finagle's
    /// nack) or a timeout: the dependency has no room.
    Overloaded,
    /// Says nothing of the dependency's load (a 5xx, a connection error, an open
    /// circuit): no sample.
    Unrelated,
}

/// Finagle's "retryable nack" response header: the server rejected the request before
/// any work, for lack of room.
const FINAGLE_NACK: &str = "finagle-http-nack";

impl Load {
    /// How an HTTP or gRPC answer reads: 429, gRPC `RESOURCE_EXHAUSTED` (in the headers:
    /// a trailers-only answer), Envoy's `x-envoy-overloaded` or Finagle's nacks on a 5xx are
    /// [`Overloaded`](Load::Overloaded); any other 5xx is [`Unrelated`](Load::Unrelated);
    /// everything else is [`Served`](Load::Served).
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use stormguard_core::limit::Load;
    ///
    /// let none = HeaderMap::new();
    /// assert_eq!(Load::of_response(StatusCode::OK, &none), Load::Served);
    /// assert_eq!(Load::of_response(StatusCode::NOT_FOUND, &none), Load::Served);
    /// assert_eq!(Load::of_response(StatusCode::TOO_MANY_REQUESTS, &none), Load::Overloaded);
    /// assert_eq!(Load::of_response(StatusCode::SERVICE_UNAVAILABLE, &none), Load::Unrelated);
    /// let mut grpc = HeaderMap::new();
    /// grpc.insert("grpc-status", "8".parse().unwrap());
    /// assert_eq!(Load::of_response(StatusCode::OK, &grpc), Load::Overloaded);
    /// let mut envoy = HeaderMap::new();
    /// envoy.insert("x-envoy-overloaded", "true".parse().unwrap());
    /// assert_eq!(Load::of_response(StatusCode::SERVICE_UNAVAILABLE, &envoy), Load::Overloaded);
    /// ```
    pub fn of_response(status: http::StatusCode, headers: &http::HeaderMap) -> Load {
        // Envoy's and Finagle's nacks come on a 503, a trailers-only gRPC answer on a
        // 200: a success reads one header.
        let overloaded = if status == http::StatusCode::TOO_MANY_REQUESTS {
            true
        } else if status.is_server_error() {
            headers.contains_key(crate::classify::X_ENVOY_OVERLOADED)
                || headers.contains_key(FINAGLE_NACK)
                || headers.contains_key(crate::classify::FINAGLE_NONRETRYABLE_NACK)
        } else {
            headers
                .get(crate::classify::GRPC_STATUS)
                .is_some_and(|code| code.as_bytes() == b"8")
        };
        if overloaded {
            Load::Overloaded
        } else if status.is_server_error() {
            Load::Unrelated
        } else {
            Load::Served
        }
    }
}

/// A refusal: the calls in flight are at the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    /// The limit when the call was refused.
    pub limit: u32,
    /// The calls in flight then.
    pub in_flight: u32,
}

/// An adaptive limit on the calls in flight to one dependency: see the
/// [module docs](self).
#[derive(Clone)]
pub struct LoadLimit {
    state: Arc<State>,
}

struct State {
    config: LoadLimitConfig,
    /// The instant every other is counted from, in nanoseconds: the first `now` seen.
    origin: OnceLock<Instant>,
    in_flight: AtomicU32,
    /// The limit in whole calls, read by admission.
    limit: AtomicU32,
    /// The limit in thousandths, the controller's own.
    limit_milli: AtomicU64,
    /// The current window's start.
    window_start: AtomicU64,
    /// The window's samples (calls served) and drops (overload answers, timeouts).
    served: AtomicU32,
    dropped: AtomicU32,
    /// The window's shortest latency among calls sent since the last cut, and their count.
    fresh_min: AtomicU64,
    fresh: AtomicU32,
    /// The most calls in flight the window saw, counted once they reach half the limit.
    peak: AtomicU32,
    /// The latency floor.
    floor: AtomicU64,
    /// When the limit was last cut: calls sent before it are not fresh.
    cut_at: AtomicU64,
    /// The minimum that caused the last latency cut, until calls sent after it tell
    /// whether it helped; zero when none is pending.
    cut_min: AtomicU64,
    /// The calls served per second in the window of the last cut, and the share of the
    /// limit it kept (`f64` bits).
    cut_throughput: AtomicU64,
    cut_kept: AtomicU64,
    /// Windows in a row whose calls waited at the limit.
    saturated_run: AtomicU32,
    /// Windows in a row whose calls waited at the limit with the latency at its floor,
    /// the limit grown after each.
    grow_run: AtomicU32,
    /// Windows in a row that held nothing back and saw no queue nor overload.
    calm_run: AtomicU32,
    /// Whether a queue or overload answers have cut the limit since it started or last
    /// let go (a probe's halving teaches nothing).
    learnt: AtomicBool,
    /// Whether the limit doubles while calls wait at it (until the first latency cut).
    slow_start: AtomicBool,
    /// The limit (thousandths) a probe halved, until the probe's calls come back.
    probe_restore: AtomicU64,
    /// Whether the last window's shortest latency read as a queue.
    queue_seen: AtomicBool,
    /// The last window's shortest latency among fresh calls.
    last_min: AtomicU64,
    /// The ratio to the floor that reads as a queue: the configured tolerance, raised
    /// by the cuts that turned out wrong (an `f64`'s bits).
    tolerance: AtomicU64,
    /// The ratio to the floor that made the last latency cut (an `f64`'s bits).
    cut_ratio: AtomicU64,
}

/// The settings of a [`LoadLimit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadLimitConfig {
    initial: u32,
    min: u32,
    max: u32,
    tolerance: f64,
    max_wait: Duration,
}

impl Default for LoadLimitConfig {
    fn default() -> Self {
        LoadLimitConfig {
            initial: DEFAULT_INITIAL,
            min: DEFAULT_MIN,
            max: DEFAULT_MAX,
            tolerance: DEFAULT_TOLERANCE,
            max_wait: DEFAULT_MAX_WAIT,
        }
    }
}

impl LoadLimitConfig {
    /// The limit a new `LoadLimit` starts at.
    pub fn initial(&self) -> u32 {
        self.initial
    }

    /// The lowest the limit goes.
    pub fn min(&self) -> u32 {
        self.min
    }

    /// The highest the limit goes.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// How far above the floor a window's shortest latency reads as a queue.
    pub fn tolerance(&self) -> f64 {
        self.tolerance
    }

    /// How long a call may wait for room before it is shed (longer while the limit is
    /// learning: [`LoadLimit::wait_for_room`]).
    pub fn max_wait(&self) -> Duration {
        self.max_wait
    }
}

/// Builds a [`LoadLimit`]; every setting has a default.
#[derive(Debug, Clone, Copy, Default)]
#[must_use]
pub struct LoadLimitBuilder {
    config: LoadLimitConfig,
    /// The initial limit asked for; else the default, kept between `min` and `max`.
    initial: Option<u32>,
}

impl LoadLimitBuilder {
    /// The limit it starts at \[100, or `min` or `max` if 100 is outside them\]: a new
    /// client is not held back before the dependency has said anything.
    pub fn initial(mut self, calls: u32) -> Self {
        self.initial = Some(calls);
        self
    }

    /// The lowest the limit goes \[4\]; at least 1.
    pub fn min(mut self, calls: u32) -> Self {
        self.config.min = calls;
        self
    }

    /// The highest the limit goes \[1000\]; at least `min`.
    pub fn max(mut self, calls: u32) -> Self {
        self.config.max = calls;
        self
    }

    /// How far above the latency floor a window's shortest latency may be before it
    /// counts as a queue \[1.25\]; above 1 and at most 10. The limit raises it, up to
    /// 10, where the dependency's own spread of latencies read as a queue: see the
    /// [module docs](self).
    pub fn tolerance(mut self, ratio: f64) -> Self {
        self.config.tolerance = ratio;
        self
    }

    /// How long a call may wait for room before it is shed \[100 ms\], once the limit
    /// has learnt the dependency (before, see [`LoadLimit::wait_for_room`]); zero sheds
    /// at once.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.config.max_wait = wait;
        self
    }

    /// The settings, or what contradicts.
    pub fn config(self) -> Result<LoadLimitConfig, ConfigError> {
        let mut c = self.config;
        c.initial = match self.initial {
            Some(initial) => initial,
            None => DEFAULT_INITIAL.clamp(c.min, c.max.max(c.min)),
        };
        if c.min == 0 {
            return Err(ConfigError::invalid("min", c.min, "at least 1"));
        }
        if c.max < c.min {
            return Err(ConfigError::invalid(
                "max",
                c.max,
                format!("at least min, {}", c.min),
            ));
        }
        if !(c.min..=c.max).contains(&c.initial) {
            return Err(ConfigError::invalid(
                "initial",
                c.initial,
                format!("between min and max, {}..={}", c.min, c.max),
            ));
        }
        if !(c.tolerance > 1.0 && c.tolerance <= 10.0) {
            return Err(ConfigError::invalid(
                "tolerance",
                c.tolerance,
                "above 1 and at most 10",
            ));
        }
        Ok(c)
    }

    /// The limit, or what contradicts.
    pub fn build(self) -> Result<LoadLimit, ConfigError> {
        Ok(LoadLimit::with_config(self.config()?))
    }
}

impl Default for LoadLimit {
    fn default() -> Self {
        LoadLimit::with_config(LoadLimitConfig::default())
    }
}

impl fmt::Debug for LoadLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadLimit")
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .field("floor", &self.floor())
            .field("tolerance", &self.tolerance())
            .finish_non_exhaustive()
    }
}

impl LoadLimit {
    /// A builder with the defaults.
    pub fn builder() -> LoadLimitBuilder {
        LoadLimitBuilder::default()
    }

    /// A limit with `config`.
    pub fn with_config(config: LoadLimitConfig) -> Self {
        LoadLimit {
            state: Arc::new(State {
                config,
                origin: OnceLock::new(),
                in_flight: AtomicU32::new(0),
                limit: AtomicU32::new(config.initial),
                limit_milli: AtomicU64::new(u64::from(config.initial) * 1000),
                window_start: AtomicU64::new(0),
                served: AtomicU32::new(0),
                dropped: AtomicU32::new(0),
                fresh_min: AtomicU64::new(UNKNOWN),
                fresh: AtomicU32::new(0),
                peak: AtomicU32::new(0),
                floor: AtomicU64::new(UNKNOWN),
                cut_at: AtomicU64::new(0),
                cut_min: AtomicU64::new(0),
                cut_throughput: AtomicU64::new(0),
                cut_kept: AtomicU64::new(0),
                saturated_run: AtomicU32::new(0),
                grow_run: AtomicU32::new(0),
                calm_run: AtomicU32::new(0),
                learnt: AtomicBool::new(false),
                slow_start: AtomicBool::new(true),
                probe_restore: AtomicU64::new(0),
                queue_seen: AtomicBool::new(false),
                last_min: AtomicU64::new(UNKNOWN),
                tolerance: AtomicU64::new(config.tolerance.to_bits()),
                cut_ratio: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &LoadLimitConfig {
        &self.state.config
    }

    /// The limit now, in calls.
    pub fn limit(&self) -> u32 {
        self.state.limit.load(Ordering::Acquire)
    }

    /// The calls in flight now.
    pub fn in_flight(&self) -> u32 {
        self.state.in_flight.load(Ordering::Acquire)
    }

    /// How far above the floor a window's shortest latency reads as a queue now: the
    /// configured tolerance, or the spread of the dependency's own latencies once a cut
    /// has shown it larger (see the [module docs](self)).
    pub fn tolerance(&self) -> f64 {
        f64::from_bits(self.state.tolerance.load(Ordering::Acquire))
    }

    /// Whether the limit is a guess: it has not been cut by a queue or overload
    /// answers since it started or last let go, its last window read no queue, and it
    /// is below `max`, so it grows while calls wait at it (the slow start). See
    /// [`wait_for_room`](Self::wait_for_room) and the [module docs](self).
    ///
    /// ```
    /// use stormguard_core::limit::LoadLimit;
    ///
    /// let limit = LoadLimit::builder().build()?;
    /// assert!(limit.learning());
    /// // A limit that cannot grow is not a guess that will.
    /// let fixed = LoadLimit::builder().min(1).initial(1).max(1).build()?;
    /// assert!(!fixed.learning());
    /// # Ok::<(), stormguard_core::ConfigError>(())
    /// ```
    pub fn learning(&self) -> bool {
        let state = &self.state;
        !state.learnt.load(Ordering::Acquire)
            && !state.queue_seen.load(Ordering::Acquire)
            && state.limit.load(Ordering::Acquire) < state.config.max
    }

    /// Whether a call past the limit that has waited `waited` for room waits on: how
    /// much longer before it asks again (at most `max_wait`), or `None` to shed it.
    ///
    /// A call waits for room up to `max_wait` in all; while the limit is
    /// [learning](Self::learning), up to sixteen latency floors (four sampling windows,
    /// in which the limit doubles four times while calls wait), or two seconds while no
    /// call has been served yet, if that is longer. What holds such a call back is the
    /// guess, not the dependency. Never longer than `longest`, the caller's own bound
    /// (the standard stack's attempt timeout; `Duration::MAX` for none): a call that
    /// would wait longer than an answer may take is better shed for the caller to fall
    /// back. A `max_wait` of zero is never waited.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard_core::limit::LoadLimit;
    ///
    /// const MS: Duration = Duration::from_millis(1);
    /// let limit = LoadLimit::builder().max_wait(100 * MS).build()?;
    /// let none = Duration::MAX;
    /// // Nothing served yet: a new client's burst waits for its first answers, 2 s.
    /// assert_eq!(limit.wait_for_room(100 * MS, none), Some(100 * MS));
    /// assert_eq!(limit.wait_for_room(1950 * MS, none), Some(50 * MS));
    /// assert_eq!(limit.wait_for_room(2000 * MS, none), None);
    /// // Behind a 250 ms attempt timeout, 250 ms at most.
    /// assert_eq!(limit.wait_for_room(200 * MS, 250 * MS), Some(50 * MS));
    /// assert_eq!(limit.wait_for_room(250 * MS, 250 * MS), None);
    /// // A limit that cannot grow holds calls `max_wait` at most.
    /// let fixed = LoadLimit::builder().min(1).initial(1).max(1).build()?;
    /// assert_eq!(fixed.wait_for_room(50 * MS, none), Some(50 * MS));
    /// assert_eq!(fixed.wait_for_room(100 * MS, none), None);
    /// # Ok::<(), stormguard_core::ConfigError>(())
    /// ```
    pub fn wait_for_room(&self, waited: Duration, longest: Duration) -> Option<Duration> {
        let max_wait = self.state.config.max_wait;
        let allowed = if max_wait.is_zero() || !self.learning() {
            max_wait
        } else {
            match self.state.floor.load(Ordering::Acquire) {
                UNKNOWN => FIRST_ANSWERS_WAIT,
                nanos => Duration::from_nanos(nanos).saturating_mul(LEARNING_FLOORS),
            }
            .max(max_wait)
        }
        .min(longest);
        (waited < allowed).then(|| (allowed - waited).min(max_wait))
    }

    /// The latency floor, once a call has been served.
    pub fn floor(&self) -> Option<Duration> {
        match self.state.floor.load(Ordering::Acquire) {
            UNKNOWN => None,
            nanos => Some(Duration::from_nanos(nanos)),
        }
    }

    /// A place for one call sent at `now`, or [`Full`] when the calls in flight are at
    /// the limit. The permit is given back when completed or dropped.
    pub fn try_acquire(&self, now: Instant) -> Result<LimitPermit, Full> {
        let state = &self.state;
        let limit = state.limit.load(Ordering::Acquire);
        let mut in_flight = state.in_flight.load(Ordering::Relaxed);
        loop {
            if in_flight >= limit {
                return Err(Full { limit, in_flight });
            }
            match state.in_flight.compare_exchange_weak(
                in_flight,
                in_flight + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now_in_flight) => in_flight = now_in_flight,
            }
        }
        if (in_flight + 1) * 2 >= limit {
            state.peak.fetch_max(in_flight + 1, Ordering::Relaxed);
        }
        Ok(LimitPermit {
            state: self.state.clone(),
            sent: state.nanos(now),
        })
    }
}

/// One call's place under a [`LoadLimit`]: [`complete`](Self::complete) it with how the
/// call ended; dropped without, it gives its place back and says nothing.
#[must_use = "a permit holds a place until completed or dropped"]
pub struct LimitPermit {
    state: Arc<State>,
    sent: u64,
}

impl fmt::Debug for LimitPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitPermit").finish_non_exhaustive()
    }
}

impl LimitPermit {
    /// Records how the call ended at `now` and gives its place back.
    pub fn complete(self, load: Load, now: Instant) {
        let state = &self.state;
        let at = state.nanos(now);
        match load {
            Load::Served => {
                state.served.fetch_add(1, Ordering::Relaxed);
                if self.sent >= state.cut_at.load(Ordering::Acquire) {
                    // The shortest of the window's first calls; written before the count
                    // that publishes it, so that a window that counts a fresh call has
                    // its sample (under a race, a few more than `SAMPLED` may sample).
                    if state.fresh.load(Ordering::Relaxed) < SAMPLED {
                        state
                            .fresh_min
                            .fetch_min(at.saturating_sub(self.sent).max(1), Ordering::Relaxed);
                    }
                    state.fresh.fetch_add(1, Ordering::Release);
                }
            }
            Load::Overloaded => {
                state.dropped.fetch_add(1, Ordering::Release);
            }
            Load::Unrelated => {}
        }
        state.close_window(at);
    }
}

impl Drop for LimitPermit {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What one window saw.
struct Window {
    served: u32,
    dropped: u32,
    fresh: u32,
    fresh_min: u64,
    peak: u32,
    /// Its length, in nanoseconds.
    length: u64,
}

impl State {
    fn nanos(&self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_init(|| now);
        u64::try_from(now.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX - 1)
    }

    /// Ends the window at `at` if it is due, once whatever races it, and adjusts.
    fn close_window(&self, at: u64) {
        let start = self.window_start.load(Ordering::Acquire);
        let floor = self.floor.load(Ordering::Acquire);
        let length = match floor {
            UNKNOWN => MIN_WINDOW,
            nanos => Duration::from_nanos(nanos.saturating_mul(u64::from(WINDOW_FLOORS)))
                .clamp(MIN_WINDOW, MAX_WINDOW),
        };
        let elapsed = Duration::from_nanos(at.saturating_sub(start));
        if elapsed < length {
            return;
        }
        let calls = self.served.load(Ordering::Relaxed) + self.dropped.load(Ordering::Relaxed);
        if calls < MIN_CALLS && elapsed < MAX_WINDOW {
            return;
        }
        if self
            .window_start
            .compare_exchange(start, at, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return; // another call closed it
        }
        let mut window = Window {
            served: self.served.swap(0, Ordering::AcqRel),
            dropped: self.dropped.swap(0, Ordering::AcqRel),
            fresh: self.fresh.swap(0, Ordering::AcqRel),
            fresh_min: self.fresh_min.swap(UNKNOWN, Ordering::AcqRel),
            peak: self.peak.swap(0, Ordering::AcqRel),
            length: at - start,
        };
        if window.fresh_min == UNKNOWN {
            // A call that ended as the window closed can sample the old window and count
            // in this one: a count without its sample measured nothing.
            window.fresh = 0;
        }
        self.adjust(&window, at);
    }

    /// The controller: the module docs' rules, in order.
    fn adjust(&self, w: &Window, at: u64) {
        let c = &self.config;
        let mut limit = self.limit_milli.load(Ordering::Acquire) as f64 / 1000.0;
        let mut floor = self.floor.load(Ordering::Acquire);
        // The floor comes down to what two windows in a row showed, not to one lucky
        // call: where latencies have no floor, the shortest of all calls ever made is
        // far below what any window shows, and every window would read as a queue.
        let last = if w.fresh > 0 {
            self.last_min.swap(w.fresh_min, Ordering::AcqRel)
        } else {
            UNKNOWN
        };
        let lower = if floor == UNKNOWN {
            w.fresh_min
        } else {
            w.fresh_min.max(last)
        };
        // A floor well below the one known: the dependency got faster, and a queue that
        // the old floor tolerated may hide how much. Probe for the floor at once.
        let faster = w.fresh > 0 && floor != UNKNOWN && (lower as f64) < floor as f64 * 0.9;
        if w.fresh > 0 {
            floor = floor.min(lower);
        }
        let throughput = f64::from(w.served) / (w.length.max(1) as f64 / 1e9);
        let calls = w.served + w.dropped;
        let cut_at = self.cut_at.load(Ordering::Acquire);
        let pending = self.cut_min.load(Ordering::Acquire);
        let saturated = f64::from(w.peak) >= limit.floor();
        let mut tolerance = f64::from_bits(self.tolerance.load(Ordering::Acquire));
        let run = if saturated {
            self.saturated_run.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            self.saturated_run.store(0, Ordering::Release);
            0
        };
        // Whether the window held nothing back and saw no sign of load.
        // A window that measured nothing (only 5xx, refusals, or calls sent before a cut)
        // shows no room either.
        let mut calm = !saturated && w.dropped == 0 && w.fresh > 0;
        let mut grew = false;
        if w.dropped > 0 && w.dropped * DROPS_PER_CUT >= calls {
            let restore = self.probe_restore.swap(0, Ordering::AcqRel);
            if restore != 0 {
                // A probe halved the limit only to see the floor: the overload answers
                // judge the limit it halved (and the probe's restore would otherwise
                // undo their cut).
                limit = restore as f64 / 1000.0;
            }
            limit *= DROP_CUT;
            self.cut(at, 0, 0.0);
            self.learnt.store(true, Ordering::Release);
        } else if w.fresh > 0 && pending != 0 && at < cut_at.saturating_add(pending) {
            // Calls sent before the cut may still be coming back: no verdict yet.
            calm = false;
        } else if w.fresh > 0 {
            let restore = self.probe_restore.swap(0, Ordering::AcqRel);
            if restore != 0 {
                // The probe's round trip is back, and the floor with it: the limit it
                // halved returns, for the rules below to judge against that floor.
                limit = restore as f64 / 1000.0;
            }
            if pending != 0 {
                self.cut_min.store(0, Ordering::Release);
                let before = f64::from_bits(self.cut_throughput.load(Ordering::Acquire));
                let kept = f64::from_bits(self.cut_kept.load(Ordering::Acquire));
                if throughput < before * (1.0 + kept) / 2.0 {
                    // Fewer calls in flight, about as many fewer served: the calls were
                    // not queueing, the dependency is slower. Its latency is the floor.
                    // The cut was wrong: it is undone.
                    limit /= kept;
                    floor = w.fresh_min;
                    if (w.fresh_min as f64) * c.tolerance < pending as f64 {
                        // And the latency that read as a queue is gone: it was the
                        // spread of the dependency's own latencies (no floor, as with
                        // exponential service), which a window's shortest call reads
                        // above the floor by chance. Such a ratio is not a queue.
                        let misread = f64::from_bits(self.cut_ratio.load(Ordering::Acquire));
                        tolerance = tolerance.max(misread).min(MAX_TOLERANCE);
                        self.tolerance.store(tolerance.to_bits(), Ordering::Release);
                    }
                }
            }
            let ratio = w.fresh_min as f64 / floor.max(1) as f64;
            calm &= ratio <= tolerance && restore == 0;
            let queue = ratio > tolerance && saturated;
            let seen = self.queue_seen.swap(queue, Ordering::AcqRel);
            if queue && !seen {
                // One window's shortest latency above the floor may be chance: where
                // latencies have no floor (exponential service, a mix of cache hits and
                // database reads), a window of a few calls often has no short one. A
                // queue lasts: it is cut for when the next window shows it too.
            } else if queue && limit <= f64::from(c.min) {
                // At the fewest calls in flight allowed and still above the floor: no
                // cut is left to tell a queue from the dependency's own latency, and a
                // queue behind so few calls is not this client's. The latency is the
                // dependency's: the floor moves up to it, and the limit may grow again
                // as a new client's does, so that it lets go once the dependency has
                // room (without this, a floor set by one lucky call held the limit at
                // its minimum for good).
                floor = w.fresh_min;
                self.slow_start.store(true, Ordering::Release);
            } else if queue {
                let kept = (tolerance / ratio).max(MAX_CUT);
                limit *= kept;
                self.cut(at, w.fresh_min, throughput);
                self.learnt.store(true, Ordering::Release);
                self.cut_ratio.store(ratio.to_bits(), Ordering::Release);
                self.cut_kept.store(kept.to_bits(), Ordering::Release);
                self.slow_start.store(false, Ordering::Release);
            } else if ratio > tolerance {
                // A queue this client's limit does not bind: not this client's to cut.
            } else if saturated && limit < f64::from(c.max) && (run >= PROBE_AFTER || faster) {
                // Calls have waited at the limit for a while with the latency within
                // the tolerance of a floor that a standing queue may be hiding: halve the
                // calls in flight for a round trip to see the floor again.
                self.probe_restore
                    .store((limit * 1000.0) as u64, Ordering::Release);
                limit *= 0.5;
                self.cut(at, 0, 0.0);
                self.saturated_run.store(0, Ordering::Release);
            } else if saturated && self.slow_start.load(Ordering::Acquire) {
                // Calls waited at the limit and the latency stayed at its floor. (At the
                // `max` set, no probe: the limit the user capped stays, whatever queue a
                // probe would find.)
                limit *= 2.0;
            } else if saturated {
                // Calls waited at the limit and the latency stayed at its floor: grow by
                // one a window, then, the longer that lasts, by twice as much each
                // window, up to the square root of the limit (held near a dependency's
                // capacity, a queue shows and cuts within a few windows; past them,
                // demand above the limit meets a dependency that has room again, and is
                // not held back for seconds; the root bounds how far past a queue one
                // window's growth goes).
                let run = self.grow_run.fetch_add(1, Ordering::AcqRel);
                let step = f64::from(1u32 << run.saturating_sub(GROW_AFTER).min(16));
                limit += step.min(limit.sqrt().max(1.0));
                grew = true;
            } else if f64::from(w.peak) * 2.0 >= limit {
                limit += limit.sqrt();
            }
        }
        if !grew {
            self.grow_run.store(0, Ordering::Release);
        }
        let calm_run = if calm {
            self.calm_run.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            self.calm_run.store(0, Ordering::Release);
            0
        };
        if calm_run >= LET_GO_AFTER && self.learnt.load(Ordering::Acquire) {
            // Nothing held back, no queue, no overload for a while since the last cut:
            // the dependency has room again, and what the cut taught is stale. The limit
            // is a new client's guess again (no lower than its initial limit), so that
            // demand that has grown meanwhile is not shed by a limit learnt in an
            // incident since over.
            // (A calm window has no cut's verdict pending: `cut_min` is clear.)
            limit = limit.max(f64::from(c.initial));
            self.slow_start.store(true, Ordering::Release);
            self.learnt.store(false, Ordering::Release);
            self.calm_run.store(0, Ordering::Release);
        }
        let limit = limit.clamp(f64::from(c.min), f64::from(c.max));
        self.floor.store(floor, Ordering::Release);
        self.limit_milli
            .store((limit * 1000.0) as u64, Ordering::Release);
        self.limit.store(limit as u32, Ordering::Release);
    }

    /// Records a cut at `at`: calls sent before it are not fresh; `min` (zero after
    /// overload answers) and `throughput` are what the verdict on it compares with.
    fn cut(&self, at: u64, min: u64, throughput: f64) {
        self.cut_at.store(at.max(1), Ordering::Release);
        self.cut_throughput
            .store(throughput.to_bits(), Ordering::Release);
        self.cut_min.store(min, Ordering::Release);
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests take their time zero from the clock
mod tests {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, VecDeque};

    use rand::rngs::SmallRng;
    use rand::{RngExt, SeedableRng};

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A dependency of `workers` serving one call at a time each, first come first
    /// served, on a virtual clock, called through a shared `LoadLimit`; a call refused
    /// by the limit is shed at once (the tower layer's wait for room left out).
    struct Sim {
        limit: LoadLimit,
        t0: Instant,
        now: Duration,
        rng: SmallRng,
        workers: usize,
        busy: usize,
        queue: VecDeque<LimitPermit>,
        /// (end of service, permit) of the calls being served.
        serving: BinaryHeap<Reverse<(Duration, u64)>>,
        permits: Vec<Option<LimitPermit>>,
        shed: u64,
        served: u64,
        /// Whether service times are drawn from an exponential distribution of mean
        /// `service` (a dependency without a latency floor), not all equal to it.
        exponential: bool,
    }

    impl Sim {
        fn new(limit: LoadLimit, workers: usize, seed: u64) -> Self {
            Sim {
                limit,
                t0: Instant::now(),
                now: Duration::ZERO,
                rng: SmallRng::seed_from_u64(seed),
                workers,
                busy: 0,
                queue: VecDeque::new(),
                serving: BinaryHeap::new(),
                permits: Vec::new(),
                shed: 0,
                served: 0,
                exponential: false,
            }
        }

        /// Offers `rate` calls a second (Poisson arrivals) until `until`, each served in
        /// `service`; `probe` sees the limit after every arrival.
        fn run(
            &mut self,
            rate: f64,
            service: Duration,
            until: Duration,
            mut probe: impl FnMut(Duration, u32, Option<Duration>),
        ) {
            let mut next = self.now;
            while next < until {
                self.finish_until(next, service);
                self.now = next;
                match self.limit.try_acquire(self.t0 + self.now) {
                    Ok(permit) => self.queue.push_back(permit),
                    Err(_) => self.shed += 1,
                }
                self.start(service);
                probe(self.now, self.limit.limit(), self.limit.floor());
                let draw: f64 = self.rng.random();
                let gap = -(1.0 - draw).ln() / rate;
                next = self.now + Duration::from_secs_f64(gap);
            }
            self.finish_until(until, service);
            self.now = until;
        }

        fn start(&mut self, service: Duration) {
            while self.busy < self.workers {
                let Some(permit) = self.queue.pop_front() else {
                    return;
                };
                self.busy += 1;
                let id = self.permits.len() as u64;
                self.permits.push(Some(permit));
                let service = if self.exponential {
                    let draw: f64 = self.rng.random();
                    service.mul_f64(-(1.0 - draw).ln())
                } else {
                    service
                };
                self.serving.push(Reverse((self.now + service, id)));
            }
        }

        fn finish_until(&mut self, until: Duration, service: Duration) {
            while let Some(&Reverse((end, id))) = self.serving.peek() {
                if end > until {
                    return;
                }
                self.serving.pop();
                self.now = end;
                self.busy -= 1;
                self.served += 1;
                if let Some(permit) = self.permits[id as usize].take() {
                    permit.complete(Load::Served, self.t0 + end);
                }
                self.start(service);
            }
        }
    }

    /// Up to `calls` calls sent at `at` (as many as the limit admits), all ending with
    /// `load` after `took`, which `at` moves on by.
    fn round(limit: &LoadLimit, at: &mut Instant, calls: u32, took: Duration, load: Load) {
        let permits: Vec<_> = (0..calls)
            .filter_map(|_| limit.try_acquire(*at).ok())
            .collect();
        *at += took;
        for permit in permits {
            permit.complete(load, *at);
        }
    }

    #[test]
    fn overload_answers_cut_the_limit_and_5xx_do_not() {
        let limit = LoadLimit::builder().initial(40).build().expect("valid");
        let mut at = Instant::now();
        // A second of fast 503s at the limit: not load, the limit stays.
        for _ in 0..200 {
            round(&limit, &mut at, 40, 5 * MS, Load::Unrelated);
        }
        assert_eq!(limit.limit(), 40);
        assert!(limit.learning(), "5xx teach the limit nothing");
        // Overload answers (429s, timeouts): cut by a quarter per window, to the minimum.
        for _ in 0..200 {
            round(&limit, &mut at, 40, 5 * MS, Load::Overloaded);
        }
        assert_eq!(limit.limit(), DEFAULT_MIN);
        assert!(!limit.learning(), "cut: the limit is learnt");
    }

    #[test]
    fn a_limit_cut_in_an_incident_lets_go_once_calm() {
        let limit = LoadLimit::builder().build().expect("valid");
        let mut at = Instant::now();
        // Overload answers cut the limit to its minimum: it is learnt.
        for _ in 0..100 {
            round(&limit, &mut at, 8, 10 * MS, Load::Overloaded);
        }
        assert_eq!(limit.limit(), DEFAULT_MIN);
        assert!(!limit.learning());
        // Then one call at a time, served at the floor: nothing waits, no queue. Not
        // before 25 such windows does the limit let go.
        let mut windows_to_let_go = None;
        for call in 0..400 {
            assert_eq!(limit.in_flight(), 0);
            round(&limit, &mut at, 1, 10 * MS, Load::Served);
            if limit.learning() {
                windows_to_let_go = Some(call);
                break;
            }
        }
        // Windows of four floors (40 ms), four calls each at one call per 10 ms.
        let call = windows_to_let_go.expect("lets go");
        assert!((25 * 4..=27 * 4).contains(&call), "{call}");
        assert_eq!(limit.limit(), DEFAULT_INITIAL);
    }

    #[test]
    fn windows_that_measure_nothing_or_wait_do_not_let_go() {
        let limit = LoadLimit::builder().build().expect("valid");
        let mut at = Instant::now();
        for _ in 0..100 {
            round(&limit, &mut at, 8, 10 * MS, Load::Overloaded);
        }
        assert!(!limit.learning());
        // A long outage of fast 5xx: windows of a second, none served.
        for _ in 0..200 {
            round(&limit, &mut at, 2, 250 * MS, Load::Unrelated);
        }
        assert!(!limit.learning(), "5xx show no room");
        // Calls waiting at the limit (all its places taken, every window): no room.
        for _ in 0..400 {
            round(&limit, &mut at, 1000, 10 * MS, Load::Served);
        }
        assert!(!limit.learning(), "{limit:?}");
    }

    #[test]
    fn a_dropped_permit_gives_its_place_back() {
        let t0 = Instant::now();
        let limit = LoadLimit::builder()
            .min(1)
            .initial(1)
            .build()
            .expect("valid");
        let permit = limit.try_acquire(t0).expect("room");
        assert_eq!(
            limit.try_acquire(t0).map(|_| ()),
            Err(Full {
                limit: 1,
                in_flight: 1
            })
        );
        let panicked = std::panic::catch_unwind(move || {
            let _held = permit;
            panic!("the service panicked");
        });
        assert!(panicked.is_err());
        assert_eq!(limit.in_flight(), 0);
        assert!(limit.try_acquire(t0).is_ok());
    }

    #[test]
    fn bad_settings_are_refused_with_the_reason() {
        let err = |b: LoadLimitBuilder| b.build().expect_err("invalid").to_string();
        assert_eq!(
            err(LoadLimit::builder().min(0)),
            "invalid min: 0 (allowed: at least 1)"
        );
        assert_eq!(
            err(LoadLimit::builder().initial(2)),
            "invalid initial: 2 (allowed: between min and max, 4..=1000)"
        );
        // Unasked, the initial limit keeps within the bounds.
        let small = LoadLimit::builder().max(16).build().expect("valid");
        assert_eq!(small.limit(), 16);
        assert_eq!(
            err(LoadLimit::builder().tolerance(1.0)),
            "invalid tolerance: 1.0 (allowed: above 1 and at most 10)"
        );
        assert_eq!(
            err(LoadLimit::builder().min(10).max(5).initial(10)),
            "invalid max: 5 (allowed: at least min, 10)"
        );
    }

    #[test]
    fn a_healthy_dependency_at_80_percent_of_capacity_sheds_nothing() {
        // Every call 10 ms, or (without a latency floor) an exponential draw of mean 10 ms.
        for (seed, exponential) in [(0, false), (1, false), (2, false), (0, true), (1, true)] {
            // 8 workers x 10 ms: 800 calls a second; 640 offered.
            let mut sim = Sim::new(LoadLimit::default(), 8, seed);
            sim.exponential = exponential;
            sim.run(640.0, 10 * MS, Duration::from_secs(160), |_, _, _| {});
            assert!(sim.served > 100_000, "{}", sim.served);
            assert_eq!(sim.shed, 0, "seed {seed}: limit {}", sim.limit.limit());
        }
    }

    #[test]
    fn the_limit_follows_littles_law_when_the_latency_doubles_and_back() {
        // 8 workers: Little's law gives 8 calls in flight whatever the service time
        // (capacity 8 / s, times the floor s). Three times the capacity is offered, at
        // 10 ms a call, then 20, then 10 again.
        let workers = 8;
        let phases = [(2400.0, 10 * MS), (1200.0, 20 * MS), (2400.0, 10 * MS)];
        let settle = 400 * MS;
        for seed in 0..3 {
            let mut sim = Sim::new(LoadLimit::default(), workers, seed);
            for (i, (rate, service)) in phases.into_iter().enumerate() {
                let from = Duration::from_secs(2 * i as u64);
                let to = from + Duration::from_secs(2);
                let mut early = Vec::new();
                sim.run(rate, service, from + settle, |at, limit, _| {
                    if at >= from + 200 * MS {
                        early.push(limit);
                    }
                });
                // Within 200 ms of the change the limit is back near Little's law...
                let low = early
                    .iter()
                    .filter(|&&l| (l as usize) < workers / 2)
                    .count();
                assert!(low * 20 <= early.len(), "seed {seed} phase {i}: {early:?}");
                // ...and the floor has followed the service time by the settle.
                let floor = sim.limit.floor().expect("served");
                assert!(
                    floor >= service && floor <= service.mul_f64(1.25),
                    "{floor:?}"
                );
                // A latency with a floor has no spread to learn: a cut that the
                // throughput showed wrong was the dependency getting slower.
                assert_eq!(
                    sim.limit.tolerance(),
                    DEFAULT_TOLERANCE,
                    "seed {seed} phase {i}"
                );
                let served = sim.served;
                let mut limits = Vec::new();
                sim.run(rate, service, to, |_, limit, _| {
                    limits.push(f64::from(limit))
                });
                let mean = limits.iter().sum::<f64>() / limits.len() as f64;
                let capacity = workers as f64 / service.as_secs_f64();
                let goodput = (sim.served - served) as f64 / (to - from - settle).as_secs_f64();
                eprintln!(
                    "seed {seed} phase {i}: mean limit {mean:.1}, served {goodput:.0}/s of \
                     {capacity:.0}"
                );
                // Every worker kept busy, and the calls queued behind them no more than
                // as many again (a queue of one service time at most).
                assert!(
                    goodput >= 0.95 * capacity,
                    "seed {seed} phase {i}: {goodput}"
                );
                let w = workers as f64;
                assert!(
                    mean >= w && mean <= 2.0 * w,
                    "seed {seed} phase {i}: {mean}"
                );
            }
        }
    }

    #[test]
    fn a_limit_held_at_its_max_by_demand_is_not_probed() {
        // Demand far above a `max` of 20, a dependency answering in 10 ms: the limit
        // stays at the cap, window after window (a probe would halve it for a round
        // trip, and shed what a healthy dependency would serve).
        let limit = LoadLimit::builder()
            .initial(20)
            .max(20)
            .build()
            .expect("valid");
        let mut at = Instant::now();
        let mut lowest = u32::MAX;
        for _ in 0..400 {
            round(&limit, &mut at, 40, 10 * MS, Load::Served);
            lowest = lowest.min(limit.limit());
        }
        assert_eq!(lowest, 20);
    }

    #[test]
    fn overload_answers_during_a_probe_cut_the_limit_the_probe_halved() {
        let limit = LoadLimit::builder().initial(40).build().expect("valid");
        let state = &limit.state;
        // A probe halved the limit, 40, for a round trip to see the floor...
        state.probe_restore.store(40_000, Ordering::Release);
        state.limit_milli.store(20_000, Ordering::Release);
        state.limit.store(20, Ordering::Release);
        // ...and its window came back all overload answers: a quarter off the limit
        // the probe halved.
        let window = |served, dropped, fresh, fresh_min| Window {
            served,
            dropped,
            fresh,
            fresh_min,
            peak: 10,
            length: 40_000_000,
        };
        state.adjust(&window(0, 20, 0, UNKNOWN), 1_000_000_000);
        assert_eq!(limit.limit(), 30);
        // A calm window after it: the probe's restore does not undo the cut.
        state.adjust(&window(20, 0, 8, 10_000_000), 2_000_000_000);
        assert_eq!(limit.limit(), 30);
    }

    #[test]
    fn a_limit_cut_in_an_overload_climbs_within_two_and_a_half_seconds_once_it_has_room() {
        // 50 workers x 20 ms (2500 calls a second), offered 5000 a second: the limit is
        // cut to about 50. The dependency then scales out to 200 workers while the
        // demand stays: it needs 100 calls in flight, which calls waiting at the limit
        // with the latency at its floor show: 0.8 to 2.1 s here, where one more a
        // window took 3.3 to 4.3 s.
        for seed in 0..3 {
            let mut sim = Sim::new(LoadLimit::default(), 50, seed);
            let scaled = Duration::from_secs(3);
            sim.run(5000.0, 20 * MS, scaled, |_, _, _| {});
            let cut = sim.limit.limit();
            assert!(cut < 90, "seed {seed}: {cut}");
            sim.workers = 200;
            let mut reached = None;
            sim.run(
                5000.0,
                20 * MS,
                scaled + Duration::from_secs(3),
                |at, limit, _| {
                    if reached.is_none() && limit >= 110 {
                        reached = Some(at - scaled);
                    }
                },
            );
            let reached = reached.expect("the limit climbs");
            assert!(
                reached <= Duration::from_millis(2500),
                "seed {seed}: {cut} {reached:?}"
            );
        }
    }

    #[test]
    fn without_a_latency_floor_the_limit_lets_go_after_an_overload() {
        // 8 workers, each call an exponential draw of mean 10 ms: no floor, so a window
        // of a few calls often has no short one. Three times the capacity for 2 s, then
        // 60% of it: within a second the limit no longer binds.
        for seed in 0..3 {
            let mut sim = Sim::new(LoadLimit::default(), 8, seed);
            sim.exponential = true;
            sim.run(2400.0, 10 * MS, Duration::from_secs(2), |_, _, _| {});
            sim.run(480.0, 10 * MS, Duration::from_secs(3), |_, _, _| {});
            let (shed, served) = (sim.shed, sim.served);
            sim.run(480.0, 10 * MS, Duration::from_secs(13), |_, _, _| {});
            let (shed, served) = (sim.shed - shed, sim.served - served);
            eprintln!(
                "seed {seed}: {shed} shed, {served} served, limit {}",
                sim.limit.limit()
            );
            assert!(
                shed * 1000 <= served,
                "seed {seed}: {shed} shed, {served} served"
            );
        }
    }

    #[test]
    fn without_a_latency_floor_an_overload_is_served_at_capacity() {
        // Each call an exponential draw of mean 10 ms: a window's shortest call is far
        // above the floor by chance, and fewer calls in flight make it longer still.
        // Read as a queue, the spread would cut the limit below the workers (at 64
        // workers, to a fifth of the capacity); the cuts that cost as much throughput
        // as they took calls are undone, and the spread learnt.
        for workers in [8, 15, 64] {
            for seed in 0..3 {
                let mut sim = Sim::new(LoadLimit::default(), workers, seed);
                sim.exponential = true;
                let capacity = workers as f64 / 0.010;
                sim.run(
                    0.65 * capacity,
                    10 * MS,
                    Duration::from_secs(5),
                    |_, _, _| {},
                );
                let served = sim.served;
                sim.run(
                    3.0 * capacity,
                    10 * MS,
                    Duration::from_secs(15),
                    |_, _, _| {},
                );
                let goodput = (sim.served - served) as f64 / 10.0;
                let tolerance = sim.limit.tolerance();
                eprintln!(
                    "{workers} workers, seed {seed}: {goodput:.0}/s of {capacity:.0}, \
                     tolerance {tolerance:.2}"
                );
                assert!(tolerance > DEFAULT_TOLERANCE && tolerance <= MAX_TOLERANCE);
                assert!(
                    goodput >= 0.8 * capacity,
                    "{workers} workers, seed {seed}: {goodput:.0}/s of {capacity:.0}"
                );
            }
        }
    }
}
