//! Webhooks from `nightshift serve`: OpenAI's batch events, signed, delivered at least once
//! across restarts with a stable `webhook-id`, never to internal addresses unless allowed,
//! and never in a batch's way. (The SDK's own verification: tests/e2e/webhooks_sdk.py.)

use crate::common;

use std::time::Duration;

use common::client::{Client, ids, input};
use common::receiver::Receiver;
use common::serve::Serve;
use common::{KEY, PROJECT};
use nightshift::webhooks::{SigningSecret, sign};
use tempfile::TempDir;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A configuration whose project sends its events to `urls`.
fn config(dir: &TempDir, urls: &[&str], extra: &str) -> std::path::PathBuf {
    let hooks: String = urls.iter().map(|url| format!("      - {{url: \"{url}\", secret: {SECRET}}}\n")).collect();
    common::write_config(
        dir.path(),
        &format!("    webhooks:\n{hooks}webhooks:\n  allowed_hosts: [127.0.0.1]\n  timeout: 2s\n{extra}"),
    )
}

fn start(dir: &TempDir, config: &std::path::Path) -> (Serve, Client) {
    let serve = Serve::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let client = Client::new(&serve.url, PROJECT, KEY);
    (serve, client)
}

async fn run_batch(client: &Client, lines: usize) -> String {
    let file = client.upload(input(&ids("w", lines), "echo")).await;
    let batch = client.create(&file).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    let done = client.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(done["status"], "completed", "{done}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_is_signed_and_retried_with_the_same_id_across_a_restart() {
    let receiver = Receiver::start().await;
    receiver.refuse(1);
    let dir = TempDir::new().unwrap();
    let config = config(&dir, &[&receiver.url], "");
    let (serve, client) = start(&dir, &config);
    let batch = run_batch(&client, 3).await;
    let first = receiver.wait_for(1, 30).await.remove(0);
    // Refused; then the process dies before the next attempt.
    serve.kill();
    let (_serve, _client) = start(&dir, &config);
    let deliveries = receiver.wait_for(2, 30).await;
    let second = &deliveries[1];
    assert_eq!(second.id, first.id, "the same webhook-id on every attempt");
    assert!(second.id.starts_with("evt_"), "{}", second.id);
    let event = second.json();
    assert_eq!(event["type"], "batch.completed", "{event}");
    assert_eq!((event["object"].as_str(), event["data"]["id"].as_str()), (Some("event"), Some(batch.as_str())));
    assert_eq!(event["id"], second.id.as_str());
    let timestamp: i64 = second.timestamp.parse().unwrap();
    assert!((nightshift::clock::now() - timestamp).abs() < 60, "signed when sent, not when created");
    let secret = SigningSecret::parse(SECRET).unwrap();
    assert_eq!(second.signature, sign::signature(&secret, &second.id, timestamp, &second.body));
    // Delivered: the outbox empties, and nothing more comes.
    let outbox = dir.path().join("data/webhooks/events");
    for _ in 0..50 {
        if std::fs::read_dir(&outbox).map_or(0, |entries| entries.count()) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(std::fs::read_dir(&outbox).unwrap().count(), 0, "the delivered event left the outbox");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(receiver.received().len(), 2);
}

/// A value of serve's `/metrics` (at `url`, its own address).
async fn metric(url: &str, series: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    text.lines().find_map(|line| line.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_internal_endpoints_never_hold_batches_up() {
    let receiver = Receiver::start().await;
    let closed = format!("http://127.0.0.1:{}/hook", common::ports::claim_one());
    let dir = TempDir::new().unwrap();
    // One endpoint that accepts, one whose port is closed, one on an internal address
    // that is not allowed (link-local: a cloud's metadata service).
    let config = config(&dir, &[&receiver.url, &closed, "http://169.254.169.254/latest"], "");
    let (serve, client) = start(&dir, &config);
    let started = std::time::Instant::now();
    let mut batches = Vec::new();
    for _ in 0..3 {
        batches.push(run_batch(&client, 5).await);
    }
    assert!(started.elapsed() < Duration::from_secs(30), "batches ran at their pace: {:?}", started.elapsed());
    let received = receiver.wait_for(3, 30).await;
    let mut delivered: Vec<String> =
        received.iter().map(|d| d.json()["data"]["id"].as_str().unwrap().to_owned()).collect();
    delivered.sort();
    batches.sort();
    assert_eq!(delivered, batches, "the live endpoint got every event, once");
    for _ in 0..50 {
        if metric(&serve.metrics_url, "nightshift_webhook_deliveries_total{outcome=\"refused\"}").await >= 3.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(metric(&serve.metrics_url, "nightshift_webhook_deliveries_total{outcome=\"refused\"}").await >= 3.0);
    assert!(metric(&serve.metrics_url, "nightshift_webhook_deliveries_total{outcome=\"failed\"}").await >= 3.0);
    assert_eq!(metric(&serve.metrics_url, "nightshift_webhook_deliveries_total{outcome=\"delivered\"}").await, 3.0);
    assert_eq!(metric(&serve.metrics_url, "nightshift_webhook_events_pending").await, 3.0, "kept for the other two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_the_guard_refuses_is_counted_as_refused_only() {
    let dir = TempDir::new().unwrap();
    // IPv4 loopback carried in a NAT64 address: internal, and not in allowed_hosts.
    let config = config(&dir, &["http://[64:ff9b::127.0.0.1]/hook"], "");
    let (serve, client) = start(&dir, &config);
    run_batch(&client, 2).await;
    run_batch(&client, 2).await;
    let refused = "nightshift_webhook_deliveries_total{outcome=\"refused\"}";
    for _ in 0..50 {
        if metric(&serve.metrics_url, refused).await >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&serve.metrics_url, refused).await, 2.0, "one refused attempt per event so far");
    let failed = metric(&serve.metrics_url, "nightshift_webhook_deliveries_total{outcome=\"failed\"}").await;
    assert_eq!(failed, 0.0, "a refused attempt is not also a failed one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_cancelled_batches_send_their_events() {
    let receiver = Receiver::start().await;
    let upstream = common::upstream::MockUpstream::start().await;
    upstream.delay(Duration::from_millis(500));
    let dir = TempDir::new().unwrap();
    let extra = format!(
        "upstreams:\n  - name: slow\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 1\n\
         batches:\n  reconcile_interval: 100ms\n  cancel_grace: 1s\n",
        upstream.base_url
    );
    let config = config(&dir, &[&receiver.url], &extra);
    let (_serve, client) = start(&dir, &config);

    // A create refused by validation answers 400, and the batch it recorded is failed.
    let bad = client.upload(b"{\"custom_id\": 1}\n".to_vec()).await;
    let (status, _) = client.try_create(&bad).await;
    assert_eq!(status, 400);
    let (_, listed) = client.get("/v1/batches").await;
    let refused = listed["data"][0].clone();
    assert_eq!(refused["status"], "failed", "{refused}");
    let slow = client.upload(input(&ids("slow", 20), "mock-1")).await;
    let running = client.create(&slow).await;
    let running = running["id"].as_str().unwrap();
    client.cancel(running).await;
    let cancelled = client.wait_terminal(running, Duration::from_secs(60)).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");

    let received = receiver.wait_for(2, 30).await;
    let events: Vec<(String, String)> = received
        .iter()
        .map(|d| (d.json()["type"].as_str().unwrap().to_owned(), d.json()["data"]["id"].as_str().unwrap().to_owned()))
        .collect();
    assert!(events.contains(&("batch.failed".into(), refused["id"].as_str().unwrap().into())), "{events:?}");
    assert!(events.contains(&("batch.cancelled".into(), running.into())), "{events:?}");
}

#[test]
fn bad_webhook_configurations_are_refused_at_start() {
    let project = |webhook: &str| {
        format!(
            "storage: {{dir: /tmp/x}}\nprojects:\n  - id: {PROJECT}\n    api_keys: [{{plain: k}}]\n    webhooks: [{webhook}]\n"
        )
    };
    let cases = [
        ("{url: \"ftp://example.com/hook\", secret: whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw}", "http or https"),
        ("{url: \"not a url\", secret: whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw}", "is not a URL"),
        ("{url: \"https://example.com/\", secret: plain-secret}", "whsec_"),
        ("{url: \"https://example.com/\", secret: whsec_c2hvcnQ=}", "whsec_"),
    ];
    for (webhook, expected) in cases {
        let error = nightshift::config::Config::from_yaml(&project(webhook)).unwrap_err().to_string();
        assert!(error.contains(expected), "{webhook}: {error}");
    }
    let error = nightshift::config::Config::from_yaml("storage: {dir: /tmp/x}\nwebhooks: {timeout: 0s}\n").unwrap_err();
    assert!(error.to_string().contains("webhooks.timeout"), "{error}");
}
