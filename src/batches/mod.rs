//! Batches: the durable Batch document, its lifecycle rules, and the store that keeps
//! it (embedded here; Kubernetes custom resources in the operator).

pub mod create;
mod embedded;
mod model;
mod object;
mod retention;
mod schema;
mod store;
mod transitions;

pub use create::{BatchSettings, CreateBatch};
pub use embedded::EmbeddedBatchStore;
pub use model::{
    Batch, BatchError, BatchSpec, BatchState, Condition, Ending, RequestCounts, ReservedFiles, Status, Usage,
};
pub use object::BatchObject;
pub use retention::run_retention_loop;
pub use store::{BatchPage, BatchStore, StateChange, StoreError, UpdateError};
pub use transitions::{Refusal, cancel};
