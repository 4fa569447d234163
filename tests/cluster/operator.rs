//! The operator on a real Kubernetes API server (kube-apiserver, etcd and
//! kube-controller-manager on 127.0.0.1, a stand-in kubelet that runs each Pod's
//! command locally), with a real S3 server and the official OpenAI SDK:
//! SDK → `nightshift api` → Batch → controller → Jobs → Pods → finalize → output.
//! The api and the controller run with ServiceAccount tokens bound only to their own Roles.
//!
//! This file is the harness ([`Operator`], [`Setup`]) and what the tests share; the tests
//! are in `operator/`: a batch end to end, faults, replicas, hand-made objects.

mod end_to_end;
mod faults;
mod objects;
mod replicas;

use crate::common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::TestS3;
use common::cluster::{TestCluster, eventually};
use common::kubelet::Kubelet;
use common::process::{Process, spawn};
use common::simulator::Simulator;
use common::sts::Sts;
use common::upstream::MockUpstream;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::core::CustomResourceExt;
use nightshift::k8s::crd::{BATCH_LABEL, BatchResource, ProjectResource};
use nightshift::k8s::rbac;
use serde_json::{Value, json};
use tempfile::TempDir;

pub(crate) const NS: &str = "nightshift";
const IMAGE: &str = "nightshift:test";

/// What the STS stand-in accepts, as IRSA's webhook would set it up.
const WEB_IDENTITY_TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.operator-test.signature";
const ROLE_ARN: &str = "arn:aws:iam::123456789012:role/nightshift";

pub(crate) struct Operator {
    sts: Option<Sts>,
    pub(crate) cluster: TestCluster,
    pub(crate) s3: TestS3,
    pub(crate) upstream: MockUpstream,
    kubelet: Kubelet,
    dir: TempDir,
    config: PathBuf,
    env: Vec<(&'static str, String)>,
    pub(crate) api_url: String,
    _api: Process,
    controller: Option<Process>,
    controller_kubeconfig: PathBuf,
    /// Where controller-1 serves its probes, `/metrics` and `/backlog`.
    pub(crate) probe_port: u16,
    api_token: String,
    pub(crate) controller_token: String,
}

impl Drop for Operator {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = std::fs::read_dir(self.dir.path()).unwrap().filter_map(Result::ok).map(|e| e.path());
            for path in logs.filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("controller-")) {
                common::cluster::print_tail(&path.file_name().unwrap().to_string_lossy(), &path);
            }
        }
    }
}

pub(crate) async fn bind_role(
    cluster: &TestCluster,
    name: &str,
    rules: Vec<k8s_openapi::api::rbac::v1::PolicyRule>,
) -> String {
    let client = cluster.client().await;
    let meta = |name: &str| ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(NS.to_owned()),
        ..ObjectMeta::default()
    };
    let pp = PostParams::default();
    Api::<ServiceAccount>::namespaced(client.clone(), NS)
        .create(&pp, &ServiceAccount { metadata: meta(name), ..Default::default() })
        .await
        .unwrap();
    Api::<Role>::namespaced(client.clone(), NS)
        .create(&pp, &Role { metadata: meta(name), rules: Some(rules) })
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: meta(name),
        role_ref: RoleRef { api_group: "rbac.authorization.k8s.io".into(), kind: "Role".into(), name: name.into() },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(NS.into()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client, NS).create(&pp, &binding).await.unwrap();
    cluster.service_account_token(NS, name).await
}

/// The worker image that the stand-in kubelet runs as `/bin/false`: every pod fails.
const FAILING_IMAGE: &str = "nightshift:failing";

/// An image that the stand-in kubelet runs as `/bin/sleep`: a pod that is ready and
/// does nothing (a model server's replica, where the upstream is served elsewhere).
pub(crate) const SLEEPER_IMAGE: &str = "sleeper:test";

