//! The HTTP API: one router per resource, merged, behind the shared layers.

mod batches;
mod error;
mod extract;
mod files;
mod idempotent;
mod list;
mod middleware;
pub mod rate_limits;
pub mod server;
mod shutdown;
mod upload;
mod uploads;

use std::sync::Arc;

use axum::Router;
use axum::middleware::{from_fn, from_fn_with_state};

pub use error::{ApiError, ErrorType};
pub use middleware::REQUEST_ID_HEADER;
pub use shutdown::Drain;

use crate::batches::{BatchSettings, BatchStore};
use crate::files::FileCatalog;
use crate::projects::ProjectDirectory;
use crate::quota::QuotaLedger;
use tokio::sync::Notify;

/// What every handler may reach.
#[derive(Clone)]
pub struct AppState {
    pub projects: Arc<ProjectDirectory>,
    pub files: FileCatalog,
    pub batches: Arc<dyn BatchStore>,
    pub batch_settings: BatchSettings,
    pub quota: Arc<QuotaLedger>,
    /// Wakes whatever executes batches when one is created or cancelled.
    pub wake: Arc<Notify>,
    /// Set when the server is stopping (see [`Drain`]).
    pub drain: Drain,
    /// Claims of `Idempotency-Key`s.
    pub idempotency: crate::idempotency::IdempotencyStore,
    /// Uploads of the Uploads API (files sent in parts).
    pub uploads: crate::uploads::UploadStore,
    /// Uploads and parts being received; when none is left, another is answered 429.
    pub receiving: Arc<tokio::sync::Semaphore>,
    /// Request rate limits (per project, and failed authentications per client).
    pub limits: Arc<rate_limits::RateLimits>,
}

/// `/metrics`, in the OpenMetrics text format, served on an address of its own (see
/// `roles::serve_metrics`), never by the API's router.
pub async fn metrics() -> impl axum::response::IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        crate::metrics::METRICS.encode(),
    )
}

/// `/backlog`: what the unfinished batches need of each upstream, as JSON in the shape
/// KEDA's `metrics-api` scaler reads (`upstreams.<name>.<field>`), served beside
/// `/metrics` by the process that drives batches (`serve`, the leading controller). A
/// controller that does not lead has none: 503, so a scaler never reads an empty backlog
/// as a true one.
pub async fn backlog() -> axum::response::Response {
    use axum::response::IntoResponse;
    match crate::metrics::METRICS.backlog() {
        Some(report) => axum::Json(report).into_response(),
        None => {
            let message = "no backlog here: this process does not drive batches (a controller that does not lead)";
            let body =
                serde_json::json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}});
            (axum::http::StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
        }
    }
}

/// The whole API. Layers run outside in: request id and logging, draining, panics as
/// 500s, CORS, then routing;
/// authentication wraps only the matched routes, so unknown URLs answer 404 as such.
pub fn router(state: AppState) -> Router {
    let drain = state.drain.clone();
    Router::new()
        .merge(files::router())
        .merge(uploads::router())
        .merge(batches::router())
        .route_layer(from_fn_with_state(state.clone(), middleware::authenticate))
        // Probes: no credentials, no dependencies checked beyond the process answering
        // (and, for readiness, not draining).
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/readyz", axum::routing::get(shutdown::readyz).with_state(drain.clone()))
        .fallback(middleware::not_found)
        .method_not_allowed_fallback(middleware::method_not_allowed)
        .with_state(state)
        .layer(middleware::cors())
        .layer(from_fn(middleware::preflight_no_content))
        .layer(middleware::catch_panic())
        .layer(from_fn_with_state(drain, shutdown::close_connections))
        .layer(from_fn(middleware::request_id))
}
