//! The spec's validation rules and their exact messages.

use std::collections::HashSet;

use sha2::{Digest, Sha256};

use super::line::{Body, LineFacts, Shape, Text};

pub const MAX_FILE_BYTES: u64 = 200 * 1024 * 1024;
pub const MAX_LINE_BYTES: usize = 1024 * 1024;
pub const MAX_LINES: u64 = 50_000;
/// Every endpoint a batch may target; only the first is enabled unless the configuration
/// (`batches.endpoints`) enables others (supported-endpoints.txt names the first alone).
pub const BATCHABLE_URLS: [&str; 5] =
    ["/v1/chat/completions", "/v1/embeddings", "/v1/completions", "/v1/responses", "/v1/moderations"];

/// A body field an endpoint requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyField {
    Model,
    Input,
    Prompt,
}

impl BodyField {
    fn name(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::Input => "input",
            Self::Prompt => "prompt",
        }
    }

    fn param(self) -> &'static str {
        match self {
            Self::Model => "body.model",
            Self::Input => "body.input",
            Self::Prompt => "body.prompt",
        }
    }
}

/// The fields a line's body must hold for its endpoint, beyond being a non-empty object.
/// Chat completions keep the spec's checks alone.
pub fn required_body_fields(url: &str) -> &'static [BodyField] {
    use BodyField::{Input, Model, Prompt};
    match url {
        "/v1/embeddings" | "/v1/responses" => &[Model, Input],
        "/v1/completions" => &[Model, Prompt],
        "/v1/moderations" => &[Input],
        _ => &[],
    }
}

/// The endpoints enabled for batches, a subset of [`BATCHABLE_URLS`]. Read from a list
/// of at least one of their URLs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "Vec<String>")]
pub struct Endpoints(u8);

impl TryFrom<Vec<String>> for Endpoints {
    type Error = String;

    fn try_from(urls: Vec<String>) -> Result<Self, String> {
        if urls.is_empty() {
            return Err("name at least one endpoint".into());
        }
        Self::from_urls(&urls).map_err(|unknown| {
            format!("{unknown:?} is not a batchable endpoint (any of {})", BATCHABLE_URLS.join(", "))
        })
    }
}

impl Default for Endpoints {
    /// The spec's: chat completions only.
    fn default() -> Self {
        Self(1)
    }
}

impl Endpoints {
    /// The endpoints named, or the first name that is no batchable endpoint.
    pub fn from_urls<S: AsRef<str>>(urls: &[S]) -> Result<Self, String> {
        let mut bits = 0;
        for url in urls {
            let position = BATCHABLE_URLS
                .iter()
                .position(|known| *known == url.as_ref())
                .ok_or_else(|| url.as_ref().to_owned())?;
            bits |= 1 << position;
        }
        Ok(Self(bits))
    }

    pub fn allows(self, url: &str) -> bool {
        BATCHABLE_URLS.iter().position(|known| *known == url).is_some_and(|position| self.0 & (1 << position) != 0)
    }
}

/// Why an input file was refused: the message of the spec's table, with the 1-based
/// line it is about and the parameter it names, where those mean something.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidInput {
    pub message: String,
    pub line: Option<u64>,
    pub param: Option<&'static str>,
}

impl InvalidInput {
    fn file(message: String) -> Self {
        Self { message, line: None, param: None }
    }

    fn at(line: u64, message: String, param: Option<&'static str>) -> Self {
        Self { message, line: Some(line), param }
    }

    pub fn no_lines() -> Self {
        Self::file("Input file contains no JSONL lines".into())
    }

    pub fn too_many_lines() -> Self {
        Self::file(format!("Input file exceeds maximum of {MAX_LINES} lines"))
    }

    pub fn line_too_long(n: u64) -> Self {
        Self::at(n, format!("Line {n} exceeds maximum size of {MAX_LINE_BYTES} bytes"), None)
    }

    pub(super) fn bad_line(n: u64, shape: Shape) -> Self {
        match shape {
            Shape::NotJson => Self::at(n, format!("Line {n} is not valid JSON"), None),
            Shape::NotObject => Self::at(n, format!("Line {n} must be a JSON object"), None),
            Shape::RepeatedKey(path) => {
                let param = match path.as_str() {
                    "custom_id" => Some("custom_id"),
                    "method" => Some("method"),
                    "url" => Some("url"),
                    "body" => Some("body"),
                    "body.model" => Some("body.model"),
                    _ => None,
                };
                Self::at(n, format!("Line {n} has the key \"{path}\" more than once; each key may appear once"), param)
            }
        }
    }
}

