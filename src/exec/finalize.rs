//! Finalize: the output and error files, assembled from the committed chunks by
//! streaming them record by record (never whole), and registered as `batch_output`
//! files. Each request's first record wins, so every input line lands in exactly
//! one of the two files even if two workers once raced on a shard.

use std::ops::Range;
use std::sync::Arc;

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
        let mut chunks = open_chunks(ctx, spec, shard.index, ledger);
        while let Some(chunk) = chunks.next().await {
            let Chunk { checkpoint, kind, body } = chunk?;
            let body = match body {
                Body::Object(stream) => stream,
                Body::Journal(key, range) => {
                    let bytes = journal.read(ctx.store.as_ref(), &key, range).await?;
                    futures_util::stream::once(std::future::ready(Ok(bytes))).boxed()
                }
            };
            let (into, count) = match kind {
                ChunkKind::Out => (&mut output, &mut counts.completed),
                ChunkKind::Err => (&mut errors, &mut counts.failed),
            };
            let indexes = records_of(&checkpoint, kind);
            let (records, copied) = copy_new_records(body, indexes, &mut seen, into).await?;
            if records != indexes.len() {
                return Err(ExecError::Corrupt(format!(
                    "chunk {} of shard {} of {} holds {records} records, its checkpoint lists {}",
                    checkpoint.seq,
                    shard.index,
                    spec.id,
                    indexes.len()
                )));
            }
            *count += copied;
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

/// Chunk objects opened ahead of the one being copied. Each open is a round trip to
/// object storage, and a shard has a chunk for every commit its worker made (thousands):
/// opened one at a time, a finalize took a minute where its bytes took a second. The
/// bodies stay unread until their turn, so this bounds connections, not memory.
const OPEN_AHEAD: usize = 32;

/// A chunk of one checkpoint's records, opened.
struct Chunk {
    checkpoint: Arc<Checkpoint>,
    kind: ChunkKind,
    body: Body,
}

enum Body {
    /// An object of its own, its body streaming.
    Object(ByteStream),
    /// Frames of a journal, read in order through the shard's [`JournalCursor`].
    Journal(Key, Range<u64>),
}

fn records_of(checkpoint: &Checkpoint, kind: ChunkKind) -> &[u32] {
    match kind {
        ChunkKind::Out => &checkpoint.out,
        ChunkKind::Err => &checkpoint.err,
    }
}

/// The shard's chunks that hold records, in the ledger's order, objects opened
/// [`OPEN_AHEAD`] at a time.
fn open_chunks(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: u32,
    ledger: &ShardLedger,
) -> impl futures_util::Stream<Item = Result<Chunk, StorageError>> + use<> {
    let chunks: Vec<(Arc<Checkpoint>, ChunkKind)> = ledger
        .checkpoints
        .iter()
        .flat_map(|checkpoint| [ChunkKind::Out, ChunkKind::Err].map(|kind| (checkpoint.clone(), kind)))
        .filter(|(checkpoint, kind)| !records_of(checkpoint, *kind).is_empty())
        .collect();
    let (store, batch) = (ctx.store.clone(), spec.id.clone());
    futures_util::stream::iter(chunks)
        .map(move |(checkpoint, kind)| {
            let (store, (key, range)) = (store.clone(), chunk_location(&batch, shard, &checkpoint, kind));
            async move {
                let body = match range {
                    Some(range) => Body::Journal(key, range),
                    None => Body::Object(store.read(&key, None).await?),
                };
                Ok(Chunk { checkpoint, kind, body })
            }
        })
        .buffered(OPEN_AHEAD)
}

/// Appends the records of `body` whose requests (`indexes`, in record order) were not
/// seen yet; returns how many records it held and how many it copied.
async fn copy_new_records(
    mut body: ByteStream,
    indexes: &[u32],
    seen: &mut [bool],
    into: &mut Upload,
) -> Result<(usize, u64), ExecError> {
    let mut buffer = BytesMut::new();
    let mut record = 0usize;
    let mut copied = 0;
    loop {
        while let Some(newline) = memchr::memchr(b'\n', &buffer) {
            let line = buffer.split_to(newline + 1).freeze();
            if let Some(&index) = indexes.get(record)
                && let Some(slot) = seen.get_mut(index as usize).filter(|slot| !**slot)
            {
                *slot = true;
                into.write(line).await?;
                copied += 1;
            }
            record += 1;
        }
        match body.next().await {
            Some(chunk) => buffer.extend_from_slice(&chunk?),
            None => break,
        }
    }
    Ok((record, copied))
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
