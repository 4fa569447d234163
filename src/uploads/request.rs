//! What `POST /v1/uploads` and `POST /v1/uploads/{id}/complete` send, parsed and checked
//! with OpenAI's error codes and wording.

use serde_json::{Map, Value};

use super::MAX_PARTS;
use crate::files::expiry::{self, kind};
use crate::files::{ExpiresAfter, ExpiryError, Purpose};
use crate::validate::MAX_FILE_BYTES;

/// A refused request (400), with the parameter it is about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub code: &'static str,
    pub message: String,
    pub param: String,
}

impl From<ExpiryError> for RequestError {
    fn from(error: ExpiryError) -> Self {
        Self { code: error.code, message: error.message, param: error.param }
    }
}

fn refuse(code: &'static str, param: &str, message: String) -> RequestError {
    RequestError { code, message, param: param.to_owned() }
}

fn missing(param: &str) -> RequestError {
    refuse("missing_required_parameter", param, format!("Missing required parameter: '{param}'."))
}

fn wrong_type(param: &str, expected: &str, got: &Value) -> RequestError {
    let message = format!("Invalid type for '{param}': expected {expected}, but got {} instead.", kind(got));
    refuse("invalid_type", param, message)
}

fn object(body: &Value) -> Result<&Map<String, Value>, RequestError> {
    match body {
        Value::Object(object) => Ok(object),
        other => Err(refuse(
            "invalid_request_error",
            "body",
            format!("The request body must be a JSON object, but got {} instead.", kind(other)),
        )),
    }
}

fn string<'a>(body: &'a Map<String, Value>, param: &str) -> Result<&'a str, RequestError> {
    match body.get(param) {
        None | Some(Value::Null) => Err(missing(param)),
        Some(Value::String(value)) if value.is_empty() => Err(refuse(
            "empty_string",
            param,
            format!(
                "Invalid '{param}': empty string. Expected a string with minimum length 1, but got an empty string instead."
            ),
        )),
        Some(Value::String(value)) => Ok(value),
        Some(other) => Err(wrong_type(param, "a string", other)),
    }
}

/// The longest filename kept (longer ones are cut, as on `POST /v1/files`).
const MAX_FILENAME_CHARS: usize = 255;

/// The media types of JSON Lines (and of the plain text it is), with or without
/// parameters such as `; charset=utf-8`.
const BATCH_MIME_TYPES: &[&str] = &[
    "application/jsonl",
    "application/x-jsonl",
    "application/jsonlines",
    "application/x-jsonlines",
    "application/x-ndjson",
    "application/json",
    "text/jsonl",
    "text/plain",
];

/// `POST /v1/uploads`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewUpload {
    pub filename: String,
    pub purpose: Purpose,
    pub bytes: u64,
    pub mime_type: String,
    /// For the file the upload becomes.
    pub expires_after: Option<ExpiresAfter>,
}

impl NewUpload {
    pub fn parse(body: &Value) -> Result<Self, RequestError> {
        let body = object(body)?;
        let bytes = match body.get("bytes") {
            None | Some(Value::Null) => return Err(missing("bytes")),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => n.as_i64().unwrap_or(i64::MAX),
            Some(other) => return Err(wrong_type("bytes", "an integer", other)),
        };
        if bytes < 1 {
            return Err(refuse(
                "integer_below_min_value",
                "bytes",
                format!(
                    "Invalid 'bytes': integer below minimum value. Expected a value >= 1, but got {bytes} instead."
                ),
            ));
        }
        let filename: String = string(body, "filename")?.chars().take(MAX_FILENAME_CHARS).collect();
        let purpose = match string(body, "purpose")? {
            "batch" => Purpose::Batch,
            other => {
                return Err(refuse(
                    "invalid_purpose",
                    "purpose",
                    format!("Invalid purpose {other:?}: the only purpose accepted for uploads is \"batch\""),
                ));
            }
        };
        let bytes = bytes as u64;
        if bytes > MAX_FILE_BYTES {
            return Err(refuse(
                "file_too_large",
                "bytes",
                format!(
                    "Invalid 'bytes': an upload for purpose \"batch\" may hold at most {MAX_FILE_BYTES} bytes (200 MB), but got {bytes}."
                ),
            ));
        }
        let mime_type = string(body, "mime_type")?;
        let essence = mime_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        if !BATCH_MIME_TYPES.contains(&essence.as_str()) {
            return Err(refuse(
                "invalid_value",
                "mime_type",
                format!(
                    "Invalid mime_type {mime_type:?} for purpose \"batch\": a batch input is JSON Lines, e.g. \"application/jsonl\" or \"text/jsonl\"."
                ),
            ));
        }
        let expires_after = expiry::from_json("expires_after", body.get("expires_after"))?;
        Ok(Self { filename, purpose, bytes, mime_type: mime_type.to_owned(), expires_after })
    }
}

