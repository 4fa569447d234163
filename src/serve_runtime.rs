//! The embedded runtime of `nightshift serve`: a loop that drives every unfinished batch
//! ([`crate::drive`]) with workers as tasks of this process and the batch documents in
//! the embedded store. On Kubernetes the controller drives the same way with Jobs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::batches::{Batch, BatchState, BatchStore, EmbeddedBatchStore, Status};
use crate::capacity::backlog::{self, Report, Serving};
use crate::config::Scheduling;
use crate::drive::{News, Next, Runtime, WorkerPhase, drive};
use crate::exec::worker::{ShardExit, run_shard};
use crate::exec::{ExecContext, ExecError};
use crate::ids::{BatchId, FileId, ProjectId};
use crate::lifecycle::schedule::{Candidate, allot, allot_in_order};
use crate::validate::Shard;

struct Worker {
    stop: CancellationToken,
    handle: JoinHandle<()>,
    /// Set when the task ended with an error: a failed worker, until retired.
    failed: Arc<AtomicBool>,
    /// Set once the shard has no line left to send: its last lines finishing no longer
    /// hold a slot of `max_running_shards` (the upstream's limit still bounds them).
    dispatched: Arc<AtomicBool>,
}

impl Worker {
    /// Whether the worker holds a slot: running, with lines left to send.
    fn holds_a_slot(&self) -> bool {
        !self.handle.is_finished() && !self.dispatched.load(Ordering::Relaxed)
    }
}

pub struct Runner {
    batches: Arc<EmbeddedBatchStore>,
    exec: Arc<ExecContext>,
    workers: Mutex<HashMap<(BatchId, u32), Worker>>,
    interval: Duration,
    /// Shards run at once over all batches: bounds memory and open inputs.
    max_running_shards: usize,
    /// How those are shared between batches, and the projects' weights for it.
    scheduling: Scheduling,
    weights: HashMap<ProjectId, u32>,
    /// Shards each running batch may run, as the last pass allotted them.
    allotted: Mutex<HashMap<BatchId, usize>>,
    /// Shards whose worker finished them (they need no slot any more).
    finished: Arc<Mutex<HashSet<(BatchId, u32)>>>,
    wake: Arc<Notify>,
}

impl Runner {
    pub fn new(
        batches: Arc<EmbeddedBatchStore>,
        exec: Arc<ExecContext>,
        interval: Duration,
        max_running_shards: usize,
    ) -> Self {
        Self {
            batches,
            exec,
            workers: Mutex::default(),
            interval,
            max_running_shards,
            scheduling: Scheduling::default(),
            weights: HashMap::new(),
            allotted: Mutex::default(),
            finished: Arc::default(),
            wake: Arc::new(Notify::new()),
        }
    }

