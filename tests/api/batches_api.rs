//! `/v1/batches` through the router in-process: create (request checks, lookup,
//! validation, persistence), retrieve, list and cancel.

use crate::common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{Backend, OTHER_KEY, OTHER_PROJECT, TestApp};
use nightshift::batches::BatchStore;
use nightshift::ids::{BatchId, ProjectId};
use nightshift::storage::Key;
use serde_json::{Value, json};

const URL: &str = "/v1/chat/completions";

fn line(custom_id: &str) -> String {
    json!({"custom_id": custom_id, "method": "POST", "url": URL,
           "body": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}})
    .to_string()
}

fn jsonl(lines: &[String]) -> Vec<u8> {
    lines.iter().map(|l| format!("{l}\n")).collect::<String>().into_bytes()
}

async fn app() -> (Backend, TestApp) {
    let (backend, store) = Backend::dir().await;
    (backend, TestApp::new(store).await)
}

async fn upload(app: &TestApp, content: &[u8]) -> String {
    app.upload("input.jsonl", content).await["id"].as_str().unwrap().to_owned()
}

async fn create(app: &TestApp, file_id: &str) -> common::Answer {
    app.post_json("/v1/batches", json!({"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"})).await
}

fn as_other(method: &str, uri: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-project-id", OTHER_PROJECT)
        .header("x-api-key", OTHER_KEY)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn a_valid_input_creates_an_in_progress_batch_with_every_field() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a"), line("b"), line("c"), line("d")])).await;
    let metadata = json!({"job": "nightly", "nested": {"k": [1, null]}, "ü": "✓"});
    let answer =
        app.post_json("/v1/batches", json!({"input_file_id": file, "endpoint": URL, "metadata": metadata})).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer.body));
    let batch = answer.json();
    assert!(batch["id"].as_str().unwrap().starts_with("batch_"));
    assert_eq!(batch["object"], "batch");
    assert_eq!(batch["endpoint"], URL);
    assert_eq!(batch["errors"], Value::Null);
    assert_eq!(batch["input_file_id"], file);
    assert_eq!(batch["completion_window"], "24h");
    assert_eq!(batch["status"], "in_progress");
    assert_eq!(batch["output_file_id"], Value::Null);
    assert_eq!(batch["error_file_id"], Value::Null);
    let created = batch["created_at"].as_i64().unwrap();
    assert!(batch["in_progress_at"].as_i64().unwrap() >= created);
    assert_eq!(batch["expires_at"].as_i64().unwrap(), created + 86_400);
    for field in ["finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"] {
        assert_eq!(batch[field], Value::Null, "{field}");
    }
    assert_eq!(batch["request_counts"], json!({"total": 4, "completed": 0, "failed": 0}));
    assert_eq!(batch["metadata"], metadata, "metadata is echoed unchanged");
    assert_eq!(batch["usage"]["total_tokens"], 0);
    assert_eq!(batch["model"], "echo", "the model every line names");

    // The shard plan is persisted with the batch: 4 requests at 3 per shard.
    let id = BatchId::parse(batch["id"].as_str().unwrap()).unwrap();
    let stored = app.batches.get(&ProjectId::parse(common::PROJECT).unwrap(), &id).await.unwrap().unwrap();
    let shards: Vec<u64> = stored.spec.plan.shards.iter().map(|s| s.requests).collect();
    assert_eq!(shards, [3, 1]);
}

#[tokio::test]
async fn omitted_metadata_is_an_empty_object_and_omitted_window_is_24h() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let batch = app.post_json("/v1/batches", json!({"input_file_id": file, "endpoint": URL})).await.json();
    assert_eq!(batch["metadata"], json!({}));
    assert_eq!(batch["completion_window"], "24h");
}

