//! OpenAI's Batch object, as the API shows a [`Batch`].

use serde::Serialize;
use serde_json::{Map, Value};

use super::model::{Batch, BatchError, RequestCounts};
use crate::clock::UnixSeconds;
use crate::ids::{BatchId, FileId};

#[derive(Clone, Debug, Serialize)]
pub struct BatchObject {
    pub id: BatchId,
    pub object: &'static str,
    pub endpoint: String,
    pub errors: Option<ErrorList>,
    pub input_file_id: FileId,
    pub completion_window: String,
    pub status: &'static str,
    pub output_file_id: Option<FileId>,
    pub error_file_id: Option<FileId>,
    pub created_at: UnixSeconds,
    pub in_progress_at: Option<UnixSeconds>,
    pub expires_at: UnixSeconds,
    pub finalizing_at: Option<UnixSeconds>,
    pub completed_at: Option<UnixSeconds>,
    pub failed_at: Option<UnixSeconds>,
    pub expired_at: Option<UnixSeconds>,
    pub cancelling_at: Option<UnixSeconds>,
    pub cancelled_at: Option<UnixSeconds>,
    pub request_counts: RequestCounts,
    pub metadata: Map<String, Value>,
    /// The model every input line names (OpenAI's `Batch.model`); null when they differ.
    pub model: Option<String>,
    pub usage: UsageObject,
    /// Nightshift's extension: when an in-progress batch should be done at its pace so
    /// far (unix seconds); null otherwise. The SDKs keep fields they don't know.
    pub estimated_completion_at: Option<UnixSeconds>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ErrorList {
    pub object: &'static str,
    pub data: Vec<BatchError>,
}

/// OpenAI's `BatchUsage`, details included, so the SDK's type parses.
#[derive(Clone, Debug, Serialize)]
pub struct UsageObject {
    pub input_tokens: u64,
    pub input_tokens_details: CachedTokens,
    pub output_tokens: u64,
    pub output_tokens_details: ReasoningTokens,
    pub total_tokens: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CachedTokens {
    pub cached_tokens: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReasoningTokens {
    pub reasoning_tokens: u64,
}

impl From<&Batch> for BatchObject {
    fn from(batch: &Batch) -> Self {
        let (spec, state) = (&batch.spec, &batch.state);
        Self {
            id: spec.id.clone(),
            object: "batch",
            endpoint: spec.endpoint.clone(),
            errors: (!state.errors.is_empty()).then(|| ErrorList { object: "list", data: state.errors.clone() }),
            input_file_id: spec.input_file_id.clone(),
            completion_window: spec.completion_window.clone(),
            status: state.status.as_str(),
            output_file_id: state.output_file_id.clone(),
            error_file_id: state.error_file_id.clone(),
            created_at: spec.created_at,
            in_progress_at: state.in_progress_at,
            expires_at: spec.expires_at,
            finalizing_at: state.finalizing_at,
            completed_at: state.completed_at,
            failed_at: state.failed_at,
            expired_at: state.expired_at,
            cancelling_at: state.cancelling_at,
            cancelled_at: state.cancelled_at,
            request_counts: state.request_counts,
            metadata: spec.metadata.clone(),
            model: spec.model.clone(),
            usage: UsageObject {
                input_tokens: state.usage.input_tokens,
                input_tokens_details: CachedTokens { cached_tokens: state.usage.cached_tokens },
                output_tokens: state.usage.output_tokens,
                output_tokens_details: ReasoningTokens { reasoning_tokens: state.usage.reasoning_tokens },
                total_tokens: state.usage.total_tokens,
            },
            estimated_completion_at: state.estimated_completion_at,
        }
    }
}
