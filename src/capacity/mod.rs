//! Capacity on demand. What the batches waiting for each upstream need of it
//! ([`backlog`]: lines and tokens waiting, the pace the deadlines need, the replicas that
//! gives), and when to change the replicas of the workload that serves it ([`scale`]).
//! Pure: batch documents, counts and times in; reports and decisions out. `serve` and
//! the controller publish the report (gauges and `/backlog`, the shape KEDA's
//! `metrics-api` scaler reads); the controller acts on the decisions.
//!
//! The design: docs/src/capacity.md

pub mod backlog;
pub mod scale;
