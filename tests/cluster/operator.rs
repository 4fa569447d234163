//! The operator on a real Kubernetes API server (kube-apiserver, etcd and
//! kube-controller-manager on 127.0.0.1, a stand-in kubelet that runs each Pod's
//! command locally), with a real S3 server and the official OpenAI SDK:
//! SDK → `nightshift api` → Batch → controller → Jobs → Pods → finalize → output.
//! The api and the controller run with ServiceAccount tokens bound only to their own Roles.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::TestS3;
use common::client::{Client, ids, input};
use common::cluster::{Kubelet, TestCluster, eventually};
use common::process::{Process, spawn};
use common::proxy::Partition;
use common::simulator::{SimConfig, Simulator};
use common::sts::Sts;
use common::upstream::MockUpstream;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::core::CustomResourceExt;
use nightshift::grants::Grant;
use nightshift::k8s::crd::{BATCH_LABEL, BatchResource, ProjectResource, resource_name};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_end_to_end_as_sharded_jobs_under_least_privilege() {
    let operator = Operator::start(7, Duration::ZERO, 8).await;
    let results = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "20")]));
    let finished = results.last().unwrap();
    check_results(finished, 20);

    // One Job per shard (20 lines at 7 a shard), owned by the Batch, without credentials.
    let jobs = operator.jobs().await;
    assert_eq!(jobs.len(), 3, "{:?}", jobs.iter().map(|j| j.metadata.name.clone()).collect::<Vec<_>>());
    for job in &jobs {
        assert_eq!(job.status.as_ref().and_then(|s| s.succeeded), Some(1));
        let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "Batch");
        let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
    }

    // `kubectl get batches` shows status, counts, the ETA (none once done), where the
    // batch came from and age.
    let table = operator.kubectl(&["get", "batches", "-n", NS]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    let columns = ["NAME", "STATUS", "PROGRESS", "COMPLETED", "FAILED", "TOTAL", "ETA", "SOURCE", "AGE"];
    assert_eq!(header, columns, "{table}");
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&row[1..6], ["completed", "100%", "20", "0", "20"], "{table}");
    assert_eq!(row[6], "api", "{table}");
    assert_eq!(row.len(), header.len() - 1, "a finished batch has no ETA: {table}");
    let short = operator.kubectl(&["get", "nsb", "-n", NS, "-o", "name"]);
    assert!(short.starts_with("batch.nightshift.dev/batch-"), "{short}");
    let category = operator.kubectl(&["get", "nightshift", "-n", NS, "-o", "name"]);
    assert!(category.contains(short.trim()) && category.contains("project.nightshift.dev/demo"), "{category}");

    // Conditions, as for Jobs: `kubectl wait` on a completed batch and on a refused one.
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Complete", "--timeout=30s", short.trim()]);
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let refused = client.upload(b"{\"custom_id\": 1}\n".to_vec()).await;
    let (status, body) = client.try_create(&refused).await;
    assert_eq!(status, 400, "{body}");
    let failed = operator.kubectl(&[
        "get",
        "batches",
        "-n",
        NS,
        "-o",
        "jsonpath={.items[?(@.status.status==\"failed\")].metadata.name}",
    ]);
    let waited = operator.kubectl(&[
        "wait",
        "-n",
        NS,
        "--for=condition=Failed",
        "--timeout=30s",
        &format!("batch/{}", failed.trim()),
    ]);
    assert!(waited.contains("condition met"), "{waited}");
    let reason = operator.kubectl(&[
        "get",
        "batch",
        "-n",
        NS,
        failed.trim(),
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Failed\")].reason}",
    ]);
    assert_eq!(reason, "Failed");
    // Status is only ever applied (server-side apply), by each role under its own field
    // manager; being atomic, it belongs whole to the role that applied it last.
    let batches = Api::<BatchResource>::namespaced(operator.cluster.client().await, NS);
    let status_owners = |batch: BatchResource| -> Vec<String> {
        let entries = batch.metadata.managed_fields.unwrap_or_default();
        let owns_status = |e: &ManagedFieldsEntry| e.fields_v1.as_ref().is_some_and(|f| f.0.get("f:status").is_some());
        let owners = entries.iter().filter(|e| owns_status(e));
        owners
            .map(|e| format!("{}/{}", e.manager.clone().unwrap_or_default(), e.operation.clone().unwrap_or_default()))
            .collect()
    };
    let refused = batches.get(failed.trim()).await.unwrap();
    assert_eq!(status_owners(refused), ["nightshift-api/Apply"]);
    let completed = batches.get(short.trim().rsplit('/').next().unwrap()).await.unwrap();
    assert_eq!(status_owners(completed), ["nightshift-controller/Apply"]);
    let events = operator.kubectl(&["get", "events", "-n", NS]);
    assert!(events.contains("Finished"), "{events}");

    // Least privilege: each role is refused what it does not need.
    let api_client = operator.cluster.client_for_token(&operator.api_token).await;
    let job = jobs[0].clone();
    let forbidden = Api::<Job>::namespaced(api_client, NS).create(&PostParams::default(), &job).await.unwrap_err();
    assert!(matches!(forbidden, kube::Error::Api(ref s) if s.code == 403), "{forbidden}");
    let controller_client = operator.cluster.client_for_token(&operator.controller_token).await;
    // It reads Secrets (its Projects' webhook signing secrets) but never writes them.
    let secret = Secret {
        metadata: ObjectMeta { name: Some("made-by-controller".into()), ..ObjectMeta::default() },
        ..Secret::default()
    };
    let forbidden = Api::<Secret>::namespaced(controller_client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_err();
    assert!(matches!(forbidden, kube::Error::Api(ref s) if s.code == 403), "{forbidden}");
    let forbidden = Api::<Pod>::namespaced(controller_client, NS).list(&ListParams::default()).await.unwrap_err();
    assert!(matches!(forbidden, kube::Error::Api(ref s) if s.code == 403), "{forbidden}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_pod_is_retried_and_resumes_without_duplicates() {
    let operator = Operator::start(100, Duration::from_millis(100), 2).await;
    let upstream = &operator.upstream;
    let sdk = operator.sdk_in_background(40);
    let pod = eventually("a worker pod with lines done", 60, || {
        let pods = operator.kubelet.running_pods();
        let calls = upstream.total_calls();
        async move { (calls >= 8).then(|| pods.first().cloned()).flatten() }
    })
    .await;
    operator.kubelet.kill_pod_process(&pod);
    // The Job's next pod starts after the Job controller's backoff (10 s): read what the
    // killed one had committed now.
    common::committed::settle(upstream).await;
    let committed = common::committed::committed_custom_ids(&*operator.s3.store(), &[]).await;
    let sent_at_kill = upstream.all_calls();
    let output = sdk.await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let finished: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    check_results(&finished, 40);
    // Nothing committed at the kill was sent again; only what was sent and not committed.
    let resent = common::committed::check_kill_laws(&sent_at_kill, &committed, &upstream.all_calls());
    eprintln!("{} committed at the kill, {} sent again", committed.len(), resent.len());
    let job = &operator.jobs().await[0];
    assert_eq!(job.status.as_ref().and_then(|s| s.failed), Some(1), "the killed pod counts as a failure");
}

/// Two pods on one shard at once, as when the Job controller gave up on a pod whose node
/// stopped answering and started another while the first still ran: a pod with the Job
/// pod's own spec claims the shard; the Job's pod learns it is superseded at its next
/// commit, stops and fails. Every line is in the output once, and what the shard's owner
/// counts records each line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_pods_on_one_shard_the_superseded_one_stops_and_its_later_commits_never_count() {
    let operator = Operator::start(100, Duration::from_millis(200), 2).await;
    let upstream = &operator.upstream;
    let sdk = operator.sdk_in_background(40);
    let job_pod = eventually("a worker pod with lines done", 60, || {
        let pods = operator.kubelet.running_pods();
        let calls = upstream.total_calls();
        async move { (calls >= 4).then(|| pods.first().cloned()).flatten() }
    })
    .await;
    let pods = Api::<Pod>::namespaced(operator.cluster.client().await, NS);
    let spec = pods.get(&job_pod).await.unwrap().spec;
    let second = Pod {
        metadata: ObjectMeta { name: Some(format!("{job_pod}-second")), ..ObjectMeta::default() },
        spec,
        ..Pod::default()
    };
    pods.create(&PostParams::default(), &second).await.unwrap();
    eventually("the Job's pod superseded", 60, || {
        let log = operator.kubelet.pod_log(&job_pod);
        async move { log.contains("a newer run claimed shard 0").then_some(()) }
    })
    .await;

    let output = sdk.await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let finished: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    check_results(&finished, 40);
    let batch = nightshift::ids::BatchId::parse(finished["id"].as_str().unwrap()).unwrap();
    let store = operator.s3.store();
    let claims = store.list(&nightshift::exec::layout::claims_prefix(&batch, 0)).await.unwrap();
    assert!(claims.len() >= 2, "the Job's pod and the second one claimed the shard: {claims:?}");
    common::committed::assert_counted_once(store.as_ref(), &batch, 0, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_restarted_mid_batch_loses_nothing_and_a_standby_takes_over() {
    let mut operator = Operator::start(10, Duration::from_millis(50), 2).await;
    let standby = std::thread::spawn(operator.controller_starter("controller-2"));
    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "40"), ("CREATE_ONLY", "1")]));
    let id = created[0]["id"].as_str().unwrap().to_owned();
    eventually("lines done", 60, || {
        let calls = operator.upstream.total_calls();
        async move { (calls >= 10).then_some(()) }
    })
    .await;
    assert!(!standby.is_finished(), "only one controller leads at a time");
    drop(operator.controller.take());
    let _standby = tokio::task::spawn_blocking(move || standby.join().unwrap()).await.unwrap();

    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.wait_terminal(&id, Duration::from_secs(120)).await;
    let custom_ids: Vec<String> = (0..40).map(|n| format!("line-{n}")).collect();
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 40);
}

