//! `Idempotency-Key` on `POST /v1/batches` and `POST /v1/files`, through the router
//! in-process: replays, conflicts, requests at once, a restart, failures that free the key.

use crate::common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::StatusCode;
use common::multipart::Form;
use common::{Answer, Backend, TestApp};
use nightshift::storage::{Key, ObjectStore};
use serde_json::{Value, json};

const INPUT: &[u8] = b"{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"model\":\"echo\",\"messages\":[]}}\n";

async fn create_batch(app: &TestApp, key: &str, body: &Value) -> Answer {
    let request = TestApp::request("POST", "/v1/batches")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    app.send(request).await
}

async fn upload(app: &TestApp, key: &str, name: &str, content: &[u8]) -> Answer {
    let form = Form::new().text("purpose", "batch").file("file", name, content);
    app.send(form.request(TestApp::request("POST", "/v1/files").header("idempotency-key", key))).await
}

fn replayed(answer: &Answer) -> bool {
    answer.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
}

async fn batches(app: &TestApp) -> usize {
    app.get("/v1/batches?limit=100").await.json()["data"].as_array().unwrap().len()
}

async fn same_key_same_batch(store: Arc<dyn ObjectStore>) {
    let app = TestApp::new(store.clone()).await;
    let file = app.upload("in.jsonl", INPUT).await;
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"a": "1", "b": "2"}});
    let first = create_batch(&app, "nightly-2026-11-23", &body).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json());
    assert!(!replayed(&first));
    let id = first.json()["id"].clone();

    // The same body in another key order is the same request.
    let reordered = json!({"metadata": {"b": "2", "a": "1"}, "completion_window": "24h", "endpoint": "/v1/chat/completions", "input_file_id": file["id"]});
    let again = create_batch(&app, "nightly-2026-11-23", &reordered).await;
    assert_eq!((again.status, again.json()["id"].clone()), (StatusCode::OK, id.clone()));
    assert!(replayed(&again));

    // After a restart (a new process over the same storage), still the same batch.
    let restarted = TestApp::new(store).await;
    let after = create_batch(&restarted, "nightly-2026-11-23", &body).await;
    assert_eq!(after.json()["id"], id);

    // Another body under the key is a conflict; another key is another batch.
    let other = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let conflict = create_batch(&app, "nightly-2026-11-23", &other).await;
    conflict.error(StatusCode::CONFLICT, "idempotency_key_reused");
    let fresh = create_batch(&app, "nightly-2026-11-24", &body).await;
    assert_ne!(fresh.json()["id"], id);
    assert_eq!(batches(&app).await, 2);
}

#[tokio::test]
async fn the_same_key_and_body_answer_the_first_batch_on_a_directory() {
    let (_b, store) = Backend::dir().await;
    same_key_same_batch(store).await;
}

