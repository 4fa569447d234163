//! Load signals: a model server's own Prometheus metrics, read to see whether its
//! interactive requests queue or its KV cache is nearly full.
//!
//! The design: docs/src/night-shift-design.md#the-load-signals-the-servers-own-metrics

use std::time::Duration;

use serde::Deserialize;

use super::gate::Pressure;
use super::presets::ServerKind;
use crate::duration;

/// `upstreams[].load_signal`: where a server's metrics are and when it is busy.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSignalConfig {
    /// The server's Prometheus endpoint (`http://vllm:8000/metrics`).
    pub url: String,
    #[serde(default)]
    pub server: ServerKind,
    /// How often it is read (50ms to 10s).
    #[serde(default = "default_every", deserialize_with = "duration::deserialize_precise")]
    pub every: Duration,
    /// Batch dispatch holds while more requests than this wait at the server (0: any).
    #[serde(default)]
    pub max_waiting: f64,
    /// … or while its KV cache is fuller than this share (0 < x ≤ 1). Beside users, the
    /// batch's places are also held to what fills this share of it
    /// ([`super::headroom::Headroom::new`]).
    #[serde(default = "default_max_kv_cache_usage")]
    pub max_kv_cache_usage: f64,
    /// The metric of requests waiting, if not the server's usual one.
    #[serde(default)]
    pub waiting_metric: Option<String>,
    /// The metric of KV-cache usage (0..1), if not the server's usual one.
    #[serde(default)]
    pub kv_cache_metric: Option<String>,
    /// The metric of requests running, if not the server's usual one.
    #[serde(default)]
    pub running_metric: Option<String>,
    /// The histogram of the server's time a token (its `_sum` over its `_count`), if not
    /// the server's usual one.
    #[serde(default)]
    pub token_time_metric: Option<String>,
}

/// Every 50 ms, not 100: a batch line holds its place for its whole answer, so what the
/// batch can give back when users come is what it has not sent before it hears of them.
/// Read twice as often, the headroom beside users took more of the idle capacity at no
/// higher p99 on the family's 16- and 64-seq servers
/// (docs/src/night-shift-record.md#readings-every-50-ms).
fn default_every() -> Duration {
    Duration::from_millis(50)
}
/// How full a server's KV cache may be, by default
/// ([`LoadSignalConfig::max_kv_cache_usage`]).
pub const MAX_KV_CACHE_USAGE: f64 = 0.95;

fn default_max_kv_cache_usage() -> f64 {
    MAX_KV_CACHE_USAGE
}

impl LoadSignalConfig {
    /// A server's signal at `url`, read with `server`'s names and every default: what a
    /// signal found where none is configured is read as ([`super::discovery`]).
    pub fn preset(url: String, server: ServerKind) -> Self {
        Self {
            url,
            server,
            every: default_every(),
            max_waiting: 0.0,
            max_kv_cache_usage: default_max_kv_cache_usage(),
            waiting_metric: None,
            kv_cache_metric: None,
            running_metric: None,
            token_time_metric: None,
        }
    }

    /// Out-of-range settings, as a config error.
    pub fn validate(&self, upstream: &str) -> Result<(), String> {
        let at = format!("upstream {upstream}: load_signal");
        match reqwest::Url::parse(&self.url) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            _ => return Err(format!("{at}.url {:?} is not an http(s) URL", self.url)),
        }
        if !(Duration::from_millis(50)..=Duration::from_secs(10)).contains(&self.every) {
            return Err(format!("{at}.every must be between 50ms and 10s"));
        }
        if !self.max_waiting.is_finite() || self.max_waiting < 0.0 {
            return Err(format!("{at}.max_waiting must be 0 or more"));
        }
        if !(self.max_kv_cache_usage > 0.0 && self.max_kv_cache_usage <= 1.0) {
            return Err(format!("{at}.max_kv_cache_usage must be more than 0 and at most 1"));
        }
        let named = [&self.waiting_metric, &self.kv_cache_metric, &self.running_metric, &self.token_time_metric];
        for name in named.into_iter().flatten() {
            if name.is_empty() || name.contains(char::is_whitespace) || name.contains('{') {
                return Err(format!("{at}: {name:?} is not a metric name"));
            }
        }
        Ok(())
    }

    /// The waiting metric's names, the first present counting.
    fn waiting_metrics(&self) -> Vec<&str> {
        named_or(&self.waiting_metric, self.server.waiting())
    }

    fn kv_cache_metrics(&self) -> Vec<&str> {
        named_or(&self.kv_cache_metric, self.server.kv_cache())
    }

    fn running_metrics(&self) -> Vec<&str> {
        named_or(&self.running_metric, self.server.running())
    }

    /// Every sample a reading looks for, by its name in the exposition: what a reading asks
    /// the server for ([`read`]).
    fn sample_names(&self) -> Vec<String> {
        let counts = [self.waiting_metrics(), self.running_metrics(), self.kv_cache_metrics()].concat();
        let times = self.token_time_metrics().flat_map(|(seconds, tokens)| [seconds, tokens]);
        counts.into_iter().map(str::to_owned).chain(times.map(|Name(stem, suffix)| format!("{stem}{suffix}"))).collect()
    }

    /// The time-a-token metrics' names, (seconds, tokens), the first pair present counting:
    /// the named histogram's sum and count, else the server's own pairs.
    fn token_time_metrics(&self) -> impl Iterator<Item = (Name<'_>, Name<'_>)> {
        let named = self.token_time_metric.as_deref().map(|name| (Name(name, "_sum"), Name(name, "_count")));
        let own = self.server.token_time().iter().filter(move |_| named.is_none());
        named.into_iter().chain(own.map(|&(seconds, tokens)| (Name(seconds, ""), Name(tokens, ""))))
    }
}

