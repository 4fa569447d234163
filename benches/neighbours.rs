//! Noisy neighbours (`just bench`): one project with 100,000 files, another with one, in
//! one `nightshift serve` (release build).
//!
//! Reported, as median and 99th percentile of sequential requests:
//!   1. the big project's own listings (`limit=1`, `limit=100`, and a page deep in the
//!      list through `after`), newest first and oldest first;
//!   2. the small project's listing and retrieve, first with the big project idle, then
//!      while 8 connections of the big project list its files as fast as they are
//!      answered: once at the big project's default rate limit, once with its rate limit
//!      raised out of the way (the worst case, not the default).
//!
//! The files are written through the file catalog itself before serve starts (uploading
//! 100,000 files over HTTP would measure uploads). Knobs: `BENCH_FILES` (default 100000),
//! `BENCH_SAMPLES` (requests per measurement, default 400).

#[path = "common/serve.rs"]
mod serve;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use nightshift::files::{FileCatalog, NewFile, Purpose};
use nightshift::ids::ProjectId;
use nightshift::storage::{DirStore, ObjectStore};

const BIG: &str = "0f0e0d0c-0b0a-4909-8807-060504030201";
const SMALL: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
/// Each project's API key (a key belongs to one project).
fn key(project: &str) -> &'static str {
    if project == BIG { "big-bench-key" } else { "small-bench-key" }
}
const NOISY_CONNECTIONS: usize = 8;

struct Percentiles {
    median: Duration,
    p99: Duration,
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "median {:>7.2} ms, p99 {:>7.2} ms", ms(self.median), ms(self.p99))
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn percentiles(mut samples: Vec<Duration>) -> Percentiles {
    samples.sort();
    Percentiles { median: samples[samples.len() / 2], p99: samples[samples.len() * 99 / 100] }
}

