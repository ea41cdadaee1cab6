//! [`ResponseFuture`]: deciding (the limiter's, when the store answers later) → inner service →
//! done.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{BoxError, Service};

use crate::limiter::{Deciding, OnResponse, Resolved};

pin_project! {
    /// The response future of [`RateLimit`](crate::layer::RateLimit).
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
        // The limiter deciding (a store answering later, units in flight, a slot, a delay); the
        // request waits with the service that was polled ready for it.
        // Boxed: only a request that waits (a remote store's answer, a slot, a delay) pays for
        // it, and the future of every other stays small (it is moved a few times on its way).
        Deciding {
            waiting: Option<Box<(Deciding, S, Request<ReqBody>)>>,
        },
        // Admitted: the inner service runs; its response gets what the admission holds.
        Inner {
            #[pin]
            future: S::Future,
            on_response: Option<OnResponse>,
        },
        // Answered by the limiter (429, 503, missing key).
        Done {
            response: Option<Response<Body>>,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn inner(future: S::Future, on_response: OnResponse) -> Self {
        ResponseFuture {
            state: State::Inner {
                future,
                on_response: Some(on_response),
            },
        }
    }

    pub(crate) fn respond(response: Response<Body>) -> Self {
        ResponseFuture {
            state: State::Done {
                response: Some(response),
            },
        }
    }

    pub(crate) fn deciding(deciding: Deciding, service: S, request: Request<ReqBody>) -> Self {
        ResponseFuture {
            state: State::Deciding {
                waiting: Some(Box::new((deciding, service, request))),
            },
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
                StateProj::Deciding { waiting } => {
                    let (deciding, _, _) = &mut **waiting
                        .as_mut()
                        .expect("ResponseFuture polled after it completed");
                    let settled = ready!(Pin::new(deciding).poll(cx));
                    let (_, mut service, mut request) = *waiting
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    state.set(match settled {
                        Resolved::Admitted(admission) => State::Inner {
                            on_response: Some(admission.on_call(request.extensions_mut())),
                            future: service.call(request),
                        },
                        Resolved::Answered(answered) => State::Done {
                            response: Some(answered.response()),
                        },
                    });
                }
                StateProj::Inner {
                    future,
                    on_response,
                } => {
                    let response = ready!(future.poll(cx))?;
                    let on_response = on_response
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    return Poll::Ready(Ok(on_response.apply(response)));
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
            State::Deciding { .. } => "Deciding",
            State::Inner { .. } => "Inner",
            State::Done { .. } => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
