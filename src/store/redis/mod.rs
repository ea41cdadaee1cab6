//! The Redis store: many app instances share one limit.
//!
//! Every rule of a request goes to one call of the store's Lua from `lua/` (`FCALL` of its function
//! library on Redis 7, `EVALSHA` of the same code as a script before 7.0 and on a cluster), which
//! reads the time with Redis `TIME`, checks every rule, and records the request in all of them only
//! if all admit it, setting each key's expiry in the same call. So a request costs one round trip
//! whatever the number of rules, app servers' clocks don't matter, and no key outlives its window.
//! Checks that arrive while a call is in flight go together in the next one (see `batch`).
//!
//! Topologies: one node, a Redis Cluster (feature `cluster`: the call goes to the node of the
//! identity's slot, every key of a check sharing one hash tag) or a Sentinel-managed primary
//! (feature `sentinel`), each over `rediss://` with feature `tls`.
//!
//! Connections: the store takes one connection (from the user's pool, or its own client) and shares
//! it, multiplexed, between requests. It takes a new one only when that connection fails or a
//! request times out, so no request pays for a pool's per-checkout health check (a `PING`, a
//! second round trip).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ::redis::{ErrorKind, Script, Value};
use tokio::time::Instant;

use self::batch::{Batched, Batcher};
use self::client::CallStats;
use self::client::ServerCheck;
use self::command::Member;
use self::command::PackedCheck;
use self::connection::{Connection, Connector};
use self::error::store_error;
use self::script::{LIBRARY, OVERRIDE_BOOK, PAUSE, PAUSE_LEFT, RESET, block_key, evalsha};
use self::topology::Target;
use super::ListFuture;
use super::{
    ActionFuture, CheckFuture, CheckRequest, PauseFuture, Released, ResetListener, ResetWatch,
    Store, StoreError,
};
use crate::decision::Decision;
use crate::policy::{Policy, StoredOverride, Whom};
use crate::store::overrides::OverrideBook;

mod batch;
mod client;
#[cfg(feature = "cluster")]
mod cluster;
mod command;
mod connection;
mod error;
mod fair_tag;
mod merge;
mod override_mirror;
mod overrides;
mod reply;
mod resets;
mod script;
mod server;
#[cfg(any(debug_assertions, feature = "test-hooks"))]
mod test_hooks;
#[cfg(feature = "tls")]
mod tls;
mod topology;
#[cfg(any(debug_assertions, feature = "test-hooks"))]
use self::test_hooks::TestHooks;
mod wire;

/// The reader of batch replies, for `crate::fuzzing`: `true` if it read one entry per check.
#[cfg(fuzzing)]
pub(crate) fn read_batch_reply_for_fuzzing(packed: &[u8], short_lengths: &[usize]) -> bool {
    let limits: Vec<_> = short_lengths
        .iter()
        .map(|&length| reply::limits_of_short_length(length))
        .collect();
    reply::read_batch_reply(packed, limits.iter().map(|limits| &limits[..])).is_ok()
}

pub use self::client::BatchStats;
pub use self::server::{MINIMUM_VERSION, RedisVersion, ServerInfo, ServerMode, ServerSoftware};
#[cfg(feature = "tls")]
pub use self::tls::TlsOptions;

pub use super::DEFAULT_TIMEOUT;

/// A [`Store`] in Redis. Cheap to clone; clones share the connection.
///
/// ```no_run
/// use tower_redis_ratelimit::{Policy, RateLimitLayer, Rule};
/// use tower_redis_ratelimit::store::RedisStore;
///
/// let store = RedisStore::from_url("redis://127.0.0.1:6379/0")?;
/// let policy = Policy::builder("api").rule(Rule::per_minute(20)).build()?;
/// let layer = RateLimitLayer::new(policy, store);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RedisStore {
    shared: Arc<Shared>,
    timeout: Duration,
    /// Replicas that must acknowledge a check's writes before it counts (`WAIT`), if any.
    wait_for_replicas: Option<u32>,
}