/// What an operator test starts: `Setup::new(..)`, then the fields it changes.
pub(crate) struct Setup<'a> {
    /// Lines per shard.
    pub(crate) shard_lines: u32,
    /// How long the mock upstream takes to answer.
    pub(crate) upstream_delay: Duration,
    /// The mock upstream's `max_concurrency`.
    pub(crate) concurrency: usize,
    /// The worker Jobs' image.
    pub(crate) worker_image: &'a str,
    /// YAML appended to the `batches:` section.
    pub(crate) batches: &'a str,
    /// YAML appended to the `upstreams:` section (after the mock's fields: indented by
    /// four, more of the mock's; by two, another upstream).
    pub(crate) upstreams: &'a str,
    /// Every role (api, controller, worker pods) reaches S3 as IRSA would have it: a
    /// token file and a role, traded at an STS stand-in for keys.
    pub(crate) web_identity: bool,
}

impl Setup<'_> {
    pub(crate) fn new(shard_lines: u32, upstream_delay: Duration, concurrency: usize) -> Self {
        Setup {
            shard_lines,
            upstream_delay,
            concurrency,
            worker_image: IMAGE,
            batches: "",
            upstreams: "",
            web_identity: false,
        }
    }
}

impl Operator {
    /// Another replica of the api, as a Deployment scaled up would start, and its URL.
    fn another_api(&self, name: &str) -> (impl Drop, String) {
        let dir = self.dir.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let mut env = self.env.clone();
        let kubeconfig = self.cluster.kubeconfig_for_token(&self.api_token, &dir);
        env.push(("KUBECONFIG", kubeconfig.display().to_string()));
        let config = self.config.display().to_string();
        let (child, line) = spawn(
            &[
                "api",
                "--config",
                &config,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--namespace",
                NS,
            ],
            &env,
            "listening on",
            &self.dir.path().join(format!("{name}.log")),
        );
        (child, line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned())
    }

    /// An installation whose upstream `sim` is `sim`, its load signal read, with
    /// `fields` (YAML, each line indented by four) added to it; four shards of
    /// `shard_lines` run at once.
    pub(crate) async fn for_simulator(sim: &Simulator, fields: &str, shard_lines: u32) -> Self {
        let upstream = format!(
            "  - name: sim\n    base_url: {url}\n    models: [\"sim-*\"]\n    load_signal: {{url: \"{metrics}\"}}\n{fields}",
            url = sim.url,
            metrics = sim.metrics_url()
        );
        let batches = "  max_running_shards: 4\n";
        Self::set_up(Setup { batches, upstreams: &upstream, ..Setup::new(shard_lines, Duration::ZERO, 16) }).await
    }

    pub(crate) async fn start(shard_lines: u32, upstream_delay: Duration, concurrency: usize) -> Self {
        Self::set_up(Setup::new(shard_lines, upstream_delay, concurrency)).await
    }

    /// `worker_image` for the Jobs; `batches` is YAML appended to the `batches:` section.
    async fn start_with(
        shard_lines: u32,
        upstream_delay: Duration,
        concurrency: usize,
        worker_image: &str,
        batches: &str,
    ) -> Self {
        Self::set_up(Setup { worker_image, batches, ..Setup::new(shard_lines, upstream_delay, concurrency) }).await
    }

