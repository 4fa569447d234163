//! The Batch controller: a kube-runtime Controller that drives every Batch through its
//! lifecycle with the one driver ([`crate::drive`]), as the runtime whose workers are
//! one Job per shard. Status is written with server-side apply under one field manager,
//! guarded by the resourceVersion it was decided from, so a cancel written by the API
//! in between is never overwritten.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::finalizer::{Event as Finalizing, finalizer};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::admission::allotment;
use super::context::{Context, FIELD_MANAGER, Stopped};
use super::crd::{BATCH_LABEL, BatchResource, resource_name};
use super::error::ControllerError;
use super::guard::valid_only;
use super::jobs::{is_running_worker, job_attempt, job_shard, job_workers, shard_job};
use super::store::{apply_status, to_batch};
use crate::batches::{Batch, BatchState};
use crate::clock;
use crate::drive::{News, Next, Runtime, WorkerPhase, drive};
use crate::exec::ExecError;
use crate::exec::checkpoint::ShardLedger;
use crate::grants::{read_ack, read_grant};
use crate::lifecycle::decide as decisions;
use crate::metrics::{METRICS, ReasonLabel};
use crate::validate::Shard;

/// Removes a Batch's shard data from object storage before the Batch goes.
pub const FINALIZER: &str = "nightshift.dev/storage-cleanup";
/// Batches reconciled at the same time.
const RECONCILE_CONCURRENCY: u16 = 16;
/// How often a running batch is looked at again: live counts come from checkpoints.
const PROGRESS_REQUEUE: Duration = Duration::from_secs(2);
/// How long a Batch may stay without a status before the controller writes the one its
/// api would have: the api writes it right after creating the Batch, so a Batch still
/// without one after this long lost its api in between.
const STATUSLESS_GRACE: Duration = Duration::from_secs(10);

/// Watch caches of the controller: Batches and their Jobs, shared by the reconciler
/// and the loops beside it. The streams feed the caches as the controller polls them.
pub struct Caches<B, J> {
    pub batches: Store<BatchResource>,
    pub jobs: Store<Job>,
    batch_stream: B,
    job_stream: J,
    /// Batches that failed to decode, left out of `batches` (see [`super::guard`]).
    invalid: mpsc::UnboundedReceiver<InvalidObject>,
}

/// Managed fields are the bulk of an object the controller keeps (every field of the
/// status, per manager) and it never reads them: dropped on the way in, they no
/// longer weigh on a cache of thousands of Batches.
fn without_managed_fields<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

pub fn caches(
    client: &Client,
    namespace: &str,
) -> Caches<
    impl futures_util::Stream<Item = Result<BatchResource, watcher::Error>> + Send + 'static,
    impl futures_util::Stream<Item = Result<Job, watcher::Error>> + Send + 'static,
> {
    let (batches, batch_writer) = reflector::store();
    let (report, invalid) = mpsc::unbounded_channel();
    let guarded = watcher(
        Api::<DeserializeGuard<BatchResource>>::namespaced(client.clone(), namespace),
        watcher::Config::default(),
    )
    .default_backoff();
    let batch_stream = valid_only(guarded, move |object| {
        let _ = report.send(object);
    })
    .modify(without_managed_fields)
    .reflect(batch_writer)
    .applied_objects();
    let (jobs, job_writer) = reflector::store();
    let job_stream =
        watcher(Api::<Job>::namespaced(client.clone(), namespace), watcher::Config::default().labels(BATCH_LABEL))
            .default_backoff()
            .modify(without_managed_fields)
            .reflect(job_writer)
            .touched_objects();
    Caches { batches, jobs, batch_stream, job_stream, invalid }
}