struct Shared {
    connector: Connector,
    /// What the store's own client was built for, so TLS settings can rebuild it.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    target: Option<Target>,
    /// The shared connection; `None` until the first request and after a failure.
    connection: Mutex<Option<Connection>>,
    /// Held while a new connection is fetched, so a reconnect storm asks the pool once.
    reconnecting: tokio::sync::Mutex<()>,
    script: Script,
    /// Whether calls go to the store's function library (`FCALL`) rather than its script
    /// (`EVALSHA`): until Redis shows it has no functions (before 7.0, or an ACL that forbids
    /// them); never on a cluster.
    functions: AtomicBool,
    batcher: Batcher,
    /// How many script calls carried how many checks.
    call_stats: CallStats,
    /// What the crate's own tests set (a fixed time, generic checks): nothing in a release build.
    hooks: TestHooks,
    /// What the version check of the last new connection found.
    server: Mutex<ServerCheck>,
    /// Who hears of resets, and whether the store's subscription is up (`resets.rs`).
    resets: resets::ResetFeed,
    /// A client to subscribe with, given for a pool ([`RedisStore::reset_notices_from`]).
    notices_client: Option<::redis::Client>,
    /// This instance's copies of the networks set at run time, by policy
    /// (`override_mirror.rs`).
    mirrors: override_mirror::Mirrors,
}

impl RedisStore {
    /// Connects (unless connected), checks the server and readies the store's Lua on it, and says
    /// what it found: the server's version, its mode, whether the store calls its Lua as a
    /// function library or a script, and the round trip of one `INFO server`. Call it when the
    /// app starts, to fail early or log what the limits run on:
    ///
    /// ```no_run
    /// # async fn start() -> Result<(), tower_redis_ratelimit::store::StoreError> {
    /// use tower_redis_ratelimit::store::RedisStore;
    ///
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379/0")?;
    /// let server = store.probe().await?;
    /// println!("rate limits on {server}"); // Redis 7.0.15, standalone, functions, round trip 0.21 ms
    /// # Ok(()) }
    /// ```
    ///
    /// A Redis older than [`MINIMUM_VERSION`] is a [`StoreError::UnsupportedVersion`], as every
    /// check on it is. Requests need no probe: the first check does the same on its own.
    pub async fn probe(&self) -> Result<ServerInfo, StoreError> {
        let shared = &self.shared;
        let timeout = self.timeout;
        let mut connection = shared.connection(timeout).await?;
        let started = Instant::now();
        let found = shared.server_info(&mut connection, timeout).await?;
        let round_trip = started.elapsed();
        if shared.functions.load(Ordering::Relaxed) {
            // Loading the library now spares the first request; a server without functions (or
            // an ACL that forbids them) turns the store to its script, as a check would.
            let mut load = ::redis::cmd("FUNCTION");
            load.arg("LOAD").arg("REPLACE").arg(&LIBRARY.code);
            match connection.query(&load, timeout).await {
                Ok(_) => {}
                Err(error) if matches!(error.kind(), ErrorKind::Server(_)) => {
                    shared.functions.store(false, Ordering::Relaxed);
                }
                Err(error) => return Err(store_error(error, timeout)),
            }
        }
        Ok(ServerInfo {
            version: found.version,
            software: found.software,
            mode: found.mode,
            functions: shared.functions.load(Ordering::Relaxed),
            round_trip,
        })
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .field("wait_for_replicas", &self.wait_for_replicas)
            .field("cluster", &self.shared.connector.is_cluster())
            .finish_non_exhaustive()
    }
}

impl Store for RedisStore {
    fn peek(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.check(&request.peeking())
    }

    fn refund(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.check(&request.refunding())
    }

    fn give_back(&self, request: &CheckRequest<'_>, charged: &Decision) -> CheckFuture {
        self.call(&request.giving_back(charged), Sent::WhenAsked)
    }

