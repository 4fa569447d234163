//! A finished applied Batch's output and error files, copied under the prefix its
//! `spec.output.uri` names (`<prefix><batch id>/output.jsonl`, `errors.jsonl`), once:
//! the status records where they landed. With `keep_files: false` they then leave the
//! Files API.

use futures_util::StreamExt;
use kube::runtime::events::EventType;

use super::applied::output_uris;
use super::context::{Context, FIELD_MANAGER};
use super::controller::ControllerError;
use super::crd::BatchResource;
use super::store::apply_status;
use crate::batches::{BatchSpec, BatchState};
use crate::ids::FileId;
use crate::storage::uri::S3Uri;
use crate::storage::{ObjectStore, StorageError};

/// Whether `state` has files not copied yet to an output location.
pub fn undelivered(resource: &BatchResource, state: &BatchState) -> bool {
    let wanted = resource.spec.request.as_ref().is_some_and(|r| r.output.is_some());
    let has_files = state.output_file_id.is_some() || state.error_file_id.is_some();
    wanted
        && state.status.is_terminal()
        && has_files
        && (state.output_uri.is_some() != state.output_file_id.is_some()
            || state.error_uri.is_some() != state.error_file_id.is_some())
}

/// Copies the files of a finished batch to its output location and records where.
pub async fn deliver(
    resource: &BatchResource,
    spec: &BatchSpec,
    state: &BatchState,
    ctx: &Context,
) -> Result<(), ControllerError> {
    let Some(output) = resource.spec.request.as_ref().and_then(|r| r.output.as_ref()) else {
        return Ok(());
    };
    let prefix = match S3Uri::prefix(&output.uri) {
        Ok(prefix) => prefix,
        Err(error) => {
            ctx.event(resource, EventType::Warning, "OutputNotWritten", error.to_string()).await;
            return Ok(());
        }
    };
    let bucket = match ctx.buckets.bucket(&prefix.bucket) {
        Ok(bucket) => bucket,
        Err(error) => {
            ctx.event(resource, EventType::Warning, "OutputNotWritten", error.to_string()).await;
            return Ok(());
        }
    };
    let (output_uri, error_uri) = output_uris(&prefix, spec.id.as_str());
    let mut delivered = state.clone();
    if let Some(file) = &state.output_file_id {
        copy(ctx, spec, file, bucket.as_ref(), &output_uri).await?;
        delivered.output_uri = Some(output_uri.to_string());
    }
    if let Some(file) = &state.error_file_id {
        copy(ctx, spec, file, bucket.as_ref(), &error_uri).await?;
        delivered.error_uri = Some(error_uri.to_string());
    }
    if apply_status(&ctx.batches(), FIELD_MANAGER, resource, &delivered).await?.is_none() {
        // Changed meanwhile: the next pass copies again (the same bytes to the same keys).
        return Ok(());
    }
    let written: Vec<String> = [&delivered.output_uri, &delivered.error_uri].into_iter().flatten().cloned().collect();
    ctx.event(resource, EventType::Normal, "OutputWritten", written.join(", ")).await;
    if !output.keep_files {
        for file in [&state.output_file_id, &state.error_file_id].into_iter().flatten() {
            ctx.exec.files.delete(&spec.project_id, file.as_str()).await?;
        }
    }
    Ok(())
}

/// Streams file `file` of the batch's project to `to`.
async fn copy(
    ctx: &Context,
    spec: &BatchSpec,
    file: &FileId,
    bucket: &dyn ObjectStore,
    to: &S3Uri,
) -> Result<(), ControllerError> {
    let files = &ctx.exec.files;
    let record = files
        .record(&spec.project_id, file)
        .await?
        .ok_or_else(|| StorageError::NotFound(format!("file {file} of batch {}", spec.id)))?;
    let mut content = files.open(&record).await?;
    let key = to.key.as_ref().expect("an output URI names an object");
    let mut writer = bucket.writer(key).await?;
    while let Some(chunk) = content.next().await {
        let written = match chunk {
            Ok(chunk) => writer.write(chunk).await,
            Err(error) => Err(error),
        };
        if let Err(error) = written {
            writer.abort().await;
            return Err(error.into());
        }
    }
    writer.finish().await?;
    Ok(())
}
