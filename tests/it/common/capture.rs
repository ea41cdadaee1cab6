//! Log lines captured from `tracing`, for tests that check what is logged and how much.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// Collects everything a subscriber writes.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// A capturing subscriber at `info`, the default on this thread while the guard lives.
    pub fn install() -> (Captured, tracing::subscriber::DefaultGuard) {
        Captured::install_at(tracing::Level::INFO)
    }

    /// A capturing subscriber at `level` that also logs each span as it closes, the default on
    /// this thread while the guard lives.
    pub fn install_at(level: tracing::Level) -> (Captured, tracing::subscriber::DefaultGuard) {
        // tracing caches each call site's interest once, process-wide. With this thread's
        // subscriber the only one registered, a sibling test's thread that has none would
        // register a call site as never logged, and this test would miss its line. With the
        // global subscriber registered as well, a call site's interest is asked of both.
        Captured::global();
        let captured = Captured::default();
        let subscriber = captured.subscriber(level);
        (captured, tracing::subscriber::set_default(subscriber))
    }

    /// The process's capturing subscriber at `info`, for every thread (a multi-threaded runtime,
    /// a store's own tasks): one per test binary, so tests tell their lines apart by policy name.
    pub fn global() -> &'static Captured {
        static GLOBAL: OnceLock<Captured> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let captured = Captured::default();
            tracing::subscriber::set_global_default(captured.subscriber(tracing::Level::INFO))
                .expect("no other global subscriber in this test binary");
            captured
        })
    }

    fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(level)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// The lines written so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|line| line.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
