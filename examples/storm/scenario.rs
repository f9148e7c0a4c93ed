//! The flags and the scenarios: what a run does and what each bad window is.

use std::path::PathBuf;
use std::time::Duration;

use crate::strategy::Kind;
use crate::{
    ATTEMPT_TIMEOUT, BLIPS, BLIP_EVERY, BLIP_LENGTH, BROWNOUT_SLOWDOWN, OVERLOAD, PARTIAL_LONG_SECS,
};

/// Which scenarios `--scenario` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Selection {
    Outage,
    Partial,
    Brownout,
    Overload,
    Fleet,
    Blip,
    FleetPartial,
    PartialLong,
    All,
}

/// The flags.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) selection: Selection,
    pub(crate) fail_ratio: f64,
    pub(crate) quick: bool,
    pub(crate) json: bool,
    pub(crate) clients: Option<u32>,
    pub(crate) window_secs: Option<f64>,
    pub(crate) seed: u64,
    pub(crate) svg: PathBuf,
    pub(crate) series: bool,
    /// The rows `--strategy` asked for, in the order of [`Kind::ALL`]; else each
    /// scenario's own ([`Scenario::kinds`]).
    pub(crate) kinds: Option<Vec<Kind>>,
    /// `--rate`: requests per second per client.
    pub(crate) rate: Option<f64>,
}

