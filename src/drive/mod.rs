//! One batch driver for both runtimes: observe → decide → act, written once.
//!
//! A pass over one batch reads which workers its runtime knows of (before the shards'
//! checkpoints: a worker that ends in between is then seen as running, never as stopped
//! with its last chunk unseen), loads the checkpoints, asks [`crate::lifecycle::decide::decide`]
//! what comes next, saves the new state, and acts: starts or stops workers as
//! [`crate::lifecycle::workers::plan`] says, drains, or finalizes.
//!
//! What differs between the runtimes is behind [`Runtime`]: `nightshift serve` runs
//! workers as tasks and saves to its embedded store (`crate::serve_runtime`); the controller
//! runs them as Jobs and saves to the Batch's status (`crate::k8s::controller`).

pub mod create;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use async_trait::async_trait;

use crate::batches::{Batch, BatchState, Ending, ReservedFiles, Status};
use crate::clock;
use crate::exec::checkpoint::ShardLedger;
use crate::exec::drain::drain_shard;
use crate::exec::finalize::finalize;
use crate::exec::{ExecContext, ExecError, failure};
use crate::ids::FileId;
use crate::lifecycle::decide::{Action, ShardProgress, decide, finalize_failing, finished};
pub use crate::lifecycle::workers::{WorkerPhase, WorkerPlan};
use crate::lifecycle::{eta, workers as worker_plan};
use crate::validate::Shard;
use crate::webhooks;

/// What a runtime does that the driver can't: know, start and stop workers, and save.
#[async_trait]
pub trait Runtime: Send + Sync {
    type Error: From<ExecError> + Send;

    /// The workers of `batch` that the runtime knows of, by shard.
    async fn workers(&self, batch: &Batch) -> Result<BTreeMap<u32, WorkerPhase>, Self::Error>;
    /// How many more workers of `batch` may start now (`None`: no bound).
    fn free_slots(&self, batch: &Batch) -> Option<usize>;
    /// Starts a worker for `shard`.
    async fn start(&self, batch: &Batch, shard: &Shard) -> Result<(), Self::Error>;
    /// Tells the worker of `shard` to stop dispatching (it commits what it has, then exits).
    async fn stop(&self, batch: &Batch, shard: u32) -> Result<(), Self::Error>;
    /// Removes the failed worker of `shard`, so that the shard can start afresh.
    async fn retire(&self, batch: &Batch, shard: u32) -> Result<(), Self::Error>;
    /// Saves `state` unless the batch moved on since `read` (a cancel came in); returns
    /// the batch as saved, or `None` when it moved on.
    async fn save(&self, read: &Batch, state: BatchState) -> Result<Option<Batch>, Self::Error>;
    /// Something an operator may want to see (an Event on Kubernetes, a log line in serve).
    async fn tell(&self, batch: &Batch, news: News);
    /// The shards' checkpoints as this pass read them (for metrics kept from them).
    fn observed(&self, _batch: &Batch, _ledgers: &[ShardLedger]) {}
}

/// What the driver reports as it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum News {
    StatusChanged {
        from: Status,
        to: Status,
    },
    /// A failed worker was retired; its shard starts again.
    ShardRetried {
        shard: u32,
        failures: u32,
    },
    /// A shard's worker failed past the retry budget: its lines without a record failed.
    ShardGaveUp {
        shard: u32,
        failures: u32,
    },
    /// At its pace so far, the batch would end after its window (at `eta`).
    WillMissWindow {
        eta: crate::clock::UnixSeconds,
    },
    /// Workers were told to stop.
    Stopping,
    /// The batch reached its terminal state.
    Finished,
}

/// When the batch wants another pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Something changed that the next pass acts on: at once.
    Now,
    /// Workers are stopping: shortly.
    Shortly,
    /// Workers run, or the batch waits: at the runtime's usual pace (and at expiry).
    AtPace,
    /// Terminal: never again.
    Done,
}

