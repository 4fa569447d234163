//! An applied Batch becomes a batch (`super::applied` says what a user may apply). The
//! controller checks the request as the API checks one, finds the project, reads an
//! `s3://` input into a file of the project, validates it with the one streaming
//! validator, and records the batch on the same resource: the record beside the request
//! in `spec`, then the status. A refused request is a `failed` Batch with the reason (and
//! the line, for an input that does not validate) in its status and an Event.

use std::collections::BTreeSet;

use futures_util::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::applied::{Input, project_of};
use super::context::{Context, FIELD_MANAGER};
use super::crd::{BatchResource, PROJECT_LABEL, SOURCE_LABEL};
use super::error::ControllerError;
use super::store::apply_status;
use crate::batches::create::CreateError;
use crate::batches::{BatchError, BatchState};
use crate::clock;
use crate::drive::create::{Decided, announce_refusal, decide_batch};
use crate::files::{NewFile, Purpose};
use crate::ids::{BatchId, ProjectId};
use crate::storage::StorageError;
use crate::storage::uri::S3Uri;
use crate::validate;

/// Why an applied Batch was not accepted, as its status records it.
struct Refused {
    code: &'static str,
    message: String,
    param: Option<String>,
}

impl Refused {
    fn invalid(message: impl Into<String>, param: &str) -> Self {
        Self { code: "invalid_request_error", message: message.into(), param: Some(param.to_owned()) }
    }
}

/// The spec's error for a request refused before its input was read, or `Err` for a
/// failure that trying again can mend (storage, the store).
fn refused(error: CreateError) -> Result<Refused, ControllerError> {
    Ok(match error {
        CreateError::Request { message, param } => Refused::invalid(message, param),
        CreateError::InputNotFound(_) | CreateError::InputMissing(_) => {
            Refused { code: "file_not_found", message: error.to_string(), param: Some("input.file_id".into()) }
        }
        CreateError::InputPurpose(_) => {
            Refused { code: "invalid_purpose", message: error.to_string(), param: Some("input.file_id".into()) }
        }
        CreateError::Expiry(error) => Refused::invalid(error.to_string(), "output_expires_after"),
        // decide_batch records an invalid input as a failed batch instead; as a refusal, the same.
        CreateError::Invalid { error, .. } => Refused::invalid(error.message, error.param.unwrap_or("input")),
        CreateError::Storage(error) => return Err(ControllerError::Storage(error)),
        CreateError::Store(error) => return Err(ControllerError::Storage(StorageError::Backend(error.to_string()))),
    })
}

/// One pass over an applied Batch the controller has not accepted yet.
pub async fn accept(resource: &BatchResource, ctx: &Context) -> Result<Action, ControllerError> {
    let Some(request) = &resource.spec.request else {
        let note = "it names no input (spec.input) and holds no batch: left alone".to_owned();
        ctx.event(resource, EventType::Warning, "InvalidSpec", note).await;
        return Ok(Action::await_change());
    };
    let projects: BTreeSet<ProjectId> = ctx.projects.state().iter().map(|p| p.spec.id.clone()).collect();
    let project = match project_of(resource.labels().get(PROJECT_LABEL).map(String::as_str), &projects) {
        Ok(project) => project,
        Err(message) => return refuse(resource, ctx, Refused::invalid(message, "metadata.labels")).await,
    };
    let checked = match request.check() {
        Ok(checked) => checked,
        Err(error) => return refuse(resource, ctx, refused(error)?).await,
    };
    if ctx.quota_left(&project) == Some(0) {
        let message = "You exceeded your current quota: the project's token quota is used up";
        let refusal = Refused { code: "insufficient_quota", message: message.into(), param: None };
        return refuse(resource, ctx, refusal).await;
    }
    let Some(resource) = validating(resource, ctx).await? else {
        return Ok(Action::requeue(std::time::Duration::ZERO));
    };
    let mut create = checked.create;
    if let Input::Object(uri) = &checked.input {
        match import(ctx, &project, uri).await? {
            Ok(file) => create.input_file_id = file,
            Err(refusal) => return refuse(&resource, ctx, refusal).await,
        }
    }
    let decided = match decide_batch(&ctx.exec.files, ctx.batch_settings, &project, BatchId::generate(), create).await {
        Ok(decided) => decided,
        Err(error) => return refuse(&resource, ctx, refused(error)?).await,
    };
    record(&resource, ctx, decided, request.priority).await
}

/// Writes `validating` as the status of a Batch that has none (its progress is then
/// visible while a large input is read); `None` when the Batch changed meanwhile.
async fn validating(resource: &BatchResource, ctx: &Context) -> Result<Option<BatchResource>, ControllerError> {
    if resource.status.is_some() {
        return Ok(Some(resource.clone()));
    }
    Ok(apply_status(&ctx.batches(), FIELD_MANAGER, resource, &BatchState::validating()).await?)
}

