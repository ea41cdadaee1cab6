//! Metered outbound calls (issue 49) against a stand-in for an OpenAI-style API that counts the
//! tokens its callers use: each call reserves its estimate before it is sent and settles at the
//! usage its answer reports; the vendor's headers keep the next calls from needing more than it
//! has left.

use crate::common;
use crate::outbound::{Client, client_of as tower_client, second_client_of as second_client};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::IntoResponse;
use common::capture::Captured;
use common::redis_server::{TestRedis, unique_prefix};
use http::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::meter::{Estimate, Meter, Usage};
use tower_redis_ratelimit::outbound::{OutboundError, OutboundLayer};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, RedisStore, Rule, Store};

/// A scripted upstream's answer: a response, or none (a transport error).
type Answer = Result<Response<String>, ()>;

/// Vendor headers, as names and values.
type Headers = &'static [(&'static str, &'static str)];

/// What the stand-in saw: each call's arrival, the tokens it reported, and its status.
type Seen = Arc<Mutex<Vec<(Instant, u64, u16)>>>;

/// A stand-in for an OpenAI-style API on a free port. It allows `limit` tokens per `window`,
/// counted by arrival in a sliding window, and answers 429 beyond. Each call uses the tokens of
/// its `x-use` header; the answer reports them in its body (`usage.total_tokens`) with
/// `headers` added.
async fn stand_in(
    limit: u64,
    window: Duration,
    headers: Vec<(&'static str, &'static str)>,
) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let noted = seen.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move |request: http::HeaderMap| {
            let used: u64 = request
                .get("x-use")
                .and_then(|value| value.to_str().ok()?.parse().ok())
                .unwrap_or(0);
            let now = Instant::now();
            let mut seen = noted.lock().unwrap();
            let in_window: u64 = seen
                .iter()
                .filter(|(at, _, status)| *status == 200 && now - *at < window)
                .map(|(_, used, _)| used)
                .sum();
            let status = if in_window + used > limit { 429 } else { 200 };
            seen.push((now, used, status));
            let headers = headers.clone();
            async move {
                let mut response = if status == 429 {
                    (StatusCode::TOO_MANY_REQUESTS, "rate limited").into_response()
                } else {
                    axum::Json(serde_json::json!({ "usage": { "total_tokens": used } }))
                        .into_response()
                };
                for (name, value) in headers {
                    response.headers_mut().insert(name, value.parse().unwrap());
                }
                response
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

/// A metered policy: `limit` tokens per `period` counted by a sliding log, each call
/// reserving `estimate`.
fn metered(prefix: &str, limit: u64, period: Duration, estimate: u64) -> Policy {
    Policy::builder("llm")
        .prefix(prefix)
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::new(limit, period).metered())
        .meter(Meter::new("tokens").estimate(move |_| estimate))
        .build()
        .unwrap()
}

/// Calls `url` through `client` for a call that uses `used` tokens; records what the answer's
/// body reports when `record`. The status, or the error.
async fn call(client: &mut Client, url: &str, used: u64, record: bool) -> Result<u16, BoxError> {
    let request = Request::post(url)
        .header("x-use", used.to_string())
        .body(String::new())
        .unwrap();
    let response = client.ready().await?.call(request).await?;
    let status = response.status().as_u16();
    let usage = response.extensions().get::<Usage>().cloned();
    if status == 200 && record {
        let body: serde_json::Value = serde_json::from_str(response.body())?;
        let usage = usage.expect("a metered call's answer carries its Usage");
        usage.record(body["usage"]["total_tokens"].as_u64().unwrap());
    }
    Ok(status)
}

/// The Redis and the memory store, each as two instances' stores (one Redis shared by two
/// clients; one memory store shared by two layers).
fn stores(redis: &TestRedis) -> Vec<(&'static str, [Arc<dyn Store>; 2])> {
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let redis_store = || -> Arc<dyn Store> {
        Arc::new(
            RedisStore::from_url(&redis.url)
                .unwrap()
                .timeout(Duration::from_secs(10)),
        )
    };
    vec![
        ("memory", [memory.clone(), memory]),
        ("redis", [redis_store(), redis_store()]),
    ]
}

/// A client whose calls go through `layer` to an upstream that answers 200 at once.
fn answered_at_once(layer: OutboundLayer) -> Client {
    tower::util::BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(service_fn(
        |_: Request<String>| async { Ok::<_, BoxError>(Response::new(String::new())) },
    )))
}

