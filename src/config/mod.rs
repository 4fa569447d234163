//! The configuration file read by every role, with its defaults.
//!
//! The YAML shape is documented key by key in docs/src/configuration.md. Command-line
//! flags and environment variables override it (see `cli.rs`). Everything is parsed into
//! types here, so nothing deeper re-validates strings.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::ids::ProjectId;

mod batches;
mod files;
mod http;
mod kubernetes;
mod projects;
mod storage;
pub mod upstreams;

pub use batches::{BatchesConfig, KUBERNETES_RUNNING_SHARDS, Scheduling, default_max_running_shards};
pub use files::FilesConfig;
pub use http::{HttpConfig, MetricsConfig};
pub use kubernetes::{KubernetesConfig, WorkerTemplate};
pub use projects::{ApiKeyConfig, ProjectConfig, QuotaConfig, RateLimitConfig, Weight, key_digest};
pub use storage::{S3Config, StorageConfig};
pub use upstreams::{ScaleConfig, UpstreamConfig, WorkloadKind};

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
                if let Some(owner) = owners.insert(key.digest, &project.id).filter(|owner| **owner != project.id) {
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
            if let Some(scale) = &upstream.scale {
                scale.validate(&upstream.name)?;
            }
            if let Some(signal) = upstream.load_signal.set() {
                signal.validate(&upstream.name)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
    fn a_load_signal_is_looked_for_unless_set_or_turned_off() {
        use crate::config::upstreams::LoadSignalSetting;
        let setting = |line: &str| {
            let yaml = format!("storage: {{dir: /tmp/x}}\nupstreams:\n  - name: u\n    base_url: http://u/v1\n{line}");
            Config::from_yaml(&yaml).unwrap().upstreams.remove(0).load_signal
        };
        assert_eq!(setting(""), LoadSignalSetting::Discover);
        assert_eq!(setting("    load_signal:\n"), LoadSignalSetting::Discover);
        assert_eq!(setting("    load_signal: true\n"), LoadSignalSetting::Discover);
        assert_eq!(setting("    load_signal: false\n"), LoadSignalSetting::Off);
        let set = setting("    load_signal: {url: http://u/metrics, server: sglang}\n");
        let set = set.set().expect("a signal set");
        assert_eq!(
            (set.url.as_str(), set.server),
            ("http://u/metrics", crate::concurrency::presets::ServerKind::Sglang)
        );
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
        let project = |fields: &str| {
            format!("projects: [{{id: 3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11, api_keys: [{{plain: a}}], {fields}}}]")
        };
        let short = project("api_keys: [{sha256: abc}]").replace("api_keys: [{plain: a}], ", "");
        let error = Config::from_yaml(&short).unwrap_err().to_string();
        assert!(error.contains("projects[0].api_keys: sha256 keys are 64 hex digits"), "{error}");
        let error = Config::from_yaml(&project("weight: 0")).unwrap_err().to_string();
        assert!(error.contains("projects[0]: weight must be between 1 and 1000"), "{error}");
        let webhook = project("webhooks: [{url: \"https://example.com/\", secret: nope}]");
        let error = Config::from_yaml(&webhook).unwrap_err().to_string();
        assert!(error.contains("projects[0].webhooks: the secret of webhook https://example.com/"), "{error}");
        let bad_id = "projects: [{id: demo, api_keys: [{plain: a}]}]";
        assert!(Config::from_yaml(bad_id).is_err());
        assert!(Config::from_yaml("batches: {completion_window: soon}").is_err());
    }

    #[test]
    fn an_upstream_may_name_the_workload_to_scale_within_bounds() {
        let upstream =
            |scale: &str| format!("upstreams: [{{name: llama, base_url: \"http://llama:8080/v1\", scale: {scale}}}]");
        let config = Config::from_yaml(&upstream("{kind: Deployment, name: llama, max_replicas: 2}")).unwrap();
        let scale = config.upstreams[0].scale.clone().unwrap();
        assert_eq!(
            (scale.kind, scale.name.as_str(), scale.namespace.as_deref()),
            (WorkloadKind::Deployment, "llama", None)
        );
        assert_eq!((scale.min_replicas, scale.max_replicas), (0, 2));
        assert_eq!((scale.cooldown, scale.max_wait), (Duration::from_secs(300), Duration::from_secs(600)));
        assert_eq!(scale.bounds(), crate::capacity::scale::Bounds { min: 0, max: 2, cooldown: 300 });
        let full = "{kind: StatefulSet, name: big, namespace: models, min_replicas: 1, max_replicas: 4, cooldown: 30s, max_wait: 2m}";
        let scale = Config::from_yaml(&upstream(full)).unwrap().upstreams[0].scale.clone().unwrap();
        assert_eq!(
            (scale.kind, scale.namespace.as_deref(), scale.max_wait),
            (WorkloadKind::StatefulSet, Some("models"), Duration::from_secs(120))
        );
        for (bad, says) in [
            ("{kind: Deployment, name: llama, max_replicas: 0}", "1 <= max_replicas"),
            ("{kind: Deployment, name: llama, min_replicas: 3, max_replicas: 2}", "min_replicas <= max_replicas"),
            ("{kind: Deployment, name: \"\", max_replicas: 1}", "scale.name must name the workload"),
        ] {
            let error = Config::from_yaml(&upstream(bad)).unwrap_err().to_string();
            assert!(error.contains(says), "{bad}: {error}");
        }
        for refused in [
            "{kind: DaemonSet, name: x, max_replicas: 1}",
            "{kind: Deployment, name: x}",
            "{kind: Deployment, name: x, max_replicas: 1, min: 0}",
        ] {
            assert!(Config::from_yaml(&upstream(refused)).is_err(), "{refused}");
        }
    }
}
