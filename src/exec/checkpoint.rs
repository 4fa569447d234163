//! Shard results in storage: chunks of records, each made durable by a checkpoint
//! that says which of the shard's requests the chunk holds (where they live:
//! [`super::layout`]). Finalize keeps the first record of each request.
//!
//! Commits are group commits: the worker hands a [`Group`] of records to storage while
//! the next group fills, and a line's permit goes to the next line only once its
//! record is durable, so a crash re-sends only lines that were in flight.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};

use super::ExecError;
use super::journal;
use super::layout::{
    Checkpoint, ChunkKind, JOURNAL_PREFIX, checkpoint_key, chunk_key, claim_key, claims_prefix, journal_key,
    shard_prefix,
};
use super::owner::{Claim, ClaimName, newest};
use crate::batches::Usage;
use crate::ids::BatchId;
use crate::storage::{Key, ObjectStore, StorageError};

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
    /// The shard's newest claim, if any run ever claimed it.
    pub owner: Option<Arc<Claim>>,
    /// The highest `seq` of any checkpoint, counted or not.
    pub max_seq: Option<u32>,
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

    /// The `seq` a new run starts at (above every checkpoint's, counted or not).
    pub fn next_seq(&self) -> u32 {
        self.max_seq.map_or(0, |seq| seq + 1)
    }

    /// The ledger of a shard's checkpoints (in any order) under its newest claim:
    /// only what that owner counts.
    pub fn of(requests: u64, owner: Option<Arc<Claim>>, mut checkpoints: Vec<Arc<Checkpoint>>) -> Self {
        checkpoints.sort_by(|a, b| (a.seq, &a.writer).cmp(&(b.seq, &b.writer)));
        let mut ledger = Self::new(requests);
        let max_seq = checkpoints.iter().map(|c| c.seq).max();
        for checkpoint in checkpoints {
            if owner.as_ref().is_none_or(|owner| owner.counts(&checkpoint)) {
                ledger.add(checkpoint);
            }
        }
        ledger.max_seq = max_seq;
        ledger.owner = owner;
        ledger
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
        self.max_seq = self.max_seq.max(Some(checkpoint.seq));
        for (code, count) in &checkpoint.codes {
            *self.codes.entry(code.clone()).or_default() += u64::from(*count);
        }
        self.checkpoints.push(checkpoint);
    }
}

/// Checkpoints a ledger reads from storage at once.
const READS_AT_ONCE: usize = 32;

/// Reads shards' checkpoints and claims. Neither changes once written, so each is
/// fetched once and then served from memory: polling progress costs two listings.
#[derive(Default)]
pub struct CheckpointReader {
    cache: Mutex<HashMap<Key, Arc<dyn std::any::Any + Send + Sync>>>,
    /// Journals grow: what was read of each, to read on from.
    journals: Mutex<HashMap<Key, journal::Decoded>>,
}

impl CheckpointReader {
    /// A shard's ledger. Checkpoints are listed before claims, so each checkpoint read
    /// is judged by claims at least as new as itself.
    pub async fn ledger(
        &self,
        store: &dyn ObjectStore,
        batch: &BatchId,
        shard: u32,
        requests: u64,
    ) -> Result<ShardLedger, ExecError> {
        let (owner, checkpoints) = self.checkpoints(store, batch, shard).await?;
        Ok(ShardLedger::of(requests, owner, checkpoints))
    }

    /// Every checkpoint of a shard, counted or not, and its newest claim.
    pub async fn checkpoints(
        &self,
        store: &dyn ObjectStore,
        batch: &BatchId,
        shard: u32,
    ) -> Result<(Option<Arc<Claim>>, Vec<Arc<Checkpoint>>), ExecError> {
        let prefix = shard_prefix(batch, shard);
        // The ones not read before, several at a time: a pod commits a checkpoint every
        // few tens of milliseconds, and read one by one they came in faster than a pass
        // over a few busy shards could read them.
        let keys = store.list(&format!("{prefix}checkpoint-")).await?;
        let mut checkpoints: Vec<Arc<Checkpoint>> = futures_util::stream::iter(keys)
            .map(|key| async move { self.read(store, &key, "checkpoint").await })
            .buffered(READS_AT_ONCE)
            .try_collect()
            .await?;
        // Journals exist only where storage writes in place: elsewhere, no listing for them.
        if store.writes_in_place() {
            for key in store.list(&format!("{prefix}{JOURNAL_PREFIX}")).await? {
                checkpoints.extend(self.read_journal(store, &key).await?);
            }
        }
        let claims = store.list(&claims_prefix(batch, shard)).await?;
        let owner = match newest(&claims) {
            Some((_, key)) => Some(self.read(store, key, "claim").await?),
            None => None,
        };
        Ok((owner, checkpoints))
    }

