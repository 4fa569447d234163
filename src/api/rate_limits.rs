//! Request rate limits, answered as OpenAI does: 429 `rate_limit_exceeded` with
//! `retry-after`. Two kinds: requests of a project (all its keys together; the project's
//! `rate_limit`, else `http.requests_per_minute`), and failed authentications by client
//! address (`http.failed_auth_per_minute`), so that guessing keys is slow.
//!
//! Limits hold per process: with several api replicas behind a Service, a project may
//! send up to the limit to each replica (see docs/src/kubernetes.md).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Mutex;

use axum::http::StatusCode;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, NotUntil, Quota, RateLimiter};

use super::error::{ApiError, ErrorType};
use crate::config::HttpConfig;
use crate::ids::ProjectId;
use crate::projects::Project;

/// The address of the client at the other end of the connection (set by the server).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddress(pub SocketAddr);

pub struct RateLimits {
    default_per_minute: u32,
    projects: Mutex<HashMap<ProjectId, (u32, DefaultDirectRateLimiter)>>,
    failed_auth: DefaultKeyedRateLimiter<IpAddr>,
    /// Failed authentications seen: every [`TRIM_EVERY`] of them, clients whose limits
    /// have refilled are forgotten, so that many addresses can't grow memory for good.
    failures: std::sync::atomic::AtomicU64,
    clock: DefaultClock,
}

fn quota(per_minute: u32) -> Quota {
    Quota::per_minute(NonZeroU32::new(per_minute.max(1)).expect("at least 1"))
}

impl RateLimits {
    pub fn new(http: &HttpConfig) -> Self {
        Self {
            default_per_minute: http.requests_per_minute,
            projects: Mutex::default(),
            failed_auth: RateLimiter::keyed(quota(http.failed_auth_per_minute)),
            failures: std::sync::atomic::AtomicU64::new(0),
            clock: DefaultClock::default(),
        }
    }

    fn refused(&self, not_until: &NotUntil<<DefaultClock as Clock>::Instant>, what: &str) -> ApiError {
        let wait = not_until.wait_time_from(self.clock.now());
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorType::RateLimitExceeded,
            Some("rate_limit_exceeded"),
            format!("Rate limit reached for {what}. Please try again in {}s.", seconds.max(1)),
        )
        .with_retry_after(seconds.max(1))
    }

    /// One request of `project`.
    pub fn check_project(&self, project: &Project) -> Result<(), ApiError> {
        let per_minute = project.requests_per_minute.unwrap_or(self.default_per_minute);
        let mut projects = self.projects.lock().expect("rate limits");
        let entry =
            projects.entry(project.id.clone()).or_insert_with(|| (per_minute, RateLimiter::direct(quota(per_minute))));
        if entry.0 != per_minute {
            // The project's limit changed: start over with the new one.
            *entry = (per_minute, RateLimiter::direct(quota(per_minute)));
        }
        entry.1.check().map_err(|not_until| self.refused(&not_until, "requests of this project"))
    }

    /// One failed authentication from `client`: refused (429) once there were too many.
    pub fn check_failed_auth(&self, client: Option<ClientAddress>) -> Result<(), ApiError> {
        let address = client.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
        if self.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % TRIM_EVERY == TRIM_EVERY - 1 {
            self.failed_auth.retain_recent();
        }
        self.failed_auth.check_key(&address).map_err(|not_until| self.refused(&not_until, "failed authentications"))
    }
}

const TRIM_EVERY: u64 = 1024;
