//! The custom resources, defined by their Rust types: `Batch` (the document of
//! `batches::model`, spec and state) and `Project` (who may call, with what quota).
//! `nightshift crd` prints their CRDs; `crds/` holds the committed copy, and a test
//! fails when the two drift apart.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{CustomResourceDefinition, ValidationRule};
use kube::CustomResource;
use kube::core::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::applied::BatchRequest;
use crate::batches::{BatchSpec, BatchState};
use crate::ids::{BatchId, ProjectId};

mod batch_spec;

pub const GROUP: &str = "nightshift.dev";
/// Label on every Batch (and its Jobs) naming the project that owns it.
pub const PROJECT_LABEL: &str = "nightshift.dev/project";
/// Label on a Batch's Jobs naming the batch.
pub const BATCH_LABEL: &str = "nightshift.dev/batch";
/// Label on a Batch saying where it came from: `api` or `applied`.
pub const SOURCE_LABEL: &str = "nightshift.dev/source";

/// A batch: `spec` is the immutable create request with its shard plan, `status`
/// its lifecycle, counts and files. Fields keep the OpenAI Batch object's names.
#[derive(CustomResource, Clone, Debug, PartialEq)]
#[kube(
    group = "nightshift.dev",
    version = "v1alpha1",
    kind = "Batch",
    plural = "batches",
    shortname = "nsb",
    category = "nightshift",
    namespaced,
    root = "BatchResource",
    status = "BatchState",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.status"}"#,
    printcolumn = r#"{"name":"Progress","type":"string","jsonPath":".status.progress"}"#,
    printcolumn = r#"{"name":"Completed","type":"integer","jsonPath":".status.request_counts.completed"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.request_counts.failed"}"#,
    printcolumn = r#"{"name":"Total","type":"integer","jsonPath":".status.request_counts.total"}"#,
    printcolumn = r#"{"name":"ETA","type":"string","jsonPath":".status.eta"}"#,
    printcolumn = r#"{"name":"Source","type":"string","jsonPath":".metadata.labels.nightshift\\.dev/source"}"#,
    printcolumn = r#"{"name":"Output","type":"string","priority":1,"jsonPath":".spec.output.uri"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct BatchResourceSpec {
    /// What a user applied (`kubectl apply`); `None` for a batch created through the API.
    pub request: Option<BatchRequest>,
    /// Seconds after the batch finished at which the controller deletes the resource (as
    /// a Job's field of the same name); its files follow their own expiry.
    pub ttl_seconds_after_finished: Option<i64>,
    /// Where this batch's events are delivered, besides its project's endpoints.
    pub webhooks: Vec<WebhookRef>,
    /// The batch as accepted: written by the api when it creates one, and by the
    /// controller once it accepted an applied request (`None` until then).
    pub batch: Option<BatchSpec>,
}

impl BatchResourceSpec {
    /// The spec of a batch created through the API: its record, nothing applied.
    pub fn recorded(batch: BatchSpec) -> Self {
        Self { request: None, ttl_seconds_after_finished: None, webhooks: Vec::new(), batch: Some(batch) }
    }
}

impl BatchResource {
    /// The batch as accepted, if it is.
    pub fn accepted(&self) -> Option<&BatchSpec> {
        self.spec.batch.as_ref()
    }

    /// The name the batch's Jobs, grants and shard data know it by: the resource's name
    /// for a batch made through the API, its id's spelling as a name for an applied one.
    pub fn key(&self) -> Option<String> {
        self.accepted().map(|spec| resource_name(&spec.id))
    }
}
/// A project: its id (sent as `x-project-id`), its API keys as SHA-256 hashes held in
/// Secrets, and its token quota. `status.used_tokens` is kept by the controller.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "nightshift.dev",
    version = "v1alpha1",
    kind = "Project",
    plural = "projects",
    shortname = "nsp",
    category = "nightshift",
    namespaced,
    root = "ProjectResource",
    status = "ProjectStatus",
    printcolumn = r#"{"name":"Project","type":"string","jsonPath":".spec.id"}"#,
    printcolumn = r#"{"name":"Quota","type":"integer","jsonPath":".spec.quota.tokens"}"#,
    printcolumn = r#"{"name":"Used","type":"integer","jsonPath":".status.used_tokens"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct ProjectSpec {
    pub id: ProjectId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub api_keys: Vec<ApiKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<TokenQuota>,
    /// Requests a minute for this project, per api replica (else the installation's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<crate::config::RateLimitConfig>,
    /// Where the project's batch events are delivered (by the controller).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub webhooks: Vec<WebhookRef>,
    /// Its share of an upstream's capacity when several projects' batches run (1 to
    /// 1000; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub weight: Option<u32>,
}

