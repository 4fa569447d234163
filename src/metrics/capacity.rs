//! The metrics of capacity on demand (`crate::capacity`): the backlog per upstream and
//! model as the last report had it (the report itself is kept for `/backlog`), lines
//! waiting for a replica, and the controller's changes of replicas.

use std::sync::RwLock;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{UpstreamLabel, registered};
use crate::capacity::backlog::Report;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub upstream: String,
    /// The model every line of a batch names.
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScaleLabels {
    pub upstream: String,
    /// `wake`, `deadline`, `idle` or `floor` (`crate::capacity::scale::Reason`).
    pub reason: &'static str,
}

type Gauges = Family<UpstreamLabel, Gauge>;
type FloatGauges = Family<UpstreamLabel, Gauge<f64, AtomicU64>>;

pub(super) struct Capacity {
    lines: Gauges,
    in_flight: Gauges,
    tokens: Gauges,
    model_lines: Family<ModelLabels, Gauge>,
    model_tokens: Family<ModelLabels, Gauge>,
    pace: FloatGauges,
    pace_needed: FloatGauges,
    pace_ratio: FloatGauges,
    slack: Gauges,
    replicas_ready: Gauges,
    replicas_needed: Gauges,
    waiting: Gauges,
    changes: Family<ScaleLabels, Counter>,
    /// `None` until a report was published (a controller that does not lead publishes none).
    report: RwLock<Option<Report>>,
}

impl Capacity {
    pub(super) fn register(r: &mut Registry) -> Self {
        let mut gauge = |name: &str, help: &str| registered(r, name, help, Gauges::default());
        let lines = gauge("backlog_lines", "Lines of in-progress batches not yet sent, per upstream");
        let in_flight = gauge("backlog_lines_in_flight", "Batch lines in flight at each upstream");
        let tokens = gauge("backlog_tokens", "Tokens the lines left are expected to take (estimated), per upstream");
        let slack = gauge(
            "backlog_deadline_slack_seconds",
            "The least time from a batch's projected finish to its window's end (negative: late)",
        );
        let replicas_ready =
            gauge("backlog_replicas_ready", "Ready replicas of the workload that serves the upstream, where known");
        let replicas_needed = gauge(
            "backlog_replicas_needed",
            "Replicas that would finish every batch inside its window, where the ready ones are known",
        );
        let waiting = gauge(
            "capacity_waiting",
            "1 while an upstream's batch lines wait for a replica of its workload to become ready",
        );
        let mut float = |name: &str, help: &str| registered(r, name, help, FloatGauges::default());
        let pace = float("backlog_pace_lines_per_second", "Batch lines answered per second, per upstream");
        let pace_needed = float(
            "backlog_pace_needed_lines_per_second",
            "The pace at which every batch would finish inside its window",
        );
        let pace_ratio =
            float("backlog_pace_ratio", "The pace needed over the pace (0: nothing left; 1: nothing measured yet)");
        let per_model = "Lines without a record yet, per upstream and model";
        let model_tokens = "Tokens those lines are expected to take, per upstream and model";
        let changes = "Changes of a workload's replicas made by the controller, by upstream and reason";
        Self {
            lines,
            in_flight,
            tokens,
            model_lines: registered(r, "backlog_model_lines", per_model, Family::default()),
            model_tokens: registered(r, "backlog_model_tokens", model_tokens, Family::default()),
            pace,
            pace_needed,
            pace_ratio,
            slack,
            replicas_ready,
            replicas_needed,
            waiting,
            changes: registered(r, "scale_changes", changes, Family::default()),
            report: RwLock::default(),
        }
    }

    /// Sets the gauges from `report` and keeps it. Series of upstreams, models and values
    /// the last report had and this one has not are removed, after the others are set
    /// (clearing first would let a scrape in between see none).
    pub(super) fn publish(&self, report: Report) {
        let upstream_gauges = [&self.lines, &self.in_flight, &self.tokens];
        let optional_gauges = [&self.slack, &self.replicas_ready, &self.replicas_needed];
        let float_gauges = [&self.pace, &self.pace_needed, &self.pace_ratio];
        for (name, upstream) in &report.upstreams {
            let label = UpstreamLabel { upstream: name.clone() };
            let counts = [upstream.lines_waiting, upstream.lines_in_flight, upstream.tokens_waiting];
            for (family, value) in upstream_gauges.iter().zip(counts) {
                family.get_or_create(&label).set(value as i64);
            }
            for (family, value) in float_gauges.iter().zip([upstream.pace, upstream.pace_needed, upstream.pace_ratio]) {
                family.get_or_create(&label).set(value);
            }
            let known = [
                upstream.deadline_slack_seconds,
                upstream.replicas_ready.map(i64::from),
                upstream.replicas_needed.map(i64::from),
            ];
            for (family, value) in optional_gauges.iter().zip(known) {
                if let Some(value) = value {
                    family.get_or_create(&label).set(value);
                } else {
                    family.remove(&label);
                }
            }
            for (model, backlog) in &upstream.models {
                let labels = ModelLabels { upstream: name.clone(), model: model.clone() };
                self.model_lines.get_or_create(&labels).set(backlog.lines_waiting as i64);
                self.model_tokens.get_or_create(&labels).set(backlog.tokens_waiting as i64);
            }
        }
        let mut kept = self.report.write().expect("the backlog report");
        for (name, before) in kept.iter().flat_map(|before| &before.upstreams) {
            let now = report.upstreams.get(name);
            let label = UpstreamLabel { upstream: name.clone() };
            if now.is_none() {
                for family in upstream_gauges.iter().chain(&optional_gauges) {
                    family.remove(&label);
                }
                for family in float_gauges {
                    family.remove(&label);
                }
            }
            for model in before.models.keys().filter(|model| now.is_none_or(|now| !now.models.contains_key(*model))) {
                let labels = ModelLabels { upstream: name.clone(), model: model.clone() };
                self.model_lines.remove(&labels);
                self.model_tokens.remove(&labels);
            }
        }
        *kept = Some(report);
    }

    pub(super) fn report(&self) -> Option<Report> {
        self.report.read().expect("the backlog report").clone()
    }

    pub(super) fn waiting_of(&self, upstream: &str) -> Gauge {
        self.waiting.get_or_create(&UpstreamLabel { upstream: upstream.to_owned() }).clone()
    }

    pub(super) fn scaled(&self, upstream: &str, reason: &'static str) {
        self.changes.get_or_create(&ScaleLabels { upstream: upstream.to_owned(), reason }).inc();
    }
}
