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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use ::redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, Value};
use tokio::time::Instant;

use self::batch::{Batcher, Member};
use self::command::{PackedCheck, batch_command};
use self::connection::{Connection, Connector};
use self::error::{is_no_script, store_error};
use self::wire::eval_of;
use super::{
    ActionFuture, CheckFuture, CheckRequest, PauseFuture, ResetListener, ResetWatch, Store,
    StoreError,
};
use crate::decision::Decision;

mod batch;
#[cfg(feature = "cluster")]
mod cluster;
mod command;
mod connection;
mod error;
mod reply;
mod resets;
mod server;
#[cfg(feature = "tls")]
mod tls;
mod wire;

/// The reader of batch replies, for `crate::fuzzing`: `true` if it read one entry per check.
#[cfg(fuzzing)]
pub(crate) fn read_batch_reply_for_fuzzing(packed: &[u8], short_lengths: &[usize]) -> bool {
    reply::read_batch_reply(packed, short_lengths.iter().copied()).is_ok()
}

pub use self::batch::BatchStats;
pub use self::server::{MINIMUM_VERSION, RedisVersion, ServerInfo, ServerMode, ServerSoftware};
#[cfg(feature = "tls")]
pub use self::tls::TlsOptions;

/// How long a check may take by default before it counts as a store failure.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// A check function of the batch script for one algorithm (see `lua/batch.lua`): the shared head
/// (arguments, penalty block, duplicate guard), the algorithm's part, the shared tail (check all,
/// record in all or none, reply).
macro_rules! check_function {
    ($code:literal, $algorithm:literal) => {
        concat!(
            "checks.",
            $code,
            " = function(KEYS, ARGV, now_us, receipt)\n",
            include_str!("../../../lua/head.lua"),
            include_str!(concat!("../../../lua/", $algorithm, ".lua")),
            include_str!("../../../lua/tail.lua"),
            "end\n"
        )
    };
}

/// The store's Lua: shared helpers, a check function per algorithm, the lean functions of the
/// common case, and `batch(KEYS, ARGV)`, the function that runs a batch of checks
/// (`lua/batch.lua`).
macro_rules! library_body {
    () => {
        concat!(
            include_str!("../../../lua/common.lua"),
            "local checks = {}\n",
            check_function!("fw", "fixed_window"),
            check_function!("sl", "sliding_log"),
            check_function!("sc", "sliding_counter"),
            check_function!("tb", "token_bucket"),
            include_str!("../../../lua/fast.lua"),
            include_str!("../../../lua/batch.lua")
        )
    };
}

/// The store's Lua as a script (`EVALSHA`): for Redis before 7.0, and for clusters, whose nodes
/// come and go without the library.
const SCRIPT: &str = concat!(
    "-- tower-redis-ratelimit: a batch of rate-limit checks (see lua/batch.lua)\n",
    library_body!(),
    "return batch(KEYS, ARGV)\n"
);

/// The store's Lua as a Redis function library (`FUNCTION LOAD` once, then `FCALL`): the helpers
/// and check functions are made when the library loads rather than at every call, which saves Redis
/// a few microseconds per call. Its name (also the function's) carries the script's hash, so
/// instances of two versions of the crate sharing a Redis (a rolling deploy) each call their own.
struct Library {
    name: String,
    code: String,
}

static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(|| {
    let name = format!(
        "tower_redis_ratelimit_{}",
        &Script::new(SCRIPT).get_hash()[..16]
    );
    let code = format!(
        "#!lua name={name}\n{}redis.register_function('{name}', batch)\n",
        library_body!()
    );
    Library { name, code }
});

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
    /// A time (µs) that every script call takes instead of Redis TIME; 0: none (tests only).
    fixed_time_us: AtomicU64,
    /// Whether checks skip the script's lean functions of the common case (tests only).
    generic_only: AtomicBool,
    /// What the version check of the last new connection found.
    server: Mutex<ServerCheck>,
    /// Who hears of resets, and whether the store's subscription is up (`resets.rs`).
    resets: resets::ResetFeed,
    /// A client to subscribe with, given for a pool ([`RedisStore::reset_notices_from`]).
    notices_client: Option<::redis::Client>,
}

