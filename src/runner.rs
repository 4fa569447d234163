//! The embedded driver of `nightshift serve`: a loop that reconciles every
//! unfinished batch, acting on the pure decisions of [`crate::reconcile`] with
//! in-process workers. On Kubernetes the controller makes the same decisions and
//! acts with Jobs instead.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::batches::{Batch, BatchStore, EmbeddedBatchStore, Ending, ReservedFiles};
use crate::clock;
use crate::exec::checkpoint::ShardLedger;
use crate::exec::drain::drain_shard;
use crate::exec::finalize::finalize;
use crate::exec::worker::{ShardExit, run_shard};
use crate::exec::{ExecContext, ExecError, failure};
use crate::ids::{BatchId, FileId};
use crate::reconcile::{Action, ShardProgress, decide, finished};

struct Worker {
    stop: CancellationToken,
    handle: JoinHandle<()>,
}

pub struct Runner {
    batches: Arc<EmbeddedBatchStore>,
    exec: Arc<ExecContext>,
    workers: Mutex<HashMap<(BatchId, u32), Worker>>,
    interval: Duration,
    /// Shards run at once over all batches: bounds memory and open inputs.
    max_running_shards: usize,
    wake: Arc<Notify>,
}

impl Runner {
    pub fn new(
        batches: Arc<EmbeddedBatchStore>,
        exec: Arc<ExecContext>,
        interval: Duration,
        max_running_shards: usize,
    ) -> Self {
        Self { batches, exec, workers: Mutex::default(), interval, max_running_shards, wake: Arc::new(Notify::new()) }
    }

    /// Notified when a batch is created or cancelled, so the loop need not wait a tick.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// The inputs of unfinished batches, which garbage collection must keep.
    pub async fn pinned_inputs(&self) -> HashSet<FileId> {
        self.batches.unfinished().await.into_iter().map(|b| b.spec.input_file_id).collect()
    }

