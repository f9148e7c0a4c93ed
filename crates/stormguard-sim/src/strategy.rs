//! Retry strategies: what a client does when an attempt fails.
//!
//! Each strategy is a combination of an attempt limit, a backoff, something that bounds
//! retries across requests (a budget, a throttle, a quota) and optionally a circuit
//! breaker. Where stormguard has the mechanism, the simulator drives the real type from
//! `stormguard-core` ([`Backoff`], [`RetryBudget`], [`RetryThrottle`], [`Breaker`]). The
//! two mechanisms of other libraries are modelled here from their documented rules:
//! tower's `ExponentialBackoff` + `TpsBudget` and the AWS SDKs' retry quota.

use std::time::{Duration, Instant};

use stormguard_core::breaker::{Breaker, BreakerConfig};
use stormguard_core::limit::{LoadLimit, LoadLimitConfig};
use stormguard_core::throttle::RetryThrottle;
use stormguard_core::{Backoff, Jitter, RetryBudget};

/// Every strategy the simulator knows, by the name the CLI uses.
pub const ALL: &[&str] = &[
    "none",
    "naive",
    "exponential",
    "unlimited",
    "tower",
    "a6",
    "bucket",
    "sre",
    "breaker",
    "breaker-retries",
    "stormguard",
    "stormguard+breaker",
    "standard",
];

/// The strategies `fleet` and `metastable` compare by default.
pub const FLEET: &[&str] = &[
    "none",
    "naive",
    "exponential",
    "unlimited",
    "tower",
    "a6",
    "bucket",
    "stormguard",
    "stormguard+breaker",
    "standard",
];

/// How long to wait before retry `n` (0 is the first retry).
#[derive(Debug, Clone, Copy)]
pub enum BackoffKind {
    /// The same interval every time, no jitter.
    Fixed(Duration),
    /// stormguard-core's [`Backoff`], driven through its [`Schedule`](stormguard_core::Schedule).
    Core(Backoff),
    /// tower 0.5's `ExponentialBackoff`: `b = min(max, min * 2^n)`, delay
    /// `b + min(max - b, b * jitter * u)` where `u` comes from an RNG that tower clones
    /// from the maker for every request, so request after request of one client draws
    /// the same `u` for its `n`-th retry (correlated across requests).
    Tower {
        /// tower's `min`.
        min: Duration,
        /// tower's `max`.
        max: Duration,
        /// tower's `jitter` factor.
        jitter: f64,
    },
}

/// What bounds retries across the requests of a client.
#[derive(Debug, Clone, Copy)]
pub enum BudgetKind {
    /// Nothing: every request may use all its attempts.
    None,
    /// stormguard-core's [`RetryBudget`] with these settings.
    Core {
        /// Retries per original request.
        ratio: f64,
        /// Rolling window: a whole number of 10 ms (the core is given time in whole
        /// milliseconds, and its buckets are a tenth of the window).
        window: Duration,
        /// Retries a new client may waste before it has a window of its own.
        allowance: u32,
    },
    /// tower 0.5's `TpsBudget(ttl, min_per_sec, retry_percent)`: each request deposits 1,
    /// each retry withdraws `floor(1 / retry_percent)`, the balance is the deposits minus
    /// withdrawals of the last `ttl` (ten slots) plus a reserve of
    /// `min_per_sec * ttl * withdraw`; a retry needs the whole withdrawal in the balance.
    Tps {
        /// `ttl`, whole seconds.
        ttl_secs: u32,
        /// `min_per_sec`.
        min_per_sec: u32,
        /// `retry_percent`.
        retry_percent: f64,
    },
    /// gRFC A6 retry throttling, stormguard-core's [`RetryThrottle`].
    A6 {
        /// `maxTokens`.
        max_tokens: f64,
        /// `tokenRatio`.
        token_ratio: f64,
    },
    /// Google SRE's client-side adaptive throttling ("Handling Overload", Site
    /// Reliability Engineering, 2016): every attempt, first tries included, is rejected
    /// locally with probability `max(0, (requests - k * accepts) / (requests + 1))`,
    /// over the last `history_secs` of attempts (in ten-second buckets); `accepts` are
    /// the attempts the dependency served.
    Sre {
        /// `K` (2 in the book).
        k: f64,
        /// The history, seconds (about two minutes in the book).
        history_secs: u32,
    },
    /// The AWS SDK "standard" retry quota (botocore `retries/quota.py` and
    /// `retries/standard.py`; AWS SDKs and Tools reference guide, "Retry behavior"):
    /// a bucket of 500 starts full; a retry costs 5, a retry after a timeout 10, and is
    /// refused if the bucket holds less; a request that succeeds without a retry puts 1
    /// back, one that succeeds after retries gives back what its last retry cost; capped
    /// at 500.
    Quota {
        /// Initial and maximum capacity (500).
        capacity: u32,
        /// Cost of a retry (5).
        retry_cost: u32,
        /// Cost of a retry after a timeout (10).
        timeout_cost: u32,
        /// Refund of a success without retries (1).
        success_refund: u32,
    },
}

