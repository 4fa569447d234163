//! A batch end to end on the operator: the SDK's batch as sharded Jobs under least
//! privilege, seen through kubectl and the Batch's conditions, and every role reaching S3
//! through web identity (IRSA's STS) instead of keys.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use nightshift::k8s::crd::BatchResource;

use super::{NS, Operator, Setup, check_results};
use crate::common;
use common::client::Client;

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
