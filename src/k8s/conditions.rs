//! A Batch's `status.conditions`, as kubectl users expect them: `Complete` once the batch
//! completed, `Failed` once it failed, expired or was cancelled (the reason says which),
//! so that `kubectl wait --for=condition=Complete batch/NAME` works. Pure: derived from the
//! state each time a status is written. Conditions of other types (`CapacityReady`, set by
//! `super::scaling`) pass through as the state has them.

use crate::batches::{BatchState, Condition, Status};
use crate::clock::UnixSeconds;

/// The conditions of `state`, keeping each one's transition time from `previous` while its
/// status stays the same; then `state`'s conditions of other types, as they are.
pub fn conditions(
    state: &BatchState,
    previous: &[Condition],
    generation: Option<i64>,
    now: UnixSeconds,
) -> Vec<Condition> {
    let counts = state.request_counts;
    let reason = pascal(state.status.as_str());
    let ended = match state.status {
        Status::Completed => {
            Some(("Complete", format!("{} completed, {} failed of {}", counts.completed, counts.failed, counts.total)))
        }
        Status::Failed => Some(("Failed", state.errors.first().map(|e| e.message.clone()).unwrap_or_default())),
        Status::Expired => Some((
            "Failed",
            format!(
                "the completion window elapsed: {} of {} lines ran",
                counts.completed + counts.failed,
                counts.total
            ),
        )),
        Status::Cancelled => {
            Some(("Failed", format!("cancelled: {} of {} lines ran", counts.completed + counts.failed, counts.total)))
        }
        _ => None,
    };
    DERIVED
        .into_iter()
        .map(|type_| {
            let message = ended.as_ref().filter(|(holds, _)| *holds == type_).map(|(_, message)| message.clone());
            let status = if message.is_some() { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|c| c.type_ == type_ && c.status == status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| rfc3339(now));
            Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.clone(),
                message: message.unwrap_or_default(),
                last_transition_time: since,
                observed_generation: generation,
            }
        })
        .chain(state.conditions.iter().filter(|c| !DERIVED.contains(&c.type_.as_str())).cloned())
        .collect()
}

/// The condition types derived from the state here.
const DERIVED: [&str; 2] = ["Complete", "Failed"];

/// `state` as it is written to a Batch whose status was `previous`: with its conditions and
/// its progress (for `kubectl get batches`).
pub fn kubernetes_status(state: &BatchState, previous: Option<&BatchState>, generation: Option<i64>) -> BatchState {
    let previous = previous.map(|p| p.conditions.as_slice()).unwrap_or_default();
    BatchState {
        conditions: conditions(state, previous, generation, crate::clock::now()),
        progress: progress(state),
        eta: state.estimated_completion_at.map(rfc3339).unwrap_or_default(),
        ..state.clone()
    }
}

/// The share of lines with a record, as a whole percentage: `0%` … `100%`.
pub fn progress(state: &BatchState) -> String {
    let counts = state.request_counts;
    let done = counts.completed + counts.failed;
    let percent = (done.min(counts.total) * 100).checked_div(counts.total).unwrap_or(0);
    format!("{percent}%")
}

/// `in_progress` → `InProgress`.
fn pascal(snake: &str) -> String {
    snake.split('_').map(|word| word[..1].to_ascii_uppercase() + &word[1..]).collect()
}

pub fn rfc3339(at: UnixSeconds) -> String {
    k8s_openapi::jiff::Timestamp::from_second(at).map(|t| t.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::BatchError;

    fn of(conditions: &[Condition], type_: &str) -> Condition {
        conditions.iter().find(|c| c.type_ == type_).cloned().expect(type_)
    }

    #[test]
    fn progress_is_the_share_of_lines_with_a_record() {
        let mut state = BatchState::in_progress(1, 3);
        assert_eq!(progress(&state), "0%");
        state.request_counts.completed = 1;
        assert_eq!(progress(&state), "33%", "rounded down: 100% only when every line has one");
        state.request_counts.failed = 2;
        assert_eq!(progress(&state), "100%");
        assert_eq!(progress(&BatchState::failed(1, Vec::new())), "0%", "no lines");
    }

    #[test]
    fn complete_and_failed_follow_the_status() {
        #[rustfmt::skip]
        let table = [
            (Status::InProgress, "False", "False", "InProgress"),
            (Status::Finalizing, "False", "False", "Finalizing"),
            (Status::Cancelling, "False", "False", "Cancelling"),
            (Status::Completed,  "True",  "False", "Completed"),
            (Status::Failed,     "False", "True",  "Failed"),
            (Status::Expired,    "False", "True",  "Expired"),
            (Status::Cancelled,  "False", "True",  "Cancelled"),
        ];
        for (status, complete, failed, reason) in table {
            let mut state = BatchState::in_progress(1, 4);
            state.status = status;
            let conditions = conditions(&state, &[], Some(2), 100);
            assert_eq!(of(&conditions, "Complete").status, complete, "{status:?}");
            assert_eq!(of(&conditions, "Failed").status, failed, "{status:?}");
            assert_eq!(of(&conditions, "Failed").reason, reason, "{status:?}");
            assert_eq!(of(&conditions, "Complete").observed_generation, Some(2));
        }
    }

    #[test]
    fn a_refused_batch_says_why_and_times_are_kept_until_a_status_changes() {
        let state = BatchState::failed(
            5,
            vec![BatchError {
                code: "invalid_request_error".into(),
                message: "Line 3 is not valid JSON".into(),
                line: Some(3),
                param: None,
            }],
        );
        let first = conditions(&state, &[], None, 1_800_000_000);
        assert_eq!(of(&first, "Failed").message, "Line 3 is not valid JSON");
        assert_eq!(of(&first, "Failed").last_transition_time, "2027-01-15T08:00:00Z");
        let again = conditions(&state, &first, None, 1_800_000_999);
        assert_eq!(again, first, "nothing changed, nothing moves");
        let mut completed = BatchState::in_progress(1, 1);
        completed.status = Status::Completed;
        let after = conditions(&completed, &first, None, 1_800_000_999);
        assert_ne!(of(&after, "Failed").last_transition_time, of(&first, "Failed").last_transition_time);
    }

    #[test]
    fn conditions_of_other_types_pass_through() {
        let mut state = BatchState::in_progress(1, 4);
        let capacity = Condition {
            type_: "CapacityReady".into(),
            status: "False".into(),
            reason: "WaitingForReplica".into(),
            message: "no replica ready".into(),
            last_transition_time: "2027-01-15T08:00:00Z".into(),
            observed_generation: None,
        };
        state.conditions = conditions(&state, &[], None, 100);
        state.conditions.push(capacity.clone());
        let written = conditions(&state, &state.conditions, None, 200);
        assert_eq!(written.len(), 3);
        assert_eq!(of(&written, "CapacityReady"), capacity);
        assert_eq!(written.iter().filter(|c| c.type_ == "Complete").count(), 1, "derived ones are not doubled");
    }
}
