//! OpenAI's webhook event for a batch: `{"id", "object": "event", "created_at", "type",
//! "data": {"id"}}`.

use serde::{Deserialize, Serialize};

use crate::batches::Status;
use crate::clock::UnixSeconds;
use crate::ids::BatchId;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// `evt_…`, the same on every delivery of the event: receivers deduplicate by it (it
    /// is also the `webhook-id` header).
    pub id: String,
    pub object: String,
    pub created_at: UnixSeconds,
    #[serde(rename = "type")]
    pub kind: String,
    pub data: EventData,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventData {
    pub id: String,
}

/// The event type of a terminal status; `None` for the others.
pub fn event_type(status: Status) -> Option<&'static str> {
    match status {
        Status::Completed => Some("batch.completed"),
        Status::Failed => Some("batch.failed"),
        Status::Cancelled => Some("batch.cancelled"),
        Status::Expired => Some("batch.expired"),
        _ => None,
    }
}

impl Event {
    /// The event of `batch` reaching `status`, if that is terminal. A batch reaches one
    /// terminal status once, so its id makes the event's.
    pub fn for_batch(batch: &BatchId, status: Status, now: UnixSeconds) -> Option<Self> {
        let kind = event_type(status)?;
        Some(Self {
            id: format!("evt_{}", &batch.as_str()[BatchId::PREFIX.len()..]),
            object: "event".into(),
            created_at: now,
            kind: kind.into(),
            data: EventData { id: batch.to_string() },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_status_makes_openais_event_and_no_other_does() {
        let batch = BatchId::parse("batch_01JABCDEF").unwrap();
        let event = Event::for_batch(&batch, Status::Completed, 1_700_000_000).unwrap();
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            serde_json::json!({"id": "evt_01JABCDEF", "object": "event", "created_at": 1_700_000_000,
                "type": "batch.completed", "data": {"id": "batch_01JABCDEF"}})
        );
        for (status, kind) in [
            (Status::Failed, "batch.failed"),
            (Status::Cancelled, "batch.cancelled"),
            (Status::Expired, "batch.expired"),
        ] {
            assert_eq!(Event::for_batch(&batch, status, 1).unwrap().kind, kind);
        }
        for status in [Status::Validating, Status::InProgress, Status::Finalizing, Status::Cancelling] {
            assert_eq!(Event::for_batch(&batch, status, 1), None);
        }
    }
}
