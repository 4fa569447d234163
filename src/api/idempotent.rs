//! The request side of idempotent creates (the rules are in `crate::idempotency`): read
//! the header, claim the key or wait for the request that holds it, and mark replays.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ErrorType};
use crate::clock;
use crate::idempotency::{Claim, Found, IdempotencyKey, IdempotencyStore};
use crate::ids::ProjectId;

pub const HEADER: &str = "idempotency-key";
/// Set on an answer that is a replay of an earlier request's.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// How long a request waits for the same request under its key to finish creating.
const WAIT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);

/// The request's key, if it sent one; a malformed one is refused.
pub fn key_from(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let Some(value) = headers.get(HEADER) else { return Ok(None) };
    value.to_str().ok().and_then(IdempotencyKey::parse).map(Some).ok_or_else(|| {
        ApiError::bad_request(
            "invalid_idempotency_key",
            "The Idempotency-Key header must be 1 to 255 visible ASCII characters",
        )
    })
}

pub enum Begin<T> {
    /// The key is ours: create, then keep the claim, or release it if creating failed.
    Create(Claim),
    /// The same request made this before.
    Replay(T),
}

/// Claims `key` for a request with this fingerprint that will create `object_id`, or
/// finds what the same request under the key created (`find` looks an object up by id),
/// waiting while that request is still creating it.
pub async fn begin<T, F, Fut>(
    store: &IdempotencyStore,
    project: &ProjectId,
    key: &IdempotencyKey,
    fingerprint: String,
    object_id: String,
    find: F,
) -> Result<Begin<T>, ApiError>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Option<T>, ApiError>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let ours = Claim { fingerprint: fingerprint.clone(), object_id: object_id.clone(), claimed_at: clock::now() };
        match store.claim(project, key, &ours).await? {
            None => return Ok(Begin::Create(ours)),
            // Released meanwhile (that request failed): claim it again at once.
            Some(None) => {}
            Some(Some(found)) => match found.judge(&fingerprint, clock::now()) {
                Found::Expired => {
                    store.take_over(project, key, &ours).await?;
                    return Ok(Begin::Create(ours));
                }
                Found::Conflict => return Err(reused()),
                Found::Same { object_id, stale } => {
                    if let Some(object) = find(object_id).await? {
                        return Ok(Begin::Replay(object));
                    }
                    if stale {
                        store.take_over(project, key, &ours).await?;
                        return Ok(Begin::Create(ours));
                    }
                }
            },
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorType::InvalidRequestError,
                Some("idempotency_key_in_use"),
                "A request with this Idempotency-Key is still being processed; retry shortly",
            )
            .with_retry_after(1));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Gives the key up after creating failed, so that a retry creates anew; a failure to do
/// so only delays that until the claim is stale.
pub async fn release(store: &IdempotencyStore, project: &ProjectId, key: &IdempotencyKey, claim: &Claim) {
    if let Err(error) = store.release(project, key, claim).await {
        tracing::warn!(%error, "could not release an idempotency key after a failed create");
    }
}

fn reused() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ErrorType::InvalidRequestError,
        Some("idempotency_key_reused"),
        "This Idempotency-Key was already used with a different request in the last 24 hours; \
         use another key for a different request",
    )
}

/// An answer marked as a replay.
pub fn replayed(answer: impl IntoResponse) -> Response {
    let mut response = answer.into_response();
    response.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}
