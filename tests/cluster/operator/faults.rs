//! The operator under faults: a worker pod killed, a superseded pod on one shard, the
//! controller restarted or cut off from the API server, Jobs that keep failing, a batch
//! its api left without a status, a corrupt checkpoint, a batch that does not decode.

use crate::common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use common::client::Client;
use common::cluster::eventually;
use common::proxy::Partition;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ObjectMeta, PostParams};
use nightshift::k8s::crd::resource_name;
use serde_json::{Value, json};
use tempfile::TempDir;

use super::{FAILING_IMAGE, NS, Operator, batch_object, check_results};

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
