//! What happens next to a batch: the decisions the embedded runtime (`serve`) and the
//! Kubernetes controller both act on, in one place. Pure: they are given the batch's
//! document, its shards' committed progress, the workers a runtime knows of and the
//! clock, and say what to do; `crate::drive` carries a decision out.
//!
//! - [`decide`]: the next step of one batch (start shards, finalize, expire, fail…).
//! - [`workers`]: which workers to start, stop or retire for that step.
//! - [`schedule`]: which batches run when shard slots are short (weights, deadlines).
//! - [`eta`]: when a batch will finish at its pace, and whether it is late.
//!
//! The transitions the API asks for (cancel) are the batch document's own, beside its
//! model in `crate::batches`.

pub mod decide;
pub mod eta;
pub mod schedule;
pub mod workers;
