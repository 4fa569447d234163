//! Test harness: real servers on 127.0.0.1 (s3s-fs, `nightshift serve`), fresh
//! storage per test, and an in-process router with a known project.
#![allow(dead_code)]

pub mod apiextensions;
pub mod client;
pub mod cluster;
pub mod committed;
pub mod engine;
pub mod faults;
pub mod image;
pub mod interactive;
pub mod kubelet;
pub mod multipart;
pub mod node;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod receiver;
pub mod serve;
pub mod simulator;
pub mod sts;
pub mod tools;
pub mod upstream;
pub mod values_doc;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use nightshift::api::{self, AppState};
use nightshift::batches::{BatchSettings, EmbeddedBatchStore};
use nightshift::config::{ApiKeyConfig, ProjectConfig};
use nightshift::files::FileCatalog;
use nightshift::ids::ProjectId;
use nightshift::projects::Projects;
use nightshift::storage::{DirStore, ObjectStore, S3Settings, S3Store, StaticKeys};
use tempfile::TempDir;
use tower::ServiceExt;

pub const PROJECT: &str = "3f6c1f4e-8b8f-4b59-9a55-0d6f1b8a2e11";
pub const KEY: &str = "test-key";
pub const OTHER_PROJECT: &str = "0b7e8a52-4a1c-4d5e-9a53-6f0c7d8e9f10";
pub const OTHER_KEY: &str = "other-key";

pub fn wait_for_port(port: u16, child: &mut Child, what: &str) {
    wait_for_address((std::net::Ipv4Addr::LOCALHOST, port), child, what)
}

pub fn wait_for_address(address: (std::net::Ipv4Addr, u16), child: &mut Child, what: &str) {
    let port = address.1;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(address).is_ok() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited early with {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} did not listen on port {port} within 20s");
}

/// A real S3 server (s3s-fs) on a free port, over a temporary directory.
pub struct TestS3 {
    child: Child,
    pub endpoint: String,
    pub bucket: String,
    _root: TempDir,
}

pub const S3_ACCESS_KEY: &str = "nightshift-test";
pub const S3_SECRET_KEY: &str = "nightshift-test-secret";

impl TestS3 {
    pub fn start() -> Self {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST)
    }

    /// On `host` (an address pods reach, for the real node), still served on a free port.
    pub fn start_on(host: std::net::Ipv4Addr) -> Self {
        let root = TempDir::new().unwrap();
        let bucket = "nightshift".to_owned();
        std::fs::create_dir(root.path().join(&bucket)).unwrap();
        let port = ports::claim_one();
        let mut child = Command::new(tools::s3s_fs())
            .args(["--host", &host.to_string(), "--port", &port.to_string()])
            .args(["--access-key", S3_ACCESS_KEY, "--secret-key", S3_SECRET_KEY])
            .arg(root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("s3s-fs starts");
        wait_for_address((host, port), &mut child, "s3s-fs");
        Self { child, endpoint: format!("http://{host}:{port}"), bucket, _root: root }
    }

    pub fn settings(&self, prefix: &str) -> S3Settings {
        S3Settings {
            bucket: self.bucket.clone(),
            endpoint: Some(self.endpoint.clone()),
            region: "us-east-1".into(),
            prefix: prefix.into(),
            path_style: true,
            keys: Some(StaticKeys {
                access_key_id: S3_ACCESS_KEY.into(),
                secret_access_key: S3_SECRET_KEY.into(),
                session_token: None,
            }),
            timeout: Duration::from_secs(30),
        }
    }

    pub fn store(&self) -> Arc<dyn ObjectStore> {
        Arc::new(S3Store::new(self.settings("")))
    }

    /// The `storage:` section of a Nightshift config on this server, reached at `endpoint`
    /// (this server's, or a proxy's in front of it), with `extra` keys (`timeout: 1s`);
    /// its key pair is in environment variables that child processes inherit.
    pub fn storage_yaml(&self, endpoint: &str, extra: &str) -> String {
        // SAFETY: nextest runs each test in a process of its own, and this is called
        // before any other thread reads the environment.
        unsafe {
            std::env::set_var("NS_TEST_S3_KEY", S3_ACCESS_KEY);
            std::env::set_var("NS_TEST_S3_SECRET", S3_SECRET_KEY);
            std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
        }
        format!(
            "storage:\n  s3: {{bucket: {}, endpoint: \"{endpoint}\", path_style: true, access_key_id_env: NS_TEST_S3_KEY, \
             secret_access_key_env: NS_TEST_S3_SECRET{extra}}}\n",
            self.bucket
        )
    }
}

impl Drop for TestS3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Storage for one test; keeps its server or directory alive as long as it lives.
pub enum Backend {
    Dir(TempDir),
    S3(TestS3),
}