/// A metric's name in the exposition as a stem and a suffix (a histogram named in the
/// configuration, and its `_sum`), matched as one name without joining them.
#[derive(Clone, Copy, Debug)]
struct Name<'a>(&'a str, &'static str);

impl<'a> From<&'a str> for Name<'a> {
    fn from(name: &'a str) -> Self {
        Self(name, "")
    }
}

/// The metric named in the configuration, else the server's own names.
fn named_or<'a>(named: &'a Option<String>, defaults: &'static [&'static str]) -> Vec<&'a str> {
    match named {
        Some(name) => vec![name.as_str()],
        None => defaults.to_vec(),
    }
}

/// What one reading of the metrics said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    /// Requests waiting, over every series of the metric (each model served).
    pub waiting: f64,
    /// The fullest KV cache, when the server reports one.
    pub kv_cache_usage: Option<f64>,
    /// Requests running, over every series, when the server reports them.
    pub running: Option<f64>,
    /// The time its sequences took a token so far, where the server says.
    pub token_time: Option<TokenTime>,
}

/// A server's own count of the time its sequences took a token (cumulative, over every
/// series): the time of a step as its sequences saw it, without any wait in the queue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenTime {
    pub seconds: f64,
    pub tokens: f64,
}

impl TokenTime {
    /// Seconds a token over what came between `earlier` and this (`None`: no token, or
    /// counts that went back).
    pub fn since(self, earlier: Self) -> Option<f64> {
        let tokens = self.tokens - earlier.tokens;
        (tokens > 0.0 && !self.went_back(earlier)).then(|| (self.seconds - earlier.seconds) / tokens)
    }

    /// Either count is less than `earlier`'s, as after the server restarted.
    pub fn went_back(self, earlier: Self) -> bool {
        self.tokens < earlier.tokens || self.seconds < earlier.seconds
    }
}

impl Reading {
    /// Whether batch dispatch should back off: requests queue, or the cache is full.
    pub fn pressure(&self, config: &LoadSignalConfig) -> Pressure {
        let over = self.waiting - config.max_waiting;
        if over > 0.0 || self.kv_cache_usage.is_some_and(|usage| usage > config.max_kv_cache_usage) {
            Pressure::Queueing { over: over.max(0.0) }
        } else {
            Pressure::Clear
        }
    }
}

/// Reads the signal's metrics out of a Prometheus text exposition.
pub fn parse(text: &str, config: &LoadSignalConfig) -> Result<Reading, String> {
    let waiting = config
        .waiting_metrics()
        .into_iter()
        .find_map(|name| fold(text, name, |a, b| a + b))
        .ok_or_else(|| format!("no {} in the metrics", config.waiting_metrics().join(" or ")))??;
    let kv_cache_usage =
        config.kv_cache_metrics().into_iter().find_map(|name| fold(text, name, f64::max)).transpose()?;
    let mut running =
        config.running_metrics().into_iter().find_map(|name| fold(text, name, |a, b| a + b)).transpose()?;
    if config.running_metric.is_none() && config.server.running_counts_waiting() {
        running = running.map(|in_flight| (in_flight - waiting).max(0.0));
    }
    for (what, count) in [("waiting", Some(waiting)), ("running", running)] {
        if let Some(count) = count
            && (!count.is_finite() || count < 0.0)
        {
            return Err(format!("requests {what} is {count}"));
        }
    }
    if let Some(usage) = kv_cache_usage
        && !(0.0..=1.5).contains(&usage)
    {
        return Err(format!("KV-cache usage is {usage}, not a share"));
    }
    Ok(Reading { waiting, kv_cache_usage, running, token_time: token_time(text, config) })
}

