//! Quota alerts: what a [`Quota`](crate::Quota) sends when a user reaches a threshold of their
//! daily limit, and how it leaves the request path.
//!
//! The store decides, in the same atomic step as the check, which request reached a threshold
//! first today (one per key, threshold and day, across every app instance). The layer then puts
//! the alert on a bounded queue and goes on at once; a background task hands queued alerts to a
//! [`QuotaNotifier`] one at a time. A notifier that is slow or failing never slows or fails a
//! request: when the queue is full, alerts are dropped, logged and counted ([`AlertStats`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
#[cfg(feature = "webhook")]
use std::time::Duration;

use serde::Serialize;
use tokio::sync::mpsc;

/// The error a notifier reports.
pub type NotifyError = Box<dyn std::error::Error + Send + Sync>;

/// The future a notifier returns.
pub type NotifyFuture<'a> = Pin<Box<dyn Future<Output = Result<(), NotifyError>> + Send + 'a>>;

/// One quota alert: `user` reached `percent` % of their tier's daily `limit` on `day`.
///
/// Serialised as the webhook's JSON body:
/// `{"user": "alice", "tier": "free", "percent": 80, "used": 80, "limit": 100, "day": "2026-11-21"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuotaAlert {
    /// The quota key's identity: the user id (or the client address, an API key's hash) as the
    /// quota's key found it.
    pub user: String,
    /// The request's tier.
    pub tier: String,
    /// The threshold reached, in percent of the limit.
    pub percent: u8,
    /// The day's count after the request that reached it.
    pub used: u64,
    /// The tier's daily limit.
    pub limit: u64,
    /// The day, `YYYY-MM-DD`, at the quota's UTC offset.
    pub day: String,
}

/// Where quota alerts go: a webhook (`WebhookNotifier`, with
/// the `webhook` feature), a mailer, a queue of your own.
///
/// Alerts arrive one at a time, from a background task. An error is logged and counted
/// ([`AlertStats::failed`]); retrying is the notifier's business.
pub trait QuotaNotifier: Send + Sync + 'static {
    /// Delivers one alert.
    fn notify<'a>(&'a self, alert: &'a QuotaAlert) -> NotifyFuture<'a>;
}

/// Where the outcome of each alert is reported besides [`AlertStats`]: `(quota, percent, outcome)`
/// with outcome `sent`, `failed` or `dropped`. The layer that sends the alerts passes its metrics
/// here, so alerts need not know how outcomes are counted.
pub(crate) type AlertReport = fn(quota: &str, percent: u8, outcome: &'static str);

/// Counts of what became of a quota's alerts.
#[derive(Debug, Default)]
pub struct AlertStats {
    /// Alerts the queue took (each then sent or failed).
    queued: AtomicU64,
    sent: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
}

impl AlertStats {
    /// Alerts the notifier delivered.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }

    /// Alerts the notifier gave up on.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// Alerts dropped before the notifier saw them: the queue was full, or there was no tokio
    /// runtime to run the notifier on.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Alerts queued and not yet delivered or given up on: the notifier's backlog. Once every
    /// request that could fire an alert has ended, 0 means the notifier has seen them all (and
    /// `ratelimit_quota_alerts_total` counts each outcome).
    pub fn pending(&self) -> u64 {
        // (Read the outcomes first: an alert is counted queued before it can have one.)
        let done = self.sent() + self.failed();
        self.queued.load(Ordering::Acquire).saturating_sub(done)
    }
}

/// The bounded queue between requests and a notifier.
pub(crate) struct AlertQueue {
    /// The quota's name (the `quota` label of `ratelimit_quota_alerts_total`).
    quota: Arc<str>,
    notifier: Arc<dyn QuotaNotifier>,
    capacity: usize,
    /// Made, with its draining task, by the first alert (which runs on the app's runtime), and
    /// made again should that runtime have shut down.
    sender: Mutex<Option<mpsc::Sender<QuotaAlert>>>,
    stats: Arc<AlertStats>,
}

impl fmt::Debug for AlertQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlertQueue")
            .field("capacity", &self.capacity)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl AlertQueue {
    pub(crate) fn new(quota: &str, notifier: Arc<dyn QuotaNotifier>, capacity: usize) -> Self {
        AlertQueue {
            quota: quota.into(),
            notifier,
            capacity: capacity.max(1),
            sender: Mutex::new(None),
            stats: Arc::default(),
        }
    }

    pub(crate) fn stats(&self) -> &AlertStats {
        &self.stats
    }

    /// Queues `alert` without waiting: a full queue drops it. Its outcome goes to `report` too.
    pub(crate) fn push(&self, alert: QuotaAlert, report: AlertReport) {
        let mut sender = self.sender.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.as_ref().is_none_or(mpsc::Sender::is_closed) {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                drop(sender);
                self.drop_alert(&alert, "no tokio runtime to send it from", report);
                return;
            };
            let (new_sender, receiver) = mpsc::channel(self.capacity);
            runtime.spawn(drain(
                receiver,
                self.notifier.clone(),
                self.stats.clone(),
                self.quota.clone(),
                report,
            ));
            *sender = Some(new_sender);
        }
        // Counted queued before the notifier can see it, so `pending` never misses it.
        self.stats.queued.fetch_add(1, Ordering::AcqRel);
        let result = match sender.as_ref() {
            Some(sender) => sender.try_send(alert),
            None => Err(mpsc::error::TrySendError::Closed(alert)),
        };
        drop(sender);
        let (alert, why) = match result {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(alert)) => (alert, "the alert queue is full"),
            Err(mpsc::error::TrySendError::Closed(alert)) => (alert, "the alert task has stopped"),
        };
        self.stats.queued.fetch_sub(1, Ordering::AcqRel);
        self.drop_alert(&alert, why, report);
    }

    fn drop_alert(&self, alert: &QuotaAlert, why: &str, report: AlertReport) {
        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        report(&self.quota, alert.percent, "dropped");
        tracing::warn!(
            user = %alert.user,
            percent = alert.percent,
            day = %alert.day,
            "quota alert dropped: {why}"
        );
    }
}

