//! `/v1/files`: list, retrieve, download and delete (upload is in `upload.rs`).

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use super::extract::{CurrentProject, Path, Query};
use super::list::ListPage;
use super::upload::{MAX_UPLOAD_REQUEST_BYTES, create_file};
use crate::files::{FileListQuery, FileObject, FileRecord, Order};
use crate::ids::FileId;
use crate::storage::StorageError;

/// OpenAI's bounds for `GET /v1/files?limit=`.
const DEFAULT_LIMIT: usize = 10_000;
const MAX_LIMIT: usize = 10_000;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/files", post(create_file).layer(DefaultBodyLimit::max(MAX_UPLOAD_REQUEST_BYTES)).get(list_files))
        .route("/v1/files/{file_id}", get(retrieve_file).delete(delete_file))
        .route("/v1/files/{file_id}/content", get(file_content))
}

fn file_not_found(id: &str) -> ApiError {
    ApiError::not_found("file_not_found", format!("No such file: {id}")).with_param("file_id")
}

async fn find(state: &AppState, project: &crate::projects::Project, id: &str) -> Result<FileRecord, ApiError> {
    state.files.find(&project.id, id).await?.ok_or_else(|| file_not_found(id))
}

#[derive(Deserialize)]
struct ListParams {
    purpose: Option<String>,
    limit: Option<String>,
    after: Option<String>,
    order: Option<String>,
}

fn parse_list_params(params: ListParams) -> Result<FileListQuery, ApiError> {
    let limit = match params.limit.as_deref() {
        None => DEFAULT_LIMIT,
        Some(raw) => match raw.trim().parse::<u64>() {
            Ok(n) if n > 0 => usize::try_from(n).unwrap_or(MAX_LIMIT).min(MAX_LIMIT),
            _ => {
                return Err(ApiError::bad_request(
                    "invalid_limit",
                    format!("Invalid limit {raw:?}: limit must be a positive integer"),
                )
                .with_param("limit"));
            }
        },
    };
    let order = match params.order.as_deref() {
        None | Some("desc") => Order::Desc,
        Some("asc") => Order::Asc,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_order",
                format!("Invalid order {other:?}: use \"asc\" or \"desc\""),
            )
            .with_param("order"));
        }
    };
    let after = params.after.filter(|after| !after.is_empty());
    Ok(FileListQuery { purpose: params.purpose.filter(|p| !p.is_empty()), order, after, limit })
}

async fn list_files(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Query(params): Query<ListParams>,
) -> Result<Json<ListPage<FileObject>>, ApiError> {
    let query = parse_list_params(params)?;
    let page = state.files.list(&project.id, &query).await?;
    let data = page.records.iter().map(FileObject::from).collect();
    Ok(Json(ListPage::new(data, page.has_more, |file: &FileObject| file.id.to_string())))
}

async fn retrieve_file(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(file_id): Path<String>,
) -> Result<Json<FileObject>, ApiError> {
    Ok(Json(FileObject::from(&find(&state, &project, &file_id).await?)))
}

async fn file_content(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(file_id): Path<String>,
) -> Result<Response, ApiError> {
    let record = find(&state, &project, &file_id).await?;
    let stream = match state.files.open(&record).await {
        Ok(stream) => stream,
        Err(StorageError::NotFound(_)) => {
            return Err(ApiError::not_found("file_not_found", format!("The content of file {file_id} is missing"))
                .with_param("file_id"));
        }
        Err(error) => return Err(error.into()),
    };
    let body = Body::from_stream(stream.inspect_err(|error| tracing::error!(%error, "file download broke off")));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, record.bytes.to_string()),
        ],
        body,
    )
        .into_response())
}

#[derive(Serialize)]
struct Deleted {
    id: FileId,
    object: &'static str,
    deleted: bool,
}

async fn delete_file(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(file_id): Path<String>,
) -> Result<Json<Deleted>, ApiError> {
    let record = state.files.delete(&project.id, &file_id).await?.ok_or_else(|| file_not_found(&file_id))?;
    tracing::info!(file = %record.id, "file deleted");
    Ok(Json(Deleted { id: record.id, object: "file", deleted: true }))
}
