//! The load signal's hold on batch dispatch: a cap on an upstream's batch requests in
//! flight, cut when the server says requests queue and grown back while they don't.
//! The server's queue is the congestion signal, as ECN marks are to TCP. Pure: the
//! caller passes the time, the reading and its own requests in flight.
//!
//! - **queueing**, seen by two readings in a row (a request waits for the next step of
//!   even an idle server, and one reading may catch it; a queue lasts; the first reading
//!   only stops new lines until the next one): the cap drops
//!   under the requests in flight at once, by a tenth, or
//!   by as many as wait past the threshold when that is more; no batch line is sent
//!   until they drain below it. Readings that stay busy cut again only once the lines
//!   in flight have come down to the cap (an earlier cut still takes effect as lines
//!   finish; cutting again then would only count it twice).
//! - **drained**: while the batch uses it, the cap grows back fast towards the requests in
//!   flight when the queue began (closing [`RECOVERY_PER_SEC`] of the gap a second), then
//!   by [`PROBE_PER_SEC`] past them, as CUBIC and BIC do in TCP: the batch spends its time
//!   just under the point where the queue began, and reaches past it rarely and slowly.
//!   The cap goes away once it reaches the limit the throughput rule gives.
//!
//! Without a reading (no load signal, or a failing one), nothing is held.

use std::time::{Duration, Instant};

/// A queue cuts the cap to at most this share of the batch
/// requests in flight.
pub const CUT: f64 = 0.9;
/// While nothing queues, the cap closes this share of its gap to the requests in flight
/// when the queue began, a second (as long as it is used)…
pub const RECOVERY_PER_SEC: f64 = 2.0;
/// … and grows at least this much a second.
pub const PROBE_PER_SEC: f64 = 0.5;
/// Growth counts at most this much time between two readings (a stalled loop does not
/// release a burst).
const MAX_GAP: Duration = Duration::from_secs(1);

/// What one reading of the load signal says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pressure {
    /// Nothing queues (or the reading failed: batches go on without it).
    Clear,
    /// Requests queue, this many past the threshold (0 when only the KV cache is full).
    Queueing { over: f64 },
}

#[derive(Clone, Debug, Default)]
pub struct Gate {
    cap: Option<f64>,
    /// What the reading before this one said was over the threshold, if anything.
    before: Option<f64>,
    /// Batch requests in flight when the queue began, last time.
    queued_at: f64,
    last: Option<Instant>,
}

impl Gate {
    /// The cap on batch requests in flight now (`None`: no cap).
    pub fn cap(&self) -> Option<u32> {
        self.cap.map(|cap| cap.floor() as u32)
    }