/// Hands queued alerts to the notifier, one at a time, until every sender is gone.
async fn drain(
    mut receiver: mpsc::Receiver<QuotaAlert>,
    notifier: Arc<dyn QuotaNotifier>,
    stats: Arc<AlertStats>,
    quota: Arc<str>,
    report: AlertReport,
) {
    while let Some(alert) = receiver.recv().await {
        match notifier.notify(&alert).await {
            // Reported before counted: once `pending` reads 0, the metrics have every outcome.
            Ok(()) => {
                report(&quota, alert.percent, "sent");
                stats.sent.fetch_add(1, Ordering::Release);
            }
            Err(error) => {
                report(&quota, alert.percent, "failed");
                stats.failed.fetch_add(1, Ordering::Release);
                tracing::warn!(
                    user = %alert.user,
                    percent = alert.percent,
                    day = %alert.day,
                    %error,
                    "quota alert not delivered"
                );
            }
        }
    }
}

/// The date (`YYYY-MM-DD`) of `unix_ms` at a fixed UTC offset.
pub(crate) fn date_of(unix_ms: u64, utc_offset_minutes: i32) -> String {
    let local_ms = i128::from(unix_ms) + i128::from(utc_offset_minutes) * 60_000;
    let days = i64::try_from(local_ms.div_euclid(86_400_000)).unwrap_or(0);
    let (year, month, day) = civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Posts each alert as JSON to a URL, with a timeout per attempt and a few retries with
/// exponential backoff. Needs the `webhook` feature. Plain `http://` works out of the box; for
/// `https://`, enable a TLS feature of `reqwest` in your own `Cargo.toml` (features unify).
///
/// ```
/// # #[cfg(feature = "webhook")] {
/// use std::time::Duration;
/// use tower_redis_ratelimit::alert::WebhookNotifier;
///
/// let webhook = WebhookNotifier::new("http://127.0.0.1:9000/alerts")
///     .timeout(Duration::from_secs(2))
///     .retries(3);
/// # }
/// ```
#[cfg(feature = "webhook")]
#[derive(Debug, Clone)]
pub struct WebhookNotifier {
    url: String,
    client: reqwest::Client,
    timeout: Duration,
    retries: u32,
    backoff: Duration,
}

#[cfg(feature = "webhook")]
impl WebhookNotifier {
    /// Posts to `url`; by default each attempt may take 2 s, and a failed one is retried 3 times,
    /// after 100 ms, 200 ms and 400 ms.
    pub fn new(url: impl Into<String>) -> Self {
        WebhookNotifier {
            url: url.into(),
            client: reqwest::Client::new(),
            timeout: Duration::from_secs(2),
            retries: 3,
            backoff: Duration::from_millis(100),
        }
    }

    /// How long one attempt may take.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many times a failed attempt (an error, a timeout, a status other than 2xx) is retried.
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// The wait before the first retry; each later one waits twice as long as the one before.
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    async fn attempt(&self, alert: &QuotaAlert) -> Result<(), NotifyError> {
        let response = self
            .client
            .post(&self.url)
            .timeout(self.timeout)
            .json(alert)
            .send()
            .await?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("webhook answered {status}").into())
        }
    }
}

#[cfg(feature = "webhook")]
impl QuotaNotifier for WebhookNotifier {
    fn notify<'a>(&'a self, alert: &'a QuotaAlert) -> NotifyFuture<'a> {
        Box::pin(async move {
            let mut wait = self.backoff;
            let mut attempt = 0;
            loop {
                match self.attempt(alert).await {
                    Ok(()) => return Ok(()),
                    Err(error) if attempt >= self.retries => return Err(error),
                    Err(error) => {
                        tracing::debug!(%error, attempt, "quota webhook failed; retrying");
                        tokio::time::sleep(wait).await;
                        wait = wait.saturating_mul(2);
                        attempt += 1;
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_at_an_offset() {
        assert_eq!(date_of(0, 0), "1970-01-01");
        assert_eq!(date_of(0, -60), "1969-12-31");
        // 2026-11-21T23:30:00Z
        let late = 1_795_303_800_000;
        assert_eq!(date_of(late, 0), "2026-11-21");
        assert_eq!(date_of(late, 60), "2026-11-22");
        assert_eq!(date_of(late, -5 * 60), "2026-11-21");
        // 2024-02-29T12:00:00Z, a leap day.
        assert_eq!(date_of(1_709_208_000_000, 0), "2024-02-29");
        assert_eq!(date_of(1_709_208_000_000, 13 * 60), "2024-03-01");
    }

    #[test]
    fn alerts_serialise_to_the_webhook_body() {
        let alert = QuotaAlert {
            user: "alice".into(),
            tier: "free".into(),
            percent: 80,
            used: 80,
            limit: 100,
            day: "2026-11-21".into(),
        };
        assert_eq!(
            serde_json::to_string(&alert).unwrap(),
            r#"{"user":"alice","tier":"free","percent":80,"used":80,"limit":100,"day":"2026-11-21"}"#
        );
    }
}