/// The server's own time a token, if it says; numbers that make no sense count as not
/// said (the time a token only informs the delay; the wait decides the pressure).
fn token_time(text: &str, config: &LoadSignalConfig) -> Option<TokenTime> {
    config.token_time_metrics().find_map(|(seconds, tokens)| {
        let seconds = fold(text, seconds, |a, b| a + b)?.ok()?;
        let tokens = fold(text, tokens, |a, b| a + b)?.ok()?;
        let sane = |value: f64| value.is_finite() && value >= 0.0;
        (sane(seconds) && sane(tokens)).then_some(TokenTime { seconds, tokens })
    })
}

/// Whether a page has a series of `name`.
pub(super) fn has_series(text: &str, name: &str) -> bool {
    values(text, name.into()).next().is_some()
}

/// The values of every series of `name` (`None`: no series).
fn values<'a>(text: &'a str, name: Name<'a>) -> impl Iterator<Item = Result<f64, String>> + 'a {
    let Name(stem, suffix) = name;
    text.lines().filter(|line| !line.starts_with('#')).filter_map(move |line| {
        let rest = line.strip_prefix(stem)?.strip_prefix(suffix)?;
        let rest = match rest.chars().next()? {
            '{' => &rest[rest.rfind('}')? + 1..],
            ' ' | '\t' => rest,
            _ => return None, // a longer name with this one as its prefix
        };
        let value = rest.split_whitespace().next()?;
        Some(value.parse::<f64>().map_err(|_| format!("{stem}{suffix} has the value {value:?}")))
    })
}

/// Every series of `name` folded with `combine` (`None`: no series; an error: a value
/// that is not a number).
fn fold<'a>(text: &'a str, name: impl Into<Name<'a>>, combine: fn(f64, f64) -> f64) -> Option<Result<f64, String>> {
    let mut found: Option<Result<f64, String>> = None;
    for value in values(text, name.into()) {
        found = Some(match (found, value) {
            (Some(Err(error)), _) | (_, Err(error)) => Err(error),
            (None, Ok(value)) => Ok(value),
            (Some(Ok(so_far)), Ok(value)) => Ok(combine(so_far, value)),
        });
    }
    found
}

/// Why a reading failed, never fatal: `reason` is its metric label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `unreachable` (no answer, an error status, an answer cut off) or `invalid` (an
    /// answer without the metrics, or with numbers that make no sense).
    pub reason: &'static str,
    pub detail: String,
}

impl Failure {
    fn unreachable(detail: impl Into<String>) -> Self {
        Self { reason: "unreachable", detail: detail.into() }
    }
}

