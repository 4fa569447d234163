//! Line throughput of `nightshift serve` against a plain client (`just bench`).
//! Each side runs three times and the best run of each is compared.
//!
//! Knobs for investigating: `NIGHTSHIFT_BINARY` (another build, to compare), `BENCH_SERVE_LOG` (serve's RUST_LOG), `BENCH_SERVE_THREADS`
//! (its tokio worker threads), `BENCH_BATCHES` (YAML lines for `batches:`, `;`-separated),
//! `BENCH_PAUSE_SECS` (time to attach `perf record -p` to serve).
//!
//! With an instant upstream (this same binary, run as `throughput upstream`, in a
//! process of its own so its CPU is measured apart), 50,000 chat-completion
//! requests are sent twice at the same concurrency:
//!   1. by a plain client (reqwest, bounded concurrency): the baseline;
//!   2. as a batch through `nightshift serve` (release build), from create to completed.
//!
//! Reported: lines/s of both and their ratio, serve's CPU time per 1,000 lines and peak
//! RSS, and the upstream's CPU use, to show it was not the bottleneck.

#[allow(dead_code)]
#[path = "common/input.rs"]
mod input;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use futures_util::StreamExt;

const LINES: usize = 50_000;
const CONCURRENCY: usize = 64;
/// Each side runs this many times; the best run counts (the machine is shared and noisy).
const RUNS: usize = 3;
const PROJECT: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
const KEY: &str = "bench-key";

const COMPLETION: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1736295000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14},"system_fingerprint":null}"#;

fn body(n: usize) -> String {
    format!(r#"{{"model":"bench","messages":[{{"role":"user","content":"What is the capital of France? ({n})"}}]}}"#)
}

/// CPU seconds (user + system) and peak RSS in MB of a process.
fn usage(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: f64 = hwm.split_whitespace().nth(1).unwrap().parse().unwrap();
    (ticks / 100.0, kb / 1024.0)
}

fn upstream_main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    runtime.block_on(async {
        let app = Router::new().route(
            "/v1/chat/completions",
            post(|| async { ([("content-type", "application/json"), ("x-request-id", "req_bench")], COMPLETION) }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        axum::serve(listener, app).await.unwrap();
    });
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn first_line_with(child: &mut Child, marker: &str) -> String {
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = lines.next().expect("process ended early").unwrap();
        if line.contains(marker) {
            std::thread::spawn(move || for _ in lines {});
            return line;
        }
    }
}

async fn baseline(client: &reqwest::Client, url: &str) -> Duration {
    let started = Instant::now();
    let url = Arc::new(url.to_owned());
    futures_util::stream::iter(0..LINES)
        .map(|n| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let response = client
                    .post(url.as_str())
                    .header("content-type", "application/json")
                    .body(body(n))
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_success());
                response.bytes().await.unwrap();
            }
        })
        .buffer_unordered(CONCURRENCY)
        .for_each(|()| async {})
        .await;
    started.elapsed()
}

