//! A webhook receiver to point Nightshift at: it records every delivery (headers and
//! body) and can be told to refuse the next ones.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

#[derive(Clone, Debug)]
pub struct Delivery {
    pub id: String,
    pub timestamp: String,
    pub signature: String,
    pub body: Bytes,
}

impl Delivery {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

#[derive(Default)]
struct Shared {
    /// Every request, refused ones too.
    received: Mutex<Vec<Delivery>>,
    refuse: AtomicU32,
}

pub struct Receiver {
    /// The URL to configure (`.../hook`).
    pub url: String,
    shared: Arc<Shared>,
    _server: tokio::task::JoinHandle<()>,
}

async fn hook(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let delivery = Delivery {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body,
    };
    shared.received.lock().unwrap().push(delivery);
    let refused = shared.refuse.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
    if refused { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::NO_CONTENT }
}

impl Receiver {
    pub async fn start() -> Self {
        let shared = Arc::new(Shared::default());
        let app = Router::new().route("/hook", post(hook)).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url: format!("http://{address}/hook"), shared, _server: server }
    }

    /// Answers the next `n` deliveries 503.
    pub fn refuse(&self, n: u32) {
        self.shared.refuse.store(n, Ordering::SeqCst);
    }

    pub fn received(&self) -> Vec<Delivery> {
        self.shared.received.lock().unwrap().clone()
    }

    /// Waits until `n` requests came (or panics after `seconds`).
    pub async fn wait_for(&self, n: usize, seconds: u64) -> Vec<Delivery> {
        for _ in 0..seconds * 10 {
            let received = self.received();
            if received.len() >= n {
                return received;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("{n} webhook requests expected within {seconds}s, got {:?}", self.received());
    }
}
