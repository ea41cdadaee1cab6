//! The store's own Redis Cluster client: a slot table and one multiplexed connection per primary,
//! so a check goes straight from the request to the connection of its slot's node.
//!
//! redis-rs's `ClusterConnection` (still used over a user's cluster pool) sends each command
//! through a channel to a routing task, which sends it through another channel to the node
//! connection's task: measured on the load run, that costs about 30 % more client CPU per check
//! than one node. Here the routing is a slot lookup under a read lock, on the caller's task.
//!
//! The table mends itself the way cluster clients do: `MOVED` points a slot at its new node and
//! triggers a refresh (`CLUSTER SLOTS`) in the background; `ASK` sends `ASKING` and the call to
//! the importing node in one pipeline; `TRYAGAIN` (keys of a slot split by a migration) retries
//! shortly; a node that stops answering loses its connection and triggers a refresh, so after a
//! failover the next requests find the promoted replica. Every retry stays within the check's
//! timeout.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError,
    RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;

#[cfg(feature = "tls")]
use super::tls::TlsOptions;
use super::wire::call;

/// Slots of a Redis Cluster.
const SLOTS: usize = 16_384;
/// A slot whose node is not known yet.
const UNKNOWN: u16 = u16::MAX;
/// Redirections and retries one check may take before its error stands.
const MAX_ATTEMPTS: usize = 8;
/// How long to wait before retrying after `TRYAGAIN` (a migration in progress).
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(10);
/// Background refreshes are at least this far apart (a dead node fails every request until the
/// cluster promotes its replica; one refresh per failure would flood the healthy nodes).
const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// A cluster client of the store's own; shared by every request (behind an `Arc`).
pub(super) struct ClusterRouter {
    /// The URLs' connection settings: where discovery starts, and the scheme, credentials and
    /// protocol of every node's connection.
    seeds: Vec<ConnectionInfo>,
    #[cfg(feature = "tls")]
    tls: Option<TlsOptions>,
    routes: RwLock<Routes>,
    /// One connect at a time, so a burst of requests to an unconnected node connects once.
    connecting: tokio::sync::Mutex<()>,
    /// One refresh at a time; holds when the last one finished.
    refreshing: tokio::sync::Mutex<Option<Instant>>,
    /// A background refresh is queued or running.
    refresh_queued: AtomicBool,
    /// Tells a node's connections apart, so a failed one is dropped, not its replacement.
    next_generation: AtomicU64,
}

/// The slot table and the nodes it points at.
struct Routes {
    /// The index in `nodes` of each slot's primary, or [`UNKNOWN`].
    slots: Box<[u16]>,
    nodes: Vec<Node>,
}

struct Node {
    host: String,
    port: u16,
    /// The connection to it and its generation, once connected.
    connection: Option<(u64, MultiplexedConnection)>,
}

impl Routes {
    fn empty() -> Self {
        Routes {
            slots: vec![UNKNOWN; SLOTS].into_boxed_slice(),
            nodes: Vec::new(),
        }
    }

    /// The index of the node at `host:port`, added if new.
    fn node_index(&mut self, host: &str, port: u16) -> usize {
        if let Some(index) = self.position(host, port) {
            return index;
        }
        self.nodes.push(Node {
            host: host.to_owned(),
            port,
            connection: None,
        });
        self.nodes.len() - 1
    }

    fn position(&self, host: &str, port: u16) -> Option<usize> {
        self.nodes
            .iter()
            .position(|node| node.port == port && node.host == host)
    }
}

impl ClusterRouter {
    /// A router for the cluster behind `urls`. Nothing connects yet.
    pub(super) fn new(
        urls: &[String],
        #[cfg(feature = "tls")] tls: Option<TlsOptions>,
    ) -> RedisResult<Self> {
        let seeds = urls
            .iter()
            .map(|url| url.as_str().into_connection_info())
            .collect::<RedisResult<Vec<_>>>()?;
        let router = ClusterRouter {
            seeds,
            #[cfg(feature = "tls")]
            tls,
            routes: RwLock::new(Routes::empty()),
            connecting: tokio::sync::Mutex::new(()),
            refreshing: tokio::sync::Mutex::new(None),
            refresh_queued: AtomicBool::new(false),
            next_generation: AtomicU64::new(0),
        };
        // Checks the settings (a CA that doesn't parse, say) now rather than at the first request.
        for seed in &router.seeds {
            router.client(seed.clone())?;
        }
        Ok(router)
    }