/// Where a circuit breaker sits, if anywhere.
#[derive(Debug, Clone)]
pub enum BreakerMode {
    /// No breaker.
    Off,
    /// Every attempt asks the breaker; an open circuit fails the request at once
    /// (`CircuitOpen` is `DontRetry`).
    AllCalls(BreakerConfig),
    /// The breaker sees every outcome but only stops retries; first tries always go out.
    RetriesOnly(BreakerConfig),
}

/// A retry strategy: see [`Strategy::named`] for the list.
#[derive(Debug, Clone)]
pub struct Strategy {
    /// The name the CLI and the tables use.
    pub name: String,
    /// Attempts per request, the first included.
    pub attempts: u32,
    /// Delay before each retry.
    pub backoff: BackoffKind,
    /// Bound on retries across requests.
    pub budget: BudgetKind,
    /// Circuit breaker placement.
    pub breaker: BreakerMode,
    /// The load control between the retries and the breaker, as in the standard stack
    /// (`None`: no limit on the calls in flight).
    pub load: Option<LoadLimitConfig>,
}

impl Strategy {
    /// The strategy called `name`, with `attempts` attempts per request where the
    /// strategy retries at all:
    ///
    /// | name | backoff | across requests | breaker |
    /// |---|---|---|---|
    /// | `none` | - (1 attempt) | - | - |
    /// | `naive` | fixed 200 ms | - | - |
    /// | `exponential` | core `Backoff` 200 ms..20 s, `Jitter::None` | - | - |
    /// | `unlimited` (was `retries`) | full jitter 200 ms..20 s | - | - |
    /// | `tower` | tower `ExponentialBackoff` 200 ms..20 s, jitter 0.99 (tower's default factor) | tower `TpsBudget::default()`: 10 s, 10/s, 20% | - |
    /// | `a6` | full jitter 200 ms..20 s | A6 throttle, maxTokens 10, tokenRatio 0.1 | - |
    /// | `bucket` | full jitter 200 ms..20 s | AWS retry quota 500 / 5 / 10 / 1 | - |
    /// | `sre` | full jitter 200 ms..20 s | SRE adaptive throttling, K = 2, 120 s, on every attempt | - |
    /// | `breaker` | full jitter 200 ms..20 s | - | core `BreakerConfig::default()` on all calls |
    /// | `breaker-retries` | full jitter 200 ms..20 s | - | core `BreakerConfig::default()` on retries only |
    /// | `stormguard` | core `Backoff::default()` | core `RetryBudget::default()` (waste within 10% over 10 s, allowance 1) | - |
    /// | `stormguard+breaker` | core `Backoff::default()` | core `RetryBudget::default()` | core `BreakerConfig::default()` on all calls |
    /// | `standard` | core `Backoff::default()` | core `RetryBudget::default()`, and the core's default `LoadLimit` on the calls in flight | core `BreakerConfig::default()` on all calls |
    ///
    /// `standard` is the standard stack's retry wing: its load control limits each
    /// client's (or, `--shared`, the fleet's) attempts in flight; an attempt past the
    /// limit waits for room as long as the limit's `wait_for_room` allows (its
    /// `max_wait`, longer while the limit is learning), newest first, then is shed
    /// (never sent, not retried).
    pub fn named(name: &str, attempts: u32) -> Option<Strategy> {
        let full = BackoffKind::Core(Backoff::default());
        let core_budget = {
            let b = RetryBudget::default();
            BudgetKind::Core {
                ratio: b.ratio(),
                window: b.window(),
                allowance: b.allowance(),
            }
        };
        // 200 ms to 20 s, whatever the core's defaults become.
        let pinned = |jitter| {
            Backoff::new(Duration::from_millis(200), Duration::from_secs(20), jitter)
                .ok()
                .map(BackoffKind::Core)
        };
        let mut load = None;
        let (attempts, backoff, budget, breaker) = match name {
            "none" => (1, full, BudgetKind::None, BreakerMode::Off),
            "naive" => (
                attempts,
                BackoffKind::Fixed(Duration::from_millis(200)),
                BudgetKind::None,
                BreakerMode::Off,
            ),
            "exponential" => (
                attempts,
                pinned(Jitter::None)?,
                BudgetKind::None,
                BreakerMode::Off,
            ),
            // The reference of what retries can do: pinned, whatever the defaults become.
            // `retries` is its name before v0.3.
            "unlimited" | "retries" => (
                attempts,
                pinned(Jitter::Full)?,
                BudgetKind::None,
                BreakerMode::Off,
            ),
            "tower" => (
                attempts,
                BackoffKind::Tower {
                    min: Duration::from_millis(200),
                    max: Duration::from_secs(20),
                    jitter: 0.99,
                },
                BudgetKind::Tps {
                    ttl_secs: 10,
                    min_per_sec: 10,
                    retry_percent: 0.2,
                },
                BreakerMode::Off,
            ),
            "a6" => (
                attempts,
                full,
                BudgetKind::A6 {
                    max_tokens: 10.0,
                    token_ratio: 0.1,
                },
                BreakerMode::Off,
            ),
            "bucket" => (attempts, full, BudgetKind::AWS_QUOTA, BreakerMode::Off),
            "sre" => (
                attempts,
                full,
                BudgetKind::Sre {
                    k: 2.0,
                    history_secs: 120,
                },
                BreakerMode::Off,
            ),
            "breaker" => (
                attempts,
                full,
                BudgetKind::None,
                BreakerMode::AllCalls(BreakerConfig::default()),
            ),
            "breaker-retries" => (
                attempts,
                full,
                BudgetKind::None,
                BreakerMode::RetriesOnly(BreakerConfig::default()),
            ),
            "stormguard" => (attempts, full, core_budget, BreakerMode::Off),
            "stormguard+breaker" => (
                attempts,
                full,
                core_budget,
                BreakerMode::AllCalls(BreakerConfig::default()),
            ),
            "standard" => {
                load = Some(LoadLimitConfig::default());
                (
                    attempts,
                    full,
                    core_budget,
                    BreakerMode::AllCalls(BreakerConfig::default()),
                )
            }
            _ => return None,
        };
        Some(Strategy {
            name: name.to_string(),
            attempts: attempts.max(1),
            backoff,
            budget,
            breaker,
            load,
        })
    }
}

