//! A real Kubernetes node for the test cluster: kube-scheduler, a kubelet running pods in
//! containers through containerd (runc, overlayfs, a CNI bridge), and kube-proxy (iptables
//! mode), so that pods are scheduled, run the image under their securityContext, mount
//! ConfigMaps, Secrets and ServiceAccount tokens, get pod IPs, and Services route to them.
//!
//! The Kubernetes binaries come from `tests/tools/install-kube.sh` (the same Debian source
//! build as kube-apiserver); containerd, runc, the CNI plugins, the base and pause images
//! from `tests/tools/install-node.sh`. The cluster must be started with
//! [`ClusterOptions::for_real_node`] so pods reach the API server.
//!
//! What this VM (Debian 12, Firecracker, root without CAP_SYS_RESOURCE, cgroup v1 with an
//! empty cgroup2 mounted beside it) needs, as found out here:
//! - kubelet: `cgroupDriver: cgroupfs` (no systemd), `failSwapOn: false` (harmless: there
//!   is no swap), `--oom-score-adj=0` (a negative score needs CAP_SYS_RESOURCE), eviction
//!   thresholds low enough that a test machine's disk never evicts the pods;
//! - containerd: `restrict_oom_score_adj` (the sandbox's -998 would be refused the same
//!   way), runc through `io.containerd.runc.v2` with cgroupfs, network namespaces kept
//!   under its own state directory, so that teardown finds every mount it made;
//! - kube-proxy: `--conntrack-max-per-core=0` (leave the host's conntrack table alone),
//!   `--oom-score-adj=0`; iptables (nf_tables) and br_netfilter are built into the kernel;
//! - no cluster DNS: pods are given IPs (the host's for S3 and the test upstream), the
//!   `kubernetes` Service's ClusterIP for the API server;
//! - this VM's network answers a TCP connection to any outside address on port 8080 (404,
//!   no body). A connection to a Service that kube-proxy did not DNAT (between its removal
//!   of a Service's REJECT and its DNAT, as a Deployment wakes from zero replicas) would
//!   reach that answer, where a cluster's network would lose it: the node refuses traffic
//!   to the Service range that was not DNAT'd ([`ServiceRangeFence`]).
//!
//! One node at a time per machine (the bridge, the iptables chains and `/kubepods` are the
//! host's): [`RealNode::start`] takes a lock file.
#![allow(dead_code)]

