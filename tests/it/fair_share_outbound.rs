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
use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::fair::FairShare;
use tower_redis_ratelimit::outbound::OutboundLayer;
use tower_redis_ratelimit::{Key, MemoryStore, Policy, Rule, Store};

type Client = BoxCloneSyncService<Request<String>, Response<String>, BoxError>;

/// The vendor: what each tenant's calls reached it.
type Arrivals = Arc<Mutex<HashMap<String, u64>>>;

/// An instance's client of the vendor, limited by a budget of 40 calls a second shared by the
/// tenants of `x-tenant`, each weighing its `x-weight` (the vendor itself takes 10 000 a second).
fn client(store: impl Store, prefix: &str, vendor: Arrivals) -> Client {
    let policy = Policy::builder("vendor")
        .prefix(prefix)
        .key(Key::header("x-tenant"))
        .algorithm(tower_redis_ratelimit::Algorithm::SlidingLog)
        .rule(Rule::per_second(10_000))
        .fair_share(
            FairShare::new(Rule::per_second(40).named("budget")).weight_from_fn(|parts| {
                parts
                    .headers
                    .get("x-weight")
                    .and_then(|weight| weight.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }),
        )
        .build()
        .unwrap();
    let send = service_fn(move |request: Request<String>| {
        let vendor = vendor.clone();
        async move {
            let tenant = request.headers()["x-tenant"].to_str()?.to_owned();
            *vendor.lock().unwrap().entry(tenant).or_default() += 1;
            Ok::<_, BoxError>(Response::new(String::from("ok")))
        }
    });
    // (No margin: the budget's windows are whole seconds.)
    let layer = OutboundLayer::new(policy, store)
        .max_wait(Duration::from_secs(30))
        .margin(Duration::ZERO);
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(send))
}

/// A tenant calling from 6 loops, taking turns among the instances, until told to stop.
fn start(
    clients: &[Client],
    tenant: &'static str,
    weight: u32,
    stop: &Arc<AtomicBool>,
) -> Arc<AtomicU64> {
    let sent = Arc::new(AtomicU64::new(0));
    for index in 0..6 {
        let mut client = clients[index % clients.len()].clone();
        let (sent, stop) = (sent.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let request = Request::get("http://vendor.test/v1/chat")
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

async fn tenants_share_a_vendors_budget_by_weight(stores: [impl Store; 2], prefix: &str) {
    let vendor = Arrivals::default();
    let [one, two] = stores;
    let clients = [
        client(one, prefix, vendor.clone()),
        client(two, prefix, vendor.clone()),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let light = start(&clients, "light", 1, &stop);
    let heavy = start(&clients, "heavy", 3, &stop);
    // The first window saturates while running: shares from the next one.
    tokio::time::sleep(Duration::from_millis(1200)).await;
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
