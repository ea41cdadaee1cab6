//! One-time passwords by SMS, against SMS pumping: bots that ask codes for many numbers drain the
//! SMS balance, rotating numbers under one prefix. The number is in the JSON body, so the handler
//! limits it with two [`RateLimiter`]s: 3 codes per number per hour, and 20 per number prefix (its
//! first 8 characters) per hour. When the prefix refuses, the number's charge is given back, so a
//! pumping wave doesn't use up a real user's codes.
//!
//! ```text
//! cargo run --example otp     # serves 127.0.0.1:3005 (REDIS_URL: counts in Redis)
//! for i in $(seq 1 4); do curl -s -o /dev/null -w "%{http_code} " -H 'content-type: application/json' \
//!   -d '{"phone":"+15550100"}' 127.0.0.1:3005/otp; done
//! # 200 200 200 429
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Router, response::IntoResponse};
use tower_redis_ratelimit::{
    Key, MemoryStore, Policy, RateLimiter, RedisStore, Refused, Rule, Store,
};

#[derive(serde::Deserialize)]
struct OtpRequest {
    phone: String,
}

#[derive(Clone)]
struct Otp {
    per_number: RateLimiter,
    per_prefix: RateLimiter,
    /// Codes sent: what the SMS provider bills.
    sent: Arc<AtomicUsize>,
}

/// The prefix pumping rotates numbers under.
fn prefix_of(phone: &str) -> &str {
    phone.get(..8).unwrap_or(phone)
}

async fn send_otp(
    State(otp): State<Otp>,
    Json(request): Json<OtpRequest>,
) -> Result<impl IntoResponse, Refused> {
    let phone = request.phone.trim();
    if phone.len() < 8 || !phone.starts_with('+') {
        return Ok((
            StatusCode::BAD_REQUEST,
            None,
            "a phone number such as +15550100\n",
        ));
    }
    let admitted = otp.per_number.check(phone).await?;
    let admitted = match otp.per_prefix.check(prefix_of(phone)).await {
        Ok(_) => admitted,
        Err(refused) => {
            // The number's code wasn't sent: give back its unit, by its receipt (exactly that
            // unit, to the window it was charged in; best effort).
            let _ = admitted.refund().await;
            return Err(refused);
        }
    };
    otp.sent.fetch_add(1, Ordering::Relaxed);
    Ok((StatusCode::OK, Some(admitted), "code sent\n"))
}

fn app(store: impl Store + Clone, per_prefix_per_hour: u64) -> (Router, Otp) {
    // Keyed as a header's value is (a handle stores it as its hash, as the layer would): no
    // phone number in Redis keys, logs or the top-refused list.
    let per_number = Policy::builder("otp-number")
        .key(Key::header("x-phone"))
        .rule(Rule::per_hour(3))
        .message("Too many codes for this number; try again later.")
        .build()
        .expect("a valid policy");
    let per_prefix = Policy::builder("otp-prefix")
        .key(Key::header("x-phone"))
        .rule(Rule::per_hour(per_prefix_per_hour))
        .message("Too many codes for numbers like this one; try again later.")
        .build()
        .expect("a valid policy");
    let otp = Otp {
        per_number: RateLimiter::new(per_number, store.clone()),
        per_prefix: RateLimiter::new(per_prefix, store),
        sent: Arc::new(AtomicUsize::new(0)),
    };
    let router = Router::new()
        .route("/otp", post(send_otp))
        .with_state(otp.clone());
    (router, otp)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let (app, _) = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url).expect("a valid REDIS_URL"), 20),
        Err(_) => app(MemoryStore::new(), 20),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3005").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::body::Body;
    use http::Request;
    use tower::ServiceExt;

    async fn ask(app: &Router, phone: &str) -> http::Response<Body> {
        let request = Request::post("/otp")
            .header("content-type", "application/json")
            .body(Body::from(format!("{{\"phone\":\"{phone}\"}}")))
            .unwrap();
        app.clone().oneshot(request).await.unwrap()
    }

    #[tokio::test]
    async fn three_codes_per_number_with_headers() {
        let (app, otp) = app(MemoryStore::new(), 20);
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let response = ask(&app, "+15550100").await;
            assert!(response.headers().contains_key("ratelimit-policy"));
            statuses.push(response.status().as_u16());
        }
        assert_eq!(statuses, [200, 200, 200, 429]);
        assert_eq!(otp.sent.load(Ordering::Relaxed), 3);
        assert_eq!(ask(&app, "garbage").await.status(), 400);
    }

    #[tokio::test]
    async fn a_pumping_wave_under_one_prefix_is_cut_and_spares_the_numbers() {
        let (app, otp) = app(MemoryStore::new(), 5);
        let mut statuses = Vec::new();
        for n in 0..8 {
            statuses.push(ask(&app, &format!("+1555010{n}")).await.status().as_u16());
        }
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
        assert_eq!(otp.sent.load(Ordering::Relaxed), 5);
        // The numbers the prefix refused were given their unit back.
        let state = otp.per_number.peek("+15550107").await.unwrap();
        assert_eq!(state.rules[0].remaining, 3);
        // Another prefix is untouched.
        assert_eq!(ask(&app, "+44207946000").await.status(), 200);
    }
}
