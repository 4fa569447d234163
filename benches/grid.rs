//! Does a batch keep every permit busy, at every latency and concurrency? (`just bench`)
//!
//! An upstream that answers each request after a fixed latency, whatever the load (the
//! model's name says how long: `c64-lat300` waits 300 ms; this binary, run as `grid
//! upstream`, in a process of its own), and a grid of latency (0, 50 ms, 300 ms, 2 s) x
//! `max_concurrency` (16, 64, 256, 1,024):
//!   1. a plain client (reqwest, `buffer_unordered` at the concurrency, connections warmed);
//!   2. a batch through `nightshift serve` with `adaptive: false` at the same concurrency
//!      and every other setting at its default, timed from create to completed.
//!
//! Each point sends enough lines for a steady state: `BENCH_ROUNDS` (10) round trips at
//! the concurrency or 5 s of them, whichever is more, at least 1,000 lines below a second
//! of latency, at most a batch's 50,000 (50,000 at no latency). Reported per point: both rates, their
//! ratio, and the median of the requests in flight at the upstream while the middle 80% of
//! the lines finished, against the limit.
//!
//! Then the short-batch case: batches of 1,000, 3,000 and 12,000 lines at the 300 ms
//! upstream, untuned (`adaptive`, ceiling 256) against fixed 256, whole runs: a fresh
//! process's first batch (at once, and after the process sat idle 5 s), its next one,
//! and the first after a restart.
//!
//! Knobs: `NIGHTSHIFT_BINARY` (another build, to compare), `BENCH_ROUNDS`, `BENCH_ONLY` (a substring of a point's name, e.g. `lat300`),
//! `BENCH_SHORT=0` (skip the short-batch case), `BENCH_GRID=0` (skip the grid), `BENCH_LOG`
//! (`serve`'s `RUST_LOG`, default `warn`), `BENCH_TRACE=1` (the upstream prints each point's
//! requests in flight over time, to stderr).

#[allow(dead_code)]
#[path = "common/input.rs"]
mod input;
#[path = "common/serve.rs"]
mod serve;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Json;
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};

const PROJECT: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
const KEY: &str = "bench-key";
const LATENCIES_MS: [u64; 4] = [0, 50, 300, 2000];
const CONCURRENCIES: [u32; 4] = [16, 64, 256, 1024];

const COMPLETION: &str = r#"{"id":"chatcmpl-grid","object":"chat.completion","created":1736295000,"model":"grid","choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14},"system_fingerprint":null}"#;

/// The upstream's counters: requests in flight and finished, and samples of both.
#[derive(Default)]
struct Load {
    in_flight: AtomicU64,
    finished: AtomicU64,
    /// (finished, in flight) every 5 ms while anything is in flight.
    samples: Mutex<Vec<(u64, u64)>>,
}

fn upstream_main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    runtime.block_on(async {
        let load = Arc::new(Load::default());
        let sampler = load.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(5));
            loop {
                every.tick().await;
                let in_flight = sampler.in_flight.load(Ordering::Relaxed);
                if in_flight > 0 {
                    let finished = sampler.finished.load(Ordering::Relaxed);
                    sampler.samples.lock().unwrap().push((finished, in_flight));
                }
            }
        });
        let answering = load.clone();
        let app = Router::new()
            .route(
                "/v1/chat/completions",
                post(move |Json(body): Json<Value>| {
                    let load = answering.clone();
                    async move {
                        let model = body["model"].as_str().unwrap_or_default();
                        let ms: u64 = model.rsplit("lat").next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
                        load.in_flight.fetch_add(1, Ordering::Relaxed);
                        if ms > 0 {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        load.in_flight.fetch_sub(1, Ordering::Relaxed);
                        load.finished.fetch_add(1, Ordering::Relaxed);
                        ([("content-type", "application/json")], COMPLETION)
                    }
                }),
            )
            // The median in flight while the middle 80% of what finished since the last
            // call finished; then starts over.
            .route(
                "/stats",
                get(move || {
                    let load = load.clone();
                    async move {
                        let samples = std::mem::take(&mut *load.samples.lock().unwrap());
                        if std::env::var_os("BENCH_TRACE").is_some() {
                            let every_50ms = samples.iter().step_by(10).map(|(done, now)| format!("{done}:{now}"));
                            eprintln!(
                                "in flight (finished:in flight, every 50 ms): {}",
                                every_50ms.collect::<Vec<_>>().join(" ")
                            );
                        }
                        let first = samples.first().map_or(0, |s| s.0);
                        let last = load.finished.load(Ordering::Relaxed);
                        let span = last.saturating_sub(first) as f64;
                        let (low, high) = (first + (0.1 * span) as u64, first + (0.9 * span) as u64);
                        let mut middle: Vec<u64> =
                            samples.iter().filter(|s| (low..=high).contains(&s.0)).map(|s| s.1).collect();
                        middle.sort_unstable();
                        let median = middle.get(middle.len() / 2).copied().unwrap_or(0);
                        Json(json!({"median_in_flight": median}))
                    }
                }),
            );
        // A backlog for a batch's first round at 1,024: its connections open at once, and
        // at tokio's default (1,024) some 80 of them overflowed the accept queue here (on
        // one thread, with serve on the other core) and came a SYN retry, a second, later.
        // A model server's is larger (uvicorn's 2,048); the plain client's are warmed.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(4096).unwrap();
        println!("{}", listener.local_addr().unwrap());
        axum::serve(listener, app).await.unwrap();
    });
}

