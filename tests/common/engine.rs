//! llama.cpp's `llama-server`, a real model server (continuous batching over slots, a
//! queue, Prometheus metrics), as a child process of a test, over a random-weight model
//! that answers exactly `max_tokens` tokens (tests/tools/make-model.py).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{ports, tools};

pub struct LlamaServer {
    child: Child,
    /// `http://127.0.0.1:<port>`: its OpenAI API is under `/v1`, its metrics at `/metrics`.
    pub url: String,
    /// The name its answers give as `model` (the request's is ignored).
    pub alias: String,
}

impl LlamaServer {
    /// Serves the test model `model` (`tiny`, `small`) with `slots` sequences at once, on
    /// 127.0.0.1.
    pub async fn start(model: &str, slots: usize) -> Self {
        Self::start_on("127.0.0.1", model, slots).await
    }

    /// [`Self::start`] on the address `host` (one that pods reach, for a real node).
    // A start that times out panics the test, whose exit ends the child.
    #[allow(clippy::zombie_processes)]
    pub async fn start_on(host: &str, model: &str, slots: usize) -> Self {
        let port = ports::claim_one();
        let log = std::env::temp_dir().join(format!("llama-server-{port}.log"));
        let child = Command::new(tools::llama_server())
            .args(["-m", tools::engine_model(model).to_str().unwrap(), "--host", host])
            .args(["--port", &port.to_string(), "-np", &slots.to_string(), "-c", &(512 * slots).to_string()])
            // One thread: busy-waiting threads starve each other on a small machine; many HTTP
            // threads: its HTTP layer stalls when many connections arrive at once.
            .args(["-t", "1", "--threads-http", "64", "--metrics", "--no-webui", "-a", model])
            .env("OMP_WAIT_POLICY", "passive")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("llama-server starts");
        let server = Self { child, url: format!("http://{host}:{port}"), alias: model.to_owned() };
        // 503 while the model loads, 200 once it serves.
        let started = Instant::now();
        loop {
            if let Ok(answer) = reqwest::get(format!("{}/health", server.url)).await
                && answer.status() == 200
            {
                return server;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "llama-server did not come up: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
