//! A real, throw-away Kubernetes 1.20 control plane for integration tests.
//!
//! [`TestCluster`] starts etcd, kube-apiserver and kube-controller-manager
//! (binaries installed by `tests/tools/install-kube.sh`) on 127.0.0.1 inside a
//! temporary directory, with the same flags as `tests/tools/kube-smoke.sh`.
//! The controller manager runs every default controller, so Jobs create Pods,
//! the garbage collector cascades deletions and ServiceAccounts get token
//! Secrets, exactly as on a real cluster.
//!
//! Two tiers of nodes. The fast tier has no scheduler and no node: [`Kubelet`] stands in for the kubelet:
//! it runs each Pod of one namespace as a local process (container images map
//! to local executables) and reports the Pod's phase back through the status
//! subresource, so that the Job controller sees Pods run, succeed and fail.
//!
//! The real tier (`tests/common/node.rs`) adds kube-scheduler, a kubelet on containerd and
//! kube-proxy; its cluster is started with [`ClusterOptions::for_real_node`], so that pods
//! reach the API server through the `kubernetes` Service.
//!
//! Every component listens on 127.0.0.1 only (but the API server of a real-node cluster,
//! which listens on every address) and every client connects directly (proxy settings
//! from the environment are ignored).
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::future::Future;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, Namespace, Pod, PodCondition, PodStatus, Secret, ServiceAccount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config, ResourceExt};
use tempfile::TempDir;
use tokio::sync::{Semaphore, SemaphorePermit, oneshot, watch};
use tokio::task::{AbortHandle, JoinHandle};

/// Lines of each log printed when a test panics.
const LOG_TAIL_LINES: usize = 40;

/// The Services' ClusterIP range.
pub const SERVICE_CIDR: &str = "10.0.0.0/24";

// ---------------------------------------------------------------------------
// TestCluster
// ---------------------------------------------------------------------------

/// etcd + kube-apiserver + kube-controller-manager, stopped and deleted on drop.
///
/// Authentication is a static token file with one admin token (group
/// `system:masters`); authorization is RBAC, so ServiceAccount tokens see real
/// permission checks.
pub struct TestCluster {
    components: Vec<Component>,
    server_url: String,
    admin_token: String,
    kubeconfig: PathBuf,
    /// Plain HTTP(S) client for health endpoints (self-signed certs accepted).
    http: reqwest::Client,
    /// Declared after `components` so the directory is removed only after
    /// every process is gone.
    dir: TempDir,
    /// Caps how many clusters one test binary runs at once (see `cluster_slots`).
    _slot: SemaphorePermit<'static>,
}

/// One control-plane (or node) process and its log file.
pub struct Component {
    pub name: &'static str,
    pub child: Child,
    pub log: PathBuf,
}

impl Component {
    /// Starts `program args` with stdout and stderr to `<dir>/<name>.log`.
    pub fn spawn(dir: &Path, name: &'static str, program: &Path, args: &[String]) -> Component {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let err = out.try_clone().expect("clone log file handle");
        // The components don't fork, so killing their pid is enough. They
        // stay in the test's process group: Ctrl-C on `cargo test` (which
        // skips destructors) still stops them.
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name} ({}): {e}", program.display()));
        Component { name, child, log }
    }

    /// Panics if the process has exited.
    pub fn assert_running(&mut self, while_: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            print_tail(self.name, &self.log);
            panic!("{} exited early ({status}) while {while_}", self.name);
        }
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a [`TestCluster`] is started.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// An address of this host that pods can reach. When set, the API server listens on
    /// every address and advertises this one, and the `kubernetes` Service's endpoints are
    /// maintained (they point at it), as a real node's pods need.
    pub advertise: Option<std::net::Ipv4Addr>,
}

impl ClusterOptions {
    /// For a cluster with a real node: pods reach the API server at `host`.
    pub fn for_real_node(host: std::net::Ipv4Addr) -> Self {
        ClusterOptions { advertise: Some(host) }
    }
}

impl TestCluster {
    /// Starts a fresh control plane and waits until it serves requests.
    ///
    /// Panics (printing the component logs) if a binary is missing, a process
    /// exits early or a health check times out.
    pub async fn start() -> TestCluster {
        Self::start_with(ClusterOptions::default()).await
    }

