//! The Helm chart (charts/nightshift): it lints, it renders manifests that are valid
//! Kubernetes 1.20 objects and that keep the chart's promises (least-privilege RBAC that
//! is exactly src/k8s/rbac.rs, non-root read-only pods, CRDs identical to the generated
//! ones), and, applied to a real kube-apiserver 1.20, it is enough for `nightshift api`
//! and `nightshift controller` to run a batch end to end with the chart's own
//! ServiceAccounts, ConfigMap, Secrets and worker template. A last test installs,
//! upgrades and uninstalls it with helm itself. The tests on the API server are in
//! `installed`; those of what the chart documents (values.yaml, its schema and README,
//! the dashboard) in `documented`.
//!
//! Needs helm (tests/tools/install-helm.sh), the Kubernetes toolchain
//! (tests/tools/install-kube.sh), s3s-fs and the venv with kubernetes-validate; `tests/run`
//! installs them all.

mod documented;
mod installed;

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use common::tools::{helm, run};
use k8s_openapi::api::rbac::v1::Role;
use nightshift::config::WorkloadKind;
use nightshift::k8s::rbac;
use serde::Deserialize;
use serde_json::{Value, json};
use tempfile::TempDir;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nightshift");
const FULL_VALUES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nightshift/ci/full-values.yaml");
/// The version of the test API server (tests/common/cluster.rs), and of the schemas.
const KUBE_VERSION: &str = "1.20.0";
const RELEASE: &str = "nightshift";

// ---------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------

/// `helm template` of the chart as release [`RELEASE`] in `namespace` for Kubernetes 1.20.
fn render(namespace: &str, args: &[&str]) -> String {
    let home = TempDir::new().unwrap();
    run(helm(home.path())
        .args(["template", RELEASE, CHART, "--namespace", namespace, "--kube-version", KUBE_VERSION])
        .args(args))
}

/// The documents of a multi-document YAML stream, as JSON values (empty ones skipped).
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|document| Value::deserialize(document).expect("helm renders valid YAML"))
        .filter(|document| !document.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among {:?}", kinds(docs)))
}

fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| format!("{}/{}", d["kind"].as_str().unwrap(), d["metadata"]["name"].as_str().unwrap()))
        .collect()
}

fn count(docs: &[Value], kind: &str) -> usize {
    docs.iter().filter(|d| d["kind"] == kind).count()
}

/// The nightshift configuration file inside the rendered ConfigMap.
fn rendered_config(docs: &[Value]) -> String {
    find(docs, "ConfigMap", &format!("{RELEASE}-config"))["data"]["config.yaml"].as_str().unwrap().to_owned()
}

// ---------------------------------------------------------------------------
// Lint, files, rendering
// ---------------------------------------------------------------------------

#[test]
fn the_chart_lints_with_defaults_and_with_everything_enabled() {
    let home = TempDir::new().unwrap();
    run(helm(home.path()).args(["lint", "--strict", CHART]));
    // Ingress with TLS, ServiceMonitors, the dashboard, projects, upstreams with keys.
    run(helm(home.path()).args(["lint", "--strict", CHART, "-f", FULL_VALUES]));
}

