//! The layer among tower's parts: with `route_layer`, a `ServiceBuilder` and nesting (both layers'
//! items in one list of headers), `poll_ready` passed through to the inner service, the service
//! `Clone`, and a store answering asynchronously giving the answers of one that answers at once.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use common::{app, assert_refused, limits, policy, request_from, retry_after_secs, send};
use http::{Request, Response, StatusCode};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::store::{CheckFuture, CheckRequest};
use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, Rule, Store, layer::RateLimit};

const PEER: &str = "203.0.113.10:4000";

#[tokio::test]
async fn works_with_route_layer_service_builder_and_nesting() {
    let store = MemoryStore::new();
    let login = policy([Rule::per_hour(1)]).build().unwrap();
    let site = Policy::builder("site")
        .rule(Rule::per_hour(100).named("site-hourly"))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(|| async { "welcome" }))
        .route_layer(RateLimitLayer::new(login, store.clone()))
        .route("/open", get(|| async { "open" }))
        .layer(ServiceBuilder::new().layer(RateLimitLayer::new(site, store)));

    let mut login_request = request_from(PEER, "/login");
    *login_request.method_mut() = http::Method::POST;
    let response = send(&app, login_request).await;
    assert_eq!(response.status(), StatusCode::OK);
    // Both layers' items, appended into one list each.
    let state = limits(&response);
    let names: Vec<&str> = state.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["1-per-3600s", "site-hourly"]);
    assert_eq!(state.status("site-hourly").unwrap().remaining, 99);

    let mut again = request_from(PEER, "/login");
    *again.method_mut() = http::Method::POST;
    assert_eq!(
        send(&app, again).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The route layer doesn't cover /open.
    let open = send(&app, request_from(PEER, "/open")).await;
    assert_eq!(open.status(), StatusCode::OK);
    assert_eq!(limits(&open).policies.len(), 1);
}

/// A service that is ready only when told.
#[derive(Clone)]
struct Gate {
    open: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Service<Request<Body>> for Gate {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.open.load(Ordering::SeqCst) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(Body::from("through"))))
    }
}

#[tokio::test]
async fn poll_ready_passes_through_and_the_service_is_clone() {
    let gate = Gate {
        open: Arc::new(AtomicBool::new(false)),
        calls: Arc::new(AtomicUsize::new(0)),
    };
    let mut service = RateLimit::new(
        gate.clone(),
        policy([Rule::per_hour(1)]).build().unwrap(),
        MemoryStore::new(),
    );
    let mut cx = Context::from_waker(Waker::noop());
    assert!(service.poll_ready(&mut cx).is_pending());
    gate.open.store(true, Ordering::SeqCst);
    assert!(matches!(service.poll_ready(&mut cx), Poll::Ready(Ok(()))));

    let response = service
        .clone()
        .oneshot(request_from(PEER, "/"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let refused = service.oneshot(request_from(PEER, "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // The refused request never reached the inner service.
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
}

/// The memory store answering asynchronously, to drive the future's checking state.
#[derive(Clone)]
struct SlowStore(MemoryStore);

impl Store for SlowStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let mut answer = self.0.check(request);
        let result = answer
            .take_ready()
            .expect("the memory store answers at once");
        CheckFuture::from_future(async move {
            tokio::task::yield_now().await;
            result
        })
    }
}

#[tokio::test]
async fn an_asynchronous_store_gives_the_same_answers() {
    let app = app(
        policy([Rule::per_minute(3)]).build().unwrap(),
        SlowStore(MemoryStore::new()),
    );
    for remaining in [2, 1, 0] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            limits(&response).status("3-per-60s").unwrap().remaining,
            remaining
        );
    }
    let refused = send(&app, request_from(PEER, "/")).await;
    assert!((1..=60).contains(&retry_after_secs(&refused)));
    assert_refused(refused, &["3-per-60s"]).await;
}
