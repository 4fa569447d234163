//! Cross-cutting layers: request ids and logging, panics as 500 envelopes, CORS,
//! authentication, and the envelope for the router's own 404 and 405.

use std::any::Any;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::{CatchPanicLayer, ResponseForPanic};
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer, ExposeHeaders};
use tracing::Instrument;

use super::AppState;
use super::error::{ApiError, ErrorType};
use super::rate_limits::ClientAddress;
use crate::ids::RequestId;
use crate::metrics::{HttpLabels, METRICS, RouteLabels};
use crate::projects::{Credentials, Project};

pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Gives every exchange a `req_…` id (header and log span) and logs its outcome.
pub async fn request_id(request: Request, next: Next) -> Response {
    let id = RequestId::generate();
    let started = Instant::now();
    let method = method_label(request.method());
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
        let response = next.run(request).await;
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
    // Until the response's head: a download's body streams after.
    let took = started.elapsed().as_secs_f64();
    METRICS.http_duration.get_or_create(&RouteLabels { method, route: route.clone() }).observe(took);
    let labels = HttpLabels { method, route, status: response.status().as_u16() };
    METRICS.http_requests.get_or_create(&labels).inc();
    response
}

/// A request's method as a metrics label: a closed set, whatever a client sends (any
/// token is a valid HTTP method, and each new label value would be a new series).
fn method_label(method: &Method) -> &'static str {
    const KNOWN: [&str; 7] = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"];
    KNOWN.into_iter().find(|known| *known == method.as_str()).unwrap_or("other")
}

/// Turns a panic in a handler into the 500 envelope, instead of a dropped connection.
/// It sits inside `request_id`, so that the answer still carries the request's id.
pub fn catch_panic() -> CatchPanicLayer<PanicEnvelope> {
    CatchPanicLayer::custom(PanicEnvelope)
}

#[derive(Clone, Copy)]
pub struct PanicEnvelope;

impl ResponseForPanic for PanicEnvelope {
    type ResponseBody = axum::body::Body;

    fn response_for_panic(&mut self, panic: Box<dyn Any + Send + 'static>) -> Response {
        let message =
            panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str));
        let detail = format!("handler panicked: {}", message.unwrap_or("(not a string)"));
        ApiError::internal("internal_error", detail).into_response()
    }
}

const ALLOWED_HEADERS: [&str; 14] = [
    "authorization",
    "content-type",
    "x-api-key",
    "x-project-id",
    "openai-organization",
    "openai-project",
    "x-stainless-arch",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-retry-count",
    "x-stainless-timeout",
];

/// Browsers may call the API from any origin (auth is by header, never by cookie): every
/// response carries the CORS headers and preflights are answered before routing.
pub fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(AllowOrigin::any())
        .allow_methods(AllowMethods::list([Method::GET, Method::POST, Method::DELETE, Method::OPTIONS]))
        .allow_headers(AllowHeaders::list(ALLOWED_HEADERS.map(HeaderName::from_static)))
        .expose_headers(ExposeHeaders::list([REQUEST_ID_HEADER]))
        .max_age(Duration::from_secs(86400))
}

/// A CORS preflight answered by [`cors`] is the spec's `204` (success with no body);
/// the layer itself answers 200.
pub async fn preflight_no_content(request: Request, next: Next) -> Response {
    let preflight = request.method() == Method::OPTIONS
        && request.headers().contains_key(axum::http::header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = next.run(request).await;
    if preflight && response.status() == StatusCode::OK {
        *response.status_mut() = StatusCode::NO_CONTENT;
    }
    response
}

/// Authenticates `x-project-id` + `x-api-key` (or a bearer key) and hands the project to the handler,
/// within the rate limits: a client's failed attempts, then the project's requests.
pub async fn authenticate(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let project = match authenticated_project(&state, request.headers()) {
        Ok(project) => project,
        Err(error) => {
            let client = request.extensions().get::<ClientAddress>().copied();
            return match state.limits.check_failed_auth(client) {
                Ok(()) => error.into_response(),
                Err(throttled) => throttled.into_response(),
            };
        }
    };
    if let Err(throttled) = state.limits.check_project(&project) {
        return throttled.into_response();
    }
    tracing::Span::current().record("project", project.id.as_str());
    request.extensions_mut().insert(project);
    next.run(request).await
}

fn authenticated_project(state: &AppState, headers: &HeaderMap) -> Result<Project, ApiError> {
    let credentials = Credentials::from_headers(|name| headers.get(name).and_then(|v| v.to_str().ok()));
    Ok(state.projects.current().authenticate_with(credentials)?.clone())
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

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::body::Body;
    use axum::middleware::from_fn;
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    async fn boom() -> &'static str {
        panic!("a bug")
    }

    #[tokio::test]
    async fn a_panicking_handler_answers_the_500_envelope_with_its_request_id() {
        let router = Router::new().route("/boom", get(boom)).layer(catch_panic()).layer(from_fn(request_id));
        let response = router.oneshot(Request::get("/boom").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(response.headers()[REQUEST_ID_HEADER].to_str().unwrap().starts_with("req_"));
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["type"], "internal_error", "{body}");
        assert_eq!(body["error"]["code"], "internal_error", "{body}");
        assert!(!body.to_string().contains("a bug"), "the panic's text stays in the log: {body}");
    }
}