pub fn file_too_large() -> InvalidInput {
    InvalidInput::file(format!("Input file exceeds maximum size of {MAX_FILE_BYTES} bytes"))
}

pub fn endpoint_mismatch(endpoint: &str, url: &str) -> InvalidInput {
    InvalidInput {
        message: format!("endpoint \"{endpoint}\" does not match the url \"{url}\" used by the input file"),
        line: None,
        param: Some("endpoint"),
    }
}

/// Every custom_id seen so far. Ids up to [`SHORT_ID`] bytes are kept as they are;
/// longer ones (up to a megabyte each) only as SHA-256 digests, which keeps memory
/// bounded by the line count rather than by the file's size.
#[derive(Default)]
pub struct CustomIds {
    short: HashSet<Box<str>>,
    long: HashSet<[u8; 32]>,
}

const SHORT_ID: usize = 128;

impl CustomIds {
    /// Adds `id`; false when it was there already.
    fn insert(&mut self, id: &str) -> bool {
        if id.len() <= SHORT_ID {
            self.short.insert(id.into())
        } else {
            self.long.insert(Sha256::digest(id.as_bytes()).into())
        }
    }
}

/// Applies the per-line rules in the order of the spec's table. `batch_url` is the
/// url the first line set; `endpoint` is the create request's.
pub fn check(
    facts: &LineFacts<'_>,
    n: u64,
    custom_ids: &mut CustomIds,
    batch_url: &mut Option<String>,
    endpoint: &str,
    allowed: Endpoints,
) -> Result<(), InvalidInput> {
    let custom_id = match &facts.custom_id {
        Text::Value(id) if !id.is_empty() => id,
        _ => {
            return Err(InvalidInput::at(n, format!("Line {n} is missing custom_id"), Some("custom_id")));
        }
    };
    if !custom_ids.insert(custom_id) {
        // The spec's example shows `param: null` for this one.
        return Err(InvalidInput::at(n, format!("Line {n} duplicates custom_id \"{custom_id}\""), None));
    }
    match &facts.method {
        Text::Value(method) if method.eq_ignore_ascii_case("POST") => {}
        _ => {
            return Err(InvalidInput::at(n, format!("Line {n} method must be \"POST\""), Some("method")));
        }
    }
    let url = match &facts.url {
        Text::Value(url) => url,
        _ => {
            return Err(InvalidInput::at(n, format!("Line {n} is missing url"), Some("url")));
        }
    };
    check_url(n, url, batch_url, endpoint, allowed)?;
    check_body(n, &facts.body, url)
}

/// The line's url: the batch's (the first line's), or for the first line, an allowed
/// endpoint that is the create request's.
fn check_url(
    n: u64,
    url: &str,
    batch_url: &mut Option<String>,
    endpoint: &str,
    allowed: Endpoints,
) -> Result<(), InvalidInput> {
    match batch_url {
        Some(expected) if expected != url => {
            return Err(InvalidInput::at(
                n,
                format!("Line {n} url \"{url}\" does not match the batch endpoint \"{expected}\""),
                Some("url"),
            ));
        }
        Some(_) => {}
        None => {
            if !allowed.allows(url) {
                return Err(InvalidInput::at(
                    n,
                    format!("Line {n} url \"{url}\" is not an allowed batch endpoint"),
                    Some("url"),
                ));
            }
            if endpoint != url {
                return Err(endpoint_mismatch(endpoint, url));
            }
            *batch_url = Some(url.to_string());
        }
    }
    Ok(())
}

/// The line's body: an object, not streamed, with the fields its url requires.
fn check_body(n: u64, body: &Body<'_>, url: &str) -> Result<(), InvalidInput> {
    match *body {
        Body::Missing | Body::NotObject | Body::Object { keys: 0, .. } => {
            Err(InvalidInput::at(n, format!("Line {n} is missing body"), Some("body")))
        }
        Body::Object { stream_true: true, .. } => Err(InvalidInput::at(
            n,
            format!("Line {n} has stream=true; streaming is not supported in batch mode"),
            Some("body.stream"),
        )),
        Body::Object { ref model, input, prompt, .. } => {
            for &field in required_body_fields(url) {
                let present = match field {
                    BodyField::Model => matches!(model, Text::Value(_)),
                    BodyField::Input => input,
                    BodyField::Prompt => prompt,
                };
                if !present {
                    let message = format!("Line {n} body is missing {}, which {url} requires", field.name());
                    return Err(InvalidInput::at(n, message, Some(field.param())));
                }
            }
            Ok(())
        }
    }
}
