//! The serve tier: `nightshift serve` as a process, against scriptable upstreams, the
//! model-server simulator and llama.cpp's server, driven over HTTP and by the official
//! OpenAI Python SDK.

#[path = "../common/mod.rs"]
mod common;

mod capacity;
mod execution;
mod load_signal;
mod night_shift;
mod presets;
mod rate_limits;
mod s3_credentials;
mod sdk_e2e;
mod signal_by_name;
mod slow_clients;
mod storage_faults;
mod webhooks;
