//! The background sweep that removes finished batches past their retention
//! (`batches.retention`) from the embedded store.

use std::sync::Arc;
use std::time::Duration;

use super::EmbeddedBatchStore;
use crate::clock;

/// Sweeps every `interval`, the first time at once, until the task is dropped.
pub async fn run_retention_loop(batches: Arc<EmbeddedBatchStore>, retention: Duration, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let cutoff = clock::now().saturating_sub(i64::try_from(retention.as_secs()).unwrap_or(i64::MAX));
        match batches.remove_finished_before(cutoff).await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "removed batches finished longer ago than their retention"),
            Err(error) => tracing::warn!(%error, "could not remove old batches; retrying next interval"),
        }
    }
}