/// Reads the signal once: the reading, and a digest of the whole answer (to tell a
/// signal that has gone stale, [`super::staleness`]).
///
/// While `by_name`, it asks for the samples it reads alone (`?name[]=…`, as Prometheus's
/// Python client takes it: vLLM, SGLang and TensorRT-LLM serve their metrics through it,
/// and render only what is named). A whole page is rendered in the server's own Python
/// process, the one that serves its users: some 50 KB and 3 ms of its CPU at vLLM's
/// size, every 50 ms and for every pod that reads it. Servers that do not filter answer
/// the whole page; one that refuses the query (answers 4xx to it) is asked again
/// without it, and `by_name` is cleared for good.
pub async fn read(
    client: &reqwest::Client,
    config: &LoadSignalConfig,
    by_name: &mut bool,
) -> Result<(Reading, u64), Failure> {
    let timeout = config.every.max(Duration::from_millis(200)) * 4;
    let url = reqwest::Url::parse(&config.url).map_err(|_| Failure::unreachable("not a URL"))?;
    let get = |by_name: bool| {
        let mut url = url.clone();
        if by_name {
            url.query_pairs_mut().extend_pairs(config.sample_names().iter().map(|name| ("name[]", name)));
        }
        client.get(url).timeout(timeout).send()
    };
    let unreachable = |error: reqwest::Error| {
        Failure::unreachable(if error.is_timeout() { "timed out" } else { "could not connect" })
    };
    let mut response = get(*by_name).await.map_err(unreachable)?;
    if *by_name && response.status().is_client_error() {
        *by_name = false;
        response = get(false).await.map_err(unreachable)?;
    }
    if !response.status().is_success() {
        return Err(Failure::unreachable(format!("answered {}", response.status().as_u16())));
    }
    let bytes = response.bytes().await.map_err(|_| Failure::unreachable("the answer broke off"))?;
    if bytes.len() > 8 * 1024 * 1024 {
        return Err(Failure { reason: "invalid", detail: "the answer is over 8 MB".to_owned() });
    }
    let reading =
        parse(&String::from_utf8_lossy(&bytes), config).map_err(|detail| Failure { reason: "invalid", detail })?;
    Ok((reading, super::staleness::digest(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> LoadSignalConfig {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    const VLLM: &str = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
        # TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{model_name=\"a\"} 2.0\n\
        vllm:num_requests_waiting{model_name=\"b\"} 1.0\n\
        vllm:num_requests_waiting_by_reason{reason=\"x\"} 50\n\
        vllm:kv_cache_usage_perc{model_name=\"a\"} 0.5\n\
        vllm:kv_cache_usage_perc{model_name=\"b\"} 0.97\n\
        vllm:num_requests_running{model_name=\"a\"} 30\n\
        vllm:num_requests_running{model_name=\"b\"} 2\n";

    #[test]
    fn a_reading_asks_for_every_sample_it_reads_and_no_other() {
        // Every name of a preset, in the order they are looked for (vLLM's are asserted
        // over HTTP, tests/serve/signal_by_name.rs).
        let sglang = config("url: http://sglang:30000/metrics\nserver: sglang");
        assert_eq!(
            sglang.sample_names(),
            [
                "sglang:num_queue_reqs",
                "sglang:num_running_reqs",
                "sglang:token_usage",
                "sglang:inter_token_latency_seconds_sum",
                "sglang:inter_token_latency_seconds_count",
                "sglang:time_per_output_token_seconds_sum",
                "sglang:time_per_output_token_seconds_count",
            ]
        );
        // Named metrics replace the preset's; a histogram named for the time a token is
        // asked for by its sum and count; llama.cpp's preset has no KV-cache metric.
        let named =
            config("url: http://x/metrics\nserver: llamacpp\nwaiting_metric: queue\ntoken_time_metric: step_seconds");
        assert_eq!(
            named.sample_names(),
            ["queue", "llamacpp:requests_processing", "step_seconds_sum", "step_seconds_count"]
        );
    }

    #[test]
    fn readings_of_vllm_sglang_and_named_metrics() {
        let vllm = config("url: http://vllm:8000/metrics");
        assert_eq!(
            parse(VLLM, &vllm),
            Ok(Reading { waiting: 3.0, kv_cache_usage: Some(0.97), running: Some(32.0), token_time: None })
        );
        let old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.25\n";
        assert_eq!(
            parse(old, &vllm),
            Ok(Reading { waiting: 0.0, kv_cache_usage: Some(0.25), running: None, token_time: None })
        );
        let sglang = config("url: http://sglang:30000/metrics\nserver: sglang");
        let text = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:token_usage{model_name=\"m\"} 0.1\n\
            sglang:num_running_reqs{model_name=\"m\"} 12\n";
        assert_eq!(
            parse(text, &sglang),
            Ok(Reading { waiting: 4.0, kv_cache_usage: Some(0.1), running: Some(12.0), token_time: None })
        );
        let named =
            config("url: http://x/metrics\nwaiting_metric: tgi_queue_size\nrunning_metric: tgi_batch_current_size");
        assert_eq!(
            parse("tgi_queue_size 7\ntgi_batch_current_size 3\n", &named),
            Ok(Reading { waiting: 7.0, kv_cache_usage: None, running: Some(3.0), token_time: None })
        );
    }

    /// Each preset against an exposition in its server's own names (llama-server's as it
    /// prints them; TensorRT-LLM's, Dynamo's and TGI's as their docs list them).
    #[test]
    fn readings_of_llamacpp_trtllm_dynamo_and_tgi() {
        let llamacpp = config("url: http://llama:8080/metrics\nserver: llamacpp");
        let text = "# HELP llamacpp:requests_processing Number of requests processing.\n\
            # TYPE llamacpp:requests_processing gauge\n\
            llamacpp:requests_processing 4\n\
            # TYPE llamacpp:requests_deferred gauge\n\
            llamacpp:requests_deferred 2\n\
            llamacpp:prompt_tokens_total 1200\n";
        assert_eq!(
            parse(text, &llamacpp),
            Ok(Reading { waiting: 2.0, kv_cache_usage: None, running: Some(4.0), token_time: None })
        );
        let trtllm = config("url: http://trt:8000/prometheus/metrics\nserver: trtllm");
        let text = "trtllm_num_requests_waiting{model_name=\"m\"} 1\n\
            trtllm_num_requests_running{model_name=\"m\"} 60\n\
            trtllm_kv_cache_utilization{model_name=\"m\"} 0.42\n";
        assert_eq!(
            parse(text, &trtllm),
            Ok(Reading { waiting: 1.0, kv_cache_usage: Some(0.42), running: Some(60.0), token_time: None })
        );
        let dynamo = config("url: http://dynamo:8000/metrics\nserver: dynamo");
        let text = "dynamo_frontend_queued_requests{model=\"m\"} 3\n\
            dynamo_frontend_inflight_requests{model=\"m\"} 19\n";
        let reading = parse(text, &dynamo).unwrap();
        assert_eq!(
            reading,
            Reading { waiting: 3.0, kv_cache_usage: None, running: Some(16.0), token_time: None },
            "in flight less queued"
        );
        assert!(matches!(reading.pressure(&dynamo), Pressure::Queueing { .. }));
        // TGI's router: gauges without labels beside its token budget (not a cache share),
        // and each request's mean time a token in a histogram.
        let tgi = config("url: http://tgi:80/metrics\nserver: tgi");
        let text = "# TYPE tgi_queue_size gauge\ntgi_queue_size 5\n\
            tgi_batch_current_size 24\ntgi_batch_current_max_tokens 9000\ntgi_batch_total_tokens 16000\n\
            tgi_request_mean_time_per_token_duration_bucket{le=\"0.05\"} 7\n\
            tgi_request_mean_time_per_token_duration_sum 0.21\ntgi_request_mean_time_per_token_duration_count 7\n";
        let token_time = Some(TokenTime { seconds: 0.21, tokens: 7.0 });
        assert_eq!(
            parse(text, &tgi),
            Ok(Reading { waiting: 5.0, kv_cache_usage: None, running: Some(24.0), token_time })
        );
    }

    /// Each preset's time a token: vLLM's newer name before its older one, llama-server's
    /// two counters, every series summed; nonsense is not said. A histogram named in the
    /// config instead of the preset's.
    #[test]
    fn the_servers_own_time_a_token() {
        let time = |seconds, tokens| Some(TokenTime { seconds, tokens });
        let (itl, tpot) = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds");
        let renamed = "token_time_metric: my_itl_seconds";
        let cases = [
            (
                "server: vllm",
                format!(
                    "{itl}_sum{{model_name=\"a\"}} 2.5\n{itl}_count{{model_name=\"a\"}} 100\n\
                    {itl}_sum{{model_name=\"b\"}} 0.5\n{itl}_count{{model_name=\"b\"}} 20\n\
                    {tpot}_sum 9\n{tpot}_count 9\n"
                ),
                time(3.0, 120.0),
            ),
            ("server: vllm", format!("{tpot}_sum 2\n{tpot}_count 80\n"), time(2.0, 80.0)),
            ("server: vllm", format!("{itl}_sum 2\n{tpot}_count 80\n"), None),
            ("server: vllm", format!("{itl}_sum NaN\n{itl}_count 8\n"), None),
            ("server: vllm", format!("{itl}_sum 1\n{itl}_count -8\n"), None),
            (
                "server: sglang",
                "sglang:inter_token_latency_seconds_sum 1\nsglang:inter_token_latency_seconds_count 50\n".into(),
                time(1.0, 50.0),
            ),
            (
                "server: llamacpp",
                "llamacpp:tokens_predicted_total 192\nllamacpp:tokens_predicted_seconds_total 9.05596\n\
                llamacpp:predicted_tokens_seconds 20.5\n"
                    .into(),
                time(9.05596, 192.0),
            ),
            (
                "server: trtllm",
                "trtllm_time_per_output_token_seconds_sum 0.3\ntrtllm_time_per_output_token_seconds_count 10\n".into(),
                time(0.3, 10.0),
            ),
            (
                "server: dynamo",
                "dynamo_frontend_inter_token_latency_seconds_sum 4\n\
                dynamo_frontend_inter_token_latency_seconds_count 400\n"
                    .into(),
                time(4.0, 400.0),
            ),
            (
                renamed,
                format!("my_itl_seconds_sum 2\nmy_itl_seconds_count 40\n{itl}_sum 1\n{itl}_count 1\n"),
                time(2.0, 40.0),
            ),
            (renamed, format!("{itl}_sum 1\n{itl}_count 1\n"), None),
        ];
        for (setting, text, expected) in cases {
            let signal = config(&format!("url: http://x/metrics\n{setting}"));
            // Each server's waiting metric, which a reading needs.
            let waiting = signal.waiting_metrics()[0];
            let text = format!("{waiting} 0\n{text}");
            assert_eq!(parse(&text, &signal).unwrap().token_time, expected, "{setting}: {text}");
        }
    }

    #[test]
    fn the_time_a_token_between_two_readings() {
        let now = TokenTime { seconds: 3.0, tokens: 120.0 };
        assert_eq!(now.since(TokenTime { seconds: 1.0, tokens: 20.0 }), Some(0.02));
        assert_eq!(now.since(now), None, "no token since");
        assert_eq!(now.since(TokenTime { seconds: 9.0, tokens: 10.0 }), None, "a restart");
    }

    #[test]
    fn garbage_is_an_error_never_a_reading() {
        let vllm = config("url: http://vllm:8000/metrics");
        let cases = [
            "",
            "<html>not metrics</html>",
            "vllm:num_requests_waiting_total 3\n",
            "vllm:num_requests_waiting{model_name=\"a\"} many\n",
            "vllm:num_requests_waiting -1\n",
            "vllm:num_requests_waiting NaN\n",
            "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 97\n",
            "vllm:num_requests_waiting 0\nvllm:num_requests_running -2\n",
            "vllm:num_requests_waiting 0\nvllm:num_requests_running +Inf\n",
        ];
        for text in cases {
            assert!(parse(text, &vllm).is_err(), "{text:?}");
        }
    }

    #[test]
    fn pressure_when_requests_wait_or_the_cache_is_full() {
        let strict = config("url: http://x/metrics");
        let lenient = config("url: http://x/metrics\nmax_waiting: 4\nmax_kv_cache_usage: 0.99");
        let queueing = |over| Pressure::Queueing { over };
        let cases = [
            (0.0, None, Pressure::Clear, Pressure::Clear),
            (1.0, None, queueing(1.0), Pressure::Clear),
            (4.0, None, queueing(4.0), Pressure::Clear),
            (5.0, Some(0.1), queueing(5.0), queueing(1.0)),
            (0.0, Some(0.96), queueing(0.0), Pressure::Clear),
            (2.0, Some(0.995), queueing(2.0), queueing(0.0)),
        ];
        for (waiting, kv_cache_usage, strict_pressure, lenient_pressure) in cases {
            let reading = Reading { waiting, kv_cache_usage, running: None, token_time: None };
            assert_eq!(
                (reading.pressure(&strict), reading.pressure(&lenient)),
                (strict_pressure, lenient_pressure),
                "{reading:?}"
            );
        }
    }

    #[test]
    fn a_signal_found_is_read_as_one_configured_with_its_url_and_server() {
        for kind in ServerKind::ALL {
            let yaml = format!("url: http://server:8000/metrics\nserver: {}", kind.name());
            assert_eq!(LoadSignalConfig::preset("http://server:8000/metrics".into(), kind), config(&yaml));
        }
    }

    #[test]
    fn out_of_range_settings_are_config_errors() {
        let cases = [
            ("url: vllm:8000/metrics", "not an http(s) URL"),
            ("url: ftp://x/metrics", "not an http(s) URL"),
            ("url: http://x/metrics\nevery: 10ms", "between 50ms and 10s"),
            ("url: http://x/metrics\nmax_waiting: -1", "0 or more"),
            ("url: http://x/metrics\nmax_kv_cache_usage: 0", "more than 0 and at most 1"),
            ("url: http://x/metrics\nmax_kv_cache_usage: 1.5", "more than 0 and at most 1"),
            ("url: http://x/metrics\nwaiting_metric: \"a b\"", "not a metric name"),
            ("url: http://x/metrics\ntoken_time_metric: \"itl{model=\\\"m\\\"}\"", "not a metric name"),
        ];
        for (yaml, message) in cases {
            let error = config(yaml).validate("vllm").unwrap_err();
            assert!(error.contains(message), "{yaml}: {error}");
        }
        assert!(config("url: http://x/metrics\nmax_kv_cache_usage: 1").validate("vllm").is_ok());
    }
}
