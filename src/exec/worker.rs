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

use super::call::{LineOutcome, call_upstream};
use super::checkpoint::{ChunkWriter, Fence, Group, ShardLedger};
use super::classify::{Step, classify};
use super::echo::echo;
use super::failure;
use super::input::RequestLines;
use super::records::{error_line, line_id, write_output_line};
use super::{ExecContext, ExecError};
use crate::batches::BatchSpec;
use crate::clock;
use crate::metrics::METRICS;
use crate::quota::Room;
use crate::storage::StorageError;
use crate::validate::Shard;

/// Commit at the latest when this many records, or this many bytes of them, wait,
/// whatever the interval: a worker's memory stays bounded whatever the responses.
const MAX_CHUNK_RECORDS: usize = 4096;
const MAX_CHUNK_BYTES: usize = 4 * 1024 * 1024;
/// How a failing commit is tried again: backoff from the first delay to the cap, and
/// how many tries the last commit of a stopping run gets.
const COMMIT_RETRY_FIRST: Duration = Duration::from_millis(50);
const COMMIT_RETRY_MAX: Duration = Duration::from_secs(5);
const FINAL_ATTEMPTS: u32 = 3;
/// A group commit starts once the lines waiting for it are at least as many as those
/// still in flight, or once the first of them has waited this long: fewer, larger
/// commits when the upstream is fast, at most this much added to a slow line.
const GROUP_WAIT: Duration = Duration::from_millis(2);

/// How a shard run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardExit {
    /// Every request of the shard has a record.
    Finished,
    /// Dispatch stopped (cancel, expiry) with requests left unrecorded.
    Stopped,
    /// A newer run claimed the shard: this one stopped at once (`super::owner`).
    Superseded,
}

/// A line in flight; it hands its permit back when done, so that the worker can
/// send its next line on it at once instead of waking another task for it.
type InFlight<'a> = Pin<Box<dyn Future<Output = Done> + Send + 'a>>;

struct Done {
    index: u32,
    custom_id: String,
    outcome: LineOutcome,
    upstream: Option<usize>,
    permit: OwnedSemaphorePermit,
}

/// A permit of a line that finished, with its upstream by position (`None`: echo).
type Held = (Option<usize>, OwnedSemaphorePermit);

/// The group commit under way, and the permits of the lines whose records it makes
/// durable: they go to the next lines only once it has.
struct Committing {
    group: Arc<Group>,
    write: Pin<Box<dyn Future<Output = Result<Fence, StorageError>> + Send>>,
    permits: Vec<Held>,
}

/// A request read ahead of dispatch, waiting for a permit of its upstream.
struct Ready {
    index: u32,
    custom_id: String,
    /// Its upstream by position, `None` for the built-in echo model.
    upstream: Option<usize>,
    body: bytes::Bytes,
}

