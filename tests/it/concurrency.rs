//! Concurrency limits (`max_in_flight` with a lease) and once-only tokens, on both stores: one
//! request of a user in progress at once across two instances, slots freed when the response is
//! done, when the client goes away, or (a dead instance) when the lease expires; rate rules and the
//! slot all or nothing; a token used once whatever the race; in delay mode, jobs that wait for
//! the slot in the order they came.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::extract::Query;
use axum::routing::get;
use axum::{Extension, Router};
use common::redis_server::{TestRedis, unique_prefix};
use common::serve;
use http::StatusCode;
use redis::Commands;
use tower_redis_ratelimit::store::CheckRequest;
use tower_redis_ratelimit::{
    Decision, Key, LimitPolicy, LimitStore, Limited, MemoryStore, Mode, Policy, PolicyBuilder,
    PolicyError, RateLimitLayer, RedisStore, Rule, Store,
};

#[derive(serde::Deserialize)]
struct Work {
    ms: u64,
}

/// `GET /work?ms=N` answers after N ms, limited by `policy` in `store`.
fn work_app(policy: Policy, store: impl Store) -> Router {
    Router::new()
        .route(
            "/work",
            get(|Query(work): Query<Work>| async move {
                tokio::time::sleep(Duration::from_millis(work.ms)).await;
                "done"
            }),
        )
        .layer(RateLimitLayer::new(policy, store))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// One job per user at a time, leased for `lease`.
fn one_per_user(prefix: &str, lease: Duration) -> PolicyBuilder {
    Policy::builder("jobs")
        .prefix(prefix)
        .key(Key::header(http::HeaderName::from_static("x-user")))
        .max_in_flight(1)
        .lease(lease)
}

async fn work(client: &reqwest::Client, addr: SocketAddr, ms: u64) -> reqwest::Response {
    client
        .get(format!("http://{addr}/work?ms={ms}"))
        .header("x-user", "ann")
        .send()
        .await
        .unwrap()
}

/// Two instances sharing `stores`' counts: of 10 concurrent one-second jobs of one user exactly
/// one runs; the refusals say why and when; the next job is admitted as soon as it is done.
async fn one_job_at_a_time_across_two_instances(stores: [Arc<dyn Store>; 2], prefix: &str) {
    let [a, b] = stores.map(|store| {
        work_app(
            one_per_user(prefix, Duration::from_secs(30))
                .build()
                .unwrap(),
            store,
        )
    });
    let addrs = [serve(a).await, serve(b).await];
    let client = client();
    let jobs: Vec<_> = (0..10)
        .map(|n| {
            let (client, addr) = (client.clone(), addrs[n % 2]);
            tokio::spawn(async move {
                let response = work(&client, addr, 1_000).await;
                (response.status(), Instant::now(), response)
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for job in jobs {
        let (status, done_at, response) = job.await.unwrap();
        match status {
            StatusCode::OK => admitted.push(done_at),
            StatusCode::TOO_MANY_REQUESTS => refused.push(response),
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(admitted.len(), 1, "exactly one job runs");
    assert_eq!(refused.len(), 9);
    // The refusal names the concurrency limit, with no window, no free slot, and a Retry-After
    // no later than the running job's lease.
    let response = refused.pop().unwrap();
    let headers = response.headers().clone();
    let policy_header = headers["ratelimit-policy"].to_str().unwrap();
    assert_eq!(policy_header, "\"1-in-flight\";q=1");
    let status_header = headers["ratelimit"].to_str().unwrap();
    assert!(
        status_header.starts_with("\"1-in-flight\";r=0;t="),
        "{status_header}"
    );
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    let body: serde_json::Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["1-in-flight"])
    );
    // The slot is free once the job's response is done: the next job goes, on either instance.
    // (The release reaches a networked store in a task of its own, a moment after the response's
    // end reaches the client; on a loaded machine the next request can win that race by a few
    // milliseconds, so it may ask again.)
    for addr in addrs {
        let started = Instant::now();
        let next = loop {
            let next = work(&client, addr, 0).await;
            if next.status() != StatusCode::TOO_MANY_REQUESTS
                || started.elapsed() > Duration::from_secs(2)
            {
                break next;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(next.status(), StatusCode::OK);
        // Its own slot taken: none left, the earliest lease (its own) ending in 30 s.
        assert_eq!(
            next.headers()["ratelimit"].to_str().unwrap(),
            "\"1-in-flight\";r=0;t=30"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_at_a_time_on_one_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("conc");
    one_job_at_a_time_across_two_instances(two_redis_instances(&redis), &prefix).await;
    // The lease set, if the last release is still on its way (an empty one is gone).
    assert!(assert_every_key_expires(&redis, &prefix) <= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_at_a_time_on_one_memory_store() {
    one_job_at_a_time_across_two_instances(two_instances_in_one_memory_store(), "mem").await;
}

/// Two instances' stores on one Redis.
fn two_redis_instances(redis: &TestRedis) -> [Arc<dyn Store>; 2] {
    [(); 2].map(|()| -> Arc<dyn Store> { Arc::new(RedisStore::from_url(&redis.url).unwrap()) })
}

/// Two instances sharing one memory store (each layer hears only of its own releases).
fn two_instances_in_one_memory_store() -> [Arc<dyn Store>; 2] {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    [store.clone(), store]
}

/// Every key under `prefix` has an expiry (a lease set outlives its leases by nothing); how many
/// there are.
fn assert_every_key_expires(redis: &TestRedis, prefix: &str) -> usize {
    let mut connection = redis.client();
    let keys: Vec<String> = connection.keys(format!("{prefix}:*")).unwrap();
    let count = keys.len();
    for key in keys {
        let ttl: i64 = connection.pttl(&key).unwrap();
        assert!(ttl > 0, "{key} has no expiry ({ttl})");
    }
    count
}

/// A client that gives up on a long job frees its slot at once, long before the lease ends.
async fn a_client_that_goes_away_frees_its_slot(store: impl Store, prefix: &str) {
    let app = work_app(
        one_per_user(prefix, Duration::from_secs(60))
            .build()
            .unwrap(),
        store,
    );
    let addr = serve(app).await;
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gave_up = impatient
        .get(format!("http://{addr}/work?ms=20000"))
        .header("x-user", "ann")
        .send()
        .await;
    assert!(gave_up.unwrap_err().is_timeout());
    // The server notices the closed connection and drops the job, releasing its slot; allow it a
    // moment on a busy machine.
    let client = client();
    let started = Instant::now();
    loop {
        let next = work(&client, addr, 0).await;
        if next.status() == StatusCode::OK {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the slot of a client that went away is still held"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_slot_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("gone");
    a_client_that_goes_away_frees_its_slot(RedisStore::from_url(&redis.url).unwrap(), &prefix)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_slot_in_memory() {
    a_client_that_goes_away_frees_its_slot(MemoryStore::new(), "mem").await;
}

fn check_of<'a>(policy: &'a Policy, key: &'a str) -> CheckRequest<'a> {
    // Every key of these tests ends with the identity `user:ann`, its Redis hash tag.
    CheckRequest::new(key, policy.rules(), policy.algorithm())
        .identity("user:ann")
        .concurrency(policy.concurrency())
}

async fn check(store: &dyn Store, policy: &Policy, key: &str) -> Decision {
    store.check(&check_of(policy, key)).await.unwrap()
}

/// The concurrency state: the last of a decision.
fn slots(decision: &Decision) -> (u64, bool) {
    let state = decision.rules.last().unwrap();
    (state.remaining, state.refused())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instances_slot_frees_when_its_lease_expires_not_before() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("dead");
    let policy = one_per_user(&prefix, Duration::from_millis(1_500))
        .build()
        .unwrap();
    let key = format!("{prefix}:jobs:user:ann");
    // The instance that takes the slot dies: nobody releases its lease.
    let dead = RedisStore::from_url(&redis.url).unwrap();
    let taken = check(&dead, &policy, &key).await;
    assert!(taken.allowed && taken.lease.is_some());
    let taken_at = Instant::now();
    drop(dead);
    let other = RedisStore::from_url(&redis.url).unwrap();
    let refused = check(&other, &policy, &key).await;
    assert!(!refused.allowed);
    assert_eq!(slots(&refused), (0, true));
    let retry = refused.retry_after().unwrap();
    assert!(
        retry <= Duration::from_millis(1_500) && retry >= Duration::from_millis(1_000),
        "{retry:?}"
    );
    // Still held a little before the lease's end…
    tokio::time::sleep(Duration::from_millis(1_000).saturating_sub(taken_at.elapsed())).await;
    assert!(!check(&other, &policy, &key).await.allowed);
    // …and free after it.
    tokio::time::sleep(Duration::from_millis(1_600).saturating_sub(taken_at.elapsed())).await;
    let after = check(&other, &policy, &key).await;
    assert!(after.allowed, "{after:?}");
    let leases: u64 = redis
        .client()
        .llen(format!("{prefix}:{{user:ann}}:jobs:leases"))
        .unwrap();
    assert_eq!(
        leases, 1,
        "the expired lease is gone, the new one holds the only slot"
    );
}

/// A lease expires no earlier than the one taken before it on its key (lua/leases.lua keeps them
/// in expiry order; the memory store mirrors it): a 2 s lease taken after a 60 s one holds its
/// slot as long, in both stores alike, and the slots it frees are counted the same.
async fn a_shorter_lease_after_a_longer_one_ends_with_it(store: &dyn Store, prefix: &str) {
    let long = one_per_user(prefix, Duration::from_secs(60))
        .max_in_flight(3)
        .build()
        .unwrap();
    let short = one_per_user(prefix, Duration::from_secs(2))
        .max_in_flight(3)
        .build()
        .unwrap();
    let key = format!("{prefix}:jobs:user:ann");
    let first = check(store, &long, &key).await;
    let second = check(store, &short, &key).await;
    let (Some(first_lease), Some(_)) = (first.lease, second.lease) else {
        panic!("two leases: {first:?} {second:?}")
    };
    // The 60 s lease ends: the 2 s one, held now alone, ends when the 60 s one would have.
    store
        .release(&check_of(&long, &key), first_lease)
        .await
        .unwrap();
    let third = check(store, &short, &key).await;
    assert_eq!(slots(&third), (1, false), "{third:?}");
    let frees = third.rules.last().unwrap().reset;
    assert!(
        frees > Duration::from_secs(50) && frees <= Duration::from_secs(60),
        "the earliest lease ends with the 60 s one: {frees:?}"
    );
}

#[tokio::test]
async fn a_shorter_lease_after_a_longer_one_ends_with_it_on_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    a_shorter_lease_after_a_longer_one_ends_with_it(&store, &unique_prefix("order")).await;
}

#[tokio::test]
async fn a_shorter_lease_after_a_longer_one_ends_with_it_in_memory() {
    a_shorter_lease_after_a_longer_one_ends_with_it(&MemoryStore::new(), "mem").await;
}

/// A lease released twice (the second time by mistake, or late) ends nothing the second time,
/// even when a lease taken since in the same millisecond holds the slot: ids are not handed out
/// again. 20 rounds, each release and take a call of its own, most of them in one millisecond.
async fn a_second_release_ends_no_other_lease(store: &dyn Store, prefix: &str) {
    let policy = one_per_user(prefix, Duration::from_secs(60))
        .build()
        .unwrap();
    let key = format!("{prefix}:jobs:user:ann");
    let request = check_of(&policy, &key);
    for round in 0..20 {
        let first = check(store, &policy, &key)
            .await
            .lease
            .expect("the free slot");
        store.release(&request, first).await.unwrap();
        let second = check(store, &policy, &key).await;
        let second = second.lease.expect("the slot, free again");
        assert_ne!(
            first, second,
            "round {round}: a released id handed out again"
        );
        store.release(&request, first).await.unwrap();
        let refused = check(store, &policy, &key).await;
        assert!(
            !refused.allowed,
            "round {round}: the second release of {first} ended {second}"
        );
        store.release(&request, second).await.unwrap();
    }
}

#[tokio::test]
async fn a_second_release_ends_no_other_lease_on_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    a_second_release_ends_no_other_lease(&store, &unique_prefix("twice")).await;
}

#[tokio::test]
async fn a_second_release_ends_no_other_lease_in_memory() {
    a_second_release_ends_no_other_lease(&MemoryStore::new(), "mem").await;
}

/// A rate rule's refusal takes no slot; a refusal for want of a slot uses no rate quota.
async fn rate_rules_and_slots_are_all_or_nothing(store: &dyn Store, prefix: &str) {
    // 1 per minute, 2 slots: the second request is refused by the rate rule and takes no slot.
    let rate_first = Policy::builder("rate-first")
        .prefix(prefix)
        .rule(Rule::per_minute(1))
        .max_in_flight(2)
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let key = format!("{prefix}:rate-first:user:ann");
    let first = check(store, &rate_first, &key).await;
    assert!(first.allowed);
    assert_eq!(slots(&first), (1, false));
    let second = check(store, &rate_first, &key).await;
    assert!(!second.allowed && second.rules[0].refused());
    assert_eq!(slots(&second), (1, false), "a rate refusal takes no slot");
    assert!(second.lease.is_none());

    // 5 per minute, 1 slot: a refusal for want of the slot uses none of the 5.
    let slot_first = Policy::builder("slot-first")
        .prefix(prefix)
        .rule(Rule::per_minute(5))
        .max_in_flight(1)
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let key = format!("{prefix}:slot-first:user:ann");
    let holder = check(store, &slot_first, &key).await;
    assert_eq!(holder.rules[0].remaining, 4);
    for _ in 0..3 {
        let refused = check(store, &slot_first, &key).await;
        assert!(!refused.allowed);
        assert_eq!(slots(&refused), (0, true));
        assert!(!refused.rules[0].refused());
        assert_eq!(
            refused.rules[0].remaining, 4,
            "a slot refusal uses no rate quota"
        );
    }
    store
        .release(&check_of(&slot_first, &key), holder.lease.unwrap())
        .await
        .unwrap();
    let next = check(store, &slot_first, &key).await;
    assert!(next.allowed);
    assert_eq!(next.rules[0].remaining, 3);
    // A second release of the same lease frees nothing more.
    store
        .release(&check_of(&slot_first, &key), holder.lease.unwrap())
        .await
        .unwrap();
    assert!(!check(store, &slot_first, &key).await.allowed);
}

#[tokio::test]
async fn rate_rules_and_slots_are_all_or_nothing_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("aon");
    let store = RedisStore::from_url(&redis.url).unwrap();
    rate_rules_and_slots_are_all_or_nothing(&store, &prefix).await;
    // Per policy, its rate counter and its lease set (each holding a lease never released).
    assert_eq!(assert_every_key_expires(&redis, &prefix), 4);
}

#[tokio::test]
async fn rate_rules_and_slots_are_all_or_nothing_in_memory() {
    rate_rules_and_slots_are_all_or_nothing(&MemoryStore::new(), "mem").await;
}

/// `n` slots under a race of 40 checks over two stores: exactly `n` leases, and the set never holds
/// more (Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_checks_take_exactly_the_free_slots() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("slots");
    let policy = one_per_user(&prefix, Duration::from_secs(60))
        .max_in_flight(3)
        .build()
        .unwrap();
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(RedisStore::from_url(&redis.url).unwrap()),
        Arc::new(RedisStore::from_url(&redis.url).unwrap()),
    ];
    let key = format!("{prefix}:jobs:user:ann");
    let barrier = Arc::new(tokio::sync::Barrier::new(40));
    let tasks: Vec<_> = (0..40)
        .map(|n| {
            let (store, policy, key, barrier) = (
                stores[n % 2].clone(),
                policy.clone(),
                key.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                check(&*store, &policy, &key).await.lease
            })
        })
        .collect();
    let mut leases = Vec::new();
    for task in tasks {
        leases.extend(task.await.unwrap());
    }
    leases.sort_unstable();
    leases.dedup();
    assert_eq!(leases.len(), 3, "three distinct leases");
    let held: u64 = redis
        .client()
        .llen(format!("{prefix}:{{user:ann}}:jobs:leases"))
        .unwrap();
    assert_eq!(held, 3);
}

/// 50 racing uses of one token, over two instances: exactly one is admitted.
async fn a_token_is_used_once(stores: [Arc<dyn Store>; 2], prefix: &str) {
    let policy = Policy::builder("spawn_vm")
        .prefix(prefix)
        .key(Key::query("token"))
        .rule(Rule::new(1, Duration::from_secs(600)))
        .build()
        .unwrap();
    let apps = stores.map(|store| {
        Router::new()
            .route("/spawn_vm", get(|| async { "spawned" }))
            .layer(RateLimitLayer::new(policy.clone(), store))
    });
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks = (0..50)
        .map(|n| {
            let (app, barrier) = (apps[n % 2].clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let request = common::request_from("192.0.2.1:1", "/spawn_vm?token=t0k%2Fen");
                common::send(&app, request).await.status()
            })
        })
        .collect();
    assert_eq!(common::admitted_and_refused(tasks).await, (1, 49));
    // Another token is its own; the same one, wherever it is in the query, is used up.
    let other = common::request_from("192.0.2.1:1", "/spawn_vm?token=another");
    assert_eq!(common::send(&apps[0], other).await.status(), StatusCode::OK);
    let again = common::request_from("192.0.2.1:1", "/spawn_vm?x=1&token=t0k%2Fen");
    assert_eq!(
        common::send(&apps[1], again).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_used_once_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("token");
    a_token_is_used_once(two_redis_instances(&redis), &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_used_once_in_memory() {
    a_token_is_used_once(two_instances_in_one_memory_store(), "mem").await;
}

#[test]
fn a_concurrency_limit_needs_a_lease_and_a_lease_its_limit() {
    let base = || Policy::builder("jobs").rule(Rule::per_minute(5));
    let missing = base().max_in_flight(1).build().unwrap_err().to_string();
    assert!(missing.contains("lease"), "{missing}");
    let alone = base()
        .lease(Duration::from_secs(1))
        .build()
        .unwrap_err()
        .to_string();
    assert!(alone.contains("max_in_flight"), "{alone}");
    let zero = base()
        .max_in_flight(0)
        .lease(Duration::from_secs(1))
        .build()
        .unwrap_err()
        .to_string();
    assert!(zero.contains("max_in_flight"), "{zero}");
    let instant = base()
        .max_in_flight(1)
        .lease(Duration::ZERO)
        .build()
        .unwrap_err()
        .to_string();
    assert!(instant.contains("lease"), "{instant}");
    // A concurrency limit alone is a whole policy.
    let only = Policy::builder("jobs")
        .max_in_flight(2)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    assert!(only.rules().is_empty());
}

#[derive(serde::Deserialize)]
struct NumberedWork {
    ms: u64,
    n: usize,
}

/// What the jobs of [`tracked_app`]s did: the order they started in, and the most running at once.
#[derive(Default)]
struct JobLog {
    started: std::sync::Mutex<Vec<usize>>,
    running: AtomicUsize,
    most_running: AtomicUsize,
}

impl JobLog {
    /// Job `work.n`: logged, then `work.ms` of work.
    async fn run(&self, work: NumberedWork) -> &'static str {
        self.started.lock().unwrap().push(work.n);
        let running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_running.fetch_max(running, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(work.ms)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        "done"
    }
}

/// `GET /work?ms=N&n=I` answers after N ms, logging job I in `log`; limited by `policy` in `store`.
fn tracked_app(policy: Policy, store: Arc<dyn Store>, log: Arc<JobLog>) -> Router {
    Router::new()
        .route(
            "/work",
            get(move |Query(work): Query<NumberedWork>| async move { log.run(work).await }),
        )
        .layer(RateLimitLayer::new(policy, store))
}

/// One job per user at a time, waiting up to `max_delay` for the slot.
fn one_per_user_waiting(prefix: &str, max_delay: Duration) -> PolicyBuilder {
    one_per_user(prefix, Duration::from_secs(30)).mode(Mode::Delay { max_delay })
}

async fn numbered_work(
    client: &reqwest::Client,
    addr: SocketAddr,
    ms: u64,
    n: usize,
) -> reqwest::Response {
    client
        .get(format!("http://{addr}/work?ms={ms}&n={n}"))
        .header("x-user", "ann")
        .send()
        .await
        .unwrap()
}

/// In delay mode, five jobs of one user sent 40 ms apart to one instance all run, one at a time,
/// in the order they came; none is refused.
async fn waiting_jobs_take_the_slot_in_arrival_order(store: Arc<dyn Store>, prefix: &str) {
    let log = Arc::new(JobLog::default());
    let policy = one_per_user_waiting(prefix, Duration::from_secs(10))
        .build()
        .unwrap();
    let addr = serve(tracked_app(policy, store, log.clone())).await;
    let client = client();
    let mut jobs = Vec::new();
    for n in 0..5 {
        let client = client.clone();
        jobs.push(tokio::spawn(async move {
            numbered_work(&client, addr, 150, n).await.status()
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for job in jobs {
        assert_eq!(job.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(*log.started.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(log.most_running.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_take_the_slot_in_arrival_order_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("fifo");
    let store = Arc::new(RedisStore::from_url(&redis.url).unwrap());
    waiting_jobs_take_the_slot_in_arrival_order(store, &prefix).await;
    assert!(assert_every_key_expires(&redis, &prefix) <= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_take_the_slot_in_arrival_order_in_memory() {
    waiting_jobs_take_the_slot_in_arrival_order(Arc::new(MemoryStore::new()), "mem").await;
}

/// In delay mode over two instances, a slot released by one is found by the other's waiting
/// job (it polls): eight jobs sent at once, four to each, all run, never two at once.
async fn waiting_jobs_find_slots_freed_by_another_instance(
    stores: [Arc<dyn Store>; 2],
    prefix: &str,
) {
    let log = Arc::new(JobLog::default());
    let [a, b] = stores.map(|store| {
        let policy = one_per_user_waiting(prefix, Duration::from_secs(10))
            .build()
            .unwrap();
        tracked_app(policy, store, log.clone())
    });
    let addrs = [serve(a).await, serve(b).await];
    let client = client();
    let jobs: Vec<_> = (0..8)
        .map(|n| {
            let (client, addr) = (client.clone(), addrs[n % 2]);
            tokio::spawn(async move { numbered_work(&client, addr, 100, n).await.status() })
        })
        .collect();
    for job in jobs {
        assert_eq!(job.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(log.started.lock().unwrap().len(), 8);
    assert_eq!(log.most_running.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_find_slots_freed_by_another_instance_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("poll");
    waiting_jobs_find_slots_freed_by_another_instance(two_redis_instances(&redis), &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_find_slots_freed_by_another_instance_in_memory() {
    // Two layers over one store: neither hears of the other's releases.
    waiting_jobs_find_slots_freed_by_another_instance(two_instances_in_one_memory_store(), "mem")
        .await;
}

/// A job that can't get the slot within `max_delay` is refused after waiting that long, with the
/// slot's 429; its polls used none of the rate rule's quota.
async fn a_wait_past_max_delay_is_refused(store: Arc<dyn Store>, prefix: &str) {
    let policy = one_per_user_waiting(prefix, Duration::from_millis(300))
        .rule(Rule::per_minute(3))
        .build()
        .unwrap();
    let addr = serve(work_app(policy, store)).await;
    let client = client();
    let long = tokio::spawn({
        let client = client.clone();
        async move { work(&client, addr, 1_500).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let refused = work(&client, addr, 0).await;
    let waited = asked.elapsed();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        waited >= Duration::from_millis(300),
        "refused after {waited:?}"
    );
    let body: serde_json::Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["1-in-flight"])
    );
    assert_eq!(long.await.unwrap(), StatusCode::OK);
    // The long job used one of the 3; the refused one's polls none.
    let next = work(&client, addr, 0).await;
    assert_eq!(next.status(), StatusCode::OK);
    let status = next.headers()["ratelimit"].to_str().unwrap();
    assert!(status.starts_with("\"3-per-60s\";r=1;"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_max_delay_is_refused_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("late");
    let store = Arc::new(RedisStore::from_url(&redis.url).unwrap());
    a_wait_past_max_delay_is_refused(store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_max_delay_is_refused_in_memory() {
    a_wait_past_max_delay_is_refused(Arc::new(MemoryStore::new()), "mem").await;
}

/// A job that arrives while another of its user waits for the slot queues behind it, even when it
/// comes just as a slot frees elsewhere and the waiting one has yet to poll.
async fn a_newcomer_queues_behind_waiting_jobs(stores: [Arc<dyn Store>; 2], prefix: &str) {
    let log = Arc::new(JobLog::default());
    let [a, b] = stores.map(|store| {
        let policy = one_per_user_waiting(prefix, Duration::from_secs(10))
            .build()
            .unwrap();
        tracked_app(policy, store, log.clone())
    });
    let (a, b) = (serve(a).await, serve(b).await);
    let client = client();
    let holder = tokio::spawn({
        let client = client.clone();
        async move { numbered_work(&client, a, 400, 0).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { numbered_work(&client, b, 0, 1).await.status() }
    });
    // The slot frees on the other instance; the waiting job finds it at its next poll.
    assert_eq!(holder.await.unwrap(), StatusCode::OK);
    let newcomer = numbered_work(&client, b, 0, 2).await;
    assert_eq!(newcomer.status(), StatusCode::OK);
    assert_eq!(waiting.await.unwrap(), StatusCode::OK);
    assert_eq!(*log.started.lock().unwrap(), vec![0, 1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_queues_behind_waiting_jobs_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("queue");
    a_newcomer_queues_behind_waiting_jobs(two_redis_instances(&redis), &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_queues_behind_waiting_jobs_in_memory() {
    a_newcomer_queues_behind_waiting_jobs(two_instances_in_one_memory_store(), "mem").await;
}

/// One job at a time, waiting up to 10 s for the slot, declared next to its handler.
struct OneJobWaiting;

impl LimitPolicy for OneJobWaiting {
    fn policy() -> Result<Policy, PolicyError> {
        one_per_user_waiting("extractor", Duration::from_secs(10)).build()
    }
}

/// The `Limited` extractor waits for a slot as the layer does: three jobs sent 40 ms apart all
/// run, one at a time, in the order they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extractor_waits_for_a_slot_in_delay_mode() {
    let log = Arc::new(JobLog::default());
    let app = Router::new()
        .route(
            "/work",
            get(
                |slot: Limited<OneJobWaiting>,
                 Extension(log): Extension<Arc<JobLog>>,
                 Query(work): Query<NumberedWork>| async move {
                    // Held until the handler is done (a closure's unused argument would not be).
                    let _slot = slot;
                    log.run(work).await
                },
            ),
        )
        .layer(Extension(log.clone()))
        .layer(Extension(LimitStore::new(MemoryStore::new())));
    let addr = serve(app).await;
    let client = client();
    let mut jobs = Vec::new();
    for n in 0..3 {
        let client = client.clone();
        jobs.push(tokio::spawn(async move {
            numbered_work(&client, addr, 150, n).await.status()
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for job in jobs {
        assert_eq!(job.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(*log.started.lock().unwrap(), vec![0, 1, 2]);
    assert_eq!(log.most_running.load(Ordering::SeqCst), 1);
}

/// Leases taken and released by many tasks at once on two instances (Redis), so that batches mix
/// checks and releases of one set of leases, more than a batch reads of it at once
/// (`LEASE_WINDOW` in lua/entry.lua), released in every order: the count stays exact. No check
/// is admitted past the slots held in the store, and once every lease is released the next 64
/// checks take the 64 slots, the 65th is refused, and each says how many are left and when the
/// earliest lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_churned_in_batches_keep_their_count() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("churn");
    let policy = one_per_user(&prefix, Duration::from_secs(60))
        .max_in_flight(64)
        .build()
        .unwrap();
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(RedisStore::from_url(&redis.url).unwrap()),
        Arc::new(RedisStore::from_url(&redis.url).unwrap()),
    ];
    let key = format!("{prefix}:jobs:user:ann");
    let holding = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..96u64)
        .map(|n| {
            let (store, policy, key, holding) = (
                stores[(n % 2) as usize].clone(),
                policy.clone(),
                key.clone(),
                holding.clone(),
            );
            tokio::spawn(async move {
                let mut admitted = 0;
                for round in 0..20u64 {
                    let decision = check(&*store, &policy, &key).await;
                    let Some(lease) = decision.lease else {
                        continue;
                    };
                    admitted += 1;
                    let held = holding.fetch_add(1, Ordering::SeqCst) + 1;
                    assert!(held <= 64, "{held} leases held at once");
                    // Held for 0 to 3 ms: releases come in every order.
                    tokio::time::sleep(Duration::from_millis((n * 7 + round) % 4)).await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    store
                        .release(&check_of(&policy, &key), lease)
                        .await
                        .unwrap();
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert!(admitted >= 64, "{admitted} admissions");
    let held: u64 = redis
        .client()
        .llen(format!("{prefix}:{{user:ann}}:jobs:leases"))
        .unwrap();
    assert_eq!(held, 0, "every lease released");
    for taken in 1..=64u64 {
        let decision = check(&*stores[0], &policy, &key).await;
        assert!(decision.allowed, "slot {taken} of 64");
        assert_eq!(slots(&decision), (64 - taken, false));
        let reset = decision.rules.last().unwrap().reset;
        assert!(
            reset > Duration::from_secs(58) && reset <= Duration::from_secs(60),
            "the earliest lease ends in {reset:?}"
        );
    }
    let refused = check(&*stores[1], &policy, &key).await;
    assert!(!refused.allowed);
    assert_eq!(slots(&refused), (0, true));
}
