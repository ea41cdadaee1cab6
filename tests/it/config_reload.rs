//! Live reload of a `RouteLimitsLayer` (feature `config`): unchanged rules keep their counts, a
//! changed limit applies to the next request, a bad file changes nothing, requests in flight
//! finish under the policies they started with, concurrent requests see one policy or the other,
//! and a `ConfigWatcher` reloads on a change of the file and on SIGHUP.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::{request_from, send};
use http::{Response, StatusCode};
use tokio::sync::Notify;
use tower_redis_ratelimit::config::{
    ConfigLoader, ConfigWatcher, RateLimitConfig, ReloadSummary, RouteLimitsLayer,
};
use tower_redis_ratelimit::policy::Override;
use tower_redis_ratelimit::{MemoryStore, RedisStore, Rule, Store};

const PEER: &str = "192.0.2.7:4000";

/// The config of `routes` (TOML `[[routes]]` entries) with key prefix `prefix`.
fn config(prefix: &str, routes: &str) -> RateLimitConfig {
    RateLimitConfig::from_toml_str(&format!("prefix = \"{prefix}\"\n{routes}")).unwrap()
}

/// `/a`, `/b`, `/c` answering "ok", limited by `limits`.
fn app(limits: &RouteLimitsLayer) -> Router {
    let ok = || get(|| async { "ok" });
    Router::new()
        .route("/a", ok())
        .route("/b", ok())
        .route("/c", ok())
        .route_layer(limits.clone())
}

async fn get_path(app: &Router, path: &str) -> Response<Body> {
    send(app, request_from(PEER, path)).await
}

/// The quota (`q`) of each rule named in `RateLimit-Policy`, in order.
fn quotas(response: &Response<Body>) -> Vec<(String, u64)> {
    common::limits(response)
        .policies
        .into_iter()
        .map(|policy| (policy.name, policy.quota))
        .collect()
}

async fn counts_survive_for_unchanged_rules(store: Arc<dyn Store>, prefix: &str) {
    let first = config(
        prefix,
        r#"
        [[routes]]
        path = "/a"
        rules = [{ limit = 3, period = "1m" }]
        [[routes]]
        path = "/b"
        rules = [{ limit = 2, period = "1m" }]
        "#,
    );
    let limits = first.route_limits(store).unwrap();
    let app = app(&limits);
    for path in ["/a", "/a", "/b", "/b"] {
        assert_eq!(get_path(&app, path).await.status(), StatusCode::OK);
    }

    let second = config(
        prefix,
        r#"
        [[routes]]
        path = "/a"
        rules = [{ limit = 3, period = "1m" }]
        [[routes]]
        path = "/b"
        rules = [{ limit = 2, period = "1m" }, { limit = 100, period = "1h" }]
        [[routes]]
        path = "/c"
        rules = [{ limit = 1, period = "1m" }]
        "#,
    );
    let summary: ReloadSummary = limits.reload(&second).unwrap();
    let changes = (
        summary.kept,
        summary.changed,
        summary.added,
        summary.removed,
    );
    assert_eq!(changes, (1, 1, 1, 0));
    assert_eq!(limits.reload_counts(), (1, 0));

    // `/a` is unchanged: its third request is its last.
    let third = get_path(&app, "/a").await;
    assert_eq!(third.status(), StatusCode::OK);
    assert_eq!(
        common::limits(&third)
            .status("3-per-60s")
            .unwrap()
            .remaining,
        0
    );
    common::assert_refused(get_path(&app, "/a").await, &["3-per-60s"]).await;
    // `/b` changed, but its 2-per-minute rule did not: its two requests still count.
    common::assert_refused(get_path(&app, "/b").await, &["2-per-60s"]).await;
    // `/c` is new.
    assert_eq!(get_path(&app, "/c").await.status(), StatusCode::OK);
    common::assert_refused(get_path(&app, "/c").await, &["1-per-60s"]).await;
}

#[tokio::test]
async fn counts_survive_a_reload_for_unchanged_rules_in_memory() {
    counts_survive_for_unchanged_rules(Arc::new(MemoryStore::new()), "rl").await;
}

