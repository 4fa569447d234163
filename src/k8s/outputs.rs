//! A finished applied Batch's output and error files, copied under the prefix its
//! `spec.output.uri` names (`<prefix><batch id>/output.jsonl`, `errors.jsonl`), once:
//! the status records where they landed. With `keep_files: false` they then leave the
//! Files API.

use std::sync::Arc;

use futures_util::StreamExt;
use kube::runtime::events::EventType;

use super::applied::output_uris;
use super::context::Context;
use super::crd::BatchResource;
use super::error::ControllerError;
use crate::batches::{BatchSpec, BatchState};
use crate::ids::FileId;
use crate::storage::uri::S3Uri;
use crate::storage::{ObjectStore, S3Store, StorageError};

/// Whether `state` is the end of a Batch whose files are to be copied and are not yet.
fn to_copy(resource: &BatchResource, state: &BatchState) -> bool {
    let wanted = resource.spec.request.as_ref().is_some_and(|r| r.output.is_some());
    let copied = state.output_uri.is_some() || state.error_uri.is_some();
    let has_files = state.output_file_id.is_some() || state.error_file_id.is_some();
    wanted && state.status.is_terminal() && has_files && !copied
}

/// Copies the files of a batch about to be written as finished to its output location:
/// `state` with where they landed, to be written in the same status (so that a `kubectl
/// wait` for the end finds them there). Unchanged for a Batch that names no output, or a
/// state that does not end it. A location that cannot be written (a bucket this
/// installation cannot reach) is a Warning Event, and the batch ends without the copy.
pub async fn deliver(
    resource: &BatchResource,
    spec: &BatchSpec,
    mut state: BatchState,
    ctx: &Context,
) -> Result<BatchState, ControllerError> {
    let output = resource.spec.request.as_ref().and_then(|r| r.output.as_ref());
    let (Some(output), true) = (output, to_copy(resource, &state)) else {
        return Ok(state);
    };
    let (bucket, prefix) = match target(ctx, &output.uri) {
        Ok(found) => found,
        Err(error) => {
            ctx.event(resource, EventType::Warning, "OutputNotWritten", error).await;
            return Ok(state);
        }
    };
    let (output_uri, error_uri) = output_uris(&prefix, spec.id.as_str());
    if let Some(file) = &state.output_file_id {
        copy(ctx, spec, file, bucket.as_ref(), &output_uri).await?;
        state.output_uri = Some(output_uri.to_string());
    }
    if let Some(file) = &state.error_file_id {
        copy(ctx, spec, file, bucket.as_ref(), &error_uri).await?;
        state.error_uri = Some(error_uri.to_string());
    }
    Ok(state)
}

/// The bucket and prefix `uri` names, or why they cannot be written to.
fn target(ctx: &Context, uri: &str) -> Result<(Arc<S3Store>, S3Uri), String> {
    let prefix = S3Uri::prefix(uri).map_err(|error| error.to_string())?;
    let bucket = ctx.buckets.bucket(&prefix.bucket).map_err(|error| error.to_string())?;
    Ok((bucket, prefix))
}

/// Once the state [`deliver`] returned is written: an Event saying where the files are,
/// and, with `keep_files: false`, the files leave the Files API.
pub async fn delivered(
    resource: &BatchResource,
    spec: &BatchSpec,
    before: &BatchState,
    after: &BatchState,
    ctx: &Context,
) -> Result<(), ControllerError> {
    let newly = |was: &Option<String>, now: &Option<String>| if was.is_none() { now.clone() } else { None };
    let written: Vec<String> =
        [newly(&before.output_uri, &after.output_uri), newly(&before.error_uri, &after.error_uri)]
            .into_iter()
            .flatten()
            .collect();
    if written.is_empty() {
        return Ok(());
    }
    ctx.event(resource, EventType::Normal, "OutputWritten", written.join(", ")).await;
    let keep = resource.spec.request.as_ref().and_then(|r| r.output.as_ref()).is_none_or(|o| o.keep_files);
    if !keep {
        for file in [&after.output_file_id, &after.error_file_id].into_iter().flatten() {
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