/// One pass over `batch`.
pub async fn drive<R: Runtime>(runtime: &R, exec: &ExecContext, batch: Batch) -> Result<Next, R::Error> {
    if batch.state.status.is_terminal() {
        return Ok(Next::Done);
    }
    // Observe: workers first, then checkpoints.
    let workers = runtime.workers(&batch).await?;
    let ledgers = ledgers(exec, &batch).await?;
    runtime.observed(&batch, &ledgers);
    let running: BTreeSet<u32> =
        workers.iter().filter(|(_, phase)| **phase == WorkerPhase::Running).map(|(shard, _)| *shard).collect();

    // Decide.
    let decision = decide(&batch, &progress(&batch, &ledgers), &running, clock::now());
    exec.quota.observe(&batch.spec.project_id, &batch.spec.id, decision.state.usage.total_tokens);
    let from = batch.state.status;
    let late = eta::newly_late(&batch.state, &decision.state, batch.spec.expires_at);
    let Some(batch) = save_if_changed(runtime, batch, decision.state).await? else { return Ok(Next::Now) };
    if batch.state.status != from {
        runtime.tell(&batch, News::StatusChanged { from, to: batch.state.status }).await;
    }
    if let Some(eta) = batch.state.estimated_completion_at.filter(|_| late) {
        runtime.tell(&batch, News::WillMissWindow { eta }).await;
    }

    // Act.
    let work = worker_plan::plan(&decision.action, &workers, runtime.free_slots(&batch));
    let batch = match retire_failed(runtime, exec, batch, &work.retire).await? {
        Some(batch) => batch,
        None => return Ok(Next::Now),
    };
    let exhausted = give_up_exhausted(exec, &batch, &ledgers, &running).await?;
    for index in work.start.iter().filter(|shard| !exhausted.contains(shard)) {
        if let Some(shard) = batch.spec.plan.shards.iter().find(|s| s.index == *index) {
            runtime.start(&batch, shard).await?;
        }
    }
    for &shard in &work.stop {
        runtime.stop(&batch, shard).await?;
    }
    match decision.action {
        Action::Wait | Action::Run(_) => Ok(Next::AtPace),
        Action::Stop => {
            runtime.tell(&batch, News::Stopping).await;
            Ok(Next::Shortly)
        }
        Action::Drain(ending) => {
            let reason = if ending == Ending::Expired { failure::expired() } else { failure::cancelled() };
            for (shard, ledger) in batch.spec.plan.shards.iter().zip(&ledgers) {
                drain_shard(exec, &batch.spec, shard, ledger, &reason).await?;
            }
            Ok(Next::Now)
        }
        Action::Finalize(ending) => finalize_batch(runtime, exec, batch, &ledgers, ending).await,
    }
}

/// Counts the failed workers' failures, then retires them: a shard within its budget
/// starts again on a later pass; a shard past it is given up ([`give_up_exhausted`]).
/// The counts are saved first: a save that conflicts retires nothing (the next pass
/// counts again from fresh state), and a crash after it leaves a failed worker of an
/// earlier attempt, which runtimes no longer report. Returns the batch as saved.
async fn retire_failed<R: Runtime>(
    runtime: &R,
    exec: &ExecContext,
    batch: Batch,
    failed: &[u32],
) -> Result<Option<Batch>, R::Error> {
    if failed.is_empty() {
        return Ok(Some(batch));
    }
    let budgeted = worker_plan::budget(failed, &batch.state.shard_failures, exec.settings.max_shard_retries);
    let mut state = batch.state.clone();
    state.shard_failures = budgeted.failures.clone();
    let Some(batch) = runtime.save(&batch, state).await? else { return Ok(None) };
    for &shard in failed {
        runtime.retire(&batch, shard).await?;
    }
    for &shard in &budgeted.retry {
        runtime.tell(&batch, News::ShardRetried { shard, failures: budgeted.failures[&shard] }).await;
    }
    for &shard in &budgeted.give_up {
        runtime.tell(&batch, News::ShardGaveUp { shard, failures: budgeted.failures[&shard] }).await;
    }
    Ok(Some(batch))
}

