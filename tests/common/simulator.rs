//! A model-server simulator for tests and benchmarks (no GPU here): an OpenAI-compatible
//! `POST /v1/chat/completions` served the way vLLM serves it, and its `GET /metrics` in
//! vLLM's names. Independent of Nightshift: anything that speaks HTTP can drive it.
//!
//! The model (one engine loop, in real time):
//! - **Continuous batching.** Requests wait in a queue and join the running batch between
//!   steps, up to `max_batch` sequences (vLLM's `max_num_seqs`).
//! - **Step time grows with the batch**: `step_base + step_per_seq × running` (and
//!   `step_per_waiting` for each request queued, for a server whose queue costs it). Each step
//!   gives every running sequence one output token; a sequence finishes after its
//!   `max_tokens` (or `max_completion_tokens`, else `default_max_tokens`) tokens.
//! - **KV-cache capacity.** A sequence holds its prompt's tokens (content length / 4) plus
//!   those generated so far. A request is admitted only if its prompt fits in what is free;
//!   when the running sequences outgrow the cache, the newest is preempted: it goes back to
//!   the front of the queue and starts over (vLLM's recompute), wasting its work.
//! - **Priority scheduling** (optional, vLLM's `--scheduling-policy priority`): the queue
//!   is ordered by the request's `priority` (lower first, default 0), then arrival; a
//!   waiting request that cannot be admitted preempts a running one of a worse priority.
//! - `/metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc` (0..1), `vllm:generation_tokens_total` and the sum and
//!   count of `vllm:inter_token_latency_seconds` (each token's step, as long as it took).
//!   The gauges are what vLLM publishes: a snapshot the engine takes each step, once it has
//!   admitted what fits (vLLM's scheduler stats). A request counts as waiting only when the
//!   engine could not take it; one that arrived since the last step and joins the next is
//!   not seen. With `gauges_every`, they are what SGLang publishes instead: set at a
//!   scheduling pass that admitted a request and every so many steps, so a request that
//!   finished stays counted until then.
//!
//! Usage: `Simulator::start(SimConfig::default()).await` gives a server on 127.0.0.1;
//! [`Simulator::stats`] counts what it generated, by the `priority` requests carried, and
//! who read its `/metrics`; [`Simulator::trace`] records it step by step.
//! `cargo bench --bench night_shift -- simulator` runs one on its own (see that file).

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};

#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Sequences decoded together at most (vLLM's `max_num_seqs`).
    pub max_batch: usize,
    /// Tokens the KV cache holds.
    pub kv_capacity: u64,
    /// A step's time with one running sequence (less `step_per_seq`).
    pub step_base: Duration,
    /// What each running sequence adds to a step.
    pub step_per_seq: Duration,
    /// What each waiting request adds to a step: a server that pays for its queue every
    /// step (none by default).
    pub step_per_waiting: Duration,
    /// Output tokens of a request that does not say.
    pub default_max_tokens: u32,
    /// Order the queue by `priority` (vLLM's priority scheduling policy).
    pub priority_scheduling: bool,
    /// The gauges are published every this many steps, and at a scheduling pass that
    /// admitted a request: SGLang's scheduler sets its gauges when it logs its stats, at
    /// every prefill batch and every `decode_log_interval` (40) decode steps, so a
    /// finished request stays counted until then. 1 (the default): at every step, as
    /// vLLM does.
    pub gauges_every: u64,
}

impl Default for SimConfig {
    /// A small model server: 32 sequences, 5 ms steps growing 0.04 ms per sequence (a
    /// memory-bound decode: 32 sequences make a step 1.25 times as long as one does), a
    /// cache of 24,000 tokens.
    fn default() -> Self {
        Self {
            max_batch: 32,
            kv_capacity: 24_000,
            step_base: Duration::from_millis(5),
            step_per_seq: Duration::from_micros(40),
            step_per_waiting: Duration::ZERO,
            default_max_tokens: 32,
            priority_scheduling: false,
            gauges_every: 1,
        }
    }
}

impl SimConfig {
    /// Output tokens per second with a full batch: the server's capacity.
    pub fn capacity_tokens_per_sec(&self) -> f64 {
        self.max_batch as f64 / self.step(self.max_batch).as_secs_f64()
    }

    /// A server whose steps slow with every sequence, as a CPU's: 20 ms, and a
    /// millisecond more for each sequence (32 make a step 2.6 times as long as one, and
    /// still give 2.2 times the tokens of 8), 16 tokens an answer.
    pub fn cpu_like() -> Self {
        Self {
            max_batch: 32,
            step_base: Duration::from_millis(20),
            step_per_seq: Duration::from_millis(1),
            default_max_tokens: 16,
            ..Self::default()
        }
    }

