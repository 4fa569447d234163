//! A fault-injecting HTTP proxy between Nightshift and the S3 server (s3s-fs): every
//! request passes through unchanged (the Host header too, so signatures still hold)
//! until a fault is injected, for every request or only for those of a method whose
//! path contains a string. Faults: the connection closed without an answer (refused),
//! an S3 error status (`503 SlowDown`, `500 InternalError`), the answer reset halfway
//! through its body, or no answer at all (a stall). It counts what it injected.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The connection is closed without an answer.
    Refuse,
    /// An S3 error: 503 `SlowDown` or 500 `InternalError`.
    Status(u16),
    /// The server's answer, cut halfway through its body.
    ResetMidBody,
    /// No answer, ever.
    Stall,
}

pub const ALL: [Fault; 5] = [Fault::Refuse, Fault::Status(503), Fault::Status(500), Fault::ResetMidBody, Fault::Stall];

#[derive(Clone)]
struct Rule {
    fault: Fault,
    /// Only requests of one of these methods whose path contains this.
    only: Option<(Vec<String>, String)>,
}

type Body = BoxBody<Bytes, std::io::Error>;

pub struct FaultProxy {
    /// The endpoint to give Nightshift instead of the server's.
    pub endpoint: String,
    rule: Arc<Mutex<Option<Rule>>>,
    injected: Arc<AtomicU64>,
    _task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Proxies to `target` (`http://host:port`).
    pub async fn start(target: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let rule: Arc<Mutex<Option<Rule>>> = Arc::default();
        let injected = Arc::new(AtomicU64::new(0));
        let client = reqwest::Client::builder().build().unwrap();
        let target = target.trim_end_matches('/').to_owned();
        let (rules, counter) = (rule.clone(), injected.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (rules, counter, client, target) = (rules.clone(), counter.clone(), client.clone(), target.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let (rules, counter, client, target) =
                            (rules.clone(), counter.clone(), client.clone(), target.clone());
                        async move { handle(request, rules, counter, client, target).await }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Self { endpoint, rule, injected, _task: task }
    }

    /// Every request meets `fault` from now on.
    pub fn inject(&self, fault: Fault) {
        *self.rule.lock().unwrap() = Some(Rule { fault, only: None });
    }

    /// Requests of one of `methods` whose path contains `path` meet `fault` from now on.
    pub fn inject_where(&self, fault: Fault, methods: &[&str], path: &str) {
        let methods = methods.iter().map(|m| (*m).to_owned()).collect();
        *self.rule.lock().unwrap() = Some(Rule { fault, only: Some((methods, path.to_owned())) });
    }

    pub fn heal(&self) {
        *self.rule.lock().unwrap() = None;
    }

    /// Requests that met a fault so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }
}

async fn handle(
    request: Request<Incoming>,
    rules: Arc<Mutex<Option<Rule>>>,
    injected: Arc<AtomicU64>,
    client: reqwest::Client,
    target: String,
) -> Result<Response<Body>, std::io::Error> {
    let rule = rules.lock().unwrap().clone();
    let fault = rule
        .filter(|rule| {
            rule.only.as_ref().is_none_or(|(methods, path)| {
                methods.iter().any(|m| m == request.method().as_str()) && request.uri().path().contains(path.as_str())
            })
        })
        .map(|rule| rule.fault);
    if fault.is_some() {
        injected.fetch_add(1, Ordering::SeqCst);
    }
    match fault {
        Some(Fault::Refuse) => Err(std::io::Error::other("refused by the fault proxy")),
        Some(Fault::Stall) => std::future::pending().await,
        Some(Fault::Status(status)) => {
            let code = if status == 503 { "SlowDown" } else { "InternalError" };
            let xml = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>injected</Message></Error>"
            );
            Ok(Response::builder()
                .status(status)
                .header("content-type", "application/xml")
                .header("connection", "close")
                .body(full(Bytes::from(xml)))
                .unwrap())
        }
        Some(Fault::ResetMidBody) | None => {
            let response = forward(request, &client, &target).await?;
            if fault.is_none() {
                return Ok(response);
            }
            // Half the body (at least a byte short of it), then the connection breaks.
            let (parts, body) = response.into_parts();
            let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let half = bytes.slice(..bytes.len() / 2);
            let stream = futures_util::stream::iter([
                Ok(Frame::data(half)),
                Err(std::io::Error::other("reset by the fault proxy")),
            ]);
            let mut parts = parts;
            parts.headers.insert("content-length", bytes.len().max(1).to_string().parse().unwrap());
            Ok(Response::from_parts(parts, BodyExt::boxed(StreamBody::new(stream))))
        }
    }
}

async fn forward(
    request: Request<Incoming>,
    client: &reqwest::Client,
    target: &str,
) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = request.into_parts();
    let url = format!("{target}{}", parts.uri.path_and_query().map_or("/", |p| p.as_str()));
    let body = reqwest::Body::wrap_stream(body.into_data_stream());
    let answer = client
        .request(parts.method, url)
        .headers(parts.headers)
        .body(body)
        .send()
        .await
        .map_err(std::io::Error::other)?;
    let mut response = Response::builder().status(answer.status());
    for (name, value) in answer.headers() {
        response = response.header(name, value);
    }
    let stream = answer.bytes_stream().map(|chunk| chunk.map(Frame::data).map_err(std::io::Error::other));
    Ok(response.body(BodyExt::boxed(StreamBody::new(stream))).unwrap())
}

fn full(bytes: Bytes) -> Body {
    BodyExt::boxed(http_body_util::Full::new(bytes).map_err(|never: Infallible| match never {}))
}
