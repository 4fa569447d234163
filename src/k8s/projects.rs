//! Projects on Kubernetes: Project resources, with their API keys' hashes read from
//! the Secrets they name, kept in a [`ProjectDirectory`] that follows every change.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;

use super::controller::cache;
use super::crd::{BatchResource, ProjectResource, WebhookRef};
use crate::config::{ApiKeyConfig, ProjectConfig, QuotaConfig, Weight};
use crate::projects::{ProjectDirectory, Projects};
use crate::quota::QuotaLedger;
use crate::webhooks::{BatchEndpoints, Webhook};

/// The webhook `webhook` names, its signing secret read from `secrets`: `None` when the
/// Secret or its entry is missing, or the webhook is refused.
fn resolve(secrets: &BTreeMap<&str, &Secret>, webhook: &WebhookRef) -> Option<Webhook> {
    let data = secrets.get(webhook.secret_name.as_str())?.data.as_ref()?.get(&webhook.key)?;
    Webhook::parse(&webhook.url, std::str::from_utf8(&data.0).ok()?).ok()
}

fn by_name(secrets: &[Arc<Secret>]) -> BTreeMap<&str, &Secret> {
    secrets.iter().filter_map(|s| Some((s.metadata.name.as_deref()?, s.as_ref()))).collect()
}

/// Each accepted Batch's own webhooks (`spec.webhooks`), by batch id, with their signing
/// secrets read from `secrets`; a webhook that cannot be resolved is left out.
pub fn batch_webhooks(batches: &[Arc<BatchResource>], secrets: &[Arc<Secret>]) -> HashMap<String, Vec<Webhook>> {
    let secrets = by_name(secrets);
    batches
        .iter()
        .filter(|batch| !batch.spec.webhooks.is_empty())
        .filter_map(|batch| {
            let id = batch.accepted()?.id.to_string();
            Some((id, batch.spec.webhooks.iter().filter_map(|webhook| resolve(&secrets, webhook)).collect()))
        })
        .collect()
}

/// Project configurations from the resources and the key hashes in their Secrets.
/// A key whose Secret or entry is missing, or is not 64 hex digits, is left out.
pub fn project_configs(projects: &[Arc<ProjectResource>], secrets: &[Arc<Secret>]) -> Vec<ProjectConfig> {
    let secrets = by_name(secrets);
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
                webhooks: project.spec.webhooks.iter().filter_map(|webhook| resolve(&secrets, webhook)).collect(),
                weight: Weight::clamped(project.spec.weight.unwrap_or(1)),
            }
        })
        .collect()
}

/// Watches Projects and Secrets in `namespace` and keeps `directory` and the quota
/// ledger current. Returns both caches once their watches have synced.
pub async fn follow(
    client: kube::Client,
    namespace: &str,
    directory: Arc<ProjectDirectory>,
    quota: Arc<QuotaLedger>,
) -> anyhow::Result<(Store<ProjectResource>, Store<Secret>)> {
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
    Ok((projects, secrets))
}

/// Keeps `endpoints` current with the Batches' own webhooks, each second, until dropped.
pub async fn follow_batch_webhooks(
    batches: Store<BatchResource>,
    secrets: Store<Secret>,
    endpoints: Arc<BatchEndpoints>,
) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    loop {
        ticker.tick().await;
        endpoints.replace(batch_webhooks(&batches.state(), &secrets.state()));
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;

    use super::*;
    use crate::batches::BatchSpec;
    use crate::k8s::crd::BatchResourceSpec;
    use crate::validate::ShardPlan;

    fn secret(name: &str, value: &str) -> Arc<Secret> {
        Arc::new(Secret {
            metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
            data: Some([("secret".to_owned(), ByteString(value.as_bytes().to_vec()))].into()),
            ..Secret::default()
        })
    }

    fn hook(url: &str, secret_name: &str) -> WebhookRef {
        WebhookRef { url: url.into(), secret_name: secret_name.into(), key: "secret".into() }
    }

    #[test]
    fn a_batchs_own_webhooks_are_resolved_by_its_id_and_the_unresolvable_left_out() {
        let signing = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let spec = BatchSpec::sample(ShardPlan::default(), 1, 2);
        let id = spec.id.to_string();
        let mut accepted = BatchResourceSpec::recorded(spec);
        accepted.webhooks = vec![
            hook("https://hooks.example.com/a", "hook"),
            hook("https://hooks.example.com/b", "missing"),
            hook("https://hooks.example.com/c", "not-a-secret"),
        ];
        let not_accepted = BatchResourceSpec { batch: None, ..accepted.clone() };
        let batches = [accepted, not_accepted].map(|spec| Arc::new(BatchResource::new("b", spec)));
        let secrets = [secret("hook", signing), secret("not-a-secret", "hunter2")];
        let endpoints = batch_webhooks(&batches, &secrets);
        assert_eq!(endpoints.len(), 1, "only an accepted batch has an id to deliver by");
        let urls: Vec<&str> = endpoints[&id].iter().map(|w| w.url.as_str()).collect();
        assert_eq!(urls, ["https://hooks.example.com/a"]);
    }
}