/// Runs the controller until a shutdown signal.
pub async fn run<B, J>(ctx: Arc<Context>, caches: Caches<B, J>)
where
    B: futures_util::Stream<Item = Result<BatchResource, watcher::Error>> + Send + 'static,
    J: futures_util::Stream<Item = Result<Job, watcher::Error>> + Send + 'static,
{
    // Bounded concurrency: a restart over thousands of Batches reconciles them a few at
    // a time instead of all at once (memory, and the API server's patience).
    let config = kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY);
    let reporter = tokio::spawn(report_invalid(ctx.clone(), caches.invalid));
    Controller::for_stream(caches.batch_stream, caches.batches)
        .with_config(config)
        .owns_stream(caches.job_stream)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "reconcile did not complete");
            }
        })
        .await;
    reporter.abort();
}

/// A Warning Event `InvalidObject` on each Batch that fails to decode, once per version.
async fn report_invalid(ctx: Arc<Context>, mut invalid: mpsc::UnboundedReceiver<InvalidObject>) {
    let mut reported = std::collections::HashSet::new();
    while let Some(object) = invalid.recv().await {
        let meta = &object.metadata;
        if !reported.insert((meta.uid.clone(), meta.resource_version.clone())) {
            continue;
        }
        tracing::warn!(batch = ?meta.name, error = %object.error, "a Batch that does not decode is left alone");
        let reference = ObjectReference {
            api_version: Some(BatchResource::api_version(&()).into_owned()),
            kind: Some(BatchResource::kind(&()).into_owned()),
            name: meta.name.clone(),
            namespace: meta.namespace.clone(),
            uid: meta.uid.clone(),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: "InvalidObject".into(),
            note: Some(format!("left alone: it does not decode ({})", object.error)),
            action: "InvalidObject".into(),
            secondary: None,
        };
        if let Err(error) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(%error, "could not publish an event");
        }
    }
}

/// Starts a watch cache of `api` (filtered by `config`) and waits for its first sync.
pub async fn cache<K>(api: Api<K>, config: watcher::Config) -> anyhow::Result<Store<K>>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let stream =
        watcher(api, config).default_backoff().modify(without_managed_fields).reflect(writer).applied_objects();
    tokio::spawn(async move {
        futures_util::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Err(error) = event {
                tracing::warn!(%error, "watch interrupted; retrying");
            }
        }
    });
    store.wait_until_ready().await?;
    Ok(store)
}

/// One pass over a Batch, in a span that names it, timed and counted by outcome.
async fn reconcile(batch: Arc<BatchResource>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    let started = Instant::now();
    let span = tracing::info_span!("reconcile", batch = %batch.name_any());
    let result = reconcile_once(batch, ctx).instrument(span).await;
    METRICS.reconciles.duration.observe(started.elapsed().as_secs_f64());
    if let Some(reason) = result.as_ref().err().and_then(ControllerError::reason) {
        METRICS.reconciles.errors.get_or_create(&ReasonLabel { reason }).inc();
    }
    result
}

async fn reconcile_once(batch: Arc<BatchResource>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    let resource = batch.clone();
    match reconcile_finalized(batch, &ctx).await {
        Err(error) if error.is_permanent() => {
            tracing::error!(batch = %resource.name_any(), %error, "reconcile failed for good; waiting for a change");
            ctx.event(&resource, EventType::Warning, "ReconcileFailed", format!("{error}; waiting for a change")).await;
            Ok(Action::await_change())
        }
        other => other,
    }
}

async fn reconcile_finalized(batch: Arc<BatchResource>, ctx: &Context) -> Result<Action, ControllerError> {
    finalizer(&ctx.batches(), FINALIZER, batch, |event| async {
        match event {
            Finalizing::Apply(batch) => apply(&batch, ctx).await,
            Finalizing::Cleanup(batch) => cleanup(&batch, ctx).await,
        }
    })
    .await
    .map_err(|error| match error {
        kube::runtime::finalizer::Error::ApplyFailed(error) | kube::runtime::finalizer::Error::CleanupFailed(error) => {
            error
        }
        other => ControllerError::Finalizer(other.to_string()),
    })
}

