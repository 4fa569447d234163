use super::*;
use crate::batches::{BatchSpec, BatchState};
use crate::ids::FileId;
use crate::validate::ShardPlan;

fn batch(shards: &[u64], status: Status) -> Batch {
    let spec = BatchSpec::sample(ShardPlan::of_sizes(shards), 100, 1000);
    let mut state = BatchState::in_progress(100, shards.iter().sum());
    state.status = status;
    Batch { spec, state }
}

fn progress(requests: u64, completed: u64, failed: u64) -> ShardProgress {
    ShardProgress {
        requests,
        completed,
        failed,
        usage: Usage { input_tokens: completed, output_tokens: 1, total_tokens: completed + 1, ..Usage::default() },
    }
}

fn running(shards: &[u32]) -> BTreeSet<u32> {
    shards.iter().copied().collect()
}

#[test]
fn idle_unfinished_shards_are_started_and_counts_are_live() {
    let batch = batch(&[10, 10, 5], Status::InProgress);
    let shards = [progress(10, 10, 0), progress(10, 3, 1), progress(5, 0, 0)];
    let decision = decide(&batch, &shards, &running(&[1]), 200);
    assert_eq!(decision.action, Action::Run(vec![2]));
    assert_eq!(decision.state.request_counts, RequestCounts { total: 25, completed: 13, failed: 1 });
    assert_eq!(decision.state.usage.total_tokens, 10 + 1 + 3 + 1 + 1);
    assert_eq!(decision.state.status, Status::InProgress);
    let all_running = decide(&batch, &shards, &running(&[1, 2]), 200);
    assert_eq!(all_running.action, Action::Wait);
}

#[test]
fn a_batch_whose_lines_all_have_records_finalizes_as_completed() {
    let batch = batch(&[10, 5], Status::InProgress);
    let decision = decide(&batch, &[progress(10, 9, 1), progress(5, 5, 0)], &running(&[]), 300);
    assert_eq!(decision.action, Action::Finalize(Ending::Completed));
    assert_eq!(decision.state.status, Status::Finalizing);
    assert_eq!(decision.state.finalizing_at, Some(300));
    // A crash during finalize: the next decision finalizes again.
    let resumed = Batch { state: decision.state, ..batch };
    assert_eq!(
        decide(&resumed, &[progress(10, 9, 1), progress(5, 5, 0)], &running(&[]), 400).action,
        Action::Finalize(Ending::Completed)
    );
}

#[test]
fn cancelling_stops_workers_then_drains_then_finalizes_as_cancelled() {
    let batch = batch(&[10, 10], Status::Cancelling);
    let partial = [progress(10, 4, 0), progress(10, 0, 0)];
    assert_eq!(decide(&batch, &partial, &running(&[0, 1]), 200).action, Action::Stop);
    assert_eq!(decide(&batch, &partial, &running(&[]), 200).action, Action::Drain(Ending::Cancelled));
    let drained = [progress(10, 4, 6), progress(10, 0, 10)];
    let decision = decide(&batch, &drained, &running(&[]), 200);
    assert_eq!(decision.action, Action::Finalize(Ending::Cancelled));
    assert_eq!(decision.state.status, Status::Cancelling, "cancelling goes straight to cancelled");
}

#[test]
fn expiry_stops_dispatch_drains_and_ends_expired_even_once_all_lines_have_records() {
    let batch = batch(&[10], Status::InProgress);
    let partial = [progress(10, 4, 0)];
    let decision = decide(&batch, &partial, &running(&[0]), 1000);
    assert_eq!(decision.action, Action::Stop);
    assert_eq!(decision.state.ending, Some(Ending::Expired));
    let expiring = Batch { state: decision.state, ..batch.clone() };
    assert_eq!(decide(&expiring, &partial, &running(&[]), 1001).action, Action::Drain(Ending::Expired));
    let drained = decide(&expiring, &[progress(10, 4, 6)], &running(&[]), 1002);
    assert_eq!(drained.action, Action::Finalize(Ending::Expired));
    // Finishing every line just in time is a completion, not an expiry.
    let done = decide(&batch, &[progress(10, 10, 0)], &running(&[]), 1000);
    assert_eq!(done.action, Action::Finalize(Ending::Completed));
}

#[test]
fn terminal_batches_are_left_alone() {
    for status in [Status::Completed, Status::Failed, Status::Expired, Status::Cancelled] {
        let batch = batch(&[10], status);
        let decision = decide(&batch, &[progress(10, 0, 0)], &running(&[]), 5000);
        assert_eq!(decision.action, Action::Wait);
        assert_eq!(decision.state, batch.state, "terminal states never change");
    }
}

#[test]
fn finishing_sets_the_files_counts_and_the_endings_timestamp() {
    let batch = batch(&[3], Status::Finalizing);
    let files = Finalized {
        output_file_id: Some(FileId::generate()),
        error_file_id: None,
        counts: RequestCounts { total: 3, completed: 3, failed: 0 },
    };
    let done = finished(&batch.state, Ending::Completed, &files, 500);
    assert_eq!((done.status, done.completed_at), (Status::Completed, Some(500)));
    assert_eq!(done.output_file_id, files.output_file_id);
    assert_eq!(done.request_counts.completed + done.request_counts.failed, done.request_counts.total);
    let cancelled = finished(&batch.state, Ending::Cancelled, &files, 501);
    assert_eq!((cancelled.status, cancelled.cancelled_at), (Status::Cancelled, Some(501)));
    let expired = finished(&batch.state, Ending::Expired, &files, 502);
    assert_eq!((expired.status, expired.expired_at), (Status::Expired, Some(502)));
}

#[test]
fn a_batch_whose_first_status_was_lost_is_rebuilt_from_its_plan() {
    let planned = batch(&[3, 2], Status::InProgress).spec;
    let state = recovered_state(&planned, 500);
    assert_eq!(state.status, Status::InProgress);
    assert_eq!(state.in_progress_at, Some(500));
    assert_eq!(state.request_counts, RequestCounts { total: 5, completed: 0, failed: 0 });

    let mut refused = planned;
    refused.plan = ShardPlan::default();
    let state = recovered_state(&refused, 500);
    assert_eq!(state.status, Status::Failed);
    assert_eq!(state.failed_at, Some(500));
    assert_eq!(state.errors.len(), 1);
    assert_eq!(state.errors[0].code, VALIDATION_INTERRUPTED);
    assert!(state.errors[0].message.contains("create the batch again"), "{}", state.errors[0].message);
}

#[test]
fn a_finished_batch_lives_its_ttl_then_is_due() {
    use std::time::Duration;
    assert_eq!(time_to_live(1_000, 60, 1_000), Some(Duration::from_secs(60)));
    assert_eq!(time_to_live(1_000, 60, 1_059), Some(Duration::from_secs(1)));
    assert_eq!(time_to_live(1_000, 60, 1_060), None);
    assert_eq!(time_to_live(1_000, 0, 1_000), None, "0: deleted as soon as it finished");
    assert_eq!(time_to_live(1_000, -5, 990), Some(Duration::from_secs(10)), "a negative ttl counts as 0");
    assert!(time_to_live(1_000, i64::MAX, 2_000).is_some(), "no overflow");
}