/// The time of the first line of a log that contains `text` (tracing's RFC 3339 UTC
/// timestamps, all of one width: they order as strings).
fn log_time(log: &Path, text: &str) -> String {
    let log = std::fs::read_to_string(log).unwrap();
    let line = log.lines().find(|line| line.contains(text)).unwrap_or_else(|| panic!("no {text:?} in {log}"));
    line.split_whitespace().next().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_steps_down_before_a_standby_leads() {
    let mut operator = Operator::start(10, Duration::from_millis(100), 2).await;
    // The leader reaches the API server through a proxy that can partition it.
    let server = operator.cluster.server_url();
    let partition = Partition::start(server.trim_start_matches("https://").parse().unwrap()).await;
    let kubeconfig = operator.dir.path().join("kubeconfig-partitioned");
    let direct = std::fs::read_to_string(&operator.controller_kubeconfig).unwrap();
    std::fs::write(&kubeconfig, direct.replace(&server, &format!("https://{}", partition.addr))).unwrap();
    drop(operator.controller.take());
    let start_leader = operator.controller_starter_with("controller-a", &kubeconfig);
    let mut leader = tokio::task::spawn_blocking(start_leader).await.unwrap();
    let standby = std::thread::spawn(operator.controller_starter("controller-b"));

    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "40"), ("CREATE_ONLY", "1")]));
    let id = created[0]["id"].as_str().unwrap().to_owned();
    eventually("lines done", 60, || {
        let calls = operator.upstream.total_calls();
        async move { (calls >= 5).then_some(()) }
    })
    .await;
    assert!(!standby.is_finished(), "the standby waits while the leader renews");
    partition.cut();

    let _standby = tokio::task::spawn_blocking(move || standby.join().unwrap()).await.unwrap();
    let mut waited = 0;
    while leader.0.try_wait().unwrap().is_none() {
        assert!(waited < 100, "the cut-off leader exits after stepping down");
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
    }
    let dir = operator.dir.path();
    let stepped_down = log_time(&dir.join("controller-a.log"), "stepping down");
    let took_over = log_time(&dir.join("controller-b.log"), ": leading");
    eprintln!("[partition] cut; controller-a stepped down at {stepped_down}; controller-b led at {took_over}");
    assert!(stepped_down < took_over, "controller-a stepped down at {stepped_down}, controller-b led at {took_over}");

    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.wait_terminal(&id, Duration::from_secs(120)).await;
    assert_eq!(batch["status"], "completed", "the new leader finishes the batch: {batch}");
    assert_eq!(batch["request_counts"]["completed"], 40);
}

