//! Clients that stall, idle or misbehave can't hold `nightshift serve`: each kind is cut
//! off in bounded time (`http` in the configuration, lowered here to a second), other
//! clients are served meanwhile, also with every connection slot taken, one client can't
//! take every slot, and what the server answers before routing is the API's envelope.

use crate::common;

use std::time::{Duration, Instant};

use common::process::{Process, spawn};
use common::{KEY, PROJECT, write_config};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: &str = "http: {header_timeout: 1s, body_idle_timeout: 1s, max_connections: 4, max_uploads: 1}\n";

fn serve(dir: &TempDir) -> (Process, String) {
    serve_with(dir, LIMITS)
}

fn serve_with(dir: &TempDir, limits: &str) -> (Process, String) {
    let config = write_config(dir.path(), limits);
    let data = dir.path().join("data").display().to_string();
    let args = [
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--data-dir",
        &data,
    ];
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

#[tokio::test]
async fn a_connection_that_never_speaks_is_closed_at_the_header_deadline() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut silent = TcpStream::connect(&address).await.unwrap();
    let (received, after) = until_closed(&mut silent, Duration::from_secs(5)).await;
    eprintln!("[slow] a silent connection closed after {after:?}");
    assert_eq!(received, "", "nothing to answer");
    assert!(after >= Duration::from_millis(900), "not before the deadline: {after:?}");
}

/// An HTTP/2 frame: its 9-byte header, then `payload`.
fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let length = (payload.len() as u32).to_be_bytes();
    let mut frame = vec![length[1], length[2], length[3], kind, flags, 0, 0, 0, 0];
    frame.extend_from_slice(payload);
    frame
}

#[tokio::test]
async fn an_http2_connection_with_no_streams_is_closed_though_it_answers_pings() {
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const GOAWAY: u8 = 7;
    const ACK: u8 = 1;
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let mut h2 = TcpStream::connect(&address).await.unwrap();
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    h2.write_all(&frame(SETTINGS, 0, &[])).await.unwrap();
    let started = Instant::now();
    let (mut pings, mut goaway) = (0, false);
    let talk = async {
        loop {
            let mut header = [0u8; 9];
            if h2.read_exact(&mut header).await.is_err() {
                return;
            }
            let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let mut payload = vec![0u8; length];
            if h2.read_exact(&mut payload).await.is_err() {
                return;
            }
            let answer = match (header[3], header[4] & ACK) {
                (SETTINGS, 0) => frame(SETTINGS, ACK, &[]),
                (PING, 0) => {
                    pings += 1;
                    frame(PING, ACK, &payload)
                }
                (GOAWAY, _) => {
                    goaway = true;
                    continue;
                }
                _ => continue,
            };
            if h2.write_all(&answer).await.is_err() {
                return;
            }
        }
    };
    let closed = tokio::time::timeout(Duration::from_secs(6), talk).await;
    eprintln!(
        "[slow] an HTTP/2 connection with no streams closed after {:?} ({pings} pings answered, goaway: {goaway})",
        started.elapsed()
    );
    assert!(closed.is_ok(), "still open after 6 s, {pings} pings answered");
}

/// A connection to `address` from the loopback address `from` (any of 127.0.0.0/8).
async fn connect_from(from: &str, address: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(address.parse().unwrap()).await.unwrap()
}

#[tokio::test]
async fn one_client_cannot_hold_every_connection_slot() {
    let dir = TempDir::new().unwrap();
    let limits = "http: {header_timeout: 30s, max_connections: 8, max_connections_per_client: 4}\n";
    let (_serve, address) = serve_with(&dir, limits);
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..8 {
        let mut stream = connect_from("127.0.0.2", &address).await;
        let mut byte = [0u8; 1];
        // A connection over the client's share is closed at once; one within it stays.
        match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await {
            Ok(Ok(0) | Err(_)) => refused += 1,
            Ok(Ok(_)) => panic!("the server spoke first"),
            Err(_) => held.push(stream),
        }
    }
    assert_eq!((held.len(), refused), (4, 4), "the client holds its share, and no more");
    let waited = tokio::time::timeout(Duration::from_secs(3), healthy(&address)).await;
    assert!(waited.is_ok(), "another client is served while the first holds its share of silent connections");
}

