//! The one error type of the HTTP API and its OpenAI envelope:
//! `{"error": {"message", "type", "code", "param"}}`, plus `line` for JSONL validation.

use std::borrow::Cow;
use std::fmt::Display;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::projects::AuthError;
use crate::storage::StorageError;

/// OpenAI's `error.type` vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    AuthenticationError,
    RateLimitExceeded,
    InsufficientQuota,
    InternalError,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub error_type: ErrorType,
    pub code: Option<Cow<'static, str>>,
    pub message: String,
    pub param: Option<Cow<'static, str>>,
    pub line: Option<u64>,
    /// Seconds to wait before trying again (the `retry-after` header of a 429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        error_type: ErrorType,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            error_type,
            code: code.map(Cow::Borrowed),
            message: message.into(),
            param: None,
            line: None,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error` with a machine-readable code.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError, Some(code), message)
    }

    /// 404 `invalid_request_error`: missing, or another project's (never 403).
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorType::InvalidRequestError, Some(code), message)
    }

    /// A 500 whose detail goes to the log, never to the client.
    pub fn internal(code: &'static str, detail: impl Display) -> Self {
        tracing::error!(code, detail = %detail, "request failed on the server side");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::InternalError,
            Some(code),
            "The server had an error while processing your request. Retry with exponential backoff; \
             if the error persists, report the x-request-id of this response.",
        )
    }

    pub fn with_param(mut self, param: impl Into<Cow<'static, str>>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_line(mut self, line: u64) -> Self {
        self.line = Some(line);
        self
    }

    /// Says when to try again (`retry-after`, in seconds).
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

impl From<StorageError> for ApiError {
    fn from(error: StorageError) -> Self {
        Self::internal("storage_error", error)
    }
}

impl From<crate::files::ExpiryError> for ApiError {
    fn from(error: crate::files::ExpiryError) -> Self {
        ApiError::bad_request(error.code, error.message).with_param(error.param)
    }
}

impl From<AuthError> for ApiError {
    fn from(error: AuthError) -> Self {
        // A wrong bearer key is OpenAI's 401 (the SDK's AuthenticationError); the spec's
        // headers keep the spec's 403.
        let status = match error {
            AuthError::MissingHeaders | AuthError::UnknownBearerKey => StatusCode::UNAUTHORIZED,
            AuthError::InvalidCredentials | AuthError::ProjectMismatch => StatusCode::FORBIDDEN,
        };
        let code = match error {
            AuthError::MissingHeaders => "missing_credentials",
            AuthError::InvalidCredentials | AuthError::UnknownBearerKey | AuthError::ProjectMismatch => {
                "invalid_api_key"
            }
        };
        Self::new(status, ErrorType::AuthenticationError, Some(code), error.to_string())
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    error_type: ErrorType,
    code: Option<&'a str>,
    param: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<u64>,
}

impl ApiError {
    /// The envelope, as the body of a response.
    pub fn envelope_json(&self) -> Vec<u8> {
        let envelope = Envelope {
            error: Body {
                message: &self.message,
                error_type: self.error_type,
                code: self.code.as_deref(),
                param: self.param.as_deref(),
                line: self.line,
            },
        };
        serde_json::to_vec(&envelope).expect("an envelope serializes")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let headers = [(axum::http::header::CONTENT_TYPE, "application/json")];
        let mut response = (self.status, headers, self.envelope_json()).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}
