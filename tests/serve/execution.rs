//! Batches run end to end in `nightshift serve` against the scriptable upstream:
//! error mapping, retries, cancel, expiry, quota, live counts, and a SIGKILL.

use crate::common;

use std::time::{Duration, Instant};

use common::client::{Client, ids, input};
use common::serve::Serve;
use common::upstream::{Answer, MockUpstream};
use common::{KEY, PROJECT, ports, write_config};
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
    let config = write_config(
        data.path(),
        &format!(
            "{project}upstreams:\n  - name: mock\n    base_url: {base_url}\n    models: [\"mock-*\"]\n    max_concurrency: {concurrency}\n    \
             timeout: 1s\n    retry_base_delay: 20ms\nbatches:\n  shard_lines: 7\n  checkpoint_interval: 50ms\n  \
             reconcile_interval: 100ms\n  cancel_grace: 5s\n{batches}"
        ),
    );
    let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
    let client = Client::new(&serve.url, PROJECT, KEY);
    (serve, client)
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
async fn serve_killed_mid_batch_resumes_with_no_duplicate_and_no_lost_line() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(15));
    let data = TempDir::new().unwrap();
    let (serve, client) = serve_with(&data, &upstream, 4, "", "");
    let custom_ids = ids("k", 300);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    client.wait(&id, MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 60).await;
    serve.kill();
    common::committed::settle(&upstream).await;
    let store = nightshift::storage::DirStore::open(data.path().join("data")).await.unwrap();
    let committed = common::committed::committed_custom_ids(&store, &[]).await;
    let sent_at_kill = upstream.all_calls();
    assert!(sent_at_kill.len() < 300, "the kill came mid-batch");

    let (_serve, client) = serve_with(&data, &upstream, 4, "", "");
    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 300);
    // Nothing committed at the kill was sent again; only what was sent and not committed.
    let resent = common::committed::check_kill_laws(&sent_at_kill, &committed, &upstream.all_calls());
    eprintln!("{} committed at the kill, {} sent again", committed.len(), resent.len());
    // batch_req_ ids are stable: derived, not drawn.
    let ids: std::collections::HashSet<_> =
        results.output.values().map(|r| r["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ids.len(), 300);
}

/// The law of a crash at many random points in one batch: a line is sent again only if
/// it was in flight at the kill, since a finished line's permit goes to the next line
/// only once its record is durable. Odd kills come while the upstream holds every
/// answer and all the permits are at it (nothing waits for a commit then): exactly the
/// lines in flight are sent again. Even kills come at any instant: at most a permit's
/// worth of lines, and the upstream's count at the kill is reported beside it.
#[tokio::test(flavor = "multi_thread")]
async fn kills_at_random_points_resend_only_the_lines_in_flight() {
    const CONCURRENCY: u64 = 4;
    const KILLS: usize = 24;
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(20));
    let data = TempDir::new().unwrap();
    let store = nightshift::storage::DirStore::open(data.path().join("data")).await.unwrap();
    // A timeout no busy machine reaches: every call after the first is a re-send. One
    // shard: the permits all reach the upstream whenever four lines are left.
    let config = write_config(
        data.path(),
        &format!(
            "upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: {CONCURRENCY}\n    \
             timeout: 5m\nbatches:\n  shard_lines: 1500\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let start = || {
        let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
        let client = Client::new(&serve.url, PROJECT, KEY);
        (serve, client)
    };
    let (mut serve, mut client) = start();
    let custom_ids = ids("r", 1500);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut random = |below: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % below
    };
    struct Kill {
        held: bool,
        in_flight: u64,
        sent: std::collections::HashMap<String, u32>,
        committed: std::collections::HashSet<String>,
    }
    let mut kills = Vec::new();
    for round in 0..KILLS {
        let target = upstream.total_calls() + 3 + random(40);
        let deadline = Instant::now() + MINUTE;
        while upstream.total_calls() < target {
            assert!(Instant::now() < deadline, "round {round}: the batch made no progress");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The laws are about what was committed before a kill: the first kill waits for a
        // first commit, which a draw of 3 calls could come before.
        while round == 0 && common::committed::committed_custom_ids(&store, &[]).await.is_empty() {
            assert!(Instant::now() < deadline, "the batch committed nothing");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let held = round % 2 == 1;
        if held {
            upstream.hold();
            while upstream.in_flight() < CONCURRENCY {
                assert!(Instant::now() < deadline, "round {round}: the permits never all reached the upstream");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let (in_flight, total) = (upstream.in_flight(), upstream.total_calls());
        serve.kill();
        upstream.release();
        common::committed::settle(&upstream).await;
        // Requests that reached the upstream after the count had been sent before the kill.
        let in_flight = in_flight + (upstream.total_calls() - total);
        let committed = common::committed::committed_custom_ids(&store, &[]).await;
        kills.push(Kill { held, in_flight, sent: upstream.all_calls(), committed });
        (serve, client) = start();
    }
    let batch = client.wait_terminal(&id, 2 * MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 1500, "every line once");

    let end = upstream.all_calls();
    let (mut report, mut worst) = (Vec::new(), i64::MIN);
    for (k, kill) in kills.iter().enumerate() {
        let after = kills.get(k + 1).map_or(&end, |next| &next.sent);
        // Nothing committed at the kill is sent again, then or after a later kill.
        common::committed::check_kill_laws(&kill.sent, &kill.committed, after);
        for id in &kill.committed {
            assert_eq!(end.get(id), kill.sent.get(id), "{id} was committed at kill {k} and sent again later");
        }
        // Sent again after kill k: sent before it and again before the next one.
        let resent =
            kill.sent.iter().filter(|(id, calls)| after.get(*id).copied().unwrap_or(0) > **calls).count() as u64;
        assert!(resent <= CONCURRENCY, "kill {k}: {resent} lines sent again, more than the {CONCURRENCY} permits");
        if kill.held {
            assert_eq!(resent, kill.in_flight, "kill {k} (held): exactly the lines in flight are sent again");
        }
        worst = worst.max(resent as i64 - kill.in_flight as i64);
        report.push(format!("{}{resent}/{}", if kill.held { "h" } else { "" }, kill.in_flight));
    }
    eprintln!(
        "sent again / in flight at each kill (h: held): {}; worst excess over in flight: {worst}",
        report.join(" ")
    );
}

/// Two runs on one shard at once (as a pod the Job controller gave up on and its
/// replacement): a worker started by hand on serve's storage claims shard 0; serve's
/// run learns it at its next commit and stops, serve claims the shard back at its next
/// pass, and the hand-run worker learns it the same way and exits with an error. What
/// the shard's owner counts records each line exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn of_two_runs_on_one_shard_the_superseded_one_stops_and_its_later_commits_never_count() {
    // Shared S3, as two pods have (a data directory is locked by the process using it).
    let s3 = common::TestS3::start();
    let storage = s3.storage_yaml(&s3.endpoint, "");
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(150));
    let data = TempDir::new().unwrap();
    let serve_config = write_config(
        data.path(),
        &format!(
            "{storage}upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 2\n    \
             timeout: 5s\nbatches:\n  shard_lines: 40\n  checkpoint_interval: 50ms\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let serve = Serve::start_configured(&serve_config);
    let client = Client::new(&serve.url, PROJECT, KEY);
    let custom_ids = ids("f", 40);
    let lines = input(&custom_ids, "mock-a");
    let file = client.upload(lines.clone()).await;
    let batch = client.create(&file).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    while upstream.total_calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // One shard of 40 lines: a run of it takes seconds, where taking it over takes a
    // commit and a pass (a fraction of one).
    let shard_end = lines.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(39).unwrap().0 + 1;
    let config = data.path().join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "{storage}upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 2\n    \
             timeout: 5s\nbatches:\n  checkpoint_interval: 50ms\n",
            upstream.base_url
        ),
    )
    .unwrap();
    let worker = std::process::Command::new(env!("CARGO_BIN_EXE_nightshift"))
        .args(["worker", "--config", config.to_str().unwrap(), "--batch-id", &id, "--project-id", PROJECT])
        .args(["--input-file-id", &file, "--expires-at", &batch["expires_at"].to_string(), "--shard-index", "0"])
        .args(["--first-request", "0", "--requests", "40", "--byte-start", "0", "--byte-end", &shard_end.to_string()])
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let worker = tokio::task::spawn_blocking(move || worker.wait_with_output().unwrap());
    let worker = tokio::time::timeout(MINUTE, worker).await.expect("the superseded worker stops").unwrap();
    let stderr = String::from_utf8_lossy(&worker.stderr);
    assert!(!worker.status.success(), "a superseded run fails, so its Job does not complete: {stderr}");
    assert!(stderr.contains("a newer run claimed shard 0"), "{stderr}");

    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 40);
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("nightshift_superseded_runs_total 1"), "serve's run of shard 0 was superseded once");

    let store = s3.store();
    let batch_id = nightshift::ids::BatchId::parse(&id).unwrap();
    let claims =
        nightshift::storage::ObjectStore::list(store.as_ref(), &nightshift::exec::layout::claims_prefix(&batch_id, 0))
            .await
            .unwrap();
    assert!(claims.len() >= 3, "serve, the worker, serve again: {claims:?}");
    common::committed::assert_counted_once(store.as_ref(), &batch_id, 0, 40).await;
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

/// A serve killed during an upload leaves a temp file: the next start removes it. And
/// one data directory has one serve: a second is refused instead of sharing it.
#[tokio::test]
async fn a_restart_removes_a_killed_uploads_temp_file_and_a_second_serve_is_refused() {
    let data = TempDir::new().unwrap();
    let dir = data.path().join("data");
    let serve = Serve::start(&dir, &[]);
    let orphan = dir.join(".tmp").join("01KILLEDUPLOAD");
    std::fs::write(&orphan, vec![0u8; 64 * 1024]).unwrap();

    let second = std::process::Command::new(env!("CARGO_BIN_EXE_nightshift"))
        .args(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("in use by another nightshift process"), "{stderr}");
    assert!(orphan.exists(), "the refused serve touched nothing");

    serve.kill();
    let _serve = Serve::start(&dir, &[]);
    assert!(!orphan.exists(), "the restart removed what the killed upload left");
}

/// A tmpfs mounted over a directory for one test (the suite runs as root), unmounted
/// when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("mount runs");
        assert!(status.success(), "mounting a tmpfs needs root, as the rest of the suite does");
        Self(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system of `dir` but for about `leave` bytes, with `dir/filler`.
fn fill_disk(dir: &std::path::Path, leave: usize) {
    use std::io::Write;
    let reserve = dir.join("reserve");
    std::fs::write(&reserve, vec![1u8; leave]).unwrap();
    let mut filler = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![1u8; 64 * 1024];
    while filler.write_all(&block).is_ok() {}
    let _ = filler.sync_all();
    std::fs::remove_file(reserve).unwrap();
}

/// A full disk while the output files are written: the batch stays `finalizing` with
/// the cause in `errors` (a `storage_error`), finalize is retried, and once space is free
/// the batch completes with every line and no error left on it.
#[tokio::test]
async fn a_full_disk_at_finalize_is_said_on_the_batch_and_retried_until_it_completes() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let disk = Tmpfs::mount(&data.path().join("data"), "24m");
    let (_serve, client) = serve_with(&data, &upstream, 8, "", "");
    let mut custom_ids = ids("d", 3_000);
    // The last line hangs three times (a 1 s timeout each, within its 4 attempts), so the
    // disk is filled (tens of milliseconds) while it runs: a 3 s window.
    let last = "d-last".to_owned();
    upstream.script(&last, vec![Answer::Hang, Answer::Hang, Answer::Hang, Answer::Ok]);
    custom_ids.push(last);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    // 429 shards of 7 lines: about a minute on a loaded machine, so three are allowed.
    client.wait(&id, 3 * MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 3_000).await;
    fill_disk(&disk.0, 256 * 1024);

    let stuck = client.wait(&id, MINUTE, |b| b["errors"].is_object()).await;
    assert_eq!(stuck["status"], "finalizing", "{stuck}");
    let error = &stuck["errors"]["data"][0];
    assert_eq!(error["code"], "storage_error", "{stuck}");
    assert!(error["message"].as_str().unwrap().contains("No space left on device"), "{stuck}");
    assert_eq!(stuck["output_file_id"], Value::Null);
    // Still retried, still stuck, while the disk is full.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client.batch(&id).await["status"], "finalizing");

    std::fs::remove_file(disk.0.join("filler")).unwrap();
    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(batch["errors"], Value::Null, "the note went with the failure: {batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 3_001);
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
