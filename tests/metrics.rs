//! The `metrics` feature against a real Prometheus recorder, scraped over HTTP (its own
//! test binary: the recorder is global to the process).

#[path = "support/budget.rs"]
mod budget;
#[path = "../examples/metrics/demo.rs"]
mod demo;

/// A Prometheus recorder for one test's thread (`metrics::with_local_recorder`), its
/// handle to render a scrape, and a current-thread runtime on paused time.
fn local() -> (
    metrics_exporter_prometheus::PrometheusRecorder,
    metrics_exporter_prometheus::PrometheusHandle,
    tokio::runtime::Runtime,
) {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    (recorder, handle, runtime)
}

/// The value of the series `name{labels}` in a Prometheus text scrape.
fn value(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (series, number) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        if metric != name {
            return None;
        }
        let all = labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        if all {
            number.parse().ok()
        } else {
            None
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_series_reach_a_real_exporter() {
    let scrape = demo::run().await.expect("the demo runs");
    let service = ("service", "payments");
    // Every request's first attempt is counted, whatever happened to it.
    assert_eq!(
        value(
            &scrape,
            "retry_attempts_total",
            &[service, ("attempt_number", "1")]
        ),
        Some(f64::from(demo::REQUESTS)),
        "{scrape}"
    );
    // The outage made retries (attempt 2), and the budget refused some.
    assert!(
        value(
            &scrape,
            "retry_attempts_total",
            &[service, ("attempt_number", "2")]
        ) >= Some(1.0)
    );
    assert!(
        value(
            &scrape,
            "retry_give_ups_total",
            &[service, ("reason", "budget")]
        ) >= Some(1.0)
    );
    assert!(value(&scrape, "retry_delay_seconds_count", &[service]) >= Some(1.0));
    assert!(value(&scrape, "retry_budget_remaining", &[service]).is_some());
    assert!(value(&scrape, "retry_ratio", &[service]).is_some());
    assert!(value(&scrape, "retry_retries_per_call_count", &[service]) >= Some(1.0));
    // Forty failed calls open the breaker (20 in its window, every one failing).
    let dependency = ("dependency", "payments");
    assert!(
        value(
            &scrape,
            "circuit_breaker_transitions_total",
            &[dependency, ("from", "closed"), ("to", "open")]
        ) >= Some(1.0),
        "{scrape}"
    );
    assert!(value(&scrape, "circuit_breaker_state", &[dependency]).is_some());
    // The burst past the load control's one place: the calls it shed are counted.
    assert!(
        value(&scrape, "load_control_shed_total", &[service]) == Some(f64::from(demo::BURST - 1)),
        "{scrape}"
    );
    // Every series the Prometheus rules' unit tests feed in is one the example exports,
    // name and labels: renaming either breaks this test, not only the dashboards.
    let tests = include_str!("../contrib/prometheus/stormguard-rules.test.yml");
    let mut checked = 0;
    for line in tests.lines() {
        let Some(series) = line.trim().strip_prefix("- series: '") else {
            continue;
        };
        let series = series.trim_end_matches('\'');
        let (name, labels) = series.split_once('{').unwrap_or((series, "}"));
        let labels: Vec<(&str, &str)> = labels
            .trim_end_matches('}')
            .split(',')
            .filter(|pair| !pair.is_empty())
            .filter_map(|pair| pair.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        assert!(
            value(&scrape, name, &labels).is_some(),
            "{series} (in contrib/prometheus/stormguard-rules.test.yml) is not in the scrape:\n{scrape}"
        );
        checked += 1;
    }
    assert!(checked >= 7, "the rules' tests feed in {checked} series");
    // Every series the Grafana dashboard queries, with the labels its selectors name.
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../contrib/grafana/stormguard.json")).expect("JSON");
    let mut queried = 0;
    for expr in exprs(&dashboard) {
        for (name, keys) in selectors(&expr) {
            let lines: Vec<&str> = scrape
                .lines()
                .filter(|line| line.split(['{', ' ']).next() == Some(name.as_str()))
                .collect();
            assert!(
                !lines.is_empty(),
                "the dashboard queries {name}, not in the scrape: {expr}"
            );
            for key in keys {
                assert!(
                    lines.iter().any(|line| line.contains(&format!("{key}=\""))),
                    "the dashboard selects {name} by {key}, a label it does not have: {expr}"
                );
            }
            queried += 1;
        }
    }
    assert!(queried >= 12, "the dashboard queries {queried} series");
}

/// Every PromQL expression of a Grafana dashboard: its panels' targets and its
/// templating queries.
fn exprs(dashboard: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    let panels = dashboard["panels"].as_array().into_iter().flatten();
    for target in panels.flat_map(|p| p["targets"].as_array().into_iter().flatten()) {
        out.extend(target["expr"].as_str().map(str::to_owned));
    }
    let variables = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten();
    for variable in variables.filter(|v| v["type"] == "query") {
        out.extend(variable["query"].as_str().map(str::to_owned));
    }
    out
}

/// The stormguard series an expression names (`retry_...`, `hedge_...`,
/// `circuit_breaker_...`, `load_control_...`), each with the label keys of the selector right after it.
fn selectors(expr: &str) -> Vec<(String, Vec<String>)> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_name(c)).unwrap_or(tail.len());
        let (name, after) = tail.split_at(end);
        // Skip quoted strings' contents: a word inside "..." is a value, not a name.
        let quoted = rest[..start].matches('"').count() % 2 == 1;
        if !quoted
            && ["retry_", "hedge_", "circuit_breaker_", "load_control_"]
                .iter()
                .any(|p| name.starts_with(p))
        {
            let keys = after
                .strip_prefix('{')
                .and_then(|s| s.split_once('}'))
                .map(|(inside, _)| {
                    inside
                        .split(',')
                        .filter_map(|m| m.split(['=', '!']).next())
                        .map(|k| k.trim().to_owned())
                        .filter(|k| !k.is_empty())
                        .collect()
                })
                .unwrap_or_default();
            out.push((name.to_owned(), keys));
        }
        rest = after;
    }
    out
}

