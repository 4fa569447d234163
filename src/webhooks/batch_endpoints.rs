//! Endpoints of single batches (an applied Batch's `spec.webhooks`), beside their
//! project's: the controller keeps them current from the Batch resources, and the
//! deliverer sends a batch's events to both.

use std::collections::HashMap;
use std::sync::RwLock;

use super::Webhook;

#[derive(Default)]
pub struct BatchEndpoints(RwLock<HashMap<String, Vec<Webhook>>>);

impl BatchEndpoints {
    /// Every batch's endpoints, by batch id, as they are now.
    pub fn replace(&self, endpoints: HashMap<String, Vec<Webhook>>) {
        *self.0.write().expect("batch endpoints") = endpoints;
    }

    /// The endpoints of batch `id` (none for most).
    pub fn of(&self, id: &str) -> Vec<Webhook> {
        self.0.read().expect("batch endpoints").get(id).cloned().unwrap_or_default()
    }
}