/// An upstream's `max_concurrency` is the installation's, not each pod's: with 8 shards
/// running at once it would be 8 times over if every pod took it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_limit_holds_across_all_worker_pods_and_is_reached() {
    const LIMIT: u64 = 6;
    let operator =
        Operator::start_with(10, Duration::from_millis(300), LIMIT as usize, IMAGE, "  max_running_shards: 8\n").await;
    let finished = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "80")]));
    check_results(finished.last().unwrap(), 80);
    let jobs = operator.jobs().await;
    assert_eq!(jobs.len(), 8, "one Job per shard");
    let peak = operator.upstream.max_in_flight();
    eprintln!("[limits] 8 shards, limit {LIMIT}: peak {peak} requests in flight at the upstream");
    assert!(peak <= LIMIT, "{peak} requests in flight at once over a limit of {LIMIT}");
    assert_eq!(peak, LIMIT, "the limit is reached");
    // Finished workers' grants are cleaned up.
    let store = operator.s3.store();
    eventually("the finished workers' grants removed", 30, || {
        let store = store.clone();
        async move { store.list("control/").await.unwrap().is_empty().then_some(()) }
    })
    .await;
}

/// An adaptive upstream's limit is the installation's: the controller finds it from what
/// every worker pod reports and divides it among them, and each pod reads the server's
/// load signal and takes its part of the room there. Four pods at once against a server
/// that decodes 8 sequences at a time keep its queue short; each pod with a quarter of
/// the ceiling of 512 would queue hundreds of lines (504 at once). The peak is the start's
/// (four pods' first doublings before the first readings agree), and it moves with the
/// machine's load: 6 to 56 over seven runs on 2 cores with the signal's address wrong (it
/// answered 404), 4 and 7 with it read; the bound is a sixth of 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_limit_is_found_for_the_installation_and_shared_by_its_worker_pods() {
    let server = SimConfig { max_batch: 8, step_base: Duration::from_millis(2), ..SimConfig::default() };
    let sim = Simulator::start(server).await;
    let upstream = format!(
        "  - name: sim\n    base_url: {url}\n    models: [\"sim-*\"]\n    max_concurrency: 512\n    \
         load_signal: {{url: \"{metrics}\"}}\n",
        url = sim.url,
        metrics = sim.metrics_url()
    );
    let setup =
        Setup { batches: "  max_running_shards: 4\n", upstreams: &upstream, ..Setup::new(400, Duration::ZERO, 16) };
    let operator = Operator::set_up(setup).await;
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.create(&client.upload(input(&ids("line", 1600), "sim-a")).await).await;
    // While the four shards run, each pod's grant says four send to the server.
    let store = operator.s3.store();
    eventually("four pods' grants that say four share the server", 120, || {
        let store = store.clone();
        async move {
            let mut sharing = Vec::new();
            for key in store.list("control/grants/").await.ok()? {
                let grant: Grant = serde_json::from_slice(&store.get(&key).await.ok()?).ok()?;
                sharing.push(grant.sharing.get("sim").copied());
            }
            (sharing == [Some(4); 4]).then_some(())
        }
    })
    .await;
    let done = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(300)).await;
    assert_eq!(done["request_counts"]["completed"], 1600, "{done}");
    assert_eq!(operator.jobs().await.len(), 4, "one Job per shard");
    let (_, limit) = scrape(&operator, "nightshift_upstream_concurrency_limit{upstream=\"sim\"}").await;
    let stats = sim.stats();
    eprintln!("[night shift] four pods: installation limit {limit}, peak queue at the server {}", stats.peak_waiting);
    assert_eq!(stats.finished.values().sum::<u64>(), 1600, "each line once: {stats:?}");
    assert!(stats.metrics_reads.values().sum::<u64>() > 0, "the pods read the server's load signal: {stats:?}");
    assert!(stats.peak_waiting <= 84, "the installation's limit keeps the queue short: {}", stats.peak_waiting);
    assert!((4.0..=40.0).contains(&limit), "near the batch size of 8, not 512: {limit}");
}

