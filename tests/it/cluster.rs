//! The Redis store on a Redis Cluster of three primaries and three replicas that the test starts
//! itself (see `common::redis_cluster`): exact counts for identities on every primary, one
//! `EVALSHA` per request, no key without an expiry, NOSCRIPT on every node recovered in the
//! request, a slot moved between primaries while requests flow, and quotas keyed apart from their
//! policy refused when the layer is built.
//!
//! One cluster serves every scenario, one after another (their command counts must not mix).

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::redis_cluster::{TestCluster, node_client};
use common::redis_server::unique_prefix;
use common::{admitted_and_refused, app, limits, send};
use http::{Request, StatusCode};
use tower_redis_ratelimit::policy::Override;
use tower_redis_ratelimit::store::ServerMode;
use tower_redis_ratelimit::{
    Algorithm, Key, OnStoreError, Policy, PolicyError, Quota, RateLimitLayer, RateLimiter,
    RedisStore, Rule, UserId,
};

/// A store of its own on the cluster; a generous timeout, since these tests check what Redis
/// answers and a busy CI machine can stall a first connect.
fn store(cluster: &TestCluster) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .expect("valid cluster URLs")
        .timeout(Duration::from_secs(10))
}

/// A store over a `deadpool_redis::cluster::Pool` of the test's (redis-rs routes its calls).
fn pool_store(cluster: &TestCluster) -> RedisStore {
    let pool = deadpool_redis::cluster::Config::from_urls(cluster.urls())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a cluster pool");
    RedisStore::from_cluster_pool(pool).timeout(Duration::from_secs(10))
}

fn user_request(user: &str) -> Request<Body> {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    request.extensions_mut().insert(UserId::new(user));
    request
}

