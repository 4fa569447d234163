//! The load signal asks for its metrics by name (`?name[]=…`): a server that renders
//! only what is named, as Prometheus's Python client does for vLLM, SGLang and
//! TensorRT-LLM, is asked for exactly the samples a reading uses and holds a batch on
//! that answer; a server that refuses the query is read whole from then on, and nothing
//! is counted as a failure.

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::RawQuery;
use axum::http::StatusCode;
use axum::routing::get;
use common::client::{ids, input};
use common::serve::Serve;
use common::upstream::MockUpstream;
use tempfile::TempDir;

/// vLLM's page, with a histogram no reading uses, 3 requests waiting.
const PAGE: &str = "# TYPE vllm:num_requests_waiting gauge\n\
    vllm:num_requests_waiting{model_name=\"m\"} WAITING\n\
    vllm:num_requests_running{model_name=\"m\"} 4\n\
    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.3\n\
    vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",le=\"0.3\"} 7\n\
    vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 9\n\
    vllm:time_per_output_token_seconds_sum{model_name=\"m\"} 1.5\n\
    vllm:time_per_output_token_seconds_count{model_name=\"m\"} 100\n";

/// What the stand-in was asked: the names of each request that named any, and how many
/// asked for the whole page.
#[derive(Default)]
struct Asked {
    named: Vec<BTreeSet<String>>,
    whole: usize,
}

/// A `/metrics` endpoint serving [`PAGE`] with `waiting` requests waiting. `honour`: as
/// Prometheus's Python client, it answers the named samples alone; otherwise it refuses
/// any query with 400.
async fn stand_in(honour: bool, waiting: Arc<Mutex<u32>>, asked: Arc<Mutex<Asked>>) -> String {
    let app = Router::new().route(
        "/metrics",
        get(move |RawQuery(query): RawQuery| {
            let page = PAGE.replace("WAITING", &waiting.lock().unwrap().to_string());
            let asked = asked.clone();
            async move {
                let query = query.unwrap_or_default();
                let url = reqwest::Url::parse(&format!("http://x/?{query}")).unwrap();
                let names: BTreeSet<String> =
                    url.query_pairs().filter(|(key, _)| key == "name[]").map(|(_, name)| name.into_owned()).collect();
                let mut asked = asked.lock().unwrap();
                if names.is_empty() {
                    asked.whole += 1;
                    return (StatusCode::OK, page);
                }
                asked.named.push(names.clone());
                if !honour {
                    return (StatusCode::BAD_REQUEST, "unknown query parameter".to_owned());
                }
                let sample = |line: &&str| names.iter().any(|name| line.split(['{', ' ']).next() == Some(name));
                (StatusCode::OK, page.lines().filter(sample).map(|line| format!("{line}\n")).collect())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// `serve` with one upstream whose load signal is the stand-in; waits until a reading
/// has held batch dispatch (3 requests wait), then runs a batch of 10 lines: none is
/// sent while they wait, and all complete once they are gone. No reading is counted
/// as failed.
async fn held_then_released(honour: bool) -> Arc<Mutex<Asked>> {
    let upstream = MockUpstream::start().await;
    let waiting = Arc::new(Mutex::new(3));
    let asked = Arc::new(Mutex::new(Asked::default()));
    let url = stand_in(honour, waiting.clone(), asked.clone()).await;
    let dir = TempDir::new().unwrap();
    let config = format!(
        "upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    load_signal: {{url: \"{url}\", every: 50ms}}\n\
         batches:\n  reconcile_interval: 100ms\n",
        upstream.base_url
    );
    let (serve, client) = Serve::for_project(dir.path(), &config);
    let held = "nightshift_upstream_dispatch_held{upstream=\"mock\"}";
    common::cluster::eventually("the queue read", 30, || async {
        (serve.metric(held).await == Some(1.0)).then_some(())
    })
    .await;

    let id =
        client.create(&client.upload(input(&ids("l", 10), "mock-a")).await).await["id"].as_str().unwrap().to_owned();
    client.wait(&id, Duration::from_secs(30), |b| b["status"] == "in_progress").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(upstream.total_calls(), 0, "3 requests wait at the server: no line is sent");
    *waiting.lock().unwrap() = 0;
    let done = client.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(done["request_counts"]["completed"], 10, "{done}");
    for reason in ["invalid", "unreachable", "stale"] {
        let failures = format!("nightshift_load_signal_failures_total{{upstream=\"mock\",reason=\"{reason}\"}}");
        assert_eq!(serve.metric(&failures).await.unwrap_or(0.0), 0.0, "{reason}");
    }
    asked
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reading_asks_for_the_samples_it_reads_and_holds_on_that_answer() {
    let asked = held_then_released(true).await;
    let asked = asked.lock().unwrap();
    assert!(asked.named.len() >= 10, "every reading asks by name: {} readings", asked.named.len());
    assert_eq!(asked.whole, 0, "never the whole page");
    let expected: BTreeSet<String> = [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_sum",
        "vllm:time_per_output_token_seconds_count",
    ]
    .map(str::to_owned)
    .into();
    assert!(asked.named.iter().all(|names| *names == expected), "{:?}", asked.named[0]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_that_refuses_the_query_is_read_whole_from_then_on() {
    let asked = held_then_released(false).await;
    let asked = asked.lock().unwrap();
    assert_eq!(asked.named.len(), 1, "asked by name once, refused, and not again");
    assert!(asked.whole >= 10, "read whole: {} readings", asked.whole);
}