    /// [`TestCluster::start`] with options.
    pub async fn start_with(options: ClusterOptions) -> TestCluster {
        let bins = Binaries::locate();
        let slot = cluster_slots().acquire().await.expect("cluster semaphore closed");
        let started = Instant::now();

        let dir = tempfile::Builder::new().prefix("nightshift-cluster-").tempdir().expect("create cluster tempdir");
        let d = dir.path();
        let [etcd_port, etcd_peer_port, api_port, kcm_port] = super::ports::claim();
        let admin_token = format!("nightshift-admin-{}", random_hex(16));
        let server_url = format!("https://127.0.0.1:{api_port}");

        // Token file format: token,user,uid,"group1,group2".
        std::fs::write(
            d.join("tokens.csv"),
            format!("{admin_token},nightshift-admin,nightshift-admin,\"system:masters\"\n"),
        )
        .expect("write tokens.csv");
        // Key pair used by the API server to sign and verify ServiceAccount
        // tokens, and by the controller manager's token controller.
        let sa_key = d.join("sa.key");
        let sa_pub = d.join("sa.pub");
        openssl(&["genrsa", "-out", path_str(&sa_key), "2048"]);
        openssl(&["rsa", "-in", path_str(&sa_key), "-pubout", "-out", path_str(&sa_pub)]);
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(&server_url, "nightshift-admin", &admin_token))
            .expect("write kubeconfig");

        let http = reqwest::Client::builder()
            .no_proxy()
            .danger_accept_invalid_certs(true)
            .timeout(Duration::from_secs(5))
            .build()
            .expect("build reqwest client");

        // From here on, a panic drops `cluster`, which kills what was started
        // and prints the logs.
        let mut cluster =
            TestCluster { components: Vec::new(), server_url, admin_token, kubeconfig, http, dir, _slot: slot };
        let d = cluster.dir.path().to_owned();

        let (advertise, bind, reconciler) = match options.advertise {
            Some(host) => (host.to_string(), "0.0.0.0", "lease"),
            None => ("127.0.0.1".to_owned(), "127.0.0.1", "none"),
        };
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
        cluster.spawn(
            "etcd",
            &bins.etcd,
            &[
                "--name=nightshift".into(),
                format!("--data-dir={}", d.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=nightshift={peer_url}"),
                "--initial-cluster-state=new".into(),
            ],
        );
        cluster
            .wait_healthy("etcd /health", &format!("{etcd_url}/health"), false, 30, |body| {
                body.contains(r#""health":"true""#)
            })
            .await;

        cluster.spawn(
            "kube-apiserver",
            &bins.apiserver,
            &[
                format!("--advertise-address={advertise}"),
                format!("--bind-address={bind}"),
                format!("--secure-port={api_port}"),
                "--insecure-port=0".into(),
                format!("--cert-dir={}", d.join("certs").display()),
                format!("--etcd-servers={etcd_url}"),
                format!("--token-auth-file={}", d.join("tokens.csv").display()),
                "--authorization-mode=RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", sa_pub.display()),
                format!("--service-account-signing-key-file={}", sa_key.display()),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                // 127.0.0.1 is not a valid Endpoints address: without a real node, don't
                // maintain the endpoints of the "kubernetes" service.
                format!("--endpoint-reconciler-type={reconciler}"),
                // Reach kubelets (logs, exec, port-forward) at their node's address: the
                // test node's name resolves nowhere.
                "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            ],
        );
        let readyz = format!("{}/readyz", cluster.server_url);
        cluster.wait_healthy("kube-apiserver /readyz", &readyz, true, 90, |b| b == "ok").await;

        cluster.spawn(
            "kube-controller-manager",
            &bins.controller_manager,
            &[
                format!("--kubeconfig={}", cluster.kubeconfig.display()),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={kcm_port}"),
                "--port=0".into(),
                format!("--cert-dir={}", d.join("kcm-certs").display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=false".into(),
                format!("--service-account-private-key-file={}", sa_key.display()),
                // The API server wrote its self-signed serving cert here at startup.
                format!("--root-ca-file={}", d.join("certs/apiserver.crt").display()),
                "--controllers=*".into(),
            ],
        );
        let healthz = format!("https://127.0.0.1:{kcm_port}/healthz");
        cluster.wait_healthy("kube-controller-manager /healthz", &healthz, false, 60, |b| b == "ok").await;

        eprintln!("[cluster] {} ready in {:.1?} (dir {})", cluster.server_url, started.elapsed(), d.display());
        cluster
    }

    /// `https://127.0.0.1:<port>` of the API server.
    pub fn server_url(&self) -> String {
        self.server_url.clone()
    }

    /// Bearer token of the cluster admin (group `system:masters`).
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// Kubeconfig file for the admin token (TLS verification disabled).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Temporary directory holding the cluster's state and component logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Client authenticated as the cluster admin.
    pub async fn client(&self) -> Client {
        self.client_for_token(&self.admin_token).await
    }

    /// Client authenticated with an arbitrary bearer token, e.g. one from
    /// [`TestCluster::service_account_token`].
    pub async fn client_for_token(&self, token: &str) -> Client {
        let yaml = kubeconfig_yaml(&self.server_url, "token-user", token);
        client_from_kubeconfig(Kubeconfig::from_yaml(&yaml).expect("parse generated kubeconfig")).await
    }

    /// Writes a kubeconfig for `token` into `dir` (a new file per call) and
    /// returns its path: for running a process (e.g. the operator binary) as
    /// a ServiceAccount.
    pub fn kubeconfig_for_token(&self, token: &str, dir: &Path) -> PathBuf {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let path = dir.join(format!("kubeconfig-{}", SEQ.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&path, kubeconfig_yaml(&self.server_url, "token-user", token))
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// Creates a namespace and waits until Pods can be created in it.
    ///
    /// On 1.20 the ServiceAccount admission plugin rejects Pods until the
    /// namespace's `default` ServiceAccount exists *and* has its token Secret
    /// (both made asynchronously by the controller manager). Without this
    /// wait the Job controller's first Pod creation fails and it retries only
    /// after a backoff, which makes tests slow and flaky.
    pub async fn create_namespace(&self, name: &str) {
        let client = self.client().await;
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name }
        }))
        .unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        let sas: Api<ServiceAccount> = Api::namespaced(client, name);
        eventually(&format!("default ServiceAccount with token in namespace {name}"), 60, || async {
            let sa = sas.get_opt("default").await.ok()??;
            (!sa.secrets.unwrap_or_default().is_empty()).then_some(())
        })
        .await;
    }