fn body(model: &str, n: usize) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": format!("line {n}")}]})
}

/// Sends `lines` requests for `model` at `concurrency` from a plain client.
async fn plain(client: &reqwest::Client, url: &str, model: &str, lines: usize, concurrency: u32) -> Duration {
    let started = Instant::now();
    futures_util::stream::iter(0..lines)
        .map(|n| {
            let request = client.post(format!("{url}/v1/chat/completions")).json(&body(model, n));
            async move {
                let response = request.send().await.unwrap();
                assert!(response.status().is_success());
                response.bytes().await.unwrap();
            }
        })
        .buffer_unordered(concurrency as usize)
        .for_each(|()| async {})
        .await;
    started.elapsed()
}

struct Serve {
    url: String,
    client: reqwest::Client,
    _process: serve::Process,
    _work: tempfile::TempDir,
}

impl Serve {
    /// `serve` with an upstream `c<N>` (models `c<N>-*`) at each concurrency, `adaptive`
    /// as given, every other setting at its default.
    fn start(upstream: &str, adaptive: bool) -> Self {
        let work = tempfile::TempDir::new().unwrap();
        let upstreams: String = CONCURRENCIES
            .iter()
            .map(|c| {
                format!(
                    "  - name: c{c}\n    base_url: {upstream}/v1\n    models: [\"c{c}-*\"]\n    max_concurrency: {c}\n    adaptive: {adaptive}\n"
                )
            })
            .collect();
        let config = work.path().join("nightshift.yaml");
        std::fs::write(
            &config,
            format!("projects:\n  - id: {PROJECT}\n    api_keys: [{{plain: {KEY}}}]\nupstreams:\n{upstreams}"),
        )
        .unwrap();
        let (process, url) = serve::spawn(&config, &work.path().join("data"), &log());
        Self { url, client: reqwest::Client::new(), _process: process, _work: work }
    }

    /// The same installation started again, its storage kept: a restarted process.
    fn restarted(self) -> Self {
        let Self { client, _process: process, _work: work, .. } = self;
        drop(process);
        let (process, url) = serve::spawn(&work.path().join("nightshift.yaml"), &work.path().join("data"), &log());
        Self { url, client, _process: process, _work: work }
    }

    fn auth(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        request.header("x-project-id", PROJECT).header("x-api-key", KEY)
    }