#[tokio::test]
async fn request_checks_answer_400_with_the_specs_messages() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let cases = [
        (json!({"endpoint": URL}), "input_file_id is required", "input_file_id"),
        (json!({"input_file_id": 42, "endpoint": URL}), "input_file_id is required", "input_file_id"),
        (json!({"input_file_id": file}), "endpoint is required", "endpoint"),
        (json!({"input_file_id": file, "endpoint": ["x"]}), "endpoint is required", "endpoint"),
        (
            json!({"input_file_id": file, "endpoint": URL, "completion_window": "1h"}),
            "completion_window must be \"24h\"",
            "completion_window",
        ),
        (
            json!({"input_file_id": file, "endpoint": URL, "metadata": "tag"}),
            "metadata must be a JSON object",
            "metadata",
        ),
    ];
    for (body, message, param) in cases {
        let error = app.post_json("/v1/batches", body).await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["message"], message);
        assert_eq!(error["param"], param);
        assert_eq!(error["type"], "invalid_request_error");
    }
    assert_eq!(app.get("/v1/batches").await.json()["data"], json!([]), "request errors persist nothing");
}

/// `output_expires_after` is checked like OpenAI does and kept for finalize.
#[tokio::test]
async fn output_expires_after_is_checked_and_kept_with_the_batch() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let body = |after: Value| json!({"input_file_id": file, "endpoint": URL, "output_expires_after": after});
    for (after, code, param) in [
        (json!({"anchor": "created_at", "seconds": 10}), "integer_below_min_value", "output_expires_after.seconds"),
        (
            json!({"anchor": "created_at", "seconds": 2_592_001}),
            "integer_above_max_value",
            "output_expires_after.seconds",
        ),
        (json!({"anchor": "created_at", "seconds": "3600"}), "invalid_type", "output_expires_after.seconds"),
        (json!({"anchor": "created_at"}), "missing_required_parameter", "output_expires_after.seconds"),
        (json!({"anchor": "expires_at", "seconds": 3600}), "invalid_value", "output_expires_after.anchor"),
        (json!("1h"), "invalid_type", "output_expires_after"),
    ] {
        let error = app.post_json("/v1/batches", body(after)).await.error(StatusCode::BAD_REQUEST, code);
        assert_eq!(error["param"], param, "{error}");
        assert_eq!(error["type"], "invalid_request_error");
    }
    assert_eq!(app.get("/v1/batches").await.json()["data"], json!([]), "refused options persist nothing");
    let created = app.post_json("/v1/batches", body(json!({"anchor": "created_at", "seconds": 7200}))).await.json();
    let id = BatchId::parse(created["id"].as_str().unwrap()).unwrap();
    let stored = app.batches.get(&ProjectId::parse(common::PROJECT).unwrap(), &id).await.unwrap().unwrap();
    assert_eq!(stored.spec.output_expires_after, Some(7200));
    let plain = app
        .post_json("/v1/batches", json!({"input_file_id": file, "endpoint": URL, "output_expires_after": null}))
        .await;
    assert_eq!(plain.status, StatusCode::OK, "null is no option");
}

#[tokio::test]
async fn bodies_that_are_not_json_get_the_envelope() {
    let (_b, app) = app().await;
    let request = |content_type: &str, body: &'static str| {
        TestApp::request("POST", "/v1/batches").header("content-type", content_type).body(Body::from(body)).unwrap()
    };
    app.send(request("application/json", "{\"input_file_id\": ")).await.error(StatusCode::BAD_REQUEST, "invalid_json");
    app.send(request("text/plain", "{}")).await.error(StatusCode::BAD_REQUEST, "invalid_content_type");
    let error =
        app.send(request("application/json", "[1,2]")).await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["param"], "body");
    let huge = "x".repeat(3 * 1024 * 1024);
    let request = TestApp::request("POST", "/v1/batches")
        .header("content-type", "application/json")
        .body(Body::from(format!("{{\"metadata\": \"{huge}\"}}")))
        .unwrap();
    app.send(request).await.error(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large");
}

#[tokio::test]
async fn unknown_and_other_projects_input_files_are_404() {
    let (_b, app) = app().await;
    for id in ["file-01ARZ3NDEKTSV4RRFFQ69G5FAV", "nonsense", "../etc"] {
        let error = create(&app, id).await.error(StatusCode::NOT_FOUND, "file_not_found");
        assert_eq!(error["message"], format!("Input file not found: {id}"));
        assert_eq!(error["param"], "input_file_id");
    }
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let request = Request::builder()
        .method("POST")
        .uri("/v1/batches")
        .header("x-project-id", OTHER_PROJECT)
        .header("x-api-key", OTHER_KEY)
        .header("content-type", "application/json")
        .body(Body::from(json!({"input_file_id": file, "endpoint": URL}).to_string()))
        .unwrap();
    let error = app.send(request).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(error["message"], format!("Input file not found: {file}"));
    // A deleted input is not found either.
    app.delete(&format!("/v1/files/{file}")).await;
    create(&app, &file).await.error(StatusCode::NOT_FOUND, "file_not_found");
}

