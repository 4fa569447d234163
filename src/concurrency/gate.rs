//! The load signal's hold on batch dispatch: a cap on an upstream's batch requests in
//! flight, cut when the server says requests queue and grown back while they don't.
//! Pure: the caller passes the time, the reading and its own requests in flight.
//!
//! The design: docs/src/night-shift-design.md#the-gate-the-load-signals-hold

use std::time::{Duration, Instant};

/// The span over which marks are counted, and the cap cut at most once.
pub const WINDOW: Duration = Duration::from_secs(1);
/// The weight of the latest window's share of marked readings in `alpha`.
pub const G: f64 = 0.25;
/// While nothing queues, the cap grows this much a second for every [`PROBE_PLACES`] of
/// the server's places (this much at least)…
pub const PROBE_PER_SEC: f64 = 0.5;
/// … so that a cap cut by half grows back in the same time at any server's size: at a
/// server of 256 places, half a line a second took some 40 s to regrow what a queue at
/// the start had cut, while the room beside the users stood free. 32: the default
/// simulator's places, on which the pace was tuned; below that it is unchanged.
pub const PROBE_PLACES: f64 = 32.0;
/// … times the seconds since the last queue over this (at least once, at most
/// [`MAX_SPEEDUP`] times).
pub const ACCELERATE_AFTER: Duration = Duration::from_secs(5);
pub const MAX_SPEEDUP: f64 = 10.0;
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

#[derive(Clone, Debug)]
pub struct Gate {
    cap: Option<f64>,
    /// The moving average of the share of readings that saw a queue, window by window.
    alpha: f64,
    window: Window,
    /// What the reading before this one said was over the threshold, if anything.
    before: Option<f64>,
    /// The last reading that saw a queue.
    queued: Option<Instant>,
    last: Option<Instant>,
}

#[derive(Clone, Debug, Default)]
struct Window {
    start: Option<Instant>,
    readings: u32,
    marked: u32,
}

impl Default for Gate {
    /// `alpha` starts at 1, as in DCTCP: the first queue halves the cap.
    fn default() -> Self {
        Self { cap: None, alpha: 1.0, window: Window::default(), before: None, queued: None, last: None }
    }
}

impl Gate {
    /// The cap on batch requests in flight now (`None`: no cap).
    pub fn cap(&self) -> Option<u32> {
        self.cap.map(|cap| cap.floor() as u32)
    }

    /// Takes a reading in, with this process's batch requests `in_flight`, the
    /// throughput rule's `limit` and the server's `places` where they are known (this
    /// process's part of them, where it shares the server's room); returns the cap.
    pub fn read(
        &mut self,
        now: Instant,
        pressure: Pressure,
        in_flight: u32,
        limit: u32,
        places: Option<f64>,
    ) -> Option<u32> {
        let gap = self.last.map_or(Duration::ZERO, |last| now.saturating_duration_since(last)).min(MAX_GAP);
        self.last = Some(now);
        let in_flight = f64::from(in_flight);
        self.close_window(now);
        self.window.readings += 1;
        let over = match pressure {
            Pressure::Queueing { over } => Some(over),
            Pressure::Clear => None,
        };
        match (std::mem::replace(&mut self.before, over), over) {
            (before, Some(over)) => {
                self.window.marked += 1;
                self.queued = Some(now);
                let cap = *self.cap.get_or_insert(in_flight);
                // Users wait now (two readings saw them): make room for them at once,
                // unless lines over the cap are still finishing.
                let waiting = before.map_or(0.0, |before| before.min(over)).ceil();
                if waiting > 0.0 && in_flight <= cap.floor() {
                    self.cap = Some(cap.min((in_flight - waiting).max(0.0)));
                }
            }
            (_, None) => {
                if let Some(cap) = self.cap
                    && self.window.marked == 0
                    && in_flight + 1.0 >= cap
                {
                    let calm = self.queued.map_or(Duration::MAX, |at| now.saturating_duration_since(at));
                    let speed = (calm.as_secs_f64() / ACCELERATE_AFTER.as_secs_f64()).clamp(1.0, MAX_SPEEDUP);
                    let scale = places.map_or(1.0, |places| (places / PROBE_PLACES).max(1.0));
                    let grown = cap + PROBE_PER_SEC * scale * speed * gap.as_secs_f64();
                    self.cap = (grown < f64::from(limit)).then_some(grown);
                }
            }
        }
        self.cap()
    }

