//! A real Prometheus server scrapes the metrics example's endpoint while the example
//! drives its outage, and its HTTP API shows what happened: the first attempts and
//! their `increase()`, the retries, and the breaker's opening and its state.
//!
//! The test starts `prometheus` (Debian's package `prometheus`) on 127.0.0.1 with a
//! scrape config of its own and a data directory in the system's temporary directory,
//! and kills it by PID at the end, also when the test fails. It is `#[ignore]`d, so that
//! the README's test command passes where the binary is absent (it says "ignored", not
//! "ok"); `.ci/run` installs the package and runs it with
//! `cargo test --all-features --test prometheus -- --ignored`.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::BoxError;

// Each user of the demo takes the parts it needs.
#[allow(dead_code)]
#[path = "../examples/metrics/demo.rs"]
mod demo;

/// A Prometheus server this test started; killed (by PID) and its data removed on drop.
struct Prometheus {
    child: Child,
    dir: std::path::PathBuf,
    addr: SocketAddr,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port on 127.0.0.1, as the kernel picks one for port 0.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts Prometheus scraping `target` every second.
fn start(target: SocketAddr) -> Result<Prometheus, BoxError> {
    let dir = std::env::temp_dir().join(format!("stormguard-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: stormguard\n    metrics_path: /metrics\n    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("prometheus (Debian's package `prometheus`) must be on PATH: {e}"))?;
    Ok(Prometheus { child, dir, addr })
}

/// The value of the first sample `query` gives at the server's now, if any.
async fn query(prometheus: &Prometheus, promql: &str) -> Result<Option<f64>, BoxError> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut encoded = String::new();
    for byte in promql.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    let uri = format!("http://{}/api/v1/query?query={encoded}", prometheus.addr);
    let response = client
        .request(http::Request::get(uri).body(Full::default())?)
        .await?;
    let body = response.into_body().collect().await?.to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body)?;
    let value = json["data"]["result"][0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok());
    Ok(value)
}

/// Polls `promql` every 250 ms, for at most `within`, until `accept` takes its value;
/// the last value seen.
async fn until(
    prometheus: &Prometheus,
    promql: &str,
    within: Duration,
    accept: impl Fn(f64) -> bool,
) -> Option<f64> {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < within {
        if let Ok(Some(value)) = query(prometheus, promql).await {
            last = Some(value);
            if accept(value) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs prometheus on PATH (Debian's package `prometheus`); .ci/run runs it"]
async fn a_real_prometheus_sees_the_outage() -> Result<(), BoxError> {
    let exporter = demo::exporter().await?;
    let prometheus = start(exporter)?;
    // Scraped once before the requests: `increase()` then has a baseline.
    let up = until(
        &prometheus,
        "up{job=\"stormguard\"}",
        Duration::from_secs(60),
        |v| v == 1.0,
    )
    .await;
    assert_eq!(up, Some(1.0), "Prometheus never scraped the exporter");
    demo::drive().await?;
    // Every request's first attempt: the counter, once scraped after the requests, and
    // its `increase()` over the last minute. (The series is registered at the policy's
    // first request, so the first sample Prometheus has of it is already above 0, and
    // `increase()` counts from that sample: it shows the activity, not all of it.)
    let first = until(
        &prometheus,
        "retry_attempts_total{service=\"payments\",attempt_number=\"1\"}",
        Duration::from_secs(30),
        |v| v >= f64::from(demo::REQUESTS),
    )
    .await;
    assert_eq!(first, Some(f64::from(demo::REQUESTS)), "first attempts");
    let increase = query(
        &prometheus,
        "increase(retry_attempts_total{service=\"payments\",attempt_number=\"1\"}[1m])",
    )
    .await?;
    assert!(
        increase.is_some_and(|v| v > 0.0),
        "increase of first attempts: {increase:?}"
    );
    // The outage's retries (all made before the series' first sample: the counter).
    let retries = query(
        &prometheus,
        "retry_attempts_total{service=\"payments\",attempt_number=\"2\"}",
    )
    .await?;
    assert!(retries.is_some_and(|v| v >= 1.0), "retries: {retries:?}");
    // The breaker opened during the outage and has closed again since.
    let opened = query(
        &prometheus,
        "circuit_breaker_transitions_total{dependency=\"payments\",from=\"closed\",to=\"open\"}",
    )
    .await?;
    assert!(opened.is_some_and(|v| v >= 1.0), "openings: {opened:?}");
    let state = query(
        &prometheus,
        "circuit_breaker_state{dependency=\"payments\"}",
    )
    .await?;
    assert_eq!(state, Some(0.0), "closed after the recovery");
    Ok(())
}