impl Strategy {
    /// The strategy of one dependency of a configuration file, named `config:NAME`: its
    /// attempts, backoff, budget, load control and breaker (on all calls; each `None`
    /// when the file turns it off). The simulator models one bound across requests, so a dependency with
    /// both a budget and `retry_throttling` is simulated with the budget; hedging and
    /// per-method gRPC settings are not simulated.
    pub fn from_settings(
        name: &str,
        settings: &stormguard_core::config::DependencySettings,
    ) -> Result<Strategy, stormguard_core::ConfigError> {
        let budget = settings.budget.clone().build()?;
        Ok(Strategy {
            name: format!("config:{name}"),
            attempts: settings.retry.max_attempts.max(1),
            backoff: BackoffKind::Core(settings.retry.backoff),
            budget: BudgetKind::Core {
                ratio: budget.ratio(),
                window: budget.window(),
                allowance: budget.allowance(),
            },
            breaker: match &settings.breaker {
                Some(breaker) => BreakerMode::AllCalls(breaker.config.clone()),
                None => BreakerMode::Off,
            },
            load: settings.load_control,
        })
    }
}

impl BudgetKind {
    /// The AWS SDK standard retry quota: 500, retry 5, timeout retry 10, refund 1.
    pub const AWS_QUOTA: BudgetKind = BudgetKind::Quota {
        capacity: 500,
        retry_cost: 5,
        timeout_cost: 10,
        success_refund: 1,
    };
}

