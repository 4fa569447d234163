//! How a line fails: the spec's error-file codes and their `[legacy:…]` message
//! prefixes, decided from what the upstream answered. Pure.

use serde_json::Value;

/// The error-file codes of jsonl-format.txt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCode {
    InvalidRequestError,
    AuthenticationError,
    NotFoundError,
    RequestTooLarge,
    InsufficientQuota,
    RateLimitExceeded,
    InternalError,
    BatchCancelled,
    BatchExpired,
}

impl FailureCode {
    const ALL: [FailureCode; 9] = [
        Self::InvalidRequestError,
        Self::AuthenticationError,
        Self::NotFoundError,
        Self::RequestTooLarge,
        Self::InsufficientQuota,
        Self::RateLimitExceeded,
        Self::InternalError,
        Self::BatchCancelled,
        Self::BatchExpired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequestError => "invalid_request_error",
            Self::AuthenticationError => "authentication_error",
            Self::NotFoundError => "not_found_error",
            Self::RequestTooLarge => "request_too_large",
            Self::InsufficientQuota => "insufficient_quota",
            Self::RateLimitExceeded => "rate_limit_exceeded",
            Self::InternalError => "internal_error",
            Self::BatchCancelled => "batch_cancelled",
            Self::BatchExpired => "batch_expired",
        }
    }
}

/// The code named `code`, as the `'static` text metrics label lines with.
pub fn known_code(code: &str) -> Option<&'static str> {
    FailureCode::ALL.iter().map(|c| c.as_str()).find(|known| *known == code)
}

/// A failed line, as its error record will say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineFailure {
    pub code: FailureCode,
    pub message: String,
    pub param: Option<String>,
}

/// The attempts a line gets in all (the first and three retries).
pub const ATTEMPTS: u32 = 4;

/// Upstream detail folded into messages is cut to this many characters.
const DETAIL_CHARS: usize = 1000;

/// What to do with one upstream answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// 2xx: the line succeeded.
    Success,
    /// Worth another attempt (429, 5xx), if any are left.
    Retry,
    /// Final: the line failed.
    Fail(LineFailure),
}

fn cut(text: &str) -> String {
    if text.chars().count() <= DETAIL_CHARS {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(DETAIL_CHARS).collect();
    cut.push('…');
    cut
}

/// The upstream's own words about an error: its `error` object, byte for byte, when
/// it sent the OpenAI envelope, else the body as text.
pub fn upstream_detail(body: &[u8]) -> (String, Option<String>) {
    #[derive(serde::Deserialize)]
    struct Envelope<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
    }
    if let Ok(Envelope { error: Some(error) }) = serde_json::from_slice::<Envelope<'_>>(body) {
        return match serde_json::from_str::<Value>(error.get()) {
            Ok(Value::String(message)) => (cut(&message), None),
            Ok(object) => {
                let param = object.get("param").and_then(Value::as_str).map(str::to_owned);
                (cut(error.get()), param)
            }
            Err(_) => (cut(error.get()), None),
        };
    }
    (cut(String::from_utf8_lossy(body).trim()), None)
}

/// Whether a 429 says the upstream's quota, not its rate, ran out (OpenAI's wording).
fn is_quota_exhausted(body: &[u8]) -> bool {
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else { return false };
    let error = object.get("error");
    ["type", "code"]
        .iter()
        .any(|field| error.and_then(|e| e.get(field)).and_then(Value::as_str) == Some("insufficient_quota"))
}

/// Decides what an upstream HTTP answer means for the line.
pub fn judge(status: u16, body: &[u8]) -> Verdict {
    let fail = |code, legacy: &str| {
        let (detail, param) = upstream_detail(body);
        let detail = if detail.is_empty() { format!("The upstream answered {status} with no body") } else { detail };
        Verdict::Fail(LineFailure { code, message: format!("[legacy:{legacy}] {detail}"), param })
    };
    match status {
        200..=299 => Verdict::Success,
        429 if is_quota_exhausted(body) => fail(FailureCode::InsufficientQuota, "http_429"),
        429 | 500..=599 => Verdict::Retry,
        400 => fail(FailureCode::InvalidRequestError, "http_400"),
        422 => fail(FailureCode::InvalidRequestError, "http_422"),
        401 => fail(FailureCode::AuthenticationError, "http_401"),
        403 => fail(FailureCode::AuthenticationError, "http_403"),
        404 => fail(FailureCode::NotFoundError, "http_404"),
        413 => fail(FailureCode::RequestTooLarge, "http_413"),
        other => fail(FailureCode::InvalidRequestError, &format!("http_{other}")),
    }
}

/// The failure of a line whose every attempt was retryable, described by the last one.
pub fn exhausted(last: &Attempt) -> LineFailure {
    let (code, what) = match last {
        Attempt::Status { status: 429, body } => {
            (FailureCode::RateLimitExceeded, format!("upstream returned 429: {}", upstream_detail(body).0))
        }
        Attempt::Status { status, body } => {
            (FailureCode::InternalError, format!("upstream returned {status}: {}", upstream_detail(body).0))
        }
        Attempt::Transport(error) => (FailureCode::InternalError, cut(error)),
    };
    LineFailure {
        code,
        message: format!("[legacy:retries_exhausted] Line failed after {ATTEMPTS} attempts: {what}"),
        param: None,
    }
}

