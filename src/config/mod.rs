//! The configuration file read by every role, with its defaults.
//!
//! The YAML shape is documented key by key in docs/src/configuration.md. Command-line
//! flags and environment variables override it (see `cli.rs`). Everything is parsed into
//! types here, so nothing deeper re-validates strings.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::duration;
use crate::ids::ProjectId;

mod kubernetes;

pub use kubernetes::{KubernetesConfig, WorkerTemplate};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    #[serde(default)]
    pub storage: StorageConfig,
    #[serde(default)]
    pub projects: Vec<ProjectConfig>,
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    #[serde(default)]
    pub batches: BatchesConfig,
    #[serde(default)]
    pub files: FilesConfig,
    /// Only read by `api`, `controller` and `worker`.
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// Limits of the API's HTTP server (`serve` and `api`).
    #[serde(default)]
    pub http: HttpConfig,
    /// How webhooks are delivered (`serve` and `controller`).
    #[serde(default)]
    pub webhooks: crate::webhooks::WebhooksConfig,
    /// Where `serve` and `api` serve `/metrics` (never on the API's own address).
    #[serde(default)]
    pub metrics: MetricsConfig,
}

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

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            storage: StorageConfig::default(),
            projects: Vec::new(),
            upstreams: Vec::new(),
            batches: BatchesConfig::default(),
            files: FilesConfig::default(),
            http: HttpConfig::default(),
            kubernetes: KubernetesConfig::default(),
            webhooks: Default::default(),
            metrics: MetricsConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageConfig {
    /// Local directory storage (the embedded default).
    pub dir: Option<PathBuf>,
    /// S3-compatible object storage; wins over `dir` when both are given.
    pub s3: Option<S3Config>,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self { dir: Some(PathBuf::from("./nightshift-data")), s3: None }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    pub bucket: String,
    pub endpoint: Option<String>,
    #[serde(default = "default_region")]
    pub region: String,
    #[serde(default)]
    pub prefix: String,
    #[serde(default)]
    pub path_style: bool,
    /// Environment variables holding a static access key pair, read once at start: for an
    /// S3-compatible server with keys under names of your own. Unset (both), the AWS SDK's
    /// default chain finds the credentials and refreshes them: `AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY`, the shared profile files, web identity (IRSA), container
    /// credentials (EKS Pod Identity, ECS), instance metadata.
    #[serde(default)]
    pub access_key_id_env: Option<String>,
    #[serde(default)]
    pub secret_access_key_env: Option<String>,
    /// How long a request waits for the server's next bytes before its attempt fails
    /// and is tried again (a stalled server is an error, not a hang).
    #[serde(default = "default_s3_timeout", deserialize_with = "duration::deserialize_precise")]
    pub timeout: Duration,
}

fn default_s3_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_region() -> String {
    "us-east-1".to_owned()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectConfig {
    pub id: ProjectId,
    #[serde(default)]
    pub name: Option<String>,
    pub api_keys: Vec<ApiKeyConfig>,
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
    /// Requests a minute for this project (else `http.requests_per_minute`).
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Where this project's batch events are delivered.
    #[serde(default)]
    pub webhooks: Vec<WebhookConfig>,
    /// Its share of capacity when batches of several projects wait (`crate::schedule`):
    /// a project of weight 2 runs twice the shards of one of weight 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

pub fn default_weight() -> u32 {
    1
}

/// `{url: https://..., secret: whsec_...}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub url: String,
    pub secret: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    pub requests_per_minute: u32,
}

/// `{plain: dev-key}` or `{sha256: <hex>}`, optionally `active: false`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    pub plain: Option<String>,
    pub sha256: Option<String>,
    #[serde(default = "yes")]
    pub active: bool,
}

impl BatchesConfig {
    /// What `POST /v1/batches` creates batches with.
    pub fn batch_settings(&self) -> crate::batches::BatchSettings {
        crate::batches::BatchSettings {
            completion_window: self.completion_window,
            shard_lines: self.shard_lines,
            // Config::check has refused any other name.
            endpoints: crate::validate::Endpoints::from_urls(&self.endpoints).unwrap_or_default(),
        }
    }
}

