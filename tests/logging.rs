//! A refused request is logged with its policy, rule, key kind and a non-secret form of the key.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{app, request_from, send};
use http::{HeaderName, HeaderValue, StatusCode};
use tower_redis_ratelimit::{Key, MemoryStore, Policy, Rule};

/// Collects everything the subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_rejection_is_logged_without_the_raw_api_key() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let app = app(
        Policy::builder("partner-api")
            .key(Key::header(HeaderName::from_static("x-api-key")))
            .rule(Rule::per_hour(1))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let request = || {
        let mut request = request_from("203.0.113.10:4000", "/");
        request.headers_mut().insert(
            "x-api-key",
            HeaderValue::from_static("sk_live_very_secret_key"),
        );
        request
    };
    assert_eq!(send(&app, request()).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, request()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = log
        .lines()
        .find(|line| line.contains("request rate limited"))
        .unwrap_or_else(|| panic!("no rejection logged in:\n{log}"));
    assert!(line.contains("policy=\"partner-api\""), "{line}");
    assert!(line.contains("rule=1-per-3600s"), "{line}");
    assert!(line.contains("key_kind=\"header\""), "{line}");
    assert!(line.contains("key=\"header#"), "{line}");
    assert!(!log.contains("sk_live_very_secret_key"), "{log}");
    // Exactly one rejection, one line.
    assert_eq!(log.matches("request rate limited").count(), 1);
}
