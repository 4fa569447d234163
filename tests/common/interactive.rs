//! Interactive traffic for the model-server simulator (or any OpenAI-compatible server):
//! chat completions sent at random (Poisson) arrivals whose rate follows a pattern, or by
//! a constant number of users who each ask again once answered; each request timed end
//! to end. What users of a model server feel while batches run on it.
//!
//! ```ignore
//! let load = Interactive::start(url, Pattern::Steady { per_sec: 20.0 }, 24);
//! tokio::time::sleep(Duration::from_secs(10)).await;
//! let latencies = load.stop().await; // p50/p99 via Latencies::percentile
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;

#[derive(Clone, Copy, Debug)]
pub enum Pattern {
    /// The same rate all along.
    Steady { per_sec: f64 },
    /// `per_sec` on average, in bursts: `burst` seconds at `factor` times the base rate
    /// every `every` seconds, the base rate lowered to keep the average.
    Bursty { per_sec: f64, factor: f64, burst: f64, every: f64 },
    /// Day and night: the rate follows a sine between `low` and `high` over `period`
    /// seconds, starting at night.
    DayNight { low: f64, high: f64, period: f64 },
}

impl Pattern {
    /// Requests per second `t` seconds after the start.
    pub fn rate_at(&self, t: f64) -> f64 {
        match *self {
            Pattern::Steady { per_sec } => per_sec,
            Pattern::Bursty { per_sec, factor, burst, every } => {
                let share = (burst / every).clamp(0.0, 1.0);
                let base = per_sec / (1.0 + share * (factor - 1.0));
                if t % every < burst { base * factor } else { base }
            }
            Pattern::DayNight { low, high, period } => {
                let phase = (1.0 - (2.0 * std::f64::consts::PI * t / period).cos()) / 2.0;
                low + (high - low) * phase
            }
        }
    }
}

/// End-to-end latencies of the requests that finished, in seconds.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    pub seconds: Vec<f64>,
    /// Requests that failed (not 200).
    pub failed: usize,
    /// Output tokens the finished requests asked for.
    pub tokens: u64,
}

impl Latencies {
    /// The `p`th percentile (0..=100) by nearest rank.
    pub fn percentile(&self, p: f64) -> f64 {
        if self.seconds.is_empty() {
            return f64::NAN;
        }
        let mut sorted = self.seconds.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
        sorted[rank.min(sorted.len()) - 1]
    }
}

pub struct Interactive {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
    latencies: Arc<Mutex<Latencies>>,
    /// Requests sent before this do not count.
    measured_from: Arc<Mutex<Instant>>,
}

impl Interactive {
    /// Sends requests for `max_tokens` output tokens each to `base_url`
    /// (`…/v1`), arriving as `pattern` says, until stopped.
    pub fn start(base_url: &str, pattern: Pattern, max_tokens: u32) -> Self {
        let started = Instant::now();
        Self::run(base_url, max_tokens, move |sender, stop| async move {
            let mut requests = tokio::task::JoinSet::new();
            while !stop.is_cancelled() {
                let rate = pattern.rate_at(started.elapsed().as_secs_f64()).max(0.01);
                let gap = -rand::rng().random::<f64>().max(1e-9).ln() / rate;
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs_f64(gap.min(5.0))) => {}
                }
                let sender = sender.clone();
                requests.spawn(async move { sender.send().await });
                while requests.try_join_next().is_some() {}
            }
            // Requests in flight finish and count.
            while requests.join_next().await.is_some() {}
        })
    }

    /// `users` users, each sending its next request as soon as the last is answered
    /// (a closed loop: the server always holds about `users` of their requests).
    pub fn closed(base_url: &str, users: usize, max_tokens: u32) -> Self {
        Self::run(base_url, max_tokens, move |sender, stop| async move {
            let mut loops = tokio::task::JoinSet::new();
            for _ in 0..users {
                let (sender, stop) = (sender.clone(), stop.clone());
                loops.spawn(async move {
                    while !stop.is_cancelled() {
                        sender.send().await;
                    }
                });
            }
            while loops.join_next().await.is_some() {}
        })
    }

    fn run<F, Fut>(base_url: &str, max_tokens: u32, traffic: F) -> Self
    where
        F: FnOnce(Sender, tokio_util::sync::CancellationToken) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let stop = tokio_util::sync::CancellationToken::new();
        let sender = Sender {
            client: reqwest::Client::new(),
            url: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            max_tokens,
            sent: Arc::default(),
            latencies: Arc::default(),
            measured_from: Arc::new(Mutex::new(Instant::now())),
        };
        let (latencies, measured_from) = (sender.latencies.clone(), sender.measured_from.clone());
        let task = tokio::spawn(traffic(sender, stop.clone()));
        Self { stop, task, latencies, measured_from }
    }

    /// Forgets what was measured so far: from now on only requests sent from now count
    /// (the traffic goes on as it was).
    pub fn measure_from_now(&self) {
        *self.measured_from.lock().unwrap() = Instant::now();
        *self.latencies.lock().unwrap() = Latencies::default();
    }

    /// Stops sending, waits for the requests in flight, and gives every latency.
    pub async fn stop(self) -> Latencies {
        self.stop.cancel();
        let _ = self.task.await;
        self.latencies.lock().unwrap().clone()
    }

    /// Latencies so far, and the time since the start (or since measuring began again).
    pub fn so_far(&self) -> (Latencies, Duration) {
        (self.latencies.lock().unwrap().clone(), self.measured_from.lock().unwrap().elapsed())
    }
}

/// Sends one user's request and times it.
#[derive(Clone)]
struct Sender {
    client: reqwest::Client,
    url: String,
    max_tokens: u32,
    /// Requests sent so far (numbers them).
    sent: Arc<AtomicU64>,
    latencies: Arc<Mutex<Latencies>>,
    measured_from: Arc<Mutex<Instant>>,
}

impl Sender {
    async fn send(&self) {
        let (n, max_tokens) = (self.sent.fetch_add(1, Ordering::Relaxed) + 1, self.max_tokens);
        let body = format!(
            r#"{{"model":"sim","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"interactive request number {n}: a question of a user"}}]}}"#
        );
        let sent = Instant::now();
        let answer = self.client.post(&self.url).header("content-type", "application/json").body(body).send().await;
        let ok = matches!(&answer, Ok(response) if response.status().is_success());
        let ok = ok && answer.unwrap().bytes().await.is_ok();
        let mut latencies = self.latencies.lock().unwrap();
        if sent < *self.measured_from.lock().unwrap() {
            return;
        }
        if ok {
            latencies.seconds.push(sent.elapsed().as_secs_f64());
            latencies.tokens += u64::from(max_tokens);
        } else {
            latencies.failed += 1;
        }
    }
}
