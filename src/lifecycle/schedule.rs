//! Which batches run when capacity is short: shards (and so the upstream's permits,
//! which running shards take in turn) are shared between projects in proportion to
//! their weights, so that one project's 50,000 lines can't starve another's 100; within
//! a project, the batch whose window ends first goes first (earliest deadline first).
//! Pure: the runner (`serve`) and the controller (Kubernetes) act on its answers.

/// A batch that has shards left to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate<P> {
    pub project: P,
    /// The project's weight (1 unless configured).
    pub weight: u32,
    /// When the batch expires (unix seconds): its deadline.
    pub expires_at: i64,
    /// Created at (unix seconds), for ties.
    pub created_at: i64,
    /// The batch's id, for ties of deadline and creation (a burst of batches made in one
    /// second): every pass, of every process, ranks the same batches alike. By position
    /// instead, each Batch the controller drives (put last) saw the others first, and of
    /// 17 made in one second with 16 slots, none ever started.
    pub id: String,
    /// Shards it could run now (unfinished ones, running or not).
    pub shards: usize,
}

/// How many shards each candidate may run, of `slots` in all. Slots go one at a time to
/// the project furthest below its weighted share (water-filling: a project that needs
/// fewer leaves the rest to the others), ties to the earliest deadline; within the
/// project, to its batch with the earliest deadline that wants more.
pub fn allot<P: PartialEq>(slots: usize, candidates: &[Candidate<P>]) -> Vec<usize> {
    let mut given = vec![0usize; candidates.len()];
    // Projects by their first candidate, with the slots they have so far.
    let mut projects: Vec<(usize, usize)> = Vec::new();
    for (at, candidate) in candidates.iter().enumerate() {
        if !projects.iter().any(|(first, _)| candidates[*first].project == candidate.project) {
            projects.push((at, 0));
        }
    }
    for _ in 0..slots {
        // The most urgent batch of each project that wants more.
        let next = |project: &P| {
            (0..candidates.len())
                .filter(|&at| candidates[at].project == *project && given[at] < candidates[at].shards)
                .min_by_key(|&at| rank(&candidates[at]))
        };
        let choice = projects
            .iter_mut()
            .filter_map(|(first, held)| {
                let candidate = next(&candidates[*first].project)?;
                Some((held, candidate, candidates[*first].weight.max(1)))
            })
            .min_by(|(a_held, a, a_weight), (b_held, b, b_weight)| {
                // held/weight compared without division: a/wa < b/wb ⇔ a·wb < b·wa.
                let share = (**a_held as u64 * u64::from(*b_weight)).cmp(&(**b_held as u64 * u64::from(*a_weight)));
                share.then(rank(&candidates[*a]).cmp(&rank(&candidates[*b])))
            });
        let Some((held, candidate, _)) = choice else { break };
        *held += 1;
        given[candidate] += 1;
    }
    given
}

/// Which of two batches goes first: the earlier deadline, the older, the smaller id.
fn rank<P>(candidate: &Candidate<P>) -> (i64, i64, &str) {
    (candidate.expires_at, candidate.created_at, &candidate.id)
}

