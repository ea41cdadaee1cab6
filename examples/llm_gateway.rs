//! An LLM gateway in front of an OpenAI-compatible upstream (an in-process stand-in here), with
//! the limits such gateways keep: 60 requests and 40 000 tokens a minute per API key, and tokens
//! per day by plan (100 000 on `free`, 2 000 000 on `pro`, from `x-plan`). The upstream streams
//! its answer as server-sent events with the usage in the last event, as OpenAI's
//! `stream_options.include_usage` does; the gateway passes the stream through, reads that event,
//! and records it with [`Usage`]: the layer settles once the stream has ended.
//!
//! A request reserves its estimate before it reaches the upstream: the prompt's length in
//! tokens (about 4 bytes each) plus its `max_tokens`. The layer sees only the request's head, so
//! a middleware before it reads the body and puts an [`Estimate`] in the request's extensions.
//!
//! ```text
//! cargo run --example llm_gateway     # serves 127.0.0.1:3006 (REDIS_URL: counts in Redis)
//! for i in $(seq 1 7); do
//!   curl -s -o /dev/null -w "%{http_code} " -H 'x-api-key: k1' \
//!     -d '{"prompt":"Hello","max_tokens":1000}' 127.0.0.1:3006/v1/completions
//! done
//! # 200 200 200 200 200 429 429: each answer uses 9 000 tokens where 1 002 were reserved, so
//! # the fifth leaves 45 000 counted in the minute, past 40 000, and the next waits it out.
//! ```

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use http::StatusCode;
use http_body::Frame;
use tower::ServiceExt;
use tower_redis_ratelimit::meter::{Estimate, Meter, Usage};
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, Quota, RateLimitLayer, RedisStore, Rule, Store,
};

/// The tokens every answer of the stand-in uses: what its last event reports.
const TOKENS_PER_ANSWER: u64 = 9_000;

/// The upstream's answer: a few events of text, then one with the usage, then `[DONE]`.
fn upstream() -> Router {
    Router::new().route(
        "/v1/completions",
        post(|| async {
            let events = [
                "data: {\"choices\":[{\"text\":\"Hello\"}]}\n\n".to_owned(),
                "data: {\"choices\":[{\"text\":\", world\"}]}\n\n".to_owned(),
                format!(
                    "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1000,\
                     \"completion_tokens\":{},\"total_tokens\":{TOKENS_PER_ANSWER}}}}}\n\n",
                    TOKENS_PER_ANSWER - 1_000
                ),
                "data: [DONE]\n\n".to_owned(),
            ];
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::new(Events(events.into_iter().collect())))
                .unwrap()
        }),
    )
}

/// A stream of server-sent events, one frame each.
struct Events(std::collections::VecDeque<String>);

impl http_body::Body for Events {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(
            self.0
                .pop_front()
                .map(|event| Ok(Frame::data(event.into()))),
        )
    }
}

/// The upstream's stream, passed through: the usage event is recorded, and the `Usage` goes
/// when the stream ends (or the client leaves), which settles the request.
struct Metered {
    upstream: Body,
    usage: Option<Usage>,
}

impl http_body::Body for Metered {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.upstream).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let (Some(data), Some(usage)) = (frame.data_ref(), &self.usage)
                    && let Some(tokens) = total_tokens(data)
                {
                    usage.record(tokens);
                }
            }
            _ => self.usage = None,
        }
        Poll::Ready(frame)
    }
}

/// The `total_tokens` of an event that reports usage.
fn total_tokens(event: &[u8]) -> Option<u64> {
    let json = std::str::from_utf8(event).ok()?.strip_prefix("data: ")?;
    let event: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
    event.get("usage")?.get("total_tokens")?.as_u64()
}

/// The gateway's route: sends the request upstream and streams the answer back, metered.
async fn complete(usage: Usage, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let upstream_request = Request::from_parts(parts, body);
    let answer = upstream()
        .oneshot(upstream_request)
        .await
        .expect("infallible");
    answer.map(|upstream| {
        Body::new(Metered {
            upstream,
            usage: Some(usage),
        })
    })
}

/// Reads the body before the layer: the prompt's tokens (about 4 bytes each) plus its
/// `max_tokens` (default 256) is the request's [`Estimate`].
async fn estimate(request: Request, next: Next) -> Result<Response, StatusCode> {
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .map_err(|_| StatusCode::PAYLOAD_TOO_LARGE)?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| StatusCode::BAD_REQUEST)?;
    let prompt = json.get("prompt").and_then(|p| p.as_str()).unwrap_or("");
    let max_tokens = json
        .get("max_tokens")
        .and_then(|m| m.as_u64())
        .unwrap_or(256);
    let estimate = (prompt.len() as u64).div_ceil(4) + max_tokens;
    parts.extensions.insert(Estimate(estimate));
    Ok(next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await)
}

/// The gateway: per API key, 60 requests and 40 000 tokens a minute, and tokens a day by plan.
fn app(store: impl Store) -> Router {
    let tokens_a_day = Quota::builder("tokens-daily")
        .key(Key::header("x-api-key"))
        .tier("free", 100_000)
        .tier("pro", 2_000_000)
        .tier_from_fn(|parts| {
            let plan = parts.headers.get("x-plan")?.to_str().ok()?;
            Some(plan.to_owned())
        })
        .metered()
        .build()
        .expect("a valid quota");
    let policy = Policy::builder("llm")
        .key(Key::header("x-api-key"))
        .algorithm(Algorithm::SlidingCounter)
        .rule(Rule::per_minute(60))
        .rule(Rule::per_minute(40_000).metered())
        .quota(tokens_a_day)
        .meter(Meter::new("tokens"))
        .build()
        .expect("a valid policy");
    Router::new()
        .route("/v1/completions", post(complete))
        .layer(RateLimitLayer::new(policy, store))
        // Outermost: runs first, so the estimate is there when the layer checks.
        .layer(middleware::from_fn(estimate))
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url).expect("a valid REDIS_URL")),
        Err(_) => app(MemoryStore::new()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3006")
        .await
        .expect("port 3006 is free");
    println!("listening on http://{}", listener.local_addr().unwrap());
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_event_is_read_and_the_others_are_not() {
        let usage = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":42}}\n\n";
        assert_eq!(total_tokens(usage), Some(42));
        assert_eq!(total_tokens(b"data: [DONE]\n\n"), None);
        assert_eq!(total_tokens(b"data: {\"choices\":[]}\n\n"), None);
    }
}
