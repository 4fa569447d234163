//! Where the test tools that `tests/run` installs live.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `$NIGHTSHIFT_CACHE`, else `~/.cache/nightshift`: where `tests/run` installs the tools.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("NIGHTSHIFT_CACHE").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/nightshift"),
    }
}

fn find(env: &str, cached: PathBuf, what: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env) {
        return PathBuf::from(path);
    }
    assert!(
        cached.exists(),
        "{what} is not installed at {}: run `tests/run` (it installs the test tools), or set {env}",
        cached.display()
    );
    cached
}

/// The s3s-fs binary (a real S3 server).
pub fn s3s_fs() -> PathBuf {
    find("NIGHTSHIFT_S3S_FS", cache_dir().join("tools/bin/s3s-fs"), "s3s-fs")
}

/// A Python with the official OpenAI SDK installed.
pub fn python() -> PathBuf {
    find("NIGHTSHIFT_PYTHON", cache_dir().join("venv/bin/python"), "the Python venv with the openai SDK")
}

/// `$HELM`, else the binary tests/tools/install-helm.sh installed.
pub fn helm_bin() -> PathBuf {
    find("HELM", cache_dir().join("helm/bin/helm"), "helm")
}

/// helm with its own state (config, cache, data) in `home`, never the user's.
pub fn helm(home: &Path) -> Command {
    let mut command = Command::new(helm_bin());
    command
        .env("HOME", home)
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"));
    command
}

/// `$KUBECTL`, else `kubectl` on the PATH.
pub fn kubectl_bin() -> String {
    std::env::var("KUBECTL").ok().filter(|v| !v.is_empty()).unwrap_or_else(|| "kubectl".into())
}

/// Runs `command`, panicking with its output unless it succeeds; returns stdout.
pub fn run(command: &mut Command) -> String {
    let output = command.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `$LLAMA_SERVER`, else the llama-server that tests/tools/install-engine.sh built.
pub fn llama_server() -> PathBuf {
    find("LLAMA_SERVER", cache_dir().join("engine/bin/llama-server"), "llama.cpp's llama-server")
}

/// A test model that tests/tools/install-engine.sh made (`tiny`, `small`).
pub fn engine_model(name: &str) -> PathBuf {
    let models = std::env::var_os("ENGINE_MODELS").map_or_else(|| cache_dir().join("engine/models"), PathBuf::from);
    let path = models.join(format!("{name}.gguf"));
    assert!(path.exists(), "no test model at {}: run `tests/run` (it makes them)", path.display());
    path
}
