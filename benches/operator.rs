//! The controller at scale, on a real kube-apiserver (`just bench-operator`; needs the
//! tools of `tests/run`), at its default `max_running_shards` (16): it can't start a Job
//! for every Batch, so the bench measures what a backlog costs it.
//!
//! First, a burst probe: 32 Batches stamped with the same second (as the api stamps a
//! burst), created before the controller starts: how many Jobs start within 30 s (16
//! expected). Then, for each point N (`BENCH_BATCHES`: 1,000 by default; `1000,10000` adds
//! the 10,000 point, about 3 minutes more on 2 cores), in a namespace of its own
//! with a controller of its own:
//!   1. N one-shard Batches created as the api creates them (the resource, then its
//!      `in_progress` status under the api's field manager, read again after a conflict),
//!      64 at a time, as a backlog submitted one a second (distinct `created_at`: a burst
//!      stamped with one second is what the probe shows);
//!   2. the time until the first Job and the first 16 exist, and until the controller has
//!      seen every Batch (each carries its finalizer);
//!   3. a steady window of 20 s with N in progress: the controller's RSS and CPU, the Jobs
//!      running, and its passes from its own `nightshift_reconcile_duration_seconds`
//!      (scraped from /metrics: rate, mean, p50 and p99 interpolated within the buckets as
//!      Prometheus's `histogram_quantile` does), against the N / 2 s its requeues ask for;
//!   4. `BENCH_SAMPLES` (default 6) times, one running Job's pod reported succeeded (as a
//!      kubelet reports a worker that exited 0): the time until the Job controller marks
//!      the Job Complete, and until the controller creates the next Job;
//!   5. `nightshift_reconcile_errors_total`, by reason.
//!
//! Every wait has a deadline; one that passes reports what it saw, and the bench goes on.
//! Knobs: `BENCH_BATCHES` (counts, comma-separated), `BENCH_SAMPLES`, `BENCH_BURST=0` (no
//! burst probe), `NIGHTSHIFT_BINARY` (another build, to compare).

#[path = "../tests/common/cluster.rs"]
mod cluster;
#[path = "operator/controller.rs"]
mod controller;
#[path = "../tests/common/ports.rs"]
#[allow(dead_code)]
mod ports;

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::process::Command;
use std::time::{Duration, Instant};

use controller::{Controller, Histogram, start_controller};
use futures_util::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use nightshift::batches::{BatchSpec, BatchState};
use nightshift::config::KUBERNETES_RUNNING_SHARDS;
use nightshift::ids::{BatchId, FileId, ProjectId};
use nightshift::k8s::controller::FINALIZER;
use nightshift::k8s::crd::{BATCH_LABEL, BatchResource, BatchResourceSpec, PROJECT_LABEL, resource_name};
use nightshift::k8s::store::{API_FIELD_MANAGER, apply_status};
use nightshift::validate::{Shard, ShardPlan};

/// Api requests creating Batches at once.
const CREATE_CONCURRENCY: usize = 64;
/// The controller looks at a running Batch again every 2 s (`PROGRESS_REQUEUE`).
const REQUEUE_SECONDS: f64 = 2.0;
const STEADY_WINDOW: Duration = Duration::from_secs(20);
const FIRST_JOBS_DEADLINE: Duration = Duration::from_secs(300);
const SEEN_DEADLINE: Duration = Duration::from_secs(600);
const POD_DEADLINE: Duration = Duration::from_secs(30);
const NEXT_JOB_DEADLINE: Duration = Duration::from_secs(180);
const BURST: usize = 32;
const BURST_DEADLINE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

struct Settings {
    points: Vec<usize>,
    samples: usize,
    burst: bool,
}

fn settings() -> Settings {
    let points = std::env::var("BENCH_BATCHES").unwrap_or_else(|_| "1000".into());
    let points = points
        .split(',')
        .map(|n| n.trim().replace(['_', ','], "").parse().expect("BENCH_BATCHES: counts, comma-separated"))
        .collect();
    let samples = std::env::var("BENCH_SAMPLES").map_or(6, |n| n.parse().expect("BENCH_SAMPLES: a count"));
    let burst = std::env::var("BENCH_BURST").map_or(true, |v| v != "0");
    Settings { points, samples, burst }
}

// ---------------------------------------------------------------------------
// Waiting with a deadline
// ---------------------------------------------------------------------------

/// What a wait with a deadline came to: when it was met, or what was seen at the deadline.
enum Waited {
    Met(Duration),
    TimedOut(String),
}