/// The keys under `prefix` on the node at `port`.
fn keys_on(port: u16, prefix: &str) -> Vec<String> {
    let mut client = node_client(port);
    redis::Commands::scan_match::<_, String>(&mut client, format!("{prefix}:*"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// `INFO commandstats` calls of `command`, summed over the primaries.
fn calls_on_primaries(cluster: &TestCluster, command: &str) -> u64 {
    cluster
        .primaries()
        .into_iter()
        .map(|port| {
            common::redis_server::command_calls(&mut node_client(port))
                .get(command)
                .copied()
                .unwrap_or(0)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_limits_exactly_in_one_call_per_request() {
    let mut cluster = TestCluster::start(3);
    let prefix = unique_prefix("cluster");

    // Both stores see a cluster, and call their Lua as a script (nodes come and go without a
    // library).
    for store in [store(&cluster), pool_store(&cluster)] {
        let server = store.probe().await.unwrap();
        assert_eq!(server.mode, ServerMode::Cluster, "{server}");
        assert!(!server.functions, "{server}");
    }
    exact_counts_on_every_primary(&cluster, &prefix).await;
    one_evalsha_per_request(&cluster, &prefix).await;
    script_flush_on_every_node_is_recovered(&cluster, &prefix).await;
    a_quota_keyed_like_its_policy_rides_along_and_one_keyed_apart_is_refused(&cluster, &prefix)
        .await;
    a_slot_moved_between_primaries_keeps_its_count(&mut cluster, &prefix).await;
    a_reset_reaches_the_identitys_primary_through_either_store(&cluster, &prefix).await;
    a_reset_reaches_units_held_ahead_across_the_cluster(&cluster, &prefix).await;
    run_time_overrides_apply_on_every_primary(&cluster, &prefix).await;
    crate::fair_share::fair_shares_on_a_cluster(&cluster, &prefix).await;

    // No key on any node lacks an expiry after all of that.
    let mut keys = 0;
    for port in cluster.primaries() {
        keys += common::redis_server::assert_every_key_expires(&mut node_client(port), &prefix);
    }
    assert!(keys > 0, "the scenarios left keys to check");
}

/// Blocked identities (on every primary) are reset through the store that routes by itself and
/// through the one over a cluster pool: the other admits them at once.
async fn a_reset_reaches_the_identitys_primary_through_either_store(
    cluster: &TestCluster,
    prefix: &str,
) {
    let policy = Policy::builder("reset")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_minute(2))
        .block_for(Duration::from_secs(3600))
        .build()
        .unwrap();
    let own = RateLimitLayer::new(policy.clone(), store(cluster));
    let pooled = RateLimitLayer::new(policy, pool_store(cluster));
    let layers = [own, pooled];
    let apps = layers.clone().map(|layer| {
        Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer)
    });
    let status = |app: &Router, user: &str| {
        let request = user_request(user);
        let app = app.clone();
        async move { send(&app, request).await.status().as_u16() }
    };
    for n in 0..12 {
        let user = format!("reset-{n}");
        let (by, other) = (n % 2, 1 - n % 2);
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(status(&apps[other], &user).await);
        }
        assert_eq!(statuses, [200, 200, 429], "{user}");
        assert_eq!(status(&apps[by], &user).await, 429, "{user} blocked");
        layers[by].reset(&format!("user:{user}")).await.unwrap();
        let state = layers[other]
            .inspect(&format!("user:{user}"))
            .await
            .unwrap();
        assert_eq!(state[0].remaining, 2, "{user}");
        assert_eq!(status(&apps[other], &user).await, 200, "{user} reset");
    }
}

/// Units one instance holds ahead (`prefetch`) are dropped when another resets the identity:
/// the reset's notice is published on the identity's primary and heard on the seed node the
/// holder subscribed to (a cluster's pub/sub reaches every node). The fresh instance and the
/// holder are admitted the limit together, not the limit and the units held.
async fn a_reset_reaches_units_held_ahead_across_the_cluster(cluster: &TestCluster, prefix: &str) {
    let policy = Policy::builder("held")
        .prefix(prefix)
        .key(Key::global())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::new(300, Duration::from_secs(60)))
        .prefetch(100)
        .build()
        .unwrap();
    let holder = tower_redis_ratelimit::RateLimiter::new(policy.clone(), store(cluster));
    holder.check("global").await.unwrap();
    // Its subscription takes a round trip; no unit is taken ahead before it is up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..40 {
        holder.check("global").await.unwrap();
    }
    let left = holder.peek("global").await.unwrap().rules[0].remaining;
    assert!(left < 300 - 41, "the holder holds nothing ({left} left)");
    let resetter = tower_redis_ratelimit::RateLimiter::new(policy.clone(), pool_store(cluster));
    resetter.reset("global").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = tower_redis_ratelimit::RateLimiter::new(policy, store(cluster));
    let mut admitted = 0;
    while fresh.check("global").await.is_ok() {
        admitted += 1;
    }
    while holder.check("global").await.is_ok() {
        admitted += 1;
    }
    assert_eq!(
        admitted, 300,
        "{admitted} admitted after the reset, against 300"
    );
}

/// 400 requests per identity race over two layers with separate stores (one routing by itself,
/// one over a cluster pool) against a limit of 100, for identities on each of the three
/// primaries: exactly 100 admitted each.
async fn exact_counts_on_every_primary(cluster: &TestCluster, prefix: &str) {
    let users = cluster.users_on_every_primary(2);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        let policy = Policy::builder(format!("exact-{algorithm:?}").to_lowercase())
            .prefix(prefix)
            .key(Key::user())
            .algorithm(algorithm)
            .rule(Rule::per_hour(100))
            .build()
            .unwrap();
        let apps = [
            app(policy.clone(), store(cluster)),
            app(policy.clone(), pool_store(cluster)),
        ];
        let mut tasks: HashMap<&str, Vec<_>> = HashMap::new();
        for user in users.values().flatten() {
            for n in 0..400 {
                let app = apps[n % 2].clone();
                let user = user.clone();
                tasks
                    .entry(users_key(&users, &user))
                    .or_default()
                    .push(tokio::spawn(async move {
                        send(&app, user_request(&user)).await.status()
                    }));
            }
        }
        for (user, tasks) in tasks {
            let (admitted, refused) = admitted_and_refused(tasks).await;
            assert_eq!(
                (admitted, refused),
                (100, 300),
                "{algorithm:?}, user {user}"
            );
        }
    }
    for (port, on_it) in &users {
        assert!(
            !keys_on(*port, prefix).is_empty(),
            "primary 127.0.0.1:{port} holds keys of {on_it:?}"
        );
    }
}