    pub(crate) async fn set_up(setup: Setup<'_>) -> Self {
        let Setup { shard_lines, upstream_delay, concurrency, worker_image, batches, upstreams, web_identity } = setup;
        let cluster = TestCluster::start().await;
        cluster.create_namespace(NS).await;
        let client = cluster.client().await;

        // The CRDs, as `kubectl apply -f crds/` would install them.
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        // This API server (1.20) predates CRD validation rules: kubectl's own check would
        // refuse their fields, and the server drops them (docs/src/applied-batches.md).
        let committed = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/nightshift.yaml");
        kubectl(&cluster, &["create", "--validate=false", "-f", committed]);
        for crd in [BatchResource::crd(), ProjectResource::crd()] {
            let name = crd.metadata.name.clone().unwrap();
            eventually(&format!("CRD {name} established"), 30, || {
                let crds = crds.clone();
                let name = name.clone();
                async move {
                    let crd = crds.get(&name).await.ok()?;
                    let conditions = crd.status?.conditions?;
                    conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
                }
            })
            .await;
        }

        create_project(&client, "demo", common::PROJECT, common::KEY).await;

        let api_token = bind_role(&cluster, "nightshift-api", rbac::api_rules()).await;
        let controller_token = bind_role(&cluster, "nightshift-controller", rbac::controller_rules()).await;
        let dir = TempDir::new().unwrap();
        std::fs::create_dir(dir.path().join("api")).unwrap();
        std::fs::create_dir(dir.path().join("controller")).unwrap();
        let api_kubeconfig = cluster.kubeconfig_for_token(&api_token, &dir.path().join("api"));
        let controller_kubeconfig = cluster.kubeconfig_for_token(&controller_token, &dir.path().join("controller"));

        let s3 = TestS3::start();
        let upstream = MockUpstream::start().await;
        upstream.delay(upstream_delay);
        let sts = match web_identity {
            true => Some(Sts::start(WEB_IDENTITY_TOKEN, ROLE_ARN, Duration::from_secs(30)).await),
            false => None,
        };
        let mut env: Vec<(&'static str, String)> = match &sts {
            None => vec![
                ("AWS_ACCESS_KEY_ID", common::S3_ACCESS_KEY.to_owned()),
                ("AWS_SECRET_ACCESS_KEY", common::S3_SECRET_KEY.to_owned()),
            ],
            Some(sts) => {
                let token = dir.path().join("web-identity-token");
                std::fs::write(&token, WEB_IDENTITY_TOKEN).unwrap();
                vec![
                    ("AWS_WEB_IDENTITY_TOKEN_FILE", token.display().to_string()),
                    ("AWS_ROLE_ARN", ROLE_ARN.to_owned()),
                    ("AWS_ENDPOINT_URL_STS", sts.url.clone()),
                    ("AWS_REGION", "us-east-1".to_owned()),
                ]
            }
        };
        env.push(("AWS_EC2_METADATA_DISABLED", "true".to_owned()));
        let worker_env: String =
            env.iter().map(|(name, value)| format!("      - {{name: {name}, value: \"{value}\"}}\n")).collect();
        let config = dir.path().join("nightshift.yaml");
        std::fs::write(
            &config,
            format!(
                "storage:\n  s3: {{bucket: {bucket}, endpoint: \"{endpoint}\", path_style: true}}\n\
                 upstreams:\n  - name: mock\n    base_url: {upstream}\n    models: [\"mock-*\"]\n    max_concurrency: {concurrency}\n    retry_base_delay: 20ms\n{upstreams}\
                 batches:\n  shard_lines: {shard_lines}\n  checkpoint_interval: 100ms\n  cancel_grace: 5s\n{batches}\
                 webhooks:\n  allowed_hosts: [127.0.0.1]\n\
                 kubernetes:\n  namespace: {NS}\n  worker:\n    image: \"{worker_image}\"\n    config_path: {config}\n    backoff_limit: {backoff}\n    env:\n\
                 {worker_env}      - {{name: RUST_LOG, value: info}}\n",
                bucket = s3.bucket,
                endpoint = s3.endpoint,
                upstream = upstream.base_url,
                config = dir.path().join("nightshift.yaml").display(),
                backoff = if worker_image == FAILING_IMAGE { 0 } else { 3 },
            ),
        )
        .unwrap();
        let kubelet = Kubelet::start(
            client,
            NS,
            HashMap::from([
                (IMAGE.to_owned(), PathBuf::from(env!("CARGO_BIN_EXE_nightshift"))),
                (FAILING_IMAGE.to_owned(), PathBuf::from("/bin/false")),
                (SLEEPER_IMAGE.to_owned(), PathBuf::from("/bin/sleep")),
            ]),
        )
        .await;

        let mut api_env = env.clone();
        api_env.push(("KUBECONFIG", api_kubeconfig.display().to_string()));
        let config_arg = config.display().to_string();
        let (api, line) = spawn(
            &[
                "api",
                "--config",
                &config_arg,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--namespace",
                NS,
            ],
            &api_env,
            "listening on",
            &dir.path().join("api.log"),
        );
        let api_url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned();
        let mut operator = Self {
            sts,
            cluster,
            s3,
            upstream,
            kubelet,
            config,
            env,
            api_url,
            _api: api,
            controller: None,
            controller_kubeconfig,
            probe_port: common::ports::claim_one(),
            api_token,
            controller_token,
            dir,
        };
        operator.controller = Some(operator.start_controller("controller-1"));
        operator
    }

