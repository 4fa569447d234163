//! Batches run end to end in `nightshift serve` against the scriptable upstream:
//! error mapping, retries, cancel, expiry, quota, live counts, usage; kills, restarts and
//! a full disk in `crashes`.

mod crashes;

use crate::common;

use std::time::{Duration, Instant};

use common::client::{Client, ids, input};
use common::ports;
use common::serve::Serve;
use common::upstream::{Answer, MockUpstream};
use serde_json::Value;
use tempfile::TempDir;

const MINUTE: Duration = Duration::from_secs(60);

/// `serve` over `data`, with the mock upstream serving `mock-*` models. `project`
/// is YAML added to the project (a quota), `batches` to the batches settings.
fn serve_with(
    data: &TempDir,
    upstream: &MockUpstream,
    concurrency: usize,
    project: &str,
    batches: &str,
) -> (Serve, Client) {
    serve_at(data, &upstream.base_url, concurrency, project, batches)
}

/// [`serve_with`] an upstream at `base_url`, whether anything listens there or not.
fn serve_at(data: &TempDir, base_url: &str, concurrency: usize, project: &str, batches: &str) -> (Serve, Client) {
    Serve::for_project(
        data.path(),
        &format!(
            "{project}upstreams:\n  - name: mock\n    base_url: {base_url}\n    models: [\"mock-*\"]\n    max_concurrency: {concurrency}\n    \
             timeout: 1s\n    retry_base_delay: 20ms\nbatches:\n  shard_lines: 7\n  checkpoint_interval: 50ms\n  \
             reconcile_interval: 100ms\n  cancel_grace: 5s\n{batches}"
        ),
    )
}

