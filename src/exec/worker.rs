//! The worker for one shard: reads only its byte range, sends each request not yet
//! recorded to the upstream serving its model, and commits the results in chunks.
//! The same code runs in `nightshift serve` and as a Kubernetes Job's pod.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::{Future, StreamExt};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::call::{LineOutcome, call_upstream, echo};
use super::checkpoint::{ChunkWriter, ShardLedger};
use super::failure::{self, LineFailure};
use super::input::{RequestLines, parse_request};
use super::records::{error_line, line_id, output_line};
use super::upstream::Route;
use super::{ExecContext, ExecError};
use crate::batches::BatchSpec;
use crate::clock;
use crate::validate::Shard;

/// Commit at the latest when this many records wait, whatever the interval.
const MAX_CHUNK_RECORDS: usize = 4096;

/// How a shard run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardExit {
    /// Every request of the shard has a record.
    Finished,
    /// Dispatch stopped (cancel, expiry) with requests left unrecorded.
    Stopped,
}

type InFlight<'a> = Pin<Box<dyn Future<Output = (u32, String, LineOutcome)> + Send + 'a>>;

/// A request read ahead of dispatch, waiting for a permit of its upstream.
struct Ready {
    index: u32,
    custom_id: String,
    model: String,
    body: bytes::Bytes,
}

/// Runs `shard` of the batch until every request has a record, or until `stop` fires
/// or the batch expires; then lines in flight get `grace` to finish.
pub async fn run_shard(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: &Shard,
    ledger: &ShardLedger,
    stop: CancellationToken,
) -> Result<ShardExit, ExecError> {
    if ledger.is_complete() {
        return Ok(ShardExit::Finished);
    }
    let mut writer = ChunkWriter::new(ctx.store.clone(), spec.id.clone(), shard.index, ledger.next_seq());
    let range = shard.byte_start..shard.byte_end;
    let mut lines = RequestLines::new(ctx.files.open_data_range(&spec.project_id, &spec.input_file_id, range).await?);
    let expiry = deadline_at(spec.expires_at);

    let mut next_index: u32 = 0;
    let mut input_done = false;
    let mut ready: Option<Ready> = None;
    let mut in_flight: FuturesUnordered<InFlight<'_>> = FuturesUnordered::new();
    let mut dispatching = true;
    let mut grace_ends: Option<Instant> = None;
    let mut flush = tokio::time::interval(ctx.settings.checkpoint_interval);
    flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        // Read ahead to the next request that has no record yet, settling at once
        // those that need no upstream.
        while dispatching && ready.is_none() && !input_done {
            let Some(line) = lines.next_line().await? else {
                input_done = true;
                break;
            };
            let index = next_index;
            next_index += 1;
            if ledger.recorded.get(index as usize).copied().unwrap_or(true) {
                continue;
            }
            let Some(request) = parse_request(&line) else {
                let failure = LineFailure {
                    code: failure::FailureCode::InvalidRequestError,
                    message: "[legacy:http_400] The input line can no longer be read as a request".into(),
                    param: None,
                };
                record(
                    ctx,
                    spec,
                    shard,
                    &mut writer,
                    index,
                    &super::input::custom_id(&line),
                    LineOutcome::Failure(failure),
                );
                continue;
            };
            if let Route::Unserved = ctx.upstreams.route(&request.model) {
                let outcome = LineOutcome::Failure(failure::no_upstream(&request.model));
                record(ctx, spec, shard, &mut writer, index, &request.custom_id, outcome);
                continue;
            }
            ready = Some(Ready { index, custom_id: request.custom_id, model: request.model, body: request.body });
        }
        if writer.pending() >= MAX_CHUNK_RECORDS {
            writer.commit().await?;
        }
        if in_flight.is_empty() && (ready.is_none() || !dispatching) {
            break;
        }

        let permits = ready.as_ref().map(|r| match ctx.upstreams.route(&r.model) {
            Route::Upstream(upstream) => upstream.permits.clone(),
            _ => ctx.echo_permits.clone(),
        });
        tokio::select! {
            biased;
            _ = stop.cancelled(), if dispatching => {
                dispatching = false;
                grace_ends = Some(Instant::now() + ctx.settings.cancel_grace);
            }
            _ = tokio::time::sleep_until(expiry), if dispatching => {
                dispatching = false;
                grace_ends = Some(Instant::now() + ctx.settings.cancel_grace);
            }
            Some((index, custom_id, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                record(ctx, spec, shard, &mut writer, index, &custom_id, outcome);
            }
            _ = flush.tick() => {
                writer.commit().await?;
            }
            permit = acquire(permits), if dispatching && ready.is_some() => {
                let request = ready.take().expect("guarded by ready.is_some()");
                // Quota is checked at the last moment, once earlier lines have charged theirs.
                if ctx.quota.has_room(&spec.project_id) {
                    in_flight.push(dispatch(ctx, request, permit));
                } else {
                    let outcome = LineOutcome::Failure(failure::quota_exhausted());
                    record(ctx, spec, shard, &mut writer, request.index, &request.custom_id, outcome);
                }
            }
            _ = sleep_until_option(grace_ends), if grace_ends.is_some() => {
                // Lines still in flight are abandoned: they have no record, and the
                // drain that follows accounts for them.
                tracing::warn!(batch = %spec.id, shard = shard.index, abandoned = in_flight.len(), "grace period over");
                break;
            }
        }
    }
    writer.commit().await?;
    Ok(if dispatching && input_done && in_flight.is_empty() { ShardExit::Finished } else { ShardExit::Stopped })
}

fn deadline_at(expires_at: i64) -> Instant {
    let left = (expires_at - clock::now()).max(0) as u64;
    Instant::now() + Duration::from_secs(left)
}

async fn sleep_until_option(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn acquire(permits: Option<Arc<tokio::sync::Semaphore>>) -> OwnedSemaphorePermit {
    match permits {
        Some(permits) => permits.acquire_owned().await.expect("upstream semaphores are never closed"),
        None => std::future::pending().await,
    }
}

fn dispatch<'a>(ctx: &'a ExecContext, request: Ready, permit: OwnedSemaphorePermit) -> InFlight<'a> {
    Box::pin(async move {
        let outcome = match ctx.upstreams.route(&request.model) {
            Route::Upstream(upstream) => {
                let (outcome, stats) = call_upstream(&ctx.client, upstream, request.body).await;
                ctx.stats.record(stats);
                outcome
            }
            _ => echo(&request.body),
        };
        drop(permit);
        (request.index, request.custom_id, outcome)
    })
}

fn record(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: &Shard,
    writer: &mut ChunkWriter,
    index: u32,
    custom_id: &str,
    outcome: LineOutcome,
) {
    let id = line_id(&spec.id, shard.first_request + u64::from(index));
    match outcome {
        LineOutcome::Success { status, request_id, body, usage } => {
            ctx.quota.charge(&spec.project_id, &spec.id, usage.total_tokens);
            writer.push_output(index, &output_line(&id, custom_id, status, request_id.as_deref(), &body), usage);
        }
        LineOutcome::Failure(failure) => {
            writer.push_error(index, &error_line(&id, custom_id, &failure));
        }
    }
}
