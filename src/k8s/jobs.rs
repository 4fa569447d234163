//! What Job a shard of a Batch runs as, and what a Job's status says. Pure.

use std::borrow::Borrow;
use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec, PodTemplateSpec};
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};

use super::crd::{BATCH_LABEL, BatchResource, PROJECT_LABEL, resource_name};
use crate::batches::BatchSpec;
use crate::config::WorkerTemplate;
use crate::drive::WorkerPhase;
use crate::validate::Shard;

pub const SHARD_LABEL: &str = "nightshift.dev/shard";
/// The label that names a Job's Kueue LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// Which run of the shard a Job is: the shard's failed runs before it.
pub const ATTEMPT_LABEL: &str = "nightshift.dev/attempt";

/// `<batch>-s<shard>`, and `-r<attempt>` from the first retry on: a retry never waits for
/// the failed Job's name to be free.
pub fn job_name(spec: &BatchSpec, shard: u32, attempt: u32) -> String {
    match attempt {
        0 => format!("{}-s{shard}", resource_name(&spec.id)),
        n => format!("{}-s{shard}-r{n}", resource_name(&spec.id)),
    }
}

/// The Job that runs `shard` of `batch` (accepted as `spec`): one pod, no Kubernetes
/// credentials, its shard's line and byte range in its arguments, owned by the Batch (so
/// deleting the Batch deletes it).
pub fn shard_job(
    batch: &BatchResource,
    spec: &BatchSpec,
    shard: &Shard,
    attempt: u32,
    template: &WorkerTemplate,
    quota_left: Option<u64>,
) -> Job {
    let labels = worker_labels(spec, shard, attempt, template);
    let mut job_labels = labels.clone();
    if let Some(queue) = &template.queue_name {
        job_labels.insert(QUEUE_LABEL.to_owned(), queue.clone());
    }
    let name = job_name(spec, shard.index, attempt);
    let args = worker_args(spec, shard, template, quota_left, &name);
    Job {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: batch.metadata.namespace.clone(),
            labels: Some(job_labels),
            owner_references: batch.controller_owner_ref(&()).map(|owner| vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(template.backoff_limit),
            active_deadline_seconds: template.active_deadline_seconds,
            ttl_seconds_after_finished: template.ttl_seconds_after_finished,
            // Admitted (unsuspended) by someone else; the controller never changes it.
            suspend: (template.suspend || template.queue_name.is_some()).then_some(true),
            template: worker_pod(template, labels, worker_container(template, args)),
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// A worker pod's labels: the standard ones first, then the operator's own, then
/// Nightshift's, which win.
fn worker_labels(spec: &BatchSpec, shard: &Shard, attempt: u32, template: &WorkerTemplate) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = [
        ("app.kubernetes.io/name", "nightshift"),
        ("app.kubernetes.io/component", "worker"),
        ("app.kubernetes.io/managed-by", "nightshift-controller"),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value.to_owned()))
    .collect();
    labels.extend(template.labels.clone());
    labels.extend([
        (BATCH_LABEL.to_owned(), resource_name(&spec.id)),
        (PROJECT_LABEL.to_owned(), spec.project_id.to_string()),
        (SHARD_LABEL.to_owned(), shard.index.to_string()),
        (ATTEMPT_LABEL.to_owned(), attempt.to_string()),
    ]);
    labels
}

/// `nightshift worker`'s arguments for `shard`, its grant named after its Job.
fn worker_args(
    spec: &BatchSpec,
    shard: &Shard,
    template: &WorkerTemplate,
    quota_left: Option<u64>,
    job: &str,
) -> Vec<String> {
    let mut args = vec![
        "worker".to_owned(),
        format!("--config={}", template.config_path),
        format!("--batch-id={}", spec.id),
        format!("--project-id={}", spec.project_id),
        format!("--input-file-id={}", spec.input_file_id),
        format!("--endpoint={}", spec.endpoint),
        format!("--expires-at={}", spec.expires_at),
        format!("--shard-index={}", shard.index),
        format!("--first-request={}", shard.first_request),
        format!("--requests={}", shard.requests),
        format!("--byte-start={}", shard.byte_start),
        format!("--byte-end={}", shard.byte_end),
    ];
    if let Some(left) = quota_left {
        args.push(format!("--quota-tokens-left={left}"));
    }
    if let Some(priority) = spec.priority {
        args.push(format!("--priority={priority}"));
    }
    args.push(format!("--grant-name={job}"));
    if let Some(port) = template.metrics_port {
        args.push(format!("--metrics-listen=0.0.0.0:{port}"));
    }
    args
}

fn worker_container(template: &WorkerTemplate, args: Vec<String>) -> Container {
    let ports = template.metrics_port.map(|port| {
        vec![ContainerPort {
            name: Some("metrics".into()),
            container_port: i32::from(port),
            ..ContainerPort::default()
        }]
    });
    Container {
        name: "worker".to_owned(),
        image: Some(template.image.clone()),
        image_pull_policy: template.image_pull_policy.clone(),
        args: Some(args),
        env: (!template.env.is_empty()).then(|| template.env.clone()),
        volume_mounts: (!template.volume_mounts.is_empty()).then(|| template.volume_mounts.clone()),
        resources: template.resources.clone(),
        security_context: template.security_context.clone(),
        ports,
        ..Container::default()
    }
}

fn worker_pod(template: &WorkerTemplate, labels: BTreeMap<String, String>, container: Container) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            annotations: (!template.annotations.is_empty()).then(|| template.annotations.clone()),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            restart_policy: Some("Never".to_owned()),
            service_account_name: template.service_account_name.clone(),
            image_pull_secrets: (!template.image_pull_secrets.is_empty()).then(|| template.image_pull_secrets.clone()),
            // Progress and checkpoints travel through object storage.
            automount_service_account_token: Some(false),
            containers: vec![container],
            volumes: (!template.volumes.is_empty()).then(|| template.volumes.clone()),
            node_selector: (!template.node_selector.is_empty()).then(|| template.node_selector.clone()),
            tolerations: (!template.tolerations.is_empty()).then(|| template.tolerations.clone()),
            affinity: template.affinity.clone(),
            priority_class_name: template.priority_class_name.clone(),
            security_context: template.pod_security_context.clone(),
            ..PodSpec::default()
        }),
    }
}

