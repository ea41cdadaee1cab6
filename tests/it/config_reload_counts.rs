//! Counts follow their route across a reload, not its place in the file (issue 46): reordering
//! routes or inserting one keeps every count; each single-field edit keeps or resets a route's
//! counts exactly as `ReloadSummary` documents, and the reset routes are named. Both stores.

use crate::common;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::send;
use http::{Request, StatusCode};
use tower_redis_ratelimit::config::RateLimitConfig;
use tower_redis_ratelimit::{MemoryStore, RedisStore, Store};

fn config(prefix: &str, routes: &str) -> RateLimitConfig {
    RateLimitConfig::from_toml_str(&format!("prefix = \"{prefix}\"\n{routes}")).unwrap()
}

/// `GET uri` from one client, with `x-client: c1` (the header-keyed routes' identity).
async fn status(app: &Router, uri: &str) -> StatusCode {
    let mut request = Request::get(uri)
        .header("x-client", "c1")
        .body(Body::empty())
        .unwrap();
    let peer: std::net::SocketAddr = "192.0.2.7:4000".parse().unwrap();
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(peer));
    send(app, request).await.status()
}

/// Requests to `uri` until one is refused (at most `at_most`): how many were admitted.
async fn admitted(app: &Router, uri: &str, at_most: usize) -> usize {
    for admitted in 0..at_most {
        if status(app, uri).await == StatusCode::TOO_MANY_REQUESTS {
            return admitted;
        }
    }
    at_most
}

/// A store and the key prefix its case runs under.
type PrefixedStore = (Arc<dyn Store>, String);

/// The two stores, each with its key prefix, and the test Redis (kept running while it lives).
fn both_stores(test: &str) -> (Vec<PrefixedStore>, TestRedis) {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    let stores = vec![
        (
            Arc::new(MemoryStore::new()) as Arc<dyn Store>,
            "rl".to_owned(),
        ),
        (Arc::new(store) as Arc<dyn Store>, unique_prefix(test)),
    ];
    (stores, redis)
}

const A_THEN_B: &str = r#"
[[routes]]
path = "/a/{x}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
[[routes]]
path = "/b/{y}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
"#;

const B_THEN_A: &str = r#"
[[routes]]
path = "/b/{y}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
[[routes]]
path = "/a/{x}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
"#;

const INSERTED_ABOVE: &str = r#"
[[routes]]
path = "/c/{z}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
[[routes]]
path = "/a/{x}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
[[routes]]
path = "/b/{y}"
key = "header:x-client"
rules = [{ limit = 3, period = "1m" }]
"#;

fn router() -> Router {
    let ok = || get(|| async { "ok" });
    Router::new()
        .route("/a/{x}", ok())
        .route("/b/{y}", ok())
        .route("/c/{z}", ok())
}