/// The version check of new connections (see [`Shared::connection`]).
#[derive(Default)]
struct ServerCheck {
    /// The last server found too old, and when: for a second after, no connection is tried.
    refused: Option<(Instant, RedisVersion)>,
    /// The last too old version logged, so each is logged once, not per request.
    logged: Option<RedisVersion>,
}

/// Why `INFO server` gave no version.
enum InfoError {
    /// Redis refused it (`NOPERM`, a renamed command) or answered what names no version.
    Refused(StoreError),
    /// The store failed (an outage).
    Store(StoreError),
}

impl From<InfoError> for StoreError {
    fn from(error: InfoError) -> Self {
        match error {
            InfoError::Refused(error) | InfoError::Store(error) => error,
        }
    }
}

/// How long a server found too old is taken at its word before it is asked again (an upgrade).
const RECHECK_OLD_SERVER_AFTER: Duration = Duration::from_secs(1);

/// What a store of its own connects to, kept so [`RedisStore::with_tls`] can rebuild its client.
#[derive(Debug, Clone)]
enum Target {
    Node(String),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    #[cfg(feature = "sentinel")]
    Sentinel {
        master: String,
        urls: Vec<String>,
    },
}

impl RedisStore {
    fn with_connector(connector: Connector, target: Option<Target>) -> Self {
        let functions = AtomicBool::new(!connector.is_cluster());
        RedisStore {
            shared: Arc::new(Shared {
                connector,
                target,
                connection: Mutex::new(None),
                reconnecting: tokio::sync::Mutex::new(()),
                functions,
                script: Script::new(SCRIPT),
                batcher: Batcher::default(),
                fixed_time_us: AtomicU64::new(0),
                generic_only: AtomicBool::new(false),
                server: Mutex::new(ServerCheck::default()),
                resets: resets::ResetFeed::default(),
                notices_client: None,
            }),
            timeout: DEFAULT_TIMEOUT,
            wait_for_replicas: None,
        }
    }

    /// A store over `pool` (one Redis node), with the default timeout of 250 ms.
    ///
    /// A pool lends no connection to subscribe with: give the store a URL for its reset
    /// notices with [`RedisStore::reset_notices_from`], or a `reset` reaches the units other
    /// instances took ahead ([`PolicyBuilder::prefetch`](crate::PolicyBuilder::prefetch)) only
    /// when their window ends.
    pub fn new(pool: deadpool_redis::Pool) -> Self {
        RedisStore::with_connector(Connector::Pool(pool), None)
    }

    /// Hears the store's reset notices ([`Store::watch_resets`]) through a subscription to
    /// `url`: for a store over a pool you built ([`RedisStore::new`], `from_cluster_pool`,
    /// `from_sentinel_pool`), which lends no connection to subscribe with. Any node that hears
    /// what the store's scripts publish will do: the node itself, any node of a cluster (its
    /// pub/sub reaches every node), a replica of the primary. Call it before the store is
    /// cloned or used.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a malformed URL, or a store already cloned or used.
    pub fn reset_notices_from(mut self, url: &str) -> Result<Self, StoreError> {
        let client =
            ::redis::Client::open(url).map_err(|error| StoreError::Config(error.to_string()))?;
        let shared = Arc::get_mut(&mut self.shared).ok_or_else(|| {
            StoreError::Config("reset_notices_from: the store was already cloned or used".into())
        })?;
        shared.notices_client = Some(client);
        Ok(self)
    }

    /// A store with a client of its own for `url` (`redis://host:port/db`, or `rediss://` with
    /// feature `tls`). Nothing connects yet: a Redis that is down makes requests fail open or
    /// closed, not this call; a malformed URL is an error here.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let target = Target::Node(url.to_owned());
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a Redis Cluster, found from any of its nodes' URLs (`redis://10.0.0.1:6379`).
    /// Each check goes to the primary of its identity's slot; `MOVED` and `ASK` are followed and
    /// the slot map is refreshed after a failover. Nothing connects yet.
    ///
    /// A layer over a cluster store refuses a policy whose quota is keyed apart from its rules
    /// (their keys would be in different slots): see [`Store::keys_share_one_slot`].
    #[cfg(feature = "cluster")]
    pub fn cluster<I>(urls: I) -> Result<Self, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let target = Target::Cluster(
            urls.into_iter()
                .map(|url| url.as_ref().to_owned())
                .collect(),
        );
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a cluster pool you already have; the store takes one connection from it.
    #[cfg(feature = "cluster")]
    pub fn from_cluster_pool(pool: deadpool_redis::cluster::Pool) -> Self {
        RedisStore::with_connector(Connector::ClusterPool(pool), None)
    }