#[tokio::test]
async fn counts_survive_a_reload_for_unchanged_rules_in_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    counts_survive_for_unchanged_rules(Arc::new(store), &unique_prefix("reload-counts")).await;
}

async fn a_changed_limit_applies_to_the_next_request(store: Arc<dyn Store>, prefix: &str) {
    let route = |limit: u64| {
        format!("[[routes]]\npath = \"/a\"\nrules = [{{ limit = {limit}, period = \"1m\" }}]\n")
    };
    let limits = config(prefix, &route(1)).route_limits(store).unwrap();
    let app = app(&limits);
    assert_eq!(get_path(&app, "/a").await.status(), StatusCode::OK);
    common::assert_refused(get_path(&app, "/a").await, &["1-per-60s"]).await;

    limits.reload(&config(prefix, &route(3))).unwrap();
    let next = get_path(&app, "/a").await;
    assert_eq!(next.status(), StatusCode::OK);
    assert_eq!(quotas(&next), [("3-per-60s".to_owned(), 3)]);

    // A route the file no longer names is no longer limited.
    let summary = limits
        .reload(&config(prefix, &route(3).replace("/a", "/b")))
        .unwrap();
    assert_eq!((summary.added, summary.removed), (1, 1));
    for _ in 0..5 {
        let response = get_path(&app, "/a").await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit-policy").is_none());
    }
}

/// An override set at run time through a route's layer (`RouteLimitsLayer::layers`) is the
/// store's: the route's limiter after a reload applies it too, counting where it did (both
/// stores fix an override's counters when it is set), and the layer from before the reload
/// still removes it.
async fn a_run_time_override_of_a_route_outlives_a_reload(store: Arc<dyn Store>, prefix: &str) {
    let route = |limit: u64| {
        format!("[[routes]]\npath = \"/a\"\nrules = [{{ limit = {limit}, period = \"1m\" }}]\n")
    };
    let limits = config(prefix, &route(2)).route_limits(store).unwrap();
    let app = app(&limits);
    let layer = limits.layers().into_iter().next().unwrap();
    let client = Override::identity(PEER.split(':').next().unwrap());
    layer
        .set_override(client.clone().rules([Rule::per_minute(5)]))
        .await
        .unwrap();
    let first = get_path(&app, "/a").await;
    assert_eq!(quotas(&first), [("5-per-60s".to_owned(), 5)]);
    for _ in 0..4 {
        assert_eq!(get_path(&app, "/a").await.status(), StatusCode::OK);
    }
    common::assert_refused(get_path(&app, "/a").await, &["5-per-60s"]).await;

    // The route's limit changed: the override counts on where it was set to (its store fixed
    // its counters), and applies to the route's new limiter.
    limits.reload(&config(prefix, &route(4))).unwrap();
    common::assert_refused(get_path(&app, "/a").await, &["5-per-60s"]).await;
    // Removed through the layer from before the reload: the route's own 4 again, in the
    // counter of its new limit, which starts afresh.
    layer.remove_override(client).await.unwrap();
    for _ in 0..4 {
        assert_eq!(get_path(&app, "/a").await.status(), StatusCode::OK);
    }
    common::assert_refused(get_path(&app, "/a").await, &["4-per-60s"]).await;
}

#[tokio::test]
async fn a_run_time_override_of_a_route_outlives_a_reload_in_memory() {
    a_run_time_override_of_a_route_outlives_a_reload(Arc::new(MemoryStore::new()), "rl").await;
}

#[tokio::test]
async fn a_run_time_override_of_a_route_outlives_a_reload_in_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    let prefix = unique_prefix("reload-override");
    a_run_time_override_of_a_route_outlives_a_reload(Arc::new(store), &prefix).await;
}

#[tokio::test]
async fn a_changed_limit_applies_to_the_next_request_in_memory() {
    a_changed_limit_applies_to_the_next_request(Arc::new(MemoryStore::new()), "rl").await;
}

#[tokio::test]
async fn a_changed_limit_applies_to_the_next_request_in_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    a_changed_limit_applies_to_the_next_request(Arc::new(store), &unique_prefix("reload-limit"))
        .await;
}

