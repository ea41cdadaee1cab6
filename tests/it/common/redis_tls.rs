//! A `redis-server` of the test's own that speaks TLS, with a CA and a server certificate the test
//! makes itself (rcgen). It also listens in plain text on another loopback port, so that the
//! test's own assertions (`INFO`, `SCAN`, `CLIENT LIST`) need no TLS client: what is under test is
//! the store's connection, which goes to the TLS port.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use super::redis_cluster::info;
use super::redis_server::free_port;

/// A TLS Redis server, stopped (and its certificate files removed) when dropped.
pub struct TlsRedis {
    /// `rediss://127.0.0.1:<tls port>/0`: what the store under test connects to.
    pub url: String,
    /// The TLS port.
    pub tls_port: u16,
    /// The CA that signed the server's certificate, in PEM.
    pub ca_pem: String,
    /// The CA's file (for `TlsOptions::ca_file`).
    pub ca_file: PathBuf,
    plain_url: String,
    dir: PathBuf,
    child: Child,
}

impl TlsRedis {
    /// Makes a CA and a certificate for `127.0.0.1` and `localhost` signed by it, then starts a
    /// server with them on two free ports (TLS and plain).
    pub fn start() -> TlsRedis {
        let dir =
            std::env::temp_dir().join(format!("trr-tls-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("a directory for the certificates");
        let (ca_pem, cert_pem, key_pem) = certificates();
        let ca_file = dir.join("ca.crt");
        std::fs::write(&ca_file, &ca_pem).unwrap();
        std::fs::write(dir.join("redis.crt"), cert_pem).unwrap();
        std::fs::write(dir.join("redis.key"), key_pem).unwrap();
        // A free port may be taken by another test's server between our probe and its bind; then
        // ours exits and we would be talking to theirs. Try other ports.
        for _ in 0..5 {
            let (tls_port, plain_port) = (free_port(), free_port());
            let mut child = spawn(&dir, tls_port, plain_port);
            let ours = [plain_port, tls_port]
                .into_iter()
                .all(|port| listening(&mut child, port))
                && info(plain_port, "server").get("process_id") == Some(&child.id().to_string());
            if !ours {
                let _ = child.kill();
                let _ = child.wait();
                continue;
            }
            return TlsRedis {
                url: format!("rediss://127.0.0.1:{tls_port}/0"),
                tls_port,
                ca_pem,
                ca_file,
                plain_url: format!("redis://127.0.0.1:{plain_port}/0"),
                dir,
                child,
            };
        }
        panic!("could not start a TLS redis-server of our own on free ports in 5 tries");
    }

    /// A plain-text client for assertions about the server's state.
    pub fn client(&self) -> redis::Connection {
        redis::Client::open(self.plain_url.as_str())
            .and_then(|client| client.get_connection())
            .unwrap_or_else(|error| panic!("cannot connect to {}: {error}", self.plain_url))
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-server` with TLS on `tls_port` (certificates from `dir`) and plain text on `plain_port`.
fn spawn(dir: &Path, tls_port: u16, plain_port: u16) -> Child {
    Command::new(tls_server_binary())
        .args(["--port", &plain_port.to_string()])
        .args(["--tls-port", &tls_port.to_string()])
        .arg("--tls-cert-file")
        .arg(dir.join("redis.crt"))
        .arg("--tls-key-file")
        .arg(dir.join("redis.key"))
        .arg("--tls-ca-cert-file")
        .arg(dir.join("ca.crt"))
        // Clients need no certificate of their own: the server's is what is under test.
        .args(["--tls-auth-clients", "no"])
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "cannot start redis-server ({error}). Install it (`apt-get install redis-server`; \
                 Debian's build has TLS)"
            )
        })
}

/// A CA, and a server certificate and key signed by it, all in PEM.
fn certificates() -> (String, String, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tower-redis-ratelimit test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "127.0.0.1");
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// Waits until something listens on `port`: `false` if the child exited first (port taken).
fn listening(child: &mut Child, port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return true;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server did not listen on {addr} within 10 s (a build without TLS?)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server the TLS tests start: `REDIS_TLS_SERVER` when set, else the suite's (`REDIS_SERVER`).
/// `scripts/test` sets it in its Valkey pass to Debian's `redis-server`: the only Valkey this
/// machine can get (PyPI's wheel) has no TLS.
fn tls_server_binary() -> String {
    std::env::var("REDIS_TLS_SERVER")
        .ok()
        .filter(|path| !path.is_empty())
        .unwrap_or_else(super::redis_server::server_binary)
}