impl Options {
    /// Parses the flags; `Ok(None)` means help was asked for.
    pub(crate) fn from_args(args: impl Iterator<Item = String>) -> Result<Option<Self>, String> {
        let mut selection = None;
        let mut options = Options {
            selection: Selection::Outage,
            fail_ratio: 0.3,
            quick: false,
            json: false,
            clients: None,
            window_secs: None,
            seed: 1,
            svg: PathBuf::from("target/storm.svg"),
            series: false,
            kinds: None,
            rate: None,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match flag.as_str() {
                "--scenario" => {
                    selection = Some(match value("--scenario")?.as_str() {
                        "outage" => Selection::Outage,
                        "partial" => Selection::Partial,
                        "brownout" => Selection::Brownout,
                        "overload" => Selection::Overload,
                        "fleet" => Selection::Fleet,
                        "blip" => Selection::Blip,
                        "fleet-partial" => Selection::FleetPartial,
                        "partial30-long" => Selection::PartialLong,
                        "all" => Selection::All,
                        other => {
                            return Err(format!(
                                "--scenario: `{other}` is not one of outage, partial, \
                                 brownout, overload, fleet, blip, fleet-partial, \
                                 partial30-long, all"
                            ))
                        }
                    });
                }
                "--fail-ratio" => {
                    options.fail_ratio =
                        parse_in("--fail-ratio", &value("--fail-ratio")?, 0.0..=1.0)?;
                }
                "--quick" => options.quick = true,
                "--json" => options.json = true,
                "--series" => options.series = true,
                "--clients" => {
                    options.clients = Some(parse_in("--clients", &value("--clients")?, 1..=1000)?);
                }
                "--outage-secs" => {
                    options.window_secs = Some(parse_in(
                        "--outage-secs",
                        &value("--outage-secs")?,
                        0.1..=30.0,
                    )?);
                }
                "--strategy" => options.kinds = Some(parse_kinds(&value("--strategy")?)?),
                "--rate" => {
                    options.rate = Some(parse_in("--rate", &value("--rate")?, 0.1..=10_000.0)?);
                }
                "--seed" => options.seed = parse_in("--seed", &value("--seed")?, 0..=u64::MAX)?,
                "--svg" => options.svg = PathBuf::from(value("--svg")?),
                "-h" | "--help" => return Ok(None),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        // `--quick` alone is the CI smoke test: every scenario, briefly.
        options.selection = selection.unwrap_or(if options.quick {
            Selection::All
        } else {
            Selection::Outage
        });
        Ok(Some(options))
    }

    /// The scenarios to run, in order.
    pub(crate) fn scenarios(&self) -> Vec<Scenario> {
        let partial = |ratio: f64| Fault::Partial(ratio);
        let outage = || self.scenario(Fault::Outage, false, None);
        let partial_long = || self.scenario(partial(0.3), false, Some(PARTIAL_LONG_SECS));
        let fleet_partial = || self.scenario(partial(0.3), true, None);
        match self.selection {
            Selection::Outage => vec![outage()],
            Selection::Partial => vec![self.scenario(partial(self.fail_ratio), false, None)],
            Selection::Brownout => vec![self.scenario(Fault::Brownout, false, None)],
            Selection::Overload => vec![self.scenario(Fault::Overload, false, None)],
            Selection::Fleet => vec![self.scenario(Fault::Outage, true, None)],
            Selection::Blip => vec![self.blips()],
            Selection::FleetPartial => vec![fleet_partial()],
            Selection::PartialLong => vec![partial_long()],
            Selection::All => vec![
                outage(),
                self.blips(),
                self.scenario(partial(0.3), false, None),
                self.scenario(partial(0.6), false, None),
                partial_long(),
                self.scenario(Fault::Brownout, false, None),
                self.scenario(Fault::Overload, false, None),
                self.scenario(Fault::Outage, true, None),
                fleet_partial(),
            ],
        }
    }

    /// Ten blips (fewer with `--quick`), one every [`BLIP_EVERY`].
    pub(crate) fn blips(&self) -> Scenario {
        let blips = if self.quick { 1.0 } else { BLIPS };
        let secs = blips * BLIP_EVERY.as_secs_f64();
        self.scenario(Fault::Blip, false, Some(secs))
    }

    /// A scenario of `fault`, seen by 200 small clients with their own state
    /// (`own_state`) or 8 sharing one, with a window of `window_secs` (else
    /// `--outage-secs`, else 5 s).
    pub(crate) fn scenario(
        &self,
        fault: Fault,
        own_state: bool,
        window_secs: Option<f64>,
    ) -> Scenario {
        let long = window_secs.is_some_and(|w| w > 20.0);
        let name = match (fault, own_state) {
            (Fault::Partial(ratio), true) => format!("fleet-partial{:.0}", ratio * 100.0),
            (_, true) => "fleet".to_owned(),
            (Fault::Outage, false) => "outage".to_owned(),
            (Fault::Partial(ratio), false) if long => {
                format!("partial{:.0}-long", ratio * 100.0)
            }
            (Fault::Partial(ratio), false) => format!("partial{:.0}", ratio * 100.0),
            (Fault::Brownout, false) => "brownout".to_owned(),
            (Fault::Overload, false) => "overload".to_owned(),
            (Fault::Blip, false) => "blip".to_owned(),
        };
        // 520 requests/s offered by default either way: 8 x 65 or 200 x 2.6.
        let (default_clients, rate_per_client) = if own_state { (200, 2.6) } else { (8, 65.0) };
        let rate_per_client = self.rate.unwrap_or(rate_per_client);
        let (phases, request_deadline) = if self.quick {
            let window = match fault {
                Fault::Blip => BLIP_EVERY.as_secs_f64(),
                _ => self.window_secs.unwrap_or(0.8),
            };
            (Phases::new(0.4, window, 0.6), Duration::from_secs(1))
        } else {
            let window = window_secs.or(self.window_secs).unwrap_or(5.0);
            (Phases::new(3.0, window, 5.0), Duration::from_secs(2))
        };
        let kinds = self.kinds.clone().unwrap_or_else(|| {
            Kind::ALL
                .into_iter()
                .filter(|kind| {
                    !kind.is_peer() || matches!(fault, Fault::Brownout | Fault::Overload)
                })
                .collect()
        });
        Scenario {
            name,
            kinds,
            fault,
            own_state,
            clients: self.clients.unwrap_or(default_clients),
            rate_per_client,
            phases,
            workers: 8,
            service_time: Duration::from_millis(10),
            queue: 160,
            attempt_timeout: ATTEMPT_TIMEOUT,
            request_deadline,
            seed: self.seed,
        }
    }
}

pub(crate) fn parse_in<T>(
    flag: &str,
    text: &str,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    let value: T = text
        .parse()
        .map_err(|_| format!("{flag}: `{text}` is not a number"))?;
    if !range.contains(&value) {
        return Err(format!(
            "{flag}: {text} is out of range ({}..={})",
            range.start(),
            range.end()
        ));
    }
    Ok(value)
}

/// What goes wrong in the bad window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fault {
    /// Every request gets a 503 at once.
    Outage,
    /// Each request gets a 503 at once with this probability.
    Partial(f64),
    /// Every request takes [`BROWNOUT_SLOWDOWN`] times as long to serve.
    Brownout,
    /// Every request gets a 503 at once during the first [`BLIP_LENGTH`] of every
    /// [`BLIP_EVERY`] of the window.
    Blip,
    /// The clients offer [`OVERLOAD`] times the server's capacity in the window.
    Overload,
}

/// Everything one scenario depends on.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub(crate) name: String,
    /// The rows to run.
    pub(crate) kinds: Vec<Kind>,
    pub(crate) fault: Fault,
    /// Each client builds its own policy, budget and breaker (else one per strategy).
    pub(crate) own_state: bool,
    pub(crate) clients: u32,
    /// Requests each client starts per second, whatever happens to earlier ones.
    pub(crate) rate_per_client: f64,
    pub(crate) phases: Phases,
    /// Requests the server processes at once.
    pub(crate) workers: usize,
    /// Time the server spends on each request it accepts, outside a brownout.
    pub(crate) service_time: Duration,
    /// Requests that may wait for a worker; beyond that the server answers 503 at once.
    pub(crate) queue: usize,
    /// Every strategy's per-attempt timeout.
    pub(crate) attempt_timeout: Duration,
    /// The caller's deadline for a whole request, retries included.
    pub(crate) request_deadline: Duration,
    pub(crate) seed: u64,
}

