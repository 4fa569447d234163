//! Nightshift on Kubernetes: the custom resources, the batch store over them, the
//! project directory, and the controller that runs batches as Jobs.

pub mod accept;
pub mod admission;
pub mod applied;
pub mod capacity;
pub mod conditions;
pub mod context;
pub mod controller;
pub mod crd;
pub mod error;
pub mod granting;
pub mod guard;
pub mod jobs;
pub mod leader;
pub mod outputs;
pub mod projects;
pub mod rbac;
pub mod recorded;
pub mod scaling;
pub mod stale_signals;
pub mod store;
pub mod usage;