impl Backend {
    pub async fn dir() -> (Self, Arc<dyn ObjectStore>) {
        let dir = TempDir::new().unwrap();
        let store = DirStore::open(dir.path()).await.unwrap();
        (Self::Dir(dir), Arc::new(store))
    }

    pub async fn s3() -> (Self, Arc<dyn ObjectStore>) {
        let server = TestS3::start();
        let store = server.store();
        (Self::S3(server), store)
    }
}

pub fn projects() -> Projects {
    let project = |id: &str, key: &str| ProjectConfig {
        id: ProjectId::parse(id).unwrap(),
        name: None,
        api_keys: vec![ApiKeyConfig::plain(key)],
        quota: None,
        rate_limit: None,
        webhooks: Vec::new(),
        weight: nightshift::config::Weight::default(),
    };
    Projects::from_config(&[project(PROJECT, KEY), project(OTHER_PROJECT, OTHER_KEY)])
}

/// The API router in-process over `store`, with [`PROJECT`] and [`OTHER_PROJECT`].
pub struct TestApp {
    pub router: axum::Router,
    pub store: Arc<dyn ObjectStore>,
    pub files: FileCatalog,
    pub batches: Arc<EmbeddedBatchStore>,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts the OpenAI error envelope and returns its `error` object.
    pub fn error(&self, status: StatusCode, code: &str) -> serde_json::Value {
        let json = self.json();
        assert_eq!(self.status, status, "{json}");
        let error = &json["error"];
        assert_eq!(error["code"], code, "{json}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{json}");
        assert!(error["type"].is_string(), "{json}");
        assert!(error.get("param").is_some(), "param is always present: {json}");
        error.clone()
    }
}

impl TestApp {
    pub async fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self::with_batch_objects(store.clone(), store).await
    }

    /// Files in `store`, batch documents in `batch_objects`.
    pub async fn with_batch_objects(store: Arc<dyn ObjectStore>, batch_objects: Arc<dyn ObjectStore>) -> Self {
        let files = FileCatalog::new(store.clone(), Duration::from_secs(30 * 86_400));
        let batches = Arc::new(EmbeddedBatchStore::open(batch_objects).await.unwrap());
        let projects = projects();
        let quota = Arc::new(nightshift::quota::QuotaLedger::new(&projects));
        let state = AppState {
            quota,
            wake: Default::default(),
            projects: Arc::new(nightshift::projects::ProjectDirectory::new(projects)),
            files: files.clone(),
            batches: batches.clone(),
            batch_settings: BatchSettings {
                completion_window: Duration::from_secs(86_400),
                shard_lines: 3,
                endpoints: Default::default(),
            },
            drain: Default::default(),
            idempotency: nightshift::idempotency::IdempotencyStore::new(store.clone()),
            uploads: nightshift::uploads::UploadStore::new(files.clone()),
            receiving: Arc::new(tokio::sync::Semaphore::new(64)),
            limits: Arc::new(api::rate_limits::RateLimits::new(&Default::default())),
        };
        Self { router: api::router(state), store, files, batches }
    }

    pub async fn post_json(&self, uri: &str, body: serde_json::Value) -> Answer {
        let request = Self::request("POST", uri)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap();
        self.send(request).await
    }

    pub async fn send(&self, request: Request<Body>) -> Answer {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer { status, headers, body }
    }

    /// A request authenticated as [`PROJECT`].
    pub fn request(method: &str, uri: &str) -> axum::http::request::Builder {
        Request::builder().method(method).uri(uri).header("x-project-id", PROJECT).header("x-api-key", KEY)
    }

    pub async fn get(&self, uri: &str) -> Answer {
        self.send(Self::request("GET", uri).body(Body::empty()).unwrap()).await
    }

    pub async fn delete(&self, uri: &str) -> Answer {
        self.send(Self::request("DELETE", uri).body(Body::empty()).unwrap()).await
    }

    /// Uploads `content` as a batch file named `name`, expecting success.
    pub async fn upload(&self, name: &str, content: &[u8]) -> serde_json::Value {
        let form = multipart::Form::new().text("purpose", "batch").file("file", name, content);
        let answer = self.send(form.request(Self::request("POST", "/v1/files"))).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer.body));
        answer.json()
    }
}

/// Writes a `serve` configuration for [`PROJECT`] (key [`KEY`]) and returns its path.
/// `extra` is YAML appended as it is (upstreams, batches, quota).
pub fn write_config(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("nightshift.yaml");
    let yaml = format!("projects:\n  - id: {PROJECT}\n    api_keys: [{{plain: {KEY}}}]\n{extra}");
    std::fs::write(&path, yaml).unwrap();
    path
}
