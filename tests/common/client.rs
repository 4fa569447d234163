//! A small client of a running `nightshift serve`, for tests that drive it over HTTP.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub struct Client {
    pub url: String,
    project: String,
    key: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(url: &str, project: &str, key: &str) -> Self {
        Self { url: url.to_owned(), project: project.to_owned(), key: key.to_owned(), http: reqwest::Client::new() }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.url))
            .header("x-project-id", &self.project)
            .header("x-api-key", &self.key)
    }

    pub async fn upload(&self, content: Vec<u8>) -> String {
        let (_, file) = self.try_upload(content).await;
        file["id"].as_str().unwrap_or_else(|| panic!("upload failed: {file}")).to_owned()
    }

    /// Uploads a batch input; returns the status code and the body.
    pub async fn try_upload(&self, content: Vec<u8>) -> (u16, Value) {
        let form = reqwest::multipart::Form::new()
            .text("purpose", "batch")
            .part("file", reqwest::multipart::Part::bytes(content).file_name("input.jsonl"));
        let response = self.request(reqwest::Method::POST, "/v1/files").multipart(form).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    /// GETs `path`; returns the status code and the body.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self.request(reqwest::Method::GET, path).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
    }

    /// Creates a batch; returns the status code and the body.
    pub async fn try_create(&self, file_id: &str) -> (u16, Value) {
        self.try_create_for(file_id, "/v1/chat/completions").await
    }

    /// Creates a batch for `endpoint`; returns the status code and the body.
    pub async fn try_create_for(&self, file_id: &str, endpoint: &str) -> (u16, Value) {
        let body = json!({"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"});
        let response = self.request(reqwest::Method::POST, "/v1/batches").json(&body).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    pub async fn create(&self, file_id: &str) -> Value {
        let (status, batch) = self.try_create(file_id).await;
        assert_eq!(status, 200, "{batch}");
        batch
    }

    pub async fn batch(&self, id: &str) -> Value {
        self.request(reqwest::Method::GET, &format!("/v1/batches/{id}")).send().await.unwrap().json().await.unwrap()
    }

    pub async fn cancel(&self, id: &str) -> Value {
        self.request(reqwest::Method::POST, &format!("/v1/batches/{id}/cancel"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn file(&self, id: &str) -> Value {
        self.request(reqwest::Method::GET, &format!("/v1/files/{id}")).send().await.unwrap().json().await.unwrap()
    }

    pub async fn content(&self, id: &str) -> String {
        self.request(reqwest::Method::GET, &format!("/v1/files/{id}/content"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Polls the batch until `done` holds, or panics after `timeout`.
    pub async fn wait(&self, id: &str, timeout: Duration, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let batch = self.batch(id).await;
            if done(&batch) {
                return batch;
            }
            assert!(Instant::now() < deadline, "batch did not get there in {timeout:?}: {batch}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_terminal(&self, id: &str, timeout: Duration) -> Value {
        self.wait(id, timeout, |b| {
            matches!(b["status"].as_str(), Some("completed" | "failed" | "expired" | "cancelled"))
        })
        .await
    }

    /// Downloads the batch's output and error files and checks the laws: every input
    /// line is in exactly one of them, once, and the counts agree. Returns the records
    /// by custom_id.
    pub async fn results(&self, batch: &Value, custom_ids: &[String]) -> Results {
        let mut output = HashMap::new();
        let mut errors = HashMap::new();
        for (field, into) in [("output_file_id", &mut output), ("error_file_id", &mut errors)] {
            if let Some(id) = batch[field].as_str() {
                for line in self.content(id).await.lines() {
                    let record: Value = serde_json::from_str(line).unwrap();
                    let custom_id = record["custom_id"].as_str().unwrap().to_owned();
                    assert!(into.insert(custom_id.clone(), record).is_none(), "{custom_id} appears twice in {field}");
                }
            }
        }
        for custom_id in custom_ids {
            let found = usize::from(output.contains_key(custom_id)) + usize::from(errors.contains_key(custom_id));
            assert_eq!(found, 1, "{custom_id} is in {found} of the two files");
        }
        assert_eq!(output.len() + errors.len(), custom_ids.len(), "no record for a line that was not in the input");
        let counts = &batch["request_counts"];
        assert_eq!(counts["completed"], output.len(), "{batch}");
        assert_eq!(counts["failed"], errors.len(), "{batch}");
        assert_eq!(counts["total"], custom_ids.len(), "{batch}");
        Results { output, errors }
    }
}

pub struct Results {
    pub output: HashMap<String, Value>,
    pub errors: HashMap<String, Value>,
}

/// A JSONL input whose lines ask `model` and carry their custom_id as the content.
pub fn input(custom_ids: &[String], model: &str) -> Vec<u8> {
    custom_ids
        .iter()
        .map(|id| {
            let line = json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
                              "body": {"model": model, "messages": [{"role": "user", "content": id}]}});
            format!("{line}\n")
        })
        .collect::<String>()
        .into_bytes()
}

pub fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}
