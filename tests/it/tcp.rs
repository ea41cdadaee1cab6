//! The layer behind a real TCP socket on loopback, driven by an HTTP client, in real time.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use reqwest::StatusCode;
use tower_redis_ratelimit::headers::{self, RateLimitHeaders};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, RateLimitLayer, Rule};

/// Serves `policy` on a free loopback port with connect info, as a real deployment does.
async fn serve(policy: Policy) -> SocketAddr {
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()));
    common::serve(app).await
}

/// A client that talks to loopback directly, whatever `HTTP_PROXY` says.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client")
}

struct Reply {
    status: StatusCode,
    limits: RateLimitHeaders,
    retry_after: Option<u64>,
    body: String,
}

async fn get_once(client: &reqwest::Client, addr: SocketAddr, forwarded: Option<&str>) -> Reply {
    let mut request = client.get(format!("http://{addr}/"));
    if let Some(chain) = forwarded {
        request = request.header("x-forwarded-for", chain);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status();
    let limits = headers::parse(response.headers()).expect("well-formed headers");
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().parse().unwrap());
    let body = response.text().await.unwrap();
    Reply {
        status,
        limits,
        retry_after,
        body,
    }
}

fn violated(reply: &Reply) -> Vec<String> {
    let body: serde_json::Value = serde_json::from_str(&reply.body).expect("a problem body");
    serde_json::from_value(body["violated-policies"].clone()).unwrap()
}

#[tokio::test]
async fn seed_curl_loop_over_tcp() {
    let addr = serve(
        Policy::builder("curl")
            .rule(Rule::per_minute(20))
            .build()
            .unwrap(),
    )
    .await;
    let client = client();
    for n in 1..=20u64 {
        let reply = get_once(&client, addr, None).await;
        assert_eq!(reply.status, StatusCode::OK, "request {n}");
        assert_eq!(reply.body, "hello");
        assert_eq!(reply.limits.status("20-per-60s").unwrap().remaining, 20 - n);
    }
    for n in 21..=22 {
        let reply = get_once(&client, addr, None).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "request {n}");
        let retry = reply.retry_after.expect("Retry-After on a 429");
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
        assert_eq!(violated(&reply), ["20-per-60s"]);
    }
}

/// 2 per second AND 5 per 10 seconds over a few seconds of real time (sliding log). Each phase
/// waits 1.2 s after the last admission it depends on, so a slow machine only makes it longer.
#[tokio::test]
async fn two_rules_in_real_time() {
    let addr = serve(
        Policy::builder("two")
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_second(2))
            .rule(Rule::new(5, Duration::from_secs(10)))
            .build()
            .unwrap(),
    )
    .await;
    let client = client();
    let settle = Duration::from_millis(1_200);

    // Phase 1: two pass, the third is refused by the per-second rule for under a second.
    let before_first = Instant::now();
    assert_eq!(get_once(&client, addr, None).await.status, StatusCode::OK);
    let after_first = Instant::now();
    assert_eq!(get_once(&client, addr, None).await.status, StatusCode::OK);
    let after_second = Instant::now();
    let refused = get_once(&client, addr, None).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.retry_after, Some(1));
    assert_eq!(violated(&refused), ["2-per-1s"]);
    assert_eq!(refused.limits.status("5-per-10s").unwrap().remaining, 3);

    // Phase 2: once both are over a second old, two more pass; the per-second rule binds again.
    tokio::time::sleep_until((after_second + settle).into()).await;
    for _ in 0..2 {
        assert_eq!(get_once(&client, addr, None).await.status, StatusCode::OK);
    }
    let after_fourth = Instant::now();
    let refused = get_once(&client, addr, None).await;
    assert_eq!(refused.retry_after, Some(1));
    assert_eq!(violated(&refused), ["2-per-1s"]);

    // Phase 3: the fifth passes; now only the 10-second rule refuses, until the first is 10 s old.
    tokio::time::sleep_until((after_fourth + settle).into()).await;
    let fifth = get_once(&client, addr, None).await;
    assert_eq!(fifth.status, StatusCode::OK);
    assert_eq!(fifth.limits.status("5-per-10s").unwrap().remaining, 0);
    let before_refusal = Instant::now();
    let refused = get_once(&client, addr, None).await;
    let after_refusal = Instant::now();
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&refused), ["5-per-10s"]);
    assert_eq!(refused.limits.status("2-per-1s").unwrap().remaining, 1);
    // The first admission happened between `before_first` and `after_first` and leaves the window
    // 10 s later; the refusal between `before_refusal` and `after_refusal`.
    let window = Duration::from_secs(10);
    let shortest = (before_first + window).saturating_duration_since(after_refusal);
    let longest = (after_first + window).saturating_duration_since(before_refusal);
    let retry = refused.retry_after.unwrap();
    assert!(
        (shortest.as_secs()..=longest.as_secs() + 1).contains(&retry) && retry >= 1,
        "Retry-After {retry}, expected between {shortest:?} and {longest:?} rounded up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_clients_get_exactly_fifty() {
    let addr = serve(
        Policy::builder("race")
            .rule(Rule::per_hour(50))
            .build()
            .unwrap(),
    )
    .await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                // A client each: separate connections racing on the server.
                let client = client();
                barrier.wait().await;
                get_once(&client, addr, None).await.status
            })
        })
        .collect();
    assert_eq!(common::admitted_and_refused(tasks).await, (50, 150));
}

#[tokio::test]
async fn spoofed_forwarded_for_over_tcp_changes_nothing() {
    // No trusted proxies: the loopback peer is the client, whatever it claims.
    let addr = serve(
        Policy::builder("spoof")
            .rule(Rule::per_hour(3))
            .build()
            .unwrap(),
    )
    .await;
    let client = client();
    for (n, chain) in ["192.0.2.1", "192.0.2.2", "192.0.2.3"].iter().enumerate() {
        let reply = get_once(&client, addr, Some(chain)).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(
            reply.limits.status("3-per-3600s").unwrap().remaining,
            2 - n as u64
        );
    }
    let reply = get_once(&client, addr, Some("192.0.2.4")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
}