use std::fs::File;
use std::net::{Ipv4Addr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use super::cluster::{Component, TestCluster, eventually, print_tail, tool, tool_setting};

/// The node's name (its `kubernetes.io/hostname` label).
pub const NODE_NAME: &str = "nightshift-node";
/// Pod addresses (the CNI bridge's host-local range).
pub const POD_CIDR: &str = "10.244.0.0/24";
/// The CNI bridge on the host.
const BRIDGE: &str = "nsbr0";

/// containerd, kubelet, kube-proxy and kube-scheduler for one [`TestCluster`]; torn down
/// (containers killed, mounts removed) when dropped.
pub struct RealNode {
    components: Vec<Component>,
    containerd_socket: PathBuf,
    ctr: PathBuf,
    podman: PathBuf,
    containers_conf: String,
    dir: tempfile::TempDir,
    _fence: ServiceRangeFence,
    _lock: File,
}

impl RealNode {
    /// Starts the node's processes and waits until the Node is Ready.
    pub async fn start(cluster: &TestCluster, host: Ipv4Addr) -> RealNode {
        let lock = node_lock();
        let started = Instant::now();
        let dir = tempfile::Builder::new().prefix("nightshift-node-").tempdir().expect("create node tempdir");
        let d = dir.path().to_owned();
        let ctr = tool("node", "CTR");
        let mut node = RealNode {
            components: Vec::new(),
            containerd_socket: d.join("containerd/containerd.sock"),
            ctr,
            podman: tool("node", "PODMAN"),
            containers_conf: tool_setting("node", "CONTAINERS_CONF").expect("CONTAINERS_CONF from install-node.sh"),
            dir,
            _fence: ServiceRangeFence::raise(),
            _lock: lock,
        };

        // containerd with a private root, state and socket, and the CNI bridge.
        let cni_conf = d.join("cni");
        std::fs::create_dir_all(&cni_conf).unwrap();
        std::fs::write(cni_conf.join("10-nightshift.conflist"), cni_config(&d.join("cni-ipam"))).unwrap();
        let pause = tool_setting("node", "NODE_PAUSE_IMAGE").expect("NODE_PAUSE_IMAGE from install-node.sh");
        let cni_bin = tool_setting("node", "CNI_BIN_DIR").unwrap_or_else(|| "/usr/lib/cni".into());
        let runc = tool("node", "RUNC");
        std::fs::write(d.join("containerd.toml"), containerd_config(&d, &pause, &cni_bin, &cni_conf, &runc)).unwrap();
        let containerd = Component::spawn(
            &d,
            "containerd",
            &tool("node", "CONTAINERD"),
            &["--config".into(), d.join("containerd.toml").display().to_string()],
        );
        node.components.push(containerd);
        node.wait_for("containerd's socket", 30, |n| n.containerd_socket.exists() && n.ctr(&["version"]).is_ok()).await;
        node.load_images(&[&pause]);

        // kube-scheduler.
        let kubeconfig = cluster.kubeconfig_path().display().to_string();
        let [scheduler_port, kubelet_port, kubelet_healthz, proxy_healthz, proxy_metrics] = super::ports::claim();
        node.spawn(
            "kube-scheduler",
            &tool("kube", "KUBE_SCHEDULER"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                "--leader-elect=false".into(),
                "--port=0".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={scheduler_port}"),
                format!("--cert-dir={}", d.join("scheduler-certs").display()),
            ],
        );

        // The kubelet.
        std::fs::write(d.join("kubelet.yaml"), kubelet_config(kubelet_port, kubelet_healthz)).unwrap();
        node.spawn(
            "kubelet",
            &tool("kube", "KUBELET"),
            &[
                format!("--config={}", d.join("kubelet.yaml").display()),
                format!("--kubeconfig={kubeconfig}"),
                "--container-runtime=remote".into(),
                format!("--container-runtime-endpoint=unix://{}", node.containerd_socket.display()),
                "--runtime-request-timeout=2m".into(),
                format!("--root-dir={}", d.join("kubelet").display()),
                format!("--cert-dir={}", d.join("kubelet-certs").display()),
                format!("--hostname-override={NODE_NAME}"),
                format!("--node-ip={host}"),
                "--oom-score-adj=0".into(),
                "--v=1".into(),
            ],
        );

        // kube-proxy.
        node.spawn(
            "kube-proxy",
            &tool("kube", "KUBE_PROXY"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--hostname-override={NODE_NAME}"),
                "--proxy-mode=iptables".into(),
                format!("--cluster-cidr={POD_CIDR}"),
                "--conntrack-max-per-core=0".into(),
                "--oom-score-adj=0".into(),
                format!("--healthz-bind-address=127.0.0.1:{proxy_healthz}"),
                format!("--metrics-bind-address=127.0.0.1:{proxy_metrics}"),
            ],
        );

        let nodes: Api<Node> = Api::all(cluster.client().await);
        let ready = async {
            eventually("the node to be Ready", 120, || async {
                let n = nodes.get_opt(NODE_NAME).await.ok()??;
                let ready = n.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True");
                ready.then_some(())
            })
            .await
        };
        // A component that dies while we wait makes the wait pointless: check them too.
        tokio::select! {
            () = ready => {}
            () = node.watch_components("the node starts") => {}
        }
        eprintln!("[node] {NODE_NAME} ready in {:.1?} (dir {})", started.elapsed(), d.display());
        node
    }

    /// Copies images from podman's store into the node's containerd (namespace `k8s.io`), as
    /// a registry pull would: pods with `imagePullPolicy: IfNotPresent` find them.
    pub fn load_images(&self, images: &[&str]) {
        let archive = self.dir.path().join("images.tar");
        let _ = std::fs::remove_file(&archive);
        let out = Command::new(&self.podman)
            .env("CONTAINERS_CONF", &self.containers_conf)
            .args(["save", "--quiet", "--multi-image-archive", "--format", "docker-archive", "-o"])
            .arg(&archive)
            .args(images)
            .output()
            .expect("run podman save");
        assert!(out.status.success(), "podman save {images:?}: {}", String::from_utf8_lossy(&out.stderr));
        let path = archive.display().to_string();
        self.ctr(&["images", "import", "--no-unpack", &path]).unwrap_or_else(|e| panic!("ctr import {images:?}: {e}"));
        let _ = std::fs::remove_file(&archive);
    }

    /// `ctr` against the node's containerd, in the `k8s.io` namespace; stdout on success.
    pub fn ctr(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.ctr)
            .arg("--address")
            .arg(&self.containerd_socket)
            .args(["--namespace", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Kills the main process of a running container, as an OOM kill or a crash would:
    /// the kubelet sees the container exit with 137.
    pub fn kill_container(&self, container_id: &str) {
        self.ctr(&["tasks", "kill", "--signal", "SIGKILL", container_id])
            .unwrap_or_else(|e| panic!("kill container {container_id}: {e}"));
    }

    /// Prints the last lines of every node component's log.
    pub fn print_logs(&self) {
        for c in &self.components {
            print_tail(c.name, &c.log);
        }
    }

    /// Returns when one of the node's processes has exited (panicking with its log).
    async fn watch_components(&mut self, while_: &str) {
        loop {
            for c in &mut self.components {
                c.assert_running(while_);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn spawn(&mut self, name: &'static str, program: &Path, args: &[String]) {
        let component = Component::spawn(self.dir.path(), name, program, args);
        self.components.push(component);
    }

    async fn wait_for(&mut self, what: &str, timeout_secs: u64, ok: impl Fn(&RealNode) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(timeout_secs);
        while !ok(self) {
            for c in &mut self.components {
                c.assert_running(&format!("waiting for {what}"));
            }
            assert!(Instant::now() < deadline, "timed out after {timeout_secs}s waiting for {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills every container of the node's containerd (their shims go with them).
    fn kill_all_containers(&self) {
        let Ok(tasks) = self.ctr(&["tasks", "list", "--quiet"]) else { return };
        for id in tasks.lines().filter(|l| !l.is_empty()) {
            let _ = self.ctr(&["tasks", "kill", "--all", "--signal", "SIGKILL", id]);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && self.ctr(&["tasks", "list", "--quiet"]).is_ok_and(|t| !t.trim().is_empty()) {
            for id in self.ctr(&["tasks", "list", "--quiet"]).unwrap_or_default().lines() {
                let _ = self.ctr(&["tasks", "delete", "--force", id]);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_logs();
            eprintln!("[node] state was in {}", self.dir.path().display());
        }
        // The kubelet first, so it restarts nothing; then the containers, through their
        // containerd; then the processes this node started that outlive it (shims), and
        // the mounts it made (secrets, network namespaces, overlay rootfs).
        for c in self.components.iter_mut().filter(|c| c.name != "containerd") {
            c.kill();
        }
        self.kill_all_containers();
        for c in &mut self.components {
            c.kill();
        }
        kill_processes_mentioning(&self.containerd_socket);
        unmount_under(self.dir.path());
    }
}

/// iptables rules that refuse packets to the Service range that kube-proxy did not DNAT:
/// from pods (`FORWARD`) and from this host (`OUTPUT`). Both chains are looked at after
/// kube-proxy's DNAT, so a packet to a Service with a ready endpoint never matches. Raised
/// with the node, lowered when it is dropped; a killed test's leftovers are lowered first.
struct ServiceRangeFence;

impl ServiceRangeFence {
    const COMMENT: &str = "nightshift-node: a Service's traffic not DNAT'd";

    fn raise() -> ServiceRangeFence {
        while Self::rules("-D").iter().any(|ok| *ok) {}
        let raised = Self::rules("-I");
        assert!(raised.iter().all(|ok| *ok), "iptables refused the node's Service-range rules");
        ServiceRangeFence
    }

    /// Runs `iptables -w <action>` for each rule; whether each succeeded.
    fn rules(action: &str) -> [bool; 2] {
        let service_cidr = super::cluster::SERVICE_CIDR;
        let rules: [&[&str]; 2] = [&["FORWARD", "-s", POD_CIDR, "-d", service_cidr], &["OUTPUT", "-d", service_cidr]];
        rules.map(|rule| {
            Command::new("iptables")
                .args(["-w", action])
                .args(rule)
                .args(["-m", "comment", "--comment", Self::COMMENT, "-j", "REJECT"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    }
}

impl Drop for ServiceRangeFence {
    fn drop(&mut self) {
        Self::rules("-D");
    }
}

/// The address of this host that its containers reach: the source address of the default
/// route (no packet is sent), falling back to the first non-loopback IPv4 address.
pub fn host_address() -> Ipv4Addr {
    let socket = UdpSocket::bind("0.0.0.0:0").expect("bind a UDP socket");
    if socket.connect("192.0.2.1:9").is_ok()
        && let Ok(std::net::SocketAddr::V4(addr)) = socket.local_addr()
        && !addr.ip().is_loopback()
        && !addr.ip().is_unspecified()
    {
        return *addr.ip();
    }
    let out = Command::new("hostname").arg("-I").output().expect("run hostname -I");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|a| a.parse::<Ipv4Addr>().ok())
        .find(|a| !a.is_loopback())
        .expect("this host has no IPv4 address that containers could reach")
}

fn node_lock() -> File {
    let path = std::env::temp_dir().join("nightshift-real-node.lock");
    let file = File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    // Blocks until another test's node is gone.
    file.lock().expect("lock the real-node lock file");
    file
}

fn cni_config(ipam_dir: &Path) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "nightshift-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    // Per node, so a killed test never leaks addresses into the next one.
                    "dataDir": ipam_dir,
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}

fn containerd_config(dir: &Path, pause: &str, cni_bin: &str, cni_conf: &Path, runc: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{d}/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"#,
        runc = runc.display(),
        cni_conf = cni_conf.display(),
    )
}

fn kubelet_config(port: u16, healthz_port: u16) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 0.0.0.0
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
cgroupDriver: cgroupfs
failSwapOn: false
clusterDomain: cluster.local
serializeImagePulls: false
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
maxPods: 60
"#
    )
}

/// SIGKILLs every process whose command line mentions `needle` (the shims of the node's
/// containerd name its socket).
fn kill_processes_mentioning(needle: &Path) {
    let needle = needle.as_os_str().as_encoded_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

/// Lazily unmounts every mount point under `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> =
        mounts.lines().filter_map(|line| line.split(' ').nth(4)).filter(|point| point.starts_with(&prefix)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = Command::new("umount").args(["--lazy", point]).stderr(Stdio::null()).status();
    }
}