/// Sends `request` and reads the answer until the server closes the connection.
async fn answer_to(address: &str, request: Vec<u8>) -> String {
    let stream = TcpStream::connect(address).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    // The server may answer and close before it has read everything.
    let writing = tokio::spawn(async move {
        let _ = writer.write_all(&request).await;
        writer
    });
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut received)).await;
    drop(writing.await);
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn requests_hyper_cannot_parse_are_answered_in_the_envelope_with_a_request_id() {
    let dir = TempDir::new().unwrap();
    let (_serve, address) = serve(&dir);
    let many_headers: String = (0..101).map(|n| format!("x-header-{n}: {n}\r\n")).collect();
    let huge_header = format!("x-big: {}\r\n", "a".repeat(1 << 20));
    let long_url = format!("/v1/files/{}", "a".repeat(1 << 20));
    // The start of a TLS 1.2 ClientHello: a client that speaks TLS to a plain port.
    let mut client_hello = vec![0x16, 0x03, 0x01, 0x00, 0xa5, 0x01, 0x00, 0x00, 0xa1, 0x03, 0x03];
    client_hello.extend_from_slice(&[7u8; 160]);
    let cases: [(&str, Vec<u8>, &str, &str); 4] = [
        (
            "101 headers",
            format!("GET /healthz HTTP/1.1\r\nhost: x\r\n{many_headers}\r\n").into_bytes(),
            "431",
            "headers_too_large",
        ),
        (
            "a 1 MB header",
            format!("GET /healthz HTTP/1.1\r\nhost: x\r\n{huge_header}\r\n").into_bytes(),
            "431",
            "headers_too_large",
        ),
        ("a 1 MB URL", format!("GET {long_url} HTTP/1.1\r\nhost: x\r\n\r\n").into_bytes(), "431", "headers_too_large"),
        ("a TLS ClientHello", client_hello, "400", "invalid_http_request"),
    ];
    for (what, request, status, code) in cases {
        let answer = answer_to(&address, request).await;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{what}: {answer:?}"));
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{what}: {head}");
        assert!(head.to_ascii_lowercase().contains("\r\nx-request-id: req_"), "{what}: {head}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{what}: {body:?}"));
        assert_eq!(body["error"]["code"], code, "{what}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{what}: {body}");
    }
    // What hyper parses reaches the router, as before.
    assert!(healthy(&address).await < Duration::from_secs(1));
}

#[tokio::test]
async fn shutdown_cuts_a_download_whose_reader_stalls_after_its_timeout() {
    let dir = TempDir::new().unwrap();
    let (mut serve, address) = serve_with(&dir, "http: {shutdown_timeout: 1s}\n");
    let client = common::client::Client::new(&format!("http://{address}"), PROJECT, KEY);
    let ids = common::client::ids("line", 150_000);
    let file = client.upload(common::client::input(&ids, "echo")).await;
    let mut download = TcpStream::connect(&address).await.unwrap();
    let request = format!(
        "GET /v1/files/{file}/content HTTP/1.1\r\nhost: x\r\nx-project-id: {PROJECT}\r\nx-api-key: {KEY}\r\n\r\n"
    );
    download.write_all(request.as_bytes()).await.unwrap();
    let mut first = [0u8; 12];
    download.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200", "the download began");
    // The reader stops reading: the server's writes fill the socket's buffers and stall.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let terminated = std::process::Command::new("kill").args(["-TERM", &serve.0.id().to_string()]).status();
    assert!(terminated.unwrap().success());
    let stopped = Instant::now();
    let exited = loop {
        if let Some(status) = serve.0.try_wait().unwrap() {
            break Some(status);
        }
        if stopped.elapsed() > Duration::from_secs(10) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("[slow] with a stalled download, serve exited {:?} after SIGTERM", stopped.elapsed());
    assert!(exited.is_some(), "serve still running 10 s after SIGTERM, its shutdown_timeout being 1 s");
    drop(download);
}
