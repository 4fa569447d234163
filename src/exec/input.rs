//! Reading a shard's requests back from the input file: only its byte range, one
//! non-blank line at a time.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::storage::{ByteStream, StorageError};

/// The lines of a byte range, blank ones skipped.
pub struct RequestLines {
    stream: ByteStream,
    buffer: BytesMut,
    done: bool,
}

impl RequestLines {
    pub fn new(stream: ByteStream) -> Self {
        Self { stream, buffer: BytesMut::new(), done: false }
    }

    pub async fn next_line(&mut self) -> Result<Option<Bytes>, StorageError> {
        loop {
            if let Some(newline) = memchr::memchr(b'\n', &self.buffer) {
                let line = self.buffer.split_to(newline + 1).freeze().slice(..newline);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(line));
            }
            if self.done {
                let rest = self.buffer.split().freeze();
                return Ok((!rest.iter().all(u8::is_ascii_whitespace)).then_some(rest));
            }
            match self.stream.next().await {
                Some(chunk) => self.buffer.extend_from_slice(&chunk?),
                None => self.done = true,
            }
        }
    }
}

/// The parts of a validated request line that executing it needs.
pub struct Request {
    pub custom_id: String,
    pub model: String,
    /// The line's `body`, as the bytes it was written with.
    pub body: Bytes,
}

#[derive(Deserialize)]
struct Line<'a> {
    custom_id: String,
    #[serde(borrow)]
    body: &'a RawValue,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<serde_json::Value>,
}

/// Parses a request line. Lines were validated when the batch was created, so only a
/// file changed behind our back fails here; the caller records it as a failed line.
pub fn parse_request(line: &[u8]) -> Option<Request> {
    let parsed: Line<'_> = serde_json::from_slice(line).ok()?;
    let body: Body = serde_json::from_str(parsed.body.get()).ok()?;
    let model = match body.model {
        Some(serde_json::Value::String(model)) => model,
        _ => String::new(),
    };
    Some(Request { custom_id: parsed.custom_id, model, body: Bytes::copy_from_slice(parsed.body.get().as_bytes()) })
}

/// Just the custom_id, for records of lines that never run.
pub fn custom_id(line: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Id {
        custom_id: String,
    }
    serde_json::from_slice::<Id>(line).map(|id| id.custom_id).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use futures_util::stream;

    use super::*;

    #[tokio::test]
    async fn lines_split_across_chunks_and_blank_lines_are_skipped() {
        let chunks = vec!["{\"a\":1}\n\n  \n{\"b\"", ":2}\r\n", "\n{\"c\":3}"];
        let stream = stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from(c)))).boxed();
        let mut lines = RequestLines::new(stream);
        let mut seen = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            seen.push(String::from_utf8(line.to_vec()).unwrap());
        }
        assert_eq!(seen, ["{\"a\":1}", "{\"b\":2}\r", "{\"c\":3}"]);
    }

    #[test]
    fn requests_keep_their_body_bytes() {
        let line =
            br#"{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":{"model":"m", "messages":[]}}"#;
        let request = parse_request(line).unwrap();
        assert_eq!(request.custom_id, "x");
        assert_eq!(request.model, "m");
        assert_eq!(&request.body[..], br#"{"model":"m", "messages":[]}"#);
        assert_eq!(custom_id(line), "x");
        assert!(parse_request(b"[1]").is_none());
    }
}
