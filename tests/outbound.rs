//! Outbound limiting against a local upstream that timestamps every request: clients that share a
//! store never send more than the policy allows in any window, and a request that would wait too
//! long fails at once.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use http::{Request, Response};
use tokio::net::TcpListener;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::outbound::{OutboundError, OutboundLayer};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, PolicyError, RedisStore, Rule, Store};

/// An upstream on a free port that notes when each request arrived.
async fn upstream() -> (String, Arc<Mutex<Vec<Instant>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let noted = arrivals.clone();
    let app = Router::new().route(
        "/quote",
        get(move || {
            noted.lock().unwrap().push(Instant::now());
            async { "42" }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/quote", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, arrivals)
}

type Client = BoxCloneSyncService<Request<String>, Response<String>, BoxError>;

/// A reqwest client as a tower service, limited by `policy` in `store`.
fn client(policy: Policy, store: impl Store, max_wait: Duration) -> Client {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let send = service_fn(move |request: Request<String>| {
        let http = http.clone();
        async move {
            let response = http.execute(reqwest::Request::try_from(request)?).await?;
            let status = response.status().as_u16();
            let body = response.text().await?;
            Ok::<_, BoxError>(Response::builder().status(status).body(body)?)
        }
    });
    let limited = ServiceBuilder::new()
        .layer(OutboundLayer::new(policy, store).max_wait(max_wait))
        .service(send);
    BoxCloneSyncService::new(limited)
}

fn five_per_second(prefix: &str) -> Policy {
    Policy::builder("quotes")
        .prefix(prefix)
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_second(5))
        .build()
        .unwrap()
}

/// Sends `count` GETs to `url` through `client`, `concurrency` at a time; the statuses.
async fn send_all(client: Client, url: &str, count: usize, concurrency: usize) -> Vec<u16> {
    let semaphore = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let tasks: Vec<_> = (0..count)
        .map(|_| {
            let (mut client, url, semaphore) = (client.clone(), url.to_owned(), semaphore.clone());
            tokio::spawn(async move {
                let _permit = semaphore.acquire_owned().await.unwrap();
                let request = Request::get(url).body(String::new()).unwrap();
                let response = client.ready().await.unwrap().call(request).await.unwrap();
                response.status().as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    statuses
}

/// No six arrivals within one second, as the upstream counts them (the layer's margin absorbs
/// the jitter between counting and arriving).
fn assert_at_most_five_a_second(arrivals: &[Instant]) {
    let mut arrivals = arrivals.to_vec();
    arrivals.sort();
    for (index, window) in arrivals.windows(6).enumerate() {
        let span = window[5] - window[0];
        assert!(
            span >= Duration::from_secs(1),
            "arrivals {index}..={}: six within {span:?}",
            index + 5
        );
    }
}

/// Two clients sharing `stores`' counts, `each` requests apiece, 10 in flight each.
async fn two_clients_share_the_limit(stores: [Arc<dyn Store>; 2], prefix: &str, each: usize) {
    let (url, arrivals) = upstream().await;
    let [a, b] =
        stores.map(|store| client(five_per_second(prefix), store, Duration::from_secs(60)));
    let started = Instant::now();
    let (from_a, from_b) = tokio::join!(send_all(a, &url, each, 10), send_all(b, &url, each, 10));
    assert!(from_a.iter().chain(&from_b).all(|status| *status == 200));
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2 * each);
    assert_at_most_five_a_second(&arrivals);
    // And not much slower than the limit allows: 5 a second from the start.
    let floor = Duration::from_millis((2 * each as u64 - 5) * 200);
    assert!(started.elapsed() >= floor, "{:?}", started.elapsed());
    assert!(
        started.elapsed() < floor + Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_on_one_redis_send_at_most_five_a_second_together() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("outbound");
    let store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::from_url(&redis.url)
                .unwrap()
                .timeout(Duration::from_secs(10)),
        )
    };
    two_clients_share_the_limit([store(), store()], &prefix, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_on_one_memory_store_send_at_most_five_a_second_together() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    two_clients_share_the_limit([store.clone(), store], "mem", 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_past_the_maximum_wait_fails_at_once_and_says_when() {
    let (url, arrivals) = upstream().await;
    let max_wait = Duration::from_millis(1_100);
    let mut limited = client(five_per_second("late"), MemoryStore::new(), max_wait);
    let started = Instant::now();
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        let request = Request::get(&url).body(String::new()).unwrap();
        let call = limited.ready().await.unwrap().call(request);
        // Sent one after another: each waits for its slot before the next asks.
        outcomes.push(tokio::spawn(call));
    }
    let mut sent = 0;
    let mut refused = Vec::new();
    for outcome in outcomes {
        match outcome.await.unwrap() {
            Ok(response) => {
                assert_eq!(response.status(), 200);
                sent += 1;
            }
            Err(error) => match error.downcast::<OutboundError>() {
                Ok(error) => match *error {
                    OutboundError::WouldWait {
                        upstream,
                        retry_after,
                    } => {
                        assert!(upstream.starts_with("127.0.0.1:"), "{upstream}");
                        refused.push(retry_after);
                    }
                    other => panic!("{other}"),
                },
                Err(error) => panic!("{error}"),
            },
        }
    }
    // Slots within the wait: the 5 at once and the 5 of the next second (1.02 s away, periods
    // being counted 20 ms longer).
    assert_eq!(sent, 10, "{refused:?}");
    assert_eq!(refused.len(), 10);
    assert!(refused.iter().all(|retry| *retry > max_wait));
    assert!(refused.iter().all(|retry| *retry <= Duration::from_secs(3)));
    assert!(started.elapsed() < Duration::from_millis(1_600));
    assert_eq!(arrivals.lock().unwrap().len(), 10);
}

#[tokio::test]
async fn a_policy_that_cannot_reserve_and_a_bad_key_are_refused() {
    let fixed = Policy::builder("fixed")
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_second(5))
        .build()
        .unwrap();
    let error = OutboundLayer::try_new(fixed, MemoryStore::new()).unwrap_err();
    assert!(
        matches!(
            error,
            PolicyError::InvalidOption {
                option: "algorithm",
                ..
            }
        ),
        "{error}"
    );

    let echo =
        service_fn(|_: Request<String>| async { Ok::<_, BoxError>(Response::new(String::new())) });
    let mut keyed = ServiceBuilder::new()
        .layer(
            OutboundLayer::new(five_per_second("bad"), MemoryStore::new()).key_from_fn(
                |_, headers| {
                    headers
                        .get("x-tenant")
                        .and_then(|tenant| tenant.to_str().ok())
                        .unwrap_or_default()
                        .to_owned()
                },
            ),
        )
        .service(echo);
    let request = Request::get("http://api.example/")
        .header("x-tenant", "{evil}")
        .body(String::new())
        .unwrap();
    let error = keyed
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    assert!(
        matches!(error.downcast_ref::<OutboundError>(), Some(OutboundError::BadKey(key)) if key == "{evil}"),
        "{error}"
    );
    let request = Request::get("http://api.example/")
        .header("x-tenant", "acme")
        .body(String::new())
        .unwrap();
    assert!(keyed.ready().await.unwrap().call(request).await.is_ok());
}
