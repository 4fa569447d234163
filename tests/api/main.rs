//! The API tier: the HTTP API through the router in-process (`tower::ServiceExt::oneshot`),
//! on a local directory and on a real S3 server (s3s-fs), and the storage conformance suite.

#[path = "../common/mod.rs"]
mod common;

mod batches_api;
mod files_api;
mod idempotency;
mod storage_conformance;
mod uploads_api;
