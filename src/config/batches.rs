//! `batches:`: how batches are sharded, checkpointed, retried, kept and scheduled.

use std::time::Duration;

use serde::Deserialize;

use super::files::default_retention;
use crate::duration;

/// `batches.scheduling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduling {
    #[default]
    Fair,
    Fifo,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchesConfig {
    /// How long a batch may run before it expires. The API always reports "24h".
    #[serde(default = "default_window", deserialize_with = "duration::deserialize")]
    pub completion_window: Duration,
    #[serde(default = "default_shard_lines")]
    pub shard_lines: u32,
    /// How often a worker commits its results: the most work a crash can cost.
    #[serde(default = "default_checkpoint_interval", deserialize_with = "duration::deserialize_precise")]
    pub checkpoint_interval: Duration,
    /// How long lines in flight may take to finish after a cancel or expiry.
    #[serde(default = "default_cancel_grace", deserialize_with = "duration::deserialize_precise")]
    pub cancel_grace: Duration,
    /// The endpoints batches may target: `/v1/chat/completions` (the spec's only one, the
    /// default), and any of `/v1/embeddings`, `/v1/completions`, `/v1/responses` and
    /// `/v1/moderations`. Each line goes to the same path on its upstream.
    #[serde(default)]
    pub endpoints: crate::validate::Endpoints,
    /// How long `serve` keeps a finished batch (completed, failed, expired or cancelled,
    /// refused creates among them) after it finished; then it is removed, at the pace of
    /// `files.gc_interval`. Its tokens stay counted against its project's quota.
    #[serde(default = "default_retention", deserialize_with = "duration::deserialize")]
    pub retention: Duration,
    /// How many shards run at once, over all batches: in `serve` (default: the number
    /// of cores), and on Kubernetes, worker Jobs over the whole installation (default:
    /// [`KUBERNETES_RUNNING_SHARDS`]).
    #[serde(default)]
    pub max_running_shards: Option<usize>,
    /// How those shards are shared between batches: `fair` (projects by weight, earliest
    /// deadline first within one) or `fifo` (oldest batch first).
    #[serde(default)]
    pub scheduling: Scheduling,
    /// How often `serve` reconciles unfinished batches (live counts, expiry).
    #[serde(default = "default_reconcile_interval", deserialize_with = "duration::deserialize_precise")]
    pub reconcile_interval: Duration,
    /// How often a shard's worker may fail (a task's error in `serve`, a Job past its pod
    /// retries on Kubernetes) and be started again; then its lines without a record get
    /// an `internal_error` record and the batch finishes.
    #[serde(default = "default_max_shard_retries")]
    pub max_shard_retries: u32,
}

fn default_max_shard_retries() -> u32 {
    3
}

fn default_window() -> Duration {
    Duration::from_secs(24 * 3600)
}

fn default_shard_lines() -> u32 {
    5000
}

fn default_checkpoint_interval() -> Duration {
    Duration::from_millis(500)
}

fn default_cancel_grace() -> Duration {
    Duration::from_secs(30)
}

/// As many shards as cores: one shard's loop is one task, so more shards than cores
/// only add switching (measured: 2 running shards on 2 cores move 88% of a plain
/// client's lines per second, 8 move 78%), while each shard may still fill its
/// upstream's whole `max_concurrency`.
pub fn default_max_running_shards() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)
}

/// Worker Jobs running at once on Kubernetes when `max_running_shards` is not set.
pub const KUBERNETES_RUNNING_SHARDS: usize = 16;

fn default_reconcile_interval() -> Duration {
    Duration::from_secs(1)
}

impl Default for BatchesConfig {
    fn default() -> Self {
        Self {
            completion_window: default_window(),
            shard_lines: default_shard_lines(),
            checkpoint_interval: default_checkpoint_interval(),
            cancel_grace: default_cancel_grace(),
            reconcile_interval: default_reconcile_interval(),
            max_running_shards: None,
            scheduling: Scheduling::default(),
            max_shard_retries: default_max_shard_retries(),
            retention: default_retention(),
            endpoints: crate::validate::Endpoints::default(),
        }
    }
}

impl BatchesConfig {
    pub(super) fn check(&self) -> Result<(), String> {
        if self.shard_lines == 0 {
            return Err("batches.shard_lines must be at least 1".into());
        }
        if self.max_running_shards == Some(0) {
            return Err("batches.max_running_shards must be at least 1".into());
        }
        if self.completion_window.is_zero() {
            return Err("batches.completion_window must be longer than 0s".into());
        }
        Ok(())
    }
}

impl BatchesConfig {
    /// What `POST /v1/batches` creates batches with.
    pub fn batch_settings(&self) -> crate::batches::BatchSettings {
        crate::batches::BatchSettings {
            completion_window: self.completion_window,
            shard_lines: self.shard_lines,
            endpoints: self.endpoints,
        }
    }
}
