//! The outbox: `webhooks/events/<event id>.json` for each batch that reached its terminal
//! state, written before that state is saved, and kept until every endpoint of the
//! batch's project has the event (or it is given up). A write that is repeated (a pass
//! run again after a crash) keeps what the first wrote, so deliveries never restart.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::event::Event;
use crate::batches::Status;
use crate::clock::UnixSeconds;
use crate::ids::{BatchId, ProjectId};
use crate::storage::{Key, ObjectStore, StorageError};

const PREFIX: &str = "webhooks/events/";

/// An event still to deliver, and how its delivery to each endpoint went so far.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    pub project: ProjectId,
    pub event: Event,
    /// By endpoint URL.
    #[serde(default)]
    pub deliveries: BTreeMap<String, Delivery>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    pub attempts: u32,
    /// When the next attempt is due.
    pub next_at: UnixSeconds,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<UnixSeconds>,
    /// Attempts the SSRF guard refused (the endpoint's host is internal): a setting to
    /// fix, not a failure to wait out, so it is given up after [`REFUSED_ATTEMPTS`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Refused attempts after which an endpoint is given up (the third comes 35 s after the
/// first: time for a name that resolved inward by mistake to be fixed).
pub const REFUSED_ATTEMPTS: u32 = 3;

impl Delivery {
    /// Whether nothing more will be sent: delivered, or given up as refused.
    pub fn is_closed(&self) -> bool {
        self.delivered_at.is_some() || self.refused >= REFUSED_ATTEMPTS
    }

    pub fn is_due(&self, now: UnixSeconds) -> bool {
        !self.is_closed() && self.next_at <= now
    }
}

/// Seconds before the next attempt after `attempts` failed ones: 5 s, 30 s, 2 min,
/// 10 min, 30 min, then hourly.
pub fn backoff(attempts: u32) -> i64 {
    match attempts {
        0 | 1 => 5,
        2 => 30,
        3 => 120,
        4 => 600,
        5 => 1800,
        _ => 3600,
    }
}

fn key(event: &Event) -> Key {
    Key::from_segments(&["webhooks", "events", &format!("{}.json", event.id)])
}

/// Notes the event of `batch` reaching `status` (nothing for a status that is not
/// terminal).
pub async fn announce(
    store: &dyn ObjectStore,
    project: &ProjectId,
    batch: &BatchId,
    status: Status,
    now: UnixSeconds,
) -> Result<(), StorageError> {
    let Some(event) = Event::for_batch(batch, status, now) else { return Ok(()) };
    let pending = Pending { project: project.clone(), event, deliveries: BTreeMap::new() };
    let json = serde_json::to_vec(&pending).expect("events serialize");
    store.create_exclusive(&key(&pending.event), Bytes::from(json)).await.map(drop)
}

/// Every event still to deliver (an unreadable record is skipped, and said).
pub async fn pending(store: &dyn ObjectStore) -> Result<Vec<Pending>, StorageError> {
    let mut all = Vec::new();
    for key in store.list(PREFIX).await? {
        match store.get(&key).await {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(pending) => all.push(pending),
                Err(error) => tracing::warn!(%key, %error, "skipping an unreadable webhook event"),
            },
            Err(StorageError::NotFound(_)) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(all)
}

pub async fn save(store: &dyn ObjectStore, pending: &Pending) -> Result<(), StorageError> {
    store.put(&key(&pending.event), Bytes::from(serde_json::to_vec(pending).expect("events serialize"))).await
}

pub async fn remove(store: &dyn ObjectStore, pending: &Pending) -> Result<(), StorageError> {
    store.delete(&key(&pending.event)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_hourly() {
        let waits: Vec<i64> = (1..=8).map(backoff).collect();
        assert_eq!(waits, [5, 30, 120, 600, 1800, 3600, 3600, 3600]);
    }

    #[test]
    fn a_refused_endpoint_is_closed_after_a_few_attempts() {
        let mut delivery = Delivery::default();
        for _ in 1..REFUSED_ATTEMPTS {
            delivery.refused += 1;
            assert!(!delivery.is_closed());
        }
        delivery.refused += 1;
        assert!(delivery.is_closed() && !delivery.is_due(i64::MAX));
    }

    #[test]
    fn a_delivery_is_due_until_delivered_from_its_next_time() {
        let mut delivery = Delivery { attempts: 1, next_at: 100, ..Delivery::default() };
        assert!(!delivery.is_due(99));
        assert!(delivery.is_due(100));
        delivery.delivered_at = Some(100);
        assert!(!delivery.is_due(1_000));
    }
}
