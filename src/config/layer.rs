//! [`RouteLimitsLayer`]: the policies of a configuration on the routes they name, as one
//! `route_layer` that picks each request's policy by its matched path (a gRPC call's own path),
//! and swaps them all at once
//! on a reload.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::MatchedPath;
use bytes::Bytes;
use http::{Request, Response};
use tower::{BoxError, Layer, Service};

use super::store::RedisSettings;
use super::{ConfigError, ConfigLoader, RateLimitConfig, RouteSource, StoreSpec};
use crate::RateLimitLayer;
use crate::future::ResponseFuture;
use crate::limiter::{Admission, Limiter};
use crate::service::limit_call;
use crate::store::Store;
use crate::telemetry;

/// Limits each request by the policy of its route (axum's [`MatchedPath`]; for a gRPC call
/// that axum routed by a wildcard, or that reaches the layer without a router, the call's own
/// path, `/package.Service/Method`); a route the file doesn't name is not limited. Made by [`RateLimitConfig::route_limits`] (and
/// [`RateLimitConfig::apply`](super::RateLimitConfig::apply)); add it with `Router::route_layer`,
/// which runs it after routing.
///
/// Its policies can be replaced while it serves, all at once ([`RouteLimitsLayer::reload`],
/// or a [`ConfigWatcher`](super::ConfigWatcher) on the file): each request reads the route table
/// once, so it runs wholly under the old policies or wholly under the new ones, and requests in
/// flight finish under those they started with. Clones share the table.
#[derive(Clone)]
pub struct RouteLimitsLayer {
    shared: Arc<Shared>,
}

/// What the layer's clones and services share.
struct Shared {
    /// Where every route counts; a reload keeps it (a new store needs a restart).
    store: Arc<dyn Store>,
    /// The `store` (and its settings) of the file the layer was built from, to warn when a
    /// reload names another.
    store_spec: (StoreSpec, RedisSettings),
    routes: ArcSwap<RouteTable>,
    /// Held from reading the table to storing the next, so two reloads at once can't build
    /// from the same table and lose one of them.
    reloading: Mutex<()>,
    applied: AtomicU64,
    refused: AtomicU64,
}

/// The limiter of each limited path, and what it was built from. A route that lists several
/// paths is one entry under each of them: one limiter, one budget.
#[derive(Default)]
struct RouteTable {
    by_path: HashMap<String, Arc<Route>>,
}

struct Route {
    /// The route's first path, which names it (in a reload's summary and in `layers`).
    path: String,
    limiter: Arc<Limiter>,
    source: RouteSource,
}

impl RouteTable {
    /// Each route once, under its first path.
    fn routes(&self) -> impl Iterator<Item = &Route> {
        self.by_path
            .iter()
            .filter(|(path, route)| **path == route.path)
            .map(|(_, route)| &**route)
    }
}

/// What a reload changed, route by route (a route is known by its path, its first when it lists
/// several).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReloadSummary {
    /// Routes whose entry and shared settings are unchanged: they keep their limiter as it was.
    pub kept: usize,
    /// Routes whose policy changed: a new limiter. Rules that are the same (limit and period)
    /// keep their counts, which live in the store under the same keys.
    pub changed: usize,
    /// Routes new to the file.
    pub added: usize,
    /// Routes no longer in the file: unlimited from now on.
    pub removed: usize,
}

