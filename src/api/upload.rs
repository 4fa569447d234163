//! `POST /v1/files`: a multipart upload streamed into storage.
//!
//! The file part is written chunk by chunk as it arrives, never held whole; the
//! 100 MB limit is counted while streaming. Nothing becomes visible unless every
//! check passes: an aborted upload leaves no bytes and no record.

use axum::Json;
use axum::extract::multipart::{Field, MultipartError, MultipartRejection};
use axum::extract::{Multipart, State};
use axum::http::{HeaderMap, StatusCode, header};

use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::{ApiError, ErrorType};
use super::extract::CurrentProject;
use super::idempotent::{self, Begin};
use crate::files::{ExpiresAfter, FileObject, FileRecord, MAX_UPLOAD_BYTES, NewFile, Purpose, Upload, expiry};
use crate::idempotency::{IdempotencyKey, fingerprint};
use crate::ids::{FileId, ProjectId};

/// The request may carry a little more than the file: boundaries and other fields.
pub const MAX_UPLOAD_REQUEST_BYTES: usize = MAX_UPLOAD_BYTES as usize + 1024 * 1024;

const MAX_FILENAME_CHARS: usize = 255;
const MAX_TEXT_FIELD_BYTES: usize = 64 * 1024;

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorType::InvalidRequestError,
        Some("file_too_large"),
        format!("File exceeds the maximum upload size of {MAX_UPLOAD_BYTES} bytes (100 MB)"),
    )
    .with_param("file")
}

pub(super) fn multipart_error(error: MultipartError) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    // The body stalled past `http.body_idle_timeout` (the server's body timeout).
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(cause) = source {
        if cause.is::<tower_http::timeout::TimeoutError>() {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                ErrorType::InvalidRequestError,
                Some("request_timeout"),
                "The upload stalled: no part of the body arrived in time",
            );
        }
        source = cause.source();
    }
    ApiError::bad_request("invalid_multipart", format!("The multipart body could not be parsed: {}", error.body_text()))
}

/// Every upload slot is taken (`http.max_uploads`): 429, retry in a second.
pub(super) fn busy() -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        ErrorType::RateLimitExceeded,
        Some("rate_limit_exceeded"),
        "Too many uploads are in progress; retry shortly",
    )
    .with_retry_after(1)
}

fn invalid_purpose(got: Option<&str>) -> ApiError {
    let message = match got {
        None => "purpose is required and must be \"batch\"".to_owned(),
        Some(other) => {
            format!("Invalid purpose {other:?}: the only purpose accepted for uploads is \"batch\"")
        }
    };
    ApiError::bad_request("invalid_purpose", message).with_param("purpose")
}

pub async fn create_file(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    headers: HeaderMap,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let idempotency_key = idempotent::key_from(&headers)?;
    // Each upload holds memory and a storage writer while it streams: a bounded number.
    let Ok(_receiving) = state.receiving.clone().try_acquire_owned() else {
        return Err(busy());
    };
    check_headers(&headers)?;
    let mut multipart = multipart.map_err(|rejection| {
        ApiError::bad_request(
            "invalid_multipart",
            format!("The multipart body could not be parsed: {}", rejection.body_text()),
        )
    })?;

    let mut form = Form { digest: idempotency_key.as_ref().map(|_| Sha256::new()), ..Form::default() };
    let outcome = read_parts(&state, &project.id, &mut multipart, &mut form).await;
    let expires_after = match outcome.and_then(|()| form.checked()) {
        Ok(expires_after) => expires_after,
        Err(error) => {
            if let Some((file, _)) = form.upload {
                file.abort().await;
            }
            drain(&mut multipart).await;
            return Err(error);
        }
    };
    let fingerprint = form.fingerprint();
    let (file, filename) = form.upload.expect("checked above");
    let claimed = match (idempotency_key, fingerprint) {
        (Some(key), Some(fingerprint)) => {
            match claim(&state, &project.id, &key, fingerprint, file.id().to_string()).await {
                Ok(Begin::Create(claim)) => Some((key, claim)),
                Ok(Begin::Replay(record)) => {
                    file.abort().await;
                    return Ok(idempotent::replayed(Json(FileObject::from(&record))));
                }
                Err(error) => {
                    file.abort().await;
                    return Err(error);
                }
            }
        }
        _ => None,
    };
    let new = NewFile { filename, purpose: Purpose::Batch, is_error: false, expires_after };
    let committed = file.commit(new).await;
    if let (Err(_), Some((key, claim))) = (&committed, &claimed) {
        idempotent::release(&state.idempotency, &project.id, key, claim).await;
    }
    let record = committed?;
    tracing::info!(file = %record.id, bytes = record.bytes, "file uploaded");
    Ok(Json(FileObject::from(&record)).into_response())
}

/// A multipart body, and not one declared larger than an upload may be.
fn check_headers(headers: &HeaderMap) -> Result<(), ApiError> {
    let is_multipart = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("multipart/form-data"));
    if !is_multipart {
        return Err(ApiError::bad_request(
            "invalid_content_type",
            "Uploads must be sent as multipart/form-data with a `file` part and a `purpose` field",
        ));
    }
    let declared_length =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared_length.is_some_and(|length| length > MAX_UPLOAD_REQUEST_BYTES as u64) {
        return Err(too_large());
    }
    Ok(())
}

