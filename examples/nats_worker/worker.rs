//! The NATS JetStream parts of the `nats_worker` example, shared with `tests/nats.rs` so
//! the test checks the very worker the example runs: a nats-server of our own, the job
//! mix and its handler, the streams and consumer, and the worker loop.

// Shared by the example and the test; each reads only some of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::consumer::{pull, AckPolicy};
use async_nats::jetstream::stream::{self, RetentionPolicy};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use http::{HeaderMap, StatusCode};
use stormguard::sans_io::classify::Rules;
use stormguard::sans_io::redelivery::{Decision, Reason, Redelivery};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The work queue: a message leaves it when it is acknowledged or terminated.
pub(crate) const WORK_STREAM: &str = "WORK";
const WORK_SUBJECT: &str = "work.jobs";
/// Where permanent failures and exhausted messages go, with the reason in headers.
pub(crate) const DEAD_LETTER_STREAM: &str = "DEAD_LETTERS";
const DEAD_LETTER_SUBJECT: &str = "dead.jobs";
const CONSUMER: &str = "worker";
/// The broker redelivers an unacknowledged message after this long. Far above any
/// backoff delay here, so a redelivery caused by a lost `Nak` (instead of its delay)
/// would show as a gap far outside the jitter bounds.
pub(crate) const ACK_WAIT: Duration = Duration::from_secs(10);

/// The dead-letter headers: a stable token, a sentence, the deliveries made.
pub(crate) const REASON_HEADER: &str = "Stormguard-Dead-Letter-Reason";
pub(crate) const DETAIL_HEADER: &str = "Stormguard-Dead-Letter-Detail";
pub(crate) const DELIVERIES_HEADER: &str = "Stormguard-Deliveries";

/// A `nats-server -js` of our own on 127.0.0.1 with a temporary store, killed (by its
/// process handle) and its store removed when dropped, so a failing test still cleans up.
#[derive(Debug)]
pub(crate) struct NatsServer {
    child: Child,
    store: PathBuf,
    url: String,
}

impl NatsServer {
    /// Starts the server on a free port and waits (at most 10 s) until it accepts
    /// connections. Fails with a clear message if `nats-server` is not installed.
    pub(crate) async fn start() -> Result<Self, BoxError> {
        let mut last_error = String::new();
        // A port found free can be taken before the server binds it: try a few.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            // Also the server's name, so we know it is ours that answers on the port.
            let name = format!("stormguard-nats-{}-{port}-{nanos}", std::process::id());
            let store = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(&store)?;
            let spawned = Command::new("nats-server")
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-n", &name])
                .args(["-js", "-sd"])
                .arg(&store)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&store);
                    if e.kind() == std::io::ErrorKind::NotFound {
                        return Err("nats-server is not installed (not on PATH): \
                                    `apt-get install nats-server` (.ci/run does this)"
                            .into());
                    }
                    return Err(format!("cannot start nats-server: {e}").into());
                }
            };
            let mut server = NatsServer {
                child,
                store,
                url: format!("nats://127.0.0.1:{port}"),
            };
            match server.wait_until_ready(port, &name).await {
                Ok(()) => return Ok(server),
                Err(e) => last_error = e.to_string(), // dropped: killed, store removed
            }
        }
        Err(format!("nats-server did not start: {last_error}").into())
    }

    async fn wait_until_ready(&mut self, port: u16, name: &str) -> Result<(), BoxError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Err(format!("exited with {status} (port {port} taken?)").into());
            }
            if greets_as(port, name).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("no connection on port {port} within 10 s").into())
    }

    /// `nats://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }
}

/// Whether a NATS server named `name` answers on `port`: its first line is
/// `INFO {..."server_name":"NAME"...}`. Another process that took the port meanwhile
/// (another test's server) does not count.
async fn greets_as(port: u16, name: &str) -> bool {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let greeting = async {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let mut line = String::new();
        tokio::io::BufReader::new(stream.take(16 * 1024))
            .read_line(&mut line)
            .await?;
        Ok::<_, std::io::Error>(line)
    };
    match tokio::time::timeout(Duration::from_secs(1), greeting).await {
        Ok(Ok(line)) => {
            line.starts_with("INFO ") && line.contains(&format!("\"server_name\":\"{name}\""))
        }
        _ => false,
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// How a job's downstream call behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Succeeds on the first delivery.
    Good,
    /// 503 on the first two deliveries, then succeeds.
    Flaky,
    /// 400 on every delivery: a permanent failure.
    Bad,
    /// 503 on every delivery: a transient failure that never clears.
    Down,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Good => "good",
            Kind::Flaky => "flaky",
            Kind::Bad => "bad",
            Kind::Down => "down",
        }
    }
}

