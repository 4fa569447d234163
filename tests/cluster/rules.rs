//! The Batch CRD's validation rules, enforced by a current (1.36) API server: a bad spec
//! is refused at apply time with the rule's message, a created Batch's spec does not
//! change (its TTL may), the record the controller adds is accepted once and fixed, and
//! a finished Batch's status stays finished. The 1.20 test cluster drops these rules
//! (the controller checks the same things there: `applied.rs`).

use crate::common;

use common::apiextensions::CrdServer;
use common::cluster::eventually;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use nightshift::batches::{BatchSpec, BatchState};
use nightshift::ids::{BatchId, FileId, ProjectId};
use nightshift::k8s::crd::{BatchResource, crds};
use serde_json::{Value, json};

const NS: &str = "default";

/// A Batch as a user applies it, with `spec` merged over a valid one.
fn applied(name: &str, spec: Value) -> Value {
    let mut base = json!({
        "input": {"uri": "s3://data-lake/evals/in.jsonl"},
        "endpoint": "/v1/chat/completions",
        "metadata": {"team": "evals"},
        "output": {"uri": "s3://results/nightly/"},
        "ttlSecondsAfterFinished": 3600,
    });
    for (key, value) in spec.as_object().unwrap() {
        match value {
            Value::Null => base.as_object_mut().unwrap().remove(key),
            value => base.as_object_mut().unwrap().insert(key.clone(), value.clone()),
        };
    }
    json!({"apiVersion": "nightshift.dev/v1alpha1", "kind": "Batch", "metadata": {"name": name}, "spec": base})
}

/// The record the controller adds beside an applied request once it accepted it.
fn record() -> Value {
    let spec = BatchSpec {
        id: BatchId::generate(),
        project_id: ProjectId::generate(),
        input_file_id: FileId::generate(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "24h".into(),
        metadata: serde_json::from_value(json!({"team": "evals"})).unwrap(),
        created_at: 1_000,
        expires_at: 87_400,
        model: Some("mock-a".into()),
        output_expires_after: None,
        priority: None,
        plan: Default::default(),
    };
    serde_json::to_value(spec).unwrap()
}

/// Server-side applies `object` as `manager`: the refusal's message, if refused.
async fn apply(api: &Api<BatchResource>, manager: &str, object: &Value) -> Result<BatchResource, String> {
    let name = object["metadata"]["name"].as_str().unwrap();
    let params = PatchParams::apply(manager).force();
    api.patch(name, &params, &Patch::Apply(object)).await.map_err(|error| match error {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 422, "{status:?}");
            status.message
        }
        other => panic!("{other}"),
    })
}