/// A file of this test's own in the temporary directory, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!(
            "trr-{}-{name}-{}.toml",
            std::process::id(),
            unique_prefix("f")
        ));
        std::fs::write(&path, text).unwrap();
        TempFile(path)
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.0, text).unwrap();
    }
}

/// The limits of `file`, in a memory store, and the loader that read it.
fn limits_from(file: &TempFile) -> (ConfigLoader, RouteLimitsLayer) {
    let loader = RateLimitConfig::loader();
    let config = loader.from_path(&file.0).unwrap();
    let limits = config.route_limits(Arc::new(MemoryStore::new())).unwrap();
    (loader, limits)
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const ONE_PER_MINUTE: &str =
    "[[routes]]\npath = \"/a\"\nrules = [{ limit = 1, period = \"1m\" }]\n";
const FIVE_PER_MINUTE: &str =
    "[[routes]]\npath = \"/a\"\nrules = [{ limit = 5, period = \"1m\" }]\n";
const BAD_LIMIT: &str = "[[routes]]\npath = \"/a\"\nrules = [{ limit = 0, period = \"1m\" }]\n";

#[tokio::test]
async fn a_bad_file_changes_nothing() {
    let file = TempFile::new("bad", ONE_PER_MINUTE);
    let (loader, limits) = limits_from(&file);
    let app = app(&limits);
    assert_eq!(get_path(&app, "/a").await.status(), StatusCode::OK);

    file.write(BAD_LIMIT);
    let error = limits.reload_from_path(&loader, &file.0).unwrap_err();
    assert_eq!(
        error.to_string(),
        "routes[0].rules[0].limit: must be at least 1 (line 3, column 20)"
    );
    std::fs::remove_file(&file.0).unwrap();
    let missing = limits.reload_from_path(&loader, &file.0).unwrap_err();
    assert!(missing.to_string().starts_with("cannot read "), "{missing}");
    assert_eq!(limits.reload_counts(), (0, 2));
    // The first policy stands, with its count.
    let refused = get_path(&app, "/a").await;
    assert_eq!(quotas(&refused), [("1-per-60s".to_owned(), 1)]);
    common::assert_refused(refused, &["1-per-60s"]).await;
}

#[tokio::test]
async fn requests_in_flight_finish_under_the_policy_they_started_with() {
    let limits = config(
        "rl",
        ONE_PER_MINUTE.replace("limit = 1", "limit = 2").as_str(),
    )
    .route_limits(Arc::new(MemoryStore::new()))
    .unwrap();
    let entered = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let slow = {
        let (entered, release) = (entered.clone(), release.clone());
        get(move || async move {
            entered.notify_one();
            release.notified().await;
            "late"
        })
    };
    let app = Router::new().route("/a", slow).route_layer(limits.clone());
    let in_flight = tokio::spawn({
        let app = app.clone();
        async move { get_path(&app, "/a").await }
    });
    entered.notified().await;
    limits.reload(&config("rl", FIVE_PER_MINUTE)).unwrap();
    release.notify_one();
    let response = in_flight.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(quotas(&response), [("2-per-60s".to_owned(), 2)]);

    let next = tokio::spawn({
        let app = app.clone();
        async move { get_path(&app, "/a").await }
    });
    entered.notified().await;
    release.notify_one();
    assert_eq!(quotas(&next.await.unwrap()), [("5-per-60s".to_owned(), 5)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_during_reloads_see_one_policy_or_the_other() {
    // The two policies differ in every header they produce: rules, and the legacy trio.
    let old = config(
        "rl",
        "[[routes]]\npath = \"/a\"\nrules = [{ limit = 100000, period = \"1m\" }]\n",
    );
    let new = config(
        "rl",
        "legacy_headers = true\n[[routes]]\npath = \"/a\"\n\
         rules = [{ limit = 200000, period = \"1m\" }, { limit = 900000, period = \"1h\" }]\n",
    );
    let limits = old.route_limits(Arc::new(MemoryStore::new())).unwrap();
    let app = app(&limits);
    let reloads = tokio::spawn({
        let limits = limits.clone();
        async move {
            for round in 0..200 {
                let next = if round % 2 == 0 { &new } else { &old };
                limits.reload(next).unwrap();
                tokio::task::yield_now().await;
            }
        }
    });
    let requests: Vec<_> = (0..8)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for _ in 0..150 {
                    let response = get_path(&app, "/a").await;
                    assert_eq!(response.status(), StatusCode::OK);
                    let headers = common::limits(&response);
                    let names: Vec<&str> = headers.limits.iter().map(|s| s.name.as_str()).collect();
                    let policies: Vec<(String, u64)> = quotas(&response);
                    let legacy = headers.legacy.map(|legacy| legacy.limit);
                    let whole = match (&policies[..], &names[..], legacy) {
                        ([(a, 100_000)], ["100000-per-60s"], None) => a == "100000-per-60s",
                        (
                            [(a, 200_000), (b, 900_000)],
                            ["200000-per-60s", "900000-per-3600s"],
                            Some(200_000),
                        ) => a == "200000-per-60s" && b == "900000-per-3600s",
                        _ => false,
                    };
                    assert!(whole, "a mix of policies: {:?}", response.headers());
                    seen.push(policies.len());
                    tokio::task::yield_now().await;
                }
                seen
            })
        })
        .collect();
    let mut seen = Vec::new();
    for task in requests {
        seen.extend(task.await.unwrap());
    }
    reloads.await.unwrap();
    assert_eq!(limits.reload_counts(), (200, 0));
    assert_eq!(seen.len(), 8 * 150);
}