#[tokio::test]
async fn the_same_key_and_body_answer_the_first_batch_on_s3() {
    let (_b, store) = Backend::s3().await;
    same_key_same_batch(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_at_once_under_one_key_make_one_batch_and_one_file() {
    let (_b, store) = Backend::dir().await;
    let app = Arc::new(TestApp::new(store).await);
    let file = app.upload("in.jsonl", INPUT).await;
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let creates: Vec<_> = (0..8)
        .map(|_| {
            let (app, body) = (app.clone(), body.clone());
            tokio::spawn(async move { create_batch(&app, "at-once", &body).await })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for create in creates {
        let answer = create.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
        ids.insert(answer.json()["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(batches(&app).await, 1);

    let uploads: Vec<_> = (0..8)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { upload(&app, "file-at-once", "same.jsonl", INPUT).await })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for upload in uploads {
        let answer = upload.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
        ids.insert(answer.json()["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let files = app.get("/v1/files").await.json();
    assert_eq!(files["data"].as_array().unwrap().len(), 2, "the input and one idempotent upload: {files}");
    // The losers' bytes were not kept.
    assert_eq!(app.store.list("file-data/").await.unwrap().len(), 2);
}

#[tokio::test]
async fn an_upload_under_a_used_key_answers_the_first_file_or_a_conflict() {
    let (_b, store) = Backend::dir().await;
    let app = TestApp::new(store).await;
    let first = upload(&app, "upload-1", "a.jsonl", INPUT).await;
    assert_eq!(first.status, StatusCode::OK);
    let again = upload(&app, "upload-1", "a.jsonl", INPUT).await;
    assert_eq!(again.json(), first.json());
    assert!(replayed(&again));
    // Deleted since: the replay still names the file the key made.
    let id = first.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(app.delete(&format!("/v1/files/{id}")).await.status, StatusCode::OK);
    assert_eq!(upload(&app, "upload-1", "a.jsonl", INPUT).await.json()["id"], id.as_str());
    // Other bytes, another name: conflicts.
    upload(&app, "upload-1", "a.jsonl", b"{}\n").await.error(StatusCode::CONFLICT, "idempotency_key_reused");
    upload(&app, "upload-1", "b.jsonl", INPUT).await.error(StatusCode::CONFLICT, "idempotency_key_reused");
    // A key used for a file is not one for a batch.
    let body = json!({"input_file_id": id, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    create_batch(&app, "upload-1", &body).await.error(StatusCode::CONFLICT, "idempotency_key_reused");
}

#[tokio::test]
async fn a_failed_create_frees_its_key_and_bad_keys_are_refused() {
    let (_b, store) = Backend::dir().await;
    let app = TestApp::new(store).await;
    let body =
        json!({"input_file_id": "file-01NOSUCHFILE", "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    create_batch(&app, "k", &body).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert!(app.store.list("idempotency/").await.unwrap().is_empty(), "the failed create released the key");
    let file = app.upload("in.jsonl", INPUT).await;
    let good = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    assert_eq!(create_batch(&app, "k", &good).await.status, StatusCode::OK, "the key is free for another request");

    for bad in ["", "with space", &"k".repeat(256)] {
        let answer = create_batch(&app, bad, &good).await;
        answer.error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
    }
    upload(&app, "ü", "a.jsonl", INPUT).await.error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
    assert_eq!(batches(&app).await, 1);
}

#[tokio::test]
async fn a_claim_left_by_a_dead_request_is_taken_over_once_stale_and_keys_expire() {
    let (_b, store) = Backend::dir().await;
    let app = TestApp::new(store).await;
    let file = app.upload("in.jsonl", INPUT).await;
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let first = create_batch(&app, "stale", &body).await.json();
    let claims = app.store.list("idempotency/").await.unwrap();
    assert_eq!(claims.len(), 1);
    let claim_key: &Key = &claims[0];
    let mut claim: Value = serde_json::from_slice(&app.store.get(claim_key).await.unwrap()).unwrap();

    // A claim naming a batch never made, six minutes old: the request died; a retry creates.
    claim["object_id"] = json!("batch_01NEVERMADE");
    claim["claimed_at"] = json!(nightshift::clock::now() - 360);
    app.store.put(claim_key, serde_json::to_vec(&claim).unwrap().into()).await.unwrap();
    let retried = create_batch(&app, "stale", &body).await;
    assert_eq!(retried.status, StatusCode::OK);
    assert!(!replayed(&retried));
    assert_ne!(retried.json()["id"], first["id"]);

    // A day later the key is free, even for another request; the collector drops it.
    let mut claim: Value = serde_json::from_slice(&app.store.get(claim_key).await.unwrap()).unwrap();
    claim["claimed_at"] = json!(nightshift::clock::now() - 86_400);
    app.store.put(claim_key, serde_json::to_vec(&claim).unwrap().into()).await.unwrap();
    let other = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"x": "y"}});
    assert_eq!(create_batch(&app, "stale", &other).await.status, StatusCode::OK);
    let claims = nightshift::idempotency::IdempotencyStore::new(app.store.clone());
    assert_eq!(claims.collect_garbage(nightshift::clock::now() + 86_400).await.unwrap(), 1);
    assert!(app.store.list("idempotency/").await.unwrap().is_empty());
}
