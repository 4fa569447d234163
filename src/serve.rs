//! `nightshift serve`: the API, the reconcile loop and the workers in one process,
//! with state in local storage (or S3, when configured).

use std::sync::Arc;

use anyhow::Context;

use crate::api::{self, AppState};
use crate::auth::Projects;
use crate::batches::{BatchSettings, EmbeddedBatchStore};
use crate::config::{Config, StorageConfig};
use crate::exec::upstream::Upstreams;
use crate::exec::{ExecContext, ExecSettings};
use crate::files::{self, FileCatalog};
use crate::quota::QuotaLedger;
use crate::runner::Runner;
use crate::storage::{DirStore, ObjectStore, S3Settings, S3Store};

pub async fn open_store(config: &StorageConfig) -> anyhow::Result<Arc<dyn ObjectStore>> {
    if let Some(s3) = &config.s3 {
        let env = |name: &str| std::env::var(name).with_context(|| format!("S3 credentials: ${name} is not set"));
        return Ok(Arc::new(S3Store::new(S3Settings {
            bucket: s3.bucket.clone(),
            endpoint: s3.endpoint.clone(),
            region: s3.region.clone(),
            prefix: s3.prefix.clone(),
            path_style: s3.path_style,
            access_key_id: env(&s3.access_key_id_env)?,
            secret_access_key: env(&s3.secret_access_key_env)?,
            session_token: std::env::var("AWS_SESSION_TOKEN").ok(),
        })));
    }
    let dir = config.dir.as_ref().context("storage needs `dir` or `s3`")?;
    let store = DirStore::open(dir).await.with_context(|| format!("cannot use {} for storage", dir.display()))?;
    Ok(Arc::new(store))
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    let store = open_store(&config.storage).await?;
    let mut project_configs = config.projects.clone();
    if project_configs.is_empty() {
        let dev = crate::dev::load_or_create(store.as_ref()).await.context("cannot set up the dev project")?;
        println!("No projects configured: using the dev project.");
        println!("  x-project-id: {}", dev.project_id);
        println!("  x-api-key:    {}", dev.api_key);
        project_configs.push(dev.project());
    }
    let files = FileCatalog::new(store.clone(), config.files.retention);
    let batches = Arc::new(EmbeddedBatchStore::open(store.clone()).await.context("cannot load the batch store")?);
    let projects = Projects::from_config(&project_configs);
    let quota = Arc::new(QuotaLedger::new(&projects));
    let upstreams = Upstreams::from_config(&config.upstreams).map_err(anyhow::Error::msg)?;
    if config.upstreams.is_empty() {
        println!("No upstreams configured: every model is served by the built-in echo model.");
    }
    let settings = ExecSettings {
        checkpoint_interval: config.batches.checkpoint_interval,
        cancel_grace: config.batches.cancel_grace,
    };
    let exec = Arc::new(ExecContext::new(store.clone(), files.clone(), upstreams, quota.clone(), settings));
    let runner = Arc::new(Runner::new(
        batches.clone(),
        exec,
        config.batches.reconcile_interval,
        config.batches.max_running_shards,
    ));
    let state = AppState {
        projects: Arc::new(projects),
        files: files.clone(),
        batches,
        batch_settings: BatchSettings {
            completion_window: config.batches.completion_window,
            shard_lines: config.batches.shard_lines,
        },
        quota,
        wake: runner.waker(),
    };

    let pins = runner.clone();
    let gc = tokio::spawn(files::run_gc_loop(files, config.files.gc_interval, move || {
        let pins = pins.clone();
        async move { pins.pinned_inputs().await }
    }));
    let reconciler = tokio::spawn(runner.run());
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let address = listener.local_addr()?;
    // Tests and scripts read this line to find the port when listening on port 0.
    println!("Nightshift listening on http://{address}");
    tracing::info!(%address, "serving");
    axum::serve(listener, api::router(state)).with_graceful_shutdown(shutdown_signal()).await?;
    gc.abort();
    reconciler.abort();
    Ok(())
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler can be installed");
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("shutting down");
}
