//! The embedded batch store: every Batch document is a JSON object in storage
//! (`batch-docs/<project>/<batch id>.json`), with an empty marker
//! (`batch-newest/<project>/<marker>`) that lists it newest first ([`newest_first`]).
//!
//! Memory holds only the unfinished batches (the runner drives them) and a count by
//! status; a finished batch is read from storage when asked for, so refused creates and
//! years of finished batches cost disk, not memory. A finished batch is removed
//! [`BatchesConfig::retention`](crate::config::BatchesConfig) after it finished; its
//! tokens stay counted in its project's usage (`batch-usage/<project>.json`), so quotas
//! do not forget them.
//!
//! Writes go to storage first and to memory after, under one lock, so memory never
//! shows a state that a restart would lose. Opening reads every document once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::RwLock;

use super::model::{Batch, Status};
use super::store::{BatchPage, BatchStore, StateChange, StoreError, UpdateError};
use crate::clock::UnixSeconds;
use crate::ids::{BatchId, ProjectId};
use crate::storage::{Key, ObjectStore, StorageError, newest_first, read_page};

const DOCS: &str = "batch-docs";
const NEWEST: &str = "batch-newest";
const USAGE: &str = "batch-usage";

pub struct EmbeddedBatchStore {
    objects: Arc<dyn ObjectStore>,
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    unfinished: HashMap<ProjectId, BTreeMap<BatchId, Batch>>,
    counts: HashMap<Status, u64>,
    /// Tokens of finished batches (present or removed) by project, as of opening.
    settled: HashMap<ProjectId, u64>,
}

impl Inner {
    fn unfinished(&self, project: &ProjectId, id: &BatchId) -> Option<&Batch> {
        self.unfinished.get(project).and_then(|batches| batches.get(id))
    }

    /// Keeps memory in step with a stored document: counted, and held while unfinished.
    fn stored(&mut self, before: Option<Status>, batch: &Batch) {
        if let Some(status) = before {
            self.uncount(status);
        }
        *self.counts.entry(batch.state.status).or_default() += 1;
        let project = &batch.spec.project_id;
        if !batch.state.status.is_terminal() {
            self.unfinished.entry(project.clone()).or_default().insert(batch.spec.id.clone(), batch.clone());
        } else if let Some(batches) = self.unfinished.get_mut(project) {
            batches.remove(&batch.spec.id);
            if batches.is_empty() {
                self.unfinished.remove(project);
            }
        }
    }

    fn uncount(&mut self, status: Status) {
        if let Some(count) = self.counts.get_mut(&status) {
            *count = count.saturating_sub(1);
        }
    }
}

/// What a project's removed batches used, and which were removed last (their documents
/// may still be there after a crash: they are counted here, not again).
#[derive(Debug, Default, Serialize, Deserialize)]
struct RemovedUsage {
    tokens: u64,
    #[serde(default)]
    last_removed: Vec<BatchId>,
}

fn doc_key(project: &ProjectId, id: &BatchId) -> Key {
    Key::from_segments(&[DOCS, project.as_str(), &format!("{id}.json")])
}

fn marker_key(project: &ProjectId, id: &BatchId) -> Key {
    newest_first::marker(NEWEST, project.as_str(), id.as_str()).expect("batch ids are marker-safe")
}

fn usage_key(project: &ProjectId) -> Key {
    Key::from_segments(&[USAGE, &format!("{project}.json")])
}

/// The project and batch a marker key names.
fn marked(key: &Key) -> Option<(ProjectId, BatchId)> {
    let mut segments = key.as_str().split('/').skip(1);
    let project = ProjectId::parse(segments.next()?)?;
    let id = BatchId::parse(&newest_first::id(segments.next()?)?)?;
    Some((project, id))
}

fn decode<T: serde::de::DeserializeOwned>(key: &Key, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes)
        .map_err(|e| StoreError::Storage(StorageError::Corrupt(format!("unreadable document {key}: {e}"))))
}

