//! `nightshift serve` as a child process, the way a user runs it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct Serve {
    child: Child,
    pub url: String,
    /// Where serve's `/metrics` is (its own address, never the API's).
    pub metrics_url: String,
    pub project_id: Option<String>,
    pub api_key: Option<String>,
    pub data_dir: PathBuf,
}

impl Serve {
    /// Starts `nightshift serve` on a free port over `data_dir`, with `extra` arguments.
    // A start that times out panics the test, and the test process's exit ends the child.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Self {
        Self::start_over(Some(data_dir), extra)
    }

    /// Starts `nightshift serve` for the test project, `extra` (YAML) added to its config
    /// in `dir` and its data under `dir/data`; with that project's client.
    pub fn for_project(dir: &Path, extra: &str) -> (Self, super::client::Client) {
        let config = super::write_config(dir, extra);
        let serve = Self::start(&dir.join("data"), &["--config", config.to_str().unwrap()]);
        let client = super::client::Client::new(&serve.url, super::PROJECT, super::KEY);
        (serve, client)
    }

    /// Starts `nightshift serve` on a free port over the storage its `--config` names.
    pub fn start_configured(config: &Path) -> Self {
        Self::start_over(None, &["--config", config.to_str().unwrap()])
    }

    #[allow(clippy::zombie_processes)]
    fn start_over(data_dir: Option<&Path>, extra: &[&str]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_nightshift"));
        command.arg("serve").args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]);
        if let Some(dir) = data_dir {
            command.arg("--data-dir").arg(dir);
        }
        let mut child = command
            .args(extra)
            .env("RUST_LOG", std::env::var("NIGHTSHIFT_TEST_SERVE_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nightshift serve starts");
        let stdout = child.stdout.take().unwrap();
        let (lines, received) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let (mut project_id, mut api_key, mut metrics_url) = (None, None, None);
        loop {
            let line = received
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("nightshift serve printed no address within 30s"));
            let field = |name: &str| line.trim().strip_prefix(name).map(|v| v.trim().to_owned());
            project_id = project_id.or(field("x-project-id:"));
            api_key = api_key.or(field("x-api-key:"));
            metrics_url = metrics_url.or(field("Nightshift metrics on"));
            if let Some(address) = line.strip_prefix("Nightshift listening on ") {
                return Self {
                    child,
                    url: address.trim().to_owned(),
                    metrics_url: metrics_url.expect("serve says where its metrics are before it listens"),
                    project_id,
                    api_key,
                    data_dir: data_dir.map(Path::to_owned).unwrap_or_default(),
                };
            }
        }
    }

    /// A value of serve's `/metrics` (the first series whose line starts with `series`).
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = reqwest::get(&self.metrics_url).await.ok()?.text().await.ok()?;
        text.lines().find(|l| l.starts_with(series))?.rsplit(' ').next()?.parse().ok()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
