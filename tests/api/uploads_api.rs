//! `/v1/uploads` (OpenAI's Uploads API) through the router in-process: the whole cycle on
//! both storage backends, every refusal with its status, code and param, and the garbage
//! collection of what uploads leave.

use crate::common;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use axum::http::StatusCode;
use common::multipart::Form;
use common::{Answer, Backend, OTHER_KEY, OTHER_PROJECT, TestApp};
use md5::{Digest, Md5};
use nightshift::storage::{ByteStream, Key, ObjectStore, ObjectWriter, StorageError};
use serde_json::{Value, json};

fn line(n: usize) -> String {
    format!(
        "{{\"custom_id\":\"r{n}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\
         \"body\":{{\"model\":\"echo\",\"messages\":[{{\"role\":\"user\",\"content\":\"q{n}\"}}]}}}}\n"
    )
}

fn lines(range: std::ops::Range<usize>) -> Vec<u8> {
    range.map(line).collect::<String>().into_bytes()
}

async fn create(app: &TestApp, bytes: usize) -> Value {
    let body = json!({"bytes": bytes, "filename": "big.jsonl", "purpose": "batch", "mime_type": "application/jsonl"});
    let answer = app.post_json("/v1/uploads", body).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
    answer.json()
}

async fn try_part(app: &TestApp, upload: &str, data: &[u8]) -> Answer {
    let form = Form::new().file("data", "blob", data);
    app.send(form.request(TestApp::request("POST", &format!("/v1/uploads/{upload}/parts")))).await
}

async fn part(app: &TestApp, upload: &str, data: &[u8]) -> String {
    let answer = try_part(app, upload, data).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
    let part = answer.json();
    assert_eq!(part["object"], "upload.part");
    assert_eq!(part["upload_id"], upload);
    assert!(part["created_at"].as_i64().is_some());
    part["id"].as_str().unwrap().to_owned()
}

async fn complete(app: &TestApp, upload: &str, body: Value) -> Answer {
    app.post_json(&format!("/v1/uploads/{upload}/complete"), body).await
}

fn md5_hex(bytes: &[u8]) -> String {
    hex::encode(Md5::digest(bytes))
}

async fn whole_cycle(app: TestApp) {
    let parts = [lines(0..40), lines(40..41), lines(41..100)];
    let whole = parts.concat();
    let upload = create(&app, whole.len()).await;
    let id = upload["id"].as_str().unwrap();
    assert!(id.starts_with("upload_"), "{upload}");
    assert_eq!((upload["object"].as_str(), upload["status"].as_str()), (Some("upload"), Some("pending")));
    assert_eq!((upload["filename"].as_str(), upload["purpose"].as_str()), (Some("big.jsonl"), Some("batch")));
    assert_eq!(upload["bytes"], whole.len());
    assert_eq!(upload["expires_at"].as_i64().unwrap(), upload["created_at"].as_i64().unwrap() + 3600);
    assert_eq!(upload["file"], Value::Null);

    let mut ids = Vec::new();
    for data in &parts {
        ids.push(part(&app, id, data).await);
    }
    let done = complete(&app, id, json!({"part_ids": ids, "md5": md5_hex(&whole)})).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.json());
    let done = done.json();
    assert_eq!(done["status"], "completed");
    let file = &done["file"];
    assert_eq!((file["object"].as_str(), file["purpose"].as_str()), (Some("file"), Some("batch")));
    assert_eq!((file["bytes"].as_u64(), file["filename"].as_str()), (Some(whole.len() as u64), Some("big.jsonl")));
    let file_id = file["id"].as_str().unwrap();
    let content = app.get(&format!("/v1/files/{file_id}/content")).await;
    assert_eq!(content.body.as_ref(), whole.as_slice());
    assert_eq!(app.get(&format!("/v1/files/{file_id}")).await.json(), *file);

    // The same completion again (a retry after a lost answer) answers the same.
    let again = complete(&app, id, json!({"part_ids": ids})).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.json());
    assert_eq!(again.json()["file"]["id"], file_id);
    // The parts are gone from storage; the file is a normal input.
    assert!(app.store.list("upload-parts/").await.unwrap().is_empty());
    let batch = app
        .post_json(
            "/v1/batches",
            json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        )
        .await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.json());
    assert_eq!(batch.json()["request_counts"]["total"], 100);
}

