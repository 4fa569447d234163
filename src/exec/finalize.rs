//! Finalize: the output and error files, assembled from the committed chunks by
//! streaming them record by record (never whole), and registered as `batch_output`
//! files. Each request's first record wins, so every input line lands in exactly
//! one of the two files even if two workers once raced on a shard.

use futures_util::StreamExt;

use super::checkpoint::{Checkpoint, ChunkKind, ShardLedger, chunk_location};
use super::{ExecContext, ExecError};
use crate::batches::{BatchSpec, RequestCounts, ReservedFiles};
use crate::files::{ExpiresAfter, FileRecord, NewFile, Purpose, Upload};
use crate::ids::FileId;
use crate::storage::StorageError;

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
        for checkpoint in &ledger.checkpoints {
            counts.completed +=
                copy_chunk(ctx, spec, shard.index, checkpoint, ChunkKind::Out, &mut seen, &mut output).await?;
            counts.failed +=
                copy_chunk(ctx, spec, shard.index, checkpoint, ChunkKind::Err, &mut seen, &mut errors).await?;
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

/// Appends the records of one chunk whose requests were not seen yet; returns how many.
async fn copy_chunk(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: u32,
    checkpoint: &Checkpoint,
    kind: ChunkKind,
    seen: &mut [bool],
    into: &mut Upload,
) -> Result<u64, ExecError> {
    let indexes = match kind {
        ChunkKind::Out => &checkpoint.out,
        ChunkKind::Err => &checkpoint.err,
    };
    if indexes.is_empty() {
        return Ok(0);
    }
    let seq = checkpoint.seq;
    let (key, range) = chunk_location(&spec.id, shard, checkpoint, kind);
    let mut stream = ctx.store.read(&key, range).await?;
    let mut buffer = bytes::BytesMut::new();
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
        match stream.next().await {
            Some(chunk) => buffer.extend_from_slice(&chunk?),
            None => break,
        }
    }
    if record != indexes.len() {
        return Err(ExecError::Corrupt(format!(
            "chunk {seq} of shard {shard} of {} holds {record} records, its checkpoint lists {}",
            spec.id,
            indexes.len()
        )));
    }
    Ok(copied)
}
