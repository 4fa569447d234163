//! Proves the test-cluster harness (`tests/common/cluster.rs`, `tests/common/kubelet.rs`):
//! real Jobs run to completion through the Job controller, crashed Pods are retried,
//! cascading deletion terminates processes, and ServiceAccount tokens are subject to RBAC.
//!
//! Needs the toolchain from `tests/tools/install-kube.sh`.

use crate::common::cluster;
use crate::common::kubelet::Kubelet;

use std::collections::HashMap;
use std::path::PathBuf;

use cluster::{TestCluster, eventually};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::serde::de::DeserializeOwned;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

const SH_IMAGE: &str = "nightshift-test/sh";

fn sh_images() -> HashMap<String, PathBuf> {
    HashMap::from([(SH_IMAGE.to_owned(), PathBuf::from("/bin/sh"))])
}

fn from_json<T: DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("valid object")
}

/// A Job whose single container runs `/bin/sh <args>` with `env`
/// (restartPolicy Never, 5 s termination grace period).
fn sh_job(name: &str, args: &[&str], env: serde_json::Value, backoff_limit: i32) -> Job {
    from_json(json!({
        "metadata": { "name": name },
        "spec": {
            "backoffLimit": backoff_limit,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "main",
                        "image": SH_IMAGE,
                        "args": args,
                        "env": env,
                    }]
                }
            }
        }
    }))
}

async fn job_pods(pods: &Api<Pod>, job: &str) -> Vec<Pod> {
    pods.list(&ListParams::default().labels(&format!("job-name={job}"))).await.unwrap().items
}

fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

fn exit_code(pod: &Pod) -> Option<i32> {
    let status = pod.status.as_ref()?.container_statuses.as_ref()?.first()?;
    Some(status.state.as_ref()?.terminated.as_ref()?.exit_code)
}

/// Waits until the Job has `succeeded == 1`.
async fn wait_job_succeeded(jobs: &Api<Job>, name: &str, timeout_secs: u64) -> Job {
    eventually(&format!("Job {name} to succeed"), timeout_secs, || async {
        let job = jobs.get(name).await.ok()?;
        (job.status.as_ref()?.succeeded == Some(1)).then_some(job)
    })
    .await
}

/// Waits until the Kubelet runs a Pod of `job` whose log contains `marker`.
async fn wait_running(kubelet: &Kubelet, pods: &Api<Pod>, job: &str, marker: &str) -> String {
    eventually(&format!("a running Pod of Job {job} logging {marker:?}"), 60, || async {
        let running = kubelet.running_pods();
        job_pods(pods, job)
            .await
            .into_iter()
            .map(|p| p.name_any())
            .find(|n| running.contains(n) && kubelet.pod_log(n).contains(marker))
    })
    .await
}