impl EmbeddedBatchStore {
    /// Opens the store: reads every Batch document once, keeps the unfinished ones, puts
    /// back markers that are missing (documents from before markers), and finishes
    /// removals that a crash interrupted.
    pub async fn open(objects: Arc<dyn ObjectStore>) -> Result<Self, StoreError> {
        let mut inner = Inner::default();
        let mut removed: HashSet<BatchId> = HashSet::new();
        for key in objects.list(&format!("{USAGE}/")).await? {
            let usage: RemovedUsage = decode(&key, &objects.get(&key).await?)?;
            let Some(project) = key.name().strip_suffix(".json").and_then(ProjectId::parse) else { continue };
            *inner.settled.entry(project).or_default() += usage.tokens;
            removed.extend(usage.last_removed);
        }
        let markers: HashSet<Key> = objects.list(&format!("{NEWEST}/")).await?.into_iter().collect();
        let store = Self { objects, inner: RwLock::new(Inner::default()) };
        for key in store.objects.list(&format!("{DOCS}/")).await? {
            let batch: Batch = decode(&key, &store.objects.get(&key).await?)?;
            let (project, id) = (&batch.spec.project_id, &batch.spec.id);
            if removed.contains(id) {
                store.remove(project, id).await?;
                continue;
            }
            if !markers.contains(&marker_key(project, id)) {
                store.objects.put(&marker_key(project, id), Bytes::new()).await?;
            }
            if batch.state.status.is_terminal() {
                *inner.settled.entry(project.clone()).or_default() += batch.state.usage.total_tokens;
            }
            inner.stored(None, &batch);
        }
        *store.inner.write().await = inner;
        Ok(store)
    }

    async fn persist(&self, batch: &Batch) -> Result<(), StoreError> {
        let json = serde_json::to_vec(batch).expect("batches serialize");
        self.objects.put(&doc_key(&batch.spec.project_id, &batch.spec.id), Bytes::from(json)).await?;
        Ok(())
    }

