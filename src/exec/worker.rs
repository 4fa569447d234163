//! The worker for one shard: reads only its byte range, sends each request not yet
//! recorded to the upstream serving its model, and commits the results in chunks.
//! The same code runs in `nightshift serve` and as a Kubernetes Job's pod.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::{Future, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::time::{Instant, Interval, Sleep};
use tokio_util::sync::CancellationToken;

use super::call::{LineOutcome, call_upstream};
use super::checkpoint::{ChunkWriter, Fence, Group, ShardLedger};
use super::classify::{Step, classify};
use super::echo::echo;
use super::failure;
use super::input::RequestLines;
use super::limiter::Limiter;
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
/// commits when the upstream is fast, at most this much added to a slow line. Every
/// round trip pays it before a permit is reused: 2 ms cost a 50-ms upstream 5–10% of
/// the plain client's rate at 16 to 256 in flight, 200 µs cost 1–6%, and the same CPU
/// per line at an instant upstream (docs/src/benchmarks.md).
const GROUP_WAIT: Duration = Duration::from_micros(200);

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
    /// `None`: taken back from the server's queue, to be sent again.
    outcome: Option<LineOutcome>,
    upstream: Option<usize>,
    body: bytes::Bytes,
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
    let writer = ChunkWriter::claim(ctx.store.clone(), spec.id.clone(), shard.index, ledger).await?;
    let range = shard.byte_start..shard.byte_end;
    let input = NumberedLines::new(ctx.files.open_data_range(&spec.project_id, &spec.input_file_id, range).await?);
    ShardRun::new(ctx, spec, shard, ledger, writer, input).run(&stop, dispatched).await
}

/// One run of a shard: what its loop keeps from one turn to the next.
struct ShardRun<'a> {
    ctx: &'a ExecContext,
    spec: &'a BatchSpec,
    shard: &'a Shard,
    ledger: &'a ShardLedger,
    writer: ChunkWriter,
    input: NumberedLines,
    /// The next request to send, read ahead.
    ready: Option<Ready>,
    /// Lines taken back from their server's queue, sent again before the next is read.
    taken_back: Vec<Ready>,
    in_flight: FuturesUnordered<InFlight<'a>>,
    /// Lines are still sent: neither stopped nor expired.
    dispatching: bool,
    /// Once dispatch stopped: when the lines still in flight are abandoned.
    grace_ends: Option<Instant>,
    /// Permits of lines recorded but not durable yet, and since when the first waits.
    awaiting: Vec<Held>,
    awaiting_since: Option<Instant>,
    /// Permits of lines made durable, free for the next lines.
    spares: Vec<Held>,
    committing: Option<Committing>,
    /// Timers made once and reset, not one per turn of the loop: registering a timer
    /// takes the time driver's lock, and the loop turns once per line.
    expiry: Pin<Box<Sleep>>,
    group_due: Pin<Box<Sleep>>,
    flush: Interval,
    flush_due: bool,
    /// A journal is synced at the checkpoint interval, with the commit under way then:
    /// one is due, and one was left out since the last sync.
    sync_due: bool,
    unsynced: bool,
    /// A granted worker whose allowance is spent holds its next line until more comes.
    grants: Option<watch::Receiver<(u64, bool)>>,
    waiting_for_tokens: bool,
    all_sent: bool,
}

/// What woke the loop.
enum Event {
    /// Stopped or expired: no more lines are sent.
    Stop,
    Committed(Result<Fence, StorageError>),
    Answered(Done),
    /// The checkpoint interval.
    Flush,
    Permit(OwnedSemaphorePermit),
    /// A group's wait or the allowance changed: look again.
    Look,
    GraceOver,
}