/// A call estimated at `units`.
fn estimated(units: u64) -> Request<String> {
    let mut request = Request::post("http://llm.example/v1")
        .body(String::new())
        .unwrap();
    request.extensions_mut().insert(Estimate(units));
    request
}

/// Two instances, three calls in flight each, under one limit of 1 000 tokens per 2 s that the
/// stand-in enforces too: each reserves 400 and uses 50 to 400, settled as it answers. The
/// stand-in never refuses, so no window of it ever saw more than 1 000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_under_one_token_limit_never_meet_a_429() {
    let redis = TestRedis::shared();
    for (name, [first, second]) in stores(&redis) {
        let window = Duration::from_secs(2);
        let (url, seen) = stand_in(1_000, window, Vec::new()).await;
        let prefix = unique_prefix("outbound-metered");
        let layer = |store: Arc<dyn Store>| {
            // A margin wide enough for a busy machine's lag between counting and arriving.
            OutboundLayer::new(metered(&prefix, 1_000, window, 400), store)
                .margin(Duration::from_millis(200))
                .max_wait(Duration::from_secs(20))
        };
        let clients = [tower_client(layer(first)), second_client(layer(second))];
        let until = Instant::now() + Duration::from_secs(4);
        let mut tasks = Vec::new();
        for (instance, client) in clients.into_iter().enumerate() {
            for lane in 0..3u64 {
                let (mut client, url) = (client.clone(), url.clone());
                tasks.push(tokio::spawn(async move {
                    let mut uses = [50, 400, 150, 300]
                        .into_iter()
                        .cycle()
                        .skip(lane as usize + instance);
                    while Instant::now() < until {
                        let status = call(&mut client, &url, uses.next().unwrap(), true)
                            .await
                            .unwrap();
                        assert_eq!(status, 200);
                    }
                }));
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        let refused = seen.iter().filter(|(_, _, status)| *status != 200).count();
        assert_eq!(
            refused,
            0,
            "{name}: the stand-in refused {refused} of {} calls",
            seen.len()
        );
        assert!(seen.len() >= 2, "{name}: {} calls", seen.len());
    }
}

/// Reserve 500 and use 100, in a window of 1 000: settled, six calls share it (five used 500,
/// and the sixth's 500 fits); not settled (nothing recorded: the reservations stand), two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_lets_six_calls_share_a_window_where_two_would_without() {
    let redis = TestRedis::shared();
    for (name, [store, _]) in stores(&redis) {
        let (url, _) = stand_in(u64::MAX, Duration::from_secs(60), Vec::new()).await;
        for (record, fits) in [(true, 6), (false, 2)] {
            let policy = metered(
                &unique_prefix("settling"),
                1_000,
                Duration::from_secs(60),
                500,
            );
            let layer =
                OutboundLayer::new(policy, store.clone()).max_wait(Duration::from_millis(300));
            let mut client = tower_client(layer);
            let mut sent = 0;
            loop {
                match call(&mut client, &url, 100, record).await {
                    Ok(status) => {
                        assert_eq!(status, 200);
                        sent += 1;
                    }
                    Err(error) => {
                        let error = error.downcast_ref::<OutboundError>();
                        assert!(
                            matches!(error, Some(OutboundError::WouldWait { .. })),
                            "{error:?}"
                        );
                        break;
                    }
                }
                assert!(sent <= fits, "{name}: more than {fits} calls fit");
            }
            assert_eq!(sent, fits, "{name}, settled: {record}");
        }
    }
}

