//! `/v1/files` through the router in-process: every Files error code of the spec,
//! auth, the error envelope, and the whole cycle on both storage backends.

use crate::common;

use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::multipart::Form;
use common::{Backend, OTHER_KEY, OTHER_PROJECT, TestApp};
use nightshift::storage::{ByteStream, Key, ObjectStore, ObjectWriter, StorageError};

const LINES: &[u8] = b"{\"custom_id\":\"a\"}\n{\"custom_id\":\"b\"}\n";

async fn app() -> (Backend, TestApp) {
    let (backend, store) = Backend::dir().await;
    (backend, TestApp::new(store).await)
}

fn upload(form: Form) -> Request<Body> {
    form.request(TestApp::request("POST", "/v1/files"))
}

#[tokio::test]
async fn upload_answers_a_file_object_with_every_field() {
    let (_b, app) = app().await;
    let file = app.upload("input.jsonl", LINES).await;
    let id = file["id"].as_str().unwrap();
    assert!(id.starts_with("file-"), "{file}");
    assert_eq!(file["object"], "file");
    assert_eq!(file["bytes"], LINES.len());
    assert_eq!(file["filename"], "input.jsonl");
    assert_eq!(file["purpose"], "batch");
    assert_eq!(file["status"], "processed");
    let created = file["created_at"].as_i64().unwrap();
    assert_eq!(file["expires_at"].as_i64().unwrap(), created + 30 * 86_400);
    assert!(file.get("is_error").is_none(), "is_error only appears on error files: {file}");
}

#[tokio::test]
async fn upload_keeps_unicode_filenames_and_names_unnamed_files_after_their_id() {
    let (_b, app) = app().await;
    let file = app.upload("données ✓.jsonl", LINES).await;
    assert_eq!(file["filename"], "données ✓.jsonl");
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nline\n\r\n--{b}--\r\n",
        b = common::multipart::BOUNDARY
    );
    let request = TestApp::request("POST", "/v1/files")
        .header("content-type", format!("multipart/form-data; boundary={}", common::multipart::BOUNDARY))
        .body(Body::from(body))
        .unwrap();
    let file = app.send(request).await.json();
    assert_eq!(file["filename"], format!("{}.jsonl", file["id"].as_str().unwrap()));
}

#[tokio::test]
async fn upload_that_is_not_multipart_is_invalid_content_type() {
    let (_b, app) = app().await;
    let request = TestApp::request("POST", "/v1/files")
        .header("content-type", "application/json")
        .body(Body::from("{\"purpose\":\"batch\"}"))
        .unwrap();
    app.send(request).await.error(StatusCode::BAD_REQUEST, "invalid_content_type");
    let request = TestApp::request("POST", "/v1/files").body(Body::from("x")).unwrap();
    app.send(request).await.error(StatusCode::BAD_REQUEST, "invalid_content_type");
}

#[tokio::test]
async fn upload_with_a_broken_multipart_body_is_invalid_multipart() {
    let (_b, app) = app().await;
    // Truncated: the closing boundary never comes.
    let truncated = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\nhalf a li",
        b = common::multipart::BOUNDARY
    );
    for (content_type, body) in [
        (format!("multipart/form-data; boundary={}", common::multipart::BOUNDARY), truncated),
        ("multipart/form-data".to_owned(), "no boundary at all".to_owned()),
        (format!("multipart/form-data; boundary={}", common::multipart::BOUNDARY), "garbage".to_owned()),
    ] {
        let request =
            TestApp::request("POST", "/v1/files").header("content-type", content_type).body(Body::from(body)).unwrap();
        app.send(request).await.error(StatusCode::BAD_REQUEST, "invalid_multipart");
    }
    assert!(app.store.list("file-").await.unwrap().is_empty(), "nothing half-written is left");
}

