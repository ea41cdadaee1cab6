//! The demo's operator listener (`metrics = "127.0.0.1:9091"`): Prometheus text at `GET /metrics`,
//! the most refused identities per policy at `GET /debug/ratelimit/top`, and one identity's state
//! at `GET /debug/ratelimit/{policy}/{identity}` (`DELETE` resets it). Policy names are paths, so
//! their slashes are sent as `%2F`. It answers anyone who can reach it, so bind it to loopback
//! or a private interface.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use tower_redis_ratelimit::config::RouteLimitsLayer;
use tower_redis_ratelimit::{
    RateLimitLayer,
    operate::{HeavyHitter, OperatorError},
};

/// Store calls take from tens of microseconds (memory) to a timeout (250 ms by default).
const STORE_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// Delay-mode waits: up to a policy's `max_delay`, seconds to a minute or so.
const DELAY_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Installs the process's Prometheus recorder, before any layer is built, so that every layer's
/// metric handles record into it; histograms as buckets, for `histogram_quantile`.
pub fn install_recorder() -> Result<PrometheusHandle, BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("ratelimit_store_duration_seconds".into()),
            STORE_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("ratelimit_delay_seconds".into()),
            DELAY_BUCKETS,
        )?
        .install_recorder()
}

/// What the listener answers from: the recorder and the routes' limiter (none with
/// `--no-limiter`).
#[derive(Clone)]
pub struct Operator {
    pub prometheus: PrometheusHandle,
    pub limits: Option<RouteLimitsLayer>,
}

impl Operator {
    /// Each route's layer, asked of the limiter at each request, so that the policies answered
    /// are the ones it limits by now.
    fn layers(&self) -> Vec<RateLimitLayer> {
        self.limits
            .as_ref()
            .map(RouteLimitsLayer::layers)
            .unwrap_or_default()
    }
}

/// `?n=` of `/debug/ratelimit/top`: how many identities per policy (default 10, at most 1 000).
#[derive(Deserialize)]
struct TopQuery {
    n: Option<usize>,
}

/// The operator routes.
pub fn router(operator: Operator) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/debug/ratelimit/top", get(top))
        .route(
            "/debug/ratelimit/{policy}/{identity}",
            get(inspect).delete(reset),
        )
        .with_state(operator)
}

async fn metrics(State(operator): State<Operator>) -> String {
    operator.prometheus.render()
}

/// `{"<policy>": [{"key_kind", "identity", "count", "error"}, …], …}`, most refused first.
async fn top(
    State(operator): State<Operator>,
    Query(query): Query<TopQuery>,
) -> Json<BTreeMap<String, Vec<HeavyHitter>>> {
    let n = query.n.unwrap_or(10).min(1_000);
    Json(
        operator
            .layers()
            .iter()
            .map(|layer| (layer.policy().name().to_owned(), layer.top_refused(n)))
            .collect(),
    )
}

/// The layer of `policy`.
fn layer_of(operator: &Operator, policy: &str) -> Option<RateLimitLayer> {
    operator
        .layers()
        .into_iter()
        .find(|layer| layer.policy().name() == policy)
}

fn no_policy(policy: &str) -> Response {
    (StatusCode::NOT_FOUND, format!("no policy {policy:?}\n")).into_response()
}

/// An operator error as an answer: the store's failures are 503, the rest the caller's (400).
fn failed(error: OperatorError) -> Response {
    let status = match error {
        OperatorError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, format!("{error}\n")).into_response()
}

/// `[{"rule", "limit", "remaining", "reset_ms"}, …]`: the identity's state, nothing counted.
async fn inspect(
    State(operator): State<Operator>,
    Path((policy, identity)): Path<(String, String)>,
) -> Response {
    let Some(layer) = layer_of(&operator, &policy) else {
        return no_policy(&policy);
    };
    match layer.inspect(&identity).await {
        Ok(state) => Json(state).into_response(),
        Err(error) => failed(error),
    }
}

/// Forgets the identity's counts and lifts its block: 204.
async fn reset(
    State(operator): State<Operator>,
    Path((policy, identity)): Path<(String, String)>,
) -> Response {
    let Some(layer) = layer_of(&operator, &policy) else {
        return no_policy(&policy);
    };
    match layer.reset(&identity).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => failed(error),
    }
}

/// Serves the operator routes on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, operator: Operator) {
    let address = listener.local_addr().ok();
    if let Err(error) = axum::serve(listener, router(operator)).await {
        tracing::error!(?address, %error, "the operator listener stopped");
    }
}

/// The address `metrics = "…"` names, or a message for the config error.
pub fn parse_address(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP address and port such as \"127.0.0.1:9091\""))
}