    /// Reconciles forever (until the task is dropped).
    pub async fn run(self: Arc<Self>) {
        for (project, batch, tokens) in self.batches.usage().await {
            self.exec.quota.observe(&project, &batch, tokens);
        }
        loop {
            self.tick().await;
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = self.wake.notified() => {}
            }
        }
    }

    /// One pass over every unfinished batch, oldest first (ids sort by creation).
    pub async fn tick(&self) {
        let (statuses, queue_depth) = self.batches.status_summary().await;
        crate::metrics::METRICS.set_batches(statuses.into_iter(), queue_depth);
        let mut batches = self.batches.unfinished().await;
        batches.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        for batch in batches {
            let id = batch.spec.id.clone();
            if let Err(error) = self.reconcile(batch).await {
                tracing::warn!(batch = %id, %error, "reconcile failed; retrying next tick");
            }
        }
    }

    fn running(&self, batch: &BatchId) -> BTreeSet<u32> {
        let mut workers = self.workers.lock().expect("workers");
        workers.retain(|_, worker| !worker.handle.is_finished());
        workers.keys().filter(|(b, _)| b == batch).map(|(_, shard)| *shard).collect()
    }

    fn running_total(&self) -> usize {
        self.workers.lock().expect("workers").values().filter(|w| !w.handle.is_finished()).count()
    }

    async fn ledgers(&self, batch: &Batch) -> Result<Vec<ShardLedger>, ExecError> {
        let mut ledgers = Vec::with_capacity(batch.spec.plan.shards.len());
        for shard in &batch.spec.plan.shards {
            let ledger = self
                .exec
                .checkpoints
                .ledger(self.exec.store.as_ref(), &batch.spec.id, shard.index, shard.requests)
                .await?;
            ledgers.push(ledger);
        }
        Ok(ledgers)
    }

    async fn reconcile(&self, batch: Batch) -> Result<(), ExecError> {
        // Which workers run is read before their checkpoints: a worker that ends in
        // between is then taken as still running (wait a tick), never as stopped with
        // its last chunk unseen (which a drain would then contradict).
        let running = self.running(&batch.spec.id);
        let ledgers = self.ledgers(&batch).await?;
        let progress: Vec<ShardProgress> = batch
            .spec
            .plan
            .shards
            .iter()
            .zip(&ledgers)
            .map(|(shard, ledger)| ShardProgress {
                requests: shard.requests,
                completed: ledger.completed,
                failed: ledger.failed,
                usage: ledger.usage,
            })
            .collect();
        let decision = decide(&batch, &progress, &running, clock::now());
        self.exec.quota.observe(&batch.spec.project_id, &batch.spec.id, decision.state.usage.total_tokens);
        let Some(batch) = self.save(&batch, decision.state).await? else { return Ok(()) };

        match decision.action {
            Action::Wait => {}
            Action::Run(shards) => {
                let free = self.max_running_shards.saturating_sub(self.running_total());
                for index in shards.into_iter().take(free) {
                    self.start(&batch, index);
                }
            }
            Action::Stop => {
                let workers = self.workers.lock().expect("workers");
                for ((_, _), worker) in workers.iter().filter(|((b, _), _)| *b == batch.spec.id) {
                    worker.stop.cancel();
                }
            }
            Action::Drain(ending) => {
                let reason = if ending == Ending::Expired { failure::expired() } else { failure::cancelled() };
                for (shard, ledger) in batch.spec.plan.shards.iter().zip(&ledgers) {
                    drain_shard(&self.exec, &batch.spec, shard, ledger, &reason).await?;
                }
                self.wake.notify_one();
            }
            Action::Finalize(ending) => self.finalize(batch, &ledgers, ending).await?,
        }
        Ok(())
    }

    /// Writes `state` unless the batch's status moved on since it was read (a cancel
    /// came in): then the next tick decides again from the new state. Returns the
    /// batch as stored, or `None` when it moved on.
    async fn save(&self, read: &Batch, state: crate::batches::BatchState) -> Result<Option<Batch>, ExecError> {
        if state == read.state {
            return Ok(Some(read.clone()));
        }
        let status = read.state.status;
        let result = self
            .batches
            .update(&read.spec.project_id, &read.spec.id, &|current| {
                if current.status != status {
                    return Ok(false);
                }
                *current = state.clone();
                Ok(true)
            })
            .await;
        match result {
            Ok(batch) if batch.state.status == state.status => Ok(Some(batch)),
            Ok(_) => Ok(None),
            Err(error) => Err(ExecError::Corrupt(format!("cannot save batch {}: {error}", read.spec.id))),
        }
    }

    fn start(&self, batch: &Batch, index: u32) {
        let Some(shard) = batch.spec.plan.shards.iter().find(|s| s.index == index).cloned() else { return };
        let stop = CancellationToken::new();
        let (exec, spec, token) = (self.exec.clone(), batch.spec.clone(), stop.clone());
        let wake = self.wake.clone();
        let handle = tokio::spawn(async move {
            let ledger = exec.checkpoints.ledger(exec.store.as_ref(), &spec.id, shard.index, shard.requests).await;
            let result = match ledger {
                Ok(ledger) => run_shard(&exec, &spec, &shard, &ledger, token).await,
                Err(error) => Err(error.into()),
            };
            match result {
                Ok(ShardExit::Finished) => tracing::debug!(batch = %spec.id, shard = shard.index, "shard finished"),
                Ok(ShardExit::Stopped) => tracing::info!(batch = %spec.id, shard = shard.index, "shard stopped"),
                Err(error) => tracing::warn!(batch = %spec.id, shard = shard.index, %error, "shard worker failed"),
            }
            wake.notify_one();
        });
        self.workers.lock().expect("workers").insert((batch.spec.id.clone(), index), Worker { stop, handle });
    }

    async fn finalize(&self, batch: Batch, ledgers: &[ShardLedger], ending: Ending) -> Result<(), ExecError> {
        // Reserve the files' ids durably first, so a finalize run again writes the same files.
        let batch = match &batch.state.reserved_files {
            Some(_) => batch,
            None => {
                let mut state = batch.state.clone();
                state.reserved_files = Some(ReservedFiles { output: FileId::generate(), error: FileId::generate() });
                match self.save(&batch, state).await? {
                    Some(batch) => batch,
                    None => return Ok(()),
                }
            }
        };
        let reserved = batch.state.reserved_files.clone().expect("reserved above");
        let files = finalize(&self.exec, &batch.spec, ledgers, &reserved).await?;
        let state = finished(&batch.state, ending, &files, clock::now());
        if let Some(done) = self.save(&batch, state).await? {
            tracing::info!(
                batch = %done.spec.id,
                status = done.state.status.as_str(),
                completed = done.state.request_counts.completed,
                failed = done.state.request_counts.failed,
                "batch finished"
            );
            self.exec.checkpoints.forget(&done.spec.id);
        }
        Ok(())
    }
}