/// `POST /v1/uploads/{id}/complete`: the parts in the order the file is made of, and
/// optionally the MD5 the whole must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompleteUpload {
    /// As sent: an id that names no part of the upload is refused when looked up.
    pub part_ids: Vec<String>,
    /// Lowercase hex.
    pub md5: Option<String>,
}

impl CompleteUpload {
    pub fn parse(body: &Value) -> Result<Self, RequestError> {
        let body = object(body)?;
        let ids = match body.get("part_ids") {
            None | Some(Value::Null) => return Err(missing("part_ids")),
            Some(Value::Array(ids)) => ids,
            Some(other) => return Err(wrong_type("part_ids", "an array", other)),
        };
        if ids.is_empty() {
            return Err(refuse(
                "empty_array",
                "part_ids",
                "Invalid 'part_ids': empty array. Expected an array with minimum length 1, but got an empty array instead."
                    .into(),
            ));
        }
        if ids.len() > MAX_PARTS {
            return Err(refuse(
                "array_above_max_length",
                "part_ids",
                format!(
                    "Invalid 'part_ids': array too long. Expected an array with maximum length {MAX_PARTS}, but got an array with length {} instead.",
                    ids.len()
                ),
            ));
        }
        let mut part_ids = Vec::with_capacity(ids.len());
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for (index, id) in ids.iter().enumerate() {
            let Value::String(id) = id else {
                return Err(wrong_type(&format!("part_ids[{index}]"), "a string", id));
            };
            if !seen.insert(id.as_str()) {
                return Err(refuse(
                    "duplicate_part_id",
                    "part_ids",
                    format!("Invalid 'part_ids': part {id} is listed more than once."),
                ));
            }
            part_ids.push(id.clone());
        }
        let md5 = match body.get("md5") {
            None | Some(Value::Null) => None,
            Some(Value::String(md5)) if md5.len() == 32 && md5.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Some(md5.to_ascii_lowercase())
            }
            Some(Value::String(md5)) => {
                return Err(refuse(
                    "invalid_value",
                    "md5",
                    format!("Invalid 'md5': {md5:?} is not an MD5 checksum (32 hexadecimal digits)."),
                ));
            }
            Some(other) => return Err(wrong_type("md5", "a string", other)),
        };
        Ok(Self { part_ids, md5 })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn create(body: Value) -> Result<NewUpload, (String, &'static str)> {
        NewUpload::parse(&body).map_err(|error| (error.param, error.code))
    }

    #[test]
    fn an_upload_names_its_size_name_purpose_and_type() {
        let body = json!({"bytes": 150_000_000, "filename": "big.jsonl", "purpose": "batch", "mime_type": "application/jsonl; charset=utf-8"});
        let upload = NewUpload::parse(&body).unwrap();
        assert_eq!(
            (upload.bytes, upload.filename.as_str(), upload.purpose),
            (150_000_000, "big.jsonl", Purpose::Batch)
        );
        assert_eq!(upload.expires_after, None);
        let body = json!({"bytes": 1, "filename": "a", "purpose": "batch", "mime_type": "text/jsonl",
            "expires_after": {"anchor": "created_at", "seconds": 3600}});
        assert_eq!(NewUpload::parse(&body).unwrap().expires_after, Some(ExpiresAfter { seconds: 3600 }));
    }

