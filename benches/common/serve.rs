//! `nightshift serve` as the benches run it: the release build in a child process,
//! stopped when dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running `serve` (or another child); killed on drop.
pub struct Process {
    child: Child,
    /// Where `serve` serves `/metrics` (`http://…/metrics`), if it said.
    #[allow(dead_code)] // not every bench scrapes serve
    pub metrics_url: Option<String>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl From<Child> for Process {
    fn from(child: Child) -> Self {
        Self { child, metrics_url: None }
    }
}

/// Starts `serve` with `config` over `data` and `RUST_LOG=log`; returns once it listens,
/// with its URL (the rest of its output is drained) and, in the process, its metrics URL. `NIGHTSHIFT_BINARY` names another
/// binary than the release build (an older one, to compare).
#[allow(dead_code)] // not every bench runs the default build
pub fn spawn(config: &Path, data: &Path, log: &str) -> (Process, String) {
    spawn_binary(&binary(), config, data, log)
}

/// The binary the benches run: `NIGHTSHIFT_BINARY`, else the release build.
pub fn binary() -> String {
    std::env::var("NIGHTSHIFT_BINARY")
        .unwrap_or_else(|_| format!("{}/target/release/nightshift", env!("CARGO_MANIFEST_DIR")))
}

/// [`spawn`] with the binary `nightshift`.
pub fn spawn_binary(nightshift: &str, config: &Path, data: &Path, log: &str) -> (Process, String) {
    // Older builds served /metrics on the API's address and have no --metrics-listen.
    let help = Command::new(nightshift).args(["serve", "--help"]).output().unwrap();
    let metrics: &[&str] = match String::from_utf8_lossy(&help.stdout).contains("--metrics-listen") {
        true => &["--metrics-listen", "127.0.0.1:0"],
        false => &[],
    };
    let mut child = Command::new(nightshift)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(metrics)
        .args(["--config", config.to_str().unwrap(), "--data-dir"])
        .arg(data)
        .env("RUST_LOG", log)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Older builds served /metrics on the API's address, and said nothing of it.
    let mut metrics_url = None;
    let url = loop {
        let line = lines.next().expect("serve printed its address").unwrap();
        if let Some(address) = line.strip_prefix("Nightshift metrics on ") {
            metrics_url = Some(address.trim().to_owned());
        }
        if let Some(address) = line.strip_prefix("Nightshift listening on ") {
            break address.trim().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let metrics_url = metrics_url.or_else(|| Some(format!("{url}/metrics")));
    (Process { child, metrics_url }, url)
}