    /// Runs a batch of `lines` lines for `model`, from create to completed.
    async fn batch(&self, model: &str, lines: usize) -> Duration {
        let input: String = (0..lines)
            .map(|n| {
                format!(
                    "{}\n",
                    json!({"custom_id": format!("r{n}"), "method": "POST", "url": "/v1/chat/completions", "body": body(model, n)})
                )
            })
            .collect();
        let file = input::upload(self.auth(self.client.post(format!("{}/v1/files", self.url))), input).await;
        let started = Instant::now();
        let create = json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
        let batch = answer(self.auth(self.client.post(format!("{}/v1/batches", self.url))).json(&create)).await;
        let id = batch["id"].as_str().unwrap_or_else(|| panic!("the batch was not created: {batch}")).to_owned();
        loop {
            let batch = answer(self.auth(self.client.get(format!("{}/v1/batches/{id}", self.url)))).await;
            if !matches!(batch["status"].as_str(), Some("validating" | "in_progress" | "finalizing")) {
                assert_eq!(batch["status"], "completed", "{batch}");
                assert_eq!(batch["request_counts"]["completed"], lines, "{batch}");
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `serve`'s `RUST_LOG`: `BENCH_LOG`, or warnings only.
fn log() -> String {
    std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".into())
}

/// The JSON answer to `request`.
async fn answer(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

async fn median_in_flight(client: &reqwest::Client, upstream: &str) -> u64 {
    let stats = answer(client.get(format!("{upstream}/stats"))).await;
    stats["median_in_flight"].as_u64().unwrap()
}

/// The most lines a batch may hold (the spec's limit).
const MAX_LINES: usize = nightshift::validate::MAX_LINES as usize;
/// Round trips a point lasts at the least, in seconds of latency, so that a batch's
/// fixed cost (create, its first round trip, finalize: some 40 ms) is a few percent of
/// it: 10 round trips at 50 ms are 0.5 s, of which that cost is nearly a tenth.
const STEADY_SECS: u64 = 5;

/// Lines for a point: `rounds` round trips at the concurrency, at least [`STEADY_SECS`]
/// of round trips, 1,000 lines below a second of latency, and no more than a batch holds
/// (with no latency, a batch's worth).
fn lines_for(latency_ms: u64, concurrency: u32, rounds: usize) -> usize {
    let concurrency = concurrency as usize;
    let steady = match latency_ms {
        0 => MAX_LINES,
        ms => concurrency * rounds.max((STEADY_SECS * 1000).div_ceil(ms) as usize),
    };
    // At 2 s a round trip, 1,000 lines at 16 would take two minutes.
    let least = if latency_ms < 1000 { 1_000 } else { 0 };
    steady.max(least).min(MAX_LINES)
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("upstream") {
        return upstream_main();
    }
    let nightshift = std::env::var("NIGHTSHIFT_BINARY")
        .unwrap_or_else(|_| format!("{}/target/release/nightshift", env!("CARGO_MANIFEST_DIR")));
    assert!(std::path::Path::new(&nightshift).exists(), "build the release binary first: cargo build --release");
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(10);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let enabled = |knob: &str| std::env::var(knob).map_or(true, |v| v != "0");
    let mut child: Child =
        Command::new(std::env::current_exe().unwrap()).arg("upstream").stdout(Stdio::piped()).spawn().unwrap();
    let address = BufReader::new(child.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    let upstream = format!("http://{address}");
    let _upstream = serve::Process::from(child);

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::new();
        if enabled("BENCH_GRID") {
            let serve = Serve::start(&upstream, false);
            println!("grid: adaptive: false, defaults otherwise; plain client vs serve (create to completed)");
            println!(
                "{:>8} {:>6} {:>7} {:>10} {:>10} {:>6} {:>13}",
                "latency", "limit", "lines", "plain/s", "serve/s", "ratio", "in flight"
            );
            for latency in LATENCIES_MS {
                for concurrency in CONCURRENCIES {
                    let model = format!("c{concurrency}-lat{latency}");
                    if !model.contains(&only) {
                        continue;
                    }
                    let lines = lines_for(latency, concurrency, rounds);
                    plain(&client, &upstream, &model, concurrency as usize, concurrency).await; // warm connections
                    median_in_flight(&client, &upstream).await;
                    let plain_time = plain(&client, &upstream, &model, lines, concurrency).await;
                    let plain_in_flight = median_in_flight(&client, &upstream).await;
                    let serve_time = serve.batch(&model, lines).await;
                    let serve_in_flight = median_in_flight(&client, &upstream).await;
                    let (plain_rate, serve_rate) =
                        (lines as f64 / plain_time.as_secs_f64(), lines as f64 / serve_time.as_secs_f64());
                    println!(
                        "{:>6}ms {concurrency:>6} {lines:>7} {plain_rate:>10.0} {serve_rate:>10.0} {:>6.3} {:>6}/{plain_in_flight:<6}",
                        latency,
                        serve_rate / plain_rate,
                        serve_in_flight,
                    );
                }
            }
            println!("  (in flight: the median at the upstream while the middle 80% of lines finished, serve/plain)");
        }
        if enabled("BENCH_SHORT") && "c256-lat300".contains(&only) {
            println!("short batches at 300 ms, ceiling 256: untuned (adaptive) against fixed 256, create to completed");
            let fixed = Serve::start(&upstream, false);
            for lines in [1_000, 3_000, 12_000] {
                // A fresh installation: the limit starts from the start, as on a first batch;
                // then the same process's next batch, from the limit the first one found;
                // then the first batch of the process started again, from the limit kept.
                let serve = Serve::start(&upstream, true);
                let first = serve.batch("c256-lat300", lines).await;
                let next = serve.batch("c256-lat300", lines).await;
                let serve = serve.restarted();
                let restarted = serve.batch("c256-lat300", lines).await;
                // A fresh installation whose first batch comes once it has sat idle a while,
                // as a server started before anyone sends it work does.
                let idle = Serve::start(&upstream, true);
                tokio::time::sleep(Duration::from_secs(5)).await;
                let after_idle = idle.batch("c256-lat300", lines).await;
                drop(idle);
                let best = fixed.batch("c256-lat300", lines).await;
                let [first, next, restarted, after_idle, best] =
                    [first, next, restarted, after_idle, best].map(|time| time.as_secs_f64());
                println!(
                    "  {lines:>6} lines: untuned {first:>6.2} s ({:.2}x), idle 5 s first {after_idle:>6.2} s ({:.2}x), its next batch {next:>6.2} s ({:.2}x), after a restart {restarted:>6.2} s ({:.2}x); fixed 256 {best:>6.2} s",
                    first / best,
                    after_idle / best,
                    next / best,
                    restarted / best,
                );
            }
        }
    });
}
