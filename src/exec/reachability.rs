//! Whether an upstream takes connections. A line whose connection was refused never
//! reached the model server, so it cannot have been paid for, and sending it again is
//! safe. While an upstream has refused every connection for less than [`PATIENCE`] (a
//! model server restarting, a Service whose new endpoint is not programmed yet), such
//! an attempt does not count against the line's attempts: the line waits, holding its
//! permit, so that a batch's lines wait for the server instead of failing at the pace
//! connections are refused. Past that, refusals count, and the lines of a batch pointed
//! at a server that is gone fail as any other exhausted line.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::backoff::Backoff;

/// How long an upstream may refuse every connection before refusals count as attempts.
pub const PATIENCE: Duration = Duration::from_secs(600);
/// The longest wait between two connections tried while an upstream refuses them:
/// a refused connection costs the server nothing, and a server back takes lines soon.
pub const MAX_PAUSE: Duration = Duration::from_secs(5);

/// Since when an upstream has refused every connection, shared by its lines.
#[derive(Debug, Default)]
pub struct Reachability {
    /// Whether `refusing_since` is set: what every answered request reads, without a lock.
    refusing: AtomicBool,
    refusing_since: Mutex<Option<Instant>>,
}

impl Reachability {
    /// A connection was made, whatever came of it.
    pub fn reached(&self, upstream: &str) {
        if !self.refusing.load(Ordering::Relaxed) {
            return;
        }
        let mut refusing_since = self.refusing_since.lock().expect("never poisoned");
        self.refusing.store(false, Ordering::Relaxed);
        if let Some(since) = refusing_since.take() {
            tracing::info!(upstream, after = ?since.elapsed(), "upstream takes connections again");
        }
    }

    /// A connection was refused at `now`: whether the attempt counts against the line.
    pub fn refused(&self, upstream: &str, now: Instant) -> bool {
        let mut refusing_since = self.refusing_since.lock().expect("never poisoned");
        if refusing_since.is_none() {
            tracing::warn!(upstream, patience = ?PATIENCE, "upstream refuses connections; its lines wait for it");
        }
        self.refusing.store(true, Ordering::Relaxed);
        counts(*refusing_since.get_or_insert(now), now)
    }
}

/// Whether a refusal at `now` counts, the upstream refusing since `since`.
fn counts(since: Instant, now: Instant) -> bool {
    now.saturating_duration_since(since) >= PATIENCE
}

/// The wait after the `refusals`-th refusal of a line that did not count.
pub fn pause(backoff: Backoff, refusals: u32, jitter: f64) -> Duration {
    backoff.delay(refusals, None, jitter).min(MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_count_only_once_the_upstream_has_refused_for_the_patience() {
        let reachability = Reachability::default();
        let start = Instant::now();
        assert!(!reachability.refused("u", start), "the first refusal waits");
        assert!(!reachability.refused("u", start + PATIENCE - Duration::from_secs(1)));
        assert!(reachability.refused("u", start + PATIENCE), "refusing for the patience: counted");
        reachability.reached("u");
        assert!(!reachability.refused("u", start + PATIENCE * 2), "reached since: patience again");
    }

    #[test]
    fn the_pause_grows_and_stays_short() {
        let backoff = Backoff { base: Duration::from_millis(100), ..Backoff::default() };
        assert_eq!(pause(backoff, 1, 1.0), Duration::from_millis(100));
        assert_eq!(pause(backoff, 3, 1.0), Duration::from_millis(400));
        assert_eq!(pause(backoff, 30, 1.0), MAX_PAUSE);
    }
}