impl ApiKeyConfig {
    /// The key's SHA-256, from either form; `None` for an entry that is neither (which
    /// `Config::check` refuses; a Project resource's bad key is left out).
    pub fn digest(&self) -> Option<[u8; 32]> {
        match (&self.plain, &self.sha256) {
            (Some(plain), None) if !plain.is_empty() => Some(key_digest(plain)),
            (None, Some(hash)) => {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(hash, &mut digest).ok().map(|()| digest)
            }
            _ => None,
        }
    }
}

/// The SHA-256 of an API key, as keys are kept and compared.
pub fn key_digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    pub tokens: u64,
}

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
/// `batches.scheduling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduling {
    #[default]
    Fair,
    Fifo,
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchesConfig {
    /// How long a batch may run before it expires. The API always reports "24h".
    #[serde(default = "default_window", deserialize_with = "duration::deserialize")]
    pub completion_window: Duration,
    #[serde(default = "default_shard_lines")]
    pub shard_lines: u32,
    /// How often a worker commits its results: the most work a crash can cost.
    #[serde(default = "default_checkpoint_interval", deserialize_with = "duration::deserialize_precise")]
    pub checkpoint_interval: Duration,
    /// How long lines in flight may take to finish after a cancel or expiry.
    #[serde(default = "default_cancel_grace", deserialize_with = "duration::deserialize_precise")]
    pub cancel_grace: Duration,
    /// The endpoints batches may target: `/v1/chat/completions` (the spec's only one, the
    /// default), and any of `/v1/embeddings`, `/v1/completions`, `/v1/responses` and
    /// `/v1/moderations`. Each line goes to the same path on its upstream.
    #[serde(default = "default_endpoints")]
    pub endpoints: Vec<String>,
    /// How long `serve` keeps a finished batch (completed, failed, expired or cancelled,
    /// refused creates among them) after it finished; then it is removed, at the pace of
    /// `files.gc_interval`. Its tokens stay counted against its project's quota.
    #[serde(default = "default_retention", deserialize_with = "duration::deserialize")]
    pub retention: Duration,
    /// How many shards run at once, over all batches: in `serve` (default: the number
    /// of cores), and on Kubernetes, worker Jobs over the whole installation (default:
    /// [`KUBERNETES_RUNNING_SHARDS`]).
    #[serde(default)]
    pub max_running_shards: Option<usize>,
    /// How those shards are shared between batches: `fair` (projects by weight, earliest
    /// deadline first within one) or `fifo` (oldest batch first).
    #[serde(default)]
    pub scheduling: Scheduling,
    /// How often `serve` reconciles unfinished batches (live counts, expiry).
    #[serde(default = "default_reconcile_interval", deserialize_with = "duration::deserialize_precise")]
    pub reconcile_interval: Duration,
    /// How often a shard's worker may fail (a task's error in `serve`, a Job past its pod
    /// retries on Kubernetes) and be started again; then its lines without a record get
    /// an `internal_error` record and the batch finishes.
    #[serde(default = "default_max_shard_retries")]
    pub max_shard_retries: u32,
}

fn default_endpoints() -> Vec<String> {
    vec!["/v1/chat/completions".to_owned()]
}

fn default_max_shard_retries() -> u32 {
    3
}

fn default_window() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_shard_lines() -> u32 {
    5000
}

fn default_checkpoint_interval() -> Duration {
    Duration::from_millis(500)
}
fn default_cancel_grace() -> Duration {
    Duration::from_secs(30)
}
/// As many shards as cores: one shard's loop is one task, so more shards than cores
/// only add switching (measured: 2 running shards on 2 cores move 88% of a plain
/// client's lines per second, 8 move 78%), while each shard may still fill its
/// upstream's whole `max_concurrency`.
pub fn default_max_running_shards() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)
}
/// Worker Jobs running at once on Kubernetes when `max_running_shards` is not set.
pub const KUBERNETES_RUNNING_SHARDS: usize = 16;

fn default_reconcile_interval() -> Duration {
    Duration::from_secs(1)
}

