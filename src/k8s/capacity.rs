//! What the controller's loops share of capacity on demand (`crate::capacity`): the
//! upstreams' routes (which upstream a Batch's model goes to), the workloads as the
//! scaling loop last read them (`super::scaling`), and the backlog counted from the
//! Batches' watch cache.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::runtime::reflector::Store;

use super::crd::BatchResource;
use crate::capacity::backlog::{self, Pending, Report, Serving};
use crate::capacity::scale::Dispatch;
use crate::clock::UnixSeconds;
use crate::config::UpstreamConfig;

/// Each configured upstream's name and the models it serves, in the configuration's order.
#[derive(Clone, Debug, Default)]
pub struct Routes(Vec<(String, Vec<String>)>);

impl Routes {
    pub fn of(upstreams: &[UpstreamConfig]) -> Self {
        Self(upstreams.iter().map(|u| (u.name.clone(), u.models.clone())).collect())
    }

    fn name_of(&self, model: &str) -> Option<String> {
        crate::config::upstreams::name_of(self.0.iter().map(|(name, models)| (name.as_str(), models.as_slice())), model)
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(name, _)| name.as_str())
    }
}

/// What the scaling loop last read of each scaled upstream's workload.
#[derive(Default)]
pub struct Workloads {
    seen: Mutex<BTreeMap<String, Seen>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Ready replicas; `None` until first read.
    pub ready: Option<u32>,
    /// Lines waited `max_wait` for a ready replica: they go out anyway.
    pub gave_up: bool,
}

impl Workloads {
    /// The workloads behind `upstreams`, none read yet.
    pub fn of<'a>(upstreams: impl IntoIterator<Item = &'a str>) -> Self {
        Self { seen: Mutex::new(upstreams.into_iter().map(|name| (name.to_owned(), Seen::default())).collect()) }
    }

    /// Ready replicas of the workload behind `upstream`, if it has one and it was read.
    pub fn ready(&self, upstream: &str) -> Option<u32> {
        self.seen.lock().expect("workloads").get(upstream).and_then(|seen| seen.ready)
    }

    /// Whether `upstream`'s lines wait for a replica of its workload: none is ready (or
    /// none was read yet), and they have not waited `max_wait`. Its grants give them
    /// nothing meanwhile.
    pub fn holds(&self, upstream: &str) -> bool {
        let seen = self.seen.lock().expect("workloads");
        seen.get(upstream).is_some_and(|seen| !seen.gave_up && seen.ready.is_none_or(|ready| ready == 0))
    }

    pub fn seen(&self, upstream: &str) -> Option<Seen> {
        self.seen.lock().expect("workloads").get(upstream).copied()
    }

    pub fn set(&self, upstream: &str, seen: Seen) {
        self.seen.lock().expect("workloads").insert(upstream.to_owned(), seen);
    }
}

/// The condition a Batch whose upstream's workload is scaled carries.
pub const CAPACITY_READY: &str = "CapacityReady";

/// `CapacityReady` for the lines of a batch at a scaled upstream: status, reason and message.
pub fn capacity_condition(
    dispatch: Dispatch,
    workload: &str,
    max_wait: Duration,
) -> (&'static str, &'static str, String) {
    match dispatch {
        Dispatch::Hold => ("False", "WaitingForReplica", format!("its lines wait for a ready replica of {workload}")),
        Dispatch::GaveUp => (
            "False",
            "NoReplicaReady",
            format!(
                "no replica of {workload} became ready within {max_wait:?} (scale.max_wait): its lines are sent anyway"
            ),
        ),
        Dispatch::Send => ("True", "ReplicaReady", format!("a replica of {workload} is ready")),
    }
}

/// The in-progress Batches with lines left, each under the upstream its model goes to.
pub fn pending(routes: &Routes, batches: &Store<BatchResource>, now: UnixSeconds) -> Vec<Pending> {
    let batches = batches.state();
    backlog::pending(
        batches.iter().filter_map(|b| Some((b.accepted()?, b.status.as_ref()?))),
        |model| routes.name_of(model),
        now,
    )
}

/// The backlog of every upstream, with the lines in flight that `in_flight` counts and
/// the ready replicas the scaling loop last read.
pub fn report(
    routes: &Routes,
    batches: &Store<BatchResource>,
    workloads: &Workloads,
    in_flight: impl Fn(&str) -> u64,
    now: UnixSeconds,
) -> Report {
    let serving = routes
        .names()
        .map(|name| (name.to_owned(), Serving { in_flight: in_flight(name), ready: workloads.ready(name) }))
        .collect();
    backlog::report(&pending(routes, batches, now), &serving, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scaled_upstreams_lines_wait_until_a_replica_is_read_ready_or_max_wait_passed() {
        let workloads = Workloads::of(["llama"]);
        assert!(workloads.holds("llama"), "not read yet");
        assert!(!workloads.holds("plain"), "no workload behind it");
        let cases = [
            (Seen { ready: Some(0), gave_up: false }, true),
            (Seen { ready: Some(1), gave_up: false }, false),
            (Seen { ready: Some(0), gave_up: true }, false),
        ];
        for (seen, holds) in cases {
            workloads.set("llama", seen);
            assert_eq!(workloads.holds("llama"), holds, "{seen:?}");
        }
        assert_eq!(workloads.ready("llama"), Some(0));
    }

    #[test]
    fn the_condition_says_whether_lines_wait_and_why() {
        let wait = Duration::from_secs(180);
        let cases = [
            (Dispatch::Hold, "False", "WaitingForReplica", "its lines wait for a ready replica of Deployment/llama"),
            (Dispatch::GaveUp, "False", "NoReplicaReady", "no replica of Deployment/llama became ready within 180s"),
            (Dispatch::Send, "True", "ReplicaReady", "a replica of Deployment/llama is ready"),
        ];
        for (dispatch, status, reason, message) in cases {
            let (s, r, m) = capacity_condition(dispatch, "Deployment/llama", wait);
            assert_eq!((s, r), (status, reason));
            assert!(m.starts_with(message), "{m}");
        }
    }
}