    #[test]
    fn bad_creates_name_the_parameter_at_fault() {
        let ok = json!({"bytes": 10, "filename": "a.jsonl", "purpose": "batch", "mime_type": "application/jsonl"});
        let with = |field: &str, value: Value| {
            let mut body = ok.clone();
            body[field] = value;
            body
        };
        let without = |field: &str| {
            let mut body = ok.clone();
            body.as_object_mut().unwrap().remove(field);
            body
        };
        let cases = [
            (json!([1]), ("body", "invalid_request_error")),
            (without("bytes"), ("bytes", "missing_required_parameter")),
            (with("bytes", json!("10")), ("bytes", "invalid_type")),
            (with("bytes", json!(1.5)), ("bytes", "invalid_type")),
            (with("bytes", json!(0)), ("bytes", "integer_below_min_value")),
            (with("bytes", json!(-4)), ("bytes", "integer_below_min_value")),
            (with("bytes", json!(MAX_FILE_BYTES + 1)), ("bytes", "file_too_large")),
            (with("bytes", json!(u64::MAX)), ("bytes", "file_too_large")),
            (without("filename"), ("filename", "missing_required_parameter")),
            (with("filename", json!("")), ("filename", "empty_string")),
            (with("filename", json!(7)), ("filename", "invalid_type")),
            (without("purpose"), ("purpose", "missing_required_parameter")),
            (with("purpose", json!("fine-tune")), ("purpose", "invalid_purpose")),
            (without("mime_type"), ("mime_type", "missing_required_parameter")),
            (with("mime_type", json!("image/png")), ("mime_type", "invalid_value")),
            (
                with("expires_after", json!({"anchor": "created_at", "seconds": 60})),
                ("expires_after.seconds", "integer_below_min_value"),
            ),
            (with("expires_after", json!("soon")), ("expires_after", "invalid_type")),
        ];
        for (body, (param, code)) in cases {
            assert_eq!(create(body.clone()), Err((param.to_owned(), code)), "{body}");
        }
        assert_eq!(create(with("bytes", json!(MAX_FILE_BYTES))).map(|u| u.bytes), Ok(MAX_FILE_BYTES));
    }

    #[test]
    fn a_completion_lists_distinct_parts_and_perhaps_an_md5() {
        let complete = |body: Value| CompleteUpload::parse(&body).map_err(|error| (error.param, error.code));
        let parsed = complete(json!({"part_ids": ["part_b", "part_a"], "md5": "0123456789ABCDEF0123456789abcdef"}));
        assert_eq!(
            parsed,
            Ok(CompleteUpload {
                part_ids: vec!["part_b".into(), "part_a".into()],
                md5: Some("0123456789abcdef0123456789abcdef".into())
            })
        );
        let cases = [
            (json!({}), ("part_ids", "missing_required_parameter")),
            (json!({"part_ids": "part_a"}), ("part_ids", "invalid_type")),
            (json!({"part_ids": []}), ("part_ids", "empty_array")),
            (json!({"part_ids": ["part_a", 3]}), ("part_ids[1]", "invalid_type")),
            (json!({"part_ids": ["part_a", "part_a"]}), ("part_ids", "duplicate_part_id")),
            (json!({"part_ids": ["part_a"], "md5": "abc"}), ("md5", "invalid_value")),
            (json!({"part_ids": ["part_a"], "md5": "z".repeat(32)}), ("md5", "invalid_value")),
            (json!({"part_ids": ["part_a"], "md5": 5}), ("md5", "invalid_type")),
        ];
        for (body, (param, code)) in cases {
            assert_eq!(complete(body.clone()), Err((param.to_owned(), code)), "{body}");
        }
        let too_many: Vec<String> = (0..=MAX_PARTS).map(|n| format!("part_{n}")).collect();
        assert_eq!(complete(json!({ "part_ids": too_many })).unwrap_err().1, "array_above_max_length");
    }
}
