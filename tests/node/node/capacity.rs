//! The node test's capacity-on-demand phase: a model server's Deployment woken from zero
//! replicas for a batch and scaled down after it, by the controller, within the Role the
//! chart gives it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::{CHART, Installation, NS, RELEASE};
use crate::common::image;

/// The engine's Deployment (`llama`, at zero replicas, ready once `/health` answers) and
/// its Service.
fn engine_workload(image: &str) -> (Deployment, Service) {
    let args = ["-m", "/models/tiny.gguf", "--host", "0.0.0.0", "--port", "8080", "-np", "2", "-c", "1024", "-t", "1"];
    let args: Vec<&str> =
        args.into_iter().chain(["--threads-http", "32", "--metrics", "--no-webui", "-a", "tiny"]).collect();
    let deployment = json!({
        "metadata": {"name": "llama"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "llama"}},
            "template": {
                "metadata": {"labels": {"app": "llama"}},
                "spec": {"containers": [{
                    "name": "server", "image": image, "imagePullPolicy": "Never", "args": args,
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 1},
                }]},
            },
        },
    });
    let service = json!({
        "metadata": {"name": "llama"},
        "spec": {"selector": {"app": "llama"}, "ports": [{"port": 8080, "targetPort": 8080}]},
    });
    (serde_json::from_value(deployment).unwrap(), serde_json::from_value(service).unwrap())
}

/// Replicas of the engine's Deployment over time: (seconds since `start`, asked, ready),
/// a row per change.
#[derive(Default)]
struct Timeline(Vec<(f64, i32, i32)>);

impl Timeline {
    async fn look(&mut self, deployments: &Api<Deployment>, start: Instant) -> (i32, i32) {
        let deployment = deployments.get("llama").await.unwrap();
        let asked = deployment.spec.and_then(|s| s.replicas).unwrap_or(1);
        let ready = deployment.status.and_then(|s| s.ready_replicas).unwrap_or(0);
        if self.0.last().is_none_or(|(_, a, r)| (*a, *r) != (asked, ready)) {
            self.0.push((start.elapsed().as_secs_f64(), asked, ready));
        }
        (asked, ready)
    }