/// Transient failures (the API server, storage) are retried with a pause; a step
/// that waits is looked at again soon.
fn error_policy(batch: Arc<BatchResource>, error: &ControllerError, _ctx: Arc<Context>) -> Action {
    if let ControllerError::Waiting(what) = error {
        tracing::debug!(batch = %batch.name_any(), what, "waiting");
        return Action::requeue(Duration::from_secs(1));
    }
    if let ControllerError::Finalizer(_) = error {
        // Most often our cache was behind the finalizer we added a moment ago.
        tracing::debug!(batch = %batch.name_any(), %error, "finalizer patch refused; retrying");
        return Action::requeue(Duration::from_millis(500));
    }
    tracing::warn!(batch = %batch.name_any(), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

async fn apply(resource: &BatchResource, ctx: &Context) -> Result<Action, ControllerError> {
    let finished = resource.status.as_ref().and_then(BatchState::finished_at);
    if let Some(finished_at) = finished {
        return after_finish(resource, finished_at, ctx).await;
    }
    if resource.accepted().is_none() {
        return super::accept::accept(resource, ctx).await;
    }
    if resource.status.is_none() {
        return recover_statusless(resource, ctx).await;
    }
    forget_statusless(resource, ctx);
    drive_pass(resource, ctx).await
}

/// One pass of the driver over an accepted Batch with a status.
async fn drive_pass(resource: &BatchResource, ctx: &Context) -> Result<Action, ControllerError> {
    let (Some(batch), Some(key)) = (to_batch(resource), resource.key()) else {
        return Ok(Action::await_change());
    };
    let jobs = ctx.jobs.state().into_iter().filter(|job| job.labels().get(BATCH_LABEL) == Some(&key)).collect();
    let runtime = KubeRuntime { ctx, resource: Mutex::new(Arc::new(resource.clone())), jobs };
    let expires_at = batch.spec.expires_at;
    Ok(match drive(&runtime, &ctx.exec, batch).await? {
        Next::Now => Action::requeue(Duration::ZERO),
        Next::Shortly => Action::requeue(Duration::from_secs(1)),
        Next::AtPace => {
            let until_expiry = Duration::from_secs((expires_at - clock::now()).max(0) as u64);
            Action::requeue(PROGRESS_REQUEUE.min(until_expiry + Duration::from_millis(100)))
        }
        Next::Done => Action::await_change(),
    })
}

/// A finished Batch is deleted once its `ttlSecondsAfterFinished` passed.
async fn after_finish(resource: &BatchResource, finished_at: i64, ctx: &Context) -> Result<Action, ControllerError> {
    let Some(ttl) = resource.spec.ttl_seconds_after_finished else {
        return Ok(Action::await_change());
    };
    match decisions::time_to_live(finished_at, ttl, clock::now()) {
        Some(left) => Ok(Action::requeue(left)),
        None => {
            if resource.metadata.deletion_timestamp.is_none() {
                let note = format!("finished {}s ago; ttlSecondsAfterFinished is {ttl}", clock::now() - finished_at);
                ctx.event(resource, EventType::Normal, "Expired", note).await;
                let params =
                    DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
                match ctx.batches().delete(&resource.name_any(), &params).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(error) => return Err(error.into()),
                }
            }
            Ok(Action::await_change())
        }
    }
}

/// The api writes a Batch's first status right after creating it; one still without a
/// status after [`STATUSLESS_GRACE`] (timed from when this controller first saw it, so
/// no other host's clock is read) gets the status its api would have written.
async fn recover_statusless(resource: &BatchResource, ctx: &Context) -> Result<Action, ControllerError> {
    let waited = {
        let mut seen = ctx.statusless.lock().expect("statusless");
        seen.entry(resource.uid().unwrap_or_default()).or_insert_with(Instant::now).elapsed()
    };
    if waited < STATUSLESS_GRACE {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let Some(spec) = resource.accepted() else { return Ok(Action::await_change()) };
    let state = decisions::recovered_state(spec, clock::now());
    if write_status(resource, &state, ctx).await?.is_some() {
        let note = format!(
            "no status {}s after it was seen: its api stopped before writing it; now {}",
            STATUSLESS_GRACE.as_secs(),
            state.status.as_str()
        );
        ctx.event(resource, EventType::Warning, "StatusRecovered", note).await;
    }
    forget_statusless(resource, ctx);
    Ok(Action::requeue(Duration::ZERO))
}

/// Most Batches are seen once without a status (the create event comes before the api's
/// status write): they are forgotten as soon as one has a status.
fn forget_statusless(resource: &BatchResource, ctx: &Context) {
    let mut seen = ctx.statusless.lock().expect("statusless");
    if !seen.is_empty()
        && let Some(uid) = resource.uid()
    {
        seen.remove(&uid);
    }
}

/// One pass's runtime: the Batch's shard Jobs as the cache had them, and the Batch
/// resource as last written (its resourceVersion guards the next status write).
struct KubeRuntime<'a> {
    ctx: &'a Context,
    resource: Mutex<Arc<BatchResource>>,
    jobs: Vec<Arc<Job>>,
}

impl KubeRuntime<'_> {
    fn resource(&self) -> Arc<BatchResource> {
        self.resource.lock().expect("resource").clone()
    }

    /// This Batch's shards whose Jobs were deleted to stop them and whose workers may
    /// still be committing: until a worker says it exited (it released its grant, after
    /// its last commit; or the controller cleaned its grant up since) or `cancel_grace`
    /// has passed. Forgotten by a controller that restarts, whose drain then fences out
    /// what such a worker commits late.
    async fn still_stopping(&self) -> Vec<u32> {
        let batch = self.resource().name_any();
        let grace = self.ctx.exec.settings.cancel_grace;
        let stopped: Vec<(String, u32)> = {
            let mut stopped = self.ctx.stopped.lock().expect("stopped");
            stopped.retain(|_, s| s.at.elapsed() < grace);
            stopped.iter().filter(|(_, s)| s.batch == batch).map(|(job, s)| (job.clone(), s.shard)).collect()
        };
        let store = self.ctx.exec.store.as_ref();
        let mut stopping = Vec::new();
        for (job, shard) in stopped {
            let exited = match read_ack(store, &job).await {
                Ok(Some(ack)) => ack.released,
                Ok(None) => matches!(read_grant(store, &job).await, Ok(None)),
                Err(_) => false,
            };
            if exited {
                self.ctx.stopped.lock().expect("stopped").remove(&job);
            } else {
                stopping.push(shard);
            }
        }
        stopping
    }

    /// The shard's Job of its latest attempt.
    fn job_of(&self, shard: u32) -> Option<&Arc<Job>> {
        self.jobs.iter().filter(|job| job_shard(job) == Some(shard)).max_by_key(|job| job_attempt(job))
    }
}

