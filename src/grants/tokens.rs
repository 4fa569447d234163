//! How a project's token quota is shared among its running workers. Pure.
//!
//! What the project may still come to spend is what is committed outside its running
//! workers' shards, plus, for each running worker, what its shard had committed when
//! the worker started and the larger of its allowance and what it spent. What is left
//! under the quota is handed out in slices to the workers running low; when nothing is
//! left and every worker waits, the quota is exhausted and their lines fail.

use std::collections::BTreeMap;

use super::TokenGrant;

/// One running worker of the project, from its last acknowledgment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenRun {
    pub worker: String,
    /// The run (pod) that acknowledged; empty when none has yet: it gets nothing.
    pub run: String,
    /// Tokens its shard had committed when the run started.
    pub base: u64,
    pub spent: u64,
    /// What this run was granted (0 when the grant was for an earlier run).
    pub allowance: u64,
    pub waiting: bool,
}

impl TokenRun {
    /// Its allowance as it counts: an unbounded one (its project had no quota when it
    /// was granted) is taken back to what it spent.
    fn allowance(&self) -> u64 {
        if self.allowance == u64::MAX { self.spent } else { self.allowance }
    }
}

/// The next token grant of every running worker that has a run.
pub fn divide_tokens(quota: u64, committed: u64, runs: &[TokenRun]) -> BTreeMap<String, TokenGrant> {
    let potential: u64 = committed + runs.iter().map(|r| r.base + r.allowance().max(r.spent)).sum::<u64>();
    let mut free = quota.saturating_sub(potential);
    let grantable: Vec<&TokenRun> = runs.iter().filter(|r| !r.run.is_empty()).collect();
    let exhausted = free == 0 && !grantable.is_empty() && runs.iter().all(|r| r.waiting || r.run.is_empty());
    let slice = (free / grantable.len().max(1) as u64).max(1);
    let mut grants = BTreeMap::new();
    for run in grantable {
        let left = run.allowance().saturating_sub(run.spent);
        let mut allowance = run.allowance();
        // Top up a run that is low: below half a slice left, or waiting.
        if free > 0 && (run.waiting || left < slice.div_ceil(2)) {
            let more = slice.min(free);
            free -= more;
            allowance = allowance.max(run.spent) + more;
        }
        grants.insert(run.worker.clone(), TokenGrant { run: run.run.clone(), allowance, exhausted });
    }
    grants
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(worker: &str, base: u64, spent: u64, allowance: u64, waiting: bool) -> TokenRun {
        TokenRun { worker: worker.into(), run: format!("{worker}-1"), base, spent, allowance, waiting }
    }

    fn allowances(grants: &BTreeMap<String, TokenGrant>) -> Vec<(String, u64, bool)> {
        grants.iter().map(|(w, g)| (w.clone(), g.allowance, g.exhausted)).collect()
    }

    /// Runs every worker to spend all it is granted, `rounds` times; returns what was
    /// spent in all and whether the quota ended exhausted.
    fn spend_all(quota: u64, committed: u64, workers: usize, line: u64) -> (u64, bool) {
        let mut runs: Vec<TokenRun> = (0..workers).map(|w| run(&format!("w{w}"), 0, 0, 0, true)).collect();
        for _ in 0..1000 {
            let grants = divide_tokens(quota, committed, &runs);
            if grants.values().all(|g| g.exhausted) {
                return (committed + runs.iter().map(|r| r.spent).sum::<u64>(), true);
            }
            for r in &mut runs {
                r.allowance = grants[&r.worker].allowance;
                // A line is sent while something is left; its tokens are known after.
                while r.spent < r.allowance {
                    r.spent += line;
                }
                r.waiting = true;
            }
        }
        panic!("never exhausted");
    }

    #[test]
    fn what_is_left_is_sliced_among_the_workers() {
        let runs = [run("a", 0, 0, 0, true), run("b", 0, 0, 0, true)];
        assert_eq!(allowances(&divide_tokens(100, 20, &runs)), [("a".into(), 40, false), ("b".into(), 40, false)]);
    }

    #[test]
    fn a_worker_with_enough_left_is_not_topped_up() {
        let runs = [run("a", 0, 10, 50, false), run("b", 0, 40, 40, true)];
        // potential: 50 + 40 = 90; 10 free, sliced by 2: 5 each, and only b is low.
        let grants = divide_tokens(100, 0, &runs);
        assert_eq!(allowances(&grants), [("a".into(), 50, false), ("b".into(), 45, false)]);
    }

    #[test]
    fn the_quota_is_exhausted_only_once_nothing_is_free_and_everyone_waits() {
        let waiting = [run("a", 0, 50, 50, true), run("b", 10, 40, 40, true)];
        assert!(divide_tokens(100, 0, &waiting).values().all(|g| g.exhausted));
        let one_still_spending = [run("a", 0, 50, 50, true), run("b", 10, 20, 40, false)];
        assert!(divide_tokens(100, 0, &one_still_spending).values().all(|g| !g.exhausted), "b may give some back");
    }

    #[test]
    fn a_run_that_has_not_acknowledged_gets_nothing_but_counts() {
        let runs = [TokenRun { worker: "a".into(), base: 30, ..TokenRun::default() }, run("b", 0, 0, 0, true)];
        let grants = divide_tokens(100, 0, &runs);
        assert!(!grants.contains_key("a"));
        assert_eq!(grants["b"].allowance, 70, "a's shard committed 30 before");
    }

    #[test]
    fn a_quota_set_on_a_project_while_its_workers_run_takes_their_unbounded_grants_back() {
        let runs = [run("a", 0, 30, u64::MAX, false), run("b", 0, 10, u64::MAX, false)];
        let grants = divide_tokens(60, 0, &runs);
        assert_eq!(allowances(&grants), [("a".into(), 40, false), ("b".into(), 20, false)]);
        assert!(
            divide_tokens(20, 0, &runs).values().all(|g| g.allowance <= 30 && !g.exhausted),
            "over already: no more"
        );
    }

    #[test]
    fn spend_never_passes_the_quota_by_more_than_a_line_per_worker() {
        for (quota, committed, workers, line) in
            [(1000, 0, 4, 7), (1000, 900, 8, 5), (50, 0, 3, 20), (10_000, 123, 16, 33)]
        {
            let (spent, exhausted) = spend_all(quota, committed, workers, line);
            assert!(exhausted);
            let overshoot = spent.saturating_sub(quota);
            assert!(overshoot < workers as u64 * line, "{quota}/{workers}/{line}: spent {spent}");
        }
    }
}
