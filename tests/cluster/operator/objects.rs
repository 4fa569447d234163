//! Batch objects on the API server: a deleted Batch takes its Jobs and shard data with it,
//! and hand-made objects with bad ids are refused by the Batch CRD's rules.

use std::time::Duration;

use crate::common::cluster::eventually;
use kube::api::{Api, DeleteParams};
use nightshift::k8s::crd::BatchResource;
use serde_json::json;
use tempfile::TempDir;

use super::{NS, Operator, batch_object, check_results};
use crate::common;
use common::client::{Client, ids, input};

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

/// Cancel, as in `serve`: the Jobs stop, the lines that ran keep their results, and the
/// lines never sent get `batch_cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_running_batch_stops_its_pods_and_keeps_what_ran() {
    let operator = Operator::start(10, Duration::from_millis(200), 2).await;
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let custom_ids = ids("line", 40);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    client.wait(&id, Duration::from_secs(60), |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 4).await;
    let cancelling = client.cancel(&id).await;
    assert_eq!(cancelling["status"], "cancelling", "{cancelling}");
    let batch = client.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    assert!(batch["cancelled_at"].as_i64().unwrap() >= batch["cancelling_at"].as_i64().unwrap());
    let results = client.results(&batch, &custom_ids).await;
    assert!(results.output.len() >= 4, "{batch}");
    assert!(!results.errors.is_empty(), "{batch}");
    assert!(results.errors.values().all(|r| r["error"]["code"] == "batch_cancelled"), "{:?}", results.errors);
    assert_eq!(operator.upstream.total_calls() as usize, results.output.len(), "cancelled lines were never sent");
    // The Jobs that ran when it was cancelled are gone; one whose shard had finished stays.
    let left = operator.jobs().await;
    assert!(left.iter().all(|job| job.status.as_ref().and_then(|s| s.succeeded) == Some(1)), "{left:?}");
}
