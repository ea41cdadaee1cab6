//! The Redis store over `rediss://` to a TLS `redis-server` the test starts with certificates it
//! makes itself (see `common::redis_tls`): the single-node tests' core (an exact limit over two
//! stores, every key with an expiry, NOSCRIPT recovered in the request), and a server whose
//! certificate can't be checked is a store error, never a silent plain-text fallback.

use crate::common;

use std::time::Duration;

use common::redis_server::{assert_every_key_expires, command_calls, has_functions, unique_prefix};
use common::redis_tls::TlsRedis;
use common::{app, limits, request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::store::{RedisStore, TlsOptions};
use tower_redis_ratelimit::{Algorithm, OnStoreError, Policy, Rule};

const PEER: &str = "203.0.113.20:4000";

/// A store over the TLS port trusting the test's CA. The long timeout is for a busy CI machine
/// (a TLS handshake and a first script load); the tests check answers, not speed.
fn store(redis: &TlsRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .and_then(|store| store.with_tls(TlsOptions::new().ca_pem(redis.ca_pem.clone())))
        .expect("a valid rediss:// URL and CA")
        .timeout(Duration::from_secs(10))
}

fn policy(prefix: &str, name: &str, algorithm: Algorithm, limit: u64) -> Policy {
    Policy::builder(name)
        .prefix(prefix)
        .algorithm(algorithm)
        .rule(Rule::per_hour(limit))
        .build()
        .unwrap()
}

/// The local ports of the server's client connections (`laddr` of `CLIENT LIST`): which of its
/// listeners each client came in through.
fn client_listener_ports(redis: &TlsRedis) -> Vec<u16> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.client())
        .unwrap();
    list.lines()
        .filter_map(|line| {
            let laddr = line.split(' ').find_map(|f| f.strip_prefix("laddr="))?;
            laddr.rsplit_once(':')?.1.parse().ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_tls_two_stores_share_a_limit_exactly_and_every_key_expires() {
    let redis = TlsRedis::start();
    let prefix = unique_prefix("tls");
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        let policy = policy(&prefix, algorithm.as_str(), algorithm, 50);
        let instances = [
            app(policy.clone(), store(&redis)),
            app(policy, store(&redis)),
        ];
        assert_eq!(
            common::race(&instances, 200, PEER).await,
            (50, 150),
            "{algorithm}"
        );
        // Both stores' connections came in through the TLS listener.
        let tls_clients = client_listener_ports(&redis)
            .into_iter()
            .filter(|&port| port == redis.tls_port)
            .count();
        assert!(tls_clients >= 2, "{tls_clients} clients on the TLS port");
    }
    assert_eq!(assert_every_key_expires(&mut redis.client(), &prefix), 2);
}

#[tokio::test]
async fn over_tls_a_function_flush_is_recovered_in_the_request() {
    let redis = TlsRedis::start();
    let prefix = unique_prefix("tls-flush");
    // The CA from its file this time, as a deployment would give it.
    let store = RedisStore::from_url(&redis.url)
        .unwrap()
        .with_tls(TlsOptions::new().ca_file(&redis.ca_file).unwrap())
        .unwrap()
        .timeout(Duration::from_secs(10));
    let app = app(policy(&prefix, "flush", Algorithm::FixedWindow, 3), store);

    let first = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&first).status("3-per-3600s").unwrap().remaining, 2);
    // Redis 6.2 has no functions: its script cache stands in for the library.
    let functions = has_functions(&mut redis.client());
    let _: () = redis::cmd(if functions { "FUNCTION" } else { "SCRIPT" })
        .arg("FLUSH")
        .query(&mut redis.client())
        .unwrap();
    let second = send(&app, request_from(PEER, "/")).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(limits(&second).status("3-per-3600s").unwrap().remaining, 1);
    let calls = command_calls(&mut redis.client());
    if functions {
        assert_eq!(calls.get("function|load").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("eval"), None, "{calls:?}");
    } else {
        // Sent as EVAL the first time and after the flush (EVALSHA answered NOSCRIPT).
        assert_eq!(calls.get("eval").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("evalsha").copied(), Some(1), "{calls:?}");
    }
    assert_eq!(assert_every_key_expires(&mut redis.client(), &prefix), 1);
}

#[tokio::test]
async fn a_certificate_that_cannot_be_checked_is_a_store_error_unless_told_insecure() {
    let redis = TlsRedis::start();
    let prefix = unique_prefix("tls-untrusted");
    let fail_closed = |store: RedisStore, timeout: Duration| {
        let policy = Policy::builder("untrusted")
            .prefix(&prefix)
            .rule(Rule::per_hour(5))
            .on_store_error(OnStoreError::Deny)
            .build()
            .unwrap();
        app(policy, store.timeout(timeout))
    };

    // The system's roots don't know the test's CA: the handshake fails, the check is a store
    // error (fail closed: 503), and nothing is counted.
    // (A short timeout: a failed handshake may also just go unanswered.)
    let short = Duration::from_secs(2);
    let untrusted = fail_closed(RedisStore::from_url(&redis.url).unwrap(), short);
    assert_eq!(
        send(&untrusted, request_from(PEER, "/")).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    // A plain-text client on the TLS port gets no answer either.
    let plain_url = redis.url.replacen("rediss://", "redis://", 1);
    let plain = fail_closed(RedisStore::from_url(&plain_url).unwrap(), short);
    assert_eq!(
        send(&plain, request_from(PEER, "/")).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(assert_every_key_expires(&mut redis.client(), &prefix), 0);

    // Told to skip the checks, the same store limits (over TLS all the same).
    let insecure = fail_closed(
        RedisStore::from_url(&redis.url)
            .unwrap()
            .with_tls(TlsOptions::new().insecure(true))
            .unwrap(),
        Duration::from_secs(10),
    );
    let response = send(&insecure, request_from(PEER, "/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        limits(&response).status("5-per-3600s").unwrap().remaining,
        4
    );
    assert_eq!(assert_every_key_expires(&mut redis.client(), &prefix), 1);
}
