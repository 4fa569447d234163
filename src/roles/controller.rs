//! `nightshift controller`: reconciles Batch resources into shard Jobs, finalizes
//! them, and keeps Projects' usage. Leader-elected: replicas wait on a Lease.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;

use super::api::namespace;
use super::open_store;
use crate::config::Config;
use crate::exec::upstream::Upstreams;
use crate::exec::{ExecContext, ExecSettings};
use crate::files::FileCatalog;
use crate::k8s::context::Context;
use crate::k8s::controller::{self, check_crds, reporter};
use crate::k8s::crd::{BatchResource, ProjectResource};
use crate::k8s::granting::{UpstreamLimit, divide_limits};
use crate::k8s::leader::{LeaderElection, Timing};
use crate::k8s::projects::follow_batch_webhooks;
use crate::k8s::scaling::{Scaled, scale_workloads};
use crate::k8s::usage::sync_project_usage;
use crate::quota::QuotaLedger;

pub const LEASE_NAME: &str = "nightshift-controller";

#[derive(Args, Debug, Clone)]
pub struct ControllerArgs {
    /// YAML configuration file (storage, batches, kubernetes.worker).
    #[arg(long, env = "NIGHTSHIFT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Namespace of Batches, Projects and Jobs; overrides `kubernetes.namespace`.
    #[arg(long, env = "NIGHTSHIFT_NAMESPACE")]
    pub namespace: Option<String>,
    /// This replica's name in the leader Lease (the pod's name on Kubernetes).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Where `/healthz`, `/readyz`, `/metrics` and `/backlog` are served.
    #[arg(long, env = "NIGHTSHIFT_PROBE_LISTEN", default_value = "0.0.0.0:9090")]
    pub probe_listen: std::net::SocketAddr,
    /// Seconds a standby must see the Lease unrenewed before it takes the lead; the
    /// leader steps down after two thirds of it without a renewal.
    #[arg(long, env = "NIGHTSHIFT_LEASE_SECONDS", default_value_t = 15)]
    pub lease_seconds: u32,
}

pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let namespace = namespace(args.namespace.as_deref(), &config);
    let identity = args.identity.clone().unwrap_or_else(|| format!("nightshift-controller-{}", ulid::Ulid::new()));
    // Lines and tokens are counted from the checkpoints the controller's passes read.
    crate::metrics::METRICS.count_from_checkpoints();
    let client = kube::Client::try_default().await.context("cannot reach the Kubernetes API")?;
    check_crds(&client, &namespace).await?;

    // Probes answer from the start: a standby replica is healthy while it waits to lead.
    serve_probes(args.probe_listen).await?;

    let timing = Timing::for_lease(args.lease_seconds);
    let mut leader = LeaderElection::new(client.clone(), &namespace, LEASE_NAME, &identity, timing);
    tracing::info!(%identity, "waiting to lead");
    let acquired = leader.acquire().await;
    tracing::info!(%identity, "leading");
    println!("Nightshift controller leading in namespace {namespace}");

    let store = open_store(&config.storage).await?;
    let files = FileCatalog::new(store.clone(), config.files.retention);
    let settings = ExecSettings::from_config(&config.batches);
    // The controller drains and finalizes; it never calls upstreams (workers do).
    let exec = ExecContext::new(store, files, Upstreams::echo_only(), Arc::new(QuotaLedger::default()), settings);
    // Projects with their webhooks' signing secrets, for the deliverer.
    let directory = Arc::new(crate::projects::ProjectDirectory::default());
    let (projects, secrets) =
        crate::k8s::projects::follow(client.clone(), &namespace, directory.clone(), Arc::new(QuotaLedger::default()))
            .await?;
    // Applied Batches may name endpoints of their own.
    let endpoints = Arc::new(crate::webhooks::BatchEndpoints::default());
    let deliverer = crate::webhooks::Deliverer::new(exec.store.clone(), directory, config.webhooks.clone())
        .with_batch_endpoints(endpoints.clone());
    let caches = controller::caches(&client, &namespace);
    let (batches, jobs) = (caches.batches.clone(), caches.jobs.clone());
    let recorder = Recorder::new(client.clone(), reporter(&identity));
    let ctx = Arc::new(context(&config, client, namespace, exec, recorder, (batches.clone(), jobs, projects))?);
    let limits = upstream_limits(&config.upstreams);
    let scaled = Scaled::of(&config.upstreams, &ctx.namespace);
    tokio::select! {
        () = controller::run(ctx.clone(), caches) => Ok(()),
        () = sync_project_usage(ctx.clone(), batches.clone()) => Ok(()),
        () = scale_workloads(ctx.clone(), batches.clone(), scaled) => Ok(()),
        () = follow_batch_webhooks(batches.clone(), secrets, endpoints) => Ok(()),
        () = divide_limits(ctx, batches, limits) => Ok(()),
        () = deliverer.run(Duration::from_secs(1)) => Ok(()),
        // Returning ends the process: every task of this leader stops with it.
        () = leader.hold(acquired) => anyhow::bail!("lost the leader Lease; exiting so that a new leader takes over"),
    }
}

/// What the controller's loops share, from the configuration and the watch caches
/// (Batches, Jobs, Projects).
fn context(
    config: &Config,
    client: kube::Client,
    namespace: String,
    exec: ExecContext,
    recorder: Recorder,
    (batches, jobs, projects): (Store<BatchResource>, Store<Job>, Store<ProjectResource>),
) -> anyhow::Result<Context> {
    Ok(Context {
        client,
        namespace,
        exec: Arc::new(exec),
        worker: config.kubernetes.worker.clone(),
        recorder,
        jobs,
        batch_cache: batches,
        projects,
        scheduling: config.batches.scheduling,
        statusless: Default::default(),
        max_running_shards: config.batches.max_running_shards.unwrap_or(crate::config::KUBERNETES_RUNNING_SHARDS),
        created: Default::default(),
        stopped: Default::default(),
        starting: Default::default(),
        recorded: Default::default(),
        allotments: Default::default(),
        routes: crate::k8s::capacity::Routes::of(&config.upstreams),
        workloads: crate::k8s::capacity::Workloads::of(
            config.upstreams.iter().filter(|u| u.scale.is_some()).map(|u| u.name.as_str()),
        ),
        batch_settings: config.batches.batch_settings(),
        buckets: crate::storage::buckets::Buckets::new(super::s3_settings(&config.storage)?),
    })
}

/// Each upstream as the controller divides its limit.
fn upstream_limits(upstreams: &[crate::config::UpstreamConfig]) -> Vec<UpstreamLimit> {
    upstreams
        .iter()
        .map(|u| UpstreamLimit { name: u.name.clone(), ceiling: u.max_concurrency as u32, adaptive: u.adaptive })
        .collect()
}

/// `/healthz`, `/readyz`, `/metrics` and `/backlog` on `address`, for as long as the process runs.
async fn serve_probes(address: std::net::SocketAddr) -> anyhow::Result<()> {
    let probes = tokio::net::TcpListener::bind(address).await.with_context(|| format!("cannot listen on {address}"))?;
    tokio::spawn(async move {
        let router = axum::Router::new()
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .route("/readyz", axum::routing::get(|| async { "ok" }))
            .route("/metrics", axum::routing::get(crate::api::metrics))
            .route("/backlog", axum::routing::get(crate::api::backlog));
        if let Err(error) = axum::serve(probes, router).await {
            tracing::error!(%error, "the probe server stopped");
        }
    });
    Ok(())
}
