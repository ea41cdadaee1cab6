//! TLS settings for the store's own clients (`rediss://` URLs): a CA of your own, or no checks.

use std::path::Path;

use ::redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisResult, TlsCertificates};

/// How the store's own clients check a `rediss://` server: against the system's roots (the
/// default), against a CA you give, or not at all. Used with [`RedisStore::with_tls`].
///
/// [`RedisStore::with_tls`]: super::RedisStore::with_tls
#[derive(Clone, Default)]
pub struct TlsOptions {
    ca_pem: Option<Vec<u8>>,
    insecure: bool,
}

impl TlsOptions {
    /// The system's roots, certificates checked.
    pub fn new() -> Self {
        TlsOptions::default()
    }

    /// Trusts the CA certificates in `pem` (PEM text) instead of the system's roots.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Trusts the CA certificates in the PEM file at `path` instead of the system's roots.
    pub fn ca_file(self, path: impl AsRef<Path>) -> std::io::Result<Self> {
        Ok(self.ca_pem(std::fs::read(path)?))
    }

    /// Skips every certificate check (`true`): for tests and private networks only, since anyone
    /// in the middle can then read and change the limiter's traffic.
    pub fn insecure(mut self, insecure: bool) -> Self {
        self.insecure = insecure;
        self
    }

    fn certificates(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: None,
            root_cert: self.ca_pem.clone(),
        }
    }

    #[cfg(feature = "sentinel")]
    fn mode(&self) -> ::redis::TlsMode {
        if self.insecure {
            ::redis::TlsMode::Insecure
        } else {
            ::redis::TlsMode::Secure
        }
    }

    /// A client for one node at `url`.
    pub(super) fn node_client(&self, url: &str) -> RedisResult<::redis::Client> {
        self.client(url.into_connection_info()?)
    }

    /// A client for the node `info` names.
    pub(super) fn client(&self, mut info: ConnectionInfo) -> RedisResult<::redis::Client> {
        if self.insecure
            && let ConnectionAddr::TcpTls { host, port, .. } = info.addr()
        {
            let addr = ConnectionAddr::TcpTls {
                host: host.clone(),
                port: *port,
                insecure: true,
                tls_params: None,
            };
            info = info.set_addr(addr);
        }
        ::redis::Client::build_with_tls(info, self.certificates())
    }

    /// The Sentinel client's builder with these settings for the sentinels and the primary.
    #[cfg(feature = "sentinel")]
    pub(super) fn sentinel_builder(
        &self,
        builder: ::redis::sentinel::SentinelClientBuilder,
    ) -> ::redis::sentinel::SentinelClientBuilder {
        builder
            .set_client_to_redis_tls_mode(self.mode())
            .set_client_to_redis_certificates(self.certificates())
            .set_client_to_sentinel_tls_mode(self.mode())
            .set_client_to_sentinel_certificates(self.certificates())
    }
}

impl std::fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsOptions")
            .field("ca", &self.ca_pem.as_ref().map(|_| "custom"))
            .field("insecure", &self.insecure)
            .finish()
    }
}
