//! Which Batches start shard Jobs when the installation's `max_running_shards` is
//! short: each in-progress Batch's share of the slots ([`crate::lifecycle::schedule`]: projects by
//! weight, earliest deadline first within one; or first come, first served), read off
//! the controller's caches. A Batch starts Jobs only while it runs fewer than its
//! share; one above it (it started before the others came) keeps its Jobs, and the
//! slots they free go to those below theirs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;

use super::crd::{BATCH_LABEL, BatchResource, resource_name};
use super::jobs::job_workers;
use crate::batches::{BatchSpec, Status};
use crate::config::Scheduling;
use crate::drive::WorkerPhase;
use crate::lifecycle::schedule::{Candidate, allot, allot_in_order};

/// An allotment reused for this long, while the running Jobs stay as many.
pub const FRESH: Duration = Duration::from_millis(500);

/// Every in-progress Batch's share of `slots` over the installation (by resource name),
/// `ours` (the Batch being driven) among them; `weights` by project id (1 if missing).
/// Ours counts whatever the cache says of it: it may have gone in progress in this very
/// pass, and a Batch the cache has not caught up with must not start Jobs past the
/// others' shares.
pub fn allotment(
    ours: &BatchResource,
    batches: &[Arc<BatchResource>],
    jobs: &[Arc<Job>],
    weights: &HashMap<String, u32>,
    scheduling: Scheduling,
    slots: usize,
) -> HashMap<String, usize> {
    let name = ours.name_any();
    let in_progress =
        |b: &BatchResource| b.status.as_ref().is_some_and(|s| s.status == Status::InProgress && s.ending.is_none());
    let others = batches.iter().map(|b| b.as_ref()).filter(|b| b.name_any() != name && in_progress(b));
    // Jobs by their Batch, once: a pass over each of N Batches looks at all of them.
    let mut by_batch: HashMap<&str, Vec<&Job>> = HashMap::new();
    for job in jobs {
        if let Some(batch) = job.labels().get(BATCH_LABEL) {
            by_batch.entry(batch.as_str()).or_default().push(job.as_ref());
        }
    }
    let resources: Vec<(&BatchResource, &BatchSpec)> =
        others.chain(std::iter::once(ours)).filter_map(|b| Some((b, b.accepted()?))).collect();
    let candidates: Vec<Candidate<String>> = resources
        .iter()
        .map(|(resource, spec)| {
            let own = by_batch.get(resource_name(&spec.id).as_str()).map(Vec::as_slice).unwrap_or_default();
            let failures = resource.status.as_ref().map(|s| s.shard_failures.clone()).unwrap_or_default();
            let done = job_workers(own, &failures).values().filter(|phase| **phase == WorkerPhase::Succeeded).count();
            let project = spec.project_id.to_string();
            Candidate {
                weight: weights.get(&project).copied().unwrap_or(1),
                project,
                expires_at: spec.expires_at,
                created_at: spec.created_at,
                id: spec.id.to_string(),
                shards: spec.plan.shards.len().saturating_sub(done),
            }
        })
        .collect();
    let shares = match scheduling {
        Scheduling::Fair => allot(slots, &candidates),
        Scheduling::Fifo => allot_in_order(slots, &candidates),
    };
    resources.iter().map(|(resource, _)| resource.name_any()).zip(shares).collect()
}

/// The last allotment, reused while it is [`FRESH`] and the running Jobs are as many:
/// computed for every pass, it cost O(N) a pass and O(N²) a round of passes, which at
/// 10,000 Batches in progress took both cores and left new Batches unseen for minutes.
#[derive(Debug, Default)]
pub struct Allotments {
    last: Option<(Instant, usize, HashMap<String, usize>)>,
}

impl Allotments {
    /// `name`'s share: the last allotment's while it holds, else `compute`'s (which then
    /// is kept). A Batch the last one does not know (just in progress) computes anew.
    pub fn share_of(
        &mut self,
        name: &str,
        running: usize,
        now: Instant,
        compute: impl FnOnce() -> HashMap<String, usize>,
    ) -> usize {
        if let Some((at, was_running, shares)) = &self.last
            && now.saturating_duration_since(*at) < FRESH
            && *was_running == running
            && let Some(share) = shares.get(name)
        {
            return *share;
        }
        let shares = compute();
        let share = shares.get(name).copied().unwrap_or(0);
        self.last = Some((now, running, shares));
        share
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};

    use super::*;
    use crate::batches::{BatchSpec, BatchState};
    use crate::config::WorkerTemplate;
    use crate::ids::{BatchId, FileId, ProjectId};
    use crate::k8s::crd::{BatchResourceSpec, resource_name};
    use crate::k8s::jobs::shard_job;
    use crate::validate::{Shard, ShardPlan};

    /// How many shard Jobs `ours` may run now, as the controller reads it.
    fn share(
        ours: &BatchResource,
        batches: &[Arc<BatchResource>],
        jobs: &[Arc<Job>],
        weights: &HashMap<String, u32>,
        scheduling: Scheduling,
        slots: usize,
    ) -> usize {
        allotment(ours, batches, jobs, weights, scheduling, slots)[&ours.name_any()]
    }

    fn shard(index: u32) -> Shard {
        Shard { index, first_request: u64::from(index) * 10, requests: 10, byte_start: 0, byte_end: 1 }
    }

