//! A scriptable OpenAI-compatible upstream, served on 127.0.0.1 (or an address pods reach) by the test process:
//! `POST /v1/chat/completions` (and `/v1/embeddings`, `/v1/completions`, `/v1/responses`,
//! `/v1/moderations`, each answered in its shape) answers per line as the test scripted
//! it (status codes, delays, flaky attempts, Retry-After, hangs), and counts every call.
//!
//! A line is recognised by the content of its last message (or its `input` or `prompt`
//! string), which tests set to the line's custom_id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

#[derive(Clone, Debug)]
pub enum Answer {
    /// 200 with a chat completion (3 prompt tokens, 1 of them cached, + 2 completion
    /// tokens, 1 of them reasoning).
    Ok,
    /// Any status with this body.
    Status(u16, &'static str),
    /// 429 with `Retry-After: <seconds>`.
    RetryAfter(u64),
    /// Never answers (until the client gives up).
    Hang,
}

#[derive(Default)]
struct Script {
    /// Per line: the answers to its first, second, … attempt; the last one repeats.
    lines: HashMap<String, Vec<Answer>>,
    delay: Duration,
}

struct Shared {
    script: Mutex<Script>,
    /// While true, requests are not answered (those in flight and those that come).
    held: tokio::sync::watch::Sender<bool>,
    calls: Mutex<HashMap<String, u32>>,
    paths: Mutex<HashMap<String, u32>>,
    total: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            script: Mutex::default(),
            held: tokio::sync::watch::Sender::new(false),
            calls: Mutex::default(),
            paths: Mutex::default(),
            total: AtomicU64::default(),
            in_flight: AtomicU64::default(),
            max_in_flight: AtomicU64::default(),
        }
    }
}

pub struct MockUpstream {
    /// The base URL to configure, ending in `/v1`.
    pub base_url: String,
    shared: Arc<Shared>,
    _server: tokio::task::JoinHandle<()>,
}

impl MockUpstream {
    pub async fn start() -> Self {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST).await
    }

    /// On `host` (an address pods reach, for the real node).
    pub async fn start_on(host: std::net::Ipv4Addr) -> Self {
        Self::listen(tokio::net::TcpListener::bind((host, 0)).await.unwrap())
    }

    /// On a port of the loopback address claimed beforehand ([`super::ports::claim`]).
    pub async fn start_at(port: u16) -> Self {
        Self::listen(tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)).await.unwrap())
    }

    fn listen(listener: tokio::net::TcpListener) -> Self {
        let shared = Arc::new(Shared::default());
        let app = Router::new().route("/v1/{*path}", post(complete)).with_state(shared.clone());
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { base_url: format!("http://{address}/v1"), shared, _server: server }
    }

    /// Every answer waits this long first.
    pub fn delay(&self, delay: Duration) {
        self.shared.script.lock().unwrap().delay = delay;
    }

    /// Scripts the answers to a line's attempts, in order; the last one repeats.
    pub fn script(&self, line: &str, answers: Vec<Answer>) {
        self.shared.script.lock().unwrap().lines.insert(line.to_owned(), answers);
    }

    /// From now on, no request is answered (they stay in flight) until [`Self::release`].
    pub fn hold(&self) {
        self.shared.held.send_replace(true);
    }

    pub fn release(&self) {
        self.shared.held.send_replace(false);
    }

    pub fn calls(&self, line: &str) -> u32 {
        self.shared.calls.lock().unwrap().get(line).copied().unwrap_or(0)
    }

    /// Calls by path (`/v1/embeddings`).
    pub fn paths(&self) -> HashMap<String, u32> {
        self.shared.paths.lock().unwrap().clone()
    }

    pub fn all_calls(&self) -> HashMap<String, u32> {
        self.shared.calls.lock().unwrap().clone()
    }

    pub fn total_calls(&self) -> u64 {
        self.shared.total.load(Ordering::SeqCst)
    }

    /// Requests being answered right now.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    pub fn max_in_flight(&self) -> u64 {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }
}

struct InFlight<'a>(&'a Shared);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn complete(
    State(shared): State<Arc<Shared>>,
    Path(path): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let line = request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .or_else(|| request["input"].as_str())
        .or_else(|| request["prompt"].as_str())
        .unwrap_or("")
        .to_owned();
    *shared.paths.lock().unwrap().entry(format!("/v1/{path}")).or_default() += 1;
    let attempt = {
        let mut calls = shared.calls.lock().unwrap();
        let count = calls.entry(line.clone()).or_default();
        *count += 1;
        *count
    };
    let number = shared.total.fetch_add(1, Ordering::SeqCst) + 1;
    let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let _guard = InFlight(&shared);
    let (answer, delay) = {
        let script = shared.script.lock().unwrap();
        let answers = script.lines.get(&line);
        let answer = answers.map(|a| a[(attempt as usize - 1).min(a.len() - 1)].clone()).unwrap_or(Answer::Ok);
        (answer, script.delay)
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut held = shared.held.subscribe();
    let _ = held.wait_for(|held| !held).await;
    let _ = headers;
    match answer {
        Answer::Ok => {
            let model = &request["model"];
            let completion = match path.as_str() {
                "embeddings" => json!({
                    "object": "list", "model": model,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3},
                }),
                "completions" => json!({
                    "id": format!("cmpl-{number}"), "object": "text_completion", "created": 1_736_295_000, "model": model,
                    "choices": [{"text": format!("answer to {line}"), "index": 0, "logprobs": null, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                }),
                "responses" => json!({
                    "id": format!("resp_{number}"), "object": "response", "created_at": 1_736_295_000,
                    "status": "completed", "model": model,
                    "output": [{"type": "message", "role": "assistant",
                                "content": [{"type": "output_text", "text": format!("answer to {line}")}]}],
                    "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                              "input_tokens_details": {"cached_tokens": 1},
                              "output_tokens_details": {"reasoning_tokens": 1}},
                }),
                "moderations" => json!({
                    "id": format!("modr-{number}"), "model": model,
                    "results": [{"flagged": false, "categories": {}, "category_scores": {}}],
                }),
                _ => json!({
                    "id": format!("chatcmpl-{number}"),
                    "object": "chat.completion",
                    "created": 1_736_295_000,
                    "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answer to {line}")}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1},
                              "completion_tokens_details": {"reasoning_tokens": 1}},
                    "system_fingerprint": null,
                }),
            };
            (
                [("x-request-id", format!("req_up{number}")), ("content-type", "application/json".into())],
                completion.to_string(),
            )
                .into_response()
        }
        Answer::Status(status, body) => (StatusCode::from_u16(status).unwrap(), body).into_response(),
        Answer::RetryAfter(seconds) => {
            (StatusCode::TOO_MANY_REQUESTS, [("retry-after", seconds.to_string())], "slow down").into_response()
        }
        Answer::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            StatusCode::GATEWAY_TIMEOUT.into_response()
        }
    }
}
