//! The metrics a layer records, read back from a real Prometheus exporter.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The process's Prometheus recorder (one per test binary; tests keep apart by policy name).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .set_buckets(&[0.001, 0.01, 0.1, 1.0, 10.0])
            .unwrap()
            .install_recorder()
            .expect("no other recorder in this test binary")
    })
}

/// The value of the series `name{labels}` (labels in any order), 0 when it doesn't exist.
pub fn value(name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = prometheus().render();
    let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let matches: Vec<f64> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, label_text) = series.split_once('{').unwrap_or((series, "}"));
            let label_text = label_text.strip_suffix('}')?;
            let have: Vec<&str> = if label_text.is_empty() {
                Vec::new()
            } else {
                label_text.split(',').collect()
            };
            let same = metric == name
                && have.len() == wanted.len()
                && wanted.iter().all(|label| have.contains(&label.as_str()));
            same.then(|| value.parse().expect("a number"))
        })
        .collect();
    assert!(matches.len() <= 1, "{name} {labels:?} matches {matches:?}");
    matches.first().copied().unwrap_or(0.0)
}