    /// A store over the primary that Redis Sentinel names `master`, asking the sentinels at
    /// `urls` (`redis://10.0.0.1:26379`). After a failover the store's connection breaks (or the
    /// old primary answers `READONLY`) and the next request asks the sentinels again. The primary
    /// is reached with the TLS mode of the sentinel URLs; for a password or database on the
    /// primary, build a `deadpool_redis::sentinel::Pool` and use [`RedisStore::from_sentinel_pool`].
    #[cfg(feature = "sentinel")]
    pub fn sentinel<I>(master: &str, urls: I) -> Result<Self, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let target = Target::Sentinel {
            master: master.to_owned(),
            urls: urls
                .into_iter()
                .map(|url| url.as_ref().to_owned())
                .collect(),
        };
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a Sentinel pool you already have; the store takes one connection from it.
    #[cfg(feature = "sentinel")]
    pub fn from_sentinel_pool(pool: deadpool_redis::sentinel::Pool) -> Self {
        RedisStore::with_connector(Connector::SentinelPool(pool), None)
    }

    /// Rebuilds the store's own client with these TLS settings (a CA of your own, or no
    /// certificate checks at all) for its `rediss://` URLs. A store over your pool takes its TLS
    /// settings from the pool: this is an error there.
    ///
    /// ```no_run
    /// use tower_redis_ratelimit::store::{RedisStore, TlsOptions};
    ///
    /// let store = RedisStore::from_url("rediss://redis.internal:6380/0")?
    ///     .with_tls(TlsOptions::new().ca_file("certs/ca.crt")?)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "tls")]
    pub fn with_tls(self, tls: TlsOptions) -> Result<Self, StoreError> {
        let Some(target) = self.shared.target.clone() else {
            return Err(StoreError::Config(
                "TLS settings of a store over your own pool belong to the pool".to_owned(),
            ));
        };
        let connector = target.connector(Some(&tls))?;
        Ok(RedisStore {
            timeout: self.timeout,
            wait_for_replicas: self.wait_for_replicas,
            ..RedisStore::with_connector(connector, Some(target))
        })
    }

    /// How long a check may take, connecting included, before it is a [`StoreError::Timeout`]
    /// (default 250 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The configured timeout.
    pub fn timeout_duration(&self) -> Duration {
        self.timeout
    }

    /// Counts a check only once `replicas` replicas of its node have its writes: the script call
    /// is followed by `WAIT <replicas> <half the timeout>` on the same connection, in the same
    /// round trip. An admission that too few replicas acknowledge is a
    /// [`StoreError::NotReplicated`], answered by the policy's
    /// [`OnStoreError`](crate::OnStoreError) (fail closed: 503); a refusal stands as it is.
    ///
    /// Replication is asynchronous, so without this the admissions of the last moments before a
    /// primary dies can be lost and admitted again on the promoted replica. With it and a
    /// fail-closed policy, no admission a client saw is lost in a failover. Each check then waits
    /// for a replica's acknowledgement, and `WAIT` holds the shared connection while it waits:
    /// see the README for what it costs. `0` turns it off (the default).
    pub fn wait_for_replicas(mut self, replicas: u32) -> Self {
        self.wait_for_replicas = (replicas > 0).then_some(replicas);
        self
    }
}

impl RedisStore {
    /// How the store's checks were batched so far (shared by its clones): see the README's
    /// "Performance" section for what group commit is. On a cluster every check is a call of its
    /// own.
    pub fn batch_stats(&self) -> BatchStats {
        self.shared.batcher.stats()
    }

    /// `request` packed, with this store's timeout and replication.
    fn member(&self, request: &CheckRequest<'_>) -> Member {
        Member {
            check: PackedCheck::new(request, self.shared.generic_only.load(Ordering::Relaxed)),
            replicas: self.wait_for_replicas,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
        }
    }

