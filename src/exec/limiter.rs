//! An upstream's permits (requests in flight) in one process, resizable while lines
//! run: on Kubernetes each worker pod holds a share of the upstream's limit, and the
//! controller changes that share as workers come and go (`crate::grants`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::Semaphore;

pub struct Limiter {
    semaphore: Arc<Semaphore>,
    /// Permits that exist (handed out or not): what the limiter allows.
    applied: tokio::sync::Mutex<u32>,
    /// Set while permits are being taken back: a finished line's permit must then go
    /// back to the semaphore, not straight to the next line.
    shrinking: AtomicBool,
    /// A line waited for this upstream since the last [`Limiter::take_wanted`].
    wanted: AtomicBool,
    /// The size as last applied, readable without the lock.
    size: AtomicU32,
}

impl Limiter {
    pub fn new(permits: u32) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(permits as usize)),
            applied: tokio::sync::Mutex::new(permits),
            shrinking: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            size: AtomicU32::new(permits),
        }
    }

    pub fn semaphore(&self) -> &Arc<Semaphore> {
        &self.semaphore
    }

    /// Whether a finished line's permit may go straight to the next line.
    pub fn may_reuse(&self) -> bool {
        !self.shrinking.load(Ordering::Relaxed)
    }

    /// Notes that a line is waiting to be sent to this upstream.
    pub fn want(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// Whether lines wanted this upstream since the last call, or requests are in
    /// flight to it.
    pub fn take_wanted(&self) -> bool {
        let in_flight = self.semaphore.available_permits() < self.size.load(Ordering::Relaxed) as usize;
        self.wanted.swap(false, Ordering::Relaxed) || in_flight
    }

    /// Permits that exist now.
    pub fn size(&self) -> u32 {
        self.size.load(Ordering::Relaxed)
    }

    /// Makes `to` permits exist: at once when growing; when shrinking, once enough of
    /// the requests in flight have finished (new ones wait meanwhile).
    pub async fn resize(&self, to: u32) {
        let mut applied = self.applied.lock().await;
        if to > *applied {
            self.semaphore.add_permits((to - *applied) as usize);
        } else if to < *applied {
            self.shrinking.store(true, Ordering::Relaxed);
            let taken = self.semaphore.acquire_many(*applied - to).await.expect("limiters are never closed");
            taken.forget();
            self.shrinking.store(false, Ordering::Relaxed);
        }
        *applied = to;
        self.size.store(to, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_limiter_grows_at_once_and_shrinks_once_lines_in_flight_finish() {
        let limiter = Arc::new(Limiter::new(0));
        assert_eq!(limiter.semaphore().available_permits(), 0, "a worker without a grant sends nothing");
        limiter.resize(3).await;
        let held: Vec<_> = (0..3).map(|_| limiter.semaphore().clone().try_acquire_owned().unwrap()).collect();
        assert!(limiter.take_wanted(), "requests in flight: the upstream is wanted");

        let shrink = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.resize(1).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!shrink.is_finished(), "three are in flight: the shrink waits");
        assert!(!limiter.may_reuse(), "meanwhile a finished line's permit goes back");
        drop(held);
        shrink.await.unwrap();
        assert_eq!((limiter.size(), limiter.semaphore().available_permits()), (1, 1));
        assert!(limiter.may_reuse());
        assert!(!limiter.take_wanted(), "nothing in flight and nobody waited");
        limiter.want();
        assert!(limiter.take_wanted());
    }
}
