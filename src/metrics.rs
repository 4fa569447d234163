//! Prometheus metrics, one registry per process, served on `/metrics` by the api
//! (and `serve`) and by the controller's probe port. Names are documented in the
//! README and used by the chart's Grafana dashboard.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::batches::Status;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LineLabels {
    /// `completed` or `failed`.
    pub outcome: &'static str,
    /// The error-file code of a failed line; empty for a completed one.
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub method: String,
    /// The matched route (`/v1/files/{file_id}`), never the raw path: ids would
    /// make every request a new series.
    pub route: String,
    pub status: u16,
}

type HistogramFamily = Family<UpstreamLabel, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    pub batches: Family<StatusLabel, Gauge>,
    pub lines: Family<LineLabels, Counter>,
    pub upstream_latency: HistogramFamily,
    pub upstream_retries: Family<UpstreamLabel, Counter>,
    pub queue_depth: Gauge,
    pub http_requests: Family<HttpLabels, Counter>,
    /// `lines{outcome="completed"}`, held apart: it is counted once per line.
    completed_lines: Counter,
}

fn latency_histogram() -> Histogram {
    // 5 ms to ~3 minutes: an instant mock to a long generation.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("nightshift");
        let batches = Family::<StatusLabel, Gauge>::default();
        registry.register("batches", "Batches by status", batches.clone());
        let lines = Family::<LineLabels, Counter>::default();
        registry.register("lines", "Lines recorded, by outcome and error code", lines.clone());
        let upstream_latency: HistogramFamily = Family::new_with_constructor(latency_histogram);
        registry.register(
            "upstream_request_duration_seconds",
            "Time of each attempt of a request to an upstream",
            upstream_latency.clone(),
        );
        let upstream_retries = Family::<UpstreamLabel, Counter>::default();
        registry.register("upstream_retries", "Attempts after the first, per upstream", upstream_retries.clone());
        let queue_depth = Gauge::default();
        registry.register("queue_depth", "Lines of unfinished batches that have no record yet", queue_depth.clone());
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by method, route and status",
            http_requests.clone(),
        );
        let completed_lines = lines.get_or_create(&LineLabels { outcome: "completed", code: "" }).clone();
        Self {
            registry,
            batches,
            lines,
            upstream_latency,
            upstream_retries,
            queue_depth,
            http_requests,
            completed_lines,
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }

    pub fn line_completed(&self) {
        self.completed_lines.inc();
    }

    pub fn line_failed(&self, code: &'static str) {
        self.lines.get_or_create(&LineLabels { outcome: "failed", code }).inc();
    }

    /// The latency histogram of one upstream, for its caller to keep: observing through
    /// the handle costs no label lookup per request.
    pub fn upstream_latency_of(&self, upstream: &str) -> Histogram {
        self.upstream_latency.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub fn upstream_attempt(&self, upstream: &str, took: Duration) {
        self.upstream_latency_of(upstream).observe(took.as_secs_f64());
    }

    pub fn upstream_retry(&self, upstream: &str) {
        self.upstream_retries.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).inc();
    }

    /// Sets the batch gauges from a full count: every status, zero where none.
    pub fn set_batches(&self, statuses: impl Iterator<Item = Status>, queue_depth: u64) {
        let mut counts = std::collections::HashMap::new();
        for status in statuses {
            *counts.entry(status).or_insert(0i64) += 1;
        }
        for status in ALL_STATUSES {
            self.batches
                .get_or_create(&StatusLabel { status: status.as_str() })
                .set(*counts.get(&status).unwrap_or(&0));
        }
        self.queue_depth.set(queue_depth as i64);
    }
}

const ALL_STATUSES: [Status; 8] = [
    Status::Validating,
    Status::Failed,
    Status::InProgress,
    Status::Finalizing,
    Status::Completed,
    Status::Expired,
    Status::Cancelling,
    Status::Cancelled,
];

pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_their_documented_names() {
        let metrics = Metrics::new();
        metrics.line_completed();
        metrics.line_failed("internal_error");
        metrics.upstream_attempt("local", Duration::from_millis(30));
        metrics.upstream_retry("local");
        metrics.set_batches([Status::InProgress, Status::Completed, Status::Completed].into_iter(), 7);
        let text = metrics.encode();
        for expected in [
            "nightshift_lines_total{outcome=\"completed\",code=\"\"} 1",
            "nightshift_lines_total{outcome=\"failed\",code=\"internal_error\"} 1",
            "nightshift_upstream_request_duration_seconds_count{upstream=\"local\"} 1",
            "nightshift_upstream_retries_total{upstream=\"local\"} 1",
            "nightshift_batches{status=\"completed\"} 2",
            "nightshift_batches{status=\"cancelled\"} 0",
            "nightshift_queue_depth 7",
        ] {
            assert!(text.contains(expected), "{expected} missing from:\n{text}");
        }
    }
}