/// One attempt that did not succeed, kept to describe the failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt {
    Status {
        status: u16,
        body: Vec<u8>,
    },
    /// A timeout or connection error.
    Transport(String),
}

pub fn cancelled() -> LineFailure {
    LineFailure {
        code: FailureCode::BatchCancelled,
        message: "The batch was cancelled before this line was dispatched".into(),
        param: None,
    }
}

pub fn expired() -> LineFailure {
    LineFailure {
        code: FailureCode::BatchExpired,
        message: "The batch's completion window elapsed before this line was dispatched".into(),
        param: None,
    }
}

/// The record of a line whose shard's worker failed more often than
/// `batches.max_shard_retries` allows: it was never sent (or its answer was never
/// committed). Transient, as the spec says of `internal_error`: resubmit it.
pub fn shard_failed(runs: u32) -> LineFailure {
    LineFailure {
        code: FailureCode::InternalError,
        message: format!("[legacy:dlq_exhausted] The shard's worker failed {runs} times; this line was not run"),
        param: None,
    }
}

pub fn quota_exhausted() -> LineFailure {
    LineFailure {
        code: FailureCode::InsufficientQuota,
        message: "[legacy:http_420] The project's token quota is used up".into(),
        param: None,
    }
}

pub fn no_upstream(model: &str) -> LineFailure {
    LineFailure {
        code: FailureCode::NotFoundError,
        message: format!("[legacy:http_404] No upstream serves the model {model:?}"),
        param: Some("model".into()),
    }
}

pub fn bad_upstream_body(status: u16) -> LineFailure {
    LineFailure {
        code: FailureCode::InternalError,
        message: format!("[legacy:http_{status}] The upstream answered {status} with a body that is not a JSON object"),
        param: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(status: u16, body: &str) -> LineFailure {
        match judge(status, body.as_bytes()) {
            Verdict::Fail(failure) => failure,
            other => panic!("{status} should fail the line, got {other:?}"),
        }
    }

    #[test]
    fn client_errors_map_to_the_specs_codes_and_legacy_prefixes() {
        let envelope = r#"{"error":{"message":"messages: missing required field","type":"invalid_request_error","param":"messages"}}"#;
        let bad = failure(400, envelope);
        assert_eq!(bad.code, FailureCode::InvalidRequestError);
        assert_eq!(
            bad.message,
            r#"[legacy:http_400] {"message":"messages: missing required field","type":"invalid_request_error","param":"messages"}"#
        );
        assert_eq!(bad.param.as_deref(), Some("messages"));
        let cases = [
            (422, FailureCode::InvalidRequestError, "[legacy:http_422]"),
            (401, FailureCode::AuthenticationError, "[legacy:http_401]"),
            (403, FailureCode::AuthenticationError, "[legacy:http_403]"),
            (404, FailureCode::NotFoundError, "[legacy:http_404]"),
            (413, FailureCode::RequestTooLarge, "[legacy:http_413]"),
            (409, FailureCode::InvalidRequestError, "[legacy:http_409]"),
        ];
        for (status, code, prefix) in cases {
            let failure = failure(status, "plain text detail");
            assert_eq!(failure.code, code, "{status}");
            assert_eq!(failure.message, format!("{prefix} plain text detail"));
        }
        // A proxy or a half-started server answers with nothing: the message says so.
        for body in ["", " \n"] {
            assert_eq!(failure(404, body).message, "[legacy:http_404] The upstream answered 404 with no body");
        }
    }

    #[test]
    fn throttling_and_server_errors_are_retried_then_exhausted() {
        assert_eq!(judge(200, b"{}"), Verdict::Success);
        for status in [429, 500, 502, 503, 504] {
            assert_eq!(judge(status, b"busy"), Verdict::Retry, "{status}");
        }
        let throttled = exhausted(&Attempt::Status { status: 429, body: b"slow down".to_vec() });
        assert_eq!(throttled.code, FailureCode::RateLimitExceeded);
        assert_eq!(
            throttled.message,
            "[legacy:retries_exhausted] Line failed after 4 attempts: upstream returned 429: slow down"
        );
        let down = exhausted(&Attempt::Status { status: 503, body: b"upstream timeout".to_vec() });
        assert_eq!(down.code, FailureCode::InternalError);
        assert_eq!(
            down.message,
            "[legacy:retries_exhausted] Line failed after 4 attempts: upstream returned 503: upstream timeout"
        );
        let refused = exhausted(&Attempt::Transport("connection refused".into()));
        assert_eq!(refused.message, "[legacy:retries_exhausted] Line failed after 4 attempts: connection refused");
    }

    #[test]
    fn a_429_that_says_insufficient_quota_fails_at_once() {
        let failure = failure(429, r#"{"error":{"message":"no credit","type":"insufficient_quota"}}"#);
        assert_eq!(failure.code, FailureCode::InsufficientQuota);
        assert!(failure.message.starts_with("[legacy:http_429] "));
    }

    #[test]
    fn long_upstream_details_are_cut() {
        let failure = failure(400, &"x".repeat(5000));
        assert!(failure.message.chars().count() < 1100);
        assert!(failure.message.ends_with('…'));
    }
}
