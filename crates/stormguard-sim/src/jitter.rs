//! Brooker 2015, "Exponential Backoff And Jitter" (AWS Architecture Blog): contention
//! on one optimistic-concurrency row.
//!
//! The model is the one the article describes and its public simulator implements: N
//! clients start together, each wanting to make one write to one shared row. A client
//! reads the row's version, then writes conditioned on that version; the write succeeds
//! only if no other write landed in between (the version is unchanged), otherwise the
//! client backs off and starts again with a read. Every message crosses a network whose
//! one-way delay is `|Normal(10 ms, 2 ms)|`. The backoff before retry `n` (1 for the first
//! retry) uses base 5 ms and cap 2 s, as in the article's simulator:
//!
//! | strategy | delay |
//! |---|---|
//! | `none` | 0 |
//! | `exponential` | `min(cap, base * 2^n)` |
//! | `equal` | half that plus `U[0, half)` |
//! | `full` | `U[0, min(cap, base * 2^n))` |
//! | `decorrelated` | `U[base, min(cap, 3 * previous)]`, `previous` starting at base |
//!
//! The four backoffs are stormguard-core's own [`Backoff`] with [`Jitter::None`],
//! [`Jitter::Equal`], [`Jitter::Full`] and [`Jitter::Decorrelated`], asked through
//! [`Backoff::delay`] with retry index `n` (the article's simulator counts from 1, so its
//! first backoff ceiling is 10 ms). "Calls" counts writes; "completion" is the time the
//! last client learns its write succeeded.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard_core::{Backoff, Jitter};

/// The strategies, in the order of the article's figures.
pub const STRATEGIES: [&str; 5] = ["none", "exponential", "equal", "full", "decorrelated"];

/// The backoff base of the article's simulator.
pub const BASE: Duration = Duration::from_millis(5);
/// The backoff cap of the article's simulator.
pub const CAP: Duration = Duration::from_millis(2000);

/// The published figures at 100 clients (the public simulator, seed 12345): strategy,
/// calls, completion in ms (none: not published).
pub const PUBLISHED_100: [(&str, u64, Option<f64>); 5] = [
    ("none", 2427, None),
    ("exponential", 1857, Some(63_700.0)),
    ("equal", 810, Some(6_500.0)),
    ("full", 795, Some(4_900.0)),
    ("decorrelated", 1003, Some(4_500.0)),
];

/// The mean result over several runs at one client count.
#[derive(Debug, Clone, PartialEq)]
pub struct JitterResult {
    /// The strategy.
    pub strategy: &'static str,
    /// Clients contending.
    pub clients: u32,
    /// Mean writes per run.
    pub calls: f64,
    /// Mean time until the last write succeeded, ms.
    pub completion_ms: f64,
    /// Events processed over all runs.
    pub events: u64,
}

fn backoff_for(strategy: &str) -> Option<Backoff> {
    let jitter = match strategy {
        "exponential" => Jitter::None,
        "equal" => Jitter::Equal,
        "full" => Jitter::Full,
        "decorrelated" => Jitter::Decorrelated,
        _ => return None,
    };
    Backoff::new(BASE, CAP, jitter).ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Msg {
    /// The server gets a read.
    Read,
    /// The client gets the version.
    ReadReply(u64),
    /// The server gets a write made against this version.
    Write(u64),
    /// The client learns whether its write succeeded.
    WriteReply(bool),
}

#[derive(Debug, Clone, Copy)]
struct Client {
    retries: u32,
    previous: Duration,
}

/// One run with `clients` clients; returns (writes, completion time in ns, events).
pub fn run_once(strategy: &str, clients: u32, seed: u64) -> (u64, u64, u64) {
    let backoff = backoff_for(strategy);
    let mut rng = SmallRng::seed_from_u64(seed);
    let net = move |rng: &mut SmallRng| -> u64 {
        // |Normal(10 ms, 2 ms)| by Box-Muller.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        ((10.0 + 2.0 * z).abs() * 1e6) as u64
    };
    let mut queue = BinaryHeap::new();
    let mut seq = 0u64;
    let mut state = vec![
        Client {
            retries: 0,
            previous: BASE,
        };
        clients as usize
    ];
    for c in 0..clients {
        seq += 1;
        queue.push(Reverse((net(&mut rng), seq, c, Msg::Read)));
    }
    let (mut version, mut writes, mut now, mut events) = (0u64, 0u64, 0u64, 0u64);
    while let Some(Reverse((t, _, c, msg))) = queue.pop() {
        now = t;
        events += 1;
        let next = match msg {
            Msg::Read => Some(Msg::ReadReply(version)),
            Msg::ReadReply(v) => Some(Msg::Write(v)),
            Msg::Write(v) => {
                writes += 1;
                let ok = v == version;
                if ok {
                    version += 1;
                }
                Some(Msg::WriteReply(ok))
            }
            Msg::WriteReply(true) => None,
            Msg::WriteReply(false) => {
                let client = &mut state[c as usize];
                client.retries += 1;
                let wait = match backoff {
                    Some(b) => b.delay(client.retries, client.previous, &mut rng),
                    None => Duration::ZERO,
                };
                client.previous = wait;
                // The read goes out after the backoff and takes its network delay.
                seq += 1;
                let at = t + wait.as_nanos() as u64 + net(&mut rng);
                queue.push(Reverse((at, seq, c, Msg::Read)));
                None
            }
        };
        if let Some(m) = next {
            seq += 1;
            queue.push(Reverse((t + net(&mut rng), seq, c, m)));
        }
    }
    (writes, now, events)
}

/// The mean over `runs` runs (seeds `seed`, `seed + 1`, ...) of `strategy` at `clients`.
pub fn mean(strategy: &'static str, clients: u32, runs: u32, seed: u64) -> JitterResult {
    let runs = runs.max(1);
    let (mut calls, mut time, mut events) = (0u64, 0u64, 0u64);
    for r in 0..runs {
        let (w, t, e) = run_once(strategy, clients, seed.wrapping_add(u64::from(r)));
        calls += w;
        time += t;
        events += e;
    }
    JitterResult {
        strategy,
        clients,
        calls: calls as f64 / f64::from(runs),
        completion_ms: time as f64 / f64::from(runs) / 1e6,
        events,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_writes_once() {
        for s in STRATEGIES {
            let (writes, t, _) = run_once(s, 1, 1);
            assert_eq!(writes, 1, "{s}");
            // Four network hops of about 10 ms.
            assert!(t > 20_000_000 && t < 60_000_000, "{s}: {t}");
        }
    }

    #[test]
    fn every_client_eventually_writes_and_runs_repeat() {
        for s in STRATEGIES {
            let (writes, _, _) = run_once(s, 20, 3);
            assert!(writes >= 20, "{s}");
            assert_eq!(run_once(s, 20, 3), run_once(s, 20, 3));
        }
    }

    #[test]
    fn jitter_beats_plain_exponential_at_fifty_clients() {
        let exp = mean("exponential", 50, 5, 12345);
        let full = mean("full", 50, 5, 12345);
        let none = mean("none", 50, 5, 12345);
        assert!(full.calls < exp.calls, "{full:?} vs {exp:?}");
        assert!(
            full.completion_ms < exp.completion_ms,
            "{full:?} vs {exp:?}"
        );
        assert!(exp.calls < none.calls, "{exp:?} vs {none:?}");
    }
}