/// The per-client (or fleet-shared) state of a strategy: its budget, its load control
/// and its breaker.
#[derive(Debug)]
pub(crate) struct ClientState {
    pub(crate) budget: BudgetState,
    pub(crate) load: Option<LoadLimit>,
    /// Boxed, like the larger budget models, so that the clients' states stay small and
    /// close together for the strategies that do not use them.
    pub(crate) breaker: Option<Box<Breaker>>,
    /// Seed of the client's tower backoff RNG (cloned for every request).
    pub(crate) tower_seed: u64,
    /// The real `Instant` that virtual time 0 maps to for this client's core types.
    origin: Instant,
}

#[derive(Debug)]
pub(crate) enum BudgetState {
    None,
    Core(RetryBudget),
    Tps(Box<TpsModel>),
    A6(RetryThrottle),
    Quota(QuotaModel),
    Sre(Box<SreModel>),
}

impl ClientState {
    pub(crate) fn new(strategy: &Strategy, seed: u64) -> Result<Self, String> {
        // The core's types are given virtual time as `origin + t`, the budget counting
        // its epochs from that same origin: a run is a pure function of the seed.
        let origin = Instant::now();
        let budget = Self::budget(strategy, origin)?;
        let breaker = match &strategy.breaker {
            BreakerMode::Off => None,
            BreakerMode::AllCalls(c) | BreakerMode::RetriesOnly(c) => {
                Some(Box::new(Breaker::with_seed(c.clone(), seed)))
            }
        };
        Ok(ClientState {
            budget,
            load: strategy.load.map(LoadLimit::with_config),
            breaker,
            tower_seed: seed.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15,
            origin,
        })
    }

    /// The `Instant` the core's types are given for virtual time `t` (ns).
    pub(crate) fn instant(&self, t: u64) -> Instant {
        self.origin + Duration::from_nanos(t)
    }

    fn budget(strategy: &Strategy, origin: Instant) -> Result<BudgetState, String> {
        Ok(match strategy.budget {
            BudgetKind::None => BudgetState::None,
            BudgetKind::Core {
                ratio,
                window,
                allowance,
            } => BudgetState::Core(
                RetryBudget::builder()
                    .ratio(ratio)
                    .window(window)
                    .allowance(allowance)
                    .origin(origin)
                    .build()
                    .map_err(|e| e.to_string())?,
            ),
            BudgetKind::Tps {
                ttl_secs,
                min_per_sec,
                retry_percent,
            } => BudgetState::Tps(Box::new(TpsModel::new(
                ttl_secs,
                min_per_sec,
                retry_percent,
            ))),
            BudgetKind::A6 {
                max_tokens,
                token_ratio,
            } => BudgetState::A6(
                RetryThrottle::builder()
                    .max_tokens(max_tokens)
                    .token_ratio(token_ratio)
                    .build()
                    .map_err(|e| e.to_string())?,
            ),
            BudgetKind::Sre { k, history_secs } => {
                BudgetState::Sre(Box::new(SreModel::new(k, history_secs)))
            }
            BudgetKind::Quota {
                capacity,
                retry_cost,
                timeout_cost,
                success_refund,
            } => BudgetState::Quota(QuotaModel {
                available: capacity,
                capacity,
                retry_cost,
                timeout_cost,
                success_refund,
            }),
        })
    }

