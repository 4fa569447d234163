//! Where a shard's records live in storage, under `batches/<batch id>/shard-<index>/`:
//!
//! - `chunk-<seq>-<writer>.out.jsonl` and `chunk-<seq>-<writer>.err.jsonl` (each only
//!   when non-empty), then `checkpoint-<seq>-<writer>.json`, written last: a chunk
//!   without its checkpoint does not exist for anyone, so a worker killed at any instant
//!   leaves only whole, checkpointed chunks behind (`super::checkpoint`);
//! - or, where storage writes in place, `journal-<writer>.jsonl`, one frame per commit
//!   (`super::journal`);
//! - `owners/<epoch>-<writer>.json`: the runs' claims; only the newest claim's
//!   checkpoints count (`super::owner`).
//!
//! `<writer>` is unique to each worker run, so two runs that overlap on a shard (a Job's
//! retried pod while the old one still lives) never overwrite each other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::batches::Usage;
use crate::ids::BatchId;
use crate::storage::Key;

/// One committed chunk: the shard-local indexes of its records, in the order the
/// records stand in the chunk files (or in its journal frame).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub seq: u32,
    pub writer: String,
    pub out: Vec<u32>,
    pub err: Vec<u32>,
    pub usage: Usage,
    /// The error records' codes, counted (for the line metrics by code).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub codes: BTreeMap<String, u32>,
    /// In a journal frame's header: the bytes of output, then error, records after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub err_bytes: Option<u64>,
    /// Read from a journal: where in it the frame's records start.
    #[serde(skip)]
    pub journal_at: Option<u64>,
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

/// Where a checkpoint's records of `kind` are: a range of its run's journal, or a chunk
/// object of their own.
pub fn chunk_location(
    batch: &BatchId,
    shard: u32,
    checkpoint: &Checkpoint,
    kind: ChunkKind,
) -> (Key, Option<std::ops::Range<u64>>) {
    match checkpoint.journal_at {
        Some(at) => {
            let out_end = at + checkpoint.out_bytes.unwrap_or(0);
            let range = match kind {
                ChunkKind::Out => at..out_end,
                ChunkKind::Err => out_end..out_end + checkpoint.err_bytes.unwrap_or(0),
            };
            (journal_key(batch, shard, &checkpoint.writer), Some(range))
        }
        None => (chunk_key(batch, shard, checkpoint, kind), None),
    }
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

pub const JOURNAL_PREFIX: &str = "journal-";

pub fn journal_key(batch: &BatchId, shard: u32, writer: &str) -> Key {
    Key::parse(&format!("{}{JOURNAL_PREFIX}{writer}.jsonl", shard_prefix(batch, shard)))
        .expect("journal keys are valid")
}

pub fn claims_prefix(batch: &BatchId, shard: u32) -> String {
    format!("{}owners/", shard_prefix(batch, shard))
}

pub fn claim_key(batch: &BatchId, shard: u32, epoch: u32, writer: &str) -> Key {
    Key::parse(&format!("{}{epoch:08}-{writer}.json", claims_prefix(batch, shard))).expect("claim keys are valid")
}