    /// Sends `script` (and `WAIT`, with `replicas`) to the primary of its first key's slot, within
    /// `timeout`, following redirections.
    pub(super) async fn send(
        self: &Arc<Self>,
        script: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> RedisResult<(Value, Option<i64>)> {
        let deadline = Instant::now() + timeout;
        let slot = slot_of(script)?;
        // The common case: the slot's node is known and connected, and answers.
        let first_error = match self.connection_of_slot(slot) {
            Some((node, generation, mut connection)) => {
                match call(&mut connection, script, replicas, false, timeout).await {
                    Ok(reply) => return Ok(reply),
                    Err(error) if redirection(&error).is_some() => Some(error),
                    Err(error) => {
                        self.failed(node, generation, &error);
                        return Err(error);
                    }
                }
            }
            None => None,
        };
        let slow = self.send_slowly(slot, script, replicas, deadline, first_error);
        match tokio::time::timeout_at(deadline, Box::pin(slow)).await {
            Ok(reply) => reply,
            Err(_elapsed) => Err(timed_out()),
        }
    }

    /// The rare path: follows the fast path's `MOVED`, `ASK` or `TRYAGAIN` (`error`), or finds
    /// and connects the slot's node when none was at hand (`None`), and retries.
    async fn send_slowly(
        self: &Arc<Self>,
        slot: u16,
        script: &Cmd,
        replicas: Option<u32>,
        deadline: Instant,
        mut error: Option<RedisError>,
    ) -> RedisResult<(Value, Option<i64>)> {
        for _ in 0..MAX_ATTEMPTS {
            let mut asking = None;
            match error.take().map(|error| (redirection(&error), error)) {
                None => {}
                Some((Some(Redirection::Moved { slot, host, port }), _)) => {
                    self.point(slot, &host, port);
                    self.refresh_soon();
                }
                Some((Some(Redirection::Ask { host, port }), _)) => asking = Some((host, port)),
                Some((Some(Redirection::TryAgain), _)) => {
                    tokio::time::sleep(TRY_AGAIN_AFTER).await;
                }
                Some((None, error)) => return Err(error),
            }
            let (host, port) = match asking.clone() {
                Some(target) => target,
                None => self.primary_or_discover(slot).await?,
            };
            let (node, generation, mut connection) =
                self.connect(&host, port).await.inspect_err(|_| {
                    // A node that can't be reached may have failed over.
                    self.refresh_soon();
                })?;
            let remaining = deadline.saturating_duration_since(Instant::now());
            match call(
                &mut connection,
                script,
                replicas,
                asking.is_some(),
                remaining,
            )
            .await
            {
                Ok(reply) => return Ok(reply),
                Err(next) if redirection(&next).is_some() => error = Some(next),
                Err(next) => {
                    self.failed(node, generation, &next);
                    return Err(next);
                }
            }
        }
        Err(error.unwrap_or_else(|| {
            RedisError::from((ErrorKind::Client, "Redis Cluster redirected too often"))
        }))
    }

    /// The primary of `slot`, reading the table first if no node is known for it.
    async fn primary_or_discover(&self, slot: u16) -> RedisResult<(String, u16)> {
        if let Some(primary) = self.primary_of(slot) {
            return Ok(primary);
        }
        self.discover(slot).await?;
        self.primary_of(slot).ok_or_else(|| {
            RedisError::from((
                ErrorKind::Server(ServerErrorKind::ClusterDown),
                "no node of the Redis Cluster serves the slot",
                slot.to_string(),
            ))
        })
    }

    /// The known connection to `slot`'s primary.
    fn connection_of_slot(&self, slot: u16) -> Option<(usize, u64, MultiplexedConnection)> {
        let routes = self.read();
        let node = usize::from(*routes.slots.get(usize::from(slot))?);
        let (generation, connection) = routes.nodes.get(node)?.connection.as_ref()?;
        Some((node, *generation, connection.clone()))
    }

    fn primary_of(&self, slot: u16) -> Option<(String, u16)> {
        let routes = self.read();
        let node = routes
            .nodes
            .get(usize::from(routes.slots[usize::from(slot)]))?;
        Some((node.host.clone(), node.port))
    }

    /// The connection to `host:port`, made if there is none.
    async fn connect(
        &self,
        host: &str,
        port: u16,
    ) -> RedisResult<(usize, u64, MultiplexedConnection)> {
        let _one_at_a_time = self.connecting.lock().await;
        {
            let mut routes = self.write();
            let node = routes.node_index(host, port);
            if let Some((generation, connection)) = &routes.nodes[node].connection {
                return Ok((node, *generation, connection.clone()));
            }
        }
        let connection = self
            .client(self.node_info(host, port))?
            .get_multiplexed_async_connection()
            .await?;
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let mut routes = self.write();
        let node = routes.node_index(host, port);
        routes.nodes[node].connection = Some((generation, connection.clone()));
        Ok((node, generation, connection))
    }

    /// A failed call: a connection that the error shows broken is dropped (the next request makes
    /// a new one), and the table is refreshed, since the node may have failed over.
    fn failed(self: &Arc<Self>, node: usize, generation: u64, error: &RedisError) {
        let broken = self.drop_if_broken(node, generation, error);
        if broken || error.kind() == ErrorKind::Server(ServerErrorKind::ClusterDown) {
            self.refresh_soon();
        }
    }

    /// `MOVED`: the slot is served by `host:port` now.
    fn point(&self, slot: u16, host: &str, port: u16) {
        let mut routes = self.write();
        let node = routes.node_index(host, port);
        routes.slots[usize::from(slot)] = u16::try_from(node).unwrap_or(UNKNOWN);
    }

    /// Reads the table before a first request to `slot` (or a slot no node served last time),
    /// unless another request just did.
    async fn discover(&self, slot: u16) -> RedisResult<()> {
        let mut last = self.refreshing.lock().await;
        if self.primary_of(slot).is_some() {
            return Ok(());
        }
        let refreshed = self.refresh().await;
        *last = Some(Instant::now());
        refreshed
    }

    /// Queues a refresh of the table in the background (at most one queued, at most one per
    /// [`REFRESH_INTERVAL`]); requests go on with the table they have.
    fn refresh_soon(self: &Arc<Self>) {
        if self.refresh_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let router = Arc::clone(self);
        tokio::spawn(async move {
            let mut last = router.refreshing.lock().await;
            if let Some(at) = *last {
                tokio::time::sleep_until(at + REFRESH_INTERVAL).await;
            }
            // Failures that happen from here on queue the next refresh.
            router.refresh_queued.store(false, Ordering::Release);
            if let Err(error) = router.refresh().await {
                tracing::debug!(%error, "Redis Cluster slot refresh failed");
            }
            *last = Some(Instant::now());
        });
    }

    /// Sends `command`, which names no key, to the first node that answers (known nodes first,
    /// then the URLs given), within `timeout`.
    pub(super) async fn query_any(&self, command: &Cmd, timeout: Duration) -> RedisResult<Value> {
        let asked = async {
            let mut last_error =
                RedisError::from((ErrorKind::Client, "no Redis Cluster node to ask"));
            for (host, port) in self.candidates() {
                let reply = match self.connect(&host, port).await {
                    Ok((node, generation, mut connection)) => {
                        let reply = call(&mut connection, command, None, false, timeout).await;
                        if let Err(error) = &reply {
                            self.drop_if_broken(node, generation, error);
                        }
                        reply.map(|(reply, _)| reply)
                    }
                    Err(error) => Err(error),
                };
                match reply {
                    Ok(reply) => return Ok(reply),
                    Err(error) => last_error = error,
                }
            }
            Err(last_error)
        };
        tokio::time::timeout(timeout, asked)
            .await
            .unwrap_or_else(|_| Err(timed_out()))
    }

    /// The nodes to ask what any node can answer: connected ones first (asking them costs no
    /// connect), then the other known ones, then the URLs given.
    fn candidates(&self) -> Vec<(String, u16)> {
        let mut candidates: Vec<(String, u16)> = {
            let routes = self.read();
            let mut nodes: Vec<&Node> = routes.nodes.iter().collect();
            // Connected nodes first: asking them costs no connect.
            nodes.sort_by_key(|node| node.connection.is_none());
            nodes
                .into_iter()
                .map(|node| (node.host.clone(), node.port))
                .collect()
        };
        for seed in &self.seeds {
            if let Some(address) = host_and_port(seed.addr())
                && !candidates.contains(&address)
            {
                candidates.push(address);
            }
        }
        candidates
    }

    /// Reads `CLUSTER SLOTS` from the first node that answers (see [`ClusterRouter::candidates`])
    /// and replaces the table, keeping the connections of nodes still in it.
    async fn refresh(&self) -> RedisResult<()> {
        let candidates = self.candidates();
        let mut last_error = RedisError::from((
            ErrorKind::Client,
            "no Redis Cluster node to ask for its slots",
        ));
        for (host, port) in candidates {
            let slots = match self.connect(&host, port).await {
                Ok((node, generation, mut connection)) => {
                    let reply = ::redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query_async::<Value>(&mut connection)
                        .await;
                    if let Err(error) = &reply {
                        self.drop_if_broken(node, generation, error);
                    }
                    reply.and_then(|reply| parse_slots(&reply, &host))
                }
                Err(error) => Err(error),
            };
            match slots {
                Ok(slots) => {
                    self.replace(slots);
                    return Ok(());
                }
                Err(error) => last_error = error,
            }
        }
        Err(last_error)
    }

    /// Drops the node's connection (that generation of it) when `error` shows it broken; says
    /// whether it did.
    fn drop_if_broken(&self, node: usize, generation: u64, error: &RedisError) -> bool {
        let broken = error.is_io_error()
            || error.is_timeout()
            || error.is_connection_dropped()
            || error.is_connection_refusal()
            || error.is_unrecoverable_error();
        if broken {
            let mut routes = self.write();
            if let Some(node) = routes.nodes.get_mut(node)
                && node.connection.as_ref().map(|(g, _)| *g) == Some(generation)
            {
                node.connection = None;
            }
        }
        broken
    }

    /// A new table from `CLUSTER SLOTS` ranges; nodes no range names are forgotten (with their
    /// connections), the others keep theirs.
    fn replace(&self, ranges: Vec<SlotRange>) {
        let mut routes = self.write();
        let mut next = Routes::empty();
        for range in ranges {
            let node = next.node_index(&range.host, range.port);
            if let Some(old) = routes.position(&range.host, range.port) {
                next.nodes[node].connection = routes.nodes[old].connection.take();
            }
            let node = u16::try_from(node).unwrap_or(UNKNOWN);
            for slot in range.start..=range.end.min(SLOTS as u16 - 1) {
                next.slots[usize::from(slot)] = node;
            }
        }
        *routes = next;
    }

    /// The settings of a connection to `host:port`: the first URL's, at that address.
    fn node_info(&self, host: &str, port: u16) -> ConnectionInfo {
        let seed = &self.seeds[0];
        let addr = match seed.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        seed.clone().set_addr(addr)
    }

    /// A client of the `attempt`-th seed (round robin), for the store's reset subscription:
    /// any node hears a cluster's messages (classic pub/sub is broadcast to every node).
    pub(super) fn seed_client(&self, attempt: usize) -> RedisResult<Client> {
        let seed = &self.seeds[attempt % self.seeds.len()];
        self.client(seed.clone())
    }

    fn client(&self, info: ConnectionInfo) -> RedisResult<Client> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.client(info);
        }
        Client::open(info)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Routes> {
        self.routes.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What an error answer asks the router to do.
#[derive(Debug, PartialEq)]
enum Redirection {
    Moved { slot: u16, host: String, port: u16 },
    Ask { host: String, port: u16 },
    TryAgain,
}

fn redirection(error: &RedisError) -> Option<Redirection> {
    let target = || {
        let (address, slot) = error.redirect_node()?;
        let (host, port) = address.rsplit_once(':')?;
        Some((slot, host.to_owned(), port.parse().ok()?))
    };
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => {
            let (slot, host, port) = target()?;
            Some(Redirection::Moved { slot, host, port })
        }
        ErrorKind::Server(ServerErrorKind::Ask) => {
            let (_, host, port) = target()?;
            Some(Redirection::Ask { host, port })
        }
        ErrorKind::Server(ServerErrorKind::TryAgain) => Some(Redirection::TryAgain),
        _ => None,
    }
}

fn timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no reply within the store timeout",
    ))
}

