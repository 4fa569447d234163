//! The fast tier's node: a stand-in for the kubelet that runs the Pods of one namespace
//! as local processes and reports their phase to a [`TestCluster`](super::cluster::TestCluster)'s
//! API server (`tests/common/cluster.rs` says where each tier stands).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, Pod, PodCondition, PodStatus, Secret,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tempfile::TempDir;
use tokio::sync::{oneshot, watch};
use tokio::task::{AbortHandle, JoinHandle};

use super::cluster::print_tail;

/// Stand-in for a kubelet: runs the Pods of one namespace as local processes.
///
/// Emulated container-runtime behaviour, per Pod:
/// * only the first container runs (init and sidecar containers are ignored);
/// * its `image` must be a key of the image map; the mapped executable is the
///   program, with argv `command[1..] ++ args` if `command` is set, else
///   `args` (i.e. `command[0]` stands for the image's entrypoint);
/// * `env`: `value` (with `$(VAR)` expansion), `valueFrom.secretKeyRef`,
///   `valueFrom.configMapKeyRef`, and `valueFrom.fieldRef` for
///   `metadata.name|namespace|uid` and `spec.serviceAccountName`; `$(VAR)`
///   references in `command`/`args` are expanded too. The process also gets
///   `PATH` and `HOME` of the test process and `HOSTNAME` = Pod name. A
///   missing Secret/ConfigMap keeps the Pod Pending
///   (`CreateContainerConfigError`) and is retried, like the real kubelet;
/// * the process gets its own process group (standing in for the container's
///   pid namespace): signals go to the whole group, and when the main process
///   exits whatever it left behind is killed;
/// * `restartPolicy` is always treated as `Never`.
///
/// Status: phase `Running` once started, then `Succeeded` (exit 0) or
/// `Failed` with `containerStatuses[0].state.terminated.exitCode`
/// (128 + signal if killed by a signal).
///
/// Deletion: SIGTERM to the process group, SIGKILL after the Pod's
/// `terminationGracePeriodSeconds` (capped at 30 s). Because Pods are never
/// bound to a node, the API server deletes them immediately (no graceful
/// `deletionTimestamp` phase), so the final status of a deleted Pod is not
/// reported anywhere.
pub struct Kubelet {
    shared: Arc<Shared>,
    watch_task: JoinHandle<()>,
}

struct Shared {
    client: Client,
    namespace: String,
    images: HashMap<String, PathBuf>,
    /// Per-pod log files and working directories.
    dir: TempDir,
    /// Keyed by Pod uid; entries are kept after the Pod ends (for logs).
    pods: Mutex<HashMap<String, PodEntry>>,
    seq: AtomicUsize,
}

struct PodEntry {
    name: String,
    /// Creation order, to prefer the newest Pod when names repeat.
    seq: usize,
    log: PathBuf,
    /// Set once the process runs: its pid (= process group id) and a channel
    /// carrying its exit code once it has exited.
    process: Option<(u32, watch::Receiver<Option<i32>>)>,
    /// Flipped to `true` when the Pod is deleted.
    deleted: watch::Sender<bool>,
    task: AbortHandle,
}

/// Why a Pod's process can't be started (yet).
enum StartError {
    /// Retried, e.g. a referenced Secret doesn't exist yet.
    Retry { reason: &'static str, message: String },
    /// Never going to work (unknown image, unsupported feature).
    Fatal { reason: &'static str, message: String },
}

/// Everything needed to spawn a Pod's process.
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    workdir: PathBuf,
    grace: Duration,
}

impl Kubelet {
    /// Starts watching Pods in `namespace`; returns once the initial list has
    /// been processed. `images` maps image names to local executables.
    pub async fn start(client: Client, namespace: &str, images: HashMap<String, PathBuf>) -> Kubelet {
        let dir = tempfile::Builder::new().prefix("nightshift-kubelet-").tempdir().expect("create kubelet tempdir");
        let shared = Arc::new(Shared {
            client,
            namespace: namespace.to_owned(),
            images,
            dir,
            pods: Mutex::new(HashMap::new()),
            seq: AtomicUsize::new(0),
        });
        let (ready_tx, ready_rx) = oneshot::channel();
        let watch_task = tokio::spawn(watch_pods(shared.clone(), ready_tx));
        tokio::time::timeout(Duration::from_secs(30), ready_rx)
            .await
            .expect("kubelet: initial Pod list timed out")
            .expect("kubelet: watch task ended before the initial list");
        Kubelet { shared, watch_task }
    }

