//! Lifecycle transitions requested through the API, as pure functions of the state.

use super::model::{BatchState, Status};
use crate::clock::UnixSeconds;

/// A transition the batch's status does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("batch is {}", .0.as_str())]
pub struct Refusal(pub Status);

/// `POST /v1/batches/{id}/cancel`: a running batch becomes `cancelling`; a batch
/// already cancelling stays as it is (cancel is idempotent); a terminal one refuses.
/// Returns whether the state changed.
pub fn cancel(state: &mut BatchState, now: UnixSeconds) -> Result<bool, Refusal> {
    match state.status {
        status if status.is_terminal() => Err(Refusal(status)),
        Status::Cancelling => Ok(false),
        _ => {
            state.status = Status::Cancelling;
            state.cancelling_at = Some(now);
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancel_moves_running_batches_to_cancelling_once() {
        let mut state = BatchState::in_progress(100, 3);
        assert_eq!(cancel(&mut state, 200), Ok(true));
        assert_eq!(state.status, Status::Cancelling);
        assert_eq!(state.cancelling_at, Some(200));
        assert_eq!(cancel(&mut state, 300), Ok(false), "idempotent");
        assert_eq!(state.cancelling_at, Some(200), "the first request's time stays");
    }

    #[test]
    fn cancel_on_terminal_batches_is_refused_and_changes_nothing() {
        for status in [Status::Completed, Status::Failed, Status::Expired, Status::Cancelled] {
            let mut state = BatchState::in_progress(100, 3);
            state.status = status;
            let before = state.clone();
            assert_eq!(cancel(&mut state, 200), Err(Refusal(status)));
            assert_eq!(state, before);
        }
    }
}
