//! What the chart documents: every key of values.yaml has a comment; the values schema
//! and the chart's README are generated from it (`just chart-docs`); the templates read
//! nothing it leaves out, and helm refuses what its schema does not allow; the dashboard
//! queries the documented metrics.

use serde_json::Value;
use tempfile::TempDir;

use super::{CHART, KUBE_VERSION, RELEASE};
use crate::common;
use crate::common::tools::helm;

#[test]
fn every_key_of_values_yaml_is_documented() {
    let values = std::fs::read_to_string(format!("{CHART}/values.yaml")).unwrap();
    let lines: Vec<&str> = values.lines().collect();
    let mut undocumented = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let is_key = !trimmed.starts_with('#')
            && !trimmed.starts_with('-')
            && trimmed.split_once(':').is_some_and(|(key, _)| !key.is_empty() && !key.contains(' '));
        if is_key && !(n > 0 && lines[n - 1].trim_start().starts_with('#')) {
            undocumented.push(format!("{}: {line}", n + 1));
        }
    }
    assert!(undocumented.is_empty(), "keys without a comment above them:\n{}", undocumented.join("\n"));
}

const README_HEADER: &str =
    "<!-- Generated from values.yaml by tests/cluster/chart/documented.rs: edit values.yaml, then run `just chart-docs`. -->
# The Nightshift Helm chart

Nightshift's api, controller and worker Jobs on Kubernetes. `docs/src/kubernetes.md` (in the
repository) walks through a whole installation: the image, S3, an upstream, a project, the
ingress. The CRDs are in `crds/`; Helm installs them on the first install only.

```sh
helm install nightshift charts/nightshift -n nightshift --create-namespace -f my-values.yaml
```

Helm checks the values against `values.schema.json`: a misspelled key or a wrong type is
refused before anything is applied.

## Values

";

/// Compares a generated file with the committed one, or writes it with NIGHTSHIFT_BLESS=1.
fn generated(path: &str, text: &str) {
    let path = format!("{CHART}/{path}");
    if std::env::var_os("NIGHTSHIFT_BLESS").is_some() {
        std::fs::write(&path, text).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(committed == text, "{path} is stale: run `just chart-docs` (it regenerates it from values.yaml)");
}

#[test]
fn the_values_schema_and_the_chart_readme_are_generated_from_values_yaml() {
    let values = std::fs::read_to_string(format!("{CHART}/values.yaml")).unwrap();
    let schema = common::values_doc::schema(&values);
    generated("values.schema.json", &(serde_json::to_string_pretty(&schema).unwrap() + "\n"));
    generated("README.md", &format!("{README_HEADER}{}", common::values_doc::readme_table(&values)));
}

#[test]
fn every_value_the_templates_read_is_in_values_yaml() {
    let values: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(format!("{CHART}/values.yaml")).unwrap()).unwrap();
    let mut templates = String::new();
    for entry in std::fs::read_dir(format!("{CHART}/templates")).unwrap() {
        templates.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap());
    }
    let references = common::values_doc::template_references(&templates);
    assert!(references.len() > 30, "{references:?}");
    let missing: Vec<&String> = references
        .iter()
        .filter(|path| path.split('.').try_fold(&values, |value, key| value.get(key)).is_none())
        .collect();
    assert!(missing.is_empty(), "read by templates, absent from values.yaml (so undocumented): {missing:?}");
}

#[test]
fn helm_refuses_values_the_schema_does_not_allow() {
    let home = TempDir::new().unwrap();
    let template = |set: &str| {
        helm(home.path())
            .args(["template", RELEASE, CHART, "--kube-version", KUBE_VERSION, "--set", set])
            .output()
            .unwrap()
    };
    for (bad, what) in [
        ("worker.nodeSelecter.gpu=true", "nodeSelecter"),
        ("api.replicas=two", "replicas"),
        ("controller.leaseSeconds=", "leaseSeconds"),
    ] {
        let output = template(bad);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "--set {bad} was accepted");
        assert!(stderr.contains("schema") && stderr.contains(what), "--set {bad}: {stderr}");
    }
    // Free-form maps take any key; nullable numbers take numbers.
    for good in [
        "worker.nodeSelector.gpu=true",
        "securityContext.procMount=Default",
        "ingress.annotations.x=y",
        "worker.ttlSecondsAfterFinished=600",
    ] {
        let output = template(good);
        assert!(output.status.success(), "--set {good}: {}", String::from_utf8_lossy(&output.stderr));
    }
}

#[test]
fn the_dashboard_is_valid_json_over_the_documented_metrics() {
    let text = std::fs::read_to_string(format!("{CHART}/dashboards/nightshift.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(dashboard["uid"], "nightshift");
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| t["expr"].as_str().unwrap())
        .collect();
    for metric in [
        "nightshift_batches{",
        "nightshift_lines_total{",
        "nightshift_upstream_request_duration_seconds_bucket{",
        "nightshift_upstream_retries_total{",
        "nightshift_queue_depth{",
        "nightshift_http_requests_total{",
        "nightshift_upstream_concurrency_limit{",
        "nightshift_upstream_dispatch_held{",
        "nightshift_load_signal_failures_total{",
        "nightshift_backlog_lines{",
        "nightshift_backlog_pace_ratio{",
        "nightshift_backlog_replicas_needed{",
        "nightshift_scale_changes_total{",
    ] {
        assert!(exprs.iter().any(|e| e.contains(metric)), "no panel queries {metric}");
    }
}
