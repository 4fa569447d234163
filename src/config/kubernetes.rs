//! `kubernetes:` in the configuration: the namespace, and the template of worker Jobs
//! (read by `api`, `controller` and `worker`).

use std::time::Duration;

use serde::Deserialize;

use crate::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The namespace of Batches, Projects and worker Jobs; else `$POD_NAMESPACE`, else `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub worker: WorkerTemplate,
    /// How long a stopping `api` stays unready, still answering (with `Connection: close`),
    /// before it stops accepting: the time Services and ingresses take to forget it.
    #[serde(default = "default_api_shutdown_delay", deserialize_with = "duration::deserialize_precise")]
    pub api_shutdown_delay: Duration,
}

fn default_api_shutdown_delay() -> Duration {
    Duration::from_secs(5)
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self { namespace: None, worker: WorkerTemplate::default(), api_shutdown_delay: default_api_shutdown_delay() }
    }
}

/// How the controller shapes each shard's Job. Fields under it use Kubernetes' own
/// YAML (as in a pod spec).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerTemplate {
    #[serde(default = "default_worker_image")]
    pub image: String,
    #[serde(default)]
    pub image_pull_policy: Option<String>,
    /// Where the worker's pod finds this configuration (a mounted ConfigMap).
    #[serde(default = "default_worker_config_path")]
    pub config_path: String,
    /// Pod retries per shard Job; a retried pod resumes from the shard's checkpoints.
    #[serde(default = "default_backoff_limit")]
    pub backoff_limit: i32,
    /// The worker pods' ServiceAccount (one with no Role: workers need no credentials).
    #[serde(default)]
    pub service_account_name: Option<String>,
    #[serde(default)]
    pub image_pull_secrets: Vec<k8s_openapi::api::core::v1::LocalObjectReference>,
    #[serde(default)]
    pub env: Vec<k8s_openapi::api::core::v1::EnvVar>,
    #[serde(default)]
    pub volumes: Vec<k8s_openapi::api::core::v1::Volume>,
    #[serde(default)]
    pub volume_mounts: Vec<k8s_openapi::api::core::v1::VolumeMount>,
    #[serde(default)]
    pub resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    #[serde(default)]
    pub node_selector: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    #[serde(default)]
    pub security_context: Option<k8s_openapi::api::core::v1::SecurityContext>,
    #[serde(default)]
    pub pod_security_context: Option<k8s_openapi::api::core::v1::PodSecurityContext>,
    /// Labels of worker Jobs and their pods, beside the standard `app.kubernetes.io/*`
    /// ones and Nightshift's own (which win).
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Annotations of worker pods.
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
    #[serde(default)]
    pub priority_class_name: Option<String>,
    /// Finished Jobs are deleted this long after they finish (the Batch's deletion
    /// removes them otherwise). Leave the controller time to see a failure: a minute or more.
    #[serde(default)]
    pub ttl_seconds_after_finished: Option<i32>,
    /// A shard's run that takes longer fails (and is retried within the failure budget).
    #[serde(default)]
    pub active_deadline_seconds: Option<i64>,
    /// Create Jobs suspended, for an admission system (such as Kueue) to start them.
    #[serde(default)]
    pub suspend: bool,
    /// Kueue's LocalQueue for worker Jobs (label `kueue.x-k8s.io/queue-name`); Jobs are
    /// then created suspended and Kueue starts them when it admits them.
    #[serde(default)]
    pub queue_name: Option<String>,
    /// The port worker pods serve `/metrics` on (upstream latencies and retries), named
    /// `metrics` in the pod; none: they serve no metrics.
    #[serde(default)]
    pub metrics_port: Option<u16>,
}

fn default_worker_image() -> String {
    "nightshift:latest".to_owned()
}
fn default_worker_config_path() -> String {
    "/etc/nightshift/config.yaml".to_owned()
}
fn default_backoff_limit() -> i32 {
    3
}

impl Default for WorkerTemplate {
    fn default() -> Self {
        Self {
            image: default_worker_image(),
            image_pull_policy: None,
            config_path: default_worker_config_path(),
            backoff_limit: default_backoff_limit(),
            service_account_name: None,
            image_pull_secrets: Vec::new(),
            env: Vec::new(),
            volumes: Vec::new(),
            volume_mounts: Vec::new(),
            resources: None,
            node_selector: Default::default(),
            tolerations: Vec::new(),
            security_context: None,
            pod_security_context: None,
            labels: Default::default(),
            annotations: Default::default(),
            affinity: None,
            priority_class_name: None,
            ttl_seconds_after_finished: None,
            active_deadline_seconds: None,
            suspend: false,
            queue_name: None,
            metrics_port: None,
        }
    }
}