/// A gRPC method may allow more attempts than the policy's own (3): each of its
/// attempts is counted too. A recorder local to this thread, on paused time.
#[test]
fn attempts_past_the_policy_s_own_limit_by_a_grpc_method_are_counted() {
    use std::time::Duration;

    use stormguard::sans_io::classify::GrpcCodeSet;
    use stormguard::sans_io::methods::{GrpcRetryPolicy, MethodPolicy, MethodTable};
    use stormguard::{Attempts, Backoff, BoxError, Jitter, RetryLayer, RetryPolicy};
    use tower::{ServiceBuilder, ServiceExt};

    let (recorder, handle, runtime) = local();
    let backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(10),
        Jitter::Full,
    )
    .expect("backoff");
    let retry = GrpcRetryPolicy::new(5, backoff, GrpcCodeSet::retryable_default()).expect("A6");
    let mut methods = MethodTable::new();
    methods.insert_service("s.S", MethodPolicy::Retry(retry));
    let policy = RetryPolicy::builder()
        .name("grpc")
        .budget(budget::roomy())
        .grpc_methods(&methods)
        .build()
        .expect("policy");
    let attempts = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let unavailable = tower::service_fn(|_req: http::Request<String>| async {
                let mut res = http::Response::new(String::new());
                res.headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static("14"));
                Ok::<_, BoxError>(res)
            });
            let call = http::Request::post("http://upstream/s.S/M")
                .header("content-type", "application/grpc")
                .body(String::new())
                .expect("request");
            let stack = ServiceBuilder::new()
                .layer(RetryLayer::new(policy))
                .service(unavailable);
            stack.oneshot(call).await.map(|res| Attempts::of(&res))
        })
    });
    assert_eq!(attempts.expect("a response"), 5);
    let scrape = handle.render();
    for n in ["1", "2", "3", "4", "5"] {
        assert_eq!(
            value(
                &scrape,
                "retry_attempts_total",
                &[("service", "grpc"), ("attempt_number", n)]
            ),
            Some(1.0),
            "attempt {n}: {scrape}"
        );
    }
}