    /// A step's time with `running` sequences.
    pub fn step(&self, running: usize) -> Duration {
        self.step_base + self.step_per_seq * running as u32
    }
}

/// What the simulator did, by request priority.
#[derive(Clone, Debug, Default)]
pub struct SimStats {
    /// Output tokens of finished requests.
    pub tokens: BTreeMap<i64, u64>,
    pub finished: BTreeMap<i64, u64>,
    /// Requests preempted (their work thrown away).
    pub preempted: u64,
    pub steps: u64,
    /// Tokens decoded, finished or not (a step decodes one for every running sequence):
    /// over `steps`, how many places each priority held on average.
    pub decoded: BTreeMap<i64, u64>,
    /// The most requests a scheduling pass left waiting (a request that comes mid-step
    /// is admitted at the next pass if it fits: it did not queue).
    pub peak_waiting: usize,
    /// How long admitted requests had waited in the queue (from arrival to their first
    /// admission), by priority.
    pub waited: BTreeMap<i64, Vec<Duration>>,
    /// `/metrics` reads, by the reader's address.
    pub metrics_reads: BTreeMap<IpAddr, u64>,
    /// Σ over decoded tokens of their step's time (vLLM's inter-token latency).
    pub token_seconds: f64,
    /// Requests dropped, waiting or running, because their client hung up (as vLLM
    /// aborts them).
    pub aborted: u64,
}

struct Sequence {
    priority: i64,
    arrival: u64,
    prompt: u64,
    wanted: u32,
    generated: u32,
    /// When it came, until it is first admitted.
    queued: Option<Instant>,
    done: oneshot::Sender<u32>,
}

impl Sequence {
    fn held(&self) -> u64 {
        self.prompt + u64::from(self.generated)
    }
}

#[derive(Default)]
struct Engine {
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    arrivals: u64,
    /// Requests that came since the last scheduling pass: the next one admits them if
    /// they fit.
    arrived_since_pass: usize,
    stats: SimStats,
    /// The gauges `/metrics` shows, as of the last step or scheduling pass.
    published: Gauges,
    /// While [`Simulator::trace`] is on: a line for every step, arrival and admission.
    trace: Option<Vec<String>>,
}

/// What the engine published after its last step or scheduling pass.
#[derive(Clone, Copy, Default)]
struct Gauges {
    running: usize,
    waiting: usize,
    kv_used: u64,
}

impl Engine {
    fn kv_used(&self) -> u64 {
        self.running.iter().map(Sequence::held).sum()
    }

    fn enqueue(&mut self, config: &SimConfig, mut sequence: Sequence, front: bool) {
        if !front {
            self.arrivals += 1;
            self.arrived_since_pass += 1;
            sequence.arrival = self.arrivals;
        }
        if config.priority_scheduling {
            let key = (sequence.priority, sequence.arrival);
            let at = self.waiting.partition_point(|s| (s.priority, s.arrival) <= key);
            self.waiting.insert(at, sequence);
        } else if front {
            self.waiting.push_front(sequence);
        } else {
            self.waiting.push_back(sequence);
        }
    }

