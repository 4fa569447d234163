//! The delivery loop: every pass sends each due event to each endpoint of its project,
//! many at once, and notes how it went in the outbox; a failed attempt is tried again
//! after [`outbox::backoff`], across restarts, until `webhooks.give_up_after`. An
//! endpoint the SSRF guard refuses is a setting to fix: said at start and at each
//! refused event (warnings), counted once as `refused`, and given up after
//! [`outbox::REFUSED_ATTEMPTS`].

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::event::Event;
use super::outbox::{self, Delivery};
use super::{BatchEndpoints, Webhook, WebhooksConfig, sign, target};
use crate::clock::{self, UnixSeconds};
use crate::metrics::METRICS;
use crate::projects::ProjectDirectory;
use crate::storage::{ObjectStore, StorageError};

/// Attempts made at once in a pass, over every event and endpoint.
const AT_ONCE: usize = 32;

pub struct Deliverer {
    store: Arc<dyn ObjectStore>,
    projects: Arc<ProjectDirectory>,
    /// Batches' own endpoints, when the batches may name some (on Kubernetes).
    batches: Option<Arc<BatchEndpoints>>,
    settings: WebhooksConfig,
}

/// How old a delivered event must be before it leaves the outbox where batches name
/// endpoints of their own: those are learnt from the batch's resource within a second or
/// two of its record, and an event of a batch that ended at once must wait for them.
const SETTLE: UnixSeconds = 3;

impl Deliverer {
    pub fn new(store: Arc<dyn ObjectStore>, projects: Arc<ProjectDirectory>, settings: WebhooksConfig) -> Self {
        Self { store, projects, batches: None, settings }
    }

    /// Also delivers each batch's events to the batch's own endpoints.
    pub fn with_batch_endpoints(self, batches: Arc<BatchEndpoints>) -> Self {
        Self { batches: Some(batches), ..self }
    }