#[tokio::test]
async fn an_input_whose_bytes_are_gone_is_404_object_missing() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let data = Key::parse(&format!("file-data/{}/{file}", common::PROJECT)).unwrap();
    app.store.delete(&data).await.unwrap();
    let error = create(&app, &file).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(error["message"], format!("Input file object missing: {file}"));
}

#[tokio::test]
async fn every_validation_message_comes_back_with_its_line_over_http() {
    let (_b, app) = app().await;
    let with = |field: &str, value: Value| {
        let mut l: Value = serde_json::from_str(&line("x")).unwrap();
        if value.is_null() {
            l.as_object_mut().unwrap().remove(field);
        } else {
            l[field] = value;
        }
        l.to_string()
    };
    let cases: Vec<(Vec<u8>, String, Option<u64>)> = vec![
        (b"\n \n".to_vec(), "Input file contains no JSONL lines".into(), None),
        (jsonl(&[line("a"), "{not json".into()]), "Line 2 is not valid JSON".into(), Some(2)),
        (jsonl(&[line("a"), "[1]".into()]), "Line 2 must be a JSON object".into(), Some(2)),
        (jsonl(&[line("a"), with("custom_id", Value::Null)]), "Line 2 is missing custom_id".into(), Some(2)),
        (jsonl(&[line("a"), line("b"), line("a")]), "Line 3 duplicates custom_id \"a\"".into(), Some(3)),
        (jsonl(&[line("a"), with("method", json!("GET"))]), "Line 2 method must be \"POST\"".into(), Some(2)),
        (jsonl(&[line("a"), with("url", Value::Null)]), "Line 2 is missing url".into(), Some(2)),
        (
            jsonl(&[with("url", json!("/v1/embeddings"))]),
            "Line 1 url \"/v1/embeddings\" is not an allowed batch endpoint".into(),
            Some(1),
        ),
        (
            jsonl(&[line("a"), with("url", json!("/v1/responses"))]),
            "Line 2 url \"/v1/responses\" does not match the batch endpoint \"/v1/chat/completions\"".into(),
            Some(2),
        ),
        (jsonl(&[line("a"), with("body", json!({}))]), "Line 2 is missing body".into(), Some(2)),
        (
            jsonl(&[line("a"), with("body", json!({"model": "m", "stream": true}))]),
            "Line 2 has stream=true; streaming is not supported in batch mode".into(),
            Some(2),
        ),
        (
            jsonl(&[line("a"), format!("{{\"custom_id\":\"{}\"}}", "x".repeat(1024 * 1024))]),
            "Line 2 exceeds maximum size of 1048576 bytes".into(),
            Some(2),
        ),
    ];
    for (content, message, line_number) in cases {
        let file = upload(&app, &content).await;
        let answer = create(&app, &file).await;
        let error = answer.error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["message"], message.as_str());
        assert_eq!(error.get("line").and_then(Value::as_u64), line_number, "{message}");
    }
    // The endpoint of the request against the file's url.
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let answer = app.post_json("/v1/batches", json!({"input_file_id": file, "endpoint": "/v1/embeddings"})).await;
    let error = answer.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(
        error["message"],
        "endpoint \"/v1/embeddings\" does not match the url \"/v1/chat/completions\" used by the input file"
    );
    assert_eq!(error["param"], "endpoint");
}

#[tokio::test]
async fn inputs_over_200_mb_are_refused_without_reading_them() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    // Uploads stop at 100 MB, so make a record that claims more, as a large server-written file would.
    let meta = Key::parse(&format!("file-meta/{}/{file}.json", common::PROJECT)).unwrap();
    let mut record: Value = serde_json::from_slice(&app.store.get(&meta).await.unwrap()).unwrap();
    record["bytes"] = json!(209_715_201u64);
    app.store.put(&meta, serde_json::to_vec(&record).unwrap().into()).await.unwrap();
    let error = create(&app, &file).await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["message"], "Input file exceeds maximum size of 209715200 bytes");
}

