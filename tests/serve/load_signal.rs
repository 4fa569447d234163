//! The load signal on `nightshift serve`: batch dispatch held while the server's users
//! queue, a signal that stops answering, fails, lies or goes stale (held a while at most,
//! then counted and set aside), and its settings refused at start when out of range.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::PROJECT;
use common::client::{Client, ids, input};
use common::serve::Serve;
use common::upstream::MockUpstream;
use tempfile::TempDir;

/// A waiting count that makes [`signal`]'s endpoint stop answering.
const SILENT: u64 = u64::MAX;

/// A `/metrics` endpoint whose `vllm:num_requests_waiting` the test sets ([`SILENT`]:
/// it accepts requests and never answers them); `garbage` makes it answer something
/// else entirely.
async fn signal(waiting: Arc<AtomicU64>, garbage: bool) -> String {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let waiting = waiting.load(Ordering::Relaxed);
            async move {
                if waiting == SILENT {
                    std::future::pending::<()>().await;
                }
                if garbage {
                    "<html>metrics moved</html>".to_owned()
                } else {
                    format!("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n")
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// The gauge that says batch dispatch to the mock upstream is held.
const HELD: &str = "nightshift_upstream_dispatch_held{upstream=\"mock\"}";

/// A batch of 20 lines in progress at a mock upstream whose load signal says 3 requests
/// wait (`waiting` sets it), held at no line sent.
struct Held {
    upstream: MockUpstream,
    waiting: Arc<AtomicU64>,
    serve: Serve,
    client: Client,
    id: String,
    _dir: TempDir,
}

async fn held_at_a_queue() -> Held {
    let upstream = MockUpstream::start().await;
    let waiting = Arc::new(AtomicU64::new(3));
    let signal = signal(waiting.clone(), false).await;
    let dir = TempDir::new().unwrap();
    let config = format!(
        "upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    load_signal:\n      url: {signal}\n      every: 50ms\nbatches:\n  reconcile_interval: 100ms\n",
        upstream.base_url
    );
    let (serve, client) = Serve::for_project(dir.path(), &config);
    common::cluster::eventually("dispatch held", 30, || async {
        (serve.metric(HELD).await == Some(1.0)).then_some(())
    })
    .await;
    let batch = client.create(&client.upload(input(&ids("r", 20), "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    client.wait(&id, Duration::from_secs(30), |b| b["status"] == "in_progress").await;
    Held { upstream, waiting, serve, client, id, _dir: dir }
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_dispatch_holds_while_interactive_requests_queue_and_resumes_when_they_drain() {
    let Held { upstream, waiting, serve, client, id, _dir } = held_at_a_queue().await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(upstream.total_calls(), 0, "3 interactive requests wait at the server: no batch line is sent");
    waiting.store(0, Ordering::Relaxed);
    let batch = client.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(batch["request_counts"]["completed"], 20, "{batch}");
    assert_eq!(serve.metric(HELD).await, Some(0.0));
}

/// A signal that stops answering while users queue holds the batch a while: a server
/// too busy to answer its metrics in time is not an empty one. Then the batch goes on
/// without it, and the failures are counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_load_signal_that_stops_answering_while_users_queue_holds_the_batch_a_while() {
    let Held { upstream, waiting, serve, client, id, _dir } = held_at_a_queue().await;

    waiting.store(SILENT, Ordering::Relaxed);
    // A reading times out after 800 ms here: some three fail in 3 s, well within the
    // hold (`staleness::FAILED_HOLD`, 10 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failures = "nightshift_load_signal_failures_total{upstream=\"mock\",reason=\"unreachable\"}";
    assert!(serve.metric(failures).await.unwrap_or(0.0) >= 1.0, "readings failed meanwhile");
    assert_eq!(upstream.total_calls(), 0, "the queue last read holds the batch through the failures");
    assert_eq!(serve.metric(HELD).await, Some(1.0));
    let batch = client.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(
        batch["request_counts"]["completed"], 20,
        "past the hold, the batch goes on without the signal: {batch}"
    );
    assert_eq!(serve.metric(HELD).await, Some(0.0));
}

/// Load signals that fail, time out or answer garbage from the start cost nothing but a
/// warning metric: batches run on, governed by throughput alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_load_signal_that_fails_or_lies_never_stops_batches() {
    let upstream = MockUpstream::start().await;
    let garbage = signal(Arc::default(), true).await;
    let closed = format!("http://127.0.0.1:{}/metrics", common::ports::claim_one());
    // Accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}/metrics", silent.local_addr().unwrap());
    let dir = TempDir::new().unwrap();
    let upstreams: String = [("a", &garbage), ("b", &closed), ("c", &silent_url)]
        .iter()
        .map(|(name, url)| {
            format!(
                "  - name: {name}\n    base_url: {}\n    models: [\"mock-{name}\"]\n    load_signal: {{url: \"{url}\", every: 50ms}}\n",
                upstream.base_url
            )
        })
        .collect();
    let (serve, client) =
        Serve::for_project(dir.path(), &format!("upstreams:\n{upstreams}batches:\n  reconcile_interval: 100ms\n"));
    let mut lines = Vec::new();
    for model in ["mock-a", "mock-b", "mock-c"] {
        lines.extend(input(&ids(model, 10), model));
    }
    let batch = client.create(&client.upload(lines).await).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(batch["request_counts"]["completed"], 30, "{batch}");
    for (name, reason) in [("a", "invalid"), ("b", "unreachable"), ("c", "unreachable")] {
        // The silent one fails once its read times out (a second or so).
        let series = format!("nightshift_load_signal_failures_total{{upstream=\"{name}\",reason=\"{reason}\"}}");
        common::cluster::eventually(&format!("upstream {name}'s signal failures counted"), 30, || async {
            (serve.metric(&series).await.unwrap_or(0.0) >= 1.0).then_some(())
        })
        .await;
    }
    drop(silent);
}

/// Signals that go stale are set aside, counted as `stale`: one stuck on a queue that
/// never moves holds its batch a minute at most (it would hold it for ever), one that
/// answers the same page while lines finish stops counting as the server's word.
#[tokio::test(flavor = "multi_thread")]
async fn a_load_signal_gone_stale_is_set_aside_and_counted() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(100));
    let stuck_queue = signal(Arc::new(AtomicU64::new(5)), false).await;
    let same_page = signal(Arc::default(), false).await;
    let dir = TempDir::new().unwrap();
    let upstreams: String = [("held", &stuck_queue, 16), ("flowing", &same_page, 2)]
        .iter()
        .map(|(name, url, concurrency)| {
            format!(
                "  - name: {name}\n    base_url: {}\n    models: [\"mock-{name}\"]\n    max_concurrency: {concurrency}\n    \
                 adaptive: false\n    load_signal: {{url: \"{url}\"}}\n",
                upstream.base_url
            )
        })
        .collect();
    let (serve, client) =
        Serve::for_project(dir.path(), &format!("upstreams:\n{upstreams}batches:\n  reconcile_interval: 100ms\n"));
    let mut lines = input(&ids("mock-held", 10), "mock-held");
    // Two at a time, a tenth of a second each: 15 s of lines finishing.
    lines.extend(input(&ids("mock-flowing", 300), "mock-flowing"));
    let started = std::time::Instant::now();
    let batch = client.create(&client.upload(lines).await).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(150)).await;
    assert_eq!(batch["request_counts"]["completed"], 310, "{batch}");
    eprintln!("[night shift] a batch behind a stuck queue took {:?}", started.elapsed());
    for name in ["held", "flowing"] {
        let series = format!("nightshift_load_signal_failures_total{{upstream=\"{name}\",reason=\"stale\"}}");
        assert!(serve.metric(&series).await.unwrap_or(0.0) >= 1.0, "{name}'s signal was set aside as stale");
    }
}

#[test]
fn load_signal_thresholds_weights_and_scheduling_out_of_range_are_refused_at_start() {
    let upstream = |signal: &str| {
        format!(
            "storage: {{dir: /tmp/x}}\nupstreams:\n  - name: vllm\n    base_url: http://vllm:8000/v1\n    load_signal: {signal}\n"
        )
    };
    let cases = [
        (
            upstream("{url: http://vllm:8000/metrics, max_kv_cache_usage: 1.5}"),
            "max_kv_cache_usage must be more than 0 and at most 1",
        ),
        (
            upstream("{url: http://vllm:8000/metrics, max_kv_cache_usage: 0}"),
            "max_kv_cache_usage must be more than 0 and at most 1",
        ),
        (upstream("{url: http://vllm:8000/metrics, max_waiting: -2}"), "max_waiting must be 0 or more"),
        (upstream("{url: http://vllm:8000/metrics, every: 1ms}"), "every must be between 50ms and 10s"),
        (upstream("{url: \"vllm:8000\"}"), "not an http(s) URL"),
        (upstream("{url: http://vllm:8000/metrics, server: ollama}"), "unknown variant"),
        (upstream("{server: vllm}"), "missing field `url`"),
        (upstream("vllm"), "or false for none"),
        (upstream("3"), "or false for none"),
        (
            format!(
                "storage: {{dir: /tmp/x}}\nprojects:\n  - id: {PROJECT}\n    api_keys: [{{plain: k}}]\n    weight: 0\n"
            ),
            "weight must be between 1 and 1000",
        ),
        ("storage: {dir: /tmp/x}\nbatches: {scheduling: lifo}\n".to_owned(), "unknown variant"),
    ];
    for (yaml, message) in cases {
        let error = nightshift::config::Config::from_yaml(&yaml).unwrap_err().to_string();
        assert!(error.contains(message), "{yaml}\n→ {error}");
    }
}
