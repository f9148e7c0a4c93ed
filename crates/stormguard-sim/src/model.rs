//! The fleet model: a server with workers and a bounded queue, a timeline of failures,
//! and N open-loop clients retrying with a [`Strategy`], all on one virtual clock.
//!
//! # Time and events
//!
//! Virtual time is a `u64` of nanoseconds since the start. Three sources of events are
//! merged in time order: the next arrival of the fleet's Poisson process (a superposition
//! of N Poisson clients is one Poisson process whose arrivals pick a client uniformly),
//! the per-attempt timeouts (all of one length, so a FIFO queue keeps them in order), and
//! a binary heap for the rest (service completions, delayed responses, retries after a
//! backoff). Ties are broken by insertion order, so a run is a pure function of its
//! [`FleetConfig`] and seed. The core's types take `std::time::Instant`: the model hands
//! them `origin + virtual offset`, with one fixed `origin` per run.
//!
//! # Server
//!
//! `workers` serve one attempt each for an exponentially distributed service time;
//! past them, a FIFO queue of `queue_limit`; past that, 503 at once (load shedding).
//! Work whose caller already timed out is still served (that is how metastable failures
//! hold) unless `drop_expired` is set. The [`Timeline`] changes the server between
//! `start` and `start + duration`: an outage answers every attempt with a fast 503; a
//! partial failure answers a share `p` of attempts with a fast 500; a brownout divides
//! capacity by `1/f` (service times are stretched); a latency spike delays every
//! response by a fixed amount without occupying a worker; an overload multiplies the
//! clients' rate by `f`.
//!
//! # Load control
//!
//! A strategy with a load control (`standard`) gives each client state a
//! `stormguard_core::limit::LoadLimit`, consulted before the breaker as in the standard
//! stack. An attempt past the limit waits for room as long as the limit's
//! `wait_for_room` allows (its `max_wait`, longer while it is learning, never longer
//! than the attempt timeout), as the standard stack's does; a place given back goes to the newest waiter (LIFO); a wait that runs out sheds
//! the attempt, which is never sent and ends its request (the retry machine's
//! `Attempt::Shed`). A
//! served answer is the limit's sample, a timeout its overload signal, a 5xx neither.
//!
//! # Memory
//!
//! Requests and attempts live in slabs whose slots are reused: memory grows with the
//! requests in flight, not with the requests made. Statistics are per virtual second.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderMap, StatusCode};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard_core::breaker::{CircuitState, Outcome, Permit};
use stormguard_core::classify::Rules;
use stormguard_core::limit::{LimitPermit, Load};
use stormguard_core::retry::{self, Decision, Env, Refusal, RequestRetry};
use stormguard_core::{Backoff, Class, Schedule};

use crate::strategy::{
    tower_delay, BackoffKind, BreakerMode, BudgetKind, BudgetState, ClientState, Strategy,
};

const NS: u64 = 1_000_000_000;
/// Latency of a fast error (outage, partial failure, shed).
const FAST_ERROR_NS: u64 = 1_000_000;

/// What the server does during the incident window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scenario {
    /// Nothing happens.
    Healthy,
    /// Every attempt fails fast with a 503.
    Outage,
    /// Each attempt fails fast with a 500 with probability `p`.
    Partial(f64),
    /// Capacity is multiplied by `f` (0 < f <= 1).
    Brownout(f64),
    /// Every response is delayed by this much.
    LatencySpike(Duration),
    /// The clients offer `f` times their rate (f >= 1): demand past capacity, nothing
    /// failing.
    Overload(f64),
}

/// When the [`Scenario`] applies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeline {
    /// The incident.
    pub scenario: Scenario,
    /// Its start, seconds of virtual time.
    pub start: f64,
    /// How long it lasts, seconds.
    pub duration: f64,
}

impl Timeline {
    fn active(&self, t: u64) -> Option<Scenario> {
        let s = t as f64 / NS as f64;
        (s >= self.start && s < self.start + self.duration).then_some(self.scenario)
    }

    /// The end of the incident window, seconds.
    pub fn end(&self) -> f64 {
        self.start + self.duration
    }
}

