//! Broker-held backoff against a real NATS JetStream server.
//!
//! Each test starts its own `nats-server -js` on 127.0.0.1 (a free port, a temporary
//! store) and kills it at the end, also when the test fails. They are `#[ignore]`d, so
//! that `cargo test --workspace --all-features` passes on a machine with only a Rust
//! toolchain (libtest has no run-time skip, and a test returning early would print
//! "ok" for nothing). Run them with `cargo test --test nats -- --ignored`, with
//! `nats-server` on PATH (Debian's package `nats-server`); .ci/run installs it and does.
//! The worker is the `nats_worker` example's own.

#[path = "../examples/nats_worker/worker.rs"]
mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use http::StatusCode;
use stormguard::sans_io::redelivery::{Decision, Reason, Redelivery};
use stormguard::{Backoff, Jitter};
use worker::{BoxError, Delivery, Job, Kind, NatsServer, Summary};

/// How late the broker may redeliver past the delay the worker asked for, as seen on
/// the worker's clock: the server's redelivery timer, the trip to the worker, and the
/// worker reaching the message behind those already buffered, on a shared CI machine.
/// Far below [`worker::ACK_WAIT`] (10 s), so a redelivery by ack timeout instead of by
/// the `Nak`'s delay still fails.
const SLACK: Duration = Duration::from_secs(2);

/// Every test is over within this, passing or not.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

fn redelivery(max_deliveries: u32) -> Result<Redelivery, BoxError> {
    let backoff = Backoff::new(
        Duration::from_millis(50),
        Duration::from_secs(5),
        Jitter::Full,
    )?;
    Ok(Redelivery::builder()
        .backoff(backoff)
        .max_deliveries(max_deliveries)
        .build()?)
}

/// The run: a server, the streams, the jobs published, the worker until every job
/// ended; then the broker's dead-letter stream and what is left in the work queue.
async fn run(
    jobs: &[Job],
    redelivery: &Redelivery,
) -> Result<(Vec<Delivery>, Vec<worker::DeadLetter>, u64), BoxError> {
    let server = NatsServer::start().await?;
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await?);
    worker::set_up(&js, redelivery).await?;
    worker::publish(&js, jobs).await?;
    let deliveries = worker::run_worker(&js, redelivery, jobs.len(), TEST_TIMEOUT / 2).await?;
    let letters = worker::dead_letters(&js).await?;
    let left = worker::left_in_queue(&js).await?;
    drop(server);
    Ok((deliveries, letters, left))
}

fn by_job(deliveries: &[Delivery]) -> BTreeMap<&str, Vec<&Delivery>> {
    let mut map: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
    for d in deliveries {
        map.entry(d.job.as_str()).or_default().push(d);
    }
    map
}

/// Each redelivery came no sooner than the delay the worker asked for, no later than
/// that plus [`SLACK`], and the delay was under the full-jitter ceiling for the
/// delivery count. Returns the delays asked for.
fn check_gaps(redelivery: &Redelivery, deliveries: &[&Delivery]) -> Vec<Duration> {
    let mut delays = Vec::new();
    for pair in deliveries.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        assert_eq!(after.count, before.count + 1, "{before:?} then {after:?}");
        let Decision::RetryAfter(delay) = before.decision else {
            panic!("redelivered without a retry decision: {before:?}");
        };
        assert!(
            delay < redelivery.ceiling(before.count),
            "{delay:?} for delivery {} is over the ceiling {:?}",
            before.count,
            redelivery.ceiling(before.count)
        );
        let gap = after.received.duration_since(before.received);
        assert!(
            gap >= delay,
            "{}: redelivered after {gap:?}, sooner than the {delay:?} asked",
            before.job
        );
        assert!(
            gap <= delay + SLACK,
            "{}: redelivered after {gap:?}, the delay asked was {delay:?}",
            before.job
        );
        delays.push(delay);
    }
    delays
}

