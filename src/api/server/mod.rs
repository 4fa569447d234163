//! The API's HTTP server: axum's router on hyper, with the limits that keep slow, idle or
//! hostile clients from holding it (`http` in the configuration):
//! - a connection with no request in progress for `header_timeout` is closed, counted
//!   from its opening or its last response, whatever the protocol ([`idle`]); hyper's
//!   own deadline also cuts a head that is still arriving after `header_timeout`;
//! - a request body that pauses for `body_idle_timeout` is cut;
//! - at most `max_connections` connections at once, and `max_connections_per_client`
//!   of them from one client ([`clients`]): more from that client are closed at once;
//! - what hyper answers by itself is answered in the API's envelope ([`unparsed`]);
//! - on shutdown, requests in progress get `shutdown_timeout` to finish, then are cut.
//!
//! Accept errors (out of file descriptors) back off instead of spinning.

mod clients;
mod idle;
mod unparsed;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceExt};
use tower_http::timeout::RequestBodyTimeoutLayer;

use self::clients::ClientSlots;
use self::idle::Activity;
use self::unparsed::{Enveloped, MAX_HEADERS};

use super::rate_limits::ClientAddress;
use crate::config::HttpConfig;

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, gives
/// the requests in progress `shutdown_timeout` to finish, and cuts what is left.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let router = router.layer(RequestBodyTimeoutLayer::new(limits.body_idle_timeout));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).max_headers(MAX_HEADERS);
    // Pings find peers that are gone; they do not keep an idle connection open (see `idle`).
    builder.http2().timer(TokioTimer::new()).keep_alive_interval(Some(limits.header_timeout));
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let clients = ClientSlots::new(limits.max_connections_per_client);
    let graceful = GracefulShutdown::new();
    let cut = CancellationToken::new();
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
        let Some(slot) = clients.take(peer.ip()) else {
            tracing::debug!(%peer, "closed a connection: its client holds max_connections_per_client");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let activity = Activity::new();
        let service = TowerToHyperService::new(tracked(router.clone(), peer, activity.clone()));
        let io = TokioIo::new(Enveloped::new(stream, activity.clone()));
        let connection = graceful.watch(builder.serve_connection_with_upgrades(io, service).into_owned());
        let (cut, idle_limit) = (cut.clone(), limits.header_timeout);
        tokio::spawn(async move {
            // A client that stalls or leaves ends its connection: nothing to report.
            tokio::select! {
                _ = connection => {}
                () = activity.idle_for(idle_limit) => tracing::debug!(%peer, "closed an idle connection"),
                () = cut.cancelled() => {}
            }
            drop((permit, slot));
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(timeout = ?limits.shutdown_timeout, "requests still in progress at the shutdown timeout: cut");
        cut.cancel();
    }
    Ok(())
}

/// The router as one connection's service: each request carries the client's address
/// (for the rate limits) and is in progress on the connection until its response's body
/// is sent or dropped.
fn tracked(
    router: Router,
    peer: std::net::SocketAddr,
    activity: Arc<Activity>,
) -> impl Service<
    axum::extract::Request<Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send,
> + Clone {
    tower::service_fn(move |mut request: axum::extract::Request<Incoming>| {
        request.extensions_mut().insert(ClientAddress(peer));
        let in_progress = activity.begin();
        let answer = router.clone().oneshot(request);
        async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                axum::body::Body::new(body.map_frame(move |frame| {
                    let _in_progress = &in_progress;
                    frame
                }))
            }))
        }
    })
}