/// The hedge layer's series: a slow request hedged and won by its hedge (the original
/// cancelled), and one whose hedge a spent budget refused. A recorder local to this
/// thread, on paused time.
#[test]
fn hedges_sent_won_cancelled_and_refused_are_counted() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use stormguard::{BoxError, HedgeLayer, HedgePolicy, RetryBudget};
    use tower::{ServiceBuilder, ServiceExt};

    let (recorder, handle, runtime) = local();
    let hedged = |name: &str, budget: RetryBudget| {
        HedgePolicy::builder()
            .name(name)
            .delay(Duration::from_millis(50))
            .budget(budget)
            .build()
            .expect("policy")
    };
    let roomy = hedged("search", budget::roomy());
    let spent = RetryBudget::builder()
        .ratio(0.0)
        .allowance(0)
        .build()
        .expect("budget");
    let tight = hedged("tight", spent);
    // The first call of each upstream takes 200 ms, the later ones 10 ms.
    let upstream = || {
        let calls = Arc::new(AtomicU32::new(0));
        tower::service_fn(move |_req: http::Request<String>| {
            let slow = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                let ms = if slow { 200 } else { 10 };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, BoxError>(http::Response::new(String::new()))
            }
        })
    };
    let get = || {
        http::Request::get("http://upstream/")
            .body(String::new())
            .expect("request")
    };
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for policy in [&roomy, &tight] {
                let stack = ServiceBuilder::new()
                    .layer(HedgeLayer::new(policy.clone()))
                    .service(upstream());
                stack.oneshot(get()).await.expect("a response");
            }
        })
    });
    assert_eq!(roomy.stats().hedges_won, 1);
    assert_eq!(tight.stats().budget_denied, 1);
    let scrape = handle.render();
    let search = [("service", "search")];
    assert_eq!(
        value(&scrape, "hedge_sent_total", &search),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        value(&scrape, "hedge_won_total", &search),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        value(&scrape, "hedge_cancelled_total", &search),
        Some(1.0),
        "{scrape}"
    );
    let tight_label = [("service", "tight")];
    assert_eq!(
        value(&scrape, "hedge_budget_refused_total", &tight_label),
        Some(1.0),
        "{scrape}"
    );
    // A policy's series are registered together, at its first event: no hedge sent.
    assert_eq!(
        value(&scrape, "hedge_sent_total", &tight_label),
        Some(0.0),
        "{scrape}"
    );
}

/// The budget's gauges after a recovery: a client of ten requests a second whose
/// dependency fails for three seconds, then serves it for twenty. No failure comes
/// after the recovery, yet the gauges show the room the successes earned: they are
/// refreshed at the budget's roll-overs. A recorder local to this thread, on paused time.
#[test]
fn the_budget_gauges_are_current_after_a_recovery() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use stormguard::{BoxError, RetryBudget, RetryLayer, RetryPolicy};
    use tower::{ServiceBuilder, ServiceExt};

    let (recorder, handle, runtime) = local();
    let budget = RetryBudget::builder()
        .name("recovering")
        .build()
        .expect("budget");
    let policy = RetryPolicy::builder()
        .budget(budget.clone())
        .seed(1)
        .build()
        .expect("policy");
    let failing = Arc::new(AtomicBool::new(true));
    let flag = failing.clone();
    let upstream = tower::service_fn(move |_req: http::Request<String>| {
        let status = if flag.load(Ordering::SeqCst) {
            503
        } else {
            200
        };
        async move {
            let mut res = http::Response::new(String::new());
            *res.status_mut() = http::StatusCode::from_u16(status)?;
            Ok::<_, BoxError>(res)
        }
    });
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(upstream);
    let remaining = |scrape: &str| {
        value(
            scrape,
            "retry_budget_remaining",
            &[("service", "recovering")],
        )
    };
    let (during, after, room) = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let run = |seconds: u64| {
                let stack = stack.clone();
                async move {
                    for _ in 0..seconds * 10 {
                        let call = http::Request::get("http://upstream/")
                            .body(String::new())
                            .expect("request");
                        let _ = tokio::time::timeout(
                            Duration::from_secs(60),
                            stack.clone().oneshot(call),
                        )
                        .await;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            };
            run(3).await;
            let during = remaining(&handle.render());
            failing.store(false, Ordering::SeqCst);
            run(20).await;
            let now = tokio::time::Instant::now().into_std();
            (during, remaining(&handle.render()), budget.available(now))
        })
    });
    assert_eq!(during, Some(0.0), "spent by the failures");
    // Ten requests a second over the 10 s window pay for ten retries, and the allowance
    // one more; the gauge shows it (as of the last roll-over, at most a second ago).
    assert!(room >= 10, "{room}");
    assert_eq!(after, Some(room as f64));
}