    /// An original request was made at `now` (virtual time `t` in ns).
    pub(crate) fn on_request(&mut self, t: u64) {
        let now = self.instant(t);
        match &mut self.budget {
            BudgetState::Core(b) => b.deposit(now),
            BudgetState::Tps(b) => b.deposit(t),
            _ => {}
        }
    }

    /// An attempt finished at `t`: `success`, or a failure (error or timeout).
    pub(crate) fn on_attempt(&mut self, t: u64, success: bool) {
        match &mut self.budget {
            BudgetState::A6(throttle) if success => throttle.record_success(),
            BudgetState::A6(throttle) => throttle.record_failure(),
            BudgetState::Sre(sre) if success => sre.accepted(t),
            _ => {}
        }
    }

    /// Whether an attempt about to go out at `t` is sent: SRE throttling rejects some
    /// locally (`u` is a uniform draw); everything else sends them all.
    pub(crate) fn allows_attempt(&mut self, t: u64, u: f64) -> bool {
        match &mut self.budget {
            BudgetState::Sre(sre) => sre.allows(t, u),
            _ => true,
        }
    }

    /// A request finished successfully; `spent` is what its last retry cost the quota.
    pub(crate) fn on_success(&mut self, spent: u32) {
        if let BudgetState::Quota(q) = &mut self.budget {
            let refund = if spent > 0 { spent } else { q.success_refund };
            q.available = q.available.saturating_add(refund).min(q.capacity);
        }
    }

    /// A request ended at `t`, `wasted` of its retries failed.
    pub(crate) fn on_wasted(&mut self, t: u64, wasted: u32) {
        let now = self.instant(t);
        if let BudgetState::Core(b) = &self.budget {
            b.charge(now, wasted);
        }
    }

    /// An attempt timed out at `t`: work the server may have done for nobody, which a
    /// core budget is charged as two wasted retries once the attempt's own retry is
    /// decided, whatever was decided (as the retry layer charges a timeout).
    pub(crate) fn on_timeout(&mut self, t: u64) {
        let now = self.instant(t);
        if let BudgetState::Core(b) = &self.budget {
            b.charge(now, stormguard_core::budget::EXPENSIVE_FAILURE);
        }
    }

    /// May a retry be made at `t` after a failure (`timeout` if it timed out) of a
    /// request that has made `retries` retries? Returns the quota it cost (0 for the
    /// others) or `None` when refused.
    pub(crate) fn try_retry(&mut self, t: u64, retries: u32, timeout: bool) -> Option<u32> {
        let now = self.instant(t);
        match &mut self.budget {
            BudgetState::None => Some(0),
            BudgetState::Core(b) => b.admit(now, retries).then_some(0),
            BudgetState::Tps(b) => b.withdraw(t).then_some(0),
            BudgetState::A6(th) => th.allows_retry().then_some(0),
            BudgetState::Sre(_) => Some(0),
            BudgetState::Quota(q) => {
                let cost = if timeout {
                    q.timeout_cost
                } else {
                    q.retry_cost
                };
                if q.available >= cost {
                    q.available -= cost;
                    Some(cost)
                } else {
                    None
                }
            }
        }
    }
}

