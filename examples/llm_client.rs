//! Calling a token-limited LLM API from two instances that share one limit: each call reserves
//! its estimate (its prompt and every token it may generate) before it is sent, records the
//! tokens the answer reports, and settles, so that the room it didn't use goes back at once.
//!
//! The API is a stand-in, in-process, for an OpenAI-style one. It allows 1 000 tokens per 2 s
//! (counted as calls arrive), answers 429 beyond, reports each call's `usage` in its body and
//! sends OpenAI's `x-ratelimit-*` headers. Two tasks stand for two instances of an app: each has
//! its own `OutboundLayer`, and they count in one store (Redis with `REDIS_URL`, else one memory
//! store). None of their calls meets a 429: the example exits 1 if one does.
//!
//! ```text
//! cargo run --example llm_client                                      # one memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_client     # one Redis
//! ```

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::response::{IntoResponse, Response as AxumResponse};
use http::{HeaderMap, Request, Response, StatusCode};
use serde_json::{Value, json};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::meter::{Estimate, Meter, Usage};
use tower_redis_ratelimit::outbound::OutboundLayer;
use tower_redis_ratelimit::{
    Algorithm, MemoryStore, OnStoreError, Policy, RedisStore, Rule, Store,
};

/// The API's limit, and ours: 1 000 tokens per 2 s.
const TOKENS: u64 = 1_000;
const WINDOW: Duration = Duration::from_secs(2);

/// The calls each instance makes.
const CALLS: usize = 5;

/// The most tokens a call may generate (its `max_tokens`).
const MAX_TOKENS: u64 = 300;

/// The limit of the API as its console shows it, mirrored: its tokens per window, counted by a
/// sliding log (as the stand-in counts them).
fn policy() -> Policy {
    Policy::builder("llm-api")
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::new(TOKENS, WINDOW).metered())
        .meter(Meter::new("tokens"))
        // Without the store, no call: the API would refuse what it can't count.
        .on_store_error(OnStoreError::Deny)
        .build()
        .expect("a valid policy")
}

type Client = BoxCloneSyncService<Request<String>, Response<String>, BoxError>;

/// An HTTP client (reqwest, as a tower service) under `layer`.
fn client(layer: OutboundLayer) -> Client {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("a client");
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
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(send))
}

/// Tokens of a prompt, roughly, as the stand-in counts them (a real app uses its model's
/// tokenizer).
fn prompt_tokens(prompt: &str) -> u64 {
    prompt.len() as u64 / 4 + 1
}

/// One completion: reserves the prompt's tokens and `MAX_TOKENS`, records what the answer
/// reports. The status and the tokens used.
async fn complete(client: &mut Client, url: &str, prompt: &str) -> Result<(u16, u64), BoxError> {
    let body = json!({ "prompt": prompt, "max_tokens": MAX_TOKENS }).to_string();
    let mut request = Request::post(url)
        .header("content-type", "application/json")
        .body(body)?;
    request
        .extensions_mut()
        .insert(Estimate(prompt_tokens(prompt) + MAX_TOKENS));
    let response = client.ready().await?.call(request).await?;
    let status = response.status().as_u16();
    if status != 200 {
        return Ok((status, 0));
    }
    let answer: Value = serde_json::from_str(response.body())?;
    let used = answer["usage"]["total_tokens"].as_u64().unwrap_or(0);
    // What the call used settles when the response and this `Usage` are dropped: the rest of
    // its reservation goes back.
    if let Some(usage) = response.extensions().get::<Usage>() {
        usage.record(used);
    }
    Ok((status, used))
}

/// One instance: its calls, one after another. How many the API refused.
async fn instance(number: usize, mut client: Client, url: String, started: Instant) -> usize {
    let mut refused = 0;
    for call in 1..=CALLS {
        let prompt = format!("Instance {number}, call {call}: summarize the news. ").repeat(call);
        match complete(&mut client, &url, &prompt).await {
            Ok((status, used)) => {
                println!(
                    "{:>5} ms  instance {number} call {call}: {status}, {used} tokens",
                    started.elapsed().as_millis()
                );
                refused += usize::from(status == 429);
            }
            Err(error) => {
                println!("instance {number} call {call}: not sent: {error}");
                refused += 1;
            }
        }
    }
    refused
}