    /// Waits for the token Secret that the controller manager's token
    /// controller creates for ServiceAccount `namespace/sa` and returns the
    /// decoded token (a JWT the API server accepts as that ServiceAccount).
    ///
    /// The ServiceAccount must exist or be created by the caller; this only
    /// waits for its legacy, non-expiring token Secret (auto-created up to
    /// Kubernetes 1.23).
    pub async fn service_account_token(&self, namespace: &str, sa: &str) -> String {
        let client = self.client().await;
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let secrets: Api<Secret> = Api::namespaced(client, namespace);
        let lp = ListParams::default().fields("type=kubernetes.io/service-account-token");
        eventually(&format!("token Secret of ServiceAccount {namespace}/{sa}"), 60, || async {
            let uid = sas.get_opt(sa).await.ok()??.uid()?;
            secrets.list(&lp).await.ok()?.items.into_iter().find_map(|s| {
                let ann = s.metadata.annotations.as_ref()?;
                // Match the uid too: a Secret of a deleted namesake is useless.
                if ann.get("kubernetes.io/service-account.name")? != sa
                    || *ann.get("kubernetes.io/service-account.uid")? != uid
                {
                    return None;
                }
                let token = s.data?.remove("token")?;
                Some(String::from_utf8(token.0).expect("token is not UTF-8"))
            })
        })
        .await
    }

    /// Prints the last lines of every component's log to stderr.
    pub fn print_logs(&self) {
        for c in &self.components {
            print_tail(c.name, &c.log);
        }
    }

    fn spawn(&mut self, name: &'static str, program: &Path, args: &[String]) {
        let component = Component::spawn(self.dir.path(), name, program, args);
        self.components.push(component);
    }