/// tower's `TpsBudget` semantics on virtual time: ten slots of `ttl / 10`, each the
/// net of deposits (+1) and withdrawals (-withdraw) made in it, plus a reserve.
#[derive(Debug)]
pub(crate) struct TpsModel {
    slot_ns: u64,
    /// (epoch, net) per slot.
    slots: [(u64, i64); 10],
    reserve: i64,
    withdraw: i64,
    deposit: i64,
}

impl TpsModel {
    fn new(ttl_secs: u32, min_per_sec: u32, retry_percent: f64) -> Self {
        // tower: percent 0 => deposit 0, withdraw 1; <= 1 => 1 and 1/percent truncated;
        // above 1 => 1000 and 1000/percent.
        let (deposit, withdraw) = if retry_percent <= 0.0 {
            (0, 1)
        } else if retry_percent <= 1.0 {
            (1, (1.0 / retry_percent) as i64)
        } else {
            (1000, (1000.0 / retry_percent) as i64)
        };
        TpsModel {
            slot_ns: u64::from(ttl_secs) * 100_000_000,
            slots: [(u64::MAX, 0); 10],
            reserve: i64::from(min_per_sec) * i64::from(ttl_secs) * withdraw,
            withdraw,
            deposit,
        }
    }

    fn slot(&mut self, t: u64) -> &mut i64 {
        let epoch = t / self.slot_ns.max(1);
        let slot = &mut self.slots[(epoch % 10) as usize];
        if slot.0 != epoch {
            *slot = (epoch, 0);
        }
        &mut slot.1
    }

    fn balance(&self, t: u64) -> i64 {
        let epoch = t / self.slot_ns.max(1);
        self.slots
            .iter()
            .filter(|(e, _)| *e != u64::MAX && *e + 10 > epoch)
            .map(|(_, n)| *n)
            .sum::<i64>()
            + self.reserve
    }

    fn deposit(&mut self, t: u64) {
        let d = self.deposit;
        *self.slot(t) += d;
    }

    fn withdraw(&mut self, t: u64) -> bool {
        if self.balance(t) >= self.withdraw {
            let w = self.withdraw;
            *self.slot(t) -= w;
            true
        } else {
            false
        }
    }
}

/// SRE adaptive throttling (see [`BudgetKind::Sre`]): attempts and accepts in ten-second
/// buckets.
#[derive(Debug)]
pub(crate) struct SreModel {
    k: f64,
    /// (epoch, attempts, accepts) per bucket.
    buckets: Vec<(u64, u32, u32)>,
}

/// The SRE model's bucket width.
const SRE_BUCKET_NS: u64 = 10_000_000_000;

impl SreModel {
    fn new(k: f64, history_secs: u32) -> Self {
        let n = (u64::from(history_secs) * 1_000_000_000)
            .div_ceil(SRE_BUCKET_NS)
            .max(1);
        SreModel {
            k,
            buckets: vec![(u64::MAX, 0, 0); n as usize],
        }
    }

    fn bucket(&mut self, t: u64) -> &mut (u64, u32, u32) {
        let epoch = t / SRE_BUCKET_NS;
        let n = self.buckets.len() as u64;
        let b = &mut self.buckets[(epoch % n) as usize];
        if b.0 != epoch {
            *b = (epoch, 0, 0);
        }
        b
    }

    /// Counts an attempt at `t` and says whether it goes out.
    fn allows(&mut self, t: u64, u: f64) -> bool {
        let epoch = t / SRE_BUCKET_NS;
        let n = self.buckets.len() as u64;
        let (requests, accepts) = self
            .buckets
            .iter()
            .filter(|b| b.0 != u64::MAX && b.0 + n > epoch)
            .fold((0.0, 0.0), |(r, a), b| {
                (r + f64::from(b.1), a + f64::from(b.2))
            });
        let reject = ((requests - self.k * accepts) / (requests + 1.0)).max(0.0);
        let bucket = self.bucket(t);
        bucket.1 = bucket.1.saturating_add(1);
        u >= reject
    }

