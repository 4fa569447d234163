//! The controller's side of capacity on demand (`crate::capacity`). Every two seconds,
//! each upstream whose `scale` names a workload is read (replicas asked for, replicas
//! ready), its backlog judged, and its replicas changed through the workload's `scale`
//! subresource when [`scale::decide`] says so, with an Event (`ScaledUp`, `ScaledDown`) on
//! the workload and on the Batch that asked. While lines wait for a replica to become ready, the upstream's
//! grants give them nothing (`super::capacity::Workloads::holds`); after `max_wait` they go out anyway,
//! with a Warning Event on each Batch that waited. Each Batch of the upstream says which in
//! its `CapacityReady` condition.
//!
//! The RBAC it needs is per workload: `get` on it, `get` and `patch` on its `scale`, and
//! `list` on the pods of its namespace, to count the ready ones (`super::rbac::scale_rules`);
//! the chart grants exactly that, for the workloads named.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::Selector;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};

use super::capacity::{self, Seen};
use super::context::{Context, FIELD_MANAGER};
use super::crd::{BatchResource, resource_name};
use super::store::apply_status;
use crate::batches::Condition;
use crate::capacity::backlog::{self, Pending, Serving};
use crate::capacity::scale::{self, Decision, Dispatch, History, Need, Reason, Workload};
use crate::config::{ScaleConfig, WorkloadKind};

const EVERY: Duration = Duration::from_secs(2);

/// An upstream with a workload to scale, in the namespace its `scale` names (or the
/// controller's).
pub struct Scaled {
    pub upstream: String,
    pub scale: ScaleConfig,
    pub namespace: String,
}

impl Scaled {
    /// The upstreams of `configs` that name a workload; `namespace` where none is said.
    pub fn of(configs: &[crate::config::UpstreamConfig], namespace: &str) -> Vec<Self> {
        configs
            .iter()
            .filter_map(|u| {
                let scale = u.scale.clone()?;
                let namespace = scale.namespace.clone().unwrap_or_else(|| namespace.to_owned());
                Some(Self { upstream: u.name.clone(), scale, namespace })
            })
            .collect()
    }
}

/// Scales the workloads of `scaled`, for as long as this controller leads.
pub async fn scale_workloads(ctx: Arc<Context>, batches: Store<BatchResource>, scaled: Vec<Scaled>) {
    if scaled.is_empty() {
        return std::future::pending().await;
    }
    let mut histories: BTreeMap<String, History> = BTreeMap::new();
    loop {
        tokio::time::sleep(EVERY).await;
        let now = crate::clock::now();
        let mut read = BTreeMap::new();
        for one in &scaled {
            match read_workload(&ctx.client, one).await {
                Ok(workload) => {
                    read.insert(one.upstream.clone(), workload);
                }
                Err(error) => tracing::warn!(upstream = %one.upstream, %error, "cannot read the workload to scale"),
            }
        }
        let pending = capacity::pending(&ctx.routes, &batches, now);
        let serving = read.iter().map(|(name, (w, _))| (name.clone(), Serving { in_flight: 0, ready: Some(w.ready) }));
        let report = backlog::report(&pending, &serving.collect(), now);
        for one in &scaled {
            let (Some((workload, reference)), Some(backlog)) =
                (read.get(&one.upstream), report.upstreams.get(&one.upstream))
            else {
                continue;
            };
            let history = histories.entry(one.upstream.clone()).or_default();
            let lines_left = backlog.lines_waiting;
            let had_given_up = ctx.workloads.seen(&one.upstream).is_some_and(|seen| seen.gave_up);
            let max_wait = one.scale.max_wait.as_secs() as i64;
            let dispatch = scale::dispatch(workload.ready, lines_left, max_wait, history, now);
            let gave_up_now = dispatch == Dispatch::GaveUp;
            ctx.workloads.set(&one.upstream, Seen { ready: Some(workload.ready), gave_up: gave_up_now });
            crate::metrics::METRICS.capacity_waiting_of(&one.upstream).set(i64::from(dispatch == Dispatch::Hold));
            if gave_up_now && !had_given_up {
                gave_up(&ctx, &batches, &pending, one).await;
            }
            if lines_left > 0 {
                tell_batches(&ctx, &batches, &pending, one, dispatch, now).await;
            }
            let need = Need {
                lines_left,
                slack: backlog.deadline_slack_seconds,
                replicas: backlog.replicas_needed.unwrap_or(0),
            };
            if let Decision::Scale { to, reason } = scale::decide(need, *workload, one.scale.bounds(), history, now) {
                let asking = earliest(&pending, &one.upstream).and_then(|id| find(&ctx, &batches, id));
                apply(&ctx, one, workload.replicas, to, reason, reference, asking.as_deref()).await;
            }
        }
    }
}

