//! Limits per customer changed at run time: an API of 5 requests a minute per API key, and an
//! admin route an operator calls to raise, lower or block one key's limits on every instance,
//! with what the key has used carried over (see the guide's run-time overrides). Put the admin
//! routes behind your own authentication: here they are open, on loopback.
//!
//! ```text
//! cargo run --example admin_overrides      # serves 127.0.0.1:3007 (REDIS_URL: kept in Redis)
//! for i in $(seq 1 3); do curl -s -o /dev/null -w "%{http_code} " -H 'x-api-key: acme' 127.0.0.1:3007/api; done
//! # 200 200 200: acme used 3 of its 5
//! curl -X PUT -H 'content-type: application/json' -d '{"per_minute":20}' 127.0.0.1:3007/admin/overrides/acme
//! # acme has 17 left this minute, on every instance sharing the store
//! curl -X PUT -H 'content-type: application/json' -d '{"deny":true,"for_seconds":3600}' 127.0.0.1:3007/admin/overrides/acme
//! curl 127.0.0.1:3007/admin/overrides      # what is set, and how long it has left
//! curl -X DELETE 127.0.0.1:3007/admin/overrides/acme
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::{Json, Path, State};
use axum::http::StatusCode;
use axum::routing::{get, put};
use tower_redis_ratelimit::operate::{OperatorError, SetOverride};
use tower_redis_ratelimit::policy::Override;
use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Rule, Store};

/// What an operator sets for one API key: a limit a minute, or a block; for a while or until
/// removed.
#[derive(serde::Deserialize)]
struct Change {
    per_minute: Option<u64>,
    #[serde(default)]
    deny: bool,
    for_seconds: Option<u64>,
}

/// `PUT /admin/overrides/{key}`: the key's override from now on, on every instance.
async fn set(
    State(layer): State<RateLimitLayer>,
    Path(key): Path<String>,
    Json(change): Json<Change>,
) -> Result<StatusCode, (StatusCode, String)> {
    let target = Override::identity(key);
    let over = match (change.deny, change.per_minute) {
        (true, _) => target.deny(),
        (false, Some(limit)) => target.rules([Rule::per_minute(limit)]),
        (false, None) => return Err((StatusCode::BAD_REQUEST, "per_minute or deny\n".into())),
    };
    let set = match change.for_seconds {
        Some(seconds) => {
            layer
                .set_override_for(over, Duration::from_secs(seconds))
                .await
        }
        None => layer.set_override(over).await,
    };
    set.map(|()| StatusCode::NO_CONTENT).map_err(refused)
}

/// `DELETE /admin/overrides/{key}`: back to the policy's limits, with what the key used.
async fn remove(
    State(layer): State<RateLimitLayer>,
    Path(key): Path<String>,
) -> Result<StatusCode, (StatusCode, String)> {
    layer
        .remove_override(Override::identity(key))
        .await
        .map(|()| StatusCode::NO_CONTENT)
        .map_err(refused)
}

/// `GET /admin/overrides`: what is set (keys as the policy stores them: hashed).
async fn list(
    State(layer): State<RateLimitLayer>,
) -> Result<Json<Vec<SetOverride>>, (StatusCode, String)> {
    layer.overrides().await.map(Json).map_err(refused)
}

/// A bad override is the operator's mistake (400); a store that fails, the service's (503).
fn refused(error: OperatorError) -> (StatusCode, String) {
    let status = match error {
        OperatorError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, format!("{error}\n"))
}

fn app(store: impl Store) -> Router {
    let policy = Policy::builder("api")
        .key(Key::header("x-api-key"))
        .rule(Rule::per_minute(5))
        .build()
        .expect("a valid policy");
    let layer = RateLimitLayer::new(policy, store);
    let admin = Router::new()
        .route("/admin/overrides", get(list))
        .route("/admin/overrides/{key}", put(set).delete(remove))
        .with_state(layer.clone());
    Router::new()
        .route("/api", get(|| async { "ok\n" }))
        .layer(layer)
        .merge(admin)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url).expect("a valid REDIS_URL")),
        Err(_) => app(MemoryStore::new()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3007").await?;
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

    async fn call(app: &Router, request: Request<Body>) -> StatusCode {
        app.clone().oneshot(request).await.unwrap().status()
    }

    fn api(key: &str) -> Request<Body> {
        Request::get("/api")
            .header("x-api-key", key)
            .body(Body::empty())
            .unwrap()
    }

    fn change(key: &str, body: &str) -> Request<Body> {
        Request::put(format!("/admin/overrides/{key}"))
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    /// How many calls of `key` are admitted before the first refusal (at most 50).
    async fn admitted(app: &Router, key: &str) -> usize {
        for admitted in 0..50 {
            if call(app, api(key)).await == StatusCode::TOO_MANY_REQUESTS {
                return admitted;
            }
        }
        50
    }

    #[tokio::test]
    async fn a_raise_carries_the_count_and_a_removal_ends_it() {
        let app = app(MemoryStore::new());
        for _ in 0..3 {
            assert_eq!(call(&app, api("acme")).await, StatusCode::OK);
        }
        assert_eq!(
            call(&app, change("acme", r#"{"per_minute":20}"#)).await,
            StatusCode::NO_CONTENT
        );
        assert_eq!(admitted(&app, "acme").await, 17);
        assert_eq!(admitted(&app, "globex").await, 5);
        let listed = app
            .clone()
            .oneshot(
                Request::get("/admin/overrides")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let body = axum::body::to_bytes(listed.into_body(), 1 << 16)
            .await
            .unwrap();
        let listed: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
        assert_eq!(listed.len(), 1);
        let removal = Request::delete("/admin/overrides/acme")
            .body(Body::empty())
            .unwrap();
        assert_eq!(call(&app, removal).await, StatusCode::NO_CONTENT);
        assert_eq!(admitted(&app, "acme").await, 0);
        // A block, and a bad change.
        assert_eq!(
            call(&app, change("globex", r#"{"deny":true,"for_seconds":60}"#)).await,
            StatusCode::NO_CONTENT
        );
        assert_eq!(call(&app, api("globex")).await, StatusCode::FORBIDDEN);
        assert_eq!(
            call(&app, change("globex", r#"{"per_minute":0}"#)).await,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            call(&app, change("globex", "{}")).await,
            StatusCode::BAD_REQUEST
        );
    }
}
