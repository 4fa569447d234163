//! Capacity on demand in `serve`: what the batches need of each upstream, as `/backlog`
//! (the JSON that KEDA's `metrics-api` scaler reads) and as gauges on `/metrics`.

use crate::common;

use std::time::{Duration, Instant};

use common::client::{Client, ids, input};
use common::serve::Serve;
use common::upstream::MockUpstream;
use common::{KEY, PROJECT, write_config};
use serde_json::Value;
use tempfile::TempDir;

const MINUTE: Duration = Duration::from_secs(60);

/// The upstream named `mock` in `/backlog`, once `ready` says so (or a minute passed).
async fn backlog_when(url: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + MINUTE;
    loop {
        let report: Value = reqwest::get(url).await.unwrap().json().await.unwrap();
        let mock = report["upstreams"]["mock"].clone();
        if ready(&mock) || Instant::now() > deadline {
            return mock;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_backlog_counts_lines_waiting_and_in_flight_per_upstream_then_empties() {
    let upstream = MockUpstream::start().await;
    upstream.hold();
    let data = TempDir::new().unwrap();
    let config = write_config(
        data.path(),
        &format!(
            "upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 3\n    \
             timeout: 60s\nbatches:\n  checkpoint_interval: 50ms\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    let client = Client::new(&serve.url, PROJECT, KEY);
    let url = serve.metrics_url.replace("/metrics", "/backlog");

    let idle = backlog_when(&url, |mock| mock.is_object()).await;
    assert_eq!((idle["batches"].as_u64(), idle["lines_waiting"].as_u64()), (Some(0), Some(0)), "{idle}");
    assert_eq!(idle["pace_ratio"], 0.0, "nothing left: {idle}");

    let custom_ids = ids("line", 30);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let held = backlog_when(&url, |mock| mock["lines_in_flight"] == 3 && mock["lines_waiting"] == 27).await;
    assert_eq!((held["lines_in_flight"].as_u64(), held["lines_waiting"].as_u64()), (Some(3), Some(27)), "{held}");
    assert_eq!(held["batches"], 1, "{held}");
    assert_eq!(held["models"]["mock-a"]["lines_waiting"], 30, "in flight included per model: {held}");
    assert!(held["tokens_waiting"].as_u64().unwrap() > 0, "estimated from the input's bytes: {held}");
    // Nothing answered yet: no pace to judge by, and all of the 24-hour window left.
    assert_eq!((held["pace"].as_f64(), held["pace_ratio"].as_f64()), (Some(0.0), Some(1.0)), "{held}");
    assert!(held["deadline_slack_seconds"].as_i64().unwrap() > 86_000, "{held}");
    assert!(held["replicas_needed"].is_null(), "serve knows no workload: {held}");
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    for gauge in [
        "nightshift_backlog_lines{upstream=\"mock\"} 27",
        "nightshift_backlog_lines_in_flight{upstream=\"mock\"} 3",
        "nightshift_backlog_model_lines{upstream=\"mock\",model=\"mock-a\"} 30",
        "nightshift_backlog_pace_ratio{upstream=\"mock\"} 1.0",
    ] {
        assert!(metrics.contains(gauge), "{gauge} missing from:\n{metrics}");
    }

    upstream.release();
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let done = backlog_when(&url, |mock| mock["batches"] == 0).await;
    assert_eq!((done["batches"].as_u64(), done["lines_waiting"].as_u64()), (Some(0), Some(0)), "{done}");
    assert_eq!(done["models"], serde_json::json!({}), "{done}");
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    assert!(
        !metrics.contains("nightshift_backlog_model_lines{"),
        "a model with nothing left loses its series:\n{metrics}"
    );
}