/// The batch of `upstream` with the earliest deadline: the one a change is for.
fn earliest<'a>(pending: &'a [Pending], upstream: &str) -> Option<&'a crate::ids::BatchId> {
    pending.iter().filter(|p| p.upstream == upstream).min_by_key(|p| p.expires_at).map(|p| &p.batch)
}

/// The Batch of `id` in the watch cache (a lookup by name, not a scan).
fn find(ctx: &Context, batches: &Store<BatchResource>, id: &crate::ids::BatchId) -> Option<Arc<BatchResource>> {
    batches.get(&ObjectRef::new(&resource_name(id)).within(&ctx.namespace))
}

/// The workload's replicas as asked for and as ready, and a reference for its Events.
/// Ready ones are counted from its pods, not read from its status: a status lags its
/// pods, and a workload scaled to zero and woken again seconds later still says one
/// ready while that one terminates, so lines would go to a Service with no replica.
async fn read_workload(client: &Client, scaled: &Scaled) -> anyhow::Result<(Workload, ObjectReference)> {
    let (name, namespace) = (&scaled.scale.name, &scaled.namespace);
    let (replicas, selector, reference) = match scaled.scale.kind {
        WorkloadKind::Deployment => {
            let deployment = Api::<Deployment>::namespaced(client.clone(), namespace).get(name).await?;
            let reference = deployment.object_ref(&());
            let spec = deployment.spec.unwrap_or_default();
            (spec.replicas.unwrap_or(1), spec.selector, reference)
        }
        WorkloadKind::StatefulSet => {
            let set = Api::<StatefulSet>::namespaced(client.clone(), namespace).get(name).await?;
            let reference = set.object_ref(&());
            let spec = set.spec.unwrap_or_default();
            (spec.replicas.unwrap_or(1), spec.selector, reference)
        }
    };
    let selector = Selector::try_from(selector)?;
    let pods =
        Api::<Pod>::namespaced(client.clone(), namespace).list(&ListParams::default().labels_from(&selector)).await?;
    Ok((workload(replicas, ready_to_serve(&pods.items)), reference))
}

/// The pods that are ready and not on their way out: the ones a Service sends to.
fn ready_to_serve(pods: &[Pod]) -> u32 {
    let ready = |pod: &&Pod| {
        let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_deref()).unwrap_or_default();
        pod.metadata.deletion_timestamp.is_none() && conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True")
    };
    pods.iter().filter(ready).count() as u32
}

/// At most as many are ready as are asked for: a workload just asked for fewer has not
/// yet marked the pods it will remove.
fn workload(replicas: i32, ready: u32) -> Workload {
    let replicas = replicas.max(0) as u32;
    Workload { replicas, ready: ready.min(replicas) }
}

/// Changes the workload's replicas through its `scale` subresource; says so in Events
/// and the metric.
async fn apply(
    ctx: &Context,
    scaled: &Scaled,
    from: u32,
    to: u32,
    reason: Reason,
    workload: &ObjectReference,
    asking: Option<&BatchResource>,
) {
    let patch = Patch::Merge(serde_json::json!({"spec": {"replicas": to}}));
    let (name, namespace, params) = (&scaled.scale.name, &scaled.namespace, PatchParams::default());
    let result = match scaled.scale.kind {
        WorkloadKind::Deployment => {
            Api::<Deployment>::namespaced(ctx.client.clone(), namespace).patch_scale(name, &params, &patch).await
        }
        WorkloadKind::StatefulSet => {
            Api::<StatefulSet>::namespaced(ctx.client.clone(), namespace).patch_scale(name, &params, &patch).await
        }
    };
    if let Err(error) = result {
        tracing::warn!(upstream = %scaled.upstream, %error, "cannot scale the workload");
        return;
    }
    crate::metrics::METRICS.scaled(&scaled.upstream, reason.as_str());
    let note = format!(
        "{:?}/{name} from {from} to {to} replicas for upstream {}: {}",
        scaled.scale.kind,
        scaled.upstream,
        explain(reason)
    );
    tracing::info!(%note, "scaled");
    // Events of one reason on one object are one series (the first note kept): a change up
    // and one down are told apart by their reason.
    let told = if to > from { "ScaledUp" } else { "ScaledDown" };
    let event = Event {
        type_: EventType::Normal,
        reason: told.into(),
        note: Some(note.clone()),
        action: "Scale".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, workload).await {
        tracing::warn!(%error, "could not publish an event on the workload");
    }
    if let Some(batch) = asking.filter(|_| reason != Reason::Idle) {
        ctx.event(batch, EventType::Normal, told, note).await;
    }
}