    /// A journal's checkpoints: those read before from memory, and the frames written
    /// since from storage.
    async fn read_journal(&self, store: &dyn ObjectStore, key: &Key) -> Result<Vec<Arc<Checkpoint>>, ExecError> {
        let known = self.journals.lock().expect("journal cache").get(key).cloned().unwrap_or_default();
        if known.broken {
            return Ok(known.checkpoints);
        }
        let mut stream = store.read(key, Some(known.consumed..u64::MAX)).await?;
        let mut bytes = Vec::new();
        while let Some(chunk) = futures_util::StreamExt::next(&mut stream).await {
            bytes.extend_from_slice(&chunk?);
        }
        let decoded = journal::decode(&bytes, known.consumed);
        if decoded.broken {
            tracing::warn!(%key, at = known.consumed + decoded.consumed, "a journal frame's header is unreadable; nothing after it counts");
        }
        let mut journal = known;
        journal.checkpoints.extend(decoded.checkpoints);
        journal.consumed += decoded.consumed;
        journal.broken = decoded.broken;
        let checkpoints = journal.checkpoints.clone();
        self.journals.lock().expect("journal cache").insert(key.clone(), journal);
        Ok(checkpoints)
    }

    /// An object that never changes once written, from the cache or from storage.
    async fn read<T>(&self, store: &dyn ObjectStore, key: &Key, what: &str) -> Result<Arc<T>, ExecError>
    where
        T: serde::de::DeserializeOwned + Send + Sync + 'static,
    {
        let cached = self.cache.lock().expect("checkpoint cache").get(key).cloned();
        if let Some(cached) = cached
            && let Ok(value) = cached.downcast::<T>()
        {
            return Ok(value);
        }
        let bytes = store.get(key).await?;
        let value: T =
            serde_json::from_slice(&bytes).map_err(|e| ExecError::Corrupt(format!("unreadable {what} {key}: {e}")))?;
        let value = Arc::new(value);
        self.cache.lock().expect("checkpoint cache").insert(key.clone(), value.clone());
        Ok(value)
    }

    /// Drops what is cached for a batch (once it is terminal).
    pub fn forget(&self, batch: &BatchId) {
        let prefix = format!("batches/{batch}/");
        self.cache.lock().expect("checkpoint cache").retain(|key, _| !key.as_str().starts_with(&prefix));
        self.journals.lock().expect("journal cache").retain(|key, _| !key.as_str().starts_with(&prefix));
    }
}

/// Whether a commit found its run still owning the shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// It does: the checkpoint is written.
    Owner,
    /// A newer run claimed the shard: the checkpoint was not written, and this run
    /// must stop.
    Superseded,
}

/// Buffers records and commits them as chunks, as the shard's owner.
pub struct ChunkWriter {
    store: Arc<dyn ObjectStore>,
    batch: BatchId,
    shard: u32,
    out: Vec<u8>,
    err: Vec<u8>,
    pending: Checkpoint,
    claim: ClaimName,
    /// Where storage writes in place: the run's journal, and where its next frame goes.
    journal: Option<(Key, u64)>,
}

