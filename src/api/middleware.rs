//! Cross-cutting layers: request ids and logging, CORS, authentication, and the
//! envelope for the router's own 404 and 405.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use super::AppState;
use super::error::{ApiError, ErrorType};
use crate::auth::{API_KEY_HEADER, PROJECT_HEADER, Project};
use crate::ids::RequestId;
use crate::metrics::{HttpLabels, METRICS};

pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Gives every exchange a `req_…` id (header and log span), logs its outcome, and
/// turns a panic in a handler into a 500 envelope instead of a dropped connection.
pub async fn request_id(request: Request, next: Next) -> Response {
    let id = RequestId::generate();
    let started = Instant::now();
    let method = request.method().to_string();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %request.method(),
        path = %request.uri().path(),
        project = tracing::field::Empty,
    );
    let mut response = async move {
        let outcome = AssertUnwindSafe(next.run(request)).catch_unwind().await;
        let response =
            outcome.unwrap_or_else(|_| ApiError::internal("internal_error", "handler panicked").into_response());
        let status = response.status().as_u16();
        let elapsed_ms = started.elapsed().as_millis() as u64;
        if response.status().is_server_error() {
            tracing::warn!(status, elapsed_ms, "answered");
        } else {
            tracing::info!(status, elapsed_ms, "answered");
        }
        response
    }
    .instrument(span)
    .await;
    if let Ok(value) = HeaderValue::from_str(id.as_str()) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    let labels = HttpLabels { method, route, status: response.status().as_u16() };
    METRICS.http_requests.get_or_create(&labels).inc();
    response
}

const ALLOWED_HEADERS: &str = "authorization, content-type, x-api-key, x-project-id, openai-organization, \
    openai-project, x-stainless-arch, x-stainless-lang, x-stainless-os, x-stainless-package-version, \
    x-stainless-runtime, x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout";

/// Browsers may call the API from any origin (auth is by header, never by cookie):
/// preflights answer 204 and every response carries the CORS headers.
pub async fn cors(request: Request, next: Next) -> Response {
    let is_preflight =
        request.method() == Method::OPTIONS && request.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if is_preflight { StatusCode::NO_CONTENT.into_response() } else { next.run(request).await };
    let headers = response.headers_mut();
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    headers.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("x-request-id"));
    if is_preflight {
        headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, DELETE, OPTIONS"));
        headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static(ALLOWED_HEADERS));
        headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("86400"));
    }
    response
}

/// Authenticates `x-project-id` + `x-api-key` and hands the project to the handler.
pub async fn authenticate(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let project = match authenticated_project(&state, request.headers()) {
        Ok(project) => project,
        Err(error) => return error.into_response(),
    };
    tracing::Span::current().record("project", project.id.as_str());
    request.extensions_mut().insert(project);
    next.run(request).await
}

fn authenticated_project(state: &AppState, headers: &HeaderMap) -> Result<Project, ApiError> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    Ok(state.projects.current().authenticate(header(PROJECT_HEADER), header(API_KEY_HEADER))?.clone())
}

/// Unknown routes, worded like OpenAI's.
pub async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorType::InvalidRequestError,
        Some("unknown_url"),
        format!("Invalid URL ({method} {})", uri.path()),
    )
}

pub async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorType::InvalidRequestError,
        Some("method_not_allowed"),
        format!("Method {method} is not allowed for {}", uri.path()),
    )
}
