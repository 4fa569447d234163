//! `serve` as the family bench runs it (`benches/family.rs`): a build of it sending to a
//! member's server, fixed or untuned, with a batch created.

use super::members::Server;
use super::{BATCH_TOKENS, KEY, PROJECT, input, serve};

/// How the batch is run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Batch {
    Fixed(u32),
    /// What a user sets who tunes nothing: a high ceiling. The load signal is found
    /// beside the server's API (builds before 2026-11-30 read none unless told where).
    Untuned,
}

impl Batch {
    pub fn upstream(self) -> String {
        match self {
            Self::Fixed(n) => format!("    max_concurrency: {n}\n    adaptive: false\n"),
            Self::Untuned => "    max_concurrency: 1024\n".to_owned(),
        }
    }
}

pub struct Serve {
    process: serve::Process,
    url: String,
    _work: tempfile::TempDir,
}

impl Serve {
    /// `serve` (the binary `nightshift`) sending to `server` as `batch` says, with a batch
    /// of `lines` created.
    pub async fn start(nightshift: &str, server: &Server, batch: Batch, lines: usize) -> Self {
        let work = tempfile::TempDir::new().unwrap();
        let config = work.path().join("nightshift.yaml");
        let yaml = format!(
            "projects:\n  - id: {PROJECT}\n    api_keys: [{{plain: {KEY}}}]\nupstreams:\n  - name: server\n    base_url: {}\n{}batches:\n  reconcile_interval: 100ms\n",
            server.api(),
            batch.upstream()
        );
        std::fs::write(&config, yaml).unwrap();
        let log = std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".into());
        let (process, url) = serve::spawn_binary(nightshift, &config, &work.path().join("data"), &log);
        let serve = Self { process, url, _work: work };
        serve.submit(lines).await;
        serve
    }

    fn auth(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        request.header("x-project-id", PROJECT).header("x-api-key", KEY)
    }

    async fn submit(&self, lines: usize) {
        let client = reqwest::Client::new();
        let input = input::summaries(lines, "m", |_| BATCH_TOKENS);
        let file = input::upload(self.auth(client.post(format!("{}/v1/files", self.url))), input).await;
        let create =
            serde_json::json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
        let batch = self.auth(client.post(format!("{}/v1/batches", self.url))).json(&create).send().await.unwrap();
        assert!(batch.status().is_success(), "{}", batch.text().await.unwrap());
    }

    /// Batch lines that got their answer so far.
    pub async fn completed(&self) -> f64 {
        let url = self.process.metrics_url.as_deref().expect("serve says where its metrics are");
        let text = reqwest::get(url).await.unwrap().text().await.unwrap();
        let line = text.lines().find(|l| l.starts_with("nightshift_lines_total{outcome=\"completed\""));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0.0)
    }
}
