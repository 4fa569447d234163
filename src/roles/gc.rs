//! The background sweep of `serve` and `api`: it removes deleted and expired files from
//! storage, what writers killed mid-write left behind (temp files, multipart uploads),
//! the parts of finished and expired uploads (the Uploads API) and idempotency keys past
//! their day.

use std::collections::HashSet;
use std::time::Duration;

use crate::clock;
use crate::files::FileCatalog;
use crate::ids::FileId;

/// Sweeps every `interval`, the first time at once (a restart cleans up after the crash
/// before it), until the task is dropped. `pinned` names the files that
/// must stay whatever their records say (the inputs of unfinished batches).
pub async fn run_gc_loop<F, Fut>(catalog: FileCatalog, interval: Duration, pinned: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = HashSet<FileId>>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match catalog.sweep_abandoned().await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "removed what writers killed mid-write left behind"),
            Err(error) => tracing::warn!(%error, "could not sweep abandoned writes; retrying next interval"),
        }
        // Uploads are files in the making: their parts go with them.
        match crate::uploads::UploadStore::new(catalog.clone()).collect_garbage(clock::now()).await {
            Ok(0) => {}
            Ok(cleared) => tracing::info!(cleared, "removed finished and expired uploads"),
            Err(error) => tracing::warn!(%error, "could not sweep uploads; retrying next interval"),
        }
        // Idempotency keys live a day.
        let claims = crate::idempotency::IdempotencyStore::new(catalog.store().clone());
        if let Err(error) = claims.collect_garbage(clock::now()).await {
            tracing::warn!(%error, "could not sweep idempotency keys; retrying next interval");
        }
        let pinned = pinned().await;
        match catalog.collect_garbage(clock::now(), &pinned).await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "garbage-collected deleted and expired files"),
            Err(error) => {
                tracing::warn!(%error, "file garbage collection failed; retrying next interval")
            }
        }
    }
}
