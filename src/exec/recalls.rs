//! An upstream's requests in flight, youngest last, so that the youngest can be taken
//! back from the server's queue when its users come (how many:
//! [`crate::concurrency::recall`]). A request taken back hangs up; its line is sent
//! again later ([`super::worker`]). Kept only for upstreams with a load signal from a
//! server that drops a request whose client hung up
//! ([`ServerKind::drops_hung_up`](crate::concurrency::presets::ServerKind::drops_hung_up)):
//! the others never take a line back, and pay nothing for it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// A request taken back still counts as the batch's at the server for this long (its
/// guard at the upstream is held): the server drops it at its next step or so, and until
/// it has, the request would look like someone else's, a user who came, to the next
/// readings.
pub const GOING_FOR: Duration = Duration::from_millis(250);

#[derive(Default)]
pub struct Recalls {
    enabled: AtomicBool,
    next: AtomicU64,
    in_flight: Mutex<BTreeMap<u64, CancellationToken>>,
}

/// A request in flight that may be taken back, while it lives.
pub struct Ticket<'a> {
    recalls: &'a Recalls,
    entry: Option<(u64, CancellationToken)>,
}

impl Recalls {
    /// Requests may be taken back (`enabled`: the upstream's load signal tells when, and
    /// its server drops them) or not.
    pub fn new(enabled: bool) -> Self {
        Self { enabled: AtomicBool::new(enabled), ..Self::default() }
    }

    /// Requests may be taken back from now on: a load signal was found at a server that
    /// drops them.
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Relaxed);
    }

    /// Enters a request sent now, the youngest.
    pub fn enter(&self) -> Ticket<'_> {
        let entry = self.enabled.load(Ordering::Relaxed).then(|| {
            let seq = self.next.fetch_add(1, Ordering::Relaxed);
            let token = CancellationToken::new();
            self.lock().insert(seq, token.clone());
            (seq, token)
        });
        Ticket { recalls: self, entry }
    }

    /// Takes back the youngest `lines` requests in flight; returns how many there were.
    pub fn take_back(&self, lines: u32) -> u32 {
        if lines == 0 {
            return 0;
        }
        let mut in_flight = self.lock();
        let mut taken = 0;
        while taken < lines
            && let Some((_, token)) = in_flight.pop_last()
        {
            token.cancel();
            taken += 1;
        }
        taken
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, CancellationToken>> {
        self.in_flight.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Ticket<'_> {
    /// Resolves when the request is taken back (never where none can be).
    pub async fn taken_back(&self) {
        match &self.entry {
            Some((_, token)) => token.cancelled().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some((seq, _)) = self.entry.take() {
            self.recalls.lock().remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_youngest_are_taken_back() {
        let recalls = Recalls::new(true);
        let mut tickets: Vec<_> = (0..6).map(|_| recalls.enter()).collect();
        // 3 is answered: in flight, oldest first, 0, 1, 2, 4, 5.
        drop(tickets.remove(3));
        assert_eq!(recalls.take_back(3), 3);
        // 5, 4 and 2 hang up; 0 and 1 do not.
        for at in [4, 3, 2] {
            tickets[at].taken_back().await;
        }
        for at in [0, 1] {
            let untouched = tokio::time::timeout(Duration::from_millis(10), tickets[at].taken_back()).await;
            assert!(untouched.is_err(), "{at} is not taken back");
        }
        // Asked for 5, the two left go.
        assert_eq!(recalls.take_back(5), 2);
        assert_eq!(recalls.take_back(1), 0);
    }

    #[tokio::test]
    async fn an_upstream_without_a_signal_keeps_nothing() {
        let recalls = Recalls::new(false);
        let ticket = recalls.enter();
        assert_eq!(recalls.take_back(1), 0);
        let taken = tokio::time::timeout(Duration::from_millis(10), ticket.taken_back()).await;
        assert!(taken.is_err(), "never taken back");
    }
}