/// A model server that refuses connections for a while (restarting, or a Service whose
/// new endpoint is not programmed yet) costs a batch nothing: a refused line never
/// reached it, so the lines wait for it instead of spending their attempts, and each is
/// sent once when it is back.
#[tokio::test]
async fn lines_wait_for_an_upstream_that_refuses_connections_and_none_fails() {
    let [port] = ports::claim::<1>();
    let data = TempDir::new().unwrap();
    let (serve, client) = serve_at(&data, &format!("http://127.0.0.1:{port}/v1"), 4, "", "");
    let custom_ids = ids("down", 12);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-model")).await).await;
    // Four attempts 20, 40 and 80 ms apart would be spent many times over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let upstream = MockUpstream::start_at(port).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["request_counts"], serde_json::json!({"total": 12, "completed": 12, "failed": 0}), "{batch}");
    for id in &custom_ids {
        assert_eq!(upstream.calls(id), 1, "{id} reached the upstream once");
    }
    // The wait shows in the refusals, not in the retries.
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    let counted = |name: &str| {
        metrics
            .lines()
            .filter(|line| line.starts_with(name))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    assert!(counted("nightshift_upstream_refusals_total{") >= 12, "every line was refused at least once:\n{metrics}");
    assert_eq!(counted("nightshift_upstream_retries_total{"), 0, "{metrics}");
}

#[tokio::test]
async fn every_upstream_failure_maps_to_the_specs_code_and_prefix() {
    let upstream = MockUpstream::start().await;
    let cases: Vec<(&str, Vec<Answer>, &str, &str, u32)> = vec![
        (
            "bad",
            vec![Answer::Status(
                400,
                r#"{"error":{"message":"messages: missing required field","type":"invalid_request_error","param":"messages"}}"#,
            )],
            "invalid_request_error",
            "[legacy:http_400] {\"message\":\"messages: missing required field\",\"type\":\"invalid_request_error\",\"param\":\"messages\"}",
            1,
        ),
        (
            "unprocessable",
            vec![Answer::Status(422, "bad schema")],
            "invalid_request_error",
            "[legacy:http_422] bad schema",
            1,
        ),
        ("unauthorized", vec![Answer::Status(401, "no key")], "authentication_error", "[legacy:http_401] no key", 1),
        ("forbidden", vec![Answer::Status(403, "revoked")], "authentication_error", "[legacy:http_403] revoked", 1),
        (
            "missing-model",
            vec![Answer::Status(404, "no such model")],
            "not_found_error",
            "[legacy:http_404] no such model",
            1,
        ),
        ("too-large", vec![Answer::Status(413, "too long")], "request_too_large", "[legacy:http_413] too long", 1),
        (
            "throttled",
            vec![Answer::Status(429, "slow down")],
            "rate_limit_exceeded",
            "[legacy:retries_exhausted] Line failed after 4 attempts: upstream returned 429: slow down",
            4,
        ),
        (
            "down",
            vec![Answer::Status(503, "upstream timeout")],
            "internal_error",
            "[legacy:retries_exhausted] Line failed after 4 attempts: upstream returned 503: upstream timeout",
            4,
        ),
        (
            "hanging",
            vec![Answer::Hang],
            "internal_error",
            "[legacy:retries_exhausted] Line failed after 4 attempts: upstream mock timed out after 1s",
            4,
        ),
        (
            "no-credit",
            vec![Answer::Status(429, r#"{"error":{"message":"no credit","type":"insufficient_quota"}}"#)],
            "insufficient_quota",
            "[legacy:http_429] {\"message\":\"no credit\",\"type\":\"insufficient_quota\"}",
            1,
        ),
    ];
    for (line, answers, ..) in &cases {
        upstream.script(line, answers.clone());
    }
    upstream.script("flaky", vec![Answer::Status(500, "oops"), Answer::Status(502, "oops"), Answer::Ok]);
    let data = TempDir::new().unwrap();
    let (_serve, client) = serve_with(&data, &upstream, 16, "", "");
    let mut custom_ids: Vec<String> = cases.iter().map(|(line, ..)| line.to_string()).collect();
    custom_ids.extend(["flaky".to_owned(), "fine".to_owned()]);
    let mut content = input(&custom_ids, "mock-model");
    // A model that no upstream serves.
    content.extend_from_slice(&input(&["unserved".to_owned()], "other-model"));
    custom_ids.push("unserved".to_owned());

    let batch = client.create(&client.upload(content).await).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["status"], "completed", "a batch with failed lines still completes: {batch}");
    let results = client.results(&batch, &custom_ids).await;
    for (line, _, code, message, calls) in &cases {
        let record = &results.errors[*line];
        assert_eq!(record["response"], Value::Null);
        assert_eq!(record["error"]["code"], *code, "{line}: {record}");
        assert_eq!(record["error"]["message"], *message, "{line}");
        assert!(record["id"].as_str().unwrap().starts_with("batch_req_"));
        assert_eq!(upstream.calls(line), *calls, "{line} was sent {} times", upstream.calls(line));
    }
    assert_eq!(results.errors["bad"]["error"]["param"], "messages");
    assert_eq!(results.errors["unserved"]["error"]["code"], "not_found_error");
    assert_eq!(upstream.calls("flaky"), 3, "two retries, then success");
    let ok = &results.output["flaky"];
    assert_eq!(ok["response"]["status_code"], 200);
    assert!(ok["response"]["request_id"].as_str().unwrap().starts_with("req_up"), "{ok}");
    assert_eq!(ok["response"]["body"]["choices"][0]["message"]["content"], "answer to flaky");
    assert_eq!(batch["usage"]["total_tokens"], 10, "two successful lines of 5 tokens");
    assert_eq!(batch["usage"]["input_tokens"], 6);
    let error_file = client.file(batch["error_file_id"].as_str().unwrap()).await;
    assert_eq!((error_file["purpose"].as_str(), error_file["is_error"].as_bool()), (Some("batch_output"), Some(true)));
    let output_file = client.file(batch["output_file_id"].as_str().unwrap()).await;
    assert_eq!(output_file["purpose"], "batch_output");
    assert!(output_file.get("is_error").is_none());
    for field in ["in_progress_at", "finalizing_at", "completed_at"] {
        assert!(batch[field].is_i64(), "{field}: {batch}");
    }
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let upstream = MockUpstream::start().await;
    upstream.script("patient", vec![Answer::RetryAfter(1), Answer::Ok]);
    let data = TempDir::new().unwrap();
    let (_serve, client) = serve_with(&data, &upstream, 4, "", "");
    let custom_ids = vec!["patient".to_owned()];
    let started = Instant::now();
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert!(started.elapsed() >= Duration::from_secs(1), "the retry waited for Retry-After");
    assert_eq!(upstream.calls("patient"), 2);
    assert_eq!(client.results(&batch, &custom_ids).await.output.len(), 1);
}

#[tokio::test]
async fn concurrency_per_upstream_is_bounded_and_counts_are_live() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(40));
    let data = TempDir::new().unwrap();
    let (serve, client) = serve_with(&data, &upstream, 3, "", "");
    let custom_ids = ids("line", 60);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    let midway = client
        .wait(&id, MINUTE, |b| {
            b["status"] == "in_progress" && b["request_counts"]["completed"].as_u64().unwrap_or(0) > 5
        })
        .await;
    assert!(midway["request_counts"]["completed"].as_u64().unwrap() < 60, "{midway}");
    let batch = client.wait_terminal(&id, MINUTE).await;
    client.results(&batch, &custom_ids).await;
    assert!(upstream.max_in_flight() <= 3, "{} requests were in flight at once", upstream.max_in_flight());
    assert_eq!(upstream.total_calls(), 60, "each line sent exactly once");

    // The metrics that docs/src/metrics.md documents, as Prometheus scrapes them.
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    let on_the_api = reqwest::get(format!("{}/metrics", client.url)).await.unwrap();
    assert_eq!(on_the_api.status(), 404, "metrics name every project: never on the API's address");
    let batches = client.wait(&id, MINUTE, |b| b["status"] == "completed").await;
    assert_eq!(batches["status"], "completed");
    for expected in [
        "nightshift_lines_total{outcome=\"completed\",code=\"\"} 60",
        "nightshift_upstream_request_duration_seconds_count{upstream=\"mock\"} 60",
        "nightshift_http_requests_total{method=\"POST\",route=\"/v1/batches\",status=\"200\"} 1",
        "nightshift_queue_depth",
        "nightshift_batches{status=\"in_progress\"}",
    ] {
        assert!(metrics.contains(expected), "{expected} missing from:\n{metrics}");
    }
}

