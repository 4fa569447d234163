//! What the unfinished batches need of each upstream: lines and tokens waiting, lines in
//! flight, the pace every batch's window needs against the pace they get, the earliest
//! deadline's slack, and the replicas that would make the pace. Pure.
//!
//! - **Pace** is lines answered per second: each batch's lines with a record over the
//!   time since it went in progress (as its ETA counts them), summed over the upstream's
//!   batches.
//! - **The pace needed** is the least pace at which every batch finishes inside its
//!   window when the earliest deadline goes first: the largest, over the batches by
//!   deadline, of the lines left up to that batch over the time left to its deadline.
//! - **Replicas needed**, where the replicas that serve now are known: those replicas
//!   times the pace needed over the pace (each replica gives the pace it gives now).
//!   Without that number, `pace_ratio` (needed over measured) is the same figure for an
//!   autoscaler that multiplies it by the replicas it sees.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::batches::{BatchSpec, BatchState, Status};
use crate::clock::UnixSeconds;
use crate::ids::BatchId;

/// An input line's bytes per token, for a batch with no answered line yet to count from
/// (a JSONL line's envelope included: a rough figure, and said so in the docs).
const BYTES_PER_TOKEN: f64 = 4.0;

/// One in-progress batch as the backlog counts it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    pub batch: BatchId,
    pub upstream: String,
    /// The model every line names; empty for a batch of several models.
    pub model: String,
    /// Lines without a record yet (waiting or in flight).
    pub lines_left: u64,
    /// The tokens those lines are expected to take.
    pub tokens_left: u64,
    pub expires_at: UnixSeconds,
    /// When the batch is expected to finish, at its pace so far.
    pub eta: Option<UnixSeconds>,
    /// Lines with a record per second since it went in progress.
    pub pace: Option<f64>,
}

impl Pending {
    /// The batch of `spec` and `state` as sent to `upstream`, if it is in progress with
    /// lines left.
    pub fn of(spec: &BatchSpec, state: &BatchState, upstream: &str, now: UnixSeconds) -> Option<Self> {
        if state.status != Status::InProgress || state.ending.is_some() {
            return None;
        }
        let counts = state.request_counts;
        let done = counts.completed + counts.failed;
        let lines_left = counts.total.saturating_sub(done);
        if lines_left == 0 {
            return None;
        }
        let tokens_left = if counts.completed > 0 {
            state.usage.total_tokens as f64 / counts.completed as f64 * lines_left as f64
        } else {
            let bytes: u64 = spec.plan.shards.iter().map(|s| s.byte_end.saturating_sub(s.byte_start)).sum();
            bytes as f64 / BYTES_PER_TOKEN * lines_left as f64 / counts.total.max(1) as f64
        };
        let elapsed = state.in_progress_at.map(|at| now - at).filter(|seconds| *seconds > 0);
        Some(Self {
            batch: spec.id.clone(),
            upstream: upstream.to_owned(),
            model: spec.model.clone().unwrap_or_default(),
            lines_left,
            tokens_left: tokens_left.round() as u64,
            expires_at: spec.expires_at,
            eta: state.estimated_completion_at,
            pace: elapsed.filter(|_| done > 0).map(|seconds| done as f64 / seconds as f64),
        })
    }
}

/// The in-progress batches among `batches` with lines left, each under the upstream
/// `route` names for its model. A batch whose lines name several models is left out:
/// its lines' upstreams are known line by line only.
pub fn pending<'a>(
    batches: impl IntoIterator<Item = (&'a BatchSpec, &'a BatchState)>,
    route: impl Fn(&str) -> Option<String>,
    now: UnixSeconds,
) -> Vec<Pending> {
    batches
        .into_iter()
        .filter_map(|(spec, state)| Pending::of(spec, state, &route(spec.model.as_deref()?)?, now))
        .collect()
}

