//! [`ConfigWatcher`]: reloads a [`RouteLimitsLayer`] when its file changes, or on `SIGHUP`.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::{ConfigError, ConfigLoader, RateLimitConfig, RouteLimitsLayer};

/// How often the file is read by default to see whether it changed.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Reloads a [`RouteLimitsLayer`] from a TOML file whenever the file's contents change, and on
/// `SIGHUP` (Unix) whether they changed or not, as servers such as nginx do.
///
/// The file is read every [`poll_interval`](Self::poll_interval) (default one second) and
/// compared with what was last applied; a change is applied once two reads in a row agree, so a
/// file being written in place is not read half-written: plain reads work the same on every platform, in containers
/// and on network mounts, and editors that replace the file by renaming are seen like any other.
/// A file that can't be read for a moment (being replaced) is tried again at the next poll. A
/// change that fails a check keeps the old policies and is logged naming its field, once, until
/// the file changes again. Every reload is counted ([`RouteLimitsLayer::reload_counts`]).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::config::{ConfigWatcher, RateLimitConfig};
///
/// let loader = RateLimitConfig::loader();
/// let config = loader.from_path("limits.toml")?;
/// let limits = config.route_limits(config.open_store()?)?;
/// let app: Router = Router::new()
///     .route("/api/ping", get(|| async { "PONG" }))
///     .route_layer(limits.clone());
/// ConfigWatcher::new(&limits, loader, "limits.toml").spawn();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ConfigWatcher {
    layer: RouteLimitsLayer,
    loader: ConfigLoader,
    path: PathBuf,
    poll_interval: Duration,
    sighup: bool,
    check: Option<AppCheck>,
}

/// An app's own check of a new file: its text and the configuration the crate read from it.
type AppCheck = Arc<dyn Fn(&str, &RateLimitConfig) -> Result<(), ConfigError> + Send + Sync>;

impl fmt::Debug for ConfigWatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConfigWatcher")
            .field("path", &self.path)
            .field("poll_interval", &self.poll_interval)
            .field("sighup", &self.sighup)
            .field("check", &self.check.is_some())
            .finish_non_exhaustive()
    }
}

impl ConfigWatcher {
    /// Watches `path`, read by `loader`, for `layer`, which should have been built from it: the
    /// contents at [`spawn`](Self::spawn) are taken as applied already.
    pub fn new(layer: &RouteLimitsLayer, loader: ConfigLoader, path: impl Into<PathBuf>) -> Self {
        ConfigWatcher {
            layer: layer.clone(),
            loader,
            path: path.into(),
            poll_interval: DEFAULT_POLL_INTERVAL,
            sighup: true,
            check: None,
        }
    }

    /// Runs the app's own checks on each new file (its text, and the configuration the crate
    /// read from it) before it is applied: an error refuses the reload like the crate's own,
    /// logged and counted. For fields the app reads itself
    /// ([`ConfigLoader::app_fields`]) and rules of its own.
    pub fn check<F>(mut self, check: F) -> Self
    where
        F: Fn(&str, &RateLimitConfig) -> Result<(), ConfigError> + Send + Sync + 'static,
    {
        self.check = Some(Arc::new(check));
        self
    }

    /// How often the file is read to see whether it changed (default one second).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Whether `SIGHUP` reloads the file (default `true`; no effect off Unix).
    pub fn on_sighup(mut self, enabled: bool) -> Self {
        self.sighup = enabled;
        self
    }

    /// Starts watching on the current Tokio runtime until the returned task is aborted.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn spawn(self) -> JoinHandle<()> {
        // The handler goes in before this returns, so a SIGHUP sent after it never meets the
        // default action (which ends the process).
        let hangups = self.hangups();
        // What the layer was built from: read now, so a change made after this returns is seen.
        let applied = std::fs::read_to_string(&self.path).ok();
        tokio::spawn(self.run(hangups, applied))
    }

    async fn run(self, mut hangups: Hangups, mut last: Option<String>) {
        // What the previous poll read.
        let mut seen: Option<String> = None;
        let mut ticks = tokio::time::interval(self.poll_interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            let forced = tokio::select! {
                _ = ticks.tick() => false,
                Some(()) = next_hangup(&mut hangups) => true,
            };
            let text = tokio::fs::read_to_string(&self.path).await;
            match text {
                // A change is applied once two reads in a row agree: a file written in place
                // (`cp`, `>`) may be read half-written, and a cut-off file can still parse.
                Ok(text)
                    if forced || (last.as_ref() != Some(&text) && seen.as_ref() == Some(&text)) =>
                {
                    self.reload(&text);
                    last = Some(text);
                    seen = None;
                }
                Ok(text) => seen = Some(text),
                // A signal asked for this reload: refuse it, saying why (logged and counted).
                Err(error) if forced => {
                    let message = format!("cannot read {}: {error}", self.path.display());
                    let source = self.path.display().to_string();
                    self.layer.refuse(ConfigError::new("", message), &source);
                }
                // Being replaced, perhaps: read again at the next poll.
                Err(_) => {}
            }
        }
    }

    fn reload(&self, text: &str) {
        let source = self.path.display().to_string();
        let checked = self.loader.from_toml_str(text).and_then(|config| {
            if let Some(check) = &self.check {
                check(text, &config)?;
            }
            Ok(config)
        });
        // Both outcomes are logged and counted by the layer.
        let _ = match checked {
            Ok(config) => self.layer.reload(&config),
            Err(error) => Err(self.layer.refuse(error, &source)),
        };
    }

    #[cfg(unix)]
    fn hangups(&self) -> Hangups {
        if !self.sighup {
            return None;
        }
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(signal) => Some(signal),
            Err(error) => {
                tracing::warn!(%error, "SIGHUP can't reload the rate-limit configuration");
                None
            }
        }
    }

    #[cfg(not(unix))]
    fn hangups(&self) -> Hangups {
        None
    }
}

/// The stream of `SIGHUP`s, when they reload.
#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = Option<()>;

/// The next `SIGHUP`, or never.
#[cfg(unix)]
async fn next_hangup(hangups: &mut Hangups) -> Option<()> {
    match hangups {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(not(unix))]
async fn next_hangup(_: &mut Hangups) -> Option<()> {
    std::future::pending().await
}