/// Gives every line without a record of a shard past its retry budget its failure record.
/// Idempotent: a pass after a crash gives up what the last one could not. Returns the
/// shards given up, which must not start again.
async fn give_up_exhausted(
    exec: &ExecContext,
    batch: &Batch,
    ledgers: &[ShardLedger],
    running: &BTreeSet<u32>,
) -> Result<BTreeSet<u32>, ExecError> {
    let max = exec.settings.max_shard_retries;
    let mut exhausted = BTreeSet::new();
    for (shard, ledger) in batch.spec.plan.shards.iter().zip(ledgers) {
        let Some(&runs) = batch.state.shard_failures.get(&shard.index).filter(|runs| **runs > max) else { continue };
        exhausted.insert(shard.index);
        if !ledger.is_complete() && !running.contains(&shard.index) {
            drain_shard(exec, &batch.spec, shard, ledger, &failure::shard_failed(runs)).await?;
        }
    }
    Ok(exhausted)
}

/// Writes the output and error files, then the terminal state.
async fn finalize_batch<R: Runtime>(
    runtime: &R,
    exec: &ExecContext,
    batch: Batch,
    ledgers: &[ShardLedger],
    ending: Ending,
) -> Result<Next, R::Error> {
    // The files' ids are reserved durably first, so a finalize run again writes the same files.
    let batch = match batch.state.reserved_files {
        Some(_) => batch,
        None => {
            let mut state = batch.state.clone();
            state.reserved_files = Some(ReservedFiles { output: FileId::generate(), error: FileId::generate() });
            match runtime.save(&batch, state).await? {
                Some(batch) => batch,
                None => return Ok(Next::Now),
            }
        }
    };
    let reserved = batch.state.reserved_files.clone().expect("reserved above");
    let files = match finalize(exec, &batch.spec, ledgers, &reserved).await {
        Ok(files) => files,
        Err(error) => {
            // Said on the batch, so a client sees why it stays `finalizing`; the save may
            // fail as well (the same full disk), and the next pass tries both again.
            let noted = finalize_failing(&batch.state, &error.to_string());
            if noted != batch.state && runtime.save(&batch, noted).await.is_err() {
                tracing::warn!(batch = %batch.spec.id, "could not note the finalize failure on the batch either");
            }
            return Err(error.into());
        }
    };
    let state = finished(&batch.state, ending, &files, clock::now());
    // The webhook event first: a crash before the save below announces it again, the same.
    webhooks::outbox::announce(exec.store.as_ref(), &batch.spec.project_id, &batch.spec.id, state.status, clock::now())
        .await
        .map_err(ExecError::from)?;
    let from = batch.state.status;
    let Some(done) = runtime.save(&batch, state).await? else { return Ok(Next::Now) };
    runtime.tell(&done, News::StatusChanged { from, to: done.state.status }).await;
    runtime.tell(&done, News::Finished).await;
    exec.checkpoints.forget(&done.spec.id);
    Ok(Next::Done)
}

async fn save_if_changed<R: Runtime>(runtime: &R, read: Batch, state: BatchState) -> Result<Option<Batch>, R::Error> {
    if state == read.state { Ok(Some(read)) } else { runtime.save(&read, state).await }
}

/// Every shard's ledger, in plan order.
async fn ledgers(exec: &ExecContext, batch: &Batch) -> Result<Vec<ShardLedger>, ExecError> {
    let mut ledgers = Vec::with_capacity(batch.spec.plan.shards.len());
    for shard in &batch.spec.plan.shards {
        ledgers.push(exec.checkpoints.ledger(exec.store.as_ref(), &batch.spec.id, shard.index, shard.requests).await?);
    }
    Ok(ledgers)
}

fn progress(batch: &Batch, ledgers: &[ShardLedger]) -> Vec<ShardProgress> {
    batch
        .spec
        .plan
        .shards
        .iter()
        .zip(ledgers)
        .map(|(shard, ledger)| ShardProgress {
            requests: shard.requests,
            completed: ledger.completed,
            failed: ledger.failed,
            usage: ledger.usage,
        })
        .collect()
}
