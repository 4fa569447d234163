//! Answers to requests that never reach the router, in the API's envelope. hyper answers
//! an HTTP/1.1 head it cannot parse by itself, with an empty body and no request id:
//! 400 for what is not HTTP (a TLS ClientHello), 414 for a URL too long, 431 for more
//! than [`MAX_HEADERS`] headers or a head over hyper's buffer. The connection's IO is
//! wrapped, and that answer, written when no request of ours is in progress, is replaced
//! by the same status with the envelope and an `x-request-id`. hyper closes the
//! connection after it, so nothing else is written.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::idle::Activity;
use crate::api::error::{ApiError, ErrorType};
use crate::api::middleware::REQUEST_ID_HEADER;
use crate::ids::RequestId;

/// The most headers a request may have (hyper's limit, named here for the message).
pub const MAX_HEADERS: usize = 100;

/// A connection's IO, with hyper's parse-error answers replaced.
pub struct Enveloped<T> {
    inner: T,
    activity: Arc<Activity>,
    /// Our answer being written in place of hyper's: its bytes, how many are written,
    /// and the length of hyper's, reported as written once ours is.
    replacing: Option<(Vec<u8>, usize, usize)>,
}

impl<T> Enveloped<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        Self { inner, activity, replacing: None }
    }
}

impl<T: AsyncWrite + Unpin> Enveloped<T> {
    /// Writes what is left of the replacement; ready with hyper's length once done.
    fn poll_replacing(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        while let Some((answer, written, reported)) = &mut self.replacing {
            if *written == answer.len() {
                let reported = *reported;
                self.replacing = None;
                return Poll::Ready(Ok(reported));
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &answer[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        unreachable!("called while replacing")
    }

    /// Starts replacing `first` (all that hyper writes now being `total` bytes) if it
    /// is hyper's own answer.
    fn intercept(&mut self, first: &[u8], total: usize) -> bool {
        if self.replacing.is_some() || self.activity.is_busy() {
            return self.replacing.is_some();
        }
        match envelope_for(first) {
            Some(answer) => {
                self.replacing = Some((answer, 0, total));
                true
            }
            None => false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Enveloped<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Enveloped<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.intercept(buf, buf.len()) {
            return self.poll_replacing(cx);
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's answer is a head alone: the first slice, with nothing after it.
        let first = bufs.iter().find(|slice| !slice.is_empty()).map_or(&[][..], |slice| &slice[..]);
        let total = bufs.iter().map(|slice| slice.len()).sum();
        if first.len() == total && self.intercept(first, total) {
            return self.poll_replacing(cx);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.replacing.is_some() {
            ready!(self.poll_replacing(cx))?;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.replacing.is_some() {
            ready!(self.poll_replacing(cx))?;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Our answer in place of `written`, if `written` is hyper's answer to a head it could not
/// parse: a whole head of one of its statuses, with no body and no request id (every
/// answer of the router has one).
fn envelope_for(written: &[u8]) -> Option<Vec<u8>> {
    let rest = written.strip_prefix(b"HTTP/1.1 ")?;
    let error = match rest.get(..3)? {
        b"400" => ApiError::bad_request(
            "invalid_http_request",
            "The request could not be read as HTTP/1.1 or HTTP/2 (this port does not speak TLS)",
        ),
        b"414" => ApiError::new(
            StatusCode::URI_TOO_LONG,
            ErrorType::InvalidRequestError,
            Some("url_too_long"),
            "The request's URL is too long",
        ),
        b"431" => ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorType::InvalidRequestError,
            Some("headers_too_large"),
            format!(
                "The request's headers are too large: at most {MAX_HEADERS} headers, and the URL and headers together at most about 400 KB"
            ),
        ),
        _ => return None,
    };
    let head = std::str::from_utf8(written).ok()?.strip_suffix("\r\n\r\n")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let mut others = Vec::new();
    let mut empty_body = false;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        if name.eq_ignore_ascii_case(REQUEST_ID_HEADER.as_str()) {
            return None;
        }
        if name.eq_ignore_ascii_case("content-length") {
            empty_body = value.trim() == "0";
        } else if !name.eq_ignore_ascii_case("connection") {
            others.push(line);
        }
    }
    if !empty_body {
        return None;
    }
    let id = RequestId::generate();
    tracing::info!(request_id = %id, status = error.status.as_u16(), "answered a request that could not be parsed");
    let body = error.envelope_json();
    let mut answer = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}: {id}\r\nconnection: close\r\n",
        body.len(),
        REQUEST_ID_HEADER.as_str(),
        id = id.as_str(),
    );
    for line in others {
        answer.push_str(line);
        answer.push_str("\r\n");
    }
    answer.push_str("\r\n");
    let mut answer = answer.into_bytes();
    answer.extend_from_slice(&body);
    Some(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(written: &str) -> Option<String> {
        envelope_for(written.as_bytes()).map(|bytes| String::from_utf8(bytes).unwrap())
    }

    #[test]
    fn hypers_own_answers_get_the_envelope_and_a_request_id() {
        let date = "date: Wed, 25 Nov 2026 16:00:00 GMT";
        for (status, code) in [
            ("400 Bad Request", "invalid_http_request"),
            ("414 URI Too Long", "url_too_long"),
            ("431 Request Header Fields Too Large", "headers_too_large"),
        ] {
            let written = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n{date}\r\n\r\n");
            let answer = answer(&written).unwrap();
            let (head, body) = answer.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with(&format!("HTTP/1.1 {status}\r\n")), "{head}");
            assert!(head.contains("\r\nx-request-id: req_"), "{head}");
            assert!(head.contains(date), "hyper's other headers stay: {head}");
            assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
            let body: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(body["error"]["code"], code);
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn answers_of_the_router_and_anything_else_are_left_alone() {
        for written in [
            // Ours: a request id, or a body.
            "HTTP/1.1 400 Bad Request\r\nx-request-id: req_1\r\ncontent-length: 0\r\n\r\n",
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n",
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{\"error\":{}}",
            // Other statuses, part of a head, a body's bytes, HTTP/2 frames.
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n",
            "{\"data\": []}",
            "\0\0\x12\x04\0\0\0\0\0",
        ] {
            assert_eq!(answer(written), None, "{written:?}");
        }
    }
}
