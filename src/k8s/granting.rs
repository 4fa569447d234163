//! The controller's side of the installation-wide limits (`crate::grants`): twice a
//! second, the running worker Jobs are the workers, their acknowledgments are read from
//! storage, each upstream's limit and each project's remaining quota are divided among
//! them, and the changed grants are written back. What the acknowledgments say of
//! stale load signals becomes Warning Events (`super::stale_signals`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use kube::runtime::reflector::Store;

use super::context::Context;
use super::crd::{BATCH_LABEL, BatchResource, PROJECT_LABEL, resource_name};
use super::jobs::{is_running_worker, job_phase, job_shard};
use super::stale_signals::{self, Warned};
use crate::capacity::backlog::Report;
use crate::clock;
use crate::concurrency::Counts;
use crate::concurrency::governor::{Governor, Look, OVERLOAD_RULES_FOR};
use crate::drive::WorkerPhase;
use crate::exec::ExecError;
use crate::grants::divide::{Seen, divide};
use crate::grants::tokens::{TokenRun, divide_tokens};
use crate::grants::{self, Ack, BEAT, Grant, TokenGrant, read_ack, read_grant, write_grant};
use crate::storage::ObjectStore;

/// A pass starts this long after the beat on which the pods took their views and
/// acknowledged, so that its grants are written before the next beat, when the pods
/// read them (passes took 0.26 s on average with four pods; half a beat after, users
/// who came were told 1.3 s late, where they could have been 0.8 s).
const PASS_AFTER: Duration = Duration::from_millis(150);
/// How long a deleted Job's pod may still be sending (its grace period), when it did
/// not say that it released its grant.
const DELETED_GRACE: Duration = Duration::from_secs(60);

/// An upstream as the controller divides it: `max_concurrency`, and whether the limit
/// under it adapts (`crate::concurrency`).
pub struct UpstreamLimit {
    pub name: String,
    pub ceiling: u32,
    pub adaptive: bool,
}

