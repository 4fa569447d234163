//! What batches have used, as the controller keeps it: each Project's `used_tokens`, and
//! the line and token metrics, counted from the checkpoints the controller's passes read
//! (a worker pod may end before a scrape; its checkpoints stay).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use serde_json::json;

use super::controller::{Context, FIELD_MANAGER};
use super::crd::{BatchResource, ProjectResource};
use crate::batches::{Batch, BatchState};
use crate::exec::checkpoint::ShardLedger;
use crate::metrics::METRICS;

/// Lines and tokens of a batch's checkpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Recorded {
    completed: u64,
    codes: BTreeMap<String, u64>,
    tokens: u64,
}

impl Recorded {
    fn of(ledgers: &[ShardLedger]) -> Self {
        let mut recorded = Self::default();
        for ledger in ledgers {
            recorded.completed += ledger.completed;
            recorded.tokens += ledger.usage.total_tokens;
            for (code, count) in &ledger.codes {
                *recorded.codes.entry(code.clone()).or_default() += count;
            }
        }
        recorded
    }

    /// What is new since `before`: completed lines, failed ones by code, tokens.
    fn since(&self, before: &Recorded) -> (u64, Vec<(&str, u64)>, u64) {
        let failed = self
            .codes
            .iter()
            .map(|(code, count)| (code.as_str(), count.saturating_sub(before.codes.get(code).copied().unwrap_or(0))))
            .filter(|(_, count)| *count > 0)
            .collect();
        (self.completed.saturating_sub(before.completed), failed, self.tokens.saturating_sub(before.tokens))
    }
}

/// What each unfinished batch's checkpoints held at its last pass, by batch id.
#[derive(Default)]
pub struct RecordedMarks(Mutex<HashMap<String, Recorded>>);

impl RecordedMarks {
    /// Counts into the metrics what a pass finds beyond the last one. A batch seen for
    /// the first time by this process only sets the mark: its earlier lines were counted
    /// by the controller that led then.
    pub fn count(&self, batch: &Batch, ledgers: &[ShardLedger]) {
        let now = Recorded::of(ledgers);
        let before = self.0.lock().expect("recorded").insert(batch.spec.id.to_string(), now.clone());
        if let Some(before) = before {
            let (completed, failed, tokens) = now.since(&before);
            METRICS.recorded(completed, &failed, batch.spec.project_id.as_str(), tokens);
        }
    }

    /// Forgets the batches that are not in `unfinished`.
    fn keep_only(&self, unfinished: &HashSet<String>) {
        self.0.lock().expect("recorded").retain(|id, _| unfinished.contains(id));
    }
}

/// Keeps each Project's `status.used_tokens` equal to the usage of its Batches, and
/// the batch metrics current.
pub async fn sync_project_usage(ctx: Arc<Context>, batches: Store<BatchResource>) {
    let api: Api<ProjectResource> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    loop {
        ticker.tick().await;
        let all = batches.state();
        let states: Vec<BatchState> = all.iter().filter_map(|b| b.status.clone()).collect();
        let queue_depth = states
            .iter()
            .filter(|s| !s.status.is_terminal())
            .map(|s| s.request_counts.total.saturating_sub(s.request_counts.completed + s.request_counts.failed))
            .sum();
        crate::metrics::METRICS.set_batches(states.iter().map(|s| s.status), queue_depth);
        let unfinished: HashSet<String> = all
            .iter()
            .filter(|b| b.status.as_ref().is_some_and(|s| !s.status.is_terminal()))
            .map(|b| b.spec.batch.id.to_string())
            .collect();
        ctx.recorded.keep_only(&unfinished);
        for project in ctx.projects.state() {
            let used: u64 = all
                .iter()
                .filter(|b| b.spec.batch.project_id == project.spec.id)
                .filter_map(|b| b.status.as_ref())
                .map(|s| s.usage.total_tokens)
                .sum();
            if project.status.as_ref().map_or(0, |s| s.used_tokens) == used {
                continue;
            }
            let patch =
                json!({"apiVersion": "nightshift.dev/v1alpha1", "kind": "Project", "status": {"used_tokens": used}});
            let params = PatchParams::apply(FIELD_MANAGER).force();
            if let Err(error) = api.patch_status(&project.name_any(), &params, &Patch::Apply(&patch)).await {
                tracing::warn!(project = %project.name_any(), %error, "could not update project usage");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_pass_finds_beyond_the_last_is_counted_once() {
        let before = Recorded { completed: 3, codes: [("server_error".to_owned(), 1)].into(), tokens: 30 };
        let now = Recorded {
            completed: 5,
            codes: [("server_error".to_owned(), 1), ("rate_limit_exceeded".to_owned(), 2)].into(),
            tokens: 50,
        };
        assert_eq!(now.since(&before), (2, vec![("rate_limit_exceeded", 2)], 20));
        assert_eq!(now.since(&now), (0, vec![], 0), "nothing new, nothing counted");
    }
}
