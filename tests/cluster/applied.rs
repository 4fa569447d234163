//! Batches declared as resources (`kubectl apply`): the input read from S3 or named by
//! file id, the output copied to an S3 prefix, `kubectl wait` for the end, a refused
//! input's line errors in the status and Events, re-applying as a no-op, cleanup after
//! `ttlSecondsAfterFinished`, and a running Batch deleted: cancelled first, nothing left
//! running.

use crate::common;
use crate::operator::{NS, Operator, Setup, signing_secret};

use std::collections::HashSet;
use std::time::Duration;

use common::client::{Client, ids, input};
use common::cluster::eventually;
use common::simulator::{SimConfig, Simulator};
use kube::api::Api;
use nightshift::batches::Status;
use nightshift::k8s::crd::{BatchResource, PROJECT_LABEL, SOURCE_LABEL};
use nightshift::storage::Key;
use serde_json::{Value, json};
use tempfile::TempDir;

/// Applies `manifest` with kubectl; its output.
fn apply(operator: &Operator, dir: &TempDir, manifest: &str) -> String {
    let path = dir.path().join("batch.yaml");
    std::fs::write(&path, manifest).unwrap();
    operator.kubectl(&["apply", "-n", NS, "-f", path.to_str().unwrap()])
}

async fn put(operator: &Operator, key: &str, content: Vec<u8>) {
    operator.s3.store().put(&Key::parse(key).unwrap(), content.into()).await.unwrap();
}