    /// Shares shards between batches as `scheduling` says, projects by `weights` (1
    /// for those not named).
    pub fn scheduled(mut self, scheduling: Scheduling, weights: HashMap<ProjectId, u32>) -> Self {
        self.scheduling = scheduling;
        self.weights = weights;
        self
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
        let (settled, unfinished) = self.batches.usage().await;
        for (project, tokens) in settled {
            self.exec.quota.settle(&project, tokens);
        }
        for (project, batch, tokens) in unfinished {
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
        let (counts, queue_depth) = self.batches.status_summary().await;
        crate::metrics::METRICS.set_batch_counts(&counts, queue_depth);
        let mut batches = self.batches.unfinished().await;
        crate::metrics::METRICS.publish_backlog(self.backlog(&batches));
        batches.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        self.allot(&batches).await;
        for batch in batches {
            let id = batch.spec.id.clone();
            if let Err(error) = self.reconcile(batch).await {
                tracing::warn!(batch = %id, %error, "reconcile failed; retrying next tick");
            }
        }
    }

    /// What `batches` need of each upstream, with this process's lines in flight (no
    /// workload behind an upstream is known here).
    fn backlog(&self, batches: &[Batch]) -> Report {
        let upstreams = &self.exec.upstreams;
        let now = crate::clock::now();
        let pending =
            backlog::pending(batches.iter().map(|b| (&b.spec, &b.state)), |model| upstreams.name_of(model), now);
        let serving = upstreams
            .iter()
            .map(|u| (u.name.clone(), Serving { in_flight: u64::from(u.limiter.in_flight()), ready: None }))
            .collect();
        backlog::report(&pending, &serving, now)
    }

    /// Shares the shard slots among the batches that run (`crate::lifecycle::schedule`), and stops
    /// shards of a batch that runs more than its share now (they go on later from their
    /// checkpoints).
    async fn allot(&self, batches: &[Batch]) {
        let running: Vec<&Batch> = batches.iter().filter(|b| b.state.status == Status::InProgress).collect();
        let live = self.running_shards();
        let finished = self.finished.lock().expect("finished").clone();
        let candidates: Vec<Candidate<&ProjectId>> = running
            .iter()
            .map(|batch| {
                let done = finished.iter().filter(|(id, _)| *id == batch.spec.id).count();
                Candidate {
                    project: &batch.spec.project_id,
                    weight: self.weights.get(&batch.spec.project_id).copied().unwrap_or(1),
                    expires_at: batch.spec.expires_at,
                    created_at: batch.spec.created_at,
                    id: batch.spec.id.to_string(),
                    shards: batch.spec.plan.shards.len().saturating_sub(done),
                }
            })
            .collect();
        let shares = match self.scheduling {
            Scheduling::Fair => allot(self.max_running_shards, &candidates),
            Scheduling::Fifo => allot_in_order(self.max_running_shards, &candidates),
        };
        let mut over = Vec::new();
        for (batch, share) in running.iter().zip(&shares) {
            let mut shards: Vec<u32> =
                live.iter().filter(|(id, _)| *id == batch.spec.id).map(|(_, shard)| *shard).collect();
            shards.sort_unstable();
            over.extend(shards.iter().skip(*share).map(|shard| (*batch, *shard)));
        }
        let ids: HashSet<&BatchId> = batches.iter().map(|b| &b.spec.id).collect();
        self.finished.lock().expect("finished").retain(|(id, _)| ids.contains(id));
        *self.allotted.lock().expect("allotted") =
            running.iter().zip(shares).map(|(batch, share)| (batch.spec.id.clone(), share)).collect();
        for (batch, shard) in over {
            tracing::debug!(batch = %batch.spec.id, shard, "over its share: the shard stops for now");
            let _ = Runtime::stop(self, batch, shard).await;
        }
    }

    /// The shards whose workers run (not told to stop).
    fn running_shards(&self) -> Vec<(BatchId, u32)> {
        let workers = self.workers.lock().expect("workers");
        workers
            .iter()
            .filter(|(_, worker)| worker.holds_a_slot() && !worker.stop.is_cancelled())
            .map(|(key, _)| key.clone())
            .collect()
    }

    fn running_total(&self) -> usize {
        self.workers.lock().expect("workers").values().filter(|w| w.holds_a_slot()).count()
    }

    async fn reconcile(&self, batch: Batch) -> Result<(), ExecError> {
        if drive(self, &self.exec, batch).await? == Next::Now {
            self.wake.notify_one();
        }
        Ok(())
    }
}

/// Workers are tasks of this process; the batch document is in the embedded store.
#[async_trait]
impl Runtime for Runner {
    type Error = ExecError;

    async fn workers(&self, batch: &Batch) -> Result<BTreeMap<u32, WorkerPhase>, ExecError> {
        // A task that finished is forgotten (its shard is idle, and runs again if
        // incomplete), unless it failed: that one stays until retired, to be counted.
        let mut workers = self.workers.lock().expect("workers");
        workers.retain(|_, worker| !worker.handle.is_finished() || worker.failed.load(Ordering::Relaxed));
        let ours = workers.iter().filter(|((b, _), _)| *b == batch.spec.id);
        Ok(ours
            .map(|((_, shard), worker)| {
                let phase = if worker.handle.is_finished() { WorkerPhase::Failed } else { WorkerPhase::Running };
                (*shard, phase)
            })
            .collect())
    }