    /// An in-progress Batch of `project` with `shards` shards, created at `created_at`.
    fn batch(project: &ProjectId, shards: u32, created_at: i64) -> Arc<BatchResource> {
        let id = BatchId::generate();
        let name = resource_name(&id);
        let spec = BatchSpec {
            id,
            project_id: project.clone(),
            input_file_id: FileId::generate(),
            endpoint: "/v1/chat/completions".into(),
            completion_window: "24h".into(),
            metadata: Default::default(),
            created_at,
            expires_at: created_at + 86_400,
            model: None,
            output_expires_after: None,
            priority: None,
            plan: ShardPlan { shard_lines: 10, shards: (0..shards).map(shard).collect() },
        };
        let mut resource = BatchResource::new(&name, BatchResourceSpec::recorded(spec));
        resource.metadata.uid = Some(format!("uid-{name}"));
        resource.status = Some(BatchState::in_progress(created_at, u64::from(shards) * 10));
        Arc::new(resource)
    }

    fn job(batch: &BatchResource, index: u32, complete: bool) -> Arc<Job> {
        let spec = batch.accepted().unwrap();
        let mut job = shard_job(batch, spec, &shard(index), 0, &WorkerTemplate::default(), None);
        if complete {
            let condition = JobCondition { type_: "Complete".into(), status: "True".into(), ..Default::default() };
            job.status = Some(JobStatus { conditions: Some(vec![condition]), ..Default::default() });
        }
        Arc::new(job)
    }

    #[test]
    fn an_allotment_is_reused_while_fresh_and_the_running_jobs_are_as_many() {
        let mut allotments = Allotments::default();
        let start = Instant::now();
        let shares = |n: usize| move || HashMap::from([("a".to_owned(), n), ("b".to_owned(), 1)]);
        assert_eq!(allotments.share_of("a", 3, start, shares(2)), 2);
        assert_eq!(allotments.share_of("a", 3, start + FRESH / 2, shares(5)), 2, "fresh: reused");
        assert_eq!(allotments.share_of("b", 3, start + FRESH / 2, shares(5)), 1);
        assert_eq!(allotments.share_of("a", 4, start + FRESH / 2, shares(5)), 5, "a Job more: anew");
        assert_eq!(allotments.share_of("c", 4, start + FRESH / 2, shares(6)), 0, "unknown: anew");
        assert_eq!(allotments.share_of("a", 4, start + FRESH / 2, shares(7)), 6);
        assert_eq!(allotments.share_of("a", 4, start + FRESH * 2, shares(7)), 7, "stale: anew");
    }

    #[test]
    fn a_burst_made_in_one_second_takes_every_slot() {
        let (a, b) = (ProjectId::generate(), ProjectId::generate());
        let burst: Vec<_> = (0..17).map(|n| batch(if n < 12 { &a } else { &b }, 1, 100)).collect();
        let weights = HashMap::new();
        for scheduling in [Scheduling::Fair, Scheduling::Fifo] {
            let started: usize = burst.iter().map(|ours| share(ours, &burst, &[], &weights, scheduling, 16)).sum();
            assert_eq!(started, 16, "{scheduling:?}: every slot is some Batch's");
        }
    }

    #[test]
    fn a_small_batch_gets_a_slot_beside_a_big_one_that_started_first() {
        let (a, b) = (ProjectId::generate(), ProjectId::generate());
        let big = batch(&a, 8, 100);
        let small = batch(&b, 1, 200);
        let batches = [big.clone(), small.clone()];
        let jobs: Vec<Arc<Job>> = (0..4).map(|i| job(&big, i, false)).collect();
        let weights = HashMap::new();
        let of = |batch: &BatchResource, scheduling| share(batch, &batches, &jobs, &weights, scheduling, 4);
        let fair = (of(&big, Scheduling::Fair), of(&small, Scheduling::Fair));
        assert_eq!(fair, (3, 1), "the big one keeps 3 of its 4, the next free slot is the small one's");
        let fifo = (of(&big, Scheduling::Fifo), of(&small, Scheduling::Fifo));
        assert_eq!(fifo, (4, 0), "first come, first served");
    }

    #[test]
    fn projects_share_by_weight_and_finished_shards_leave_their_slots() {
        let (a, b) = (ProjectId::generate(), ProjectId::generate());
        let first = batch(&a, 20, 100);
        let second = batch(&b, 20, 200);
        let batches = [first.clone(), second.clone()];
        let weights: HashMap<String, u32> = [(b.to_string(), 3)].into();
        let of = |batch: &BatchResource, jobs: &[Arc<Job>]| share(batch, &batches, jobs, &weights, Scheduling::Fair, 8);
        assert_eq!((of(&first, &[]), of(&second, &[])), (2, 6), "weights 1 and 3");
        // 19 of the second's shards are done: one is left, and the first takes the rest.
        let done: Vec<Arc<Job>> = (0..19).map(|i| job(&second, i, true)).collect();
        assert_eq!((of(&first, &done), of(&second, &done)), (7, 1));
    }

    #[test]
    fn the_batch_driven_counts_with_the_others_whatever_the_cache_says_of_it() {
        let project = ProjectId::generate();
        let first = batch(&project, 4, 100);
        let mut ending = (*batch(&project, 4, 50)).clone();
        ending.status = Some(BatchState::failed(100, Vec::new()));
        // Just gone in progress: the cache has it without a status yet, or not at all.
        let mut newcomer = (*batch(&project, 4, 200)).clone();
        newcomer.status = None;
        let cached = [Arc::new(ending.clone()), first.clone(), Arc::new(newcomer.clone())];
        let of = |batch: &BatchResource, batches: &[Arc<BatchResource>]| {
            share(batch, batches, &[], &HashMap::new(), Scheduling::Fifo, 5)
        };
        assert_eq!(of(&newcomer, &cached), 1, "after the 4 of the first, not the 5 free");
        assert_eq!(of(&newcomer, &cached[..2]), 1);
        assert_eq!(of(&first, &cached), 4, "it has 4 shards; the ending one counts for nothing");
    }
}