#[tokio::test]
async fn a_failed_validation_is_persisted_retrievable_and_listed() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a"), line("b"), line("c"), line("d"), line("a")])).await;
    let answer = create(&app, &file).await;
    let error = answer.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["message"], "Line 5 duplicates custom_id \"a\"");
    assert_eq!(error["line"], 5);
    assert_eq!(error["param"], Value::Null);

    let listed = app.get("/v1/batches").await.json();
    let failed = &listed["data"][0];
    assert_eq!(failed["status"], "failed");
    assert!(failed["failed_at"].is_i64());
    assert_eq!(failed["in_progress_at"], Value::Null);
    assert_eq!(
        failed["errors"],
        json!({"object": "list", "data": [{"code": "invalid_request_error", "message": "Line 5 duplicates custom_id \"a\"", "line": 5, "param": null}]})
    );
    let retrieved = app.get(&format!("/v1/batches/{}", failed["id"].as_str().unwrap())).await.json();
    assert_eq!(&retrieved, failed);
}

#[tokio::test]
async fn retrieve_of_unknown_malformed_or_other_projects_batches_is_404() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let id = create(&app, &file).await.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(app.get(&format!("/v1/batches/{id}")).await.json()["id"], id);
    for uri in ["/v1/batches/batch_01ARZ3NDEKTSV4RRFFQ69G5FAV", "/v1/batches/nonsense", "/v1/batches/file-123"] {
        app.get(uri).await.error(StatusCode::NOT_FOUND, "batch_not_found");
    }
    app.send(as_other("GET", &format!("/v1/batches/{id}"))).await.error(StatusCode::NOT_FOUND, "batch_not_found");
    app.send(as_other("POST", &format!("/v1/batches/{id}/cancel")))
        .await
        .error(StatusCode::NOT_FOUND, "batch_not_found");
    let theirs = app.send(as_other("GET", "/v1/batches")).await.json();
    assert_eq!(theirs["data"], json!([]));
    app.get("/v1/batches/").await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
}

