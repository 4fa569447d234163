//! Warning Events for load signals gone stale. A worker pod that sets its upstream's
//! load signal aside (`crate::concurrency::staleness`) says so in its acknowledgment;
//! the controller tells the owner of each Batch that pod runs for, as a Warning Event
//! `LoadSignalStale` on the Batch: once, and again every [`WARN_AGAIN_AFTER`] while it
//! stays stale. Its lines go on under the throughput rule alone meanwhile.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;

use super::crd::BATCH_LABEL;
use crate::grants::divide::Seen;

/// A Batch is warned again after this long, if the signal is still stale.
pub const WARN_AGAIN_AFTER: Duration = Duration::from_secs(600);

/// A Batch (its resource's name) whose worker pod set `upstream`'s signal aside.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stale {
    pub batch: String,
    pub upstream: String,
}

impl Stale {
    pub fn note(&self) -> String {
        format!(
            "upstream {}'s load signal is stale (the same answer while lines finish, or a hold that does not move); \
             this batch's lines go on under the throughput rule alone until it changes",
            self.upstream
        )
    }
}

/// What the running workers' acknowledgments say is stale.
pub fn reported(running: &[Arc<Job>], seen: &BTreeMap<String, Seen>) -> BTreeSet<Stale> {
    let mut stale = BTreeSet::new();
    for job in running {
        let Some(batch) = job.labels().get(BATCH_LABEL) else { continue };
        let Some(ack) = seen.get(&job.name_any()).and_then(|seen| seen.acked.as_ref()) else { continue };
        for (upstream, observation) in &ack.observed {
            if observation.signal_stale {
                stale.insert(Stale { batch: batch.clone(), upstream: upstream.clone() });
            }
        }
    }
    stale
}

/// When each stale signal was last warned of.
#[derive(Debug, Default)]
pub struct Warned(HashMap<Stale, Instant>);

impl Warned {
    /// Of what is `stale` now, what to warn of: what was not warned of in the last
    /// [`WARN_AGAIN_AFTER`]. Forgets what is no longer stale (it is warned of at once if
    /// it goes stale again).
    pub fn due(&mut self, now: Instant, stale: BTreeSet<Stale>) -> Vec<Stale> {
        self.0.retain(|warned, _| stale.contains(warned));
        let mut due = Vec::new();
        for signal in stale {
            let last = self.0.get(&signal);
            if last.is_none_or(|at| now.saturating_duration_since(*at) >= WARN_AGAIN_AFTER) {
                self.0.insert(signal.clone(), now);
                due.push(signal);
            }
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grants::{Ack, Observation};

    fn job(name: &str, batch: &str) -> Arc<Job> {
        let mut job = Job::default();
        job.metadata.name = Some(name.into());
        job.metadata.labels = Some([(BATCH_LABEL.to_owned(), batch.to_owned())].into());
        Arc::new(job)
    }

    fn acked(stale: &[(&str, bool)]) -> Seen {
        let observed = stale
            .iter()
            .map(|(upstream, stale)| {
                ((*upstream).to_owned(), Observation { signal_stale: *stale, ..Observation::default() })
            })
            .collect();
        Seen { acked: Some(Ack { observed, ..Ack::default() }), ..Seen::default() }
    }

    fn stale(batch: &str, upstream: &str) -> Stale {
        Stale { batch: batch.into(), upstream: upstream.into() }
    }

    #[test]
    fn the_running_workers_say_which_batches_see_a_stale_signal() {
        let running = [job("w1", "batch-a"), job("w2", "batch-a"), job("w3", "batch-b"), job("w4", "batch-c")];
        let seen = BTreeMap::from([
            ("w1".to_owned(), acked(&[("vllm", true), ("echo", false)])),
            ("w2".to_owned(), acked(&[("vllm", true)])),
            ("w3".to_owned(), acked(&[("vllm", false)])),
            ("w5".to_owned(), acked(&[("vllm", true)])), // not running any more
        ]);
        assert_eq!(reported(&running, &seen), BTreeSet::from([stale("batch-a", "vllm")]));
    }

    #[test]
    fn a_stale_signal_is_warned_of_once_then_again_after_a_while_and_at_once_when_it_comes_back() {
        let start = Instant::now();
        let mut warned = Warned::default();
        let now = BTreeSet::from([stale("a", "vllm"), stale("b", "vllm")]);
        assert_eq!(warned.due(start, now.clone()).len(), 2);
        assert!(warned.due(start + Duration::from_secs(1), now.clone()).is_empty());
        assert_eq!(warned.due(start + WARN_AGAIN_AFTER, now).len(), 2);
        // `a` recovers, then goes stale again: warned of at once.
        let later = start + WARN_AGAIN_AFTER + Duration::from_secs(2);
        assert!(warned.due(later, BTreeSet::from([stale("b", "vllm")])).is_empty());
        assert_eq!(warned.due(later, BTreeSet::from([stale("a", "vllm")])), vec![stale("a", "vllm")]);
    }
}
