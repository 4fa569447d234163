//! The roles of the one binary (`nightshift <role>`), each a thin assembly of the
//! library's parts: `serve` (everything in one process), `api`, `controller` and
//! `worker` (Kubernetes).

pub mod api;
pub mod controller;
pub mod gc;
pub mod serve;
pub mod worker;

use std::sync::Arc;

use anyhow::Context;

use crate::config::StorageConfig;
use crate::storage::{DirStore, ObjectStore, S3Settings, S3Store, StaticKeys};

/// Serves `/metrics` and `/backlog` on `address`, if any, for as long as the process
/// runs; says where.
pub async fn serve_metrics(address: Option<std::net::SocketAddr>) -> anyhow::Result<()> {
    let Some(address) = address else {
        return Ok(());
    };
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot serve /metrics on {address} (metrics.listen)"))?;
    println!("Nightshift metrics on http://{}/metrics", listener.local_addr()?);
    tokio::spawn(async move {
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(crate::api::metrics))
            .route("/backlog", axum::routing::get(crate::api::backlog));
        if let Err(error) = axum::serve(listener, router).await {
            tracing::error!(%error, "the metrics server stopped");
        }
    });
    Ok(())
}

/// The S3 storage's settings, with its static keys read from the environment; `None`
/// when storage is a directory.
pub fn s3_settings(config: &StorageConfig) -> anyhow::Result<Option<S3Settings>> {
    let Some(s3) = &config.s3 else { return Ok(None) };
    let env = |name: &str| std::env::var(name).with_context(|| format!("S3 credentials: ${name} is not set"));
    let keys = match (&s3.access_key_id_env, &s3.secret_access_key_env) {
        (Some(id), Some(secret)) => {
            Some(StaticKeys { access_key_id: env(id)?, secret_access_key: env(secret)?, session_token: None })
        }
        (None, None) => None,
        _ => anyhow::bail!("storage.s3: set both access_key_id_env and secret_access_key_env, or neither"),
    };
    Ok(Some(S3Settings {
        bucket: s3.bucket.clone(),
        endpoint: s3.endpoint.clone(),
        region: s3.region.clone(),
        prefix: s3.prefix.clone(),
        path_style: s3.path_style,
        keys,
        timeout: s3.timeout,
    }))
}

/// The object store the configuration names.
pub async fn open_store(config: &StorageConfig) -> anyhow::Result<Arc<dyn ObjectStore>> {
    if let Some(settings) = s3_settings(config)? {
        return Ok(Arc::new(S3Store::new(settings)));
    }
    let dir = config.dir.as_ref().context("storage needs `dir` or `s3`")?;
    let store = DirStore::open(dir).await.with_context(|| format!("cannot use {} for storage", dir.display()))?;
    // One process per data directory: then every temp file there is a killed writer's.
    lock_for_life(&dir.join(".lock"))?;
    let swept = store.sweep_abandoned(std::time::Duration::ZERO).await?;
    if swept > 0 {
        tracing::info!(swept, "removed temp files left by a writer that was killed");
    }
    Ok(Arc::new(store))
}

/// Holds an exclusive lock on `path` until the process exits (the kernel drops it then,
/// however the process ends).
fn lock_for_life(path: &std::path::Path) -> anyhow::Result<()> {
    static HELD: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
    file.try_lock().map_err(|_| {
        anyhow::anyhow!(
            "{} is in use by another nightshift process (its lock is {})",
            path.parent().unwrap_or(path).display(),
            path.display()
        )
    })?;
    HELD.lock().expect("lock files").push(file);
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
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
