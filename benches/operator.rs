//! The controller at scale, on a real kube-apiserver (`just bench-operator`; needs the
//! tools of `tests/run`):
//!   1. 1,000 Batch resources created at once (as the api creates them: spec, then an
//!      `in_progress` status): the time until every one has its Job;
//!   2. 10,000 terminal Batches in the controller's cache: its memory (RSS) once synced.

#[path = "../tests/common/cluster.rs"]
mod cluster;
#[path = "../tests/common/ports.rs"]
#[allow(dead_code)]
mod ports;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, PostParams};
use nightshift::batches::{BatchSpec, BatchState, Status};
use nightshift::ids::{BatchId, FileId, ProjectId};
use nightshift::k8s::crd::{BATCH_LABEL, BatchResource, BatchResourceSpec, PROJECT_LABEL, resource_name};
use nightshift::validate::{Shard, ShardPlan};

const NS: &str = "bench";

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> f64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn batch(project: &ProjectId, state: BatchState) -> BatchResource {
    let spec = BatchSpec {
        id: BatchId::generate(),
        project_id: project.clone(),
        input_file_id: FileId::generate(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        metadata: Default::default(),
        created_at: nightshift::clock::now(),
        expires_at: nightshift::clock::now() + 86_400,
        model: None,
        output_expires_after: None,
        plan: ShardPlan {
            shard_lines: 5000,
            shards: vec![Shard { index: 0, first_request: 0, requests: 10, byte_start: 0, byte_end: 1000 }],
        },
    };
    let mut resource = BatchResource::new(&resource_name(&spec.id), BatchResourceSpec { batch: spec });
    resource.metadata.labels = Some([(PROJECT_LABEL.to_owned(), project.to_string())].into());
    resource.status = Some(state);
    resource
}

/// Creates `count` Batches, 64 at a time, each with its status as the api writes it.
async fn create(api: &Api<BatchResource>, project: &ProjectId, count: usize, state: BatchState) {
    futures_util::stream::iter(0..count)
        .map(|_| {
            let (api, state) = (api.clone(), state.clone());
            async move {
                let resource = batch(project, state);
                let name = resource.metadata.name.clone().unwrap();
                let mut current = api.create(&PostParams::default(), &resource).await.unwrap();
                // As the api does: on a conflict (the controller's finalizer), read again.
                loop {
                    current.status = resource.status.clone();
                    match api.replace_status(&name, &PostParams::default(), &current).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(status)) if status.code == 409 => current = api.get(&name).await.unwrap(),
                        Err(error) => panic!("{error}"),
                    }
                }
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<()>>()
        .await;
}

fn start_controller(cluster: &cluster::TestCluster, config: &std::path::Path) -> Process {
    let binary = concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/nightshift");
    let mut child = Command::new(binary)
        .args(["controller", "--namespace", NS, "--identity", "bench", "--probe-listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .env("KUBECONFIG", cluster.kubeconfig_path())
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    while let Some(Ok(line)) = lines.next() {
        if line.contains("leading") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Process(child)
}

#[tokio::main]
async fn main() {
    assert!(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/nightshift")).exists(),
        "build the release binary first: cargo build --release"
    );
    let cluster = cluster::TestCluster::start().await;
    cluster.create_namespace(NS).await;
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let status = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .args(["create", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/crds/nightshift.yaml")])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let work = tempfile::TempDir::new().unwrap();
    let config = work.path().join("nightshift.yaml");
    std::fs::write(&config, format!("storage:\n  dir: {}\n", work.path().join("data").display())).unwrap();
    let client = cluster.client().await;
    let batches: Api<BatchResource> = Api::namespaced(client.clone(), NS);
    let jobs: Api<Job> = Api::namespaced(client.clone(), NS);
    let project = ProjectId::generate();

    let controller = start_controller(&cluster, &config);
    let started = Instant::now();
    create(&batches, &project, 1000, BatchState::in_progress(nightshift::clock::now(), 10)).await;
    let created = started.elapsed();
    loop {
        let count = jobs.list_metadata(&ListParams::default().labels(BATCH_LABEL)).await.unwrap().items.len();
        if count >= 1000 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "only {count} Jobs after 10 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_jobs = started.elapsed();
    let (rss, peak) = rss_mb(controller.0.id());
    println!(
        "operator: 1,000 Batches created in {:.1} s; all 1,000 in progress with their Jobs after {:.1} s",
        created.as_secs_f64(),
        all_jobs.as_secs_f64()
    );
    println!("operator: controller RSS {rss:.1} MB (peak {peak:.1} MB) with 1,000 running Batches and their Jobs");
    drop(controller);

    let mut terminal = BatchState::in_progress(nightshift::clock::now(), 10);
    terminal.status = Status::Completed;
    terminal.completed_at = Some(nightshift::clock::now());
    terminal.request_counts.completed = 10;
    let started = Instant::now();
    create(&batches, &project, 9000, terminal).await;
    println!("operator: 9,000 more Batches (terminal) created in {:.1} s", started.elapsed().as_secs_f64());
    // The earlier 1,000 end too, so that the cache holds 10,000 terminal Batches.
    for resource in batches.list(&ListParams::default()).await.unwrap().items {
        let mut resource = resource;
        if resource.status.as_ref().is_some_and(|s| !s.status.is_terminal()) {
            let state = resource.status.as_mut().unwrap();
            state.status = Status::Cancelled;
            state.cancelled_at = Some(nightshift::clock::now());
            let name = resource.metadata.name.clone().unwrap();
            let _ = batches.replace_status(&name, &PostParams::default(), &resource).await;
        }
    }
    let controller = start_controller(&cluster, &config);
    tokio::time::sleep(Duration::from_secs(15)).await;
    let (rss, peak) = rss_mb(controller.0.id());
    println!("operator: controller RSS {rss:.1} MB (peak {peak:.1} MB) with 10,000 terminal Batches in its caches");
}
