//! The guide: one chapter per task, each a module of this one (the modules hold no items, only
//! their text; every code block in them is a doctest).
//!
//! Start with [the front page](crate) (what the crate does, a first limited route), then read the
//! chapter of what you are doing:
//!
//! | chapter | for |
//! |---|---|
//! | [`policies`] | rules, algorithms and choosing one (Redis memory per identity), one policy per route, nesting, overrides |
//! | [`derive`](mod@derive) | a policy as a type beside its handler, checked when the app compiles (feature `macros`) |
//! | [`keys`] | what counts together; client IPs behind proxies |
//! | [`stores`] | memory, Redis, Cluster, Sentinel, TLS; which servers and versions |
//! | [`answers`] | the headers, the 429 body, gRPC's answers, reading headers on the client |
//! | [`costs`] | costs per request, duplicates, penalty blocks, shadow and delay modes |
//! | [`quotas`] | daily quotas by plan tier, and alerts |
//! | [`metered`] | limits on what requests use (tokens, bytes, money): reserve, record, settle; streamed bodies; token quotas by plan |
//! | [`concurrency`] | requests or jobs at once; limits called from code, for handlers, jobs and workers; limits on outcomes |
//! | [`outbound`] | calls to a rate-limited API, shared by every instance |
//! | [`config`] | limits from a TOML file, and reload (feature `config`) |
//! | [`monitoring`] | metrics, the dashboard, alert rules, logs |
//! | [`store_failures`] | what happens when Redis is down or broken, and what to do |
//! | [`performance`] | what it costs, measured beside the peers; hot keys; the soak run |
//! | [`testing`] | how the crate is tested: the servers, fuzzing |
//! | [`migrating_from_tower_governor`] | the same limits, from `tower_governor` |
//! | [`migrating_from_tower_rate_limit_redis`] | the same limits, from `tower-rate-limit-redis` |
//!
//! The path of one request (made by `scripts/pictures` from `docs/pictures/request-path.dot`):
//!
#![doc = include_str!("../docs/pictures/request-path.svg.html")]

#[doc = include_str!("../docs/guide/policies.md")]
pub mod policies {}

#[doc = include_str!("../docs/guide/derive.md")]
#[cfg(any(all(doc, not(doctest)), feature = "macros"))]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub mod derive {}

#[doc = include_str!("../docs/guide/keys.md")]
pub mod keys {}

#[doc = include_str!("../docs/guide/stores.md")]
// Rendered always; its examples are tested only with these features, which they need (rustdoc
// sets `doc` when it collects doctests too, hence `not(doctest)`).
#[cfg(any(
    all(doc, not(doctest)),
    all(feature = "cluster", feature = "sentinel", feature = "tls")
))]
pub mod stores {}

#[doc = include_str!("../docs/guide/answers.md")]
pub mod answers {}

#[doc = include_str!("../docs/guide/costs.md")]
pub mod costs {}

#[doc = include_str!("../docs/guide/quotas.md")]
// Rendered always; its examples are tested only with these features, which they need (rustdoc
// sets `doc` when it collects doctests too, hence `not(doctest)`).
#[cfg(any(all(doc, not(doctest)), feature = "webhook"))]
pub mod quotas {}

#[doc = include_str!("../docs/guide/metered.md")]
pub mod metered {}

#[doc = include_str!("../docs/guide/concurrency.md")]
pub mod concurrency {}

#[doc = include_str!("../docs/guide/outbound.md")]
// Rendered always; its examples are tested only with these features, which they need (rustdoc
// sets `doc` when it collects doctests too, hence `not(doctest)`).
#[cfg(any(all(doc, not(doctest)), feature = "reqwest-middleware"))]
pub mod outbound {}

#[doc = include_str!("../docs/guide/config.md")]
#[cfg(any(all(doc, not(doctest)), feature = "config"))]
#[cfg_attr(docsrs, doc(cfg(feature = "config")))]
pub mod config {}

#[doc = include_str!("../docs/guide/monitoring.md")]
pub mod monitoring {}

#[doc = include_str!("../docs/guide/store_failures.md")]
pub mod store_failures {}

#[doc = include_str!("../docs/guide/performance.md")]
#[doc = "\n## The peers, in a picture\n\nMade by `scripts/pictures` from `benches/load_peers.sh`'s medians (`benches/peers/medians.tsv`):\n\n"]
#[doc = include_str!("../docs/pictures/performance.svg.html")]
#[doc = "\n## The soak run, in a picture\n\nDrawn by `benches/soak.sh` (`benches/soak.gp`):\n\n"]
#[doc = include_str!("../benches/soak/soak.svg.html")]
pub mod performance {}

#[doc = include_str!("../docs/guide/testing.md")]
pub mod testing {}

#[doc = include_str!("../docs/guide/migrating_from_tower_governor.md")]
pub mod migrating_from_tower_governor {}

#[doc = include_str!("../docs/guide/migrating_from_tower_rate_limit_redis.md")]
pub mod migrating_from_tower_rate_limit_redis {}
