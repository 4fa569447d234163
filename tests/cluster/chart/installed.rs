//! The chart on a real API server: applied to kube-apiserver 1.20, enough for `nightshift
//! api` and `nightshift controller` to run a batch end to end with its own ServiceAccounts,
//! ConfigMap, Secrets and worker template; then installed, upgraded and uninstalled with
//! helm itself.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::TestS3;
use common::cluster::{TestCluster, eventually};
use common::kubelet::Kubelet;
use common::process::spawn;
use common::tools::{helm, kubectl_bin, run};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, PostParams};
use nightshift::k8s::crd::BatchResource;
use serde_json::{Value, json};
use tempfile::TempDir;

use super::{CHART, RELEASE, documents, render, rendered_config};

const NS: &str = "nightshift";
/// The api and controller image: not runnable by the stand-in kubelet (they run as local
/// processes below), so their pods are only admitted, never started.
const IMAGE_TAG: &str = "chart-test";
/// The worker image, which the stand-in kubelet maps to the nightshift binary.
const WORKER_IMAGE: &str = "nightshift-worker:chart-test";

fn kubectl(cluster: &TestCluster, args: &[&str]) -> String {
    run(Command::new(kubectl_bin())
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .arg("--cache-dir")
        .arg(cluster.dir().join("kubectl-cache"))
        .args(args))
}

/// The values of the cluster test: the test S3 server, two projects (an inline hash and
/// an existing Secret), an upstream whose key comes from a Secret (never called: lines
/// ask the built-in echo model, but workers must find its key to start), small shards.
fn cluster_values(s3: &TestS3) -> Value {
    json!({
        "image": {"repository": "nightshift", "tag": IMAGE_TAG},
        // Worker "pods" are host processes here, one network: no metrics port each.
        "worker": {"image": {"repository": "nightshift-worker"}, "metricsPort": null},
        "storage": {"s3": {
            "bucket": s3.bucket, "endpoint": s3.endpoint, "pathStyle": true,
            "credentials": {"existingSecret": "nightshift-s3"},
        }},
        "upstreams": [{
            "name": "unused", "base_url": "http://127.0.0.1:9/v1", "models": ["unused-*"],
            "apiKeySecret": {"name": "upstream-key", "key": "api-key"},
        }],
        "projects": [
            {"name": "demo", "id": common::PROJECT, "apiKeys": [{"sha256": hex::encode(nightshift::config::key_digest(common::KEY))}]},
            {"name": "other", "id": common::OTHER_PROJECT, "apiKeys": [{"existingSecret": "other-key"}]},
        ],
        "config": {"batches": {"shard_lines": 2, "checkpoint_interval": "100ms", "cancel_grace": "5s"}},
        "ingress": {"enabled": true, "host": "nightshift.test", "tls": {"enabled": true}},
        "grafana": {"dashboard": {"enabled": true}},
    })
}

