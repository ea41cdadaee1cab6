//! Redis topologies for the tests, started from `redis-server` on free loopback ports and stopped
//! when dropped: a Redis Cluster of primaries with one replica each, and a Sentinel-managed
//! primary with a replica and three sentinels.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One `redis-server` process of a topology.
struct Node {
    port: u16,
    child: Option<Child>,
    /// How it was started, to start it again.
    command: Vec<std::ffi::OsString>,
}

/// A set of `redis-server` processes in a directory of their own.
struct Servers {
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl Servers {
    fn new(kind: &str) -> Servers {
        Servers {
            dir: super::redis_server::fresh_dir(kind),
            nodes: Vec::new(),
        }
    }

    /// Starts one server with `args` (after a config file, if any) on a free port below 55000
    /// whose cluster bus port (+10000) is free too, and returns the port.
    fn start(&mut self, config: Option<&str>, args: &[&str]) -> u16 {
        for _ in 0..10 {
            let port = free_cluster_port();
            let mut command: Vec<std::ffi::OsString> = Vec::new();
            if let Some(config) = config {
                let path = self.dir.join(format!("{port}.conf"));
                std::fs::write(&path, config.replace("{port}", &port.to_string()))
                    .expect("a config file");
                command.push(path.into());
            }
            let port_text = port.to_string();
            let fixed = [
                "--port",
                &port_text,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--repl-diskless-sync",
                "yes",
                "--repl-diskless-sync-delay",
                "0",
            ];
            command.extend(fixed.into_iter().map(Into::into));
            command.push("--dir".into());
            command.push(self.dir.clone().into());
            command.extend(args.iter().map(Into::into));
            let mut node = Node {
                port,
                child: None,
                command,
            };
            if spawn(&mut node) {
                self.nodes.push(node);
                return port;
            }
            stop(&mut node); // the port was taken by someone else: try another
        }
        panic!("could not start a redis-server on a free port in 10 tries");
    }

    fn kill(&mut self, port: u16) {
        if let Some(node) = self.nodes.iter_mut().find(|node| node.port == port) {
            stop(node);
        }
    }

    fn restart(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of ours");
        assert!(spawn(node), "redis-server could not start again on {port}");
    }
}

/// Starts `node`'s server; `false` if what then listens on its port is not it.
fn spawn(node: &mut Node) -> bool {
    let child = Command::new(super::redis_server::server_binary())
        .args(&node.command)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "cannot start redis-server ({error}). Install it (`apt-get install \
                 redis-server`): the cluster and Sentinel tests start their own servers"
            )
        });
    let pid = child.id();
    node.child = Some(child);
    wait_listening(node) && process_id(node.port) == Some(pid)
}

impl Drop for Servers {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            stop(node);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn stop(node: &mut Node) {
    if let Some(mut child) = node.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn wait_listening(node: &mut Node) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], node.port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some(child) = &mut node.child
            && let Ok(Some(_)) = child.try_wait()
        {
            node.child = None;
            return false;
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn free_cluster_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let port = listener.local_addr().expect("its address").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A synchronous client of one node.
pub fn node_client(port: u16) -> redis::Connection {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("a URL");
    let connection = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap_or_else(|error| panic!("cannot connect to 127.0.0.1:{port}: {error}"));
    connection
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("a read timeout");
    connection
}

/// `INFO <section>` of one node as field → value; empty when the node can't be reached or
/// answered nothing, which the polls read as "not yet".
pub fn info(port: u16, section: &str) -> HashMap<String, String> {
    fields_of(port, redis::cmd("INFO").arg(section))
}

/// A command's `field:value` lines from one node. A refused connection or a reset is an empty
/// answer, not a panic: a Sentinel promoting a replica disconnects its clients
/// (`CLIENT KILL TYPE normal`), and a poll that met that reset must simply poll again.
fn fields_of(port: u16, command: &redis::Cmd) -> HashMap<String, String> {
    let text: String = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(2)))
        .and_then(|mut connection| {
            connection.set_read_timeout(Some(Duration::from_secs(5)))?;
            command.query(&mut connection)
        })
        .unwrap_or_default();
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(field, value)| (field.to_owned(), value.trim().to_owned()))
        .collect()
}

fn process_id(port: u16) -> Option<u32> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    let text: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut connection)
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}

