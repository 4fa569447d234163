//! Clients that stall or idle can't hold `nightshift serve`: each kind is cut off in
//! bounded time (`http` in the configuration, lowered here to a second), and other
//! clients are served meanwhile, also with every connection slot taken.

mod common;

use std::time::{Duration, Instant};

use common::process::{Process, spawn};
use common::{KEY, PROJECT, write_config};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: &str = "http: {header_timeout: 1s, body_idle_timeout: 1s, max_connections: 4, max_uploads: 1}\n";

fn serve(dir: &TempDir) -> (Process, String) {
    let config = write_config(dir.path(), LIMITS);
    let data = dir.path().join("data").display().to_string();
    let args = ["serve", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0", "--data-dir", &data];
    let (process, line) = spawn(&args, &[], "listening on", &dir.path().join("serve.log"));
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_owned();
    (process, url.trim_start_matches("http://").to_owned())
}

/// Reads until the server closes the connection; returns what it sent and when it closed.
async fn until_closed(stream: &mut TcpStream, within: Duration) -> (String, Duration) {
    let started = Instant::now();
    let mut received = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "still open after {within:?}: {}", String::from_utf8_lossy(&received));
    (String::from_utf8_lossy(&received).into_owned(), started.elapsed())
}

async fn healthy(address: &str) -> Duration {
    let started = Instant::now();
    let response = reqwest::get(format!("http://{address}/healthz")).await.unwrap();
    assert_eq!(response.status(), 200);
    started.elapsed()
}

const UPLOAD_HEAD: &str = "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n";

fn upload_head(address: &str, length: usize) -> String {
    format!(
        "{UPLOAD_HEAD}x-project-id: {PROJECT}\r\nx-api-key: {KEY}\r\nHost: {address}\r\nContent-Length: {length}\r\n\r\n"
    )
}

#[tokio::test]
async fn headers_dripped_or_never_finished_are_cut_off() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut half = TcpStream::connect(&address).await.unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let mut drip = TcpStream::connect(&address).await.unwrap();
    let dripping = tokio::spawn(async move {
        // One header line every 400 ms: each arrives in time, the whole never does.
        for n in 0..20 {
            if drip.write_all(format!("X-Drip-{n}: 1\r\n").as_bytes()).await.is_err() {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        20
    });
    assert!(healthy(&address).await < Duration::from_secs(1), "others are served meanwhile, before any cut-off");
    let (_, after) = until_closed(&mut half, Duration::from_secs(5)).await;
    eprintln!("[slow] half-sent headers closed after {after:?}");
    let lines = dripping.await.unwrap();
    assert!(lines < 10, "the dripping client was cut off after {lines} header lines");
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut idle = TcpStream::connect(&address).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let (received, after) = until_closed(&mut idle, Duration::from_secs(5)).await;
    assert!(received.starts_with("HTTP/1.1 200"), "{received}");
    eprintln!("[slow] an idle kept-alive connection closed {after:?} after its request");
}

#[tokio::test]
async fn a_stalled_upload_is_cut_off_and_leaves_no_file() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut stalled = TcpStream::connect(&address).await.unwrap();
    stalled.write_all(upload_head(&address, 100_000).as_bytes()).await.unwrap();
    stalled.write_all(b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n").await.unwrap();
    // Time for the server to read the first's headers and take the only upload slot: a
    // second upload that came first would take it instead (and the first get the 429).
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A second upload while the first holds the only slot: told to come back.
    let second = || {
        reqwest::Client::new()
            .post(format!("http://{address}/v1/files"))
            .header("x-project-id", PROJECT)
            .header("x-api-key", KEY)
            .header("content-type", "multipart/form-data; boundary=b")
            .body("--b--\r\n")
            .send()
    };
    let mut busy = second().await.unwrap();
    for _ in 0..25 {
        if busy.status() == 429 {
            break;
        }
        assert_eq!(busy.status(), 400, "the first upload is not read yet: the second one is, and is empty");
        tokio::time::sleep(Duration::from_millis(20)).await;
        busy = second().await.unwrap();
    }
    assert_eq!(busy.status(), 429, "the stalled upload never held the upload slot");
    assert_eq!(busy.headers()["retry-after"], "1");
    let error: serde_json::Value = busy.json().await.unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");

    let (received, after) = until_closed(&mut stalled, Duration::from_secs(5)).await;
    eprintln!(
        "[slow] a stalled upload was answered and closed after {after:?}: {}",
        received.lines().next().unwrap_or("")
    );
    assert!(received.starts_with("HTTP/1.1 408"), "{received}");
    assert!(received.contains(r#""code":"request_timeout""#), "{received}");
    let files = reqwest::Client::new()
        .get(format!("http://{address}/v1/files"))
        .header("x-project-id", PROJECT)
        .header("x-api-key", KEY)
        .send()
        .await
        .unwrap();
    let files: serde_json::Value = files.json().await.unwrap();
    assert_eq!(files["data"], serde_json::json!([]), "no file appeared");
    let temp = std::fs::read_dir(dir.path().join("data").join(".tmp")).unwrap().count();
    assert_eq!(temp, 0, "no temp file is left");
}

#[tokio::test]
async fn with_every_connection_slot_held_by_stalled_clients_a_new_client_is_served() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        stalled.push(stream);
    }
    let waited = healthy(&address).await;
    eprintln!("[slow] with 4 of 4 connections stalled, a new client was served after {waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}