#[tokio::test]
async fn cancel_stops_dispatch_and_records_undispatched_lines_as_batch_cancelled() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(100));
    let data = TempDir::new().unwrap();
    let (_serve, client) = serve_with(&data, &upstream, 2, "", "");
    let custom_ids = ids("c", 40);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    client.wait(&id, MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 4).await;
    let cancelling = client.cancel(&id).await;
    assert_eq!(cancelling["status"], "cancelling");
    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    assert!(batch["cancelled_at"].as_i64().unwrap() >= batch["cancelling_at"].as_i64().unwrap());
    let results = client.results(&batch, &custom_ids).await;
    assert!(results.output.len() >= 4);
    assert!(!results.errors.is_empty());
    assert!(results.errors.values().all(|r| r["error"]["code"] == "batch_cancelled"));
    assert_eq!(upstream.total_calls() as usize, results.output.len(), "cancelled lines were never sent");
    assert_eq!(client.cancel(&id).await["error"]["code"], "batch_not_cancellable", "terminal now: 409");
}

#[tokio::test]
async fn expiry_records_the_rest_as_batch_expired_and_keeps_finished_results() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(150));
    let data = TempDir::new().unwrap();
    // The window is an operator setting: two seconds here.
    let (_serve, client) = serve_with(&data, &upstream, 1, "", "  completion_window: 2s\n");

    let custom_ids = ids("e", 40);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    assert_eq!(batch["completion_window"], "24h", "the API still says 24h");
    assert_eq!(batch["expires_at"].as_i64().unwrap() - batch["created_at"].as_i64().unwrap(), 2);
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["status"], "expired", "{batch}");
    assert!(batch["expired_at"].is_i64());
    let results = client.results(&batch, &custom_ids).await;
    assert!(!results.output.is_empty(), "finished results are kept");
    assert!(results.errors.values().any(|r| r["error"]["code"] == "batch_expired"));
    assert!(results.errors.values().all(|r| r["error"]["code"] == "batch_expired"));
}

#[tokio::test]
async fn quota_is_enforced_per_line_then_at_create_and_survives_a_restart() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let (serve, client) = serve_with(&data, &upstream, 1, "    quota: {tokens: 12}\n", "");
    let custom_ids = ids("q", 6);
    let file = client.upload(input(&custom_ids, "mock-a")).await;
    let batch = client.create(&file).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["status"], "completed", "the batch still completes");
    let results = client.results(&batch, &custom_ids).await;
    // 5 tokens a line and a quota of 12: the third line finds none left.
    assert_eq!(results.output.len(), 3, "{batch}");
    for record in results.errors.values() {
        assert_eq!(record["error"]["code"], "insufficient_quota");
        assert!(record["error"]["message"].as_str().unwrap().starts_with("[legacy:http_420] "));
    }
    let (status, error) = client.try_create(&file).await;
    assert_eq!(status, 429);
    assert_eq!(error["error"]["type"], "insufficient_quota");
    assert_eq!(error["error"]["code"], "insufficient_quota");

    serve.kill();
    let (_serve, client) = serve_with(&data, &upstream, 1, "    quota: {tokens: 12}\n", "");
    let (status, _) = client.try_create(&file).await;
    assert_eq!(status, 429, "usage survives a restart");
}

