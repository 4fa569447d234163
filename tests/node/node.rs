//! The deployment path as a user takes it, on a real node: the image built from the
//! Dockerfile, `helm install` of the chart with its default security settings, the api,
//! the controller and the worker Jobs as real pods (containerd, runc, CNI, kube-proxy), S3
//! served by s3s-fs on the host, and the official OpenAI SDK reaching the api through its
//! Service's ClusterIP. Then the faults a cluster brings: a worker container killed
//! mid-shard, the leading controller's pod deleted mid-batch, `helm upgrade` to a rebuilt
//! image mid-batch, then the night shift (worker pods reading a model server's load
//! signal while its users keep it busy; then a real engine's, llama.cpp's llama-server),
//! and removal as docs/src/kubernetes.md describes it.
//!
//! One test, in phases, on one node: a node takes about half a minute to start and the
//! phases build on one installation, as a user's do. A failing phase prints the node's
//! component logs and every pod's log.
//!
//! Needs the control plane and node binaries (tests/tools/install-kube.sh), the node's
//! runtime and images (tests/tools/install-node.sh), helm, s3s-fs, llama-server
//! (tests/tools/install-engine.sh) and the SDK's venv; `tests/run` installs them all.

mod applied;
mod capacity;

use crate::common;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{ClusterOptions, TestCluster, eventually};
use common::committed::{check_kill_laws, committed_custom_ids, settle};
use common::engine::LlamaServer;
use common::image;
use common::interactive::Interactive;
use common::node::{NODE_NAME, POD_CIDR, RealNode, host_address};
use common::simulator::{SimConfig, Simulator};
use common::tools::{helm, kubectl_bin, run};
use common::upstream::MockUpstream;
use common::{KEY, PROJECT, TestS3};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use nightshift::k8s::crd::{BATCH_LABEL, resource_name};
use serde_json::{Value, json};
use tempfile::TempDir;

const NS: &str = "nightshift";
const RELEASE: &str = "nightshift";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nightshift");
const SDK_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/operator_sdk.py");
/// Lines per shard (one Job each) and the upstream's concurrency (over the installation).
const SHARD_LINES: usize = 10;
const CONCURRENCY: u64 = 2;

/// Everything of one installation; fields drop in order, so the node's containers stop
/// before its control plane.
struct Installation {
    node: RealNode,
    cluster: TestCluster,
    s3: TestS3,
    upstream: MockUpstream,
    /// A model server with users of its own and a load signal (`sim-*` models).
    sim: Simulator,
    /// A real one (the model `tiny`), reached through `engine_front`.
    engine: LlamaServer,
    engine_front: EngineFront,
    helm_home: TempDir,
    values: std::path::PathBuf,
    api_url: String,
}

