//! The API's HTTP server: axum's router on hyper, with the limits that keep slow or idle
//! clients from holding it (`http` in the configuration): a deadline for each request's
//! headers (which is also the idle timeout of a kept-alive connection), a longest pause
//! in a request body, and a bound on connections served at once. Accept errors (out of
//! file descriptors) back off instead of spinning.

use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_http::timeout::RequestBodyTimeoutLayer;

use super::limits::ClientAddress;
use crate::config::HttpConfig;

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting and
/// waits for the connections in progress to finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let router = router.layer(RequestBodyTimeoutLayer::new(limits.body_idle_timeout));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new()).keep_alive_interval(Some(limits.header_timeout));
    let connections = std::sync::Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut backoff = Duration::ZERO;
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = connections.clone().acquire_owned() => permit.expect("the connection semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors (or memory): wait for connections to end.
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                    tracing::warn!(%error, ?backoff, "accept failed; backing off");
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            },
        };
        backoff = Duration::ZERO;
        let _ = stream.set_nodelay(true);
        // The client's address, for the rate limits (an extension, not a layer per connection).
        let service = router.clone().map_request(move |mut request: axum::extract::Request<Incoming>| {
            request.extensions_mut().insert(ClientAddress(peer));
            request
        });
        let service = TowerToHyperService::new(service);
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that stalls or leaves ends its connection: nothing to report.
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