/// The user id as a `&str` that lives as long as `users`.
fn users_key<'a>(users: &'a HashMap<u16, Vec<String>>, user: &str) -> &'a str {
    users
        .values()
        .flatten()
        .find(|known| *known == user)
        .expect("a known user")
}

/// `INFO commandstats` over the primaries: one EVALSHA per request, nothing else sent by the store.
async fn one_evalsha_per_request(cluster: &TestCluster, prefix: &str) {
    let users = cluster.users_on_every_primary(1);
    let policy = Policy::builder("trips")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_second(1_000))
        .rule(Rule::per_hour(100_000))
        .build()
        .unwrap();
    let app = app(policy, store(cluster));
    // The first request of each primary may load the script there.
    for user in users.values().flatten() {
        assert_eq!(
            send(&app, user_request(user)).await.status(),
            StatusCode::OK
        );
    }
    let (evalsha, eval) = (
        calls_on_primaries(cluster, "evalsha"),
        calls_on_primaries(cluster, "eval"),
    );
    let mut requests = 0;
    for _ in 0..20 {
        for user in users.values().flatten() {
            assert_eq!(
                send(&app, user_request(user)).await.status(),
                StatusCode::OK
            );
            requests += 1;
        }
    }
    assert_eq!(calls_on_primaries(cluster, "evalsha") - evalsha, requests);
    assert_eq!(calls_on_primaries(cluster, "eval") - eval, 0);
}

