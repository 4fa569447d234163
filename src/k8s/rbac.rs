//! The least privilege each role needs, in one place: the Helm chart's Roles and the
//! operator tests' Roles are both made from these rules. Workers need none at all.

use crate::config::WorkloadKind;

use k8s_openapi::api::rbac::v1::PolicyRule;

fn rule(group: &str, resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(resources.iter().map(|r| (*r).to_owned()).collect()),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..PolicyRule::default()
    }
}

/// `nightshift api`: creates Batches and applies their first status and cancels;
/// reads Projects and the Secrets holding their key hashes.
pub fn api_rules() -> Vec<PolicyRule> {
    vec![
        rule("nightshift.dev", &["batches"], &["get", "list", "watch", "create"]),
        rule("nightshift.dev", &["batches/status"], &["get", "patch"]),
        rule("nightshift.dev", &["projects"], &["get", "list", "watch"]),
        rule("", &["secrets"], &["get", "list", "watch"]),
    ]
}

/// `nightshift controller`: drives Batches (status, finalizer), owns their Jobs,
/// keeps Projects' usage, reads the Secrets holding their webhooks' signing secrets,
/// holds its Lease, and records Events.
pub fn controller_rules() -> Vec<PolicyRule> {
    vec![
        rule("nightshift.dev", &["batches"], &["get", "list", "watch", "patch", "update", "delete"]),
        rule("nightshift.dev", &["batches/status"], &["get", "patch"]),
        rule("nightshift.dev", &["batches/finalizers"], &["update"]),
        rule("nightshift.dev", &["projects"], &["get", "list", "watch"]),
        rule("nightshift.dev", &["projects/status"], &["get", "patch", "update"]),
        rule("", &["secrets"], &["get", "list", "watch"]),
        rule("batch", &["jobs"], &["get", "list", "watch", "create", "delete"]),
        rule("coordination.k8s.io", &["leases"], &["get", "create", "update"]),
        rule("events.k8s.io", &["events"], &["create", "patch"]),
    ]
}

/// `nightshift controller`, for each workload an upstream's `scale` names, in that
/// workload's namespace: reads it and lists the pods there (to count its ready replicas),
/// changes its replicas through its `scale` subresource, and records Events there. That
/// workload only: any other's replicas are out of reach.
pub fn scale_rules(kind: WorkloadKind, name: &str) -> Vec<PolicyRule> {
    let resource = match kind {
        WorkloadKind::Deployment => "deployments",
        WorkloadKind::StatefulSet => "statefulsets",
    };
    let named = |resource: &str, verbs: &[&str]| PolicyRule {
        resource_names: Some(vec![name.to_owned()]),
        ..rule("apps", &[resource], verbs)
    };
    vec![
        named(resource, &["get"]),
        named(&format!("{resource}/scale"), &["get", "patch"]),
        rule("", &["pods"], &["list"]),
        rule("events.k8s.io", &["events"], &["create", "patch"]),
    ]
}
