//! The worker's side: applies its grant as it changes and acknowledges what it holds and
//! which upstreams it has lines for; releases everything when the worker ends.

use std::time::Duration;

use super::{Ack, read_grant, write_ack};
use crate::exec::upstream::Upstreams;
use crate::storage::ObjectStore;

/// How often a worker looks at its grant.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// Follows `worker`'s grant forever (the caller stops it by dropping it).
pub async fn follow(store: &dyn ObjectStore, worker: &str, upstreams: &Upstreams) {
    let mut last: Option<Ack> = None;
    loop {
        match read_grant(store, worker).await {
            Ok(grant) => {
                let grant = grant.unwrap_or_default();
                for upstream in upstreams.iter() {
                    upstream.limiter.resize(grant.upstreams.get(&upstream.name).copied().unwrap_or(0)).await;
                }
                let ack = Ack {
                    upstreams: upstreams.iter().map(|u| (u.name.clone(), u.limiter.size())).collect(),
                    wants: upstreams.iter().filter(|u| u.limiter.take_wanted()).map(|u| u.name.clone()).collect(),
                    released: false,
                };
                if last.as_ref() != Some(&ack) {
                    match write_ack(store, worker, &ack).await {
                        Ok(()) => last = Some(ack),
                        Err(error) => tracing::warn!(%error, "could not acknowledge the upstream grant"),
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "could not read the upstream grant"),
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Says that `worker` holds nothing any more (it is exiting).
pub async fn release(store: &dyn ObjectStore, worker: &str) {
    let ack = Ack { released: true, ..Ack::default() };
    if let Err(error) = write_ack(store, worker, &ack).await {
        tracing::warn!(%error, "could not release the upstream grant");
    }
}
