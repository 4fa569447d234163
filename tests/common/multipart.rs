//! A multipart/form-data body built by hand, so tests can also build broken ones.

use axum::body::Body;
use axum::http::Request;
use axum::http::request::Builder;

pub const BOUNDARY: &str = "nightshift-test-boundary";

#[derive(Default)]
pub struct Form {
    body: Vec<u8>,
}

impl Form {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn text(mut self, name: &str, value: &str) -> Self {
        self.body.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
        self
    }

    pub fn file(mut self, name: &str, filename: &str, content: &[u8]) -> Self {
        self.body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n\
                 Content-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        self.body.extend_from_slice(content);
        self.body.extend_from_slice(b"\r\n");
        self
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
        self.body
    }

    pub fn request(self, builder: Builder) -> Request<Body> {
        builder
            .header("content-type", format!("multipart/form-data; boundary={BOUNDARY}"))
            .body(Body::from(self.finish()))
            .unwrap()
    }
}
