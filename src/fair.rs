//! Fair shares of one budget ([`PolicyBuilder::fair_share`](crate::PolicyBuilder::fair_share)):
//! one limit shared by every identity the policy's key names (the tokens a minute an LLM vendor
//! sells, the requests a second a database takes), which, once saturated, each identity gets
//! its weighted share of, and what one leaves goes to those who want more.
//!
//! ```
//! use tower_redis_ratelimit::fair::FairShare;
//! use tower_redis_ratelimit::{Key, Policy, Rule};
//!
//! // 300 requests a second for everyone; a tenant on the "pro" plan weighs twice as much.
//! let policy = Policy::builder("gateway")
//!     .key(Key::header("x-tenant"))
//!     .rule(Rule::per_second(1_000))
//!     .fair_share(FairShare::new(Rule::per_second(300)).weight_from_fn(|parts| {
//!         match parts.headers.get("x-plan").map(|plan| plan.as_bytes()) {
//!             Some(b"pro") => 2,
//!             _ => 1,
//!         }
//!     }))
//!     .build()?;
//! # Ok::<(), tower_redis_ratelimit::PolicyError>(())
//! ```
//!
//! The arithmetic, in windows of the budget's period:
//! - **While what is asked stays below the budget**, nobody is held to a share: requests are
//!   admitted as the policy's own rules say, the budget counting them.
//! - **Once it is saturated** (what was asked, refused requests included, reached the budget in
//!   the window before, or so far in this one), each identity active in this window or the one
//!   before is admitted up to its share: `budget × weight / Σ weights` when all want more than
//!   that; max-min fair by weight otherwise, so an identity that asked less (in the window
//!   before) is held to nothing it doesn't use, and what it leaves goes to the others. An
//!   identity refused in the window before wanted more than it got, whatever it asked: it needs
//!   more than any share. Shares are set at a window's first request, so they hold from its
//!   first millisecond.
//! - **An identity that arrives** is held to the level the others' shares stand at, and counted
//!   in the next window's shares: it has its share within one window. One that stops lets its
//!   share go a tenth into the next window.
//! - **The budget itself is never passed**: it is a limit like any other, counted with the
//!   policy's algorithm. A refusal for fairness is a 429 with `Retry-After` (the window's end),
//!   like any other.
//!
//! How far a tenant can pass its share within a window: by what it was admitted before the
//! window saturated (the requests admitted, or in flight, at that moment), never by more.
//!
//! Both stores keep them, across instances, in the request's one store call; on Redis every key
//! of such a policy's checks has the policy's hash tag, so one budget and its tenants live on
//! one Cluster slot (see the [guide](crate::guide::policies#sharing-one-budget-fairly)).
//!
//! In delay mode ([`Mode::Delay`](crate::Mode::Delay)) a request may wait for room in the
//! policy's own rules, never for a share: a refusal for fairness (or by the budget) is answered
//! at once, its `Retry-After` no later than the window's end while shares bind.
//!
//! On the way out, an [`OutboundLayer`](crate::outbound::OutboundLayer) of a policy with a fair
//! share shares its budget among the callers of one vendor: its calls are counted by upstream
//! as always, and the policy's key names each call's caller on the outgoing request (a header
//! your code sets, such as `Key::header("x-tenant")`, or a `UserId` in its extensions; calls it
//! names no caller for share one, `-`). A call past its caller's share waits for the next
//! window within the layer's maximum wait, as any call waits for room.

pub use crate::policy::fair_share::FairShare;