    /// Makes every script call of this store (and its clones) check at `unix_us` instead of
    /// Redis's time, or at Redis's time again with `None`. For tests that compare decisions
    /// exactly; never in production.
    #[doc(hidden)]
    pub fn fix_time_for_tests(&self, unix_us: Option<u64>) {
        self.shared
            .fixed_time_us
            .store(unix_us.unwrap_or(0), Ordering::Relaxed);
    }

    /// Makes the store's checks skip the script's lean functions of the common case
    /// (`lua/fast.lua`), for tests that compare them with the generic ones.
    #[doc(hidden)]
    pub fn generic_checks_for_tests(&self, generic: bool) {
        self.shared.generic_only.store(generic, Ordering::Relaxed);
    }

    /// Sends `requests` as one batch, in order, bypassing the queue: for tests that compare a
    /// batch with the same checks one at a time.
    #[doc(hidden)]
    pub async fn check_batch_for_tests(
        &self,
        requests: &[CheckRequest<'_>],
    ) -> Vec<Result<Decision, StoreError>> {
        let members: Vec<Member> = requests
            .iter()
            .map(|request| self.member(request))
            .collect();
        let deadline = Instant::now() + self.timeout;
        self.shared.call(&members, deadline).await
    }
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

impl Target {
    /// The store's own client for this target.
    #[cfg_attr(not(feature = "tls"), allow(unused_variables))]
    fn connector(&self, tls: Option<&TlsSettings>) -> Result<Connector, StoreError> {
        let invalid = |error: RedisError| StoreError::Config(error.to_string());
        Ok(match self {
            Target::Node(url) => {
                #[cfg(feature = "tls")]
                if let Some(tls) = tls {
                    return Ok(Connector::Node(tls.node_client(url).map_err(invalid)?));
                }
                Connector::Node(::redis::Client::open(url.as_str()).map_err(invalid)?)
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(StoreError::Config(
                        "a cluster needs at least one node URL".into(),
                    ));
                }
                let router = cluster::ClusterRouter::new(
                    urls,
                    #[cfg(feature = "tls")]
                    tls.cloned(),
                )
                .map_err(invalid)?;
                Connector::Cluster(Arc::new(router))
            }
            #[cfg(feature = "sentinel")]
            Target::Sentinel { master, urls } => {
                if urls.is_empty() {
                    return Err(StoreError::Config(
                        "Sentinel needs at least one sentinel URL".into(),
                    ));
                }
                let infos = urls
                    .iter()
                    .map(|url| ::redis::IntoConnectionInfo::into_connection_info(url.as_str()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(invalid)?;
                let tls_mode = match infos[0].addr() {
                    ::redis::ConnectionAddr::TcpTls { insecure: true, .. } => {
                        Some(::redis::TlsMode::Insecure)
                    }
                    ::redis::ConnectionAddr::TcpTls { .. } => Some(::redis::TlsMode::Secure),
                    _ => None,
                };
                let mut builder = ::redis::sentinel::SentinelClientBuilder::new(
                    infos.iter().map(|info| info.addr().clone()),
                    master,
                    ::redis::sentinel::SentinelServerType::Master,
                )
                .map_err(invalid)?;
                if let Some(mode) = tls_mode {
                    builder = builder.set_client_to_redis_tls_mode(mode);
                }
                #[cfg(feature = "tls")]
                if let Some(tls) = tls {
                    builder = tls.sentinel_builder(builder);
                }
                Connector::Sentinel(tokio::sync::Mutex::new(builder.build().map_err(invalid)?))
            }
        })
    }
}

#[cfg(feature = "tls")]
type TlsSettings = TlsOptions;
#[cfg(not(feature = "tls"))]
type TlsSettings = ();

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
        self.check(&request.giving_back(charged))
    }

    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
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
        let member = self.member(request);
        let shared = self.shared.clone();
        if shared.connector.is_cluster() {
            // A batch would need all its keys in one slot: a cluster's checks go one per call.
            return CheckFuture::from_future(async move { shared.call_alone(&member).await });
        }
        CheckFuture::from_future(async move { shared.check_batched(member).await })
    }

