//! The fleet: clients at a fixed arrival rate, one run per strategy and scenario.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::load::Shed;
use stormguard::BoxError;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::report::Report;
use crate::scenario::Scenario;
use crate::server::{start_server, Dependency};
use crate::strategy::{client_seed, Counters, Kind, Strategy};
use crate::Stack;

/// What happened to one request, as its caller saw it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outcome {
    /// When it was started, from the start of the run.
    pub(crate) started: Duration,
    pub(crate) latency: Duration,
    pub(crate) ok: bool,
    /// Failed with the load control's `Shed`: never sent.
    pub(crate) shed: bool,
}

/// Runs one strategy against a fresh server, stops the server, and reports.
pub(crate) async fn run_strategy(kind: Kind, scenario: &Scenario) -> Result<Report, BoxError> {
    // One state for the whole fleet, or one per client.
    let states = if scenario.own_state {
        (0..scenario.clients)
            .map(|index| Strategy::new(kind, client_seed(scenario.seed, index)))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![Strategy::new(kind, scenario.seed)?]
    };
    // A little lead so every client and the server share one start.
    let start = Instant::now() + Duration::from_millis(50);
    let dependency = Arc::new(Dependency::new(scenario, start));
    let (addr, server) = start_server(dependency.clone()).await?;
    let uri: Uri = format!("http://{addr}/").parse()?;

    let mut fleet = JoinSet::new();
    for index in 0..scenario.clients {
        let client = Client::builder(TokioExecutor::new()).build_http();
        let state = &states[index as usize % states.len()];
        fleet.spawn(run_client(
            index,
            state.stack(client, scenario),
            uri.clone(),
            scenario.clone(),
            start,
        ));
    }
    let mut outcomes = Vec::new();
    let mut failure = None;
    while let Some(client) = fleet.join_next().await {
        match client {
            Ok(client) => outcomes.extend(client),
            Err(err) => failure = Some(err),
        }
    }
    // Nothing outlives the run: the accept loop and its connections are aborted, and
    // work still queued at the server is dropped.
    server.abort();
    let _ = server.await;
    dependency.workers.close();
    if let Some(err) = failure {
        return Err(err.into());
    }
    let mut counters = Counters::default();
    for state in &states {
        state.add_counters(&mut counters);
    }
    Ok(Report::new(
        kind,
        &outcomes,
        &dependency,
        scenario,
        counters,
    ))
}

/// One client: starts a request every `1 / rate` seconds until the schedule ends, each
/// in its own task, never waiting for earlier ones (an open loop), then collects them.
pub(crate) async fn run_client(
    index: u32,
    stack: Stack,
    uri: Uri,
    scenario: Scenario,
    start: Instant,
) -> Vec<Outcome> {
    let period = |at: Duration| Duration::from_secs_f64(1.0 / scenario.rate_at(at));
    // Clients are spread evenly over one period, not in lockstep.
    let offset = period(Duration::ZERO).mul_f64(f64::from(index) / f64::from(scenario.clients));
    let stop = start + scenario.phases.end;
    let peak_rate = scenario
        .rate_at(scenario.phases.window_start)
        .max(scenario.rate_per_client);
    let max_requests = scenario.phases.end.as_secs_f64() * peak_rate + 1.0;

    let mut requests = JoinSet::new();
    // An open loop on a schedule: a late tick is sent at once (a burst), as tokio's
    // `MissedTickBehavior::Burst` does, and the schedule is not shifted.
    let mut at = start + offset;
    for _ in 0..max_requests as u64 {
        if at >= stop {
            break;
        }
        tokio::time::sleep_until(at).await;
        let request = send(stack.clone(), uri.clone(), scenario.request_deadline);
        let started = at - start;
        requests.spawn(async move {
            let (latency, ok, shed) = request.await;
            Outcome {
                started,
                latency,
                ok,
                shed,
            }
        });
        at += period(started);
    }
    // Every request gives up at its deadline, so this ends; the timeout is a backstop
    // (the set aborts whatever is left when it is dropped).
    let mut outcomes = Vec::with_capacity(requests.len());
    let drain = stop + scenario.request_deadline + Duration::from_secs(1);
    while let Ok(Some(done)) = tokio::time::timeout_at(drain, requests.join_next()).await {
        if let Ok(outcome) = done {
            outcomes.push(outcome);
        }
    }
    outcomes
}

/// Sends one request through `stack`; its latency, whether it succeeded, and whether
/// the load control shed it.
pub(crate) async fn send(stack: Stack, uri: Uri, deadline: Duration) -> (Duration, bool, bool) {
    let began = Instant::now();
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = uri;
    let (ok, shed) = match tokio::time::timeout(deadline, stack.oneshot(req)).await {
        Ok(Ok(res)) => (res.status().is_success(), false),
        Ok(Err(err)) => (false, err.downcast_ref::<Shed>().is_some()),
        Err(_elapsed) => (false, false),
    };
    (began.elapsed(), ok, shed)
}
