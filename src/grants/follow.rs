//! The worker's side: applies its grant as it changes and acknowledges what it holds,
//! which upstreams it has lines for and the tokens it spent; releases everything when
//! the worker ends.

use std::time::Duration;

use super::{Ack, TokenUse, read_grant, write_ack};
use crate::exec::ExecContext;

/// How often a worker looks at its grant.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// One run of a worker, as it follows its grant.
pub struct Run<'a> {
    pub exec: &'a ExecContext,
    /// Its Job's name.
    pub worker: &'a str,
    /// Unique to this pod.
    pub run: String,
    /// Tokens its shard had committed when it started.
    pub base_tokens: u64,
}

impl Run<'_> {
    /// Follows the grant forever (the caller stops it by dropping it).
    pub async fn follow(&self) {
        let (store, upstreams, quota) = (self.exec.store.as_ref(), &self.exec.upstreams, &self.exec.quota);
        let mut last: Option<Ack> = None;
        loop {
            match read_grant(store, self.worker).await {
                Ok(grant) => {
                    let grant = grant.unwrap_or_default();
                    for upstream in upstreams.iter() {
                        upstream.limiter.resize(grant.upstreams.get(&upstream.name).copied().unwrap_or(0)).await;
                    }
                    if let Some(tokens) = grant.tokens.filter(|tokens| tokens.run == self.run) {
                        quota.grant(tokens.allowance, tokens.exhausted);
                    }
                    let ack = Ack {
                        upstreams: upstreams.iter().map(|u| (u.name.clone(), u.limiter.size())).collect(),
                        wants: upstreams.iter().filter(|u| u.limiter.take_wanted()).map(|u| u.name.clone()).collect(),
                        released: false,
                        run: self.run.clone(),
                        tokens: quota.is_granted().then(|| TokenUse {
                            base: self.base_tokens,
                            spent: quota.spent(),
                            waiting: quota.waiting(),
                        }),
                    };
                    if last.as_ref() != Some(&ack) {
                        match write_ack(store, self.worker, &ack).await {
                            Ok(()) => last = Some(ack),
                            Err(error) => tracing::warn!(%error, "could not acknowledge the grant"),
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "could not read the grant"),
            }
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
    }

    /// Says that this run holds nothing any more (it is exiting), with what it spent.
    pub async fn release(&self) {
        let quota = &self.exec.quota;
        let ack = Ack {
            released: true,
            run: self.run.clone(),
            tokens: quota.is_granted().then(|| TokenUse {
                base: self.base_tokens,
                spent: quota.spent(),
                waiting: false,
            }),
            ..Ack::default()
        };
        if let Err(error) = write_ack(self.exec.store.as_ref(), self.worker, &ack).await {
            tracing::warn!(%error, "could not release the grant");
        }
    }
}
