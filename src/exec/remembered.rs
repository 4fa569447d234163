//! An upstream's adaptive limit kept across restarts of `serve`. The permit loop writes
//! the limit it has settled on to storage, and a process started again resumes from it
//! ([`crate::concurrency::governor::Governor::resume`]) instead of doubling up from the
//! start: a batch of a few thousand lines would otherwise spend its life climbing. A limit
//! older than [`MAX_AGE`] is not trusted (the server behind the upstream may have changed),
//! nor is one that does not read: the process then starts as if it had none.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::clock::{self, UnixSeconds};
use crate::storage::{Key, ObjectStore, StorageError};

/// A limit written longer ago than this is not resumed from.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// The limit is written at most this often, and only when it changed.
pub const WRITE_EVERY: Duration = Duration::from_secs(10);

/// What is kept of an upstream's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Kept {
    limit: u32,
    at: UnixSeconds,
}

impl Kept {
    /// The limit to resume from at `now`, if it is recent enough.
    fn usable(self, now: UnixSeconds) -> Option<u32> {
        let age = now.saturating_sub(self.at);
        (self.limit > 0 && (0..=MAX_AGE.as_secs() as i64).contains(&age)).then_some(self.limit)
    }
}

/// One upstream's kept limit, in a process's storage.
pub struct LimitMemory {
    store: Arc<dyn ObjectStore>,
    key: Key,
    written: Option<u32>,
    last_write: Option<Instant>,
}

impl LimitMemory {
    /// `None` for an upstream whose name cannot be part of a storage key.
    pub fn new(store: Arc<dyn ObjectStore>, upstream: &str) -> Option<Self> {
        let key = Key::parse(&format!("limits/{upstream}.json"))?;
        Some(Self { store, key, written: None, last_write: None })
    }

    /// The limit an earlier run settled on, if there is one to resume from.
    pub async fn recall(&mut self) -> Option<u32> {
        let bytes = match self.store.get(&self.key).await {
            Ok(bytes) => bytes,
            Err(StorageError::NotFound(_)) => return None,
            Err(error) => {
                tracing::warn!(key = %self.key, %error, "cannot read the kept limit; starting without it");
                return None;
            }
        };
        let kept: Kept = serde_json::from_slice(&bytes)
            .inspect_err(|error| tracing::warn!(key = %self.key, %error, "the kept limit does not read; ignored"))
            .ok()?;
        self.written = Some(kept.limit);
        kept.usable(clock::now())
    }

    /// Writes `limit` when it changed since the last write and [`WRITE_EVERY`] has passed.
    pub async fn keep(&mut self, limit: u32, now: Instant) {
        let due = self.last_write.is_none_or(|at| now.duration_since(at) >= WRITE_EVERY);
        if !due || self.written == Some(limit) {
            return;
        }
        self.last_write = Some(now);
        let kept = Kept { limit, at: clock::now() };
        let bytes = Bytes::from(serde_json::to_vec(&kept).expect("a kept limit serializes"));
        match self.store.put(&self.key, bytes).await {
            Ok(()) => self.written = Some(limit),
            Err(error) => tracing::warn!(key = %self.key, %error, "cannot keep the limit"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_limit_is_resumed_while_it_is_recent() {
        let kept = Kept { limit: 200, at: 1_000 };
        assert_eq!(kept.usable(1_000), Some(200));
        assert_eq!(kept.usable(1_000 + 24 * 3600), Some(200));
        assert_eq!(kept.usable(1_000 + 24 * 3600 + 1), None, "a day old: the server may have changed");
        assert_eq!(kept.usable(900), None, "written in the future: a clock moved back");
        assert_eq!(Kept { limit: 0, at: 1_000 }.usable(1_000), None);
    }

    #[tokio::test]
    async fn a_limit_kept_by_one_run_is_recalled_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> = Arc::new(crate::storage::DirStore::open(dir.path()).await.unwrap());
        let mut first = LimitMemory::new(store.clone(), "vllm").unwrap();
        assert_eq!(first.recall().await, None, "nothing kept yet");
        let start = Instant::now();
        first.keep(96, start).await;
        first.keep(120, start + Duration::from_secs(1)).await;
        assert_eq!(LimitMemory::new(store.clone(), "vllm").unwrap().recall().await, Some(96), "not due yet");
        first.keep(120, start + WRITE_EVERY).await;
        assert_eq!(LimitMemory::new(store.clone(), "vllm").unwrap().recall().await, Some(120));
        assert_eq!(LimitMemory::new(store.clone(), "other").unwrap().recall().await, None);
        store.put(&Key::parse("limits/vllm.json").unwrap(), Bytes::from_static(b"{oops")).await.unwrap();
        assert_eq!(LimitMemory::new(store, "vllm").unwrap().recall().await, None, "unreadable: ignored");
    }
}