/// Overrides set at run time through one store apply at the next check through the other, for
/// identities on every primary (each check reads its identity's override key in its own call);
/// removed, they leave no key behind.
async fn run_time_overrides_apply_on_every_primary(cluster: &TestCluster, prefix: &str) {
    let users = cluster.users_on_every_primary(1);
    let policy = Policy::builder("upgrades")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_hour(5))
        .build()
        .unwrap();
    let (one, other) = (
        RateLimiter::new(policy.clone(), store(cluster)),
        RateLimiter::new(policy, pool_store(cluster)),
    );
    let admitted = |limiter: &RateLimiter, user: &str| {
        let (limiter, user) = (limiter.clone(), user.to_owned());
        async move {
            let mut admitted = 0;
            while admitted < 100 && limiter.check(user.as_str()).await.is_ok() {
                admitted += 1;
            }
            admitted
        }
    };
    for user in users.values().flatten() {
        for _ in 0..3 {
            one.check(user.as_str()).await.unwrap();
        }
        one.set_override(Override::identity(user.as_str()).rules([Rule::per_hour(20)]))
            .await
            .unwrap();
    }
    assert_eq!(one.overrides().await.unwrap().len(), users.len());
    for user in users.values().flatten() {
        assert_eq!(admitted(&other, user).await, 17, "{user}");
        other
            .remove_override(Override::identity(user.as_str()))
            .await
            .unwrap();
        assert_eq!(admitted(&one, user).await, 0, "{user}");
    }
    assert!(one.overrides().await.unwrap().is_empty());
    // A denial for a while: at once on the other store, then gone by itself.
    let user = users.values().flatten().next().unwrap();
    one.set_override_for(
        Override::identity(user.as_str()).deny(),
        Duration::from_millis(300),
    )
    .await
    .unwrap();
    let denied = other.check(user.as_str()).await.err();
    assert_eq!(
        denied.map(|refused| refused.status()),
        Some(StatusCode::FORBIDDEN)
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(other.overrides().await.unwrap().is_empty());
    // A network on a Cluster: each instance keeps a copy of the policy's networks (they lie in
    // another slot than a check's keys), and a check carries the override of the network its
    // client's address falls in; an identity's own wins over it, on the identity's primary.
    let by_user = Policy::builder("upgrades-net")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_hour(2))
        .build()
        .unwrap();
    let setter = RateLimitLayer::new(by_user.clone(), store(cluster));
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(by_user, store(cluster)));
    let status = |user: &str, peer: &str| {
        let mut request = user_request(user);
        request.extensions_mut().insert(axum::extract::ConnectInfo(
            peer.parse::<std::net::SocketAddr>().unwrap(),
        ));
        let app = app.clone();
        async move { send(&app, request).await.status() }
    };
    setter
        .set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
        .await
        .unwrap();
    let mut users = users.values().flatten();
    let lifted = users.next().unwrap();
    setter
        .set_override(Override::identity(lifted.as_str()).unlimited())
        .await
        .unwrap();
    // The other instance hears of the network within a notice's round trip.
    let mut heard = false;
    for probe in 0..250 {
        if status(&format!("probe-{probe}"), "10.9.9.9:1").await == StatusCode::FORBIDDEN {
            heard = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(heard, "the network's deny never reached the other instance");
    for user in users {
        assert_eq!(
            status(user, "10.1.1.1:1").await,
            StatusCode::FORBIDDEN,
            "{user}"
        );
        assert_eq!(status(user, "192.0.2.1:1").await, StatusCode::OK, "{user}");
    }
    for _ in 0..3 {
        assert_eq!(
            status(lifted, "10.1.1.1:1").await,
            StatusCode::OK,
            "{lifted}"
        );
    }
    // Removed, they leave no key behind.
    setter
        .remove_override(Override::cidr("10.0.0.0/8".parse().unwrap()))
        .await
        .unwrap();
    setter
        .remove_override(Override::identity(lifted.as_str()))
        .await
        .unwrap();
    assert!(setter.overrides().await.unwrap().is_empty());
}

/// `SCRIPT FLUSH` on every node: the next request on each primary still gets its answer, with
/// the count it had.
async fn script_flush_on_every_node_is_recovered(cluster: &TestCluster, prefix: &str) {
    let users = cluster.users_on_every_primary(1);
    let policy = Policy::builder("flush")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_hour(5))
        .build()
        .unwrap();
    let app = app(policy, store(cluster));
    for user in users.values().flatten() {
        let first = send(&app, user_request(user)).await;
        assert_eq!(limits(&first).status("5-per-3600s").unwrap().remaining, 4);
    }
    for port in cluster.primaries() {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut node_client(port))
            .unwrap();
    }
    for user in users.values().flatten() {
        let second = send(&app, user_request(user)).await;
        assert_eq!(second.status(), StatusCode::OK, "user {user}");
        assert_eq!(limits(&second).status("5-per-3600s").unwrap().remaining, 3);
    }
}

