//! The batch store over Batch custom resources: reads from a watch cache (cheap and
//! current), writes to the API server. Status is written whole by server-side apply,
//! each role under its own field manager, with the resourceVersion it was decided on
//! as a precondition: a write that raced another fails with 409 and is decided again.

use std::sync::Arc;

use async_trait::async_trait;
use futures_util::StreamExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;

use super::conditions::kubernetes_status;
use super::crd::{BatchResource, BatchResourceSpec, PROJECT_LABEL, SOURCE_LABEL, resource_name};
use super::guard::valid_only;
use crate::batches::{Batch, BatchPage, BatchState, BatchStore, StateChange, Status, StoreError, UpdateError};
use crate::ids::{BatchId, ProjectId};
use kube::core::DeserializeGuard;

/// The api's field manager for Batch status (the controller has its own).
pub const API_FIELD_MANAGER: &str = "nightshift-api";

pub struct KubeBatchStore {
    api: Api<BatchResource>,
    namespace: String,
    cache: Store<BatchResource>,
    _watch: JoinHandle<()>,
}

fn backend(error: kube::Error) -> StoreError {
    StoreError::Backend(Box::new(error))
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// Applies `state` as the status of `resource` under `manager`, on the condition that the
/// Batch is still at the resourceVersion it was read at: `Ok(None)` when it changed since
/// (a 409), so that the caller decides again on the newer Batch.
pub async fn apply_status(
    api: &Api<BatchResource>,
    manager: &str,
    resource: &BatchResource,
    state: &BatchState,
) -> Result<Option<BatchResource>, kube::Error> {
    let status = kubernetes_status(state, resource.status.as_ref(), resource.metadata.generation);
    let patch = json!({
        "apiVersion": BatchResource::api_version(&()),
        "kind": BatchResource::kind(&()),
        "metadata": {"name": resource.name_any(), "resourceVersion": resource.resource_version()},
        "status": status,
    });
    let params = PatchParams::apply(manager).force();
    match api.patch_status(&resource.name_any(), &params, &Patch::Apply(&patch)).await {
        Ok(written) => Ok(Some(written)),
        Err(error) if is_conflict(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// A Batch resource as the domain's Batch: `None` for an applied Batch not accepted yet.
/// A resource without status yet (the instant between create and the first status
/// write) reads as `validating`.
pub fn to_batch(resource: &BatchResource) -> Option<Batch> {
    let spec = resource.accepted()?.clone();
    let state = resource.status.clone().unwrap_or_else(|| BatchState::failed(0, Vec::new()));
    let state = match resource.status {
        Some(_) => state,
        None => BatchState { status: Status::Validating, failed_at: None, ..state },
    };
    Some(Batch { spec, state })
}

impl KubeBatchStore {
    /// Starts the watch cache of Batches in `namespace` and waits for its first sync.
    pub async fn start(client: kube::Client, namespace: &str) -> anyhow::Result<Self> {
        let api: Api<BatchResource> = Api::namespaced(client.clone(), namespace);
        let (cache, writer) = reflector::store();
        let guarded =
            watcher(Api::<DeserializeGuard<BatchResource>>::namespaced(client, namespace), watcher::Config::default());
        // The controller reports such a Batch with an Event; here it is only left out.
        let stream = valid_only(guarded.default_backoff(), |object| {
            tracing::warn!(batch = ?object.metadata.name, error = %object.error, "a Batch that does not decode is left alone");
        })
        .reflect(writer)
        .applied_objects();
        let watch = tokio::spawn(async move {
            futures_util::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Err(error) = event {
                    tracing::warn!(%error, "batch watch interrupted; retrying");
                }
            }
        });
        cache.wait_until_ready().await?;
        Ok(Self { api, namespace: namespace.to_owned(), cache, _watch: watch })
    }

    /// The watch cache, for readers that want every Batch (the controller's status).
    pub fn cache(&self) -> &Store<BatchResource> {
        &self.cache
    }

    fn owned_by(resource: &BatchResource, project: &ProjectId) -> bool {
        resource.accepted().is_some_and(|spec| spec.project_id == *project)
    }

    /// The name of the resource that holds batch `id`: its id's spelling for a batch made
    /// through the API, the user's name for an applied one (found in the cache).
    fn name_of(&self, id: &BatchId) -> String {
        let name = resource_name(id);
        if self.cache.get(&ObjectRef::new(&name).within(&self.namespace)).is_some() {
            return name;
        }
        let applied = self.cache.find(|r| r.accepted().is_some_and(|spec| spec.id == *id));
        applied.map(|r| r.name_any()).unwrap_or(name)
    }

    async fn fetch(&self, project: &ProjectId, id: &BatchId) -> Result<Option<BatchResource>, StoreError> {
        let name = self.name_of(id);
        let cached = self.cache.get(&ObjectRef::new(&name).within(&self.namespace));
        let resource = match cached {
            Some(resource) => Some(Arc::unwrap_or_clone(resource)),
            // Not in the cache yet (just created): ask the API server.
            None => self.api.get_opt(&name).await.map_err(backend)?,
        };
        Ok(resource.filter(|r| Self::owned_by(r, project) && r.accepted().is_some_and(|spec| spec.id == *id)))
    }
}

#[async_trait]
impl BatchStore for KubeBatchStore {
    async fn insert(&self, batch: &Batch) -> Result<(), StoreError> {
        let name = resource_name(&batch.spec.id);
        let resource = BatchResource {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(
                    [
                        (PROJECT_LABEL.to_owned(), batch.spec.project_id.to_string()),
                        (SOURCE_LABEL.to_owned(), "api".to_owned()),
                    ]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: BatchResourceSpec::recorded(batch.spec.clone()),
            status: None,
        };
        let mut current = self.api.create(&PostParams::default(), &resource).await.map_err(backend)?;
        // The status subresource ignores status on create: apply it next. The controller
        // may add its finalizer in between (a conflict): it leaves a status-less Batch
        // alone, so re-read and apply again, unless the status-less Batch was recovered.
        loop {
            match apply_status(&self.api, API_FIELD_MANAGER, &current, &batch.state).await.map_err(backend)? {
                Some(_) => return Ok(()),
                None => current = self.api.get(&name).await.map_err(backend)?,
            }
            if current.status.is_some() {
                return Err(StoreError::Superseded(format!(
                    "batch {name} was recovered by the controller before the api wrote its first status"
                )));
            }
        }
    }

    async fn get(&self, project: &ProjectId, id: &BatchId) -> Result<Option<Batch>, StoreError> {
        Ok(self.fetch(project, id).await?.as_ref().and_then(to_batch))
    }

    async fn list(&self, project: &ProjectId, after: Option<&BatchId>, limit: usize) -> Result<BatchPage, StoreError> {
        let mut batches: Vec<Batch> = self
            .cache
            .state()
            .iter()
            .filter(|r| Self::owned_by(r, project))
            .filter_map(|r| to_batch(r))
            .filter(|b| after.is_none_or(|after| b.spec.id < *after))
            .collect();
        batches.sort_by(|a, b| b.spec.id.cmp(&a.spec.id));
        let has_more = batches.len() > limit;
        batches.truncate(limit);
        Ok(BatchPage { batches, has_more })
    }

    async fn update(&self, project: &ProjectId, id: &BatchId, change: StateChange<'_>) -> Result<Batch, UpdateError> {
        let name = self.name_of(id);
        loop {
            // Fresh from the API server: its resourceVersion makes the write a compare-and-swap.
            let resource = self.api.get_opt(&name).await.map_err(backend)?.ok_or(UpdateError::NotFound)?;
            let Some(mut batch) = to_batch(&resource).filter(|b| b.spec.project_id == *project && b.spec.id == *id)
            else {
                return Err(UpdateError::NotFound);
            };
            if !change(&mut batch.state)? {
                return Ok(batch);
            }
            if apply_status(&self.api, API_FIELD_MANAGER, &resource, &batch.state).await.map_err(backend)?.is_some() {
                return Ok(batch);
            }
        }
    }
}
