//! The worker's side: applies its grant as it changes and acknowledges what it holds,
//! which upstreams it has lines for and the tokens it spent; releases everything when
//! the worker ends.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Ack, BEAT, Observation, TokenUse, read_ack, read_grant, write_ack};
use crate::clock;
use crate::exec::ExecContext;
use crate::exec::upstream::Upstreams;

/// How often a worker writes its acknowledgment even when nothing changed: two runs of
/// one Job (a pod given up on, still running, and its replacement) share it, and the
/// live one's must not stay overwritten by the other's.
pub const ACK_AGAIN_EVERY: Duration = Duration::from_secs(5);

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
    /// Follows the grant forever, on the [`BEAT`] (the caller stops it by dropping it).
    pub async fn follow(&self) {
        let (store, upstreams, quota) = (self.exec.store.as_ref(), &self.exec.upstreams, &self.exec.quota);
        let mut last: Option<(Ack, tokio::time::Instant)> = None;
        loop {
            // Before the grant is read, whose answer takes its own time: the view is of
            // the beat's half second, as the other pods' are.
            let observed = observed(upstreams);
            match read_grant(store, self.worker).await {
                Ok(grant) => {
                    let grant = grant.unwrap_or_default();
                    // The upstreams' control loops apply it (`crate::exec::permits`).
                    for upstream in upstreams.iter() {
                        let granted = grant.upstreams.get(&upstream.name).copied().unwrap_or(0);
                        upstream.control.grant.store(granted, Ordering::Relaxed);
                        let sharing = grant.sharing.get(&upstream.name).copied().unwrap_or(1);
                        upstream.control.sharing.store(sharing, Ordering::Relaxed);
                        let turn = grant.turn.get(&upstream.name).copied().unwrap_or(0);
                        upstream.control.turn.store(turn, Ordering::Relaxed);
                        let users = grant.users.get(&upstream.name).copied().unwrap_or(u64::MAX);
                        upstream.control.users.store(users, Ordering::Relaxed);
                    }
                    if let Some(tokens) = grant.tokens.filter(|tokens| tokens.run == self.run) {
                        quota.grant(tokens.allowance, tokens.exhausted);
                    }
                    let ack = Ack {
                        // What it may be using: the permits it has, or the grant it may
                        // take up at any moment.
                        upstreams: upstreams
                            .iter()
                            .map(|u| (u.name.clone(), u.limiter.size().max(u.control.grant.load(Ordering::Relaxed))))
                            .collect(),
                        observed,
                        wants: upstreams.iter().filter(|u| u.limiter.take_wanted()).map(|u| u.name.clone()).collect(),
                        released: false,
                        run: self.run.clone(),
                        tokens: quota.is_granted().then(|| TokenUse {
                            base: self.base_tokens,
                            spent: quota.spent(),
                            waiting: quota.waiting(),
                        }),
                    };
                    let fresh =
                        last.as_ref().is_some_and(|(written, at)| *written == ack && at.elapsed() < ACK_AGAIN_EVERY);
                    if !fresh {
                        match write_ack(store, self.worker, &ack).await {
                            Ok(()) => last = Some((ack, tokio::time::Instant::now())),
                            Err(error) => tracing::warn!(%error, "could not acknowledge the grant"),
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "could not read the grant"),
            }
            next_beat().await;
        }
    }

    /// Says that this run holds nothing any more (it is exiting), with what it spent;
    /// unless another run of the same Job is live and acknowledged last (this one was
    /// superseded by it): releasing would take that run's grant away.
    pub async fn release(&self) {
        // On the next beat, as the others acknowledge: written now, it would replace this
        // beat's acknowledgment before the controller combined its view with theirs.
        next_beat().await;
        let store = self.exec.store.as_ref();
        if let Ok(Some(current)) = read_ack(store, self.worker).await
            && current.run != self.run
            && !current.released
        {
            return;
        }
        let quota = &self.exec.quota;
        // With what it saw of the servers since its last acknowledgment: its last lines
        // are in the other workers' views for a while yet, and the users the controller
        // sums from them would be those lines ([`crate::concurrency::view::users`]).
        let ack = Ack {
            released: true,
            observed: observed(&self.exec.upstreams),
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

/// Waits for the next [`BEAT`] of the wall clock.
async fn next_beat() {
    tokio::time::sleep(clock::until_beat(clock::since_epoch(), BEAT, Duration::ZERO)).await;
}

/// What the worker saw of each upstream since its last acknowledgment, stamped with the
/// beat nearest now (it is taken on one).
fn observed(upstreams: &Upstreams) -> BTreeMap<String, Observation> {
    let until = clock::nearest_beat(clock::since_epoch(), BEAT);
    upstreams
        .iter()
        .map(|u| {
            let observation = Observation {
                counts: u.observed.counts(),
                in_flight: u.limiter.in_flight(),
                signal_stale: u.control.signal_stale.load(Ordering::Relaxed),
                filling: u.control.filling.load(Ordering::Relaxed),
                view: u.observed.take_view(until),
            };
            (u.name.clone(), observation)
        })
        .collect()
}
