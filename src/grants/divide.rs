//! How an upstream's limit is divided among workers. Pure.
//!
//! Every worker that wants an upstream (or has not said yet) is aimed at its share of
//! its limit: projects by weight, a project's part equally among its workers
//! ([`shares`]). A worker whose last grant is not acknowledged yet is left as it is; the
//! others shrink to their share at once (a shrink never adds to what is held) and grow
//! toward it from what nobody holds. A worker holds the larger of its grant and its
//! acknowledgment, and the sum of what workers hold never exceeds the limit.

use std::collections::BTreeMap;

use super::{Ack, Grant, Observation};
use crate::concurrency::view::{self, View};
use crate::lifecycle::schedule::shares;

/// One worker as the controller sees it: what it was last granted and what it last
/// acknowledged (`None`: it has not answered yet).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    pub granted: Grant,
    pub acked: Option<Ack>,
}

impl Seen {
    fn granted(&self, upstream: &str) -> u32 {
        self.granted.upstreams.get(upstream).copied().unwrap_or(0)
    }

    fn acked(&self, upstream: &str) -> u32 {
        self.acked.as_ref().and_then(|ack| ack.upstreams.get(upstream)).copied().unwrap_or(0)
    }

    /// What the worker may be using now.
    fn holds(&self, upstream: &str) -> u32 {
        self.granted(upstream).max(self.acked(upstream))
    }

    /// Its last grant is applied: it may be given a new one.
    fn settled(&self) -> bool {
        match &self.acked {
            Some(ack) => {
                self.granted.upstreams.iter().all(|(name, n)| ack.upstreams.get(name).copied().unwrap_or(0) == *n)
            }
            None => self.granted.upstreams.values().all(|n| *n == 0),
        }
    }

    /// A worker that has not said what it wants may want anything.
    fn wants(&self, upstream: &str) -> bool {
        self.acked.as_ref().is_none_or(|ack| ack.wants.contains(upstream))
    }
}

/// The next grant of every worker (`workers` by name), given each upstream's limit and
/// each worker's project and its weight (`projects`; a worker missing there is a project
/// of weight 1 of its own).
pub fn divide(
    limits: &BTreeMap<String, u32>,
    workers: &BTreeMap<String, Seen>,
    projects: &BTreeMap<String, (String, u32)>,
) -> BTreeMap<String, Grant> {
    let mut next: BTreeMap<String, Grant> =
        workers.iter().map(|(name, seen)| (name.clone(), seen.granted.clone())).collect();
    for (upstream, &limit) in limits {
        let wanting: Vec<&String> =
            workers.iter().filter(|(_, seen)| seen.wants(upstream)).map(|(name, _)| name).collect();
        let members: Vec<(&str, u32)> = wanting
            .iter()
            .map(|name| projects.get(*name).map_or((name.as_str(), 1), |(project, weight)| (project.as_str(), *weight)))
            .collect();
        let targets = shares(limit, &members);
        let target =
            |name: &String| -> u32 { wanting.iter().position(|w| *w == name).map_or(0, |position| targets[position]) };
        // Shrinks first: they free capacity without taking any.
        for (name, seen) in workers {
            if seen.settled() && target(name) < seen.granted(upstream) {
                next.get_mut(name).expect("every worker").upstreams.insert(upstream.clone(), target(name));
            }
        }
        let held: u32 = workers
            .iter()
            .map(|(name, seen)| {
                let granted = next[name].upstreams.get(upstream).copied().unwrap_or(0);
                granted.max(seen.acked(upstream))
            })
            .sum();
        let mut free = limit.saturating_sub(held);
        for (name, seen) in workers {
            let current = seen.granted(upstream);
            if free == 0 || !seen.settled() || target(name) <= current {
                continue;
            }
            let more = (target(name) - current).min(free);
            free -= more;
            next.get_mut(name).expect("every worker").upstreams.insert(upstream.clone(), current + more);
        }
        let users = seen_users(workers, upstream);
        for (name, seen) in workers {
            let grant = next.get_mut(name).expect("every worker");
            if seen.holds(upstream) == 0 && grant.upstreams.get(upstream) == Some(&0) {
                grant.upstreams.remove(upstream);
            }
            if grant.upstreams.contains_key(upstream) {
                let sharing = wanting.len().max(1).try_into().unwrap_or(u32::MAX);
                grant.sharing.insert(upstream.clone(), sharing);
                let turn = wanting.iter().position(|wants| *wants == name).unwrap_or(wanting.len());
                grant.turn.insert(upstream.clone(), turn.try_into().unwrap_or(u32::MAX));
                match users {
                    Some(users) => grant
                        .users
                        .insert(upstream.clone(), view::steady(seen.granted.users.get(upstream).copied(), users)),
                    None => grant.users.remove(upstream),
                };
            } else {
                grant.sharing.remove(upstream);
                grant.turn.remove(upstream);
                grant.users.remove(upstream);
            }
        }
    }
    next
}

