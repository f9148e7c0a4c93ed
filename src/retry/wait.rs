//! The wait before a retry.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Sleep;

/// The wait before a retry: the [`tower::retry::Policy::Future`] of [`RetryPolicy`](super::RetryPolicy).
///
/// A backoff or server-requested delay on tokio's clock, or no wait at all for a
/// transparent retry.
#[derive(Debug)]
pub struct Wait {
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Wait {
    pub(super) fn now() -> Self {
        Wait { sleep: None }
    }

    pub(super) fn sleep(delay: Duration) -> Self {
        Wait {
            sleep: Some(Box::pin(tokio::time::sleep(delay))),
        }
    }
}

impl Future for Wait {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match &mut self.sleep {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}