impl Waited {
    fn met(&self) -> Option<f64> {
        match self {
            Waited::Met(at) => Some(at.as_secs_f64()),
            Waited::TimedOut(_) => None,
        }
    }

    fn show(&self) -> String {
        match self {
            Waited::Met(at) => format!("{:.1} s", at.as_secs_f64()),
            Waited::TimedOut(saw) => format!("timed out: {saw}"),
        }
    }
}

/// Asks `check` every `every` whether it is done (and what it saw) until it is, or until
/// `deadline` has passed since `since`; a met wait is timed from `since` to the check.
async fn poll_until<F, Fut>(since: Instant, deadline: Duration, every: Duration, mut check: F) -> Waited
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (bool, String)>,
{
    loop {
        let at = since.elapsed();
        let (done, saw) = check().await;
        if done {
            return Waited::Met(at);
        }
        if at > deadline {
            return Waited::TimedOut(format!("{saw} after {:.0} s", at.as_secs_f64()));
        }
        tokio::time::sleep(every).await;
    }
}

// ---------------------------------------------------------------------------
// Batches, as the api creates them
// ---------------------------------------------------------------------------

/// A one-shard Batch of `project`, created at `created_at`, as the api builds it.
fn batch_resource(project: &ProjectId, created_at: i64) -> BatchResource {
    let spec = BatchSpec {
        id: BatchId::generate(),
        project_id: project.clone(),
        input_file_id: FileId::generate(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        metadata: Default::default(),
        created_at,
        expires_at: created_at + 86_400,
        model: None,
        output_expires_after: None,
        priority: None,
        plan: ShardPlan {
            shard_lines: 5000,
            shards: vec![Shard { index: 0, first_request: 0, requests: 10, byte_start: 0, byte_end: 1000 }],
        },
    };
    let mut resource = BatchResource::new(&resource_name(&spec.id), BatchResourceSpec::recorded(spec));
    resource.metadata.labels = Some([(PROJECT_LABEL.to_owned(), project.to_string())].into());
    resource
}

/// Creates `resource`, then applies its `in_progress` status under the api's field
/// manager, reading it again after a conflict (the controller's finalizer came first).
async fn create_as_api(api: &Api<BatchResource>, resource: BatchResource) -> Result<(), kube::Error> {
    let name = resource.name_any();
    let state = BatchState::in_progress(nightshift::clock::now(), 10);
    let mut current = api.create(&PostParams::default(), &resource).await?;
    while apply_status(api, API_FIELD_MANAGER, &current, &state).await?.is_none() {
        current = api.get(&name).await?;
    }
    Ok(())
}

/// Creates `count` Batches of one project, `CREATE_CONCURRENCY` at a time: with
/// `created_at` one second apart, ending now (`spread`), or all of this second. Returns
/// how many creates failed.
async fn create_batches(api: &Api<BatchResource>, count: usize, spread: bool) -> usize {
    let project = ProjectId::generate();
    let now = nightshift::clock::now();
    let stamp = |at: usize| if spread { now - (count - at) as i64 } else { now };
    let results: Vec<Result<(), kube::Error>> = futures_util::stream::iter(0..count)
        .map(|at| create_as_api(api, batch_resource(&project, stamp(at))))
        .buffer_unordered(CREATE_CONCURRENCY)
        .collect()
        .await;
    let failed: Vec<&kube::Error> = results.iter().filter_map(|result| result.as_ref().err()).collect();
    if let Some(error) = failed.first() {
        eprintln!("operator: {} of {count} creates failed; the first: {error}", failed.len());
    }
    failed.len()
}

/// Whether the controller has seen every one of `count` Batches: each carries its finalizer.
async fn batches_seen(api: &Api<BatchResource>, count: usize) -> (bool, String) {
    match api.list_metadata(&ListParams::default()).await {
        Ok(list) => {
            let seen = list.items.iter().filter(|b| b.finalizers().iter().any(|f| f == FINALIZER)).count();
            (seen >= count, format!("{seen} of {count} Batches seen"))
        }
        Err(error) => (false, format!("listing Batches failed: {error}")),
    }
}

// ---------------------------------------------------------------------------
// Jobs and their pods
// ---------------------------------------------------------------------------

fn is_finished(job: &Job) -> bool {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|c| c.iter().any(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True"))
}

/// The shard Jobs of the namespace: their names, and how many run.
async fn shard_jobs(jobs: &Api<Job>) -> Result<(HashSet<String>, usize), String> {
    let list = jobs.list(&ListParams::default().labels(BATCH_LABEL)).await.map_err(|e| format!("listing Jobs: {e}"))?;
    let running = list.items.iter().filter(|job| !is_finished(job)).count();
    Ok((list.items.iter().map(ResourceExt::name_any).collect(), running))
}

async fn jobs_at_least(jobs: &Api<Job>, wanted: usize) -> (bool, String) {
    match shard_jobs(jobs).await {
        Ok((names, _)) => (names.len() >= wanted, format!("{} Jobs", names.len())),
        Err(error) => (false, error),
    }
}

/// From `since` on, in the background: when the namespace's first Job exists, and its
/// first `slots`.
fn track_first_jobs(jobs: Api<Job>, since: Instant, slots: usize) -> tokio::task::JoinHandle<(Waited, Waited)> {
    tokio::spawn(async move {
        let first = poll_until(since, FIRST_JOBS_DEADLINE, POLL * 2, || jobs_at_least(&jobs, 1)).await;
        let all = poll_until(since, FIRST_JOBS_DEADLINE, POLL * 2, || jobs_at_least(&jobs, slots)).await;
        (first, all)
    })
}

/// A pod of a running shard Job (the Job controller makes it), waited for.
async fn running_worker_pod(pods: &Api<Pod>) -> Result<Pod, String> {
    let deadline = Instant::now() + POD_DEADLINE;
    loop {
        let list = pods.list(&ListParams::default().labels(BATCH_LABEL)).await.map_err(|e| format!("pods: {e}"))?;
        let total = list.items.len();
        let phase = |pod: &Pod| pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        if let Some(pod) = list.items.into_iter().find(|pod| matches!(phase(pod).as_str(), "" | "Pending" | "Running"))
        {
            return Ok(pod);
        }
        if Instant::now() > deadline {
            return Err(format!("no pod of a running Job after {POD_DEADLINE:?} ({total} worker pods)"));
        }
        tokio::time::sleep(POLL * 4).await;
    }
}

/// Reports the pod's worker as exited 0, as its kubelet would; the Job controller then
/// marks its Job Complete.
async fn succeed(pods: &Api<Pod>, pod: &Pod) -> Result<(), String> {
    let container = pod.spec.as_ref().and_then(|s| s.containers.first()).cloned().unwrap_or_default();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let terminated = serde_json::json!({ "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now });
    let status = serde_json::json!({
        "name": container.name, "image": container.image.unwrap_or_default(), "imageID": "",
        "ready": false, "restartCount": 0, "state": { "terminated": terminated },
    });
    let patch = serde_json::json!({
        "metadata": { "uid": pod.uid() },
        "status": { "phase": "Succeeded", "containerStatuses": [status] },
    });
    let params = PatchParams::default();
    pods.patch_status(&pod.name_any(), &params, &Patch::Merge(&patch)).await.map_err(|e| format!("pod status: {e}"))?;
    Ok(())
}

/// One Job made to finish: how long until it was Complete, and until the next Job existed.
struct Sample {
    complete: Waited,
    next: Waited,
}

async fn finish_one_job(jobs: &Api<Job>, pods: &Api<Pod>) -> Result<Sample, String> {
    let pod = running_worker_pod(pods).await?;
    let job = pod.labels().get("job-name").cloned().ok_or("a worker pod without its job-name label")?;
    let (before, _) = shard_jobs(jobs).await?;
    let (job, before) = (job.as_str(), &before);
    let started = Instant::now();
    succeed(pods, &pod).await?;
    let complete = poll_until(started, NEXT_JOB_DEADLINE, POLL, || async move {
        match jobs.get(job).await {
            Ok(found) => (is_finished(&found), format!("Job {job} not Complete")),
            Err(error) => (false, format!("reading Job {job}: {error}")),
        }
    })
    .await;
    let next = poll_until(started, NEXT_JOB_DEADLINE, POLL, || async move {
        match shard_jobs(jobs).await {
            Ok((names, running)) => {
                (names.difference(before).next().is_some(), format!("no new Job ({running} running)"))
            }
            Err(error) => (false, error),
        }
    })
    .await;
    Ok(Sample { complete, next })
}

/// `count` Jobs finished one after the other; stops at the first whose next Job never came.
async fn next_job_samples(jobs: &Api<Job>, pods: &Api<Pod>, count: usize) -> Vec<Sample> {
    let mut samples = Vec::new();
    for _ in 0..count {
        match finish_one_job(jobs, pods).await {
            Ok(sample) => {
                let stuck = sample.next.met().is_none();
                eprintln!(
                    "operator: a Job finished: Complete {}, next Job {}",
                    sample.complete.show(),
                    sample.next.show()
                );
                samples.push(sample);
                if stuck {
                    break;
                }
            }
            Err(error) => {
                eprintln!("operator: could not finish a Job: {error}");
                break;
            }
        }
    }
    samples
}

// ---------------------------------------------------------------------------
// One point
// ---------------------------------------------------------------------------

/// The controller over `STEADY_WINDOW` with nothing changing, and its passes before it.
struct Steady {
    syncing: Histogram,
    passes: Histogram,
    seconds: f64,
    cpu: f64,
    rss: (f64, f64),
    running: Option<usize>,
}

async fn steady_window(controller: &Controller, jobs: &Api<Job>) -> Steady {
    let (before, cpu_before, at) = (controller.scrape().await, controller.cpu_seconds(), Instant::now());
    tokio::time::sleep(STEADY_WINDOW).await;
    let after = controller.scrape().await;
    let seconds = at.elapsed().as_secs_f64();
    let cpu = (controller.cpu_seconds() - cpu_before) / seconds;
    let running = shard_jobs(jobs).await.ok().map(|(_, running)| running);
    let passes = after.passes.since(&before.passes);
    Steady { syncing: before.passes, passes, seconds, cpu, rss: controller.rss_mb(), running }
}

struct PointReport {
    batches: usize,
    create_failures: usize,
    created: Duration,
    first_job: Waited,
    first_slots: Waited,
    seen: Waited,
    steady: Steady,
    samples: Vec<Sample>,
    errors: BTreeMap<String, f64>,
}

async fn run_point(cluster: &cluster::TestCluster, client: &Client, batches: usize, samples: usize) -> PointReport {
    let namespace = format!("bench-{batches}");
    cluster.create_namespace(&namespace).await;
    let work = tempfile::TempDir::new().unwrap();
    let controller = start_controller(cluster, &namespace, work.path());
    let api: Api<BatchResource> = Api::namespaced(client.clone(), &namespace);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let started = Instant::now();
    let first_jobs = track_first_jobs(jobs.clone(), started, KUBERNETES_RUNNING_SHARDS);
    let create_failures = create_batches(&api, batches, true).await;
    let created = started.elapsed();
    eprintln!("operator: {batches} Batches created in {:.1} s", created.as_secs_f64());
    let seen = poll_until(started, SEEN_DEADLINE, Duration::from_secs(2), || batches_seen(&api, batches)).await;
    eprintln!("operator: every Batch seen: {}", seen.show());
    let (first_job, first_slots) = first_jobs.await.unwrap();
    let steady = steady_window(&controller, &jobs).await;
    let samples = next_job_samples(&jobs, &pods, samples).await;
    let errors = controller.scrape().await.errors;
    PointReport { batches, create_failures, created, first_job, first_slots, seen, steady, samples, errors }
}

/// `BURST` Batches stamped with one second, created before the controller starts: how
/// many Jobs it starts within `BURST_DEADLINE`.
async fn burst_probe(cluster: &cluster::TestCluster, client: &Client) -> String {
    let namespace = "bench-burst";
    cluster.create_namespace(namespace).await;
    let api: Api<BatchResource> = Api::namespaced(client.clone(), namespace);
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    create_batches(&api, BURST, false).await;
    let work = tempfile::TempDir::new().unwrap();
    let _controller = start_controller(cluster, namespace, work.path());
    let started = Instant::now();
    let slots = KUBERNETES_RUNNING_SHARDS;
    let waited = poll_until(started, BURST_DEADLINE, POLL * 4, || jobs_at_least(&jobs, slots)).await;
    let (names, _) = shard_jobs(&jobs).await.unwrap_or_default();
    match waited {
        Waited::Met(at) => format!("{} Jobs after {:.1} s", names.len(), at.as_secs_f64()),
        Waited::TimedOut(_) => format!("{} Jobs after {} s ({slots} expected)", names.len(), BURST_DEADLINE.as_secs()),
    }
}

// ---------------------------------------------------------------------------
// Reporting
// ---------------------------------------------------------------------------

fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (at, digit) in digits.chars().enumerate() {
        if at > 0 && (digits.len() - at).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// `median 1.2 s, max 2.0 s (6)`, and how many timed out.
fn spread(waits: impl Iterator<Item = Option<f64>>) -> String {
    let (mut met, mut missed) = (Vec::new(), 0);
    for wait in waits {
        match wait {
            Some(seconds) => met.push(seconds),
            None => missed += 1,
        }
    }
    met.sort_by(f64::total_cmp);
    let mut out = match met.len() {
        0 => "none".to_owned(),
        n => format!("median {:.2} s, max {:.2} s ({n})", met[n / 2], met[n - 1]),
    };
    if missed > 0 {
        out.push_str(&format!("; {missed} timed out"));
    }
    out
}

fn rows(report: &PointReport) -> Vec<(&'static str, String)> {
    let steady = &report.steady;
    let wanted = report.batches as f64 / REQUEUE_SECONDS;
    let errors: Vec<String> = report.errors.iter().map(|(reason, n)| format!("{reason} {n}")).collect();
    vec![
        ("Batches in progress", thousands(report.batches)),
        (
            "created (api-style, 64 at a time)",
            format!("{:.1} s, {} failed", report.created.as_secs_f64(), report.create_failures),
        ),
        ("first Job after", report.first_job.show()),
        ("16 Jobs after", report.first_slots.show()),
        ("every Batch seen (finalizer) after", report.seen.show()),
        ("passes until then", format!("{} ({})", thousands(steady.syncing.count as usize), steady.syncing.show())),
        ("controller RSS (peak)", format!("{:.0} MB ({:.0} MB)", steady.rss.0, steady.rss.1)),
        ("controller CPU, steady", format!("{:.0}% of a core", steady.cpu * 100.0)),
        ("passes/s, steady (N / 2 s wanted)", format!("{:.0} of {wanted:.0}", steady.passes.count / steady.seconds)),
        ("pass time, steady", steady.passes.show()),
        ("Jobs running, steady", steady.running.map_or("?".into(), |n| n.to_string())),
        ("Job finished → Complete", spread(report.samples.iter().map(|s| s.complete.met()))),
        ("Job finished → next Job", spread(report.samples.iter().map(|s| s.next.met()))),
        ("reconcile errors", if errors.is_empty() { "none".into() } else { errors.join(", ") }),
    ]
}

fn print_table(reports: &[PointReport], burst: Option<&str>) {
    let columns: Vec<Vec<(&str, String)>> = reports.iter().map(rows).collect();
    let Some(first) = columns.first() else { return };
    let label_width = first.iter().map(|(label, _)| label.chars().count()).max().unwrap_or(0);
    let widths: Vec<usize> =
        columns.iter().map(|c| c.iter().map(|(_, v)| v.chars().count()).max().unwrap_or(0)).collect();
    println!("\noperator: the controller at max_running_shards {KUBERNETES_RUNNING_SHARDS}, one-shard Batches");
    if let Some(burst) = burst {
        println!("{:label_width$}  {burst}", format!("burst of {BURST}, one second"));
    }
    for (at, (label, _)) in first.iter().enumerate() {
        let values: Vec<String> = columns.iter().zip(&widths).map(|(c, w)| format!("{:w$}", c[at].1)).collect();
        println!("{label:label_width$}  {}", values.join("  |  "));
    }
}

/// Installs the CRDs and waits until Batches can be listed.
async fn install_crds(cluster: &cluster::TestCluster, client: &Client) {
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let status = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .args(["create", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/crds/nightshift.yaml")])
        .status()
        .unwrap();
    assert!(status.success(), "kubectl create -f crds/nightshift.yaml failed");
    let api: &Api<BatchResource> = &Api::namespaced(client.clone(), "default");
    let waited = poll_until(Instant::now(), Duration::from_secs(60), Duration::from_millis(500), || async move {
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => (true, String::new()),
            Err(error) => (false, format!("Batches not served: {error}")),
        }
    })
    .await;
    if let Waited::TimedOut(saw) = waited {
        panic!("the CRDs: {saw}");
    }
}

#[tokio::main]
async fn main() {
    let settings = settings();
    let started = Instant::now();
    let cluster = cluster::TestCluster::start().await;
    let client = cluster.client().await;
    install_crds(&cluster, &client).await;
    let burst = if settings.burst { Some(burst_probe(&cluster, &client).await) } else { None };
    let mut reports = Vec::new();
    for &batches in &settings.points {
        reports.push(run_point(&cluster, &client, batches, settings.samples).await);
    }
    print_table(&reports, burst.as_deref());
    println!("(all in {:.0} s)", started.elapsed().as_secs_f64());
}
