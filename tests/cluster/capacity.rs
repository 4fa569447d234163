//! Capacity on demand on a real API server: a batch for an upstream whose model server
//! is scaled to zero wakes it through its `scale` subresource, its lines wait until a
//! replica is ready, and once the backlog is gone and the cooldown has passed, the
//! server is back at zero. A workload the configuration does not name is never touched,
//! and the controller's RBAC forbids it.

use crate::common;
use crate::operator::{NS, Operator, SLEEPER_IMAGE, Setup, scrape};

use std::time::Duration;

use common::client::{Client, ids, input};
use common::cluster::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use nightshift::config::WorkloadKind;
use nightshift::k8s::crd::resource_name;
use nightshift::k8s::rbac;
use serde_json::{Value, json};

/// A Deployment of `replicas` pods of `image` (the stand-in kubelet runs it), named `name`.
fn deployment(name: &str, image: &str, replicas: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "server", "image": image, "args": ["3600"]}]},
            },
        },
    }))
    .unwrap()
}

/// `rules` in a Role of their own, bound to the controller's ServiceAccount (as the
/// chart binds its per-workload Role).
async fn grant_controller(operator: &Operator, name: &str, rules: Vec<PolicyRule>) {
    let client = operator.cluster.client().await;
    let meta = ObjectMeta { name: Some(name.to_owned()), namespace: Some(NS.to_owned()), ..ObjectMeta::default() };
    let pp = PostParams::default();
    Api::<Role>::namespaced(client.clone(), NS)
        .create(&pp, &Role { metadata: meta.clone(), rules: Some(rules) })
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: meta,
        role_ref: RoleRef { api_group: "rbac.authorization.k8s.io".into(), kind: "Role".into(), name: name.into() },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "nightshift-controller".into(),
            namespace: Some(NS.into()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client, NS).create(&pp, &binding).await.unwrap();
}

async fn replicas(deployments: &Api<Deployment>, name: &str) -> i32 {
    deployments.get(name).await.unwrap().spec.and_then(|s| s.replicas).unwrap_or(1)
}

/// The Events' messages with `reason` on the object `name`.
fn events(operator: &Operator, reason: &str, name: &str) -> String {
    let selector = format!("reason={reason},involvedObject.name={name}");
    let jsonpath = "jsonpath={.items[*].message}";
    operator.kubectl(&["get", "events", "-n", NS, "--field-selector", &selector, "-o", jsonpath])
}

