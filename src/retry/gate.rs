//! The gate of throttled retries, as the drivers of [`RetryPolicy`] ask it: a retry of a
//! throttling answer whose wait is over is sent, waits for its slot, or is not sent
//! (`stormguard_core::retry::ThrottlePace`).

use std::sync::Arc;

use http::{Request, Response};
use stormguard_core::retry::Decision;

use super::request::is_grpc;
use super::wait::Wait;
use super::RetryPolicy;

/// What becomes of a gated retry once its wait is over ([`RetryPolicy::release`]).
pub(crate) enum Release {
    /// Send it now.
    Send,
    /// Send it after this wait, for its slot.
    Wait(Wait),
    /// Not sent: hand the outcome back (settled).
    GiveUp,
}

impl RetryPolicy {
    /// Whether the retry just decided is one of a throttling answer, to be let through
    /// by the gate once its wait is over ([`release`](Self::release)): its driver keeps
    /// the outcome, to hand it back if it is not.
    pub(crate) fn is_gated(&self) -> bool {
        self.retry.is_gated()
    }

    /// Once a gated retry's wait is over: send it now, wait for its slot, or hand
    /// `result` back (the gate had no slot for it; the retry is not sent).
    pub(crate) fn release<B, Res, E>(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<Res>, E>,
    ) -> Release {
        let now = tokio::time::Instant::now().into_std();
        let shared = Arc::clone(&self.shared);
        let mut env = shared.env(now, self.deadline());
        match self.retry.release(&mut env).decision {
            Decision::Retry { delay, attempts } if delay.is_zero() => {
                if is_grpc(req) {
                    self.set_grpc_timeout(req.headers_mut(), now);
                }
                let waited = self.gated_since.take().map(|since| now - since);
                let status = result.as_ref().ok().map(|res| res.status().as_u16());
                shared.retried(attempts, waited.unwrap_or_default(), status);
                Release::Send
            }
            Decision::Retry { delay, .. } => Release::Wait(Wait::sleep(delay)),
            Decision::Done { attempts, give_up } => {
                self.finish(result, attempts, give_up);
                Release::GiveUp
            }
            Decision::Transparent { .. } | Decision::Refused { .. } => Release::Send,
        }
    }
}
