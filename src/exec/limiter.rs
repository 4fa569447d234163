//! An upstream's permits (requests in flight) in one process, with a target that may
//! change at any moment: the controller's grant on Kubernetes, the adaptive limit, or
//! none at all while interactive requests queue at the server (`crate::concurrency`).
//! Setting a target never waits: [`Limiter::apply`], a task of its own, adds permits at
//! once and takes them back as requests in flight finish; no line gets one meanwhile
//! ([`Limiter::acquire`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

pub struct Limiter {
    semaphore: Arc<Semaphore>,
    target: watch::Sender<u32>,
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
            wanted: AtomicBool::new(false),
            queued: AtomicU32::new(0),
            size: AtomicU32::new(permits),
        }
    }

    #[cfg(test)]
    fn semaphore(&self) -> &Arc<Semaphore> {
        &self.semaphore
    }

    /// Whether a finished line's permit may go straight to the next line of the same
    /// shard: not while permits are taken back, nor while other lines wait for one
    /// (they get it in turn, so that no shard keeps the permits it has).
    pub fn may_reuse(&self) -> bool {
        self.size() <= self.target() && self.queued.load(Ordering::Relaxed) == 0
    }

    /// A permit for a line, in turn. While there are more permits than the target, one
    /// that comes free goes to the shrink, whoever waited for it: the semaphore hands a
    /// freed permit to the first in its queue, and lines that queued before the shrink's
    /// own wait took half of those freed, so that a batch cut to make room for users
    /// sent a line for every two that finished (19 lines in 1.5 s after users came to
    /// the family's CPU-like server, where the cut said none).
    pub async fn acquire(&self) -> OwnedSemaphorePermit {
        loop {
            let permit = self.semaphore.clone().acquire_owned().await.expect("limiters are never closed");
            if !self.retire_one() {
                return permit;
            }
            permit.forget();
        }
    }

    /// Counts one permit out of existence if there are more than the target; its holder
    /// then forgets it.
    fn retire_one(&self) -> bool {
        let target = self.target();
        self.size.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |size| (size > target).then(|| size - 1)).is_ok()
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
                // Added, not set: a line may have retired one since `size` was read
                // (under a lower target, since raised).
                self.size.fetch_add(to - size, Ordering::Relaxed);
                continue;
            }
            if to == size {
                if target.changed().await.is_err() {
                    return;
                }
                continue;
            }
            tokio::select! {
                permit = self.semaphore.acquire() => {
                    let permit = permit.expect("limiters are never closed");
                    // A line may have retired the last one over the target meanwhile.
                    if self.retire_one() {
                        permit.forget();
                    }
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

    #[tokio::test]
    async fn a_line_that_waited_before_a_shrink_gets_no_permit_until_the_shrink_is_done() {
        let limiter = Arc::new(Limiter::new(2));
        let held: Vec<_> = (0..2).map(|_| limiter.semaphore().clone().try_acquire_owned().unwrap()).collect();
        let line = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let applying = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.apply().await }
        });
        limiter.set_target(1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!limiter.may_reuse(), "two permits for a target of one");

        let mut held = held.into_iter();
        drop(held.next());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!line.is_finished(), "the first permit freed goes to the shrink, though the line queued first");
        assert_eq!((limiter.size(), limiter.in_flight()), (1, 1));

        drop(held.next());
        let permit = tokio::time::timeout(Duration::from_secs(1), line).await.expect("the line gets the next").unwrap();
        assert_eq!((limiter.size(), limiter.in_flight()), (1, 1));
        drop(permit);
        applying.abort();
    }
}
