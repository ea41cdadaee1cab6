//! Outbound limiting against a local upstream that timestamps every request: clients that share a
//! store never send more than the policy allows in any window, and a request that would wait too
//! long fails at once.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use http::{Request, Response};
use tokio::net::TcpListener;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::outbound::{ObeyRetryAfter, OutboundError, OutboundLayer};
use tower_redis_ratelimit::store::{ActionFuture, CheckFuture, CheckRequest};
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

pub(crate) type Client = BoxCloneSyncService<Request<String>, Response<String>, BoxError>;

/// A reqwest client as a tower service, limited by `policy` in `store`.
fn client(policy: Policy, store: impl Store, max_wait: Duration) -> Client {
    client_of(OutboundLayer::new(policy, store).max_wait(max_wait))
}

/// A reqwest client as a tower service, limited by `layer` (the response keeps the extensions
/// the layer gives it: a metered call's `Usage`).
pub(crate) fn client_of(layer: OutboundLayer) -> Client {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let send = service_fn(move |request: Request<String>| {
        let http = http.clone();
        async move {
            let response = http.execute(reqwest::Request::try_from(request)?).await?;
            let mut answer = Response::builder().status(response.status().as_u16());
            for (name, value) in response.headers() {
                answer = answer.header(name.as_str(), value.as_bytes());
            }
            Ok::<_, BoxError>(answer.body(response.text().await?)?)
        }
    });
    let limited = ServiceBuilder::new().layer(layer).service(send);
    BoxCloneSyncService::new(limited)
}

/// The second client of the two-client tests: with feature `reqwest-middleware`, the same layer
/// as a middleware of a `reqwest_middleware` client, so that both kinds are seen to keep one
/// count and honour one pause together; without it, another tower client.
fn second_client(policy: Policy, store: impl Store, max_wait: Duration) -> Client {
    second_client_of(OutboundLayer::new(policy, store).max_wait(max_wait))
}