/// First come, first served: the oldest batches take what they can.
pub fn allot_in_order<P>(slots: usize, candidates: &[Candidate<P>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by_key(|&at| (candidates[at].created_at, &candidates[at].id));
    let mut left = slots;
    let mut given = vec![0; candidates.len()];
    for at in order {
        given[at] = candidates[at].shards.min(left);
        left -= given[at];
    }
    given
}

/// `limit` (an upstream's requests in flight) divided among workers, each named by its
/// project and that project's weight: projects in proportion to their weights, a
/// project's part equally among its workers; whole numbers that add up to `limit`
/// (largest remainders first, then the order given).
pub fn shares<P: PartialEq>(limit: u32, workers: &[(P, u32)]) -> Vec<u32> {
    if workers.is_empty() {
        return Vec::new();
    }
    let members = |project: &P| workers.iter().filter(|(p, _)| p == project).count() as f64;
    let mut total_weight = 0.0;
    for (at, (project, weight)) in workers.iter().enumerate() {
        if workers[..at].iter().all(|(p, _)| p != project) {
            total_weight += f64::from((*weight).max(1));
        }
    }
    let exact: Vec<f64> = workers
        .iter()
        .map(|(project, weight)| f64::from(limit) * f64::from((*weight).max(1)) / total_weight / members(project))
        .collect();
    let mut given: Vec<u32> = exact.iter().map(|x| x.floor() as u32).collect();
    let mut left = limit.saturating_sub(given.iter().sum());
    let mut order: Vec<usize> = (0..workers.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for at in order.into_iter().cycle() {
        if left == 0 {
            break;
        }
        given[at] += 1;
        left -= 1;
    }
    given
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(project: &'static str, weight: u32, expires_at: i64, shards: usize) -> Candidate<&'static str> {
        let id = format!("batch_{project}_{expires_at}_{shards}");
        Candidate { project, weight, expires_at, created_at: expires_at - 86_400, id, shards }
    }

    /// Batches made in one second are ranked by id wherever they stand in the list: each
    /// Batch the controller drives comes last in its own list, and all must agree.
    #[test]
    fn ties_go_by_id_not_by_place_in_the_list() {
        let burst: Vec<Candidate<&'static str>> = (0..17)
            .map(|n| Candidate { id: format!("batch_{n:02}"), ..batch(if n % 2 == 0 { "a" } else { "b" }, 1, 100, 1) })
            .collect();
        for allot in [allot::<&str>, allot_in_order::<&str>] {
            let mut started = 0;
            for ours in 0..burst.len() {
                // Its own view: the others first, itself last.
                let mut view: Vec<_> =
                    burst.iter().enumerate().filter(|(at, _)| *at != ours).map(|(_, c)| c.clone()).collect();
                view.push(burst[ours].clone());
                started += allot(16, &view)[view.len() - 1];
            }
            assert_eq!(started, 16, "every slot is someone's");
        }
    }

    #[test]
    fn slots_are_shared_by_weight_between_projects() {
        type Case = (usize, Vec<Candidate<&'static str>>, Vec<usize>);
        let cases: [Case; 6] = [
            // A huge batch and a small one: the small one gets its share at once.
            (2, vec![batch("a", 1, 100, 50), batch("b", 1, 200, 1)], vec![1, 1]),
            (8, vec![batch("a", 1, 100, 50), batch("b", 1, 200, 1)], vec![7, 1]),
            // Weights 3:1.
            (8, vec![batch("a", 3, 100, 50), batch("b", 1, 200, 50)], vec![6, 2]),
            // Nothing to run: nothing given.
            (4, vec![batch("a", 1, 100, 0)], vec![0]),
            // More slots than shards.
            (10, vec![batch("a", 1, 100, 2), batch("b", 5, 100, 3)], vec![2, 3]),
            // Three projects, one slot each before anyone gets a second.
            (3, vec![batch("a", 1, 300, 9), batch("b", 1, 200, 9), batch("c", 1, 100, 9)], vec![1, 1, 1]),
        ];
        for (slots, candidates, expected) in cases {
            assert_eq!(allot(slots, &candidates), expected, "{slots} slots: {candidates:?}");
        }
    }

    #[test]
    fn within_a_project_and_between_equals_the_earliest_deadline_goes_first() {
        // One project: the batch expiring first takes what it wants first.
        let one = vec![batch("a", 1, 500, 3), batch("a", 1, 100, 2), batch("a", 1, 300, 9)];
        assert_eq!(allot(4, &one), vec![0, 2, 2]);
        // Two equal projects and one slot: the earlier deadline.
        let two = vec![batch("a", 1, 500, 3), batch("b", 1, 100, 3)];
        assert_eq!(allot(1, &two), vec![0, 1]);
        // A weight of 0 counts as 1.
        assert_eq!(allot(2, &[batch("a", 0, 100, 5), batch("b", 1, 100, 5)]), vec![1, 1]);
    }

    #[test]
    fn an_upstream_is_shared_by_project_weight_then_equally_within() {
        type Case = (u32, Vec<(&'static str, u32)>, Vec<u32>);
        let cases: [Case; 6] = [
            (6, vec![("a", 1), ("a", 1), ("b", 1)], vec![2, 1, 3]),
            (8, vec![("a", 3), ("b", 1)], vec![6, 2]),
            (7, vec![("a", 1), ("b", 1), ("c", 1)], vec![3, 2, 2]),
            (2, vec![("a", 1), ("b", 1), ("c", 1)], vec![1, 1, 0]),
            (0, vec![("a", 1)], vec![0]),
            (10, vec![], vec![]),
        ];
        for (limit, workers, expected) in cases {
            let given = shares(limit, &workers);
            assert_eq!(given, expected, "{limit} among {workers:?}");
            assert_eq!(given.iter().sum::<u32>(), if workers.is_empty() { 0 } else { limit }, "whole");
        }
    }

    #[test]
    fn in_order_the_oldest_takes_all() {
        let candidates = vec![batch("a", 1, 200, 5), batch("b", 9, 100, 5)];
        assert_eq!(allot_in_order(6, &candidates), vec![1, 5], "b was created first");
        assert_eq!(allot_in_order(3, &candidates), vec![0, 3]);
    }
}