#[async_trait]
impl Runtime for KubeRuntime<'_> {
    type Error = ControllerError;

    /// The shards' Jobs; and a shard whose Job was deleted to stop it runs until its
    /// worker has committed what it had in flight ([`KubeRuntime::still_stopping`]):
    /// drained before, those lines' answers would be thrown away.
    async fn workers(&self, batch: &Batch) -> Result<BTreeMap<u32, WorkerPhase>, ControllerError> {
        let mut workers = job_workers(&self.jobs, &batch.state.shard_failures);
        for shard in self.still_stopping().await {
            workers.entry(shard).or_insert(WorkerPhase::Running);
        }
        Ok(workers)
    }

    /// The installation's free slots, and no more than this Batch's share of all of them
    /// (`super::admission`) less the Jobs it runs.
    fn free_slots(&self, _batch: &Batch) -> Option<usize> {
        let ctx = self.ctx;
        let free = ctx.max_running_shards.saturating_sub(ctx.running_jobs());
        if free == 0 {
            // No slot to share: the shares (a look at every Batch) can wait for one.
            return Some(0);
        }
        let ours = self.resource();
        let running = ctx.max_running_shards - free;
        let share =
            ctx.allotments.lock().expect("allotments").share_of(&ours.name_any(), running, Instant::now(), || {
                let (batches, jobs) = (ctx.batch_cache.state(), ctx.jobs.state());
                allotment(&ours, &batches, &jobs, &ctx.project_weights(), ctx.scheduling, ctx.max_running_shards)
            });
        let ours = self.jobs.iter().filter(|job| is_running_worker(job)).count();
        Some(free.min(share.saturating_sub(ours)))
    }

    /// Creates the shard's Job, unless the installation's running shards are at their
    /// bound by now (another batch's pass started some): then a later pass starts it.
    async fn start(&self, batch: &Batch, shard: &Shard) -> Result<(), ControllerError> {
        let attempt = batch.state.shard_failures.get(&shard.index).copied().unwrap_or(0);
        let left = self.ctx.quota_left(&batch.spec.project_id);
        let job = shard_job(&self.resource(), &batch.spec, shard, attempt, &self.ctx.worker, left);
        let _starting = self.ctx.starting.lock().await;
        if self.ctx.running_jobs() >= self.ctx.max_running_shards {
            return Ok(());
        }
        match self.ctx.jobs_api().create(&PostParams::default(), &job).await {
            Ok(_) => {
                self.ctx.created.lock().expect("created").insert(job.name_any(), Instant::now());
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    async fn stop(&self, _batch: &Batch, shard: u32) -> Result<(), ControllerError> {
        // Deleting the Job sends its pod SIGTERM: the worker stops dispatching and commits.
        let Some(job) = self.job_of(shard) else { return Ok(()) };
        let stopped = Stopped { batch: self.resource().name_any(), shard, at: Instant::now() };
        self.ctx.stopped.lock().expect("stopped").entry(job.name_any()).or_insert(stopped);
        delete_job(self.ctx, &job.name_any()).await
    }

    /// A failed worker has exited: its Job goes, and nothing waits for it.
    async fn retire(&self, _batch: &Batch, shard: u32) -> Result<(), ControllerError> {
        match self.job_of(shard) {
            Some(job) => delete_job(self.ctx, &job.name_any()).await,
            None => Ok(()),
        }
    }

    /// Writes `state`; a state that ends an applied Batch naming an output location is
    /// written with its files copied there.
    async fn save(&self, read: &Batch, state: BatchState) -> Result<Option<Batch>, ControllerError> {
        let resource = self.resource();
        let state = super::outputs::deliver(&resource, &read.spec, state, self.ctx).await?;
        match write_status(&resource, &state, self.ctx).await? {
            Some(written) => {
                let batch = to_batch(&written);
                *self.resource.lock().expect("resource") = Arc::new(written);
                super::outputs::delivered(&resource, &read.spec, &read.state, &state, self.ctx).await?;
                Ok(batch)
            }
            None => Ok(None),
        }
    }

    fn observed(&self, batch: &Batch, ledgers: &[ShardLedger]) {
        self.ctx.recorded.count(batch, ledgers);
    }

    async fn tell(&self, batch: &Batch, news: News) {
        let (warning, reason, note) = match news {
            News::StatusChanged { from, to } => {
                (false, "StatusChanged", format!("{} → {}", from.as_str(), to.as_str()))
            }
            News::ShardRetried { shard, failures } => (
                true,
                "ShardRetried",
                format!("the Job of shard {shard} failed ({failures} so far); starting it again"),
            ),
            News::ShardGaveUp { shard, failures } => (
                true,
                "ShardFailed",
                format!(
                    "the Job of shard {shard} failed {failures} times; its remaining lines failed with internal_error"
                ),
            ),
            News::WillMissWindow { eta } => (
                true,
                "WillMissWindow",
                format!(
                    "at its pace so far the batch ends at {}, after its window closes at {}: its last lines would expire",
                    crate::k8s::conditions::rfc3339(eta),
                    crate::k8s::conditions::rfc3339(batch.spec.expires_at)
                ),
            ),
            News::Stopping => (false, "Stopping", "stopping the batch's workers".to_owned()),
            News::Finished => {
                let counts = batch.state.request_counts;
                let note = format!(
                    "{}: {} completed, {} failed of {}",
                    batch.state.status.as_str(),
                    counts.completed,
                    counts.failed,
                    counts.total
                );
                (false, "Finished", note)
            }
        };
        let type_ = if warning { EventType::Warning } else { EventType::Normal };
        self.ctx.event(&self.resource(), type_, reason, note).await;
    }
}

/// Applies `state` as the Batch's status, unless the Batch changed since `resource`
/// was read (then: `None`, and the next reconcile decides again). Returns the Batch as
/// written.
async fn write_status(
    resource: &BatchResource,
    state: &BatchState,
    ctx: &Context,
) -> Result<Option<BatchResource>, ControllerError> {
    Ok(apply_status(&ctx.batches(), FIELD_MANAGER, resource, state).await?)
}

async fn delete_job(ctx: &Context, name: &str) -> Result<(), ControllerError> {
    let params = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    match ctx.jobs_api().delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// The Batch is being deleted. One still running is cancelled first and driven to its
/// end (its workers stop and commit, finalize writes the lines they ran), so nothing is
/// left running and nothing done is lost. Then its Jobs go, and, once a stopped worker
/// has had its grace period to commit, the shard data in object storage. Files the
/// batch produced stay: they are the user's, under the Files API.
async fn cleanup(resource: &BatchResource, ctx: &Context) -> Result<Action, ControllerError> {
    let Some(spec) = resource.accepted() else { return Ok(Action::await_change()) };
    if let Some(mut state) = resource.status.clone().filter(|state| !state.status.is_terminal()) {
        if matches!(crate::batches::cancel(&mut state, clock::now()), Ok(true)) {
            if write_status(resource, &state, ctx).await?.is_some() {
                let note = "deleted while it ran: cancelled first, its workers stop and finalize writes what ran";
                ctx.event(resource, EventType::Normal, "CancelledOnDelete", note.to_owned()).await;
            }
            return Err(ControllerError::Waiting("the cancel to be written"));
        }
        drive_pass(resource, ctx).await?;
        return Err(ControllerError::Waiting("the deleted batch's cancel to finish"));
    }
    let name = resource_name(&spec.id);
    let jobs: Vec<Arc<Job>> =
        ctx.jobs.state().into_iter().filter(|job| job.labels().get(BATCH_LABEL) == Some(&name)).collect();
    if !jobs.is_empty() {
        let params =
            DeleteParams { propagation_policy: Some(PropagationPolicy::Foreground), ..DeleteParams::default() };
        for job in &jobs {
            match ctx.jobs_api().delete(&job.name_any(), &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(error.into()),
            }
        }
        return Err(ControllerError::Waiting("the batch's Jobs to go"));
    }
    let deleted_at = resource.metadata.deletion_timestamp.as_ref().map(|t| t.0.as_second()).unwrap_or_else(clock::now);
    if clock::now() - deleted_at < ctx.exec.settings.cancel_grace.as_secs() as i64 {
        return Err(ControllerError::Waiting("stopped workers to commit"));
    }
    let prefix = format!("batches/{}/", spec.id);
    let store = ctx.exec.store.as_ref();
    for key in store.list(&prefix).await.map_err(ExecError::from)? {
        store.delete(&key).await.map_err(ExecError::from)?;
    }
    ctx.exec.checkpoints.forget(&spec.id);
    Ok(Action::await_change())
}

/// Fails startup with instructions when the CRDs are not installed.
pub async fn check_crds(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let api: Api<BatchResource> = Api::namespaced(client.clone(), namespace);
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => anyhow::bail!(
            "the Batch CRD is not installed: `kubectl apply -f crds/nightshift.yaml` (or install the Helm chart, whose crds/ holds it)"
        ),
        Err(error) => Err(error.into()),
    }
}

pub fn reporter(instance: &str) -> Reporter {
    Reporter { controller: FIELD_MANAGER.into(), instance: Some(instance.to_owned()) }
}
