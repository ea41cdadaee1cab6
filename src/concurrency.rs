//! Concurrency limits: at most `n` requests of one identity in progress at once, on every instance
//! together ([`PolicyBuilder::max_in_flight`](crate::PolicyBuilder::max_in_flight)).
//!
//! A request admitted under a concurrency limit holds a *lease*: a slot taken by the store in the
//! same step as the policy's rate rules (all or nothing), released when the response body has been
//! sent or dropped (a client that disconnects releases it too), and otherwise when the lease
//! expires, so a crashed instance can't hold a slot for ever. Leases are not renewed: the lease is
//! the longest a request may hold its slot, which bounds a worker's lifetime. A request that
//! outlives it keeps running, but its slot is free for another; choose a lease longer than the
//! slowest request you serve.
//!
//! In [`Mode::Delay`](crate::Mode::Delay) a request that finds no free slot waits for one, up to
//! `max_delay` from its arrival, first come first served among this instance's requests of its
//! key: only the oldest asks the store, at once when this instance frees a slot of the key, and
//! otherwise every 5 ms doubling up to 100 ms, for slots freed elsewhere or by an expired lease.
//! Across instances the oldest waiters of each compete at those polls. A poll that finds no slot
//! records nothing, so waiting uses no rate quota.

pub use crate::policy::concurrency_limit::ConcurrencyLimit;
