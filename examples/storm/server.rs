//! The dependency: a server on 127.0.0.1 with finite capacity and a bounded queue.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use stormguard::BoxError;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::scenario::{Fault, Phases, Scenario};
use crate::{BROWNOUT_SLOWDOWN, BUCKET};

/// The server's model and its counters.
#[derive(Debug)]
pub(crate) struct Dependency {
    pub(crate) start: Instant,
    pub(crate) phases: Phases,
    pub(crate) fault: Fault,
    pub(crate) service_time: Duration,
    /// Requests in the building: waiting for a worker or being served.
    pub(crate) admitted: AtomicUsize,
    pub(crate) max_admitted: usize,
    pub(crate) workers: Semaphore,
    /// Attempts that reached the server, per [`BUCKET`] since `start`.
    pub(crate) attempts: Vec<AtomicU64>,
    /// Requests the workers served (a 200), per [`BUCKET`] of their completion.
    pub(crate) served: Vec<AtomicU64>,
    /// The partial outage's random draws: a counter through a mixing function.
    pub(crate) draws: AtomicU64,
    pub(crate) seed: u64,
}

impl Dependency {
    pub(crate) fn new(scenario: &Scenario, start: Instant) -> Self {
        // Room for the drain after the last request starts.
        let span = scenario.phases.end + scenario.request_deadline + Duration::from_secs(1);
        let buckets = (span.as_millis() / BUCKET.as_millis()) as usize;
        Dependency {
            start,
            phases: scenario.phases,
            fault: scenario.fault,
            service_time: scenario.service_time,
            admitted: AtomicUsize::new(0),
            max_admitted: scenario.workers + scenario.queue,
            workers: Semaphore::new(scenario.workers),
            attempts: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
            served: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
            draws: AtomicU64::new(0),
            seed: scenario.seed,
        }
    }

    /// A uniform draw in [0, 1) for the partial outage.
    pub(crate) fn draw(&self) -> f64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let x = splitmix64(self.seed ^ 0x5EED_0FFA_1100 ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Answers one request: 503 at once when the window's fault says so or when the
    /// queue is full, otherwise 200 after waiting for a worker and doing the work.
    pub(crate) async fn serve(self: Arc<Self>) -> StatusCode {
        let now = self.start.elapsed();
        let bucket = (now.as_millis() / BUCKET.as_millis()) as usize;
        // Attempts after the last bucket (a straggler of the drain) count in the last.
        if let Some(count) = self.attempts.get(bucket).or(self.attempts.last()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if self.phases.failing(self.fault, now) {
            match self.fault {
                Fault::Outage | Fault::Blip => return StatusCode::SERVICE_UNAVAILABLE,
                Fault::Partial(ratio) if self.draw() < ratio => {
                    return StatusCode::SERVICE_UNAVAILABLE
                }
                Fault::Partial(_) | Fault::Brownout | Fault::Overload => {}
            }
        }
        if self.admitted.fetch_add(1, Ordering::AcqRel) >= self.max_admitted {
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        // The work runs in its own task: a client that times out and hangs up does not
        // cancel it, as in most servers. That wasted work is what keeps a storm going.
        let work = tokio::spawn(async move {
            let served = match self.workers.acquire().await {
                Ok(_worker) => {
                    let brownout = self.fault == Fault::Brownout
                        && self.phases.in_window(self.start.elapsed());
                    let work = if brownout {
                        self.service_time.mul_f64(BROWNOUT_SLOWDOWN)
                    } else {
                        self.service_time
                    };
                    tokio::time::sleep(work).await;
                    let done = self.start.elapsed().as_millis() / BUCKET.as_millis();
                    let bucket = usize::try_from(done).unwrap_or(usize::MAX);
                    if let Some(count) = self.served.get(bucket).or(self.served.last()) {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                    true
                }
                // Closed at the end of the run: drop the queued work.
                Err(_closed) => false,
            };
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            served
        });
        match work.await {
            Ok(true) => StatusCode::OK,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Attempts in the buckets that start in `[from, to)`.
    pub(crate) fn attempts_between(&self, from: Duration, to: Duration) -> u64 {
        self.buckets(from, to).iter().sum()
    }

    /// The attempt counts of the buckets that start in `[from, to)`.
    pub(crate) fn buckets(&self, from: Duration, to: Duration) -> Vec<u64> {
        let index = |at: Duration| {
            usize::try_from(at.as_millis() / BUCKET.as_millis()).unwrap_or(usize::MAX)
        };
        let (first, last) = (index(from), index(to));
        self.attempts
            .iter()
            .take(last)
            .skip(first)
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    /// Requests served in the buckets that start in `[from, to)`.
    pub(crate) fn served_between(&self, from: Duration, to: Duration) -> u64 {
        let index = |at: Duration| {
            usize::try_from(at.as_millis() / BUCKET.as_millis()).unwrap_or(usize::MAX)
        };
        self.served
            .iter()
            .take(index(to))
            .skip(index(from))
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }

    pub(crate) fn total_attempts(&self) -> u64 {
        self.attempts
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }
}

/// Steele, Lea and Flood's SplitMix64 finaliser: a well-mixed 64-bit value from any input.
pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Starts the server on an ephemeral port of 127.0.0.1. Aborting the returned task stops
/// it accepting and drops (aborts) every connection it is serving.
pub(crate) async fn start_server(
    dependency: Arc<Dependency>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accept = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            // Reap finished connections so the set stays as large as the open ones.
            while connections.try_join_next().is_some() {}
            let Ok((stream, _)) = listener.accept().await else {
                // Out of file descriptors, most likely: let some connections close.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let dependency = dependency.clone();
            let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let dependency = dependency.clone();
                async move {
                    let status = dependency.serve().await;
                    let mut response = Response::new(Full::new(Bytes::new()));
                    *response.status_mut() = status;
                    Ok::<_, Infallible>(response)
                }
            });
            connections.spawn(async move {
                // A client hanging up mid-request is part of the scenario, not an error.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((addr, accept))
}
