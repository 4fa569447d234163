//! The node test's applied-batch phase: `examples/applied-batch.yaml` as a user applies it.

use std::collections::HashSet;
use std::time::Instant;

use serde_json::Value;

use super::Installation;
use crate::common::{self, cluster::eventually};

const APPLIED_EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/applied-batch.yaml");

/// `examples/applied-batch.yaml` applied as it is: its input read from the bucket, its
/// output written there, `kubectl wait` returning once both are done; then a refused
/// input's line in `kubectl describe`. Prints the applied batch's timeline.
pub(super) async fn applied_batch(installation: &Installation) {
    let store = installation.s3.store();
    let custom_ids: Vec<String> = (0..20).map(|i| format!("applied-{i}")).collect();
    let input = common::client::input(&custom_ids, "mock-a");
    store.put(&nightshift::storage::Key::parse("inputs/nightly-eval.jsonl").unwrap(), input.into()).await.unwrap();
    let batches = installation.api::<nightshift::k8s::crd::BatchResource>().await;
    let started = Instant::now();
    assert!(installation.kubectl(&["apply", "-f", APPLIED_EXAMPLE]).contains("created"));
    let accepted = eventually("the applied Batch accepted", 60, || async {
        let batch = batches.get("nightly-eval").await.ok()?;
        let running = batch.status.as_ref()?.status != nightshift::batches::Status::Validating;
        (batch.accepted().is_some() && running).then(|| started.elapsed())
    })
    .await;
    installation.kubectl(&["wait", "--for=condition=Complete", "--timeout=120s", "batch/nightly-eval"]);
    let complete = started.elapsed();
    let batch = batches.get("nightly-eval").await.unwrap();
    let (spec, status) = (batch.accepted().unwrap(), batch.status.as_ref().unwrap());
    let key = format!("results/{}/output.jsonl", spec.id);
    assert_eq!(status.output_uri.as_deref(), Some(format!("s3://nightshift/{key}").as_str()));
    let output = store.get(&nightshift::storage::Key::parse(&key).unwrap()).await.unwrap();
    let answered: HashSet<String> = String::from_utf8(output.to_vec())
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap()["custom_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(answered, custom_ids.iter().cloned().collect::<HashSet<_>>(), "every line, in the bucket");
    assert!(installation.kubectl(&["apply", "-f", APPLIED_EXAMPLE]).contains("unchanged"), "re-applied: a no-op");
    let columns = installation.kubectl(&["get", "batch", "nightly-eval", "-o", "wide"]);
    assert!(columns.contains("applied") && columns.contains("s3://nightshift/results/"), "{columns}");
    eprintln!(
        "[node] applied batch of 20 lines: accepted (input read, validated, planned) {:.1} s after kubectl apply, \
         complete with its output in the bucket at {:.1} s (kubectl wait returned); batch {}",
        accepted.as_secs_f64(),
        complete.as_secs_f64(),
        spec.id
    );

    // A refused one: the line and the reason where a kubectl user looks.
    let mut broken = common::client::input(&["fine".to_owned()], "mock-a");
    broken.extend_from_slice(b"{\"custom_id\": \"no-method\", \"url\": \"/v1/chat/completions\", \"body\": {}}\n");
    store.put(&nightshift::storage::Key::parse("inputs/broken.jsonl").unwrap(), broken.into()).await.unwrap();
    let manifest = std::fs::read_to_string(APPLIED_EXAMPLE)
        .unwrap()
        .replace("name: nightly-eval", "name: broken-eval")
        .replace("inputs/nightly-eval.jsonl", "inputs/broken.jsonl");
    let file = installation.helm_home.path().join("broken-eval.yaml");
    std::fs::write(&file, manifest).unwrap();
    installation.kubectl(&["apply", "-f", file.to_str().unwrap()]);
    installation.kubectl(&["wait", "--for=condition=Failed", "--timeout=60s", "batch/broken-eval"]);
    let described = installation.kubectl(&["describe", "batch", "broken-eval"]);
    assert!(described.contains("Refused") && described.contains("line 2:"), "{described}");
}
