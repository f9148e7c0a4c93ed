//! The retry layer's policy and the simulator run one decision: stormguard-core's
//! `RequestRetry`. Driven with the same outcomes and the same seed, the policy (as tower
//! drives it) and the machine (as the simulator drives it) decide the same waits and the
//! same give-up.

use std::time::Duration;

use http::{Request, Response};
use stormguard::{BoxError, GiveUp, RetryBudget, RetryPolicy};
use stormguard_core::retry::{Attempt, Decision, Env, RequestRetry};
use stormguard_core::{Backoff, Class};
use tower::retry::Policy;

const SEED: u64 = 0x5EED;

fn budget() -> RetryBudget {
    RetryBudget::builder()
        .allowance(100)
        .build()
        .expect("budget")
}

/// The waits the policy decides for a GET whose every call fails with a 503, timed on
/// paused time, and the attempts it made.
async fn policy_waits(max_attempts: u32) -> (Vec<Duration>, u32) {
    let policy = RetryPolicy::builder()
        .max_attempts(max_attempts)
        .budget(budget())
        .seed(SEED)
        .build()
        .expect("policy");
    let mut request = policy.clone();
    let mut req = Request::get("http://example.test/")
        .body(())
        .expect("request");
    let _copy = Policy::<Request<()>, Response<()>, BoxError>::clone_request(&mut request, &req);
    let mut waits = Vec::new();
    loop {
        let mut result: Result<Response<()>, BoxError> =
            Ok(Response::builder().status(503).body(()).expect("response"));
        let Some(wait) = request.retry(&mut req, &mut result) else {
            let attempts = result.as_ref().map(stormguard::Attempts::of).unwrap_or(0);
            return (waits, attempts);
        };
        let start = tokio::time::Instant::now();
        wait.await;
        waits.push(start.elapsed());
    }
}

/// The same, from the machine alone.
fn machine_waits(max_attempts: u32) -> (Vec<Duration>, Decision) {
    let budget = budget();
    let now = std::time::Instant::now();
    let request = stormguard_core::retry::Request::new(max_attempts, Backoff::default());
    let mut retry = RequestRetry::new();
    let mut waits = Vec::new();
    loop {
        let mut seed = || Some(SEED);
        let mut env = Env::new(now, &budget);
        env.seed = Some(&mut seed);
        let decided = retry.decide(
            &mut env,
            &request,
            Attempt::Answered {
                throttled: false,
                class: Class::Retryable { after: None },
                any_method: false,
            },
        );
        match decided.decision {
            Decision::Retry { delay, .. } => waits.push(delay),
            done => return (waits, done),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_policy_and_the_simulators_machine_decide_alike() {
    for max_attempts in [1, 2, 3, 5] {
        let (policy, attempts) = policy_waits(max_attempts).await;
        let (machine, done) = machine_waits(max_attempts);
        // tokio's timer, paused, sleeps to the next whole millisecond.
        let machine: Vec<Duration> = machine
            .iter()
            .map(|d| Duration::from_millis(d.as_nanos().div_ceil(1_000_000) as u64))
            .collect();
        assert_eq!(policy, machine, "{max_attempts} attempts");
        assert_eq!(
            done,
            Decision::Done {
                attempts: max_attempts,
                give_up: Some(GiveUp::Exhausted)
            }
        );
        assert_eq!(attempts, max_attempts, "the response's attempt count");
        assert_eq!(policy.len() as u32, max_attempts - 1);
    }
}