async fn object(operator: &Operator, key: &str) -> String {
    let bytes = operator.s3.store().get(&Key::parse(key).unwrap()).await.unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

async fn resource(operator: &Operator, name: &str) -> Option<BatchResource> {
    let api: Api<BatchResource> = Api::namespaced(operator.cluster.client().await, NS);
    api.get_opt(name).await.unwrap()
}

/// The custom ids of an output file's records, each checked for the mock's answer.
fn answered(output: &str) -> Vec<String> {
    output
        .lines()
        .map(|line| {
            let record: Value = serde_json::from_str(line).unwrap();
            let id = record["custom_id"].as_str().unwrap().to_owned();
            let content = &record["response"]["body"]["choices"][0]["message"]["content"];
            assert_eq!(content, &json!(format!("answer to {id}")), "{line}");
            id
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applied_batch_reads_its_input_from_s3_runs_and_writes_its_output_there() {
    let operator = Operator::start(5, Duration::ZERO, 4).await;
    let dir = TempDir::new().unwrap();
    let custom_ids = ids("applied", 12);
    put(&operator, "inputs/eval.jsonl", input(&custom_ids, "mock-a")).await;
    let manifest = "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: nightly-eval\nspec:\n  \
                    input: {uri: s3://nightshift/inputs/eval.jsonl}\n  endpoint: /v1/chat/completions\n  \
                    metadata: {team: evals, run: {day: 26}}\n  output: {uri: s3://nightshift/results/}\n";
    assert!(apply(&operator, &dir, manifest).contains("created"));
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Complete", "batch/nightly-eval", "--timeout=120s"]);

    let batch = resource(&operator, "nightly-eval").await.unwrap();
    let (spec, status) = (batch.accepted().unwrap().clone(), batch.status.clone().unwrap());
    assert_eq!(status.status, Status::Completed);
    assert_eq!((status.request_counts.total, status.request_counts.completed), (12, 12));
    let labels = batch.metadata.labels.clone().unwrap();
    assert_eq!(labels.get(SOURCE_LABEL).map(String::as_str), Some("applied"));
    assert_eq!(labels.get(PROJECT_LABEL).map(String::as_str), Some(common::PROJECT), "the namespace's only Project");
    let output_key = format!("results/{}/output.jsonl", spec.id);
    assert_eq!(status.output_uri, Some(format!("s3://nightshift/{output_key}")));
    assert_eq!(status.error_uri, None, "no line failed: no error file");
    let output = object(&operator, &output_key).await;
    let mut got = answered(&output);
    got.sort();
    let mut want = custom_ids.clone();
    want.sort();
    assert_eq!(got, want, "every line once, in the bucket");

    // Through the API, like any batch: the same record, the input a file of the project.
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let listed = client.get("/v1/batches").await.1;
    let found = listed["data"].as_array().unwrap().iter().find(|b| b["id"] == json!(spec.id)).cloned();
    let found = found.expect("an applied batch is listed by the API");
    assert_eq!(found["status"], "completed");
    assert_eq!(found["metadata"], json!({"team": "evals", "run": {"day": 26}}));
    let file = client.file(spec.input_file_id.as_str()).await;
    assert_eq!((file["purpose"].as_str(), file["filename"].as_str()), (Some("batch"), Some("eval.jsonl")));
    let file_output = client.content(found["output_file_id"].as_str().unwrap()).await;
    assert_eq!(file_output, output, "the bucket has what the Files API has");

    // GitOps: the same manifest again changes nothing.
    let generation = batch.metadata.generation;
    assert!(apply(&operator, &dir, manifest).contains("unchanged"));
    assert_eq!(resource(&operator, "nightly-eval").await.unwrap().metadata.generation, generation);

    // An input named by file id, next to a batch made through the API.
    let uploaded = client.upload(input(&ids("by-id", 3), "mock-a")).await;
    let by_id = format!(
        "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: by-file-id\nspec:\n  \
         input: {{file_id: {uploaded}}}\n  endpoint: /v1/chat/completions\n"
    );
    apply(&operator, &dir, &by_id);
    let made = client.create(&uploaded).await;
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Complete", "batch/by-file-id", "--timeout=120s"]);
    client.wait_terminal(made["id"].as_str().unwrap(), Duration::from_secs(120)).await;
    let table = operator.kubectl(&["get", "batches", "-n", NS, "-o", "wide"]);
    let row = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{table}")).to_owned();
    assert!(
        row("nightly-eval").contains("applied") && row("nightly-eval").contains("s3://nightshift/results/"),
        "{table}"
    );
    assert!(row("by-file-id").contains("applied"), "{table}");
    let api_made =
        nightshift::k8s::crd::resource_name(&nightshift::ids::BatchId::parse(made["id"].as_str().unwrap()).unwrap());
    assert!(row(&api_made).contains(" api "), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_applied_batch_shows_why_in_its_status_and_events_and_goes_after_its_ttl() {
    let operator = Operator::start(5, Duration::ZERO, 4).await;
    let dir = TempDir::new().unwrap();
    let mut broken = input(&ids("ok", 1), "mock-a");
    broken.extend_from_slice(b"{\"custom_id\": \"x\", \"method\": \"POST\"\n");
    put(&operator, "inputs/broken.jsonl", broken).await;
    let manifest = |name: &str, uri: &str, ttl: &str| {
        format!(
            "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: {name}\nspec:\n  input: {{uri: {uri}}}\n  \
             endpoint: /v1/chat/completions\n{ttl}"
        )
    };
    apply(
        &operator,
        &dir,
        &manifest("broken", "s3://nightshift/inputs/broken.jsonl", "  ttlSecondsAfterFinished: 8\n"),
    );
    apply(&operator, &dir, &manifest("missing", "s3://nightshift/inputs/missing.jsonl", ""));
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Failed", "batch/broken", "batch/missing", "--timeout=60s"]);

    // An input that does not validate: a failed batch with the line, as the API records one.
    let broken = resource(&operator, "broken").await.unwrap();
    let status = broken.status.clone().unwrap();
    assert_eq!(status.status, Status::Failed);
    assert_eq!(status.errors[0].line, Some(2), "{:?}", status.errors);
    let described = operator.kubectl(&["describe", "batch", "broken", "-n", NS]);
    assert!(described.contains("Refused") && described.contains("line 2:"), "{described}");
    let id = broken.accepted().unwrap().id.clone();
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let seen = client.batch(id.as_str()).await;
    assert_eq!((seen["status"].as_str(), seen["errors"]["data"][0]["line"].as_u64()), (Some("failed"), Some(2)));

    // An object that is not there: refused before any batch exists, with why.
    let missing = resource(&operator, "missing").await.unwrap();
    assert!(missing.accepted().is_none(), "no batch recorded");
    let error = &missing.status.unwrap().errors[0];
    assert_eq!(error.message, "Input object not found: s3://nightshift/inputs/missing.jsonl");
    assert_eq!(error.param.as_deref(), Some("input.uri"));
    let message = operator.warning("Refused", "missing").await;
    assert!(message.contains("Input object not found"), "{message}");

    // Cleanup by policy: the Batch with a TTL goes, the one without stays.
    eventually("the Batch with ttlSecondsAfterFinished gone", 60, || async {
        resource(&operator, "broken").await.is_none().then_some(())
    })
    .await;
    assert!(resource(&operator, "missing").await.is_some());
    let file = client.file(seen["input_file_id"].as_str().unwrap()).await;
    assert_eq!(file["id"], seen["input_file_id"], "its files follow their own expiry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_running_applied_batch_cancels_it_first_and_leaves_nothing_running() {
    let operator = Operator::start(10, Duration::from_millis(300), 2).await;
    let dir = TempDir::new().unwrap();
    // 80 lines at 300 ms, two at a time: 12 s at the least, where the delete comes after
    // 4 calls; the margin is what "fewer than all ran" leans on.
    let custom_ids = ids("deleted", 80);
    put(&operator, "inputs/long.jsonl", input(&custom_ids, "mock-a")).await;
    let manifest = "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: long\nspec:\n  \
                    input: {uri: s3://nightshift/inputs/long.jsonl}\n  endpoint: /v1/chat/completions\n  \
                    output: {uri: s3://nightshift/results/}\n";
    apply(&operator, &dir, manifest);
    eventually("some lines done", 60, || {
        let calls = operator.upstream.total_calls();
        async move { (calls >= 4).then_some(()) }
    })
    .await;
    let id = resource(&operator, "long").await.unwrap().accepted().unwrap().id.clone();
    operator.kubectl(&["delete", "batch", "long", "-n", NS, "--wait=false"]);
    eventually("the Batch gone", 90, || async { resource(&operator, "long").await.is_none().then_some(()) }).await;
    let events = operator.kubectl(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        "involvedObject.name=long",
        "-o",
        "jsonpath={.items[*].reason}",
    ]);
    assert!(events.contains("CancelledOnDelete") && events.contains("OutputWritten"), "{events}");
    eventually("its Jobs gone", 60, || async { operator.jobs().await.is_empty().then_some(()) }).await;
    let calls = operator.upstream.total_calls();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(operator.upstream.total_calls(), calls, "nothing sends after the Batch is gone");

    // What ran before the delete is in the bucket, each line once.
    let output = object(&operator, &format!("results/{id}/output.jsonl")).await;
    let answered = answered(&output);
    let unique: HashSet<&String> = answered.iter().collect();
    assert_eq!(unique.len(), answered.len(), "no line twice");
    assert!(!answered.is_empty() && answered.len() < custom_ids.len(), "{} of 80 lines ran", answered.len());
    let left = operator.s3.store().list(&format!("batches/{id}/")).await.unwrap();
    assert!(left.is_empty(), "the shard data went with the Batch: {left:?}");
}

/// An applied Batch's `priority` goes on its lines, over its upstream's (vLLM's priority
/// scheduling); a Batch without one keeps the upstream's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applied_batchs_priority_goes_on_its_lines_over_the_upstreams() {
    let sim = Simulator::start(SimConfig { priority_scheduling: true, ..SimConfig::default() }).await;
    let upstream = format!("  - name: sim\n    base_url: {}\n    models: [\"sim-*\"]\n    priority: 7\n", sim.url);
    let operator = Operator::set_up(Setup { upstreams: &upstream, ..Setup::new(10, Duration::ZERO, 4) }).await;
    let dir = TempDir::new().unwrap();
    put(&operator, "inputs/urgent.jsonl", input(&ids("urgent", 12), "sim-a")).await;
    put(&operator, "inputs/plain.jsonl", input(&ids("plain", 5), "sim-a")).await;
    for (name, priority) in [("urgent", "  priority: -3\n"), ("plain", "")] {
        let manifest = format!(
            "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: {name}\nspec:\n  \
             input: {{uri: s3://nightshift/inputs/{name}.jsonl}}\n  endpoint: /v1/chat/completions\n{priority}"
        );
        apply(&operator, &dir, &manifest);
    }
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Complete", "batch/urgent", "batch/plain", "--timeout=120s"]);
    let finished = sim.stats().finished;
    assert_eq!((finished.get(&-3), finished.get(&7)), (Some(&12), Some(&5)), "{finished:?}");
    let urgent = resource(&operator, "urgent").await.unwrap();
    assert_eq!(urgent.accepted().unwrap().priority, Some(-3), "kept in the record, for the workers");
}

/// An applied Batch's own webhook gets its event, signed with its own secret, although
/// its project has no endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applied_batchs_own_webhook_gets_its_event() {
    const SIGNING: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let receiver = common::receiver::Receiver::start().await;
    let operator = Operator::start(10, Duration::ZERO, 4).await;
    signing_secret(&operator, "eval-hook", SIGNING).await;
    let dir = TempDir::new().unwrap();
    put(&operator, "inputs/hooked.jsonl", input(&ids("hooked", 4), "mock-a")).await;
    let manifest = format!(
        "apiVersion: nightshift.dev/v1alpha1\nkind: Batch\nmetadata:\n  name: hooked\nspec:\n  \
         input: {{uri: s3://nightshift/inputs/hooked.jsonl}}\n  endpoint: /v1/chat/completions\n  \
         webhooks: [{{url: \"{}\", secret_name: eval-hook}}]\n",
        receiver.url
    );
    apply(&operator, &dir, &manifest);
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Complete", "batch/hooked", "--timeout=120s"]);
    let id = resource(&operator, "hooked").await.unwrap().accepted().unwrap().id.to_string();
    let delivery = receiver.wait_for(1, 60).await.remove(0);
    let event = delivery.json();
    assert_eq!((event["type"].as_str(), event["data"]["id"].as_str()), (Some("batch.completed"), Some(id.as_str())));
    // A batch refused at validation announces `batch.failed` before its record (and so its
    // endpoints) exists: the event waits for them.
    put(&operator, "inputs/hooked-broken.jsonl", b"not json\n".to_vec()).await;
    apply(
        &operator,
        &dir,
        &manifest.replace("name: hooked", "name: hooked-broken").replace("hooked.jsonl", "hooked-broken.jsonl"),
    );
    operator.kubectl(&["wait", "-n", NS, "--for=condition=Failed", "batch/hooked-broken", "--timeout=60s"]);
    let broken = resource(&operator, "hooked-broken").await.unwrap().accepted().unwrap().id.to_string();
    let deliveries = receiver.wait_for(2, 60).await;
    let failed = deliveries[1].json();
    assert_eq!((failed["type"].as_str(), failed["data"]["id"].as_str()), (Some("batch.failed"), Some(broken.as_str())));
    let secret = nightshift::webhooks::SigningSecret::parse(SIGNING).unwrap();
    let timestamp: i64 = delivery.timestamp.parse().unwrap();
    let expected = nightshift::webhooks::sign::signature(&secret, &delivery.id, timestamp, &delivery.body);
    assert_eq!(delivery.signature, expected, "signed with the batch's own secret");
}