impl Default for BatchesConfig {
    fn default() -> Self {
        Self {
            completion_window: default_window(),
            shard_lines: default_shard_lines(),
            checkpoint_interval: default_checkpoint_interval(),
            cancel_grace: default_cancel_grace(),
            reconcile_interval: default_reconcile_interval(),
            max_running_shards: None,
            scheduling: Scheduling::default(),
            max_shard_retries: default_max_shard_retries(),
            retention: default_retention(),
            endpoints: default_endpoints(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesConfig {
    /// How long an upload is kept (OpenAI and the spec: 30 days).
    #[serde(default = "default_retention", deserialize_with = "duration::deserialize")]
    pub retention: Duration,
    /// How often expired and deleted files are swept from storage.
    #[serde(default = "default_gc_interval", deserialize_with = "duration::deserialize")]
    pub gc_interval: Duration,
}

fn default_retention() -> Duration {
    Duration::from_secs(30 * 86_400)
}
fn default_gc_interval() -> Duration {
    Duration::from_secs(600)
}

impl Default for FilesConfig {
    fn default() -> Self {
        Self { retention: default_retention(), gc_interval: default_gc_interval() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a valid configuration: {source}")]
    Parse { path: PathBuf, source: serde_yaml_ng::Error },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::from_yaml(&text).map_err(|error| match error {
            ConfigError::Parse { source, .. } => ConfigError::Parse { path: path.to_owned(), source },
            other => other,
        })
    }

    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        // An empty file is an empty mapping: every default.
        let config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml_ng::from_str(text).map_err(|source| ConfigError::Parse { path: PathBuf::new(), source })?
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.storage.dir.is_none() && self.storage.s3.is_none() {
            return Err(ConfigError::Invalid("storage needs either `dir` or `s3`".into()));
        }
        self.check_projects().and_then(|()| self.check_limits()).map_err(ConfigError::Invalid)
    }

    /// Each project once, each key of one project, and each project sound.
    fn check_projects(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        // A key names its project (`Authorization: Bearer`), so no two projects share one.
        let mut owners: std::collections::HashMap<[u8; 32], &ProjectId> = std::collections::HashMap::new();
        for project in &self.projects {
            for key in &project.api_keys {
                let Some(digest) = key.digest() else { continue };
                if let Some(owner) = owners.insert(digest, &project.id).filter(|owner| **owner != project.id) {
                    return Err(format!(
                        "projects {owner} and {} share an api key: each key belongs to one project",
                        project.id
                    ));
                }
            }
            if !seen.insert(&project.id) {
                return Err(format!("project {} is configured twice", project.id));
            }
            project.check()?;
        }
        Ok(())
    }

    /// The HTTP limits, the metrics' address, webhooks, batches and upstreams.
    fn check_limits(&self) -> Result<(), String> {
        let http = &self.http;
        if [http.max_connections, http.max_connections_per_client, http.max_uploads].contains(&0)
            || [http.requests_per_minute, http.failed_auth_per_minute].contains(&0)
        {
            return Err("http: every limit must be at least 1".into());
        }
        if self.metrics.listen.is_some_and(|metrics| metrics == self.listen && metrics.port() != 0) {
            return Err("metrics.listen must differ from listen: /metrics is not served on the API's address".into());
        }
        if self.webhooks.timeout.is_zero() || self.webhooks.give_up_after.is_zero() {
            return Err("webhooks.timeout and webhooks.give_up_after must be longer than 0s".into());
        }
        self.batches.check()?;
        for upstream in &self.upstreams {
            if upstream.max_concurrency == 0 {
                return Err(format!("upstream {}: max_concurrency must be at least 1", upstream.name));
            }
            if let Some(signal) = &upstream.load_signal {
                signal.validate(&upstream.name)?;
            }
        }
        Ok(())
    }
}

impl ProjectConfig {
    /// Its webhooks, keys and weight.
    fn check(&self) -> Result<(), String> {
        for webhook in &self.webhooks {
            if let Err(error) = crate::webhooks::target::parse_url(&webhook.url) {
                return Err(format!("project {}: webhook {error}", self.id));
            }
            if crate::webhooks::SigningSecret::parse(&webhook.secret).is_none() {
                return Err(format!(
                    "project {}: the secret of webhook {} is not whsec_ followed by the base64 of at least 16 bytes",
                    self.id, webhook.url
                ));
            }
        }
        if self.api_keys.is_empty() {
            return Err(format!("project {} has no api_keys", self.id));
        }
        if !(1..=1000).contains(&self.weight) {
            return Err(format!("project {}: weight must be between 1 and 1000", self.id));
        }
        for key in &self.api_keys {
            match (&key.plain, &key.sha256) {
                (Some(plain), None) if !plain.is_empty() => {}
                (None, Some(hash)) if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {}
                (None, Some(_)) => return Err(format!("project {}: sha256 keys are 64 hex digits", self.id)),
                _ => {
                    return Err(format!(
                        "project {}: each api key is exactly one of {{plain: ...}} or {{sha256: ...}}",
                        self.id
                    ));
                }
            }
        }
        Ok(())
    }
}

impl BatchesConfig {
    fn check(&self) -> Result<(), String> {
        if self.shard_lines == 0 {
            return Err("batches.shard_lines must be at least 1".into());
        }
        if self.endpoints.is_empty() {
            return Err("batches.endpoints must name at least one endpoint".into());
        }
        if let Err(unknown) = crate::validate::Endpoints::from_urls(&self.endpoints) {
            return Err(format!(
                "batches.endpoints: {unknown:?} is not a batchable endpoint (any of {})",
                crate::validate::BATCHABLE_URLS.join(", ")
            ));
        }
        if self.max_running_shards == Some(0) {
            return Err("batches.max_running_shards must be at least 1".into());
        }
        if self.completion_window.is_zero() {
            return Err("batches.completion_window must be longer than 0s".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_design_example_parses() {
        let config = Config::from_yaml(
            r#"
listen: 127.0.0.1:8080
storage:
  dir: ./nightshift-data
projects:
  - id: 3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11
    name: demo
    api_keys: [{plain: dev-key}]
    quota: {tokens: 1000000}
upstreams:
  - name: local
    base_url: http://127.0.0.1:8000/v1
    api_key_env: UPSTREAM_API_KEY
    models: ["*"]
    max_concurrency: 64
batches:
  completion_window: 24h
  shard_lines: 5000
"#,
        )
        .unwrap();
        assert_eq!(config.projects[0].quota.unwrap().tokens, 1_000_000);
        assert_eq!(config.batches.completion_window, Duration::from_secs(86_400));
        assert_eq!(config.upstreams[0].max_concurrency, 64);
    }

    #[test]
    fn an_empty_file_is_all_defaults() {
        let config = Config::from_yaml("").unwrap();
        assert_eq!(config.listen, default_listen());
        assert_eq!(config.files.retention, Duration::from_secs(30 * 86_400));
    }

    #[test]
    fn mistakes_are_reported_not_ignored() {
        assert!(Config::from_yaml("listn: 1.2.3.4:5").is_err(), "unknown keys are rejected");
        let two_kinds = "projects: [{id: 3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11, api_keys: [{plain: a, sha256: b}]}]";
        assert!(Config::from_yaml(two_kinds).is_err());
        let shared = "projects: [{id: 3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11, api_keys: [{plain: a}]}, \
                      {id: 0b7e8a52-4a1c-4d5e-9a53-6f0c7d8e9f10, api_keys: [{plain: b}, {plain: a}]}]";
        let error = Config::from_yaml(shared).unwrap_err().to_string();
        assert!(error.contains("share an api key"), "{error}");
        let error = Config::from_yaml("batches: {endpoints: [/v1/images/generations]}").unwrap_err().to_string();
        assert!(error.contains("is not a batchable endpoint"), "{error}");
        assert!(Config::from_yaml("batches: {endpoints: []}").is_err());
        let bad_id = "projects: [{id: demo, api_keys: [{plain: a}]}]";
        assert!(Config::from_yaml(bad_id).is_err());
        assert!(Config::from_yaml("batches: {completion_window: soon}").is_err());
    }
}