    /// Looks every 250 ms until `done` (the SDK's thread) has finished.
    async fn follow<T>(&mut self, deployments: &Api<Deployment>, start: Instant, done: &std::thread::JoinHandle<T>) {
        while !done.is_finished() {
            self.look(deployments, start).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Looks until the Deployment asks for `replicas`, at most `seconds`.
    async fn until(&mut self, deployments: &Api<Deployment>, start: Instant, replicas: i32, seconds: u64) {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        while self.look(deployments, start).await.0 != replicas {
            assert!(Instant::now() < deadline, "the engine never went to {replicas} replicas: {}", self.show());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn first(&self, test: impl Fn(i32, i32) -> bool) -> Option<f64> {
        self.0.iter().find(|(_, asked, ready)| test(*asked, *ready)).map(|(at, _, _)| *at)
    }

    fn show(&self) -> String {
        self.0.iter().map(|(at, asked, ready)| format!("{at:.1}s {asked}/{ready}")).collect::<Vec<_>>().join(", ")
    }
}

/// Runs a batch of `lines` for the engine's pods through the SDK, `max_tokens` a line,
/// while following the engine's Deployment: its replicas over time, when it started, and
/// the batch as it finished.
async fn batch_following(
    installation: &Installation,
    deployments: &Api<Deployment>,
    lines: usize,
    max_tokens: u32,
) -> (Timeline, Instant, Value) {
    let start = Instant::now();
    let mut timeline = Timeline::default();
    let sdk = installation.sdk(lines, &[("MODEL", "pod-tiny"), ("MAX_TOKENS", &max_tokens.to_string())]);
    timeline.follow(deployments, start, &sdk).await;
    let mut batch = tokio::task::block_in_place(|| sdk.join().unwrap());
    (timeline, start, batch.pop().expect("the SDK printed the batch as it finished"))
}

/// The error file's lines of a finished batch, counted by code and message: what a
/// failed assertion on its status shows.
fn failure_codes(finished: &Value) -> String {
    let mut counted = BTreeMap::<String, usize>::new();
    for line in finished["errors"].as_array().into_iter().flatten() {
        let error = &line["error"];
        let reason = match line["response"]["status_code"].as_i64() {
            Some(status) => format!("HTTP {status}: {}", line["response"]["body"]),
            None => format!("{}: {}", error["code"], error["message"]),
        };
        *counted.entry(reason).or_default() += 1;
    }
    counted.iter().map(|(reason, n)| format!("{n} × {reason}")).collect::<Vec<_>>().join("; ")
}

/// Whether the controller's ServiceAccount may `verb` the `scale` of `deployment`.
fn controller_may(installation: &Installation, verb: &str, deployment: &str) -> bool {
    let out = installation
        .kubectl_command()
        .args(["auth", "can-i", verb, &format!("deployments/{deployment}"), "--subresource=scale"])
        .arg(format!("--as=system:serviceaccount:{NS}:nightshift-controller"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "yes"
}

pub(super) async fn capacity_on_demand(installation: &Installation, image_tag: &str) {
    let engine = image::engine("tiny");
    installation.node.load_images(&[&engine]);
    let (deployment, service) = engine_workload(&engine);
    let deployments = installation.api::<Deployment>().await;
    deployments.create(&PostParams::default(), &deployment).await.unwrap();
    let service = installation.api::<Service>().await.create(&PostParams::default(), &service).await.unwrap();
    let ip = service.spec.and_then(|s| s.cluster_ip).unwrap();
    let mut values: Value = serde_json::from_str(&std::fs::read_to_string(&installation.values).unwrap()).unwrap();
    values["upstreams"].as_array_mut().unwrap().push(json!({
        "name": "pods", "base_url": format!("http://{ip}:8080/v1"), "models": ["pod-*"], "max_concurrency": 8,
        "scale": {"kind": "Deployment", "name": "llama", "max_replicas": 2, "cooldown": "10s", "max_wait": "3m"},
    }));
    // Shards of 200 lines; a window of 40 s, which 600 lines of 64 tokens cannot make
    // (the tiny model gives ~500 tokens/s on this machine's two cores, one replica or two:
    // ~80 s; 16 tokens a line made it within the window on a quiet machine).
    values["config"]["batches"]["shard_lines"] = json!(200);
    values["config"]["batches"]["completion_window"] = json!("40s");
    let file = installation.helm_home.path().join("values-capacity.json");
    std::fs::write(&file, values.to_string()).unwrap();
    let tag = format!("image.tag={image_tag}");
    installation.helm(&["upgrade", RELEASE, CHART, "-f", file.to_str().unwrap(), "--set", &tag, "--wait"]);
    assert!(controller_may(installation, "patch", "llama"), "the chart's Role lets the controller scale llama");
    assert!(!controller_may(installation, "patch", "nightshift-api"), "and no workload it was not told of");

    // A batch wakes the engine from zero; its lines wait for the ready replica.
    let (mut woken, start, finished) = batch_following(installation, &deployments, 20, 8).await;
    assert_eq!(finished["counts"], json!({"total": 20, "completed": 20, "failed": 0}), "none lost: {finished}");
    let output = finished["output"].as_array().unwrap();
    assert!(output.iter().all(|r| r["response"]["body"]["model"] == "tiny"), "answered by the engine's pod");
    let first_answer = output.iter().filter_map(|r| r["response"]["body"]["created"].as_i64()).min().unwrap();
    let created = finished["created_at"].as_i64().unwrap();
    woken.until(&deployments, start, 0, 90).await;
    eprintln!(
        "[node] capacity: woken from zero: asked at {:.1}s, ready at {:.1}s, first line answered {} s after the batch's create, back at zero at {:.1}s (cooldown 10 s): {}",
        woken.first(|asked, _| asked == 1).unwrap(),
        woken.first(|_, ready| ready == 1).unwrap(),
        first_answer - created,
        woken.0.last().unwrap().0,
        woken.show()
    );
    assert!(woken.0.iter().all(|(_, asked, _)| *asked <= 1), "one replica was enough: {}", woken.show());

    // A batch that one replica cannot finish in its window: woken, then a second replica.
    let (mut late, start, finished) = batch_following(installation, &deployments, 600, 64).await;
    assert_eq!(
        finished["status"],
        "expired",
        "{}; why lines failed: {}; replicas over time: {}",
        finished["counts"],
        failure_codes(&finished),
        late.show()
    );
    let errors = finished["errors"].as_array().unwrap();
    assert!(
        errors.iter().all(|line| line["error"]["code"] == "batch_expired"),
        "no line failed but by the window's end (none against a replica going away or not yet \
         reachable): {}; replicas over time: {}",
        failure_codes(&finished),
        late.show()
    );
    late.until(&deployments, start, 0, 120).await;
    eprintln!("[node] capacity: a late batch ({}): replicas over time: {}", finished["counts"], late.show());
    assert!(late.first(|asked, _| asked == 2).is_some(), "scaled to two for the window: {}", late.show());
    assert!(late.0.iter().all(|(_, asked, _)| *asked <= 2), "never past max_replicas: {}", late.show());
    let nightshift_api = deployments.get("nightshift-api").await.unwrap();
    assert_eq!(nightshift_api.spec.unwrap().replicas, Some(2), "a workload not named is never touched");
}