/// A job: its id (`job-007`) and how its handler will behave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) kind: Kind,
}

/// The mix: of every ten jobs two are bad, three flaky, five good.
pub(crate) fn mix(n: usize) -> Vec<Job> {
    (0..n)
        .map(|i| Job {
            id: format!("job-{i:03}"),
            kind: match i % 10 {
                0 | 1 => Kind::Bad,
                2..=4 => Kind::Flaky,
                _ => Kind::Good,
            },
        })
        .collect()
}

/// The handler: what the job's downstream call answers on delivery `delivery`. A
/// payload it cannot read is a bad request.
pub(crate) fn handle(payload: &[u8], delivery: u32) -> StatusCode {
    let kind = std::str::from_utf8(payload)
        .ok()
        .and_then(|p| p.split_once(' '))
        .map(|(_, kind)| kind);
    match kind {
        Some("good") => StatusCode::OK,
        Some("flaky") if delivery <= 2 => StatusCode::SERVICE_UNAVAILABLE,
        Some("flaky") => StatusCode::OK,
        Some("down") => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}

fn job_id(payload: &[u8]) -> String {
    let text = String::from_utf8_lossy(payload);
    text.split(' ').next().unwrap_or_default().to_owned()
}

/// Creates the work queue, the dead-letter stream and the worker's durable pull
/// consumer, whose `max_deliver` is the redelivery's maximum deliveries.
pub(crate) async fn set_up(
    js: &jetstream::Context,
    redelivery: &Redelivery,
) -> Result<(), BoxError> {
    let work = js
        .create_stream(stream::Config {
            name: WORK_STREAM.into(),
            subjects: vec![WORK_SUBJECT.into()],
            retention: RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await?;
    js.create_stream(stream::Config {
        name: DEAD_LETTER_STREAM.into(),
        subjects: vec![DEAD_LETTER_SUBJECT.into()],
        ..Default::default()
    })
    .await?;
    work.create_consumer(pull::Config {
        durable_name: Some(CONSUMER.into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        max_deliver: i64::from(redelivery.max_deliveries()),
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Publishes the jobs to the work queue, each confirmed by the broker.
pub(crate) async fn publish(js: &jetstream::Context, jobs: &[Job]) -> Result<(), BoxError> {
    for job in jobs {
        let payload = format!("{} {}", job.id, job.kind.name());
        js.publish(WORK_SUBJECT, payload.into()).await?.await?;
    }
    Ok(())
}

/// One delivery as the worker saw it.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    pub(crate) job: String,
    /// The broker's delivery count (1 is the first delivery).
    pub(crate) count: u32,
    /// When the worker took the message off the consumer (its own monotonic clock).
    pub(crate) received: Instant,
    pub(crate) status: StatusCode,
    pub(crate) decision: Decision,
}

/// The worker loop: per message, run the handler, classify its status with the core's
/// rules, let the core's [`Redelivery`] decide, and tell the broker. It never sleeps:
/// a transient failure goes back to the broker with a `Nak` carrying the delay.
///
/// Stops once `jobs` messages have reached an end (acknowledged or dead-lettered), or
/// at `timeout`.
pub(crate) async fn run_worker(
    js: &jetstream::Context,
    redelivery: &Redelivery,
    jobs: usize,
    timeout: Duration,
) -> Result<Vec<Delivery>, BoxError> {
    let consumer = js
        .get_stream(WORK_STREAM)
        .await?
        .get_consumer::<pull::Config>(CONSUMER)
        .await?;
    let mut messages = consumer.messages().await?;
    let rules = Rules::default();
    let deadline = tokio::time::Instant::now() + timeout;
    let mut deliveries = Vec::new();
    let mut ended = 0;
    while ended < jobs {
        let message = match tokio::time::timeout_at(deadline, messages.next()).await {
            Ok(Some(message)) => message?,
            Ok(None) | Err(_) => break,
        };
        let received = Instant::now();
        let (count, sequence) = {
            let info = message.info()?;
            (
                u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX),
                info.stream_sequence,
            )
        };
        let status = handle(&message.payload, count);
        let class = rules.classify(status, &HeaderMap::new(), SystemTime::now());
        // Seeded by the stream sequence: each message its own jitter, replayable.
        let decision = redelivery.decide_seeded(class, count, sequence);
        match decision {
            Decision::Ack => message.double_ack().await?,
            Decision::RetryAfter(delay) => message.ack_with(AckKind::Nak(Some(delay))).await?,
            Decision::DeadLetter(reason) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(REASON_HEADER, reason.as_str());
                headers.insert(DETAIL_HEADER, detail(reason, status).as_str());
                headers.insert(DELIVERIES_HEADER, count.to_string().as_str());
                // A redelivery after a lost Term republishes: the broker drops the copy.
                headers.insert("Nats-Msg-Id", format!("{WORK_STREAM}-{sequence}").as_str());
                // Stored in the dead-letter stream first, then terminated: never neither.
                js.publish_with_headers(DEAD_LETTER_SUBJECT, headers, message.payload.clone())
                    .await?
                    .await?;
                message.double_ack_with(AckKind::Term).await?;
            }
        }
        if !matches!(decision, Decision::RetryAfter(_)) {
            ended += 1;
        }
        deliveries.push(Delivery {
            job: job_id(&message.payload),
            count,
            received,
            status,
            decision,
        });
    }
    Ok(deliveries)
}

fn detail(reason: Reason, status: StatusCode) -> String {
    format!("{reason}: {status}")
}

/// A message read back from the dead-letter stream.
#[derive(Debug, Clone)]
pub(crate) struct DeadLetter {
    pub(crate) job: String,
    pub(crate) reason: String,
    pub(crate) detail: String,
    pub(crate) deliveries: String,
}

/// Everything in the dead-letter stream, as the broker stored it.
pub(crate) async fn dead_letters(js: &jetstream::Context) -> Result<Vec<DeadLetter>, BoxError> {
    let mut stream = js.get_stream(DEAD_LETTER_STREAM).await?;
    let last = stream.info().await?.state.last_sequence;
    let mut letters = Vec::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await?;
        let header = |name: &str| {
            message
                .headers
                .get(name)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default()
        };
        letters.push(DeadLetter {
            job: job_id(&message.payload),
            reason: header(REASON_HEADER),
            detail: header(DETAIL_HEADER),
            deliveries: header(DELIVERIES_HEADER),
        });
    }
    Ok(letters)
}

/// Messages still in the work queue (neither acknowledged nor terminated).
pub(crate) async fn left_in_queue(js: &jetstream::Context) -> Result<u64, BoxError> {
    let mut stream = js.get_stream(WORK_STREAM).await?;
    Ok(stream.info().await?.state.messages)
}

/// The run's outcome by job, from the worker's acknowledgements and the broker's
/// dead-letter stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    pub(crate) acked: usize,
    pub(crate) dead_lettered: usize,
    /// Published, but neither acknowledged nor in the dead-letter stream.
    pub(crate) lost: usize,
    /// Ended more than once (acknowledged twice, dead-lettered twice, or both).
    pub(crate) processed_twice: usize,
}

impl Summary {
    pub(crate) fn new(jobs: &[Job], deliveries: &[Delivery], letters: &[DeadLetter]) -> Self {
        let mut ends: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for d in deliveries {
            if d.decision == Decision::Ack {
                ends.entry(&d.job).or_default().0 += 1;
            }
        }
        for letter in letters {
            ends.entry(&letter.job).or_default().1 += 1;
        }
        let ended = |job: &Job| ends.get(job.id.as_str()).copied().unwrap_or_default();
        Summary {
            acked: jobs.iter().filter(|j| ended(j).0 > 0).count(),
            dead_lettered: jobs.iter().filter(|j| ended(j).1 > 0).count(),
            lost: jobs.iter().filter(|j| ended(j) == (0, 0)).count(),
            processed_twice: jobs.iter().filter(|j| ended(j).0 + ended(j).1 > 1).count(),
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} acked, {} dead-lettered, {} lost, {} processed twice",
            self.acked, self.dead_lettered, self.lost, self.processed_twice
        )
    }
}