    /// Polls `url` until `ok(body)` holds for a 2xx response; panics if a
    /// component exits or `timeout_secs` pass.
    async fn wait_healthy(
        &mut self,
        what: &str,
        url: &str,
        with_token: bool,
        timeout_secs: u64,
        ok: impl Fn(&str) -> bool,
    ) {
        let started = Instant::now();
        loop {
            for c in &mut self.components {
                if let Ok(Some(status)) = c.child.try_wait() {
                    panic!("{} exited early ({status}) while waiting for {what}", c.name);
                }
            }
            let mut req = self.http.get(url);
            if with_token {
                req = req.bearer_auth(&self.admin_token);
            }
            if let Ok(resp) = req.send().await
                && resp.status().is_success()
                && resp.text().await.is_ok_and(|b| ok(b.trim()))
            {
                eprintln!("[cluster] {what}: ok after {:.1?}", started.elapsed());
                return;
            }
            if started.elapsed() > Duration::from_secs(timeout_secs) {
                panic!("timed out after {timeout_secs}s waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_logs();
            eprintln!("[cluster] state was in {}", self.dir.path().display());
        }
        // SIGKILL in reverse start order: all state is thrown away, so a
        // graceful shutdown would only cost time.
        for c in self.components.iter_mut().rev() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
    }
}

/// Builds a client from a kubeconfig, always connecting directly (kube reads
/// `HTTPS_PROXY` from the environment; the test cluster is on 127.0.0.1).
pub async fn client_from_kubeconfig(kubeconfig: Kubeconfig) -> Client {
    let mut config =
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("load kubeconfig");
    config.proxy_url = None;
    Client::try_from(config).expect("build kube client")
}

/// [`client_from_kubeconfig`] for a kubeconfig file, e.g. one written by
/// [`TestCluster::kubeconfig_for_token`].
pub async fn client_from_kubeconfig_file(path: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    client_from_kubeconfig(kubeconfig).await
}

/// Polls `check` every 200 ms until it returns `Some`, panicking after
/// `timeout_secs` with `what` in the message.
pub async fn eventually<T, F, Fut>(what: &str, timeout_secs: u64, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(timeout_secs);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout_secs}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Paths of the control-plane binaries.
struct Binaries {
    etcd: PathBuf,
    apiserver: PathBuf,
    controller_manager: PathBuf,
}

impl Binaries {
    /// From `ETCD` / `KUBE_APISERVER` / `KUBE_CONTROLLER_MANAGER`, else from
    /// `<cache>/kube/env.sh` written by `tests/tools/install-kube.sh`.
    fn locate() -> Binaries {
        Binaries {
            etcd: tool("kube", "ETCD"),
            apiserver: tool("kube", "KUBE_APISERVER"),
            controller_manager: tool("kube", "KUBE_CONTROLLER_MANAGER"),
        }
    }
}

/// The value of `var`: from the environment, else from `<cache>/<installer>/env.sh`, which
/// `tests/tools/install-<installer>.sh` writes (`kube`, `node`).
pub fn tool_setting(installer: &str, var: &str) -> Option<String> {
    if let Some(value) = std::env::var(var).ok().filter(|v| !v.is_empty()) {
        return Some(value);
    }
    let cache = std::env::var_os("NIGHTSHIFT_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache/nightshift"));
    let env_file = cache.join(installer).join("env.sh");
    std::fs::read_to_string(&env_file).unwrap_or_default().lines().find_map(|line| {
        let (key, value) = line.trim().strip_prefix("export ")?.split_once('=')?;
        (key == var).then(|| value.trim_matches(['"', '\'']).to_owned())
    })
}

/// The executable named by [`tool_setting`]; panics with how to install it.
pub fn tool(installer: &str, var: &str) -> PathBuf {
    match tool_setting(installer, var).map(PathBuf::from) {
        Some(p) if is_executable(&p) => p,
        other => panic!(
            "{var} not found or not executable ({other:?}; looked at ${var} and the cache's {installer}/env.sh). \
             Run tests/tools/install-{installer}.sh (tests/run runs it)."
        ),
    }
}

/// Each cluster needs ~0.5 GB and a good share of a CPU while starting, and
/// the test harness runs tests in parallel; limit concurrent clusters per
/// test binary (`NIGHTSHIFT_TEST_MAX_CLUSTERS`, default 2).
fn cluster_slots() -> &'static Semaphore {
    static SLOTS: OnceLock<Semaphore> = OnceLock::new();
    SLOTS.get_or_init(|| {
        let n = std::env::var("NIGHTSHIFT_TEST_MAX_CLUSTERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(2);
        Semaphore::new(n)
    })
}

fn kubeconfig_yaml(server: &str, user: &str, token: &str) -> String {
    // A JSON string literal is a valid YAML double-quoted scalar.
    let token = serde_json::to_string(token).unwrap();
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: nightshift-test
  cluster:
    server: {server}
    insecure-skip-tls-verify: true
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: nightshift-test
  context:
    cluster: nightshift-test
    user: {user}
    namespace: default
current-context: nightshift-test
"
    )
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run openssl (is it installed?): {e}"));
    assert!(out.status.success(), "openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).expect("read /dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn is_executable(path: &Path) -> bool {
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("non-UTF-8 temp path")
}

pub fn print_tail(what: &str, path: &Path) {
    let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    eprintln!("===== last lines of {what} ({}) =====", path.display());
    for line in &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..] {
        eprintln!("{line}");
    }
}

// ---------------------------------------------------------------------------
// Kubelet
// ---------------------------------------------------------------------------

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
