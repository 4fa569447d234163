//! The lines of the output and error files, exactly as jsonl-format.txt shapes them.

use serde::Serialize;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::failure::LineFailure;
use crate::ids::{BatchId, LineId};

/// The line's `batch_req_` id: derived from the batch and the request's position, so
/// it is the same on every retry, restart and re-run of the line.
pub fn line_id(batch: &BatchId, ordinal: u64) -> LineId {
    let digest = Sha256::new().chain_update(batch.as_str()).chain_update(ordinal.to_be_bytes()).finalize();
    LineId::from_stored(format!("{}{}", LineId::PREFIX, hex::encode(&digest[..16])))
}

#[derive(Serialize)]
struct OutputRecord<'a> {
    id: &'a str,
    custom_id: &'a str,
    response: Response<'a>,
}

#[derive(Serialize)]
struct Response<'a> {
    status_code: u16,
    request_id: Option<&'a str>,
    body: &'a RawValue,
}

#[derive(Serialize)]
struct ErrorRecord<'a> {
    id: &'a str,
    custom_id: &'a str,
    response: Option<()>,
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: &'a str,
    param: Option<&'a str>,
}

/// An output line (2xx), newline-terminated. `body` is the upstream's JSON, verbatim.
pub fn output_line(id: &LineId, custom_id: &str, status: u16, request_id: Option<&str>, body: &RawValue) -> Vec<u8> {
    let mut line = Vec::new();
    write_output_line(&mut line, id, custom_id, status, request_id, body);
    line
}

/// As [`output_line`], appended to `into` (a chunk's buffer) without a copy between.
pub fn write_output_line(
    into: &mut Vec<u8>,
    id: &LineId,
    custom_id: &str,
    status: u16,
    request_id: Option<&str>,
    body: &RawValue,
) {
    let record =
        OutputRecord { id: id.as_str(), custom_id, response: Response { status_code: status, request_id, body } };
    serde_json::to_writer(&mut *into, &record).expect("records serialize");
    into.push(b'\n');
}

/// An error line, newline-terminated.
pub fn error_line(id: &LineId, custom_id: &str, failure: &LineFailure) -> Vec<u8> {
    let record = ErrorRecord {
        id: id.as_str(),
        custom_id,
        response: None,
        error: ErrorBody { code: failure.code.as_str(), message: &failure.message, param: failure.param.as_deref() },
    };
    let mut line = serde_json::to_vec(&record).expect("records serialize");
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::exec::failure::FailureCode;

    #[test]
    fn line_ids_are_stable_and_distinct() {
        let batch = BatchId::parse("batch_01HZX").unwrap();
        assert_eq!(line_id(&batch, 7), line_id(&batch, 7));
        assert_ne!(line_id(&batch, 7), line_id(&batch, 8));
        assert_ne!(line_id(&batch, 7), line_id(&BatchId::parse("batch_01HZY").unwrap(), 7));
        assert!(line_id(&batch, 0).as_str().starts_with("batch_req_"));
    }

    #[test]
    fn records_have_exactly_the_specs_shape() {
        let id = LineId::from_stored("batch_req_a".into());
        let body = RawValue::from_string(r#"{"id":"chatcmpl-1","object":"chat.completion"}"#.into()).unwrap();
        let output: Value = serde_json::from_slice(&output_line(&id, "req-1", 200, Some("req_xyz"), &body)).unwrap();
        assert_eq!(
            output,
            json!({"id": "batch_req_a", "custom_id": "req-1",
                   "response": {"status_code": 200, "request_id": "req_xyz", "body": {"id": "chatcmpl-1", "object": "chat.completion"}}})
        );
        let failure = LineFailure {
            code: FailureCode::InternalError,
            message: "[legacy:retries_exhausted] x".into(),
            param: None,
        };
        let error: Value = serde_json::from_slice(&error_line(&id, "req-5", &failure)).unwrap();
        assert_eq!(
            error,
            json!({"id": "batch_req_a", "custom_id": "req-5", "response": null,
                   "error": {"code": "internal_error", "message": "[legacy:retries_exhausted] x", "param": null}})
        );
    }
}