    fn accepted(&mut self, t: u64) {
        let bucket = self.bucket(t);
        bucket.2 = bucket.2.saturating_add(1);
    }
}

/// The AWS SDK retry quota (see [`BudgetKind::Quota`]).
#[derive(Debug)]
pub(crate) struct QuotaModel {
    available: u32,
    capacity: u32,
    retry_cost: u32,
    timeout_cost: u32,
    success_refund: u32,
}

/// tower's delay for retry `n` of a request of the client whose RNG seed is `seed`.
pub(crate) fn tower_delay(
    min: Duration,
    max: Duration,
    jitter: f64,
    seed: u64,
    n: u32,
) -> Duration {
    let base = min
        .checked_mul(2u32.saturating_pow(n))
        .unwrap_or(max)
        .min(max);
    // The same u for the same (client, n): tower clones the maker's RNG per request.
    let u = unit_f64(splitmix(
        seed ^ u64::from(n).wrapping_mul(0xa076_1d64_78bd_642f),
    ));
    let extra = base.mul_f64((u * jitter).clamp(0.0, 100.0));
    base + extra.min(max.saturating_sub(base))
}

/// SplitMix64: a small, good hash of a u64.
pub(crate) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A u64 mapped to `[0, 1)`.
pub(crate) fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_and_unknown_ones_do_not() {
        for name in ALL {
            let s = Strategy::named(name, 3).expect("known");
            assert_eq!(s.name, *name);
        }
        assert_eq!(Strategy::named("retries", 3).map(|s| s.attempts), Some(3));
        assert!(Strategy::named("bogus", 3).is_none());
        assert_eq!(Strategy::named("none", 5).map(|s| s.attempts), Some(1));
    }

    #[test]
    fn tps_model_grants_reserve_plus_a_fifth_of_requests() {
        // ttl 10 s, 0/s floor, 20%: 50 deposits pay for 10 retries in the window.
        let mut b = TpsModel::new(10, 0, 0.2);
        for i in 0..50 {
            b.deposit(i * 1_000_000);
        }
        let granted = (0..50).filter(|_| b.withdraw(60_000_000)).count();
        assert_eq!(granted, 10);
        // Eleven seconds later the deposits have expired.
        assert!(!b.withdraw(11_000_000_000));
        // The default floor: 10/s * 10 s = 100 retries with no deposits at all.
        let mut b = TpsModel::new(10, 10, 0.2);
        assert_eq!((0..500).filter(|_| b.withdraw(0)).count(), 100);
    }

    #[test]
    fn quota_follows_the_sdk_costs() {
        let s = Strategy::named("bucket", 3).expect("known");
        let mut c = ClientState::new(&s, 1).expect("state");
        // 500 / 10 = 50 timeout retries, then refused.
        assert_eq!((0..60).filter_map(|_| c.try_retry(0, 0, true)).count(), 50);
        assert_eq!(c.try_retry(0, 0, false), None);
        // A success without retries puts back 1; 5 successes pay for one retry.
        for _ in 0..5 {
            c.on_success(0);
        }
        assert_eq!(c.try_retry(0, 0, false), Some(5));
        assert_eq!(c.try_retry(0, 0, false), None);
        // A success after that retry refunds its cost.
        c.on_success(5);
        assert_eq!(c.try_retry(0, 0, false), Some(5));
    }

    #[test]
    fn tower_jitter_is_the_same_for_every_request_of_a_client() {
        let (min, max) = (Duration::from_millis(200), Duration::from_secs(20));
        let a = tower_delay(min, max, 0.99, 7, 2);
        assert_eq!(a, tower_delay(min, max, 0.99, 7, 2));
        assert!(a >= Duration::from_millis(800) && a < Duration::from_millis(1600));
        assert_ne!(a, tower_delay(min, max, 0.99, 8, 2));
        assert_eq!(tower_delay(min, max, 0.99, 7, 40), max);
    }
}
