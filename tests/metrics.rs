//! The `metrics` feature against a real Prometheus recorder, scraped over HTTP (its own
//! test binary: the recorder is global to the process).

#[path = "../examples/metrics/demo.rs"]
mod demo;

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
}
