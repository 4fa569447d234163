//! The repository's Dockerfile, built with podman into the image the chart runs.
//!
//! The Rust stage is not run here: it would be a second cold build of the whole crate inside
//! the image build (and there is no Rust base image to pull). The Dockerfile's documented
//! `BINARY=prebuilt` path takes the binary of this test build instead (stripped), and its
//! runtime stage is built for real from the bases that `tests/tools/install-node.sh` made
//! (public images can't be pulled here): `RUNTIME_IMAGE` is its distroless-like base (glibc,
//! libgcc_s, the TLS roots, nonroot in /etc/passwd; no shell, no coreutils), standing in for
//! the default `gcr.io/distroless/cc-debian12:nonroot`; `CERTS_IMAGE` its debootstrapped
//! bookworm, standing in for `debian:bookworm-slim`.
//!
//! Images are tagged by what they are made of (the binary, the Dockerfile, the bases), so the
//! tests of one run share one build, and a new base or Dockerfile is never served a stale one.
#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::cluster::{tool, tool_setting};
use super::tools::{cache_dir, run};

/// The image's repository (podman's local store; containerd sees the same name).
pub const REPOSITORY: &str = "localhost/nightshift";

/// podman with this VM's configuration (runc, explicit ulimits; see install-node.sh).
pub fn podman() -> Command {
    let mut command = Command::new(tool("node", "PODMAN"));
    command.env("CONTAINERS_CONF", tool_setting("node", "CONTAINERS_CONF").expect("CONTAINERS_CONF"));
    command
}

/// Builds the image from the Dockerfile with this test build's binary and returns its
/// reference (`localhost/nightshift:t-<hash>`, the hash of the binary, the Dockerfile and the
/// bases' image ids; `build` distinguishes rebuilds of the same binary, as a new release of
/// the same code would be). Idempotent across tests.
pub fn build(build: &str) -> String {
    let binary = Path::new(env!("CARGO_BIN_EXE_nightshift"));
    let dockerfile = repo_root().join("Dockerfile");
    let base = tool_setting("node", "NODE_BASE_IMAGE").expect("NODE_BASE_IMAGE from install-node.sh");
    let runtime = tool_setting("node", "NODE_RUNTIME_IMAGE")
        .expect("NODE_RUNTIME_IMAGE from install-node.sh (run tests/tools/install-node.sh again)");
    let mut inputs = Sha256::new();
    inputs.update(file_sha256(binary));
    inputs.update(file_sha256(&dockerfile));
    for image in [&base, &runtime] {
        inputs.update(run(podman().args(["image", "inspect", "--format", "{{.Id}}", image])).trim());
    }
    let hash = hex::encode(inputs.finalize());
    let reference = format!("{REPOSITORY}:t-{}-{build}", &hash[..12]);
    let Some(_building) = lock_unbuilt(&reference) else { return reference };
    let context = tempfile::Builder::new().prefix("nightshift-image-").tempdir().unwrap();
    run(Command::new("strip").arg("-o").arg(context.path().join("nightshift")).arg(binary));
    let started = std::time::Instant::now();
    run(podman()
        .args(["build", "--quiet", "--build-arg", "BINARY=prebuilt"])
        .args(["--build-arg", &format!("CERTS_IMAGE={base}")])
        .args(["--build-arg", &format!("RUNTIME_IMAGE={runtime}")])
        .args(["--label", &format!("dev.nightshift.test-build={build}")])
        .arg("-f")
        .arg(&dockerfile)
        .args(["-t", &reference])
        .arg(context.path()));
    eprintln!("[image] built {reference} in {:.1?}", started.elapsed());
    reference
}

/// The image's size in bytes, as podman reports it.
pub fn size(reference: &str) -> u64 {
    run(podman().args(["image", "inspect", "--format", "{{.Size}}", reference])).trim().parse().expect("image size")
}

/// An image of llama.cpp's `llama-server` with the test model `model` at `/models/<model>.gguf`
/// (its entrypoint the server, its arguments the pod's), on the bookworm base
/// `tests/tools/install-node.sh` made, with the one library the server needs beyond it
/// (libgomp) taken from this machine. Tagged by what it is made of. Its reference.
pub fn engine(model: &str) -> String {
    let server = super::tools::llama_server();
    let weights = super::tools::engine_model(model);
    let libgomp = Path::new("/lib/x86_64-linux-gnu/libgomp.so.1");
    let base = tool_setting("node", "NODE_BASE_IMAGE").expect("NODE_BASE_IMAGE from install-node.sh");
    let containerfile = format!(
        "FROM {base}\nCOPY libgomp.so.1 /usr/local/lib/libgomp.so.1\nCOPY llama-server /usr/local/bin/llama-server\n\
         COPY model.gguf /models/{model}.gguf\nENV LD_LIBRARY_PATH=/usr/local/lib OMP_WAIT_POLICY=passive\n\
         ENTRYPOINT [\"/usr/local/bin/llama-server\"]\n"
    );
    let mut inputs = Sha256::new();
    for file in [server.as_path(), weights.as_path(), libgomp] {
        inputs.update(file_sha256(file));
    }
    inputs.update(&containerfile);
    inputs.update(run(podman().args(["image", "inspect", "--format", "{{.Id}}", &base])).trim());
    let reference = format!("localhost/nightshift-engine:t-{}", &hex::encode(inputs.finalize())[..12]);
    let Some(_building) = lock_unbuilt(&reference) else { return reference };
    let context = tempfile::Builder::new().prefix("nightshift-engine-image-").tempdir().unwrap();
    std::fs::copy(&server, context.path().join("llama-server")).unwrap();
    std::fs::copy(&weights, context.path().join("model.gguf")).unwrap();
    std::fs::copy(libgomp, context.path().join("libgomp.so.1")).unwrap();
    std::fs::write(context.path().join("Containerfile"), containerfile).unwrap();
    let started = std::time::Instant::now();
    run(podman().args(["build", "--quiet", "-t", &reference]).arg(context.path()));
    eprintln!("[image] built {reference} in {:.1?}", started.elapsed());
    reference
}

/// Takes the image-build lock and keeps it while `reference` is built: `None` (the lock
/// let go) when it is built already, by this run's other tests or an earlier run.
fn lock_unbuilt(reference: &str) -> Option<File> {
    let cache = cache_dir().join("node");
    std::fs::create_dir_all(&cache).unwrap();
    let lock = File::create(cache.join("image.lock")).unwrap();
    lock.lock().expect("lock the image build");
    let built = podman().args(["image", "exists", reference]).status().is_ok_and(|s| s.success());
    (!built).then_some(lock)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn file_sha256(path: &Path) -> String {
    let mut file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hex::encode(hasher.finalize())
}
