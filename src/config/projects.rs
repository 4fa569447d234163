//! `projects:`: each project's keys, quota, rate limit, webhooks and weight.

use serde::Deserialize;

use crate::ids::ProjectId;
use crate::webhooks::Webhook;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectConfig {
    pub id: ProjectId,
    #[serde(default)]
    pub name: Option<String>,
    pub api_keys: Vec<ApiKeyConfig>,
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
    /// Requests a minute for this project (else `http.requests_per_minute`).
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Where this project's batch events are delivered (`{url: https://..., secret:
    /// whsec_...}` each).
    #[serde(default)]
    pub webhooks: Vec<Webhook>,
    /// Its share of capacity when batches of several projects wait (`crate::lifecycle::schedule`):
    /// a project of weight 2 runs twice the shards of one of weight 1.
    #[serde(default)]
    pub weight: Weight,
}

/// A project's weight: 1 to 1000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "u32")]
pub struct Weight(u32);

impl Weight {
    pub const MAX: u32 = 1000;

    /// The nearest weight to `weight` (a Project resource's, which its schema bounds).
    pub fn clamped(weight: u32) -> Self {
        Self(weight.clamp(1, Self::MAX))
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for Weight {
    fn default() -> Self {
        Self(1)
    }
}

impl TryFrom<u32> for Weight {
    type Error = String;

    fn try_from(weight: u32) -> Result<Self, String> {
        if (1..=Self::MAX).contains(&weight) {
            Ok(Self(weight))
        } else {
            Err(format!("weight must be between 1 and {}", Self::MAX))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    pub requests_per_minute: u32,
}

/// An API key, held as its SHA-256: read from `{plain: dev-key}` or `{sha256: <hex>}`,
/// optionally with `active: false`.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "ApiKeyForm")]
pub struct ApiKeyConfig {
    pub digest: [u8; 32],
    pub active: bool,
}

/// An API key as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiKeyForm {
    plain: Option<String>,
    sha256: Option<String>,
    #[serde(default = "yes")]
    active: bool,
}

impl ApiKeyConfig {
    /// An active key given in plain.
    pub fn plain(key: &str) -> Self {
        Self { digest: key_digest(key), active: true }
    }

    /// A key given as the 64 hex digits of its SHA-256; `None` for anything else.
    pub fn sha256(hex_digest: &str, active: bool) -> Option<Self> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(hex_digest, &mut digest).ok().map(|()| Self { digest, active })
    }
}

impl TryFrom<ApiKeyForm> for ApiKeyConfig {
    type Error = String;

    fn try_from(form: ApiKeyForm) -> Result<Self, String> {
        match (form.plain, form.sha256) {
            (Some(plain), None) if !plain.is_empty() => Ok(Self { digest: key_digest(&plain), active: form.active }),
            (None, Some(hash)) => {
                Self::sha256(&hash, form.active).ok_or_else(|| "sha256 keys are 64 hex digits".into())
            }
            _ => Err("each api key is exactly one of {plain: ...} or {sha256: ...}".into()),
        }
    }
}

/// The SHA-256 of an API key, as keys are kept and compared.
pub fn key_digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    pub tokens: u64,
}

impl ProjectConfig {
    /// What its fields' types cannot say: it has a key.
    pub(super) fn check(&self) -> Result<(), String> {
        if self.api_keys.is_empty() {
            return Err(format!("project {} has no api_keys", self.id));
        }
        Ok(())
    }
}
