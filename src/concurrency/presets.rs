//! The load signal's presets: each model server's own metric names, the defaults of
//! `upstreams[].load_signal` for `server: vllm | sglang | llamacpp | trtllm | dynamo | tgi`.
//!
//! The design: docs/src/night-shift-design.md#the-load-signals-the-servers-own-metrics

use serde::Deserialize;

/// The server whose metric names are the defaults.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ServerKind {
    #[default]
    Vllm,
    Sglang,
    /// llama.cpp's `llama-server` (started with `--metrics`).
    Llamacpp,
    /// TensorRT-LLM's `trtllm-serve`.
    Trtllm,
    /// NVIDIA Dynamo's frontend.
    Dynamo,
    /// Hugging Face's Text Generation Inference (its router's metrics).
    Tgi,
}

impl ServerKind {
    /// Every preset, in the order a metrics page is recognised by ([`super::discovery`]).
    pub const ALL: [Self; 6] = [Self::Vllm, Self::Sglang, Self::Llamacpp, Self::Trtllm, Self::Dynamo, Self::Tgi];

    /// Its name in the configuration (`server: vllm`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Llamacpp => "llamacpp",
            Self::Trtllm => "trtllm",
            Self::Dynamo => "dynamo",
            Self::Tgi => "tgi",
        }
    }

    /// The metric of requests waiting; of several names, the first present counts.
    pub(super) fn waiting(self) -> &'static [&'static str] {
        match self {
            Self::Vllm => &["vllm:num_requests_waiting"],
            Self::Sglang => &["sglang:num_queue_reqs"],
            Self::Llamacpp => &["llamacpp:requests_deferred"],
            Self::Trtllm => &["trtllm_num_requests_waiting"],
            Self::Dynamo => &["dynamo_frontend_queued_requests"],
            Self::Tgi => &["tgi_queue_size"],
        }
    }

    pub(super) fn kv_cache(self) -> &'static [&'static str] {
        match self {
            // Older vLLM releases call it gpu_cache_usage_perc.
            Self::Vllm => &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            Self::Sglang => &["sglang:token_usage"],
            Self::Trtllm => &["trtllm_kv_cache_utilization"],
            // TGI's router publishes its token budget, not a share of its cache in use.
            Self::Llamacpp | Self::Dynamo | Self::Tgi => &[],
        }
    }

    pub(super) fn running(self) -> &'static [&'static str] {
        match self {
            Self::Vllm => &["vllm:num_requests_running"],
            Self::Sglang => &["sglang:num_running_reqs"],
            // Busy slots.
            Self::Llamacpp => &["llamacpp:requests_processing"],
            Self::Trtllm => &["trtllm_num_requests_running"],
            // In flight through the frontend: running and queued together.
            Self::Dynamo => &["dynamo_frontend_inflight_requests"],
            // The batch the router runs.
            Self::Tgi => &["tgi_batch_current_size"],
        }
    }

    /// Where the server says how long its sequences take a token: (seconds, tokens), a
    /// histogram's sum and count or two counters; of several pairs, the first present.
    /// Unlike a line's own time, it leaves out the time a request waited in the queue.
    pub(super) fn token_time(self) -> &'static [(&'static str, &'static str)] {
        match self {
            // Newer vLLM releases name the histogram for the inter-token latency.
            Self::Vllm => &[
                ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"),
                ("vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count"),
            ],
            Self::Sglang => &[
                ("sglang:inter_token_latency_seconds_sum", "sglang:inter_token_latency_seconds_count"),
                ("sglang:time_per_output_token_seconds_sum", "sglang:time_per_output_token_seconds_count"),
            ],
            // Each slot's generation time, summed as requests finish.
            Self::Llamacpp => &[("llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total")],
            // A request's mean time per token, once a request.
            Self::Trtllm => {
                &[("trtllm_time_per_output_token_seconds_sum", "trtllm_time_per_output_token_seconds_count")]
            }
            Self::Dynamo => &[(
                "dynamo_frontend_inter_token_latency_seconds_sum",
                "dynamo_frontend_inter_token_latency_seconds_count",
            )],
            // A request's mean time per token, once a request.
            Self::Tgi => {
                &[("tgi_request_mean_time_per_token_duration_sum", "tgi_request_mean_time_per_token_duration_count")]
            }
        }
    }

    /// Whether it drops a request whose client hung up, queued or running: vLLM aborts it
    /// (its API server cancels a request's handler on the disconnect), and TGI's router
    /// leaves a queued request out of its next batch once its answer's receiver is gone
    /// (read in its source, not run here). llama-server, as checked here, ran a queued
    /// request to its end after its client had gone, and the others are not known to
    /// drop one. Only where the server drops them does a batch take its queued lines
    /// back for users who come ([`super::recall`]): elsewhere a line taken back would
    /// hold its place all the same, and run twice.
    pub fn drops_hung_up(self) -> bool {
        matches!(self, Self::Vllm | Self::Tgi)
    }

    /// Whether its running metric counts the waiting requests too.
    pub(super) fn running_counts_waiting(self) -> bool {
        self == Self::Dynamo
    }
}
