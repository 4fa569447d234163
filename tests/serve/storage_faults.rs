//! Storage faults, injected between `nightshift serve` and a real S3 server (s3s-fs) by
//! a proxy of our own (`common::faults`): connections closed unanswered, 503 SlowDown,
//! 500 InternalError, answers reset mid-body, stalls. Under each, an upload fails with a
//! clean `storage_error` and leaves no file, a running batch pauses and resumes with
//! every line once, finalize is retried and publishes no half-written file, and reads
//! that need no storage are answered.

use crate::common;

use std::time::{Duration, Instant};

use common::client::{Client, ids, input};
use common::faults::{self, FaultProxy};
use common::serve::Serve;
use common::upstream::MockUpstream;
use common::{TestS3, write_config};
use tempfile::TempDir;

const MINUTE: Duration = Duration::from_secs(60);
const CONCURRENCY: u64 = 4;

struct Setup {
    s3: TestS3,
    proxy: FaultProxy,
    upstream: MockUpstream,
    client: Client,
    serve: Serve,
    _dir: TempDir,
}

/// `serve` on S3 through the fault proxy, with a one-second storage timeout.
async fn setup(upstream_delay: Duration) -> Setup {
    let s3 = TestS3::start();
    let proxy = FaultProxy::start(&s3.endpoint).await;
    let storage = s3.storage_yaml(&proxy.endpoint, ", timeout: 1s");
    let upstream = MockUpstream::start().await;
    upstream.delay(upstream_delay);
    let dir = TempDir::new().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "{storage}upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: {CONCURRENCY}\n    \
             timeout: 5m\nbatches:\n  shard_lines: 1000\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let serve = Serve::start_configured(&config);
    let client = Client::new(&serve.url, common::PROJECT, common::KEY);
    Setup { s3, proxy, upstream, client, serve, _dir: dir }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upload_under_each_storage_fault_fails_cleanly_and_leaves_no_file() {
    let setup = setup(Duration::ZERO).await;
    for fault in faults::ALL {
        setup.proxy.inject(fault);
        let started = Instant::now();
        let (status, error) = setup.client.try_upload(input(&ids("u", 50), "mock-a")).await;
        assert_eq!(status, 500, "{fault:?}: {error}");
        assert_eq!(error["error"]["type"], "internal_error", "{fault:?}: {error}");
        assert_eq!(error["error"]["code"], "storage_error", "{fault:?}: {error}");
        eprintln!("{fault:?}: 500 storage_error after {:?}", started.elapsed());
        setup.proxy.heal();
    }
    let (status, files) = setup.client.get("/v1/files").await;
    assert_eq!(status, 200);
    assert_eq!(files["data"], serde_json::json!([]), "no file appeared");
    let store = setup.s3.store();
    let records = store.list("files/").await.unwrap();
    assert!(records.is_empty(), "no file record in storage: {records:?}");
    let data = store.list("file-data/").await.unwrap();
    eprintln!("{} requests met a fault; file data left in storage: {data:?}", setup.proxy.injected());
    assert!(setup.proxy.injected() >= faults::ALL.len() as u64);
    // Healed, uploads work again.
    setup.client.upload(input(&ids("u", 50), "mock-a")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_running_batch_pauses_under_each_storage_fault_and_resumes_with_every_line_once() {
    const LINES: usize = 400;
    let setup = setup(Duration::from_millis(20)).await;
    let custom_ids = ids("p", LINES);
    let batch = setup.client.create(&setup.client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    setup.client.wait(&id, MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 20).await;
    let mut report = Vec::new();
    for fault in faults::ALL {
        let retries_before = commit_retries(&setup.serve).await;
        setup.proxy.inject(fault);
        // Once a commit has failed, its lines keep their permits, the lines in flight
        // finish and wait for it too, and dispatch pauses: nothing is at the upstream,
        // and nothing comes.
        let deadline = Instant::now() + MINUTE;
        while commit_retries(&setup.serve).await == retries_before || setup.upstream.in_flight() > 0 {
            assert!(Instant::now() < deadline, "{fault:?}: dispatch never paused");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let paused_at = setup.upstream.total_calls();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let sent_while_paused = setup.upstream.total_calls() - paused_at;
        // The batch's state is in memory: reading it needs no storage.
        let (status, read) = setup.client.get(&format!("/v1/batches/{id}")).await;
        assert_eq!(status, 200, "{fault:?}: {read}");
        assert_eq!(read["status"], "in_progress", "{fault:?}");
        setup.proxy.heal();
        assert_eq!(sent_while_paused, 0, "{fault:?}: dispatch pauses while commits fail");
        // Healed, the next commit attempt succeeds and dispatch resumes: the next fault
        // meets a batch that runs again.
        let healed = Instant::now();
        while setup.upstream.total_calls() <= paused_at + CONCURRENCY {
            assert!(healed.elapsed() < MINUTE, "{fault:?}: dispatch never resumed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        report.push(format!("{fault:?}: paused at {paused_at} calls, resumed after {:?}", healed.elapsed()));
    }
    let batch = setup.client.wait_terminal(&id, 2 * MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = setup.client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), LINES, "no line lost");
    let sent = setup.upstream.total_calls();
    eprintln!("{}; {} requests met a fault; {sent} calls for {LINES} lines", report.join(", "), setup.proxy.injected());
    assert_eq!(sent, LINES as u64, "no line was sent twice");
}

/// `nightshift_commit_retries_total` of serve: commits that storage refused.
async fn commit_retries(serve: &Serve) -> u64 {
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    let line = metrics.lines().find(|line| line.starts_with("nightshift_commit_retries_total ")).unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn finalize_under_each_storage_fault_is_retried_and_never_publishes_a_half_written_file() {
    let setup = setup(Duration::ZERO).await;
    let custom_ids = ids("z", 30);
    let file = setup.client.upload(input(&custom_ids, "mock-a")).await;
    for fault in faults::ALL {
        // Writes of file data (finalize's output) fail; the batch's own commits pass.
        setup.proxy.inject_where(fault, &["PUT", "POST"], "/file-data/");
        let batch = setup.client.create(&file).await;
        let id = batch["id"].as_str().unwrap().to_owned();
        let stuck = setup
            .client
            .wait(&id, MINUTE, |b| b["status"] == "finalizing" && b["errors"]["data"][0]["code"] == "storage_error")
            .await;
        assert!(stuck["output_file_id"].is_null(), "{fault:?}: {stuck}");
        let (_, outputs) = setup.client.get("/v1/files?purpose=batch_output").await;
        let published: Vec<_> = outputs["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["filename"].as_str().unwrap().contains(&id))
            .collect();
        assert!(published.is_empty(), "{fault:?}: nothing is published while finalize fails: {published:?}");
        setup.proxy.heal();
        let batch = setup.client.wait_terminal(&id, MINUTE).await;
        assert_eq!(batch["status"], "completed", "{fault:?}: {batch}");
        assert!(batch["errors"].is_null(), "{fault:?}: the storage error is cleared: {batch}");
        let results = setup.client.results(&batch, &custom_ids).await;
        assert_eq!(results.output.len(), custom_ids.len(), "{fault:?}: the whole output");
        let (_, outputs) = setup.client.get("/v1/files?purpose=batch_output").await;
        let published = outputs["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["filename"].as_str().unwrap().contains(&id))
            .count();
        assert_eq!(published, 1, "{fault:?}: one output file");
    }
    eprintln!("{} requests met a fault", setup.proxy.injected());
}