fn explain(reason: Reason) -> &'static str {
    match reason {
        Reason::Wake => "batch lines wait and no replica runs",
        Reason::Deadline => "a batch's projected finish passes its window, and more replicas make the pace",
        Reason::Idle => "no batch line left for the cooldown",
        Reason::Floor => "below min_replicas",
    }
}

/// Sets `CapacityReady` on each Batch of `scaled`'s upstream whose condition says
/// otherwise (a status write on a change only; one that lost a race is done next pass).
async fn tell_batches(
    ctx: &Context,
    batches: &Store<BatchResource>,
    pending: &[Pending],
    scaled: &Scaled,
    dispatch: Dispatch,
    now: crate::clock::UnixSeconds,
) {
    let workload = format!("{:?}/{}", scaled.scale.kind, scaled.scale.name);
    let (status, reason, message) = capacity::capacity_condition(dispatch, &workload, scaled.scale.max_wait);
    for waiting in pending.iter().filter(|p| p.upstream == scaled.upstream) {
        let Some(resource) = find(ctx, batches, &waiting.batch) else { continue };
        let Some(state) = resource.status.as_ref() else { continue };
        let current = state.conditions.iter().find(|c| c.type_ == capacity::CAPACITY_READY);
        if current.is_some_and(|c| c.status == status && c.reason == reason) {
            continue;
        }
        let mut state = state.clone();
        state.conditions.retain(|c| c.type_ != capacity::CAPACITY_READY);
        state.conditions.push(Condition {
            type_: capacity::CAPACITY_READY.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.clone(),
            last_transition_time: super::conditions::rfc3339(now),
            observed_generation: resource.metadata.generation,
        });
        if let Err(error) = apply_status(&ctx.batches(), FIELD_MANAGER, &resource, &state).await {
            tracing::warn!(batch = %resource.name_any(), %error, "cannot set the CapacityReady condition");
        }
    }
}

/// A Warning Event on every Batch whose lines waited `max_wait` for a ready replica.
async fn gave_up(ctx: &Context, batches: &Store<BatchResource>, pending: &[Pending], scaled: &Scaled) {
    let note = format!(
        "no replica of {:?}/{} became ready within {:?} (scale.max_wait): its lines are sent anyway",
        scaled.scale.kind, scaled.scale.name, scaled.scale.max_wait
    );
    for waiting in pending.iter().filter(|p| p.upstream == scaled.upstream) {
        if let Some(batch) = find(ctx, batches, &waiting.batch) {
            ctx.event(&batch, EventType::Warning, "CapacityNotReady", note.clone()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: &str, terminating: bool) -> Pod {
        let mut pod =
            serde_json::json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": ready}]}});
        if terminating {
            pod["metadata"]["deletionTimestamp"] = "2026-11-28T11:09:33Z".into();
        }
        serde_json::from_value(pod).unwrap()
    }

    #[test]
    fn pods_on_their_way_out_are_not_ready_to_serve() {
        let starting: Pod = serde_json::from_value(serde_json::json!({"status": {"phase": "Pending"}})).unwrap();
        let pods = [pod("True", false), pod("True", true), pod("False", false), starting];
        assert_eq!(ready_to_serve(&pods), 1, "ready, neither terminating nor starting");
        assert_eq!(ready_to_serve(&[pod("True", true)]), 0, "woken again while the last one terminates");
        assert_eq!(workload(0, 1), Workload { replicas: 0, ready: 0 }, "scaled to zero, its pod not yet marked");
        assert_eq!(workload(1, 2), Workload { replicas: 1, ready: 1 });
        assert_eq!(workload(2, 1), Workload { replicas: 2, ready: 1 }, "one still starting");
        assert_eq!(workload(-1, 0), Workload { replicas: 0, ready: 0 });
    }
}