/// What a call that is answered, refused, unanswered or never sent leaves reserved, on a
/// window of 1 000 with estimates of 600: a 429 settles to nothing; a usage header settles; a
/// call with no answer keeps its estimate; a call not sent reserves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_way_a_call_ends_settles_as_the_contract_says() {
    let redis = TestRedis::shared();
    for (name, [store, _]) in stores(&redis) {
        let answers: Arc<Mutex<VecDeque<Answer>>> = Arc::default();
        let scripted = answers.clone();
        let upstream = service_fn(move |_: Request<String>| {
            let answer = scripted
                .lock()
                .unwrap()
                .pop_front()
                .expect("a scripted answer");
            async move { answer.map_err(|()| BoxError::from("connection reset")) }
        });
        let policy = Policy::builder("llm-ends")
            .prefix(unique_prefix("ends"))
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_minute(1_000).metered())
            .meter(
                Meter::new("tokens")
                    .estimate(|_| 600)
                    .usage_header("x-usage-tokens"),
            )
            .build()
            .unwrap();
        let mut client = ServiceBuilder::new()
            .layer(OutboundLayer::new(policy, store).max_wait(Duration::from_millis(200)))
            .service(upstream);
        let request = |estimate: Option<u64>| {
            let mut request = Request::post("http://llm.example/v1")
                .body(String::new())
                .unwrap();
            if let Some(units) = estimate {
                request.extensions_mut().insert(Estimate(units));
            }
            request
        };
        let mut send = async |estimate: Option<u64>, answer: Answer| {
            answers.lock().unwrap().push_back(answer);
            let result = client.ready().await.unwrap().call(request(estimate)).await;
            if result.is_err() {
                answers.lock().unwrap().clear();
            }
            result
        };
        let ok = || Ok(Response::new(String::new()));
        let refused = || Ok(Response::builder().status(429).body(String::new()).unwrap());
        // A 429 (no pause announced) settles to nothing: 600 more fit at once, twice.
        for _ in 0..3 {
            assert_eq!(send(None, refused()).await.unwrap().status(), 429, "{name}");
        }
        // Reported in the header: 600 reserved, 100 used, 900 left.
        let reported = Ok(Response::builder()
            .header("x-usage-tokens", "100")
            .body(String::new())
            .unwrap());
        assert_eq!(send(None, reported).await.unwrap().status(), 200, "{name}");
        // Not sent: no room for 950 of the 900 left, and nothing reserved for it.
        let error = send(Some(950), ok()).await.unwrap_err();
        assert!(
            matches!(error.downcast_ref(), Some(OutboundError::WouldWait { .. })),
            "{name}: {error}"
        );
        // Sent, no answer: its 600 stand, so 300 are left.
        assert!(send(None, Err(())).await.is_err(), "{name}");
        assert_eq!(send(Some(300), ok()).await.unwrap().status(), 200, "{name}");
        let error = send(Some(1), ok()).await.unwrap_err();
        assert!(
            matches!(error.downcast_ref(), Some(OutboundError::WouldWait { .. })),
            "{name}: {error}"
        );
    }
}