async fn status(api: &Api<BatchResource>, name: &str, state: &BatchState) -> Result<BatchResource, String> {
    let patch = json!({"apiVersion": "nightshift.dev/v1alpha1", "kind": "Batch", "status": state});
    let params = PatchParams::apply("nightshift-controller").force();
    api.patch_status(name, &params, &Patch::Apply(&patch)).await.map_err(|error| match error {
        kube::Error::Api(status) => status.message,
        other => panic!("{other}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_current_api_server_enforces_the_batch_crds_rules() {
    let server = CrdServer::start().await;
    let client = server.client().await;
    let definitions: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crds() {
        definitions.create(&PostParams::default(), &crd).await.expect("the CRD, rules and all, is accepted");
    }
    let api: Api<BatchResource> = Api::namespaced(client, NS);
    eventually("the Batch CRD served", 30, || async { api.list(&Default::default()).await.ok().map(|_| ()) }).await;

    // At apply time: what needs no file.
    let refused = [
        (
            json!({"input": {"uri": "s3://data-lake/in.jsonl", "file_id": "file-abc"}}),
            "spec.input names exactly one of uri and file_id",
        ),
        (json!({"input": {}}), "spec.input names exactly one of uri and file_id"),
        (json!({"input": {"uri": "gs://data-lake/in.jsonl"}}), "spec.input.uri must be s3://bucket/key"),
        (json!({"input": {"uri": "s3://data-lake/evals/"}}), "spec.input.uri must be s3://bucket/key"),
        (json!({"input": {"uri": "s3://data-lake/a/../b.jsonl"}}), "spec.input.uri must be s3://bucket/key"),
        (
            json!({"output": {"uri": "s3://Results_Bucket/"}}),
            "spec.output.uri must be s3://bucket/ or s3://bucket/prefix/",
        ),
        (json!({"endpoint": "/v1/images/generations"}), "spec.endpoint must be one of /v1/chat/completions"),
        (json!({"endpoint": null}), "spec.endpoint is required"),
        (json!({"completion_window": "48h"}), "completion_window must be \"24h\""),
        (json!({"input": null}), "spec.input is required"),
        (json!({"ttlSecondsAfterFinished": -1}), "should be greater than or equal to 0"),
    ];
    for (index, (spec, message)) in refused.iter().enumerate() {
        let object = applied(&format!("bad-{index}"), spec.clone());
        let error = apply(&api, "kubectl", &object).await.err().unwrap_or_else(|| panic!("accepted: {spec}"));
        assert!(error.contains(message), "{spec}: {error}");
    }

    // A good one, and the same again: a no-op.
    let good = applied("nightly", json!({}));
    let created = apply(&api, "kubectl", &good).await.unwrap();
    let again = apply(&api, "kubectl", &good).await.unwrap();
    assert_eq!(again.metadata.resource_version, created.metadata.resource_version, "re-applied: unchanged");

    // What a user wrote does not change; its TTL may.
    let changes = [
        (json!({"endpoint": "/v1/embeddings"}), "spec.endpoint is immutable"),
        (json!({"input": {"uri": "s3://data-lake/evals/other.jsonl"}}), "spec.input is immutable"),
        (json!({"metadata": {"team": "other"}}), "spec.metadata is immutable"),
        (json!({"output": {"uri": "s3://results/elsewhere/"}}), "spec.output is immutable"),
        (json!({"output": null}), "spec.output cannot be removed"),
    ];
    for (spec, message) in &changes {
        let error = apply(&api, "kubectl", &applied("nightly", spec.clone())).await.err();
        let error = error.unwrap_or_else(|| panic!("changed: {spec}"));
        assert!(error.contains(message), "{spec}: {error}");
    }
    apply(&api, "kubectl", &applied("nightly", json!({"ttlSecondsAfterFinished": 60}))).await.unwrap();

    // The controller's record: added once (beside the user's fields, which it shares), then fixed.
    let record = record();
    let accept = json!({"apiVersion": "nightshift.dev/v1alpha1", "kind": "Batch", "metadata": {"name": "nightly"}, "spec": record});
    let accepted = apply(&api, "nightshift-controller", &accept).await.unwrap();
    assert_eq!(accepted.accepted().map(|s| s.id.to_string()), record["id"].as_str().map(str::to_owned));
    assert!(accepted.spec.request.is_some(), "the user's request stays");
    let mut moved = accept.clone();
    moved["spec"]["id"] = json!(BatchId::generate());
    let error = apply(&api, "nightshift-controller", &moved).await.unwrap_err();
    assert!(error.contains("spec.id is immutable"), "{error}");
    let mut replanned = accept.clone();
    replanned["spec"]["expires_at"] = json!(1);
    let error = apply(&api, "nightshift-controller", &replanned).await.unwrap_err();
    assert!(error.contains("spec.expires_at is immutable"), "{error}");
    // The user's manifest applied again still changes nothing.
    let unchanged = apply(&api, "kubectl", &applied("nightly", json!({"ttlSecondsAfterFinished": 60}))).await.unwrap();
    assert_eq!(unchanged.metadata.resource_version, accepted.metadata.resource_version);

    // A finished Batch's status never changes again.
    let running = BatchState::in_progress(1_000, 10);
    status(&api, "nightly", &running).await.unwrap();
    let mut completed = running.clone();
    completed.status = nightshift::batches::Status::Completed;
    completed.completed_at = Some(1_100);
    status(&api, "nightly", &completed).await.unwrap();
    let mut recorded = completed.clone();
    recorded.output_uri = Some("s3://results/nightly/batch_x/output.jsonl".into());
    status(&api, "nightly", &recorded).await.expect("a finished status may still gain fields");
    let error = status(&api, "nightly", &running).await.unwrap_err();
    assert!(error.contains("a finished Batch's status never changes"), "{error}");
}
