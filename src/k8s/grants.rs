//! The controller's side of the installation-wide upstream limits (`crate::grants`):
//! every second, the running worker Jobs are the workers, their acknowledgments are
//! read from storage, and the changed grants are written back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;

use super::controller::Context;
use super::crd::BATCH_LABEL;
use super::jobs::job_phase;
use crate::drive::WorkerPhase;
use crate::grants::divide::{Seen, divide};
use crate::grants::{self, Ack, read_ack, read_grant, write_grant};
use crate::storage::ObjectStore;

const EVERY: Duration = Duration::from_millis(500);
/// How long a deleted Job's pod may still be sending (its grace period), when it did
/// not say that it released its grant.
const DELETED_GRACE: Duration = Duration::from_secs(60);

/// A Job whose pods may be sending: started (not suspended) and not finished.
pub fn is_running_worker(job: &Job) -> bool {
    let labelled = job.labels().contains_key(BATCH_LABEL);
    let suspended = job.spec.as_ref().and_then(|s| s.suspend).unwrap_or(false);
    labelled && !suspended && job.metadata.deletion_timestamp.is_none() && job_phase(job) == WorkerPhase::Running
}

/// Divides the upstreams' limits among the running workers, for as long as this
/// controller leads.
pub async fn divide_upstreams(ctx: Arc<Context>, limits: BTreeMap<String, u32>) {
    if limits.is_empty() {
        return std::future::pending().await;
    }
    let store = ctx.exec.store.clone();
    let mut seen = recall(store.as_ref()).await;
    // Workers no longer running, and since when (to let a deleted Job's pod stop).
    let mut leaving: BTreeMap<String, Instant> = BTreeMap::new();
    loop {
        tokio::time::sleep(EVERY).await;
        let jobs = ctx.jobs.state();
        let running: Vec<String> = jobs.iter().filter(|job| is_running_worker(job)).map(|job| job.name_any()).collect();
        for name in &running {
            seen.entry(name.clone()).or_default();
            leaving.remove(name);
        }
        let mut gone = Vec::new();
        for (name, worker) in seen.iter_mut() {
            let ack = match read_ack(store.as_ref(), name).await {
                Ok(ack) => ack,
                Err(error) => {
                    tracing::warn!(worker = %name, %error, "could not read a worker's acknowledgment");
                    continue;
                }
            };
            if running.contains(name) {
                worker.acked = ack;
                continue;
            }
            // Finished (its pods have ended), released, or deleted long enough ago.
            let finished = jobs.iter().any(|job| job.name_any() == *name && job_phase(job) != WorkerPhase::Running);
            let since = *leaving.entry(name.clone()).or_insert_with(Instant::now);
            if finished || ack.as_ref().is_some_and(|a| a.released) || since.elapsed() > DELETED_GRACE {
                gone.push(name.clone());
            }
            // Until then it holds what it held, and wants nothing more.
            let holds = ack.map_or_else(|| worker.granted.upstreams.clone(), |a| a.upstreams);
            worker.acked = Some(Ack { upstreams: holds, ..Ack::default() });
        }
        for name in gone {
            seen.remove(&name);
            leaving.remove(&name);
            if let Err(error) = grants::remove(store.as_ref(), &name).await {
                tracing::warn!(worker = %name, %error, "could not remove a finished worker's grant");
            }
        }
        // Only running workers get grants; those leaving keep what they hold, counted.
        let next = divide(&limits, &seen);
        for (name, grant) in next {
            let worker = seen.get_mut(&name).expect("divided among the seen");
            if !running.contains(&name) || worker.granted == grant {
                continue;
            }
            match write_grant(store.as_ref(), &name, &grant).await {
                Ok(()) => worker.granted = grant,
                Err(error) => tracing::warn!(worker = %name, %error, "could not write a worker's grant"),
            }
        }
    }
}

/// The grants in storage: what a previous leader gave.
async fn recall(store: &dyn ObjectStore) -> BTreeMap<String, Seen> {
    let mut seen = BTreeMap::new();
    let names = grants::granted_workers(store).await.unwrap_or_default();
    for name in names {
        if let Ok(Some(granted)) = read_grant(store, &name).await {
            seen.insert(name, Seen { granted, acked: None });
        }
    }
    seen
}