/// OpenAI's token headers with 100 of 1 000 left, full again in 2 s: a call of 400 needs 300
/// more, which take 2 s × 300 / 900 = 667 ms. Each instance keeps what its own answer said and
/// waits that long from it, though the store has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_needing_more_than_the_vendor_has_left_waits_on_each_instance() {
    let headers = vec![
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "100"),
        ("x-ratelimit-reset-tokens", "2s"),
    ];
    let redis = TestRedis::shared();
    for (name, [first, second]) in stores(&redis) {
        let (url, seen) = stand_in(u64::MAX, Duration::from_secs(60), headers.clone()).await;
        let prefix = unique_prefix("announced");
        let layer = |store| {
            OutboundLayer::new(
                metered(&prefix, 1_000_000, Duration::from_secs(60), 400),
                store,
            )
            .max_wait(Duration::from_secs(5))
        };
        let clients = [tower_client(layer(first)), second_client(layer(second))];
        let mut tasks = Vec::new();
        // Each instance's calls use their own number of tokens, to tell them apart.
        for (used, mut client) in (10..).zip(clients) {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..2 {
                    assert_eq!(call(&mut client, &url, used, true).await.unwrap(), 200);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        // Each instance's second call came 667 ms or more after its first (which came before
        // its answer).
        for used in [10, 11] {
            let arrivals: Vec<Instant> = seen
                .iter()
                .filter(|(_, of, _)| *of == used)
                .map(|(at, _, _)| *at)
                .collect();
            assert_eq!(arrivals.len(), 2, "{name}: {seen:?}");
            let gap = arrivals[1] - arrivals[0];
            assert!(gap >= Duration::from_millis(667), "{name}: {gap:?}");
            // The missing tokens' share of the reset, not the whole of it.
            assert!(gap < Duration::from_millis(1_900), "{name}: {gap:?}");
        }
    }
}

/// The vendor announcing a limit below the policy's is said once, at WARN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vendor_limit_below_the_policy_s_is_said_once() {
    let captured = Captured::global();
    let headers = vec![
        ("x-ratelimit-limit-tokens", "30000"),
        ("x-ratelimit-remaining-tokens", "29000"),
        ("x-ratelimit-reset-tokens", "2s"),
    ];
    let (url, _) = stand_in(u64::MAX, Duration::from_secs(60), headers).await;
    let policy = Policy::builder("llm-below")
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_minute(40_000).metered())
        .rule(Rule::per_day(10_000_000).metered())
        .meter(Meter::new("tokens").estimate(|_| 100))
        .build()
        .unwrap();
    let mut client = tower_client(OutboundLayer::new(policy, MemoryStore::new()));
    for _ in 0..3 {
        assert_eq!(call(&mut client, &url, 100, true).await.unwrap(), 200);
    }
    let warned = captured.lines_with("llm-below");
    let below: Vec<_> = warned
        .iter()
        .filter(|line| line.contains("below the policy's"))
        .collect();
    assert_eq!(below.len(), 1, "{warned:?}");
    assert!(
        below[0].contains("vendor_limit=30000") && below[0].contains("policy_limit=40000"),
        "{}",
        below[0]
    );
}

/// Hostile or broken vendor headers never panic and never pause past the cap: a reset of 90
/// minutes pauses the cap's 300 ms, and calls go again after it; a malformed duration, a reset
/// in the past or a remaining that is no number pause nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_vendor_headers_pause_at_most_the_cap() {
    let cases: [(Headers, Option<Duration>); 4] = [
        (
            &[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "90m0s"),
            ],
            Some(Duration::from_millis(300)),
        ),
        (
            &[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "6m0"),
            ],
            None,
        ),
        (
            &[
                ("anthropic-ratelimit-tokens-remaining", "0"),
                ("anthropic-ratelimit-tokens-reset", "2020-01-01T00:00:00Z"),
            ],
            None,
        ),
        (
            &[
                ("x-ratelimit-remaining-tokens", "none"),
                ("x-ratelimit-reset-tokens", "1s"),
            ],
            None,
        ),
    ];
    for (headers, pause) in cases {
        let (url, _) = stand_in(u64::MAX, Duration::from_secs(60), headers.to_vec()).await;
        let layer = OutboundLayer::new(
            metered("rl", 1_000_000, Duration::from_secs(60), 10),
            MemoryStore::new(),
        )
        .pause_cap(Duration::from_millis(300))
        .max_wait(Duration::from_millis(100));
        let mut client = tower_client(layer);
        assert_eq!(
            call(&mut client, &url, 10, true).await.unwrap(),
            200,
            "{headers:?}"
        );
        let second = call(&mut client, &url, 10, true).await;
        match pause {
            None => assert_eq!(second.unwrap(), 200, "{headers:?}"),
            Some(cap) => {
                let error = second.unwrap_err();
                match error.downcast_ref::<OutboundError>() {
                    Some(OutboundError::WouldWait { retry_after, .. }) => {
                        assert!(*retry_after <= cap, "{headers:?}: {retry_after:?}");
                        assert!(*retry_after > cap / 2, "{headers:?}: {retry_after:?}");
                        tokio::time::sleep(*retry_after).await;
                    }
                    other => panic!("{headers:?}: {other:?}"),
                }
                // The cap has passed: the next call goes (and its answer pauses anew).
                assert_eq!(
                    call(&mut client, &url, 10, true).await.unwrap(),
                    200,
                    "{headers:?}"
                );
            }
        }
    }
}