/// Polls `ready` every 50 ms until it holds, or panics with `what` after `within`.
pub fn wait_until(what: &str, within: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Redis Cluster of `primaries` primaries with one replica each, failing over within about a
/// second of a primary's death (`cluster-node-timeout 1000`).
pub struct TestCluster {
    servers: Servers,
}

impl TestCluster {
    pub fn start(primaries: usize) -> TestCluster {
        let mut servers = Servers::new("cluster");
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "1000",
            // A replica that lost its primary a while ago may still be promoted (the tests kill
            // primaries on purpose, and a stalled machine must not make that a failed failover).
            "--cluster-replica-validity-factor",
            "0",
            "--cluster-allow-replica-migration",
            "no",
        ];
        let ports: Vec<u16> = (0..primaries * 2)
            .map(|index| {
                let config = format!("cluster-config-file nodes-{{port}}-{index}.conf\n");
                servers.start(Some(&config), &args)
            })
            .collect();
        let status = Command::new(super::redis_server::cli_binary())
            .arg("--cluster")
            .arg("create")
            .args(ports.iter().map(|port| format!("127.0.0.1:{port}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli (it comes with redis-server)");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = TestCluster { servers };
        cluster.wait_healthy();
        cluster
    }

    /// Waits until every live node sees the cluster as `ok` with every slot served, and every
    /// replica is in sync with its primary.
    pub fn wait_healthy(&self) {
        wait_until("a healthy cluster", Duration::from_secs(30), || {
            self.live_ports().iter().all(|&port| {
                let cluster = cluster_info(port);
                let replication = info(port, "replication");
                cluster.get("cluster_state").map(String::as_str) == Some("ok")
                    && cluster.get("cluster_slots_ok").map(String::as_str) == Some("16384")
                    && match replication.get("role").map(String::as_str) {
                        Some("master") => true,
                        Some("slave") => {
                            replication.get("master_link_status").map(String::as_str) == Some("up")
                        }
                        _ => false,
                    }
            })
        });
    }

    /// The URLs of every live node.
    pub fn urls(&self) -> Vec<String> {
        self.live_ports()
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    fn live_ports(&self) -> Vec<u16> {
        self.servers
            .nodes
            .iter()
            .filter(|node| node.child.is_some())
            .map(|node| node.port)
            .collect()
    }

    /// The ports of the live primaries that serve slots.
    pub fn primaries(&self) -> Vec<u16> {
        self.live_ports()
            .into_iter()
            .filter(|&port| {
                info(port, "replication").get("role").map(String::as_str) == Some("master")
            })
            .collect()
    }

    /// The port of the primary serving `slot`, as the live nodes see it.
    pub fn primary_of_slot(&self, slot: u16) -> u16 {
        let port = self.live_ports()[0];
        let slots: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut node_client(port))
            .expect("CLUSTER SLOTS");
        let redis::Value::Array(ranges) = slots else {
            panic!("CLUSTER SLOTS answered {slots:?}");
        };
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                continue;
            };
            let (redis::Value::Int(start), redis::Value::Int(end)) = (&fields[0], &fields[1])
            else {
                continue;
            };
            if (*start..=*end).contains(&i64::from(slot))
                && let redis::Value::Array(primary) = &fields[2]
                && let redis::Value::Int(port) = primary[1]
            {
                return u16::try_from(port).expect("a port");
            }
        }
        panic!("no primary serves slot {slot}");
    }

    /// The hash slot of `key` (of its hash tag).
    pub fn slot_of(&self, key: &str) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut node_client(self.live_ports()[0]))
            .expect("CLUSTER KEYSLOT")
    }

    /// The replica of the primary at `port`.
    pub fn replica_of(&self, port: u16) -> u16 {
        self.replica_of_opt(port)
            .unwrap_or_else(|| panic!("no replica follows 127.0.0.1:{port}"))
    }

    /// The replica of the primary at `port`, if it has one.
    pub fn replica_of_opt(&self, port: u16) -> Option<u16> {
        self.live_ports().into_iter().find(|&replica| {
            let replication = info(replica, "replication");
            replication.get("role").map(String::as_str) == Some("slave")
                && replication.get("master_port").map(String::as_str)
                    == Some(port.to_string().as_str())
        })
    }

    /// `per_primary` user ids (`UserId` values) for each live primary, found by their hash slots.
    pub fn users_on_every_primary(&self, per_primary: usize) -> HashMap<u16, Vec<String>> {
        let primaries = self.primaries();
        let mut users: HashMap<u16, Vec<String>> = HashMap::new();
        for n in 0.. {
            let user = format!("u{n}");
            let primary = self.primary_of_slot(self.slot_of(&format!("{{user:{user}}}")));
            let on_it = users.entry(primary).or_default();
            if on_it.len() < per_primary {
                on_it.push(user);
            }
            if primaries
                .iter()
                .all(|port| users.get(port).is_some_and(|on| on.len() == per_primary))
            {
                break;
            }
        }
        users
    }

    /// A user id (prefixed `stem`) whose slot the primary at `port` serves.
    pub fn user_on(&self, port: u16, stem: &str) -> String {
        (0..)
            .map(|n| format!("{stem}{n}"))
            .find(|user| self.primary_of_slot(self.slot_of(&format!("{{user:{user}}}"))) == port)
            .expect("some user on every primary")
    }

    /// Kills the node at `port` as a crash would (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        self.servers.kill(port);
    }

    /// Starts the killed node at `port` again: it rejoins the cluster (from its nodes file), as a
    /// replica of whichever node took its slots.
    pub fn restart(&mut self, port: u16) {
        self.servers.restart(port);
    }
}