/// `max_running_shards` is shared between projects, not taken first come, first served:
/// a small batch of another project starts its shard as soon as a slot frees, instead
/// of after every shard of a huge batch created before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_batch_of_another_project_gets_a_job_slot_before_a_huge_batch_takes_them_all() {
    let operator = Operator::start_with(5, Duration::from_millis(150), 16, IMAGE, "  max_running_shards: 2\n").await;
    create_project(&operator.cluster.client().await, "other", common::OTHER_PROJECT, common::OTHER_KEY).await;
    let huge = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let started = std::time::Instant::now();
    let small = Client::new(&operator.api_url, common::OTHER_PROJECT, common::OTHER_KEY);
    let huge_batch = huge.create(&huge.upload(input(&ids("huge", 60), "mock-a")).await).await;
    let huge_id = nightshift::ids::BatchId::parse(huge_batch["id"].as_str().unwrap()).unwrap();
    eventually("the huge batch's Jobs in both slots", 60, || async {
        (operator.jobs().await.len() >= 2).then_some(())
    })
    .await;
    // The API learns of the new Project from its watch.
    let file = eventually("the other project's key accepted", 30, || async {
        let (status, file) = small.try_upload(input(&ids("small", 5), "mock-a")).await;
        (status == 200).then(|| file["id"].as_str().unwrap().to_owned())
    })
    .await;
    let small_batch = small.create(&file).await;
    let done = small.wait_terminal(small_batch["id"].as_str().unwrap(), Duration::from_secs(120)).await;
    assert_eq!(done["request_counts"]["completed"], 5, "{done}");
    let huge_jobs: Vec<Job> = operator
        .jobs()
        .await
        .into_iter()
        .filter(|job| job.metadata.owner_references.as_ref().unwrap()[0].name == resource_name(&huge_id))
        .collect();
    let succeeded = huge_jobs.iter().filter(|job| job.status.as_ref().and_then(|s| s.succeeded) == Some(1)).count();
    eprintln!(
        "[admission] the small batch done after {:?}, while {succeeded} of the huge batch's 12 Jobs had succeeded",
        started.elapsed()
    );
    // First come, first served (`scheduling: fifo`) it waits for 10 of the 12 to start:
    // all 12 are done by then.
    assert!(succeeded <= 6, "{succeeded} of the huge batch's Jobs done before the small one's");
}

/// A batch that at its pace so far would end after its window says so in a Warning
/// Event, with the projected time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_projected_to_miss_its_window_raises_a_warning_event() {
    // 40 lines one at a time, 400 ms each: some 16 s, in a window of 8.
    let operator = Operator::start_with(100, Duration::from_millis(400), 1, IMAGE, "  completion_window: 8s\n").await;
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.create(&client.upload(input(&ids("slow", 40), "mock-a")).await).await;
    let id = nightshift::ids::BatchId::parse(batch["id"].as_str().unwrap()).unwrap();
    let message = operator.warning("WillMissWindow", &resource_name(&id)).await;
    assert!(message.starts_with("at its pace so far the batch ends at "), "{message}");
    assert!(message.contains("after its window closes at"), "{message}");
    let ended = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(ended["status"], "expired", "{ended}");
    let counts = &ended["request_counts"];
    assert!(counts["completed"].as_u64().unwrap() < 40, "{ended}");
}

