//! [`ResponseFuture`]: checking (→ waiting for a slot) (→ delaying) → inner service → done.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{BoxError, Service};

use crate::concurrency::{Lease, LeasedBody};
use crate::limiter::{Admission, Charge, Checked, Limiter, Prepared, UnitsWait, Verdict};
use crate::response::LimitHeaders;
use crate::store::CheckFuture;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        // Waiting for a store that answers asynchronously.
        Checking {
            check: CheckFuture,
            waiting: Option<Waiting<S, ReqBody>>,
        },
        // Waiting for units a take in flight brings (a prefetching policy's hot identity).
        AwaitingUnits {
            wait: UnitsWait,
            waiting: Option<(S, Request<ReqBody>, Arc<Limiter>)>,
        },
        // Waiting for a concurrency slot (delay mode); boxed, as only such requests pay for it.
        WaitingForSlot {
            wait: SlotWait,
            waiting: Option<(S, Request<ReqBody>, Arc<Limiter>)>,
        },
        // Admitted by reservation: waiting for the reserved time, then the inner service runs.
        // (The timer is boxed: only delayed requests pay for its size.)
        Delaying {
            sleep: Pin<Box<tokio::time::Sleep>>,
            waiting: Option<Delayed<S, ReqBody>>,
        },
        // Admitted: the inner service runs; its response gets these headers, and its body the
        // concurrency slot's lease (released when the body is done); under count_only its status
        // settles the charge.
        Inner {
            #[pin]
            future: S::Future,
            headers: Option<LimitHeaders>,
            lease: Option<Lease>,
            charge: Option<Box<Charge>>,
        },
        // Answered without the inner service (429, 503, missing key).
        Done {
            response: Option<Response<Body>>,
        },
    }
}

/// [`Limiter::wait_for_slot`]'s future.
type SlotWait = Pin<Box<dyn Future<Output = Verdict> + Send>>;

/// What a request needs once its check completes.
struct Waiting<S, ReqBody> {
    service: S,
    request: Request<ReqBody>,
    limiter: Arc<Limiter>,
    checked: Checked,
}

/// What a delayed request needs once its time comes.
struct Delayed<S, ReqBody> {
    service: S,
    request: Request<ReqBody>,
    admission: Admission,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn inner(future: S::Future, admission: Admission) -> Self {
        ResponseFuture {
            state: State::inner(future, admission),
        }
    }

    pub(crate) fn respond(response: Response<Body>) -> Self {
        ResponseFuture {
            state: State::Done {
                response: Some(response),
            },
        }
    }

    pub(crate) fn delaying(
        delay: Duration,
        service: S,
        request: Request<ReqBody>,
        admission: Admission,
    ) -> Self {
        ResponseFuture {
            state: State::Delaying {
                sleep: Box::pin(tokio::time::sleep(delay)),
                waiting: Some(Delayed {
                    service,
                    request,
                    admission,
                }),
            },
        }
    }

    pub(crate) fn waiting_for_slot(
        wait: SlotWait,
        service: S,
        request: Request<ReqBody>,
        limiter: Arc<Limiter>,
    ) -> Self {
        ResponseFuture {
            state: State::WaitingForSlot {
                wait,
                waiting: Some((service, request, limiter)),
            },
        }
    }

    pub(crate) fn awaiting_units(
        wait: UnitsWait,
        service: S,
        request: Request<ReqBody>,
        limiter: Arc<Limiter>,
    ) -> Self {
        ResponseFuture {
            state: State::AwaitingUnits {
                wait,
                waiting: Some((service, request, limiter)),
            },
        }
    }

    pub(crate) fn checking(
        check: CheckFuture,
        service: S,
        request: Request<ReqBody>,
        limiter: Arc<Limiter>,
        checked: Checked,
    ) -> Self {
        ResponseFuture {
            state: State::Checking {
                check,
                waiting: Some(Waiting {
                    service,
                    request,
                    limiter,
                    checked,
                }),
            },
        }
    }
}

