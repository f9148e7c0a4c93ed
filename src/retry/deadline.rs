//! A request's deadline, as the policy reads it: the request's own, a total timeout
//! above the layer, or its gRPC method's timeout, whichever ends first.

use std::time::{Duration, Instant};

use http::Request;
use stormguard_core::deadline::{grpc_timeout_value, Deadline};

use super::request::{deadline_of, is_grpc};
use super::{RetryPolicy, GRPC_TIMEOUT};

/// Where a request's deadline stands: tower keeps the request as first sent until its
/// first outcome, so the deadline is read then, from that copy and the instant of the
/// first send, to the same value it would have had at the send.
#[derive(Debug, Clone, Copy)]
pub(super) enum RequestDeadline {
    /// Not sent yet (the layer's own copy of the policy).
    Unsent,
    /// First sent at this instant, with this long at most to finish if a total timeout
    /// above says so; not read yet.
    SentAt(Instant, Option<Duration>),
    /// Read at the first failure: the [`Deadline`], if the request has one.
    Read(Option<Deadline>),
}

impl RetryPolicy {
    /// Reads the request's deadline, once, from the request as first sent: call it at
    /// the first outcome that is not a success, before the request is changed for a
    /// retry.
    pub(super) fn read_deadline<B>(&mut self, req: &Request<B>) {
        if let RequestDeadline::SentAt(sent, total) = self.deadline {
            let outer = total.map(|total| Deadline::after(sent, total));
            let method = self.method_timeout(req).map(|t| Deadline::after(sent, t));
            let deadline = [deadline_of(req, sent), outer, method]
                .into_iter()
                .flatten()
                .min();
            self.deadline = RequestDeadline::Read(deadline);
        }
    }

    /// The timeout of `req`'s gRPC method, when the policy has per-method timeouts.
    fn method_timeout<B>(&self, req: &Request<B>) -> Option<Duration> {
        let timeouts = self.shared.timeouts.as_ref()?;
        if !is_grpc(req) {
            return None;
        }
        timeouts.lookup(req.uri().path()).copied().flatten()
    }

    /// Tells the server of a gRPC call sent at `sent` how long its caller still waits.
    pub(super) fn set_grpc_timeout(&self, headers: &mut http::HeaderMap, sent: Instant) {
        if let Some(deadline) = self.deadline() {
            headers.insert(GRPC_TIMEOUT, grpc_timeout_value(deadline.remaining(sent)));
        }
    }

    /// The request's deadline, once [`read_deadline`](Self::read_deadline) has run.
    pub(super) fn deadline(&self) -> Option<Deadline> {
        match self.deadline {
            RequestDeadline::Read(deadline) => deadline,
            RequestDeadline::Unsent | RequestDeadline::SentAt(..) => None,
        }
    }
}