/// The outside probe's case: after `/a/1` is refused, a reload that only swaps the two entries
/// keeps both routes as they were (`kept: 2`); `/a/1` stays refused, and `/b/1`, never called,
/// has its whole budget. A route inserted above them keeps their counts too.
#[tokio::test]
async fn reordering_or_inserting_routes_keeps_every_count() {
    let (stores, _redis) = both_stores("reload-order");
    for (store, prefix) in stores {
        let limits = config(&prefix, A_THEN_B).route_limits(store).unwrap();
        let app = router().route_layer(limits.clone());
        assert_eq!(admitted(&app, "/a/1", 5).await, 3);
        let summary = limits.reload(&config(&prefix, B_THEN_A)).unwrap();
        assert_eq!((summary.kept, summary.changed), (2, 0), "{summary:?}");
        assert!(summary.reset_paths.is_empty(), "{summary:?}");
        assert_eq!(status(&app, "/a/1").await, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(admitted(&app, "/b/1", 5).await, 3);
        let summary = limits.reload(&config(&prefix, INSERTED_ABOVE)).unwrap();
        assert_eq!((summary.kept, summary.added), (2, 1), "{summary:?}");
        assert_eq!(status(&app, "/a/1").await, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(status(&app, "/b/1").await, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(admitted(&app, "/c/1", 5).await, 3);
    }
}

/// Each single-field edit of a route whose 3-per-minute budget is used up: the edits the
/// `ReloadSummary` docs say keep its counts keep it refused, and its path is not in
/// `reset_paths`; those that reset it give it a fresh budget, and name it.
#[tokio::test]
async fn each_single_field_edit_keeps_or_resets_counts_as_documented() {
    let bucket = "algorithm = \"token_bucket\"";
    let fixed = "algorithm = \"fixed_window\"";
    let two_rules = "rules = [{ limit = 3, period = \"1m\" }, { limit = 100, period = \"1h\" }]";
    let burst = format!("{bucket}\nrules = [{{ limit = 3, period = \"1m\", burst = 2 }}]");
    let prefetch = format!("{fixed}\nprefetch = 10");
    let delay = "mode = \"delay\"\nmax_delay = \"1ms\"";
    // (the field, what the first file adds, what the second sets instead, whether counts stay)
    let cases: [(&str, &str, &str, bool); 18] = [
        ("burst", bucket, &burst, true),
        ("mode", "", delay, true),
        (
            "max_delay",
            delay,
            "mode = \"delay\"\nmax_delay = \"2ms\"",
            true,
        ),
        ("block_for", "", "block_for = \"1s\"", true),
        ("count_only", "", "count_only = [401]", true),
        ("cost_header", "", "cost_header = \"x-cost\"", true),
        (
            "max_in_flight",
            "",
            "max_in_flight = 100\nlease = \"30s\"",
            true,
        ),
        ("prevent_duplicate", "", "prevent_duplicate = true", true),
        ("prefetch", fixed, &prefetch, true),
        (
            "overrides",
            "",
            "overrides = [{ identity = \"someone\", unlimited = true }]",
            true,
        ),
        ("a rule added", "", two_rules, true),
        (
            "a rule removed",
            two_rules,
            "rules = [{ limit = 3, period = \"1m\" }]",
            true,
        ),
        ("name", "", "name = \"renamed\"", false),
        ("key", "", "key = \"ip\"", false),
        ("algorithm", "", "algorithm = \"fixed_window\"", false),
        (
            "limit",
            "",
            "rules = [{ limit = 4, period = \"1m\" }]",
            false,
        ),
        (
            "period",
            "",
            "rules = [{ limit = 3, period = \"2m\" }]",
            false,
        ),
        ("prefix", "", "", false),
    ];
    let (stores, _redis) = both_stores("reload-fields");
    for (store, prefix) in stores {
        for (field, before, after, kept) in &cases {
            // Each case under its own prefix: its counts start empty. The prefix case reloads
            // under another one.
            let case_prefix = format!("{prefix}-{}", field.replace(' ', "-"));
            let after_prefix = if *field == "prefix" {
                format!("{case_prefix}-moved")
            } else {
                case_prefix.clone()
            };
            let first = one_route(&case_prefix, before);
            // A second `rules` or `key` line replaces the first: TOML refuses duplicates, so
            // the edit is spliced in place of the line it changes.
            let second_text = edited(before, after);
            let second = one_route(&after_prefix, &second_text);
            let limits = first.route_limits(store.clone()).unwrap();
            let app = router().route_layer(limits.clone());
            assert_eq!(admitted(&app, "/a/1", 5).await, 3, "{field}");
            let summary = limits.reload(&second).unwrap();
            assert_eq!(summary.changed, 1, "{field}: {summary:?}");
            let named = summary.reset_paths == ["/a/{x}"];
            let refused = status(&app, "/a/1").await == StatusCode::TOO_MANY_REQUESTS;
            assert_eq!(
                (refused, !named),
                (*kept, *kept),
                "{field}: refused after the reload {refused}, named as reset {named}"
            );
        }
    }
}

/// The route's extra lines after an edit: `after`'s lines, and `before`'s that `after` doesn't
/// set again.
fn edited(before: &str, after: &str) -> String {
    let field = |line: &str| line.split('=').next().unwrap_or("").trim().to_owned();
    let replaced: Vec<String> = after.lines().map(field).collect();
    before
        .lines()
        .filter(|line| !replaced.contains(&field(line)))
        .chain(after.lines())
        .collect::<Vec<_>>()
        .join("\n")
}

/// One route, `/a/{x}`, keyed by `x-client`, 3 per minute, and `extra` (which may set `rules`
/// or `key` itself).
fn one_route(prefix: &str, extra: &str) -> RateLimitConfig {
    let mut lines = vec!["[[routes]]".to_owned(), "path = \"/a/{x}\"".to_owned()];
    let sets = |name: &str| {
        extra
            .lines()
            .any(|line| line.trim_start().starts_with(name))
    };
    if !sets("key") {
        lines.push("key = \"header:x-client\"".to_owned());
    }
    if !sets("rules") {
        lines.push("rules = [{ limit = 3, period = \"1m\" }]".to_owned());
    }
    lines.push(extra.to_owned());
    config(prefix, &lines.join("\n"))
}
