//! `nightshift <role>` as a child process of a test, killed when the test ends.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process that is killed when dropped.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `nightshift <args>` with `env` (stderr to `log`) and waits for a stdout line
/// containing `marker`; returns the process and that line.
// A start that times out panics the test, whose exit ends the child.
#[allow(clippy::zombie_processes)]
pub fn spawn(args: &[&str], env: &[(&str, String)], marker: &str, log: &Path) -> (Process, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nightshift"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.clone())))
        .env("RUST_LOG", "info,kube=warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    loop {
        let line = received.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            panic!("nightshift {args:?} printed no {marker:?}: {}", std::fs::read_to_string(log).unwrap_or_default())
        });
        if line.contains(marker) {
            return (Process(child), line);
        }
    }
}