    /// SIGKILLs the Pod's processes, like a crashing container; the Pod is
    /// then reported `Failed` with exit code 137. Panics if the Pod has no
    /// running process.
    pub fn kill_pod_process(&self, pod_name: &str) {
        let pods = self.shared.pods.lock().unwrap();
        match newest(&pods, pod_name).and_then(|e| e.process.as_ref()) {
            Some((pgid, exit)) if exit.borrow().is_none() => signal_group(*pgid, "KILL"),
            _ => panic!("kubelet: pod {pod_name} has no running process"),
        }
    }

    /// Names of the Pods whose process is running, sorted.
    pub fn running_pods(&self) -> Vec<String> {
        let pods = self.shared.pods.lock().unwrap();
        let mut names: Vec<String> = pods
            .values()
            .filter(|e| e.process.as_ref().is_some_and(|(_, exit)| exit.borrow().is_none()))
            .map(|e| e.name.clone())
            .collect();
        names.sort();
        names
    }

    /// Combined stdout/stderr of the Pod's process so far ("" if the Pod was
    /// never started).
    pub fn pod_log(&self, pod_name: &str) -> String {
        let log = match newest(&self.shared.pods.lock().unwrap(), pod_name) {
            Some(e) => e.log.clone(),
            None => return String::new(),
        };
        std::fs::read(&log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.watch_task.abort();
        let pods = self.shared.pods.lock().unwrap();
        for entry in pods.values() {
            // Abort first so no status is reported for the processes killed here.
            entry.task.abort();
            if let Some((pgid, _)) = &entry.process {
                signal_group(*pgid, "KILL");
            }
            if std::thread::panicking() {
                print_tail(&format!("pod {}", entry.name), &entry.log);
            }
        }
    }
}

/// The entry of the newest Pod named `name`.
fn newest<'a>(pods: &'a HashMap<String, PodEntry>, name: &str) -> Option<&'a PodEntry> {
    pods.values().filter(|e| e.name == name).max_by_key(|e| e.seq)
}

async fn watch_pods(shared: Arc<Shared>, ready: oneshot::Sender<()>) {
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut ready = Some(ready);
    // Uids seen during a (re)list: Pods deleted while the watch was
    // disconnected produce no Delete event, only absence from the relist.
    let mut listed = HashSet::new();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => listed.clear(),
            Ok(watcher::Event::InitApply(pod)) => {
                listed.extend(pod.uid());
                shared.pod_seen(pod);
            }
            Ok(watcher::Event::InitDone) => {
                let pods = shared.pods.lock().unwrap();
                for (uid, entry) in pods.iter() {
                    if !listed.contains(uid) {
                        entry.deleted.send_replace(true);
                    }
                }
                drop(pods);
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
            }
            Ok(watcher::Event::Apply(pod)) => shared.pod_seen(pod),
            Ok(watcher::Event::Delete(pod)) => shared.pod_deleted(&pod.uid().unwrap_or_default()),
            Err(e) => eprintln!("[kubelet] watch error (retrying): {e}"),
        }
    }
}