    fn keys_share_one_slot(&self) -> bool {
        self.shared.connector.is_cluster()
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        // The keys a check of the same request writes, but the quota's.
        let request = CheckRequest {
            quota: None,
            ..*request
        };
        let packed = PackedCheck::new(&request, true);
        // A script rather than DEL: its first key is where a cluster router looks for the slot
        // (all of them share the identity's hash tag).
        let mut marker = String::with_capacity(request.key.len() + 16);
        command::write_reset_marker(&mut marker, &request);
        let mut command = evalsha(&RESET);
        command.arg(packed.key_count() + 1);
        for key in packed.keys() {
            command.arg(key);
        }
        command.arg(marker);
        // The notice every instance hears (src/store/redis/resets.rs), how long the marker
        // lives, and the time tests fix.
        command
            .arg(request.key)
            .arg(super::reset_marker_ms(&request));
        match self.shared.fixed_time() {
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
        // The leases key is the last of a check with a concurrency limit and nothing after it.
        let request = CheckRequest {
            quota: None,
            block_for: None,
            ..*request
        };
        let packed = PackedCheck::new(&request, true);
        let (Some(leases), true) = (packed.keys().last(), request.concurrency.is_some()) else {
            return Box::pin(std::future::ready(Err(StoreError::Config(
                "a release needs the request's concurrency limit".into(),
            ))));
        };
        // A script, like reset: a cluster router finds the slot from its first key.
        let mut command = evalsha(&RELEASE);
        command.arg(1).arg(leases).arg(lease);
        self.run_action(command, &RELEASE)
    }
}

/// A small script of `lua/` for one store action, sent as `EVALSHA` of its hash; its text goes to
/// a node only when the node lacks it (`NOSCRIPT`), not at every call.
struct ActionScript {
    lua: &'static str,
    hash: std::sync::LazyLock<String>,
}

macro_rules! action_script {
    ($file:literal) => {
        ActionScript {
            lua: include_str!(concat!("../../../lua/", $file)),
            hash: std::sync::LazyLock::new(|| {
                Script::new(include_str!(concat!("../../../lua/", $file)))
                    .get_hash()
                    .to_owned()
            }),
        }
    };
}

/// Deletes an identity's keys (`lua/reset.lua`).
static RESET: ActionScript = action_script!("reset.lua");
/// Pauses a key until a time in Redis's clock (`lua/pause.lua`).
static PAUSE: ActionScript = action_script!("pause.lua");
/// Reads the time a pause has left (`lua/pause_left.lua`), before each outbound call that waited
/// for its slot is sent.
static PAUSE_LEFT: ActionScript = action_script!("pause_left.lua");
/// Releases a concurrency lease (`lua/release.lua`).
static RELEASE: ActionScript = action_script!("release.lua");

/// `EVALSHA <hash of script>`, for the keys and arguments to follow.
fn evalsha(script: &ActionScript) -> Cmd {
    let mut command = ::redis::cmd("EVALSHA");
    command.arg(script.hash.as_str());
    command
}

/// The block key of `request`: the last key of a check of it with a block (see `lua/head.lua`),
/// where a penalty block and a pause are kept.
fn block_key(request: &CheckRequest<'_>) -> Result<Vec<u8>, StoreError> {
    let request = CheckRequest {
        quota: None,
        block_for: Some(Duration::from_millis(1)),
        ..*request
    };
    PackedCheck::new(&request, true)
        .keys()
        .last()
        .map(<[u8]>::to_vec)
        .ok_or_else(|| StoreError::Protocol("a check with a block has no block key".into()))
}

impl RedisStore {
    /// Runs `evalsha`, the `EVALSHA` of `script`, on the store's connection; when Redis lacks
    /// the script (a restart, `SCRIPT FLUSH`, a new cluster node), sends its text with `EVAL`,
    /// which also caches it there. Its reply.
    fn run_script(
        &self,
        evalsha: Cmd,
        script: &'static ActionScript,
    ) -> impl Future<Output = Result<Value, StoreError>> + Send + 'static {
        let body = script.lua;
        let (shared, timeout) = (self.shared.clone(), self.timeout);
        async move {
            let mut connection = match shared.cached() {
                Some(connection) => connection,
                None => shared.connection(timeout).await?,
            };
            let reply = match shared.send(&mut connection, &evalsha, None, timeout).await {
                Err(error) if is_no_script(&error) => {
                    let eval = eval_of(body, &evalsha);
                    shared.send(&mut connection, &eval, None, timeout).await
                }
                reply => reply,
            };
            reply
                .map(|(value, _)| value)
                .map_err(|error| store_error(error, timeout))
        }
    }

