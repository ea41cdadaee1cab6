//! The integration tests, in one binary (one link instead of one per file). Each module is one
//! behaviour, tested through the public API; `common` holds the fakes and test servers they share.

mod common;

mod alerts;
mod algorithms;
mod batch;
#[cfg(feature = "cluster")]
mod cluster;
#[cfg(feature = "cluster")]
mod cluster_failover;
mod composition;
mod concurrency;
#[cfg(feature = "config")]
mod config;
#[cfg(feature = "config")]
mod config_reload;
#[cfg(feature = "config")]
mod config_reload_counts;
#[cfg(feature = "config")]
mod config_schema;
mod cost;
mod count_only;
#[allow(clippy::duplicated_attributes)]
#[cfg(feature = "macros")]
mod derive;
mod fair_share;
mod fair_share_outbound;
mod give_back;
mod grpc;
mod keys;
mod layering;
mod limits;
mod logging;
mod metered;
mod metered_store;
#[cfg(feature = "metrics")]
mod metrics;
mod operate;
mod outbound;
mod outbound_metered;
mod overrides;
mod prefetch;
mod quota;
mod rate_limiter;
mod redis_clients;
mod redis_versions;
mod refusal_cache;
mod reset_units;
mod responses;
mod retry_after;
mod run_time_overrides;
mod run_time_overrides_redis;
mod script_wire;
#[cfg(feature = "sentinel")]
mod sentinel;
mod store_calls;
mod store_failures;
#[cfg(feature = "metrics")]
mod store_faults;
mod stores_agree;
mod tcp;
#[cfg(feature = "tls")]
mod tls;