async fn create_secret(cluster: &TestCluster, name: &str, data: &[(&str, String)]) {
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
        string_data: Some(data.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect::<BTreeMap<_, _>>()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(cluster.client().await, NS).create(&PostParams::default(), &secret).await.unwrap();
}

/// Installs the chart's CRDs from its crds/ directory and waits until they are served.
/// Kubernetes 1.20 predates CRD validation rules: kubectl's own check would refuse their
/// fields, and the API server drops them (as docs/src/applied-batches.md tells users).
fn install_crds(cluster: &TestCluster) {
    kubectl(cluster, &["apply", "--validate=false", "-f", &format!("{CHART}/crds/")]);
    kubectl(
        cluster,
        &[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/batches.nightshift.dev",
            "crd/projects.nightshift.dev",
        ],
    );
}

async fn status_of(url: &str) -> (u16, String) {
    let response = reqwest::get(url).await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn assert_forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_a_batch_on_kubernetes_1_20_with_its_own_service_accounts() {
    let cluster = TestCluster::start().await;
    cluster.create_namespace(NS).await;
    let s3 = TestS3::start();
    let dir = TempDir::new().unwrap();

    // What an operator creates before installing: the S3 credentials, the upstream's
    // key, and the hash of a project's key.
    create_secret(
        &cluster,
        "nightshift-s3",
        &[
            ("AWS_ACCESS_KEY_ID", common::S3_ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", common::S3_SECRET_KEY.to_owned()),
        ],
    )
    .await;
    create_secret(&cluster, "upstream-key", &[("api-key", "sk-upstream".to_owned())]).await;
    create_secret(&cluster, "other-key", &[("sha256", hex::encode(nightshift::config::key_digest(common::OTHER_KEY)))])
        .await;

    // helm template → kubectl apply, CRDs from the chart's crds/ first.
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, serde_json::to_string(&cluster_values(&s3)).unwrap()).unwrap();
    let manifests = render(NS, &["-f", values.to_str().unwrap()]);
    let docs = documents(&manifests);
    let rendered = dir.path().join("rendered.yaml");
    std::fs::write(&rendered, &manifests).unwrap();
    install_crds(&cluster);
    let applied = kubectl(&cluster, &["apply", "-n", NS, "-f", rendered.to_str().unwrap()]);
    assert_eq!(applied.lines().count(), docs.len(), "every manifest applied:\n{applied}");

    // The Deployments' pods are admitted with their ServiceAccounts (the stand-in
    // kubelet does not run their image: the roles run as local processes below).
    let pods: Api<Pod> = Api::namespaced(cluster.client().await, NS);
    for (component, replicas) in [("api", 2), ("controller", 1)] {
        let selector = format!("app.kubernetes.io/component={component}");
        let created = eventually(&format!("{replicas} {component} pods"), 60, || {
            let pods = pods.clone();
            let selector = selector.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(&selector)).await.ok()?;
                (list.items.len() == replicas).then_some(list.items)
            }
        })
        .await;
        let spec = created[0].spec.as_ref().unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some(format!("nightshift-{component}").as_str()));
    }

    // The ConfigMap's configuration, for local processes: the same file, except that
    // workers (run by the stand-in kubelet on this machine) find it at a local path.
    let mut config: serde_yaml_ng::Value = serde_yaml_ng::from_str(&rendered_config(&docs)).unwrap();
    let config_path = dir.path().join("config.yaml");
    config["kubernetes"]["worker"]["config_path"] = config_path.display().to_string().into();
    std::fs::write(&config_path, serde_yaml_ng::to_string(&config).unwrap()).unwrap();
    let config_arg = config_path.display().to_string();

    // Tokens of the chart's own ServiceAccounts, bound only to the chart's Roles.
    let api_token = cluster.service_account_token(NS, "nightshift-api").await;
    let controller_token = cluster.service_account_token(NS, "nightshift-controller").await;
    let worker_token = cluster.service_account_token(NS, "nightshift-worker").await;
    std::fs::create_dir(dir.path().join("api")).unwrap();
    std::fs::create_dir(dir.path().join("controller")).unwrap();
    let api_kubeconfig = cluster.kubeconfig_for_token(&api_token, &dir.path().join("api"));
    let controller_kubeconfig = cluster.kubeconfig_for_token(&controller_token, &dir.path().join("controller"));

    let client = cluster.client().await;
    let _kubelet = Kubelet::start(
        client.clone(),
        NS,
        HashMap::from([(WORKER_IMAGE.to_owned(), PathBuf::from(env!("CARGO_BIN_EXE_nightshift")))]),
    )
    .await;
    let s3_env = [
        ("AWS_ACCESS_KEY_ID", common::S3_ACCESS_KEY.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", common::S3_SECRET_KEY.to_owned()),
    ];
    let mut api_env = s3_env.to_vec();
    api_env.push(("KUBECONFIG", api_kubeconfig.display().to_string()));
    api_env.push(("POD_NAMESPACE", NS.to_owned()));
    let metrics_port = common::ports::claim_one();
    let api_metrics = format!("127.0.0.1:{metrics_port}");
    let (_api, line) = spawn(
        &["api", "--config", &config_arg, "--listen", "127.0.0.1:0", "--metrics-listen", &api_metrics],
        &api_env,
        "listening on",
        &dir.path().join("api.log"),
    );
    let api_url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned();
    let probe_port = common::ports::claim_one();
    let mut controller_env = s3_env.to_vec();
    controller_env.push(("KUBECONFIG", controller_kubeconfig.display().to_string()));
    controller_env.push(("NIGHTSHIFT_NAMESPACE", NS.to_owned()));
    controller_env.push(("POD_NAME", "nightshift-controller-0".to_owned()));
    controller_env.push(("NIGHTSHIFT_PROBE_LISTEN", format!("127.0.0.1:{probe_port}")));
    let (_controller, _) =
        spawn(&["controller", "--config", &config_arg], &controller_env, "leading", &dir.path().join("controller.log"));

    // Probes as the chart's Deployments use them.
    for url in [format!("{api_url}/healthz"), format!("{api_url}/readyz")] {
        assert_eq!(status_of(&url).await.0, 200, "{url}");
    }
    let probes = format!("http://127.0.0.1:{probe_port}");
    for path in ["/healthz", "/readyz"] {
        assert_eq!(status_of(&format!("{probes}{path}")).await.0, 200, "controller {path}");
    }

    // Both projects of values authenticate (the rendered Secret, the existing one).
    let http = reqwest::Client::new();
    for (project, key) in [(common::PROJECT, common::KEY), (common::OTHER_PROJECT, common::OTHER_KEY)] {
        let answer = eventually(&format!("project {project} known to the api"), 30, || {
            let request = http
                .get(format!("{api_url}/v1/batches"))
                .header("x-project-id", project)
                .header("x-api-key", key)
                .send();
            async move {
                let response = request.await.ok()?;
                (response.status() == 200).then_some(response)
            }
        })
        .await;
        let list: Value = answer.json().await.unwrap();
        assert_eq!(list["object"], "list", "{list}");
    }

    // A batch end to end: 5 lines, shards of 2, run as 3 Jobs of the chart's worker template.
    let user = common::client::Client::new(&api_url, common::PROJECT, common::KEY);
    let ids = common::client::ids("line", 5);
    let file = user.upload(common::client::input(&ids, "echo")).await;
    let created = user.create(&file).await;
    let batch = user.wait_terminal(created["id"].as_str().unwrap(), Duration::from_secs(120)).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = user.results(&batch, &ids).await;
    assert_eq!(results.output.len(), 5);
    for (id, record) in &results.output {
        assert_eq!(record["response"]["body"]["choices"][0]["message"]["content"], id.as_str(), "{record}");
    }
    let jobs: Vec<Job> = Api::namespaced(client.clone(), NS)
        .list(&ListParams::default().labels(nightshift::k8s::crd::BATCH_LABEL))
        .await
        .unwrap()
        .items;
    assert_eq!(jobs.len(), 3);
    let pod = jobs[0].spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.automount_service_account_token, Some(false));
    let container = &pod.containers[0];
    assert_eq!(container.image.as_deref(), Some(WORKER_IMAGE));
    let security = container.security_context.as_ref().unwrap();
    assert_eq!((security.read_only_root_filesystem, security.run_as_non_root), (Some(true), Some(true)));
    assert_eq!(pod.security_context.as_ref().unwrap().run_as_user, Some(65532));
    let volumes: Vec<&str> = pod.volumes.iter().flatten().map(|v| v.name.as_str()).collect();
    assert_eq!(volumes, ["config", "tmp"]);
    let batches: Api<BatchResource> = Api::namespaced(client.clone(), NS);
    assert_eq!(batches.list(&ListParams::default()).await.unwrap().items.len(), 1);

    // Metrics, where the chart's ServiceMonitors scrape them.
    let (status, text) = status_of(&format!("http://{api_metrics}/metrics")).await;
    assert_eq!(status, 200);
    assert!(text.contains("nightshift_http_requests_total"), "{text}");
    assert_eq!(status_of(&format!("{api_url}/metrics")).await.0, 404, "not on the API's own port");
    let (status, text) = status_of(&format!("{probes}/metrics")).await;
    assert_eq!(status, 200);
    assert!(text.contains("nightshift_batches"), "{text}");

    // Least privilege: each ServiceAccount is refused what its role does not need.
    let api_client = cluster.client_for_token(&api_token).await;
    assert_forbidden(
        Api::<Job>::namespaced(api_client.clone(), NS).create(&PostParams::default(), &jobs[0]).await,
        "the api creating a Job",
    );
    assert_forbidden(Api::<Pod>::namespaced(api_client, NS).list(&ListParams::default()).await, "the api listing pods");
    let controller_client = cluster.client_for_token(&controller_token).await;
    // It reads Secrets (its Projects' webhook signing secrets), but never writes them.
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some("made-by-controller".into()), ..Default::default() },
        ..Default::default()
    };
    assert_forbidden(
        Api::<Secret>::namespaced(controller_client.clone(), NS).create(&PostParams::default(), &secret).await,
        "the controller creating a Secret",
    );
    assert_forbidden(
        Api::<Pod>::namespaced(controller_client, NS).list(&ListParams::default()).await,
        "the controller listing pods",
    );
    let worker_client = cluster.client_for_token(&worker_token).await;
    assert_forbidden(
        Api::<BatchResource>::namespaced(worker_client.clone(), NS).list(&ListParams::default()).await,
        "a worker listing Batches",
    );
    assert_forbidden(
        Api::<Secret>::namespaced(worker_client, NS).list(&ListParams::default()).await,
        "a worker listing Secrets",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_upgrades_and_uninstalls_the_chart_and_leaves_the_crds() {
    let cluster = TestCluster::start().await;
    cluster.create_namespace(NS).await;
    let home = TempDir::new().unwrap();
    let kubeconfig = cluster.kubeconfig_path().to_str().unwrap().to_owned();
    let helm_at = |args: &[&str]| -> String {
        run(helm(home.path()).args(args).args(["--namespace", NS, "--kubeconfig", &kubeconfig]))
    };
    let values = home.path().join("values.yaml");
    std::fs::write(
        &values,
        serde_json::to_string(&json!({
            "projects": [{"name": "demo", "id": common::PROJECT,
                          "apiKeys": [{"sha256": hex::encode(nightshift::config::key_digest(common::KEY))}]}],
        }))
        .unwrap(),
    )
    .unwrap();

    // install: the CRDs from crds/ first, then the templates (a Project among them).
    helm_at(&["install", RELEASE, CHART, "-f", values.to_str().unwrap()]);
    let crds = kubectl(&cluster, &["get", "crd", "-o", "name"]);
    assert!(crds.contains("batches.nightshift.dev") && crds.contains("projects.nightshift.dev"), "{crds}");
    let pdb = kubectl(&cluster, &["get", "pdb", "-n", NS, "nightshift-api", "-o", "jsonpath={.apiVersion}"]);
    assert_eq!(pdb, "policy/v1beta1", "helm picks the PodDisruptionBudget version the cluster serves");
    let projects = kubectl(&cluster, &["get", "projects", "-n", NS, "-o", "name"]);
    assert_eq!(projects.trim(), "project.nightshift.dev/demo");
    // A resource of the CRDs' that Helm does not manage, as Batches are.
    let manual = home.path().join("manual.yaml");
    std::fs::write(
        &manual,
        serde_json::to_string(&json!({
            "apiVersion": "nightshift.dev/v1alpha1", "kind": "Project", "metadata": {"name": "manual"},
            "spec": {"id": common::OTHER_PROJECT, "api_keys": [{"secret_name": "manual-key"}]},
        }))
        .unwrap(),
    )
    .unwrap();
    kubectl(&cluster, &["apply", "-n", NS, "-f", manual.to_str().unwrap()]);

    // upgrade: new values reach the Deployments.
    helm_at(&["upgrade", RELEASE, CHART, "-f", values.to_str().unwrap(), "--set", "api.replicas=3"]);
    let replicas = kubectl(&cluster, &["get", "deploy", "-n", NS, "nightshift-api", "-o", "jsonpath={.spec.replicas}"]);
    assert_eq!(replicas, "3");
    let history = helm_at(&["history", RELEASE]);
    assert_eq!(history.lines().count(), 3, "two revisions:\n{history}");

    // uninstall: everything the templates made is gone, the CRDs and the resources Helm
    // did not make stay.
    helm_at(&["uninstall", RELEASE]);
    let left = kubectl(&cluster, &["get", "deploy,svc,sa,role,rolebinding,configmap,pdb", "-n", NS, "-o", "name"]);
    let ours: Vec<&str> = left.lines().filter(|l| l.contains("nightshift")).collect();
    assert!(ours.is_empty(), "left behind by helm uninstall: {ours:?}");
    let crds = kubectl(&cluster, &["get", "crd", "-o", "name"]);
    assert!(crds.contains("batches.nightshift.dev") && crds.contains("projects.nightshift.dev"), "{crds}");
    let projects = kubectl(&cluster, &["get", "projects", "-n", NS, "-o", "name"]);
    assert_eq!(projects.trim(), "project.nightshift.dev/manual");
}
