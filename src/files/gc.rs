//! The background sweep that removes deleted and expired files from storage.

use std::time::Duration;

use super::FileCatalog;
use crate::clock;

/// Sweeps every `interval` until the task is dropped.
pub async fn run_gc_loop(catalog: FileCatalog, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match catalog.collect_garbage(clock::now()).await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "garbage-collected deleted and expired files"),
            Err(error) => {
                tracing::warn!(%error, "file garbage collection failed; retrying next interval")
            }
        }
    }
}
