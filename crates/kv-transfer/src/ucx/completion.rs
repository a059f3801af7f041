//! A one-shot completion slot that can be awaited by async code and waited on by blocking
//! code (a `Drop` that must not return before UCX has let go of a borrowed buffer).

use parking_lot::{Condvar, Mutex};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::error::TransferError;

type Outcome = Result<(), TransferError>;

#[derive(Debug, Default)]
pub(crate) struct Completion {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct State {
    outcome: Option<Outcome>,
    waker: Option<Waker>,
}

impl Completion {
    fn state(&self) -> parking_lot::MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Records the outcome (the first one wins) and wakes whoever waits.
    pub(crate) fn complete(&self, outcome: Outcome) {
        let waker = {
            let mut s = self.state();
            if s.outcome.is_some() {
                return;
            }
            s.outcome = Some(outcome);
            s.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    #[cfg(test)]
    fn is_complete(&self) -> bool {
        self.state().outcome.is_some()
    }

    /// Blocks the calling thread until the outcome is known.
    pub(crate) fn wait_blocking(&self) {
        let mut s = self.state();
        while s.outcome.is_none() {
            self.cv.wait(&mut s);
        }
    }

    pub(crate) fn wait(&self) -> Wait<'_> {
        Wait(self)
    }
}

/// Future of [`Completion::wait`].
#[derive(Debug)]
pub(crate) struct Wait<'a>(&'a Completion);

impl Future for Wait<'_> {
    type Output = Outcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut s = self.0.state();
        match &s.outcome {
            Some(o) => Poll::Ready(o.clone()),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn completes_across_threads() {
        let c = Arc::new(Completion::default());
        let c2 = Arc::clone(&c);
        std::thread::spawn(move || c2.complete(Err(TransferError::Closed)));
        assert_eq!(c.wait().await, Err(TransferError::Closed));
        c.complete(Ok(()));
        assert_eq!(
            c.wait().await,
            Err(TransferError::Closed),
            "first outcome wins"
        );
        c.wait_blocking();
        assert!(c.is_complete());
    }
}
