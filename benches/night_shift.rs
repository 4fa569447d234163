//! The night shift (`just bench`): batches on a model server that also serves users,
//! measured on the model-server simulator (`tests/common/simulator.rs`: continuous
//! batching of 32 sequences, steps of 5 ms growing 0.04 ms per sequence, a 24,000-token
//! KV cache; no GPU here) with `nightshift serve` (release build) in front of it.
//!
//! Sections (all by default; name some to run only those):
//! - `sweep`: batch throughput with no other traffic, at fixed concurrencies 4 to 64 and
//!   untuned (adaptive, ceiling 1024, nothing else set); the untuned run against the
//!   best fixed one.
//! - `interactive`: users' requests (Poisson, 20/s, 64 output tokens each) with no batch,
//!   with a batch at fixed concurrencies, untuned, and untuned with the server's load
//!   signal; then the same with the server scheduling by priority (batch lines carry
//!   `priority: 1`, users 0); users whose rate changes last (`changing`: bursts, and day
//!   and night), each against the same users with no batch. Their p50/p99 latency, and
//!   the share of the capacity they leave idle that the batch used.
//! - `fair`: one project's 6,000-line batch, then another's 100-line batch: the small
//!   one's completion time, first-come-first-served and with fair share.
//! - `arrive`: users who come to a server that a batch had to itself, on the default
//!   simulator and a CPU-like one: the places the batch held and the lines it queued
//!   there alone, how many of the users who came waited in the server's queue (their
//!   first 2 s, and the next 10 s), the places the batch held beside them, and the
//!   batch's lines the server dropped when they were taken back (its users' never hang up).
//!   `BENCH_TRACE=prefix` writes the simulator's trace ([`Simulator::trace`]) from 1 s
//!   before the users come to the end, to `prefix-default.trace` and
//!   `prefix-cpu-like.trace`; with `BENCH_LOG=nightshift::exec::permits=debug`, `serve`'s
//!   readings and caps line up with it by time.
//! - `simulator`: no benchmark; runs a simulator on `SIM_LISTEN` (default
//!   127.0.0.1:8011) until stopped, to drive by hand (`SIM_MAX_BATCH`, `SIM_KV`,
//!   `SIM_STEP_US`, `SIM_PER_SEQ_US`, `SIM_PRIORITY=1`).
//!
//! Knobs: `BENCH_WARM_SECS` (before measuring, default 15), `BENCH_MEASURE_SECS`
//! (default 20 for batch throughput, 60 with users: the p99 of a minute's ~1,200
//! requests is the 12th-worst, not the 4th-worst of 20 s), `BENCH_ONLY` (`interactive`:
//! only the runs whose name contains it, or is all of it after a `=`, and the one without
//! a batch), `BENCH_LOG`
//! (`serve`'s `RUST_LOG`, default `warn`).

#[path = "common/input.rs"]
mod input;
#[allow(dead_code)]
#[path = "../tests/common/interactive.rs"]
mod interactive;
#[path = "common/serve.rs"]
mod serve;
#[allow(dead_code)]
#[path = "../tests/common/simulator.rs"]
mod simulator;

use std::time::{Duration, Instant};

use interactive::{Interactive, Latencies, Pattern};
use serde_json::Value;
use simulator::{SimConfig, SimStats, Simulator};

const BIG: &str = "0f0e0d0c-0b0a-4909-8807-060504030201";
const SMALL: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
/// Each project's API key.
fn key(project: &str) -> &'static str {
    if project == BIG { "big-key" } else { "small-key" }
}
/// The `priority` batch lines carry, so that the simulator counts them apart (it
/// schedules first-come-first-served unless told otherwise).
const BATCH_PRIORITY: i64 = 1;
const INTERACTIVE_RATE: f64 = 20.0;
const INTERACTIVE_TOKENS: u32 = 64;

fn secs(name: &str, default: u64) -> Duration {
    Duration::from_secs(std::env::var(name).ok().map_or(default, |v| v.parse().unwrap()))
}

struct Serve {
    process: serve::Process,
    url: String,
    _work: tempfile::TempDir,
}

