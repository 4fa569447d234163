//! Which workers to start, stop or retire, given the decision and the workers a runtime
//! knows of. Pure: the embedded runtime's tasks and the controller's Jobs both follow it.

use std::collections::BTreeMap;

use crate::lifecycle::decide::Action;

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

/// What becomes of the failed workers that [`plan`] retires, under a retry budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budgeted {
    /// Failed runs by shard, the retired ones counted.
    pub failures: BTreeMap<u32, u32>,
    /// Shards that start again.
    pub retry: Vec<u32>,
    /// Shards out of retries: their lines without a record get a failure record.
    pub give_up: Vec<u32>,
}

/// Counts one failed run for each `retired` shard: a shard may fail `max_retries` times
/// and start again; the next failure gives it up.
pub fn budget(retired: &[u32], failures: &BTreeMap<u32, u32>, max_retries: u32) -> Budgeted {
    let mut budgeted = Budgeted { failures: failures.clone(), ..Budgeted::default() };
    for &shard in retired {
        let runs = budgeted.failures.entry(shard).or_insert(0);
        *runs += 1;
        if *runs > max_retries {
            budgeted.give_up.push(shard);
        } else {
            budgeted.retry.push(shard);
        }
    }
    budgeted
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

    /// A row: what it shows, the shards retired, the failures so far, the budget, the result.
    type BudgetRow = (&'static str, Vec<u32>, BTreeMap<u32, u32>, u32, Budgeted);

    #[test]
    fn failed_runs_are_counted_against_the_budget() {
        let counts = |list: &[(u32, u32)]| list.iter().copied().collect::<BTreeMap<u32, u32>>();
        #[rustfmt::skip]
        let table: Vec<BudgetRow> = vec![
            ("nothing failed", vec![], counts(&[(1, 2)]), 3,
             Budgeted { failures: counts(&[(1, 2)]), ..Budgeted::default() }),
            ("a first failure is retried", vec![0], counts(&[]), 3,
             Budgeted { failures: counts(&[(0, 1)]), retry: vec![0], give_up: vec![] }),
            ("the last retry", vec![0], counts(&[(0, 2)]), 3,
             Budgeted { failures: counts(&[(0, 3)]), retry: vec![0], give_up: vec![] }),
            ("one failure past the budget gives up", vec![0], counts(&[(0, 3)]), 3,
             Budgeted { failures: counts(&[(0, 4)]), retry: vec![], give_up: vec![0] }),
            ("no retries: the first failure gives up", vec![5], counts(&[]), 0,
             Budgeted { failures: counts(&[(5, 1)]), retry: vec![], give_up: vec![5] }),
            ("shards count apart", vec![0, 1], counts(&[(1, 1)]), 1,
             Budgeted { failures: counts(&[(0, 1), (1, 2)]), retry: vec![0], give_up: vec![1] }),
        ];
        for (case, retired, failures, max, expected) in table {
            assert_eq!(budget(&retired, &failures, max), expected, "{case}");
        }
    }
}
