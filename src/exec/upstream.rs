//! Upstreams: which OpenAI-compatible endpoint serves a model, with how many
//! requests in flight. The permits are shared by every shard in the process; in a
//! Kubernetes worker they are the pod's share of the installation's limit.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::backoff::Backoff;
use super::limiter::Limiter;
use super::reachability::Reachability;
use super::recalls::Recalls;
use crate::concurrency::Observed;
use crate::concurrency::control::Control;
use crate::concurrency::discovery::Discovery;
use crate::concurrency::signals::LoadSignalConfig;
use crate::config::UpstreamConfig;
use crate::config::upstreams::LoadSignalSetting;
pub use crate::config::upstreams::{ECHO_MODEL, Route};
use crate::telemetry::LogThrottle;
use crate::validate::BATCHABLE_URLS;

pub struct Upstream {
    pub name: String,
    /// `<base_url>/chat/completions` and the other batchable paths, in the order of
    /// [`BATCHABLE_URLS`], parsed once rather than on every request.
    urls: Vec<reqwest::Url>,
    pub api_key: Option<String>,
    models: Vec<String>,
    pub limiter: Arc<Limiter>,
    /// `max_concurrency`: over the installation (the controller divides it among worker
    /// pods) or, in `serve`, of the process.
    pub max_concurrency: u32,
    pub timeout: Duration,
    pub backoff: Backoff,
    /// This upstream's `nightshift_upstream_request_duration_seconds`.
    pub latency: prometheus_client::metrics::histogram::Histogram,
    /// Whether the limit adapts under `max_concurrency` (`crate::concurrency`).
    pub adaptive: bool,
    /// Its load signal as configured, or as found at the server ([`Self::load_signal`]).
    configured_signal: Option<LoadSignalConfig>,
    found_signal: OnceLock<LoadSignalConfig>,
    /// Where its signal is looked for: where none is configured and the limit adapts.
    pub discovery: Option<Discovery>,
    /// The `priority` set on its batch lines.
    pub priority: Option<i64>,
    /// Its finished requests, for the adaptive limit.
    pub observed: Observed,
    /// The grant and the load signal's verdict, shared with its control loop.
    pub control: Control,
    /// Since when it has refused connections, shared by its lines.
    pub reachability: Reachability,
    /// Its requests in flight, to take the youngest back from its queue when its users
    /// come (only with a load signal, which tells when, from a server that drops a
    /// request whose client hung up).
    pub recalls: Recalls,
    /// Lines it failed, logged with the address that answered at most every
    /// [`REJECTION_LOG_EVERY`].
    rejections: std::sync::Mutex<LogThrottle>,
}

impl Upstream {
    /// Its load signal: as configured, or as found at the server.
    pub fn load_signal(&self) -> Option<&LoadSignalConfig> {
        self.configured_signal.as_ref().or_else(|| self.found_signal.get())
    }

    /// The signal found at the server, read from now on (where its server drops a
    /// request whose client hung up, the batch's queued lines may be taken back too).
    pub fn signal_found(&self, signal: LoadSignalConfig) {
        if signal.server.drops_hung_up() {
            self.recalls.enable();
        }
        let _ = self.found_signal.set(signal);
    }

    /// Where a line of a batch for `endpoint` (`/v1/embeddings`) goes: the same path
    /// under the upstream's base URL.
    pub fn url_for(&self, endpoint: &str) -> &reqwest::Url {
        let position = BATCHABLE_URLS.iter().position(|url| *url == endpoint).unwrap_or(0);
        &self.urls[position]
    }

    /// Logs a line this upstream failed (`status`, from `remote`) at most every
    /// [`REJECTION_LOG_EVERY`]: which address answered is in no error file, and tells a
    /// replica or a proxy that answers wrongly from the model server itself.
    pub fn log_rejection(&self, status: u16, remote: Option<std::net::SocketAddr>, message: &str) {
        if !self.rejections.lock().expect("never poisoned").due(Instant::now()) {
            return;
        }
        tracing::warn!(upstream = %self.name, status, ?remote, message, "the upstream failed a line (its error file has every one)");
    }
}