/// Anthropic-style limits on input and output tokens apart: two layers, one per unit, each
/// reserving its own estimate; the caller records each unit, and each layer settles its own.
/// A call the inner layer doesn't send gives the outer one's reservation back.
#[tokio::test]
async fn input_and_output_tokens_settle_in_their_own_layers() {
    let store = MemoryStore::new();
    let layer = |unit: &'static str, estimate: u64| {
        let policy = Policy::builder(format!("llm-{unit}"))
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new(unit).estimate(move |_| estimate))
            .build()
            .unwrap();
        OutboundLayer::new(policy, store.clone()).max_wait(Duration::from_millis(100))
    };
    let upstream = || {
        service_fn(|_: Request<String>| async { Ok::<_, BoxError>(Response::new(String::new())) })
    };
    let mut client = ServiceBuilder::new()
        .layer(layer("input_tokens", 200))
        .layer(layer("output_tokens", 300))
        .service(upstream());
    let request = || {
        Request::post("http://llm.example/v1")
            .body(String::new())
            .unwrap()
    };
    // Each call uses 100 input and 100 output tokens, and needs room for 200 and 300: eight fit.
    for _ in 0..8 {
        let response = client.ready().await.unwrap().call(request()).await.unwrap();
        let usage = response
            .extensions()
            .get::<Usage>()
            .expect("the usage of both layers");
        usage.record_unit("input_tokens", 100);
        usage.record_unit("output_tokens", 100);
    }
    // 800 output tokens used: the ninth call's 300 don't fit, though its 200 input tokens do.
    let error = client
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap_err();
    match error.downcast_ref::<OutboundError>() {
        Some(OutboundError::WouldWait { upstream, .. }) => assert_eq!(upstream, "llm.example"),
        other => panic!("{other:?}"),
    }
    // Not sent: its 200 input tokens went back, so 200 more still fit (800 + 200).
    let mut input_only = ServiceBuilder::new()
        .layer(layer("input_tokens", 200))
        .service(upstream());
    let response = input_only.ready().await.unwrap().call(request()).await;
    assert!(response.is_ok(), "{:?}", response.err());
}

/// A call that finds no room waits for the store's time or for a settle on this instance,
/// whichever comes first: a call that settles at 100 of its 600 lets the waiting one go at once,
/// not when the window of 10 s rolls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_call_goes_when_a_call_here_settles() {
    let redis = TestRedis::shared();
    for (name, [store, _]) in stores(&redis) {
        let policy = metered(&unique_prefix("wakes"), 1_000, Duration::from_secs(10), 600);
        let layer = OutboundLayer::new(policy, store).max_wait(Duration::from_secs(15));
        let mut client =
            ServiceBuilder::new()
                .layer(layer)
                .service(service_fn(|_: Request<String>| async {
                    Ok::<_, BoxError>(Response::new(String::new()))
                }));
        let request = || {
            Request::post("http://llm.example/v1")
                .body(String::new())
                .unwrap()
        };
        let started = Instant::now();
        let first = client.ready().await.unwrap().call(request()).await.unwrap();
        let mut waiting = client.clone();
        let second = tokio::spawn(async move {
            waiting
                .ready()
                .await
                .unwrap()
                .call(request())
                .await
                .unwrap();
            Instant::now()
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "{name}: 600 + 600 fit in 1 000");
        first.extensions().get::<Usage>().unwrap().record(100);
        drop(first);
        let went = second.await.unwrap() - started;
        assert!(went < Duration::from_secs(5), "{name}: went after {went:?}");
    }
}