    /// Runs a store action (reset, pause, release): [`RedisStore::run_script`], its reply
    /// dropped.
    fn run_action(&self, evalsha: Cmd, script: &'static ActionScript) -> ActionFuture {
        let reply = self.run_script(evalsha, script);
        Box::pin(async move { reply.await.map(drop) })
    }
}

impl Shared {
    fn fixed_time(&self) -> Option<u64> {
        Some(self.fixed_time_us.load(Ordering::Relaxed)).filter(|&time| time > 0)
    }

    /// Sends `member` as a script call of its own.
    async fn call_alone(&self, member: &Member) -> Result<Decision, StoreError> {
        let mut decisions = self
            .call(std::slice::from_ref(member), member.deadline)
            .await;
        decisions.pop().unwrap_or_else(|| {
            Err(StoreError::Protocol(
                "a call of one check answered nothing".into(),
            ))
        })
    }

    /// Sends `members` as one script call, giving up at `deadline`, and returns their
    /// decisions, in order.
    async fn call(
        &self,
        members: &[Member],
        deadline: Instant,
    ) -> Vec<Result<Decision, StoreError>> {
        self.batcher.record(members.len());
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let replicas = members.iter().filter_map(|member| member.replicas).max();
        let command = batch_command(
            self.invocation(),
            members.iter().map(|member| &member.check),
            self.fixed_time(),
        );
        let replies =
            self.evaluate(&command, replicas, timeout)
                .await
                .and_then(|(reply, acknowledged)| match reply {
                    Value::BulkString(packed) => {
                        let shorts = members.iter().map(|member| 2 * member.check.limits.len());
                        Ok((reply::read_batch_reply(&packed, shorts)?, acknowledged))
                    }
                    other => Err(StoreError::Protocol(format!(
                        "unexpected batch reply {other:?}"
                    ))),
                });
        let (read, acknowledged) = match replies {
            Ok(replies) => replies,
            Err(error) => return each_gets(error, members),
        };
        let limits = members.iter().map(|member| &member.check.limits[..]);
        read.into_decisions(limits)
            .zip(members)
            .map(|(decision, member)| {
                let decision = decision?;
                // Only an admission must survive a failover: a refusal recorded nothing to lose
                // (but a penalty block, which a lost write only shortens).
                if let (Some(wanted), Some(acknowledged)) = (member.replicas, acknowledged)
                    && acknowledged < i64::from(wanted)
                    && decision.allowed
                {
                    return Err(StoreError::NotReplicated {
                        wanted,
                        acknowledged: u32::try_from(acknowledged).unwrap_or(0),
                    });
                }
                Ok(decision)
            })
            .collect()
    }

    /// Runs a batch's `FCALL` or `EVALSHA` (and its `WAIT`) and returns the reply and the
    /// replicas' acknowledgements, all within `timeout`.
    ///
    /// The common case, a connection at hand and the library (or script) loaded in Redis, is one
    /// send bounded by the connection's own response timeout, so a call arms one timer.
    /// Connecting and loading the library or sending the script itself are rare: they run boxed,
    /// under a deadline for the whole call.
    async fn evaluate(
        &self,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let started = Instant::now();
        let missing = match self.cached() {
            Some(mut connection) => {
                match self.send(&mut connection, command, replicas, timeout).await {
                    Ok(reply) => return Ok(reply),
                    Err(error) => match self.lacking(&error) {
                        Some(missing) => missing,
                        None => return Err(store_error(error, timeout)),
                    },
                }
            }
            None => Missing::Connection,
        };
        let slow = self.connect_and_send(missing, command, replicas, timeout);
        match tokio::time::timeout_at(started + timeout, Box::pin(slow)).await {
            Ok(reply) => reply,
            Err(_elapsed) => {
                // A connection that stopped answering without an error (a silently dropped
                // TCP connection) would time out forever: the next request takes a new one.
                self.forget_connection_after_timeout();
                Err(StoreError::Timeout(timeout))
            }
        }
    }