impl Serve {
    /// `nightshift serve` with two projects and `rest` (YAML: `upstreams:`, `batches:`).
    fn start(rest: &str) -> Self {
        let work = tempfile::TempDir::new().unwrap();
        let config = work.path().join("nightshift.yaml");
        let projects = format!(
            "projects:\n  - id: {BIG}\n    api_keys: [{{plain: {}}}]\n  - id: {SMALL}\n    api_keys: [{{plain: {}}}]\n",
            key(BIG),
            key(SMALL)
        );
        std::fs::write(&config, format!("{projects}{rest}")).unwrap();
        let log = std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".into());
        let (process, url) = serve::spawn(&config, &work.path().join("data"), &log);
        Self { process, url, _work: work }
    }

    fn auth(&self, request: reqwest::RequestBuilder, project: &str) -> reqwest::RequestBuilder {
        request.header("x-project-id", project).header("x-api-key", key(project))
    }

    /// Uploads `lines` batch lines and creates their batch; returns its id.
    async fn submit(&self, project: &str, lines: usize) -> String {
        let client = reqwest::Client::new();
        // 16 to 48 tokens a line, 32 on average.
        let input = input::summaries(lines, "sim", |n| 16 + ((n * 7919) % 33) as u32);
        let file = input::upload(self.auth(client.post(format!("{}/v1/files", self.url)), project), input).await;
        let create =
            serde_json::json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
        let batch = answer(self.auth(client.post(format!("{}/v1/batches", self.url)), project).json(&create)).await;
        batch["id"].as_str().unwrap_or_else(|| panic!("{batch}")).to_owned()
    }

    async fn batch(&self, project: &str, id: &str) -> Value {
        let client = reqwest::Client::new();
        answer(self.auth(client.get(format!("{}/v1/batches/{id}", self.url)), project)).await
    }

    /// A gauge of serve's `/metrics`.
    async fn gauge(&self, name: &str) -> Option<f64> {
        let text = reqwest::get(self.process.metrics_url.as_deref()?).await.ok()?.text().await.ok()?;
        text.lines().find(|l| l.starts_with(name))?.rsplit(' ').next()?.parse().ok()
    }
}

