//! `upstreams:`: the model servers batch lines go to, and how each is governed.

use std::time::Duration;

use serde::Deserialize;

use crate::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    pub base_url: String,
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default = "all_models")]
    pub models: Vec<String>,
    /// The most requests in flight: the ceiling under which the adaptive limit moves
    /// (or, with `adaptive: false`, the limit). On Kubernetes, over the installation.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
    /// Find the concurrency by measuring throughput (`crate::concurrency::rule`).
    #[serde(default = "default_adaptive")]
    pub adaptive: bool,
    /// The server's metrics: batch dispatch holds while its interactive requests queue.
    #[serde(default)]
    pub load_signal: Option<crate::concurrency::signals::LoadSignalConfig>,
    /// Set as `priority` on every batch line (vLLM's priority scheduling: interactive
    /// requests have 0 and go first when batch lines have more).
    #[serde(default)]
    pub priority: Option<i64>,
    /// How long one attempt of one request may take.
    #[serde(default = "default_upstream_timeout", deserialize_with = "duration::deserialize")]
    pub timeout: Duration,
    /// The wait before the first retry; doubled for each further one (with jitter).
    #[serde(default = "default_retry_base_delay", deserialize_with = "duration::deserialize_precise")]
    pub retry_base_delay: Duration,
}

fn all_models() -> Vec<String> {
    vec!["*".to_owned()]
}

fn default_adaptive() -> bool {
    true
}

fn default_max_concurrency() -> usize {
    64
}

fn default_upstream_timeout() -> Duration {
    Duration::from_secs(600)
}

fn default_retry_base_delay() -> Duration {
    Duration::from_millis(500)
}
