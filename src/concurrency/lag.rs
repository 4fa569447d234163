//! Gauges that lag the server's answers: of this process's requests answered since, those
//! a reading still counts. SGLang's scheduler sets its gauges when it logs its stats, at
//! each prefill batch and every `decode_log_interval` (40) decode steps: a request that
//! finished stays counted until then, its answer long come. Taken for someone else's, a
//! batch alone there was a batch beside users, and left half the places empty for them
//! (62.6 of a simulated server's 128 held a step, against 120 with gauges set at every
//! step).
//! Pure: the caller passes the time, each reading's gauges and its own requests.
//!
//! The design: docs/src/night-shift-design.md#gauges-that-lag-the-answers

use std::time::{Duration, Instant};

/// A server whose gauges held still while this process's lines there fell by at least
/// [`LAG_EVIDENCE`] (answered, and not sent again), within this long, is taken to lag
/// its answers.
pub const LAGGED_WITHIN: Duration = Duration::from_secs(10);
/// Gauges that move with the server's steps hold still while lines leave only where as
/// many others came in the same moment, with the same KV cache in use: a line's place
/// taken by a user's now and then, two hardly ever.
pub const LAG_EVIDENCE: u32 = 2;

/// What a reading's gauges say: requests running, queued, and the share of the KV cache
/// in use where the server says.
pub type Gauges = (f64, f64, Option<f64>);

#[derive(Clone, Debug, Default)]
pub struct Lag {
    /// The last reading's gauges.
    gauges: Option<Gauges>,
    /// This process's requests at the server when the gauges last moved, as far as
    /// readings tell.
    counted: u32,
    /// This process's requests at the server at the last reading.
    before: u32,
    /// The last reading whose gauges held still while this process's lines there fell
    /// by [`LAG_EVIDENCE`] or more.
    lagged: Option<Instant>,
}

impl Lag {
    /// Takes a reading in: its `gauges`, this process's requests at the server (`ours`),
    /// and whether the batch had the server to itself at the reading before (`alone`).
    /// Returns how many of this process's requests answered since the gauges still count.
    ///
    /// Gauges that move with every step (vLLM's: its KV cache's share moves whenever a
    /// token is decoded) count what the server had when they were read, and this process
    /// has `ours` of it: none is still counted. Gauges that held still while this
    /// process's lines there fell lag; they count what the server had when they last
    /// moved, when this process had the most of the readings on either side of it (the
    /// reading before, and the first to show them), and those of it answered since are
    /// still counted. So are they while the batch is alone, lag seen or not: gauges that
    /// move at each prefill batch, as SGLang's do, move at almost every reading while the
    /// batch's lines come and go, and hold still only once they stop. Beside users, a
    /// user hidden for a reading by a line answered as they came would leave the batch
    /// more room than is free; alone, the user is seen at the next reading, where a line
    /// answered taken for a user made the batch one beside users for the headroom's
    /// `RESERVE_OVER` (5 s).
    pub fn read(&mut self, now: Instant, gauges: Gauges, ours: u32, alone: bool) -> u32 {
        let still = self.gauges == Some(gauges);
        if still && self.before >= ours.saturating_add(LAG_EVIDENCE) {
            self.lagged = Some(now);
        }
        let lags = alone || self.lagged.is_some_and(|at| now.saturating_duration_since(at) <= LAGGED_WITHIN);
        self.counted = match (lags, still) {
            (false, _) => ours,
            (true, true) => self.counted,
            (true, false) => ours.max(self.before),
        };
        self.gauges = Some(gauges);
        self.before = ours;
        self.counted.saturating_sub(ours)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(50);

    #[test]
    fn gauges_that_move_with_every_step_count_what_this_process_has() {
        let (mut lag, t0) = (Lag::default(), Instant::now());
        // 128 lines, then 20 answered and not sent again: the gauges moved with them.
        assert_eq!(lag.read(t0, (128.0, 0.0, Some(0.50)), 128, false), 0);
        assert_eq!(lag.read(t0 + MS, (108.0, 0.0, Some(0.42)), 108, false), 0);
        // A line answered and a user come in its place, the cache as it was: the gauges
        // held still, and a line is no sign of a lag.
        assert_eq!(lag.read(t0 + 2 * MS, (108.0, 0.0, Some(0.42)), 107, false), 0);
        // Users came as 10 more lines were answered: the gauges moved, and count what
        // the server has now (the users' 10 are not hidden by the lines answered).
        assert_eq!(lag.read(t0 + 3 * MS, (108.0, 0.0, Some(0.45)), 97, false), 0);
    }

    #[test]
    fn gauges_that_held_still_while_lines_were_answered_still_count_them() {
        let (mut lag, t0) = (Lag::default(), Instant::now());
        assert_eq!(lag.read(t0, (128.0, 32.0, None), 160, false), 0);
        // 50 answered, the gauges as they were: a lag, and they still count the 50.
        assert_eq!(lag.read(t0 + MS, (128.0, 32.0, None), 110, false), 50);
        assert_eq!(lag.read(t0 + 2 * MS, (128.0, 32.0, None), 60, false), 100);
        // 100 sent again: the gauges do not count those yet, nor stop counting those
        // answered.
        assert_eq!(lag.read(t0 + 3 * MS, (128.0, 32.0, None), 160, false), 0);
        // They moved between this reading and the one before, when this process had 160
        // and now 150 (10 answered since): those 10 may be counted still.
        assert_eq!(lag.read(t0 + 4 * MS, (128.0, 22.0, None), 150, false), 10);
        // Long after the last sign of a lag, gauges that move count what this process has.
        let later = t0 + LAGGED_WITHIN + 5 * MS;
        assert_eq!(lag.read(later, (120.0, 0.0, None), 120, false), 0);
        assert_eq!(lag.read(later + MS, (110.0, 0.0, None), 110, false), 0);
    }

    #[test]
    fn alone_the_lines_answered_as_the_gauges_moved_may_be_counted() {
        let (mut lag, t0) = (Lag::default(), Instant::now());
        assert_eq!(lag.read(t0, (128.0, 32.0, Some(0.5)), 160, true), 0);
        // The gauges moved between the readings, when the batch had 160 and now 145:
        // the 15 answered may be counted still…
        assert_eq!(lag.read(t0 + MS, (128.0, 17.0, Some(0.4)), 145, true), 15);
        // … but not beside users, where a lag was never seen.
        let (mut beside, t0) = (Lag::default(), Instant::now());
        assert_eq!(beside.read(t0, (128.0, 32.0, Some(0.5)), 160, false), 0);
        assert_eq!(beside.read(t0 + MS, (128.0, 17.0, Some(0.4)), 145, false), 0);
    }
}