/// A webhook endpoint and the key of a Secret (in the Project's or Batch's namespace) that
/// holds its signing secret (`whsec_...`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WebhookRef {
    #[schemars(regex(pattern = r"^https?://"))]
    pub url: String,
    pub secret_name: String,
    #[serde(default = "default_webhook_secret_key")]
    pub key: String,
}

fn default_webhook_secret_key() -> String {
    "secret".to_owned()
}

/// A key of a Secret (in the Project's namespace) that holds the hex SHA-256 of an API key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApiKeyRef {
    pub secret_name: String,
    #[serde(default = "default_secret_key")]
    pub key: String,
    #[serde(default = "active")]
    pub active: bool,
}

fn default_secret_key() -> String {
    "sha256".to_owned()
}

fn active() -> bool {
    true
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TokenQuota {
    pub tokens: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProjectStatus {
    #[serde(default)]
    pub used_tokens: u64,
}

/// A Batch resource's name: its id in the characters Kubernetes names allow.
pub fn resource_name(id: &BatchId) -> String {
    id.as_str().to_ascii_lowercase().replace('_', "-")
}

/// The terminal statuses, as a CEL list.
const TERMINAL: &str = "['failed', 'completed', 'expired', 'cancelled']";

/// Both CRDs, as installed.
///
/// A Batch's status is one document, applied whole by the role that decided it (api or
/// controller, each under its own field manager): `x-kubernetes-map-type: atomic` makes
/// the last apply own all of it, so that a field one role leaves out is not kept because
/// the other role once applied it too.
pub fn crds() -> [CustomResourceDefinition; 2] {
    let mut batch = BatchResource::crd();
    for version in &mut batch.spec.versions {
        let schema = version.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut());
        let status = schema.and_then(|s| s.properties.as_mut()).and_then(|p| p.get_mut("status"));
        let status = status.expect("the Batch CRD has a status");
        status.x_kubernetes_map_type = Some("atomic".to_owned());
        status.x_kubernetes_validations = Some(vec![ValidationRule {
            rule: format!("!(oldSelf.status in {TERMINAL}) || self.status == oldSelf.status"),
            message: Some("a finished Batch's status never changes".to_owned()),
            ..ValidationRule::default()
        }]);
    }
    [batch, ProjectResource::crd()]
}

/// Both CRDs as one YAML stream, as committed under `crds/`.
pub fn crds_yaml() -> String {
    let [batch, project] = crds();
    let batch = serde_yaml_ng::to_string(&batch).expect("CRDs serialize");
    let project = serde_yaml_ng::to_string(&project).expect("CRDs serialize");
    format!("# Generated by `nightshift crd`; do not edit (a test compares).\n---\n{batch}---\n{project}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_crds_match_the_rust_types() {
        let committed = include_str!("../../crds/nightshift.yaml");
        assert!(
            committed == crds_yaml(),
            "crds/nightshift.yaml is stale: run `just crds` (nightshift crd > crds/nightshift.yaml)"
        );
    }

    #[test]
    fn batch_names_are_valid_kubernetes_names() {
        let id = BatchId::parse("batch_01HZXAB").unwrap();
        assert_eq!(resource_name(&id), "batch-01hzxab");
    }

    #[test]
    fn the_batch_crd_has_a_status_subresource_printer_columns_and_a_short_name() {
        let crd = BatchResource::crd();
        let version = &crd.spec.versions[0];
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<_> =
            version.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(columns, ["Status", "Progress", "Completed", "Failed", "Total", "ETA", "Source", "Output", "Age"]);
        assert_eq!(crd.spec.names.short_names.as_deref(), Some(&["nsb".to_owned()][..]));
        let schema = serde_json::to_value(&version.schema).unwrap();
        let metadata = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["metadata"];
        assert_eq!(metadata["x-kubernetes-preserve-unknown-fields"], true, "{metadata}");
    }
}
