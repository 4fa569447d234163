//! The embedded batch store: every Batch document is a JSON object in storage
//! (`batch-docs/<project>/<batch id>.json`), mirrored in memory for reads.
//!
//! Writes go to storage first and to memory after, under one lock, so memory never
//! shows a state that a restart would lose.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::RwLock;

use super::model::Batch;
use super::store::{BatchPage, BatchStore, StateChange, StoreError, UpdateError};
use crate::ids::{BatchId, ProjectId};
use crate::storage::{Key, ObjectStore};

const PREFIX: &str = "batch-docs/";

pub struct EmbeddedBatchStore {
    objects: Arc<dyn ObjectStore>,
    batches: RwLock<HashMap<ProjectId, BTreeMap<BatchId, Batch>>>,
}

fn key(batch: &Batch) -> Key {
    Key::from_segments(&["batch-docs", batch.spec.project_id.as_str(), &format!("{}.json", batch.spec.id)])
}

impl EmbeddedBatchStore {
    /// Opens the store, reading every Batch document into memory.
    pub async fn open(objects: Arc<dyn ObjectStore>) -> Result<Self, StoreError> {
        let mut batches: HashMap<ProjectId, BTreeMap<BatchId, Batch>> = HashMap::new();
        for key in objects.list(PREFIX).await? {
            let bytes = objects.get(&key).await?;
            let batch: Batch = serde_json::from_slice(&bytes)
                .map_err(|e| StoreError::Backend(format!("unreadable batch document {key}: {e}")))?;
            batches.entry(batch.spec.project_id.clone()).or_default().insert(batch.spec.id.clone(), batch);
        }
        Ok(Self { objects, batches: RwLock::new(batches) })
    }

    async fn persist(&self, batch: &Batch) -> Result<(), StoreError> {
        let json = serde_json::to_vec(batch).expect("batches serialize");
        self.objects.put(&key(batch), Bytes::from(json)).await?;
        Ok(())
    }

    /// Every batch's token usage as last stored, for the quota ledger at startup.
    pub async fn usage(&self) -> Vec<(ProjectId, BatchId, u64)> {
        let batches = self.batches.read().await;
        batches
            .values()
            .flat_map(|b| b.values())
            .map(|b| (b.spec.project_id.clone(), b.spec.id.clone(), b.state.usage.total_tokens))
            .collect()
    }

    /// Every batch's status, and how many lines of unfinished batches have no record.
    pub async fn status_summary(&self) -> (Vec<super::Status>, u64) {
        let batches = self.batches.read().await;
        let all = batches.values().flat_map(|b| b.values());
        let statuses = all.clone().map(|b| b.state.status).collect();
        let queue = all
            .filter(|b| !b.state.status.is_terminal())
            .map(|b| {
                let counts = b.state.request_counts;
                counts.total.saturating_sub(counts.completed + counts.failed)
            })
            .sum();
        (statuses, queue)
    }

    /// Every batch of every project that is not terminal yet.
    pub async fn unfinished(&self) -> Vec<Batch> {
        let batches = self.batches.read().await;
        batches.values().flat_map(|b| b.values()).filter(|b| !b.state.status.is_terminal()).cloned().collect()
    }
}

#[async_trait]
impl BatchStore for EmbeddedBatchStore {
    async fn insert(&self, batch: &Batch) -> Result<(), StoreError> {
        let mut batches = self.batches.write().await;
        self.persist(batch).await?;
        batches.entry(batch.spec.project_id.clone()).or_default().insert(batch.spec.id.clone(), batch.clone());
        Ok(())
    }

    async fn get(&self, project: &ProjectId, id: &BatchId) -> Result<Option<Batch>, StoreError> {
        Ok(self.batches.read().await.get(project).and_then(|b| b.get(id)).cloned())
    }

    async fn list(&self, project: &ProjectId, after: Option<&BatchId>, limit: usize) -> Result<BatchPage, StoreError> {
        let batches = self.batches.read().await;
        let Some(project) = batches.get(project) else {
            return Ok(BatchPage { batches: Vec::new(), has_more: false });
        };
        let older = match after {
            Some(after) => project.range(..after.clone()),
            None => project.range(..),
        };
        let mut page: Vec<Batch> = older.rev().take(limit + 1).map(|(_, batch)| batch.clone()).collect();
        let has_more = page.len() > limit;
        page.truncate(limit);
        Ok(BatchPage { batches: page, has_more })
    }

    async fn update(&self, project: &ProjectId, id: &BatchId, change: StateChange<'_>) -> Result<Batch, UpdateError> {
        let mut batches = self.batches.write().await;
        let current = batches.get(project).and_then(|b| b.get(id)).ok_or(UpdateError::NotFound)?;
        let mut next = current.clone();
        if !change(&mut next.state)? {
            return Ok(next);
        }
        self.persist(&next).await?;
        batches.entry(project.clone()).or_default().insert(id.clone(), next.clone());
        Ok(next)
    }
}