/// What one upstream's batches need of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct UpstreamBacklog {
    /// Batches in progress with lines left.
    pub batches: u64,
    /// Lines not yet sent.
    pub lines_waiting: u64,
    pub lines_in_flight: u64,
    /// The tokens the lines left are expected to take (from the batches' answered lines,
    /// or their input's size before any).
    pub tokens_waiting: u64,
    /// Lines answered per second, over the batches.
    pub pace: f64,
    /// The pace at which every batch would finish inside its window.
    pub pace_needed: f64,
    /// `pace_needed` over `pace`: 0 with nothing left, 1 while nothing was measured.
    pub pace_ratio: f64,
    /// The least, over the batches, of the time from the projected finish to the
    /// window's end (negative: late); `None` with no batch.
    pub deadline_slack_seconds: Option<i64>,
    /// Replicas of the workload that serves the upstream, ready now, where known.
    pub replicas_ready: Option<u32>,
    /// The replicas that would finish every batch inside its window, where the ready
    /// ones are known.
    pub replicas_needed: Option<u32>,
    pub models: BTreeMap<String, ModelBacklog>,
}

/// One model's share of an upstream's backlog.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ModelBacklog {
    pub batches: u64,
    /// Lines without a record yet, in flight included (in flight is counted per upstream).
    pub lines_waiting: u64,
    pub tokens_waiting: u64,
}

/// The backlog of every upstream, as `/backlog` answers it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    pub upstreams: BTreeMap<String, UpstreamBacklog>,
}

/// What is known of an upstream besides its batches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Serving {
    pub in_flight: u64,
    /// Replicas ready, where the workload that serves it is known.
    pub ready: Option<u32>,
}

/// The report over `pending`, for every upstream in `serving` (an upstream with no
/// batch shows as an empty backlog) and every one a batch names.
pub fn report(pending: &[Pending], serving: &BTreeMap<String, Serving>, now: UnixSeconds) -> Report {
    let mut by_upstream: BTreeMap<&str, Vec<&Pending>> = serving.keys().map(|name| (name.as_str(), vec![])).collect();
    for batch in pending {
        by_upstream.entry(batch.upstream.as_str()).or_default().push(batch);
    }
    let upstreams = by_upstream
        .into_iter()
        .map(|(name, batches)| {
            let serving = serving.get(name).copied().unwrap_or_default();
            (name.to_owned(), upstream(&batches, serving, now))
        })
        .collect();
    Report { upstreams }
}

fn upstream(batches: &[&Pending], serving: Serving, now: UnixSeconds) -> UpstreamBacklog {
    let lines_left: u64 = batches.iter().map(|b| b.lines_left).sum();
    let pace: f64 = batches.iter().filter_map(|b| b.pace).sum();
    let pace_needed = pace_needed(batches, now);
    let pace_ratio = match (lines_left, pace > 0.0) {
        (0, _) => 0.0,
        (_, true) => pace_needed / pace,
        (_, false) => 1.0,
    };
    let mut models: BTreeMap<String, ModelBacklog> = BTreeMap::new();
    for batch in batches {
        let model = models.entry(batch.model.clone()).or_default();
        model.batches += 1;
        model.lines_waiting += batch.lines_left;
        model.tokens_waiting += batch.tokens_left;
    }
    UpstreamBacklog {
        batches: batches.len() as u64,
        lines_waiting: lines_left.saturating_sub(serving.in_flight),
        lines_in_flight: serving.in_flight,
        tokens_waiting: batches.iter().map(|b| b.tokens_left).sum(),
        pace,
        pace_needed,
        pace_ratio,
        deadline_slack_seconds: batches.iter().map(|b| slack(b, pace, now)).min(),
        replicas_ready: serving.ready,
        replicas_needed: serving.ready.map(|ready| replicas_needed(lines_left, ready, pace, pace_needed)),
        models,
    }
}

