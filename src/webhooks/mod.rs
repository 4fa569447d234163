//! Webhooks: on every terminal state of a batch, OpenAI's event (`batch.completed`,
//! `batch.failed`, `batch.cancelled`, `batch.expired`) is delivered to each endpoint of
//! the batch's project (and of the batch itself, for an applied Batch naming some), signed per Standard Webhooks so that the SDK's
//! `client.webhooks.unwrap(...)` verifies it.
//!
//! At least once, across restarts: the driver writes the event to an outbox in storage
//! ([`outbox`]) before it saves the terminal state, and the [`deliver`] loop sends it to
//! every endpoint, retrying with backoff, with the same `webhook-id` each time. Delivery
//! runs beside batches, never in their way: a dead endpoint costs only its own retries.
//! [`event`] (the payload), [`sign`] (the signature) and [`target`] (which addresses a
//! webhook may reach) are pure.

pub mod batch_endpoints;
pub mod deliver;
pub mod event;
pub mod outbox;
pub mod sign;
pub mod target;

use std::time::Duration;

use serde::Deserialize;

pub use batch_endpoints::BatchEndpoints;
pub use deliver::Deliverer;
pub use event::Event;
pub use sign::SigningSecret;

/// One endpoint of a project: where events go and the secret they are signed with.
/// Read from the configuration's `{url: https://..., secret: whsec_...}`, checked there.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "WebhookForm")]
pub struct Webhook {
    pub url: reqwest::Url,
    pub secret: SigningSecret,
}

/// A webhook as written: `{url, secret}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WebhookForm {
    url: String,
    secret: String,
}

impl Webhook {
    /// A webhook from its URL and secret as written, or why they are refused.
    pub fn parse(url: &str, secret: &str) -> Result<Self, String> {
        let url = target::parse_url(url).map_err(|error| format!("webhook {error}"))?;
        let secret = SigningSecret::parse(secret).ok_or_else(|| {
            format!("the secret of webhook {url} is not whsec_ followed by the base64 of at least 16 bytes")
        })?;
        Ok(Self { url, secret })
    }
}

impl TryFrom<WebhookForm> for Webhook {
    type Error = String;

    fn try_from(form: WebhookForm) -> Result<Self, String> {
        Self::parse(&form.url, &form.secret)
    }
}

/// `webhooks:` in the configuration: how delivery behaves, installation-wide.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhooksConfig {
    /// Hosts (names or addresses, as in the URL) that may be reached although they are
    /// loopback, private or link-local: by default such targets are refused (SSRF).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// How long one delivery attempt may take.
    #[serde(default = "default_timeout", deserialize_with = "crate::duration::deserialize_precise")]
    pub timeout: Duration,
    /// How long an event is retried before it is given up.
    #[serde(default = "default_give_up_after", deserialize_with = "crate::duration::deserialize")]
    pub give_up_after: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_give_up_after() -> Duration {
    Duration::from_secs(3 * 24 * 3600)
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self { allowed_hosts: Vec::new(), timeout: default_timeout(), give_up_after: default_give_up_after() }
    }
}