impl Scenario {
    pub(crate) fn offered_rate(&self) -> f64 {
        self.rate_per_client * f64::from(self.clients)
    }

    /// Each client's rate at `at` from the start: [`OVERLOAD`] times the capacity
    /// shared by the clients in an overload's window, else `rate_per_client`.
    pub(crate) fn rate_at(&self, at: Duration) -> f64 {
        if self.fault == Fault::Overload && self.phases.in_window(at) {
            OVERLOAD * self.capacity() / f64::from(self.clients)
        } else {
            self.rate_per_client
        }
    }

    pub(crate) fn capacity(&self) -> f64 {
        self.workers as f64 / self.service_time.as_secs_f64()
    }

    pub(crate) fn describe(&self) -> String {
        let window = match self.fault {
            Fault::Outage => "every request 503".to_owned(),
            Fault::Partial(ratio) => format!("{:.0}% of requests 503", ratio * 100.0),
            Fault::Brownout => format!(
                "work {BROWNOUT_SLOWDOWN}x longer, capacity {:.0} req/s",
                self.capacity() / BROWNOUT_SLOWDOWN
            ),
            Fault::Blip => format!(
                "every request 503 for {} ms of every {} s; ok win counts the requests \
                 started in a blip",
                BLIP_LENGTH.as_millis(),
                BLIP_EVERY.as_secs()
            ),
            Fault::Overload => format!(
                "{OVERLOAD}x the capacity offered, {:.0} req/s",
                OVERLOAD * self.capacity()
            ),
        };
        let state = if self.own_state {
            "each client with its own policy, budget and breaker"
        } else {
            "the clients of a strategy share one policy, budget and breaker"
        };
        format!(
            "scenario {name}: a dependency of capacity {cap:.0} req/s ({w} workers x {s} ms, \
             queue {q}), {c} clients x {r} req/s = {o:.0} req/s offered ({pct:.0}% of capacity)\n\
             healthy 0-{o0:.1} s, window {o0:.1}-{o1:.1} s ({window}), healthy until {end:.1} s; \
             per-attempt timeout {t} ms, {state}; seed {seed}",
            name = self.name,
            cap = self.capacity(),
            w = self.workers,
            s = self.service_time.as_millis(),
            q = self.queue,
            c = self.clients,
            r = self.rate_per_client,
            o = self.offered_rate(),
            pct = 100.0 * self.offered_rate() / self.capacity(),
            t = self.attempt_timeout.as_millis(),
            seed = self.seed,
            o0 = self.phases.window_start.as_secs_f64(),
            o1 = self.phases.window_end.as_secs_f64(),
            end = self.phases.end.as_secs_f64(),
        )
    }
}

/// When the dependency is healthy and when it is in its bad window, from the start of a
/// run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phases {
    pub(crate) window_start: Duration,
    pub(crate) window_end: Duration,
    /// Clients start no request after this.
    pub(crate) end: Duration,
}

impl Phases {
    /// Lengths in seconds, rounded to whole buckets.
    pub(crate) fn new(healthy: f64, window: f64, after: f64) -> Self {
        let round = |secs: f64| Duration::from_millis(((secs * 10.0).round() as u64).max(1) * 100);
        let window_start = round(healthy);
        let window_end = window_start + round(window);
        Phases {
            window_start,
            window_end,
            end: window_end + round(after),
        }
    }

    pub(crate) fn in_window(&self, at: Duration) -> bool {
        (self.window_start..self.window_end).contains(&at)
    }

    /// Whether `fault` is failing requests at `at`: in the window, and for blips in
    /// one of them.
    pub(crate) fn failing(&self, fault: Fault, at: Duration) -> bool {
        self.in_window(at)
            && (fault != Fault::Blip
                || (at - self.window_start).as_nanos() % BLIP_EVERY.as_nanos()
                    < BLIP_LENGTH.as_nanos())
    }
}

/// Parses `--strategy`'s comma-separated row names into the rows to run, in the order of
/// [`Kind::ALL`] (so that tables read alike whatever order they were named in).
fn parse_kinds(list: &str) -> Result<Vec<Kind>, String> {
    let mut named = Vec::new();
    for name in list.split(',').map(str::trim) {
        let kind = Kind::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| {
                format!(
                    "--strategy: `{name}` is not one of {}",
                    Kind::ALL.map(Kind::name).join(", ")
                )
            })?;
        named.push(kind);
    }
    Ok(Kind::ALL
        .into_iter()
        .filter(|kind| named.contains(kind))
        .collect())
}