    /// Drops the requests whose client hung up, admits what fits, then publishes the
    /// gauges (what vLLM's scheduler stats say).
    fn schedule(&mut self, config: &SimConfig) {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| !s.done.is_closed());
        self.running.retain(|s| !s.done.is_closed());
        let aborted = before - self.waiting.len() - self.running.len();
        if aborted > 0 {
            self.stats.aborted += aborted as u64;
            self.note(format_args!("aborted {aborted}"));
        }
        let running_before = self.running.len();
        self.admit(config);
        let admitted = self.running.len() > running_before;
        self.arrived_since_pass = 0;
        self.stats.peak_waiting = self.stats.peak_waiting.max(self.waiting.len());
        if admitted || config.gauges_every <= 1 {
            self.publish();
        }
        if self.trace.is_some() {
            let (running, waiting) = (by_priority(&self.running), by_priority(&self.waiting));
            self.note(format_args!("step running {running} waiting {waiting}"));
        }
    }

    /// Sets the gauges `/metrics` shows to what runs now and what waits: what the last
    /// scheduling pass left waiting, and the preempted since. Requests that came since
    /// are not yet the scheduler's, as vLLM's engine takes the requests that came during
    /// a step in only before its next pass: counted as waiting at the step's end, a
    /// closed loop of users who come back together read as a full server's queue.
    fn publish(&mut self) {
        let waiting = self.waiting.len().saturating_sub(self.arrived_since_pass);
        self.published = Gauges { running: self.running.len(), waiting, kv_used: self.kv_used() };
    }

    /// Moves waiting requests into the batch while room and cache allow.
    fn admit(&mut self, config: &SimConfig) {
        while let Some(next) = self.waiting.front() {
            let fits = self.kv_used() + next.prompt < config.kv_capacity;
            if self.running.len() < config.max_batch && fits {
                let mut next = self.waiting.pop_front().expect("a front");
                if let Some(queued) = next.queued.take() {
                    let waited = queued.elapsed();
                    self.stats.waited.entry(next.priority).or_default().push(waited);
                    let waited = waited.as_secs_f64() * 1e3;
                    self.note(format_args!("admit priority {} waited {waited:.0} ms", next.priority));
                }
                self.running.push(next);
                continue;
            }
            // A better-priority request takes the place of the worst running one.
            let worst = self.running.iter().enumerate().max_by_key(|(_, s)| (s.priority, s.arrival));
            match worst {
                Some((at, worst)) if config.priority_scheduling && worst.priority > next.priority => {
                    let preempted = self.running.swap_remove(at);
                    self.preempt(config, preempted);
                }
                _ => break,
            }
        }
    }

    /// A line of the trace, if it is on, stamped with the seconds since the Unix epoch (to
    /// line up with another process's log).
    fn note(&mut self, event: std::fmt::Arguments) {
        if let Some(trace) = &mut self.trace {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            trace.push(format!("{:.4} {event}", now.as_secs_f64()));
        }
    }

    fn preempt(&mut self, config: &SimConfig, mut sequence: Sequence) {
        self.stats.preempted += 1;
        sequence.generated = 0;
        self.enqueue(config, sequence, true);
    }

    /// One decode step's bookkeeping (it `took` so long): a token for every running
    /// sequence.
    fn step(&mut self, config: &SimConfig, took: Duration) {
        self.stats.steps += 1;
        self.stats.token_seconds += took.as_secs_f64() * self.running.len() as f64;
        for sequence in &mut self.running {
            sequence.generated += 1;
            *self.stats.decoded.entry(sequence.priority).or_default() += 1;
        }
        let (finished, running): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.running).into_iter().partition(|s| s.generated >= s.wanted);
        self.running = running;
        for sequence in finished {
            *self.stats.tokens.entry(sequence.priority).or_default() += u64::from(sequence.generated);
            *self.stats.finished.entry(sequence.priority).or_default() += 1;
            let _ = sequence.done.send(sequence.generated);
        }
        while self.kv_used() > config.kv_capacity {
            let newest = self.running.iter().enumerate().max_by_key(|(_, s)| s.arrival).map(|(at, _)| at);
            let Some(at) = newest else { break };
            let preempted = self.running.swap_remove(at);
            self.preempt(config, preempted);
        }
        // The finished leave the gauges with their answers, as vLLM's scheduler stats
        // come with the step's outputs: a gauge published only at the next scheduling
        // pass still counted them, and a reader whose answer came before that pass (the
        // engine's thread descheduled on a busy machine) took them for someone else's.
        if self.stats.steps.is_multiple_of(config.gauges_every.max(1)) {
            self.publish();
        }
    }
}

struct Shared {
    config: SimConfig,
    engine: Mutex<Engine>,
    arrived: Notify,
}

