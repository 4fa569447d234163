//! Leader election on a coordination.k8s.io Lease, so that two controller replicas
//! are safe: only the holder reconciles; a standby takes over once the holder has
//! not renewed for a lease duration.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{Api, ObjectMeta, PostParams};
use lease_time::now_micro_time;

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    /// A holder that has not renewed for this long has lost the lease.
    lease_seconds: i32,
}

/// Lease times: MicroTime, over the timestamp type that k8s-openapi uses.
mod lease_time {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    pub fn now_micro_time() -> MicroTime {
        MicroTime(k8s_openapi::jiff::Timestamp::now())
    }

    pub fn seconds_since(time: &MicroTime) -> f64 {
        let elapsed = k8s_openapi::jiff::Timestamp::now().duration_since(time.0);
        elapsed.as_secs_f64()
    }
}

impl LeaderElection {
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str, lease_seconds: i32) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            lease_seconds: lease_seconds.max(1),
        }
    }

    /// Renew at a third of the lease, so that two missed renewals still hold it.
    fn renew_every(&self) -> Duration {
        Duration::from_millis(self.lease_seconds as u64 * 1000 / 3)
    }

    /// Tries once to take or renew the lease; true when we hold it after.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..ObjectMeta::default() },
                spec: Some(self.spec(0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref();
        let expired = spec.renew_time.as_ref().is_none_or(|renewed| {
            lease_time::seconds_since(renewed) > f64::from(spec.lease_duration_seconds.unwrap_or(self.lease_seconds))
        });
        if holder != Some(self.identity.as_str()) && !expired {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(holder != Some(self.identity.as_str()));
        lease.spec = Some(self.spec(transitions));
        // The resourceVersion read above makes this a compare-and-swap.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        }
    }

    fn spec(&self, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_seconds),
            acquire_time: Some(now_micro_time()),
            renew_time: Some(now_micro_time()),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Waits until this replica holds the lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "leader election failed; retrying"),
            }
            tokio::time::sleep(self.renew_every()).await;
        }
    }

    /// Renews the lease until it is lost; returns then.
    pub async fn hold(&self) {
        loop {
            tokio::time::sleep(self.renew_every()).await;
            match self.try_acquire().await {
                Ok(true) => {}
                Ok(false) => return,
                Err(error) => tracing::warn!(%error, "could not renew the lease"),
            }
        }
    }
}
