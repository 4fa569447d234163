//! When an in-progress batch should be done, projected from its pace so far: the lines
//! with a record over the time since it went in progress, applied to the lines left.
//! Pure. Shown as the Batch object's `estimated_completion_at` (an extension field), in
//! the Batch resource's status and as `kubectl get batches`' ETA column.

use crate::batches::{BatchState, Status};
use crate::clock::UnixSeconds;

/// The projection for `next` (the state a pass is about to save over `previous`):
/// unchanged while no line got a record since (so that a pass that changes nothing
/// writes nothing); `None` unless in progress with a line done.
pub fn estimate(previous: &BatchState, next: &BatchState, now: UnixSeconds) -> Option<UnixSeconds> {
    if next.status != Status::InProgress {
        return None;
    }
    let done = |state: &BatchState| state.request_counts.completed + state.request_counts.failed;
    if done(next) == done(previous) && previous.estimated_completion_at.is_some() {
        return previous.estimated_completion_at;
    }
    let (done, total) = (done(next), next.request_counts.total);
    let elapsed = now - next.in_progress_at?;
    if done == 0 || elapsed <= 0 {
        return None;
    }
    let left = total.saturating_sub(done);
    let seconds = (left as f64 * elapsed as f64 / done as f64).ceil() as i64;
    Some(now + seconds)
}

/// Whether `next`'s projection passes the batch's window when `previous`'s did not:
/// worth a warning, once.
pub fn newly_late(previous: &BatchState, next: &BatchState, expires_at: UnixSeconds) -> bool {
    let late = |state: &BatchState| state.estimated_completion_at.is_some_and(|eta| eta > expires_at);
    late(next) && !late(previous)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::RequestCounts;

    fn state(done: u64, total: u64, eta: Option<i64>) -> BatchState {
        let mut state = BatchState::in_progress(1_000, total);
        state.request_counts = RequestCounts { total, completed: done, failed: 0 };
        state.estimated_completion_at = eta;
        state
    }

    #[test]
    fn the_pace_so_far_is_applied_to_the_lines_left() {
        let cases = [
            // (done before, done now, total, now, expected)
            (0, 0, 100, 1_010, None),
            (0, 10, 100, 1_010, Some(1_100)),
            (10, 50, 100, 1_100, Some(1_200)),
            (50, 100, 100, 1_200, Some(1_200)),
            (0, 3, 10, 1_000, None),
        ];
        for (before, now_done, total, now, expected) in cases {
            let previous = state(before, total, None);
            assert_eq!(
                estimate(&previous, &state(now_done, total, None), now),
                expected,
                "{now_done}/{total} at {now}"
            );
        }
        // Nothing new: the projection stays, whatever the clock.
        assert_eq!(estimate(&state(10, 100, Some(1_100)), &state(10, 100, Some(1_100)), 5_000), Some(1_100));
        // Not in progress: none.
        let mut finalizing = state(100, 100, Some(1_200));
        finalizing.status = Status::Finalizing;
        assert_eq!(estimate(&state(90, 100, Some(1_200)), &finalizing, 1_300), None);
    }

    #[test]
    fn passing_the_window_warns_once() {
        let cases = [
            (None, Some(900), false),
            (None, Some(1_100), true),
            (Some(900), Some(1_100), true),
            (Some(1_100), Some(1_200), false),
            (Some(1_100), None, false),
        ];
        for (before, after, warn) in cases {
            assert_eq!(newly_late(&state(1, 10, before), &state(2, 10, after), 1_000), warn, "{before:?} → {after:?}");
        }
    }
}