/// Runs `shard` of the batch until every request has a record, or until `stop` fires
/// or the batch expires; then lines in flight get `grace` to finish. `dispatched` is
/// called once no line is left to send (only lines in flight to finish and commit):
/// `serve` then lets another shard take this one's slot.
///
/// A line's record is durable before its permit goes to another line: records are
/// group-committed (one commit writes every record that finished while the previous
/// one was written), so a crash re-sends only the lines that were in flight. Lines
/// settled without the upstream (invalid, no route) cost nothing to redo and wait for
/// the checkpoint interval, or for a commit that lines in flight need anyway.
pub async fn run_shard(
    ctx: &ExecContext,
    spec: &BatchSpec,
    shard: &Shard,
    ledger: &ShardLedger,
    stop: CancellationToken,
    dispatched: &(dyn Fn() + Send + Sync),
) -> Result<ShardExit, ExecError> {
    if ledger.is_complete() {
        return Ok(ShardExit::Finished);
    }
    let mut writer = ChunkWriter::claim(ctx.store.clone(), spec.id.clone(), shard.index, ledger).await?;
    let range = shard.byte_start..shard.byte_end;
    let mut input = NumberedLines::new(ctx.files.open_data_range(&spec.project_id, &spec.input_file_id, range).await?);
    // Timers made once and reset, not one per turn of the loop: registering a timer
    // takes the time driver's lock, and the loop turns once per line.
    let expiry = tokio::time::sleep_until(deadline_at(spec.expires_at));
    tokio::pin!(expiry);
    let group_due = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(group_due);

    let mut ready: Option<Ready> = None;
    let mut in_flight: FuturesUnordered<InFlight<'_>> = FuturesUnordered::new();
    let mut dispatching = true;
    let mut grace_ends: Option<Instant> = None;
    // Permits of lines recorded but not durable yet, and of lines made durable, free
    // for the next lines.
    let mut awaiting: Vec<Held> = Vec::new();
    let mut spares: Vec<Held> = Vec::new();
    let mut committing: Option<Committing> = None;
    let mut awaiting_since: Option<Instant> = None;
    let mut flush = tokio::time::interval(ctx.settings.checkpoint_interval);
    flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut flush_due = false;
    let (mut sync_due, mut unsynced) = (false, false);
    // A granted worker whose allowance is spent holds its next line until more comes.
    let mut grants = ctx.quota.grants();
    let mut waiting_for_tokens = false;
    let mut all_sent = false;

    loop {
        // Read ahead to the next request that has no record yet, settling at once
        // those that need no upstream.
        while dispatching && ready.is_none() && !full(&writer) {
            let Some((index, line)) = input.next().await? else { break };
            let recorded = ledger.recorded.get(index as usize).copied().unwrap_or(true);
            match classify(&line, recorded, |model| ctx.upstreams.route(model)) {
                Step::Recorded => {}
                Step::Settle { custom_id, failure } => {
                    record(ctx, spec, shard, &mut writer, index, &custom_id, LineOutcome::Failure(failure));
                }
                Step::Send { custom_id, upstream, body } => ready = Some(Ready { index, custom_id, upstream, body }),
            }
        }
        if !all_sent && ready.is_none() && (input.done || !dispatching) {
            all_sent = true;
            dispatched();
        }
        let group_ready = !awaiting.is_empty()
            && (awaiting.len() >= in_flight.len() || awaiting_since.is_some_and(|since| since.elapsed() >= GROUP_WAIT));
        if committing.is_none()
            && (group_ready || flush_due || full(&writer) || !dispatching)
            && let Some(mut group) = writer.take_group()
        {
            // A journal is synced at the checkpoint interval, with the commit under way then.
            group.sync = std::mem::take(&mut sync_due);
            unsynced = !group.sync;
            let group = Arc::new(group);
            let write = Box::pin(commit_durably(group.clone(), spec.id.clone(), shard.index, None));
            committing = Some(Committing { group, write, permits: std::mem::take(&mut awaiting) });
            awaiting_since = None;
            flush_due = false;
        }
        if in_flight.is_empty() && committing.is_none() && (!dispatching || (ready.is_none() && input.done)) {
            break;
        }
        // A permit that a commit just freed goes to the next line of the same upstream
        // on the spot: at full concurrency this is the common case, and it saves a
        // wake-up of another task per line. The others go back to their upstreams.
        if dispatching
            && !waiting_for_tokens
            && let Some(request) = ready.take()
        {
            match take_spare(ctx, &mut spares, request.upstream) {
                Some(permit) => {
                    ready = launch(ctx, spec, shard, &mut writer, &mut in_flight, request, permit);
                    waiting_for_tokens = ready.is_some();
                    continue;
                }
                None => ready = Some(request),
            }
        }
        spares.clear();

        // A line waiting for its upstream is counted as queued, so that other shards
        // hand their spare permits back instead of keeping them.
        let mut queued = None;
        let permits = ready.as_ref().map(|r| match r.upstream {
            Some(position) => {
                let limiter = &ctx.upstreams.get(position).limiter;
                limiter.want();
                if dispatching && !waiting_for_tokens {
                    queued = Some(limiter.queue());
                }
                limiter.semaphore().clone()
            }
            None => ctx.echo_permits.clone(),
        });
        tokio::select! {
            biased;
            _ = stop.cancelled(), if dispatching => {
                dispatching = false;
                grace_ends = Some(Instant::now() + ctx.settings.cancel_grace);
            }
            () = &mut expiry, if dispatching => {
                dispatching = false;
                grace_ends = Some(Instant::now() + ctx.settings.cancel_grace);
            }
            fence = commit_done(&mut committing) => {
                let done = committing.take().expect("a commit was under way");
                match fence? {
                    Fence::Owner => spares.extend(done.permits),
                    Fence::Superseded => return Ok(superseded(spec, shard, in_flight.len())),
                }
            }
            Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                // A line in flight no longer counts against the allowance: look again.
                waiting_for_tokens = false;
                record(ctx, spec, shard, &mut writer, done.index, &done.custom_id, done.outcome);
                awaiting.push((done.upstream, done.permit));
                if awaiting_since.is_none() {
                    let now = Instant::now();
                    awaiting_since = Some(now);
                    group_due.as_mut().reset(now + GROUP_WAIT);
                }
            }
            () = &mut group_due, if committing.is_none() && awaiting_since.is_some() => {}
            _ = flush.tick() => {
                flush_due = true;
                sync_due = unsynced;
            }
            permit = acquire(permits), if dispatching && ready.is_some() && !waiting_for_tokens => {
                let request = ready.take().expect("guarded by ready.is_some()");
                ready = launch(ctx, spec, shard, &mut writer, &mut in_flight, request, permit);
                waiting_for_tokens = ready.is_some();
            }
            () = next_grant(&mut grants), if waiting_for_tokens => {
                waiting_for_tokens = false;
            }
            _ = sleep_until_option(grace_ends), if grace_ends.is_some() => {
                // Lines still in flight are abandoned: they have no record, and the
                // drain that follows accounts for them.
                tracing::warn!(batch = %spec.id, shard = shard.index, abandoned = in_flight.len(), "grace period over");
                break;
            }
        }
        drop(queued);
    }
    // What is recorded is committed, with a few tries left for storage (a commit
    // still trying when the grace period ended is tried again from the start).
    let unfinished = committing.take().map(|committing| committing.group);
    let last = writer.take_group().map(|mut group| {
        group.sync = true;
        Arc::new(group)
    });
    let synced = last.is_some();
    for group in unfinished.into_iter().chain(last) {
        if commit_durably(group, spec.id.clone(), shard.index, Some(FINAL_ATTEMPTS)).await? == Fence::Superseded {
            return Ok(superseded(spec, shard, 0));
        }
    }
    if unsynced
        && !synced
        && let Some(journal) = writer.journal()
    {
        ctx.store.sync(journal).await?;
    }
    Ok(if dispatching && input.done && in_flight.is_empty() { ShardExit::Finished } else { ShardExit::Stopped })
}