/// The upload's idempotency key claimed for the file being made; or, when the same
/// request made a file before, that file.
async fn claim(
    state: &AppState,
    project: &ProjectId,
    key: &IdempotencyKey,
    fingerprint: String,
    file_id: String,
) -> Result<Begin<FileRecord>, ApiError> {
    let find = |object_id: String| {
        let (files, project) = (state.files.clone(), project.clone());
        async move {
            let Some(id) = FileId::parse(&object_id) else { return Ok(None) };
            files.record(&project, &id).await.map_err(ApiError::from)
        }
    };
    idempotent::begin(&state.idempotency, project, key, fingerprint, file_id, find).await
}

/// What the multipart body holds, as far as read.
#[derive(Default)]
struct Form {
    purpose: Option<String>,
    upload: Option<(Upload, Option<String>)>,
    /// `expires_after[anchor]` and `expires_after[seconds]`, checked once all is read.
    expires_anchor: Option<String>,
    expires_seconds: Option<String>,
    /// The digest of the file's bytes, taken while streaming when the request has an
    /// idempotency key (part of its fingerprint).
    digest: Option<Sha256>,
}

impl Form {
    /// The form once read: purpose `batch`, a non-empty file, and its expiry if any.
    fn checked(&self) -> Result<Option<ExpiresAfter>, ApiError> {
        match self.purpose.as_deref() {
            Some("batch") => {}
            other => return Err(invalid_purpose(other)),
        }
        let expires_after =
            expiry::from_fields("expires_after", self.expires_anchor.as_deref(), self.expires_seconds.as_deref())?;
        match &self.upload {
            None => Err(ApiError::bad_request(
                "missing_file",
                "No file part in the multipart body; send the file as `file`",
            )
            .with_param("file")),
            Some((file, _)) if file.bytes() == 0 => {
                Err(ApiError::bad_request("empty_file", "The uploaded file is empty").with_param("file"))
            }
            Some(_) => Ok(expires_after),
        }
    }

    /// What an idempotency key's request is known by: every field and the file's
    /// digest (`None` without a key, when no digest was taken).
    fn fingerprint(&mut self) -> Option<String> {
        let digest = self.digest.take()?;
        let filename = self.upload.as_ref().and_then(|(_, name)| name.as_deref());
        Some(fingerprint(&[
            b"POST /v1/files",
            self.purpose.as_deref().unwrap_or_default().as_bytes(),
            filename.unwrap_or_default().as_bytes(),
            self.expires_anchor.as_deref().unwrap_or_default().as_bytes(),
            self.expires_seconds.as_deref().unwrap_or_default().as_bytes(),
            &digest.finalize(),
        ]))
    }
}

/// Reads every part: `purpose` and `expires_after[...]` as text, `file` streamed into
/// storage, others skipped.
async fn read_parts(
    state: &AppState,
    project: &crate::ids::ProjectId,
    multipart: &mut Multipart,
    form: &mut Form,
) -> Result<(), ApiError> {
    while let Some(mut field) = multipart.next_field().await.map_err(multipart_error)? {
        match field.name() {
            Some("purpose") => {
                let value = read_text(&mut field).await?;
                // Refuse early when the purpose comes first: no need to store the file.
                if value != "batch" {
                    return Err(invalid_purpose(Some(&value)));
                }
                form.purpose = Some(value);
            }
            Some("expires_after[anchor]") => form.expires_anchor = Some(read_text(&mut field).await?),
            Some("expires_after[seconds]") => form.expires_seconds = Some(read_text(&mut field).await?),
            Some("file") => {
                if form.upload.is_some() {
                    return Err(ApiError::bad_request(
                        "invalid_multipart",
                        "The multipart body has more than one file part",
                    )
                    .with_param("file"));
                }
                let filename = field.file_name().map(|name| name.chars().take(MAX_FILENAME_CHARS).collect());
                let mut file = state.files.start_upload(project).await?;
                let streamed = stream_into(&mut field, &mut file, form.digest.as_mut()).await;
                form.upload = Some((file, filename));
                streamed?;
            }
            _ => while field.chunk().await.map_err(multipart_error)?.is_some() {},
        }
    }
    Ok(())
}

async fn stream_into(
    field: &mut Field<'_>,
    file: &mut Upload,
    mut digest: Option<&mut Sha256>,
) -> Result<(), ApiError> {
    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
        if file.bytes() + chunk.len() as u64 > MAX_UPLOAD_BYTES {
            return Err(too_large());
        }
        if let Some(digest) = digest.as_mut() {
            digest.update(&chunk);
        }
        file.write(chunk).await?;
    }
    Ok(())
}

async fn read_text(field: &mut Field<'_>) -> Result<String, ApiError> {
    let mut text = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
        if text.len() + chunk.len() > MAX_TEXT_FIELD_BYTES {
            return Err(ApiError::bad_request("invalid_multipart", "A text field of the multipart body is too long"));
        }
        text.extend_from_slice(&chunk);
    }
    String::from_utf8(text).map_err(|_| ApiError::bad_request("invalid_multipart", "A text field is not valid UTF-8"))
}

/// Reads and discards what is left of the body (bounded by the route's body limit),
/// so that a client still sending gets to read our error instead of a reset.
pub(super) async fn drain(multipart: &mut Multipart) {
    while let Ok(Some(mut field)) = multipart.next_field().await {
        while let Ok(Some(_)) = field.chunk().await {}
    }
}
