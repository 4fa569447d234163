//! What should happen next to a batch, decided from its document, its shards'
//! committed progress and the clock. Pure: the embedded loop and the Kubernetes
//! controller both act on these decisions.

use std::collections::BTreeSet;

use crate::batches::{Batch, BatchError, BatchSpec, BatchState, Ending, RequestCounts, Status, Usage};
use crate::clock::UnixSeconds;
use crate::exec::finalize::Finalized;

/// One shard's committed progress, as its checkpoints add up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardProgress {
    pub requests: u64,
    pub completed: u64,
    pub failed: u64,
    pub usage: Usage,
}

impl ShardProgress {
    pub fn is_complete(&self) -> bool {
        self.completed + self.failed >= self.requests
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing to do until something changes.
    Wait,
    /// Start workers for these shards (by index).
    Run(Vec<u32>),
    /// Running workers must stop dispatching; wait for them to exit.
    Stop,
    /// Workers have stopped: give every request without a record the ending's record.
    Drain(Ending),
    /// Every request has a record: write the files, then end the batch so.
    Finalize(Ending),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The batch's state with live counts and any transition applied.
    pub state: BatchState,
    pub action: Action,
}

/// Decides the next step for `batch`, given each shard's progress (in plan order),
/// which shards have a worker running, and the time.
pub fn decide(batch: &Batch, shards: &[ShardProgress], running: &BTreeSet<u32>, now: UnixSeconds) -> Decision {
    let mut state = batch.state.clone();
    if state.status.is_terminal() || state.status == Status::Validating {
        return Decision { state, action: Action::Wait };
    }
    state.request_counts = RequestCounts {
        total: state.request_counts.total,
        completed: shards.iter().map(|s| s.completed).sum(),
        failed: shards.iter().map(|s| s.failed).sum(),
    };
    state.usage = shards.iter().fold(Usage::default(), |mut sum, s| {
        sum += s.usage;
        sum
    });
    let all_recorded = shards.iter().all(ShardProgress::is_complete);

    let action = match state.status {
        Status::Finalizing => Action::Finalize(Ending::Completed),
        Status::Cancelling => wind_down(Ending::Cancelled, all_recorded, running),
        Status::InProgress => {
            if all_recorded {
                match state.ending {
                    Some(ending) => Action::Finalize(ending),
                    None => {
                        state.status = Status::Finalizing;
                        state.finalizing_at = Some(now);
                        Action::Finalize(Ending::Completed)
                    }
                }
            } else if now >= batch.spec.expires_at || state.ending == Some(Ending::Expired) {
                state.ending = Some(Ending::Expired);
                wind_down(Ending::Expired, all_recorded, running)
            } else {
                let idle: Vec<u32> = batch
                    .spec
                    .plan
                    .shards
                    .iter()
                    .zip(shards)
                    .filter(|(shard, progress)| !progress.is_complete() && !running.contains(&shard.index))
                    .map(|(shard, _)| shard.index)
                    .collect();
                if idle.is_empty() { Action::Wait } else { Action::Run(idle) }
            }
        }
        _ => Action::Wait,
    };
    // Only a batch that runs to the end of its lines has one (not one winding down).
    state.estimated_completion_at = match state.ending {
        None => crate::lifecycle::eta::estimate(&batch.state, &state, now),
        Some(_) => None,
    };
    Decision { state, action }
}

fn wind_down(ending: Ending, all_recorded: bool, running: &BTreeSet<u32>) -> Action {
    if all_recorded {
        Action::Finalize(ending)
    } else if !running.is_empty() {
        Action::Stop
    } else {
        Action::Drain(ending)
    }
}

/// The `code` of the error a Batch gets when its validation result was lost.
pub const VALIDATION_INTERRUPTED: &str = "validation_interrupted";

/// The state of a Batch whose api stopped between creating it and writing its first
/// status, rebuilt from its spec: the api records a shard plan only for an input that
/// passed validation (an empty input does not), so a plan means in progress, and no plan
/// means refused, with an error that says the reason was lost.
pub fn recovered_state(spec: &BatchSpec, now: UnixSeconds) -> BatchState {
    if spec.plan.shards.is_empty() {
        let error = BatchError {
            code: VALIDATION_INTERRUPTED.into(),
            message: "The API stopped before it recorded why this batch's input was refused; create the batch \
                      again to see the reason"
                .into(),
            line: None,
            param: None,
        };
        BatchState::failed(now, vec![error])
    } else {
        BatchState::in_progress(now, spec.plan.shards.iter().map(|s| s.requests).sum())
    }
}

/// The terminal state once finalize wrote the files.
pub fn finished(state: &BatchState, ending: Ending, files: &Finalized, now: UnixSeconds) -> BatchState {
    let mut state = state.clone();
    state.output_file_id = files.output_file_id.clone();
    state.error_file_id = files.error_file_id.clone();
    state.request_counts = files.counts;
    state.reserved_files = None;
    state.ending = None;
    // The note of a finalize that failed before ([`finalize_failing`]) is gone with it.
    state.errors.clear();
    match ending {
        Ending::Completed => {
            state.status = Status::Completed;
            state.completed_at = Some(now);
        }
        Ending::Cancelled => {
            state.status = Status::Cancelled;
            state.cancelled_at = Some(now);
        }
        Ending::Expired => {
            state.status = Status::Expired;
            state.expired_at = Some(now);
        }
    }
    state
}

/// The state of a batch whose output files could not be written (a full disk, storage
/// that refuses writes): still `finalizing`, and retried, with the cause in `errors` as a
/// `storage_error`, so that a client sees why it takes long. Cleared when it finishes.
pub fn finalize_failing(state: &BatchState, cause: &str) -> BatchState {
    let mut state = state.clone();
    state.errors = vec![BatchError {
        code: "storage_error".into(),
        message: format!("Writing the output files failed; retrying until storage accepts them: {cause}"),
        line: None,
        param: None,
    }];
    state
}

/// How long a finished batch's resource still lives under `ttlSecondsAfterFinished`
/// (as a Job's): `None` once it is due for deletion.
pub fn time_to_live(finished_at: UnixSeconds, ttl: i64, now: UnixSeconds) -> Option<std::time::Duration> {
    let due = finished_at.saturating_add(ttl.max(0));
    (now < due).then(|| std::time::Duration::from_secs((due - now) as u64))
}