#[tokio::test]
#[ignore = "needs nats-server on PATH: cargo test --test nats -- --ignored"]
async fn every_job_ends_once_acked_or_dead_lettered_with_its_reason() -> Result<(), BoxError> {
    let jobs = worker::mix(100);
    let redelivery = redelivery(5)?;
    let (deliveries, letters, left) =
        tokio::time::timeout(TEST_TIMEOUT, run(&jobs, &redelivery)).await??;

    let summary = Summary::new(&jobs, &deliveries, &letters);
    assert_eq!(
        summary.to_string(),
        "80 acked, 20 dead-lettered, 0 lost, 0 processed twice"
    );
    assert_eq!(left, 0, "messages neither acknowledged nor terminated");

    let seen = by_job(&deliveries);
    let mut first_retry_delays = Vec::new();
    for job in &jobs {
        let mine = seen.get(job.id.as_str()).cloned().unwrap_or_default();
        let outcomes: Vec<(u32, StatusCode, Decision)> = mine
            .iter()
            .map(|d| (d.count, d.status, d.decision))
            .collect();
        match job.kind {
            Kind::Good => assert_eq!(outcomes, [(1, StatusCode::OK, Decision::Ack)], "{}", job.id),
            Kind::Bad => assert_eq!(
                outcomes,
                [(
                    1,
                    StatusCode::BAD_REQUEST,
                    Decision::DeadLetter(Reason::Permanent)
                )],
                "{}",
                job.id
            ),
            Kind::Flaky => {
                let shape: Vec<_> = outcomes
                    .iter()
                    .map(|(n, s, d)| (*n, *s, matches!(d, Decision::RetryAfter(_))))
                    .collect();
                let unavailable = StatusCode::SERVICE_UNAVAILABLE;
                assert_eq!(
                    shape,
                    [
                        (1, unavailable, true),
                        (2, unavailable, true),
                        (3, StatusCode::OK, false)
                    ],
                    "{}",
                    job.id
                );
                assert_eq!(outcomes[2].2, Decision::Ack);
                first_retry_delays.push(check_gaps(&redelivery, &mine)[0]);
            }
            Kind::Down => unreachable!("not in the mix"),
        }
    }
    // Jitter spreads the 30 messages that failed together: no two wait the same.
    let distinct: BTreeSet<_> = first_retry_delays.iter().collect();
    assert_eq!(distinct.len(), 30, "{first_retry_delays:?}");

    // The broker's dead-letter stream: each bad job once, with its reason.
    let bad: BTreeSet<&str> = jobs
        .iter()
        .filter(|j| j.kind == Kind::Bad)
        .map(|j| j.id.as_str())
        .collect();
    let dead: BTreeSet<&str> = letters.iter().map(|l| l.job.as_str()).collect();
    assert_eq!(letters.len(), 20);
    assert_eq!(dead, bad);
    for letter in &letters {
        assert_eq!(
            (
                letter.reason.as_str(),
                letter.detail.as_str(),
                letter.deliveries.as_str()
            ),
            ("permanent", "permanent failure: 400 Bad Request", "1"),
            "{letter:?}"
        );
    }
    Ok(())
}

#[tokio::test]
#[ignore = "needs nats-server on PATH: cargo test --test nats -- --ignored"]
async fn a_failure_that_never_clears_is_dead_lettered_on_the_last_delivery() -> Result<(), BoxError>
{
    let jobs: Vec<Job> = (0..5)
        .map(|i| Job {
            id: format!("down-{i}"),
            kind: Kind::Down,
        })
        .collect();
    let redelivery = redelivery(4)?;
    let (deliveries, letters, left) =
        tokio::time::timeout(TEST_TIMEOUT, run(&jobs, &redelivery)).await??;

    assert_eq!(left, 0);
    for (job, mine) in by_job(&deliveries) {
        let counts: Vec<u32> = mine.iter().map(|d| d.count).collect();
        assert_eq!(counts, [1, 2, 3, 4], "{job}");
        check_gaps(&redelivery, &mine);
        assert_eq!(
            mine[3].decision,
            Decision::DeadLetter(Reason::Exhausted { deliveries: 4 })
        );
    }
    assert_eq!(by_job(&deliveries).len(), 5);
    assert_eq!(letters.len(), 5);
    for letter in &letters {
        assert_eq!(
            (
                letter.reason.as_str(),
                letter.detail.as_str(),
                letter.deliveries.as_str()
            ),
            (
                "exhausted",
                "still failing after 4 deliveries: 503 Service Unavailable",
                "4"
            ),
            "{letter:?}"
        );
    }
    Ok(())
}
