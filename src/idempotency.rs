//! `Idempotency-Key` on `POST /v1/batches` and `POST /v1/files`: the same key and request
//! within 24 hours answer the object the first request made; the same key with another
//! request is a conflict.
//!
//! A key is claimed in object storage, `idempotency/<project>/<sha256 of the key>.json`,
//! with an exclusive create ([`ObjectStore::create_exclusive`]), so that of two requests
//! at once, on any api replica, one creates and the other answers what it created. The
//! claim names the request's fingerprint and the id of the object it creates (chosen
//! before creating), so a replay is a lookup of that id. Pure parts (the key, the
//! fingerprint, what a found claim means) are here with their tests; the waiting is in
//! `api/idempotent.rs`.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::clock::UnixSeconds;
use crate::ids::ProjectId;
use crate::storage::{Key, ObjectStore, StorageError};

/// How long a key is remembered (OpenAI's and Stripe's 24 hours).
pub const KEY_LIFETIME_SECONDS: i64 = 24 * 3600;
/// A claim whose object has not appeared after this long was left by a request that died
/// mid-way: a retry may take it over.
pub const STALE_CLAIM_SECONDS: i64 = 300;
const MAX_KEY_CHARS: usize = 255;

/// A checked `Idempotency-Key` header value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// 1 to 255 visible ASCII characters.
    pub fn parse(raw: &str) -> Option<Self> {
        let valid = !raw.is_empty() && raw.len() <= MAX_KEY_CHARS && raw.bytes().all(|b| b.is_ascii_graphic());
        valid.then(|| Self(raw.to_owned()))
    }

    fn digest(&self) -> String {
        hex::encode(Sha256::digest(self.0.as_bytes()))
    }
}

/// A stored claim on a key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// What the request was ([`fingerprint`]).
    pub fingerprint: String,
    /// The id of the object the request creates.
    pub object_id: String,
    pub claimed_at: UnixSeconds,
}

/// What a claim found in place means for a new request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Older than a key lives: forget it, as if there were none.
    Expired,
    /// Another request under the same key.
    Conflict,
    /// The same request: answer its object, once it exists.
    Same { object_id: String, stale: bool },
}

impl Claim {
    pub fn judge(&self, fingerprint: &str, now: UnixSeconds) -> Found {
        if now >= self.claimed_at + KEY_LIFETIME_SECONDS {
            Found::Expired
        } else if self.fingerprint != fingerprint {
            Found::Conflict
        } else {
            Found::Same { object_id: self.object_id.clone(), stale: now >= self.claimed_at + STALE_CLAIM_SECONDS }
        }
    }
}

/// The fingerprint of a request: a digest of its parts (the route, then what the body
/// says), each length-prefixed so that no two lists of parts share one.
pub fn fingerprint(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// A JSON value with every object's keys in order, so that two bodies that say the same
/// thing in another key order or spacing are the same request.
pub fn canonical_json(value: &Value) -> Vec<u8> {
    fn sorted(value: &Value) -> Value {
        match value {
            Value::Object(object) => {
                let mut entries: Vec<_> = object.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                Value::Object(entries.into_iter().map(|(k, v)| (k.clone(), sorted(v))).collect())
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    serde_json::to_vec(&sorted(value)).expect("JSON values serialize")
}

/// Claims in object storage.
#[derive(Clone)]
pub struct IdempotencyStore {
    store: Arc<dyn ObjectStore>,
}

fn claim_key(project: &ProjectId, key: &IdempotencyKey) -> Key {
    Key::from_segments(&["idempotency", project.as_str(), &format!("{}.json", key.digest())])
}

impl IdempotencyStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self { store }
    }

    /// Claims the key; `None` when claimed, else the claim already in place (if it has
    /// not gone meanwhile).
    pub async fn claim(
        &self,
        project: &ProjectId,
        key: &IdempotencyKey,
        claim: &Claim,
    ) -> Result<Option<Option<Claim>>, StorageError> {
        let json = Bytes::from(serde_json::to_vec(claim).expect("claims serialize"));
        if self.store.create_exclusive(&claim_key(project, key), json).await? {
            return Ok(None);
        }
        Ok(Some(self.read(project, key).await?))
    }

    async fn read(&self, project: &ProjectId, key: &IdempotencyKey) -> Result<Option<Claim>, StorageError> {
        match self.store.get(&claim_key(project, key)).await {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(StorageError::NotFound(_)) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Replaces an expired or stale claim with ours.
    pub async fn take_over(
        &self,
        project: &ProjectId,
        key: &IdempotencyKey,
        claim: &Claim,
    ) -> Result<(), StorageError> {
        let json = Bytes::from(serde_json::to_vec(claim).expect("claims serialize"));
        self.store.put(&claim_key(project, key), json).await
    }

    /// Gives the key up after the request it was claimed for failed, if the claim is
    /// still that request's.
    pub async fn release(&self, project: &ProjectId, key: &IdempotencyKey, claim: &Claim) -> Result<(), StorageError> {
        if self.read(project, key).await?.as_ref() == Some(claim) {
            self.store.delete(&claim_key(project, key)).await?;
        }
        Ok(())
    }

    /// Removes the claims older than a key lives; returns how many.
    pub async fn collect_garbage(&self, now: UnixSeconds) -> Result<usize, StorageError> {
        let mut removed = 0;
        for key in self.store.list("idempotency/").await? {
            let expired = match self.store.get(&key).await {
                Ok(bytes) => serde_json::from_slice::<Claim>(&bytes)
                    .map_or(true, |claim| claim.judge(&claim.fingerprint, now) == Found::Expired),
                Err(StorageError::NotFound(_)) => false,
                Err(error) => return Err(error),
            };
            if expired {
                self.store.delete(&key).await?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn keys_are_short_visible_ascii() {
        assert!(IdempotencyKey::parse("retry-7f3a_2026-11-23").is_some());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_some());
        for bad in ["", " ", "with space", "tab\t", "ünïcode", &"k".repeat(256)] {
            assert_eq!(IdempotencyKey::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_same_request_in_another_key_order_has_the_same_fingerprint() {
        let a = json!({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "metadata": {"a": 1, "b": [{"y": 2, "x": 1}]}});
        let b = json!({"metadata": {"b": [{"x": 1, "y": 2}], "a": 1}, "endpoint": "/v1/chat/completions", "input_file_id": "file-1"});
        let print = |value: &Value| fingerprint(&[b"POST /v1/batches", &canonical_json(value)]);
        assert_eq!(print(&a), print(&b));
        let other = json!({"input_file_id": "file-2", "endpoint": "/v1/chat/completions"});
        assert_ne!(print(&a), print(&other));
        assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]), "parts are delimited");
    }

    #[test]
    fn a_found_claim_is_the_same_request_a_conflict_stale_or_expired() {
        let claim = Claim { fingerprint: "f".into(), object_id: "batch_1".into(), claimed_at: 1_000 };
        let same = |stale| Found::Same { object_id: "batch_1".into(), stale };
        assert_eq!(claim.judge("f", 1_000), same(false));
        assert_eq!(claim.judge("f", 1_000 + STALE_CLAIM_SECONDS - 1), same(false));
        assert_eq!(claim.judge("f", 1_000 + STALE_CLAIM_SECONDS), same(true));
        assert_eq!(claim.judge("g", 1_000 + 60), Found::Conflict);
        assert_eq!(claim.judge("f", 1_000 + KEY_LIFETIME_SECONDS), Found::Expired);
        assert_eq!(claim.judge("g", 1_000 + KEY_LIFETIME_SECONDS), Found::Expired, "an old key is free for anything");
    }
}