/// The slot of the command's first key (`EVALSHA <sha> <numkeys> <key> ...`, or `EVAL`).
fn slot_of(command: &Cmd) -> RedisResult<u16> {
    match command.args_iter().nth(3) {
        Some(::redis::Arg::Simple(key)) => Ok(key_slot(key)),
        _ => Err(RedisError::from((
            ErrorKind::Client,
            "a script call without a key has no slot",
        ))),
    }
}

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the first non-empty `{...}`), or of
/// the whole key, modulo 16384.
fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&byte| byte == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&byte| byte == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS as u16
}

fn host_and_port(addr: &ConnectionAddr) -> Option<(String, u16)> {
    match addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            Some((host.clone(), *port))
        }
        _ => None,
    }
}

/// One range of `CLUSTER SLOTS`: its slots and its primary.
#[derive(Debug, PartialEq)]
struct SlotRange {
    start: u16,
    end: u16,
    host: String,
    port: u16,
}

/// `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`. An empty host (or
/// `?`) means the node that answered, `asked`.
fn parse_slots(reply: &Value, asked: &str) -> RedisResult<Vec<SlotRange>> {
    let malformed = || RedisError::from((ErrorKind::Parse, "malformed CLUSTER SLOTS reply"));
    let Value::Array(ranges) = reply else {
        return Err(malformed());
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(parts) = range else {
                return Err(malformed());
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                return Err(malformed());
            };
            let host = match primary.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => return Err(malformed()),
            };
            let host = if host.is_empty() || host == "?" {
                asked.to_owned()
            } else {
                host
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return Err(malformed());
            };
            Ok(SlotRange {
                start: u16::try_from(*start).map_err(|_| malformed())?,
                end: u16::try_from(*end).map_err(|_| malformed())?,
                host,
                port: u16::try_from(*port).map_err(|_| malformed())?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_hash_tag() {
        // Each as `CLUSTER KEYSLOT` answers (Redis 7.0); 0x31C3 is CRC16/XMODEM's check value.
        assert_eq!(key_slot(b"123456789"), 0x31C3);
        for (key, slot) in [
            ("foo", 12182),
            ("foo{}{bar}", 8363),
            ("foo{{bar}}zap", 4015),
            ("{bar", 4015),
            ("{user1000}.following", 3443),
            ("user1000", 3443),
            ("rl:{ip:1.2.3.4}:a", 5271),
        ] {
            assert_eq!(key_slot(key.as_bytes()), slot, "{key}");
        }
    }

    #[test]
    fn the_first_key_of_a_script_call_names_the_slot() {
        let mut command = ::redis::cmd("EVALSHA");
        command
            .arg("sha")
            .arg(2)
            .arg("p:{u}:a")
            .arg("p:{u}:b")
            .arg(7);
        assert_eq!(slot_of(&command).unwrap(), key_slot(b"u"));
        let keyless = ::redis::cmd("EVALSHA").arg("sha").arg(0).to_owned();
        assert!(slot_of(&keyless).is_err());
    }

    #[test]
    fn cluster_slots_replies_become_ranges() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("", 7001)]),
        ]);
        assert_eq!(
            parse_slots(&reply, "10.0.0.9").unwrap(),
            [
                SlotRange {
                    start: 0,
                    end: 5460,
                    host: "10.0.0.1".into(),
                    port: 7000
                },
                SlotRange {
                    start: 5461,
                    end: 16383,
                    host: "10.0.0.9".into(),
                    port: 7001
                },
            ]
        );
        assert!(parse_slots(&Value::Int(1), "h").is_err());
        let short = Value::Array(vec![Value::Array(vec![Value::Int(0)])]);
        assert!(parse_slots(&short, "h").is_err());
    }

    #[test]
    fn redirections_are_read_from_error_answers() {
        let error = |text: &str| -> RedisError {
            match ::redis::parse_redis_value(format!("-{text}\r\n").as_bytes()) {
                Ok(Value::ServerError(error)) => error.into(),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(
            redirection(&error("MOVED 3999 127.0.0.1:6381")),
            Some(Redirection::Moved {
                slot: 3999,
                host: "127.0.0.1".into(),
                port: 6381
            })
        );
        assert_eq!(
            redirection(&error("ASK 3999 ::1:6381")),
            Some(Redirection::Ask {
                host: "::1".into(),
                port: 6381
            })
        );
        assert_eq!(
            redirection(&error(
                "TRYAGAIN Multiple keys request during rehashing of slot"
            )),
            Some(Redirection::TryAgain)
        );
        assert_eq!(redirection(&error("ERR unknown command")), None);
    }
}