/// Waits until `limits` counts `applied` and `refused` reloads (the watcher works in the
/// background); fails after ten seconds.
async fn wait_for_reloads(limits: &RouteLimitsLayer, applied: u64, refused: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while limits.reload_counts() != (applied, refused) {
        assert!(
            Instant::now() < deadline,
            "expected {applied} applied and {refused} refused reloads, have {:?}",
            limits.reload_counts()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn the_watcher_reloads_when_the_file_changes() {
    let file = TempFile::new("watch", ONE_PER_MINUTE);
    let (loader, limits) = limits_from(&file);
    let app = app(&limits);
    let watcher = ConfigWatcher::new(&limits, loader, &file.0)
        .poll_interval(Duration::from_millis(10))
        .on_sighup(false)
        .spawn();

    file.write(FIVE_PER_MINUTE);
    wait_for_reloads(&limits, 1, 0).await;
    assert_eq!(
        quotas(&get_path(&app, "/a").await),
        [("5-per-60s".to_owned(), 5)]
    );

    // A bad change is refused once, and the policy stays.
    file.write(BAD_LIMIT);
    wait_for_reloads(&limits, 1, 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        limits.reload_counts(),
        (1, 1),
        "refused once, not at every poll"
    );
    assert_eq!(
        quotas(&get_path(&app, "/a").await),
        [("5-per-60s".to_owned(), 5)]
    );
    file.write(ONE_PER_MINUTE);
    wait_for_reloads(&limits, 2, 1).await;
    watcher.abort();
}

#[cfg(unix)]
#[tokio::test]
async fn the_watcher_reloads_on_sighup() {
    let file = TempFile::new("sighup", ONE_PER_MINUTE);
    let (loader, limits) = limits_from(&file);
    let app = app(&limits);
    // Polls too rarely to see the change: only the signal reloads.
    let watcher = ConfigWatcher::new(&limits, loader, &file.0)
        .poll_interval(Duration::from_secs(3600))
        .spawn();
    file.write(FIVE_PER_MINUTE);
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_for_reloads(&limits, 1, 0).await;
    assert_eq!(
        quotas(&get_path(&app, "/a").await),
        [("5-per-60s".to_owned(), 5)]
    );
    watcher.abort();
}

#[tokio::test]
async fn the_watcher_runs_the_apps_own_checks_before_a_reload() {
    let file = TempFile::new("check", ONE_PER_MINUTE);
    let (loader, limits) = limits_from(&file);
    let app = app(&limits);
    // This app refuses limits above three a minute.
    let watcher = ConfigWatcher::new(&limits, loader, &file.0)
        .poll_interval(Duration::from_millis(10))
        .on_sighup(false)
        .check(|_, config| {
            if config.routes()[0].policy().rules()[0].limit() > 3 {
                let field = "routes[0].rules[0].limit";
                return Err(tower_redis_ratelimit::config::ConfigError::new(
                    field,
                    "at most 3",
                ));
            }
            Ok(())
        })
        .spawn();
    file.write(FIVE_PER_MINUTE);
    wait_for_reloads(&limits, 0, 1).await;
    assert_eq!(
        quotas(&get_path(&app, "/a").await),
        [("1-per-60s".to_owned(), 1)]
    );
    file.write(&FIVE_PER_MINUTE.replace("limit = 5", "limit = 2"));
    wait_for_reloads(&limits, 1, 1).await;
    watcher.abort();
}

/// A route is known by its first path: reordering, splitting or shortening a route of several
/// paths counts each old route once, as changed or removed, never both.
#[test]
fn a_reload_counts_a_route_of_several_paths_once() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let rules = "rules = [{ limit = 3, period = \"1m\" }]";
    let routes = |entries: &[&str]| {
        let text: String = entries
            .iter()
            .map(|paths| format!("[[routes]]\npaths = {paths}\n{rules}\n"))
            .collect();
        config("rl", &text)
    };
    let counts = |from: &[&str], to: &[&str]| {
        let limits = routes(from).route_limits(store.clone()).unwrap();
        let summary = limits.reload(&routes(to)).unwrap();
        (
            summary.kept,
            summary.changed,
            summary.added,
            summary.removed,
        )
    };
    let both = ["[\"/a\", \"/b\"]"];
    // Unchanged.
    assert_eq!(counts(&both, &both), (1, 0, 0, 0));
    // One more path: the same route, changed.
    assert_eq!(counts(&both, &["[\"/a\", \"/b\", \"/c\"]"]), (0, 1, 0, 0));
    // Reordered: a new first path is a new route; the old one is gone.
    assert_eq!(counts(&both, &["[\"/b\", \"/a\"]"]), (0, 0, 1, 1));
    // Split in two: `/a` changed, `/b` new.
    assert_eq!(counts(&both, &["[\"/a\"]", "[\"/b\"]"]), (0, 1, 1, 0));
    // The first path dropped: `/b` is a new route, the old one is gone.
    assert_eq!(counts(&both, &["[\"/b\"]"]), (0, 0, 1, 1));
}

/// `RouteLimitsLayer::on_rejected` answers every route's refusals, the routes of a later reload
/// too, with the layer's headers added; routes kept by the reload keep their counts.
#[tokio::test]
async fn a_custom_429_answers_every_route_before_and_after_a_reload() {
    let rule = "rules = [{ limit = 1, period = \"1m\" }]";
    let routes = |paths: &[&str]| {
        let text: String = paths
            .iter()
            .map(|path| format!("[[routes]]\npath = \"{path}\"\n{rule}\n"))
            .collect();
        config("custom", &text)
    };
    let limits = routes(&["/a"])
        .route_limits(Arc::new(MemoryStore::new()))
        .unwrap()
        .on_rejected(|rejected| {
            let body = serde_json::json!({ "error": "slow down", "retry_in": rejected.retry_after_secs() });
            (StatusCode::TOO_MANY_REQUESTS, axum::Json(body))
        });
    let app = app(&limits);
    assert_eq!(get_path(&app, "/a").await.status(), StatusCode::OK);
    let refused = get_path(&app, "/a").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    assert!(refused.headers().contains_key("ratelimit"));
    let body = common::json(refused).await;
    assert_eq!(body["error"], "slow down");
    assert!(body["retry_in"].as_u64().unwrap() >= 1, "{body}");

    // `/a` kept (its count too: still refused), `/b` new.
    let summary = limits.reload(&routes(&["/a", "/b"])).unwrap();
    assert_eq!((summary.kept, summary.added), (1, 1));
    for path in ["/a", "/b"] {
        if path == "/b" {
            assert_eq!(get_path(&app, path).await.status(), StatusCode::OK);
        }
        let refused = get_path(&app, path).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "{path}");
        assert_eq!(common::json(refused).await["error"], "slow down", "{path}");
    }
}

/// A reload that drops a path's limit (here a typo, `/login` edited to `/logn`) says so at WARN,
/// naming the path and what was added.
#[test]
fn a_reload_that_removes_a_paths_limit_warns_naming_it() {
    let (captured, _guard) = common::capture::Captured::install();
    let login = |path: &str| {
        config(
            "typo",
            &format!("[[routes]]\npath = \"{path}\"\nrules = [{{ limit = 3, period = \"1m\" }}]\n"),
        )
    };
    let limits = login("/login")
        .route_limits(Arc::new(MemoryStore::new()))
        .unwrap();
    limits.reload(&login("/login")).unwrap();
    assert!(
        captured.lines_with("WARN").is_empty(),
        "{}",
        captured.text()
    );
    let summary = limits.reload(&login("/logn")).unwrap();
    assert_eq!((summary.added, summary.removed), (1, 1));
    let warned = captured.lines_with("no longer limits this path");
    assert_eq!(warned.len(), 1, "{}", captured.text());
    assert!(warned[0].contains("WARN"), "{}", warned[0]);
    assert!(warned[0].contains("path=/login"), "{}", warned[0]);
    assert!(warned[0].contains("/logn"), "{}", warned[0]);
}

/// A configured path the app never serves, one edit away from a path it serves unlimited, is
/// named at WARN once, when the served path's first request shows it; a configured path that
/// limits requests is not.
#[tokio::test]
async fn a_configured_path_the_app_never_serves_is_named_once_a_near_path_is_served() {
    let (captured, _guard) = common::capture::Captured::install();
    let config = config(
        "unserved",
        r#"
        [[routes]]
        path = "/logn"
        rules = [{ limit = 3, period = "1m" }]
        [[routes]]
        path = "/a"
        rules = [{ limit = 3, period = "1m" }]
        "#,
    );
    let limits = config.route_limits(Arc::new(MemoryStore::new())).unwrap();
    let ok = || get(|| async { "ok" });
    let app = Router::new()
        .route("/login", ok())
        .route("/a", ok())
        .route("/b", ok())
        .route_layer(limits);
    for path in ["/a", "/b", "/login", "/login", "/b", "/login"] {
        assert_eq!(
            get_path(&app, path).await.status(),
            StatusCode::OK,
            "{path}"
        );
    }
    let warned = captured.lines_with("no rate limit names");
    assert_eq!(warned.len(), 1, "{}", captured.text());
    assert!(warned[0].contains("WARN"), "{}", warned[0]);
    assert!(warned[0].contains("configured=/logn"), "{}", warned[0]);
    assert!(warned[0].contains("served=/login"), "{}", warned[0]);
}

/// The removal warning goes path by path: a typo in a route's second path is named, and a route
/// whose paths were only reordered (each still limited) names none.
#[test]
fn a_reload_warns_of_each_path_it_unlimits_and_of_no_other() {
    let (captured, _guard) = common::capture::Captured::install();
    let routes = |paths: &str| {
        config(
            "paths",
            &format!("[[routes]]\npaths = {paths}\nrules = [{{ limit = 3, period = \"1m\" }}]\n"),
        )
    };
    let limits = routes(r#"["/a", "/b"]"#)
        .route_limits(Arc::new(MemoryStore::new()))
        .unwrap();
    limits.reload(&routes(r#"["/b", "/a"]"#)).unwrap();
    assert!(
        captured.lines_with("no longer limits").is_empty(),
        "{}",
        captured.text()
    );
    limits.reload(&routes(r#"["/b", "/c"]"#)).unwrap();
    let warned = captured.lines_with("no longer limits");
    assert_eq!(warned.len(), 1, "{}", captured.text());
    assert!(warned[0].contains("path=/a"), "{}", warned[0]);
}