/// One run of the fleet model.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Number of clients.
    pub clients: usize,
    /// Original requests per second, all clients together (open loop, Poisson).
    pub rate: f64,
    /// Seconds of virtual time during which requests arrive (the run then drains).
    pub seconds: f64,
    /// Seed of every random draw.
    pub seed: u64,
    /// Server workers; `0` means unlimited (no queueing at all).
    pub workers: u32,
    /// Mean service time (exponential).
    pub service: Duration,
    /// Queue bound past the workers.
    pub queue_limit: usize,
    /// Per-attempt timeout.
    pub timeout: Duration,
    /// Drop queued work whose caller has timed out instead of serving it.
    pub drop_expired: bool,
    /// One budget and breaker for the whole fleet instead of one per client.
    pub shared: bool,
    /// The incident.
    pub timeline: Timeline,
    /// Print progress to stderr.
    pub progress: bool,
}

impl FleetConfig {
    /// A healthy fleet of `clients` clients making one request per second each, against
    /// a server with 1.5x that capacity (10 ms mean service), a queue of half a second of
    /// capacity and a 1 s per-attempt timeout.
    pub fn new(clients: usize, seconds: f64, seed: u64) -> Self {
        let rate = clients as f64;
        let service = Duration::from_millis(10);
        let workers = ((rate * 1.5 * service.as_secs_f64()).ceil() as u32).max(1);
        FleetConfig {
            clients,
            rate,
            seconds,
            seed,
            workers,
            service,
            queue_limit: (f64::from(workers) / service.as_secs_f64() * 0.5) as usize,
            timeout: Duration::from_secs(1),
            drop_expired: false,
            shared: false,
            timeline: Timeline {
                scenario: Scenario::Healthy,
                start: 0.0,
                duration: 0.0,
            },
            progress: false,
        }
    }