impl RouteLimitsLayer {
    /// The layer of `config`'s routes, counting in `store`.
    pub(super) fn build(
        config: &RateLimitConfig,
        store: Arc<dyn Store>,
    ) -> Result<Self, ConfigError> {
        let (table, _) = RouteTable::build(config, &store, &RouteTable::default())?;
        Ok(RouteLimitsLayer {
            shared: Arc::new(Shared {
                store,
                store_spec: (config.store.clone(), config.redis.clone()),
                routes: ArcSwap::from_pointee(table),
                reloading: Mutex::new(()),
                applied: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        })
    }

    /// Replaces every route's policy with `config`'s, at once. Routes whose entry (and the
    /// settings every policy takes) did not change keep their limiter; the others get a new one,
    /// whose unchanged rules still find their counts in the store. The store stays the one the
    /// layer was built with. On an error nothing changes.
    ///
    /// Each call is counted ([`reload_counts`](Self::reload_counts), and the
    /// `ratelimit_config_reloads_total` metric with `outcome` `applied` or `refused`) and logged.
    pub fn reload(&self, config: &RateLimitConfig) -> Result<ReloadSummary, ConfigError> {
        // A poisoned lock guards no data: the table is swapped whole or not at all.
        let _reloading = self
            .shared
            .reloading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let current = self.shared.routes.load();
        match RouteTable::build(config, &self.shared.store, &current) {
            Ok((table, summary)) => {
                let (store, settings) = &self.shared.store_spec;
                if config.store != *store || config.redis != *settings {
                    tracing::warn!(
                        from = %store,
                        to = %config.store,
                        "the new configuration changes the store or its settings: that takes a \
                         restart; the policies are reloaded, counting where they did"
                    );
                }
                self.shared.routes.store(Arc::new(table));
                self.shared.applied.fetch_add(1, Ordering::Relaxed);
                telemetry::config_reload("applied");
                tracing::info!(
                    kept = summary.kept,
                    changed = summary.changed,
                    added = summary.added,
                    removed = summary.removed,
                    "rate-limit configuration reloaded"
                );
                Ok(summary)
            }
            Err(error) => Err(self.refuse(error, "")),
        }
    }

    /// Reads the TOML file at `path` with `loader` and [reloads](Self::reload) it. A file that
    /// can't be read or fails a check changes nothing: the error, naming the field, is logged,
    /// counted and returned.
    pub fn reload_from_path(
        &self,
        loader: &ConfigLoader,
        path: impl AsRef<std::path::Path>,
    ) -> Result<ReloadSummary, ConfigError> {
        let path = path.as_ref();
        match loader.from_path(path) {
            Ok(config) => self.reload(&config),
            Err(error) => Err(self.refuse(error, &path.display().to_string())),
        }
    }

    /// Counts, logs and returns a refused reload.
    pub(super) fn refuse(&self, error: ConfigError, source: &str) -> ConfigError {
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
        telemetry::config_reload("refused");
        tracing::error!(
            source,
            %error,
            "rate-limit configuration NOT reloaded: the previous policies stay"
        );
        error
    }

    /// How many reloads were applied and how many refused, since the layer was built.
    pub fn reload_counts(&self) -> (u64, u64) {
        (
            self.shared.applied.load(Ordering::Relaxed),
            self.shared.refused.load(Ordering::Relaxed),
        )
    }

    /// A [`RateLimitLayer`] for each route's policy as it is now, sharing the route's counts, its
    /// [`top_refused`](RateLimitLayer::top_refused) summary and its shadow count: for operator
    /// endpoints ([`inspect`](RateLimitLayer::inspect), [`reset`](RateLimitLayer::reset)). Sorted
    /// by path. Call it again after a reload.
    pub fn layers(&self) -> Vec<RateLimitLayer> {
        let table = self.shared.routes.load();
        let mut routes: Vec<&Route> = table.routes().collect();
        routes.sort_by(|a, b| a.path.cmp(&b.path));
        routes
            .into_iter()
            .map(|route| RateLimitLayer::from_limiter(route.limiter.clone()))
            .collect()
    }
}

impl RouteTable {
    /// The table of `config`'s routes, reusing `current`'s limiter of each route whose source is
    /// unchanged.
    fn build(
        config: &RateLimitConfig,
        store: &Arc<dyn Store>,
        current: &RouteTable,
    ) -> Result<(RouteTable, ReloadSummary), ConfigError> {
        let mut summary = ReloadSummary::default();
        let mut by_path = HashMap::with_capacity(config.routes.len());
        for (index, route) in config.routes.iter().enumerate() {
            // A route is known by its first path: one whose first path was another route's
            // second is a new route.
            let old = current
                .by_path
                .get(&route.path)
                .filter(|old| old.path == route.path);
            let limiter = match old {
                Some(old) if old.source == route.source => {
                    summary.kept += 1;
                    old.limiter.clone()
                }
                old => {
                    if old.is_some() {
                        summary.changed += 1;
                    } else {
                        summary.added += 1;
                    }
                    let mut limiter = Limiter::try_new(route.policy.clone(), store.clone())
                        .map_err(|error| {
                            ConfigError::new(format!("routes[{index}]"), error.to_string())
                        })?;
                    limiter.legacy_headers = config.legacy_headers;
                    Arc::new(limiter)
                }
            };
            let entry = Arc::new(Route {
                path: route.path.clone(),
                limiter,
                source: route.source.clone(),
            });
            for path in &route.paths {
                by_path.insert(path.clone(), entry.clone());
            }
        }
        summary.removed = current
            .routes()
            .filter(|old| {
                by_path
                    .get(&old.path)
                    .is_none_or(|new| new.path != old.path)
            })
            .count();
        Ok((RouteTable { by_path }, summary))
    }
}

impl fmt::Debug for RouteLimitsLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = self.shared.routes.load();
        let mut paths: Vec<&String> = table.by_path.keys().collect();
        paths.sort();
        f.debug_struct("RouteLimitsLayer")
            .field("paths", &paths)
            .field("reloads", &self.reload_counts())
            .finish()
    }
}

impl<S> Layer<S> for RouteLimitsLayer {
    type Service = RouteLimits<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RouteLimits {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service of [`RouteLimitsLayer`].
#[derive(Clone)]
pub struct RouteLimits<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for RouteLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteLimits")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RouteLimits<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // One read of the table: the request runs under this one policy to its end.
        let table = self.shared.routes.load();
        // The route axum matched; for a gRPC call, else its own path: a method's path
        // (`/package.Service/Method`) under a service that axum routes by a wildcard, or that a
        // layer around a tonic service sees without a router. (An HTTP request is only ever
        // limited by the route axum matched, as before gRPC calls were.)
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .and_then(|path| table.by_path.get(path.as_str()))
            .or_else(|| {
                crate::grpc::is_grpc(request.headers())
                    .then(|| table.by_path.get(request.uri().path()))
                    .flatten()
            });
        match route {
            Some(route) => limit_call(&route.limiter, &mut self.inner, request),
            None => ResponseFuture::inner(self.inner.call(request), Admission::unchecked()),
        }
    }
}