    fn free_slots(&self, batch: &Batch) -> Option<usize> {
        let free = self.max_running_shards.saturating_sub(self.running_total());
        let Some(share) = self.allotted.lock().expect("allotted").get(&batch.spec.id).copied() else {
            return Some(free);
        };
        let ours = self.running_shards().iter().filter(|(id, _)| *id == batch.spec.id).count();
        Some(free.min(share.saturating_sub(ours)))
    }

    async fn start(&self, batch: &Batch, shard: &Shard) -> Result<(), ExecError> {
        let stop = CancellationToken::new();
        let (exec, spec, shard, token) = (self.exec.clone(), batch.spec.clone(), shard.clone(), stop.clone());
        let index = shard.index;
        let wake = self.wake.clone();
        let finished = self.finished.clone();
        let failed = Arc::new(AtomicBool::new(false));
        let failure = failed.clone();
        let dispatched = Arc::new(AtomicBool::new(false));
        let (sent_all, wake_next) = (dispatched.clone(), self.wake.clone());
        let handle = tokio::spawn(async move {
            let ledger = exec.checkpoints.ledger(exec.store.as_ref(), &spec.id, shard.index, shard.requests).await;
            let result = match ledger {
                Ok(ledger) => {
                    // Its slot is free once its lines are all sent: the next pass may start another.
                    let sent = move || {
                        sent_all.store(true, Ordering::Relaxed);
                        wake_next.notify_one();
                    };
                    run_shard(&exec, &spec, &shard, &ledger, token, &sent).await
                }
                Err(error) => Err(error),
            };
            match result {
                Ok(ShardExit::Finished) => {
                    tracing::debug!(batch = %spec.id, shard = shard.index, "shard finished");
                    finished.lock().expect("finished").insert((spec.id.clone(), shard.index));
                }
                Ok(ShardExit::Stopped) => tracing::info!(batch = %spec.id, shard = shard.index, "shard stopped"),
                // Another process claimed the shard (only a worker run by hand on the same
                // storage can): the shard starts here again, claiming it back, if it is
                // still incomplete at the next pass.
                Ok(ShardExit::Superseded) => {}
                // Storage that fails is waited out: the shard starts again at the next
                // pass, without counting against its retries. Anything else counts.
                Err(error @ ExecError::Storage(_)) => {
                    tracing::warn!(batch = %spec.id, shard = shard.index, %error, "shard worker stopped; storage failed")
                }
                Err(error) => {
                    tracing::warn!(batch = %spec.id, shard = shard.index, %error, "shard worker failed");
                    failure.store(true, Ordering::Relaxed);
                }
            }
            wake.notify_one();
        });
        let worker = Worker { stop, handle, failed, dispatched };
        self.workers.lock().expect("workers").insert((batch.spec.id.clone(), index), worker);
        Ok(())
    }

    async fn stop(&self, batch: &Batch, shard: u32) -> Result<(), ExecError> {
        if let Some(worker) = self.workers.lock().expect("workers").get(&(batch.spec.id.clone(), shard)) {
            worker.stop.cancel();
        }
        Ok(())
    }

    async fn retire(&self, batch: &Batch, shard: u32) -> Result<(), ExecError> {
        self.workers.lock().expect("workers").remove(&(batch.spec.id.clone(), shard));
        Ok(())
    }

    async fn save(&self, read: &Batch, state: BatchState) -> Result<Option<Batch>, ExecError> {
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
            // The store failed (a full disk, a permission): worth trying again, not corrupt data.
            Err(error) => Err(ExecError::Storage(crate::storage::StorageError::Backend(format!(
                "cannot save batch {}: {error}",
                read.spec.id
            )))),
        }
    }

    async fn tell(&self, batch: &Batch, news: News) {
        match news {
            News::Finished => tracing::info!(
                batch = %batch.spec.id,
                status = batch.state.status.as_str(),
                completed = batch.state.request_counts.completed,
                failed = batch.state.request_counts.failed,
                "batch finished"
            ),
            News::ShardRetried { .. } | News::ShardGaveUp { .. } => {
                tracing::warn!(batch = %batch.spec.id, news = ?news, "shard worker failed")
            }
            other => tracing::debug!(batch = %batch.spec.id, news = ?other, "batch"),
        }
    }
}