    /// The rare path: takes a connection (a new one if needed) and sends `command`; when Redis
    /// lacks the library (a new server, `FUNCTION FLUSH`) it loads it and sends `command` again;
    /// when it lacks the script (NOSCRIPT: a restart, `SCRIPT FLUSH`, a promoted replica, a new
    /// cluster node) it sends the script itself with `EVAL`, which also caches it on that node;
    /// when it has no functions (before 7.0, or an ACL that forbids them) the store turns to
    /// the script for good.
    async fn connect_and_send(
        &self,
        mut missing: Missing,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let mut connection = self.connection(timeout).await?;
        if let Missing::Connection = missing {
            match self.send(&mut connection, command, replicas, timeout).await {
                Err(error) => match self.lacking(&error) {
                    Some(lacking) => missing = lacking,
                    None => return Err(store_error(error, timeout)),
                },
                reply => return reply.map_err(|error| store_error(error, timeout)),
            }
        }
        if let Missing::Function = missing {
            let mut load = ::redis::cmd("FUNCTION");
            load.arg("LOAD").arg("REPLACE").arg(&LIBRARY.code);
            match self.send(&mut connection, &load, None, timeout).await {
                Ok(_) => {
                    return self
                        .send(&mut connection, command, replicas, timeout)
                        .await
                        .map_err(|error| store_error(error, timeout));
                }
                // Redis answered: it won't take the library, so the script it is.
                Err(error) if matches!(error.kind(), ErrorKind::Server(_)) => {
                    tracing::warn!(%error, "Redis refused the rate limiter's function library; using its script");
                    missing = Missing::Functions;
                }
                Err(error) => return Err(store_error(error, timeout)),
            }
        }
        if let Missing::Functions = missing {
            self.functions.store(false, Ordering::Relaxed);
        }
        let eval = eval_of(SCRIPT, command);
        self.send(&mut connection, &eval, replicas, timeout)
            .await
            .map_err(|error| store_error(error, timeout))
    }

    /// What a failed call shows Redis to lack, if anything: the script, the library, or functions
    /// altogether.
    fn lacking(&self, error: &RedisError) -> Option<Missing> {
        if is_no_script(error) {
            return Some(Missing::Script);
        }
        if !self.functions.load(Ordering::Relaxed) {
            return None;
        }
        let detail = error.detail().unwrap_or_default();
        match error.kind() {
            ErrorKind::Server(ServerErrorKind::ResponseError)
                if detail.starts_with("Function not found") =>
            {
                Some(Missing::Function)
            }
            ErrorKind::Server(ServerErrorKind::ResponseError)
                if detail.starts_with("unknown command") =>
            {
                Some(Missing::Functions)
            }
            ErrorKind::Server(ServerErrorKind::NoPerm) => Some(Missing::Functions),
            _ => None,
        }
    }

    /// How a batch calls the store's Lua: `FCALL` of the library's function, or `EVALSHA` of the
    /// script.
    fn invocation(&self) -> (&'static str, &str) {
        if self.functions.load(Ordering::Relaxed) {
            ("FCALL", &LIBRARY.name)
        } else {
            ("EVALSHA", self.script.get_hash())
        }
    }

    /// Sends `command`; a connection that the failure shows to be broken is dropped so the next
    /// request takes a new one.
    async fn send(
        &self,
        connection: &mut Connection,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), RedisError> {
        let reply = connection.send(command, replicas, timeout).await;
        if let Err(error) = &reply
            && connection.is_broken_by(error)
        {
            self.forget_connection();
        }
        reply
    }

