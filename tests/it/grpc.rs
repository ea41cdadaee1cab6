//! gRPC behind the layer: real tonic clients, over h2c, against the standard health service
//! (`tonic-health`) served next to axum routes on one port and limited by the same layer. Refused
//! calls are `RESOURCE_EXHAUSTED` with a pushback and (feature `grpc`) a rich status; a fail-closed
//! store that is down is `UNAVAILABLE`; HTTP and gRPC calls of one client draw from one budget.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, free_port, unique_prefix};
use http::StatusCode;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower_redis_ratelimit::store::RedisStore;
use tower_redis_ratelimit::{
    Key, MemoryStore, Mode, OnStoreError, Policy, PolicyBuilder, RateLimitLayer, Rule, Store,
};

const CHECK: &str = "/grpc.health.v1.Health/Check";

/// The app most services that speak both have: an HTTP route and a gRPC service (the health
/// service, SERVING) on one router, so one port serves HTTP/1.1 and h2c.
fn http_and_grpc() -> Router {
    let (_reporter, health) = tonic_health::server::health_reporter();
    Router::new()
        .route("/api/ping", get(|| async { "pong" }))
        .merge(tonic::service::Routes::new(health).into_axum_router())
}

/// `http_and_grpc` limited by `policy` in `store`, served on a free loopback port.
async fn serve(policy: Policy, store: impl Store) -> SocketAddr {
    common::serve(http_and_grpc().layer(RateLimitLayer::new(policy, store))).await
}

async fn health_client(addr: SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a URI")
        .connect()
        .await
        .expect("an h2c connection");
    HealthClient::new(channel)
}

async fn check(client: &mut HealthClient<Channel>) -> Result<HealthCheckResponse, tonic::Status> {
    let request = HealthCheckRequest {
        service: String::new(),
    };
    client.check(request).await.map(tonic::Response::into_inner)
}

fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn ping(client: &reqwest::Client, addr: SocketAddr) -> reqwest::Response {
    client
        .get(format!("http://{addr}/api/ping"))
        .send()
        .await
        .expect("an HTTP answer")
}

fn per_minute(name: &str, limit: u64) -> PolicyBuilder {
    Policy::builder(name)
        .key(Key::ip())
        .rule(Rule::per_minute(limit))
        .message("Too many health checks, slow down.")
}

fn metadata<'a>(status: &'a tonic::Status, name: &str) -> Option<&'a str> {
    status
        .metadata()
        .get(name)
        .and_then(|value| value.to_str().ok())
}