/// [`second_client`] limited by `layer`; a metered call's `Usage` (in the `reqwest::Response`'s
/// extensions) is handed on with the body.
pub(crate) fn second_client_of(layer: OutboundLayer) -> Client {
    #[cfg(feature = "reqwest-middleware")]
    {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let limited = reqwest_middleware::ClientBuilder::new(http)
            .with(layer)
            .build();
        BoxCloneSyncService::new(service_fn(move |request: Request<String>| {
            let limited = limited.clone();
            async move {
                let response = limited
                    .execute(reqwest::Request::try_from(request)?)
                    .await?;
                let status = response.status();
                let usage = response
                    .extensions()
                    .get::<tower_redis_ratelimit::meter::Usage>()
                    .cloned();
                let mut answer = Response::builder().status(status);
                if let Some(usage) = usage {
                    answer = answer.extension(usage);
                }
                Ok::<_, BoxError>(answer.body(response.text().await?)?)
            }
        }))
    }
    #[cfg(not(feature = "reqwest-middleware"))]
    client_of(layer)
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

/// The margin of the tests that count arrivals upstream over time: on two cores busy with other
/// tests, a loopback trip varies by tens of milliseconds, more than the default 20 ms (made for a
/// network, not a loaded CI machine) absorbs.
const BUSY_MACHINE_MARGIN: Duration = Duration::from_millis(100);

/// Two clients sharing `stores`' counts, `each` requests apiece, 10 in flight each.
async fn two_clients_share_the_limit(stores: [Arc<dyn Store>; 2], prefix: &str, each: usize) {
    let (url, arrivals) = upstream().await;
    let [a, b] = stores;
    let layer = |store| {
        OutboundLayer::new(five_per_second(prefix), store)
            .max_wait(Duration::from_secs(60))
            .margin(BUSY_MACHINE_MARGIN)
    };
    let a = client_of(layer(a));
    let b = second_client_of(layer(b));
    let started = Instant::now();
    let (from_a, from_b) = tokio::join!(send_all(a, &url, each, 10), send_all(b, &url, each, 10));
    assert!(from_a.iter().chain(&from_b).all(|status| *status == 200));
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2 * each);
    assert_at_most_five_a_second(&arrivals);
    // And not much slower than the limit allows: 5 a period (a second and the margin) from the
    // start.
    let slot = (Duration::from_secs(1) + BUSY_MACHINE_MARGIN) / 5;
    let floor = slot * (2 * each as u32 - 5);
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

/// An upstream whose first answer is a 429 with `header`; it notes each arrival and status.
async fn upstream_refusing_once(
    header: (&'static str, String),
) -> (String, Arc<Mutex<Vec<(Instant, u16)>>>) {
    upstream_refusing(0, header).await
}

/// An upstream that answers its request number `refused` (from 0) with a 429 with `header`, and
/// every other one with a 200; it notes each arrival and status.
async fn upstream_refusing(
    refused: usize,
    header: (&'static str, String),
) -> (String, Arc<Mutex<Vec<(Instant, u16)>>>) {
    upstream_refusing_with(refused, vec![header]).await
}

/// [`upstream_refusing`] with several headers on its 429.
async fn upstream_refusing_with(
    refused: usize,
    headers: Vec<(&'static str, String)>,
) -> (String, Arc<Mutex<Vec<(Instant, u16)>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let noted = arrivals.clone();
    let app = Router::new().route(
        "/quote",
        axum::routing::any(move || {
            let mut arrivals = noted.lock().unwrap();
            let refuse = arrivals.len() == refused;
            arrivals.push((Instant::now(), if refuse { 429 } else { 200 }));
            let headers = headers.clone();
            async move {
                if refuse {
                    let mut response =
                        (http::StatusCode::TOO_MANY_REQUESTS, "slow down").into_response();
                    for (name, value) in headers {
                        response.headers_mut().append(name, value.parse().unwrap());
                    }
                    response
                } else {
                    "42".into_response()
                }
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/quote", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, arrivals)
}

/// Two clients on one Redis, each sending one request after another for `run`, against an
/// upstream that first answers 429 with `header`: once the pause is stored, nothing reaches the
/// upstream until `quiet` after that answer.
async fn an_announced_pause_holds_both_clients(header: (&'static str, String), quiet: Duration) {
    a_pause_announced_in_these_holds_both_clients(vec![header], quiet).await;
}

/// [`an_announced_pause_holds_both_clients`], the 429 carrying `headers`.
async fn a_pause_announced_in_these_holds_both_clients(
    headers: Vec<(&'static str, String)>,
    quiet: Duration,
) {
    let redis = TestRedis::shared();
    let store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::from_url(&redis.url)
                .unwrap()
                .timeout(Duration::from_secs(10)),
        )
    };
    a_pause_in_these_holds_both_clients_of([store(), store()], headers, quiet).await;
}

/// [`a_pause_announced_in_these_holds_both_clients`], the clients counting in `stores`.
async fn a_pause_in_these_holds_both_clients_of(
    stores: [Arc<dyn Store>; 2],
    headers: Vec<(&'static str, String)>,
    quiet: Duration,
) {
    let prefix = unique_prefix("pause");
    let (url, arrivals) = upstream_refusing_with(0, headers).await;
    let policy = || {
        Policy::builder("paused")
            .prefix(&prefix)
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_second(50))
            .build()
            .unwrap()
    };
    let run = quiet + Duration::from_secs(1);
    let [first, second] = stores;
    let clients = [
        client(policy(), first, Duration::from_secs(10)),
        second_client(policy(), second, Duration::from_secs(10)),
    ];
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let url = url.clone();
            tokio::spawn(async move {
                let until = Instant::now() + run;
                while Instant::now() < until {
                    let request = Request::get(&url).body(String::new()).unwrap();
                    client.ready().await.unwrap().call(request).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let (refused_at, status) = arrivals[0];
    assert_eq!(status, 429);
    // Until the client that got the 429 has paused the key in the store (a few milliseconds),
    // the other may still be sending: a quarter of a second is left for that, even on a busy
    // machine. After it, nothing until the pause is over.
    let storing = Duration::from_millis(250);
    let early: Vec<Duration> = arrivals[1..]
        .iter()
        .map(|(at, _)| *at - refused_at)
        .filter(|after| *after > storing && *after < quiet)
        .collect();
    assert!(early.is_empty(), "arrivals during the pause: {early:?}");
    assert!(
        arrivals.iter().any(|(at, _)| *at - refused_at >= quiet),
        "requests go again after the pause"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_seconds_pauses_every_client() {
    an_announced_pause_holds_both_clients(("retry-after", "2".into()), Duration::from_secs(2))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_as_an_http_date_pauses_every_client() {
    // Three seconds ahead, to the whole second: between 2 and 3 s from now, so from the 429,
    // which comes a little later, possibly a hair under 2 s: 1.8 s of quiet is what it promises.
    let date = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(3));
    let quiet = Duration::from_millis(1_800);
    an_announced_pause_holds_both_clients(("retry-after", date), quiet).await;
}

/// LLM vendors' words (issue 49), with values of their documentation: OpenAI's and Azure's
/// `retry-after-ms`, OpenAI's remaining requests at 0 with a duration reset, Anthropic's
/// remaining tokens at 0 with an RFC 3339 reset; each pauses both clients for its time, on one
/// Redis and on one memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_vendors_headers_pause_every_client() {
    let redis = TestRedis::shared();
    let redis_store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::from_url(&redis.url)
                .unwrap()
                .timeout(Duration::from_secs(10)),
        )
    };
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    for stores in [[redis_store(), redis_store()], [memory.clone(), memory]] {
        a_pause_in_these_holds_both_clients_of(
            stores.clone(),
            vec![("retry-after-ms", "1500".into())],
            Duration::from_millis(1_500),
        )
        .await;
        a_pause_in_these_holds_both_clients_of(
            stores.clone(),
            vec![
                ("x-ratelimit-remaining-requests", "0".into()),
                ("x-ratelimit-reset-requests", "1.5s".into()),
            ],
            Duration::from_millis(1_500),
        )
        .await;
        // 2.5 s ahead, to the millisecond: from the 429, a little later (the clients' setup),
        // at least 1.8 s.
        let reset = humantime::format_rfc3339_millis(
            std::time::SystemTime::now() + Duration::from_millis(2_500),
        )
        .to_string();
        a_pause_in_these_holds_both_clients_of(
            stores,
            vec![
                ("anthropic-ratelimit-tokens-remaining", "0".into()),
                ("anthropic-ratelimit-tokens-reset", reset),
            ],
            Duration::from_millis(1_800),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ietf_ratelimit_item_with_nothing_left_pauses_every_client() {
    let header = ("ratelimit", "\"upstream\";r=0;t=2".to_owned());
    an_announced_pause_holds_both_clients(header, Duration::from_secs(2)).await;
}

/// Two clients sharing `stores`' counts, 10 requests apiece all in flight at once at 5 per
/// second, so that most wait for slots reserved seconds ahead; the upstream answers its 8th
/// request (in the second burst) 429 with `Retry-After: 2`. The calls already waiting hold too:
/// nothing arrives during the pause, and no window of a second holds more than 5, after the pause
/// included.
async fn queued_calls_hold_for_a_pause(stores: [Arc<dyn Store>; 2], prefix: &str) {
    let (url, arrivals) = upstream_refusing(7, ("retry-after", "2".into())).await;
    let layer = |store: Arc<dyn Store>| {
        OutboundLayer::new(five_per_second(prefix), store)
            .max_wait(Duration::from_secs(60))
            // On 2 busy cores an arrival can lag its slot by more than the default 20 ms.
            .margin(Duration::from_millis(100))
    };
    let [a, b] = stores;
    let (from_a, from_b) = tokio::join!(
        send_all(client_of(layer(a)), &url, 10, 10),
        send_all(second_client_of(layer(b)), &url, 10, 10)
    );
    let statuses: Vec<u16> = from_a.into_iter().chain(from_b).collect();
    assert_eq!(
        statuses.iter().filter(|status| **status == 429).count(),
        1,
        "{statuses:?}"
    );
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 20);
    let refused_at = arrivals[7].0;
    // The calls sent before the pause was stored (those of the 429's own burst, a few ms) may
    // still arrive; a quarter of a second is left for that. After it, nothing for 2 s: today's
    // bug sent the next burst about a second after the 429.
    let storing = Duration::from_millis(250);
    let during: Vec<Duration> = arrivals
        .iter()
        .map(|(at, _)| at.saturating_duration_since(refused_at))
        .filter(|after| *after > storing && *after < Duration::from_secs(2))
        .collect();
    assert!(during.is_empty(), "arrivals during the pause: {during:?}");
    let times: Vec<Instant> = arrivals.iter().map(|(at, _)| *at).collect();
    assert_at_most_five_a_second(&times);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_on_one_redis_hold_for_a_pause() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("queued");
    let store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::from_url(&redis.url)
                .unwrap()
                .timeout(Duration::from_secs(10)),
        )
    };
    queued_calls_hold_for_a_pause([store(), store()], &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_on_one_memory_store_hold_for_a_pause() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    queued_calls_hold_for_a_pause([store.clone(), store], "mem").await;
}

/// A queued call that a pause would hold past its maximum wait fails at once with
/// [`OutboundError::WouldWait`], as a call whose slot is too far does, and is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_call_held_past_its_maximum_wait_by_a_pause_is_not_sent() {
    // Answers after 200 ms, so that all ten have their slots before the 429 comes back.
    let arrivals = Arc::new(AtomicUsize::new(0));
    let counted = arrivals.clone();
    let upstream = service_fn(move |_: Request<String>| {
        let first = counted.fetch_add(1, Ordering::Relaxed) == 0;
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let status = if first { 429 } else { 200 };
            let response = Response::builder()
                .status(status)
                .header("retry-after", "3")
                .body(String::new())?;
            Ok::<_, BoxError>(response)
        }
    });
    let limited = ServiceBuilder::new()
        .layer(
            OutboundLayer::new(five_per_second("held"), MemoryStore::new())
                .max_wait(Duration::from_secs(2)),
        )
        .service(upstream);
    let limited = BoxCloneSyncService::new(limited);
    let started = Instant::now();
    // Five go at once (the first is answered 429: a pause of 3 s from 0.2 s); five wait for
    // slots 1.02 s away, within the maximum wait, and then find the pause, which would hold them
    // past it.
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let mut limited = limited.clone();
            tokio::spawn(async move {
                let request = Request::get("http://api.example/")
                    .body(String::new())
                    .unwrap();
                limited.ready().await.unwrap().call(request).await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    let mut refused = Vec::new();
    for call in calls {
        match call.await.unwrap() {
            Ok(response) => statuses.push(response.status().as_u16()),
            Err(error) => match error.downcast::<OutboundError>().map(|error| *error) {
                Ok(OutboundError::WouldWait { retry_after, .. }) => refused.push(retry_after),
                other => panic!("{other:?}"),
            },
        }
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 429], "{refused:?}");
    assert_eq!(arrivals.load(Ordering::Relaxed), 5);
    // Told to come back at the pause's end, about 2.2 s after they found it.
    assert_eq!(refused.len(), 5);
    assert!(
        refused
            .iter()
            .all(|retry| *retry > Duration::from_secs(1) && *retry <= Duration::from_secs(3)),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}
/// A store of your own that pauses but reads pauses through the default of `Store::pause_left`.
struct OwnStore(MemoryStore);

impl Store for OwnStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.0.check(request)
    }

    fn pause(&self, request: &CheckRequest<'_>, pause: Duration) -> ActionFuture {
        self.0.pause(request, pause)
    }
}

/// `Store::pause_left` reads a pause in each store, and counts nothing.
#[tokio::test]
async fn each_store_reads_the_time_a_pause_has_left() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("left");
    let rules = [Rule::per_second(1)];
    let stores: [(&str, Arc<dyn Store>); 3] = [
        ("memory", Arc::new(MemoryStore::new())),
        ("redis", Arc::new(RedisStore::from_url(&redis.url).unwrap())),
        ("own", Arc::new(OwnStore(MemoryStore::new()))),
    ];
    for (name, store) in stores {
        let key = format!("{prefix}:{name}:upstream:a");
        let request = CheckRequest::new(&key, &rules, Algorithm::SlidingLog)
            .block_for(Some(Duration::from_millis(1)));
        assert_eq!(store.pause_left(&request).await.unwrap(), None, "{name}");
        store.pause(&request, Duration::from_secs(2)).await.unwrap();
        let left = store.pause_left(&request).await.unwrap();
        assert!(
            left.is_some_and(
                |left| left > Duration::from_millis(1_500) && left <= Duration::from_secs(2)
            ),
            "{name}: {left:?}"
        );
        // A read records nothing: after one, a key's single unit is still free.
        let other = format!("{prefix}:{name}:upstream:b");
        let other = CheckRequest::new(&other, &rules, Algorithm::SlidingLog);
        assert_eq!(store.pause_left(&other).await.unwrap(), None, "{name}");
        assert!(store.check(&other).await.unwrap().allowed, "{name}");
    }
}

/// A hostile `Retry-After` of a day, or any vendor header announcing a wait too long to say
/// (past u64, a billion hours, the year 9999), pauses for the cap: no longer, and not nothing.
#[tokio::test]
async fn a_pause_is_capped() {
    let hostile: [&[(&'static str, &'static str)]; 6] = [
        &[("retry-after", "86400")],
        &[("retry-after-ms", "18446744073709551616")],
        &[("retry-after-ms", "1000000000000000000")],
        &[
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "9999999999h"),
        ],
        &[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "99999999999999999999999s"),
        ],
        &[
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "9999-12-31T23:59:59Z"),
        ],
    ];
    for headers in hostile {
        a_pause_of_these_headers_is_capped(headers).await;
    }
}

async fn a_pause_of_these_headers_is_capped(headers: &'static [(&'static str, &'static str)]) {
    let store = MemoryStore::new();
    let mut limited = ServiceBuilder::new()
        .layer(
            OutboundLayer::new(five_per_second("capped"), store.clone())
                .pause_cap(Duration::from_secs(3))
                .max_wait(Duration::from_millis(100)),
        )
        .service(service_fn(move |_: Request<String>| async move {
            let mut response = Response::builder().status(429);
            for (name, value) in headers {
                response = response.header(*name, *value);
            }
            Ok::<_, BoxError>(response.body(String::new())?)
        }));
    let request = || {
        Request::get("http://api.example/")
            .body(String::new())
            .unwrap()
    };
    let first = limited
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(first.status(), 429);
    let error = limited
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap_err();
    match error.downcast_ref::<OutboundError>() {
        Some(OutboundError::WouldWait { retry_after, .. }) => {
            assert!(
                *retry_after <= Duration::from_secs(3),
                "{headers:?}: {retry_after:?}"
            );
            assert!(
                *retry_after > Duration::from_millis(2_500),
                "{headers:?}: {retry_after:?}"
            );
        }
        other => panic!("{headers:?}: {other:?}"),
    }
}

/// When each request came to a fake upstream, on tokio's clock.
type Arrivals = Arc<Mutex<Vec<tokio::time::Instant>>>;

/// A fake upstream answering from `answers` in turn (the last one again once they run out) and
/// noting when each request came (tokio's clock, paused in these tests).
fn scripted(answers: Vec<(u16, Option<&'static str>)>) -> (Client, Arrivals) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let noted = arrivals.clone();
    let service = service_fn(move |_: Request<String>| {
        let mut arrivals = noted.lock().unwrap();
        arrivals.push(tokio::time::Instant::now());
        let (status, retry_after) = answers[(arrivals.len() - 1).min(answers.len() - 1)];
        async move {
            let mut response = Response::builder().status(status);
            if let Some(retry_after) = retry_after {
                response = response.header("retry-after", retry_after);
            }
            Ok::<_, BoxError>(response.body(String::new())?)
        }
    });
    (BoxCloneSyncService::new(service), arrivals)
}

async fn call_with_retries(
    policy: ObeyRetryAfter,
    method: http::Method,
    answers: Vec<(u16, Option<&'static str>)>,
) -> (u16, Vec<Duration>) {
    let (upstream, arrivals) = scripted(answers);
    let mut client = ServiceBuilder::new()
        .layer(tower::retry::RetryLayer::new(policy))
        .service(upstream);
    let request = Request::builder()
        .method(method)
        .uri("http://api.example/")
        .body(String::new())
        .unwrap();
    let start = tokio::time::Instant::now();
    let status = client
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap()
        .status()
        .as_u16();
    let arrivals = arrivals
        .lock()
        .unwrap()
        .iter()
        .map(|at| *at - start)
        .collect();
    (status, arrivals)
}

#[tokio::test(start_paused = true)]
async fn the_retry_policy_waits_as_told_and_not_longer_than_allowed() {
    use http::Method;
    // Retried after the announced 2 s, not before.
    let (status, arrivals) = call_with_retries(
        ObeyRetryAfter::new(),
        Method::GET,
        vec![(429, Some("2")), (200, None)],
    )
    .await;
    assert_eq!(
        (status, arrivals),
        (200, vec![Duration::ZERO, Duration::from_secs(2)])
    );
    // An HTTP-date, 3 s ahead to the whole second, on a 503.
    let date: &'static str = Box::leak(
        httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(3))
            .into_boxed_str(),
    );
    let (status, arrivals) = call_with_retries(
        ObeyRetryAfter::new(),
        Method::GET,
        vec![(503, Some(date)), (200, None)],
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        arrivals[1] > Duration::from_secs(2) && arrivals[1] <= Duration::from_secs(3),
        "{arrivals:?}"
    );
    // Past the total wait: the 429 comes back at once.
    let bounded = ObeyRetryAfter::new().max_total_wait(Duration::from_secs(4));
    let (status, arrivals) = call_with_retries(bounded, Method::GET, vec![(429, Some("5"))]).await;
    assert_eq!((status, arrivals), (429, vec![Duration::ZERO]));
    // At most `attempts` retries.
    let (status, arrivals) = call_with_retries(
        ObeyRetryAfter::new().attempts(2),
        Method::GET,
        vec![(429, Some("0"))],
    )
    .await;
    assert_eq!((status, arrivals.len()), (429, 3));
    // No Retry-After: the fallback.
    let (_, arrivals) = call_with_retries(
        ObeyRetryAfter::new().fallback(Duration::from_millis(700)),
        Method::GET,
        vec![(429, None), (200, None)],
    )
    .await;
    assert_eq!(arrivals, [Duration::ZERO, Duration::from_millis(700)]);
    // A 500 is not the upstream's limit: not retried.
    let (status, arrivals) =
        call_with_retries(ObeyRetryAfter::new(), Method::GET, vec![(500, Some("1"))]).await;
    assert_eq!((status, arrivals.len()), (500, 1));
}

#[tokio::test(start_paused = true)]
async fn the_retry_policy_never_retries_a_post_unless_told() {
    let answers = || vec![(429, Some("1")), (201, None)];
    let (status, arrivals) =
        call_with_retries(ObeyRetryAfter::new(), http::Method::POST, answers()).await;
    assert_eq!((status, arrivals.len()), (429, 1));
    let any = ObeyRetryAfter::new().any_method(true);
    let (status, arrivals) = call_with_retries(any, http::Method::POST, answers()).await;
    assert_eq!(
        (status, arrivals),
        (201, vec![Duration::ZERO, Duration::from_secs(1)])
    );
}

/// The panic of `OutboundLayer::new` on a policy it can't use names the caller's line, not one
/// inside the crate.
#[test]
fn new_with_an_algorithm_that_cannot_reserve_panics_at_the_callers_line() {
    let fixed = Policy::builder("fixed")
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_second(5))
        .build()
        .unwrap();
    thread_local!(static PANICKED_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) });
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let at = info.location().map(|at| at.file().to_owned());
        PANICKED_AT.with(|cell| *cell.borrow_mut() = at);
    }));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        OutboundLayer::new(fixed, MemoryStore::new())
    }));
    std::panic::set_hook(previous);
    assert!(result.is_err(), "a fixed window can't reserve a slot");
    let file = PANICKED_AT.with(|cell| cell.borrow().clone());
    assert_eq!(file.as_deref(), Some(file!()));
}

/// With `reqwest-middleware`, `ObeyRetryAfter` before an `OutboundLayer` retries a 429 after its
/// `Retry-After`, through the layer: the upstream sees the refused call and one retry, a second
/// apart, and the caller gets the retry's 200. A POST is not retried.
#[cfg(feature = "reqwest-middleware")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_middleware_sends_a_refused_call_again_after_the_pause() {
    let (url, arrivals) = upstream_refusing_once(("retry-after", "1".to_owned())).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(ObeyRetryAfter::new().attempts(2))
        .with(OutboundLayer::new(
            five_per_second(&unique_prefix("retry-mw")),
            MemoryStore::new(),
        ))
        .build();
    let response = client.get(&url).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let seen = arrivals.lock().unwrap().clone();
    let statuses: Vec<u16> = seen.iter().map(|(_, status)| *status).collect();
    assert_eq!(statuses, [429, 200]);
    let gap = seen[1].0 - seen[0].0;
    assert!(gap >= Duration::from_secs(1), "retried after {gap:?}");

    let (url, arrivals) = upstream_refusing_once(("retry-after", "1".to_owned())).await;
    let response = client.post(&url).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 429, "a POST is not retried");
    assert_eq!(arrivals.lock().unwrap().len(), 1);
}