/// A worker pod that sets its upstream's load signal aside as stale (the same answer,
/// byte for byte, while its lines finish) says so, and the controller tells the Batch's
/// owner in a Warning Event; the lines go on under the throughput rule alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_signal_gone_stale_at_a_worker_pod_is_a_warning_event_on_its_batch() {
    let frozen = MockUpstream::start().await;
    frozen.delay(Duration::from_millis(100));
    // A metrics page that never changes: a cache, or an exporter that died.
    let page = axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async { "vllm:num_requests_waiting 0\nvllm:num_requests_running 2\n" }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, page).await.unwrap() });
    let upstream = format!(
        "  - name: frozen\n    base_url: {}\n    models: [\"frozen-*\"]\n    max_concurrency: 2\n    adaptive: false\n    \
         load_signal: {{url: \"{metrics}\", every: 100ms}}\n",
        frozen.base_url
    );
    let operator = Operator::set_up(Setup { upstreams: &upstream, ..Setup::new(1000, Duration::ZERO, 4) }).await;
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    // 300 lines, two at a time, 100 ms each: some 15 s, past the 10 s a repeated answer
    // is believed.
    let batch = client.create(&client.upload(input(&ids("line", 300), "frozen-a")).await).await;
    let id = nightshift::ids::BatchId::parse(batch["id"].as_str().unwrap()).unwrap();
    let message = operator.warning("LoadSignalStale", &resource_name(&id)).await;
    assert!(message.starts_with("upstream frozen's load signal is stale"), "{message}");
    let done = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(120)).await;
    assert_eq!(done["request_counts"]["completed"], 300, "{done}");
}

/// A project's quota is shared by its running worker pods, not copied to each: spend
/// passes it by no more than the lines in flight when it ran out, and reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projects_quota_is_shared_by_its_worker_pods_not_copied() {
    const LIMIT: u64 = 8;
    const QUOTA: u64 = 110; // 22 lines of 5 tokens, of 40 over 4 shards.
    let operator =
        Operator::start_with(10, Duration::from_millis(200), LIMIT as usize, IMAGE, "  max_running_shards: 4\n").await;
    operator.patch_project(json!({"quota": {"tokens": QUOTA}}));
    let finished = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "40")]));
    let finished = finished.last().unwrap();
    assert_eq!(finished["status"], "completed", "{finished}");
    let completed = finished["counts"]["completed"].as_u64().unwrap();
    let failed = finished["counts"]["failed"].as_u64().unwrap();
    assert_eq!(completed + failed, 40);
    for error in finished["errors"].as_array().unwrap() {
        assert_eq!(error["error"]["code"], "insufficient_quota", "{error}");
    }
    let jobs = operator.jobs().await;
    assert_eq!(jobs.len(), 4, "four shards ran");

    let spent = completed * 5;
    eprintln!("[quota] quota {QUOTA} tokens over 4 shards: {spent} spent ({completed} lines), limit {LIMIT} in flight");
    assert!(spent >= QUOTA, "the quota was used, not left idle in other pods' shares: {spent}");
    // Each pod counts its lines in flight against its allowance: past the quota, at most
    // the one line each of the 4 pods had in flight when it ran out.
    assert!(spent <= QUOTA + 4 * 5, "{spent} tokens spent: more than the lines in flight past {QUOTA}");
}

/// The controller's `/metrics` value of `name{labels}` (0 when absent).
pub(crate) async fn scrape(operator: &Operator, series: &str) -> (String, f64) {
    let response = reqwest::get(format!("http://127.0.0.1:{}/metrics", operator.probe_port)).await.unwrap();
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    let text = response.text().await.unwrap();
    let value = text.lines().find_map(|line| line.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0);
    (content_type, value)
}

/// Worker pods may end before a scrape: the controller counts lines and tokens from the
/// checkpoints, and its counters add up to the batch's counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_line_and_token_counters_add_up_to_the_batchs_counts() {
    let operator = Operator::start(10, Duration::from_millis(150), 4).await;
    let completed = "nightshift_lines_total{outcome=\"completed\",code=\"\"}";
    let tokens = format!("nightshift_tokens_total{{project=\"{}\"}}", common::PROJECT);
    let (content_type, _) = scrape(&operator, completed).await;
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    let build = format!("nightshift_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"));
    assert_eq!(scrape(&operator, &build).await.1, 1.0);
    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "40"), ("CREATE_ONLY", "1")]));
    let id = created[0]["id"].as_str().unwrap().to_owned();
    // Scraped during the batch: counts so far, never more than what the batch holds.
    let during = eventually("lines counted while the batch runs", 60, || async {
        let (_, lines) = scrape(&operator, completed).await;
        (lines > 0.0).then_some(lines)
    })
    .await;
    assert!(during <= 40.0, "{during}");
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.wait_terminal(&id, Duration::from_secs(120)).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let after = eventually("every line counted", 30, || async {
        let (_, lines) = scrape(&operator, completed).await;
        (lines == 40.0).then_some(lines)
    })
    .await;
    let (_, used) = scrape(&operator, &tokens).await;
    eprintln!("[metrics] during the batch {during} lines counted; after {after}; tokens {used}");
    assert!(during <= after);
    assert_eq!(used, batch["usage"]["total_tokens"].as_f64().unwrap(), "tokens counted as the batch's usage");
}