impl Installation {
    async fn start(image: &str) -> Installation {
        let host = host_address();
        let cluster = TestCluster::start_with(ClusterOptions::for_real_node(host)).await;
        let node = RealNode::start(&cluster, host).await;
        node.load_images(&[image]);
        let s3 = TestS3::start_on(host);
        let upstream = MockUpstream::start_on(host).await;
        // Four places, 20 ms steps: a line of 32 tokens holds one for about 0.7 s.
        let sim_config = SimConfig { max_batch: 4, step_base: Duration::from_millis(20), ..SimConfig::default() };
        let sim = Simulator::start_on(&format!("{host}:0"), sim_config).await;
        let engine = LlamaServer::start_on(&host.to_string(), "tiny", 4).await;
        let engine_front = EngineFront::start(host.into(), engine.url.clone()).await;
        cluster.create_namespace(NS).await;
        let secret = Secret {
            metadata: kube::api::ObjectMeta { name: Some("nightshift-s3".into()), ..Default::default() },
            string_data: Some(
                [
                    ("AWS_ACCESS_KEY_ID".to_owned(), common::S3_ACCESS_KEY.to_owned()),
                    ("AWS_SECRET_ACCESS_KEY".to_owned(), common::S3_SECRET_KEY.to_owned()),
                ]
                .into(),
            ),
            ..Secret::default()
        };
        Api::<Secret>::namespaced(cluster.client().await, NS).create(&PostParams::default(), &secret).await.unwrap();

        let helm_home = TempDir::new().unwrap();
        let values = helm_home.path().join("values.yaml");
        let (repository, tag) = image.rsplit_once(':').unwrap();
        let values_json = json!({
            "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
            "storage": {"s3": {
                "bucket": s3.bucket, "endpoint": s3.endpoint, "pathStyle": true,
                "credentials": {"existingSecret": "nightshift-s3"},
            }},
            "upstreams": [{"name": "mock", "base_url": upstream.base_url, "models": ["mock-*"],
                           "max_concurrency": CONCURRENCY},
                          {"name": "sim", "base_url": sim.url, "models": ["sim-*"], "max_concurrency": 64,
                           "priority": 1, "load_signal": {"url": sim.metrics_url()}},
                          // No load signal set: each worker pod finds llama-server's.
                          {"name": "engine", "base_url": format!("{}/v1", engine_front.url),
                           "models": [engine.alias], "max_concurrency": 64}],
            "projects": [{"name": "demo", "id": PROJECT,
                          "apiKeys": [{"sha256": hex::encode(nightshift::config::key_digest(KEY))}]}],
            "config": {"batches": {"shard_lines": SHARD_LINES, "checkpoint_interval": "100ms", "cancel_grace": "5s"}},
            "controller": {"replicas": 2, "leaseSeconds": 5},
        });
        std::fs::write(&values, serde_json::to_string(&values_json).unwrap()).unwrap();
        let mut installation = Installation {
            node,
            cluster,
            s3,
            upstream,
            sim,
            engine,
            engine_front,
            helm_home,
            values,
            api_url: String::new(),
        };
        let started = Instant::now();
        installation.helm(&["install", RELEASE, CHART, "-f", installation.values.to_str().unwrap(), "--wait"]);
        eprintln!("[node] helm install --wait: ready in {:.1?}", started.elapsed());
        let ip = installation.kubectl(&["get", "svc", "nightshift-api", "-o", "jsonpath={.spec.clusterIP}"]);
        installation.api_url = format!("http://{ip}:80");
        installation
    }

    fn helm(&self, args: &[&str]) -> String {
        let kubeconfig = self.cluster.kubeconfig_path().to_str().unwrap().to_owned();
        run(helm(self.helm_home.path()).args(args).args([
            "--namespace",
            NS,
            "--kubeconfig",
            &kubeconfig,
            "--timeout",
            "5m0s",
        ]))
    }

    fn kubectl(&self, args: &[&str]) -> String {
        run(self.kubectl_command().args(args))
    }

    /// kubectl on this cluster, in the test's namespace.
    fn kubectl_command(&self) -> Command {
        let mut command = Command::new(kubectl_bin());
        command.arg("--kubeconfig").arg(self.cluster.kubeconfig_path()).args(["--namespace", NS]);
        command
    }

    async fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope> + Clone + serde::de::DeserializeOwned,
        K::DynamicType: Default,
    {
        Api::namespaced(self.cluster.client().await, NS)
    }

    async fn pods(&self, labels: &str) -> Vec<Pod> {
        self.api::<Pod>().await.list(&ListParams::default().labels(labels)).await.unwrap().items
    }

    /// The SDK script in a thread: upload, create, wait, download (tests/e2e/operator_sdk.py).
    fn sdk(&self, lines: usize, env: &[(&str, &str)]) -> std::thread::JoinHandle<Vec<Value>> {
        let mut command = Command::new(common::tools::python());
        command
            .arg(SDK_SCRIPT)
            .env("NIGHTSHIFT_URL", &self.api_url)
            .env("NIGHTSHIFT_PROJECT_ID", PROJECT)
            .env("NIGHTSHIFT_API_KEY", KEY)
            .env("LINES", lines.to_string())
            .env("TIMEOUT", "240")
            .envs(env.iter().copied());
        std::thread::spawn(move || {
            let output = command.output().unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                output.status.success(),
                "the SDK script failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            stdout.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
        })
    }

