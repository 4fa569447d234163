//! Rate limits of `nightshift serve`: a project's requests a minute (its own limit, or the
//! installation's), and failed authentications a minute per client address: past them,
//! 429 `rate_limit_exceeded` with `retry-after`, as OpenAI answers.

use crate::common;

use common::process::{Process, spawn};
use tempfile::TempDir;

const LIMITED: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
const OTHER: &str = "0b7e8a52-4a1c-4d5e-9a53-6f0c7d8e9f10";

fn serve(dir: &TempDir) -> (Process, String) {
    let config = dir.path().join("nightshift.yaml");
    std::fs::write(
        &config,
        format!(
            "projects:\n\
             \x20 - {{id: {LIMITED}, api_keys: [{{plain: key-a}}], rate_limit: {{requests_per_minute: 5}}}}\n\
             \x20 - {{id: {OTHER}, api_keys: [{{plain: key-b}}]}}\n\
             http: {{requests_per_minute: 1000, failed_auth_per_minute: 3}}\n"
        ),
    )
    .unwrap();
    let data = dir.path().join("data").display().to_string();
    let args = [
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--data-dir",
        &data,
    ];
    let (process, line) = spawn(&args, &[], "listening on", &dir.path().join("serve.log"));
    (process, line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned())
}

async fn list(url: &str, project: &str, key: &str) -> reqwest::Response {
    let client = reqwest::Client::new();
    client.get(format!("{url}/v1/files")).header("x-project-id", project).header("x-api-key", key).send().await.unwrap()
}

async fn assert_throttled(response: reqwest::Response) {
    assert_eq!(response.status(), 429);
    let wait: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "retry-after {wait}");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
}

#[tokio::test]
async fn a_project_past_its_requests_a_minute_gets_429_and_others_do_not() {
    let dir = TempDir::new().unwrap();
    let (_serve, url) = serve(&dir);
    for n in 0..5 {
        assert_eq!(list(&url, LIMITED, "key-a").await.status(), 200, "request {n}");
    }
    assert_throttled(list(&url, LIMITED, "key-a").await).await;
    for _ in 0..20 {
        assert_eq!(list(&url, OTHER, "key-b").await.status(), 200, "another project is not throttled");
    }
}

#[tokio::test]
async fn wrong_keys_are_throttled_by_client_address() {
    let dir = TempDir::new().unwrap();
    let (_serve, url) = serve(&dir);
    for _ in 0..3 {
        let status = list(&url, OTHER, "guess").await.status();
        assert!(status == 401 || status == 403, "{status}");
    }
    // The fourth guess is refused without being checked, even a right one is not let
    // through by guessing: the client waits.
    assert_throttled(list(&url, OTHER, "guess-4").await).await;
    assert_eq!(list(&url, OTHER, "key-b").await.status(), 200, "a right key still works");
}
