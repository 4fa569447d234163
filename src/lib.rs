//! Nightshift: a self-hosted, OpenAI-compatible Batch and Files API for LLM serving.
//!
//! One binary, several roles (`nightshift <role>`); everything lives in this library
//! so that every role and every test reaches the same code. See the book's
//! architecture chapter (docs/src/architecture.md) for how the modules fit together.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
// A function reads in a screen: at most 60 lines of code (clippy.toml).
#![warn(clippy::too_many_lines)]

pub mod api;
pub mod batches;
pub mod capacity;
pub mod cli;
pub mod clock;
pub mod concurrency;
pub mod config;
pub mod dev;
pub mod drive;
pub mod duration;
pub mod exec;
pub mod files;
pub mod grants;
pub mod idempotency;
pub mod ids;
pub mod k8s;
pub mod lifecycle;
pub mod metrics;
pub mod projects;
pub mod quota;
pub mod roles;
pub mod serve_runtime;
pub mod storage;
pub mod telemetry;
pub mod uploads;
pub mod validate;
pub mod webhooks;