/// No keys anywhere: the api, the controller and every worker pod get their S3
/// credentials as IRSA gives them, through STS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_reaches_s3_through_web_identity() {
    let operator = Operator::set_up(Setup { web_identity: true, ..Setup::new(10, Duration::from_millis(20), 4) }).await;
    let finished = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "30")]));
    check_results(finished.last().unwrap(), 30);
    let calls = operator.sts.as_ref().unwrap().calls();
    eprintln!("[identity] {calls} credentials handed out by STS for the api, the controller and 3 worker pods");
    assert!(calls >= 5, "each process traded its token: {calls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_batch_removes_its_jobs_and_its_shard_data() {
    let operator = Operator::start(5, Duration::from_millis(200), 1).await;
    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "20"), ("CREATE_ONLY", "1")]));
    let id = created[0]["id"].as_str().unwrap().to_owned();
    eventually("the batch's Jobs", 60, || async { (operator.jobs().await.len() == 4).then_some(()) }).await;
    eventually("some lines done", 60, || {
        let calls = operator.upstream.total_calls();
        async move { (calls >= 2).then_some(()) }
    })
    .await;
    let batches: Api<BatchResource> = Api::namespaced(operator.cluster.client().await, NS);
    let name = id.to_ascii_lowercase().replace('_', "-");
    batches.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the Batch gone", 60, || {
        let batches = batches.clone();
        let name = name.clone();
        async move { batches.get_opt(&name).await.unwrap().is_none().then_some(()) }
    })
    .await;
    eventually("its Jobs garbage-collected", 60, || async { operator.jobs().await.is_empty().then_some(()) }).await;
    let store = operator.s3.store();
    let left = store.list(&format!("batches/{id}/")).await.unwrap();
    assert!(left.is_empty(), "the finalizer removed the shard data: {left:?}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_made_objects_with_bad_ids_are_refused_by_the_api_server() {
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    let dir = TempDir::new().unwrap();
    let mut path_trick = batch_object("path-trick");
    path_trick["spec"]["input_file_id"] = json!("../x");
    let mut bad_batch_id = batch_object("bad-batch-id");
    bad_batch_id["spec"]["id"] = json!("batch_a/b");
    let mut bad_project = batch_object("bad-project");
    bad_project["spec"]["project_id"] = json!("not-a-uuid");
    let project = json!({
        "apiVersion": "nightshift.dev/v1alpha1", "kind": "Project", "metadata": {"name": "bad"},
        "spec": {"id": "x/../y", "api_keys": [{"secret_name": "k"}]},
    });
    for (object, field) in [
        (path_trick, "spec.input_file_id"),
        (bad_batch_id, "spec.id"),
        (bad_project, "spec.project_id"),
        (project, "spec.id"),
    ] {
        let file = dir.path().join("object.json");
        std::fs::write(&file, object.to_string()).unwrap();
        let out = operator.try_kubectl(&["apply", "-n", NS, "-f", file.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{field}: a bad id was accepted");
        assert!(stderr.contains(field) && stderr.contains("should match"), "{field}: {stderr}");
    }
    // The controller goes on as before.
    let results = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "5")]));
    check_results(results.last().unwrap(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_jobs_keep_failing_gives_up_after_its_retries_and_the_batch_finishes() {
    let operator = Operator::start_with(4, Duration::ZERO, 2, FAILING_IMAGE, "  max_shard_retries: 2\n").await;
    let results = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "6"), ("TIMEOUT", "120")]));
    let finished = results.last().unwrap();
    assert_eq!(finished["status"], "completed", "the batch finishes: {finished}");
    assert_eq!(finished["counts"], json!({"total": 6, "completed": 0, "failed": 6}));
    let errors = finished["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 6);
    for record in errors {
        assert_eq!(record["error"]["code"], "internal_error", "{record}");
        assert_eq!(
            record["error"]["message"],
            "[legacy:dlq_exhausted] The shard's worker failed 3 times; this line was not run"
        );
    }
    assert_eq!(operator.upstream.total_calls(), 0, "no line reached the upstream");
    // Two shards, each: three failed Jobs, two retries and one give-up, as Warning Events.
    let events = operator.kubectl(&["get", "events", "-n", NS, "--field-selector", "type=Warning", "-o", "json"]);
    let events: Value = serde_json::from_str(&events).unwrap();
    // Repeats are aggregated: by `count` (core events) or `series.count` (the recorder's).
    let count = |reason: &str| -> u64 {
        let items = events["items"].as_array().unwrap().iter().filter(|e| e["reason"] == reason);
        items.map(|e| e["series"]["count"].as_u64().or(e["count"].as_u64()).unwrap_or(1)).sum()
    };
    let failed_jobs: HashSet<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reason"] == "BackoffLimitExceeded")
        .filter_map(|e| e["involvedObject"]["uid"].as_str())
        .collect();
    assert_eq!(failed_jobs.len(), 6, "three failed Jobs per shard (the Job controller may say so more than once)");
    assert_eq!(count("ShardRetried"), 4, "two retries per shard");
    assert_eq!(count("ShardFailed"), 2, "one give-up per shard");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_its_api_left_without_a_status_is_recovered_by_the_controller() {
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "5"), ("CREATE_ONLY", "1")]));
    let id = nightshift::ids::BatchId::parse(created[0]["id"].as_str().unwrap()).unwrap();
    let original: Value =
        serde_json::from_str(&operator.kubectl(&["get", "batch", "-n", NS, &resource_name(&id), "-o", "json"]))
            .unwrap();

    // As an api that crashed right after creating them would leave them: no status. One
    // with the shard plan of a valid input, one without (a refused input).
    let dir = TempDir::new().unwrap();
    let mut names = Vec::new();
    for planned in [true, false] {
        let new_id = nightshift::ids::BatchId::generate();
        let name = resource_name(&new_id);
        let mut spec = original["spec"].clone();
        spec["id"] = json!(new_id.as_str());
        if !planned {
            spec["plan"]["shards"] = json!([]);
        }
        let object = json!({
            "apiVersion": "nightshift.dev/v1alpha1", "kind": "Batch",
            "metadata": {"name": name, "labels": original["metadata"]["labels"]},
            "spec": spec,
        });
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, object.to_string()).unwrap();
        operator.kubectl(&["create", "-n", NS, "-f", file.to_str().unwrap()]);
        names.push(name);
    }
    let status = |name: &str| -> Value {
        let object: Value =
            serde_json::from_str(&operator.kubectl(&["get", "batch", "-n", NS, name, "-o", "json"])).unwrap();
        object["status"].clone()
    };
    let done = eventually("both Batches recovered and ended", 90, || async {
        let (planned, refused) = (status(&names[0]), status(&names[1]));
        (planned["status"] == "completed" && refused["status"] == "failed").then_some((planned, refused))
    })
    .await;
    assert_eq!(done.0["request_counts"], json!({"total": 5, "completed": 5, "failed": 0}), "{}", done.0);
    assert_eq!(done.1["errors"][0]["code"], "validation_interrupted", "{}", done.1);
    let events = operator.kubectl(&["get", "events", "-n", NS, "--field-selector", "reason=StatusRecovered"]);
    assert_eq!(events.lines().filter(|l| l.contains("Warning")).count(), 2, "{events}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_a_warning_event_not_a_retry_loop() {
    let operator = Operator::start(10, Duration::from_millis(200), 1).await;
    let created = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "20"), ("CREATE_ONLY", "1")]));
    let id = created[0]["id"].as_str().unwrap().to_owned();
    let key =
        nightshift::storage::Key::parse(&format!("batches/{id}/shard-00000/checkpoint-99999999-zz.json")).unwrap();
    operator.s3.store().put(&key, bytes::Bytes::from_static(b"{not json")).await.unwrap();
    let name = resource_name(&nightshift::ids::BatchId::parse(&id).unwrap());
    let message = operator.warning("ReconcileFailed", &name).await;
    assert!(message.contains("unreadable checkpoint"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_does_not_decode_is_reported_and_stalls_nothing() {
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    // As under an older CRD without the id patterns: a Batch whose input_file_id can't be
    // an id gets past the API server.
    operator.kubectl(&[
        "patch", "crd", "batches.nightshift.dev", "--type=json", "-p",
        r#"[{"op": "remove", "path": "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/input_file_id/pattern"}]"#,
    ]);
    let mut bad = batch_object("does-not-decode");
    bad["spec"]["input_file_id"] = json!("../x");
    let file = TempDir::new().unwrap();
    let path = file.path().join("bad.json");
    std::fs::write(&path, bad.to_string()).unwrap();
    eventually("the loosened schema to take effect", 30, || async {
        operator.try_kubectl(&["create", "-n", NS, "-f", path.to_str().unwrap()]).status.success().then_some(())
    })
    .await;
    let reported = operator.warning("InvalidObject", "does-not-decode").await;
    assert!(reported.contains("../x"), "{reported}");
    // Both watches go on: the api sees new Batches and the controller runs them.
    let results = tokio::task::block_in_place(|| operator.sdk(&[("LINES", "5")]));
    check_results(results.last().unwrap(), 5);
}

/// Rate limits are per api replica (docs/src/kubernetes.md): a project that used up its
/// requests a minute on one replica is still answered in full by another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projects_rate_limit_holds_per_api_replica() {
    const PER_MINUTE: usize = 30;
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    operator.patch_project(json!({"rate_limit": {"requests_per_minute": PER_MINUTE}}));
    let client = reqwest::Client::new();
    let get = |url: &str| {
        client
            .get(format!("{url}/v1/files?limit=1"))
            .header("x-project-id", common::PROJECT)
            .header("x-api-key", common::KEY)
            .send()
    };
    // The first replica: until it refuses (it has the new limit by then).
    let mut first_answered = 0;
    let refusal = loop {
        let response = get(&operator.api_url).await.unwrap();
        if response.status() == 429 {
            break response;
        }
        assert_eq!(response.status(), 200);
        first_answered += 1;
        assert!(first_answered < 5_000, "the first replica never applied the project's limit");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(refusal.headers().contains_key("retry-after"));
    let body: Value = refusal.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");

    // A second replica, started now: it reads the Projects, the limit among them, before
    // it listens.
    let (_second, second_url) = operator.another_api("api-2");

    // The second replica answers the project a whole minute's worth of its own.
    let mut second_answered = 0;
    while get(&second_url).await.unwrap().status() == 200 {
        second_answered += 1;
        assert!(second_answered <= PER_MINUTE + 2, "the second replica did not apply the project's limit");
    }
    eprintln!("[rate limit] {PER_MINUTE}/min: first replica answered {first_answered}, second {second_answered}");
    assert!(second_answered >= PER_MINUTE, "limits are per replica: the second answered only {second_answered}");
    assert_eq!(get(&operator.api_url).await.unwrap().status(), 429, "the first still refuses");
}

/// An `Idempotency-Key` holds across api replicas: the same create sent to one replica
/// and then the other makes one Batch (and the same upload, one file). Sent at once, the
/// claim is an S3 conditional write (`If-None-Match: *`), atomic on S3 but only checked
/// then written by s3s-fs, the test server; requests at once are tested on the directory
/// store (tests/api/idempotency.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_idempotency_key_sent_to_two_api_replicas_makes_one_batch() {
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    let (_second, second_url) = operator.another_api("api-idempotent");
    let urls = [operator.api_url.clone(), second_url];
    let client = reqwest::Client::new();
    let post = |url: &str, path: &str| {
        client
            .post(format!("{url}{path}"))
            .header("x-project-id", common::PROJECT)
            .header("x-api-key", common::KEY)
            .header("idempotency-key", format!("two-replicas{}", path.replace('/', "-")))
    };
    let input = input(&ids("idem", 3), "echo");
    let mut files = std::collections::HashSet::new();
    for url in urls.iter().chain(&urls) {
        let form = reqwest::multipart::Form::new()
            .text("purpose", "batch")
            .part("file", reqwest::multipart::Part::bytes(input.clone()).file_name("in.jsonl"));
        let body: Value = post(url, "/v1/files").multipart(form).send().await.unwrap().json().await.unwrap();
        files.insert(body["id"].as_str().unwrap_or_else(|| panic!("{body}")).to_owned());
    }
    assert_eq!(files.len(), 1, "{files:?}");
    let file = files.into_iter().next().unwrap();

    let body = json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let mut batches = std::collections::HashSet::new();
    for url in urls.iter().chain(&urls) {
        let answer: Value = post(url, "/v1/batches").json(&body).send().await.unwrap().json().await.unwrap();
        batches.insert(answer["id"].as_str().unwrap_or_else(|| panic!("{answer}")).to_owned());
    }
    assert_eq!(batches.len(), 1, "{batches:?}");
    let other = json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"x": "y"}});
    let conflict: Value = post(&urls[1], "/v1/batches").json(&other).send().await.unwrap().json().await.unwrap();
    assert_eq!(conflict["error"]["code"], "idempotency_key_reused", "{conflict}");
    let listed = kubectl(&operator.cluster, &["get", "batches", "-n", NS, "-o", "name"]);
    assert_eq!(listed.lines().count(), 1, "{listed}");
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let finished = client.wait_terminal(batches.iter().next().unwrap(), Duration::from_secs(120)).await;
    assert_eq!(finished["status"], "completed", "{finished}");
    assert_eq!(finished["request_counts"]["completed"], 3, "{finished}");
}

