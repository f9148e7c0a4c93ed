//! Let the broker hold the backoff: a queue consumer without tower.
//!
//! Sleeping inside a worker holds the lease, the thread and the connection for the whole
//! backoff. A queue consumer does better to hand the message back with a delay and let
//! the broker redeliver it (SQS visibility timeout, a redelivery delay). The receive
//! count is the attempt number, and the broker's maximum receive count bounds the
//! attempts without a counter of our own.
//!
//! This example runs a tiny in-memory broker on virtual time. Each message's handler
//! answers with an HTTP status, as a downstream call would. stormguard's rules classify
//! it and the core's [`Redelivery`] decides: success deletes the message, a permanent
//! failure is dead-lettered at once with its reason, a transient one is redelivered after
//! a full-jitter delay rounded up to whole seconds, and the last receive allowed
//! dead-letters it. `examples/nats_worker` does the same against a real broker.
//!
//! `cargo run --example queue_redelivery`

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use stormguard::sans_io::classify::Rules;
use stormguard::sans_io::redelivery::{Decision, Redelivery};
use stormguard::{Backoff, Jitter};

/// The broker's redrive policy: after this many receives a message is dead-lettered.
const MAX_RECEIVE_COUNT: u32 = 5;

/// A queued job and the statuses its handler will answer, one per delivery.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Message {
    id: &'static str,
    receive_count: u32,
    outcomes: Vec<u16>,
}

fn main() -> Result<(), stormguard::ConfigError> {
    // Seconds, not milliseconds: 2 s base, 15 min cap, as a broker-held backoff would use.
    let backoff = Backoff::new(
        Duration::from_secs(2),
        Duration::from_secs(900),
        Jitter::Full,
    )?;
    // Brokers count visibility timeouts in whole seconds: round up, never down.
    let redelivery = Redelivery::builder()
        .backoff(backoff)
        .max_deliveries(MAX_RECEIVE_COUNT)
        .resolution(Duration::from_secs(1))
        .build()?;
    let rules = Rules::default();
    let mut rng = SmallRng::seed_from_u64(7);

    let messages = [
        ("receipt-1", vec![200]),
        ("receipt-2", vec![503, 503, 200]),
        ("receipt-3", vec![400]),
        ("receipt-4", vec![502, 429, 504, 500, 503]),
        ("receipt-5", vec![500, 404]),
    ];
    // The broker: messages ordered by the virtual second they become visible.
    let mut queue: BinaryHeap<Reverse<(u64, Message)>> = messages
        .into_iter()
        .map(|(id, outcomes)| {
            let message = Message {
                id,
                receive_count: 0,
                outcomes,
            };
            Reverse((0, message))
        })
        .collect();
    let (mut deleted, mut dead) = (0, 0);

    // Bounded: every message is received at most MAX_RECEIVE_COUNT times.
    while let Some(Reverse((now, mut message))) = queue.pop() {
        message.receive_count += 1;
        let index = (message.receive_count - 1) as usize;
        let status = message.outcomes.get(index).copied().unwrap_or(200);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let class = rules.classify(status, &HeaderMap::new(), SystemTime::UNIX_EPOCH);
        let verdict = redelivery.decide(class, message.receive_count, &mut rng);
        let shown = status.to_string();
        print!(
            "t={now:>4}s  {:<10} receive #{}  {shown:<26} ",
            message.id, message.receive_count
        );
        match verdict {
            Decision::Ack => {
                deleted += 1;
                println!("-> deleted");
            }
            Decision::DeadLetter(reason) => {
                dead += 1;
                println!("-> dead-letter ({reason}: {status})");
            }
            Decision::RetryAfter(delay) => {
                println!(
                    "-> back to the broker, visible again in {}s",
                    delay.as_secs()
                );
                queue.push(Reverse((now + delay.as_secs(), message)));
            }
        }
    }
    println!("\n{deleted} processed, {dead} dead-lettered with their reasons; no worker slept.");
    Ok(())
}