/// Issue 59: a call waiting for room keeps its place. 1 000 tokens a second (a sliding log),
/// four callers loop on calls of 100 across two instances, and a call of 900 asks 300 ms after
/// them: it leaves a claim, the small calls after it see the room less its 900, and it is sent
/// once a second's calls have slid out, within 3 s, every round on both stores (before claims,
/// small calls kept taking the room it waited for: it failed with `WouldWait` after 4.8 s on
/// Redis). Its wait is at most about 900 / 1 000 of a second plus the calls ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_call_is_not_starved_by_small_ones() {
    let redis = TestRedis::shared();
    for (name, [first, second]) in stores(&redis) {
        for round in 0..2 {
            let prefix = unique_prefix("starved");
            let policy = metered(&prefix, 1_000, Duration::from_secs(1), 1);
            let layer = |store: Arc<dyn Store>| {
                answered_at_once(
                    OutboundLayer::new(policy.clone(), store)
                        .max_wait(Duration::from_secs(5))
                        .margin(Duration::ZERO),
                )
            };
            let clients = [layer(first.clone()), layer(second.clone())];
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let small_sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let mut small = Vec::new();
            for caller in 0..4 {
                let mut client = clients[caller % 2].clone();
                let (done, small_sent) = (done.clone(), small_sent.clone());
                small.push(tokio::spawn(async move {
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let sent = client.ready().await.unwrap().call(estimated(100)).await;
                        match sent {
                            // Nothing recorded: the call settles at its estimate.
                            Ok(_) => {
                                small_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(error) => assert!(
                                matches!(
                                    error.downcast_ref::<OutboundError>(),
                                    Some(OutboundError::WouldWait { .. })
                                ),
                                "{error}"
                            ),
                        }
                    }
                }));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut client = clients[round % 2].clone();
            let asked = Instant::now();
            let large = client.ready().await.unwrap().call(estimated(900)).await;
            let waited = asked.elapsed();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            for caller in small {
                caller.await.unwrap();
            }
            let small_sent = small_sent.load(std::sync::atomic::Ordering::Relaxed);
            eprintln!(
                "{name}, round {round}: the call of 900 waited {waited:?}; {small_sent} of 100 sent"
            );
            assert!(
                large.is_ok(),
                "{name}, round {round}: the call of 900 failed after {waited:?} ({:?}) while \
                 {small_sent} calls of 100 were sent",
                large.err()
            );
            assert!(
                waited < Duration::from_secs(3),
                "{name}, round {round}: the call of 900 waited {waited:?}"
            );
            assert!(
                small_sent >= 8,
                "{name}, round {round}: {small_sent} small calls"
            );
            if name == "redis" {
                // The claims of calls still waiting when the round ended expire with them.
                common::redis_server::assert_every_key_expires(&mut redis.client(), &prefix);
            }
        }
    }
}

/// A call that gives up takes its claim with it: a call of 900 that would wait past its 200 ms
/// (500 of 1 000 used for 10 s) fails with `WouldWait` and withdraws its claim, so a call of 100
/// right after it is sent at once, rather than waiting behind a claim nobody will use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_gives_up_withdraws_its_claim() {
    let redis = TestRedis::shared();
    for (name, [store, _]) in stores(&redis) {
        let policy = metered(
            &unique_prefix("withdrawn"),
            1_000,
            Duration::from_secs(10),
            1,
        );
        let call = |units: u64, max_wait: Duration| {
            let mut client = answered_at_once(
                OutboundLayer::new(policy.clone(), store.clone()).max_wait(max_wait),
            );
            async move { client.ready().await.unwrap().call(estimated(units)).await }
        };
        call(500, Duration::ZERO).await.unwrap();
        let gave_up = call(900, Duration::from_millis(200)).await;
        assert!(
            matches!(
                gave_up
                    .as_ref()
                    .err()
                    .and_then(|error| error.downcast_ref::<OutboundError>()),
                Some(OutboundError::WouldWait { .. })
            ),
            "{name}: {:?}",
            gave_up.err()
        );
        let small = call(100, Duration::from_millis(50)).await;
        assert!(
            small.is_ok(),
            "{name}: a call of 100 waited behind a withdrawn claim: {:?}",
            small.err()
        );
    }
}

/// A store of the app's own that checks, gives back and overdraws (what a metered outbound layer
/// needs) but knows nothing of claims: a waiting call's checks are plain checks there, and a call
/// that gives up sends it nothing more (a withdrawal would be a check of its units, charged if
/// there were room by then).
struct CheckOnly(MemoryStore);

/// `request` as a store of the app's own sees it: rebuilt from its public fields.
fn own_request<'a>(
    request: &tower_redis_ratelimit::store::CheckRequest<'a>,
) -> tower_redis_ratelimit::store::CheckRequest<'a> {
    tower_redis_ratelimit::store::CheckRequest::new(request.key, request.rules, request.algorithm)
        .identity(request.identity)
        .cost(request.cost)
        .units(request.units)
        .max_delay(request.max_delay)
        .block_for(request.block_for)
        .quota(request.quota)
        .concurrency(request.concurrency)
}

