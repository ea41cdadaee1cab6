//! The Redis versions the store runs on: `RedisStore::probe` names the server it talks to, and a
//! server older than 6.2 (a real Redis 6.0.9, see `scripts/redis-server-of`) is refused with an
//! error that names both versions, logged once at ERROR, and answered per policy, never with a
//! script error per request. (The rest of the suite runs on 6.2 and 7.x: see `scripts/test`.)

use crate::common;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::capture::Captured;
use common::redis_server::{TestRedis, has_functions, server_binary_of, server_version};
use common::{request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::store::{
    RedisStore, RedisVersion, ServerMode, ServerSoftware, StoreError,
};
use tower_redis_ratelimit::{OnStoreError, Policy, RateLimitLayer, Rule};

const PEER: &str = "203.0.113.10:4000";

fn app(store: RedisStore, on_error: OnStoreError, prefix: &str) -> Router {
    let policy = Policy::builder("old")
        .prefix(prefix)
        .rule(Rule::per_minute(3))
        .on_store_error(on_error)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store))
}

#[tokio::test]
async fn the_probe_names_the_version_the_mode_and_functions() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let store = RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_secs(10));
    let server = store.probe().await.unwrap();
    let (major, minor) = server_version(&mut client);
    assert_eq!((server.version.major, server.version.minor), (major, minor));
    assert_eq!(server.mode, ServerMode::Standalone);
    assert_eq!(server.functions, has_functions(&mut client));
    assert!(server.round_trip > Duration::ZERO);
    let shown = server.to_string();
    // Named as the server names itself: a Valkey by its own version (its redis_version is the
    // Redis version it is compatible with).
    let info: String = redis::cmd("INFO").arg("server").query(&mut client).unwrap();
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let named = match field("server_name") {
        Some("valkey") => {
            let own = field("valkey_version").unwrap();
            assert_eq!(
                server.software,
                ServerSoftware::Valkey(RedisVersion::parse(own).unwrap())
            );
            format!("Valkey {own} (as Redis {major}.{minor}.")
        }
        _ => {
            assert_eq!(server.software, ServerSoftware::Redis);
            format!("Redis {major}.{minor}.")
        }
    };
    assert!(shown.starts_with(&named), "{shown}");
    assert!(shown.contains("standalone"), "{shown}");
    if server.functions {
        // The probe loaded the library: the first check finds it.
        let libraries: redis::Value = redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg("tower_redis_ratelimit_*")
            .query(&mut client)
            .unwrap();
        assert!(matches!(libraries, redis::Value::Array(ref found) if !found.is_empty()));
    }
    // A store whose server is down answers the probe with the outage.
    let mut down = TestRedis::own();
    down.stop();
    let store = RedisStore::from_url(&down.url)
        .unwrap()
        .timeout(Duration::from_millis(500));
    assert!(matches!(
        store.probe().await,
        Err(StoreError::Unavailable(_) | StoreError::Timeout(_))
    ));
}

/// Redis 6.0 lacks `SET … PXAT`: the store refuses it when it connects, whatever the request, with
/// one ERROR line that names both versions; requests get their policy's answer to a store error.
#[tokio::test]
async fn redis_6_0_is_refused_once_at_error_naming_both_versions() {
    let (captured, _guard) = Captured::install();
    let redis = TestRedis::own_with(&server_binary_of("6.0"));
    let store = RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_secs(10));
    match store.probe().await {
        Err(StoreError::UnsupportedVersion { found, minimum }) => {
            assert_eq!((found.as_str(), minimum), ("6.0.9", "6.2"));
        }
        other => panic!("a 6.0 server probed as {other:?}"),
    }
    let open = app(store.clone(), OnStoreError::Allow, "old-open");
    let closed = app(store.clone(), OnStoreError::Deny, "old-closed");
    for _ in 0..20 {
        let admitted = send(&open, request_from(PEER, "/")).await;
        assert_eq!(admitted.status(), StatusCode::OK);
        assert!(admitted.headers().get("ratelimit").is_none());
        let refused = send(&closed, request_from(PEER, "/")).await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let logs = captured.text();
    // (The requests' own store-error lines are the layer's, bounded per policy and kind.)
    let refusals = captured.lines_with("can't use this Redis");
    assert_eq!(refusals.len(), 1, "{logs}");
    assert!(refusals[0].contains("ERROR"), "{logs}");
    assert!(
        refusals[0]
            .contains("Redis 6.0.9 is too old for the rate limiter: it needs Redis 6.2 or later"),
        "{logs}"
    );
    // Nothing reached the server but the version checks: no script ever ran there.
    let calls = common::redis_server::command_calls(&mut redis.client());
    assert_eq!(calls.get("eval"), None, "{calls:?}");
    assert_eq!(calls.get("evalsha"), None, "{calls:?}");
    // Within a second of a refusal the store doesn't ask again: 40 requests, very few INFOs.
    assert!(calls.get("info").copied().unwrap_or(0) <= 5, "{calls:?}");
}

/// A stray `dump.rdb` in the temp dir (a Valkey's, or an old Redis's, left by a server run by
/// hand) reaches no server of the tests' own: each runs in a directory of its own, so it neither
/// fails to start on a file it can't read nor loads someone else's keys.
#[test]
fn a_stray_dump_in_the_temp_dir_reaches_no_server_of_ours() {
    /// The file planted, removed when the test ends, even by a panic.
    struct Planted(Option<std::path::PathBuf>);
    impl Drop for Planted {
        fn drop(&mut self) {
            if let Some(path) = &self.0 {
                let _ = std::fs::remove_file(path);
            }
        }
    }
    let stray = std::env::temp_dir().join("dump.rdb");
    // Someone else's is left alone: it is the case under test already.
    let planted = !stray.exists() && std::fs::write(&stray, b"REDIS0011 not ours").is_ok();
    let _planted = Planted(planted.then_some(stray));
    let redis = TestRedis::own();
    let mut client = redis.client();
    let keys: u64 = redis::cmd("DBSIZE").query(&mut client).unwrap();
    let dir: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("dir")
        .query(&mut client)
        .unwrap();
    assert_eq!(keys, 0);
    assert_ne!(std::path::Path::new(&dir[1]), std::env::temp_dir());
}