    /// The shared connection, or a new one. A new one is used only once `INFO server` shows a
    /// Redis the store runs on (one round trip per connection); a server too old is logged at
    /// ERROR once and refused, without connecting again, for [`RECHECK_OLD_SERVER_AFTER`].
    async fn connection(&self, timeout: Duration) -> Result<Connection, StoreError> {
        let _only_one = self.reconnecting.lock().await;
        // Another request may have connected while this one waited for the lock.
        if let Some(connection) = self.cached() {
            return Ok(connection);
        }
        if let Some((at, version)) = self.lock_server().refused
            && at.elapsed() < RECHECK_OLD_SERVER_AFTER
        {
            return Err(server::too_old(version));
        }
        let mut connection = self.connector.connect().await?;
        let version = match self.server_info(&mut connection, timeout).await {
            Ok(found) => found.version,
            // Redis answered, but not with its version (an ACL without INFO, a renamed command):
            // the store goes on, and an old server's scripts would fail as faults.
            Err(InfoError::Refused(error)) => {
                tracing::debug!(%error, "Redis won't tell its version; the store can't check it");
                MINIMUM_VERSION
            }
            Err(InfoError::Store(error)) => return Err(error),
        };
        if let Err(error) = server::supported(version) {
            let mut check = self.lock_server();
            check.refused = Some((Instant::now(), version));
            if check.logged != Some(version) {
                check.logged = Some(version);
                tracing::error!(%error, "the rate limiter can't use this Redis: every check fails as its policy says until it is upgraded");
            }
            return Err(error);
        }
        self.lock_server().refused = None;
        *self.lock_connection() = Some(connection.clone());
        Ok(connection)
    }

    /// The version and mode `INFO server` names on `connection`.
    async fn server_info(
        &self,
        connection: &mut Connection,
        timeout: Duration,
    ) -> Result<server::Found, InfoError> {
        let reply = connection
            .query(&::redis::cmd("INFO").arg("server").clone(), timeout)
            .await
            .map_err(|error| match error.kind() {
                ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::ResponseError) => {
                    InfoError::Refused(store_error(error, timeout))
                }
                _ => InfoError::Store(store_error(error, timeout)),
            })?;
        let mut found = server::parse_info_reply(reply).map_err(InfoError::Refused)?;
        if self.connector.is_sentinel() {
            found.mode = ServerMode::SentinelManaged;
        }
        Ok(found)
    }

    fn lock_server(&self) -> std::sync::MutexGuard<'_, ServerCheck> {
        self.server.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cached(&self) -> Option<Connection> {
        self.lock_connection().clone()
    }

    fn forget_connection(&self) {
        *self.lock_connection() = None;
    }

    fn forget_connection_after_timeout(&self) {
        let mut connection = self.lock_connection();
        if connection
            .as_ref()
            .is_none_or(Connection::replace_after_timeout)
        {
            *connection = None;
        }
    }

    fn lock_connection(&self) -> std::sync::MutexGuard<'_, Option<Connection>> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the fast path lacked.
enum Missing {
    /// No connection yet, or the last one failed.
    Connection,
    /// Redis answered NOSCRIPT.
    Script,
    /// Redis has functions but not the store's library.
    Function,
    /// Redis has no functions (before 7.0) or won't let the store use them.
    Functions,
}

/// `error` as the error of each of `members`: a timeout names each one's own store timeout.
fn each_gets(error: StoreError, members: &[Member]) -> Vec<Result<Decision, StoreError>> {
    let each =
        |error: &dyn Fn(&Member) -> StoreError| members.iter().map(|m| Err(error(m))).collect();
    match error {
        StoreError::Unavailable(source) => {
            let source: Arc<dyn std::error::Error + Send + Sync> = Arc::from(source);
            each(&|_| StoreError::Unavailable(Box::new(SharedError(source.clone()))))
        }
        StoreError::Timeout(_) => each(&|member| StoreError::Timeout(member.timeout)),
        StoreError::Protocol(message) => each(&|_| StoreError::Protocol(message.clone())),
        StoreError::Script(message) => each(&|_| StoreError::Script(message.clone())),
        StoreError::WrongType(message) => each(&|_| StoreError::WrongType(message.clone())),
        StoreError::OutOfMemory(message) => each(&|_| StoreError::OutOfMemory(message.clone())),
        StoreError::Config(message) => each(&|_| StoreError::Config(message.clone())),
        StoreError::NotReplicated {
            wanted,
            acknowledged,
        } => each(&|_| StoreError::NotReplicated {
            wanted,
            acknowledged,
        }),
        StoreError::UnsupportedVersion { found, minimum } => {
            each(&|_| StoreError::UnsupportedVersion {
                found: found.clone(),
                minimum,
            })
        }
    }
}

/// One error that several checks of a batch report.
#[derive(Debug)]
struct SharedError(Arc<dyn std::error::Error + Send + Sync>);

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