    fn start_controller(&self, identity: &str) -> Process {
        self.controller_starter(identity)()
    }

    /// Starts a controller replica when called, on any thread (a standby blocks until it leads).
    fn controller_starter(&self, identity: &str) -> impl FnOnce() -> Process + Send + 'static {
        self.controller_starter_with(identity, &self.controller_kubeconfig)
    }

    /// As `controller_starter`, reaching the API server as `kubeconfig` says.
    fn controller_starter_with(&self, identity: &str, kubeconfig: &Path) -> impl FnOnce() -> Process + Send + 'static {
        let mut env = self.env.clone();
        env.push(("KUBECONFIG", kubeconfig.display().to_string()));
        let config = self.config.display().to_string();
        let log = self.dir.path().join(format!("{identity}.log"));
        let probe = match identity {
            "controller-1" => format!("127.0.0.1:{}", self.probe_port),
            _ => "127.0.0.1:0".to_owned(),
        };
        let identity = identity.to_owned();
        move || {
            let args = [
                "controller",
                "--config",
                &config,
                "--namespace",
                NS,
                "--identity",
                &identity,
                "--lease-seconds",
                "3",
                "--probe-listen",
                &probe,
            ];
            spawn(&args, &env, "leading", &log).0
        }
    }

    /// Runs tests/e2e/operator_sdk.py with `env`; returns its JSON lines.
    fn sdk(&self, env: &[(&str, &str)]) -> Vec<Value> {
        let output = Command::new(common::tools::python())
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/operator_sdk.py"))
            .env("NIGHTSHIFT_URL", &self.api_url)
            .env("NIGHTSHIFT_PROJECT_ID", common::PROJECT)
            .env("NIGHTSHIFT_API_KEY", common::KEY)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "the SDK script failed:\n{stdout}\n{}\napi log:\n{}",
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(self.dir.path().join("api.log")).unwrap_or_default()
        );
        stdout.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
    }

    /// The SDK script run in the background on `lines` lines (the test acts meanwhile);
    /// its output, once it ends.
    fn sdk_in_background(&self, lines: usize) -> tokio::task::JoinHandle<std::process::Output> {
        let (python, url) = (common::tools::python(), self.api_url.clone());
        tokio::task::spawn_blocking(move || {
            Command::new(python)
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/operator_sdk.py"))
                .env("NIGHTSHIFT_URL", url)
                .env("NIGHTSHIFT_PROJECT_ID", common::PROJECT)
                .env("NIGHTSHIFT_API_KEY", common::KEY)
                .env("LINES", lines.to_string())
                .output()
                .unwrap()
        })
    }

    pub(crate) async fn jobs(&self) -> Vec<Job> {
        let api: Api<Job> = Api::namespaced(self.cluster.client().await, NS);
        api.list(&ListParams::default().labels(BATCH_LABEL)).await.unwrap().items
    }

    pub(crate) fn kubectl(&self, args: &[&str]) -> String {
        kubectl(&self.cluster, args)
    }

    /// Merges `spec` into the `demo` Project's spec.
    fn patch_project(&self, spec: Value) {
        let patch = json!({"spec": spec}).to_string();
        self.kubectl(&["patch", "project", "demo", "-n", NS, "--type", "merge", "-p", &patch]);
    }

    /// Waits for a Warning Event `reason` on the object `name`; returns its message.
    pub(crate) async fn warning(&self, reason: &str, name: &str) -> String {
        let selector = format!("type=Warning,reason={reason},involvedObject.name={name}");
        eventually(&format!("a {reason} Warning on {name}"), 60, || async {
            let message = self.kubectl(&[
                "get",
                "events",
                "-n",
                NS,
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={.items[*].message}",
            ]);
            (!message.is_empty()).then_some(message)
        })
        .await
    }

    /// kubectl `args` that may fail (the test looks at how).
    pub(crate) fn try_kubectl(&self, args: &[&str]) -> std::process::Output {
        let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
        Command::new(kubectl).arg("--kubeconfig").arg(self.cluster.kubeconfig_path()).args(args).output().unwrap()
    }
}

