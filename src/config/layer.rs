//! [`RouteLimitsLayer`]: the policies of a configuration on the routes they name, as one
//! `route_layer` that picks each request's policy by its matched path (a gRPC call's own path),
//! and swaps them all at once
//! on a reload.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::IntoResponse;
use bytes::Bytes;
use http::{Request, Response};
use tower::{BoxError, Layer, Service};

use super::store::RedisSettings;
use super::{ConfigError, ConfigLoader, RateLimitConfig, RouteSource, StoreSpec};
use crate::RateLimitLayer;
use crate::layer::ResponseFuture;
use crate::layer::limit_call;
use crate::limiter::telemetry;
use crate::limiter::{Limiter, OnResponse, RejectHandler};
use crate::policy::Policy;
use crate::response::TooManyRequests;
use crate::store::Store;

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
    /// The 429 of every route, when the app replaces the default ([`RouteLimitsLayer::on_rejected`]).
    on_rejected: Mutex<Option<RejectHandler>>,
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
    /// Whether each path has limited a request yet, to tell a path the app never serves (a typo).
    seen: HashMap<String, AtomicU8>,
    /// How many paths have neither limited a request nor been named in a warning: while none is
    /// left (or [`MAX_EXAMINED`] served paths have been compared), nothing is watched.
    unseen: AtomicUsize,
    /// The unlimited paths the app served, each compared once with the paths not seen yet
    /// (at most [`MAX_EXAMINED`]).
    examined: RwLock<HashSet<String>>,
}

/// A configured path that has limited no request yet.
const UNSEEN: u8 = 0;
/// A configured path that has limited a request.
const SEEN: u8 = 1;
/// A configured path not seen yet, already named in a warning.
const WARNED: u8 = 2;

/// How many unlimited paths a table compares with its unseen ones; past that it stops looking.
const MAX_EXAMINED: usize = 256;

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
/// several). Where a route sits in the file doesn't matter: reordering routes, or inserting one,
/// keeps every other route as it was.
///
/// Which edits keep a route's counts: its counts live in the store under its prefix, its
/// policy's name (the route's `name`, or its path), its key, its algorithm and each rule's limit
/// and period. Edits to anything else keep them: a token bucket's `burst`, `mode`, `max_delay`,
/// `block_for`, `prevent_duplicate`, `cost_header`, `count_only`, `prefetch`, `max_in_flight`,
/// `lease`, `overrides`, another route, adding a rule (counted from now) or removing one. Edits
/// that move a route's counts start them afresh, and the route is named in
/// [`reset_paths`](Self::reset_paths) and in the reload's log line: the top-level `prefix`, its
/// `name`, its `key`, its `algorithm` (the state of one algorithm means nothing to another), or a
/// rule's `limit` or `period` (that rule's count; the route's other rules keep theirs).
/// Placing a route elsewhere in the file, or another route before it, changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReloadSummary {
    /// Routes whose entry and shared settings are unchanged: they keep their limiter as it was.
    pub kept: usize,
    /// Routes whose policy changed: a new limiter. Rules that are the same (limit and period,
    /// under the same prefix, name, key and algorithm) keep their counts, which live in the store
    /// under the same keys.
    pub changed: usize,
    /// Routes new to the file.
    pub added: usize,
    /// Routes no longer in the file: unlimited from now on.
    pub removed: usize,
    /// The changed routes (their first paths, in the file's order) whose counts start afresh
    /// (see above): their prefix, name, key or algorithm changed, or a rule's limit or period
    /// (a rule replaced by another, not only added or removed).
    pub reset_paths: Vec<String>,
}

/// The paths a reload added and removed (their routes' first paths), for its log.
#[derive(Default)]
struct PathChanges {
    added: Vec<String>,
    removed: Vec<String>,
}