    /// Ends the window if `now` is past it: folds its share of marks into `alpha`, and
    /// cuts the cap by `alpha / 2` if anything queued in it.
    fn close_window(&mut self, now: Instant) {
        let start = *self.window.start.get_or_insert(now);
        if now.saturating_duration_since(start) < WINDOW || self.window.readings == 0 {
            return;
        }
        let Window { readings, marked, .. } = std::mem::take(&mut self.window);
        self.window.start = Some(now);
        self.alpha = (1.0 - G) * self.alpha + G * f64::from(marked) / f64::from(readings);
        if marked > 0
            && let Some(cap) = self.cap
        {
            self.cap = Some(cap * (1.0 - self.alpha / 2.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u32 = 64;
    const QUEUE: Pressure = Pressure::Queueing { over: 0.0 };

    /// Readings 100 ms apart: ten to a window.
    struct Readings {
        gate: Gate,
        now: Instant,
    }

    impl Readings {
        fn new() -> Self {
            Self { gate: Gate::default(), now: Instant::now() }
        }

        fn read(&mut self, pressure: Pressure, in_flight: u32) -> Option<u32> {
            self.now += Duration::from_millis(100);
            self.gate.read(self.now, pressure, in_flight, LIMIT, None)
        }

        /// A window's ten readings, the first `marked` even ones seeing a queue (never
        /// two in a row), with the batch using its cap (20 before there is one).
        fn window(&mut self, marked: usize) -> Option<u32> {
            let mut cap = self.gate.cap();
            for n in 0..10 {
                let pressure = if n % 2 == 0 && n / 2 < marked { QUEUE } else { Pressure::Clear };
                cap = self.read(pressure, cap.unwrap_or(20));
            }
            cap
        }

        fn exact_cap(&self) -> f64 {
            self.gate.cap.expect("a cap")
        }
    }

    #[test]
    fn nothing_is_held_until_something_queues_then_the_batch_stops_growing() {
        let mut readings = Readings::new();
        for in_flight in [0, 10, 64, 200] {
            assert_eq!(readings.read(Pressure::Clear, in_flight), None);
        }
        assert_eq!(readings.read(QUEUE, 20), Some(20), "capped at the lines in flight");
        for _ in 0..5 {
            assert_eq!(readings.read(Pressure::Clear, 20), Some(20), "no growth in a window that saw a queue");
        }
        // Nothing in flight when users queue: no batch line is sent.
        let mut readings = Readings::new();
        assert_eq!(readings.read(QUEUE, 0), Some(0));
    }

    #[test]
    fn a_window_that_saw_a_queue_cuts_by_half_the_moving_share_of_readings_that_did() {
        let mut readings = Readings::new();
        readings.read(Pressure::Clear, 20);
        readings.window(1);
        // alpha starts at 1 and takes in a tenth of marked readings at a quarter's weight:
        // 0.775; the cut is half of it (then two readings grow it by 0.05 each).
        readings.read(Pressure::Clear, 20);
        let first = readings.exact_cap();
        assert!((first - (20.0 * (1.0 - 0.775 / 2.0) + 0.1)).abs() < 1e-9, "{first}");
        // Nine calm windows later alpha is 0.775 × 0.75⁹ = 0.058: a mark costs a few percent.
        for _ in 0..9 {
            readings.window(0);
        }
        let before = readings.exact_cap();
        readings.window(1);
        readings.read(Pressure::Clear, before as u32);
        let after = readings.exact_cap();
        let alpha = 0.775 * 0.75_f64.powi(10) * 0.75 + 0.025;
        let expected = before * (1.0 - alpha / 2.0) + 0.05;
        assert!((after - expected).abs() < 0.1, "{before} → {after}, want {expected}");
        assert!(after > before * 0.95, "{before} → {after}");
        // A queue half the readings see, window after window, cuts deeper each time as
        // alpha climbs towards a half: the cap loses three quarters in 8 s.
        let mut caps = vec![readings.gate.cap().unwrap()];
        for _ in 0..8 {
            caps.push(readings.window(5).unwrap());
        }
        assert!(caps.windows(2).all(|w| w[1] < w[0]), "{caps:?}");
        assert!(caps[8] * 4 <= caps[0], "{caps:?}");
    }

    #[test]
    fn users_waiting_in_two_readings_in_a_row_take_their_room_at_once_and_only_once() {
        let mut readings = Readings::new();
        readings.read(Pressure::Clear, 20);
        assert_eq!(readings.read(Pressure::Queueing { over: 5.0 }, 20), Some(20));
        assert_eq!(readings.read(Pressure::Queueing { over: 2.5 }, 20), Some(17), "the smaller of the two, rounded up");
        // Lines over the cap still finishing: that cut takes effect, no other.
        assert_eq!(readings.read(Pressure::Queueing { over: 3.0 }, 19), Some(17));
        assert_eq!(readings.read(Pressure::Queueing { over: 3.0 }, 17), Some(14), "down to the cap: cut again");
        // Users alone fill the server: the batch holds entirely.
        let mut in_flight = 14;
        for _ in 0..40 {
            in_flight = readings.read(Pressure::Queueing { over: 2.0 }, in_flight).unwrap();
        }
        assert_eq!(in_flight, 0);
    }

    #[test]
    fn without_queues_the_cap_grows_while_used_faster_the_longer_it_is_calm_then_is_lifted() {
        let mut readings = Readings::new();
        assert_eq!(readings.read(QUEUE, 10), Some(10));
        for _ in 0..9 {
            readings.read(Pressure::Clear, 10);
        }
        // The window closes with a cut; a batch with fewer lines left than the cap does
        // not grow it.
        let cut = readings.read(Pressure::Clear, 1).unwrap();
        assert_eq!(cut, 6);
        for _ in 0..20 {
            assert_eq!(readings.read(Pressure::Clear, 1), Some(cut));
        }
        // Used, it grows half a line a second until 5 s after the queue, then faster.
        let start = readings.exact_cap();
        readings.window(0);
        let grown = readings.exact_cap() - start;
        assert!((grown - 0.5).abs() < 1e-9, "{grown}");
        let mut seconds = 1;
        while readings.window(0).is_some() {
            seconds += 1;
        }
        // Some 30 s to the limit of 64; at half a line a second it would take two minutes.
        assert!((25..=40).contains(&seconds), "{seconds} s from {cut} to {LIMIT}");
    }

    #[test]
    fn a_stalled_loop_grows_the_cap_by_one_gap_at_the_fastest_pace_at_most() {
        let mut gate = Gate::default();
        let start = Instant::now();
        assert_eq!(gate.read(start, QUEUE, 10, LIMIT, None), Some(10));
        // An hour later: the window's cut (its one reading saw a queue: alpha stays 1,
        // the cap halves), then one second's growth at ten times the pace.
        let later = start + Duration::from_secs(3600);
        assert_eq!(gate.read(later, Pressure::Clear, 10, LIMIT, None), Some(10));
        assert!((gate.cap.unwrap() - (5.0 + PROBE_PER_SEC * MAX_SPEEDUP)).abs() < 1e-9);
    }

    #[test]
    fn the_cap_grows_in_proportion_to_a_server_larger_than_the_pace_was_tuned_on() {
        let start = Instant::now();
        let second = start + Duration::from_secs(1);
        let grown = |places| {
            let mut gate = Gate::default();
            gate.read(start, Pressure::Clear, 100, 1024, places);
            gate.cap = Some(100.0);
            gate.queued = Some(start);
            gate.read(second, Pressure::Clear, 100, 1024, places);
            gate.cap.unwrap() - 100.0
        };
        assert!((grown(None) - PROBE_PER_SEC).abs() < 1e-9);
        assert!((grown(Some(16.0)) - PROBE_PER_SEC).abs() < 1e-9, "no slower below 32 places");
        assert!((grown(Some(32.0)) - PROBE_PER_SEC).abs() < 1e-9);
        assert!((grown(Some(256.0)) - 8.0 * PROBE_PER_SEC).abs() < 1e-9, "eight times at 256");
    }
}