impl Shared {
    fn pod_api(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Handles an added/modified Pod: starts new Pending Pods, notices deletions.
    fn pod_seen(self: &Arc<Self>, pod: Pod) {
        let Some(uid) = pod.uid() else { return };
        if pod.metadata.deletion_timestamp.is_some() {
            self.pod_deleted(&uid);
            return;
        }
        let mut pods = self.pods.lock().unwrap();
        if pods.contains_key(&uid) {
            return;
        }
        // Only Pending Pods are ours to start; a Pod that is already running
        // or finished was handled by an earlier Kubelet (or someone else).
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if !matches!(phase, None | Some("Pending")) {
            return;
        }
        let name = pod.name_any();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let log = self.dir.path().join(format!("{name}-{}.log", &uid[..8.min(uid.len())]));
        let (deleted, deleted_rx) = watch::channel(false);
        let task = tokio::spawn(self.clone().run_pod(pod, deleted_rx)).abort_handle();
        pods.insert(uid, PodEntry { name, seq, log, process: None, deleted, task });
    }

    fn pod_deleted(&self, uid: &str) {
        if let Some(entry) = self.pods.lock().unwrap().get(uid) {
            entry.deleted.send_replace(true);
        }
    }

    /// The life of one Pod: resolve its container, run it, report status,
    /// terminate it when the Pod is deleted.
    async fn run_pod(self: Arc<Self>, pod: Pod, mut deleted: watch::Receiver<bool>) {
        let name = pod.name_any();
        let uid = pod.uid().unwrap_or_default();
        let container = pod.spec.as_ref().and_then(|s| s.containers.first()).cloned().unwrap_or_default();

        let mut last_error = String::new();
        let launch = loop {
            let (reason, message, retry) = match self.prepare(&pod, &container).await {
                Ok(launch) => break launch,
                Err(StartError::Retry { reason, message }) => (reason, message, true),
                Err(StartError::Fatal { reason, message }) => (reason, message, false),
            };
            if message != last_error {
                eprintln!("[kubelet] pod {name}: cannot start container: {reason}: {message}");
                self.report(&name, &uid, waiting_status(&container, reason, &message)).await;
                last_error = message;
            }
            if !retry {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = until_deleted(&mut deleted) => return,
            }
        };

        let started_at = now();
        let Some((pgid, mut exit)) = self.spawn_process(&uid, &launch) else {
            return; // deleted before it could start
        };
        eprintln!("[kubelet] pod {name}: started pid {pgid}: {} {:?}", launch.program.display(), launch.args);
        self.report(&name, &uid, running_status(&container, &started_at)).await;

        let still_exists = deleted.clone();
        tokio::select! {
            code = wait_exit(&mut exit) => {
                eprintln!("[kubelet] pod {name}: exited with code {code}");
                if !*still_exists.borrow() {
                    self.report(&name, &uid, terminated_status(&container, &started_at, code)).await;
                }
            }
            () = until_deleted(&mut deleted) => {
                eprintln!("[kubelet] pod {name}: deleted; sending SIGTERM (grace {:?})", launch.grace);
                signal_group(pgid, "TERM");
                let code = match tokio::time::timeout(launch.grace, wait_exit(&mut exit)).await {
                    Ok(code) => code,
                    Err(_) => {
                        eprintln!("[kubelet] pod {name}: still running after grace period; SIGKILL");
                        signal_group(pgid, "KILL");
                        wait_exit(&mut exit).await
                    }
                };
                eprintln!("[kubelet] pod {name}: terminated with code {code}");
            }
        }
    }

    /// Resolves program, argv, environment and grace period of a Pod.
    async fn prepare(&self, pod: &Pod, c: &Container) -> Result<Launch, StartError> {
        let fatal = |reason, message: String| StartError::Fatal { reason, message };
        let spec = pod.spec.as_ref().ok_or_else(|| fatal("InvalidPod", "pod has no spec".into()))?;
        let image = c.image.clone().unwrap_or_default();
        let program = self.images.get(&image).cloned().ok_or_else(|| {
            fatal(
                "ErrImagePull",
                format!("image {image:?} is not in the test Kubelet's image map {:?}", self.images.keys()),
            )
        })?;
        if c.env_from.is_some() {
            return Err(fatal("Unsupported", "envFrom is not supported by the test Kubelet".into()));
        }

        let mut env: Vec<(String, String)> =
            ["PATH", "HOME"].into_iter().filter_map(|k| Some((k.to_owned(), std::env::var(k).ok()?))).collect();
        env.push(("HOSTNAME".into(), pod.name_any()));
        for var in c.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(v), _) => Some(expand(v, &env)),
                (None, Some(from)) => self.env_value_from(pod, from).await?,
                (None, None) => Some(String::new()),
            };
            if let Some(value) = value {
                env.retain(|(k, _)| *k != var.name);
                env.push((var.name.clone(), value));
            }
        }

        let command = c.command.iter().flatten().skip(1);
        let args = command.chain(c.args.iter().flatten()).map(|a| expand(a, &env)).collect();
        let workdir = match &c.working_dir {
            Some(dir) => PathBuf::from(dir),
            None => {
                let dir = self.dir.path().join(format!("{}-{}", pod.name_any(), pod.uid().unwrap_or_default()));
                std::fs::create_dir_all(&dir).expect("create pod workdir");
                dir
            }
        };
        let grace = spec.termination_grace_period_seconds.unwrap_or(30).clamp(0, 30);
        Ok(Launch { program, args, env, workdir, grace: Duration::from_secs(grace as u64) })
    }

    /// Value of an `env[].valueFrom`; `Ok(None)` for a missing optional key.
    async fn env_value_from(
        &self,
        pod: &Pod,
        from: &k8s_openapi::api::core::v1::EnvVarSource,
    ) -> Result<Option<String>, StartError> {
        let retry = |message: String| StartError::Retry { reason: "CreateContainerConfigError", message };
        if let Some(r) = &from.secret_key_ref {
            let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
            let data = match api.get_opt(&r.name).await {
                Ok(Some(s)) => s.data.unwrap_or_default(),
                Ok(None) if r.optional == Some(true) => return Ok(None),
                Ok(None) => return Err(retry(format!("secret {:?} not found", r.name))),
                Err(e) => return Err(retry(format!("get secret {:?}: {e}", r.name))),
            };
            return match data.get(&r.key) {
                Some(v) => Ok(Some(String::from_utf8_lossy(&v.0).into_owned())),
                None if r.optional == Some(true) => Ok(None),
                None => Err(retry(format!("couldn't find key {} in Secret {}", r.key, r.name))),
            };
        }
        if let Some(r) = &from.config_map_key_ref {
            let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
            let data: BTreeMap<String, String> = match api.get_opt(&r.name).await {
                Ok(Some(cm)) => cm.data.unwrap_or_default(),
                Ok(None) if r.optional == Some(true) => return Ok(None),
                Ok(None) => return Err(retry(format!("configmap {:?} not found", r.name))),
                Err(e) => return Err(retry(format!("get configmap {:?}: {e}", r.name))),
            };
            return match data.get(&r.key) {
                Some(v) => Ok(Some(v.clone())),
                None if r.optional == Some(true) => Ok(None),
                None => Err(retry(format!("couldn't find key {} in ConfigMap {}", r.key, r.name))),
            };
        }
        if let Some(r) = &from.field_ref {
            let spec = pod.spec.as_ref();
            let value = match r.field_path.as_str() {
                "metadata.name" => pod.metadata.name.clone(),
                "metadata.namespace" => pod.metadata.namespace.clone(),
                "metadata.uid" => pod.metadata.uid.clone(),
                "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
                other => {
                    return Err(StartError::Fatal {
                        reason: "Unsupported",
                        message: format!("fieldRef {other:?} is not supported by the test Kubelet"),
                    });
                }
            };
            return Ok(Some(value.unwrap_or_default()));
        }
        Err(StartError::Fatal {
            reason: "Unsupported",
            message: format!("env valueFrom {from:?} is not supported by the test Kubelet"),
        })
    }

    /// Spawns the process and records it, unless the Pod was deleted
    /// meanwhile (checked under the same lock the deletion path takes).
    fn spawn_process(&self, uid: &str, launch: &Launch) -> Option<(u32, watch::Receiver<Option<i32>>)> {
        let mut pods = self.pods.lock().unwrap();
        let entry = pods.get_mut(uid)?;
        if *entry.deleted.borrow() {
            return None;
        }
        let out = File::create(&entry.log).unwrap_or_else(|e| panic!("create {}: {e}", entry.log.display()));
        let err = out.try_clone().expect("clone log file handle");
        let mut child = match Command::new(&launch.program)
            .args(&launch.args)
            .env_clear()
            .envs(launch.env.iter().cloned())
            .current_dir(&launch.workdir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                // Show up in pod_log and as a failed container (exit 128, like runc).
                let _ = std::fs::write(
                    &entry.log,
                    format!("test kubelet: cannot start {}: {e}\n", launch.program.display()),
                );
                let (_, rx) = watch::channel(Some(128));
                return Some((0, rx));
            }
        };
        let pgid = child.id();
        let (exit_tx, exit_rx) = watch::channel(None);
        // std::process has no async wait (and tokio's "process" feature is
        // not enabled), so a thread blocks on wait() for each process.
        std::thread::spawn(move || {
            let code = match child.wait() {
                Ok(status) => status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
                Err(_) => 255,
            };
            // As when a container's pid namespace goes away: nothing the main
            // process left behind survives it.
            signal_group(pgid, "KILL");
            let _ = exit_tx.send(Some(code));
        });
        entry.process = Some((pgid, exit_rx.clone()));
        Some((pgid, exit_rx))
    }

    /// Merge-patches the Pod's status. Gives up quietly if the Pod is gone;
    /// `metadata.uid` in the patch makes it fail rather than touch a newer
    /// Pod with the same name.
    async fn report(&self, name: &str, uid: &str, status: PodStatus) {
        let patch = serde_json::json!({ "metadata": { "uid": uid }, "status": status });
        let api = self.pod_api();
        for attempt in 1..=5 {
            match api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(kube::Error::Api(s)) if s.code < 500 && s.code != 429 => {
                    eprintln!("[kubelet] pod {name}: status update rejected: {} ({})", s.message, s.code);
                    return;
                }
                Err(e) => {
                    eprintln!("[kubelet] pod {name}: status update failed (attempt {attempt}): {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Sends `signal` (a `kill -s` name) to process group `pgid`.
fn signal_group(pgid: u32, signal: &str) {
    if pgid == 0 {
        return; // never started; `kill -- -0` would hit the test's own group
    }
    let _ = Command::new("kill")
        .args(["-s", signal, "--", &format!("-{pgid}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

async fn until_deleted(deleted: &mut watch::Receiver<bool>) {
    // An error means the Kubelet is gone; treat that as deletion too.
    let _ = deleted.wait_for(|d| *d).await;
}

async fn wait_exit(exit: &mut watch::Receiver<Option<i32>>) -> i32 {
    match exit.wait_for(Option::is_some).await {
        Ok(code) => code.unwrap(),
        Err(_) => 255, // waiter thread vanished
    }
}

/// Kubernetes `$(VAR)` expansion (as in the kubelet): `$(NAME)` becomes the
/// value of a defined variable and stays verbatim otherwise; `$$` is an
/// escaped `$`.
fn expand(input: &str, vars: &[(String, String)]) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some((name, tail)) = after.strip_prefix('(').and_then(|a| a.split_once(')')) {
            match vars.iter().rev().find(|(k, _)| k == name) {
                Some((_, value)) => out.push_str(value),
                None => out.push_str(&format!("$({name})")),
            }
            rest = tail;
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn now() -> Time {
    Time(Timestamp::now())
}

fn condition(type_: &str, status: &str) -> PodCondition {
    PodCondition { type_: type_.into(), status: status.into(), last_transition_time: Some(now()), ..Default::default() }
}

fn container_status(c: &Container, ready: bool, state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone().unwrap_or_default(),
        image_id: String::new(),
        ready,
        restart_count: 0,
        started: Some(ready),
        state: Some(state),
        ..Default::default()
    }
}

fn waiting_status(c: &Container, reason: &str, message: &str) -> PodStatus {
    let state = ContainerState {
        waiting: Some(ContainerStateWaiting { reason: Some(reason.into()), message: Some(message.into()) }),
        ..Default::default()
    };
    PodStatus {
        phase: Some("Pending".into()),
        container_statuses: Some(vec![container_status(c, false, state)]),
        ..Default::default()
    }
}

fn running_status(c: &Container, started_at: &Time) -> PodStatus {
    let state = ContainerState {
        running: Some(ContainerStateRunning { started_at: Some(started_at.clone()) }),
        ..Default::default()
    };
    PodStatus {
        phase: Some("Running".into()),
        start_time: Some(started_at.clone()),
        conditions: Some(vec![condition("ContainersReady", "True"), condition("Ready", "True")]),
        container_statuses: Some(vec![container_status(c, true, state)]),
        ..Default::default()
    }
}

fn terminated_status(c: &Container, started_at: &Time, exit_code: i32) -> PodStatus {
    let state = ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code,
            reason: Some(if exit_code == 0 { "Completed" } else { "Error" }.into()),
            started_at: Some(started_at.clone()),
            finished_at: Some(now()),
            ..Default::default()
        }),
        ..Default::default()
    };
    PodStatus {
        phase: Some(if exit_code == 0 { "Succeeded" } else { "Failed" }.into()),
        start_time: Some(started_at.clone()),
        conditions: Some(vec![condition("ContainersReady", "False"), condition("Ready", "False")]),
        container_statuses: Some(vec![container_status(c, false, state)]),
        ..Default::default()
    }
}
