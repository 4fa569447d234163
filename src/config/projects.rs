//! `projects:`: each project's keys, quota, rate limit, webhooks and weight.

use serde::Deserialize;

use crate::ids::ProjectId;

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
    /// Where this project's batch events are delivered.
    #[serde(default)]
    pub webhooks: Vec<WebhookConfig>,
    /// Its share of capacity when batches of several projects wait (`crate::schedule`):
    /// a project of weight 2 runs twice the shards of one of weight 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

pub fn default_weight() -> u32 {
    1
}

/// `{url: https://..., secret: whsec_...}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub url: String,
    pub secret: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    pub requests_per_minute: u32,
}

/// `{plain: dev-key}` or `{sha256: <hex>}`, optionally `active: false`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    pub plain: Option<String>,
    pub sha256: Option<String>,
    #[serde(default = "yes")]
    pub active: bool,
}

impl ApiKeyConfig {
    /// The key's SHA-256, from either form; `None` for an entry that is neither (which
    /// `Config::check` refuses; a Project resource's bad key is left out).
    pub fn digest(&self) -> Option<[u8; 32]> {
        match (&self.plain, &self.sha256) {
            (Some(plain), None) if !plain.is_empty() => Some(key_digest(plain)),
            (None, Some(hash)) => {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(hash, &mut digest).ok().map(|()| digest)
            }
            _ => None,
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
    /// Its webhooks, keys and weight.
    pub(super) fn check(&self) -> Result<(), String> {
        for webhook in &self.webhooks {
            if let Err(error) = crate::webhooks::target::parse_url(&webhook.url) {
                return Err(format!("project {}: webhook {error}", self.id));
            }
            if crate::webhooks::SigningSecret::parse(&webhook.secret).is_none() {
                return Err(format!(
                    "project {}: the secret of webhook {} is not whsec_ followed by the base64 of at least 16 bytes",
                    self.id, webhook.url
                ));
            }
        }
        if self.api_keys.is_empty() {
            return Err(format!("project {} has no api_keys", self.id));
        }
        if !(1..=1000).contains(&self.weight) {
            return Err(format!("project {}: weight must be between 1 and 1000", self.id));
        }
        for key in &self.api_keys {
            match (&key.plain, &key.sha256) {
                (Some(plain), None) if !plain.is_empty() => {}
                (None, Some(hash)) if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {}
                (None, Some(_)) => return Err(format!("project {}: sha256 keys are 64 hex digits", self.id)),
                _ => {
                    return Err(format!(
                        "project {}: each api key is exactly one of {{plain: ...}} or {{sha256: ...}}",
                        self.id
                    ));
                }
            }
        }
        Ok(())
    }
}