impl RouteLimitsLayer {
    /// The layer of `config`'s routes, counting in `store`.
    pub(super) fn build(
        config: &RateLimitConfig,
        store: Arc<dyn Store>,
    ) -> Result<Self, ConfigError> {
        let (table, _, _) = RouteTable::build(config, &store, &RouteTable::default(), None)?;
        Ok(RouteLimitsLayer {
            shared: Arc::new(Shared {
                store,
                store_spec: (config.store.clone(), config.redis.clone()),
                routes: ArcSwap::from_pointee(table),
                on_rejected: Mutex::new(None),
                reloading: Mutex::new(()),
                applied: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        })
    }

    /// Replaces the default 429 body of every route, now and after each reload, with what
    /// `respond` answers, as [`RateLimitLayer::on_rejected`] does for one layer: anything a
    /// handler may return. The layer still adds `Retry-After` and the rate-limit headers; a
    /// refused gRPC call still gets [`TooManyRequests::grpc_response`]. Clones of the layer share it.
    ///
    /// ```
    /// use axum::Json;
    /// use http::StatusCode;
    /// use tower_redis_ratelimit::config::RateLimitConfig;
    ///
    /// let config = RateLimitConfig::from_toml_str(r#"
    ///     store = "memory"
    ///     [[routes]]
    ///     path = "/login"
    ///     key = "ip"
    ///     rules = [{ limit = 10, period = "1m" }]
    /// "#).unwrap();
    /// let limits = config.route_limits(config.open_store().unwrap()).unwrap().on_rejected(|rejected| {
    ///     let body = serde_json::json!({ "error": "slow down", "retry_in": rejected.retry_after_secs() });
    ///     (StatusCode::TOO_MANY_REQUESTS, Json(body))
    /// });
    /// # let _ = limits;
    /// ```
    pub fn on_rejected<F, R>(self, respond: F) -> Self
    where
        F: Fn(&TooManyRequests) -> R + Send + Sync + 'static,
        R: IntoResponse,
    {
        let handler: RejectHandler = Arc::new(move |rejected| respond(rejected).into_response());
        {
            let _reloading = self.lock_reloading();
            *self
                .shared
                .on_rejected
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(handler.clone());
            let current = self.shared.routes.load();
            self.shared
                .routes
                .store(Arc::new(current.answering_with(&handler)));
        }
        self
    }

    /// Held while a table is read and its successor stored.
    fn lock_reloading(&self) -> std::sync::MutexGuard<'_, ()> {
        // A poisoned lock guards no data: the table is swapped whole or not at all.
        self.shared
            .reloading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces every route's policy with `config`'s, at once. Routes whose entry (and the
    /// settings every policy takes) did not change keep their limiter; the others get a new one,
    /// whose unchanged rules still find their counts in the store. The store stays the one the
    /// layer was built with. On an error nothing changes.
    ///
    /// Each call is counted ([`reload_counts`](Self::reload_counts), and the
    /// `ratelimit_config_reloads_total` metric with `outcome` `applied` or `refused`) and logged.
    pub fn reload(&self, config: &RateLimitConfig) -> Result<ReloadSummary, ConfigError> {
        let _reloading = self.lock_reloading();
        let current = self.shared.routes.load();
        let on_rejected = self
            .shared
            .on_rejected
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        match RouteTable::build(config, &self.shared.store, &current, on_rejected.as_ref()) {
            Ok((table, summary, changes)) => {
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
                    reset = ?summary.reset_paths,
                    "rate-limit configuration reloaded"
                );
                // A path edited by mistake (`/login` to `/logn`) removes the real path's limit:
                // say so louder than a count.
                for path in &changes.removed {
                    tracing::warn!(
                        path = %path,
                        added = ?changes.added,
                        "the reloaded configuration no longer limits this path: its requests are \
                         unlimited from now on (check the paths for a typo if that was not meant)"
                    );
                }
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
    /// unchanged; new limiters answer refusals with `on_rejected` when the app set one.
    fn build(
        config: &RateLimitConfig,
        store: &Arc<dyn Store>,
        current: &RouteTable,
        on_rejected: Option<&RejectHandler>,
    ) -> Result<(RouteTable, ReloadSummary, PathChanges), ConfigError> {
        let mut summary = ReloadSummary::default();
        let mut changes = PathChanges::default();
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
                    if let Some(old) = old {
                        summary.changed += 1;
                        if !counts_carry_over(old.limiter.policy(), &route.policy) {
                            summary.reset_paths.push(route.path.clone());
                        }
                    } else {
                        summary.added += 1;
                        changes.added.push(route.path.clone());
                    }
                    let mut limiter = Limiter::try_new(route.policy.clone(), store.clone())
                        .map_err(|error| {
                            ConfigError::new(format!("routes[{index}]"), error.to_string())
                        })?;
                    limiter.set_legacy_headers(config.legacy_headers);
                    limiter.set_on_rejected(on_rejected.cloned());
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
        // Path by path, not route by route: a typo in a route's second path unlimits that path,
        // and a route whose paths were reordered still limits every one of them.
        changes.removed = current
            .by_path
            .keys()
            .filter(|path| !by_path.contains_key(*path))
            .cloned()
            .collect();
        changes.removed.sort();
        Ok((RouteTable::of(by_path), summary, changes))
    }

    /// A table of these routes, none of its paths seen yet.
    fn of(by_path: HashMap<String, Arc<Route>>) -> RouteTable {
        let seen = by_path
            .keys()
            .map(|path| (path.clone(), AtomicU8::new(UNSEEN)))
            .collect();
        RouteTable {
            unseen: AtomicUsize::new(by_path.len()),
            seen,
            by_path,
            examined: RwLock::default(),
        }
    }

    /// The same routes, each limiter answering refusals with `handler` (their counts, shared
    /// through the store and the limiters' shared parts, go on).
    fn answering_with(&self, handler: &RejectHandler) -> RouteTable {
        let mut rebuilt: HashMap<&str, Arc<Route>> = HashMap::new();
        let by_path = self
            .by_path
            .iter()
            .map(|(path, route)| {
                let route = rebuilt.entry(&route.path).or_insert_with(|| {
                    Arc::new(Route {
                        path: route.path.clone(),
                        limiter: Arc::new(route.limiter.answering_with(handler.clone())),
                        source: route.source.clone(),
                    })
                });
                (path.clone(), route.clone())
            })
            .collect();
        RouteTable::of(by_path)
    }

    /// One path fewer to watch (never below zero: watching may have been stopped meanwhile).
    fn one_less_unseen(&self) {
        let _ = self
            .unseen
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Notes that `path` limited a request.
    fn saw(&self, path: &str) {
        // Once every path has been seen, one load a request.
        if self.unseen.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(state) = self.seen.get(path)
            && state.swap(SEEN, Ordering::Relaxed) == UNSEEN
        {
            self.one_less_unseen();
        }
    }

    /// Notes that the app served `path`, which no route limits: a configured path that has
    /// limited nothing yet and is one or two edits away from it is likely a typo of it, and is
    /// named at WARN, once.
    fn served_unlimited(&self, path: &str) {
        if self.unseen.load(Ordering::Relaxed) == 0 {
            return;
        }
        // A path compared once is not compared again: most unlimited requests (health checks,
        // static files) take a shared read lock and go.
        let known = self
            .examined
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(path);
        if known {
            return;
        }
        {
            let mut examined = self
                .examined
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if examined.len() >= MAX_EXAMINED {
                // Enough served paths compared: stop watching.
                self.unseen.store(0, Ordering::Relaxed);
                return;
            }
            if !examined.insert(path.to_owned()) {
                return;
            }
        }
        for (configured, state) in &self.seen {
            if state.load(Ordering::Relaxed) == UNSEEN
                && edit_distance(configured, path) <= 2
                && state
                    .compare_exchange(UNSEEN, WARNED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                self.one_less_unseen();
                tracing::warn!(
                    configured = %configured,
                    served = %path,
                    "the app serves a path no rate limit names, close to a configured path that \
                     has limited no request yet: a typo in the configuration? The served path is \
                     unlimited"
                );
            }
        }
    }
}

/// The Levenshtein distance of two paths, in bytes (paths are ASCII in practice; a multi-byte
/// character counts as several edits, which only makes a match less likely).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len().abs_diff(b.len()) > 2 {
        return usize::MAX;
    }
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for (i, &x) in a.iter().enumerate() {
        current[0] = i + 1;
        for (j, &y) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(x != y);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
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
        let matched = request.extensions().get::<MatchedPath>();
        let route = matched
            .and_then(|path| {
                let route = table.by_path.get(path.as_str());
                match route {
                    Some(_) => table.saw(path.as_str()),
                    None => table.served_unlimited(path.as_str()),
                }
                route
            })
            .or_else(|| {
                crate::grpc::is_grpc(request.headers())
                    .then(|| {
                        let path = request.uri().path();
                        let route = table.by_path.get(path);
                        if route.is_some() {
                            table.saw(path);
                        }
                        route
                    })
                    .flatten()
            });
        match route {
            Some(route) => limit_call(&route.limiter, &mut self.inner, request),
            None => ResponseFuture::inner(self.inner.call(request), OnResponse::nothing()),
        }
    }
}

/// Whether `old`'s counts live on under `new`: the same prefix, name, key and algorithm (the
/// store keys' parts, and what their state means), and no rule of `old` replaced by a rule of
/// another limit, period or unit (requests or metered; a rule only added starts from nothing, as any new rule; one only
/// removed takes its counts along; the duplicate guard is a rule here too).
fn counts_carry_over(old: &Policy, new: &Policy) -> bool {
    let same = |a: &crate::Rule, b: &crate::Rule| {
        a.limit() == b.limit()
            && a.period_ms() == b.period_ms()
            && a.is_duplicate_guard() == b.is_duplicate_guard()
            && a.is_metered() == b.is_metered()
    };
    let unmatched = |from: &Policy, to: &Policy| {
        from.rules()
            .iter()
            .any(|rule| !to.rules().iter().any(|other| same(rule, other)))
    };
    old.prefix() == new.prefix()
        && old.name() == new.name()
        && old.key().same_identity_as(new.key())
        && old.algorithm() == new.algorithm()
        && !(unmatched(old, new) && unmatched(new, old))
}

#[cfg(test)]
mod tests {
    use super::edit_distance;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("/login", "/login"), 0);
        assert_eq!(edit_distance("/logn", "/login"), 1);
        assert_eq!(edit_distance("/login", "/logon"), 1);
        assert_eq!(edit_distance("/users/{id}", "/users/:id"), 2);
        assert_eq!(edit_distance("", "/a"), 2);
        // Lengths three apart can't be two edits apart.
        assert_eq!(edit_distance("/a", "/abcd"), usize::MAX);
        assert_eq!(edit_distance("/orders", "/users"), 3);
    }
}
