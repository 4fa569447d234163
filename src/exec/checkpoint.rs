//! Shard results in storage: chunks of records, each made durable by a checkpoint
//! that says which of the shard's requests the chunk holds.
//!
//! Layout under `batches/<batch id>/shard-<index>/`:
//! `chunk-<seq>-<writer>.out.jsonl` and `chunk-<seq>-<writer>.err.jsonl` (each only
//! when non-empty), then `checkpoint-<seq>-<writer>.json`, written last: a chunk
//! without its checkpoint does not exist for anyone. So a worker killed at any
//! instant leaves only whole, checkpointed chunks behind. `<writer>` is unique to
//! each worker run, so two runs that overlap on a shard (a Job's retried pod while
//! the old one still lives) never overwrite each other; finalize keeps the first
//! record of each request.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::ExecError;
use crate::batches::Usage;
use crate::ids::BatchId;
use crate::storage::{Key, ObjectStore, StorageError};

/// One committed chunk: the shard-local indexes of its records, in the order the
/// records stand in the chunk files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub seq: u32,
    pub writer: String,
    pub out: Vec<u32>,
    pub err: Vec<u32>,
    pub usage: Usage,
    /// The error records' codes, counted (for the line metrics by code).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub codes: BTreeMap<String, u32>,
}

impl Checkpoint {
    fn empty() -> Self {
        Self {
            seq: 0,
            writer: String::new(),
            out: Vec::new(),
            err: Vec::new(),
            usage: Usage::default(),
            codes: BTreeMap::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    Out,
    Err,
}

pub fn shard_prefix(batch: &BatchId, shard: u32) -> String {
    format!("batches/{batch}/shard-{shard:05}/")
}

pub fn checkpoint_key(batch: &BatchId, shard: u32, seq: u32, writer: &str) -> Key {
    Key::parse(&format!("{}checkpoint-{seq:08}-{writer}.json", shard_prefix(batch, shard)))
        .expect("checkpoint keys are valid")
}

pub fn chunk_key(batch: &BatchId, shard: u32, checkpoint: &Checkpoint, kind: ChunkKind) -> Key {
    let suffix = match kind {
        ChunkKind::Out => "out",
        ChunkKind::Err => "err",
    };
    let (seq, writer) = (checkpoint.seq, &checkpoint.writer);
    Key::parse(&format!("{}chunk-{seq:08}-{writer}.{suffix}.jsonl", shard_prefix(batch, shard)))
        .expect("chunk keys are valid")
}

/// What a shard's checkpoints add up to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardLedger {
    /// Which shard-local requests have a record.
    pub recorded: Vec<bool>,
    pub completed: u64,
    pub failed: u64,
    pub usage: Usage,
    /// In `seq` order.
    pub checkpoints: Vec<Arc<Checkpoint>>,
    /// Failed requests by error code (a request recorded twice, by two raced runs, may
    /// count under both codes).
    pub codes: BTreeMap<String, u64>,
}

impl ShardLedger {
    pub fn new(requests: u64) -> Self {
        Self { recorded: vec![false; requests as usize], ..Self::default() }
    }

    pub fn recorded_count(&self) -> u64 {
        self.completed + self.failed
    }

    pub fn is_complete(&self) -> bool {
        self.recorded_count() as usize >= self.recorded.len()
    }

    pub fn next_seq(&self) -> u32 {
        self.checkpoints.iter().map(|c| c.seq + 1).max().unwrap_or(0)
    }

    /// Adds a checkpoint. A request recorded twice (two workers raced on a shard)
    /// counts once: finalize keeps its first record only.
    pub fn add(&mut self, checkpoint: Arc<Checkpoint>) {
        for (indexes, completed) in [(&checkpoint.out, true), (&checkpoint.err, false)] {
            for &index in indexes {
                let Some(slot) = self.recorded.get_mut(index as usize) else { continue };
                if !*slot {
                    *slot = true;
                    if completed {
                        self.completed += 1;
                    } else {
                        self.failed += 1;
                    }
                }
            }
        }
        self.usage += checkpoint.usage;
        for (code, count) in &checkpoint.codes {
            *self.codes.entry(code.clone()).or_default() += u64::from(*count);
        }
        self.checkpoints.push(checkpoint);
    }
}

/// Reads shards' checkpoints. Checkpoints never change once written, so each is
/// fetched once and then served from memory: polling progress costs one listing.
#[derive(Default)]
pub struct CheckpointReader {
    cache: Mutex<HashMap<Key, Arc<Checkpoint>>>,
}

impl CheckpointReader {
    pub async fn ledger(
        &self,
        store: &dyn ObjectStore,
        batch: &BatchId,
        shard: u32,
        requests: u64,
    ) -> Result<ShardLedger, ExecError> {
        let mut ledger = ShardLedger::new(requests);
        let prefix = format!("{}checkpoint-", shard_prefix(batch, shard));
        for key in store.list(&prefix).await? {
            let cached = self.cache.lock().expect("checkpoint cache").get(&key).cloned();
            let checkpoint = match cached {
                Some(checkpoint) => checkpoint,
                None => {
                    let bytes = store.get(&key).await?;
                    let checkpoint: Checkpoint = serde_json::from_slice(&bytes)
                        .map_err(|e| ExecError::Corrupt(format!("unreadable checkpoint {key}: {e}")))?;
                    let checkpoint = Arc::new(checkpoint);
                    self.cache.lock().expect("checkpoint cache").insert(key, checkpoint.clone());
                    checkpoint
                }
            };
            ledger.add(checkpoint);
        }
        Ok(ledger)
    }

