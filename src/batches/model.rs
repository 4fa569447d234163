//! The Batch document: `spec` is the immutable request and shard plan, `state` the
//! lifecycle. The same document is a file in the embedded store and a custom
//! resource on Kubernetes.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::clock::UnixSeconds;
use crate::ids::{BatchId, FileId, ProjectId};
use crate::validate::ShardPlan;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl Status {
    /// Terminal states never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Failed | Self::Completed | Self::Expired | Self::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BatchSpec {
    pub id: BatchId,
    pub project_id: ProjectId,
    pub input_file_id: FileId,
    pub endpoint: String,
    pub completion_window: String,
    #[schemars(schema_with = "super::schema::any_object")]
    pub metadata: Map<String, Value>,
    pub created_at: UnixSeconds,
    pub expires_at: UnixSeconds,
    /// The `body.model` every input line names, when they all name the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Seconds after which the output and error files expire (`output_expires_after`);
    /// `None`: the files' retention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_expires_after: Option<u64>,
    /// Set as `priority` on the batch's lines, over its upstream's (vLLM's priority
    /// scheduling: lower runs first). An applied Batch's `spec.priority`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    /// Empty for a batch whose validation failed.
    #[serde(default)]
    pub plan: ShardPlan,
}

#[cfg(test)]
impl BatchSpec {
    /// A chat-completions batch of `plan` with new ids, created at `created_at`, expiring at
    /// `expires_at` (tests).
    pub(crate) fn sample(plan: ShardPlan, created_at: UnixSeconds, expires_at: UnixSeconds) -> Self {
        Self {
            id: BatchId::generate(),
            project_id: ProjectId::generate(),
            input_file_id: FileId::generate(),
            endpoint: "/v1/chat/completions".into(),
            completion_window: "24h".into(),
            metadata: Map::default(),
            created_at,
            expires_at,
            model: None,
            output_expires_after: None,
            priority: None,
            plan,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RequestCounts {
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

/// Token usage, summed over the batch's lines (OpenAI's `Batch.usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub total_tokens: u64,
    /// Of the input tokens, those the upstream served from its prompt cache.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens: u64,
    /// Of the output tokens, those spent on reasoning.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reasoning_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Self) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.total_tokens += other.total_tokens;
        self.cached_tokens += other.cached_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
    }
}

/// One entry of `Batch.errors.data`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BatchError {
    pub code: String,
    pub message: String,
    pub line: Option<u64>,
    pub param: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BatchState {
    pub status: Status,
    #[serde(default)]
    pub in_progress_at: Option<UnixSeconds>,
    #[serde(default)]
    pub finalizing_at: Option<UnixSeconds>,
    #[serde(default)]
    pub completed_at: Option<UnixSeconds>,
    #[serde(default)]
    pub failed_at: Option<UnixSeconds>,
    #[serde(default)]
    pub expired_at: Option<UnixSeconds>,
    #[serde(default)]
    pub cancelling_at: Option<UnixSeconds>,
    #[serde(default)]
    pub cancelled_at: Option<UnixSeconds>,
    #[serde(default)]
    pub request_counts: RequestCounts,
    #[serde(default)]
    pub usage: Usage,
    #[serde(default)]
    pub output_file_id: Option<FileId>,
    #[serde(default)]
    pub error_file_id: Option<FileId>,
    /// The validation errors of a failed batch.
    #[serde(default)]
    pub errors: Vec<BatchError>,
    /// Set once the batch ran out of time, before its lines are drained: the
    /// ending that finalize will give it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::schema::optional_ending")]
    pub ending: Option<Ending>,
    /// Ids chosen for the output and error files before finalize writes them, so a
    /// finalize that is interrupted and run again rewrites the same files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_files: Option<ReservedFiles>,
    /// Failed worker runs, by shard (see `batches.max_shard_retries`).
    #[serde(
        default,
        skip_serializing_if = "std::collections::BTreeMap::is_empty",
        deserialize_with = "counts_by_shard"
    )]
    #[schemars(schema_with = "super::schema::counts_by_shard")]
    pub shard_failures: std::collections::BTreeMap<u32, u32>,
    /// On Kubernetes, `Complete` and `Failed` for `kubectl wait` (written with each status).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// On Kubernetes, the share of lines with a record (`kubectl get batches`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub progress: String,
    /// When an in-progress batch should be done at its pace so far (`super::eta`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_completion_at: Option<UnixSeconds>,
    /// On Kubernetes, that time in RFC 3339 (`kubectl get batches`' ETA column).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub eta: String,
    /// On Kubernetes, where an applied Batch's output file was copied (`spec.output`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_uri: Option<String>,
    /// On Kubernetes, where an applied Batch's error file was copied (`spec.output`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_uri: Option<String>,
}

/// A map keyed by shard index, from JSON's string keys. serde_json would turn them into
/// integers itself, but decoders that go through a generic value first (kube's
/// `DeserializeGuard`) don't.
fn counts_by_shard<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<std::collections::BTreeMap<u32, u32>, D::Error> {
    let raw: std::collections::BTreeMap<String, u32> = Deserialize::deserialize(deserializer)?;
    raw.into_iter()
        .map(|(shard, count)| {
            let shard = shard.parse().map_err(|_| serde::de::Error::custom(format!("shard index {shard:?}")))?;
            Ok((shard, count))
        })
        .collect()
}

/// How a batch whose lines all have records ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    Completed,
    Cancelled,
    Expired,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReservedFiles {
    pub output: FileId,
    pub error: FileId,
}

impl BatchState {
    /// A batch that passed validation and waits for its lines to run.
    pub fn in_progress(now: UnixSeconds, total: u64) -> Self {
        Self {
            in_progress_at: Some(now),
            request_counts: RequestCounts { total, completed: 0, failed: 0 },
            ..Self::empty(Status::InProgress)
        }
    }

    /// When the batch reached its terminal status, if it has.
    pub fn finished_at(&self) -> Option<UnixSeconds> {
        if !self.status.is_terminal() {
            return None;
        }
        self.completed_at.or(self.failed_at).or(self.expired_at).or(self.cancelled_at)
    }

    /// A batch whose input is being read and checked.
    pub fn validating() -> Self {
        Self::empty(Status::Validating)
    }

    /// A batch whose input was refused.
    pub fn failed(now: UnixSeconds, errors: Vec<BatchError>) -> Self {
        Self { failed_at: Some(now), errors, ..Self::empty(Status::Failed) }
    }

    fn empty(status: Status) -> Self {
        Self {
            status,
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            request_counts: RequestCounts::default(),
            usage: Usage::default(),
            output_file_id: None,
            error_file_id: None,
            errors: Vec::new(),
            ending: None,
            reserved_files: None,
            shard_failures: std::collections::BTreeMap::new(),
            conditions: Vec::new(),
            progress: String::new(),
            estimated_completion_at: None,
            eta: String::new(),
            output_uri: None,
            error_uri: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub spec: BatchSpec,
    pub state: BatchState,
}

/// One condition, in Kubernetes' shape (`metav1.Condition`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    pub reason: String,
    /// Omitted when empty (the test API server reads an empty string here as null).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// RFC 3339, when `status` last changed.
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
