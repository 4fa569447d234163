//! The image built from the repository's Dockerfile with podman (tests/common/image.rs):
//! it runs as uid 65532, carries the TLS roots, prints its version and the CRDs, and
//! `nightshift serve` runs a batch in it with a read-only root filesystem. The api, the
//! controller and the worker run in it as real pods in tests/node/node.rs.
//!
//! Needs podman and the local base image (tests/tools/install-node.sh; `tests/run` runs it).

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

fn in_image(image: &str, entrypoint: &str, args: &[&str]) -> String {
    run(podman().args(["run", "--rm", "--read-only", "--entrypoint", entrypoint, image]).args(args))
}

#[test]
fn the_image_runs_as_non_root_with_tls_roots_its_version_and_the_crds() {
    let image = image::build("1");
    eprintln!("[image] {image}: {:.1} MB", image::size(&image) as f64 / 1e6);

    let version = run(podman().args(["run", "--rm", "--read-only", &image, "--version"]));
    assert_eq!(version.trim(), format!("nightshift {}", env!("CARGO_PKG_VERSION")));

    let user = run(podman().args(["image", "inspect", "--format", "{{.Config.User}}", &image]));
    assert_eq!(user.trim(), "65532:65532", "the image's default user");
    let id = in_image(&image, "/usr/bin/id", &[]);
    assert!(id.starts_with("uid=65532(") && id.contains(" gid=65532("), "{id}");

    let roots = in_image(&image, "/bin/grep", &["-c", "BEGIN CERTIFICATE", "/etc/ssl/certs/ca-certificates.crt"]);
    let roots: u32 = roots.trim().parse().unwrap();
    assert!(roots > 100, "the TLS roots are Debian's bundle: {roots} certificates");

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

    // Nothing was written outside /tmp: the root filesystem is read-only for the process.
    let touch = podman().args(["exec", &container.0, "/usr/bin/touch", "/nightshift-was-here"]).output().unwrap();
    assert!(!touch.status.success(), "the root filesystem is writable");
    let stderr = String::from_utf8_lossy(&touch.stderr);
    assert!(stderr.contains("Read-only file system"), "{stderr}");
}
