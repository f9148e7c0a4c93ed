//! The `metrics` feature on a real exporter: a "payments" dependency on 127.0.0.1 is
//! failing its first 40 requests; 200 requests go through retry, breaker and
//! per-attempt timeout, and a burst goes past a load control's one place; then the
//! example scrapes its own `/metrics` endpoint (rendered
//! by `metrics-exporter-prometheus`) over HTTP and prints the stormguard series.
//!
//! `cargo run --example metrics --features metrics`

mod demo;

#[tokio::main]
async fn main() -> Result<(), tower::BoxError> {
    let scrape = demo::run().await?;
    for line in scrape.lines() {
        let ours = ["retry_", "circuit_breaker_", "load_control_"];
        if ours.iter().any(|series| line.starts_with(series)) {
            println!("{line}");
        }
    }
    Ok(())
}