    fn overdraw(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.call(&request.overdrawing(), Sent::WhenAsked)
    }

    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.call(request, Sent::Now)
    }

    fn keys_share_one_slot(&self) -> bool {
        self.shared.connector.is_cluster()
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn keeps_claims(&self) -> bool {
        true
    }

    fn abilities(&self) -> crate::store::Abilities {
        crate::store::Abilities::ALL
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn override_lookup(&self, policy: &Policy, networks: bool) -> Option<Box<str>> {
        overrides::lookup_of(policy, networks, self.shared.connector.is_cluster())
    }

    fn override_mirror(&self, policy: &Policy) -> Option<Arc<OverrideBook>> {
        let cluster = self.shared.connector.is_cluster();
        if overrides::networks_in_call(policy, cluster)
            || overrides::lookup_of(policy, false, cluster).is_none()
        {
            return None;
        }
        Some(self.mirror_of(policy.key_base()))
    }

    fn override_lookup_carrying(&self, policy: &Policy, over: &StoredOverride) -> Option<Box<str>> {
        overrides::carrying_lookup_of(policy, over, self.shared.connector.is_cluster())
    }

    fn set_override(
        &self,
        policy: &Policy,
        over: StoredOverride,
        lasting: Option<Duration>,
    ) -> ActionFuture {
        let cluster = self.shared.connector.is_cluster();
        let calls = overrides::book_calls(policy, over.whom(), Some((&over, lasting)), cluster);
        let calls = self.run_book_calls(calls);
        // This instance's copy of the networks, if it keeps one, holds the change at once.
        let mirror = match over.whom() {
            Whom::Identity(_) => None,
            Whom::Address(_) | Whom::Network(_) => self.mirror_held(policy.key_base()),
        };
        // (Counting where the store's value says: the policy's counters now.)
        let over = over.pinned_to(policy);
        Box::pin(async move {
            calls.await?;
            if let Some(mirror) = mirror {
                mirror.set(over, lasting);
            }
            Ok(())
        })
    }

    fn remove_override(&self, policy: &Policy, whom: &Whom) -> ActionFuture {
        let cluster = self.shared.connector.is_cluster();
        let calls = self.run_book_calls(overrides::book_calls(policy, whom, None, cluster));
        let mirror = match whom {
            Whom::Identity(_) => None,
            Whom::Address(_) | Whom::Network(_) => self
                .mirror_held(policy.key_base())
                .map(|mirror| (mirror, whom.clone())),
        };
        Box::pin(async move {
            calls.await?;
            if let Some((mirror, whom)) = mirror {
                mirror.remove(&whom);
            }
            Ok(())
        })
    }

    fn list_overrides(&self, policy: &str) -> ListFuture {
        let reply = self.run_script(overrides::list_call(policy), &OVERRIDE_BOOK);
        Box::pin(async move { overrides::listed_of(reply.await?) })
    }

    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        // The keys a check of the same request writes, but the quota's and a budget's shared
        // fairly (its last keys): the identity's alone.
        let request = CheckRequest {
            quota: None,
            ..*request
        };
        let packed = PackedCheck::new(&request, true);
        let own = packed.key_count()
            - if request.fair.is_some() {
                fair_tag::FAIR_KEYS
            } else {
                0
            };
        // A script rather than DEL: its first key is where a cluster router looks for the slot
        // (all of them share the identity's hash tag).
        let mut marker = String::with_capacity(request.key.len() + 16);
        command::write_reset_marker(&mut marker, &request);
        let mut command = evalsha(&RESET);
        command.arg(own + 1);
        for key in packed.keys().take(own) {
            command.arg(key);
        }
        command.arg(marker);
        // The notice every instance hears (src/store/redis/resets.rs), how long the marker
        // lives, and the time tests fix.
        command
            .arg(request.key)
            .arg(super::reset_marker_ms(&request));
        match self.shared.hooks.fixed_time() {
            Some(time) => command.arg(time),
            None => command.arg(""),
        };
        self.run_action(command, &RESET)
    }

    fn watch_resets(&self, listener: Weak<dyn ResetListener>) -> Option<ResetWatch> {
        // A pool you built lends no connection to subscribe with; nor can one start outside a
        // runtime.
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if self.shared.notices_client.is_none() && !resets::can_subscribe(&self.shared.connector) {
            return None;
        }
        let (watch, first) = self.shared.resets.watch(listener);
        if first {
            runtime.spawn(resets::serve(Arc::downgrade(&self.shared)));
        }
        Some(watch)
    }

    fn pause(&self, request: &CheckRequest<'_>, pause: Duration) -> ActionFuture {
        // The block key, set to the pause's end in Redis's time unless it already ends later.
        let block_key = match block_key(request) {
            Ok(key) => key,
            Err(error) => return Box::pin(std::future::ready(Err(error))),
        };
        let mut command = evalsha(&PAUSE);
        command
            .arg(1)
            .arg(block_key)
            .arg(u64::try_from(pause.as_millis()).unwrap_or(u64::MAX));
        self.run_action(command, &PAUSE)
    }

    fn pause_left(&self, request: &CheckRequest<'_>) -> PauseFuture {
        let block_key = match block_key(request) {
            Ok(key) => key,
            Err(error) => return Box::pin(std::future::ready(Err(error))),
        };
        let mut command = evalsha(&PAUSE_LEFT);
        command.arg(1).arg(block_key);
        let reply = self.run_script(command, &PAUSE_LEFT);
        Box::pin(async move {
            match reply.await? {
                Value::Int(left) => Ok(u64::try_from(left)
                    .ok()
                    .filter(|&left| left > 0)
                    .map(Duration::from_millis)),
                other => Err(StoreError::Protocol(format!(
                    "unexpected reply {other:?} to a pause's time left"
                ))),
            }
        })
    }

    fn release(&self, request: &CheckRequest<'_>, lease: u64) -> ActionFuture {
        let release = self.release_call(request, lease);
        Box::pin(async move { release.await.map(drop) })
    }

    fn release_then(&self, request: &CheckRequest<'_>, lease: u64, released: Released) {
        self.release_call(request, lease)
            .then(move |result| released(result.map(drop)));
    }
}

