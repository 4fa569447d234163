//! What batches have used, as the controller keeps it: each Project's `used_tokens`, and
//! the line and token metrics, counted from the checkpoints the controller's passes read
//! (a worker pod may end before a scrape; its checkpoints stay).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use serde_json::json;

use super::context::{Context, FIELD_MANAGER};
use super::crd::{BatchResource, ProjectResource};
use crate::batches::BatchState;

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
            .filter_map(|b| Some(b.accepted()?.id.to_string()))
            .collect();
        ctx.recorded.keep_only(&unfinished);
        for project in ctx.projects.state() {
            let used: u64 = all
                .iter()
                .filter(|b| b.accepted().is_some_and(|spec| spec.project_id == project.spec.id))
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
