//! Where Batch documents live: one interface, so the API and the reconcile logic do
//! not care whether that is the embedded store or Kubernetes.

use async_trait::async_trait;

use super::model::{Batch, BatchState};
use super::transitions::Refusal;
use crate::ids::{BatchId, ProjectId};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("batch store: {0}")]
    Storage(#[from] crate::storage::StorageError),
    /// The store's backend (the Kubernetes API) failed; its error is kept as it came.
    #[error("batch store: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Another writer took the batch over before this write could land.
    #[error("batch store: {0}")]
    Superseded(String),
}

#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error("no such batch")]
    NotFound,
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub struct BatchPage {
    /// Newest first.
    pub batches: Vec<Batch>,
    pub has_more: bool,
}

/// A change to a batch's state: returns whether it changed anything (only then is
/// it written), or why the transition is refused. It may run more than once when a
/// store retries on a conflicting write, so it must decide from its argument alone.
pub type StateChange<'a> = &'a (dyn Fn(&mut BatchState) -> Result<bool, Refusal> + Send + Sync);

#[async_trait]
pub trait BatchStore: Send + Sync + 'static {
    /// Stores a new batch.
    async fn insert(&self, batch: &Batch) -> Result<(), StoreError>;

    /// The project's batch with this id.
    async fn get(&self, project: &ProjectId, id: &BatchId) -> Result<Option<Batch>, StoreError>;

    /// The project's batches, newest first, strictly older than `after` when given.
    async fn list(&self, project: &ProjectId, after: Option<&BatchId>, limit: usize) -> Result<BatchPage, StoreError>;

    /// Applies `change` to the batch's state atomically and returns the batch as it
    /// then is.
    async fn update(&self, project: &ProjectId, id: &BatchId, change: StateChange<'_>) -> Result<Batch, UpdateError>;
}
