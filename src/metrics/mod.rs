//! Prometheus metrics, one registry per process, served on `/metrics` by the api
//! (and `serve`), by the controller's probe port and by worker pods. Names are
//! documented in docs/src/metrics.md and used by the chart's Grafana dashboard.
//!
//! Lines and tokens are counted where they are recorded: live by the process that runs
//! the lines in `serve`; on Kubernetes by the controller, from the checkpoints its
//! passes read (a worker pod may end before a scrape; its checkpoints stay), while
//! worker pods serve the upstream latencies and retries.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

mod capacity;

use crate::batches::Status;
use crate::capacity::backlog::Report;

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
pub struct ReasonLabel {
    /// A closed set, named where the metric is counted.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SignalLabels {
    pub upstream: String,
    /// The preset it is read with (`vllm`, `sglang`, `llamacpp`, `trtllm`, `dynamo`, `tgi`).
    pub server: &'static str,
    /// `configured`, or `found` beside the server's API.
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SignalFailureLabels {
    pub upstream: String,
    /// `unreachable`, `invalid` or `stale`: a closed set.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProjectLabel {
    pub project: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// One of the known methods, or `other`.
    pub method: &'static str,
    /// The matched route template, or `unmatched`: never the raw path.
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// One of the known methods, or `other`.
    pub method: &'static str,
    /// The matched route (`/v1/files/{file_id}`), never the raw path: ids would
    /// make every request a new series.
    pub route: String,
    pub status: u16,
}

type HistogramFamily = Family<UpstreamLabel, Histogram, fn() -> Histogram>;
type RouteHistogramFamily = Family<RouteLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    pub batches: Family<StatusLabel, Gauge>,
    pub lines: Family<LineLabels, Counter>,
    pub upstream_latency: HistogramFamily,
    pub upstream_retries: Family<UpstreamLabel, Counter>,
    /// Connections an upstream refused that its lines waited out (not counted as attempts).
    pub upstream_refusals: Family<UpstreamLabel, Counter>,
    pub queue_depth: Gauge,
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_duration: RouteHistogramFamily,
    pub tokens: Family<ProjectLabel, Counter>,
    pub commit_retries: Counter,
    /// Webhook delivery attempts, by outcome (`delivered`, `failed`, `refused`, `gave_up`).
    pub webhook_deliveries: Family<OutcomeLabel, Counter>,
    pub webhook_events_pending: Gauge,
    pub superseded_runs: Counter,
    /// 1 for each upstream whose load signal is read, with its preset and whether it was
    /// configured or found.
    pub load_signal_info: Family<SignalLabels, Gauge>,
    /// Load-signal reads that failed, per upstream (batches went on without them).
    pub load_signal_failures: Family<SignalFailureLabels, Counter>,
    /// The requests in flight an upstream is allowed now (adaptive, under the ceiling).
    pub concurrency_limit: Family<UpstreamLabel, Gauge>,
    /// 1 while batch dispatch to an upstream holds for its interactive traffic.
    pub dispatch_held: Family<UpstreamLabel, Gauge>,
    /// Batch lines taken back from an upstream's queue when its users came.
    pub lines_taken_back: Family<UpstreamLabel, Counter>,
    pub reconciles: Reconciles,
    /// What the unfinished batches need of each upstream (`crate::capacity`).
    backlog: capacity::Capacity,
    /// `lines{outcome="completed"}`, held apart: it is counted once per line.
    completed_lines: Counter,
    /// Whether this process counts lines and tokens as they are recorded (not on
    /// Kubernetes, where the controller counts them from checkpoints).
    live: AtomicBool,
}

