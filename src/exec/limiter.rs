//! An upstream's permits (requests in flight) in one process, with a target that may
//! change at any moment: the controller's grant on Kubernetes, the adaptive limit, or
//! none at all while interactive requests queue at the server (`crate::concurrency`).
//! Setting a target never waits: [`Limiter::apply`], a task of its own, adds permits at
//! once and takes them back as requests in flight finish.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::{Semaphore, watch};

pub struct Limiter {
    semaphore: Arc<Semaphore>,
    target: watch::Sender<u32>,
    /// Set while permits are being taken back: a finished line's permit must then go
    /// back to the semaphore, not straight to the next line.
    shrinking: AtomicBool,
    /// A line waited for this upstream since the last [`Limiter::take_wanted`].
    wanted: AtomicBool,
    /// Lines waiting for a permit now: a shard with a spare one lets them have it.
    queued: AtomicU32,
    /// Permits that exist (handed out or not).
    size: AtomicU32,
}

impl Limiter {
    pub fn new(permits: u32) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(permits as usize)),
            target: watch::Sender::new(permits),
            shrinking: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            queued: AtomicU32::new(0),
            size: AtomicU32::new(permits),
        }
    }

    pub fn semaphore(&self) -> &Arc<Semaphore> {
        &self.semaphore
    }

    /// Whether a finished line's permit may go straight to the next line of the same
    /// shard: not while permits are taken back, nor while other lines wait for one
    /// (they get it in turn, so that no shard keeps the permits it has).
    pub fn may_reuse(&self) -> bool {
        !self.shrinking.load(Ordering::Relaxed) && self.queued.load(Ordering::Relaxed) == 0
    }

    /// Notes that a line is waiting to be sent to this upstream.
    pub fn want(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// Counts a line as waiting for a permit while the guard lives.
    pub fn queue(&self) -> Queued<'_> {
        self.queued.fetch_add(1, Ordering::Relaxed);
        Queued(self)
    }

    /// Whether lines wanted this upstream since the last call, or requests are in
    /// flight to it.
    pub fn take_wanted(&self) -> bool {
        self.wanted.swap(false, Ordering::Relaxed) || self.in_flight() > 0
    }

    /// Permits that exist now (in use or free).
    pub fn size(&self) -> u32 {
        self.size.load(Ordering::Relaxed)
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u32 {
        self.size().saturating_sub(self.semaphore.available_permits() as u32)
    }

    pub fn target(&self) -> u32 {
        *self.target.borrow()
    }

    /// Aims at `to` permits; [`Limiter::apply`] gets there.
    pub fn set_target(&self, to: u32) {
        self.target.send_if_modified(|target| std::mem::replace(target, to) != to);
    }

    /// Makes the permits follow the target, forever: growing at once, shrinking as
    /// requests in flight finish (new ones wait meanwhile).
    pub async fn apply(&self) {
        let mut target = self.target.subscribe();
        loop {
            let to = *target.borrow_and_update();
            let size = self.size();
            if to > size {
                self.semaphore.add_permits((to - size) as usize);
                self.size.store(to, Ordering::Relaxed);
                continue;
            }
            self.shrinking.store(to < size, Ordering::Relaxed);
            if to == size {
                if target.changed().await.is_err() {
                    return;
                }
                continue;
            }
            tokio::select! {
                permit = self.semaphore.acquire() => {
                    permit.expect("limiters are never closed").forget();
                    self.size.fetch_sub(1, Ordering::Relaxed);
                }
                changed = target.changed() => if changed.is_err() { return },
            }
        }
    }
}

/// A line waiting for a permit (see [`Limiter::queue`]).
pub struct Queued<'a>(&'a Limiter);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_limiter_grows_at_once_and_shrinks_once_lines_in_flight_finish() {
        let limiter = Arc::new(Limiter::new(0));
        let applying = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.apply().await }
        });
        assert_eq!(limiter.semaphore().available_permits(), 0, "a worker without a grant sends nothing");
        limiter.set_target(3);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let held: Vec<_> = (0..3).map(|_| limiter.semaphore().clone().try_acquire_owned().unwrap()).collect();
        assert_eq!(limiter.in_flight(), 3);
        assert!(limiter.take_wanted(), "requests in flight: the upstream is wanted");

        limiter.set_target(1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(limiter.size(), 3, "three are in flight: the shrink waits for them");
        assert!(!limiter.may_reuse(), "meanwhile a finished line's permit goes back");
        drop(held);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!((limiter.size(), limiter.semaphore().available_permits()), (1, 1));
        assert!(limiter.may_reuse());
        assert!(!limiter.take_wanted(), "nothing in flight and nobody waited");
        limiter.want();
        assert!(limiter.take_wanted());

        // A shrink to nothing that is called off half way grows again at once.
        let held = limiter.semaphore().clone().try_acquire_owned().unwrap();
        limiter.set_target(0);
        tokio::time::sleep(Duration::from_millis(20)).await;
        limiter.set_target(5);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!((limiter.size(), limiter.semaphore().available_permits()), (5, 4));
        drop(held);
        let waiting = limiter.queue();
        assert!(!limiter.may_reuse(), "a line waits: spares go back to the semaphore");
        drop(waiting);
        assert!(limiter.may_reuse());
        applying.abort();
    }
}
