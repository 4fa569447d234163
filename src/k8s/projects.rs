//! Projects on Kubernetes: Project resources, with their API keys' hashes read from
//! the Secrets they name, kept in a [`ProjectDirectory`] that follows every change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;

use super::controller::cache;
use super::crd::ProjectResource;
use crate::config::{ApiKeyConfig, ProjectConfig, QuotaConfig, Weight};
use crate::projects::{ProjectDirectory, Projects};
use crate::quota::QuotaLedger;
use crate::webhooks::Webhook;

/// Project configurations from the resources and the key hashes in their Secrets.
/// A key whose Secret or entry is missing, or is not 64 hex digits, is left out.
pub fn project_configs(projects: &[Arc<ProjectResource>], secrets: &[Arc<Secret>]) -> Vec<ProjectConfig> {
    let secrets: BTreeMap<&str, &Secret> =
        secrets.iter().filter_map(|s| Some((s.metadata.name.as_deref()?, s.as_ref()))).collect();
    projects
        .iter()
        .map(|project| {
            let api_keys = project
                .spec
                .api_keys
                .iter()
                .filter_map(|key| {
                    let data = secrets.get(key.secret_name.as_str())?.data.as_ref()?.get(&key.key)?;
                    ApiKeyConfig::sha256(std::str::from_utf8(&data.0).ok()?.trim(), key.active)
                })
                .collect();
            ProjectConfig {
                id: project.spec.id.clone(),
                name: project.spec.name.clone(),
                api_keys,
                quota: project.spec.quota.map(|q| QuotaConfig { tokens: q.tokens }),
                rate_limit: project.spec.rate_limit,
                // A webhook whose Secret or entry is missing, or that is refused, is left out.
                webhooks: project
                    .spec
                    .webhooks
                    .iter()
                    .filter_map(|webhook| {
                        let data = secrets.get(webhook.secret_name.as_str())?.data.as_ref()?.get(&webhook.key)?;
                        Webhook::parse(&webhook.url, std::str::from_utf8(&data.0).ok()?).ok()
                    })
                    .collect(),
                weight: Weight::clamped(project.spec.weight.unwrap_or(1)),
            }
        })
        .collect()
}

/// Watches Projects and Secrets in `namespace` and keeps `directory` and the quota
/// ledger current. Returns the Project cache once both watches have synced.
pub async fn follow(
    client: kube::Client,
    namespace: &str,
    directory: Arc<ProjectDirectory>,
    quota: Arc<QuotaLedger>,
) -> anyhow::Result<Store<ProjectResource>> {
    let projects =
        cache(Api::<ProjectResource>::namespaced(client.clone(), namespace), watcher::Config::default()).await?;
    let secrets = cache(Api::<Secret>::namespaced(client, namespace), watcher::Config::default()).await?;
    let refresh = {
        let (projects, secrets) = (projects.clone(), secrets.clone());
        move || {
            let all = projects.state();
            let configs = project_configs(&all, &secrets.state());
            let registry = Projects::from_config(&configs);
            quota.set_limits(&registry);
            for project in &all {
                quota.observe_project(&project.spec.id, project.status.as_ref().map_or(0, |s| s.used_tokens));
            }
            directory.replace(registry);
        }
    };
    refresh();
    tokio::spawn(async move {
        // Changes are picked up within a second; projects and keys change rarely.
        let mut ticker = tokio::time::interval(Duration::from_secs(1));
        loop {
            ticker.tick().await;
            refresh();
        }
    });
    Ok(projects)
}