    /// The server's capacity in requests per second (infinite for unlimited workers).
    pub fn capacity(&self) -> f64 {
        if self.workers == 0 {
            f64::INFINITY
        } else {
            f64::from(self.workers) / self.service.as_secs_f64()
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct FleetReport {
    /// The strategy's name.
    pub strategy: String,
    /// Original requests made.
    pub offered: u64,
    /// Requests that ended in success.
    pub succeeded: u64,
    /// Requests that ended in failure (attempts exhausted, retry refused, circuit open).
    pub failed: u64,
    /// Attempts sent to the server.
    pub attempts: u64,
    /// Attempts that timed out at the client.
    pub timeouts: u64,
    /// Attempts refused by an open circuit (never sent).
    pub rejected: u64,
    /// Attempts the load control shed after their wait for room (never sent, and their
    /// requests not retried).
    pub shed: u64,
    /// Per virtual second: original requests that arrived.
    pub offered_per_s: Vec<u64>,
    /// Per second: of those, how many succeeded (by arrival second).
    pub ok_by_arrival: Vec<u64>,
    /// Per second: attempts sent to the server.
    pub attempts_per_s: Vec<u64>,
    /// Per second: successful responses (goodput, by completion second).
    pub goodput_per_s: Vec<u64>,
    /// Events processed.
    pub events: u64,
    /// Wall-clock time the run took.
    pub wall: Duration,
    /// The most requests in flight at once.
    pub peak_in_flight: usize,
    /// Request and attempt slots the run allocated: slots are reused, so this follows
    /// the requests in flight, not the requests made.
    pub slots: usize,
}

impl FleetReport {
    fn sum(v: &[u64], from: f64, to: f64) -> u64 {
        let (a, b) = (from.max(0.0) as usize, to.max(0.0).ceil() as usize);
        v.iter().take(b).skip(a).sum()
    }

    /// Attempts per original request over seconds `[from, to)`.
    pub fn amplification(&self, from: f64, to: f64) -> f64 {
        let offered = Self::sum(&self.offered_per_s, from, to);
        ratio(Self::sum(&self.attempts_per_s, from, to), offered)
    }

    /// Share of the requests arriving in `[from, to)` that succeeded.
    pub fn success(&self, from: f64, to: f64) -> f64 {
        ratio(
            Self::sum(&self.ok_by_arrival, from, to),
            Self::sum(&self.offered_per_s, from, to),
        )
    }

    /// Successful responses completed between `from` and `to` (whole seconds).
    pub fn goodput(&self, from: f64, to: f64) -> f64 {
        Self::sum(&self.goodput_per_s, from, to) as f64
    }

    /// Seconds after `end` until the success ratio of arriving requests is back to at
    /// least `share` of what it was before `start`, and stays there until `until`.
    /// `None`: never within the run.
    pub fn recovery(&self, start: f64, end: f64, until: f64, share: f64) -> Option<f64> {
        let baseline = if start >= 1.0 {
            self.success(0.0, start)
        } else {
            1.0
        };
        let per_s = |s: usize| ratio(self.ok_by_arrival[s], self.offered_per_s[s]);
        let first = end.ceil() as usize;
        let last = (until as usize).min(self.offered_per_s.len());
        let mut recovered = None;
        for s in first..last {
            if per_s(s) >= share * baseline {
                recovered.get_or_insert(s);
            } else {
                recovered = None;
            }
        }
        recovered.map(|s| (s as f64 - end).max(0.0))
    }

    /// Events processed per second of wall time.
    pub fn events_per_sec(&self) -> f64 {
        self.events as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A worker finished serving attempt (id, generation).
    ServiceDone(u32, u32),
    /// A response (status) reaches the client of attempt (id, generation).
    Response(u32, u32, u16),
    /// Request id makes its next attempt.
    Retry(u32),
    /// A place of client state `.0`'s load control was given back: the newest call
    /// waiting for room there tries again.
    Room(u32),
    /// Request `.0`'s wait for room (token `.1`) is over: shed, unless it found room.
    WaitOver(u32, u64),
}

#[derive(Debug)]
struct Request {
    client: u32,
    arrived_s: u32,
    attempts: u32,
    schedule: Option<Schedule>,
    seed: u64,
    /// What the last retry cost an AWS-style quota.
    spent: u32,
    /// Its retries, decided by stormguard-core's machine (the strategies that are
    /// stormguard's: see [`Fleet::machine`]).
    retry: RequestRetry,
    live: bool,
    /// The token of its wait for room under the load control (0: not waiting).
    waiting: u64,
    /// When that wait began (virtual nanoseconds).
    wait_since: u64,
}

#[derive(Debug)]
struct Attempt {
    req: u32,
    gen: u32,
    outstanding: bool,
    permit: Option<Permit>,
    /// Its place under the load control.
    place: Option<LimitPermit>,
}

/// One simulation run. Build with [`Fleet::new`], run with [`Fleet::run`].
#[derive(Debug)]
pub struct Fleet {
    cfg: FleetConfig,
    strategy: Strategy,
    /// The core backoff of a strategy whose retries stormguard-core's per-request
    /// machine decides ([`RequestRetry`]): one with that backoff and a core budget or
    /// none. The other strategies model other libraries' rules.
    machine: Option<Backoff>,
    rules: Rules,
    now: u64,
    seq: u64,
    /// Arrivals, client choice and request seeds: the same for every strategy.
    arrivals: SmallRng,
    /// Service times and partial failures.
    rng: SmallRng,
    heap: BinaryHeap<Reverse<(u64, u64, Kind)>>,
    timeouts: VecDeque<(u64, u32, u32)>,
    clients: Vec<ClientState>,
    requests: Vec<Request>,
    free_requests: Vec<u32>,
    attempts: Vec<Attempt>,
    free_attempts: Vec<u32>,
    busy: u32,
    queue: VecDeque<(u32, u32)>,
    in_flight: usize,
    /// Per client state: the requests waiting for room under its load control, newest
    /// last.
    waiters: Vec<Vec<u32>>,
    /// Waits begun, the last one's token.
    waits: u64,
    report: FleetReport,
}

impl Fleet {
    /// A fleet ready to run `strategy` under `cfg`.
    pub fn new(cfg: FleetConfig, strategy: Strategy) -> Result<Self, String> {
        if cfg.clients == 0 || cfg.clients > u32::MAX as usize {
            return Err(format!(
                "clients must be between 1 and {}, not {}",
                u32::MAX,
                cfg.clients
            ));
        }
        if !(cfg.rate > 0.0 && cfg.rate.is_finite()) {
            return Err(format!("rate must be positive, not {}", cfg.rate));
        }
        if !(cfg.seconds > 0.0 && cfg.seconds <= 1e6) {
            return Err(format!(
                "seconds must be in (0, 1000000], not {}",
                cfg.seconds
            ));
        }
        let n_states = if cfg.shared { 1 } else { cfg.clients };
        let mut clients = Vec::with_capacity(n_states);
        for i in 0..n_states {
            let seed = crate::strategy::splitmix(cfg.seed ^ (i as u64).wrapping_mul(31));
            clients.push(ClientState::new(&strategy, seed)?);
        }
        let seconds = cfg.seconds.ceil() as usize + 1;
        let report = FleetReport {
            strategy: strategy.name.clone(),
            offered_per_s: vec![0; seconds],
            ok_by_arrival: vec![0; seconds],
            attempts_per_s: vec![0; seconds],
            goodput_per_s: vec![0; seconds],
            ..FleetReport::default()
        };
        let machine = match (strategy.backoff, &strategy.budget) {
            (BackoffKind::Core(backoff), BudgetKind::None | BudgetKind::Core { .. }) => {
                Some(backoff)
            }
            _ => None,
        };
        Ok(Fleet {
            machine,
            arrivals: SmallRng::seed_from_u64(cfg.seed),
            rng: SmallRng::seed_from_u64(crate::strategy::splitmix(cfg.seed ^ 0x5e71_ce00)),
            cfg,
            strategy,
            rules: Rules::default(),
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            timeouts: VecDeque::new(),
            clients,
            requests: Vec::new(),
            free_requests: Vec::new(),
            attempts: Vec::new(),
            free_attempts: Vec::new(),
            busy: 0,
            queue: VecDeque::new(),
            in_flight: 0,
            waiters: (0..n_states).map(|_| Vec::new()).collect(),
            waits: 0,
            report,
        })
    }

    /// Runs to the end: arrivals stop after `seconds`, then every request in flight is
    /// carried to its outcome.
    pub fn run(mut self) -> FleetReport {
        let wall = Instant::now();
        let end = (self.cfg.seconds * NS as f64) as u64;
        let mean_gap = NS as f64 / self.cfg.rate;
        let mut next_arrival = exp(&mut self.arrivals, mean_gap);
        let mut next_progress = NS * 5;
        loop {
            let heap_t = self.heap.peek().map(|Reverse((t, _, _))| *t);
            let timeout_t = self.timeouts.front().map(|(t, _, _)| *t);
            let arrival_t = (next_arrival < end).then_some(next_arrival);
            let Some(t) = [heap_t, timeout_t, arrival_t].into_iter().flatten().min() else {
                break;
            };
            self.now = t;
            self.report.events += 1;
            if self.cfg.progress && t >= next_progress {
                eprint!(
                    "\r  {:<20} {:>5.0} s of {:.0} s virtual, {:>8} in flight ",
                    self.strategy.name,
                    t as f64 / NS as f64,
                    self.cfg.seconds,
                    self.in_flight
                );
                next_progress += NS * 5;
            }
            if arrival_t == Some(t) {
                let gap = match self.cfg.timeline.active(t) {
                    Some(Scenario::Overload(f)) => mean_gap / f.max(1.0),
                    _ => mean_gap,
                };
                next_arrival = t + exp(&mut self.arrivals, gap).max(1);
                self.arrive();
            } else if timeout_t == Some(t) {
                if let Some((_, id, gen)) = self.timeouts.pop_front() {
                    self.resolve(id, gen, None);
                }
            } else if let Some(Reverse((_, _, kind))) = self.heap.pop() {
                match kind {
                    Kind::ServiceDone(id, gen) => self.service_done(id, gen),
                    Kind::Response(id, gen, status) => self.resolve(id, gen, Some(status)),
                    Kind::Retry(req) => self.send(req),
                    Kind::Room(state) => self.room(state),
                    Kind::WaitOver(req, token) => self.wait_over(req, token),
                }
            }
        }
        if self.cfg.progress {
            eprint!("\r{:80}\r", "");
        }
        self.report.wall = wall.elapsed();
        self.report.slots = self.requests.len() + self.attempts.len();
        self.report
    }

    fn exp(&mut self, mean: f64) -> u64 {
        exp(&mut self.rng, mean)
    }

    /// The current virtual second, growing the per-second series while the run drains.
    fn second(&mut self) -> usize {
        let s = (self.now / NS) as usize;
        let r = &mut self.report;
        if s >= r.offered_per_s.len() {
            for v in [
                &mut r.offered_per_s,
                &mut r.ok_by_arrival,
                &mut r.attempts_per_s,
                &mut r.goodput_per_s,
            ] {
                v.resize(s + 1, 0);
            }
        }
        s
    }

    fn push(&mut self, t: u64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, kind)));
    }

    fn state(&mut self, client: u32) -> &mut ClientState {
        let i = self.index(client);
        &mut self.clients[i]
    }

    /// The index of `client`'s state.
    fn index(&self, client: u32) -> usize {
        if self.cfg.shared {
            0
        } else {
            client as usize
        }
    }

    /// A place under the load control of `client`'s state for request `req`'s next
    /// attempt: `Ok(None)` without a load control; `Err(())` when the request waits for
    /// room (or was shed) instead.
    fn place(&mut self, req: u32, client: u32) -> Result<Option<LimitPermit>, ()> {
        let i = self.index(client);
        let state = &self.clients[i];
        let Some(limit) = &state.load else {
            return Ok(None);
        };
        if let Ok(place) = limit.try_acquire(state.instant(self.now)) {
            self.requests[req as usize].waiting = 0;
            return Ok(Some(place));
        }
        let wait = limit
            .wait_for_room(Duration::ZERO, self.cfg.timeout)
            .unwrap_or_default();
        if self.requests[req as usize].waiting != 0 {
            // Woken, and beaten to the place: back to waiting, its deadline unchanged.
            self.waiters[i].push(req);
        } else if wait.is_zero() {
            self.shed(req);
        } else {
            self.waits += 1;
            self.requests[req as usize].waiting = self.waits;
            self.requests[req as usize].wait_since = self.now;
            self.waiters[i].push(req);
            self.push(
                self.now + wait.as_nanos() as u64,
                Kind::WaitOver(req, self.waits),
            );
        }
        Err(())
    }

    /// Gives a place back, with what the attempt's outcome says of the load (`None`:
    /// no sample), and lets the newest waiter try for it.
    fn give_back(&mut self, client: u32, place: LimitPermit, load: Option<Load>) {
        let i = self.index(client);
        match load {
            Some(load) => place.complete(load, self.clients[i].instant(self.now)),
            None => drop(place),
        }
        if !self.waiters[i].is_empty() {
            self.push(self.now, Kind::Room(i as u32));
        }
    }

    /// A place was given back under state `i`'s load control: the newest request still
    /// waiting there tries for it.
    fn room(&mut self, i: u32) {
        if let Some(req) = self.waiters[i as usize].pop() {
            self.send(req);
        }
    }

    /// Request `req`'s wait for room (token `token`) is over: shed, unless it found
    /// room meanwhile (its token is then another wait's, or none).
    fn wait_over(&mut self, req: u32, token: u64) {
        let r = &mut self.requests[req as usize];
        if r.waiting != token {
            return;
        }
        let (client, since) = (r.client, r.wait_since);
        let i = self.index(client);
        let waited = Duration::from_nanos(self.now.saturating_sub(since));
        let more = self.clients[i]
            .load
            .as_ref()
            .and_then(|limit| limit.wait_for_room(waited, self.cfg.timeout));
        if let Some(more) = more {
            // Held back by a limit still learning, not by the dependency: it waits on.
            self.push(
                self.now + more.as_nanos() as u64,
                Kind::WaitOver(req, token),
            );
            return;
        }
        self.requests[req as usize].waiting = 0;
        if let Some(at) = self.waiters[i].iter().rposition(|&w| w == req) {
            self.waiters[i].remove(at);
        }
        self.shed(req);
    }

    /// The load control sheds request `req`'s attempt: never sent, not retried.
    fn shed(&mut self, req: u32) {
        self.report.shed += 1;
        if self.machine.is_some() {
            self.decide(req, retry::Attempt::Shed);
        } else {
            self.finish(req, false);
        }
    }

    fn arrive(&mut self) {
        let client = self.arrivals.random_range(0..self.cfg.clients as u32);
        let seed: u64 = self.arrivals.random();
        let s = self.second();
        self.report.offered += 1;
        self.report.offered_per_s[s] += 1;
        let t = self.now;
        self.state(client).on_request(t);
        let req = Request {
            client,
            arrived_s: s as u32,
            attempts: 0,
            schedule: None,
            seed,
            spent: 0,
            retry: RequestRetry::new(),
            live: true,
            waiting: 0,
            wait_since: 0,
        };
        let id = match self.free_requests.pop() {
            Some(id) => {
                self.requests[id as usize] = req;
                id
            }
            None => {
                self.requests.push(req);
                (self.requests.len() - 1) as u32
            }
        };
        self.in_flight += 1;
        self.report.peak_in_flight = self.report.peak_in_flight.max(self.in_flight);
        self.send(id);
    }

    /// Makes the next attempt of request `req` now: through the load control, then
    /// the breaker, as the standard stack orders them.
    fn send(&mut self, req: u32) {
        let t = self.now;
        let (client, first) = {
            let r = &self.requests[req as usize];
            (r.client, r.attempts == 0)
        };
        let Ok(place) = self.place(req, client) else {
            return;
        };
        let mut permit = None;
        match self.strategy.breaker {
            BreakerMode::Off => {}
            BreakerMode::AllCalls(_) | BreakerMode::RetriesOnly(_) => {
                let retries_only = matches!(self.strategy.breaker, BreakerMode::RetriesOnly(_));
                let state = self.state(client);
                let now = state.instant(t);
                let acquired = state
                    .breaker
                    .as_ref()
                    .map(|b| (b.try_acquire(now), b.config().break_duration()));
                if let Some((acquired, brk)) = acquired {
                    match acquired {
                        Ok(p) => permit = Some(p),
                        // On retries only, a first try goes out anyway, uncounted.
                        Err(_) if retries_only && first => {}
                        Err(rejected) => {
                            self.report.rejected += 1;
                            if let Some(place) = place {
                                self.give_back(client, place, None);
                            }
                            if self.machine.is_some() {
                                let refusal =
                                    (rejected.state != CircuitState::Isolated).then_some(Refusal {
                                        remaining: rejected.remaining,
                                        open_for: rejected.open_for,
                                        failing_for: rejected.failing_for,
                                        break_duration: brk,
                                        state: rejected.state,
                                    });
                                self.decide(req, retry::Attempt::Refused(refusal));
                            } else {
                                self.finish(req, false);
                            }
                            return;
                        }
                    }
                }
            }
        }
        // Only SRE throttling draws here, so the other rows' draws stay as they were.
        let throttled = matches!(self.strategy.budget, BudgetKind::Sre { .. });
        let u: f64 = if throttled { self.rng.random() } else { 1.0 };
        if throttled && !self.state(client).allows_attempt(t, u) {
            // Rejected by the client itself (SRE throttling): as an open circuit.
            self.report.rejected += 1;
            if let Some(place) = place {
                self.give_back(client, place, None);
            }
            self.finish(req, false);
            return;
        }
        self.requests[req as usize].attempts += 1;
        let s = self.second();
        self.report.attempts += 1;
        self.report.attempts_per_s[s] += 1;
        let gen = self.seq as u32;
        let att = Attempt {
            req,
            gen,
            outstanding: true,
            permit,
            place,
        };
        let id = match self.free_attempts.pop() {
            Some(id) => {
                self.attempts[id as usize] = att;
                id
            }
            None => {
                self.attempts.push(att);
                (self.attempts.len() - 1) as u32
            }
        };
        self.seq += 1;
        let deadline = self.now + self.cfg.timeout.as_nanos() as u64;
        self.timeouts.push_back((deadline, id, gen));
        self.server_arrive(id, gen);
    }

    fn server_arrive(&mut self, id: u32, gen: u32) {
        let t = self.now;
        match self.cfg.timeline.active(t) {
            Some(Scenario::Outage) => {
                self.push(t + FAST_ERROR_NS, Kind::Response(id, gen, 503));
                return;
            }
            Some(Scenario::Partial(p)) => {
                let u: f64 = self.rng.random();
                if u < p {
                    self.push(t + FAST_ERROR_NS, Kind::Response(id, gen, 500));
                    return;
                }
            }
            _ => {}
        }
        if self.cfg.workers == 0 || self.busy < self.cfg.workers {
            self.start_service(id, gen);
        } else if self.queue.len() < self.cfg.queue_limit {
            self.queue.push_back((id, gen));
        } else {
            self.push(t + FAST_ERROR_NS, Kind::Response(id, gen, 503));
        }
    }

    fn start_service(&mut self, id: u32, gen: u32) {
        let mut mean = self.cfg.service.as_nanos() as f64;
        if let Some(Scenario::Brownout(f)) = self.cfg.timeline.active(self.now) {
            mean /= f.max(1e-6);
        }
        let d = self.exp(mean);
        self.busy += 1;
        self.push(self.now + d, Kind::ServiceDone(id, gen));
    }

    fn service_done(&mut self, id: u32, gen: u32) {
        self.busy = self.busy.saturating_sub(1);
        match self.cfg.timeline.active(self.now) {
            Some(Scenario::LatencySpike(extra)) => {
                self.push(
                    self.now + extra.as_nanos() as u64,
                    Kind::Response(id, gen, 200),
                );
            }
            _ => self.resolve(id, gen, Some(200)),
        }
        while let Some((qid, qgen)) = self.queue.pop_front() {
            if self.cfg.drop_expired && !self.is_outstanding(qid, qgen) {
                continue;
            }
            self.start_service(qid, qgen);
            break;
        }
    }

    fn is_outstanding(&self, id: u32, gen: u32) -> bool {
        let a = &self.attempts[id as usize];
        a.gen == gen && a.outstanding
    }

    /// The attempt (id, gen) ended: with a response status, or timed out (`None`).
    fn resolve(&mut self, id: u32, gen: u32, status: Option<u16>) {
        if !self.is_outstanding(id, gen) {
            return; // already timed out, or answered: a late response is dropped
        }
        let (req, permit, place) = {
            let a = &mut self.attempts[id as usize];
            a.outstanding = false;
            (a.req, a.permit.take(), a.place.take())
        };
        self.free_attempts.push(id);
        let code = status
            .map(|code| StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR));
        let (class, load) = match code {
            None => {
                self.report.timeouts += 1;
                // A per-attempt timeout on an idempotent request: retryable, and to the
                // load control an overload.
                (Class::Retryable { after: None }, Load::Overloaded)
            }
            Some(code) => {
                let wall = SystemTime::UNIX_EPOCH + Duration::from_nanos(self.now);
                let headers = HeaderMap::new();
                (
                    self.rules.classify_with(code, &headers, || wall),
                    Load::of_response(code, &headers),
                )
            }
        };
        let success = class == Class::Success;
        let client = self.requests[req as usize].client;
        if let Some(place) = place {
            self.give_back(client, place, Some(load));
        }
        let t = self.now;
        let state = self.state(client);
        let now = state.instant(t);
        if let (Some(p), Some(b)) = (permit, &state.breaker) {
            let outcome = match class {
                Class::Success => Outcome::Success,
                Class::Permanent => Outcome::Ignored,
                _ => Outcome::Failure,
            };
            b.record(p, outcome, now);
        }
        state.on_attempt(t, success);
        if self.machine.is_some() {
            let attempt = match status {
                None => retry::Attempt::MaybeProcessed { timed_out: true },
                Some(_) => retry::Attempt::Answered {
                    throttled: false,
                    class,
                    any_method: false,
                },
            };
            self.decide(req, attempt);
            return;
        }
        if success {
            let spent = self.requests[req as usize].spent;
            self.state(client).on_success(spent);
            self.finish(req, true);
            return;
        }
        let after = match class {
            Class::Retryable { after } => after,
            _ => {
                self.finish(req, false);
                return;
            }
        };
        let timed_out = status.is_none();
        let retry = if self.requests[req as usize].attempts >= self.strategy.attempts {
            None
        } else {
            let retries = self.requests[req as usize].attempts - 1;
            self.state(client).try_retry(t, retries, timed_out)
        };
        if timed_out {
            // Charged once its own retry is decided, whatever was decided, as the retry
            // layer does.
            self.state(client).on_timeout(t);
        }
        match retry {
            Some(spent) => self.requests[req as usize].spent = spent,
            None => {
                self.finish(req, false);
                return;
            }
        }
        let delay = self.delay(req).max(after.unwrap_or_default());
        self.push(self.now + delay.as_nanos() as u64, Kind::Retry(req));
    }