    /// Drops what is cached for a batch (once it is terminal).
    pub fn forget(&self, batch: &BatchId) {
        let prefix = format!("batches/{batch}/");
        self.cache.lock().expect("checkpoint cache").retain(|key, _| !key.as_str().starts_with(&prefix));
    }
}

/// Buffers records and commits them as chunks.
pub struct ChunkWriter {
    store: Arc<dyn ObjectStore>,
    batch: BatchId,
    shard: u32,
    out: Vec<u8>,
    err: Vec<u8>,
    pending: Checkpoint,
}

impl ChunkWriter {
    pub fn new(store: Arc<dyn ObjectStore>, batch: BatchId, shard: u32, next_seq: u32) -> Self {
        let writer = ulid::Ulid::new().to_string().to_ascii_lowercase();
        let pending = Checkpoint { seq: next_seq, writer, ..Checkpoint::empty() };
        Self { store, batch, shard, out: Vec::new(), err: Vec::new(), pending }
    }

    /// Adds an output record, written by `write` straight into the chunk's buffer.
    pub fn push_output_with(&mut self, index: u32, usage: Usage, write: impl FnOnce(&mut Vec<u8>)) {
        write(&mut self.out);
        self.pending.out.push(index);
        self.pending.usage += usage;
    }

    pub fn push_error(&mut self, index: u32, code: &str, record: &[u8]) {
        self.err.extend_from_slice(record);
        self.pending.err.push(index);
        match self.pending.codes.get_mut(code) {
            Some(count) => *count += 1,
            None => {
                self.pending.codes.insert(code.to_owned(), 1);
            }
        }
    }

    pub fn pending(&self) -> usize {
        self.pending.out.len() + self.pending.err.len()
    }

    pub fn pending_bytes(&self) -> usize {
        self.out.len() + self.err.len()
    }

    /// Makes everything pushed so far durable: chunk files first, checkpoint last.
    pub async fn commit(&mut self) -> Result<Option<Arc<Checkpoint>>, StorageError> {
        if self.pending() == 0 {
            return Ok(None);
        }
        if !self.out.is_empty() {
            let key = chunk_key(&self.batch, self.shard, &self.pending, ChunkKind::Out);
            self.store.put(&key, Bytes::from(std::mem::take(&mut self.out))).await?;
        }
        if !self.err.is_empty() {
            let key = chunk_key(&self.batch, self.shard, &self.pending, ChunkKind::Err);
            self.store.put(&key, Bytes::from(std::mem::take(&mut self.err))).await?;
        }
        let next = Checkpoint { seq: self.pending.seq + 1, writer: self.pending.writer.clone(), ..Checkpoint::empty() };
        let checkpoint = std::mem::replace(&mut self.pending, next);
        let json = serde_json::to_vec(&checkpoint).expect("checkpoints serialize");
        let key = checkpoint_key(&self.batch, self.shard, checkpoint.seq, &checkpoint.writer);
        self.store.put(&key, Bytes::from(json)).await?;
        Ok(Some(Arc::new(checkpoint)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_counts_each_request_once() {
        let mut ledger = ShardLedger::new(4);
        let usage = Usage { input_tokens: 1, output_tokens: 2, total_tokens: 3, ..Usage::default() };
        let codes = [("rate_limit_exceeded".to_owned(), 1)].into();
        ledger.add(Arc::new(Checkpoint { seq: 0, writer: "a".into(), out: vec![0, 2], err: vec![1], usage, codes }));
        assert_eq!((ledger.completed, ledger.failed), (2, 1));
        assert!(!ledger.is_complete());
        ledger.add(Arc::new(Checkpoint {
            seq: 1,
            writer: "b".into(),
            out: vec![2],
            err: vec![3, 9],
            usage: Usage::default(),
            codes: [("server_error".to_owned(), 2)].into(),
        }));
        assert_eq!((ledger.completed, ledger.failed), (2, 2), "index 2 twice counts once; 9 is out of range");
        assert_eq!(ledger.codes, [("rate_limit_exceeded".to_owned(), 1), ("server_error".to_owned(), 2)].into());
        assert!(ledger.is_complete());
        assert_eq!(ledger.next_seq(), 2);
        assert_eq!(ledger.usage.total_tokens, 3);
    }
}
