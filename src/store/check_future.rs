//! [`CheckFuture`]: a store's answer to a check, already known (an in-process store), still on its
//! way (a networked one), or not sent yet: a call whose answer nobody waits for (a give-back, a
//! settle, a lease's release) is handed to the store with what to do with its answer
//! ([`CheckFuture::then`]), so a store that group-commits answers it from the task that sends
//! its batch, with no task, channel or wake-up of its own.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use super::StoreError;
use crate::decision::Decision;

type BoxedCheck = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>;

/// What is done with the answer of a call nobody waits for ([`CheckFuture::then`]).
pub(crate) type Answered = Box<dyn FnOnce(Result<Decision, StoreError>) + Send + 'static>;

/// A call a networked store has not sent yet: sent when first polled, or handed its answer's
/// use ([`CheckFuture::then`]).
pub(crate) trait Deferred: Send + 'static {
    /// The call as a future (sent when first polled).
    fn into_future(self: Box<Self>) -> BoxedCheck;

    /// Sends the call; `answered` gets its answer from wherever the store reads it. Without a
    /// runtime to send it from, nothing is sent and `answered` is dropped unrun.
    fn send_then(self: Box<Self>, answered: Answered);
}

/// The answer of [`Store::check`](super::Store::check): either already known or still on its
/// way.
#[must_use = "futures do nothing unless polled"]
pub struct CheckFuture(CheckState);

enum CheckState {
    Ready(Option<Result<Decision, StoreError>>),
    Pending(BoxedCheck),
    // (Only the Redis store defers its calls.)
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Deferred(Option<Box<dyn Deferred>>),
}

impl CheckFuture {
    /// An answer known at once (in-process stores).
    pub fn ready(result: Result<Decision, StoreError>) -> Self {
        CheckFuture(CheckState::Ready(Some(result)))
    }

    /// An answer that still has to be waited for (networked stores).
    pub fn from_future<F>(future: F) -> Self
    where
        F: Future<Output = Result<Decision, StoreError>> + Send + 'static,
    {
        CheckFuture(CheckState::Pending(Box::pin(future)))
    }

    /// A call not sent yet (see [`Deferred`]).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn deferred(call: Box<dyn Deferred>) -> Self {
        CheckFuture(CheckState::Deferred(Some(call)))
    }

    /// Takes the answer if it is already known, so callers can skip a suspension point.
    pub fn take_ready(&mut self) -> Option<Result<Decision, StoreError>> {
        match &mut self.0 {
            CheckState::Ready(result) => result.take(),
            CheckState::Pending(_) | CheckState::Deferred(_) => None,
        }
    }

    /// Sends the call now, ahead of the requests after it, and runs `answered` on its answer
    /// when it comes, without the caller waiting: at once when it is known, from the store's own
    /// sending when the store can (a group commit's batch), else from a task of its own. Without
    /// a runtime (a test's teardown) a call still on its way is given up: `answered` is dropped
    /// unrun.
    pub(crate) fn then(self, answered: impl FnOnce(Result<Decision, StoreError>) + Send + 'static) {
        match self.0 {
            CheckState::Ready(Some(result)) => answered(result),
            CheckState::Ready(None) => {}
            CheckState::Deferred(Some(call)) => call.send_then(Box::new(answered)),
            CheckState::Deferred(None) => {}
            CheckState::Pending(mut future) => {
                // Polled once here, so a networked store sends it now.
                match future
                    .as_mut()
                    .poll(&mut Context::from_waker(Waker::noop()))
                {
                    Poll::Ready(result) => answered(result),
                    Poll::Pending => {
                        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                            runtime.spawn(async move { answered(future.await) });
                        }
                    }
                }
            }
        }
    }
}

impl Future for CheckFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = &mut self.0;
        if let CheckState::Deferred(call) = state {
            let call = call.take().expect("CheckFuture polled after it completed");
            *state = CheckState::Pending(call.into_future());
        }
        match state {
            CheckState::Ready(result) => Poll::Ready(
                result
                    .take()
                    .expect("CheckFuture polled after it completed"),
            ),
            CheckState::Pending(future) => future.as_mut().poll(cx),
            CheckState::Deferred(_) => unreachable!("a deferred call is sent when first polled"),
        }
    }
}

impl fmt::Debug for CheckFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            CheckState::Ready(_) => f.write_str("CheckFuture::Ready"),
            CheckState::Pending(_) | CheckState::Deferred(_) => f.write_str("CheckFuture::Pending"),
        }
    }
}