/// Earliest deadline first: the largest, over the batches by deadline, of the lines
/// left up to it over the seconds left to it (at least one).
fn pace_needed(batches: &[&Pending], now: UnixSeconds) -> f64 {
    let mut by_deadline: Vec<&&Pending> = batches.iter().collect();
    by_deadline.sort_by_key(|b| b.expires_at);
    let mut lines = 0;
    by_deadline
        .iter()
        .map(|batch| {
            lines += batch.lines_left;
            lines as f64 / (batch.expires_at - now).max(1) as f64
        })
        .fold(0.0, f64::max)
}

/// The window's end minus the projected finish: the batch's own ETA, or before it has
/// one, its lines at the upstream's pace, or with nothing measured, the time left.
fn slack(batch: &Pending, upstream_pace: f64, now: UnixSeconds) -> i64 {
    let finish = match batch.eta {
        Some(eta) => eta,
        None if upstream_pace > 0.0 => now + (batch.lines_left as f64 / upstream_pace).ceil() as i64,
        None => now,
    };
    batch.expires_at - finish
}

/// The replicas that give `pace_needed`, each giving what the `ready` ones give now.
/// With lines left, at least one; with nothing measured, the ready ones.
pub fn replicas_needed(lines_left: u64, ready: u32, pace: f64, pace_needed: f64) -> u32 {
    if lines_left == 0 {
        return 0;
    }
    if ready == 0 || pace <= 0.0 {
        return ready.max(1);
    }
    // A pace needed within a thousandth of what the ready replicas give is met by them.
    let replicas = (f64::from(ready) * pace_needed / pace - 1e-3).ceil();
    (replicas.min(f64::from(u32::MAX)) as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::{Batch, RequestCounts, Usage};
    use crate::validate::ShardPlan;

    fn pending(upstream: &str, lines_left: u64, expires_at: i64, pace: Option<f64>, eta: Option<i64>) -> Pending {
        Pending {
            batch: BatchId::generate(),
            upstream: upstream.into(),
            model: "m".into(),
            lines_left,
            tokens_left: lines_left * 10,
            expires_at,
            eta,
            pace,
        }
    }

    fn batch(total: u64, done: u64, tokens: u64, in_progress_at: i64) -> Batch {
        let mut plan = ShardPlan::of_sizes(&[total]);
        plan.shards[0].byte_end = total * 400;
        let mut spec = BatchSpec::sample(plan, 0, 86_400);
        spec.model = Some("llama".into());
        let mut state = BatchState::in_progress(in_progress_at, total);
        state.request_counts = RequestCounts { total, completed: done, failed: 0 };
        state.usage = Usage { total_tokens: tokens, ..Usage::default() };
        Batch { spec, state }
    }

    #[test]
    fn a_batch_counts_its_lines_left_and_their_tokens() {
        // Answered lines give the tokens per line: 2,000 over 10 lines, 90 left.
        let of = |batch: &Batch| Pending::of(&batch.spec, &batch.state, "vllm", 1_010);
        let counted = of(&batch(100, 10, 2_000, 1_000)).expect("in progress");
        assert_eq!((counted.lines_left, counted.tokens_left, counted.pace), (90, 18_000, Some(1.0)));
        assert_eq!((counted.upstream.as_str(), counted.model.as_str()), ("vllm", "llama"));
        // None answered yet: the input's bytes (400 a line) at 4 a token; no pace.
        let fresh = of(&batch(100, 0, 0, 1_000)).expect("in progress");
        assert_eq!((fresh.tokens_left, fresh.pace), (10_000, None));
        // Nothing left, or not in progress: not counted.
        assert_eq!(of(&batch(100, 100, 0, 1_000)), None);
        let mut finalizing = batch(100, 10, 0, 1_000);
        finalizing.state.status = Status::Finalizing;
        assert_eq!(of(&finalizing), None);
    }

    #[test]
    fn the_pace_needed_puts_the_earliest_deadline_first() {
        let now = 0;
        let cases: [(&[Pending], f64); 4] = [
            (&[], 0.0),
            // 100 lines in 100 s.
            (&[pending("u", 100, 100, None, None)], 1.0),
            // The late deadline alone asks 1/s, but the early one 2/s, and both by 200 s
            // only 1.5/s: the early one sets it.
            (&[pending("u", 100, 200, None, None), pending("u", 200, 100, None, None)], 2.0),
            // Both by 100 s: 3/s.
            (&[pending("u", 100, 100, None, None), pending("u", 200, 100, None, None)], 3.0),
        ];
        for (batches, expected) in cases {
            let refs: Vec<&Pending> = batches.iter().collect();
            assert_eq!(pace_needed(&refs, now), expected, "{batches:?}");
        }
        // A deadline past or now counts as one second away, not a division by zero.
        assert_eq!(pace_needed(&[&pending("u", 10, -5, None, None)], now), 10.0);
    }

    #[test]
    fn replicas_needed_scale_the_ready_ones_by_the_pace_needed() {
        let cases = [
            // (lines left, ready, pace, needed, replicas)
            (0, 3, 10.0, 0.0, 0),
            (100, 0, 0.0, 5.0, 1),
            (100, 2, 0.0, 5.0, 2),
            (100, 1, 10.0, 5.0, 1),
            (100, 1, 10.0, 10.0, 1),
            (100, 1, 10.0, 10.5, 2),
            (100, 2, 10.0, 31.0, 7),
            (100, 4, 10.0, 1.0, 1),
        ];
        for (lines, ready, pace, needed, replicas) in cases {
            assert_eq!(replicas_needed(lines, ready, pace, needed), replicas, "{lines} {ready} {pace} {needed}");
        }
    }

    #[test]
    fn the_report_sums_per_upstream_and_per_model() {
        let now = 1_000;
        let mut other = pending("vllm", 50, now + 10, Some(1.0), Some(now + 50));
        other.model = "other".into();
        let batches = [
            pending("vllm", 100, now + 1_000, Some(2.0), Some(now + 50)),
            other,
            pending("llamacpp", 10, now + 100, None, None),
        ];
        let serving = BTreeMap::from([
            ("vllm".to_owned(), Serving { in_flight: 20, ready: Some(2) }),
            ("idle".to_owned(), Serving { in_flight: 0, ready: Some(0) }),
        ]);
        let report = report(&batches, &serving, now);
        let vllm = &report.upstreams["vllm"];
        assert_eq!((vllm.batches, vllm.lines_waiting, vllm.lines_in_flight, vllm.tokens_waiting), (2, 130, 20, 1_500));
        assert_eq!(vllm.pace, 3.0);
        // 50 lines by 10 s: 5/s; 150 by 1,000 s is less.
        assert_eq!((vllm.pace_needed, vllm.pace_ratio), (5.0, 5.0 / 3.0));
        // The batch due in 10 s finishes in 50: 40 s late.
        assert_eq!(vllm.deadline_slack_seconds, Some(-40));
        // Two replicas give 3/s; 5/s takes four.
        assert_eq!((vllm.replicas_ready, vllm.replicas_needed), (Some(2), Some(4)));
        assert_eq!(vllm.models["other"], ModelBacklog { batches: 1, lines_waiting: 50, tokens_waiting: 500 });
        // Nothing measured yet: slack is the time left, the ratio 1, replicas unknown.
        let llamacpp = &report.upstreams["llamacpp"];
        assert_eq!(
            (llamacpp.pace_ratio, llamacpp.deadline_slack_seconds, llamacpp.replicas_needed),
            (1.0, Some(100), None)
        );
        // An upstream with nothing waiting still shows, at zero.
        let idle = &report.upstreams["idle"];
        assert_eq!(
            (idle.batches, idle.pace_ratio, idle.deadline_slack_seconds, idle.replicas_needed),
            (0, 0.0, None, Some(0))
        );
    }
}