/// `--metrics-listen` for binaries that have it (older ones served /metrics on the API).
fn own_metrics_address(nightshift: &str) -> &'static [&'static str] {
    let help = Command::new(nightshift).args(["serve", "--help"]).output().unwrap();
    match String::from_utf8_lossy(&help.stdout).contains("--metrics-listen") {
        true => &["--metrics-listen", "127.0.0.1:0"],
        false => &[],
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("upstream") {
        return upstream_main();
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let nightshift = std::env::var("NIGHTSHIFT_BINARY").unwrap_or_else(|_| format!("{root}/target/release/nightshift"));
    assert!(std::path::Path::new(&nightshift).exists(), "build the release binary first: cargo build --release");
    let work = tempfile::TempDir::new().unwrap();

    let mut upstream =
        Command::new(std::env::current_exe().unwrap()).arg("upstream").stdout(Stdio::piped()).spawn().unwrap();
    let address = first_line_with(&mut upstream, "127.0.0.1");
    let upstream = Process(upstream);
    let upstream_url = format!("http://{address}/v1");

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::new();
        let chat = format!("{upstream_url}/chat/completions");
        // Warm up connections, then measure.
        let _ = baseline(&client, &chat).await;
        let (upstream_cpu_before, _) = usage(upstream.0.id());
        let mut plain_runs = Vec::new();
        for _ in 0..RUNS {
            plain_runs.push(baseline(&client, &chat).await);
        }
        let (upstream_cpu_after, _) = usage(upstream.0.id());
        let plain = *plain_runs.iter().min().unwrap();
        let plain_rate = LINES as f64 / plain.as_secs_f64();
        let upstream_cpu_per_k = (upstream_cpu_after - upstream_cpu_before) / (RUNS as f64 * LINES as f64 / 1000.0);

        let config = work.path().join("nightshift.yaml");
        std::fs::write(
            &config,
            format!(
                "projects:\n  - id: {PROJECT}\n    api_keys: [{{plain: {KEY}}}]\nupstreams:\n  - name: bench\n    \
                 base_url: {upstream_url}\n    max_concurrency: {CONCURRENCY}\n    adaptive: false\nbatches:\n  reconcile_interval: 100ms\n{}",
                std::env::var("BENCH_BATCHES").unwrap_or_default().replace(';', "\n")
            ),
        )
        .unwrap();
        let mut serve = Command::new(&nightshift)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(own_metrics_address(&nightshift))
            .args(["--config", config.to_str().unwrap(), "--data-dir"])
            .arg(work.path().join("data"))
            .env("RUST_LOG", std::env::var("BENCH_SERVE_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(std::env::var("BENCH_SERVE_THREADS").map(|n| ("TOKIO_WORKER_THREADS", n)))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let listening = first_line_with(&mut serve, "listening on");
        let serve = Process(serve);
        if let Ok(pause) = std::env::var("BENCH_PAUSE_SECS") {
            // Time to attach a profiler: `perf record -g -p <pid>`.
            eprintln!("serve pid {}", serve.0.id());
            tokio::time::sleep(Duration::from_secs(pause.parse().unwrap())).await;
        }
        let url = listening.rsplit(' ').next().unwrap().to_owned();

        let input: String = (0..LINES)
            .map(|n| format!("{{\"custom_id\":\"r{n}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}}\n", body(n)))
            .collect();
        let auth = |request: reqwest::RequestBuilder| request.header("x-project-id", PROJECT).header("x-api-key", KEY);
        let file = input::upload(auth(client.post(format!("{url}/v1/files"))), input).await;
        let mut runs = Vec::new();
        let (serve_cpu_before, _) = usage(serve.0.id());
        let (upstream_cpu_before, _) = usage(upstream.0.id());
        for _ in 0..RUNS {
            let started = Instant::now();
            let batch: serde_json::Value = auth(client.post(format!("{url}/v1/batches")))
                .json(&serde_json::json!({"input_file_id": file, "endpoint": "/v1/chat/completions"}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let id = batch["id"].as_str().expect("batch created").to_owned();
            let create_latency = started.elapsed();
            let batch = loop {
                let batch: serde_json::Value =
                    auth(client.get(format!("{url}/v1/batches/{id}"))).send().await.unwrap().json().await.unwrap();
                if batch["status"] != "in_progress" && batch["status"] != "finalizing" {
                    break batch;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            runs.push((started.elapsed(), create_latency));
            assert_eq!(batch["status"], "completed", "{batch}");
            assert_eq!(batch["request_counts"]["completed"], LINES, "{batch}");
        }
        let serve_elapsed: Duration = runs.iter().map(|(elapsed, _)| *elapsed).sum();
        let (serve_cpu_after, serve_rss) = usage(serve.0.id());
        let (upstream_cpu_during, _) = usage(upstream.0.id());
        let (elapsed, create_latency) = *runs.iter().min().unwrap();
        let serve_rate = LINES as f64 / elapsed.as_secs_f64();
        let list = |runs: &mut dyn Iterator<Item = Duration>| runs.map(|d| format!("{:.2}", d.as_secs_f64())).collect::<Vec<_>>().join(", ");

        println!("throughput: {LINES} lines at concurrency {CONCURRENCY}, instant upstream");
        println!(
            "  plain client:       {:.2} s, {plain_rate:.0} lines/s (best of {RUNS}: {})",
            plain.as_secs_f64(),
            list(&mut plain_runs.iter().copied())
        );
        println!(
            "  nightshift serve:   {:.2} s, {serve_rate:.0} lines/s (best of {RUNS}: {}; create to completed, files written)",
            elapsed.as_secs_f64(),
            list(&mut runs.iter().map(|(d, _)| *d))
        );
        println!("  ratio:              {:.1}% of the plain client", 100.0 * serve_rate / plain_rate);
        println!("  create (validate):  {:.0} ms of that", create_latency.as_secs_f64() * 1000.0);
        println!(
            "  serve CPU:          {:.3} CPU-s per 1,000 lines; peak RSS {serve_rss:.1} MB",
            (serve_cpu_after - serve_cpu_before) / (RUNS as f64 * LINES as f64 / 1000.0)
        );
        println!(
            "  upstream CPU:       {upstream_cpu_per_k:.3} CPU-s per 1,000 requests; busy {:.0}% of one core during the serve run",
            100.0 * (upstream_cpu_during - upstream_cpu_before) / serve_elapsed.as_secs_f64()
        );
    });
}
