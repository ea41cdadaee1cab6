//! The Redis a bench talks to: a private `redis-server` it starts on a free loopback port (killed
//! when dropped), or the shared one of `REDIS_URL`. Shared by the benches with `#[path]`.

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};

/// The Redis the bench talks to: a private server it started (killed on drop), or `REDIS_URL`.
pub struct Server {
    child: Option<Child>,
    /// Where it answers.
    pub url: String,
}

impl Server {
    /// Starts `redis-server` on a free loopback port; `None` when it can't be started.
    pub fn private() -> Option<Server> {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|listener| listener.local_addr())
            .ok()?
            .port();
        let mut command = Command::new(server_binary());
        command
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"]);
        // Redis 7 refuses DEBUG unless allowed; 6.2 knows no such option (and allows it).
        if redis_server_major()? >= 7 {
            command.args(["--enable-debug-command", "local"]);
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        Some(Server {
            child: Some(child),
            url: format!("redis://127.0.0.1:{port}/0"),
        })
    }

    /// `REDIS_URL`, shared with others.
    pub fn shared() -> Option<Server> {
        let url = std::env::var("REDIS_URL").ok()?;
        Some(Server { child: None, url })
    }

    /// Whether the bench started it (and may flush it, or read its CPU time).
    pub fn is_private(&self) -> bool {
        self.pid().is_some()
    }

    /// The private server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `redis-server` to start: `REDIS_SERVER` when set (as for the tests), else the one on the
/// `PATH`.
pub fn server_binary() -> String {
    std::env::var("REDIS_SERVER")
        .ok()
        .filter(|path| !path.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// The major version of [`server_binary`] (`Redis server v=7.0.15 …`).
fn redis_server_major() -> Option<u32> {
    let output = Command::new(server_binary())
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text
        .split_whitespace()
        .find_map(|word| word.strip_prefix("v="))?;
    version.split('.').next()?.parse().ok()
}