async fn setup(ns: &str) -> (TestCluster, Client, Kubelet) {
    let cluster = TestCluster::start().await;
    cluster.create_namespace(ns).await;
    let client = cluster.client().await;
    let kubelet = Kubelet::start(client.clone(), ns, sh_images()).await;
    (cluster, client, kubelet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runs_to_completion_with_secret_env() {
    let ns = "greet";
    let (_cluster, client, kubelet) = setup(ns).await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    let secret: Secret = from_json(json!({
        "metadata": { "name": "greeting" },
        "stringData": { "text": "hello from a secret" }
    }));
    Api::<Secret>::namespaced(client.clone(), ns).create(&PostParams::default(), &secret).await.unwrap();
    let env = json!([{
        "name": "GREETING",
        "valueFrom": { "secretKeyRef": { "name": "greeting", "key": "text" } }
    }]);
    let job = sh_job("greet", &["-c", "echo $GREETING; exit 0"], env, 0);
    jobs.create(&PostParams::default(), &job).await.unwrap();

    let job = wait_job_succeeded(&jobs, "greet", 60).await;
    let status = job.status.unwrap();
    assert_eq!(status.failed, None);
    assert!(
        status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Complete" && c.status == "True"),
        "Job has no Complete condition"
    );

    let job_pods = job_pods(&pods, "greet").await;
    assert_eq!(job_pods.len(), 1);
    let pod = &job_pods[0];
    assert_eq!(phase(pod), "Succeeded");
    assert_eq!(exit_code(pod), Some(0));
    assert_eq!(kubelet.pod_log(&pod.name_any()), "hello from a secret\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_controller_retries_a_crashed_pod() {
    let ns = "retry";
    let (_cluster, client, kubelet) = setup(ns).await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    // First run leaves a marker and hangs; the retry finds it and succeeds.
    let scratch = tempfile::tempdir().unwrap();
    let marker = scratch.path().join("marker");
    let env = json!([{ "name": "MARKER", "value": marker.to_str().unwrap() }]);
    let script = r#"if [ -e "$MARKER" ]; then echo second run; exit 0; fi
touch "$MARKER"; echo first run; exec sleep 300"#;
    jobs.create(&PostParams::default(), &sh_job("retry", &["-c", script], env, 2)).await.unwrap();

    let first = wait_running(&kubelet, &pods, "retry", "first run").await;
    kubelet.kill_pod_process(&first);

    let job = wait_job_succeeded(&jobs, "retry", 90).await;
    assert_eq!(job.status.unwrap().failed, Some(1));

    // (creationTimestamp has 1 s resolution: tell the Pods apart by name.)
    let (crashed, retried): (Vec<Pod>, Vec<Pod>) =
        job_pods(&pods, "retry").await.into_iter().partition(|p| p.name_any() == first);
    let summary =
        |pods: &[Pod]| -> Vec<_> { pods.iter().map(|p| (p.name_any(), phase(p).to_owned(), exit_code(p))).collect() };
    assert_eq!(summary(&crashed), [(first.clone(), "Failed".to_owned(), Some(137))]);
    let [retried] = &retried[..] else { panic!("expected one retry, got {:?}", summary(&retried)) };
    assert_eq!((phase(retried), exit_code(retried)), ("Succeeded", Some(0)));
    assert_eq!(kubelet.pod_log(&retried.name_any()), "second run\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_deletion_of_a_job_terminates_its_pods() {
    let ns = "cascade";
    let (_cluster, client, kubelet) = setup(ns).await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    // `sleep & wait` so that the shell runs its trap as soon as SIGTERM comes.
    let script = "trap 'echo got SIGTERM; exit 0' TERM; echo started; sleep 300 & wait";
    jobs.create(&PostParams::default(), &sh_job("cascade", &["-c", script], json!([]), 0)).await.unwrap();
    let pod = wait_running(&kubelet, &pods, "cascade", "started").await;

    // batch/v1 Jobs orphan their Pods by default; Background cascades.
    jobs.delete("cascade", &DeleteParams::background()).await.unwrap();

    eventually("the garbage collector to delete the Job's Pods", 60, || async {
        job_pods(&pods, "cascade").await.is_empty().then_some(())
    })
    .await;
    eventually("the Kubelet to stop the Pod's process", 30, || async {
        kubelet.running_pods().is_empty().then_some(())
    })
    .await;
    assert_eq!(kubelet.pod_log(&pod), "started\ngot SIGTERM\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_account_token_is_subject_to_rbac() {
    let ns = "rbac";
    let cluster = TestCluster::start().await;
    cluster.create_namespace(ns).await;
    let admin = cluster.client().await;

    let sa: ServiceAccount = from_json(json!({ "metadata": { "name": "runner" } }));
    Api::<ServiceAccount>::namespaced(admin.clone(), ns).create(&PostParams::default(), &sa).await.unwrap();
    let token = cluster.service_account_token(ns, "runner").await;

    // Use the kubeconfig-file path, as a spawned process would.
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = cluster.kubeconfig_for_token(&token, dir.path());
    let as_sa = cluster::client_from_kubeconfig_file(&kubeconfig).await;
    let sa_pods: Api<Pod> = Api::namespaced(as_sa, ns);

    match sa_pods.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) if s.code == 403 => {
            assert!(s.message.contains("system:serviceaccount:rbac:runner"), "{}", s.message)
        }
        other => panic!("expected 403 Forbidden before the RoleBinding, got {other:?}"),
    }

    let role: Role = from_json(json!({
        "metadata": { "name": "pod-reader" },
        "rules": [{ "apiGroups": [""], "resources": ["pods"], "verbs": ["list"] }]
    }));
    let binding: RoleBinding = from_json(json!({
        "metadata": { "name": "runner-pod-reader" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader" },
        "subjects": [{ "kind": "ServiceAccount", "name": "runner", "namespace": ns }]
    }));
    Api::<Role>::namespaced(admin.clone(), ns).create(&PostParams::default(), &role).await.unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), ns).create(&PostParams::default(), &binding).await.unwrap();

    // The RBAC authorizer works from an informer cache: allow a moment.
    eventually("the RoleBinding to take effect", 30, || async { sa_pods.list(&ListParams::default()).await.ok() })
        .await;

    // The same token through client_for_token; still only what the Role allows.
    let sa_client = cluster.client_for_token(&token).await;
    Api::<Pod>::namespaced(sa_client.clone(), ns).list(&ListParams::default()).await.unwrap();
    match Api::<Pod>::namespaced(sa_client, "default").list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("expected 403 in another namespace, got {other:?}"),
    }
}