/// Where a Job stands, from its status conditions.
pub fn job_phase(job: &Job) -> WorkerPhase {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
    let holds = |kind: &str| conditions.is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"));
    if holds("Complete") {
        WorkerPhase::Succeeded
    } else if holds("Failed") {
        // Its pods failed more often than `backoffLimit` allows.
        WorkerPhase::Failed
    } else {
        WorkerPhase::Running
    }
}

/// The workers that `jobs` (one batch's) stand for, by shard: each shard's Job of its
/// current attempt (`failures`: failed runs by shard). A Job of an earlier attempt was
/// counted and retired already, even while a watch cache still shows it.
pub fn job_workers<J: Borrow<Job>>(jobs: &[J], failures: &BTreeMap<u32, u32>) -> BTreeMap<u32, WorkerPhase> {
    jobs.iter()
        .map(Borrow::borrow)
        .filter_map(|job| Some((job_shard(job)?, job_attempt(job), job_phase(job))))
        .filter(|(shard, attempt, _)| *attempt >= failures.get(shard).copied().unwrap_or(0))
        .map(|(shard, _, phase)| (shard, phase))
        .collect()
}

/// The attempt a Job runs (0 for Jobs made before attempts were labelled).
pub fn job_attempt(job: &Job) -> u32 {
    job.metadata.labels.as_ref().and_then(|l| l.get(ATTEMPT_LABEL)).and_then(|a| a.parse().ok()).unwrap_or(0)
}

/// The shard a Job runs, from its label.
pub fn job_shard(job: &Job) -> Option<u32> {
    job.metadata.labels.as_ref()?.get(SHARD_LABEL)?.parse().ok()
}