    /// Tells request `req`'s machine what became of its call, and does what it says.
    fn decide(&mut self, req: u32, attempt: retry::Attempt) {
        let Some(backoff) = self.machine else {
            return;
        };
        let r = &mut self.requests[req as usize];
        let seed = r.seed;
        let i = if self.cfg.shared {
            0
        } else {
            r.client as usize
        };
        let state = &self.clients[i];
        let budget = match &state.budget {
            BudgetState::Core(budget) => Some(budget),
            _ => None,
        };
        let mut seed = || Some(seed);
        let mut env = Env {
            now: state.instant(self.now),
            budget,
            throttle: None,
            pace: None,
            max_retry_after: Duration::from_secs(20),
            deadline: None,
            seed: Some(&mut seed),
        };
        let request = retry::Request::new(self.strategy.attempts, backoff);
        match r.retry.decide(&mut env, &request, attempt).decision {
            Decision::Done { give_up, .. } => self.finish(req, give_up.is_none()),
            Decision::Transparent { .. } => self.push(self.now, Kind::Retry(req)),
            Decision::Refused { delay, .. } | Decision::Retry { delay, .. } => {
                self.push(self.now + delay.as_nanos() as u64, Kind::Retry(req));
            }
        }
    }

    fn delay(&mut self, req: u32) -> Duration {
        let tower_seed = {
            let client = self.requests[req as usize].client;
            self.state(client).tower_seed
        };
        let r = &mut self.requests[req as usize];
        let retry = r.attempts.saturating_sub(1);
        match self.strategy.backoff {
            BackoffKind::Fixed(d) => d,
            BackoffKind::Tower { min, max, jitter } => {
                tower_delay(min, max, jitter, tower_seed, retry)
            }
            BackoffKind::Core(b) => {
                let seed = r.seed;
                r.schedule
                    .get_or_insert_with(|| b.schedule_seeded(seed))
                    .next()
                    .unwrap_or_default()
            }
        }
    }