/// On Kubernetes the controller delivers webhooks: a Project names its endpoint and the
/// Secret with the signing secret, and a batch run by worker pods sends `batch.completed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projects_webhook_gets_its_batch_event_from_the_controller() {
    const SIGNING: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let receiver = common::receiver::Receiver::start().await;
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    signing_secret(&operator, "demo-webhook", SIGNING).await;
    operator.patch_project(json!({"webhooks": [{"url": receiver.url, "secret_name": "demo-webhook"}]}));

    let api = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let file = api.upload(input(&ids("hook", 5), "mock-a")).await;
    let batch = api.create(&file).await;
    let id = batch["id"].as_str().unwrap();
    let done = api.wait_terminal(id, Duration::from_secs(120)).await;
    assert_eq!(done["status"], "completed", "{done}");
    let delivery = receiver.wait_for(1, 60).await.remove(0);
    let event = delivery.json();
    assert_eq!((event["type"].as_str(), event["data"]["id"].as_str()), (Some("batch.completed"), Some(id)), "{event}");
    let secret = nightshift::webhooks::SigningSecret::parse(SIGNING).unwrap();
    let timestamp: i64 = delivery.timestamp.parse().unwrap();
    assert_eq!(
        delivery.signature,
        nightshift::webhooks::sign::signature(&secret, &delivery.id, timestamp, &delivery.body)
    );
}