    /// Prints every pod's log of the namespace, the pods' addresses and the Services'
    /// endpoints, and the events (for a failed phase).
    fn print_pod_logs(&self) {
        let Ok(out) = self.kubectl_command().args(["get", "pods", "-o", "name"]).output() else {
            return;
        };
        for pod in String::from_utf8_lossy(&out.stdout).lines() {
            if let Ok(logs) = self.kubectl_command().args(["logs", "--tail=30", pod]).output() {
                eprintln!(
                    "===== {pod} =====\n{}{}",
                    String::from_utf8_lossy(&logs.stdout),
                    String::from_utf8_lossy(&logs.stderr)
                );
            }
        }
        // Who had which address, and which addresses each Service sent to; then the events.
        let listings: [(&str, &[&str]); 2] = [
            ("pods and endpoints", &["get", "pods,endpointslices", "-o", "wide"]),
            ("events", &["get", "events", "--sort-by=.lastTimestamp"]),
        ];
        for (what, args) in listings {
            if let Ok(out) = self.kubectl_command().args(args).output() {
                eprintln!("===== {what} =====\n{}", String::from_utf8_lossy(&out.stdout));
            }
        }
    }
}

impl Drop for Installation {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_pod_logs();
        }
    }
}

/// A model server passed through on the host, every path, by a front that records who read
/// its `/metrics` (llama-server does not say). Upstreams that name the front find the
/// server's load signal beside its API, as an untuned installation does.
struct EngineFront {
    /// The server's address through the front (`http://host:port`, no path).
    url: String,
    readers: Arc<Mutex<BTreeSet<IpAddr>>>,
}

impl EngineFront {
    async fn start(host: IpAddr, engine: String) -> Self {
        use axum::extract::{ConnectInfo, Request, State};
        use axum::http::StatusCode;
        use axum::http::header::CONTENT_TYPE;
        type Shared = (Arc<Mutex<BTreeSet<IpAddr>>>, String, reqwest::Client);
        let readers: Arc<Mutex<BTreeSet<IpAddr>>> = Arc::default();
        let state: Shared = (readers.clone(), engine, reqwest::Client::new());
        let pass = |ConnectInfo(peer): ConnectInfo<SocketAddr>,
                    State((readers, engine, client)): State<Shared>,
                    request: Request| async move {
            let (parts, body) = request.into_parts();
            if parts.uri.path() == "/metrics" {
                readers.lock().unwrap().insert(peer.ip());
            }
            let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            let body =
                axum::body::to_bytes(body, usize::MAX).await.map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
            let mut sent = client.request(parts.method, format!("{engine}{path}")).body(body);
            if let Some(kind) = parts.headers.get(CONTENT_TYPE) {
                sent = sent.header(CONTENT_TYPE, kind);
            }
            let answer = sent.send().await.map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
            let status = answer.status();
            let kind = answer.headers().get(CONTENT_TYPE).cloned();
            let body = answer.bytes().await.map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
            Ok::<_, (StatusCode, String)>((status, kind.map(|k| [(CONTENT_TYPE, k)]), body))
        };
        let app = axum::Router::new().fallback(pass).with_state(state);
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(host, 0)).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });
        Self { url, readers }
    }

    fn readers(&self) -> BTreeSet<IpAddr> {
        self.readers.lock().unwrap().clone()
    }
}

/// The SDK's last line: the batch completed, every input line is in the output exactly
/// once, answered by the upstream.
fn check_results(lines: &[Value], expected: usize) {
    let finished = lines.last().expect("the SDK printed nothing");
    assert_eq!(finished["event"], "finished", "{finished}");
    assert_eq!(finished["status"], "completed", "{finished}");
    let output = finished["output"].as_array().unwrap();
    let ids: HashSet<&str> = output.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    let wanted: HashSet<String> = (0..expected).map(|n| format!("line-{n}")).collect();
    assert_eq!(ids.len(), output.len(), "no line twice in the output");
    assert_eq!(ids, wanted.iter().map(String::as_str).collect(), "every input line in the output");
    assert_eq!(finished["counts"], json!({"total": expected, "completed": expected, "failed": 0}));
    for record in output {
        let id = record["custom_id"].as_str().unwrap();
        assert_eq!(record["response"]["status_code"], 200, "{record}");
        assert_eq!(record["response"]["body"]["choices"][0]["message"]["content"], format!("answer to {id}"));
    }
}