/// A Secret `name` holding a webhook signing secret (`whsec_...`) at the key `secret`.
pub(crate) async fn signing_secret(operator: &Operator, name: &str, signing: &str) {
    let secret = Secret {
        metadata: ObjectMeta { name: Some(name.to_owned()), ..ObjectMeta::default() },
        string_data: Some([("secret".to_owned(), signing.to_owned())].into()),
        ..Secret::default()
    };
    let client = operator.cluster.client().await;
    Api::<Secret>::namespaced(client, NS).create(&PostParams::default(), &secret).await.unwrap();
}

/// A Project `name` with the id `id`, its `key` held as a SHA-256 hash in a Secret.
async fn create_project(client: &kube::Client, name: &str, id: &str, key: &str) {
    let secret = Secret {
        metadata: ObjectMeta { name: Some(format!("{name}-key")), ..ObjectMeta::default() },
        string_data: Some([("sha256".to_owned(), hex::encode(nightshift::config::key_digest(key)))].into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), NS).create(&PostParams::default(), &secret).await.unwrap();
    let project: ProjectResource = serde_json::from_value(json!({
        "apiVersion": "nightshift.dev/v1alpha1", "kind": "Project",
        "metadata": {"name": name},
        "spec": {"id": id, "api_keys": [{"secret_name": format!("{name}-key")}]},
    }))
    .unwrap();
    Api::<ProjectResource>::namespaced(client.clone(), NS).create(&PostParams::default(), &project).await.unwrap();
}

fn kubectl(cluster: &TestCluster, args: &[&str]) -> String {
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let output = Command::new(kubectl).arg("--kubeconfig").arg(cluster.kubeconfig_path()).args(args).output().unwrap();
    assert!(output.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn check_results(finished: &Value, lines: usize) {
    assert_eq!(finished["status"], "completed", "{finished}");
    let output = finished["output"].as_array().unwrap();
    let ids: HashSet<&str> = output.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), lines, "every line once in the output");
    assert_eq!(output.len(), lines, "no duplicate records");
    assert_eq!(finished["counts"], json!({"total": lines, "completed": lines, "failed": 0}));
    for record in output {
        assert_eq!(
            record["response"]["body"]["choices"][0]["message"]["content"],
            format!("answer to {}", record["custom_id"].as_str().unwrap())
        );
    }
}

/// The controller's `/metrics` value of `name{labels}` (0 when absent).
pub(crate) async fn scrape(operator: &Operator, series: &str) -> (String, f64) {
    let response = reqwest::get(format!("http://127.0.0.1:{}/metrics", operator.probe_port)).await.unwrap();
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    let text = response.text().await.unwrap();
    let value = text.lines().find_map(|line| line.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0);
    (content_type, value)
}

/// A valid Batch resource as JSON (what the api would create), for hand-made variants.
fn batch_object(name: &str) -> Value {
    let spec = nightshift::batches::BatchSpec {
        id: nightshift::ids::BatchId::generate(),
        project_id: nightshift::ids::ProjectId::parse(common::PROJECT).unwrap(),
        input_file_id: nightshift::ids::FileId::generate(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        metadata: Default::default(),
        created_at: 1,
        expires_at: 86_401,
        model: None,
        output_expires_after: None,
        priority: None,
        plan: Default::default(),
    };
    let resource = BatchResource::new(name, nightshift::k8s::crd::BatchResourceSpec::recorded(spec));
    serde_json::to_value(&resource).unwrap()
}