async fn a_quota_keyed_like_its_policy_rides_along_and_one_keyed_apart_is_refused(
    cluster: &TestCluster,
    prefix: &str,
) {
    let quota = |key: Key| {
        Quota::builder("daily")
            .prefix(prefix)
            .key(key)
            .tier("free", 3)
            .build()
            .unwrap()
    };
    let policy = |key: Key, quota_key: Key| {
        Policy::builder("quota")
            .prefix(prefix)
            .key(key)
            .rule(Rule::per_minute(100))
            .quota(quota(quota_key))
            .build()
            .unwrap()
    };
    let refused = RateLimitLayer::try_new(policy(Key::ip(), Key::user()), store(cluster))
        .expect_err("a quota keyed apart from its policy on a cluster");
    assert!(
        matches!(&refused, PolicyError::QuotaKeyedApart { policy, key, quota, quota_key }
            if policy == "quota" && key == "Key::ip" && quota == "daily" && quota_key == "Key::user"),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("Key::ip"), "{refused}");
    assert!(refused.to_string().contains("Key::user"), "{refused}");
    // A store of one node takes it: its keys are all on the one node.
    assert!(
        RateLimitLayer::try_new(
            policy(Key::ip(), Key::user()),
            tower_redis_ratelimit::MemoryStore::new()
        )
        .is_ok()
    );

    let app = app(policy(Key::user(), Key::user()), store(cluster));
    for remaining in [2, 1, 0] {
        let response = send(&app, user_request("quota-user")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            limits(&response).status("daily").unwrap().remaining,
            remaining
        );
    }
    assert_eq!(
        send(&app, user_request("quota-user")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// While requests for one identity flow, its slot moves to another primary (keys migrated,
/// `MOVED` and `ASK` in between): every answer is a limit answer, and the count is exact.
async fn a_slot_moved_between_primaries_keeps_its_count(cluster: &mut TestCluster, prefix: &str) {
    let user = "moving";
    let slot = cluster.slot_of(&format!("{{user:{user}}}"));
    let source = cluster.primary_of_slot(slot);
    let target = *cluster
        .primaries()
        .iter()
        .find(|&&port| port != source)
        .unwrap();
    let policy = Policy::builder("moving")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_hour(200))
        .rule(Rule::per_minute(150))
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let app = app(policy, store(cluster));
    for _ in 0..20 {
        assert_eq!(
            send(&app, user_request(user)).await.status(),
            StatusCode::OK
        );
    }
    let flowing = {
        let app = app.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..300 {
                statuses.push(send(&app, user_request(user)).await.status());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            statuses
        })
    };
    let others = cluster
        .primaries()
        .into_iter()
        .filter(|port| ![source, target].contains(port))
        .collect();
    tokio::task::spawn_blocking(move || move_slot(slot, source, target, others))
        .await
        .unwrap();
    assert!(
        !flowing.is_finished(),
        "requests were still flowing when the move ended, so they met it"
    );
    let statuses = flowing.await.unwrap();
    assert_eq!(cluster.primary_of_slot(slot), target, "the slot moved");
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(
        (admitted, refused),
        (150 - 20, 300 - 130),
        "limit answers only, exact count: {statuses:?}"
    );
}

/// Moves `slot` from the primary at `source` to the one at `target`, as `redis-cli --cluster
/// reshard` does: importing/migrating, the keys migrated in small batches, then the new owner
/// announced to every primary.
fn move_slot(slot: u16, source: u16, target: u16, others: Vec<u16>) {
    let id = |port| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut node_client(port))
            .unwrap()
    };
    let (source_id, target_id) = (id(source), id(target));
    let setslot = |port: u16, state: &str, node: &str| {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .arg(node)
            .query(&mut node_client(port))
            .unwrap();
    };
    setslot(target, "IMPORTING", &source_id);
    setslot(source, "MIGRATING", &target_id);
    loop {
        // One key at a time, with pauses, so requests meet the slot half-moved (ASK, TRYAGAIN).
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1)
            .query(&mut node_client(source))
            .unwrap();
        let Some(key) = keys.first() else { break };
        let _: () = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(target)
            .arg("")
            .arg(0)
            .arg(5_000)
            .arg("KEYS")
            .arg(key)
            .query(&mut node_client(source))
            .unwrap();
        std::thread::sleep(Duration::from_millis(30));
    }
    // The new owner first, then the old one (so no moment has both refusing the slot), then the
    // rest, which would learn it by gossip anyway.
    for port in [target, source].into_iter().chain(others) {
        setslot(port, "NODE", &target_id);
    }
}