fn cluster_info(port: u16) -> HashMap<String, String> {
    fields_of(port, redis::cmd("CLUSTER").arg("INFO"))
}

/// A primary, one replica and three sentinels watching it as `mymaster`, failing over about a
/// second after the primary dies (`down-after-milliseconds 1000`).
pub struct TestSentinel {
    servers: Servers,
    pub primary: u16,
    pub replica: u16,
    pub sentinels: Vec<u16>,
}

impl TestSentinel {
    pub const MASTER: &'static str = "mymaster";

    pub fn start() -> TestSentinel {
        let mut servers = Servers::new("sentinel");
        let primary = servers.start(None, &[]);
        let primary_text = primary.to_string();
        let replica = servers.start(None, &["--replicaof", "127.0.0.1", &primary_text]);
        let config = format!(
            "sentinel monitor {master} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {master} 1000\n\
             sentinel failover-timeout {master} 5000\n\
             sentinel parallel-syncs {master} 1\n",
            master = Self::MASTER
        );
        let sentinels = (0..3)
            .map(|_| servers.start(Some(&config), &["--sentinel"]))
            .collect();
        let sentinel = TestSentinel {
            servers,
            primary,
            replica,
            sentinels,
        };
        wait_until("the replica in sync", Duration::from_secs(30), || {
            info(replica, "replication")
                .get("master_link_status")
                .map(String::as_str)
                == Some("up")
        });
        wait_until(
            "every sentinel knows the replica and the other sentinels",
            Duration::from_secs(30),
            || {
                sentinel.sentinels.iter().all(|&port| {
                    let mut client = node_client(port);
                    let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                        .arg("REPLICAS")
                        .arg(Self::MASTER)
                        .query(&mut client)
                        .unwrap_or_default();
                    let others: Vec<redis::Value> = redis::cmd("SENTINEL")
                        .arg("SENTINELS")
                        .arg(Self::MASTER)
                        .query(&mut client)
                        .unwrap_or_default();
                    replicas.len() == 1 && others.len() == 2
                })
            },
        );
        sentinel
    }

    /// The sentinels' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// Kills the primary (SIGKILL) and waits until the sentinels have promoted the replica.
    pub fn kill_primary_and_wait_for_promotion(&mut self) {
        self.servers.kill(self.primary);
        let replica = self.replica;
        wait_until("the replica promoted", Duration::from_secs(30), || {
            info(replica, "replication").get("role").map(String::as_str) == Some("master")
        });
    }
}

/// Answers `(status, answered by the store)` of a fail-open and a fail-closed app that met a dead
/// primary: fail open always 200; fail closed 200 from the store or 503 without it, some 503
/// (the failover was felt); never 429.
pub fn assert_answered_per_policy(
    open_answers: &[(http::StatusCode, bool)],
    closed_answers: &[(http::StatusCode, bool)],
) {
    use http::StatusCode;
    assert!(
        open_answers
            .iter()
            .all(|(status, _)| *status == StatusCode::OK),
        "{open_answers:?}"
    );
    assert!(
        closed_answers.iter().all(|answer| matches!(
            answer,
            (StatusCode::OK, true) | (StatusCode::SERVICE_UNAVAILABLE, false)
        )),
        "{closed_answers:?}"
    );
    assert!(
        closed_answers
            .iter()
            .any(|(status, _)| *status == StatusCode::SERVICE_UNAVAILABLE)
    );
}
