//! What can go wrong in a pass of the controller, and whether trying again can help.

use crate::exec::ExecError;
use crate::storage::StorageError;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// Not an error: a step waits for something to finish (Jobs to go away).
    #[error("waiting: {0}")]
    Waiting(&'static str),
}

impl ControllerError {
    /// The metric's label for this failure (`None`: a step that waits, not a failure).
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            ControllerError::Kube(_) => Some("kube"),
            ControllerError::Exec(_) => Some("exec"),
            ControllerError::Storage(_) => Some("storage"),
            ControllerError::Finalizer(_) => Some("finalizer"),
            ControllerError::Waiting(_) => None,
        }
    }

    /// Whether trying again later can help. Corrupt data (a shard's checkpoints, a file
    /// record) stays corrupt until someone changes something: such a Batch is not
    /// requeued but waits for a change.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            ControllerError::Exec(ExecError::Corrupt(_) | ExecError::Storage(StorageError::Corrupt(_)))
                | ControllerError::Storage(StorageError::Corrupt(_))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_a_retry_cannot_mend_is_permanent() {
        let storage = StorageError::NotFound("k".into());
        assert!(ControllerError::Exec(ExecError::Corrupt("bad checkpoint".into())).is_permanent());
        let record = || StorageError::Corrupt("unreadable file record".into());
        assert!(ControllerError::Exec(ExecError::Storage(record())).is_permanent(), "a corrupt file record");
        assert!(ControllerError::Storage(record()).is_permanent());
        assert!(!ControllerError::Exec(ExecError::Storage(storage)).is_permanent());
        assert!(!ControllerError::Waiting("jobs").is_permanent());
        assert!(!ControllerError::Finalizer("conflict".into()).is_permanent());
    }
}