#[test]
fn the_chart_crds_are_the_generated_ones() {
    let chart = std::fs::read_to_string(format!("{CHART}/crds/nightshift.yaml")).unwrap();
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/nightshift.yaml")).unwrap();
    assert!(chart == committed, "charts/nightshift/crds/nightshift.yaml differs from crds/nightshift.yaml: copy it");
    assert!(
        chart == nightshift::k8s::crd::crds_yaml(),
        "the CRDs differ from `nightshift crd`: run `cargo run -- crd > crds/nightshift.yaml` and copy it to the chart"
    );
    let dir: Vec<_> = std::fs::read_dir(format!("{CHART}/crds")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(dir, ["nightshift.yaml"], "the chart's crds/ holds only the generated file");
}

fn rules(docs: &[Value], name: &str) -> Vec<k8s_openapi::api::rbac::v1::PolicyRule> {
    let role: Role = serde_json::from_value(find(docs, "Role", name).clone()).unwrap();
    role.rules.unwrap_or_default()
}

/// The securityContext every container of the chart runs with.
fn assert_locked_down(pod: &Value, container: &Value, what: &str) {
    let pod_sc = &pod["securityContext"];
    assert_eq!(pod_sc["runAsNonRoot"], true, "{what}: {pod_sc}");
    assert_eq!(pod_sc["runAsUser"], 65532, "{what}: {pod_sc}");
    assert_eq!(pod_sc["seccompProfile"]["type"], "RuntimeDefault", "{what}: {pod_sc}");
    let sc = &container["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true, "{what}: {sc}");
    assert_eq!(sc["runAsUser"], 65532, "{what}: {sc}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}: {sc}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}: {sc}");
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{what}: {sc}");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{what}: {sc}");
    let mounts = container["volumeMounts"].as_array().unwrap_or_else(|| panic!("{what}: no volumeMounts"));
    let tmp = mounts.iter().find(|m| m["mountPath"] == "/tmp").unwrap_or_else(|| panic!("{what}: no /tmp mount"));
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == tmp["name"]).unwrap();
    assert!(volume["emptyDir"].is_object(), "{what}: /tmp is an emptyDir: {volume}");
    let config = mounts.iter().find(|m| m["mountPath"] == "/etc/nightshift").expect("the config mount");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == config["name"]).unwrap();
    assert_eq!(volume["configMap"]["name"], format!("{RELEASE}-config"), "{what}");
}

fn env_of(container: &Value) -> HashMap<String, Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e.get("value").or(e.get("valueFrom")).cloned().unwrap()))
        .collect()
}

/// An upstream whose `scale` names a workload gives the controller a Role for that
/// workload alone, in its namespace (src/k8s/rbac.rs's `scale_rules`); the others none.
#[test]
fn a_scaled_upstream_gets_a_role_for_its_workload_only() {
    let upstreams = json!([
        {"name": "llama_cpp", "base_url": "http://llama:8080/v1",
         "scale": {"kind": "Deployment", "name": "llama", "max_replicas": 2, "cooldown": "1m"}},
        {"name": "big", "base_url": "http://big:8080/v1",
         "scale": {"kind": "StatefulSet", "name": "big-model", "namespace": "models", "max_replicas": 4}},
        {"name": "plain", "base_url": "http://plain:8080/v1"},
    ]);
    let values = TempDir::new().unwrap();
    let file = values.path().join("values.yaml");
    std::fs::write(&file, json!({ "upstreams": upstreams }).to_string()).unwrap();
    let docs = documents(&render("batch", &["-f", file.to_str().unwrap()]));
    assert_eq!(count(&docs, "Role"), 4, "the api's, the controller's and one per scaled workload");
    let cases = [
        ("nightshift-scale-llama-cpp", WorkloadKind::Deployment, "llama", "batch"),
        ("nightshift-scale-big", WorkloadKind::StatefulSet, "big-model", "models"),
    ];
    for (name, kind, workload, namespace) in cases {
        assert_eq!(rules(&docs, name), rbac::scale_rules(kind, workload), "{name}");
        assert_eq!(find(&docs, "Role", name)["metadata"]["namespace"], namespace);
        let binding = find(&docs, "RoleBinding", name);
        assert_eq!(binding["metadata"]["namespace"], namespace);
        assert_eq!(binding["roleRef"]["name"], name);
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": "nightshift-controller", "namespace": "batch"}])
        );
    }
    let config = nightshift::config::Config::from_yaml(&rendered_config(&docs)).unwrap();
    let scale = config.upstreams[0].scale.as_ref().expect("scale passes through to the configuration");
    assert_eq!((scale.name.as_str(), scale.max_replicas, scale.cooldown), ("llama", 2, Duration::from_secs(60)));
    assert!(config.upstreams[2].scale.is_none());
}

