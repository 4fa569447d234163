//! `nightshift api`: the HTTP API on Kubernetes. Batches are Batch resources (reads
//! from a watch cache), projects are Project resources with key hashes in Secrets,
//! files are in object storage. Several replicas may run side by side.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokio::sync::Notify;

use super::{open_store, shutdown_signal};
use crate::api::{self, AppState, Drain};
use crate::config::Config;
use crate::files::FileCatalog;
use crate::k8s::controller::check_crds;
use crate::k8s::store::{KubeBatchStore, to_batch};
use crate::projects::ProjectDirectory;
use crate::quota::QuotaLedger;

#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// YAML configuration file (storage, batches, files; projects come from Project resources).
    #[arg(long, env = "NIGHTSHIFT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on; overrides `listen`.
    #[arg(long, env = "NIGHTSHIFT_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Namespace of Batches and Projects; overrides `kubernetes.namespace`.
    #[arg(long, env = "NIGHTSHIFT_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address of `/metrics`; overrides `metrics.listen`.
    #[arg(long, env = "NIGHTSHIFT_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

/// The namespace to work in: the flag, the configuration, the pod's own, or `default`.
pub fn namespace(flag: Option<&str>, config: &Config) -> String {
    flag.map(str::to_owned)
        .or_else(|| config.kubernetes.namespace.clone())
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_else(|| "default".to_owned())
}

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(metrics) = args.metrics_listen {
        config.metrics.listen = Some(metrics);
    }
    let namespace = namespace(args.namespace.as_deref(), &config);
    let client = kube::Client::try_default().await.context("cannot reach the Kubernetes API")?;
    check_crds(&client, &namespace).await?;

    let store = open_store(&config.storage).await?;
    let files = FileCatalog::new(store, config.files.retention);
    let batches = Arc::new(KubeBatchStore::start(client.clone(), &namespace).await?);
    let directory = Arc::new(ProjectDirectory::default());
    let quota = Arc::new(QuotaLedger::default());
    let _watched = crate::k8s::projects::follow(client, &namespace, directory.clone(), quota.clone()).await?;
    let state = AppState {
        projects: directory,
        files: files.clone(),
        batches: batches.clone(),
        batch_settings: config.batches.batch_settings(),
        quota,
        // The controller watches Batches: nothing to wake.
        wake: Arc::new(Notify::new()),
        drain: Drain::default(),
        idempotency: crate::idempotency::IdempotencyStore::new(files.store().clone()),
        uploads: crate::uploads::UploadStore::new(files.clone()),
        receiving: Arc::new(tokio::sync::Semaphore::new(config.http.max_uploads)),
        limits: Arc::new(api::rate_limits::RateLimits::new(&config.http)),
    };

    let gc = tokio::spawn(super::gc::run_gc_loop(files, config.files.gc_interval, move || {
        let batches = batches.clone();
        async move {
            let unfinished = batches.cache().state();
            unfinished
                .iter()
                .filter_map(|resource| to_batch(resource))
                .filter(|batch| !batch.state.status.is_terminal())
                .map(|batch| batch.spec.input_file_id)
                .collect()
        }
    }));
    super::serve_metrics(config.metrics.listen).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    println!("Nightshift API listening on http://{} (namespace {namespace})", listener.local_addr()?);
    let shutdown = state.drain.clone().on(shutdown_signal(), config.kubernetes.api_shutdown_delay);
    api::server::serve(listener, api::router(state), &config.http, shutdown).await?;
    gc.abort();
    Ok(())
}