fn latency_histogram() -> Histogram {
    // 5 ms to ~11 minutes: an instant mock to a generation that takes the whole default
    // upstream timeout (10 minutes).
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

fn http_histogram() -> Histogram {
    // 1 ms to ~65 s: a listing to a 100 MB upload.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The controller's passes over a Batch: how long each took, and those that failed, by
/// reason (`kube`, `exec`, `storage`, `finalizer`).
pub struct Reconciles {
    pub duration: Histogram,
    pub errors: Family<ReasonLabel, Counter>,
}

impl Reconciles {
    fn register(registry: &mut Registry) -> Self {
        let pass = "Time of each of the controller's passes over a Batch";
        let failed = "The controller's passes over a Batch that failed, by reason";
        Self {
            duration: registered(registry, "reconcile_duration_seconds", pass, http_histogram()),
            errors: registered(registry, "reconcile_errors", failed, Family::default()),
        }
    }
}

/// The attempts of requests to each upstream: their times, the retries, and the
/// refused connections that were not attempts.
fn register_attempts(
    r: &mut Registry,
) -> (HistogramFamily, Family<UpstreamLabel, Counter>, Family<UpstreamLabel, Counter>) {
    let attempt = "Time of each attempt of a request to an upstream";
    let retries = "Attempts after the first, per upstream";
    let refused = "Connections an upstream refused that its lines waited out, not counted as attempts";
    (
        registered(r, "upstream_request_duration_seconds", attempt, Family::new_with_constructor(latency_histogram)),
        registered(r, "upstream_retries", retries, Family::default()),
        registered(r, "upstream_refusals", refused, Family::default()),
    )
}

/// The night shift's metrics per upstream: load-signal failures, the limit now,
/// whether dispatch holds, and the lines taken back for users.
#[allow(clippy::type_complexity)]
fn register_night_shift(
    r: &mut Registry,
) -> (
    Family<SignalFailureLabels, Counter>,
    Family<UpstreamLabel, Gauge>,
    Family<UpstreamLabel, Gauge>,
    Family<UpstreamLabel, Counter>,
) {
    let failures = "Reads of an upstream's load signal that failed, timed out, made no sense or were set aside as stale (batches go on without it)";
    let limit = "Requests in flight an upstream is allowed now: the adaptive limit under max_concurrency (a worker pod: its grant), and the load signal's cap under that";
    let held = "1 while an upstream's load signal says requests queue at it: batch dispatch backs off";
    let taken_back = "Batch lines taken back from an upstream's queue when its users came, to be sent again later";
    (
        registered(r, "load_signal_failures", failures, Family::default()),
        registered(r, "upstream_concurrency_limit", limit, Family::default()),
        registered(r, "upstream_dispatch_held", held, Family::default()),
        registered(r, "lines_taken_back", taken_back, Family::default()),
    )
}

/// `metric`, registered under `name` (after the `nightshift_` prefix) with `help`.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("nightshift");
        let r = &mut registry;
        let batches = registered(r, "batches", "Batches by status", Family::default());
        let lines: Family<LineLabels, Counter> =
            registered(r, "lines", "Lines recorded, by outcome and error code", Family::default());
        let completed_lines = lines.get_or_create(&LineLabels { outcome: "completed", code: "" }).clone();
        let (upstream_latency, upstream_retries, upstream_refusals) = register_attempts(r);
        let queued = "Lines of unfinished batches that have no record yet";
        let queue_depth = registered(r, "queue_depth", queued, Gauge::default());
        let answered = "HTTP requests answered, by method, route and status";
        let http_requests = registered(r, "http_requests", answered, Family::default());
        let timed = "Time to answer an HTTP request, by method and route";
        let http_duration: RouteHistogramFamily =
            registered(r, "http_request_duration_seconds", timed, Family::new_with_constructor(http_histogram));
        let tokens = registered(r, "tokens", "Tokens used by recorded lines, by project", Family::default());
        let retried = "Shard commits tried again because storage failed (dispatch pauses meanwhile)";
        let commit_retries = registered(r, "commit_retries", retried, Counter::default());
        let superseded = "Shard runs that stopped because a newer run claimed their shard";
        let superseded_runs = registered(r, "superseded_runs", superseded, Counter::default());
        let deliveries = "Webhook delivery attempts by outcome: delivered, failed (retried later), refused (an internal target), gave_up (events)";
        let webhook_deliveries = registered(r, "webhook_deliveries", deliveries, Family::default());
        let pending = "Webhook events not yet delivered to every endpoint, as of the last pass";
        let webhook_events_pending = registered(r, "webhook_events_pending", pending, Gauge::default());
        let (load_signal_failures, concurrency_limit, dispatch_held, lines_taken_back) = register_night_shift(r);
        let read = "1 for each upstream whose load signal is read: the preset it is read with, and whether it was configured or found beside the server's API";
        let load_signal_info = registered(r, "load_signal_info", read, Family::default());
        let reconciles = Reconciles::register(r);
        let backlog = capacity::Capacity::register(r);
        let build = "The running build: 1, labelled with its version";
        let build_info: Family<BuildLabels, Gauge> = registered(r, "build_info", build, Family::default());
        build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        Self {
            registry,
            batches,
            lines,
            upstream_latency,
            upstream_retries,
            upstream_refusals,
            queue_depth,
            http_requests,
            http_duration,
            tokens,
            commit_retries,
            webhook_deliveries,
            webhook_events_pending,
            superseded_runs,
            load_signal_info,
            load_signal_failures,
            concurrency_limit,
            dispatch_held,
            lines_taken_back,
            reconciles,
            backlog,
            completed_lines,
            live: AtomicBool::new(true),
        }
    }

    pub fn webhook_delivered(&self) {
        self.webhook_deliveries.get_or_create(&OutcomeLabel { outcome: "delivered" }).inc();
    }

    pub fn webhook_failed(&self) {
        self.webhook_deliveries.get_or_create(&OutcomeLabel { outcome: "failed" }).inc();
    }

    pub fn webhook_refused(&self) {
        self.webhook_deliveries.get_or_create(&OutcomeLabel { outcome: "refused" }).inc();
    }

    pub fn webhook_gave_up(&self) {
        self.webhook_deliveries.get_or_create(&OutcomeLabel { outcome: "gave_up" }).inc();
    }

    /// From now on, lines and tokens are counted from checkpoints ([`Metrics::recorded`]),
    /// not as this process records them.
    pub fn count_from_checkpoints(&self) {
        self.live.store(false, Ordering::Relaxed);
    }

    fn is_live(&self) -> bool {
        self.live.load(Ordering::Relaxed)
    }

    /// Counts lines and tokens found in checkpoints: `completed` more completed lines,
    /// failed ones by code (the spec's fixed vocabulary, or `unknown`), `tokens` more
    /// tokens of `project`.
    pub fn recorded(&self, completed: u64, failed: &[(&'static str, u64)], project: &str, tokens: u64) {
        self.completed_lines.inc_by(completed);
        for (code, count) in failed {
            self.lines.get_or_create(&LineLabels { outcome: "failed", code }).inc_by(*count);
        }
        if tokens > 0 {
            self.tokens.get_or_create(&ProjectLabel { project: project.to_owned() }).inc_by(tokens);
        }
    }

    /// A line of `project` recorded by this process used `tokens`.
    pub fn tokens_used(&self, project: &str, tokens: u64) {
        if self.is_live() && tokens > 0 {
            self.tokens.get_or_create(&ProjectLabel { project: project.to_owned() }).inc_by(tokens);
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }

    pub fn line_completed(&self) {
        if self.is_live() {
            self.completed_lines.inc();
        }
    }

    pub fn line_failed(&self, code: &'static str) {
        if self.is_live() {
            self.lines.get_or_create(&LineLabels { outcome: "failed", code }).inc();
        }
    }

    /// The latency histogram of one upstream, for its caller to keep: observing through
    /// the handle costs no label lookup per request.
    pub fn upstream_latency_of(&self, upstream: &str) -> Histogram {
        self.upstream_latency.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub fn upstream_attempt(&self, upstream: &str, took: Duration) {
        self.upstream_latency_of(upstream).observe(took.as_secs_f64());
    }

    /// Failed or set-aside readings of an upstream's load signal, by `reason`
    /// (`unreachable`, `invalid`, `stale`).
    /// Says that `upstream`'s load signal is read with `server`'s preset, from `source`.
    pub fn load_signal_read(&self, upstream: &str, server: &'static str, source: &'static str) {
        let labels = SignalLabels { upstream: upstream.to_owned(), server, source };
        self.load_signal_info.get_or_create(&labels).set(1);
    }

    pub fn load_signal_failures_of(&self, upstream: &str, reason: &'static str) -> Counter {
        self.load_signal_failures.get_or_create(&SignalFailureLabels { upstream: upstream.to_owned(), reason }).clone()
    }

    pub fn concurrency_limit_of(&self, upstream: &str) -> Gauge {
        self.concurrency_limit.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub fn dispatch_held_of(&self, upstream: &str) -> Gauge {
        self.dispatch_held.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub fn upstream_retry(&self, upstream: &str) {
        self.upstream_retries.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).inc();
    }

    pub fn upstream_refused(&self, upstream: &str) {
        self.upstream_refusals.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).inc();
    }

    pub fn line_taken_back(&self, upstream: &str) {
        self.lines_taken_back.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).inc();
    }

    /// Sets the backlog's gauges from `report`, and keeps it for [`Metrics::backlog`].
    pub fn publish_backlog(&self, report: Report) {
        self.backlog.publish(report);
    }

    /// Whether `upstream`'s lines wait for a replica: 1 or 0.
    pub fn capacity_waiting_of(&self, upstream: &str) -> Gauge {
        self.backlog.waiting_of(upstream)
    }

    /// The controller changed the replicas of `upstream`'s workload, for `reason`.
    pub fn scaled(&self, upstream: &str, reason: &'static str) {
        self.backlog.scaled(upstream, reason);
    }

    /// The last backlog report published; `None` before the first.
    pub fn backlog(&self) -> Option<Report> {
        self.backlog.report()
    }

    /// Sets the batch gauges from a full count: every status, zero where none.
    pub fn set_batches(&self, statuses: impl Iterator<Item = Status>, queue_depth: u64) {
        let mut counts = std::collections::HashMap::new();
        for status in statuses {
            *counts.entry(status).or_insert(0) += 1;
        }
        self.set_batch_counts(&counts, queue_depth);
    }

    /// As [`Metrics::set_batches`], from a count by status.
    pub fn set_batch_counts(&self, counts: &std::collections::HashMap<Status, u64>, queue_depth: u64) {
        for status in ALL_STATUSES {
            let count = counts.get(&status).copied().unwrap_or(0);
            self.batches.get_or_create(&StatusLabel { status: status.as_str() }).set(count as i64);
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
        metrics.upstream_refused("local");
        metrics.line_taken_back("local");
        metrics.set_batches([Status::InProgress, Status::Completed, Status::Completed].into_iter(), 7);
        metrics.tokens_used("p1", 12);
        metrics.http_duration.get_or_create(&RouteLabels { method: "GET", route: "/v1/files".into() }).observe(0.002);
        let text = metrics.encode();
        for expected in [
            "nightshift_lines_total{outcome=\"completed\",code=\"\"} 1",
            "nightshift_lines_total{outcome=\"failed\",code=\"internal_error\"} 1",
            "nightshift_upstream_request_duration_seconds_count{upstream=\"local\"} 1",
            "nightshift_upstream_retries_total{upstream=\"local\"} 1",
            "nightshift_upstream_refusals_total{upstream=\"local\"} 1",
            "nightshift_lines_taken_back_total{upstream=\"local\"} 1",
            "nightshift_batches{status=\"completed\"} 2",
            "nightshift_batches{status=\"cancelled\"} 0",
            "nightshift_queue_depth 7",
            "nightshift_tokens_total{project=\"p1\"} 12",
            "nightshift_build_info{version=\"0.1.0\"} 1",
            "nightshift_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/files\"} 1",
            // Upstream latency buckets reach the default upstream timeout (600 s).
            "nightshift_upstream_request_duration_seconds_bucket{le=\"655.36\",upstream=\"local\"} 1",
        ] {
            assert!(text.contains(expected), "{expected} missing from:\n{text}");
        }
    }

    #[test]
    fn counting_from_checkpoints_replaces_live_counting() {
        let metrics = Metrics::new();
        metrics.count_from_checkpoints();
        metrics.line_completed();
        metrics.line_failed("internal_error");
        metrics.tokens_used("p1", 5);
        metrics.recorded(3, &[("rate_limit_exceeded", 2), ("unknown", 1)], "p1", 30);
        let text = metrics.encode();
        for expected in [
            "nightshift_lines_total{outcome=\"completed\",code=\"\"} 3",
            "nightshift_lines_total{outcome=\"failed\",code=\"rate_limit_exceeded\"} 2",
            "nightshift_lines_total{outcome=\"failed\",code=\"unknown\"} 1",
            "nightshift_tokens_total{project=\"p1\"} 30",
        ] {
            assert!(text.contains(expected), "{expected} missing from:\n{text}");
        }
        assert!(!text.contains("code=\"internal_error\""), "live counts are off:\n{text}");
    }
}