#[tokio::test]
async fn an_upload_in_parts_becomes_a_file_on_a_directory() {
    let (_b, store) = Backend::dir().await;
    whole_cycle(TestApp::new(store).await).await;
}

#[tokio::test]
async fn an_upload_in_parts_becomes_a_file_on_s3() {
    let (_b, store) = Backend::s3().await;
    whole_cycle(TestApp::new(store).await).await;
}

async fn app() -> (Backend, TestApp) {
    let (backend, store) = Backend::dir().await;
    (backend, TestApp::new(store).await)
}

#[tokio::test]
async fn parts_completed_out_of_order_make_the_file_in_the_order_given() {
    let (_b, app) = app().await;
    let (a, b) = (lines(0..3), lines(3..5));
    let upload = create(&app, a.len() + b.len()).await;
    let id = upload["id"].as_str().unwrap();
    let (first, second) = (part(&app, id, &a).await, part(&app, id, &b).await);
    let done = complete(&app, id, json!({"part_ids": [second, first]})).await.json();
    let content = app.get(&format!("/v1/files/{}/content", done["file"]["id"].as_str().unwrap())).await;
    assert_eq!(content.body.as_ref(), [b.clone(), a.clone()].concat().as_slice());

    // A line cut across two parts, completed the wrong way round, is an input the batch
    // create refuses at the line where it breaks, as for any file.
    let whole = lines(0..4);
    let cut = whole.len() - 30;
    let upload = create(&app, whole.len()).await;
    let id = upload["id"].as_str().unwrap();
    let head = part(&app, id, &whole[..cut]).await;
    let tail = part(&app, id, &whole[cut..]).await;
    let done = complete(&app, id, json!({"part_ids": [tail, head]})).await.json();
    let refused = app
        .post_json(
            "/v1/batches",
            json!({"input_file_id": done["file"]["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        )
        .await;
    let error = refused.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["line"], 1, "{error}");
}

#[tokio::test]
async fn a_wrong_md5_unknown_parts_or_a_wrong_total_leave_the_upload_pending() {
    let (_b, app) = app().await;
    let (a, b) = (lines(0..2), lines(2..4));
    let upload = create(&app, a.len() + b.len()).await;
    let id = upload["id"].as_str().unwrap();
    let (first, second) = (part(&app, id, &a).await, part(&app, id, &b).await);

    let other = create(&app, 10).await;
    let foreign = part(&app, other["id"].as_str().unwrap(), b"0123456789").await;

    let cases = [
        (json!({"part_ids": [first, second], "md5": md5_hex(b"something else")}), "md5_mismatch", "md5"),
        (json!({"part_ids": [first, "part_01NOSUCHPART"]}), "invalid_part_id", "part_ids"),
        (json!({"part_ids": [first, "../../etc/passwd"]}), "invalid_part_id", "part_ids"),
        (json!({"part_ids": [first, foreign]}), "invalid_part_id", "part_ids"),
        (json!({"part_ids": [first]}), "upload_size_mismatch", "part_ids"),
        (json!({"part_ids": [first, first]}), "duplicate_part_id", "part_ids"),
        (json!({"part_ids": []}), "empty_array", "part_ids"),
        (json!({"part_ids": "part_x"}), "invalid_type", "part_ids"),
        (json!({"md5": "x"}), "missing_required_parameter", "part_ids"),
    ];
    for (body, code, param) in cases {
        let error = complete(&app, id, body.clone()).await.error(StatusCode::BAD_REQUEST, code);
        assert_eq!(error["param"], param, "{body}: {error}");
    }
    let done = complete(&app, id, json!({"part_ids": [first, second], "md5": md5_hex(&[a, b].concat())})).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.json());
}

#[tokio::test]
async fn parts_past_the_declared_size_or_64_mb_are_refused_on_a_directory() {
    let (_b, store) = Backend::dir().await;
    part_limits(TestApp::new(store).await).await;
}

#[tokio::test]
async fn parts_past_the_declared_size_or_64_mb_are_refused_on_s3() {
    let (_b, store) = Backend::s3().await;
    part_limits(TestApp::new(store).await).await;
}

async fn part_limits(app: TestApp) {
    let upload = create(&app, 10).await;
    let id = upload["id"].as_str().unwrap();
    part(&app, id, b"01234").await;
    let error = try_part(&app, id, b"0123456").await.error(StatusCode::BAD_REQUEST, "upload_size_exceeded");
    assert_eq!(error["param"], "data");
    try_part(&app, id, b"").await.error(StatusCode::BAD_REQUEST, "empty_part");
    let no_data = Form::new().text("other", "x").request(TestApp::request("POST", &format!("/v1/uploads/{id}/parts")));
    app.send(no_data).await.error(StatusCode::BAD_REQUEST, "missing_file");
    let not_multipart = app.post_json(&format!("/v1/uploads/{id}/parts"), json!({"data": "x"})).await;
    not_multipart.error(StatusCode::BAD_REQUEST, "invalid_multipart");

    let big = create(&app, 200 * 1024 * 1024).await;
    let over = vec![b'x'; 64 * 1024 * 1024 + 1];
    let error =
        try_part(&app, big["id"].as_str().unwrap(), &over).await.error(StatusCode::PAYLOAD_TOO_LARGE, "part_too_large");
    assert_eq!(error["param"], "data");
    // Nothing of the refused parts stays: only the one part of the first upload.
    let kept = app.store.list("upload-parts/").await.unwrap();
    assert_eq!(kept.len(), 2, "the part and its size mark: {kept:?}");
}

/// A store that counts the listings of upload parts.
struct CountingListings {
    store: Arc<dyn ObjectStore>,
    part_listings: AtomicUsize,
}

#[async_trait]
impl ObjectStore for CountingListings {
    async fn writer(&self, key: &Key) -> Result<Box<dyn ObjectWriter>, StorageError> {
        self.store.writer(key).await
    }
    async fn read(&self, key: &Key, range: Option<Range<u64>>) -> Result<ByteStream, StorageError> {
        self.store.read(key, range).await
    }
    async fn size(&self, key: &Key) -> Result<Option<u64>, StorageError> {
        self.store.size(key).await
    }
    async fn delete(&self, key: &Key) -> Result<(), StorageError> {
        self.store.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Key>, StorageError> {
        if prefix.starts_with("upload-parts/") {
            self.part_listings.fetch_add(1, Ordering::Relaxed);
        }
        self.store.list(prefix).await
    }
}

#[tokio::test]
async fn adding_a_part_costs_the_same_however_many_the_upload_has() {
    let (_b, store) = Backend::dir().await;
    let counting = Arc::new(CountingListings { store, part_listings: AtomicUsize::new(0) });
    let app = TestApp::new(counting.clone()).await;
    let upload = create(&app, 1_000).await;
    let id = upload["id"].as_str().unwrap();
    let mut parts = Vec::new();
    for _ in 0..50 {
        parts.push(part(&app, id, b"0123456789").await);
    }
    let listings = counting.part_listings.load(Ordering::Relaxed);
    assert_eq!(listings, 1, "the upload's parts are listed once, not once per part");
    // The count in memory still bounds the upload: its size is all taken.
    try_part(&app, id, &[b'x'; 501]).await.error(StatusCode::BAD_REQUEST, "upload_size_exceeded");
    parts.push(part(&app, id, &[b'y'; 500]).await);
    let done = complete(&app, id, json!({ "part_ids": parts })).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.json());
}

#[tokio::test]
async fn cancelled_completed_and_expired_uploads_take_nothing_more() {
    let (_b, app) = app().await;
    let upload = create(&app, 5).await;
    let id = upload["id"].as_str().unwrap();
    let first = part(&app, id, b"01234").await;
    let cancelled = app.post_json(&format!("/v1/uploads/{id}/cancel"), json!({})).await.json();
    assert_eq!(cancelled["status"], "cancelled");
    assert!(app.store.list("upload-parts/").await.unwrap().is_empty(), "a cancel drops the parts");
    try_part(&app, id, b"x").await.error(StatusCode::BAD_REQUEST, "upload_cancelled");
    complete(&app, id, json!({"part_ids": [first]})).await.error(StatusCode::BAD_REQUEST, "upload_cancelled");
    let again = app.post_json(&format!("/v1/uploads/{id}/cancel"), json!({})).await;
    assert_eq!(again.json()["status"], "cancelled", "cancelling twice is harmless");

    let upload = create(&app, 5).await;
    let id = upload["id"].as_str().unwrap();
    let first = part(&app, id, b"01234").await;
    assert_eq!(complete(&app, id, json!({"part_ids": [first]})).await.status, StatusCode::OK);
    try_part(&app, id, b"x").await.error(StatusCode::BAD_REQUEST, "upload_completed");
    complete(&app, id, json!({"part_ids": ["part_other"]})).await.error(StatusCode::BAD_REQUEST, "upload_completed");
    app.post_json(&format!("/v1/uploads/{id}/cancel"), json!({}))
        .await
        .error(StatusCode::BAD_REQUEST, "upload_completed");

    // An upload an hour old: its record says so (rewritten here rather than waiting).
    let upload = create(&app, 5).await;
    let id = upload["id"].as_str().unwrap().to_owned();
    let first = part(&app, &id, b"01234").await;
    let key = nightshift::storage::Key::parse(&format!("uploads/{}/{id}.json", common::PROJECT)).unwrap();
    let mut record: Value = serde_json::from_slice(&app.store.get(&key).await.unwrap()).unwrap();
    record["created_at"] = json!(record["created_at"].as_i64().unwrap() - 3600);
    record["expires_at"] = json!(record["expires_at"].as_i64().unwrap() - 3600);
    app.store.put(&key, serde_json::to_vec(&record).unwrap().into()).await.unwrap();
    let error = try_part(&app, &id, b"x").await.error(StatusCode::BAD_REQUEST, "upload_expired");
    assert_eq!(error["param"], "upload_id");
    complete(&app, &id, json!({"part_ids": [first]})).await.error(StatusCode::BAD_REQUEST, "upload_expired");
    app.post_json(&format!("/v1/uploads/{id}/cancel"), json!({}))
        .await
        .error(StatusCode::BAD_REQUEST, "upload_expired");
}

#[tokio::test]
async fn another_projects_upload_or_a_made_up_id_is_not_found() {
    let (_b, app) = app().await;
    let upload = create(&app, 5).await;
    let id = upload["id"].as_str().unwrap();
    let theirs = axum::http::Request::builder()
        .method("POST")
        .uri(format!("/v1/uploads/{id}/cancel"))
        .header("x-project-id", OTHER_PROJECT)
        .header("x-api-key", OTHER_KEY)
        .header("content-type", "application/json")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    let error = app.send(theirs).await.error(StatusCode::NOT_FOUND, "upload_not_found");
    assert_eq!(error["param"], "upload_id");
    for made_up in ["upload_01NOSUCHUPLOAD", "file-01NOTANUPLOAD", "upload_..%2F..%2Fx", "%F0%9F%A6%80"] {
        try_part(&app, made_up, b"x").await.error(StatusCode::NOT_FOUND, "upload_not_found");
        complete(&app, made_up, json!({"part_ids": ["part_a"]})).await.error(StatusCode::NOT_FOUND, "upload_not_found");
    }
    assert_eq!(app.get(&format!("/v1/uploads/{id}")).await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_creates_answer_openais_errors() {
    let (_b, app) = app().await;
    let ok = json!({"bytes": 10, "filename": "a.jsonl", "purpose": "batch", "mime_type": "application/jsonl"});
    let with = |field: &str, value: Value| {
        let mut body = ok.clone();
        body[field] = value;
        body
    };
    let cases = [
        (with("bytes", json!(200 * 1024 * 1024 + 1)), "file_too_large", "bytes"),
        (with("bytes", json!(0)), "integer_below_min_value", "bytes"),
        (with("purpose", json!("assistants")), "invalid_purpose", "purpose"),
        (with("mime_type", json!("application/pdf")), "invalid_value", "mime_type"),
        (
            with("expires_after", json!({"anchor": "created_at", "seconds": 2_592_001})),
            "integer_above_max_value",
            "expires_after.seconds",
        ),
    ];
    for (body, code, param) in cases {
        let error = app.post_json("/v1/uploads", body.clone()).await.error(StatusCode::BAD_REQUEST, code);
        assert_eq!(error["param"], param, "{body}: {error}");
    }
    let request = TestApp::request("POST", "/v1/uploads")
        .header("content-type", "application/json")
        .body("{\"bytes\":".into())
        .unwrap();
    app.send(request).await.error(StatusCode::BAD_REQUEST, "invalid_json");
    // The file keeps the expiry asked for at create.
    let upload = app
        .post_json("/v1/uploads", with("expires_after", json!({"anchor": "created_at", "seconds": 7200})))
        .await
        .json();
    let id = upload["id"].as_str().unwrap();
    let first = part(&app, id, b"0123456789").await;
    let file = complete(&app, id, json!({"part_ids": [first]})).await.json()["file"].clone();
    assert_eq!(file["expires_at"].as_i64().unwrap(), file["created_at"].as_i64().unwrap() + 7200, "{file}");
}

#[tokio::test]
async fn garbage_collection_drops_the_parts_of_finished_and_expired_uploads() {
    let (_b, app) = app().await;
    let uploads = nightshift::uploads::UploadStore::new(app.files.clone());
    let pending = create(&app, 10).await;
    part(&app, pending["id"].as_str().unwrap(), b"01234").await;
    let now = nightshift::clock::now();
    assert_eq!(uploads.collect_garbage(now).await.unwrap(), 0);
    assert_eq!(app.store.list("upload-parts/").await.unwrap().len(), 2, "a pending upload keeps its part");
    // An hour and the grace later, the parts go; a day after that, the record.
    uploads.collect_garbage(now + 3600 + 600).await.unwrap();
    assert!(app.store.list("upload-parts/").await.unwrap().is_empty());
    assert_eq!(app.store.list("uploads/").await.unwrap().len(), 1);
    assert_eq!(uploads.collect_garbage(now + 3600 + 86_400).await.unwrap(), 1);
    assert!(app.store.list("uploads/").await.unwrap().is_empty());
    // Parts whose upload has no record (a crash between the two) go once old enough.
    let orphan = nightshift::storage::Key::parse(&format!(
        "upload-parts/{}/upload_01ARZ3NDEKTSV4RRFFQ69G5FAV/part_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        common::PROJECT
    ))
    .unwrap();
    app.store.put(&orphan, "x".into()).await.unwrap();
    uploads.collect_garbage(now).await.unwrap();
    assert!(app.store.list("upload-parts/").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_at_once_make_one_file_and_all_answer_it() {
    let (_b, store) = Backend::dir().await;
    let app = std::sync::Arc::new(TestApp::new(store).await);
    let (a, b) = (lines(0..50), lines(50..90));
    let upload = create(&app, a.len() + b.len()).await;
    let id = upload["id"].as_str().unwrap().to_owned();
    let ids = json!([part(&app, &id, &a).await, part(&app, &id, &b).await]);
    let completions: Vec<_> = (0..6)
        .map(|_| {
            let (app, id, ids) = (app.clone(), id.clone(), ids.clone());
            tokio::spawn(async move { complete(&app, &id, json!({ "part_ids": ids })).await })
        })
        .collect();
    let mut files = std::collections::HashSet::new();
    for completion in completions {
        let answer = completion.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
        files.insert(answer.json()["file"]["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(files.len(), 1, "{files:?}");
    let listed = app.get("/v1/files").await.json();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "{listed}");
    let file = files.into_iter().next().unwrap();
    assert_eq!(app.get(&format!("/v1/files/{file}/content")).await.body.as_ref(), [a, b].concat().as_slice());
}