/// The JSON answer to `request`.
async fn answer(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

fn upstream(sim: &Simulator, extra: &str) -> String {
    format!(
        "upstreams:\n  - name: sim\n    base_url: {}\n    priority: {BATCH_PRIORITY}\n{extra}batches:\n  reconcile_interval: 100ms\n",
        sim.url
    )
}

fn batch_tokens(sim: &Simulator) -> u64 {
    sim.stats().tokens.get(&BATCH_PRIORITY).copied().unwrap_or(0)
}

/// Batch output tokens per second over the measuring time, after the warm-up.
async fn batch_rate(sim: &Simulator) -> f64 {
    tokio::time::sleep(secs("BENCH_WARM_SECS", 15)).await;
    let (before, started) = (batch_tokens(sim), Instant::now());
    tokio::time::sleep(secs("BENCH_MEASURE_SECS", 20)).await;
    (batch_tokens(sim) - before) as f64 / started.elapsed().as_secs_f64()
}

async fn sweep() {
    println!(
        "\n## Batch throughput, no other traffic (simulator capacity {:.0} tokens/s)",
        SimConfig::default().capacity_tokens_per_sec()
    );
    println!("| concurrency | batch tokens/s | share of capacity | limit at the end |");
    println!("| --- | --- | --- | --- |");
    let mut fixed = Vec::new();
    for setting in [Some(4), Some(8), Some(16), Some(24), Some(32), Some(40), Some(48), Some(64), None] {
        let sim = Simulator::start(SimConfig::default()).await;
        let extra = match setting {
            Some(n) => format!("    max_concurrency: {n}\n    adaptive: false\n"),
            None => "    max_concurrency: 1024\n".to_owned(),
        };
        let serve = Serve::start(&upstream(&sim, &extra));
        serve.submit(BIG, 10_000).await;
        let rate = batch_rate(&sim).await;
        let limit = serve.gauge("nightshift_upstream_concurrency_limit").await.unwrap_or(f64::NAN);
        let share = rate / sim.config().capacity_tokens_per_sec();
        match setting {
            Some(n) => {
                println!("| fixed {n} | {rate:.0} | {share:.2} | {limit} |");
                fixed.push((n, rate));
            }
            None => {
                let (best_n, best) = fixed.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
                let of = |n: u32| fixed.iter().find(|(m, _)| *m == n).map_or(f64::NAN, |(_, r)| rate / r);
                println!("| untuned (ceiling 1024) | {rate:.0} | {share:.2} | {limit} |");
                println!(
                    "\nuntuned / best fixed ({best_n}): {:.3}; / fixed 64: {:.3}; / fixed 4: {:.3}",
                    rate / best,
                    of(64),
                    of(4)
                );
            }
        }
    }
}

/// Interactive latencies and batch throughput with a batch configured by `extra`
/// (`None`: no batch).
async fn with_users(extra: Option<&str>, pattern: Pattern, priority_scheduling: bool) -> (Latencies, f64, f64) {
    let sim = Simulator::start(SimConfig { priority_scheduling, ..SimConfig::default() }).await;
    // Users come from the start: what is measured is a batch beside them, after the
    // warm-up (the batch arriving at their server, and finding its place).
    let users = Interactive::start(&sim.url, pattern, INTERACTIVE_TOKENS);
    let serve = match extra {
        Some(extra) => {
            let extra = extra.replace("{metrics}", &sim.metrics_url());
            let serve = Serve::start(&upstream(&sim, &extra));
            serve.submit(BIG, 20_000).await;
            Some(serve)
        }
        None => None,
    };
    tokio::time::sleep(secs("BENCH_WARM_SECS", 15)).await;
    users.measure_from_now();
    let waited_before = sim.stats().waited.get(&0).map_or(0, Vec::len);
    let before = batch_tokens(&sim);
    tokio::time::sleep(secs("BENCH_MEASURE_SECS", 60)).await;
    let (_, elapsed) = users.so_far();
    let batch = (batch_tokens(&sim) - before) as f64 / elapsed.as_secs_f64();
    let latencies = users.stop().await;
    let interactive = latencies.tokens as f64 / elapsed.as_secs_f64();
    drop(serve);
    if std::env::var_os("BENCH_WAITS").is_some() {
        let mut waited: Vec<f64> = sim
            .stats()
            .waited
            .get(&0)
            .map_or(&[][..], |w| &w[waited_before..])
            .iter()
            .map(Duration::as_secs_f64)
            .collect();
        waited.sort_by(f64::total_cmp);
        let over = |ms: f64| waited.iter().filter(|w| **w * 1000.0 > ms).count();
        let worst: Vec<String> = waited.iter().rev().take(8).map(|w| format!("{:.0}", w * 1000.0)).collect();
        println!(
            "  users' waits in the server's queue: of {}, {} over 1 ms, {} over 20 ms, {} over 40 ms; the longest {} ms",
            waited.len(),
            over(1.0),
            over(20.0),
            over(40.0),
            worst.join(", ")
        );
    }
    (latencies, batch, interactive)
}

async fn users() {
    let capacity = SimConfig::default().capacity_tokens_per_sec();
    println!(
        "\n## Interactive traffic ({INTERACTIVE_RATE}/s, {INTERACTIVE_TOKENS} output tokens each) beside a batch; capacity {capacity:.0} tokens/s"
    );
    println!("| batch | users' p50 | users' p99 | p99 / no batch | batch tokens/s | share of idle capacity used |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let steady = Pattern::Steady { per_sec: INTERACTIVE_RATE };
    let gated = "    max_concurrency: 1024\n    load_signal:\n      url: {metrics}\n";
    let runs: [(&str, Option<&str>, bool); 8] = [
        ("none", None, false),
        ("fixed 64", Some("    max_concurrency: 64\n    adaptive: false\n"), false),
        ("fixed 16", Some("    max_concurrency: 16\n    adaptive: false\n"), false),
        // The best fixed concurrency for these users, found by hand.
        ("fixed 20", Some("    max_concurrency: 20\n    adaptive: false\n"), false),
        ("untuned, no load signal", Some("    max_concurrency: 1024\n"), false),
        ("untuned + load signal", Some(gated), false),
        ("fixed 64, server schedules by priority", Some("    max_concurrency: 64\n    adaptive: false\n"), true),
        ("untuned + load signal, server schedules by priority", Some(gated), true),
    ];
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let mut alone = f64::NAN;
    for (name, extra, priority_scheduling) in runs {
        if extra.is_some() && !selected(name, &only) {
            continue;
        }
        let (latencies, batch, interactive) = with_users(extra, steady, priority_scheduling).await;
        let (p50, p99) = (latencies.percentile(50.0), latencies.percentile(99.0));
        if extra.is_none() {
            alone = p99;
        }
        let idle = capacity - interactive;
        println!(
            "| {name} | {:.0} ms | {:.0} ms | {:.2} | {batch:.0} | {:.2} |",
            p50 * 1000.0,
            p99 * 1000.0,
            p99 / alone,
            batch / idle
        );
        if latencies.failed > 0 {
            println!("  ({} interactive requests failed)", latencies.failed);
        }
    }
    let changing = [
        (
            "bursty users (3× for 2 s in 10)",
            Pattern::Bursty { per_sec: INTERACTIVE_RATE, factor: 3.0, burst: 2.0, every: 10.0 },
        ),
        ("day and night (5/s to 35/s and back in 30 s)", Pattern::DayNight { low: 5.0, high: 35.0, period: 30.0 }),
    ];
    for (name, pattern) in changing {
        if !selected(name, &only) && !"changing".contains(&only) {
            continue;
        }
        let (alone, _, _) = with_users(None, pattern, false).await;
        let (latencies, batch, interactive) = with_users(Some(gated), pattern, false).await;
        println!(
            "| {name}: none / untuned + load signal | {:.0} / {:.0} ms | {:.0} / {:.0} ms | {:.2} | {batch:.0} | {:.2} |",
            alone.percentile(50.0) * 1000.0,
            latencies.percentile(50.0) * 1000.0,
            alone.percentile(99.0) * 1000.0,
            latencies.percentile(99.0) * 1000.0,
            latencies.percentile(99.0) / alone.percentile(99.0),
            batch / (capacity - interactive)
        );
    }
}

/// `arrive`: users who come to a server that a batch has had to itself. Alone, the batch
/// fills the server's places and keeps a short queue of its lines there (a quarter of
/// the places); users who come wait behind that queue until the next reading of the
/// load signal makes room for them. Untuned with the load signal, on the default
/// simulator and on one whose steps slow with every sequence (a CPU's).
async fn arrive() {
    println!("\n## Users who come to a server a batch had to itself (untuned + load signal)");
    println!(
        "| server | alone: places held | alone: lines queued | users who waited > 2 steps, first 2 s | their longest wait | the next 10 s | places held beside them | batch lines taken back |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let servers = [
        ("default", "default (32 places; users 20/s, 64 tokens)", SimConfig::default(), (20.0, 64)),
        (
            "cpu-like",
            "CPU-like (32 places, 20 ms + 1 ms a sequence; users 10/s, 16 tokens)",
            SimConfig::cpu_like(),
            (10.0, 16),
        ),
    ];
    for (short, name, config, (per_sec, tokens)) in servers {
        let two_steps = config.step(config.max_batch) * 2;
        let sim = Simulator::start(config).await;
        let extra = format!("    max_concurrency: 1024\n    load_signal:\n      url: {}\n", sim.metrics_url());
        let serve = Serve::start(&upstream(&sim, &extra));
        serve.submit(BIG, 20_000).await;
        tokio::time::sleep(secs("BENCH_WARM_SECS", 15)).await;
        let (filling, from) = (sim.stats(), Instant::now());
        tokio::time::sleep(Duration::from_secs(4)).await;
        let tracing = std::env::var("BENCH_TRACE").ok();
        sim.trace(tracing.is_some());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let arrival = sim.stats();
        let alone_for = from.elapsed().as_secs_f64();
        let users = Interactive::start(&sim.url, Pattern::Steady { per_sec }, tokens);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let first = sim.stats();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let then = sim.stats();
        let latencies = users.stop().await;
        drop(serve);
        if let Some(prefix) = tracing {
            let path = format!("{prefix}-{short}.trace");
            std::fs::write(&path, sim.trace(false).join("\n") + "\n").expect("write the trace");
        }
        let held = |from: &SimStats, to: &SimStats| {
            let decoded = |stats: &SimStats| stats.decoded.get(&BATCH_PRIORITY).copied().unwrap_or(0);
            (decoded(to) - decoded(from)) as f64 / (to.steps - from.steps).max(1) as f64
        };
        // Little's law: the lines queued on average are the time they waited there, over
        // the window.
        let waits = |priority: i64, from: &SimStats, to: &SimStats| {
            let of = |stats: &SimStats| stats.waited.get(&priority).map_or(0, Vec::len);
            to.waited.get(&priority).map(|waits| waits[of(from)..of(to)].to_vec()).unwrap_or_default()
        };
        let queued =
            waits(BATCH_PRIORITY, &filling, &arrival).iter().map(Duration::as_secs_f64).sum::<f64>() / alone_for;
        let (came, after) = (waits(0, &arrival, &first), waits(0, &first, &then));
        let waited = |waits: &[Duration]| waits.iter().filter(|wait| **wait > two_steps).count();
        println!(
            "| {name} | {:.1} | {queued:.1} | {} of {} | {:.0} ms | {} of {} | {:.1} | {} |",
            held(&filling, &arrival),
            waited(&came),
            came.len(),
            came.iter().max().copied().unwrap_or_default().as_secs_f64() * 1e3,
            waited(&after),
            after.len(),
            held(&first, &then),
            then.aborted - arrival.aborted,
        );
        if latencies.failed > 0 {
            println!("  ({} users' requests failed)", latencies.failed);
        }
    }
}

/// Whether `BENCH_ONLY` (`only`) picks the run `name`: by a part of its name, or by all
/// of it after `=`.
fn selected(name: &str, only: &str) -> bool {
    only.strip_prefix('=').map_or_else(|| name.contains(only), |exact| name == exact)
}

async fn fair() {
    println!("\n## Two projects: a 6,000-line batch, then a 100-line one 2 s later");
    println!("| scheduling | small batch done after | big batch done after |");
    println!("| --- | --- | --- |");
    for scheduling in ["fifo", "fair"] {
        let sim = Simulator::start(SimConfig::default()).await;
        let config = upstream(&sim, "")
            .replace("batches:\n", &format!("batches:\n  scheduling: {scheduling}\n  shard_lines: 1000\n"));
        let serve = Serve::start(&config);
        let started = Instant::now();
        let big = serve.submit(BIG, 6_000).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let small_started = Instant::now();
        let small = serve.submit(SMALL, 100).await;
        let (mut small_done, mut big_done) = (None, None);
        while small_done.is_none() || big_done.is_none() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if small_done.is_none() && serve.batch(SMALL, &small).await["status"] == "completed" {
                small_done = Some(small_started.elapsed());
            }
            if big_done.is_none() && serve.batch(BIG, &big).await["status"] == "completed" {
                big_done = Some(started.elapsed());
            }
        }
        println!(
            "| {scheduling} | {:.1} s | {:.1} s |",
            small_done.unwrap().as_secs_f64(),
            big_done.unwrap().as_secs_f64()
        );
    }
}

async fn simulator_alone() {
    let env = |name: &str| std::env::var(name).ok().map(|v| v.parse::<u64>().unwrap());
    let defaults = SimConfig::default();
    let config = SimConfig {
        max_batch: env("SIM_MAX_BATCH").map_or(defaults.max_batch, |n| n as usize),
        kv_capacity: env("SIM_KV").unwrap_or(defaults.kv_capacity),
        step_base: env("SIM_STEP_US").map_or(defaults.step_base, Duration::from_micros),
        step_per_seq: env("SIM_PER_SEQ_US").map_or(defaults.step_per_seq, Duration::from_micros),
        priority_scheduling: env("SIM_PRIORITY") == Some(1),
        ..defaults
    };
    let listen = std::env::var("SIM_LISTEN").unwrap_or_else(|_| "127.0.0.1:8011".into());
    let sim = Simulator::start_on(&listen, config.clone()).await;
    println!("{config:?}\nserving {} (metrics: {})", sim.url, sim.metrics_url());
    std::future::pending::<()>().await;
}

fn main() {
    let nightshift = format!("{}/target/release/nightshift", env!("CARGO_MANIFEST_DIR"));
    let sections: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |name: &str| sections.is_empty() || sections.iter().any(|s| s == name);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        if sections.iter().any(|s| s == "simulator") {
            return simulator_alone().await;
        }
        assert!(std::path::Path::new(&nightshift).exists(), "build the release binary first: cargo build --release");
        if wanted("sweep") {
            sweep().await;
        }
        if wanted("interactive") {
            users().await;
        }
        if wanted("fair") {
            fair().await;
        }
        if wanted("arrive") {
            arrive().await;
        }
    });
}