#[tokio::test]
async fn upload_with_any_purpose_but_batch_is_invalid_purpose() {
    let (_b, app) = app().await;
    for purpose in ["fine-tune", "batch_output", "BATCH", ""] {
        let answer = app.send(upload(Form::new().text("purpose", purpose).file("file", "a.jsonl", LINES))).await;
        let error = answer.error(StatusCode::BAD_REQUEST, "invalid_purpose");
        assert_eq!(error["param"], "purpose");
        assert_eq!(error["type"], "invalid_request_error");
    }
    // Also when the purpose comes after the file, or not at all.
    let late = Form::new().file("file", "a.jsonl", LINES).text("purpose", "assistants");
    app.send(upload(late)).await.error(StatusCode::BAD_REQUEST, "invalid_purpose");
    let none = Form::new().file("file", "a.jsonl", LINES);
    app.send(upload(none)).await.error(StatusCode::BAD_REQUEST, "invalid_purpose");
    assert!(app.store.list("file-").await.unwrap().is_empty(), "rejected uploads leave no bytes");
}

#[tokio::test]
async fn upload_without_a_file_part_is_missing_file() {
    let (_b, app) = app().await;
    let answer = app.send(upload(Form::new().text("purpose", "batch").text("other", "x"))).await;
    assert_eq!(answer.error(StatusCode::BAD_REQUEST, "missing_file")["param"], "file");
}

#[tokio::test]
async fn upload_of_zero_bytes_is_empty_file() {
    let (_b, app) = app().await;
    let answer = app.send(upload(Form::new().text("purpose", "batch").file("file", "empty.jsonl", b""))).await;
    answer.error(StatusCode::BAD_REQUEST, "empty_file");
    assert!(app.store.list("file-").await.unwrap().is_empty());
}

#[tokio::test]
async fn upload_of_two_files_is_invalid_multipart() {
    let (_b, app) = app().await;
    let form = Form::new().text("purpose", "batch").file("file", "a.jsonl", LINES).file("file", "b.jsonl", LINES);
    app.send(upload(form)).await.error(StatusCode::BAD_REQUEST, "invalid_multipart");
    assert!(app.store.list("file-").await.unwrap().is_empty());
}

#[tokio::test]
async fn upload_over_100_mb_is_413_file_too_large_and_leaves_nothing() {
    let (_b, app) = app().await;
    let limit = 100 * 1024 * 1024;
    let exactly = vec![b'x'; limit];
    let file = app.upload("exactly.jsonl", &exactly).await;
    assert_eq!(file["bytes"], limit);
    drop(exactly);

    let over = vec![b'x'; limit + 1];
    let answer = app.send(upload(Form::new().text("purpose", "batch").file("file", "big.jsonl", &over))).await;
    let error = answer.error(StatusCode::PAYLOAD_TOO_LARGE, "file_too_large");
    assert_eq!(error["type"], "invalid_request_error");
    let listed = app.get("/v1/files").await.json();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "only the file at the limit exists");
    assert_eq!(app.store.list("file-data/").await.unwrap().len(), 1);
}

#[tokio::test]
async fn upload_declaring_a_huge_content_length_is_refused_up_front() {
    let (_b, app) = app().await;
    let request = TestApp::request("POST", "/v1/files")
        .header("content-type", format!("multipart/form-data; boundary={}", common::multipart::BOUNDARY))
        .header("content-length", (200u64 * 1024 * 1024).to_string())
        .body(Body::from("tiny"))
        .unwrap();
    app.send(request).await.error(StatusCode::PAYLOAD_TOO_LARGE, "file_too_large");
}

#[tokio::test]
async fn list_rejects_limits_that_are_not_positive_integers() {
    let (_b, app) = app().await;
    for limit in ["0", "-1", "abc", "1.5", "", "99999999999999999999999"] {
        let answer = app.get(&format!("/v1/files?limit={limit}")).await;
        let error = answer.error(StatusCode::BAD_REQUEST, "invalid_limit");
        assert_eq!(error["param"], "limit");
    }
    assert_eq!(app.get("/v1/files?limit=100000").await.status, StatusCode::OK, "large limits are clamped");
}

