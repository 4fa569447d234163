//! Noisy neighbours (`just bench`): one project with 100,000 files, another with one, in
//! one `nightshift serve` (release build).
//!
//! Reported, as median and 99th percentile of sequential requests:
//!   1. the big project's own listings (`limit=1`, `limit=100`, and a page deep in the
//!      list through `after`), newest first and oldest first;
//!   2. the small project's listing and retrieve, first with the big project idle, then
//!      while 8 connections of the big project list its files as fast as they can
//!      (its rate limit raised out of the way: the worst case, not the default).
//!
//! The files are written through the file catalog itself before serve starts (uploading
//! 100,000 files over HTTP would measure uploads). Knob: `BENCH_FILES` (default 100000).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
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
const KEY: &str = "bench-key";
const SAMPLES: usize = 400;
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
                let file = NewFile { filename: Some(format!("f{n}.jsonl")), purpose: Purpose::Batch, is_error: false };
                upload.commit(file).await.unwrap().id.to_string()
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

async fn sample(client: &reqwest::Client, url: &str, project: &str) -> Percentiles {
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let response = client.get(url).header("x-project-id", project).header("x-api-key", KEY).send().await.unwrap();
        assert!(response.status().is_success(), "{url}: {}", response.status());
        response.bytes().await.unwrap();
        samples.push(started.elapsed());
    }
    percentiles(samples)
}

fn main() {
    let files: usize = std::env::var("BENCH_FILES").ok().map_or(100_000, |n| n.parse().unwrap());
    let root = env!("CARGO_MANIFEST_DIR");
    let nightshift = format!("{root}/target/release/nightshift");
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

        let config = work.path().join("nightshift.yaml");
        std::fs::write(
            &config,
            format!(
                "projects:\n  - id: {BIG}\n    api_keys: [{{plain: {KEY}}}]\n    rate_limit: {{requests_per_minute: 100000000}}\n  \
                 - id: {SMALL}\n    api_keys: [{{plain: {KEY}}}]\n"
            ),
        )
        .unwrap();
        let mut serve = Command::new(&nightshift)
            .args(["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap(), "--data-dir"])
            .arg(&data)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("serve printed its address").unwrap();
            if let Some(address) = line.strip_prefix("Nightshift listening on ") {
                break address.trim().to_owned();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        // The garbage collector's first sweep runs at start; let it finish.
        tokio::time::sleep(Duration::from_secs(5)).await;

        let client = reqwest::Client::new();
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

        let small_list = format!("{url}/v1/files?limit=20");
        let small_get = format!("{url}/v1/files/{}", small[0]);
        println!("small project, 1 file, big project idle:");
        println!("  {:<40} {}", "list", sample(&client, &small_list, SMALL).await);
        println!("  {:<40} {}", "retrieve", sample(&client, &small_get, SMALL).await);

        let stop = Arc::new(AtomicBool::new(false));
        let noisy_requests = Arc::new(AtomicU64::new(0));
        let mut noise = Vec::new();
        for n in 0..NOISY_CONNECTIONS {
            let (client, stop, count) = (reqwest::Client::new(), stop.clone(), noisy_requests.clone());
            let (url, after) = (url.clone(), big[n * files / NOISY_CONNECTIONS].clone());
            noise.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let list = format!("{url}/v1/files?limit=100&after={after}");
                    let response =
                        client.get(&list).header("x-project-id", BIG).header("x-api-key", KEY).send().await.unwrap();
                    response.bytes().await.unwrap();
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let noisy_started = (Instant::now(), noisy_requests.load(Ordering::Relaxed));
        println!("small project, while the big one lists on {NOISY_CONNECTIONS} connections:");
        println!("  {:<40} {}", "list", sample(&client, &small_list, SMALL).await);
        println!("  {:<40} {}", "retrieve", sample(&client, &small_get, SMALL).await);
        let noisy_rate = (noisy_requests.load(Ordering::Relaxed) - noisy_started.1) as f64
            / noisy_started.0.elapsed().as_secs_f64();
        println!("  (the big project's listings meanwhile: {noisy_rate:.0} a second)");
        stop.store(true, Ordering::Relaxed);
        for task in noise {
            task.await.unwrap();
        }
        let _ = serve.kill();
        let _ = serve.wait();
    });
}
