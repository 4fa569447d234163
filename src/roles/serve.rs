//! `nightshift serve`: the API, the reconcile loop and the workers in one process,
//! with state in local storage (or S3, when configured).

use std::sync::Arc;

use anyhow::Context;

use super::{open_store, shutdown_signal};
use crate::api::{self, AppState, Drain};
use crate::batches::{EmbeddedBatchStore, run_retention_loop};
use crate::concurrency::control::Mode;
use crate::config::Config;
use crate::exec::upstream::Upstreams;
use crate::exec::{ExecContext, ExecSettings};
use crate::files::FileCatalog;
use crate::projects::{ProjectDirectory, Projects};
use crate::quota::QuotaLedger;
use crate::serve_runtime::Runner;

pub async fn run(config: Config) -> anyhow::Result<()> {
    let store = open_store(&config.storage).await?;
    let project_configs = projects_or_dev(&config, store.as_ref()).await?;
    let files = FileCatalog::new(store.clone(), config.files.retention);
    let batches = Arc::new(EmbeddedBatchStore::open(store.clone()).await.context("cannot load the batch store")?);
    let projects = Projects::from_config(&project_configs);
    let quota = Arc::new(QuotaLedger::new(&projects));
    let upstreams = Upstreams::from_config(&config.upstreams, false)?;
    if config.upstreams.is_empty() {
        println!("No upstreams configured: every model is served by the built-in echo model.");
    }
    let settings = ExecSettings::from_config(&config.batches);
    let exec = Arc::new(ExecContext::new(store.clone(), files.clone(), upstreams, quota.clone(), settings));
    let control = tokio::spawn({
        let (exec, memory) = (exec.clone(), Some(store.clone()));
        async move { crate::exec::permits::govern_all(&exec.upstreams, &exec.client, Mode::Local, memory).await }
    });
    let max_running_shards =
        config.batches.max_running_shards.unwrap_or_else(crate::config::default_max_running_shards);
    let weights = project_configs.iter().map(|p| (p.id.clone(), p.weight.get())).collect();
    let runner = Runner::new(batches.clone(), exec, config.batches.reconcile_interval, max_running_shards);
    let runner = Arc::new(runner.scheduled(config.batches.scheduling, weights));
    let state = AppState {
        projects: Arc::new(ProjectDirectory::new(projects)),
        files: files.clone(),
        batches: batches.clone(),
        batch_settings: config.batches.batch_settings(),
        quota,
        wake: runner.waker(),
        // One process on one machine: no load balancer to leave, stop at once.
        drain: Drain::default(),
        idempotency: crate::idempotency::IdempotencyStore::new(files.store().clone()),
        uploads: crate::uploads::UploadStore::new(files.clone()),
        receiving: Arc::new(tokio::sync::Semaphore::new(config.http.max_uploads)),
        limits: Arc::new(api::rate_limits::RateLimits::new(&config.http)),
    };

    let pins = runner.clone();
    let gc = tokio::spawn(super::gc::run_gc_loop(files, config.files.gc_interval, move || {
        let pins = pins.clone();
        async move { pins.pinned_inputs().await }
    }));
    let deliverer = crate::webhooks::Deliverer::new(store.clone(), state.projects.clone(), config.webhooks.clone());
    let webhooks = tokio::spawn(deliverer.run(std::time::Duration::from_secs(1)));
    let retention = tokio::spawn(run_retention_loop(batches, config.batches.retention, config.files.gc_interval));
    let reconciler = tokio::spawn(runner.run());
    super::serve_metrics(config.metrics.listen).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let address = listener.local_addr()?;
    // Tests and scripts read this line to find the port when listening on port 0.
    println!("Nightshift listening on http://{address}");
    tracing::info!(%address, "serving");
    api::server::serve(listener, api::router(state), &config.http, shutdown_signal()).await?;
    for task in [gc, webhooks, retention, reconciler, control] {
        task.abort();
    }
    Ok(())
}

/// The configured projects, or with none, the dev project (made once, kept in storage),
/// whose id and key are printed.
async fn projects_or_dev(
    config: &Config,
    store: &dyn crate::storage::ObjectStore,
) -> anyhow::Result<Vec<crate::config::ProjectConfig>> {
    if !config.projects.is_empty() {
        return Ok(config.projects.clone());
    }
    let dev = crate::dev::load_or_create(store).await.context("cannot set up the dev project")?;
    println!("No projects configured: using the dev project.");
    println!("  x-project-id: {}", dev.project_id);
    println!("  x-api-key:    {}", dev.api_key);
    Ok(vec![dev.project()])
}