fn batch_id(lines: &[Value]) -> String {
    lines.first().and_then(|l| l["id"].as_str()).expect("the SDK printed the batch id").to_owned()
}

/// The label selector of a batch's Jobs and worker pods.
fn batch_selector(batch: &str) -> String {
    let id = nightshift::ids::BatchId::parse(batch).expect("a batch id");
    format!("{BATCH_LABEL}={}", resource_name(&id))
}

fn in_pod_cidr(ip: &str) -> bool {
    let prefix = POD_CIDR.rsplit_once('.').unwrap().0;
    ip.starts_with(&format!("{prefix}."))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_batches_in_real_pods_of_the_built_image_and_survives_faults() {
    let image = image::build("1");
    let installation = Installation::start(&image).await;
    let upstream = &installation.upstream;

    // -- 1. A batch through the SDK: real worker Job pods, output checked line by line.
    let lines = tokio::task::block_in_place(|| installation.sdk(30, &[("MODEL", "mock-a")]).join().unwrap());
    check_results(&lines, 30);
    let batch = batch_id(&lines);
    let jobs = installation.api::<Job>().await.list(&ListParams::default().labels(&batch_selector(&batch))).await;
    assert_eq!(jobs.unwrap().items.len(), 3, "one Job per shard of {SHARD_LINES} lines");
    // The batch can be done before the kubelet reports its pods' exit: wait for the phases.
    let workers = eventually("the worker pods to be reported Succeeded", 60, || async {
        let pods = installation.pods(&batch_selector(&batch)).await;
        let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());
        pods.iter().all(|p| phase(p).as_deref() == Some("Succeeded")).then_some(pods)
    })
    .await;
    assert_eq!(workers.len(), 3, "one pod per Job, none retried");
    for pod in &workers {
        let spec = pod.spec.as_ref().unwrap();
        let status = pod.status.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some(NODE_NAME), "scheduled onto the real node");
        assert_eq!(status.phase.as_deref(), Some("Succeeded"));
        assert!(in_pod_cidr(status.pod_ip.as_deref().unwrap_or("")), "a CNI address: {:?}", status.pod_ip);
        let container = &status.container_statuses.as_ref().unwrap()[0];
        assert_eq!(container.image, image, "the worker ran the built image");
        assert!(container.container_id.as_deref().unwrap_or("").starts_with("containerd://"));
        // No Kubernetes credentials in a worker: no token volume was mounted.
        let mounts = spec.containers[0].volume_mounts.clone().unwrap_or_default();
        assert!(mounts.iter().all(|m| !m.mount_path.starts_with("/var/run/secrets/kubernetes.io")), "{mounts:?}");
    }
    // As kubectl users expect: a condition to wait on, and the progress column.
    let name = resource_name(&nightshift::ids::BatchId::parse(&batch).unwrap());
    installation.kubectl(&["wait", "--for=condition=Complete", "--timeout=30s", &format!("batch/{name}")]);
    let progress = installation.kubectl(&["get", "batch", &name, "-o", "jsonpath={.status.progress}"]);
    assert_eq!(progress, "100%");
    // The kubelet serves logs through the API server.
    let worker_log = installation.kubectl(&["logs", &workers[0].name_any()]);
    assert!(!worker_log.is_empty(), "a worker pod's log is readable through kubectl");
    for pod in installation.pods("app.kubernetes.io/component in (api,controller)").await {
        let status = pod.status.as_ref().unwrap();
        assert_eq!(status.phase.as_deref(), Some("Running"), "{}", pod.name_any());
        assert!(status.container_statuses.as_ref().unwrap()[0].ready, "{} is ready", pod.name_any());
    }

    // -- 1b. A Batch applied with kubectl, as a GitOps repository holds it.
    applied::applied_batch(&installation).await;

    // -- 2. A worker container killed mid-shard: the Job's next pod resumes the shard.
    upstream.delay(Duration::from_millis(600));
    let calls_before = upstream.total_calls();
    let per_line_before = upstream.all_calls();
    let sdk = installation.sdk(20, &[("MODEL", "mock-b")]);
    let victim = eventually("a worker pod in the middle of its shard", 120, || async {
        let done = upstream.total_calls() - calls_before;
        if done < 3 {
            return None;
        }
        let pods = installation.pods(BATCH_LABEL).await;
        let pod = pods.into_iter().find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))?;
        let id = pod.status.as_ref()?.container_statuses.as_ref()?[0].container_id.clone()?;
        let id = id.strip_prefix("containerd://")?.to_owned();
        installation.node.kill_container(&id);
        Some(pod)
    })
    .await;
    // What the killed pod had committed (its shard's next pod starts after the Job
    // controller's backoff), and the calls since this phase began.
    settle(upstream).await;
    let committed = committed_custom_ids(&*installation.s3.store(), &[&batch]).await;
    let since = |calls: HashMap<String, u32>| -> HashMap<String, u32> {
        calls
            .into_iter()
            .map(|(line, n)| (line.clone(), n - per_line_before.get(&line).copied().unwrap_or(0)))
            .collect()
    };
    let sent_at_kill = since(upstream.all_calls());
    let lines = tokio::task::block_in_place(|| sdk.join().unwrap());
    check_results(&lines, 20);
    let job_name = victim.labels().get("job-name").unwrap().clone();
    // The Job controller counts pods after the kubelet reports them, maybe after the batch is done.
    let counts = eventually("the Job to count the killed pod and the finished one", 60, || async {
        let status = installation.api::<Job>().await.get(&job_name).await.ok()?.status?;
        status.succeeded.map(|_| (status.failed, status.succeeded))
    })
    .await;
    assert_eq!(counts, (Some(1), Some(1)), "the killed pod failed, the next one finished");
    // The batches of every phase use the custom_ids line-0, line-1, ...: this phase's calls
    // only. Nothing committed at the kill was sent again; only lines sent and not committed.
    let resent = check_kill_laws(&sent_at_kill, &committed, &since(upstream.all_calls()));
    eprintln!("[node] killed a worker: {} lines committed at the kill, {} sent again", committed.len(), resent.len());

    // -- 3. The leading controller's pod deleted mid-batch: the other replica finishes.
    upstream.delay(Duration::from_millis(300));
    let calls_before = upstream.total_calls();
    let sdk = installation.sdk(30, &[("MODEL", "mock-c")]);
    eventually("the batch under way", 120, || async { (upstream.total_calls() - calls_before >= 3).then_some(()) })
        .await;
    let leases = installation.api::<Lease>().await;
    let leader = leases.get("nightshift-controller").await.unwrap().spec.unwrap().holder_identity.unwrap();
    installation.kubectl(&["delete", "pod", &leader, "--wait=false"]);
    let lines = tokio::task::block_in_place(|| sdk.join().unwrap());
    check_results(&lines, 30);
    let new_leader = leases.get("nightshift-controller").await.unwrap().spec.unwrap().holder_identity.unwrap();
    assert_ne!(new_leader, leader, "another controller pod leads");

    // -- 4. helm upgrade to a rebuilt image mid-batch.
    let rebuilt = image::build("2");
    assert_ne!(rebuilt, image);
    installation.node.load_images(&[&rebuilt]);
    let calls_before = upstream.total_calls();
    let sdk = installation.sdk(40, &[("MODEL", "mock-d")]);
    eventually("the batch under way", 120, || async { (upstream.total_calls() - calls_before >= 3).then_some(()) })
        .await;
    let tag = rebuilt.rsplit_once(':').unwrap().1;
    installation.helm(&[
        "upgrade",
        RELEASE,
        CHART,
        "-f",
        installation.values.to_str().unwrap(),
        "--set",
        &format!("image.tag={tag}"),
        "--wait",
    ]);
    let lines = tokio::task::block_in_place(|| sdk.join().unwrap());
    check_results(&lines, 40);
    eventually("every api and controller pod on the rebuilt image", 120, || async {
        let pods = installation.pods("app.kubernetes.io/component in (api,controller)").await;
        let rolled = pods.iter().all(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .is_some_and(|c| c[0].image == rebuilt && c[0].ready)
        });
        (rolled && pods.len() == 4).then_some(())
    })
    .await;

    // -- 4b. A batch cancelled mid-run: its worker pods stop, the lines that ran keep their
    // answers, and the lines never sent get `batch_cancelled`. Lines of a second each: a
    // pod's shard takes some 5 s, so the batch is still under way when the SDK cancels.
    upstream.delay(Duration::from_secs(1));
    let calls_before = upstream.total_calls();
    let lines = tokio::task::block_in_place(|| {
        installation.sdk(40, &[("MODEL", "mock-e"), ("CANCEL_AFTER", "4")]).join().unwrap()
    });
    let finished = lines.last().expect("the SDK printed nothing");
    assert_eq!(finished["status"], "cancelled", "{}", finished["counts"]);
    assert!(finished["cancelled_at"].as_i64() >= finished["cancelling_at"].as_i64(), "{finished}");
    let (output, errors) = (finished["output"].as_array().unwrap(), finished["errors"].as_array().unwrap());
    assert!(output.len() >= 4 && !errors.is_empty(), "cancelled mid-run: {}", finished["counts"]);
    assert_eq!(output.len() + errors.len(), 40, "every line once, answered or cancelled");
    assert_eq!(finished["counts"]["completed"], output.len(), "{}", finished["counts"]);
    assert!(output.iter().all(|r| r["response"]["status_code"] == 200), "{output:?}");
    assert!(errors.iter().all(|r| r["error"]["code"] == "batch_cancelled"), "{errors:?}");
    settle(upstream).await;
    assert_eq!(upstream.total_calls() - calls_before, output.len() as u64, "no cancelled line was sent");
    let batch = batch_id(&lines);
    eventually("the cancelled batch's worker pods to stop", 60, || async {
        let pods = installation.pods(&batch_selector(&batch)).await;
        let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());
        pods.iter().all(|p| matches!(phase(p).as_deref(), Some("Succeeded" | "Failed"))).then_some(())
    })
    .await;
    eprintln!("[node] cancelled mid-run: {} lines answered, {} cancelled", output.len(), errors.len());

    // -- 5. The night shift: two users keep a request each at a server of four places,
    // and a batch of four shards (a worker pod each) runs beside them. Each pod reads the
    // server's load signal over the pod network and sends its lines with the upstream's
    // `priority`.
    let sim = &installation.sim;
    let users = Interactive::closed(&sim.url, 2, 32);
    let lines = tokio::task::block_in_place(|| installation.sdk(40, &[("MODEL", "sim-a")]).join().unwrap());
    let latencies = users.stop().await;
    let finished = lines.last().expect("the SDK printed nothing");
    assert_eq!(finished["status"], "completed", "{finished}");
    assert_eq!(finished["counts"], json!({"total": 40, "completed": 40, "failed": 0}));
    let output = finished["output"].as_array().unwrap();
    assert!(output.iter().all(|r| r["response"]["body"]["model"] == "sim-a"), "answered by the simulator");
    let stats = sim.stats();
    assert_eq!(stats.finished.get(&1), Some(&40), "each line once, with the upstream's priority: {:?}", stats.finished);
    assert!(latencies.failed == 0 && stats.finished.get(&0).copied().unwrap_or(0) > 0, "the users were served");
    // Every worker pod of the batch read the signal itself, from its own address.
    let batch = batch_id(&lines);
    let pod_ips: Vec<std::net::IpAddr> = eventually("the batch's worker pods and their addresses", 60, || async {
        let pods = installation.pods(&batch_selector(&batch)).await;
        let ips: Option<Vec<_>> = pods.iter().map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse().ok()).collect();
        ips.filter(|ips| ips.len() == 4)
    })
    .await;
    for ip in &pod_ips {
        assert!(
            stats.metrics_reads.contains_key(ip),
            "worker pod {ip} read the load signal: {:?}",
            stats.metrics_reads
        );
    }
    let users_waited = stats.waited.get(&0).map_or(0, |w| w.iter().filter(|w| **w > Duration::from_millis(40)).count());
    eprintln!(
        "[node] night shift: {} load-signal reads by {} worker pods; users' p99 {:.0} ms, {users_waited} of {} of their requests waited over two steps; the server's longest queue {}",
        pod_ips.iter().map(|ip| stats.metrics_reads[ip]).sum::<u64>(),
        pod_ips.len(),
        latencies.percentile(99.0) * 1000.0,
        latencies.seconds.len(),
        stats.peak_waiting
    );

    // -- 5b. The same on a real engine, untuned: every worker pod of the batch finds
    // llama-server's load signal beside its API and reads it through the `llamacpp` preset.
    let model = installation.engine.alias.clone();
    let lines = tokio::task::block_in_place(|| {
        installation.sdk(40, &[("MODEL", model.as_str()), ("MAX_TOKENS", "8")]).join().unwrap()
    });
    let finished = lines.last().expect("the SDK printed nothing");
    assert_eq!(finished["counts"], json!({"total": 40, "completed": 40, "failed": 0}), "{finished}");
    let output = finished["output"].as_array().unwrap();
    for record in output {
        let body = &record["response"]["body"];
        assert_eq!(body["model"], model.as_str(), "answered by llama-server: {record}");
        assert_eq!(body["usage"]["completion_tokens"], 8, "{record}");
    }
    let batch = batch_id(&lines);
    let pods: Vec<(String, IpAddr)> = eventually("the engine batch's worker pods and their addresses", 60, || async {
        let pods = installation.pods(&batch_selector(&batch)).await;
        let found: Option<Vec<_>> =
            pods.iter().map(|p| Some((p.name_any(), p.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?))).collect();
        found.filter(|pods| pods.len() == 4)
    })
    .await;
    let readers = installation.engine_front.readers();
    for (name, ip) in &pods {
        assert!(readers.contains(ip), "worker pod {ip} looked for llama-server's load signal: {readers:?}");
        let log = installation.kubectl(&["logs", name]);
        assert!(
            log.lines().any(|l| l.contains("found the server's load signal") && l.contains("Llamacpp")),
            "worker pod {name} found llama-server's signal: {log}"
        );
    }
    eprintln!("[node] llama-server: 40 lines by {} worker pods, each found and read its signal", pods.len());

    // -- 5c. Capacity on demand: llama-server as a Deployment at zero replicas, woken by a
    // batch, given back after the cooldown; a batch that would miss its window at one
    // replica scales it to two.
    capacity::capacity_on_demand(&installation, rebuilt.rsplit_once(':').unwrap().1).await;

    // -- 6. Removal as docs/src/kubernetes.md says: Batches first (the controller cleans up
    // their Jobs and shard data), then helm uninstall: no pods and no Jobs are left.
    installation.kubectl(&["delete", "batches", "--all", "--timeout=120s"]);
    installation.helm(&["uninstall", RELEASE]);
    eventually("no pods and no Jobs left", 120, || async {
        let pods = installation.api::<Pod>().await.list(&ListParams::default()).await.ok()?.items;
        let jobs = installation.api::<Job>().await.list(&ListParams::default()).await.ok()?.items;
        (pods.is_empty() && jobs.is_empty()).then_some(())
    })
    .await;
    let leftover = installation.node.ctr(&["containers", "list", "--quiet"]).unwrap();
    eprintln!("[node] containers left in containerd after uninstall: {}", leftover.lines().count());
}
