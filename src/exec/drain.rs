//! Accounting for lines that will never run: once a cancelled or expired batch's
//! workers have stopped, every request without a record gets a `batch_cancelled` or
//! `batch_expired` one. Idempotent: it looks at the checkpoints, not at memory.

use super::checkpoint::{ChunkWriter, Fence, ShardLedger};
use super::failure::LineFailure;
use super::input::{RequestLines, custom_id};
use super::records::{error_line, line_id};
use super::{ExecContext, ExecError};
use crate::batches::BatchSpec;
use crate::validate::Shard;

const DRAIN_CHUNK: usize = 4096;

pub async fn drain_shard(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: &Shard,
    ledger: &ShardLedger,
    failure: &LineFailure,
) -> Result<(), ExecError> {
    if ledger.is_complete() {
        return Ok(());
    }
    // The drain owns the shard from here (workers have stopped): a stale run's later
    // commits will not count.
    let mut writer = ChunkWriter::claim(ctx.store.clone(), spec.id.clone(), shard.index, ledger).await?;
    let range = shard.byte_start..shard.byte_end;
    let mut lines = RequestLines::new(ctx.files.open_data_range(&spec.project_id, &spec.input_file_id, range).await?);
    let mut index: u32 = 0;
    while let Some(line) = lines.next_line().await? {
        if !ledger.recorded.get(index as usize).copied().unwrap_or(true) {
            let id = line_id(&spec.id, shard.first_request + u64::from(index));
            writer.push_error(index, failure.code.as_str(), &error_line(&id, &custom_id(&line), failure));
            crate::metrics::METRICS.line_failed(failure.code.as_str());
            // Superseded: a newer drain owns the shard and writes what this one would.
            if writer.pending() >= DRAIN_CHUNK && writer.commit().await? == Fence::Superseded {
                return Ok(());
            }
        }
        index += 1;
    }
    writer.commit().await?;
    Ok(())
}
