//! A real, throw-away Kubernetes 1.20 control plane for integration tests.
//!
//! [`TestCluster`] starts etcd, kube-apiserver and kube-controller-manager
//! (binaries installed by `tests/tools/install-kube.sh`) on 127.0.0.1 inside a
//! temporary directory, with the same flags as `tests/tools/kube-smoke.sh`.
//! The controller manager runs every default controller, so Jobs create Pods,
//! the garbage collector cascades deletions and ServiceAccounts get token
//! Secrets, exactly as on a real cluster.
//!
//! Two tiers of nodes. The fast tier has no scheduler and no node: a
//! [`Kubelet`](super::kubelet::Kubelet) stands in for the kubelet: it runs each Pod of one
//! namespace as a local process (container images map to local executables) and reports
//! the Pod's phase back through the status subresource, so that the Job controller sees
//! Pods run, succeed and fail.
//!
//! The real tier (`tests/common/node.rs`) adds kube-scheduler, a kubelet on containerd and
//! kube-proxy; its cluster is started with [`ClusterOptions::for_real_node`], so that pods
//! reach the API server through the `kubernetes` Service.
//!
//! Every component listens on 127.0.0.1 only (but the API server of a real-node cluster,
//! which listens on every address) and every client connects directly (proxy settings
//! from the environment are ignored).
#![allow(dead_code)]

use std::fs::File;
use std::future::Future;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};
use tempfile::TempDir;
use tokio::sync::{Semaphore, SemaphorePermit};

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