#[tokio::test]
async fn list_pages_newest_first_with_cursors_and_filters() {
    let (_b, app) = app().await;
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(app.upload(&format!("{n}.jsonl"), LINES).await["id"].as_str().unwrap().to_owned());
    }
    let page = app.get("/v1/files?limit=2").await.json();
    assert_eq!(page["object"], "list");
    let names: Vec<_> = page["data"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap()).collect();
    assert_eq!(names, [ids[4].as_str(), ids[3].as_str()]);
    assert_eq!(page["first_id"], ids[4]);
    assert_eq!(page["last_id"], ids[3]);
    assert_eq!(page["has_more"], true);

    let rest = app.get(&format!("/v1/files?limit=10&after={}", ids[3])).await.json();
    let names: Vec<_> = rest["data"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap()).collect();
    assert_eq!(names, [ids[2].as_str(), ids[1].as_str(), ids[0].as_str()]);
    assert_eq!(rest["has_more"], false);

    let ascending = app.get(&format!("/v1/files?order=asc&after={}", ids[1])).await.json();
    assert_eq!(ascending["data"][0]["id"], ids[2]);
    assert_eq!(ascending["data"].as_array().unwrap().len(), 3);

    let outputs = app.get("/v1/files?purpose=batch_output").await.json();
    assert_eq!(outputs["data"].as_array().unwrap().len(), 0);
    assert_eq!(outputs["first_id"], serde_json::Value::Null);
    assert_eq!(app.get("/v1/files?purpose=batch").await.json()["data"].as_array().unwrap().len(), 5);
    app.get("/v1/files?order=sideways").await.error(StatusCode::BAD_REQUEST, "invalid_order");
}

#[tokio::test]
async fn retrieve_and_content_return_the_file_and_its_exact_bytes() {
    let (_b, app) = app().await;
    let content = "{\"custom_id\":\"ü\",\"x\":\"\u{1F600}\"}\n".repeat(1000);
    let id = app.upload("u.jsonl", content.as_bytes()).await["id"].as_str().unwrap().to_owned();
    let file = app.get(&format!("/v1/files/{id}")).await;
    assert_eq!(file.status, StatusCode::OK);
    assert_eq!(file.json()["bytes"], content.len());
    let download = app.get(&format!("/v1/files/{id}/content")).await;
    assert_eq!(download.status, StatusCode::OK);
    assert_eq!(download.body, content.as_bytes());
}

#[tokio::test]
async fn unknown_malformed_and_other_projects_files_are_404_file_not_found() {
    let (_b, app) = app().await;
    let id = app.upload("a.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    for uri in [
        "/v1/files/file-01ARZ3NDEKTSV4RRFFQ69G5FAV".to_owned(),
        "/v1/files/not-a-file-id".to_owned(),
        "/v1/files/file-..%2F..%2Fetc".to_owned(),
        "/v1/files/file-01ARZ3NDEKTSV4RRFFQ69G5FAV/content".to_owned(),
    ] {
        let error = app.get(&uri).await.error(StatusCode::NOT_FOUND, "file_not_found");
        assert_eq!(error["type"], "invalid_request_error");
    }
    for (method, uri) in [
        ("GET", format!("/v1/files/{id}")),
        ("GET", format!("/v1/files/{id}/content")),
        ("DELETE", format!("/v1/files/{id}")),
    ] {
        let request = Request::builder()
            .method(method)
            .uri(&uri)
            .header("x-project-id", OTHER_PROJECT)
            .header("x-api-key", OTHER_KEY)
            .body(Body::empty())
            .unwrap();
        app.send(request).await.error(StatusCode::NOT_FOUND, "file_not_found");
    }
    let theirs = Request::builder()
        .uri("/v1/files")
        .header("x-project-id", OTHER_PROJECT)
        .header("x-api-key", OTHER_KEY)
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.send(theirs).await.json()["data"].as_array().unwrap().len(), 0);
    assert_eq!(app.get(&format!("/v1/files/{id}")).await.status, StatusCode::OK, "still there for its owner");
}

