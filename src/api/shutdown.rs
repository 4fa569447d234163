//! Leaving a load balancer without refusing anyone. A stopping api pod is removed from its
//! Service's endpoints at the same moment it is sent SIGTERM, and every node's kube-proxy
//! (and any ingress) takes a moment to notice: a server that stops accepting at once
//! refuses the connections still routed to it, even during a rolling update that keeps
//! enough replicas ready. So a draining server first turns unready (`/readyz` answers 503)
//! and asks clients to move (`Connection: close` on every response) for a short delay,
//! and only then stops accepting and finishes the requests in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Whether the server is draining; shared by the probe, the middleware and the shutdown.
#[derive(Clone, Debug, Default)]
pub struct Drain(Arc<AtomicBool>);

impl Drain {
    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Waits for `signal`, drains for `delay`, then returns: pass this future to
    /// `axum::serve(..).with_graceful_shutdown`, which then stops accepting and finishes
    /// the requests in flight.
    pub async fn on(self, signal: impl Future<Output = ()>, delay: Duration) {
        signal.await;
        self.0.store(true, Ordering::Relaxed);
        if !delay.is_zero() {
            tracing::info!(?delay, "draining: unready, closing connections after each response");
            tokio::time::sleep(delay).await;
        }
    }
}

/// `GET /readyz`: 200 while serving, 503 while draining.
pub async fn readyz(State(drain): State<Drain>) -> Response {
    if drain.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        "ok".into_response()
    }
}

/// While draining, every response closes its connection, so clients' next requests open
/// new ones, which the Service sends to a replica that is not stopping.
pub async fn close_connections(State(drain): State<Drain>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    if drain.is_draining() {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn draining_starts_at_the_signal_and_lasts_the_delay() {
        let drain = Drain::default();
        let (fire, signal) = tokio::sync::oneshot::channel::<()>();
        let delay = Duration::from_millis(200);
        let shutdown = tokio::spawn(drain.clone().on(async move { signal.await.unwrap() }, delay));
        tokio::task::yield_now().await;
        assert!(!drain.is_draining(), "serving until the signal");
        let fired = std::time::Instant::now();
        fire.send(()).unwrap();
        while !drain.is_draining() {
            tokio::task::yield_now().await;
        }
        shutdown.await.unwrap();
        assert!(fired.elapsed() >= delay, "still accepting for the whole delay");
    }

    #[tokio::test]
    async fn a_draining_server_is_unready_and_closes_every_connection() {
        use tower::ServiceExt;

        let drain = Drain::default();
        let app = axum::Router::new()
            .route("/readyz", axum::routing::get(readyz).with_state(drain.clone()))
            .route("/other", axum::routing::get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(drain.clone(), close_connections));
        let get = |path: &'static str| {
            let app = app.clone();
            async move {
                app.oneshot(axum::http::Request::get(path).body(axum::body::Body::empty()).unwrap()).await.unwrap()
            }
        };
        let serving = get("/readyz").await;
        assert_eq!(serving.status(), StatusCode::OK);
        assert!(serving.headers().get(header::CONNECTION).is_none(), "keep-alive while serving");

        drain.clone().on(async {}, Duration::ZERO).await;
        let draining = get("/readyz").await;
        assert_eq!(draining.status(), StatusCode::SERVICE_UNAVAILABLE);
        let other = get("/other").await;
        assert_eq!(other.status(), StatusCode::OK, "requests are still answered");
        assert_eq!(other.headers().get(header::CONNECTION).unwrap(), "close");
    }
}