    /// Takes a reading in, with this process's batch requests `in_flight` and the
    /// throughput rule's `limit`; returns the cap.
    pub fn read(&mut self, now: Instant, pressure: Pressure, in_flight: u32, limit: u32) -> Option<u32> {
        let gap = self.last.map_or(Duration::ZERO, |last| now.saturating_duration_since(last)).min(MAX_GAP);
        self.last = Some(now);
        let in_flight = f64::from(in_flight);
        // A request waits at the server until its next step, however idle it is: a
        // queue counts once two readings in a row see it (what both saw). The first
        // only stops new lines until the next.
        let seen = match pressure {
            Pressure::Queueing { over } => Some(over),
            Pressure::Clear => None,
        };
        let pressure = match (std::mem::replace(&mut self.before, seen), seen) {
            (Some(before), Some(now)) => Pressure::Queueing { over: before.min(now) },
            (None, Some(_)) => {
                self.cap = Some(self.cap.map_or(in_flight, |cap| cap.min(in_flight)));
                return self.cap();
            }
            _ => Pressure::Clear,
        };
        match pressure {
            // Lines over the cap are still finishing: the cut already made takes effect.
            Pressure::Queueing { .. } if self.cap.is_some_and(|cap| in_flight > cap.floor()) => {}
            Pressure::Queueing { over } => {
                let cut = (in_flight * CUT).floor().min((in_flight - over.ceil()).max(0.0));
                self.cap = Some(self.cap.map_or(cut, |cap| cap.min(cut)));
                self.queued_at = in_flight;
            }
            Pressure::Clear => {
                if let Some(cap) = self.cap
                    && in_flight + 1.0 >= cap
                {
                    let rate = ((self.queued_at - cap) * RECOVERY_PER_SEC).max(PROBE_PER_SEC);
                    let grown = cap + rate * gap.as_secs_f64();
                    self.cap = (grown < f64::from(limit)).then_some(grown);
                }
            }
        }
        self.cap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u32 = 64;
    const QUEUE: Pressure = Pressure::Queueing { over: 0.0 };

    struct Readings {
        gate: Gate,
        now: Instant,
    }

    impl Readings {
        fn new() -> Self {
            Self { gate: Gate::default(), now: Instant::now() }
        }

        /// A reading 250 ms after the last one.
        fn read(&mut self, pressure: Pressure, in_flight: u32) -> Option<u32> {
            self.now += Duration::from_millis(250);
            self.gate.read(self.now, pressure, in_flight, LIMIT)
        }

        /// Two readings in a row that see a queue: the second one cuts.
        fn queue(&mut self, over: f64, in_flight: u32) -> Option<u32> {
            self.read(Pressure::Queueing { over }, in_flight);
            self.read(Pressure::Queueing { over }, in_flight)
        }
    }

    #[test]
    fn a_queue_two_readings_see_cuts_under_the_lines_in_flight_by_a_tenth_or_by_what_waits() {
        let cases = [
            // (in flight, requests waiting past the threshold, cap)
            (20, 0.0, 18),
            (20, 1.0, 18),
            (20, 5.0, 15),
            (20, 2.5, 17),
            (20, 30.0, 0),
            (5, 0.0, 4),
            (1, 0.0, 0),
            (0, 0.0, 0),
        ];
        for (in_flight, over, cap) in cases {
            let mut readings = Readings::new();
            assert_eq!(readings.queue(over, in_flight), Some(cap), "{in_flight} in flight, {over} over");
        }
        // Of two readings, the smaller queue counts.
        let mut readings = Readings::new();
        readings.read(Pressure::Queueing { over: 9.0 }, 20);
        assert_eq!(readings.read(Pressure::Queueing { over: 4.0 }, 20), Some(16));
    }

    #[test]
    fn nothing_is_held_until_something_queues_and_one_reading_only_stops_new_lines() {
        let mut readings = Readings::new();
        for in_flight in [0, 10, 64, 200] {
            assert_eq!(readings.read(Pressure::Clear, in_flight), None);
        }
        // A request waiting for the server's next step, seen once: no cut.
        assert_eq!(readings.read(Pressure::Queueing { over: 3.0 }, 10), Some(10));
        assert_eq!(readings.read(Pressure::Clear, 10), Some(10), "growing again");
        assert_eq!(readings.read(Pressure::Queueing { over: 3.0 }, 10), Some(10));
        assert_eq!(readings.read(Pressure::Queueing { over: 3.0 }, 10), Some(7), "seen twice: cut, by the 3 waiting");
    }

    #[test]
    fn a_queue_that_stays_cuts_again_only_once_the_batch_came_down_to_the_cap() {
        let mut readings = Readings::new();
        assert_eq!(readings.queue(0.0, 20), Some(18));
        // Lines still finishing: the cut already made is what takes effect.
        assert_eq!(readings.read(QUEUE, 20), Some(18));
        assert_eq!(readings.read(QUEUE, 19), Some(18));
        assert_eq!(readings.read(QUEUE, 18), Some(16), "down to the cap: a tenth of it, floored");
        assert_eq!(readings.read(QUEUE, 16), Some(14));
        // Users alone fill the server: the batch holds entirely.
        let mut in_flight = 14;
        for _ in 0..40 {
            in_flight = readings.read(QUEUE, in_flight).unwrap();
        }
        assert_eq!(in_flight, 0);
    }

    #[test]
    fn a_drained_queue_grows_the_cap_back_fast_then_probes_slowly_then_lifts_it() {
        let mut readings = Readings::new();
        assert_eq!(readings.queue(5.0, 20), Some(15));
        // The gap to the 20 in flight when the queue began closes fast: 10 a second at first.
        assert_eq!(readings.read(Pressure::Clear, 15), Some(17));
        assert_eq!(readings.read(Pressure::Clear, 17), Some(18));
        // A batch with fewer lines left than the cap does not grow it.
        for _ in 0..20 {
            assert_eq!(readings.read(Pressure::Clear, 3), Some(18));
        }
        let mut cap = 18;
        let mut readings_to_lift = 0;
        while let Some(now) = readings.read(Pressure::Clear, cap) {
            assert!(now >= cap);
            cap = now;
            readings_to_lift += 1;
        }
        // Past 20, half a line a second up to the limit of 64: some 90 s, 4 readings a second.
        assert!((340..=370).contains(&readings_to_lift), "{readings_to_lift}");
    }

    #[test]
    fn a_stalled_loop_grows_the_cap_by_one_gap_at_most() {
        let mut gate = Gate::default();
        let start = Instant::now();
        gate.read(start, QUEUE, 10, LIMIT);
        assert_eq!(gate.read(start, QUEUE, 10, LIMIT), Some(9));
        assert_eq!(gate.read(start + Duration::from_secs(60), Pressure::Clear, 9, LIMIT), Some(11));
    }
}