/// A Job whose pods may be sending: started (not suspended) and not finished.
pub fn is_running_worker(job: &Job) -> bool {
    let labelled = job.labels().contains_key(BATCH_LABEL);
    let suspended = job.spec.as_ref().and_then(|s| s.suspend).unwrap_or(false);
    labelled && !suspended && job.metadata.deletion_timestamp.is_none() && job_phase(job) == WorkerPhase::Running
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::{BatchSpec, BatchState};
    use crate::ids::{BatchId, FileId, ProjectId};
    use crate::k8s::crd::BatchResourceSpec;

    fn batch_spec() -> BatchSpec {
        BatchSpec {
            id: BatchId::parse("batch_01ABC").unwrap(),
            project_id: ProjectId::generate(),
            input_file_id: FileId::generate(),
            endpoint: "/v1/chat/completions".into(),
            completion_window: "24h".into(),
            metadata: Default::default(),
            created_at: 1,
            expires_at: 86_401,
            model: None,
            output_expires_after: None,
            priority: None,
            plan: Default::default(),
        }
    }

    fn batch() -> BatchResource {
        let mut resource = BatchResource::new("batch-01abc", BatchResourceSpec::recorded(batch_spec()));
        resource.metadata.namespace = Some("ns".into());
        resource.metadata.uid = Some("uid-1".into());
        resource.status = Some(BatchState::in_progress(1, 10));
        resource
    }

    #[test]
    fn a_shard_job_carries_its_range_has_no_credentials_and_is_owned_by_the_batch() {
        let shard = Shard { index: 2, first_request: 10, requests: 5, byte_start: 100, byte_end: 200 };
        let job = shard_job(&batch(), &batch_spec(), &shard, 0, &WorkerTemplate::default(), Some(42));
        assert_eq!(job.metadata.name.as_deref(), Some("batch-01abc-s2"));
        let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("Batch", Some(true)));
        let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let args = pod.containers[0].args.as_ref().unwrap();
        for expected in [
            "worker",
            "--endpoint=/v1/chat/completions",
            "--shard-index=2",
            "--first-request=10",
            "--requests=5",
            "--byte-start=100",
            "--byte-end=200",
            "--quota-tokens-left=42",
        ] {
            assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--priority")), "none set: the upstream's");
        assert_eq!(job_shard(&job), Some(2));
        assert_eq!(job_phase(&job), WorkerPhase::Running);
        let urgent = BatchSpec { priority: Some(-2), ..batch_spec() };
        let job = shard_job(&batch(), &urgent, &shard, 0, &WorkerTemplate::default(), None);
        let args = job.spec.unwrap().template.spec.unwrap().containers[0].args.clone().unwrap();
        assert!(args.iter().any(|a| a == "--priority=-2"), "{args:?}");
    }

    #[test]
    fn a_shard_job_is_shaped_by_the_template_for_gpu_clusters_and_kueue() {
        let shard = Shard { index: 0, first_request: 0, requests: 1, byte_start: 0, byte_end: 1 };
        let plain = shard_job(&batch(), &batch_spec(), &shard, 0, &WorkerTemplate::default(), None);
        let spec = plain.spec.as_ref().unwrap();
        assert_eq!((spec.suspend, spec.ttl_seconds_after_finished, spec.active_deadline_seconds), (None, None, None));
        let labels = plain.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["app.kubernetes.io/component"], "worker");
        assert!(!labels.contains_key(QUEUE_LABEL));

        let affinity: k8s_openapi::api::core::v1::Affinity = serde_json::from_value(serde_json::json!({
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}
        }))
        .unwrap();
        let template = WorkerTemplate {
            labels: [("app.kubernetes.io/instance", "prod"), (SHARD_LABEL, "7")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into(),
            annotations: [("cluster-autoscaler.kubernetes.io/safe-to-evict".to_owned(), "false".to_owned())].into(),
            affinity: Some(affinity.clone()),
            priority_class_name: Some("batch-low".into()),
            ttl_seconds_after_finished: Some(3600),
            active_deadline_seconds: Some(7200),
            queue_name: Some("gpu-batch".into()),
            metrics_port: Some(9090),
            ..WorkerTemplate::default()
        };
        let job = shard_job(&batch(), &batch_spec(), &shard, 0, &template, None);
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.suspend, Some(true), "a queued Job waits for Kueue to admit it");
        assert_eq!((spec.ttl_seconds_after_finished, spec.active_deadline_seconds), (Some(3600), Some(7200)));
        let labels = job.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[QUEUE_LABEL], "gpu-batch");
        assert_eq!(labels["app.kubernetes.io/instance"], "prod");
        assert_eq!(labels[SHARD_LABEL], "0", "Nightshift's labels win over the template's");
        let pod_meta = spec.template.metadata.as_ref().unwrap();
        assert_eq!(pod_meta.labels.as_ref().unwrap()["app.kubernetes.io/instance"], "prod");
        assert!(!pod_meta.labels.as_ref().unwrap().contains_key(QUEUE_LABEL), "Kueue reads the Job's label");
        assert_eq!(pod_meta.annotations.as_ref().unwrap()["cluster-autoscaler.kubernetes.io/safe-to-evict"], "false");
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.affinity.as_ref(), Some(&affinity));
        assert_eq!(pod.priority_class_name.as_deref(), Some("batch-low"));
        let container = &pod.containers[0];
        assert_eq!(container.ports.as_ref().unwrap()[0].name.as_deref(), Some("metrics"));
        assert!(container.args.as_ref().unwrap().contains(&"--metrics-listen=0.0.0.0:9090".to_owned()));
        let suspended_only = WorkerTemplate { suspend: true, ..WorkerTemplate::default() };
        let job = shard_job(&batch(), &batch_spec(), &shard, 0, &suspended_only, None);
        assert_eq!(job.spec.unwrap().suspend, Some(true));
    }

    fn job_of(shard: u32, conditions: &[(&str, &str)]) -> Job {
        attempt_of(shard, 0, conditions)
    }

    fn attempt_of(shard: u32, attempt: u32, conditions: &[(&str, &str)]) -> Job {
        let shard = Shard { index: shard, first_request: 0, requests: 1, byte_start: 0, byte_end: 1 };
        let mut job = shard_job(&batch(), &batch_spec(), &shard, attempt, &WorkerTemplate::default(), None);
        job.status = Some(k8s_openapi::api::batch::v1::JobStatus {
            conditions: Some(
                conditions
                    .iter()
                    .map(|(kind, status)| k8s_openapi::api::batch::v1::JobCondition {
                        type_: (*kind).into(),
                        status: (*status).into(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        job
    }

    /// A row: what it shows, the Jobs, the workers they stand for.
    type Row = (&'static str, Vec<Job>, Vec<(u32, WorkerPhase)>);

    #[test]
    fn jobs_become_workers_by_their_conditions() {
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            ("no Jobs, no workers", vec![], vec![]),
            ("no condition yet: running", vec![job_of(0, &[])], vec![(0, WorkerPhase::Running)]),
            ("Complete", vec![job_of(1, &[("Complete", "True")])], vec![(1, WorkerPhase::Succeeded)]),
            ("Failed (backoffLimit)", vec![job_of(2, &[("Failed", "True")])], vec![(2, WorkerPhase::Failed)]),
            ("a condition that does not hold", vec![job_of(3, &[("Failed", "False")])], vec![(3, WorkerPhase::Running)]),
            ("several, by shard",
             vec![job_of(4, &[("Complete", "True")]), job_of(0, &[])],
             vec![(0, WorkerPhase::Running), (4, WorkerPhase::Succeeded)]),
        ];
        for (case, jobs, expected) in table {
            let workers: Vec<(u32, WorkerPhase)> = job_workers(&jobs, &BTreeMap::new()).into_iter().collect();
            assert_eq!(workers, expected, "{case}");
        }
        let mut unlabelled = job_of(0, &[]);
        unlabelled.metadata.labels = None;
        assert!(job_workers(&[unlabelled], &BTreeMap::new()).is_empty(), "a Job without a shard label is not a worker");
    }

    #[test]
    fn a_job_of_an_earlier_attempt_is_not_the_shards_worker() {
        let failed = [("Failed", "True")];
        let failures = BTreeMap::from([(0, 1)]);
        // Shard 0 failed once: its attempt-0 Job was counted, and may linger in a cache.
        let stale = attempt_of(0, 0, &failed);
        assert!(job_workers(std::slice::from_ref(&stale), &failures).is_empty(), "counted once, not again");
        let current = attempt_of(0, 1, &[]);
        let workers = job_workers(&[stale, current.clone()], &failures);
        assert_eq!(workers, BTreeMap::from([(0, WorkerPhase::Running)]));
        assert_eq!(current.metadata.name.as_deref(), Some("batch-01abc-s0-r1"));
        assert_eq!(job_attempt(&current), 1);
    }
}