async fn seed(data: &std::path::Path, project: &str, files: usize) -> Vec<String> {
    let store: Arc<dyn ObjectStore> = Arc::new(DirStore::open(data).await.unwrap());
    let catalog = FileCatalog::new(store, Duration::from_secs(30 * 86_400));
    let project = ProjectId::parse(project).unwrap();
    let line =
        Bytes::from_static(b"{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n");
    futures_util::stream::iter(0..files)
        .map(|n| {
            let (catalog, project, line) = (catalog.clone(), project.clone(), line.clone());
            async move {
                let mut upload = catalog.start_upload(&project).await.unwrap();
                upload.write(line).await.unwrap();
                let file = NewFile {
                    filename: Some(format!("f{n}.jsonl")),
                    purpose: Purpose::Batch,
                    is_error: false,
                    expires_after: None,
                };
                upload.commit(file).await.unwrap().id.to_string()
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

/// Requests per measurement (`BENCH_SAMPLES`, default 400).
fn samples() -> usize {
    std::env::var("BENCH_SAMPLES").ok().map_or(400, |n| n.parse().unwrap())
}

async fn sample(client: &reqwest::Client, url: &str, project: &str) -> Percentiles {
    let mut samples = Vec::with_capacity(self::samples());
    for _ in 0..self::samples() {
        let started = Instant::now();
        let response =
            client.get(url).header("x-project-id", project).header("x-api-key", key(project)).send().await.unwrap();
        assert!(response.status().is_success(), "{url}: {}", response.status());
        response.bytes().await.unwrap();
        samples.push(started.elapsed());
    }
    percentiles(samples)
}

/// Starts serve over `data`; the big project's rate limit is `big_limit` a minute, else
/// the default. Returns its URL once its first garbage collection is done.
fn start_serve(work: &std::path::Path, data: &std::path::Path, big_limit: Option<u32>) -> (String, serve::Process) {
    let config = work.join("nightshift.yaml");
    let limit = big_limit.map(|n| format!("    rate_limit: {{requests_per_minute: {n}}}\n")).unwrap_or_default();
    std::fs::write(
        &config,
        format!(
            "projects:\n  - id: {BIG}\n    api_keys: [{{plain: {}}}]\n{limit}  \
             - id: {SMALL}\n    api_keys: [{{plain: {}}}]\n",
            key(BIG),
            key(SMALL)
        ),
    )
    .unwrap();
    let (process, url) = serve::spawn(&config, data, "warn");
    // The garbage collector's first sweep runs at start; let it finish.
    std::thread::sleep(Duration::from_secs(5));
    (url, process)
}

/// The big project listing on [`NOISY_CONNECTIONS`] connections, as fast as answered.
struct Noise {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Noise {
    fn start(url: &str, big: &[String]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (answered, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let tasks = (0..NOISY_CONNECTIONS)
            .map(|n| {
                let (client, stop) = (reqwest::Client::new(), stop.clone());
                let (answered, refused) = (answered.clone(), refused.clone());
                let list = format!("{url}/v1/files?limit=100&after={}", big[n * big.len() / NOISY_CONNECTIONS]);
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let response = client.get(&list).header("x-project-id", BIG).header("x-api-key", key(BIG));
                        let response = response.send().await.unwrap();
                        let counter = if response.status() == 429 { &refused } else { &answered };
                        response.bytes().await.unwrap();
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Self { stop, answered, refused, tasks }
    }

    fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
    }
}

fn main() {
    let files: usize = std::env::var("BENCH_FILES").ok().map_or(100_000, |n| n.parse().unwrap());
    let nightshift = format!("{}/target/release/nightshift", env!("CARGO_MANIFEST_DIR"));
    assert!(std::path::Path::new(&nightshift).exists(), "build the release binary first: cargo build --release");
    let work = tempfile::TempDir::new().unwrap();
    let data = work.path().join("data");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let started = Instant::now();
        let mut big = seed(&data, BIG, files).await;
        let small = seed(&data, SMALL, 1).await;
        big.sort();
        eprintln!("seeded {files} files in {:.0} s", started.elapsed().as_secs_f64());

        let client = reqwest::Client::new();
        for (i, limit) in [None, Some(100_000_000)].into_iter().enumerate() {
            let (url, serve) = start_serve(work.path(), &data, limit);
            if i == 0 {
                let deep = &big[files / 2];
                println!("big project, {files} files:");
                for (what, query) in [
                    ("list limit=1", "limit=1".to_owned()),
                    ("list limit=100", "limit=100".to_owned()),
                    ("list limit=100 after mid", format!("limit=100&after={deep}")),
                    ("list limit=1 oldest first", "limit=1&order=asc".to_owned()),
                    ("list limit=100 after mid oldest first", format!("limit=100&order=asc&after={deep}")),
                ] {
                    println!("  {what:<40} {}", sample(&client, &format!("{url}/v1/files?{query}"), BIG).await);
                }
            }
            let small_list = format!("{url}/v1/files?limit=20");
            let small_get = format!("{url}/v1/files/{}", small[0]);
            println!("small project, 1 file, big project idle:");
            println!("  {:<40} {}", "list", sample(&client, &small_list, SMALL).await);
            println!("  {:<40} {}", "retrieve", sample(&client, &small_get, SMALL).await);
            let how = match limit {
                None => "at its rate limit (the default, 6,000 requests a minute)",
                Some(_) => "with no rate limit",
            };
            println!("small project, while the big one lists on {NOISY_CONNECTIONS} connections {how}:");
            let noise = Noise::start(&url, &big);
            tokio::time::sleep(Duration::from_millis(500)).await;
            // At the limit: once the big project's burst is spent and it is refused.
            let deadline = Instant::now() + Duration::from_secs(60);
            while limit.is_none() && noise.refused() == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let (started, answered_before, refused_before) = (Instant::now(), noise.answered(), noise.refused());
            println!("  {:<40} {}", "list", sample(&client, &small_list, SMALL).await);
            println!("  {:<40} {}", "retrieve", sample(&client, &small_get, SMALL).await);
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "  (the big project meanwhile: {:.0} listings a second answered, {:.0} refused with 429)",
                (noise.answered() - answered_before) as f64 / seconds,
                (noise.refused() - refused_before) as f64 / seconds
            );
            noise.stop().await;
            drop(serve);
        }
    });
}
