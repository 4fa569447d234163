//! A load signal that has gone stale, to be set aside, and one that fails for a while.
//! Pure: each reading in, whether to believe it out; each failure in, whether the last
//! reading believed still holds.
//!
//! The design: docs/src/night-shift-design.md#staleness-a-signal-not-to-believe

use std::time::{Duration, Instant};

/// How long the same answer may come back while lines finish.
pub const SAME_SAMPLE_AFTER: Duration = Duration::from_secs(10);
/// Lines of this process that must finish meanwhile for the same answer to be stale.
pub const SAME_SAMPLE_LINES: u64 = 8;
/// The longest a reading that does not change may hold a batch back.
pub const MAX_HOLD: Duration = Duration::from_secs(60);
/// How long what the last reading believed said holds through readings that fail (no
/// answer in time, an error, an answer that makes no sense). A server too busy to
/// answer its metrics in time is busy, not empty: released at the first failure, a batch
/// held beside users would flood them while the server is slowest to answer.
pub const FAILED_HOLD: Duration = Duration::from_secs(10);

/// What one reading is, for the staleness rules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// A digest of the whole answer.
    pub digest: u64,
    /// The numbers read from it: waiting, running, KV-cache usage (as bits, to compare).
    pub numbers: [u64; 3],
    /// Whether the reading holds the batch back (a queue, or a full cache).
    pub holding: bool,
    /// This process's lines finished at the upstream so far (a counter).
    pub finished: u64,
}

#[derive(Clone, Debug, Default)]
pub struct Staleness {
    /// The last answer's digest, since when it has come back, and the lines finished then.
    same: Option<(u64, Instant, u64)>,
    /// The numbers of a reading that holds the batch, and since when they have.
    held: Option<([u64; 3], Instant)>,
    /// The last reading believed.
    believed: Option<Instant>,
}

/// Why a signal is set aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stale {
    SameSample,
    FrozenHold,
}

impl Staleness {
    /// Judges `sample`, read at `now`: `Some` when it is to be set aside.
    pub fn judge(&mut self, now: Instant, sample: Sample) -> Option<Stale> {
        let same = match self.same {
            Some((digest, since, finished)) if digest == sample.digest => (digest, since, finished),
            _ => (sample.digest, now, sample.finished),
        };
        self.same = Some(same);
        let held = match (self.held, sample.holding) {
            (_, false) => None,
            (Some((numbers, since)), true) if numbers == sample.numbers => Some((numbers, since)),
            (_, true) => Some((sample.numbers, now)),
        };
        self.held = held;
        let (_, since, finished_then) = same;
        if now.duration_since(since) >= SAME_SAMPLE_AFTER
            && sample.finished.saturating_sub(finished_then) >= SAME_SAMPLE_LINES
        {
            self.believed = None;
            return Some(Stale::SameSample);
        }
        if held.is_some_and(|(_, since)| now.duration_since(since) >= MAX_HOLD) {
            self.believed = None;
            return Some(Stale::FrozenHold);
        }
        self.believed = Some(now);
        None
    }

    /// Whether a reading that failed at `now` leaves what the last reading believed said
    /// in place: for [`FAILED_HOLD`] after it, and never without one (a signal that
    /// never answered, or was set aside since, holds nothing).
    pub fn holds_through_failure(&self, now: Instant) -> bool {
        self.believed.is_some_and(|at| now.saturating_duration_since(at) < FAILED_HOLD)
    }
}

/// A digest of an answer's bytes (not cryptographic: it tells a repeat from a change).
pub fn digest(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(digest: u64, waiting: u64, holding: bool, finished: u64) -> Sample {
        Sample { digest, numbers: [waiting, 0, 0], holding, finished }
    }

    /// Readings every 100 ms for `seconds`, each made by `at(elapsed, n)`; the verdicts.
    fn run(seconds: u64, at: impl Fn(Duration, u64) -> Sample) -> Vec<Option<Stale>> {
        let (mut staleness, start) = (Staleness::default(), Instant::now());
        (0..seconds * 10)
            .map(|n| {
                let elapsed = Duration::from_millis(100 * n);
                staleness.judge(start + elapsed, at(elapsed, n))
            })
            .collect()
    }

    #[test]
    fn a_live_signal_is_never_stale_however_long_it_holds() {
        // Its counters move every reading; its queue moves now and then.
        let verdicts = run(300, |_, n| sample(n, 3 + (n / 50) % 2, true, n / 10));
        assert!(verdicts.iter().all(Option::is_none));
    }

    #[test]
    fn the_same_answer_while_lines_finish_is_stale_after_a_while_and_fresh_once_it_changes() {
        // Lines finish (one a reading), the answer never changes until 20 s, then does.
        let verdicts = run(25, |elapsed, n| sample(u64::from(elapsed >= Duration::from_secs(20)) * n, 0, false, n));
        let first = verdicts.iter().position(Option::is_some).unwrap();
        assert_eq!(first, 100, "stale after {SAME_SAMPLE_AFTER:?}");
        assert!(verdicts[first..200].iter().all(|v| *v == Some(Stale::SameSample)));
        assert!(verdicts[200..].iter().all(Option::is_none), "fresh again once the answer moves");
    }

    #[test]
    fn the_same_answer_while_nothing_of_ours_finishes_is_a_quiet_server() {
        let verdicts = run(120, |_, _| sample(7, 0, false, 0));
        assert!(verdicts.iter().all(Option::is_none));
    }

    #[test]
    fn a_hold_whose_numbers_never_move_is_bounded() {
        // Counters move (another model's traffic), the queue it reports is stuck at 5.
        let verdicts = run(90, |_, n| sample(n, 5, true, 0));
        let first = verdicts.iter().position(Option::is_some).unwrap();
        assert_eq!(first, 600, "held for {MAX_HOLD:?} at most");
        assert!(verdicts[first..].iter().all(|v| *v == Some(Stale::FrozenHold)));
        // A queue that moved at 30 s may hold until 90 s.
        let moved = run(90, |elapsed, n| sample(n, if elapsed < Duration::from_secs(30) { 5 } else { 6 }, true, 0));
        assert!(moved.iter().all(Option::is_none));
    }

    #[test]
    fn failures_hold_the_last_reading_believed_for_a_while_and_nothing_without_one() {
        let (mut staleness, start) = (Staleness::default(), Instant::now());
        assert!(!staleness.holds_through_failure(start), "a signal that never answered holds nothing");
        staleness.judge(start, sample(1, 3, true, 0));
        assert!(staleness.holds_through_failure(start + Duration::from_secs(1)));
        assert!(staleness.holds_through_failure(start + FAILED_HOLD - Duration::from_millis(1)));
        assert!(!staleness.holds_through_failure(start + FAILED_HOLD), "held for {FAILED_HOLD:?} at most");
        // A reading believed again starts the hold again; one set aside ends it.
        let later = start + Duration::from_secs(30);
        staleness.judge(later, sample(2, 3, true, 0));
        assert!(staleness.holds_through_failure(later + Duration::from_secs(5)));
        let frozen = later + MAX_HOLD;
        assert_eq!(staleness.judge(frozen, sample(3, 3, true, 0)), Some(Stale::FrozenHold));
        assert!(!staleness.holds_through_failure(frozen), "a signal set aside holds nothing");
    }
}
