//! [`Meter`]: what a policy's metered rules count (tokens, bytes, money), how much a request
//! reserves when it is admitted, and where its response reports what it used. Public as
//! [`crate::meter`].

use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

/// The units a request reserves, as a request extension: set it in an earlier layer, middleware
/// or extractor that has read the body (a prompt's length, its `max_tokens`), since a layer sees
/// only the request's head. It wins over the meter's [`Meter::estimate`].
///
/// ```
/// use http::Request;
/// use tower_redis_ratelimit::meter::Estimate;
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(Estimate(1_200));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Estimate(pub u64);

/// A request's estimate as a meter computes it.
type EstimateFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// The header a response reports its usage in, as given: a name no header can have is refused
/// when the policy is built.
#[derive(Debug, Clone)]
enum UsageHeader {
    Valid(HeaderName),
    Invalid(String),
}

/// What a policy's metered rules ([`Rule::metered`](crate::Rule::metered)) and a metered quota
/// count: units whose number is known only once the response has ended, such as an LLM call's
/// tokens. A request reserves its estimate when it is admitted (every metered rule must have
/// room for it); when its response has ended and the last clone of its
/// [`Usage`](crate::meter::Usage) is dropped, the units it used settle: what it used less than it
/// reserved goes back to the windows it charged, what it used more is charged on top, past the
/// limit if need be (debt, which later requests wait out).
///
/// ```
/// use tower_redis_ratelimit::meter::Meter;
/// use tower_redis_ratelimit::{Policy, Rule};
///
/// let policy = Policy::builder("llm")
///     .rule(Rule::per_minute(60))
///     .rule(Rule::per_minute(40_000).metered())
///     .meter(
///         Meter::new("tokens")
///             .estimate(|_| 500)
///             .usage_header("x-usage-tokens"),
///     )
///     .build()
///     .unwrap();
/// assert_eq!(&*policy.rule_names()[1], "40000-tokens-per-60s");
/// ```
#[derive(Clone)]
pub struct Meter {
    unit: Arc<str>,
    estimate: Option<EstimateFn>,
    usage_header: Option<UsageHeader>,
    max_usage: Option<u64>,
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter")
            .field("unit", &self.unit)
            .field("estimate", &self.estimate.is_some())
            .field("usage_header", &self.usage_header)
            .field("max_usage", &self.max_usage)
            .finish()
    }
}

impl Meter {
    /// A meter of `unit` ("tokens"): the word names the units in rule names, headers, metrics
    /// and logs, so it is ASCII letters, digits and `_` (checked when the policy is built). A
    /// request reserves 1 unit unless [`Meter::estimate`] says otherwise.
    pub fn new(unit: impl Into<String>) -> Self {
        Meter {
            unit: unit.into().into(),
            estimate: None,
            usage_header: None,
            max_usage: None,
        }
    }

    /// The units a request reserves when it is admitted, from its head. A request's
    /// [`Estimate`] extension wins over it. An estimate above what a metered rule holds (its
    /// limit, or a token bucket's burst) is reserved as that much, since more would never fit.
    pub fn estimate<F>(mut self, estimate: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        self.estimate = Some(Arc::new(estimate));
        self
    }

    /// The response header that reports the units used (set by the handler, or by an upstream
    /// the response was proxied from): a whole number, counted as
    /// [`Usage::record`](crate::meter::Usage::record) would. Any other value is no report
    /// (logged once at WARN). A string or a [`HeaderName`]; a name no header can have is
    /// refused when the policy is built.
    ///
    /// One report counts per request: what the code records wins, and the header counts only
    /// when nothing was recorded (a gateway that forwards its upstream's usage header and also
    /// records from the stream pays once, what it recorded). A request with both is said once,
    /// at WARN.
    pub fn usage_header(mut self, name: impl AsRef<[u8]>) -> Self {
        let name = name.as_ref();
        self.usage_header = Some(match HeaderName::from_bytes(name) {
            Ok(name) => UsageHeader::Valid(name),
            Err(_) => UsageHeader::Invalid(String::from_utf8_lossy(name).into()),
        });
        self
    }

    /// The most one request's report may count (default: the largest limit among the metered
    /// rules and a metered quota). A larger report is counted as this much and logged once at
    /// WARN, so a buggy or hostile report can't lock an identity out for days.
    pub fn max_usage(mut self, units: u64) -> Self {
        self.max_usage = Some(units);
        self
    }

    /// The units this meter counts.
    pub fn unit(&self) -> &str {
        &self.unit
    }

    /// The unit, shared.
    pub(crate) fn unit_arc(&self) -> &Arc<str> {
        &self.unit
    }

    /// The bound given to [`Meter::max_usage`], if any.
    pub(crate) fn max_usage_given(&self) -> Option<u64> {
        self.max_usage
    }

    /// The usage header's name, if it was given one (valid or not).
    pub(crate) fn invalid_usage_header(&self) -> Option<&str> {
        match &self.usage_header {
            Some(UsageHeader::Invalid(name)) => Some(name),
            _ => None,
        }
    }

    /// The header a response reports its usage in.
    pub(crate) fn usage_header_name(&self) -> Option<&HeaderName> {
        match &self.usage_header {
            Some(UsageHeader::Valid(name)) => Some(name),
            _ => None,
        }
    }

    /// A request's estimate: its [`Estimate`] extension, else the meter's function, else 1.
    pub(crate) fn estimate_of(&self, parts: &Parts) -> u64 {
        if let Some(Estimate(units)) = parts.extensions.get::<Estimate>() {
            return *units;
        }
        self.estimate.as_ref().map_or(1, |estimate| estimate(parts))
    }
}
