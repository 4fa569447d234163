//! The load signal's presets for TensorRT-LLM (`trtllm`), NVIDIA Dynamo (`dynamo`) and
//! Hugging Face TGI (`tgi`), read over HTTP from stand-ins that serve each server's own
//! metric names: a queue in those names holds a batch, and the same page read through
//! another server's preset is counted `invalid` and holds nothing. (`vllm` is read from
//! the simulator and `llamacpp` from llama-server itself, in the night-shift and engine
//! tests.)

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::client::{ids, input};
use common::serve::Serve;
use common::upstream::MockUpstream;
use tempfile::TempDir;

/// TensorRT-LLM's page (`trtllm-serve`'s `/prometheus/metrics`) with `waiting` queued.
fn trtllm(waiting: u64) -> String {
    format!(
        "# TYPE trtllm_num_requests_waiting gauge\ntrtllm_num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
         trtllm_num_requests_running{{model_name=\"m\"}} 4\ntrtllm_kv_cache_utilization{{model_name=\"m\"}} 0.3\n"
    )
}

/// Dynamo's frontend page with `waiting` queued (its in-flight count includes them).
fn dynamo(waiting: u64) -> String {
    format!(
        "# TYPE dynamo_frontend_queued_requests gauge\ndynamo_frontend_queued_requests{{model=\"m\"}} {waiting}\n\
         dynamo_frontend_inflight_requests{{model=\"m\"}} {}\n",
        waiting + 4
    )
}

/// The upstreams whose signal is read through its own server's preset (the fourth,
/// `mixed`, reads TensorRT-LLM's page as Dynamo's).
const READ: [&str; 3] = ["trt", "dyn", "tgi"];

/// TGI's router page with `waiting` queued.
fn tgi(waiting: u64) -> String {
    format!(
        "# TYPE tgi_queue_size gauge\ntgi_queue_size {waiting}\ntgi_batch_current_size 4\ntgi_batch_total_tokens 16000\n"
    )
}

/// A `/metrics` endpoint answering `page` of the waiting count the test sets.
async fn stand_in(page: fn(u64) -> String, waiting: Arc<AtomicU64>) -> String {
    let app = Router::new().route("/metrics", get(move || std::future::ready(page(waiting.load(Ordering::Relaxed)))));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Calls the upstream had for the lines of `model` (their custom ids start with it).
fn calls_of(upstream: &MockUpstream, model: &str) -> u32 {
    upstream.all_calls().iter().filter(|(id, _)| id.starts_with(&format!("{model}-"))).map(|(_, n)| n).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn trtllm_dynamo_and_tgi_queues_hold_a_batch_read_through_their_presets() {
    let upstream = MockUpstream::start().await;
    let waiting = Arc::new(AtomicU64::new(3));
    let trtllm_page = stand_in(trtllm, waiting.clone()).await;
    let dynamo_page = stand_in(dynamo, waiting.clone()).await;
    let tgi_page = stand_in(tgi, waiting.clone()).await;
    // The last one reads TensorRT-LLM's page as if it were Dynamo's.
    let upstreams: String = [
        ("trt", &trtllm_page, "trtllm"),
        ("dyn", &dynamo_page, "dynamo"),
        ("tgi", &tgi_page, "tgi"),
        ("mixed", &trtllm_page, "dynamo"),
    ]
    .iter()
    .map(|(name, url, server)| {
        let entry = format!("  - name: {name}\n    base_url: {}\n    models: [\"mock-{name}\"]\n", upstream.base_url);
        entry + &format!("    load_signal: {{url: \"{url}\", server: {server}, every: 50ms}}\n")
    })
    .collect();
    let dir = TempDir::new().unwrap();
    let (serve, client) =
        Serve::for_project(dir.path(), &format!("upstreams:\n{upstreams}batches:\n  reconcile_interval: 100ms\n"));
    let held = |name: &str| format!("nightshift_upstream_dispatch_held{{upstream=\"{name}\"}}");
    common::cluster::eventually("every preset's queue read", 30, || async {
        for name in READ {
            if serve.metric(&held(name)).await != Some(1.0) {
                return None;
            }
        }
        Some(())
    })
    .await;

    // A batch's lines go out in order, so each upstream's lines are a batch of their own.
    let batch = |model: &str| input(&ids(model, 10), model);
    let mixed = client.create(&client.upload(batch("mock-mixed")).await).await;
    let mixed = client.wait_terminal(mixed["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(mixed["request_counts"]["completed"], 10, "a page without its preset's names holds nothing: {mixed}");
    let mut held_ids = Vec::new();
    for model in READ.map(|name| format!("mock-{name}")) {
        let id = client.create(&client.upload(batch(&model)).await).await["id"].as_str().unwrap().to_owned();
        client.wait(&id, Duration::from_secs(30), |b| b["status"] == "in_progress").await;
        held_ids.push(id);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for model in READ.map(|name| format!("mock-{name}")) {
        assert_eq!(calls_of(&upstream, &model), 0, "3 requests queue at {model}'s server: none of its lines is sent");
    }

    waiting.store(0, Ordering::Relaxed);
    for id in &held_ids {
        let done = client.wait_terminal(id, Duration::from_secs(60)).await;
        assert_eq!(done["request_counts"]["completed"], 10, "{done}");
    }
    let failures = |name: &str, reason: &str| {
        format!("nightshift_load_signal_failures_total{{upstream=\"{name}\",reason=\"{reason}\"}}")
    };
    assert!(serve.metric(&failures("mixed", "invalid")).await.unwrap_or(0.0) >= 1.0, "the mixed-up read is counted");
    for name in READ {
        for reason in ["invalid", "unreachable", "stale"] {
            assert_eq!(serve.metric(&failures(name, reason)).await.unwrap_or(0.0), 0.0, "{name}: {reason}");
        }
    }
}
