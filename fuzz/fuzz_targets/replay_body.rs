//! `ReplayBody` over arbitrary frame sequences, size hints, caps and stopping points of
//! the first attempt:
//! - the first attempt passes every frame of the inner body through unchanged;
//! - a replay is either byte- and trailer-identical to the whole body (whenever the
//!   original was whole and under the cap, it must be), or fails with an error: a
//!   truncated body is never yielded as complete;
//! - an original dropped before any frame of it was read hands the body on: the replay
//!   is then always replayable, and passes the body through as the original would have.
#![no_main]

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use arbitrary::Arbitrary;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use libfuzzer_sys::fuzz_target;
use stormguard::ReplayBody;

#[derive(Debug, Clone, Arbitrary)]
enum Step {
    Data(Vec<u8>),
    /// Trailers: (name index, value) pairs, possibly none.
    Trailers(Vec<(u8, u8)>),
    Pending,
    Error,
}

#[derive(Debug, Arbitrary)]
struct Input {
    steps: Vec<Step>,
    cap: u16,
    /// The body reports an exact size hint (the data bytes left).
    exact: bool,
    /// The body says when it has ended.
    reports_end: bool,
    /// The first attempt stops polling after this many polls.
    stop_after: u8,
}

#[derive(Debug)]
struct Failed;

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("failed")
    }
}

impl std::error::Error for Failed {}

/// The body as its steps say; it ends after trailers or an error, like any sane body.
struct Scripted {
    steps: VecDeque<Step>,
    exact: bool,
    reports_end: bool,
}

impl Scripted {
    fn left(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Data(d) => d.len() as u64,
                _ => 0,
            })
            .sum()
    }
}

fn trailers(pairs: &[(u8, u8)]) -> HeaderMap {
    const NAMES: [&str; 3] = ["x-a", "x-b", "grpc-status"];
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        let name = HeaderName::from_static(NAMES[usize::from(*name) % NAMES.len()]);
        map.append(name, HeaderValue::from(u16::from(*value)));
    }
    map
}

impl Body for Scripted {
    type Data = Bytes;
    type Error = Failed;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Failed>>> {
        match self.steps.pop_front() {
            None => Poll::Ready(None),
            Some(Step::Pending) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Some(Step::Data(d)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(d))))),
            Some(Step::Trailers(t)) => {
                self.steps.clear();
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&t)))))
            }
            Some(Step::Error) => {
                self.steps.clear();
                Poll::Ready(Some(Err(Failed)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.reports_end && self.steps.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact {
            SizeHint::with_exact(self.left())
        } else {
            SizeHint::default()
        }
    }
}

/// What a body yields in full: its data frames and trailers, or `None` if it fails.
fn whole(steps: &[Step]) -> Option<(Vec<Bytes>, Option<HeaderMap>)> {
    let mut data = Vec::new();
    for step in steps {
        match step {
            Step::Data(d) => data.push(Bytes::from(d.clone())),
            Step::Trailers(t) => return Some((data, Some(trailers(t)))),
            Step::Pending => {}
            Step::Error => return None,
        }
    }
    Some((data, None))
}

type Polled = Option<Result<Frame<Bytes>, stormguard::BoxError>>;

/// Polls until ready, at most `limit` times in all (`None` past it).
fn poll<B: Body<Data = Bytes, Error = stormguard::BoxError> + Unpin>(
    body: &mut B,
    budget: &mut usize,
) -> Option<Polled> {
    let mut cx = Context::from_waker(Waker::noop());
    while *budget > 0 {
        *budget -= 1;
        if let Poll::Ready(frame) = Pin::new(&mut *body).poll_frame(&mut cx) {
            return Some(frame);
        }
    }
    None
}

fuzz_target!(|input: Input| {
    let Input {
        steps,
        cap,
        exact,
        reports_end,
        stop_after,
    } = input;
    let expected = whole(&steps);
    let inner = Scripted {
        steps: steps.iter().cloned().collect(),
        exact,
        reports_end,
    };
    let mut original = ReplayBody::new(inner, usize::from(cap));
    let replay = original.clone();

    // The first attempt, stopped after `stop_after` polls (or at its end).
    let mut sent_data = Vec::new();
    let mut sent_trailers = None;
    let mut ended = false;
    let mut read_any = false;
    let mut budget = usize::from(stop_after);
    while !ended {
        let polled = poll(&mut original, &mut budget);
        read_any |= polled.is_some();
        match polled {
            None => break,
            Some(None) => ended = true,
            Some(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => sent_data.push(data),
                Err(frame) => {
                    sent_trailers = frame.into_trailers().ok();
                    ended = true;
                }
            },
            Some(Some(Err(_))) => {
                assert!(expected.is_none(), "an error the body did not yield");
                ended = true;
            }
        }
    }
    // Pass-through: what was sent is a prefix of the body, exactly.
    if let Some((data, trailers)) = &expected {
        assert!(sent_data.len() <= data.len());
        assert_eq!(&sent_data[..], &data[..sent_data.len()]);
        if sent_trailers.is_some() {
            assert_eq!(&sent_trailers, trailers);
        }
    }
    let size: usize = expected
        .as_ref()
        .map_or(0, |(data, _)| data.iter().map(Bytes::len).sum());
    let whole_and_small = ended && expected.is_some() && size <= usize::from(cap);
    drop(original);

    // The replay.
    let replayable = replay.is_replayable();
    let handed_on = !read_any;
    if whole_and_small || handed_on {
        assert!(replayable, "a whole body under the cap, or an unread one, is not replayable");
    }
    let mut replay = replay;
    let (mut data, mut trailers) = (Vec::new(), None);
    let mut budget = 10_000;
    loop {
        match poll(&mut replay, &mut budget) {
            None => panic!("the replay never ended"),
            Some(None) => break,
            Some(Some(Err(_))) => {
                // Only the body's own error, passed through from a body handed on.
                assert!(
                    !replayable || (handed_on && expected.is_none()),
                    "a replayable body failed on replay"
                );
                return;
            }
            Some(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => data.push(d),
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
        }
    }
    // It ended cleanly: it must be the whole body, byte for byte, trailers included.
    let (want_data, want_trailers) = expected.expect("a failed body replayed as complete");
    let concat = |v: &[Bytes]| {
        v.iter()
            .flat_map(|b| b.iter().copied())
            .collect::<Vec<u8>>()
    };
    assert_eq!(concat(&data), concat(&want_data), "replayed bytes differ");
    assert_eq!(trailers, want_trailers, "replayed trailers differ");
});