impl<S, ReqBody> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// The inner service running for an admitted request; under count_only its charge waits
    /// for the response's status (boxed: only such policies pay for its size).
    fn inner(future: S::Future, admission: Admission) -> Self {
        let charge = admission
            .charge
            .filter(Charge::settles_after_response)
            .map(|mut charge| {
                charge.answered(admission.decision);
                Box::new(charge)
            });
        State::Inner {
            future,
            headers: admission.headers,
            lease: admission.lease,
            charge,
        }
    }

    /// The state of a request prepared after waiting for units in flight: as `limit_call`
    /// would go on with it (the store's answer is awaited in `Checking`, even if it is ready).
    fn prepared(
        prepared: Prepared,
        limiter: Arc<Limiter>,
        mut service: S,
        request: Request<ReqBody>,
    ) -> Self {
        let (limiter, checked) = match prepared {
            Prepared::Check(checked) => (limiter, checked),
            Prepared::CheckBy(own, checked) => (own, checked),
            Prepared::Unlimited => {
                return State::inner(service.call(request), Admission::unchecked());
            }
            Prepared::Admit(admission) => return State::inner(service.call(request), admission),
            Prepared::Respond(answer) => {
                let response = Some(limiter.respond(&answer));
                return State::Done { response };
            }
            Prepared::RespondBy(own, answer) => {
                let response = Some(own.respond(&answer));
                return State::Done { response };
            }
            Prepared::AwaitUnits(_) => unreachable!("a request waits for units in flight once"),
        };
        if limiter.queues_first(&checked) {
            let wait = Box::pin(limiter.clone().wait_for_slot(checked, false));
            return State::WaitingForSlot {
                wait,
                waiting: Some((service, request, limiter)),
            };
        }
        State::checking(limiter, checked, service, request)
    }

    /// Asking the store about `checked`; the request waits with what it needs afterwards.
    fn checking(
        limiter: Arc<Limiter>,
        checked: Checked,
        service: S,
        request: Request<ReqBody>,
    ) -> Self {
        State::Checking {
            check: limiter.check(&checked),
            waiting: Some(Waiting {
                service,
                request,
                limiter,
                checked,
            }),
        }
    }

    /// The state after a final verdict: the inner service, a delay, or the answer.
    fn settled(
        verdict: Verdict,
        limiter: &Limiter,
        mut service: S,
        request: Request<ReqBody>,
    ) -> Self {
        match verdict {
            Verdict::Admit(admission) => State::inner(service.call(request), admission),
            Verdict::Delay(delay, admission) => State::Delaying {
                sleep: Box::pin(tokio::time::sleep(delay)),
                waiting: Some(Delayed {
                    service,
                    request,
                    admission,
                }),
            },
            Verdict::Respond(answer) => State::Done {
                response: Some(limiter.respond(&answer)),
            },
            Verdict::AwaitSlot | Verdict::Retake => {
                unreachable!(
                    "a slot is waited for, and a refused take asked again, before the verdict is final"
                )
            }
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Checking { check, waiting } => {
                    let result = ready!(Pin::new(check).poll(cx));
                    let Waiting {
                        service,
                        request,
                        limiter,
                        mut checked,
                    } = waiting
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    let next = match limiter.settle(result, &mut checked) {
                        Verdict::Retake => {
                            checked.exact();
                            State::checking(limiter, checked, service, request)
                        }
                        Verdict::AwaitSlot => State::WaitingForSlot {
                            wait: Box::pin(limiter.clone().wait_for_slot(checked, true)),
                            waiting: Some((service, request, limiter)),
                        },
                        verdict => State::settled(verdict, &limiter, service, request),
                    };
                    state.set(next);
                }
                StateProj::AwaitingUnits { wait, waiting } => {
                    let prepared = ready!(wait.as_mut().poll(cx));
                    let (service, request, limiter) = waiting
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    state.set(State::prepared(prepared, limiter, service, request));
                }
                StateProj::WaitingForSlot { wait, waiting } => {
                    let verdict = ready!(wait.as_mut().poll(cx));
                    let (service, request, limiter) = waiting
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    state.set(State::settled(verdict, &limiter, service, request));
                }
                StateProj::Delaying { sleep, waiting } => {
                    ready!(sleep.as_mut().poll(cx));
                    let Delayed {
                        mut service,
                        request,
                        admission,
                    } = waiting
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    state.set(State::inner(service.call(request), admission));
                }
                StateProj::Inner {
                    future,
                    headers,
                    lease,
                    charge,
                } => {
                    let response = ready!(future.poll(cx))?;
                    if let Some(charge) = charge.take() {
                        charge.settle(response.status());
                    }
                    let mut response = match lease.take() {
                        Some(lease) => response.map(|body| Body::new(LeasedBody::new(body, lease))),
                        None => response.map(Body::new),
                    };
                    if let Some(headers) = headers.take() {
                        headers.apply(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done { response } => {
                    return Poll::Ready(Ok(response
                        .take()
                        .expect("ResponseFuture polled after it completed")));
                }
            }
        }
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::AwaitingUnits { .. } => "AwaitingUnits",
            State::Checking { .. } => "Checking",
            State::WaitingForSlot { .. } => "WaitingForSlot",
            State::Delaying { .. } => "Delaying",
            State::Inner { .. } => "Inner",
            State::Done { .. } => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