#[tokio::main]
async fn main() -> ExitCode {
    let url = stand_in().await;
    println!("stand-in for an OpenAI-style API: {url} ({TOKENS} tokens per {WINDOW:?})");
    let store: Arc<dyn Store> = match std::env::var("REDIS_URL") {
        Ok(redis) => {
            println!("counting in Redis at {redis}");
            Arc::new(RedisStore::from_url(&redis).expect("a valid REDIS_URL"))
        }
        Err(_) => {
            println!("counting in one memory store (set REDIS_URL for Redis)");
            Arc::new(MemoryStore::new())
        }
    };
    let started = Instant::now();
    let tasks: Vec<_> = (1..=2)
        .map(|number| {
            // Each instance its own layer, as two processes would have; one store between them.
            // The stand-in counts arrivals exactly: a margin of 100 ms absorbs the lag between
            // counting a call and its arrival, even on a busy machine.
            let layer = OutboundLayer::new(policy(), store.clone())
                .margin(Duration::from_millis(100))
                .max_wait(Duration::from_secs(30));
            tokio::spawn(instance(number, client(layer), url.clone(), started))
        })
        .collect();
    let mut refused = 0;
    for task in tasks {
        refused += task.await.expect("an instance");
    }
    println!(
        "{} calls in {} ms, {refused} refused by the API",
        2 * CALLS,
        started.elapsed().as_millis()
    );
    if refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The stand-in's count: each call's arrival and the tokens it used, over the last window.
type Calls = Arc<Mutex<VecDeque<(Instant, u64)>>>;

/// Starts the stand-in on a free loopback port; its URL.
async fn stand_in() -> String {
    let calls: Calls = Arc::default();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move |Json(body): Json<Value>| {
            let calls = calls.clone();
            async move { answer(&calls, &body) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().expect("an address")
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// The stand-in's answer to a completion: its usage, unless the window has no room for it.
fn answer(calls: &Calls, body: &Value) -> AxumResponse {
    let prompt = body["prompt"].as_str().unwrap_or_default();
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16);
    // The model writes between a quarter of max_tokens and all of it.
    let written = max_tokens / 4 + (prompt.len() as u64 * 7) % (max_tokens * 3 / 4 + 1);
    let used = prompt_tokens(prompt) + written;
    let now = Instant::now();
    let mut calls = calls.lock().expect("the stand-in's count");
    while calls.front().is_some_and(|(at, _)| now - *at >= WINDOW) {
        calls.pop_front();
    }
    let counted: u64 = calls.iter().map(|(_, used)| used).sum();
    let fits = counted + used <= TOKENS;
    if fits {
        calls.push_back((now, used));
    }
    let remaining = TOKENS - counted - if fits { used } else { 0 };
    // The time until the window is empty again: OpenAI's "reset", as a Go duration.
    let full_in = calls
        .back()
        .map_or(Duration::ZERO, |(at, _)| WINDOW.saturating_sub(now - *at));
    let mut headers = HeaderMap::new();
    headers.insert("x-ratelimit-limit-tokens", TOKENS.into());
    headers.insert("x-ratelimit-remaining-tokens", remaining.into());
    let reset = format!("{:.3}s", full_in.as_secs_f64());
    headers.insert(
        "x-ratelimit-reset-tokens",
        reset.parse().expect("a header value"),
    );
    if !fits {
        headers.insert("retry-after-ms", 100u64.into());
        let error = json!({ "error": { "type": "tokens", "message": "Rate limit reached" } });
        return (StatusCode::TOO_MANY_REQUESTS, headers, Json(error)).into_response();
    }
    let usage = json!({
        "choices": [{ "message": { "role": "assistant", "content": "…" } }],
        "usage": { "prompt_tokens": prompt_tokens(prompt), "completion_tokens": written, "total_tokens": used },
    });
    (headers, Json(usage)).into_response()
}
