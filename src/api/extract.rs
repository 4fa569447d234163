//! Extractors whose rejections answer in the API's own error envelope.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::{ApiError, ErrorType};
use crate::projects::Project;

/// `axum::Json`, rejecting bad bodies with OpenAI-shaped 400s (and 413 when too big).
pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::bad_request("invalid_content_type", "Expected a request with Content-Type: application/json")
        }
        JsonRejection::JsonSyntaxError(_) => ApiError::bad_request(
            "invalid_json",
            "We could not parse the JSON body of your request. The API expects a JSON payload.",
        ),
        JsonRejection::JsonDataError(error) => ApiError::bad_request("invalid_json", error.body_text()),
        JsonRejection::BytesRejection(error) if error.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            Some("request_too_large"),
            "The request body is too large",
        ),
        other => ApiError::bad_request("invalid_request_error", other.body_text()),
    }
}

/// `axum::extract::Query` with enveloped rejections.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection @ QueryRejection::FailedToDeserializeQueryString(_)) => {
                Err(ApiError::bad_request("invalid_request_error", rejection.body_text()))
            }
            Err(other) => Err(ApiError::bad_request("invalid_request_error", other.body_text())),
        }
    }
}

/// `axum::extract::Path` with enveloped rejections (a path segment that is not valid
/// UTF-8 once percent-decoded, such as `%FF`).
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::bad_request("invalid_request_error", rejection.body_text())),
        }
    }
}

/// The project that the auth middleware authenticated for this request.
pub struct CurrentProject(pub Project);

impl<S: Send + Sync> FromRequestParts<S> for CurrentProject {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Project>()
            .cloned()
            .map(Self)
            .ok_or_else(|| ApiError::internal("internal_error", "route reached without authentication"))
    }
}
