//! Leader election on a coordination.k8s.io Lease, so that two controller replicas
//! are safe: only the holder reconciles.
//!
//! Times are only ever compared on this process's monotonic clock, never with the
//! `renewTime` another host wrote. A standby takes the Lease once it has seen the
//! Lease unchanged for a whole lease duration; a leader steps down once it has not
//! renewed for the renew deadline, a shorter time counted from *before* its last
//! successful renewal was sent. So the old leader has stopped before a standby can
//! take over, even when the leader is cut off from the API server and every request
//! it sends hangs.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::time::Instant;

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    /// The Lease as last read and when it was first seen so: the standby's clock.
    observed: Option<Observed>,
}

/// The three durations of an election, derived from the lease duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// A Lease unchanged for this long (as seen by a standby) may be taken.
    pub lease: Duration,
    /// A leader that has not renewed for this long steps down: shorter than `lease`.
    pub renew_deadline: Duration,
    /// How often the leader renews and a standby looks.
    pub retry: Duration,
}

impl Timing {
    /// Client-go's proportions (15 s, 10 s, 2 s by default).
    pub fn for_lease(lease_seconds: u32) -> Self {
        let lease = Duration::from_secs(u64::from(lease_seconds.max(1)));
        Self { lease, renew_deadline: lease * 2 / 3, retry: lease / 7 }
    }
}

/// What identifies one writing of the Lease: any renewal changes it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    resource_version: Option<String>,
}

#[derive(Clone, Debug)]
struct Observed {
    record: Record,
    since: Instant,
}

/// Whether a replica that is not the holder may take the Lease, having seen its
/// current record unchanged since `unchanged_since`: when nobody holds it, or when the
/// holder has let it go unrenewed for a whole lease duration on our clock.
fn may_take(holder: Option<&str>, unchanged_since: Instant, now: Instant, lease: Duration) -> bool {
    holder.is_none_or(str::is_empty) || now.saturating_duration_since(unchanged_since) >= lease
}

/// What the leader does after a renewal attempt.
#[derive(Debug, PartialEq, Eq)]
enum Hold {
    /// Renewed (or still within the deadline): try again at this instant.
    RetryAt(Instant),
    /// Another replica holds the Lease, or the deadline passed without a renewal.
    StepDown,
}

/// The leader's next step: `renewed` is when the last successful renewal was sent.
fn next_hold(renewed: Instant, now: Instant, lost: bool, timing: Timing) -> Hold {
    let deadline = renewed + timing.renew_deadline;
    if lost || now >= deadline {
        return Hold::StepDown;
    }
    Hold::RetryAt((now + timing.retry).min(deadline))
}

impl LeaderElection {
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str, timing: Timing) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            timing,
            observed: None,
        }
    }

    /// Tries once to take or renew the Lease; true when we hold it after.
    async fn try_acquire(&mut self) -> Result<bool, kube::Error> {
        let now = Instant::now();
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..ObjectMeta::default() },
                spec: Some(self.spec(None, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let record = Record { holder: spec.holder_identity.clone(), resource_version: lease.resource_version() };
        let since = match &self.observed {
            Some(observed) if observed.record == record => observed.since,
            _ => now,
        };
        self.observed = Some(Observed { record, since });
        let holder = spec.holder_identity.as_deref();
        let ours = holder == Some(self.identity.as_str());
        if !ours && !may_take(holder, since, now, self.timing.lease) {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!ours);
        let acquired = if ours { spec.acquire_time.clone() } else { None };
        lease.spec = Some(self.spec(acquired, transitions));
        // The resourceVersion read above makes this a compare-and-swap.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// `renewTime` and `acquireTime` are informative for people (`kubectl get lease`):
    /// no replica's decision reads them.
    fn spec(&self, acquired: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.timing.lease.as_secs() as i32),
            acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// One attempt, bounded in time: a request that hangs counts as failed.
    async fn attempt(&mut self, within: Duration) -> Result<bool, AttemptError> {
        match tokio::time::timeout(within, self.try_acquire()).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(AttemptError::Timeout(within)),
        }
    }

    /// Waits until this replica holds the Lease; returns when the acquiring request
    /// was sent, the instant the renew deadline counts from.
    pub async fn acquire(&mut self) -> Instant {
        loop {
            let sent = Instant::now();
            match self.attempt(self.timing.renew_deadline).await {
                Ok(true) => return sent,
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "leader election failed; retrying"),
            }
            tokio::time::sleep_until(sent + self.timing.retry).await;
        }
    }

    /// Renews the Lease acquired at `acquired`; returns once this replica must stop
    /// acting as leader: another holds the Lease, or no renewal succeeded within the
    /// renew deadline.
    pub async fn hold(&mut self, acquired: Instant) {
        let mut renewed = acquired;
        let mut lost = false;
        loop {
            match next_hold(renewed, Instant::now(), lost, self.timing) {
                Hold::StepDown if lost => return tracing::warn!("another replica holds the lease; stepping down"),
                Hold::StepDown => {
                    let after = renewed.elapsed();
                    return tracing::warn!(?after, "could not renew the lease in time; stepping down");
                }
                Hold::RetryAt(at) => tokio::time::sleep_until(at).await,
            }
            let sent = Instant::now();
            let left = (renewed + self.timing.renew_deadline).saturating_duration_since(sent);
            match self.attempt(left).await {
                Ok(true) => renewed = sent,
                Ok(false) => lost = true,
                Err(error) => tracing::warn!(%error, "could not renew the lease"),
            }
        }
    }
}

/// Why an attempt on the Lease failed.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn timing_keeps_client_go_proportions() {
        let timing = Timing::for_lease(15);
        assert_eq!((timing.lease, timing.renew_deadline), (15 * SECOND, 10 * SECOND));
        assert!(timing.retry * 4 < timing.renew_deadline, "several renewals fit in the deadline");
        assert!(Timing::for_lease(0).lease >= SECOND);
    }

    #[test]
    fn a_standby_takes_a_lease_only_after_seeing_it_unchanged_for_a_lease_duration() {
        let t0 = Instant::now();
        let lease = 15 * SECOND;
        assert!(may_take(None, t0, t0, lease), "nobody holds it");
        assert!(may_take(Some(""), t0, t0, lease), "released");
        assert!(!may_take(Some("a"), t0, t0, lease), "just seen: whatever its renewTime says");
        assert!(!may_take(Some("a"), t0, t0 + 14 * SECOND, lease));
        assert!(may_take(Some("a"), t0, t0 + lease, lease));
    }

    #[test]
    fn a_leader_steps_down_at_the_renew_deadline_before_a_standby_may_take_over() {
        let timing = Timing::for_lease(15);
        let renewed = Instant::now();
        // Retries never sleep past the deadline.
        assert_eq!(next_hold(renewed, renewed, false, timing), Hold::RetryAt(renewed + timing.retry));
        let late = renewed + timing.renew_deadline - timing.retry / 2;
        assert_eq!(next_hold(renewed, late, false, timing), Hold::RetryAt(renewed + timing.renew_deadline));
        assert_eq!(next_hold(renewed, renewed + timing.renew_deadline, false, timing), Hold::StepDown);
        assert_eq!(next_hold(renewed, renewed, true, timing), Hold::StepDown, "another holds it");
        // The standby saw the renewal no earlier than it was sent: it may take over at
        // `renewed + lease` at the earliest, after the leader stepped down.
        let standby_saw = renewed;
        assert!(!may_take(Some("leader"), standby_saw, renewed + timing.renew_deadline, timing.lease));
    }
}