    fn finish(&mut self, req: u32, ok: bool) {
        let r = &mut self.requests[req as usize];
        if !r.live {
            return;
        }
        r.live = false;
        r.schedule = None;
        let (client, retries) = (r.client, r.attempts.saturating_sub(1));
        let arrived = r.arrived_s as usize;
        // The retries that failed are wasted: all of an unserved request's, all but the
        // last of a served one's.
        let wasted = if ok {
            retries.saturating_sub(1)
        } else {
            retries
        };
        // The machine settles its requests with the budget itself.
        if wasted > 0 && self.machine.is_none() {
            let t = self.now;
            self.state(client).on_wasted(t, wasted);
        }
        if ok {
            self.report.succeeded += 1;
            self.report.ok_by_arrival[arrived] += 1;
            let s = self.second();
            self.report.goodput_per_s[s] += 1;
        } else {
            self.report.failed += 1;
        }
        self.in_flight -= 1;
        self.free_requests.push(req);
    }
}

/// An exponentially distributed number of nanoseconds with this mean.
fn exp(rng: &mut SmallRng, mean: f64) -> u64 {
    let u: f64 = rng.random();
    (-(1.0 - u).ln() * mean) as u64
}

/// Runs `strategy` under `cfg`.
pub fn run(cfg: &FleetConfig, strategy: &Strategy) -> Result<FleetReport, String> {
    Ok(Fleet::new(cfg.clone(), strategy.clone())?.run())
}