/// The Batch's `CapacityReady` condition: its status and reason.
fn capacity_reason(operator: &Operator, batch: &str) -> String {
    let jsonpath = "jsonpath={.status.conditions[?(@.type==\"CapacityReady\")]['status', 'reason']}";
    operator.kubectl(&["get", "batch", batch, "-n", NS, "-o", jsonpath])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_wakes_its_model_server_from_zero_and_gives_it_back_after_the_cooldown() {
    let scale = "    scale: {kind: Deployment, name: served, max_replicas: 2, cooldown: 4s, max_wait: 5m}\n";
    let operator = Operator::set_up(Setup { upstreams: scale, ..Setup::new(10, Duration::from_millis(20), 4) }).await;
    grant_controller(&operator, "nightshift-scale-mock", rbac::scale_rules(WorkloadKind::Deployment, "served")).await;
    let deployments: Api<Deployment> = Api::namespaced(operator.cluster.client().await, NS);
    // The model server, at zero, with an image its replicas cannot start from yet.
    let pp = PostParams::default();
    deployments.create(&pp, &deployment("served", "absent:test", 0)).await.unwrap();
    deployments.create(&pp, &deployment("other", SLEEPER_IMAGE, 0)).await.unwrap();

    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.create(&client.upload(input(&ids("line", 20), "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    eventually("the server woken to one replica", 60, || async {
        (replicas(&deployments, "served").await == 1).then_some(())
    })
    .await;

    // Its replica never becomes ready: the lines wait, and say so.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(operator.upstream.total_calls(), 0, "no line goes out before a replica is ready");
    let backlog: Value =
        reqwest::get(format!("http://127.0.0.1:{}/backlog", operator.probe_port)).await.unwrap().json().await.unwrap();
    let mock = &backlog["upstreams"]["mock"];
    assert_eq!((mock["replicas_ready"].as_u64(), mock["lines_waiting"].as_u64()), (Some(0), Some(20)), "{backlog}");
    assert_eq!(mock["replicas_needed"], 1, "{backlog}");
    assert_eq!(scrape(&operator, "nightshift_capacity_waiting{upstream=\"mock\"}").await.1, 1.0);
    let name = resource_name(&nightshift::ids::BatchId::parse(&id).unwrap());
    let waiting = eventually("the batch says why it waits", 30, || async {
        let reason = capacity_reason(&operator, &name);
        (reason == "False WaitingForReplica").then_some(reason)
    })
    .await;
    assert_eq!(waiting, "False WaitingForReplica");

    // The image fixed, a replica becomes ready: the lines go, and the batch completes.
    operator.kubectl(&["set", "image", "deployment/served", &format!("server={SLEEPER_IMAGE}"), "-n", NS]);
    let done = client.wait_terminal(&id, Duration::from_secs(90)).await;
    assert_eq!((done["status"].as_str(), done["request_counts"]["completed"].as_u64()), (Some("completed"), Some(20)));
    assert_eq!(operator.upstream.total_calls(), 20, "every line sent once");
    assert_eq!(capacity_reason(&operator, &name), "True ReplicaReady");
    assert_eq!(scrape(&operator, "nightshift_capacity_waiting{upstream=\"mock\"}").await.1, 0.0);

    // Nothing left: back at zero once the cooldown has passed.
    eventually("the server back at zero", 60, || async { (replicas(&deployments, "served").await == 0).then_some(()) })
        .await;
    // The Events and the counter follow each change (a moment after it).
    let on_server = eventually("both changes told on the server", 30, || async {
        let told = [events(&operator, "ScaledUp", "served"), events(&operator, "ScaledDown", "served")];
        (told[0].contains("from 0 to 1") && told[1].contains("from 1 to 0")).then(|| told.join("\n"))
    })
    .await;
    assert!(
        on_server.contains("Deployment/served from 1 to 0 replicas for upstream mock: no batch line"),
        "{on_server}"
    );
    let on_batch = events(&operator, "ScaledUp", &name);
    assert!(on_batch.contains("Deployment/served from 0 to 1 replicas for upstream mock"), "{on_batch}");
    let down = events(&operator, "ScaledDown", &name);
    assert_eq!(down, "", "going back to the floor is no batch's doing");
    let changes = "nightshift_scale_changes_total{upstream=\"mock\",reason=";
    assert_eq!(scrape(&operator, &format!("{changes}\"wake\"}}")).await.1, 1.0);
    assert_eq!(scrape(&operator, &format!("{changes}\"idle\"}}")).await.1, 1.0);

    // The workload nobody named: untouched, and out of the controller's reach.
    assert_eq!(replicas(&deployments, "other").await, 0);
    let as_controller: Api<Deployment> =
        Api::namespaced(operator.cluster.client_for_token(&operator.controller_token).await, NS);
    let scale = Patch::Merge(json!({"spec": {"replicas": 1}}));
    let refused = as_controller.patch_scale("other", &PatchParams::default(), &scale).await.unwrap_err();
    assert!(matches!(&refused, kube::Error::Api(e) if e.code == 403), "{refused}");
    as_controller.get_scale("served").await.expect("the named one is within reach");
}

/// A batch whose projected finish passes its window, at a server whose every replica is
/// ready: scaled up to the replicas its pace needs, within `max_replicas`; back to the
/// floor (`min_replicas`, not zero) once nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_would_miss_its_window_scales_its_server_up_within_the_ceiling() {
    let scale = "    scale: {kind: Deployment, name: served, min_replicas: 1, max_replicas: 2, cooldown: 3s}\n";
    // 60 lines one at a time, 250 ms each: some 15 s of work in a window of 10.
    let setup = Setup {
        upstreams: scale,
        batches: "  completion_window: 10s\n",
        ..Setup::new(100, Duration::from_millis(250), 1)
    };
    let operator = Operator::set_up(setup).await;
    grant_controller(&operator, "nightshift-scale-mock", rbac::scale_rules(WorkloadKind::Deployment, "served")).await;
    let deployments: Api<Deployment> = Api::namespaced(operator.cluster.client().await, NS);
    deployments.create(&PostParams::default(), &deployment("served", SLEEPER_IMAGE, 1)).await.unwrap();
    eventually("the server's replica ready", 60, || async {
        let ready = deployments.get("served").await.ok()?.status?.ready_replicas?;
        (ready == 1).then_some(())
    })
    .await;

    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.create(&client.upload(input(&ids("line", 60), "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    eventually("the server scaled to two replicas", 60, || async {
        (replicas(&deployments, "served").await == 2).then_some(())
    })
    .await;
    let name = resource_name(&nightshift::ids::BatchId::parse(&id).unwrap());
    let told = eventually("the batch told why", 30, || async {
        let told = events(&operator, "ScaledUp", &name);
        (!told.is_empty()).then_some(told)
    })
    .await;
    assert!(
        told.contains(
            "Deployment/served from 1 to 2 replicas for upstream mock: a batch's projected finish passes its window"
        ),
        "{told}"
    );
    let changes = "nightshift_scale_changes_total{upstream=\"mock\",reason=\"deadline\"}";
    assert_eq!(scrape(&operator, changes).await.1, 1.0);

    // Never past the ceiling, however late; back to the floor of one once it ended.
    let ended = client.wait_terminal(&id, Duration::from_secs(90)).await;
    assert_eq!(ended["status"], "expired", "{ended}");
    eventually("the server back at its floor", 60, || async {
        (replicas(&deployments, "served").await == 1).then_some(())
    })
    .await;
    let told = events(&operator, "ScaledUp", "served");
    assert!(!told.contains("to 3"), "{told}");
}
