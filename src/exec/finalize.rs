//! Finalize: the output and error files, assembled from the committed chunks by
//! streaming them record by record (never whole), and registered as `batch_output`
//! files. Each request's first record wins, so every input line lands in exactly
//! one of the two files even if two workers once raced on a shard.

use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::StreamExt;

use super::checkpoint::ShardLedger;
use super::layout::{Checkpoint, ChunkKind, chunk_location};
use super::{ExecContext, ExecError};
use crate::batches::{BatchSpec, RequestCounts, ReservedFiles};
use crate::files::{ExpiresAfter, FileRecord, NewFile, Purpose, Upload};
use crate::ids::FileId;
use crate::storage::{ByteStream, Key, ObjectStore, StorageError};

/// The files a finalize produced, and the counts read off them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finalized {
    pub output_file_id: Option<FileId>,
    pub error_file_id: Option<FileId>,
    pub counts: RequestCounts,
}

pub async fn finalize(
    ctx: &ExecContext,
    spec: &BatchSpec,
    ledgers: &[ShardLedger],
    reserved: &ReservedFiles,
) -> Result<Finalized, ExecError> {
    let mut output = ctx.files.start_upload_with_id(&spec.project_id, reserved.output.clone()).await?;
    let mut errors = ctx.files.start_upload_with_id(&spec.project_id, reserved.error.clone()).await?;
    let mut counts = RequestCounts::default();
    for (shard, ledger) in spec.plan.shards.iter().zip(ledgers) {
        counts.total += shard.requests;
        let mut seen = vec![false; shard.requests as usize];
        let mut journal = JournalCursor::default();
        for checkpoint in &ledger.checkpoints {
            let mut copy = Copy { ctx, spec, shard: shard.index, checkpoint, seen: &mut seen, journal: &mut journal };
            counts.completed += copy.chunk(ChunkKind::Out, &mut output).await?;
            counts.failed += copy.chunk(ChunkKind::Err, &mut errors).await?;
        }
    }
    let file = |suffix: &str, is_error| NewFile {
        filename: Some(format!("{}_{suffix}.jsonl", spec.id)),
        purpose: Purpose::BatchOutput,
        is_error,
        expires_after: spec.output_expires_after.map(|seconds| ExpiresAfter { seconds }),
    };
    let output_file_id = publish(output, counts.completed > 0, file("output", false)).await?.map(|r| r.id);
    let error_file_id = publish(errors, counts.failed > 0, file("error", true)).await?.map(|r| r.id);
    Ok(Finalized { output_file_id, error_file_id, counts })
}

async fn publish(upload: Upload, wanted: bool, file: NewFile) -> Result<Option<FileRecord>, StorageError> {
    if !wanted {
        upload.abort().await;
        return Ok(None);
    }
    Ok(Some(upload.commit(file).await?))
}

/// One checkpoint's records on their way to the output and error files.
struct Copy<'a> {
    ctx: &'a ExecContext,
    spec: &'a BatchSpec,
    shard: u32,
    checkpoint: &'a Checkpoint,
    seen: &'a mut [bool],
    journal: &'a mut JournalCursor,
}

impl Copy<'_> {
    /// Appends the records of `kind` whose requests were not seen yet; returns how many.
    async fn chunk(&mut self, kind: ChunkKind, into: &mut Upload) -> Result<u64, ExecError> {
        let indexes = match kind {
            ChunkKind::Out => &self.checkpoint.out,
            ChunkKind::Err => &self.checkpoint.err,
        };
        if indexes.is_empty() {
            return Ok(0);
        }
        let (key, range) = chunk_location(&self.spec.id, self.shard, self.checkpoint, kind);
        let mut stream = match range {
            // A journal's frames are read in order over one stream, not one open per frame.
            Some(range) => {
                let bytes = self.journal.read(self.ctx.store.as_ref(), &key, range).await?;
                futures_util::stream::once(std::future::ready(Ok(bytes))).boxed()
            }
            None => self.ctx.store.read(&key, None).await?,
        };
        let mut buffer = bytes::BytesMut::new();
        let mut record = 0usize;
        let mut copied = 0;
        loop {
            while let Some(newline) = memchr::memchr(b'\n', &buffer) {
                let line = buffer.split_to(newline + 1).freeze();
                if let Some(&index) = indexes.get(record)
                    && let Some(slot) = self.seen.get_mut(index as usize).filter(|slot| !**slot)
                {
                    *slot = true;
                    into.write(line).await?;
                    copied += 1;
                }
                record += 1;
            }
            match stream.next().await {
                Some(chunk) => buffer.extend_from_slice(&chunk?),
                None => break,
            }
        }
        if record != indexes.len() {
            return Err(ExecError::Corrupt(format!(
                "chunk {} of shard {} of {} holds {record} records, its checkpoint lists {}",
                self.checkpoint.seq,
                self.shard,
                self.spec.id,
                indexes.len()
            )));
        }
        Ok(copied)
    }
}

/// Reads ranges of a journal in increasing order over one open stream, skipping what
/// lies between (frame headers, records of the other kind).
#[derive(Default)]
struct JournalCursor {
    open: Option<OpenJournal>,
}

struct OpenJournal {
    key: Key,
    /// Where in the journal `pending` starts.
    position: u64,
    stream: ByteStream,
    pending: Bytes,
}

impl JournalCursor {
    async fn read(&mut self, store: &dyn ObjectStore, key: &Key, range: Range<u64>) -> Result<Bytes, StorageError> {
        let reusable = self.open.as_ref().is_some_and(|open| open.key == *key && open.position <= range.start);
        let open = match &mut self.open {
            Some(open) if reusable => open,
            slot => slot.insert(OpenJournal {
                key: key.clone(),
                position: range.start,
                stream: store.read(key, Some(range.start..u64::MAX)).await?,
                pending: Bytes::new(),
            }),
        };
        let mut bytes = BytesMut::with_capacity((range.end - range.start) as usize);
        while open.position < range.end {
            if open.pending.is_empty() {
                match open.stream.next().await {
                    Some(chunk) => open.pending = chunk?,
                    None => break,
                }
            }
            let available = open.pending.len() as u64;
            if open.position < range.start {
                let skip = (range.start - open.position).min(available);
                open.pending.advance(skip as usize);
                open.position += skip;
            } else {
                let take = (range.end - open.position).min(available) as usize;
                bytes.extend_from_slice(&open.pending.split_to(take));
                open.position += take as u64;
            }
        }
        Ok(bytes.freeze())
    }
}
