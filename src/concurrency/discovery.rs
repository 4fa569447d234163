//! A server's load signal found where none is configured: the model servers with a
//! preset serve their Prometheus metrics beside their OpenAI API (vLLM, SGLang and
//! llama-server at `/metrics`, TensorRT-LLM's `trtllm-serve` at `/prometheus/metrics`),
//! and their metric names say which server it is. So an untuned batch reads the signal
//! of the servers that publish one, and nobody has to configure it for the night shift
//! to make way for users.
//!
//! The design: docs/src/night-shift-design.md#the-load-signals-the-servers-own-metrics

use std::time::{Duration, Instant};

use super::presets::ServerKind;
use super::signals::{self, LoadSignalConfig};

/// Where the metrics are looked for beside the API, in this order.
const PATHS: [&str; 2] = ["/metrics", "/prometheus/metrics"];
/// A server that did not answer is asked again after this long (it may be starting).
pub const AGAIN_UNANSWERED: Duration = Duration::from_secs(30);
/// A server that answered without a signal of a preset's is asked again after this long
/// (it may be started again with its metrics on).
pub const AGAIN_UNKNOWN: Duration = Duration::from_secs(600);
/// One look's wait for each answer.
const TIMEOUT: Duration = Duration::from_secs(2);
/// A page longer than this is not read (vLLM's is some 50 KB).
const MAX_PAGE: usize = 8 * 1024 * 1024;

/// Where a server whose OpenAI API is at `base_url` (`http://vllm:8000/v1`) may serve its
/// metrics: beside the API's root, the base URL less its `/v1`.
pub fn metrics_urls(base_url: &str) -> Vec<reqwest::Url> {
    let base = base_url.trim_end_matches('/');
    let root = base.strip_suffix("/v1").unwrap_or(base);
    PATHS.iter().filter_map(|path| reqwest::Url::parse(&format!("{root}{path}")).ok()).collect()
}

/// The server whose signal a metrics page carries: the first preset whose waiting
/// metric has a sample there.
pub fn recognise(page: &str) -> Option<ServerKind> {
    ServerKind::ALL.into_iter().find(|kind| kind.waiting().iter().any(|name| signals::has_series(page, name)))
}

/// What one look found.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// A page with a preset's signal: read it as configured with that preset.
    Signal(LoadSignalConfig),
    /// Pages (or errors) that carry no signal of a preset's.
    Nothing,
    /// The server did not answer.
    Unanswered,
}

/// The looks for an upstream's signal: when the next one is due.
#[derive(Debug, Clone)]
pub struct Discovery {
    urls: Vec<reqwest::Url>,
    /// When the next look is due (`None`: none has been made, or one found a signal).
    next: Option<Instant>,
}

impl Discovery {
    pub fn new(base_url: &str) -> Self {
        Self { urls: metrics_urls(base_url), next: None }
    }

    /// Whether a look is due (the first is, at once).
    pub fn due(&self, now: Instant) -> bool {
        !self.urls.is_empty() && self.next.is_none_or(|next| now >= next)
    }

    /// Whether no look has been made yet (after one that found a signal, none is).
    pub fn first(&self) -> bool {
        self.next.is_none()
    }

    /// The next look after this one found `found` at `now`.
    pub fn looked(&mut self, now: Instant, found: &Found) {
        self.next = match found {
            Found::Signal(_) => None,
            Found::Nothing => Some(now + AGAIN_UNKNOWN),
            Found::Unanswered => Some(now + AGAIN_UNANSWERED),
        };
    }

    /// Looks at each place in turn, until one carries a preset's signal.
    pub async fn look(&self, client: &reqwest::Client) -> Found {
        for url in &self.urls {
            let response = match client.get(url.clone()).timeout(TIMEOUT).send().await {
                Ok(response) => response,
                Err(_) => return Found::Unanswered,
            };
            if !response.status().is_success() || response.content_length().is_some_and(|n| n > MAX_PAGE as u64) {
                continue;
            }
            let Ok(page) = response.bytes().await else { continue };
            if let Some(kind) = recognise(&String::from_utf8_lossy(&page[..page.len().min(MAX_PAGE)])) {
                return Found::Signal(LoadSignalConfig::preset(url.to_string(), kind));
            }
        }
        Found::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_are_looked_for_beside_the_apis_root() {
        let urls = |base: &str| metrics_urls(base).iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(urls("http://vllm:8000/v1"), ["http://vllm:8000/metrics", "http://vllm:8000/prometheus/metrics"]);
        assert_eq!(urls("http://vllm:8000/v1/")[0], "http://vllm:8000/metrics");
        // A prefix before /v1 (a gateway's route) is kept.
        assert_eq!(urls("https://gw.example/llama/v1")[0], "https://gw.example/llama/metrics");
        assert_eq!(urls("http://server:8080")[0], "http://server:8080/metrics");
        assert!(urls("not a url").is_empty());
    }

    #[test]
    fn a_page_says_which_server_it_is_by_its_waiting_metric() {
        let vllm = "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"m\"} 0.0\n";
        assert_eq!(recognise(vllm), Some(ServerKind::Vllm));
        assert_eq!(recognise("sglang:num_queue_reqs{name=\"m\"} 3\n"), Some(ServerKind::Sglang));
        assert_eq!(recognise("llamacpp:requests_deferred 0\n"), Some(ServerKind::Llamacpp));
        assert_eq!(recognise("trtllm_num_requests_waiting 1\n"), Some(ServerKind::Trtllm));
        assert_eq!(recognise("dynamo_frontend_queued_requests{model=\"m\"} 0\n"), Some(ServerKind::Dynamo));
        assert_eq!(recognise("tgi_queue_size 4\ntgi_batch_current_size 8\n"), Some(ServerKind::Tgi));
        // Only the comments, a longer name, or a page with no preset's queue: none.
        assert_eq!(recognise("# TYPE vllm:num_requests_waiting gauge\n"), None);
        assert_eq!(recognise("vllm:num_requests_waiting_by_reason{reason=\"x\"} 2\n"), None);
        assert_eq!(recognise("tgi_request_count 4\ntgi_batch_current_size 8\n"), None);
        assert_eq!(recognise(""), None);
    }

    #[test]
    fn a_look_is_due_at_once_then_after_a_while_and_never_after_a_signal() {
        let now = Instant::now();
        let mut discovery = Discovery::new("http://vllm:8000/v1");
        assert!(discovery.due(now) && discovery.first());
        discovery.looked(now, &Found::Unanswered);
        assert!(!discovery.first());
        assert!(!discovery.due(now + AGAIN_UNANSWERED - Duration::from_millis(1)));
        assert!(discovery.due(now + AGAIN_UNANSWERED));
        discovery.looked(now, &Found::Nothing);
        assert!(!discovery.due(now + AGAIN_UNANSWERED));
        assert!(discovery.due(now + AGAIN_UNKNOWN));
        assert!(!Discovery::new("not a url").due(now));
    }
}
