//! Fair shares on the way out (issue 62): tenants calling one vendor through an `OutboundLayer`
//! share its budget by weight. The layer counts its calls by upstream, as always; the policy's
//! key names each call's caller on the outgoing request. A call over its share waits (within the
//! layer's maximum wait) rather than fail, so each tenant's calls go at its share's pace. Two
//! instances (a layer each) over one store, on both stores, on the real clock.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store;
use http::Request;
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::outbound::{OutboundError, OutboundLayer};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Rule, Store};

use crate::fair_share::weighed_by_header;
use crate::outbound::{Client, client_of, second_client_of};

/// The vendor, on a free port: what each tenant's calls reached it (by `x-tenant`), and its URL.
async fn vendor() -> (Arc<Mutex<HashMap<String, u64>>>, String) {
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    let noted = arrivals.clone();
    let app = axum::Router::new().route(
        "/v1/chat",
        axum::routing::get(move |headers: http::HeaderMap| {
            let tenant = headers["x-tenant"].to_str().unwrap().to_owned();
            *noted.lock().unwrap().entry(tenant).or_default() += 1;
            async { "ok" }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/chat", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (arrivals, url)
}

/// An instance's layer for the vendor: a budget of 40 calls a second shared by the tenants of
/// `x-tenant`, each weighing its `x-weight` (the vendor itself takes 10 000 a second).
fn layer(store: impl Store, prefix: &str) -> OutboundLayer {
    let policy = Policy::builder("vendor")
        .prefix(prefix)
        .key(Key::header("x-tenant"))
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_second(10_000))
        .fair_share(weighed_by_header(Rule::per_second(40).named("budget")))
        .build()
        .unwrap();
    // (No margin: the budget's windows are whole seconds.)
    OutboundLayer::new(policy, store)
        .max_wait(Duration::from_secs(30))
        .margin(Duration::ZERO)
}

/// A tenant calling from 6 loops, taking turns among the instances, until told to stop.
fn start(
    clients: &[Client],
    url: &str,
    tenant: &'static str,
    weight: u32,
    stop: &Arc<AtomicBool>,
) -> Arc<AtomicU64> {
    let sent = Arc::new(AtomicU64::new(0));
    for index in 0..6 {
        let mut client = clients[index % clients.len()].clone();
        let (sent, stop, url) = (sent.clone(), stop.clone(), url.to_owned());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let request = Request::get(&url)
                    .header("x-tenant", tenant)
                    .header("x-weight", weight.to_string())
                    .body(String::new())
                    .unwrap();
                let response = client.ready().await.unwrap().call(request).await;
                response.unwrap_or_else(|error| panic!("{tenant}: {error}"));
                sent.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    sent
}

/// Two instances: one a tower client, the other (with `reqwest-middleware`) a reqwest
/// middleware, so both doors name their calls' callers.
async fn tenants_share_a_vendors_budget_by_weight(stores: [impl Store; 2], prefix: &str) {
    let (vendor, url) = vendor().await;
    let [one, two] = stores;
    let clients = [
        client_of(layer(one, prefix)),
        second_client_of(layer(two, prefix)),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let light = start(&clients, &url, "light", 1, &stop);
    let heavy = start(&clients, &url, "heavy", 3, &stop);
    // The first window saturates while running: shares from the next one.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    crate::fair_share::mid_second().await;
    let before = (light.load(Ordering::Relaxed), heavy.load(Ordering::Relaxed));
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let rates = (
        (light.load(Ordering::Relaxed) - before.0) as f64 / elapsed,
        (heavy.load(Ordering::Relaxed) - before.1) as f64 / elapsed,
    );
    stop.store(true, Ordering::Relaxed);
    // 40 a second shared 1:3: 10 and 30.
    assert!((9.0..=11.0).contains(&rates.0), "light: {rates:?}");
    assert!((27.0..=33.0).contains(&rates.1), "heavy: {rates:?}");
    assert!(rates.0 + rates.1 >= 0.95 * 40.0, "{rates:?}");
    // Every call sent reached the vendor, by its tenant.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let arrivals = vendor.lock().unwrap().clone();
    assert!(
        arrivals["light"] >= light.load(Ordering::Relaxed),
        "{arrivals:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_a_vendors_budget_by_weight_in_memory() {
    let store = MemoryStore::new();
    tenants_share_a_vendors_budget_by_weight([store.clone(), store], "rl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_a_vendors_budget_by_weight_on_redis() {
    let redis = TestRedis::shared();
    tenants_share_a_vendors_budget_by_weight(
        [redis_store::store(&redis), redis_store::store(&redis)],
        &unique_prefix("fair-outbound"),
    )
    .await;
}

/// A request of `tenant` to `url`.
fn call_of(url: &str, tenant: &str) -> Request<String> {
    Request::get(url)
        .header("x-tenant", tenant)
        .body(String::new())
        .unwrap()
}

/// A pause the vendor announces to one instance holds the other's calls, under a fair share
/// too: the pause is kept where the calls' checks see it (on Redis, under the budget's tag).
async fn a_pause_holds_every_instances_calls(stores: [impl Store; 2], prefix: &str) {
    let app = axum::Router::new().route(
        "/v1/chat",
        axum::routing::get(|| async {
            (
                http::StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "30")],
                "slow down",
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/chat", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let [one, two] = stores;
    let mut first = client_of(layer(one, prefix));
    let mut second = client_of(layer(two, prefix).max_wait(Duration::from_secs(1)));
    let answer = first
        .ready()
        .await
        .unwrap()
        .call(call_of(&url, "a"))
        .await
        .unwrap();
    assert_eq!(answer.status(), http::StatusCode::TOO_MANY_REQUESTS);
    let held = second
        .ready()
        .await
        .unwrap()
        .call(call_of(&url, "b"))
        .await
        .expect_err("the pause holds the other instance's call");
    assert!(
        matches!(
            held.downcast_ref::<OutboundError>(),
            Some(OutboundError::WouldWait { retry_after, .. }) if *retry_after > Duration::from_secs(20)
        ),
        "{held}"
    );
}

#[tokio::test]
async fn a_pause_holds_every_instances_calls_in_memory() {
    let store = MemoryStore::new();
    a_pause_holds_every_instances_calls([store.clone(), store], "rl").await;
}

#[tokio::test]
async fn a_pause_holds_every_instances_calls_on_redis() {
    let redis = TestRedis::shared();
    a_pause_holds_every_instances_calls(
        [redis_store::store(&redis), redis_store::store(&redis)],
        &unique_prefix("fair-pause"),
    )
    .await;
}