impl Store for CheckOnly {
    fn check(
        &self,
        request: &tower_redis_ratelimit::store::CheckRequest<'_>,
    ) -> tower_redis_ratelimit::store::CheckFuture {
        self.0.check(&own_request(request))
    }

    fn give_back(
        &self,
        request: &tower_redis_ratelimit::store::CheckRequest<'_>,
        charged: &tower_redis_ratelimit::Decision,
    ) -> tower_redis_ratelimit::store::CheckFuture {
        self.0.give_back(&own_request(request), charged)
    }

    fn overdraw(
        &self,
        request: &tower_redis_ratelimit::store::CheckRequest<'_>,
    ) -> tower_redis_ratelimit::store::CheckFuture {
        self.0.overdraw(&own_request(request))
    }

    fn abilities(&self) -> tower_redis_ratelimit::store::Abilities {
        use tower_redis_ratelimit::store::Abilities;
        Abilities::GIVE_BACK | Abilities::OVERDRAW
    }
}

/// Issue 59, after review: a waiting call dropped once room came back (its store's clock moved on
/// while it slept) charges nothing on a store that keeps no claims.
#[tokio::test]
async fn a_dropped_waiting_call_charges_nothing_on_a_store_without_claims() {
    let clock = tower_redis_ratelimit::store::ManualClock::new(1_000_000_000);
    let store = Arc::new(CheckOnly(
        MemoryStore::builder().clock(clock.clone()).build(),
    ));
    let policy = metered(
        &unique_prefix("check-only"),
        1_000,
        Duration::from_secs(1),
        1,
    );
    let client = |max_wait: Duration| {
        answered_at_once(OutboundLayer::new(policy.clone(), store.clone()).max_wait(max_wait))
    };
    let mut sender = client(Duration::ZERO);
    sender
        .ready()
        .await
        .unwrap()
        .call(estimated(800))
        .await
        .unwrap();
    let mut waiter = client(Duration::from_secs(30));
    let waiting = tokio::spawn(async move {
        let _ = waiter.ready().await.unwrap().call(estimated(500)).await;
    });
    // Refused, it sleeps; the store's second ends meanwhile, and the call is dropped.
    tokio::time::sleep(Duration::from_millis(100)).await;
    clock.advance(Duration::from_secs(2));
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    let whole = sender.ready().await.unwrap().call(estimated(1_000)).await;
    assert!(whole.is_ok(), "the dropped call charged: {:?}", whole.err());
}

/// Issue 59, after review: a waiting call dropped after its runtime is gone (a test's teardown)
/// leaves its claim to expire rather than asking a Redis store without a runtime (which panics).
#[test]
fn a_waiting_call_dropped_without_a_runtime_leaves_its_claim_to_expire() {
    let redis = TestRedis::shared();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prefix = unique_prefix("no-runtime");
    let policy = metered(&prefix, 1_000, Duration::from_secs(10), 1);
    let call = runtime.block_on(async {
        let store = RedisStore::from_url(&redis.url).unwrap();
        let mut client =
            answered_at_once(OutboundLayer::new(policy, store).max_wait(Duration::from_secs(30)));
        client
            .ready()
            .await
            .unwrap()
            .call(estimated(900))
            .await
            .unwrap();
        let mut call = Box::pin(client.ready().await.unwrap().call(estimated(500)));
        // Refused, it leaves its claim and sleeps.
        let waited = tokio::time::timeout(Duration::from_millis(300), &mut call).await;
        assert!(waited.is_err(), "a call of 500 went past 900 of 1 000");
        // (Handed out of the runtime as a box of its own, never awaited there again.)
        Some(call)
    });
    drop(runtime);
    drop(call);
    // The claim stays until the call's wait would have ended.
    let ttl: i64 = redis::cmd("PTTL")
        .arg(format!("{prefix}:{{upstream:llm.example}}:llm:claims"))
        .query(&mut redis.client())
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 30_000,
        "the claim's key expires in {ttl} ms"
    );
}