impl<'a> ShardRun<'a> {
    fn new(
        ctx: &'a ExecContext,
        spec: &'a BatchSpec,
        shard: &'a Shard,
        ledger: &'a ShardLedger,
        writer: ChunkWriter,
        input: NumberedLines,
    ) -> Self {
        let mut flush = tokio::time::interval(ctx.settings.checkpoint_interval);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            ctx,
            spec,
            shard,
            ledger,
            writer,
            input,
            ready: None,
            taken_back: Vec::new(),
            in_flight: FuturesUnordered::new(),
            dispatching: true,
            grace_ends: None,
            awaiting: Vec::new(),
            awaiting_since: None,
            spares: Vec::new(),
            committing: None,
            expiry: Box::pin(tokio::time::sleep_until(deadline_at(spec.expires_at))),
            group_due: Box::pin(tokio::time::sleep(Duration::ZERO)),
            flush,
            flush_due: false,
            sync_due: false,
            unsynced: false,
            grants: ctx.quota.grants(),
            waiting_for_tokens: false,
            all_sent: false,
        }
    }

    async fn run(
        mut self,
        stop: &CancellationToken,
        dispatched: &(dyn Fn() + Send + Sync),
    ) -> Result<ShardExit, ExecError> {
        loop {
            self.read_ahead().await?;
            if !self.all_sent && self.ready.is_none() && (self.input.done || !self.dispatching) {
                self.all_sent = true;
                dispatched();
            }
            self.start_commit();
            let nothing_to_send = !self.dispatching || (self.ready.is_none() && self.input.done);
            if self.in_flight.is_empty() && self.committing.is_none() && nothing_to_send {
                break;
            }
            if self.send_on_spare() {
                continue;
            }
            self.spares.clear();
            match self.next_event(stop).await {
                Event::Stop => {
                    self.dispatching = false;
                    self.grace_ends = Some(Instant::now() + self.ctx.settings.cancel_grace);
                }
                Event::Committed(fence) => {
                    let done = self.committing.take().expect("a commit was under way");
                    match fence? {
                        Fence::Owner => self.spares.extend(done.permits),
                        Fence::Superseded => return Ok(superseded(self.spec, self.shard, self.in_flight.len())),
                    }
                }
                Event::Answered(done) => self.answered(done),
                Event::Flush => {
                    self.flush_due = true;
                    self.sync_due = self.unsynced;
                }
                Event::Permit(permit) => {
                    let request = self.ready.take().expect("a permit is asked for a ready line");
                    self.send(request, permit);
                }
                Event::Look => {}
                Event::GraceOver => {
                    // Lines still in flight are abandoned: they have no record, and the
                    // drain that follows accounts for them.
                    let abandoned = self.in_flight.len();
                    tracing::warn!(batch = %self.spec.id, shard = self.shard.index, abandoned, "grace period over");
                    break;
                }
            }
        }
        self.finish().await
    }

    /// Reads ahead to the next request that has no record yet, settling at once those
    /// that need no upstream.
    async fn read_ahead(&mut self) -> Result<(), ExecError> {
        if self.dispatching && self.ready.is_none() {
            self.ready = self.taken_back.pop();
        }
        while self.dispatching && self.ready.is_none() && !full(&self.writer) {
            let Some((index, line)) = self.input.next().await? else { break };
            let recorded = self.ledger.recorded.get(index as usize).copied().unwrap_or(true);
            match classify(&line, recorded, |model| self.ctx.upstreams.route(model)) {
                Step::Recorded => {}
                Step::Settle { custom_id, failure } => {
                    let outcome = LineOutcome::Failure(failure);
                    record(self.ctx, self.spec, self.shard, &mut self.writer, index, &custom_id, outcome);
                }
                Step::Send { custom_id, upstream, body } => {
                    self.ready = Some(Ready { index, custom_id, upstream, body });
                }
            }
        }
        Ok(())
    }

    /// Starts a group commit, if none is under way and one is due: enough lines wait
    /// for it, or the first has waited long enough, or the interval came, or the chunk
    /// is full, or dispatch stopped.
    fn start_commit(&mut self) {
        let group_ready = !self.awaiting.is_empty()
            && (self.awaiting.len() >= self.in_flight.len()
                || self.awaiting_since.is_some_and(|since| since.elapsed() >= GROUP_WAIT));
        let due = group_ready || self.flush_due || full(&self.writer) || !self.dispatching;
        if self.committing.is_some() || !due {
            return;
        }
        let Some(mut group) = self.writer.take_group() else { return };
        group.sync = std::mem::take(&mut self.sync_due);
        self.unsynced = !group.sync;
        let group = Arc::new(group);
        let write = Box::pin(commit_durably(group.clone(), self.spec.id.clone(), self.shard.index, None));
        self.committing = Some(Committing { group, write, permits: std::mem::take(&mut self.awaiting) });
        self.awaiting_since = None;
        self.flush_due = false;
    }

    /// A permit that a commit just freed goes to the next line of the same upstream
    /// on the spot: at full concurrency this is the common case, and it saves a
    /// wake-up of another task per line (the others go back to their upstreams).
    /// Whether a line went.
    fn send_on_spare(&mut self) -> bool {
        if !self.dispatching || self.waiting_for_tokens {
            return false;
        }
        let Some(request) = self.ready.take() else { return false };
        match take_spare(self.ctx, &mut self.spares, request.upstream) {
            Some(permit) => {
                self.send(request, permit);
                true
            }
            None => {
                self.ready = Some(request);
                false
            }
        }
    }

    fn send(&mut self, request: Ready, permit: OwnedSemaphorePermit) {
        self.ready = launch(self.ctx, self.spec, self.shard, &mut self.writer, &mut self.in_flight, request, permit);
        self.waiting_for_tokens = self.ready.is_some();
    }

    fn answered(&mut self, done: Done) {
        // A line in flight no longer counts against the allowance: look again.
        self.waiting_for_tokens = false;
        let Some(outcome) = done.outcome else {
            // Its permit goes back: the cap that took the line back has room for fewer.
            let Done { index, custom_id, upstream, body, .. } = done;
            self.taken_back.push(Ready { index, custom_id, upstream, body });
            return;
        };
        record(self.ctx, self.spec, self.shard, &mut self.writer, done.index, &done.custom_id, outcome);
        self.awaiting.push((done.upstream, done.permit));
        if self.awaiting_since.is_none() {
            let now = Instant::now();
            self.awaiting_since = Some(now);
            self.group_due.as_mut().reset(now + GROUP_WAIT);
        }
    }

    /// Waits for what comes first: stop or expiry, a commit done, a line answered, a
    /// timer, a permit for the ready line, more allowance, the grace period's end.
    async fn next_event(&mut self, stop: &CancellationToken) -> Event {
        // A line waiting for its upstream is counted as queued, so that other shards
        // hand their spare permits back instead of keeping them.
        let mut queued = None;
        let wants_permit = self.dispatching && !self.waiting_for_tokens;
        let ctx = self.ctx;
        let permits = self.ready.as_ref().map(|ready| match ready.upstream {
            Some(position) => {
                let limiter = &ctx.upstreams.get(position).limiter;
                limiter.want();
                if wants_permit {
                    queued = Some(limiter.queue());
                }
                Permits::Upstream(limiter)
            }
            None => Permits::Echo(ctx.echo_permits.clone()),
        });
        let waiting = self.committing.is_none() && self.awaiting_since.is_some();
        let event = tokio::select! {
            biased;
            _ = stop.cancelled(), if self.dispatching => Event::Stop,
            () = &mut self.expiry, if self.dispatching => Event::Stop,
            fence = commit_done(&mut self.committing) => Event::Committed(fence),
            Some(done) = self.in_flight.next(), if !self.in_flight.is_empty() => Event::Answered(done),
            () = &mut self.group_due, if waiting => Event::Look,
            _ = self.flush.tick() => Event::Flush,
            permit = acquire(permits), if wants_permit && self.ready.is_some() => Event::Permit(permit),
            () = next_grant(&mut self.grants), if self.waiting_for_tokens => {
                self.waiting_for_tokens = false;
                Event::Look
            }
            _ = sleep_until_option(self.grace_ends), if self.grace_ends.is_some() => Event::GraceOver,
        };
        drop(queued);
        event
    }

    /// What is recorded is committed, with a few tries left for storage (a commit
    /// still trying when the grace period ended is tried again from the start).
    async fn finish(mut self) -> Result<ShardExit, ExecError> {
        let unfinished = self.committing.take().map(|committing| committing.group);
        let last = self.writer.take_group().map(|mut group| {
            group.sync = true;
            Arc::new(group)
        });
        let synced = last.is_some();
        for group in unfinished.into_iter().chain(last) {
            let fence = commit_durably(group, self.spec.id.clone(), self.shard.index, Some(FINAL_ATTEMPTS)).await?;
            if fence == Fence::Superseded {
                return Ok(superseded(self.spec, self.shard, 0));
            }
        }
        if self.unsynced
            && !synced
            && let Some(journal) = self.writer.journal()
        {
            self.ctx.store.sync(journal).await?;
        }
        let finished = self.dispatching && self.input.done && self.in_flight.is_empty();
        Ok(if finished { ShardExit::Finished } else { ShardExit::Stopped })
    }
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

/// Where a ready line takes its permit.
enum Permits<'a> {
    Upstream(&'a Limiter),
    /// Lines answered in process (`echo`).
    Echo(Arc<tokio::sync::Semaphore>),
}

async fn acquire(permits: Option<Permits<'_>>) -> OwnedSemaphorePermit {
    match permits {
        Some(Permits::Upstream(limiter)) => limiter.acquire().await,
        Some(Permits::Echo(permits)) => permits.acquire_owned().await.expect("echo's semaphore is never closed"),
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
        let Ready { index, custom_id, upstream, body } = request;
        let outcome = match upstream {
            Some(position) => {
                let upstream = ctx.upstreams.get(position);
                call_upstream(&ctx.client, upstream, &spec.endpoint, body.clone(), spec.priority).await
            }
            None => Some(echo(&spec.endpoint, &body)),
        };
        Done { index, custom_id, outcome, upstream, body, permit }
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
