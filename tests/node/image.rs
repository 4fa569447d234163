//! The image built from the repository's Dockerfile with podman (tests/common/image.rs):
//! it runs as uid 65532, carries the TLS roots, prints its version and the CRDs, and
//! `nightshift serve` runs a batch in it with a read-only root filesystem. The api, the
//! controller and the worker run in it as real pods in tests/node/node.rs.
//!
//! The image is distroless: nothing but the binary runs in it (no shell, no coreutils), so
//! its files are read by copying them out, and its process is looked at from the host's /proc.
//!
//! Needs podman and the local base images (tests/tools/install-node.sh; `tests/run` runs it).

use crate::common;

use std::time::Duration;

use common::client::{self, Client};
use common::image::{self, podman};
use common::tools::run;

/// A container removed when the test ends.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = podman()
                .args(["logs", &self.0])
                .output()
                .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
            eprintln!("===== logs of container {} =====\n{}", self.0, logs.unwrap_or_default());
        }
        let _ = podman().args(["rm", "--force", "--time", "0", &self.0]).output();
    }
}

/// A file of the image, copied out of a container made (never started) from it.
fn image_file(image: &str, path: &str) -> String {
    let container = Container(run(podman().args(["create", image])).trim().to_owned());
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("file");
    run(podman().arg("cp").arg(format!("{}:{path}", container.0)).arg(&copy));
    std::fs::read_to_string(&copy).unwrap_or_else(|e| panic!("{path} copied out of {image}: {e}"))
}

/// A line of the host's `/proc/<pid>/<file>` of a running container's process.
fn proc_line(container: &str, file: &str, keep: impl Fn(&str) -> bool) -> String {
    let pid = run(podman().args(["inspect", "--format", "{{.State.Pid}}", container])).trim().to_owned();
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
    text.lines().find(|&l| keep(l)).unwrap_or_else(|| panic!("no such line in /proc/{pid}/{file}:\n{text}")).to_owned()
}

#[test]
fn the_image_runs_as_non_root_with_tls_roots_its_version_and_the_crds() {
    let image = image::build("1");
    eprintln!("[image] {image}: {:.1} MB", image::size(&image) as f64 / 1e6);

    let version = run(podman().args(["run", "--rm", "--read-only", &image, "--version"]));
    assert_eq!(version.trim(), format!("nightshift {}", env!("CARGO_PKG_VERSION")));

    let user = run(podman().args(["image", "inspect", "--format", "{{.Config.User}}", &image]));
    assert_eq!(user.trim(), "65532:65532", "the image's default user");
    let passwd = image_file(&image, "/etc/passwd");
    assert!(passwd.lines().any(|l| l.starts_with("nonroot:x:65532:65532:")), "65532 is nonroot: {passwd}");

    let roots = image_file(&image, "/etc/ssl/certs/ca-certificates.crt").matches("BEGIN CERTIFICATE").count();
    assert!(roots > 100, "the TLS roots are Debian's bundle: {roots} certificates");

    // Distroless: the runtime base has no shell (so nothing the image does needs one).
    let shell = podman().args(["run", "--rm", "--entrypoint", "/bin/sh", &image, "-c", "true"]).output().unwrap();
    assert!(!shell.status.success(), "the image has a shell");

    let crds = run(podman().args(["run", "--rm", "--read-only", &image, "crd"]));
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/nightshift.yaml")).unwrap();
    assert_eq!(crds, committed, "`nightshift crd` in the image prints the committed CRDs");

    // The ENTRYPOINT is the binary: an unknown role is refused with clap's usage error.
    let status = podman().args(["run", "--rm", &image, "no-such-role"]).output().unwrap();
    assert_eq!(status.status.code(), Some(2), "{}", String::from_utf8_lossy(&status.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_a_batch_in_the_image_on_a_read_only_root_filesystem() {
    let image = image::build("1");
    let port = common::ports::claim_one();
    let name = format!("nightshift-serve-{port}");
    let container = Container(name.clone());
    // Host networking: the test reaches it on 127.0.0.1. Only /tmp is writable.
    run(podman()
        .args(["run", "--detach", "--name", &name, "--network", "host", "--read-only"])
        .args(["--tmpfs", "/tmp:rw,size=64m,mode=1777", &image])
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            "/tmp/data",
        ]));

    // serve prints the dev project's credentials, then its address.
    let (project, key) = common::cluster::eventually("serve to print its credentials", 60, || async {
        let out = podman().args(["logs", &container.0]).output().ok()?;
        let logs = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |name: &str| logs.lines().find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_owned()));
        logs.contains("Nightshift listening on").then(|| Some((field("x-project-id:")?, field("x-api-key:")?)))?
    })
    .await;

    let client = Client::new(&format!("http://127.0.0.1:{port}"), &project, &key);
    let ids = client::ids("image", 12);
    let file = client.upload(client::input(&ids, "echo")).await;
    let batch = client.create(&file).await;
    let batch = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = client.results(&batch, &ids).await;
    assert_eq!(results.output.len(), ids.len());

    // It ran as 65532, and nothing was written outside /tmp: the root filesystem is mounted
    // read-only for the process (its mount table, as the host sees it).
    let uid = proc_line(&container.0, "status", |l| l.starts_with("Uid:"));
    assert_eq!(uid.split_whitespace().skip(1).collect::<Vec<_>>(), ["65532"; 4], "{uid}");
    let gid = proc_line(&container.0, "status", |l| l.starts_with("Gid:"));
    assert_eq!(gid.split_whitespace().skip(1).collect::<Vec<_>>(), ["65532"; 4], "{gid}");
    let root = proc_line(&container.0, "mountinfo", |l| l.split(' ').nth(4) == Some("/"));
    let options = root.split(' ').nth(5).unwrap();
    assert!(options.split(',').any(|o| o == "ro"), "the root filesystem is writable: {root}");
}
