//! Where counts live: the [`Store`] trait and its implementations.
//!
//! A store answers one question per request, in one call: *check every rule of this policy for this
//! key and, only if all pass, record the request in all of them*. That one call is one `EVALSHA` on
//! Redis and one locked map update in memory, so a request costs one round trip whatever the number
//! of rules. Stores know nothing of HTTP.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::decision::Decision;
use crate::policy::{Algorithm, Rule};

mod memory;
mod redis;
mod weighted;

pub use self::memory::{Clock, ManualClock, MemoryStore, MemoryStoreBuilder, SystemClock};
pub use self::redis::{DEFAULT_TIMEOUT, RedisStore};

/// One request to check: the key, the rules (all must pass), the algorithm and the request's cost.
#[derive(Debug, Clone, Copy)]
pub struct CheckRequest<'a> {
    /// The key of the bucket, as built by the policy (`prefix:policy:identity`): it starts with the
    /// policy's prefix and a colon, and has no braces, so a store may wrap it in a hash tag.
    pub key: &'a str,
    /// The rules, every one of which must admit the request.
    pub rules: &'a [Rule],
    /// How to count.
    pub algorithm: Algorithm,
    /// How many units the request uses in every rule (1 for a plain request).
    pub cost: u64,
}

/// A rate-limit store.
///
/// `check` must be atomic: it checks every rule and records the request in all of them only if all
/// admit it; a refused request changes nothing. It returns a [`CheckFuture`]: an in-process store
/// answers with [`CheckFuture::ready`] (no allocation, no task switch), a networked one with
/// [`CheckFuture::from_future`].
///
/// The trait is object safe, so stores can be shared as `Arc<dyn Store>`.
pub trait Store: Send + Sync + 'static {
    /// Checks and, if every rule admits it, records one request.
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture;
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        (**self).check(request)
    }
}

type BoxedCheck = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>;

/// The answer of [`Store::check`]: either already known or still on its way.
#[must_use = "futures do nothing unless polled"]
pub struct CheckFuture(CheckState);

enum CheckState {
    Ready(Option<Result<Decision, StoreError>>),
    Pending(BoxedCheck),
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

    /// Takes the answer if it is already known, so callers can skip a suspension point.
    pub fn take_ready(&mut self) -> Option<Result<Decision, StoreError>> {
        match &mut self.0 {
            CheckState::Ready(result) => result.take(),
            CheckState::Pending(_) => None,
        }
    }
}

impl Future for CheckFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            CheckState::Ready(result) => Poll::Ready(
                result
                    .take()
                    .expect("CheckFuture polled after it completed"),
            ),
            CheckState::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for CheckFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            CheckState::Ready(_) => f.write_str("CheckFuture::Ready"),
            CheckState::Pending(_) => f.write_str("CheckFuture::Pending"),
        }
    }
}

/// Why a store could not answer. Never a rate limit: the policy's
/// [`OnStoreError`](crate::OnStoreError) decides what the request gets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached (connection refused, pool exhausted, I/O error).
    #[error("rate-limit store unavailable: {0}")]
    Unavailable(#[source] Box<dyn StdError + Send + Sync>),
    /// The store did not answer within the configured time.
    #[error("rate-limit store did not answer within {0:?}")]
    Timeout(Duration),
    /// The store answered something that makes no sense (a script error, a malformed reply).
    #[error("rate-limit store answered unexpectedly: {0}")]
    Protocol(String),
}
