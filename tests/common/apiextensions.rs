//! A current (1.36) API server for custom resources: the standalone apiextensions-apiserver
//! that `tests/tools/install-apiextensions.sh` builds, over etcd, with client-certificate
//! auth. It serves CRDs and custom resources (with CEL validation rules, server-side apply
//! and the status subresource) and nothing else: no namespaces, no discovery (typed
//! `Api<T>` works, kubectl does not). The rest of the suite runs on the 1.20 cluster of
//! [`super::cluster`]; this one checks what 1.20 cannot: the CRDs' validation rules.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube::Client;
use kube::config::Kubeconfig;
use tempfile::TempDir;

use super::cluster::{client_from_kubeconfig, tool};
use super::process::Process;

const OPENSSL_CNF: &str = include_str!("../tools/apiextensions-openssl.cnf");

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl runs");
    assert!(output.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}

/// A CA, a serving certificate for 127.0.0.1 and a `system:masters` client certificate
/// (X509v3, EC P-256 keys: what rustls and Go both accept), in `dir`.
fn certificates(dir: &Path) {
    std::fs::write(dir.join("openssl.cnf"), OPENSSL_CNF).unwrap();
    for name in ["ca", "server", "client"] {
        let key = format!("{name}.key");
        openssl(dir, &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key]);
    }
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-config",
            "openssl.cnf",
            "-extensions",
            "ca_ext",
            "-key",
            "ca.key",
            "-subj",
            "/CN=nightshift-test-ca",
            "-days",
            "3650",
            "-sha256",
            "-out",
            "ca.crt",
        ],
    );
    for (name, subject, extensions) in [
        ("server", "/CN=apiextensions-apiserver", "server_ext"),
        ("client", "/O=system:masters/CN=nightshift-test-admin", "client_ext"),
    ] {
        let (key, csr, crt) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"));
        openssl(dir, &["req", "-new", "-config", "openssl.cnf", "-key", &key, "-subj", subject, "-out", &csr]);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "3650",
                "-sha256",
                "-extfile",
                "openssl.cnf",
                "-extensions",
                extensions,
                "-out",
                &crt,
            ],
        );
    }
}

fn base64_of(path: &Path) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap())
}

/// etcd and an apiextensions-apiserver, stopped and deleted on drop.
pub struct CrdServer {
    // Dropped in order: the server first, then etcd, then their files.
    _server: Process,
    _etcd: Process,
    kubeconfig: String,
    dir: TempDir,
}

impl CrdServer {
    pub async fn start() -> Self {
        let server_bin = tool("apiextensions", "APIEXTENSIONS_APISERVER");
        let etcd_bin = tool("kube", "ETCD");
        let dir = tempfile::Builder::new().prefix("nightshift-crd-server-").tempdir().unwrap();
        let d = dir.path();
        certificates(d);
        let [etcd_port, peer_port, port] = super::ports::claim();
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: crds\n  cluster:\n    server: https://127.0.0.1:{port}\n    \
             certificate-authority-data: {ca}\nusers:\n- name: admin\n  user:\n    client-certificate-data: {crt}\n    \
             client-key-data: {key}\ncontexts:\n- name: crds\n  context: {{cluster: crds, user: admin, namespace: default}}\n\
             current-context: crds\n",
            ca = base64_of(&d.join("ca.crt")),
            crt = base64_of(&d.join("client.crt")),
            key = base64_of(&d.join("client.key")),
        );
        std::fs::write(d.join("kubeconfig"), &kubeconfig).unwrap();
        let log = |name: &str| std::fs::File::create(d.join(name)).unwrap();
        let (etcd_url, peer_url) = (format!("http://127.0.0.1:{etcd_port}"), format!("http://127.0.0.1:{peer_port}"));
        let etcd = Process(
            Command::new(&etcd_bin)
                .args([
                    "--name=crds".to_owned(),
                    format!("--data-dir={}", d.join("etcd").display()),
                    format!("--listen-client-urls={etcd_url}"),
                    format!("--advertise-client-urls={etcd_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster=crds={peer_url}"),
                ])
                .stdout(Stdio::null())
                .stderr(log("etcd.log"))
                .spawn()
                .expect("etcd starts"),
        );
        let own = d.join("kubeconfig").display().to_string();
        // It reads its own API for its delegated authentication and authorization (hence
        // the kubeconfigs pointing at itself); admission plugins that need core APIs it
        // does not serve are off.
        let server = Process(
            Command::new(&server_bin)
                .args([
                    format!("--etcd-servers={etcd_url}"),
                    format!("--kubeconfig={own}"),
                    format!("--authentication-kubeconfig={own}"),
                    format!("--authorization-kubeconfig={own}"),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={port}"),
                    format!("--tls-cert-file={}", d.join("server.crt").display()),
                    format!("--tls-private-key-file={}", d.join("server.key").display()),
                    format!("--client-ca-file={}", d.join("ca.crt").display()),
                    "--authentication-skip-lookup".into(),
                    "--disable-admission-plugins=NamespaceLifecycle,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,\
                     MutatingAdmissionPolicy,ValidatingAdmissionPolicy"
                        .into(),
                    "--enable-priority-and-fairness=false".into(),
                ])
                .stdout(Stdio::null())
                .stderr(log("apiserver.log"))
                .spawn()
                .expect("apiextensions-apiserver starts"),
        );
        let server = Self { _server: server, _etcd: etcd, kubeconfig, dir };
        server.wait_ready().await;
        server
    }

    /// Until `/readyz` answers (its informer of core Services, which it does not serve,
    /// never syncs: left out).
    async fn wait_ready(&self) {
        let started = Instant::now();
        let client = self.client().await;
        loop {
            let request = axum::http::Request::get("/readyz?exclude=informer-sync").body(Vec::new()).unwrap();
            if let Ok(text) = client.request_text(request).await
                && text.trim() == "ok"
            {
                eprintln!("[crd-server] ready in {:.1?}", started.elapsed());
                return;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let log = std::fs::read_to_string(self.dir.path().join("apiserver.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                panic!("the apiextensions-apiserver was not ready in 60 s:\n{}", tail.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A client with the `system:masters` certificate.
    pub async fn client(&self) -> Client {
        client_from_kubeconfig(Kubeconfig::from_yaml(&self.kubeconfig).unwrap()).await
    }
}
