//! `nightshift worker`: runs one shard of one batch, the entrypoint of a Kubernetes
//! Job's pod. Everything it needs comes in its arguments and the configuration
//! (storage, upstreams); progress goes to storage as checkpoints, so the pod needs
//! no Kubernetes credentials, and a retried pod resumes where the last one stopped.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tokio_util::sync::CancellationToken;

use super::{open_store, shutdown_signal};
use crate::batches::BatchSpec;
use crate::concurrency::control::Mode;
use crate::config::Config;
use crate::exec::upstream::Upstreams;
use crate::exec::worker::{ShardExit, run_shard};
use crate::exec::{ExecContext, ExecSettings};
use crate::files::FileCatalog;
use crate::grants;
use crate::ids::{BatchId, FileId, ProjectId};
use crate::quota::QuotaLedger;
use crate::validate::{Shard, ShardPlan};

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// YAML configuration file: storage and upstreams.
    #[arg(long, env = "NIGHTSHIFT_CONFIG")]
    pub config: PathBuf,
    #[arg(long, value_parser = |id: &str| BatchId::parse(id).ok_or("not a batch id"))]
    pub batch_id: BatchId,
    #[arg(long, value_parser = |id: &str| ProjectId::parse(id).ok_or("not a UUID"))]
    pub project_id: ProjectId,
    #[arg(long, value_parser = |id: &str| FileId::parse(id).ok_or("not a file id"))]
    pub input_file_id: FileId,
    /// The batch's endpoint: where its lines go on the upstream, and the shape the echo
    /// model answers in.
    #[arg(long, default_value = "/v1/chat/completions")]
    pub endpoint: String,
    /// Unix time at which the batch expires: dispatch stops then.
    #[arg(long)]
    pub expires_at: i64,
    #[arg(long)]
    pub shard_index: u32,
    /// 0-based position of the shard's first request in the input.
    #[arg(long)]
    pub first_request: u64,
    /// How many requests the shard holds.
    #[arg(long)]
    pub requests: u64,
    /// The shard's byte range in the input file, `[byte_start, byte_end)`.
    #[arg(long)]
    pub byte_start: u64,
    #[arg(long)]
    pub byte_end: u64,
    /// Tokens the project may still use, when it has a quota. With `--grant-name`, the
    /// controller grants tokens instead, as it shares the project's quota among its
    /// running workers, and this is not used.
    #[arg(long)]
    pub quota_tokens_left: Option<u64>,
    /// This worker's name in the installation's upstream grants (its Job's name): it
    /// then sends to each upstream only as many requests at once as the controller
    /// grants it. Without it, the worker may use each upstream's whole `max_concurrency`.
    #[arg(long)]
    pub grant_name: Option<String>,
    /// The `priority` set on the batch's lines, over each upstream's.
    #[arg(long, allow_hyphen_values = true)]
    pub priority: Option<i64>,
    /// Serve `/metrics` (upstream latencies and retries) here while the shard runs.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

impl WorkerArgs {
    /// The shard this worker runs, and what of its batch a run needs.
    fn task(&self) -> (BatchSpec, Shard) {
        let spec = BatchSpec {
            id: self.batch_id.clone(),
            project_id: self.project_id.clone(),
            input_file_id: self.input_file_id.clone(),
            endpoint: self.endpoint.clone(),
            completion_window: String::new(),
            metadata: Default::default(),
            created_at: 0,
            expires_at: self.expires_at,
            model: None,
            output_expires_after: None,
            priority: self.priority,
            plan: ShardPlan::default(),
        };
        let shard = Shard {
            index: self.shard_index,
            first_request: self.first_request,
            requests: self.requests,
            byte_start: self.byte_start,
            byte_end: self.byte_end,
        };
        (spec, shard)
    }
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    // The controller counts lines and tokens from the checkpoints: a pod may be gone
    // before its last scrape.
    crate::metrics::METRICS.count_from_checkpoints();
    if let Some(address) = args.metrics_listen {
        serve_metrics(address).await;
    }
    let exec = exec_context(&config, &args).await?;
    let (spec, shard) = args.task();
    let stop = stop_on_signal();
    let ledger = exec.checkpoints.ledger(exec.store.as_ref(), &spec.id, shard.index, shard.requests).await?;
    tracing::info!(batch = %spec.id, shard = shard.index, done = ledger.recorded_count(), of = shard.requests, "worker starting");
    let run = args.grant_name.as_deref().map(|worker| grants::follow::Run {
        exec: &exec,
        worker,
        run: ulid::Ulid::new().to_string().to_ascii_lowercase(),
        base_tokens: ledger.usage.total_tokens,
    });
    let following = async {
        match &run {
            Some(run) => run.follow().await,
            None => std::future::pending().await,
        }
    };
    let mode = if run.is_some() { Mode::Granted } else { Mode::Local };
    let exit = tokio::select! {
        // A pod holds its Job's slot until it ends: the controller counts Jobs.
        exit = run_shard(&exec, &spec, &shard, &ledger, stop, &|| {}) => exit,
        () = following => unreachable!("following a grant never ends"),
        () = crate::exec::permits::govern_all(&exec.upstreams, &exec.client, mode, None) => unreachable!("control loops never end"),
    };
    if let Some(run) = &run {
        run.release().await;
    }
    match exit? {
        ShardExit::Finished => tracing::info!(batch = %spec.id, shard = shard.index, "shard finished"),
        ShardExit::Stopped => tracing::info!(batch = %spec.id, shard = shard.index, "shard stopped before its end"),
        // A failure, not a success: the pod that superseded this one (its Job's
        // replacement) still runs, and a Job must not complete on this pod's exit.
        ShardExit::Superseded => {
            anyhow::bail!("a newer run claimed shard {} of {}; this one stopped", shard.index, spec.id)
        }
    }
    Ok(())
}

/// Serves `/metrics` on `address` while the shard runs. Metrics are a view: a port that
/// can't be had costs the view, not the shard.
async fn serve_metrics(address: std::net::SocketAddr) {
    match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => {
            tokio::spawn(async move {
                let router = axum::Router::new().route("/metrics", axum::routing::get(crate::api::metrics));
                if let Err(error) = axum::serve(listener, router).await {
                    tracing::warn!(%error, "the metrics server stopped");
                }
            });
        }
        Err(error) => tracing::warn!(%address, %error, "cannot serve metrics; running the shard without"),
    }
}

async fn exec_context(config: &Config, args: &WorkerArgs) -> anyhow::Result<ExecContext> {
    let store = open_store(&config.storage).await?;
    let files = FileCatalog::new(store.clone(), config.files.retention);
    let upstreams = Upstreams::from_config(&config.upstreams, args.grant_name.is_some())?;
    // With grants, the controller says what this worker may spend (its project's quota
    // shared by its running workers, or no bound); without, it may spend what was left
    // when its Job was made.
    let quota = match &args.grant_name {
        Some(_) => QuotaLedger::granted(),
        None => QuotaLedger::single(&args.project_id, args.quota_tokens_left),
    };
    let settings = ExecSettings::from_config(&config.batches);
    Ok(ExecContext::new(store, files, upstreams, Arc::new(quota), settings))
}

/// Kubernetes stops a pod with SIGTERM (a cancelled batch's Jobs are deleted): stop
/// dispatching, let lines in flight finish, commit, exit.
fn stop_on_signal() -> CancellationToken {
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        on_signal.cancel();
    });
    stop
}
