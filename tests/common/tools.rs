//! Where the test tools that `tests/run` installs live.

use std::path::PathBuf;

fn cache_dir() -> PathBuf {
    match std::env::var_os("NIGHTSHIFT_CACHE") {
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