#[test]
fn workload_identity_renders_no_keys_and_annotates_every_service_account() {
    let role = "arn:aws:iam::123456789012:role/nightshift";
    let docs = documents(&render(
        "batch",
        &[
            "--set",
            "storage.s3.credentials.existingSecret=",
            "--set-string",
            &format!("serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn={role}"),
        ],
    ));
    for role_name in ["api", "controller"] {
        let deployment = find(&docs, "Deployment", &format!("nightshift-{role_name}"));
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        let env = env_of(container);
        assert!(!env.contains_key("AWS_ACCESS_KEY_ID") && !env.contains_key("AWS_SECRET_ACCESS_KEY"), "{env:?}");
    }
    let config = nightshift::config::Config::from_yaml(&rendered_config(&docs)).unwrap();
    assert!(config.kubernetes.worker.env.iter().all(|e| !e.name.starts_with("AWS_")), "workers get no keys either");
    let s3 = config.storage.s3.unwrap();
    assert_eq!((s3.access_key_id_env, s3.secret_access_key_env), (None, None), "the default chain finds them");
    for account in ["api", "controller", "worker"] {
        let service_account = find(&docs, "ServiceAccount", &format!("nightshift-{account}"));
        assert_eq!(service_account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"], role, "{account}");
    }
    // With a Secret (the default), every role gets the keys from it.
    let docs = documents(&render("batch", &[]));
    let api = find(&docs, "Deployment", "nightshift-api");
    let env = env_of(&api["spec"]["template"]["spec"]["containers"][0]);
    assert_eq!(env["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"], "nightshift-s3");
}

#[test]
fn the_rendered_defaults_keep_the_charts_promises() {
    let docs = documents(&render("batch", &[]));

    // RBAC: exactly the rules of src/k8s/rbac.rs, bound to each role's own ServiceAccount.
    assert_eq!(rules(&docs, "nightshift-api"), rbac::api_rules(), "the api's Role is src/k8s/rbac.rs's");
    assert_eq!(rules(&docs, "nightshift-controller"), rbac::controller_rules(), "the controller's Role");
    assert_eq!(count(&docs, "Role"), 2, "workers get no Role");
    assert_eq!(count(&docs, "ClusterRole") + count(&docs, "ClusterRoleBinding"), 0, "namespaced only");
    for role in ["api", "controller"] {
        let binding = find(&docs, "RoleBinding", &format!("nightshift-{role}"));
        assert_eq!(binding["roleRef"]["name"], format!("nightshift-{role}"));
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": format!("nightshift-{role}"), "namespace": "batch"}])
        );
    }
    let worker_sa = find(&docs, "ServiceAccount", "nightshift-worker");
    assert_eq!(worker_sa["automountServiceAccountToken"], false);

    // The api: 2 replicas, probes, its ServiceAccount, the config, the S3 Secret.
    let api = find(&docs, "Deployment", "nightshift-api");
    assert_eq!(api["spec"]["replicas"], 2);
    let pod = &api["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "nightshift-api");
    let container = &pod["containers"][0];
    assert_eq!(container["args"], json!(["api"]));
    assert_eq!(container["readinessProbe"]["httpGet"], json!({"path": "/readyz", "port": "http"}));
    assert_eq!(container["livenessProbe"]["httpGet"], json!({"path": "/healthz", "port": "http"}));
    assert_eq!(container["ports"][0]["containerPort"], 8080);
    assert_eq!(container["ports"][1], json!({"name": "metrics", "containerPort": 9090, "protocol": "TCP"}));
    assert!(rendered_config(&docs).contains("metrics:\n  listen: 0.0.0.0:9090"), "the api's /metrics has its own port");
    assert!(container["resources"]["requests"].is_object());
    let env = env_of(container);
    assert_eq!(env["NIGHTSHIFT_CONFIG"], "/etc/nightshift/config.yaml");
    assert_eq!(env["POD_NAMESPACE"]["fieldRef"]["fieldPath"], "metadata.namespace");
    assert_eq!(env["AWS_ACCESS_KEY_ID"]["secretKeyRef"], json!({"name": "nightshift-s3", "key": "AWS_ACCESS_KEY_ID"}));
    assert_eq!(env["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"]["name"], "nightshift-s3");
    assert_locked_down(pod, container, "api");
    let service = find(&docs, "Service", "nightshift-api");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");
    let pdb = find(&docs, "PodDisruptionBudget", "nightshift-api");
    assert_eq!(pdb["apiVersion"], "policy/v1beta1", "Kubernetes 1.20 has no policy/v1 PodDisruptionBudget");

    // The controller: 1 replica, its identity from the downward API, probes on 9090.
    let controller = find(&docs, "Deployment", "nightshift-controller");
    assert_eq!(controller["spec"]["replicas"], 1);
    let pod = &controller["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "nightshift-controller");
    let container = &pod["containers"][0];
    assert_eq!(container["args"], json!(["controller"]));
    let env = env_of(container);
    assert_eq!(env["POD_NAME"]["fieldRef"]["fieldPath"], "metadata.name");
    assert_eq!(env["NIGHTSHIFT_NAMESPACE"]["fieldRef"]["fieldPath"], "metadata.namespace");
    assert_eq!(env["NIGHTSHIFT_PROBE_LISTEN"], "0.0.0.0:9090");
    assert_eq!(env["NIGHTSHIFT_CONFIG"], "/etc/nightshift/config.yaml");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_locked_down(pod, container, "controller");

    // The configuration parses as Nightshift's own, and shapes locked-down workers.
    let config = nightshift::config::Config::from_yaml(&rendered_config(&docs)).expect("the rendered config parses");
    assert_eq!(config.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(config.kubernetes.namespace.as_deref(), Some("batch"));
    assert!(config.upstreams.is_empty(), "the echo model by default");
    let s3 = config.storage.s3.as_ref().expect("S3 storage");
    assert_eq!(s3.bucket, "nightshift");
    let worker = &config.kubernetes.worker;
    assert_eq!(worker.image, "nightshift:0.1.0");
    assert_eq!(worker.config_path, "/etc/nightshift/config.yaml");
    assert_eq!(worker.backoff_limit, 3);
    let worker_pod = json!({
        "securityContext": serde_json::to_value(&worker.pod_security_context).unwrap(),
        "volumes": serde_json::to_value(&worker.volumes).unwrap(),
    });
    let worker_container = json!({
        "securityContext": serde_json::to_value(&worker.security_context).unwrap(),
        "volumeMounts": serde_json::to_value(&worker.volume_mounts).unwrap(),
    });
    assert_locked_down(&worker_pod, &worker_container, "worker");
    let names: Vec<&str> = worker.env.iter().map(|e| e.name.as_str()).collect();
    assert!(names.contains(&"AWS_ACCESS_KEY_ID") && names.contains(&"AWS_SECRET_ACCESS_KEY"), "{names:?}");
    assert!(worker.resources.is_some());

    // Optional parts are off by default.
    for kind in ["Ingress", "ServiceMonitor", "Project"] {
        assert_eq!(count(&docs, kind), 0, "no {kind} by default: {:?}", kinds(&docs));
    }
    assert!(docs.iter().all(|d| d["metadata"]["namespace"] == "batch"), "everything in the release namespace");
}

#[test]
fn the_rendered_options_keep_the_charts_promises() {
    let docs = documents(&render("batch", &["-f", FULL_VALUES]));

    let ingress = find(&docs, "Ingress", "nightshift");
    assert_eq!(ingress["apiVersion"], "networking.k8s.io/v1");
    let spec = &ingress["spec"];
    assert_eq!(spec["ingressClassName"], "nginx");
    assert_eq!(spec["tls"], json!([{"hosts": ["nightshift.example.com"], "secretName": "nightshift-tls"}]));
    let rule = &spec["rules"][0];
    assert_eq!(rule["host"], "nightshift.example.com");
    let path = &rule["http"]["paths"][0];
    assert_eq!(path["path"], "/v1");
    assert_eq!(path["backend"]["service"], json!({"name": "nightshift-api", "port": {"name": "http"}}));
    let annotations = &ingress["metadata"]["annotations"];
    assert_eq!(annotations["nginx.ingress.kubernetes.io/proxy-body-size"], "110m", "100 MB uploads pass");
    assert_eq!(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"], "600");

    // The Gateway API route, beside the Ingress.
    let route = find(&docs, "HTTPRoute", "nightshift");
    assert_eq!(route["spec"]["parentRefs"], json!([{"name": "public", "namespace": "gateways"}]));
    assert_eq!(route["spec"]["hostnames"], json!(["nightshift.example.com"]));
    let rule = &route["spec"]["rules"][0];
    assert_eq!(rule["matches"][0]["path"], json!({"type": "PathPrefix", "value": "/v1"}));
    assert_eq!(rule["backendRefs"][0], json!({"name": "nightshift-api", "port": 80}));
    assert_eq!(rule["timeouts"]["request"], "600s");

    assert_eq!(count(&docs, "ServiceMonitor"), 2);
    let workers = find(&docs, "PodMonitor", "nightshift-worker");
    assert_eq!(workers["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    let selector = &workers["spec"]["selector"]["matchLabels"];
    assert_eq!(selector["app.kubernetes.io/component"], "worker");
    let monitor = find(&docs, "ServiceMonitor", "nightshift-controller");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    let metrics = find(&docs, "Service", "nightshift-controller-metrics");
    assert_eq!(metrics["spec"]["ports"][0]["name"], "metrics");
    let api_monitor = find(&docs, "ServiceMonitor", "nightshift-api");
    assert_eq!(api_monitor["spec"]["endpoints"][0]["port"], "metrics", "the api is scraped on its metrics port");
    let api_metrics = find(&docs, "Service", "nightshift-api-metrics");
    assert_eq!(
        api_metrics["spec"]["ports"][0],
        json!({"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"})
    );

    let dashboard = find(&docs, "ConfigMap", "nightshift-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{CHART}/dashboards/nightshift.json")).unwrap()).unwrap();
    let rendered: Value = serde_json::from_str(dashboard["data"]["nightshift.json"].as_str().unwrap()).unwrap();
    assert_eq!(rendered, shipped);

    // Projects: inline hashes go to a rendered Secret, existing Secrets are referenced.
    let research = find(&docs, "Project", "research");
    assert_eq!(research["apiVersion"], "nightshift.dev/v1alpha1");
    assert_eq!(research["spec"]["id"], common::PROJECT);
    assert_eq!(research["spec"]["quota"]["tokens"], 100_000_000);
    assert_eq!(research["spec"]["rate_limit"]["requests_per_minute"], 1200);
    assert_eq!(
        research["spec"]["api_keys"],
        json!([
            {"secret_name": "nightshift-project-research", "key": "sha256-0", "active": true},
            {"secret_name": "research-old-key", "key": "sha256", "active": false},
        ])
    );
    let secret = find(&docs, "Secret", "nightshift-project-research");
    assert_eq!(secret["stringData"]["sha256-0"], hex::encode(nightshift::config::key_digest(common::KEY)));
    let billing = find(&docs, "Project", "billing");
    assert_eq!(billing["spec"]["api_keys"], json!([{"secret_name": "billing-key", "key": "sha256", "active": true}]));

    // Upstreams: the key reaches workers from its Secret, under the name the config gives.
    let config = nightshift::config::Config::from_yaml(&rendered_config(&docs)).expect("the rendered config parses");
    assert_eq!(config.upstreams.len(), 2);
    let vllm = &config.upstreams[0];
    assert_eq!((vllm.name.as_str(), vllm.max_concurrency), ("vllm-llama", 128));
    let key_env = vllm.api_key_env.clone().expect("api_key_env");
    let env = config.kubernetes.worker.env.iter().find(|e| e.name == key_env).expect("the key in the workers' env");
    let from = env.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
    assert_eq!((from.name.as_str(), from.key.as_str()), ("vllm-api-key", "api-key"));
    assert_eq!(config.upstreams[1].api_key_env, None);
    assert_eq!(config.storage.s3.as_ref().unwrap().endpoint.as_deref(), Some("http://seaweedfs.seaweedfs.svc:8333"));
    assert!(config.storage.s3.as_ref().unwrap().path_style);
    assert_eq!(config.kubernetes.worker.node_selector.get("gpu-pool").map(String::as_str), Some("true"));
    assert_eq!(config.kubernetes.worker.tolerations.len(), 1);
    // Worker Jobs shaped for a GPU cluster under Kueue.
    let worker = &config.kubernetes.worker;
    assert!(worker.affinity.as_ref().unwrap().node_affinity.is_some());
    assert_eq!(worker.priority_class_name.as_deref(), Some("batch-low"));
    assert_eq!(worker.labels["team"], "research");
    assert_eq!(worker.labels["app.kubernetes.io/instance"], "nightshift");
    assert_eq!(worker.annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"], "false");
    assert_eq!((worker.ttl_seconds_after_finished, worker.active_deadline_seconds), (Some(3600), Some(86400)));
    assert_eq!(worker.queue_name.as_deref(), Some("gpu-batch"));
    assert_eq!(worker.metrics_port, Some(9090));
    // The worker pods carry what the PodMonitor selects.
    for (key, value) in selector.as_object().unwrap() {
        assert_eq!(worker.labels.get(key).map(String::as_str).or(Some("worker")), value.as_str(), "{key}");
    }

    // A newer cluster gets policy/v1.
    let docs =
        documents(&render("batch", &["--kube-version", "1.25.0", "--api-versions", "policy/v1/PodDisruptionBudget"]));
    assert_eq!(find(&docs, "PodDisruptionBudget", "nightshift-api")["apiVersion"], "policy/v1");
}

/// Validates every manifest in the files given as arguments against the Kubernetes
/// schemas of the version given first, strictly (unknown fields are errors). Prints one
/// JSON object: what was validated, what was skipped, and every failure.
const VALIDATE_PY: &str = r#"
import json, sys
import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

# Kinds that are not part of Kubernetes have no schema in kubernetes-validate: the
# Prometheus Operator's ServiceMonitor and PodMonitor and the Gateway API's HTTPRoute (CRDs
# of their own), and Nightshift's Project, which the cluster test instead has the real API
# server validate against the CRD.
NO_SCHEMA = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("nightshift.dev/v1alpha1", "Project"),
}
version = sys.argv[1]
CRD_VERSION = "1.28.0"
result = {"validated": [], "skipped": [], "failures": []}
for path in sys.argv[2:]:
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc:
                continue
            what = "%s %s/%s" % (doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
            if (doc["apiVersion"], doc["kind"]) in NO_SCHEMA:
                result["skipped"].append(what)
                continue
            # A CRD's validation rules are fields 1.20 does not know (its API server
            # drops them): CRDs are checked against a schema that has them.
            against = CRD_VERSION if doc["kind"] == "CustomResourceDefinition" else version
            try:
                kubernetes_validate.validate(doc, against, strict=True)
                result["validated"].append(what)
            except ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                result["failures"].append("%s (%s): %s at %s" % (what, path, e.message, where))
            except SchemaNotFoundError as e:
                result["failures"].append("%s: %s" % (what, e.message))
print(json.dumps(result))
"#;

#[test]
fn the_rendered_manifests_are_valid_kubernetes_1_20_objects() {
    let dir = TempDir::new().unwrap();
    let defaults = dir.path().join("defaults.yaml");
    std::fs::write(&defaults, render("batch", &["--include-crds"])).unwrap();
    let full = dir.path().join("full.yaml");
    std::fs::write(&full, render("batch", &["--include-crds", "-f", FULL_VALUES])).unwrap();
    let output =
        run(Command::new(common::tools::python()).args(["-c", VALIDATE_PY, KUBE_VERSION]).arg(&defaults).arg(&full));
    let result: Value = serde_json::from_str(output.trim()).unwrap();
    let failures = result["failures"].as_array().unwrap();
    assert!(failures.is_empty(), "manifests that are not valid Kubernetes {KUBE_VERSION} objects:\n{failures:#?}");
    let validated: Vec<&str> = result["validated"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for expected in [
        "apps/v1 Deployment/nightshift-api",
        "apps/v1 Deployment/nightshift-controller",
        "v1 ConfigMap/nightshift-config",
        "v1 Service/nightshift-api",
        "policy/v1beta1 PodDisruptionBudget/nightshift-api",
        "networking.k8s.io/v1 Ingress/nightshift",
        "rbac.authorization.k8s.io/v1 Role/nightshift-controller",
        "v1 ServiceAccount/nightshift-worker",
        "v1 Secret/nightshift-project-research",
        "apiextensions.k8s.io/v1 CustomResourceDefinition/batches.nightshift.dev",
        "v1 ConfigMap/nightshift-dashboard",
    ] {
        assert!(validated.contains(&expected), "{expected} was not validated: {validated:#?}");
    }
    let skipped: HashSet<&str> = result["skipped"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(
        skipped,
        HashSet::from([
            "monitoring.coreos.com/v1 ServiceMonitor/nightshift-api",
            "monitoring.coreos.com/v1 ServiceMonitor/nightshift-controller",
            "monitoring.coreos.com/v1 PodMonitor/nightshift-worker",
            "gateway.networking.k8s.io/v1 HTTPRoute/nightshift",
            "nightshift.dev/v1alpha1 Project/research",
            "nightshift.dev/v1alpha1 Project/billing",
        ])
    );

    // The worker Jobs' pod-spec pieces are in the ConfigMap, out of reach of the schema
    // check above: validate them as the container and pod spec of a Job would hold them.
    let config =
        nightshift::config::Config::from_yaml(&rendered_config(&documents(&std::fs::read_to_string(&full).unwrap())))
            .unwrap();
    let worker = &config.kubernetes.worker;
    let job = json!({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "worker-template"},
        "spec": {
            "backoffLimit": worker.backoff_limit,
            "activeDeadlineSeconds": worker.active_deadline_seconds,
            "ttlSecondsAfterFinished": worker.ttl_seconds_after_finished,
            "template": {"metadata": {"labels": worker.labels, "annotations": worker.annotations}, "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": worker.pod_security_context,
            "volumes": worker.volumes,
            "nodeSelector": worker.node_selector,
            "tolerations": worker.tolerations,
            "affinity": worker.affinity,
            "priorityClassName": worker.priority_class_name,
            "containers": [{
                "name": "worker", "image": worker.image, "imagePullPolicy": worker.image_pull_policy,
                "args": ["worker"], "env": worker.env, "volumeMounts": worker.volume_mounts,
                "resources": worker.resources, "securityContext": worker.security_context,
                "ports": [{"name": "metrics", "containerPort": worker.metrics_port}],
            }],
        }}},
    });
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, serde_json::to_string(&job).unwrap()).unwrap();
    let output = run(Command::new(common::tools::python()).args(["-c", VALIDATE_PY, KUBE_VERSION]).arg(&job_file));
    let result: Value = serde_json::from_str(output.trim()).unwrap();
    assert_eq!(result["failures"], json!([]), "the worker template is not a valid pod spec");
    assert_eq!(result["validated"], json!(["batch/v1 Job/worker-template"]));
}