/// Divides the upstreams' limits and the projects' quotas among the running workers,
/// for as long as this controller leads. An adaptive upstream's limit is found over the
/// whole installation, from what every worker reports in its acknowledgment.
pub async fn divide_limits(ctx: Arc<Context>, batches: Store<BatchResource>, upstreams: Vec<UpstreamLimit>) {
    let store = ctx.exec.store.clone();
    let mut workers = Workers { seen: recall(store.as_ref()).await, leaving: BTreeMap::new(), gone: Vec::new() };
    let mut final_usage = HashMap::new();
    let mut adapting = Adapting::default();
    let mut warned = Warned::default();
    loop {
        tokio::time::sleep(clock::until_beat(clock::since_epoch(), BEAT, PASS_AFTER)).await;
        let jobs = ctx.jobs.state();
        let running: Vec<Arc<Job>> = jobs.iter().filter(|job| is_running_worker(job)).cloned().collect();
        workers.observe(store.as_ref(), &jobs, &running).await;
        for stale in warned.due(Instant::now(), stale_signals::reported(&running, &workers.seen)) {
            let batch = batches.state().into_iter().find(|b| b.key().as_deref() == Some(stale.batch.as_str()));
            if let Some(batch) = batch {
                ctx.event(&batch, EventType::Warning, "LoadSignalStale", stale.note()).await;
            }
        }
        let mut limits = adapting.limits(&upstreams, &workers.seen);
        crate::metrics::METRICS.publish_backlog(backlog(&ctx, &batches, &workers.seen));
        // Lines that wait for a replica to become ready (`super::scaling`) get nothing.
        for (upstream, limit) in &mut limits {
            if ctx.workloads.holds(upstream) {
                *limit = 0;
            }
        }
        let mut next = divide(&limits, &workers.seen, &worker_projects(&ctx, &running));
        match share_quotas(&ctx, &batches, &running, &workers.seen, &mut final_usage).await {
            Ok(tokens) => {
                for (name, grant) in tokens {
                    if let Some(next) = next.get_mut(&name) {
                        next.tokens = Some(grant);
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "could not share the projects' quotas this time"),
        }
        workers.grant(store.as_ref(), &running, next).await;
    }
}

/// What the Batches in progress need of each upstream, with the lines in flight the
/// workers last reported.
fn backlog(ctx: &Context, batches: &Store<BatchResource>, seen: &BTreeMap<String, Seen>) -> Report {
    let in_flight = |upstream: &str| -> u64 {
        let observed = seen.values().filter_map(|s| s.acked.as_ref()?.observed.get(upstream));
        observed.map(|o| u64::from(o.in_flight)).sum()
    };
    super::capacity::report(&ctx.routes, batches, &ctx.workloads, in_flight, crate::clock::now())
}

/// Each running worker's project and that project's weight.
fn worker_projects(ctx: &Context, running: &[Arc<Job>]) -> BTreeMap<String, (String, u32)> {
    let weights = ctx.project_weights();
    running
        .iter()
        .map(|job| {
            let project = job.labels().get(PROJECT_LABEL).cloned().unwrap_or_default();
            let weight = weights.get(&project).copied().unwrap_or(1);
            (job.name_any(), (project, weight))
        })
        .collect()
}

/// The installation-wide adaptive limits: a governor per upstream, fed with the sum of
/// what the workers report.
#[derive(Default)]
struct Adapting {
    governors: BTreeMap<String, Governor>,
    /// Each upstream's finished requests over all workers, as the governor counts them.
    totals: BTreeMap<String, Counts>,
    /// Each worker's last report per upstream, with its run (a new run counts from 0).
    last: BTreeMap<(String, String), (String, Counts)>,
}

impl Adapting {
    fn limits(&mut self, upstreams: &[UpstreamLimit], seen: &BTreeMap<String, Seen>) -> BTreeMap<String, u32> {
        let now = std::time::Instant::now();
        self.last.retain(|(worker, _), _| seen.contains_key(worker));
        let mut limits = BTreeMap::new();
        for upstream in upstreams {
            if !upstream.adaptive {
                limits.insert(upstream.name.clone(), upstream.ceiling);
                continue;
            }
            let (mut in_flight, mut reporting, mut filling) = (0, 0, 0);
            let total = self.totals.entry(upstream.name.clone()).or_default();
            for (worker, seen) in seen {
                let Some(ack) = &seen.acked else { continue };
                let Some(observation) = ack.observed.get(&upstream.name) else { continue };
                let key = (worker.clone(), upstream.name.clone());
                let new = match self.last.get(&key) {
                    Some((run, counts)) if *run == ack.run => observation.counts.since(counts),
                    _ => observation.counts,
                };
                total.add(&new);
                self.last.insert(key, (ack.run.clone(), observation.counts));
                in_flight += observation.in_flight;
                reporting += 1;
                filling += usize::from(observation.filling);
            }
            let governor = self
                .governors
                .entry(upstream.name.clone())
                .or_insert_with(|| Governor::with_late_counts(upstream.ceiling));
            // The pods read the load signal, not the controller; its rule, over late
            // counts, does not leap from the start whatever `crowded` says. While every
            // pod says its batch is alone at the server with its places known, their
            // caps fill those places between them and the rule stands aside, as in
            // `serve` (`crate::exec::permits`). Judged, lines that fill a server add no
            // throughput, and the rule cut four pods alone at 32 places from 32 to 13.
            let overruled =
                reporting > 0 && filling == reporting && !governor.backed_off_within(now, OVERLOAD_RULES_FOR);
            let look = Look { now, counts: *total, in_flight, ceiling: upstream.ceiling, crowded: false, overruled };
            let judged = governor.look(look);
            let limit = if overruled {
                governor.filled(in_flight, upstream.ceiling);
                upstream.ceiling
            } else {
                judged
            };
            crate::metrics::METRICS.concurrency_limit_of(&upstream.name).set(i64::from(limit));
            limits.insert(upstream.name.clone(), limit);
        }
        limits
    }
}

/// The workers as the controller last saw them.
struct Workers {
    seen: BTreeMap<String, Seen>,
    /// Workers no longer running, and since when (to let a deleted Job's pod stop).
    leaving: BTreeMap<String, Instant>,
    /// Workers found gone at the last pass, forgotten at this one: their last views
    /// count once more (`crate::concurrency::view::users`).
    gone: Vec<String>,
}

impl Workers {
    /// Reads every worker's acknowledgment; forgets those that are gone: finished (their
    /// pods ended), released, or deleted long enough ago, at the pass after the one
    /// that found them gone. Until then, one that no longer runs holds what it held and
    /// wants nothing more.
    async fn observe(&mut self, store: &dyn ObjectStore, jobs: &[Arc<Job>], running: &[Arc<Job>]) {
        for name in std::mem::take(&mut self.gone) {
            self.seen.remove(&name);
            self.leaving.remove(&name);
            if let Err(error) = grants::remove(store, &name).await {
                tracing::warn!(worker = %name, %error, "could not remove a finished worker's grant");
            }
        }
        let running: Vec<String> = running.iter().map(|job| job.name_any()).collect();
        for name in &running {
            self.seen.entry(name.clone()).or_default();
            self.leaving.remove(name);
        }
        for (name, worker) in self.seen.iter_mut() {
            let ack = match read_ack(store, name).await {
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
            let finished = jobs.iter().any(|job| job.name_any() == *name && job_phase(job) != WorkerPhase::Running);
            let since = *self.leaving.entry(name.clone()).or_insert_with(Instant::now);
            if finished || ack.as_ref().is_some_and(|a| a.released) || since.elapsed() > DELETED_GRACE {
                self.gone.push(name.clone());
            }
            // What it saw last stays: a worker that released its grant as it exited says
            // what its lines were until then, which the others' views still hold.
            worker.acked = Some(match ack {
                Some(Ack { upstreams, observed, run, .. }) => Ack { upstreams, observed, run, ..Ack::default() },
                None => Ack { upstreams: worker.granted.upstreams.clone(), ..Ack::default() },
            });
        }
    }

    /// Writes the grants that changed, to running workers only.
    async fn grant(&mut self, store: &dyn ObjectStore, running: &[Arc<Job>], next: BTreeMap<String, Grant>) {
        for (name, grant) in next {
            let Some(worker) = self.seen.get_mut(&name) else { continue };
            if worker.granted == grant || !running.iter().any(|job| job.name_any() == name) {
                continue;
            }
            match write_grant(store, &name, &grant).await {
                Ok(()) => worker.granted = grant,
                Err(error) => tracing::warn!(worker = %name, %error, "could not write a worker's grant"),
            }
        }
    }
}

/// The token grants of the running workers, by project: unbounded for a project without
/// a quota, its remaining quota divided for one with. `final_usage` keeps the usage of
/// finished shards, which never changes again.
async fn share_quotas(
    ctx: &Context,
    batches: &Store<BatchResource>,
    running: &[Arc<Job>],
    seen: &BTreeMap<String, Seen>,
    final_usage: &mut HashMap<(String, u32), u64>,
) -> Result<BTreeMap<String, TokenGrant>, ExecError> {
    let unfinished: std::collections::HashSet<String> = batches
        .state()
        .iter()
        .filter(|b| b.status.as_ref().is_some_and(|s| !s.status.is_terminal()))
        .filter_map(|b| b.key())
        .collect();
    final_usage.retain(|(batch, _), _| unfinished.contains(batch));
    let mut grants = BTreeMap::new();
    let mut by_project: BTreeMap<String, Vec<&Arc<Job>>> = BTreeMap::new();
    for job in running {
        by_project.entry(job.labels().get(PROJECT_LABEL).cloned().unwrap_or_default()).or_default().push(job);
    }
    let projects = ctx.projects.state();
    for (project_id, workers) in by_project {
        let project = projects.iter().find(|p| p.spec.id.as_str() == project_id);
        let Some(quota) = project.and_then(|p| p.spec.quota).map(|q| q.tokens) else {
            for job in workers {
                let run = seen.get(&job.name_any()).and_then(|w| w.acked.as_ref()).map(|ack| ack.run.clone());
                if let Some(run) = run.filter(|run| !run.is_empty()) {
                    grants.insert(job.name_any(), TokenGrant { run, allowance: u64::MAX, exhausted: false });
                }
            }
            continue;
        };
        let live: Vec<(String, u32)> =
            workers.iter().filter_map(|job| Some((job.labels().get(BATCH_LABEL)?.clone(), job_shard(job)?))).collect();
        let (committed, shard_usage) = project_usage(ctx, batches, &project_id, &live, final_usage).await?;
        let runs: Vec<TokenRun> = workers.iter().map(|job| token_run(job, seen, &shard_usage)).collect();
        let next = divide_tokens(quota, committed, &runs);
        tracing::debug!(project = %project_id, quota, committed, ?runs, ?next, "quota shared");
        grants.extend(next);
    }
    Ok(grants)
}

/// What a project's batches used: the tokens committed outside the `live` shards (those
/// of running workers), and each live shard's own.
async fn project_usage(
    ctx: &Context,
    batches: &Store<BatchResource>,
    project_id: &str,
    live: &[(String, u32)],
    final_usage: &mut HashMap<(String, u32), u64>,
) -> Result<(u64, HashMap<(String, u32), u64>), ExecError> {
    let store = ctx.exec.store.as_ref();
    let mut committed = 0;
    let mut shard_usage: HashMap<(String, u32), u64> = HashMap::new();
    for batch in batches.state().iter() {
        let (Some(spec), Some(status)) = (batch.accepted(), &batch.status) else { continue };
        if spec.project_id.as_str() != project_id {
            continue;
        }
        let name = resource_name(&spec.id);
        if status.status.is_terminal() {
            committed += status.usage.total_tokens;
            continue;
        }
        for shard in &spec.plan.shards {
            let key = (name.clone(), shard.index);
            let usage = match final_usage.get(&key) {
                Some(usage) => *usage,
                None => {
                    let ledger = ctx.exec.checkpoints.ledger(store, &spec.id, shard.index, shard.requests).await?;
                    if ledger.is_complete() && !live.contains(&key) {
                        final_usage.insert(key.clone(), ledger.usage.total_tokens);
                    }
                    ledger.usage.total_tokens
                }
            };
            if live.contains(&key) {
                shard_usage.insert(key, usage);
            } else {
                committed += usage;
            }
        }
    }
    Ok((committed, shard_usage))
}

/// A running worker as the quota's division sees it: its run's acknowledged spending, or
/// before any run answered, what its shard committed.
fn token_run(job: &Job, seen: &BTreeMap<String, Seen>, shard_usage: &HashMap<(String, u32), u64>) -> TokenRun {
    let name = job.name_any();
    let key = (job.labels().get(BATCH_LABEL).cloned().unwrap_or_default(), job_shard(job).unwrap_or(0));
    let worker = seen.get(&name).cloned().unwrap_or_default();
    match worker.acked.filter(|ack| !ack.run.is_empty()) {
        Some(ack) => {
            let tokens = ack.tokens.clone().unwrap_or_default();
            let granted = worker.granted.tokens.filter(|t| t.run == ack.run).map_or(0, |t| t.allowance);
            TokenRun {
                worker: name,
                run: ack.run,
                base: tokens.base,
                spent: tokens.spent,
                allowance: granted,
                waiting: tokens.waiting,
            }
        }
        // No run has answered: what its shard committed counts, and any allowance an
        // earlier run may still be spending.
        None => TokenRun {
            worker: name,
            base: shard_usage.get(&key).copied().unwrap_or(0),
            allowance: worker.granted.tokens.map_or(0, |t| t.allowance),
            ..TokenRun::default()
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grants::Observation;

    /// Workers that each acknowledged `in_flight` lines at `vllm`, `filling` or not.
    fn workers(filling: &[bool], in_flight: u32) -> BTreeMap<String, Seen> {
        let seen = |filling: bool| {
            let observation = Observation { in_flight, filling, ..Observation::default() };
            let ack = Ack { observed: BTreeMap::from([("vllm".to_owned(), observation)]), ..Ack::default() };
            Seen { granted: Grant::default(), acked: Some(ack) }
        };
        filling.iter().enumerate().map(|(n, filling)| (format!("worker-{n}"), seen(*filling))).collect()
    }

    #[test]
    fn the_installations_limit_stands_aside_while_every_pod_fills_the_server() {
        let upstreams = [UpstreamLimit { name: "vllm".to_owned(), ceiling: 1024, adaptive: true }];
        let mut adapting = Adapting::default();
        let start = adapting.limits(&upstreams, &workers(&[true, false], 4))["vllm"];
        assert!(start < 1024, "one pod does not fill: the rule's start ({start})");
        assert_eq!(adapting.limits(&upstreams, &workers(&[true, true], 4))["vllm"], 1024, "the pods' caps hold them");
        assert_eq!(
            adapting.limits(&upstreams, &workers(&[true, true, false], 4))["vllm"],
            start,
            "not judged meanwhile"
        );
        // The pods filled the server with 40 lines: the rule goes on from there when one
        // of them stops filling, not from its start.
        assert_eq!(adapting.limits(&upstreams, &workers(&[true, true], 20))["vllm"], 1024);
        assert_eq!(adapting.limits(&upstreams, &workers(&[true, true, false], 4))["vllm"], 40);
        assert_eq!(adapting.limits(&upstreams, &BTreeMap::new())["vllm"], 40, "nobody says");
        let fixed = [UpstreamLimit { name: "vllm".to_owned(), ceiling: 64, adaptive: false }];
        assert_eq!(adapting.limits(&fixed, &workers(&[true, true], 4))["vllm"], 64);
    }
}