pub struct Simulator {
    pub url: String,
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Simulator {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Simulator {
    pub async fn start(config: SimConfig) -> Self {
        Self::start_on("127.0.0.1:0", config).await
    }

    pub async fn start_on(address: &str, config: SimConfig) -> Self {
        let shared = Arc::new(Shared { config, engine: Mutex::default(), arrived: Notify::new() });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/metrics", get(metrics))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(address).await.expect("bind the simulator");
        let url = format!("http://{}/v1", listener.local_addr().expect("an address"));
        let server = tokio::spawn(async move {
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(listener, app).await.expect("the simulator serves");
        });
        let engine = tokio::spawn(run(shared.clone()));
        Self { url, shared, tasks: vec![server, engine] }
    }

    /// `…/metrics`, for a load-signal URL.
    pub fn metrics_url(&self) -> String {
        format!("{}/metrics", self.url.trim_end_matches("/v1"))
    }

    pub fn stats(&self) -> SimStats {
        self.shared.engine.lock().expect("engine").stats.clone()
    }

    /// Starts recording the engine step by step (`on`), or stops; returns what was
    /// recorded since it started. A line an event, stamped with the seconds since the
    /// Unix epoch: `step running P:N… waiting P:N…` (requests by priority, as each step
    /// begins), `arrive priority P`, `admit priority P waited MS ms`.
    pub fn trace(&self, on: bool) -> Vec<String> {
        let mut engine = self.shared.engine.lock().expect("engine");
        let recorded = engine.trace.take().unwrap_or_default();
        engine.trace = on.then(Vec::new);
        recorded
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    /// Requests running and waiting now.
    pub fn load(&self) -> (usize, usize) {
        let engine = self.shared.engine.lock().expect("engine");
        (engine.running.len(), engine.waiting.len())
    }
}

/// `P:N` for each priority `P` of `sequences`, `N` of them.
fn by_priority<'a>(sequences: impl IntoIterator<Item = &'a Sequence>) -> String {
    let mut counts = BTreeMap::<i64, usize>::new();
    for sequence in sequences {
        *counts.entry(sequence.priority).or_default() += 1;
    }
    counts.iter().map(|(priority, n)| format!("{priority}:{n}")).collect::<Vec<_>>().join(" ")
}

/// The engine loop: steps while anything runs, at the pace of the step time.
async fn run(shared: Arc<Shared>) {
    let config = &shared.config;
    let mut next = Instant::now();
    // When the last step ended (or the engine woke): a step's time, as its tokens saw it.
    let mut stepped = next;
    loop {
        let (running, waiting) = {
            let mut engine = shared.engine.lock().expect("engine");
            engine.schedule(config);
            (engine.running.len(), engine.waiting.len())
        };
        if running == 0 {
            shared.arrived.notified().await;
            next = Instant::now();
            stepped = next;
            continue;
        }
        next += config.step(running) + config.step_per_waiting * u32::try_from(waiting).unwrap_or(u32::MAX);
        tokio::time::sleep_until(next.into()).await;
        let mut engine = shared.engine.lock().expect("engine");
        let now = Instant::now();
        engine.step(config, now - stepped);
        stepped = now;
        if Instant::now() > next + Duration::from_millis(50) {
            next = Instant::now(); // far behind (a busy machine): don't burst to catch up
        }
    }
}

async fn complete(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, r#"{"error":{"message":"not JSON"}}"#).into_response();
    };
    let prompt_chars: usize = request["messages"]
        .as_array()
        .map(|messages| messages.iter().filter_map(|m| m["content"].as_str()).map(str::len).sum())
        .unwrap_or(0);
    let wanted = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|field| request[field].as_u64())
        .map_or(shared.config.default_max_tokens, |n| n.clamp(1, 1 << 20) as u32);
    let (done, finished) = oneshot::channel();
    let sequence = Sequence {
        priority: request["priority"].as_i64().unwrap_or(0),
        arrival: 0,
        prompt: (prompt_chars as u64 / 4).max(1),
        wanted,
        generated: 0,
        queued: Some(Instant::now()),
        done,
    };
    let prompt = sequence.prompt;
    {
        let mut engine = shared.engine.lock().expect("engine");
        engine.note(format_args!("arrive priority {}", sequence.priority));
        engine.enqueue(&shared.config, sequence, false);
    }
    shared.arrived.notify_one();
    let Ok(generated) = finished.await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "the engine stopped").into_response();
    };
    let completion = json!({
        "id": "chatcmpl-sim",
        "object": "chat.completion",
        "created": 1_736_295_000,
        "model": request["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + u64::from(generated)}
    });
    ([("content-type", "application/json")], completion.to_string()).into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>, ConnectInfo(reader): ConnectInfo<SocketAddr>) -> Response {
    let mut engine = shared.engine.lock().expect("engine");
    *engine.stats.metrics_reads.entry(reader.ip()).or_default() += 1;
    let gauges = engine.published;
    let usage = gauges.kv_used as f64 / shared.config.kv_capacity as f64;
    let tokens: u64 = engine.stats.tokens.values().sum();
    let decoded: u64 = engine.stats.decoded.values().sum();
    let token_seconds = engine.stats.token_seconds;
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"sim\"}} {}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"sim\"}} {}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{model_name=\"sim\"}} {usage}\n\
         # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE vllm:generation_tokens_total counter\n\
         vllm:generation_tokens_total{{model_name=\"sim\"}} {tokens}\n\
         # HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n\
         # TYPE vllm:inter_token_latency_seconds histogram\n\
         vllm:inter_token_latency_seconds_sum{{model_name=\"sim\"}} {token_seconds}\n\
         vllm:inter_token_latency_seconds_count{{model_name=\"sim\"}} {decoded}\n",
        gauges.running, gauges.waiting,
    );
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}
