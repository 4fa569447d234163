//! `http:` and `metrics:`: the API's HTTP server's limits, and where `/metrics` is served.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::duration;

/// `/metrics` has its own address: its series name every project, so it is for the
/// operator's Prometheus, not for whoever reaches the API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// The address; `null` serves no metrics.
    #[serde(default = "default_metrics_listen")]
    pub listen: Option<SocketAddr>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { listen: default_metrics_listen() }
    }
}

fn default_metrics_listen() -> Option<SocketAddr> {
    Some(SocketAddr::from(([127, 0, 0, 1], 9464)))
}

/// What a client may hold of the API's HTTP server, so that slow or idle clients can't
/// take it down: every connection is cut off when it stalls.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Time to send a request's headers, counted from the connection's opening or, on a
    /// kept-alive connection, from the previous response: also the idle timeout.
    #[serde(default = "default_header_timeout", deserialize_with = "duration::deserialize_precise")]
    pub header_timeout: Duration,
    /// Longest pause between two pieces of a request body (an upload that stalls).
    #[serde(default = "default_body_idle_timeout", deserialize_with = "duration::deserialize_precise")]
    pub body_idle_timeout: Duration,
    /// Connections served at once; more wait to be accepted.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections one client (an IPv4 address, an IPv6 /64) may hold at once; more from
    /// it are closed at once. Behind a proxy every client is the proxy: raise it there.
    #[serde(default = "default_max_connections_per_client")]
    pub max_connections_per_client: usize,
    /// On shutdown, how long requests in progress (a download to a slow reader) may take
    /// to finish before they are cut.
    #[serde(default = "default_shutdown_timeout", deserialize_with = "duration::deserialize_precise")]
    pub shutdown_timeout: Duration,
    /// Uploads received at once; more are answered 429 with `retry-after`.
    #[serde(default = "default_max_uploads")]
    pub max_uploads: usize,
    /// Requests a project may send a minute (all its keys together), unless the project
    /// sets its own `rate_limit`; per api process.
    #[serde(default = "default_requests_per_minute")]
    pub requests_per_minute: u32,
    /// Failed authentications a client address may make a minute; then 429.
    #[serde(default = "default_failed_auth_per_minute")]
    pub failed_auth_per_minute: u32,
}

fn default_requests_per_minute() -> u32 {
    6000
}

fn default_failed_auth_per_minute() -> u32 {
    60
}

fn default_header_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_body_idle_timeout() -> Duration {
    Duration::from_secs(60)
}

fn default_max_connections() -> usize {
    4096
}

fn default_max_connections_per_client() -> usize {
    256
}

fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(20)
}

fn default_max_uploads() -> usize {
    64
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_timeout: default_header_timeout(),
            body_idle_timeout: default_body_idle_timeout(),
            max_connections: default_max_connections(),
            max_connections_per_client: default_max_connections_per_client(),
            shutdown_timeout: default_shutdown_timeout(),
            max_uploads: default_max_uploads(),
            requests_per_minute: default_requests_per_minute(),
            failed_auth_per_minute: default_failed_auth_per_minute(),
        }
    }
}