#[tokio::test]
async fn delete_answers_like_openai_and_the_file_is_gone_after() {
    let (_b, app) = app().await;
    let id = app.upload("a.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    let answer = app.delete(&format!("/v1/files/{id}")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json(), serde_json::json!({"id": id, "object": "file", "deleted": true}));
    app.get(&format!("/v1/files/{id}")).await.error(StatusCode::NOT_FOUND, "file_not_found");
    app.get(&format!("/v1/files/{id}/content")).await.error(StatusCode::NOT_FOUND, "file_not_found");
    app.delete(&format!("/v1/files/{id}")).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(app.get("/v1/files").await.json()["data"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn garbage_collection_removes_deleted_and_expired_files_only() {
    let (_b, app) = app().await;
    let kept = app.upload("kept.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    let deleted = app.upload("deleted.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    app.delete(&format!("/v1/files/{deleted}")).await;
    assert_eq!(app.store.list("file-data/").await.unwrap().len(), 2, "deletion is soft until collected");

    assert_eq!(app.files.collect_garbage(nightshift::clock::now(), &Default::default()).await.unwrap(), 1);
    assert_eq!(app.store.list("file-data/").await.unwrap().len(), 1);
    assert_eq!(app.store.list("file-meta/").await.unwrap().len(), 1);
    assert_eq!(app.get(&format!("/v1/files/{kept}")).await.status, StatusCode::OK);

    // Thirty days and a second later, the kept file has expired too.
    let later = nightshift::clock::now() + 30 * 86_400 + 1;
    assert_eq!(app.files.collect_garbage(later, &Default::default()).await.unwrap(), 1);
    assert!(app.store.list("file-").await.unwrap().is_empty());
}

#[tokio::test]
async fn expired_files_are_404_before_they_are_collected() {
    let (_b, app) = app().await;
    let id = app.upload("a.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    let key = app.store.list("file-meta/").await.unwrap().remove(0);
    let mut record: serde_json::Value = serde_json::from_slice(&app.store.get(&key).await.unwrap()).unwrap();
    record["expires_at"] = serde_json::json!(nightshift::clock::now() - 1);
    app.store.put(&key, serde_json::to_vec(&record).unwrap().into()).await.unwrap();
    app.get(&format!("/v1/files/{id}")).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(app.get("/v1/files").await.json()["data"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn legacy_underscore_file_ids_stay_resolvable() {
    let (_b, app) = app().await;
    // A record written before ids were normalised to `file-`.
    let legacy = "file_legacy0123";
    let meta = serde_json::json!({
        "id": legacy, "project_id": common::PROJECT, "bytes": 3, "created_at": 1_700_000_000,
        "filename": "old.jsonl", "purpose": "batch",
    });
    let meta_key = Key::parse(&format!("file-meta/{}/{legacy}.json", common::PROJECT)).unwrap();
    app.store.put(&meta_key, serde_json::to_vec(&meta).unwrap().into()).await.unwrap();
    let data_key = Key::parse(&format!("file-data/{}/{legacy}", common::PROJECT)).unwrap();
    app.store.put(&data_key, bytes::Bytes::from_static(b"abc")).await.unwrap();

    let file = app.get(&format!("/v1/files/{legacy}")).await.json();
    assert_eq!(file["id"], legacy);
    assert!(file.get("expires_at").is_none());
    assert_eq!(app.get("/v1/files/file-legacy0123/content").await.body, "abc", "either spelling resolves");

    // And a new file is found by its `file_` spelling too.
    let id = app.upload("n.jsonl", LINES).await["id"].as_str().unwrap().to_owned();
    let legacy_spelling = id.replacen("file-", "file_", 1);
    assert_eq!(app.get(&format!("/v1/files/{legacy_spelling}")).await.json()["id"], id);

    // A record from before newest-first markers is listed oldest first at once, and newest
    // first once a garbage collection (the first runs at start) has put its marker back.
    let listed = |page: serde_json::Value| {
        page["data"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap().to_owned()).collect::<Vec<_>>()
    };
    assert_eq!(listed(app.get("/v1/files?order=asc").await.json()), [id.clone(), legacy.to_owned()]);
    assert_eq!(listed(app.get("/v1/files").await.json()), [id.as_str()]);
    app.files.collect_garbage(nightshift::clock::now(), &Default::default()).await.unwrap();
    assert_eq!(listed(app.get("/v1/files").await.json()), [legacy.to_owned(), id.clone()]);
}

/// Listing newest first goes through markers: a deleted file leaves it at once; a marker
/// whose record never came (an upload killed in between) is skipped, and removed by the
/// garbage collector once older than an hour, not before (it may be an upload under way).
#[tokio::test]
async fn newest_first_listing_skips_deleted_files_and_markers_without_records() {
    let (_b, app) = app().await;
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(app.upload(&format!("{n}.jsonl"), LINES).await["id"].as_str().unwrap().to_owned());
    }
    app.delete(&format!("/v1/files/{}", ids[1])).await;
    let markers = format!("file-newest/{}/", common::PROJECT);
    assert_eq!(app.store.list(&markers).await.unwrap().len(), 2, "the deleted file's marker went with it");
    // Markers of files whose records were never written: one an hour old, one new.
    let old =
        nightshift::ids::FileId::parse(&format!("file-{}", ulid::Ulid::from_parts(1_600_000_000_000, 7))).unwrap();
    let new = nightshift::ids::FileId::generate();
    for orphan in [&old, &new] {
        let marker =
            nightshift::storage::newest_first::marker("file-newest", common::PROJECT, orphan.as_str()).unwrap();
        app.store.put(&marker, bytes::Bytes::new()).await.unwrap();
    }
    let page = app.get("/v1/files?limit=1").await.json();
    assert_eq!(page["data"][0]["id"], ids[2]);
    assert_eq!(page["has_more"], true);
    let rest = app.get(&format!("/v1/files?after={}", ids[2])).await.json();
    assert_eq!(rest["data"].as_array().unwrap().len(), 1);
    assert_eq!(rest["data"][0]["id"], ids[0]);
    assert_eq!(rest["has_more"], false);

    assert_eq!(app.files.collect_garbage(nightshift::clock::now(), &Default::default()).await.unwrap(), 1);
    let left: Vec<String> = app.store.list(&markers).await.unwrap().iter().map(|k| k.name().to_owned()).collect();
    let name = |id: &nightshift::ids::FileId| nightshift::storage::newest_first::name(id.as_str()).unwrap();
    assert!(!left.contains(&name(&old)), "the old orphan marker is removed");
    assert!(left.contains(&name(&new)), "a new one may be an upload under way: kept");
    assert_eq!(left.len(), 3);
}

#[tokio::test]
async fn missing_credentials_are_401_and_wrong_ones_403() {
    let (_b, app) = app().await;
    let cases = [
        (None, None, StatusCode::UNAUTHORIZED),
        (Some(common::PROJECT), None, StatusCode::UNAUTHORIZED),
        (None, Some(common::KEY), StatusCode::UNAUTHORIZED),
        (Some(common::PROJECT), Some("wrong"), StatusCode::FORBIDDEN),
        (Some(common::PROJECT), Some(OTHER_KEY), StatusCode::FORBIDDEN),
        (Some("not-a-uuid"), Some(common::KEY), StatusCode::FORBIDDEN),
    ];
    for (project, key, status) in cases {
        let mut request = Request::builder().uri("/v1/files");
        if let Some(project) = project {
            request = request.header("x-project-id", project);
        }
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let answer = app.send(request.body(Body::empty()).unwrap()).await;
        assert_eq!(answer.status, status, "{project:?} {key:?}");
        assert_eq!(answer.json()["error"]["type"], "authentication_error");
    }
}

#[tokio::test]
async fn every_response_carries_a_request_id_and_router_errors_use_the_envelope() {
    let (_b, app) = app().await;
    let unknown = app.get("/v1/nothing-here").await;
    let error = unknown.error(StatusCode::NOT_FOUND, "unknown_url");
    assert_eq!(error["message"], "Invalid URL (GET /v1/nothing-here)");
    let wrong_method = app.send(TestApp::request("PUT", "/v1/files").body(Body::empty()).unwrap()).await;
    wrong_method.error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    let ok = app.get("/v1/files").await;
    let unauthenticated = app.send(Request::builder().uri("/v1/files").body(Body::empty()).unwrap()).await;
    let mut seen = std::collections::HashSet::new();
    for answer in [&unknown, &wrong_method, &ok, &unauthenticated] {
        let id = answer.headers["x-request-id"].to_str().unwrap();
        assert!(id.starts_with("req_") && id.len() > 10, "{id}");
        assert!(seen.insert(id.to_owned()), "request ids are unique");
    }
}

/// Metrics labels come from closed sets: no client can add series by inventing methods
/// or paths (unauthenticated, too).
#[tokio::test]
async fn invented_methods_and_paths_never_grow_the_metrics() {
    let (_b, app) = app().await;
    let request = |method: &str, path: &str| Request::builder().method(method).uri(path).body(Body::empty()).unwrap();
    let series = || nightshift::metrics::METRICS.encode().lines().filter(|line| !line.starts_with('#')).count();
    // One request of each shape first: an invented method on an unknown path and on a
    // route, a known one on an unknown path, and on a route with an id.
    for (method, path) in [("BREW", "/coffee"), ("BREW", "/v1/files"), ("GET", "/nope"), ("GET", "/v1/files/file-x")] {
        app.send(request(method, path)).await;
    }
    // And enough failed authentications to be throttled (429 is a status of its own).
    for _ in 0..100 {
        app.send(request("GET", "/v1/files/file-x")).await;
    }
    let before = series();
    for n in 0..2000 {
        let answer = app.send(request(&format!("M{n}"), &format!("/p{n}/{n}"))).await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND);
        app.send(request(&format!("X{n}"), "/v1/files")).await;
        app.send(request("GET", &format!("/v1/files/file-{n}"))).await;
    }
    assert_eq!(series(), before, "6,000 invented requests added series");
}

#[tokio::test]
async fn a_path_id_that_is_not_utf8_gets_the_error_envelope() {
    let (_b, app) = app().await;
    for path in ["/v1/files/%FF", "/v1/files/%FF/content", "/v1/batches/%C3%28"] {
        app.get(path).await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    }
    app.delete("/v1/files/%FF").await.error(StatusCode::BAD_REQUEST, "invalid_request_error");
    let cancel = app.post_json("/v1/batches/%FF/cancel", serde_json::json!({})).await;
    cancel.error(StatusCode::BAD_REQUEST, "invalid_request_error");
}

#[tokio::test]
async fn cors_preflight_answers_before_routing_and_authentication() {
    let (_b, app) = app().await;
    let request = Request::builder()
        .method("OPTIONS")
        .uri("/v1/files")
        .header("origin", "http://example.test")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "x-api-key, x-project-id")
        .body(Body::empty())
        .unwrap();
    let answer = app.send(request).await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT, "the spec: 204, success with no body (CORS preflight)");
    assert_eq!(answer.headers["access-control-allow-origin"], "*");
    assert_eq!(answer.headers["access-control-max-age"], "86400");
    assert!(answer.headers["access-control-allow-methods"].to_str().unwrap().contains("DELETE"));
    assert!(answer.headers["access-control-allow-headers"].to_str().unwrap().contains("x-project-id"));
    assert!(answer.headers.contains_key("x-request-id"));
    assert!(answer.body.is_empty());
    // An actual request from a page: its answer, error or not, is readable by the page.
    let request = Request::builder().uri("/v1/files").header("origin", "http://example.test").body(Body::empty());
    let answer = app.send(request.unwrap()).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.headers["access-control-allow-origin"], "*");
    assert_eq!(answer.headers["access-control-expose-headers"], "x-request-id");
}

/// A store whose every call fails, with a detail that must never reach a client.
struct BrokenStore;

fn broken() -> StorageError {
    StorageError::Backend("connection refused to secret-bucket.internal:9000".into())
}

#[async_trait]
impl ObjectStore for BrokenStore {
    async fn writer(&self, _: &Key) -> Result<Box<dyn ObjectWriter>, StorageError> {
        Err(broken())
    }
    async fn read(&self, _: &Key, _: Option<std::ops::Range<u64>>) -> Result<ByteStream, StorageError> {
        Err(broken())
    }
    async fn size(&self, _: &Key) -> Result<Option<u64>, StorageError> {
        Err(broken())
    }
    async fn delete(&self, _: &Key) -> Result<(), StorageError> {
        Err(broken())
    }
    async fn list(&self, _: &str) -> Result<Vec<Key>, StorageError> {
        Err(broken())
    }
}

#[tokio::test]
async fn storage_failures_are_500_storage_error_without_internal_details() {
    let (_backend, batch_objects) = Backend::dir().await;
    let app = TestApp::with_batch_objects(Arc::new(BrokenStore), batch_objects).await;
    let answers = [
        app.get("/v1/files").await,
        app.get("/v1/files/file-01ARZ3NDEKTSV4RRFFQ69G5FAV").await,
        app.send(upload(Form::new().text("purpose", "batch").file("file", "a.jsonl", LINES))).await,
    ];
    for answer in answers {
        let error = answer.error(StatusCode::INTERNAL_SERVER_ERROR, "storage_error");
        assert_eq!(error["type"], "internal_error");
        assert!(!String::from_utf8_lossy(&answer.body).contains("secret-bucket"), "leaked: {error}");
    }
}

#[tokio::test]
async fn the_whole_file_cycle_works_over_s3() {
    let (_backend, store) = Backend::s3().await;
    let app = TestApp::new(store).await;
    // Bigger than one multipart part, so the upload goes out in parts.
    let content = "{\"custom_id\":\"x\",\"pad\":\"............................................\"}\n".repeat(200_000);
    let id = app.upload("big.jsonl", content.as_bytes()).await["id"].as_str().unwrap().to_owned();
    assert_eq!(app.get(&format!("/v1/files/{id}")).await.json()["bytes"], content.len());
    assert!(app.get(&format!("/v1/files/{id}/content")).await.body == content.as_bytes());
    assert_eq!(app.get("/v1/files").await.json()["data"][0]["id"], id);
    assert_eq!(app.delete(&format!("/v1/files/{id}")).await.status, StatusCode::OK);
    app.get(&format!("/v1/files/{id}")).await.error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(app.files.collect_garbage(nightshift::clock::now(), &Default::default()).await.unwrap(), 1);
    assert!(app.store.list("file-").await.unwrap().is_empty());
}

/// `expires_after` on upload: reflected in `expires_at` and enforced by the collector;
/// refused with OpenAI's codes when malformed, leaving no file behind.
#[tokio::test]
async fn expires_after_sets_expires_at_and_bad_values_get_openais_errors() {
    let (_b, app) = app().await;
    let form = Form::new()
        .text("purpose", "batch")
        .text("expires_after[anchor]", "created_at")
        .text("expires_after[seconds]", "3600")
        .file("file", "soon.jsonl", LINES);
    let soon = app.send(form.request(TestApp::request("POST", "/v1/files"))).await.json();
    assert_eq!(soon["expires_at"].as_i64().unwrap(), soon["created_at"].as_i64().unwrap() + 3600, "{soon}");
    let default = app.upload("default.jsonl", LINES).await;
    assert_eq!(default["expires_at"].as_i64().unwrap(), default["created_at"].as_i64().unwrap() + 30 * 86_400);

    let in_an_hour = nightshift::clock::now() + 3601;
    assert_eq!(app.files.collect_garbage(in_an_hour, &Default::default()).await.unwrap(), 1);
    app.get(&format!("/v1/files/{}", soon["id"].as_str().unwrap()))
        .await
        .error(StatusCode::NOT_FOUND, "file_not_found");
    assert_eq!(app.get(&format!("/v1/files/{}", default["id"].as_str().unwrap())).await.status, StatusCode::OK);

    for (anchor, seconds, code, param) in [
        (Some("created_at"), Some("59"), "integer_below_min_value", "expires_after.seconds"),
        (Some("created_at"), Some("2592001"), "integer_above_max_value", "expires_after.seconds"),
        (Some("created_at"), Some("an hour"), "invalid_type", "expires_after.seconds"),
        (Some("created_at"), None, "missing_required_parameter", "expires_after.seconds"),
        (Some("last_active_at"), Some("3600"), "invalid_value", "expires_after.anchor"),
        (None, Some("3600"), "missing_required_parameter", "expires_after.anchor"),
    ] {
        let mut form = Form::new().text("purpose", "batch");
        if let Some(anchor) = anchor {
            form = form.text("expires_after[anchor]", anchor);
        }
        if let Some(seconds) = seconds {
            form = form.text("expires_after[seconds]", seconds);
        }
        let answer =
            app.send(form.file("file", "bad.jsonl", LINES).request(TestApp::request("POST", "/v1/files"))).await;
        let error = answer.error(StatusCode::BAD_REQUEST, code);
        assert_eq!(error["param"], param, "{error}");
    }
    assert_eq!(app.store.list("file-data/").await.unwrap().len(), 1, "refused uploads leave nothing");
}