    /// The stored document, if any.
    async fn read(&self, project: &ProjectId, id: &BatchId) -> Result<Option<Batch>, StoreError> {
        let key = doc_key(project, id);
        match self.objects.get(&key).await {
            Ok(bytes) => decode(&key, &bytes).map(Some),
            Err(StorageError::NotFound(_)) => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    /// Removes a batch's document, then its marker.
    async fn remove(&self, project: &ProjectId, id: &BatchId) -> Result<(), StoreError> {
        self.objects.delete(&doc_key(project, id)).await?;
        self.objects.delete(&marker_key(project, id)).await?;
        Ok(())
    }

    /// Tokens used by each project's finished batches as of opening, and by each
    /// unfinished batch: for the quota ledger at startup.
    pub async fn usage(&self) -> (HashMap<ProjectId, u64>, Vec<(ProjectId, BatchId, u64)>) {
        let inner = self.inner.read().await;
        let unfinished = inner
            .unfinished
            .values()
            .flat_map(|b| b.values())
            .map(|b| (b.spec.project_id.clone(), b.spec.id.clone(), b.state.usage.total_tokens))
            .collect();
        (inner.settled.clone(), unfinished)
    }

    /// How many batches are in each status, and how many lines of unfinished batches
    /// have no record.
    pub async fn status_summary(&self) -> (HashMap<Status, u64>, u64) {
        let inner = self.inner.read().await;
        let queue = inner
            .unfinished
            .values()
            .flat_map(|b| b.values())
            .map(|b| {
                let counts = b.state.request_counts;
                counts.total.saturating_sub(counts.completed + counts.failed)
            })
            .sum();
        (inner.counts.clone(), queue)
    }

    /// Every batch of every project that is not terminal yet.
    pub async fn unfinished(&self) -> Vec<Batch> {
        let inner = self.inner.read().await;
        inner.unfinished.values().flat_map(|b| b.values()).cloned().collect()
    }

    /// Removes every batch that finished before `cutoff`, keeping its tokens in its
    /// project's usage, and returns how many went. Only batches made before `cutoff`
    /// can qualify, and their ids say when they were made, so only those are read.
    pub async fn remove_finished_before(&self, cutoff: UnixSeconds) -> Result<usize, StoreError> {
        let mut candidates: BTreeMap<ProjectId, Vec<BatchId>> = BTreeMap::new();
        for key in self.objects.list(&format!("{NEWEST}/")).await? {
            let Some((project, id)) = marked(&key) else { continue };
            if id.created_at().is_none_or(|created| created < cutoff) {
                candidates.entry(project).or_default().push(id);
            }
        }
        let mut total = 0;
        for (project, ids) in candidates {
            let mut going = Vec::new();
            let mut tokens = 0;
            for id in ids {
                if self.inner.read().await.unfinished(&project, &id).is_some() {
                    continue;
                }
                match self.read(&project, &id).await? {
                    // A marker whose document was never written (a create killed in between).
                    None => self.objects.delete(&marker_key(&project, &id)).await?,
                    Some(batch) if batch.state.finished_at().is_some_and(|at| at < cutoff) => {
                        tokens += batch.state.usage.total_tokens;
                        going.push((id, batch.state.status));
                    }
                    Some(_) => {}
                }
            }
            if going.is_empty() {
                continue;
            }
            // Counted first, removed after: a crash in between is finished by the next
            // open, and nothing is counted twice or lost.
            let key = usage_key(&project);
            let mut usage: RemovedUsage = match self.objects.get(&key).await {
                Ok(bytes) => decode(&key, &bytes)?,
                Err(StorageError::NotFound(_)) => RemovedUsage::default(),
                Err(error) => return Err(error.into()),
            };
            for id in &usage.last_removed {
                self.remove(&project, id).await?;
            }
            usage.tokens += tokens;
            usage.last_removed = going.iter().map(|(id, _)| id.clone()).collect();
            self.objects.put(&key, Bytes::from(serde_json::to_vec(&usage).expect("usage serializes"))).await?;
            for (id, status) in &going {
                self.remove(&project, id).await?;
                self.inner.write().await.uncount(*status);
            }
            total += going.len();
        }
        Ok(total)
    }
}

#[async_trait]
impl BatchStore for EmbeddedBatchStore {
    async fn insert(&self, batch: &Batch) -> Result<(), StoreError> {
        let mut inner = self.inner.write().await;
        // The marker first: one without its document is skipped by listings.
        self.objects.put(&marker_key(&batch.spec.project_id, &batch.spec.id), Bytes::new()).await?;
        self.persist(batch).await?;
        inner.stored(None, batch);
        Ok(())
    }

    async fn get(&self, project: &ProjectId, id: &BatchId) -> Result<Option<Batch>, StoreError> {
        if let Some(batch) = self.inner.read().await.unfinished(project, id) {
            return Ok(Some(batch.clone()));
        }
        self.read(project, id).await
    }

    async fn list(&self, project: &ProjectId, after: Option<&BatchId>, limit: usize) -> Result<BatchPage, StoreError> {
        let prefix = newest_first::prefix(NEWEST, project.as_str());
        let cursor = after.map(|after| marker_key(project, after).to_string());
        let (batches, has_more) = read_page(self.objects.as_ref(), &prefix, cursor, limit, |key| async move {
            match marked(&key) {
                Some((_, id)) => self.get(project, &id).await,
                None => Ok(None),
            }
        })
        .await?;
        Ok(BatchPage { batches, has_more })
    }

    async fn update(&self, project: &ProjectId, id: &BatchId, change: StateChange<'_>) -> Result<Batch, UpdateError> {
        let mut inner = self.inner.write().await;
        let current = match inner.unfinished(project, id) {
            Some(batch) => batch.clone(),
            None => self.read(project, id).await?.ok_or(UpdateError::NotFound)?,
        };
        let before = current.state.status;
        let mut next = current;
        if !change(&mut next.state)? {
            return Ok(next);
        }
        self.persist(&next).await?;
        inner.stored(Some(before), &next);
        Ok(next)
    }
}