/// When a call of the store is sent.
enum Sent {
    /// At once (its future is polled at once: a check).
    Now,
    /// When its future is first polled, or with [`CheckFuture::then`]: a call whose answer nobody
    /// may wait for (a give-back, an overdraw, a release), which then rides a batch with no task
    /// of its own.
    WhenAsked,
}

impl RedisStore {
    /// How the store's checks were batched so far (shared by its clones): see the README's
    /// "Performance" section for what group commit is. On a cluster every check is a call of its
    /// own.
    pub fn batch_stats(&self) -> BatchStats {
        self.shared.call_stats.get()
    }

    /// The store's call of `request`: a script call of its own on a cluster (a batch would need
    /// all its keys in one slot), else an entry of the group commit, sent as `sent` says.
    fn call(&self, request: &CheckRequest<'_>, sent: Sent) -> CheckFuture {
        if self.shared.connector.is_cluster()
            && let Some(quota) = request.quota
            && quota.identity != request.identity
        {
            // Layers refuse such policies when they are built; a hand-made request gets this
            // rather than Redis's CROSSSLOT.
            return CheckFuture::ready(Err(StoreError::Config(format!(
                "on Redis Cluster a quota must be keyed like its rules (one hash slot): \
                 {:?} and {:?} differ",
                request.identity, quota.identity
            ))));
        }
        // Everything that needs the request is done here, before the future: the future then owns
        // one packed check and a few words, not the request's borrows.
        self.call_of(self.member(request), sent)
    }

    /// The call of `member` (see [`RedisStore::call`]).
    fn call_of(&self, member: Member, sent: Sent) -> CheckFuture {
        let shared = self.shared.clone();
        if shared.connector.is_cluster() {
            return CheckFuture::from_future(async move { shared.call_alone(&member).await });
        }
        match sent {
            Sent::Now => {
                CheckFuture::from_future(async move { shared.check_batched(member).await })
            }
            Sent::WhenAsked => CheckFuture::deferred(Box::new(Batched { shared, member })),
        }
    }

    /// The release of `lease` under `request`'s concurrency limit: an entry of a batch, as a
    /// check is.
    fn release_call(&self, request: &CheckRequest<'_>, lease: u64) -> CheckFuture {
        if request.concurrency.is_none() {
            return CheckFuture::ready(Err(StoreError::Config(
                "a release needs the request's concurrency limit".into(),
            )));
        }
        self.call_of(
            self.member_of(PackedCheck::release(request, lease)),
            Sent::WhenAsked,
        )
    }

    /// `request` packed, with this store's timeout and replication.
    fn member(&self, request: &CheckRequest<'_>) -> Member {
        self.member_of(PackedCheck::new(request, self.shared.hooks.generic_only()))
    }

    /// `check`, with this store's timeout and replication.
    fn member_of(&self, check: PackedCheck) -> Member {
        Member {
            check,
            replicas: self.wait_for_replicas,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
        }
    }
}

/// A release build's test hooks: none, at no cost (see `test_hooks.rs`).
#[cfg(not(any(debug_assertions, feature = "test-hooks")))]
#[derive(Default)]
struct TestHooks {}

/// A release build's hooks for the tests: each says how to get the real ones, loudly.
#[cfg(not(any(debug_assertions, feature = "test-hooks")))]
#[allow(missing_docs, clippy::unused_async)]
impl RedisStore {
    #[doc(hidden)]
    pub fn fix_time_for_tests(&self, _: Option<u64>) {
        no_test_hooks()
    }

    #[doc(hidden)]
    pub fn generic_checks_for_tests(&self, _: bool) {
        no_test_hooks()
    }

    #[doc(hidden)]
    pub async fn check_batch_for_tests(
        &self,
        _: &[CheckRequest<'_>],
    ) -> Vec<Result<Decision, StoreError>> {
        no_test_hooks()
    }
}

#[cfg(not(any(debug_assertions, feature = "test-hooks")))]
fn no_test_hooks() -> ! {
    panic!(
        "the Redis store's test hooks are in debug builds and with the `test-hooks` feature: \
         run release-built tests with `--features test-hooks` (or `--all-features`)"
    )
}

#[cfg(not(any(debug_assertions, feature = "test-hooks")))]
impl TestHooks {
    fn fixed_time(&self) -> Option<u64> {
        None
    }

    fn generic_only(&self) -> bool {
        false
    }
}
