//! Let the broker hold the backoff: a NATS JetStream worker.
//!
//! A worker that sleeps through a backoff holds the message, a task and a connection for
//! the whole wait. This one never sleeps. Per message it runs the handler, classifies
//! the handler's HTTP status with stormguard's rules and lets the core's
//! [`Redelivery`](stormguard::sans_io::redelivery::Redelivery) decide:
//!
//! - success: `Ack`;
//! - transient failure: `Nak` with a delay, full jitter under `base * 2^(n-1)` for the
//!   message's `n`-th delivery (the broker's delivery count, from the message's info);
//!   the broker holds the message and delivers it again after the delay;
//! - permanent failure, or a transient one on the last delivery allowed: publish it to a
//!   dead-letter stream with the reason in headers, then `Term` it. The consumer's
//!   `max_deliver` is the same limit, as a backstop.
//!
//! The example starts its own `nats-server -js` (the Debian package `nats-server`) on
//! 127.0.0.1 with a temporary store, runs 100 jobs (20% permanently bad, 30% failing
//! twice before they succeed) and stops the server.
//!
//! `cargo run --example nats_worker`

mod worker;

use std::time::Duration;

use stormguard::sans_io::redelivery::{Decision, Redelivery};
use stormguard::{Backoff, Jitter};
use worker::{BoxError, Summary};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // A 50 ms base keeps the run to about a second; a real worker would use seconds.
    let backoff = Backoff::new(
        Duration::from_millis(50),
        Duration::from_secs(5),
        Jitter::Full,
    )?;
    let redelivery = Redelivery::builder()
        .backoff(backoff)
        .max_deliveries(5)
        .build()?;

    let server = worker::NatsServer::start().await?;
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await?);
    worker::set_up(&js, &redelivery).await?;
    let jobs = worker::mix(100);
    worker::publish(&js, &jobs).await?;

    let deliveries =
        worker::run_worker(&js, &redelivery, jobs.len(), Duration::from_secs(60)).await?;
    let letters = worker::dead_letters(&js).await?;
    let naks = deliveries
        .iter()
        .filter(|d| matches!(d.decision, Decision::RetryAfter(_)))
        .count();
    println!(
        "{} jobs, {} deliveries ({naks} handed back with a delay), {} left in the queue",
        jobs.len(),
        deliveries.len(),
        worker::left_in_queue(&js).await?
    );
    println!("{}", Summary::new(&jobs, &deliveries, &letters));
    drop(server);
    Ok(())
}