    /// Passes every `every`, until the task is dropped.
    pub async fn run(self, every: Duration) {
        self.warn_of_refused_endpoints().await;
        loop {
            if let Err(error) = self.pass(clock::now()).await {
                tracing::warn!(%error, "webhook delivery pass failed; trying again next pass");
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Says which configured endpoints the SSRF guard would refuse now.
    pub async fn warn_of_refused_endpoints(&self) {
        let projects = self.projects.current();
        for project in projects.iter() {
            for webhook in &project.webhooks {
                if let Err(error @ target::TargetError::Internal { .. }) =
                    target::resolve(&webhook.url, &self.settings.allowed_hosts).await
                {
                    tracing::warn!(project = %project.id, url = %webhook.url, %error, "a webhook endpoint is refused: no event will reach it");
                }
            }
        }
    }

    /// One pass over the outbox.
    pub async fn pass(&self, now: UnixSeconds) -> Result<(), StorageError> {
        let projects = self.projects.current();
        let mut events = outbox::pending(self.store.as_ref()).await?;
        METRICS.webhook_events_pending.set(events.len() as i64);
        // Each event's endpoints, as configured now, and the pairs due now.
        let endpoints: Vec<Vec<Webhook>> = events.iter().map(|pending| self.endpoints(&projects, pending)).collect();
        let mut due = Vec::new();
        for (index, (pending, webhooks)) in events.iter().zip(&endpoints).enumerate() {
            for webhook in webhooks {
                if pending.deliveries.get(webhook.url.as_str()).is_none_or(|delivery| delivery.is_due(now)) {
                    due.push((index, webhook.clone()));
                }
            }
        }
        let attempts = futures_util::stream::iter(due)
            .map(|(index, webhook)| {
                let event = events[index].event.clone();
                async move {
                    let result = self.attempt(&webhook, &event).await;
                    (index, webhook, result)
                }
            })
            .buffer_unordered(AT_ONCE)
            .collect::<Vec<_>>()
            .await;
        let mut changed = vec![false; events.len()];
        for (index, webhook, result) in attempts {
            let event_id = events[index].event.id.clone();
            let delivery = events[index].deliveries.entry(webhook.url.to_string()).or_default();
            record(delivery, result, now, &event_id, &webhook);
            changed[index] = true;
        }
        let give_up_after = self.settings.give_up_after.as_secs() as i64;
        for ((pending, webhooks), changed) in events.iter_mut().zip(&endpoints).zip(changed) {
            let undelivered = |webhook: &&Webhook| {
                pending.deliveries.get(webhook.url.as_str()).is_none_or(|delivery: &Delivery| !delivery.is_closed())
            };
            let open = webhooks.iter().filter(undelivered).count();
            let settled = self.batches.is_none() || now >= pending.event.created_at + SETTLE;
            if open == 0 && !settled {
                if changed {
                    outbox::save(self.store.as_ref(), pending).await?;
                }
            } else if open == 0 {
                outbox::remove(self.store.as_ref(), pending).await?;
            } else if now >= pending.event.created_at + give_up_after {
                tracing::warn!(event = %pending.event.id, endpoints = open, "gave up delivering a webhook event");
                METRICS.webhook_gave_up();
                outbox::remove(self.store.as_ref(), pending).await?;
            } else if changed {
                outbox::save(self.store.as_ref(), pending).await?;
            }
        }
        Ok(())
    }

    /// Where `pending` goes: its project's endpoints, then its batch's own (an endpoint
    /// named by both, once).
    fn endpoints(&self, projects: &crate::projects::Projects, pending: &outbox::Pending) -> Vec<Webhook> {
        let mut webhooks = projects.get(&pending.project).map(|project| project.webhooks.clone()).unwrap_or_default();
        let own = self.batches.as_ref().map(|batches| batches.of(&pending.event.data.id)).unwrap_or_default();
        for webhook in own {
            if !webhooks.iter().any(|known| known.url == webhook.url) {
                webhooks.push(webhook);
            }
        }
        webhooks
    }

    /// One POST of `event` to `webhook`, to addresses checked against SSRF, without
    /// following redirects; a 2xx answer is a delivery.
    async fn attempt(&self, webhook: &Webhook, event: &Event) -> Result<(), Attempt> {
        let addresses =
            target::resolve(&webhook.url, &self.settings.allowed_hosts).await.map_err(|error| match error {
                target::TargetError::Internal { .. } => Attempt::Refused(error.to_string()),
                target::TargetError::Unresolved { .. } => Attempt::Failed(error.to_string()),
            })?;
        let host = webhook.url.host_str().unwrap_or_default().to_owned();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(self.settings.timeout)
            .resolve_to_addrs(&host, &addresses)
            .build()
            .map_err(|error| Attempt::Failed(error.to_string()))?;
        let body = serde_json::to_vec(event).expect("events serialize");
        let timestamp = clock::now();
        let answer = client
            .post(webhook.url.clone())
            .header("content-type", "application/json")
            .header("user-agent", concat!("Nightshift-Webhooks/", env!("CARGO_PKG_VERSION")))
            .header("webhook-id", &event.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", sign::signature(&webhook.secret, &event.id, timestamp, &body))
            .body(body)
            .send()
            .await
            .map_err(|error| Attempt::Failed(format!("request failed: {error}")))?;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(Attempt::Failed(format!("answered {}", answer.status())))
        }
    }
}

/// Why an attempt did not deliver.
enum Attempt {
    /// The SSRF guard refused the endpoint's address: nothing was sent.
    Refused(String),
    /// It was tried and failed (no answer, or not 2xx).
    Failed(String),
}

/// What an attempt to deliver `event_id` to `webhook` leaves on its delivery record.
fn record(delivery: &mut Delivery, result: Result<(), Attempt>, now: UnixSeconds, event_id: &str, webhook: &Webhook) {
    delivery.attempts += 1;
    match result {
        Ok(()) => {
            delivery.delivered_at = Some(now);
            delivery.last_error = None;
            METRICS.webhook_delivered();
        }
        Err(Attempt::Refused(error)) => {
            delivery.refused += 1;
            delivery.next_at = now + outbox::backoff(delivery.attempts);
            METRICS.webhook_refused();
            if delivery.is_closed() {
                tracing::warn!(event = %event_id, url = %webhook.url, %error, "webhook endpoint refused: gave up on it for this event");
                METRICS.webhook_gave_up();
            } else {
                tracing::warn!(event = %event_id, url = %webhook.url, %error, "webhook endpoint refused; fix webhooks.allowed_hosts or the URL");
            }
            delivery.last_error = Some(error);
        }
        Err(Attempt::Failed(error)) => {
            tracing::info!(event = %event_id, url = %webhook.url, %error, attempts = delivery.attempts, "webhook delivery failed; will retry");
            delivery.next_at = now + outbox::backoff(delivery.attempts);
            delivery.last_error = Some(error);
            METRICS.webhook_failed();
        }
    }
}
