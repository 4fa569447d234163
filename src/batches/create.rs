//! `POST /v1/batches`: the request checks, and the settings a batch is created under
//! (the input lookup, its validation and the batch persisted: `crate::drive::create`).

use std::time::Duration;

use serde_json::{Map, Value};

use super::model::Batch;
use super::store::StoreError;
use crate::files::{ExpiresAfter, ExpiryError, expiry};
use crate::storage::StorageError;
use crate::validate::{Endpoints, InvalidInput};

/// The only completion window the API accepts and reports.
pub const COMPLETION_WINDOW: &str = "24h";
/// Metadata is stored with the batch (and in a custom resource on Kubernetes).
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

#[derive(Clone, Copy, Debug)]
pub struct BatchSettings {
    /// How long a batch may run; the API still says "24h".
    pub completion_window: Duration,
    pub shard_lines: u32,
    /// The endpoints batches may target (`batches.endpoints`).
    pub endpoints: Endpoints,
}

/// A create request whose fields passed the request checks.
#[derive(Clone, Debug, PartialEq)]
pub struct CreateBatch {
    pub input_file_id: String,
    pub endpoint: String,
    pub metadata: Map<String, Value>,
    /// When the output and error files expire, if not after the files' retention.
    pub output_expires_after: Option<ExpiresAfter>,
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The request itself is malformed (400).
    #[error("{message}")]
    Request { message: String, param: &'static str },
    /// 404 "Input file not found: <id>".
    #[error("Input file not found: {0}")]
    InputNotFound(String),
    /// 404 "Input file object missing: <id>": the record is there, the bytes are not.
    #[error("Input file object missing: {0}")]
    InputMissing(String),
    /// 400: the input is a file the service wrote (`batch_output`), not an upload.
    #[error("Input file {0} has purpose 'batch_output'; a batch's input must be a file uploaded with purpose 'batch'")]
    InputPurpose(String),
    /// The input failed validation; the batch was persisted as `failed`.
    #[error("{error}")]
    Invalid { error: InvalidInput, batch: Box<Batch> },
    /// A malformed `output_expires_after` (400, with OpenAI's code).
    #[error(transparent)]
    Expiry(#[from] ExpiryError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn required(body: &Map<String, Value>, field: &'static str) -> Result<String, CreateError> {
    match body.get(field) {
        Some(Value::String(value)) if !value.is_empty() => Ok(value.clone()),
        _ => Err(CreateError::Request { message: format!("{field} is required"), param: field }),
    }
}

impl CreateBatch {
    /// The request checks, in the spec's order.
    pub fn parse(body: &Value) -> Result<Self, CreateError> {
        let Value::Object(body) = body else {
            return Err(CreateError::Request {
                message: "The request body must be a JSON object".into(),
                param: "body",
            });
        };
        let input_file_id = required(body, "input_file_id")?;
        let endpoint = required(body, "endpoint")?;
        match body.get("completion_window") {
            None | Some(Value::Null) => {}
            Some(Value::String(window)) if window == COMPLETION_WINDOW => {}
            Some(_) => {
                return Err(CreateError::Request {
                    message: format!("completion_window must be \"{COMPLETION_WINDOW}\""),
                    param: "completion_window",
                });
            }
        }
        let metadata = match body.get("metadata") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(metadata)) => {
                let size = serde_json::to_vec(metadata).map(|json| json.len()).unwrap_or(usize::MAX);
                if size > MAX_METADATA_BYTES {
                    return Err(CreateError::Request {
                        message: format!("metadata must be at most {MAX_METADATA_BYTES} bytes of JSON, got {size}"),
                        param: "metadata",
                    });
                }
                metadata.clone()
            }
            Some(_) => {
                return Err(CreateError::Request {
                    message: "metadata must be a JSON object".into(),
                    param: "metadata",
                });
            }
        };
        let output_expires_after = expiry::from_json("output_expires_after", body.get("output_expires_after"))?;
        Ok(Self { input_file_id, endpoint, metadata, output_expires_after })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn message(body: Value) -> (String, &'static str) {
        match CreateBatch::parse(&body) {
            Err(CreateError::Request { message, param }) => (message, param),
            other => panic!("expected a request error, got {other:?}"),
        }
    }

    #[test]
    fn input_file_id_and_endpoint_are_required_strings() {
        let ok = json!({"input_file_id": "file-1", "endpoint": "/v1/chat/completions"});
        assert_eq!(CreateBatch::parse(&ok).unwrap().metadata, Map::new());
        for body in [
            json!({"endpoint": "/e"}),
            json!({"input_file_id": 5, "endpoint": "/e"}),
            json!({"input_file_id": "", "endpoint": "/e"}),
        ] {
            assert_eq!(message(body), ("input_file_id is required".into(), "input_file_id"));
        }
        for body in [json!({"input_file_id": "f"}), json!({"input_file_id": "f", "endpoint": null})] {
            assert_eq!(message(body), ("endpoint is required".into(), "endpoint"));
        }
    }

    #[test]
    fn completion_window_is_24h_or_absent() {
        let base = |window: Value| json!({"input_file_id": "f", "endpoint": "/e", "completion_window": window});
        assert!(CreateBatch::parse(&base(json!("24h"))).is_ok());
        assert!(CreateBatch::parse(&base(Value::Null)).is_ok());
        for window in [json!("48h"), json!(24), json!("24H"), json!("")] {
            assert_eq!(message(base(window)), ("completion_window must be \"24h\"".into(), "completion_window"));
        }
    }

    #[test]
    fn metadata_is_any_object_echoed_unchanged_and_bounded() {
        let metadata = json!({"job": "nightly", "nested": {"n": [1, 2.5, null, true]}, "ü": "✓"});
        let body = json!({"input_file_id": "f", "endpoint": "/e", "metadata": metadata});
        assert_eq!(Value::Object(CreateBatch::parse(&body).unwrap().metadata), metadata);
        for bad in [json!("text"), json!([1]), json!(3)] {
            let body = json!({"input_file_id": "f", "endpoint": "/e", "metadata": bad});
            assert_eq!(message(body), ("metadata must be a JSON object".into(), "metadata"));
        }
        let huge = json!({"input_file_id": "f", "endpoint": "/e", "metadata": {"k": "v".repeat(MAX_METADATA_BYTES)}});
        assert_eq!(message(huge).1, "metadata");
        assert_eq!(message(json!(["not", "an", "object"])).1, "body");
    }
}