/// The users' requests at `upstream` as the workers saw them together
/// ([`view::users`]).
fn seen_users(workers: &BTreeMap<String, Seen>, upstream: &str) -> Option<u64> {
    let observed: Vec<_> = workers.values().filter_map(|seen| seen.acked.as_ref()?.observed.get(upstream)).collect();
    let beat = view::beat(&observed.iter().filter_map(|observed| observed.view).collect::<Vec<_>>());
    let (views, unseen): (Vec<&Observation>, Vec<&Observation>) =
        observed.into_iter().partition(|observed| observed.view.is_some_and(|view| Some(view.until) == beat));
    let views: Vec<View> = views.iter().filter_map(|observed| observed.view).collect();
    view::users(&views, unseen.iter().map(|observed| 1000 * u64::from(observed.in_flight)).sum())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn upstreams(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(name, n)| ((*name).to_owned(), *n)).collect()
    }

    fn grant(pairs: &[(&str, u32)]) -> Grant {
        Grant { upstreams: upstreams(pairs), ..Grant::default() }
    }

    fn ack(pairs: &[(&str, u32)], wants: &[&str]) -> Ack {
        Ack {
            upstreams: pairs.iter().map(|(name, n)| ((*name).to_owned(), *n)).collect(),
            wants: wants.iter().map(|w| (*w).to_owned()).collect::<BTreeSet<_>>(),
            ..Ack::default()
        }
    }

    fn held(limits: &BTreeMap<String, u32>, workers: &BTreeMap<String, Seen>, next: &BTreeMap<String, Grant>) {
        for (upstream, limit) in limits {
            let total: u32 = workers
                .iter()
                .map(|(name, seen)| next[name].upstreams.get(upstream).copied().unwrap_or(0).max(seen.acked(upstream)))
                .sum();
            assert!(total <= *limit, "{upstream}: {total} held over a limit of {limit}: {next:?}");
        }
    }

    /// Runs the protocol until nothing changes: each round, workers acknowledge their
    /// grant (wanting `wants`); returns the final grants.
    fn settle(
        limits: &BTreeMap<String, u32>,
        mut workers: BTreeMap<String, Seen>,
        wants: &[&str],
    ) -> BTreeMap<String, Grant> {
        for _ in 0..10 {
            let next = divide(limits, &workers, &BTreeMap::new());
            held(limits, &workers, &next);
            for (name, seen) in workers.iter_mut() {
                seen.granted = next[name].clone();
                let pairs: Vec<(&str, u32)> = next[name].upstreams.iter().map(|(u, n)| (u.as_str(), *n)).collect();
                seen.acked = Some(ack(&pairs, wants));
            }
        }
        workers.into_iter().map(|(name, seen)| (name, seen.granted)).collect()
    }

    fn limits(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(name, n)| ((*name).to_owned(), *n)).collect()
    }

    fn fresh(names: &[&str]) -> BTreeMap<String, Seen> {
        names.iter().map(|n| ((*n).to_owned(), Seen::default())).collect()
    }

    #[test]
    fn a_limit_is_divided_equally_and_whole() {
        let limits = limits(&[("vllm", 64)]);
        let grants = settle(&limits, fresh(&["a", "b", "c", "d", "e", "f", "g", "h"]), &["vllm"]);
        let shares: Vec<u32> = grants.values().map(|g| g.upstreams["vllm"]).collect();
        assert_eq!(shares, [8; 8]);
        let grants = settle(&limits, fresh(&["a", "b", "c"]), &["vllm"]);
        let shares: Vec<u32> = grants.values().map(|g| g.upstreams["vllm"]).collect();
        assert_eq!(shares, [22, 21, 21], "the remainder goes to the first");
    }

    #[test]
    fn each_grant_says_how_many_workers_send_to_the_upstream() {
        let limits = limits(&[("vllm", 64), ("tgi", 8)]);
        let mut workers = fresh(&["a", "b", "c"]);
        workers.get_mut("c").unwrap().acked = Some(ack(&[], &["tgi"]));
        let next = divide(&limits, &workers, &BTreeMap::new());
        let sharing = |name: &str| next[name].sharing.clone().into_iter().collect::<Vec<_>>();
        assert_eq!(sharing("a"), [("tgi".to_owned(), 3), ("vllm".to_owned(), 2)]);
        assert_eq!(sharing("c"), [("tgi".to_owned(), 3)], "c does not send to vllm");
        let turn = |name: &str| next[name].turn.clone().into_iter().collect::<Vec<_>>();
        assert_eq!(turn("a"), [("tgi".to_owned(), 0), ("vllm".to_owned(), 0)]);
        assert_eq!(turn("b"), [("tgi".to_owned(), 1), ("vllm".to_owned(), 1)]);
        assert_eq!(turn("c"), [("tgi".to_owned(), 2)]);
    }

    #[test]
    fn each_grant_says_what_users_the_workers_saw_at_the_upstream_together() {
        let limits = limits(&[("vllm", 64), ("tgi", 8)]);
        let mut workers = fresh(&["a", "b", "c"]);
        // Two users at vllm: a and b see them, and each other's lines.
        let observed = |view: Option<View>, in_flight| Observation { view, in_flight, ..Observation::default() };
        let saw = |others, ours| Some(View { others, ours, until: 1_000 });
        let acked = |upstream: &str, observation| Ack {
            observed: [(upstream.to_owned(), observation)].into(),
            ..ack(&[], &["vllm", "tgi"])
        };
        workers.get_mut("a").unwrap().acked = Some(acked("vllm", observed(saw(2_000 + 5_000, 3_000), 3)));
        workers.get_mut("b").unwrap().acked = Some(acked("vllm", observed(saw(2_000 + 3_000, 5_000), 5)));
        let next = divide(&limits, &workers, &BTreeMap::new());
        for name in ["a", "b", "c"] {
            assert_eq!(next[name].users.get("vllm"), Some(&2_000), "{name}");
            assert_eq!(next[name].users.get("tgi"), None, "nobody read its signal: {name}");
        }
        // Granted so, and seen a little otherwise: the grants stay as they are (a write each).
        for name in ["a", "b", "c"] {
            workers.get_mut(name).unwrap().granted = next[name].clone();
        }
        workers.get_mut("b").unwrap().acked = Some(acked("vllm", observed(saw(2_100 + 3_000, 5_000), 5)));
        assert_eq!(divide(&limits, &workers, &BTreeMap::new()), next);
        workers.get_mut("b").unwrap().acked = Some(acked("vllm", observed(saw(3_000 + 3_000, 5_000), 5)));
        assert_eq!(divide(&limits, &workers, &BTreeMap::new())["a"].users.get("vllm"), Some(&2_500));
        // b's view is of the beat before, when a's lines were others: its requests in
        // flight stand for its lines.
        let before = Some(View { others: 9_000, ours: 1_000, until: 500 });
        workers.get_mut("b").unwrap().acked = Some(acked("vllm", observed(before, 5)));
        assert_eq!(divide(&limits, &workers, &BTreeMap::new())["a"].users.get("vllm"), Some(&2_000));
    }

    #[test]
    fn more_workers_than_the_limit_leaves_some_waiting() {
        let limits = limits(&[("small", 2)]);
        let grants = settle(&limits, fresh(&["a", "b", "c"]), &["small"]);
        let shares: Vec<u32> = grants.values().map(|g| g.upstreams.get("small").copied().unwrap_or(0)).collect();
        assert_eq!(shares, [1, 1, 0]);
    }

    #[test]
    fn a_newcomer_gets_its_share_only_after_the_others_acknowledge_their_shrink() {
        let limits = limits(&[("vllm", 8)]);
        let mut workers = BTreeMap::new();
        workers.insert(
            "a".to_owned(),
            Seen { granted: grant(&[("vllm", 8)]), acked: Some(ack(&[("vllm", 8)], &["vllm"])) },
        );
        workers.insert("b".to_owned(), Seen::default());
        let next = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!(next["a"].upstreams, upstreams(&[("vllm", 4)]), "a shrinks");
        assert_eq!(
            next["b"].upstreams.get("vllm").copied().unwrap_or(0),
            0,
            "a still holds all 8 until it acknowledges"
        );
        // a has not acknowledged yet: nothing moves.
        workers.get_mut("a").unwrap().granted = next["a"].clone();
        let again = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!(again["a"].upstreams, upstreams(&[("vllm", 4)]));
        assert_eq!(again["b"].upstreams.get("vllm").copied().unwrap_or(0), 0);
        // a acknowledges: b gets the rest.
        workers.get_mut("a").unwrap().acked = Some(ack(&[("vllm", 4)], &["vllm"]));
        let after = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!(after["b"].upstreams, upstreams(&[("vllm", 4)]));
    }

    #[test]
    fn an_unacknowledged_grant_is_never_replaced() {
        let limits = limits(&[("vllm", 8)]);
        let mut workers = fresh(&["a"]);
        workers.get_mut("a").unwrap().granted = grant(&[("vllm", 3)]);
        let next = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!(next["a"].upstreams, upstreams(&[("vllm", 3)]), "a grows only once it has applied 3");
    }

    #[test]
    fn upstreams_a_worker_does_not_want_go_to_those_that_do() {
        let limits = limits(&[("a-model", 10), ("b-model", 10)]);
        let mut workers = BTreeMap::new();
        workers.insert("x".to_owned(), Seen { granted: Grant::default(), acked: Some(ack(&[], &["a-model"])) });
        workers.insert("y".to_owned(), Seen { granted: Grant::default(), acked: Some(ack(&[], &["b-model"])) });
        let next = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!(next["x"].upstreams, upstreams(&[("a-model", 10)]));
        assert_eq!(next["y"].upstreams, upstreams(&[("b-model", 10)]));
    }

    #[test]
    fn what_a_finished_worker_held_is_divided_among_the_rest() {
        let limits = limits(&[("vllm", 9)]);
        let settled = |n: u32| Seen { granted: grant(&[("vllm", n)]), acked: Some(ack(&[("vllm", n)], &["vllm"])) };
        // c finished and is gone.
        let workers: BTreeMap<String, Seen> = [("a".to_owned(), settled(3)), ("b".to_owned(), settled(3))].into();
        let next = divide(&limits, &workers, &BTreeMap::new());
        assert_eq!((next["a"].upstreams["vllm"], next["b"].upstreams["vllm"]), (5, 4));
    }

    #[test]
    fn an_acknowledged_holding_above_the_grant_counts_until_it_shrinks() {
        // a was told 2 but still holds 6 (its shrink waits for requests in flight).
        let limits = limits(&[("vllm", 8)]);
        let mut workers = BTreeMap::new();
        workers.insert(
            "a".to_owned(),
            Seen { granted: grant(&[("vllm", 2)]), acked: Some(ack(&[("vllm", 6)], &["vllm"])) },
        );
        workers.insert(
            "b".to_owned(),
            Seen { granted: grant(&[("vllm", 2)]), acked: Some(ack(&[("vllm", 2)], &["vllm"])) },
        );
        let next = divide(&limits, &workers, &BTreeMap::new());
        held(&limits, &workers, &next);
        assert_eq!(next["b"].upstreams, upstreams(&[("vllm", 2)]), "nothing is free while a holds 6");
    }
}
