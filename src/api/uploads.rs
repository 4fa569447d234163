//! `/v1/uploads`: OpenAI's Uploads API (create, add a part, complete, cancel), for batch
//! inputs up to the 200 MB input limit in parts of up to 64 MB.

use axum::extract::multipart::{Field, MultipartRejection};
use axum::extract::{DefaultBodyLimit, Multipart, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;

use super::AppState;
use super::error::{ApiError, ErrorType};
use super::extract::{self, CurrentProject, Path};
use super::upload::{busy, drain, multipart_error};
use crate::clock;
use crate::files::FileObject;
use crate::uploads::store::PartWriter;
use crate::uploads::{
    CompleteUpload, MAX_PART_BYTES, NewUpload, PartObject, RequestError, UploadError, UploadObject, UploadStatus,
};

/// A part's request may carry a little more than the part: boundaries and headers.
const MAX_PART_REQUEST_BYTES: usize = MAX_PART_BYTES as usize + 1024 * 1024;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/uploads", post(create))
        .route("/v1/uploads/{upload_id}/parts", post(add_part).layer(DefaultBodyLimit::max(MAX_PART_REQUEST_BYTES)))
        .route("/v1/uploads/{upload_id}/complete", post(complete))
        .route("/v1/uploads/{upload_id}/cancel", post(cancel))
}

impl From<RequestError> for ApiError {
    fn from(error: RequestError) -> Self {
        ApiError::bad_request(error.code, error.message).with_param(error.param)
    }
}

impl From<UploadError> for ApiError {
    fn from(error: UploadError) -> Self {
        let message = error.to_string();
        let (code, param) = match &error {
            UploadError::NotFound(_) => {
                return ApiError::not_found("upload_not_found", message).with_param("upload_id");
            }
            UploadError::PartTooLarge => {
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    ErrorType::InvalidRequestError,
                    Some("part_too_large"),
                    message,
                )
                .with_param("data");
            }
            UploadError::Storage(_) => return ApiError::internal("storage_error", message),
            UploadError::Expired { .. } => ("upload_expired", "upload_id"),
            UploadError::NotPending { status: UploadStatus::Completed, .. } => ("upload_completed", "upload_id"),
            UploadError::NotPending { .. } => ("upload_cancelled", "upload_id"),
            UploadError::EmptyPart => ("empty_part", "data"),
            UploadError::TooManyParts { .. } => ("too_many_parts", "data"),
            UploadError::OverSize { .. } => ("upload_size_exceeded", "data"),
            UploadError::UnknownPart { .. } => ("invalid_part_id", "part_ids"),
            UploadError::SizeMismatch { .. } => ("upload_size_mismatch", "part_ids"),
            UploadError::Md5Mismatch { .. } => ("md5_mismatch", "md5"),
        };
        ApiError::bad_request(code, message).with_param(param)
    }
}

async fn create(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    extract::Json(body): extract::Json<Value>,
) -> Result<Json<UploadObject>, ApiError> {
    let request = NewUpload::parse(&body)?;
    let now = clock::now();
    let record = state.uploads.create(&project.id, request, now).await?;
    tracing::info!(upload = %record.id, bytes = record.bytes, "upload created");
    Ok(Json(UploadObject::new(&record, now, None)))
}

async fn add_part(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(upload_id): Path<String>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Json<PartObject>, ApiError> {
    let Ok(_receiving) = state.receiving.clone().try_acquire_owned() else {
        return Err(busy());
    };
    let mut multipart = multipart.map_err(|rejection| {
        ApiError::bad_request(
            "invalid_multipart",
            format!("Parts must be sent as multipart/form-data with a `data` part: {}", rejection.body_text()),
        )
    })?;
    let mut part: Option<PartWriter> = None;
    let read = read_part(&state, &project.id, &upload_id, &mut multipart, &mut part).await;
    let finished = match (read, part) {
        (Ok(()), Some(part)) => part.finish().await.map_err(ApiError::from),
        (Ok(()), None) => Err(ApiError::bad_request(
            "missing_file",
            "No `data` part in the multipart body; send the part's bytes as `data`",
        )
        .with_param("data")),
        (Err(error), part) => {
            if let Some(part) = part {
                part.abort().await;
            }
            Err(error)
        }
    };
    if finished.is_err() {
        drain(&mut multipart).await;
    }
    let part = finished?;
    tracing::info!(upload = %part.upload_id, part = %part.id, "upload part received");
    Ok(Json(part))
}

/// Streams the `data` field into a new part; other fields are skipped.
async fn read_part(
    state: &AppState,
    project: &crate::ids::ProjectId,
    upload_id: &str,
    multipart: &mut Multipart,
    part: &mut Option<PartWriter>,
) -> Result<(), ApiError> {
    while let Some(mut field) = multipart.next_field().await.map_err(part_multipart_error)? {
        if field.name() != Some("data") {
            while field.chunk().await.map_err(part_multipart_error)?.is_some() {}
            continue;
        }
        if part.is_some() {
            return Err(ApiError::bad_request("invalid_multipart", "The multipart body has more than one `data` part")
                .with_param("data"));
        }
        let writer = part.insert(state.uploads.start_part(project, upload_id, clock::now()).await?);
        stream_into(&mut field, writer).await?;
    }
    Ok(())
}

async fn stream_into(field: &mut Field<'_>, part: &mut PartWriter) -> Result<(), ApiError> {
    while let Some(chunk) = field.chunk().await.map_err(part_multipart_error)? {
        part.write(chunk).await?;
    }
    Ok(())
}

/// A body over the route's limit is a part over 64 MB.
fn part_multipart_error(error: axum::extract::multipart::MultipartError) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return UploadError::PartTooLarge.into();
    }
    multipart_error(error)
}

async fn complete(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(upload_id): Path<String>,
    extract::Json(body): extract::Json<Value>,
) -> Result<Json<UploadObject>, ApiError> {
    let request = CompleteUpload::parse(&body)?;
    let now = clock::now();
    let (record, file) = state.uploads.complete(&project.id, &upload_id, request, now).await?;
    tracing::info!(upload = %record.id, bytes = record.bytes, "upload completed");
    Ok(Json(UploadObject::new(&record, now, file.as_ref().map(FileObject::from))))
}

async fn cancel(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(upload_id): Path<String>,
) -> Result<Json<UploadObject>, ApiError> {
    let now = clock::now();
    let record = state.uploads.cancel(&project.id, &upload_id, now).await?;
    tracing::info!(upload = %record.id, "upload cancelled");
    Ok(Json(UploadObject::new(&record, now, None)))
}
