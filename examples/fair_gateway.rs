//! An LLM gateway that buys one budget from its vendor and serves tenants on three plans from
//! it: 60 requests a second for everyone, shared fairly once saturated, a `free` tenant weighing
//! 1, a `team` tenant 2 and an `enterprise` tenant 3 (10, 20 and 30 a second when all want
//! more). While the budget isn't saturated nobody waits for fairness; what one tenant leaves goes
//! to the others (see the guide's fair shares). The plan comes from `x-plan`, which your
//! authentication layer would set from the API key; here the client sends it.
//!
//! ```text
//! cargo run --example fair_gateway       # serves 127.0.0.1:3008 (REDIS_URL: shared in Redis)
//! for i in $(seq 1 61); do curl -s -o /dev/null -w "%{http_code} " -H 'x-api-key: a' -H 'x-plan: free' 127.0.0.1:3008/v1/chat; done
//! # alone, a tenant may use the whole budget: 60 × 200, then 429 (within one second)
//! ```
//!
//! With `REDIS_URL`, every instance of the gateway shares the one budget and its shares.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use http::request::Parts;
use tower_redis_ratelimit::fair::FairShare;
use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Rule, Store};

/// A tenant's weight by its plan (`x-plan`): what its share of a saturated budget is in
/// proportion to.
fn plan_weight(parts: &Parts) -> u32 {
    match parts.headers.get("x-plan").map(|plan| plan.as_bytes()) {
        Some(b"enterprise") => 3,
        Some(b"team") => 2,
        _ => 1,
    }
}

fn app(store: impl Store) -> Router {
    let policy = Policy::builder("chat")
        .key(Key::header("x-api-key"))
        // Each tenant's own limit, whatever the others do.
        .rule(Rule::per_second(100))
        .fair_share(
            FairShare::new(Rule::per_second(60).named("vendor-budget")).weight_from_fn(plan_weight),
        )
        .build()
        .expect("a valid policy");
    Router::new()
        .route("/v1/chat", get(|| async { "a completion\n" }))
        .layer(RateLimitLayer::new(policy, store))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url).expect("a valid REDIS_URL")),
        Err(_) => app(MemoryStore::new()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3008").await?;
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

    use std::time::Duration;

    use axum::body::Body;
    use http::{Request, StatusCode};
    use tower::ServiceExt;
    use tower_redis_ratelimit::store::ManualClock;

    fn chat(key: &str, plan: &str) -> Request<Body> {
        Request::get("/v1/chat")
            .header("x-api-key", key)
            .header("x-plan", plan)
            .body(Body::empty())
            .unwrap()
    }

    /// Each tenant asks `asks` times in turn; how many each was admitted.
    async fn round(app: &Router, tenants: &[(&str, &str)], asks: usize) -> Vec<usize> {
        let mut admitted = vec![0; tenants.len()];
        for _ in 0..asks {
            for (at, (key, plan)) in tenants.iter().enumerate() {
                let status = app.clone().oneshot(chat(key, plan)).await.unwrap().status();
                if status == StatusCode::OK {
                    admitted[at] += 1;
                }
            }
        }
        admitted
    }

    #[tokio::test]
    async fn a_saturated_budget_is_shared_by_plan_and_a_quiet_tenants_share_goes_to_the_others() {
        // (At the start of a second: the budget's windows are epoch-aligned.)
        let clock = ManualClock::new(1_700_000_000_000);
        let app = app(MemoryStore::builder().clock(clock.clone()).build());
        let tenants = [("a", "free"), ("b", "team"), ("c", "enterprise")];
        // The first second saturates the budget; from the next, the shares hold.
        round(&app, &tenants, 40).await;
        clock.advance(Duration::from_secs(1));
        assert_eq!(round(&app, &tenants, 40).await, [10, 20, 30]);
        // The enterprise tenant goes quiet: its share is held for it a tenth of the next second,
        // then goes to the two others (by weight: 20 and 40).
        clock.advance(Duration::from_secs(1));
        assert_eq!(round(&app, &tenants[..2], 40).await, [10, 20]);
        clock.advance(Duration::from_millis(200));
        assert_eq!(round(&app, &tenants[..2], 40).await, [10, 20]);
    }
}
