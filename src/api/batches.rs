//! `/v1/batches`: create, retrieve, list and cancel.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use super::AppState;
use super::error::{ApiError, ErrorType};
use super::extract::{self, CurrentProject, Path, Query};
use super::idempotent::{self, Begin};
use super::list::ListPage;
use crate::batches::create::CreateError;
use crate::batches::{BatchObject, CreateBatch, UpdateError, cancel};
use crate::clock;
use crate::drive::create::create_batch;
use crate::idempotency::{canonical_json, fingerprint};
use crate::ids::BatchId;

const DEFAULT_LIMIT: i64 = 20;
const MAX_LIMIT: i64 = 100;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/batches", post(create).get(list))
        .route("/v1/batches/", get(missing_id))
        .route("/v1/batches/{batch_id}", get(retrieve))
        .route("/v1/batches/{batch_id}/cancel", post(cancel_batch))
        .route("/v1/batches//cancel", post(missing_id))
}

impl From<CreateError> for ApiError {
    fn from(error: CreateError) -> Self {
        match error {
            CreateError::Request { message, param } => {
                ApiError::bad_request("invalid_request_error", message).with_param(param)
            }
            CreateError::InputNotFound(_) | CreateError::InputMissing(_) => {
                ApiError::not_found("file_not_found", error.to_string()).with_param("input_file_id")
            }
            CreateError::InputPurpose(_) => {
                ApiError::bad_request("invalid_purpose", error.to_string()).with_param("input_file_id")
            }
            CreateError::Invalid { error, .. } => {
                let mut api = ApiError::bad_request("invalid_request_error", error.message);
                api.param = error.param.map(Into::into);
                api.line = error.line;
                api
            }
            CreateError::Expiry(error) => error.into(),
            CreateError::Storage(error) => error.into(),
            CreateError::Store(error) => ApiError::internal("internal_error", error),
        }
    }
}

fn batch_not_found(id: &str) -> ApiError {
    ApiError::not_found("batch_not_found", format!("Batch not found: {id}")).with_param("batch_id")
}

async fn missing_id() -> ApiError {
    ApiError::bad_request("invalid_request_error", "Missing batch ID").with_param("batch_id")
}

async fn create(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    headers: HeaderMap,
    extract::Json(body): extract::Json<Value>,
) -> Result<Response, ApiError> {
    let request = CreateBatch::parse(&body)?;
    if !state.quota.has_room(&project.id) {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorType::InsufficientQuota,
            Some("insufficient_quota"),
            "You exceeded your current quota: the project's token quota is used up",
        ));
    }
    let id = BatchId::generate();
    let claimed = match idempotent::key_from(&headers)? {
        None => None,
        Some(key) => {
            let fingerprint = fingerprint(&[b"POST /v1/batches", &canonical_json(&body)]);
            let find = |object_id: String| {
                let (batches, project) = (state.batches.clone(), project.id.clone());
                async move {
                    let Some(id) = BatchId::parse(&object_id) else { return Ok(None) };
                    batches.get(&project, &id).await.map_err(|e| ApiError::internal("internal_error", e))
                }
            };
            match idempotent::begin(&state.idempotency, &project.id, &key, fingerprint, id.to_string(), find).await? {
                Begin::Replay(batch) => return Ok(idempotent::replayed(Json(BatchObject::from(&batch)))),
                Begin::Create(claim) => Some((key, claim)),
            }
        }
    };
    let created =
        create_batch(&state.files, state.batches.as_ref(), state.batch_settings, &project.id, id, request).await;
    if let (Err(_), Some((key, claim))) = (&created, &claimed) {
        idempotent::release(&state.idempotency, &project.id, key, claim).await;
    }
    let batch = created?;
    state.wake.notify_one();
    Ok(Json(BatchObject::from(&batch)).into_response())
}

async fn retrieve(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(batch_id): Path<String>,
) -> Result<Json<BatchObject>, ApiError> {
    let id = BatchId::parse(&batch_id).ok_or_else(|| batch_not_found(&batch_id))?;
    let batch = state.batches.get(&project.id, &id).await.map_err(|e| ApiError::internal("internal_error", e))?;
    Ok(Json(BatchObject::from(&batch.ok_or_else(|| batch_not_found(&batch_id))?)))
}

#[derive(Deserialize)]
struct ListParams {
    limit: Option<String>,
    after: Option<String>,
}

async fn list(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Query(params): Query<ListParams>,
) -> Result<Json<ListPage<BatchObject>>, ApiError> {
    let limit = match params.limit.as_deref().map(str::trim) {
        None | Some("") => DEFAULT_LIMIT,
        // Out-of-range limits are clamped, as the spec says; non-numbers are refused.
        Some(raw) => match raw.parse::<i128>() {
            Ok(n) => n.clamp(1, MAX_LIMIT as i128) as i64,
            Err(_) => {
                return Err(ApiError::bad_request(
                    "invalid_limit",
                    format!("Invalid limit {raw:?}: limit must be an integer"),
                )
                .with_param("limit"));
            }
        },
    };
    let after = match params.after.as_deref().filter(|a| !a.is_empty()) {
        None => None,
        Some(raw) => Some(BatchId::parse(raw).ok_or_else(|| {
            ApiError::bad_request("invalid_request_error", format!("Invalid cursor {raw:?}: `after` takes a batch id"))
                .with_param("after")
        })?),
    };
    let page = state
        .batches
        .list(&project.id, after.as_ref(), limit as usize)
        .await
        .map_err(|e| ApiError::internal("internal_error", e))?;
    let data = page.batches.iter().map(BatchObject::from).collect();
    Ok(Json(ListPage::new(data, page.has_more, |batch: &BatchObject| batch.id.to_string())))
}

async fn cancel_batch(
    State(state): State<AppState>,
    CurrentProject(project): CurrentProject,
    Path(batch_id): Path<String>,
) -> Result<Json<BatchObject>, ApiError> {
    let id = BatchId::parse(&batch_id).ok_or_else(|| batch_not_found(&batch_id))?;
    let now = clock::now();
    match state.batches.update(&project.id, &id, &|batch_state| cancel(batch_state, now)).await {
        Ok(batch) => {
            tracing::info!(batch = %id, status = batch.state.status.as_str(), "cancel requested");
            state.wake.notify_one();
            Ok(Json(BatchObject::from(&batch)))
        }
        Err(UpdateError::NotFound) => Err(batch_not_found(&batch_id)),
        Err(UpdateError::Refused(refusal)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorType::InvalidRequestError,
            Some("batch_not_cancellable"),
            format!("Cannot cancel batch {batch_id}: it is already {}", refusal.0.as_str()),
        )),
        Err(UpdateError::Store(error)) => Err(ApiError::internal("internal_error", error)),
    }
}