/// Reads the object at `uri` into a new `batch` file of `project`: its id, or why not.
async fn import(ctx: &Context, project: &ProjectId, uri: &S3Uri) -> Result<Result<String, Refused>, ControllerError> {
    let not_found = || Refused::invalid(format!("Input object not found: {uri}"), "input.uri");
    let key = uri.key.as_ref().expect("an object's URI has a key");
    let bucket = match ctx.buckets.bucket(&uri.bucket) {
        Ok(bucket) => bucket,
        Err(error) => return Ok(Err(Refused::invalid(error.to_string(), "input.uri"))),
    };
    let bucket: &dyn crate::storage::ObjectStore = bucket.as_ref();
    match bucket.size(key).await {
        Ok(None) | Err(StorageError::NotFound(_)) => return Ok(Err(not_found())),
        Ok(Some(bytes)) if bytes > validate::MAX_FILE_BYTES => {
            return Ok(Err(Refused::invalid(validate::file_too_large().message, "input.uri")));
        }
        Ok(Some(_)) => {}
        Err(error) => return Err(ControllerError::Storage(error)),
    }
    let mut content = match bucket.read(key, None).await {
        Ok(content) => content,
        Err(StorageError::NotFound(_)) => return Ok(Err(not_found())),
        Err(error) => return Err(ControllerError::Storage(error)),
    };
    let mut upload = ctx.exec.files.start_upload(project).await?;
    while let Some(chunk) = content.next().await {
        let written = match chunk {
            Ok(chunk) => upload.write(chunk).await,
            Err(error) => Err(error),
        };
        if let Err(error) = written {
            upload.abort().await;
            return Err(ControllerError::Storage(error));
        }
    }
    let file = NewFile {
        filename: uri.name().map(str::to_owned),
        purpose: Purpose::Batch,
        is_error: false,
        expires_after: None,
    };
    let record = upload.commit(file).await?;
    tracing::info!(%uri, file = %record.id, bytes = record.bytes, "applied batch input read");
    Ok(Ok(record.id.to_string()))
}

/// Records the batch a validation pass decided on the Batch: the record into `spec`
/// (labelled with its project and source), then its status.
async fn record(
    resource: &BatchResource,
    ctx: &Context,
    decided: Decided,
    priority: Option<i64>,
) -> Result<Action, ControllerError> {
    let (mut batch, invalid) = match decided {
        Decided::Valid(batch) => (batch, None),
        Decided::Invalid { batch, error } => (batch, Some(error)),
    };
    batch.spec.priority = priority;
    if invalid.is_some() {
        announce_refusal(&ctx.exec.files, &batch).await?;
    }
    let patch = json!({
        "apiVersion": BatchResource::api_version(&()),
        "kind": BatchResource::kind(&()),
        "metadata": {
            "name": resource.name_any(),
            "resourceVersion": resource.resource_version(),
            "labels": {PROJECT_LABEL: batch.spec.project_id.to_string(), SOURCE_LABEL: "applied"},
        },
        "spec": batch.spec,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let written = match ctx.batches().patch(&resource.name_any(), &params, &Patch::Apply(&patch)).await {
        Ok(written) => written,
        // Changed meanwhile (a user's edit, a delete): decided again on the newer Batch.
        Err(kube::Error::Api(status)) if status.code == 409 => return Ok(Action::requeue(std::time::Duration::ZERO)),
        Err(error) => return Err(error.into()),
    };
    // A crash here leaves a record without status: `recover_statusless` writes it.
    apply_status(&ctx.batches(), FIELD_MANAGER, &written, &batch.state).await?;
    let (reason, note) = match &invalid {
        None => (
            "Accepted",
            format!(
                "batch {}: {} lines in {} shards, input {}",
                batch.spec.id,
                batch.state.request_counts.total,
                batch.spec.plan.shards.len(),
                batch.spec.input_file_id
            ),
        ),
        Some(error) => ("Refused", line_note(error.line, &error.message)),
    };
    let type_ = if invalid.is_some() { EventType::Warning } else { EventType::Normal };
    ctx.event(&written, type_, reason, note).await;
    tracing::info!(batch = %batch.spec.id, resource = %resource.name_any(), status = batch.state.status.as_str(), "applied batch recorded");
    Ok(Action::requeue(std::time::Duration::ZERO))
}

fn line_note(line: Option<u64>, message: &str) -> String {
    match line {
        Some(line) => format!("line {line}: {message}"),
        None => message.to_owned(),
    }
}

/// Writes a refused request's `failed` status and a Warning Event with the reason. The
/// Batch holds no batch record: it is no project's, and the API does not list it.
async fn refuse(resource: &BatchResource, ctx: &Context, refusal: Refused) -> Result<Action, ControllerError> {
    let error =
        BatchError { code: refusal.code.into(), message: refusal.message.clone(), line: None, param: refusal.param };
    let state = BatchState::failed(clock::now(), vec![error]);
    if apply_status(&ctx.batches(), FIELD_MANAGER, resource, &state).await?.is_some() {
        ctx.event(resource, EventType::Warning, "Refused", refusal.message).await;
        tracing::info!(resource = %resource.name_any(), code = refusal.code, "applied batch refused");
    }
    Ok(Action::requeue(std::time::Duration::ZERO))
}
