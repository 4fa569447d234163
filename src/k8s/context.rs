//! What the controller's loops share: the API client, the watch caches, the worker
//! template and the state of the passes in progress.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};

use super::crd::{BatchResource, ProjectResource};
use super::jobs::is_running_worker;
use super::recorded::RecordedMarks;
use crate::config::{Scheduling, WorkerTemplate};
use crate::exec::ExecContext;

/// The field manager of the controller's server-side applies.
pub const FIELD_MANAGER: &str = "nightshift-controller";

pub struct Context {
    pub client: Client,
    pub namespace: String,
    pub exec: Arc<ExecContext>,
    pub worker: WorkerTemplate,
    pub recorder: Recorder,
    pub jobs: Store<Job>,
    /// The Batches' watch cache, for each one's share of the running shards.
    pub batch_cache: Store<BatchResource>,
    pub projects: Store<ProjectResource>,
    /// How the running shards are shared when they are short (`batches.scheduling`).
    pub scheduling: Scheduling,
    /// Batches seen without a status, by uid, and since when (this process's clock).
    pub statusless: Mutex<HashMap<String, Instant>>,
    /// Shard Jobs that may run at once over the installation (`batches.max_running_shards`).
    pub max_running_shards: usize,
    /// Jobs this controller created that its cache may not show yet, and when.
    pub created: Mutex<HashMap<String, Instant>>,
    /// Jobs this controller deleted to stop their workers (a cancel, an expiry), by name.
    pub stopped: Mutex<HashMap<String, Stopped>>,
    /// Held while a Job is created, so that concurrent passes count each other's Jobs.
    pub starting: tokio::sync::Mutex<()>,
    /// What the checkpoints of each unfinished batch held at its last pass, for the line
    /// and token metrics.
    pub recorded: RecordedMarks,
    /// The shares of the running shards, as last allotted.
    pub allotments: Mutex<super::admission::Allotments>,
    /// Which upstream each model goes to, for the backlog.
    pub routes: super::capacity::Routes,
    /// The workloads behind upstreams, as the scaling loop last read them.
    pub workloads: super::capacity::Workloads,
    /// How an applied Batch is checked and planned (`batches:`), as the api does.
    pub batch_settings: crate::batches::BatchSettings,
    /// The buckets applied Batches read their input from and copy their output to.
    pub buckets: crate::storage::buckets::Buckets,
}

/// A Job deleted to stop its worker: the worker finishes the lines it has in flight and
/// commits them before it exits, though its Job is gone from the cache at once.
#[derive(Clone, Debug)]
pub struct Stopped {
    /// The Batch's name.
    pub batch: String,
    pub shard: u32,
    pub at: Instant,
}

/// How long a created Job counts as running before the cache shows it.
const CREATED_UNSEEN: Duration = Duration::from_secs(30);

impl Context {
    /// Shard Jobs that may be running now: started and not finished in the cache, or
    /// just created and not in it yet (once it has them, it says whether they run: a
    /// Job that finished frees its slot at once).
    pub(super) fn running_jobs(&self) -> usize {
        let jobs = self.jobs.state();
        let mut created = self.created.lock().expect("created");
        created.retain(|name, at| at.elapsed() < CREATED_UNSEEN && !jobs.iter().any(|job| job.name_any() == *name));
        jobs.iter().filter(|job| is_running_worker(job)).count() + created.len()
    }

    /// Each Project's weight (1 to 1000), by project id.
    pub fn project_weights(&self) -> HashMap<String, u32> {
        let projects = self.projects.state();
        projects.iter().map(|p| (p.spec.id.to_string(), p.spec.weight.unwrap_or(1).clamp(1, 1000))).collect()
    }

    pub(super) fn batches(&self) -> Api<BatchResource> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    pub(super) fn jobs_api(&self) -> Api<Job> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Tokens `project` may still use, when it has a quota.
    pub fn quota_left(&self, project: &crate::ids::ProjectId) -> Option<u64> {
        let project = self.projects.state().into_iter().find(|p| p.spec.id == *project)?;
        let quota = project.spec.quota?.tokens;
        let used = project.status.as_ref().map_or(0, |s| s.used_tokens);
        Some(quota.saturating_sub(used))
    }

    /// Publishes an Event on `batch` (failures are logged: an Event is worth no retry).
    pub async fn event(&self, batch: &BatchResource, type_: EventType, reason: &str, note: String) {
        let event = Event { type_, reason: reason.into(), note: Some(note), action: reason.into(), secondary: None };
        if let Err(error) = self.recorder.publish(&event, &batch.object_ref(&())).await {
            tracing::warn!(%error, "could not publish an event");
        }
    }
}
