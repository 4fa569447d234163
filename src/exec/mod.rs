//! Batch execution: workers that run shards against upstreams, checkpoints, the drain
//! of lines that never ran, and finalize. The reconcile loop decides what runs; this
//! module does it.

pub mod backoff;
pub mod call;
pub mod checkpoint;
pub mod classify;
pub mod drain;
pub mod echo;
pub mod failure;
pub mod finalize;
pub mod input;
pub mod journal;
pub mod layout;
pub mod limiter;
pub mod owner;
pub mod permits;
pub mod reachability;
pub mod recalls;
pub mod records;
pub mod remembered;
pub mod upstream;
pub mod worker;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::files::FileCatalog;
use crate::quota::QuotaLedger;
use crate::storage::{ObjectStore, StorageError};
use checkpoint::CheckpointReader;
use upstream::Upstreams;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("corrupt shard data: {0}")]
    Corrupt(String),
}

#[derive(Clone, Copy, Debug)]
pub struct ExecSettings {
    /// How often a worker commits what it has: the most work a crash can lose.
    pub checkpoint_interval: Duration,
    /// How long lines in flight may take to finish after cancel or expiry.
    pub cancel_grace: Duration,
    /// How often a shard's worker may fail and be started again.
    pub max_shard_retries: u32,
}

impl ExecSettings {
    pub fn from_config(batches: &crate::config::BatchesConfig) -> Self {
        Self {
            checkpoint_interval: batches.checkpoint_interval,
            cancel_grace: batches.cancel_grace,
            max_shard_retries: batches.max_shard_retries,
        }
    }
}

impl Default for ExecSettings {
    fn default() -> Self {
        Self::from_config(&crate::config::BatchesConfig::default())
    }
}

/// Everything a worker, a drain or a finalize needs.
pub struct ExecContext {
    pub store: Arc<dyn ObjectStore>,
    pub files: FileCatalog,
    pub upstreams: Upstreams,
    pub echo_permits: Arc<Semaphore>,
    pub client: reqwest::Client,
    pub quota: Arc<QuotaLedger>,
    pub checkpoints: CheckpointReader,
    pub settings: ExecSettings,
}

impl ExecContext {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        files: FileCatalog,
        upstreams: Upstreams,
        quota: Arc<QuotaLedger>,
        settings: ExecSettings,
    ) -> Self {
        // Connections are pooled and reused across lines, shards and batches.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()
            .expect("the HTTP client builds");
        Self {
            store,
            files,
            upstreams,
            echo_permits: Upstreams::echo_permits(),
            client,
            quota,
            checkpoints: CheckpointReader::default(),
            settings,
        }
    }
}
