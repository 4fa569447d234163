//! Which workers to start, stop or retire, given the decision and the workers a runtime
//! knows of. Pure: the embedded runtime's tasks and the controller's Jobs both follow it.

use std::collections::BTreeMap;

use crate::reconcile::Action;

/// A shard's worker, as its runtime reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerPhase {
    /// Running (or about to): it may still commit.
    Running,
    /// Exited having run its shard to the end or to a stop.
    Succeeded,
    /// Gave up (a Job past its pod retries): it must be retired before the shard starts again.
    Failed,
}

/// What to do to the workers of one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerPlan {
    pub start: Vec<u32>,
    pub stop: Vec<u32>,
    /// Failed workers to remove; their shards start afresh on a later pass.
    pub retire: Vec<u32>,
}

/// Plans `action` against `workers` (by shard). `free_slots` bounds how many workers may
/// start now over every batch (`None`: no bound).
pub fn plan(action: &Action, workers: &BTreeMap<u32, WorkerPhase>, free_slots: Option<usize>) -> WorkerPlan {
    let mut plan = WorkerPlan::default();
    match action {
        Action::Run(shards) => {
            let mut slots = free_slots.unwrap_or(usize::MAX);
            for &shard in shards {
                match workers.get(&shard) {
                    Some(WorkerPhase::Failed) => plan.retire.push(shard),
                    // A worker that ran, or runs, stands until it is retired or gone.
                    Some(WorkerPhase::Running | WorkerPhase::Succeeded) => {}
                    None if slots > 0 => {
                        slots -= 1;
                        plan.start.push(shard);
                    }
                    None => {}
                }
            }
        }
        Action::Stop => {
            plan.stop = workers.iter().filter(|(_, phase)| **phase == WorkerPhase::Running).map(|(s, _)| *s).collect();
        }
        Action::Wait | Action::Drain(_) | Action::Finalize(_) => {}
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::WorkerPhase::{Failed, Running, Succeeded};
    use super::*;
    use crate::batches::Ending;

    fn workers(list: &[(u32, WorkerPhase)]) -> BTreeMap<u32, WorkerPhase> {
        list.iter().copied().collect()
    }

    /// A row: what it shows, the decision's action, the workers, the free slots, the plan.
    type Row = (&'static str, Action, BTreeMap<u32, WorkerPhase>, Option<usize>, WorkerPlan);

    #[test]
    fn plans_by_table() {
        let run = |shards: &[u32]| Action::Run(shards.to_vec());
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            ("run: start every idle shard",
             run(&[0, 1, 2]), workers(&[]), None,
             WorkerPlan { start: vec![0, 1, 2], ..WorkerPlan::default() }),
            ("run: slots bound the starts, in shard order",
             run(&[0, 1, 2]), workers(&[]), Some(2),
             WorkerPlan { start: vec![0, 1], ..WorkerPlan::default() }),
            ("run: no slot, no start",
             run(&[0]), workers(&[]), Some(0),
             WorkerPlan::default()),
            ("run: a running or finished worker is left alone",
             run(&[0, 1, 2]), workers(&[(0, Running), (1, Succeeded)]), None,
             WorkerPlan { start: vec![2], ..WorkerPlan::default() }),
            ("run: a failed worker is retired, not started over in the same pass",
             run(&[0, 1]), workers(&[(0, Failed)]), Some(1),
             WorkerPlan { start: vec![1], retire: vec![0], ..WorkerPlan::default() }),
            ("run: retiring needs no slot",
             run(&[0]), workers(&[(0, Failed)]), Some(0),
             WorkerPlan { retire: vec![0], ..WorkerPlan::default() }),
            ("stop: only running workers are stopped",
             Action::Stop, workers(&[(0, Running), (1, Succeeded), (2, Failed), (3, Running)]), None,
             WorkerPlan { stop: vec![0, 3], ..WorkerPlan::default() }),
            ("wait: nothing",
             Action::Wait, workers(&[(0, Running)]), None,
             WorkerPlan::default()),
            ("drain: nothing (the driver drains)",
             Action::Drain(Ending::Cancelled), workers(&[(0, Failed)]), None,
             WorkerPlan::default()),
            ("finalize: nothing (the driver finalizes)",
             Action::Finalize(Ending::Completed), workers(&[(0, Succeeded)]), None,
             WorkerPlan::default()),
        ];
        for (case, action, workers, slots, expected) in table {
            assert_eq!(plan(&action, &workers, slots), expected, "{case}");
        }
    }
}