/// Whether the records waiting are as many as a chunk may hold.
fn full(writer: &ChunkWriter) -> bool {
    writer.pending() >= MAX_CHUNK_RECORDS || writer.pending_bytes() >= MAX_CHUNK_BYTES
}

/// A freed permit for a line of `upstream`, unless its limiter is taking permits back
/// or lines of other shards wait for one.
fn take_spare(ctx: &ExecContext, spares: &mut Vec<Held>, upstream: Option<usize>) -> Option<OwnedSemaphorePermit> {
    let reusable = upstream.is_none_or(|position| ctx.upstreams.get(position).limiter.may_reuse());
    let position = spares.iter().position(|(of, _)| *of == upstream).filter(|_| reusable)?;
    Some(spares.swap_remove(position).1)
}

fn superseded(spec: &BatchSpec, shard: &Shard, abandoned: usize) -> ShardExit {
    METRICS.superseded_runs.inc();
    tracing::warn!(batch = %spec.id, shard = shard.index, abandoned, "a newer run owns the shard; this one stops");
    ShardExit::Superseded
}

/// Commits `group`, trying again with backoff while storage fails: forever while the
/// shard runs (dispatch pauses, since the permits wait for it), `attempts` times at the
/// end of the run.
async fn commit_durably(
    group: Arc<Group>,
    batch: crate::ids::BatchId,
    shard: u32,
    attempts: Option<u32>,
) -> Result<Fence, StorageError> {
    let mut delay = COMMIT_RETRY_FIRST;
    let mut attempt = 0;
    loop {
        attempt += 1;
        match group.commit().await {
            Ok(fence) => return Ok(fence),
            Err(error) if attempts.is_some_and(|attempts| attempt >= attempts) => return Err(error),
            Err(error) => {
                METRICS.commit_retries.inc();
                tracing::warn!(%batch, shard, attempt, %error, "commit failed; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(COMMIT_RETRY_MAX);
            }
        }
    }
}

/// Resolves when the commit under way is done (never without one).
async fn commit_done(committing: &mut Option<Committing>) -> Result<Fence, StorageError> {
    match committing {
        Some(committing) => (&mut committing.write).await,
        None => std::future::pending().await,
    }
}

/// The shard's lines, numbered from 0 as its ledger counts them.
struct NumberedLines {
    lines: RequestLines,
    next: u32,
    done: bool,
}

impl NumberedLines {
    fn new(stream: crate::storage::ByteStream) -> Self {
        Self { lines: RequestLines::new(stream), next: 0, done: false }
    }

    async fn next(&mut self) -> Result<Option<(u32, bytes::Bytes)>, ExecError> {
        if self.done {
            return Ok(None);
        }
        match self.lines.next_line().await? {
            Some(line) => {
                self.next += 1;
                Ok(Some((self.next - 1, line)))
            }
            None => {
                self.done = true;
                Ok(None)
            }
        }
    }
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

/// Resolves when the worker's token grant changes (never without grants).
async fn next_grant(grants: &mut Option<tokio::sync::watch::Receiver<(u64, bool)>>) {
    let changed = match grants {
        Some(grants) => grants.changed().await.is_ok(),
        None => false,
    };
    if !changed {
        std::future::pending::<()>().await;
    }
}

/// Sends a line on `permit`, unless the project's quota is used up (the line fails)
/// or this worker's allowance of it is (the line is handed back, to wait for more):
/// checked at the last moment, once the lines before have charged theirs.
fn launch<'a>(
    ctx: &'a ExecContext,
    spec: &'a BatchSpec,
    shard: &Shard,
    writer: &mut ChunkWriter,
    in_flight: &mut FuturesUnordered<InFlight<'a>>,
    request: Ready,
    permit: OwnedSemaphorePermit,
) -> Option<Ready> {
    match ctx.quota.room(&spec.project_id, in_flight.len()) {
        Room::Yes => {}
        Room::Wait => return Some(request),
        Room::No => {
            let outcome = LineOutcome::Failure(failure::quota_exhausted());
            record(ctx, spec, shard, writer, request.index, &request.custom_id, outcome);
            return None;
        }
    }
    in_flight.push(Box::pin(async move {
        let outcome = match request.upstream {
            Some(position) => {
                call_upstream(&ctx.client, ctx.upstreams.get(position), &spec.endpoint, request.body).await
            }
            None => echo(&spec.endpoint, &request.body),
        };
        Done { index: request.index, custom_id: request.custom_id, outcome, upstream: request.upstream, permit }
    }));
    None
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
            METRICS.line_completed();
            METRICS.tokens_used(spec.project_id.as_str(), usage.total_tokens);
            ctx.quota.charge(&spec.project_id, &spec.id, usage.total_tokens);
            writer.push_output_with(index, usage, |buffer| {
                write_output_line(buffer, &id, custom_id, status, request_id.as_deref(), &body);
            });
        }
        LineOutcome::Failure(failure) => {
            METRICS.line_failed(failure.code.as_str());
            writer.push_error(index, failure.code.as_str(), &error_line(&id, custom_id, &failure));
        }
    }
}