#[tokio::test]
async fn list_is_newest_first_with_clamped_limits_and_cursors() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let mut ids = Vec::new();
    for _ in 0..25 {
        ids.push(create(&app, &file).await.json()["id"].as_str().unwrap().to_owned());
    }
    ids.reverse();
    let page = app.get("/v1/batches").await.json();
    assert_eq!(page["data"].as_array().unwrap().len(), 20, "default limit");
    assert_eq!(page["first_id"], ids[0]);
    assert_eq!(page["last_id"], ids[19]);
    assert_eq!(page["has_more"], true);
    let rest = app.get(&format!("/v1/batches?after={}", ids[19])).await.json();
    let rest_ids: Vec<&str> = rest["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap()).collect();
    assert_eq!(rest_ids, ids[20..].iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(rest["has_more"], false);
    assert_eq!(app.get("/v1/batches?limit=0").await.json()["data"].as_array().unwrap().len(), 1);
    assert_eq!(app.get("/v1/batches?limit=-3").await.json()["data"].as_array().unwrap().len(), 1);
    assert_eq!(app.get("/v1/batches?limit=1000").await.json()["data"].as_array().unwrap().len(), 25);
    app.get("/v1/batches?limit=ten").await.error(StatusCode::BAD_REQUEST, "invalid_limit");
    let empty = app.get(&format!("/v1/batches?after={}", ids[24])).await.json();
    assert_eq!(empty, json!({"object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false}));
}

#[tokio::test]
async fn cancel_is_idempotent_and_409_once_terminal() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a")])).await;
    let id = create(&app, &file).await.json()["id"].as_str().unwrap().to_owned();
    let first = app_cancel(&app, &id).await;
    assert_eq!(first.status, StatusCode::OK);
    let first = first.json();
    assert_eq!(first["status"], "cancelling");
    assert!(first["cancelling_at"].is_i64());
    let again = app_cancel(&app, &id).await.json();
    assert_eq!(again, first, "cancel is idempotent");

    let bad = upload(&app, b"[1]\n").await;
    let failed = create(&app, &bad).await.json()["error"].clone();
    assert_eq!(failed["line"], 1);
    let failed_id = app.get("/v1/batches?limit=1").await.json()["data"][0]["id"].as_str().unwrap().to_owned();
    let error = app_cancel(&app, &failed_id).await.error(StatusCode::CONFLICT, "batch_not_cancellable");
    assert_eq!(error["message"], format!("Cannot cancel batch {failed_id}: it is already failed"));
    assert_eq!(
        app.get(&format!("/v1/batches/{failed_id}")).await.json()["status"],
        "failed",
        "terminal states never change"
    );
    app_cancel(&app, "batch_01ARZ3NDEKTSV4RRFFQ69G5FAV").await.error(StatusCode::NOT_FOUND, "batch_not_found");
}

async fn app_cancel(app: &TestApp, id: &str) -> common::Answer {
    app.send(TestApp::request("POST", &format!("/v1/batches/{id}/cancel")).body(Body::empty()).unwrap()).await
}

#[tokio::test]
async fn batches_survive_a_restart_of_the_store() {
    let (_b, app) = app().await;
    let file = upload(&app, &jsonl(&[line("a"), line("b")])).await;
    let created = create(&app, &file).await.json();
    let reopened = TestApp::new(app.store.clone()).await;
    let retrieved = reopened.get(&format!("/v1/batches/{}", created["id"].as_str().unwrap())).await.json();
    assert_eq!(retrieved, created);
}

/// Refused creates are stored and served like any batch, but memory keeps only the
/// unfinished ones; listing pages through both, from storage.
#[tokio::test]
async fn refused_creates_stay_on_disk_not_in_memory_and_list_in_pages() {
    let (_b, app) = app().await;
    let good = upload(&app, &jsonl(&[line("a")])).await;
    let bad = upload(&app, b"not json\n").await;
    let mut ids = vec![create(&app, &good).await.json()["id"].as_str().unwrap().to_owned()];
    for _ in 0..30 {
        assert_eq!(create(&app, &bad).await.status, StatusCode::BAD_REQUEST);
        ids.push(app.get("/v1/batches?limit=1").await.json()["data"][0]["id"].as_str().unwrap().to_owned());
    }
    ids.reverse();
    for store in [app.batches.clone(), std::sync::Arc::new(reopen(&app).await)] {
        let unfinished = store.unfinished().await;
        assert_eq!(unfinished.iter().map(|b| b.spec.id.to_string()).collect::<Vec<_>>(), [ids[30].clone()]);
        let (counts, _) = store.status_summary().await;
        assert_eq!(counts.get(&nightshift::batches::Status::Failed), Some(&30));
        assert_eq!(counts.get(&nightshift::batches::Status::InProgress), Some(&1));
    }
    let mut listed = Vec::new();
    let mut after = String::new();
    loop {
        let page = app.get(&format!("/v1/batches?limit=7{after}")).await.json();
        listed.extend(page["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap().to_owned()));
        if page["has_more"] == false {
            break;
        }
        after = format!("&after={}", page["last_id"].as_str().unwrap());
    }
    assert_eq!(listed, ids);
    let failed = app.get(&format!("/v1/batches/{}", ids[0])).await.json();
    assert_eq!(failed["status"], "failed");
    app_cancel(&app, &ids[0]).await.error(StatusCode::CONFLICT, "batch_not_cancellable");
}

async fn reopen(app: &TestApp) -> nightshift::batches::EmbeddedBatchStore {
    nightshift::batches::EmbeddedBatchStore::open(app.store.clone()).await.unwrap()
}

/// A batch made `days_ago`, in `status`, finished `finished_days_ago` (if terminal), that
/// used `tokens`.
fn old_batch(
    days_ago: i64,
    status: nightshift::batches::Status,
    finished_days_ago: i64,
    tokens: u64,
) -> nightshift::batches::Batch {
    use nightshift::batches::{Batch, BatchSpec, BatchState, Status};
    let now = nightshift::clock::now();
    let created = now - days_ago * 86_400;
    let ulid = ulid::Ulid::from_parts(created as u64 * 1000, rand_bits());
    let mut state = BatchState::in_progress(created, 1);
    state.status = status;
    let finished = Some(now - finished_days_ago * 86_400);
    match status {
        Status::Completed => state.completed_at = finished,
        Status::Failed => state.failed_at = finished,
        Status::Cancelled => state.cancelled_at = finished,
        Status::Expired => state.expired_at = finished,
        _ => {}
    }
    state.usage.total_tokens = tokens;
    Batch {
        spec: BatchSpec {
            id: BatchId::parse(&format!("batch_{ulid}")).unwrap(),
            project_id: ProjectId::parse(common::PROJECT).unwrap(),
            input_file_id: nightshift::ids::FileId::generate(),
            endpoint: URL.into(),
            completion_window: "24h".into(),
            metadata: Default::default(),
            created_at: created,
            expires_at: created + 86_400,
            model: None,
            output_expires_after: None,
            priority: None,
            plan: Default::default(),
        },
        state,
    }
}

fn rand_bits() -> u128 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    u128::from(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `batches.retention`: a batch that finished longer ago goes (document, listing and
/// lookup), one that finished since or still runs stays, and the tokens of those that
/// went stay counted for the project's quota, once, also across an interrupted removal.
#[tokio::test]
async fn finished_batches_go_after_their_retention_and_their_tokens_stay_counted() {
    use nightshift::batches::Status;
    let (_b, app) = app().await;
    let project = ProjectId::parse(common::PROJECT).unwrap();
    let gone = [old_batch(60, Status::Completed, 40, 100), old_batch(50, Status::Failed, 50, 0)];
    let kept = [
        old_batch(60, Status::Completed, 10, 7),
        old_batch(60, Status::InProgress, 0, 3),
        old_batch(1, Status::Cancelled, 1, 5),
    ];
    for batch in gone.iter().chain(&kept) {
        app.batches.insert(batch).await.unwrap();
    }
    let cutoff = nightshift::clock::now() - 30 * 86_400;
    assert_eq!(app.batches.remove_finished_before(cutoff).await.unwrap(), 2);
    assert_eq!(app.batches.remove_finished_before(cutoff).await.unwrap(), 0, "nothing twice");
    for batch in &gone {
        app.get(&format!("/v1/batches/{}", batch.spec.id)).await.error(StatusCode::NOT_FOUND, "batch_not_found");
        assert!(
            app.store.get(&Key::parse(&format!("batch-docs/{project}/{}.json", batch.spec.id)).unwrap()).await.is_err()
        );
    }
    let listed = app.get("/v1/batches?limit=100").await.json();
    let listed: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap()).collect();
    let mut expected: Vec<String> = kept.iter().map(|b| b.spec.id.to_string()).collect();
    expected.sort();
    expected.reverse();
    assert_eq!(listed, expected);
    let (counts, _) = app.batches.status_summary().await;
    assert_eq!(counts.get(&Status::Failed), Some(&0));
    assert_eq!(counts.get(&Status::Completed), Some(&1));

    // After a restart: the finished batches' tokens, those removed among them, once.
    let settled = |store: nightshift::batches::EmbeddedBatchStore| async move { store.usage().await.0 };
    assert_eq!(settled(reopen(&app).await).await.get(&project), Some(&(100 + 7 + 5)));

    // A removal interrupted after counting: the next open finishes it, counting nothing twice.
    let interrupted = old_batch(90, Status::Expired, 90, 1_000);
    app.batches.insert(&interrupted).await.unwrap();
    let usage_key = Key::parse(&format!("batch-usage/{project}.json")).unwrap();
    let mut usage: Value = serde_json::from_slice(&app.store.get(&usage_key).await.unwrap()).unwrap();
    usage["tokens"] = json!(100 + 1_000);
    usage["last_removed"] = json!([interrupted.spec.id]);
    app.store.put(&usage_key, serde_json::to_vec(&usage).unwrap().into()).await.unwrap();
    let reopened = reopen(&app).await;
    assert!(reopened.get(&project, &interrupted.spec.id).await.unwrap().is_none());
    assert_eq!(settled(reopened).await.get(&project), Some(&(100 + 1_000 + 7 + 5)));
}