/// The refusal of the third call of 2 per minute, as a gRPC client sees it.
fn assert_resource_exhausted(status: &tonic::Status) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "Too many health checks, slow down.");
    let pushback: u64 = metadata(status, "grpc-retry-pushback-ms")
        .expect("a pushback")
        .parse()
        .expect("milliseconds");
    assert!((1..=60_000).contains(&pushback), "{pushback}");
    // The HTTP headers are there too, as metadata: Retry-After is the pushback rounded up.
    let retry_after: u64 = metadata(status, "retry-after").unwrap().parse().unwrap();
    assert_eq!(retry_after, pushback.div_ceil(1000));
    assert!(metadata(status, "ratelimit").unwrap().contains("r=0"));
    #[cfg(feature = "grpc")]
    {
        use tonic_types::StatusExt;
        let details = status
            .check_error_details()
            .expect("rich details that decode");
        let retry = details.retry_info().expect("a RetryInfo");
        assert_eq!(retry.retry_delay, Some(Duration::from_millis(pushback)));
        let violations = &details.quota_failure().expect("a QuotaFailure").violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].subject, "health");
        assert_eq!(violations[0].quota_id, "2-per-60s");
        assert_eq!(violations[0].quota_value, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_admitted_with_metadata_then_refused_as_resource_exhausted() {
    let addr = serve(per_minute("health", 2).build().unwrap(), MemoryStore::new()).await;
    let mut client = health_client(addr).await;

    for remaining in [1, 0] {
        let request = HealthCheckRequest {
            service: String::new(),
        };
        let response = client.check(request).await.expect("admitted");
        let initial = response.metadata();
        assert_eq!(
            initial.get("ratelimit-policy").unwrap(),
            "\"2-per-60s\";q=2;w=60"
        );
        let status = initial.get("ratelimit").unwrap().to_str().unwrap();
        assert!(status.contains(&format!("r={remaining}")), "{status}");
        assert_eq!(response.into_inner().status(), ServingStatus::Serving);
    }
    let refused = check(&mut client).await.expect_err("refused");
    assert_resource_exhausted(&refused);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_grpc_call_is_one_trailers_only_answer() {
    let addr = serve(per_minute("health", 1).build().unwrap(), MemoryStore::new()).await;
    let mut client = health_client(addr).await;
    check(&mut client).await.expect("admitted");

    // The same call by hand, to see the HTTP answer itself.
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let request = http::Request::post(format!("http://{addr}{CHECK}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(http_body_util::Full::new(
            bytes::Bytes::from_static(&[0, 0, 0, 0, 0]),
        )))
        .unwrap();
    let response = tower::ServiceExt::oneshot(channel, request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers();
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(
        headers["grpc-message"],
        "Too many health checks, slow down."
    );
    assert!(headers.contains_key("grpc-retry-pushback-ms"));
    assert_eq!(
        headers.contains_key("grpc-status-details-bin"),
        cfg!(feature = "grpc")
    );
    // One HEADERS frame that ends the stream: no DATA frame, no trailers after it.
    assert!(
        http_body::Body::is_end_stream(response.body()),
        "trailers-only"
    );
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap();
    assert!(body.trailers().is_none());
    assert!(body.to_bytes().is_empty());

    // A gRPC-Web call (over HTTP/1.1, as browsers send them) gets the same answer, in its own
    // content-type, which gRPC-Web clients check.
    let web = http_client()
        .post(format!("http://{addr}{CHECK}"))
        .header("content-type", "application/grpc-web+proto")
        .header("x-grpc-web", "1")
        .body(vec![0u8; 5])
        .send()
        .await
        .unwrap();
    assert_eq!(web.status(), StatusCode::OK);
    assert_eq!(web.headers()["content-type"], "application/grpc-web+proto");
    assert_eq!(web.headers()["grpc-status"], "8");
    assert!(web.bytes().await.unwrap().is_empty());
}

/// A custom 429 is for HTTP clients: a gRPC call still gets its gRPC answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_rejection_answers_http_and_grpc_calls_still_get_grpc_answers() {
    let policy = per_minute("health", 2).build().unwrap();
    let layer = RateLimitLayer::new(policy, MemoryStore::new()).on_rejected(|_| {
        let mut response = http::Response::new(axum::body::Body::from("custom"));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        response
    });
    let addr = common::serve(http_and_grpc().layer(layer)).await;
    let (mut grpc, http) = (health_client(addr).await, http_client());
    check(&mut grpc).await.expect("the first of 2");
    assert_eq!(ping(&http, addr).await.status(), StatusCode::OK);
    let refused = ping(&http, addr).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.text().await.unwrap(), "custom");
    let refused = check(&mut grpc).await.expect_err("refused");
    assert_resource_exhausted(&refused);
}

/// HTTP and gRPC of one client (one IP) on one port count against one budget: 3 per minute, in
/// any mix of the two, then both are refused, each in its own protocol's words.
async fn http_and_grpc_share_one_budget(store: impl Store, prefix: &str) {
    let policy = per_minute("health", 3).prefix(prefix).build().unwrap();
    let addr = serve(policy, store).await;
    let (mut grpc, http) = (health_client(addr).await, http_client());

    assert_eq!(ping(&http, addr).await.status(), StatusCode::OK);
    check(&mut grpc).await.expect("the second of 3");
    assert_eq!(ping(&http, addr).await.status(), StatusCode::OK);

    let refused = check(&mut grpc).await.expect_err("the fourth");
    assert_resource_exhausted_of(&refused, 3);
    // HTTP's answer is as it always was: a 429 with a problem body.
    let refused = ping(&http, addr).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert!(refused.headers().contains_key("retry-after"));
}

