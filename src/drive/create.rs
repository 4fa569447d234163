//! A batch comes to be: the input lookup, one streaming validation pass, and the batch
//! persisted either way (`in_progress`, or `failed` with errors, announced to the
//! project's webhooks as the lifecycle announces every ending).

use futures_util::StreamExt;

use crate::batches::create::{BatchSettings, COMPLETION_WINDOW, CreateBatch, CreateError};
use crate::batches::{Batch, BatchError, BatchSpec, BatchState, BatchStore, Status};
use crate::clock;
use crate::files::{FileCatalog, FileRecord, Purpose};
use crate::ids::{BatchId, ProjectId};
use crate::storage::StorageError;
use crate::validate::{self, InvalidInput, ValidInput, Validator};

/// What one validation pass made of a create request: a batch to run, or one whose
/// input was refused (recorded as `failed`, with why).
pub enum Decided {
    Valid(Batch),
    Invalid { batch: Batch, error: InvalidInput },
}

/// Looks up and validates the input, then persists the batch under `id` (chosen by the
/// caller, so that an idempotency key can name it before it exists).
pub async fn create_batch(
    files: &FileCatalog,
    store: &dyn BatchStore,
    settings: BatchSettings,
    project: &ProjectId,
    id: BatchId,
    request: CreateBatch,
) -> Result<Batch, CreateError> {
    match decide_batch(files, settings, project, id, request).await? {
        Decided::Valid(batch) => {
            store.insert(&batch).await?;
            tracing::info!(batch = %batch.spec.id, requests = batch.state.request_counts.total, shards = batch.spec.plan.shards.len(), "batch created");
            Ok(batch)
        }
        Decided::Invalid { batch, error } => {
            announce_refusal(files, &batch).await?;
            store.insert(&batch).await?;
            tracing::info!(batch = %batch.spec.id, reason = %error, "batch input refused");
            Err(CreateError::Invalid { error, batch: Box::new(batch) })
        }
    }
}

/// Tells the project's webhooks that `batch` failed validation (as the lifecycle tells
/// every ending), before the failed batch is persisted.
pub async fn announce_refusal(files: &FileCatalog, batch: &Batch) -> Result<(), StorageError> {
    let (project, id) = (&batch.spec.project_id, &batch.spec.id);
    let failed_at = batch.state.failed_at.unwrap_or_else(clock::now);
    crate::webhooks::outbox::announce(files.store().as_ref(), project, id, Status::Failed, failed_at).await
}

/// Looks up the input (a live file of the project, uploaded for batches) and validates
/// it in one streaming pass: the batch as it is to be persisted under `id`.
pub async fn decide_batch(
    files: &FileCatalog,
    settings: BatchSettings,
    project: &ProjectId,
    id: BatchId,
    request: CreateBatch,
) -> Result<Decided, CreateError> {
    let input = files
        .find(project, &request.input_file_id)
        .await?
        .ok_or_else(|| CreateError::InputNotFound(request.input_file_id.clone()))?;
    if input.purpose != Purpose::Batch {
        return Err(CreateError::InputPurpose(request.input_file_id));
    }
    let created_at = clock::now();
    let mut spec = BatchSpec {
        id,
        project_id: project.clone(),
        input_file_id: input.id.clone(),
        endpoint: request.endpoint,
        completion_window: COMPLETION_WINDOW.to_owned(),
        metadata: request.metadata,
        created_at,
        expires_at: created_at + settings.completion_window.as_secs() as i64,
        model: None,
        output_expires_after: request.output_expires_after.map(|after| after.seconds),
        priority: None,
        plan: Default::default(),
    };

    let verdict = validate_input(files, &input, &spec.endpoint, settings).await?;

    let now = clock::now();
    Ok(match verdict {
        Ok(valid) => {
            spec.plan = valid.shards;
            spec.model = valid.model;
            Decided::Valid(Batch { spec, state: BatchState::in_progress(now, valid.requests) })
        }
        Err(error) => {
            let recorded = BatchError {
                code: "invalid_request_error".into(),
                message: error.message.clone(),
                line: error.line,
                param: error.param.map(str::to_owned),
            };
            Decided::Invalid { batch: Batch { spec, state: BatchState::failed(now, vec![recorded]) }, error }
        }
    })
}

/// One streaming validation pass over `input` (a file too large is refused unread; one
/// whose bytes are gone from storage is `InputMissing`).
async fn validate_input(
    files: &FileCatalog,
    input: &FileRecord,
    endpoint: &str,
    settings: BatchSettings,
) -> Result<Result<ValidInput, InvalidInput>, CreateError> {
    if input.bytes > validate::MAX_FILE_BYTES {
        return Ok(Err(validate::file_too_large()));
    }
    let missing = |error| match error {
        StorageError::NotFound(_) => CreateError::InputMissing(input.id.to_string()),
        error => CreateError::Storage(error),
    };
    let mut content = files.open(input).await.map_err(missing)?;
    let mut validator = Validator::with_endpoints(endpoint, settings.shard_lines, settings.endpoints);
    while let Some(chunk) = content.next().await {
        if let Err(invalid) = validator.feed(&chunk.map_err(missing)?) {
            return Ok(Err(invalid));
        }
    }
    Ok(validator.finish())
}
