//! When a connection is idle: no request in progress on it. A connection idle for the
//! header deadline is closed, whatever its protocol and whatever arrives on it meanwhile:
//! a client that never speaks, a kept-alive HTTP/1.1 connection, and an HTTP/2
//! connection with no streams that answers the server's pings all count as idle. A
//! request is in progress from its head's arrival until its response's body has been
//! sent (or dropped), so a slow download is not idle.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// One connection's requests in progress, and since when it has had none.
#[derive(Debug)]
pub struct Activity {
    opened: Instant,
    in_progress: AtomicUsize,
    /// Since the opening, in milliseconds: when the last request in progress ended.
    idle_since_ms: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { opened: Instant::now(), in_progress: AtomicUsize::new(0), idle_since_ms: AtomicU64::new(0) })
    }

    /// A request began; it is in progress until the guard drops.
    pub fn begin(self: &Arc<Self>) -> InProgress {
        self.in_progress.fetch_add(1, Ordering::AcqRel);
        InProgress(self.clone())
    }

    /// Whether a request is in progress now.
    pub fn is_busy(&self) -> bool {
        self.in_progress.load(Ordering::Acquire) > 0
    }

    /// When the connection will have been idle for `limit`, unless a request begins
    /// (`None` while one is in progress).
    fn idle_deadline(&self, limit: Duration) -> Option<Instant> {
        if self.is_busy() {
            return None;
        }
        Some(self.opened + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire)) + limit)
    }

    /// Resolves once the connection has been idle for `limit` (checked again at each
    /// deadline, since a request may have come and gone meanwhile).
    pub async fn idle_for(&self, limit: Duration) {
        loop {
            match self.idle_deadline(limit) {
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => tokio::time::sleep(limit).await,
            }
        }
    }
}

/// A request in progress on its connection.
#[derive(Debug)]
pub struct InProgress(Arc<Activity>);

impl Drop for InProgress {
    fn drop(&mut self) {
        let activity = &self.0;
        let now = activity.opened.elapsed().as_millis() as u64;
        activity.idle_since_ms.fetch_max(now, Ordering::AcqRel);
        activity.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_from_its_opening_and_from_its_last_request() {
        let limit = Duration::from_secs(30);
        let activity = Activity::new();
        let opened = Instant::now();
        activity.idle_for(limit).await;
        assert_eq!(opened.elapsed(), limit, "a silent connection is idle from its opening");

        let request = activity.begin();
        tokio::time::advance(Duration::from_secs(100)).await;
        assert!(activity.idle_deadline(limit).is_none(), "busy however long the request takes");
        drop(request);
        let ended = Instant::now();
        activity.idle_for(limit).await;
        assert_eq!(ended.elapsed(), limit, "idle again from the end of the last request");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_comes_and_goes_while_waiting_moves_the_deadline() {
        let limit = Duration::from_secs(30);
        let activity = Activity::new();
        let opened = Instant::now();
        let waiting = {
            let activity = activity.clone();
            tokio::spawn(async move { activity.idle_for(limit).await })
        };
        tokio::time::advance(Duration::from_secs(20)).await;
        drop(activity.begin());
        waiting.await.unwrap();
        assert_eq!(opened.elapsed(), Duration::from_secs(50));
    }
}