fn assert_resource_exhausted_of(status: &tonic::Status, limit: u64) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let policy = metadata(status, "ratelimit-policy").unwrap();
    assert!(policy.contains(&format!("q={limit}")), "{policy}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_grpc_share_one_budget_in_memory() {
    http_and_grpc_share_one_budget(MemoryStore::new(), "rl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_grpc_share_one_budget_in_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("grpc-budget");
    let store = RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_secs(10));
    http_and_grpc_share_one_budget(store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_store_that_is_down_is_unavailable_to_grpc_and_503_to_http() {
    // Nothing listens on this port: every check is a store failure.
    let store = RedisStore::from_url(&format!("redis://127.0.0.1:{}/", free_port()))
        .unwrap()
        .timeout(Duration::from_millis(500));
    let policy = per_minute("health", 100)
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let addr = serve(policy, store).await;

    let status = check(&mut health_client(addr).await)
        .await
        .expect_err("refused while the store is down");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "The rate limiter cannot reach its store.");
    assert_eq!(
        ping(&http_client(), addr).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_no_wait_could_admit_is_told_not_to_retry() {
    let policy = per_minute("health", 2)
        .cost_from_fn(|parts| {
            parts
                .headers
                .get("x-cost")
                .and_then(|value| value.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let addr = serve(policy, MemoryStore::new()).await;
    let mut client = health_client(addr).await;
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request
        .metadata_mut()
        .insert("x-cost", "5".parse().unwrap());
    let status = client.check(request).await.expect_err("too costly");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("costs 5 units"),
        "{}",
        status.message()
    );
    // gRFC A6: a negative pushback asks the client not to retry at all.
    assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), Some("-1"));
    #[cfg(feature = "grpc")]
    {
        use tonic_types::StatusExt;
        let details = status.check_error_details().unwrap();
        assert!(details.retry_info().is_none(), "no wait helps");
        assert_eq!(
            details.quota_failure().unwrap().violations[0].quota_value,
            2
        );
    }
    // A call it can admit still is.
    check(&mut client).await.expect("a call of cost 1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_call_holds_its_concurrency_slot_until_its_stream_ends() {
    let policy = Policy::builder("watch")
        .key(Key::ip())
        .max_in_flight(1)
        // Far longer than the test: the slot must come back when the stream ends, not expire.
        .lease(Duration::from_secs(600))
        .build()
        .unwrap();
    let addr = serve(policy, MemoryStore::new()).await;
    let mut client = health_client(addr).await;
    let request = HealthCheckRequest {
        service: String::new(),
    };
    let mut stream = client.watch(request).await.expect("admitted").into_inner();
    let first = stream.message().await.unwrap().expect("the current status");
    assert_eq!(first.status(), ServingStatus::Serving);

    // The watch is still open: its slot is taken.
    let refused = check(&mut client)
        .await
        .expect_err("no slot while watching");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");

    // Ending the stream frees the slot (the server sees the reset and drops the body).
    drop(stream);
    let started = Instant::now();
    loop {
        match check(&mut client).await {
            Ok(_) => break,
            Err(status) if started.elapsed() < Duration::from_secs(10) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("the slot was never freed: {status:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_mode_delays_a_unary_call_rather_than_refusing_it() {
    let policy = Policy::builder("delayed")
        .key(Key::ip())
        .rule(Rule::new(1, Duration::from_millis(400)))
        .mode(Mode::Delay {
            max_delay: Duration::from_secs(5),
        })
        .build()
        .unwrap();
    let addr = serve(policy, MemoryStore::new()).await;
    let mut client = health_client(addr).await;
    check(&mut client).await.expect("the first");
    let started = Instant::now();
    let second = check(&mut client).await.expect("delayed, then admitted");
    assert_eq!(second.status(), ServingStatus::Serving);
    // It waited for the next window rather than being answered at once (a lower bound only).
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
}

/// A configuration route that lists an HTTP path and a gRPC method: one policy, one count per
/// identity, whichever transport a call comes by (axum routes the gRPC service by a wildcard, so
/// the layer finds the method by the request's own path).
#[cfg(feature = "config")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_route_of_an_http_path_and_a_grpc_method_has_one_budget() {
    let config = tower_redis_ratelimit::config::RateLimitConfig::from_toml_str(
        r#"
        [[routes]]
        name = "health"
        paths = ["/api/ping", "/grpc.health.v1.Health/Check"]
        rules = [{ limit = 3, period = "1m" }]
        "#,
    )
    .unwrap();
    let addr = common::serve(config.apply(http_and_grpc()).unwrap()).await;
    let (mut grpc, http) = (health_client(addr).await, http_client());

    check(&mut grpc).await.expect("the first of 3");
    assert_eq!(ping(&http, addr).await.status(), StatusCode::OK);
    check(&mut grpc).await.expect("the third of 3");
    assert_eq!(
        ping(&http, addr).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let refused = check(&mut grpc).await.expect_err("over the shared budget");
    assert_resource_exhausted_of(&refused, 3);
    // The health service's other method isn't listed: unlimited.
    let request = HealthCheckRequest {
        service: String::new(),
    };
    let watch = grpc.watch(request).await.expect("not limited");
    assert!(watch.metadata().get("ratelimit").is_none());
}

/// An upstream whose every health check is refused, trailers-only, with these headers.
async fn refusing_upstream(headers: Vec<(&'static str, String)>) -> SocketAddr {
    let refuse = move || {
        let headers = headers.clone();
        async move {
            let mut response = http::Response::new(axum::body::Body::empty());
            for (name, value) in headers {
                response
                    .headers_mut()
                    .insert(name, http::HeaderValue::from_str(&value).unwrap());
            }
            response
        }
    };
    common::serve(Router::new().route(CHECK, axum::routing::post(refuse))).await
}

/// The outbound layer around a tonic `Channel` learns a pause from the upstream's
/// `RESOURCE_EXHAUSTED`, by its pushback or its `RetryInfo`: the next call isn't sent, it fails
/// at once saying when to try again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbound_layer_learns_a_pause_from_a_grpc_upstreams_refusal() {
    use tower_redis_ratelimit::outbound::{OutboundError, OutboundLayer};

    let refusal = |more: (&'static str, String)| {
        vec![
            ("content-type", "application/grpc".to_owned()),
            ("grpc-status", "8".to_owned()),
            ("grpc-message", "slow%20down".to_owned()),
            more,
        ]
    };
    #[cfg_attr(not(feature = "grpc"), allow(unused_mut))]
    let mut upstreams = vec![(
        "pushback",
        refusal(("grpc-retry-pushback-ms", "30000".into())),
    )];
    #[cfg(feature = "grpc")]
    {
        use tonic_types::{ErrorDetails, StatusExt};
        let details = ErrorDetails::with_retry_info(Some(Duration::from_secs(30)));
        let status = tonic::Status::with_error_details(Code::ResourceExhausted, "slow", details);
        let mut headers = http::HeaderMap::new();
        status.add_header(&mut headers).unwrap();
        let bin = headers["grpc-status-details-bin"]
            .to_str()
            .unwrap()
            .to_owned();
        upstreams.push(("RetryInfo", refusal(("grpc-status-details-bin", bin))));
    }
    for (told_by, headers) in upstreams {
        let addr = refusing_upstream(headers).await;
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let ours = Policy::builder("health-upstream")
            .rule(Rule::per_second(100))
            .build()
            .unwrap();
        let outbound =
            OutboundLayer::new(ours, MemoryStore::new()).max_wait(Duration::from_secs(1));
        let service = tower::ServiceBuilder::new()
            .layer(outbound)
            .service(channel);
        let mut client = HealthClient::new(service);
        let request = || HealthCheckRequest {
            service: String::new(),
        };
        let refused = client.check(request()).await.expect_err("refused upstream");
        assert_eq!(
            refused.code(),
            Code::ResourceExhausted,
            "{told_by}: {refused:?}"
        );

        // Held back here, for the 30 s asked (less the moment since).
        let held = client.check(request()).await.expect_err("held back here");
        let error = std::error::Error::source(&held)
            .and_then(|source| source.downcast_ref::<OutboundError>());
        match error {
            Some(OutboundError::WouldWait { retry_after, .. }) => assert!(
                (Duration::from_secs(20)..=Duration::from_secs(30)).contains(retry_after),
                "{told_by}: {retry_after:?}"
            ),
            other => panic!("{told_by}: {other:?} ({held:?})"),
        }
    }
}