#[tokio::test]
async fn an_output_file_is_refused_as_a_batch_input_with_a_purpose_error() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let (_serve, client) = serve_with(&data, &upstream, 4, "", "");
    let batch = client.create(&client.upload(input(&ids("o", 3), "mock-a")).await).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    let output = batch["output_file_id"].as_str().unwrap();
    let (status, error) = client.try_create(output).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["code"], "invalid_purpose", "{error}");
    assert_eq!(error["error"]["param"], "input_file_id");
    assert!(error["error"]["message"].as_str().unwrap().contains("purpose 'batch'"), "{error}");
}

/// The Batch object as the SDK types it: `model` from the input, and usage with its
/// details summed from the upstream's answers.
#[tokio::test]
async fn the_batch_carries_its_model_and_usage_details() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let (_serve, client) = serve_with(&data, &upstream, 4, "", "");
    let batch = client.create(&client.upload(input(&ids("u", 4), "mock-a")).await).await;
    assert_eq!(batch["model"], "mock-a");
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(
        batch["usage"],
        serde_json::json!({
            "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4},
            "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 4},
            "total_tokens": 20,
        })
    );
    // Lines naming different models: no single model to show.
    let mut mixed = input(&ids("x", 1), "mock-a");
    mixed.extend(input(&ids("y", 1), "mock-b"));
    assert_eq!(client.create(&client.upload(mixed).await).await["model"], Value::Null);
}

/// `batches.endpoints` enables more than chat completions: each line goes to the same
/// path on its upstream (or the echo model answers in that endpoint's shape), and usage
/// adds up from each endpoint's own usage shape.
#[tokio::test]
async fn enabled_endpoints_run_against_the_same_path_upstream_with_their_usage() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let endpoints =
        "  endpoints: [/v1/chat/completions, /v1/embeddings, /v1/completions, /v1/responses, /v1/moderations]\n";
    let (_serve, client) = serve_with(&data, &upstream, 4, "", endpoints);
    let line = |url: &str, id: &str, model: &str| {
        let body = match url {
            "/v1/embeddings" | "/v1/moderations" | "/v1/responses" => serde_json::json!({"model": model, "input": id}),
            _ => serde_json::json!({"model": model, "prompt": id}),
        };
        format!("{}\n", serde_json::json!({"custom_id": id, "method": "POST", "url": url, "body": body}))
    };
    // (endpoint, model, expected usage of 3 lines: input, output, total, cached, reasoning)
    for (url, model, usage) in [
        ("/v1/embeddings", "mock-e", [9, 0, 9, 0, 0]),
        ("/v1/completions", "mock-c", [9, 6, 15, 0, 0]),
        ("/v1/responses", "mock-r", [9, 6, 15, 3, 3]),
        ("/v1/moderations", "mock-m", [0, 0, 0, 0, 0]),
        ("/v1/embeddings", "echo", [6, 0, 6, 0, 0]),
    ] {
        let ids: Vec<String> = (0..3).map(|n| format!("{}-{model}-{n} word", &url[4..])).collect();
        let input: String = ids.iter().map(|id| line(url, id, model)).collect();
        let (status, batch) = client.try_create_for(&client.upload(input.into_bytes()).await, url).await;
        assert_eq!(status, 200, "{batch}");
        let batch = client.wait_terminal(batch["id"].as_str().unwrap(), MINUTE).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        assert_eq!(batch["request_counts"]["completed"], 3, "{url} {model}: {batch}");
        let got = &batch["usage"];
        let got = [
            &got["input_tokens"],
            &got["output_tokens"],
            &got["total_tokens"],
            &got["input_tokens_details"]["cached_tokens"],
            &got["output_tokens_details"]["reasoning_tokens"],
        ]
        .map(|v| v.as_u64().unwrap());
        assert_eq!(got, usage, "{url} {model}");
        let results = client.results(&batch, &ids).await;
        let body = &results.output[&ids[0]]["response"]["body"];
        let shape = match url {
            "/v1/embeddings" => body["data"][0]["embedding"].is_array(),
            "/v1/completions" => body["object"] == "text_completion",
            "/v1/responses" => body["object"] == "response",
            _ => body["results"].is_array(),
        };
        assert!(shape, "{url} {model}: {body}");
    }
    let paths = upstream.paths();
    for url in ["/v1/embeddings", "/v1/completions", "/v1/responses", "/v1/moderations"] {
        assert_eq!(paths.get(url), Some(&3), "{url}: {paths:?}");
    }
    assert_eq!(paths.get("/v1/chat/completions"), None);
}