impl ChunkWriter {
    /// Claims the shard over what `ledger` counted, and starts the run's first chunk.
    pub async fn claim(
        store: Arc<dyn ObjectStore>,
        batch: BatchId,
        shard: u32,
        ledger: &ShardLedger,
    ) -> Result<Self, StorageError> {
        let writer = ulid::Ulid::new().to_string().to_ascii_lowercase();
        let claim = Claim::over(ledger.owner.as_ref().map(|owner| owner.epoch), &writer, &ledger.checkpoints);
        let key = claim_key(&batch, shard, claim.epoch, &writer);
        store.put(&key, Bytes::from(serde_json::to_vec(&claim).expect("claims serialize"))).await?;
        let journal = store.writes_in_place().then(|| (journal_key(&batch, shard, &writer), 0));
        let pending = Checkpoint { seq: ledger.next_seq(), writer: writer.clone(), ..Checkpoint::default() };
        let claim = ClaimName { epoch: claim.epoch, writer };
        Ok(Self { store, batch, shard, out: Vec::new(), err: Vec::new(), pending, claim, journal })
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

    /// The run's journal, if it keeps one (to sync).
    pub fn journal(&self) -> Option<&Key> {
        self.journal.as_ref().map(|(key, _)| key)
    }

    /// Everything pushed so far, as a group to commit; the writer starts the next one.
    pub fn take_group(&mut self) -> Option<Group> {
        if self.pending() == 0 {
            return None;
        }
        let next =
            Checkpoint { seq: self.pending.seq + 1, writer: self.pending.writer.clone(), ..Checkpoint::default() };
        let checkpoint = std::mem::replace(&mut self.pending, next);
        let (out, err) = (std::mem::take(&mut self.out), std::mem::take(&mut self.err));
        let writes = match &mut self.journal {
            Some((key, end)) => {
                let frame = journal::encode(&checkpoint, &out, &err);
                let at = *end;
                *end += frame.len() as u64;
                Writes::Journal { key: key.clone(), at, frame: Bytes::from(frame) }
            }
            None => {
                let chunk = |kind, bytes: Vec<u8>| {
                    (!bytes.is_empty())
                        .then(|| (chunk_key(&self.batch, self.shard, &checkpoint, kind), Bytes::from(bytes)))
                };
                Writes::Objects {
                    out: chunk(ChunkKind::Out, out),
                    err: chunk(ChunkKind::Err, err),
                    checkpoint_key: checkpoint_key(&self.batch, self.shard, checkpoint.seq, &checkpoint.writer),
                    checkpoint: Bytes::from(serde_json::to_vec(&checkpoint).expect("checkpoints serialize")),
                }
            }
        };
        Some(Group {
            store: self.store.clone(),
            writes,
            claims: claims_prefix(&self.batch, self.shard),
            claim: self.claim.clone(),
            sync: false,
        })
    }

    /// Commits everything pushed so far, once.
    pub async fn commit(&mut self) -> Result<Fence, StorageError> {
        match self.take_group() {
            Some(group) => group.commit().await,
            None => Ok(Fence::Owner),
        }
    }
}

/// Records made durable together.
pub struct Group {
    store: Arc<dyn ObjectStore>,
    writes: Writes,
    claims: String,
    claim: ClaimName,
    /// Also make the run's journal durable against power loss (a journal frame is
    /// durable against a crash of the process as soon as it is written).
    pub sync: bool,
}

enum Writes {
    /// A frame at the end of the run's journal.
    Journal { key: Key, at: u64, frame: Bytes },
    /// Chunk objects, then their checkpoint.
    Objects { out: Option<(Key, Bytes)>, err: Option<(Key, Bytes)>, checkpoint_key: Key, checkpoint: Bytes },
}

impl Group {
    /// Writes the records and, if the run still owns the shard, what makes them count:
    /// the checkpoint object (a journal frame counts only if the owner adopted it, so it
    /// is written in one go). Writes the same bytes each time: a failed commit may simply
    /// be tried again.
    pub async fn commit(&self) -> Result<Fence, StorageError> {
        let store = self.store.as_ref();
        match &self.writes {
            Writes::Journal { key, at, frame } => {
                let (written, fence) = tokio::join!(store.write_at(key, *at, frame.clone()), self.fence());
                written?;
                if self.sync {
                    store.sync(key).await?;
                }
                fence
            }
            Writes::Objects { out, err, checkpoint_key, checkpoint } => {
                let put = |chunk: &Option<(Key, Bytes)>| {
                    let chunk = chunk.clone();
                    async move {
                        match chunk {
                            Some((key, bytes)) => store.put(&key, bytes).await,
                            None => Ok(()),
                        }
                    }
                };
                let (out, err, fence) = tokio::join!(put(out), put(err), self.fence());
                out?;
                err?;
                let fence = fence?;
                if fence == Fence::Owner {
                    store.put(checkpoint_key, checkpoint.clone()).await?;
                }
                Ok(fence)
            }
        }
    }

    /// Whether the run still owns the shard: no newer claim, or a store no other process
    /// writes to (where runs of a shard never overlap).
    async fn fence(&self) -> Result<Fence, StorageError> {
        if self.store.exclusive() {
            return Ok(Fence::Owner);
        }
        Ok(match newest(&self.store.list(&self.claims).await?) {
            Some((newest, _)) if newest != self.claim => Fence::Superseded,
            _ => Fence::Owner,
        })
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
        ledger.add(Arc::new(Checkpoint {
            seq: 0,
            writer: "a".into(),
            out: vec![0, 2],
            err: vec![1],
            usage,
            codes,
            ..Checkpoint::default()
        }));
        assert_eq!((ledger.completed, ledger.failed), (2, 1));
        assert!(!ledger.is_complete());
        ledger.add(Arc::new(Checkpoint {
            seq: 1,
            writer: "b".into(),
            out: vec![2],
            err: vec![3, 9],
            codes: [("server_error".to_owned(), 2)].into(),
            ..Checkpoint::default()
        }));
        assert_eq!((ledger.completed, ledger.failed), (2, 2), "index 2 twice counts once; 9 is out of range");
        assert_eq!(ledger.codes, [("rate_limit_exceeded".to_owned(), 1), ("server_error".to_owned(), 2)].into());
        assert!(ledger.is_complete());
        assert_eq!(ledger.next_seq(), 2);
        assert_eq!(ledger.usage.total_tokens, 3);
    }

    #[test]
    fn a_ledger_counts_only_what_the_shards_owner_counts() {
        let checkpoint = |writer: &str, seq, out: Vec<u32>| {
            Arc::new(Checkpoint { seq, writer: writer.into(), out, ..Checkpoint::default() })
        };
        // a committed 0 and 1; b claimed having seen a's 0 only, then committed 2; a's 1
        // landed after b's claim (a was superseded, and learns at its next commit).
        let all = vec![checkpoint("b", 2, vec![2]), checkpoint("a", 1, vec![1]), checkpoint("a", 0, vec![0])];
        let owner = Claim::over(None, "b", &all[2..]);
        let ledger = ShardLedger::of(3, Some(Arc::new(owner)), all.clone());
        assert_eq!(ledger.recorded, vec![true, false, true], "a's 1 does not count");
        assert_eq!(ledger.checkpoints.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![0, 2], "in seq order");
        assert_eq!(ledger.next_seq(), 3, "above every checkpoint, counted or not");
        let unclaimed = ShardLedger::of(3, None, all);
        assert!(unclaimed.is_complete(), "without claims (before fencing) everything counts");
    }
}