/// The least time between two lines logged as failed by one upstream.
const REJECTION_LOG_EVERY: Duration = Duration::from_secs(60);

/// Every configured upstream, in the order of the configuration: the first whose
/// `models` match serves the line. The built-in `echo` model serves what no upstream
/// claims when none is configured (so Nightshift works offline), and `echo` always.
pub struct Upstreams {
    upstreams: Vec<Upstream>,
}

/// Requests in flight to the built-in echo model.
const ECHO_CONCURRENCY: usize = 256;

/// An upstream of the configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream {upstream}: the environment variable {variable} (api_key_env) is not set")]
    ApiKeyUnset { upstream: String, variable: String },
    #[error("upstream {upstream}: base_url {base_url:?} is not a URL: {source}")]
    BaseUrl { upstream: String, base_url: String, source: url::ParseError },
}

impl Upstreams {
    /// Every upstream with its whole `max_concurrency` (in `serve`), or with none until
    /// granted some (`granted`: a Kubernetes worker, see `crate::grants`).
    pub fn from_config(configs: &[UpstreamConfig], granted: bool) -> Result<Self, UpstreamError> {
        let mut upstreams = Vec::new();
        for config in configs {
            let api_key = match &config.api_key_env {
                Some(name) => Some(std::env::var(name).map_err(|_| UpstreamError::ApiKeyUnset {
                    upstream: config.name.clone(),
                    variable: name.clone(),
                })?),
                None => None,
            };
            let base = config.base_url.trim_end_matches('/');
            let urls = BATCHABLE_URLS
                .iter()
                .map(|path| reqwest::Url::parse(&format!("{base}{}", path.trim_start_matches("/v1"))))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| UpstreamError::BaseUrl {
                    upstream: config.name.clone(),
                    base_url: config.base_url.clone(),
                    source,
                })?;
            upstreams.push(Upstream {
                name: config.name.clone(),
                urls,
                api_key,
                models: config.models.clone(),
                limiter: Arc::new(Limiter::new(if granted { 0 } else { config.max_concurrency as u32 })),
                max_concurrency: config.max_concurrency as u32,
                timeout: config.timeout,
                backoff: Backoff { base: config.retry_base_delay, ..Backoff::default() },
                latency: crate::metrics::METRICS.upstream_latency_of(&config.name),
                adaptive: config.adaptive,
                configured_signal: config.load_signal.set().cloned(),
                found_signal: OnceLock::new(),
                discovery: (config.adaptive && config.load_signal == LoadSignalSetting::Discover)
                    .then(|| Discovery::new(&config.base_url)),
                priority: config.priority,
                observed: Observed::default(),
                control: Control::default(),
                reachability: Reachability::default(),
                recalls: Recalls::new(config.load_signal.set().is_some_and(|signal| signal.server.drops_hung_up())),
                rejections: std::sync::Mutex::new(LogThrottle::every(REJECTION_LOG_EVERY)),
            });
        }
        Ok(Self { upstreams })
    }

    pub fn iter(&self) -> impl Iterator<Item = &Upstream> {
        self.upstreams.iter()
    }

    /// The upstream a [`Route::Upstream`] names.
    pub fn get(&self, position: usize) -> &Upstream {
        &self.upstreams[position]
    }

    pub fn echo_only() -> Self {
        Self { upstreams: Vec::new() }
    }

    /// Where the lines of `model` go ([`crate::config::upstreams::route`]).
    pub fn route(&self, model: &str) -> Route {
        crate::config::upstreams::route(self.upstreams.iter().map(|u| u.models.as_slice()), model)
    }

    /// The name of the upstream that serves `model` (the built-in's is [`ECHO_MODEL`]);
    /// `None` for a model no upstream serves.
    pub fn name_of(&self, model: &str) -> Option<String> {
        crate::config::upstreams::name_of(self.upstreams.iter().map(|u| (u.name.as_str(), u.models.as_slice())), model)
    }

    pub fn echo_permits() -> Arc<Semaphore> {
        Arc::new(Semaphore::new(ECHO_CONCURRENCY))
    }
}
