//! The adaptive concurrency rule: how many requests in flight an upstream gets, found by
//! measuring, not guessed. Pure: windows of observations in, a limit out.
//!
//! The design: docs/src/night-shift-design.md#the-rule-throughput-at-the-current-limit

/// A probe up that raises throughput by at least this share of its own step is kept.
pub const ACCEPT_UP: f64 = 0.3;
/// A probe down that loses at most this share of its own step is kept.
pub const ACCEPT_DOWN: f64 = 0.25;
/// Windows at a limit found good before probing again.
pub const HOLD_WINDOWS: u32 = 6;
/// A window in which requests in flight averaged less than this share of the limit is
/// not judged (not enough lines to fill it).
pub const BUSY: f64 = 0.85;
const START_FACTOR: f64 = 2.0;
/// From the start, a doubling whose throughput rose by at least this share of its step
/// (nothing queued anywhere yet) is followed by a leap of [`LEAP_FACTOR`] instead, where
/// nobody else is seen at the server ([`Window::crowded`]) and counts are up to date.
pub const LEAP_GAIN: f64 = 0.6;
const LEAP_FACTOR: f64 = 4.0;
/// A leap lands at most here; past it the start doubles. A leap that fails queues three
/// times its base at the server, and hundreds of lines take seconds to drain (750 took
/// 11 s at a simulated server of 256 places), while the batches a leap is for, a few
/// thousand lines, spend few round trips at limits above it.
pub const LEAP_UP_TO: u32 = 256;
const UP_FACTOR: f64 = 1.25;
const DOWN_FACTOR: f64 = 0.8;
/// The cut on overload (429, 503, timeouts).
const OVERLOAD_FACTOR: f64 = 0.5;
/// Where the limit starts (or the ceiling, if lower).
pub const INITIAL: u32 = 8;
/// After the limit comes down, a window whose requests in flight averaged more than this
/// share of it is still draining the old limit's lines: it is not judged…
pub const DRAINED: f64 = 1.05;
/// … for at most this many windows (a limit that is never drained to is judged anyway).
pub const MAX_DRAINING: u32 = 4;

/// What was observed over one window at the current limit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    /// Requests in flight, on average.
    pub in_flight: f64,
    /// Output tokens of the lines that finished.
    pub tokens: u64,
    /// Lines that finished.
    pub lines: u64,
    pub seconds: f64,
    /// Someone besides this process was seen at the server during the window (its load
    /// signal saw requests queue, or other traffic run): the start does not leap.
    pub crowded: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Point {
    limit: u32,
    /// What the step of a move from this point is measured in: the limit, or where
    /// windows are judged while still filling one, the requests in flight on average.
    size: f64,
    tokens_per_sec: f64,
    lines_per_sec: f64,
}

impl Point {
    /// The rate to compare with `other`: tokens when both have them, else lines.
    fn rates(&self, other: &Point) -> (f64, f64) {
        if self.tokens_per_sec > 0.0 && other.tokens_per_sec > 0.0 {
            (self.tokens_per_sec, other.tokens_per_sec)
        } else {
            (self.lines_per_sec, other.lines_per_sec)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Doubling from the start.
    Start,
    /// Measuring at the limit, to probe up from it next.
    Measure,
    /// Trying a higher limit than `base`.
    Up,
    /// Trying a lower limit than `base`.
    Down,
    /// Staying at `base` for this many more windows.
    Hold(u32),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    limit: u32,
    phase: Phase,
    /// The operating point the probes are compared with.
    base: Option<Point>,
    /// The next window is still settling after a change.
    settling: bool,
    /// From the start, a doubling waits a settling window before it is judged.
    settled_start: bool,
    /// The limit came down: windows still draining the old one's lines are left out,
    /// this many more at most.
    draining: u32,
}

impl Rule {
    /// A rule over counts up to date at every window: from the start, a window right
    /// after a doubling is judged at once, by the requests in flight it had.
    pub fn new(ceiling: u32) -> Self {
        Self {
            limit: INITIAL.min(ceiling).max(1),
            phase: Phase::Start,
            base: None,
            settling: false,
            settled_start: false,
            draining: 0,
        }
    }

    /// A rule over counts that arrive late: a doubling is judged only after a window
    /// has settled, or it would be judged before its lines were counted.
    pub fn with_settled_start(ceiling: u32) -> Self {
        Self { settled_start: true, ..Self::new(ceiling) }
    }

    /// A rule that starts at a limit found before (by an earlier run of the process): it
    /// measures there and probes from it, as after a hold, instead of doubling from
    /// [`INITIAL`].
    pub fn resume(ceiling: u32, limit: u32) -> Self {
        Self { limit: limit.clamp(1, ceiling.max(1)), phase: Phase::Measure, ..Self::new(ceiling) }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Something else held `lines` in flight, more than the limit: the rule measures
    /// there, as after [`Self::resume`].
    pub fn filled(&mut self, lines: u32, ceiling: u32) {
        if lines > self.limit {
            self.set(lines.min(ceiling.max(1)), Phase::Measure, None);
        }
    }

    /// Whether the limit is still doubling from the start.
    pub fn is_starting(&self) -> bool {
        self.phase == Phase::Start
    }

    /// Judges a window observed at [`Rule::limit`]; returns the limit to use next,
    /// never above `ceiling` nor below 1.
    pub fn observe(&mut self, window: Window, ceiling: u32) -> u32 {
        let ceiling = ceiling.max(1);
        if self.limit > ceiling {
            return self.set(ceiling, Phase::Measure, None);
        }
        if std::mem::take(&mut self.settling) || window.seconds <= 0.0 {
            return self.limit;
        }
        // Not one line finished (the window ran to its longest): the server was out of
        // reach (restarting, refusing connections, which the lines wait out) or its lines
        // are longer than a window. Either way there is no rate to compare, and a limit
        // judged on nothing against nothing would drift down for as long as it lasts.
        if window.lines == 0 {
            return self.limit;
        }
        // Lines over a limit that came down are still finishing: the window measured the
        // old limit's lines (a queue of them at the server draining), not this one.
        if self.draining > 0 {
            self.draining -= 1;
            if window.in_flight > DRAINED * f64::from(self.limit) {
                return self.limit;
            }
            self.draining = 0;
        }
        let busy = window.in_flight >= BUSY * f64::from(self.limit);
        if !busy && self.phase != Phase::Down {
            // Not enough lines to fill the limit: nothing to learn about the server.
            if matches!(self.phase, Phase::Up) {
                let base = self.base.expect("a probe has a base");
                return self.set(base.limit, Phase::Hold(HOLD_WINDOWS), Some(base));
            }
            return self.limit;
        }
        let at_once = self.phase == Phase::Start && !self.settled_start;
        let here = Point {
            limit: self.limit,
            size: if at_once { window.in_flight } else { f64::from(self.limit) },
            tokens_per_sec: window.tokens as f64 / window.seconds,
            lines_per_sec: window.lines as f64 / window.seconds,
        };
        match (self.phase, self.base) {
            (Phase::Start, Some(base)) if gain(&base, &here) < ACCEPT_UP => self.start_ended(base, &here),
            (Phase::Start, Some(base)) => {
                let leap = !self.settled_start
                    && !window.crowded
                    && gain(&base, &here) >= LEAP_GAIN
                    && scaled(self.limit, LEAP_FACTOR) <= LEAP_UP_TO;
                self.probe_up(here, if leap { LEAP_FACTOR } else { START_FACTOR }, Phase::Start, ceiling)
            }
            (Phase::Start, None) => self.probe_up(here, START_FACTOR, Phase::Start, ceiling),
            (Phase::Measure, _) => self.probe_up(here, UP_FACTOR, Phase::Up, ceiling),
            (Phase::Up, Some(base)) if gain(&base, &here) >= ACCEPT_UP => {
                self.probe_up(here, UP_FACTOR, Phase::Up, ceiling)
            }
            (Phase::Up, Some(base)) => self.probe_down(base),
            (Phase::Down, Some(base)) if gain(&base, &here) <= ACCEPT_DOWN => {
                // What was taken away only queued: stay lower, and look lower still.
                self.probe_down(here)
            }
            (Phase::Down, Some(base)) => self.set(base.limit, Phase::Hold(HOLD_WINDOWS), Some(base)),
            (Phase::Hold(0), _) => self.set(self.limit, Phase::Measure, None),
            (Phase::Hold(left), base) => {
                self.phase = Phase::Hold(left - 1);
                self.base = base;
                self.limit
            }
            (Phase::Up | Phase::Down, None) => self.set(self.limit, Phase::Measure, None),
        }
    }

    /// Cuts the limit at once (the upstream is overloaded); probing starts again from
    /// the new one.
    pub fn back_off(&mut self) -> u32 {
        let cut = ((f64::from(self.limit) * OVERLOAD_FACTOR).floor() as u32).max(1);
        self.set(cut, Phase::Hold(HOLD_WINDOWS / 2), None)
    }

    /// The start's last step did not pay. After a doubling, the knee is below it: probe
    /// down from the last good limit. After a leap that still gained what a doubling must
    /// (the knee lies within it), measure at the doubling it skipped and probe up by
    /// quarters from there; a leap that gained less, the doubling would not have paid
    /// either.
    fn start_ended(&mut self, base: Point, here: &Point) -> u32 {
        let (before, after) = base.rates(here);
        let doubled = scaled(base.limit, START_FACTOR);
        let leapt = here.limit > doubled;
        if leapt && after >= (1.0 + ACCEPT_UP) * before {
            return self.set(doubled, Phase::Measure, None);
        }
        self.probe_down(base)
    }

    fn probe_up(&mut self, from: Point, factor: f64, phase: Phase, ceiling: u32) -> u32 {
        let up = scaled(from.limit, factor).min(ceiling);
        if up == from.limit {
            return self.set(from.limit, Phase::Hold(HOLD_WINDOWS), Some(from));
        }
        self.set(up, if phase == Phase::Start { Phase::Start } else { Phase::Up }, Some(from))
    }

    fn probe_down(&mut self, from: Point) -> u32 {
        let down = scaled(from.limit, DOWN_FACTOR);
        if down == from.limit {
            return self.set(from.limit, Phase::Hold(HOLD_WINDOWS), Some(from));
        }
        self.set(down, Phase::Down, Some(from))
    }

    fn set(&mut self, limit: u32, phase: Phase, base: Option<Point>) -> u32 {
        self.settling = limit != self.limit && (phase != Phase::Start || self.settled_start);
        self.draining = if limit < self.limit { MAX_DRAINING } else { 0 };
        self.limit = limit.max(1);
        self.phase = phase;
        self.base = base;
        self.limit
    }
}

/// The limit times `factor`, moved by at least one.
fn scaled(limit: u32, factor: f64) -> u32 {
    let next = (f64::from(limit) * factor).round() as u32;
    match factor > 1.0 {
        true => next.max(limit + 1),
        false => next.min(limit.saturating_sub(1)).max(1),
    }
}

/// How throughput answered the move from `base` to `here`: its relative change over
/// the relative change of their sizes (1: in proportion, 0: not at all; a probe down
/// that lost nothing gives 0).
fn gain(base: &Point, here: &Point) -> f64 {
    let (before, after) = base.rates(here);
    let step = if base.size > 0.0 { (here.size - base.size) / base.size } else { 0.0 };
    if before <= 0.0 || step == 0.0 {
        return if after > before { 1.0 } else { 0.0 };
    }
    ((after - before) / before) / step
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_rule_starts_at_its_limit_and_probes_from_there() {
        let mut rule = Rule::resume(256, 200);
        assert_eq!(rule.limit(), 200);
        assert!(!rule.is_starting());
        // A server that takes 200 and gains nothing past it: a probe up (judged after a
        // window to settle), one down, and back to 200.
        let server = |n: u32| f64::from(n.min(200)) * 10.0;
        let limits = drive(&mut rule, 256, 6, server);
        assert_eq!(limits[..5], [200, 250, 250, 160, 160], "{limits:?}");
        assert_eq!(rule.limit(), 200, "{limits:?}");
        assert_eq!(Rule::resume(64, 200).limit(), 64, "never above the ceiling");
        assert_eq!(Rule::resume(64, 0).limit(), 1);
    }

    /// A server that gives `rate(limit)` tokens/s with every slot busy.
    fn window(tokens_per_sec: f64, in_flight: f64) -> Window {
        Window {
            in_flight,
            tokens: tokens_per_sec as u64,
            lines: (tokens_per_sec / 10.0) as u64,
            seconds: 1.0,
            crowded: false,
        }
    }

    /// The same, in a window that saw someone else at the server: the start doubles.
    fn crowded(tokens_per_sec: f64, in_flight: f64) -> Window {
        Window { crowded: true, ..window(tokens_per_sec, in_flight) }
    }

    /// Runs the rule against a server whose throughput at `n` requests in flight is
    /// `server(n)`, for `windows` windows; returns the limits used, window by window.
    fn drive(rule: &mut Rule, ceiling: u32, windows: usize, server: impl Fn(u32) -> f64) -> Vec<u32> {
        (0..windows)
            .map(|_| {
                let limit = rule.limit();
                rule.observe(window(server(limit), f64::from(limit)), ceiling);
                limit
            })
            .collect()
    }

    /// A continuous-batching server: throughput rises with the batch up to `batch`
    /// sequences, each step slowing by `per_seq` of its base; beyond, requests queue.
    fn batching(batch: u32, per_seq: f64) -> impl Fn(u32) -> f64 {
        move |n| {
            let running = f64::from(n.min(batch));
            1000.0 * running / (1.0 + per_seq * running)
        }
    }

    #[test]
    fn it_doubles_from_the_start_then_settles_at_the_servers_batch_size() {
        let mut rule = Rule::new(1024);
        let limits = drive(&mut rule, 1024, 60, batching(32, 0.008));
        // 16 gives nearly twice 8's throughput: a leap to 64, which gains less than a
        // quarter of its step but more than a doubling must: measured at 32.
        assert_eq!(&limits[..4], &[8, 16, 64, 32], "each step is judged in its own window");
        let settled = &limits[20..];
        let at_knee = settled.iter().filter(|l| (26..=40).contains(*l)).count();
        assert_eq!(at_knee, settled.len(), "probes stay within a step of the batch size: {settled:?}");
        let mean = settled.iter().map(|l| f64::from(*l)).sum::<f64>() / settled.len() as f64;
        assert!((30.0..=35.0).contains(&mean), "mostly at 32: mean {mean}: {settled:?}");
    }

    #[test]
    fn from_the_start_a_doubling_in_proportion_is_followed_by_a_leap() {
        // A server far from its knee (an upstream that answers in the same time however
        // many it gets): after one doubling, the limit goes up fourfold a window.
        let linear = |n: u32| 100.0 * f64::from(n);
        let limits = drive(&mut Rule::new(1024), 1024, 6, linear);
        assert_eq!(limits, [8, 16, 64, 256, 512, 1024], "past LEAP_UP_TO, it doubles");
        // A doubling that gave less than LEAP_GAIN of its step: the next is a doubling.
        let mut rule = Rule::new(1024);
        rule.observe(window(800.0, 8.0), 1024);
        assert_eq!(rule.observe(window(1200.0, 16.0), 1024), 32, "half as much again for twice the lines");
        // Nor does a start leap while someone else is at the server.
        let mut rule = Rule::new(1024);
        rule.observe(crowded(800.0, 8.0), 1024);
        assert_eq!(rule.observe(crowded(1600.0, 16.0), 1024), 32);
        assert_eq!(rule.observe(crowded(3200.0, 32.0), 1024), 64);
    }

    #[test]
    fn a_leap_past_the_knee_falls_back_to_the_doubling_it_skipped_or_below() {
        // 16 → 64 gained 60% (less than a quarter of the step, more than a doubling must
        // give): the knee lies within the leap; measure at 32 and probe up from there.
        let mut rule = Rule::new(1024);
        rule.observe(window(800.0, 8.0), 1024);
        assert_eq!(rule.observe(window(1600.0, 16.0), 1024), 64);
        assert_eq!(rule.observe(window(2560.0, 64.0), 1024), 32);
        assert_eq!(rule.observe(window(2560.0, 60.0), 1024), 32, "the window after a change settles");
        for in_flight in [50.0, 40.0] {
            assert_eq!(rule.observe(window(2560.0, in_flight), 1024), 32, "the leap's lines still drain");
        }
        assert_eq!(rule.observe(window(2400.0, 32.0), 1024), 40, "measured at 32, it probes up");
        // 16 → 64 gained 10%: a doubling would not have paid either; probe down from 16.
        let mut rule = Rule::new(1024);
        rule.observe(window(800.0, 8.0), 1024);
        rule.observe(window(1600.0, 16.0), 1024);
        assert_eq!(rule.observe(window(1760.0, 64.0), 1024), 13);
    }

    #[test]
    fn with_late_counts_each_doubling_waits_a_settling_window() {
        let mut rule = Rule::with_settled_start(1024);
        let limits = drive(&mut rule, 1024, 6, batching(32, 0.008));
        assert_eq!(limits, [8, 16, 16, 32, 32, 64]);
    }

    #[test]
    fn from_the_start_a_doubling_is_judged_by_the_requests_it_had_in_flight() {
        // The window after a doubling to 32 averaged 28 in flight (the limit filled as
        // lines came): 75% more than the 16 before for 75% more throughput is in
        // proportion, and doubling goes on.
        let mut rule = Rule::new(1024);
        assert_eq!(rule.observe(crowded(800.0, 8.0), 1024), 16);
        assert_eq!(rule.observe(crowded(1600.0, 16.0), 1024), 32);
        assert_eq!(rule.observe(crowded(2800.0, 28.0), 1024), 64);
        // Twice the requests in flight for the same throughput: the start ends, and
        // the limit probes down from the last good one.
        assert_eq!(rule.observe(window(2800.0, 60.0), 1024), 26);
    }

    #[test]
    fn a_knee_between_doublings_is_found_by_the_probes() {
        let mut rule = Rule::new(1024);
        let limits = drive(&mut rule, 1024, 80, batching(45, 0.008));
        let settled = &limits[40..];
        let mean = settled.iter().map(|l| f64::from(*l)).sum::<f64>() / settled.len() as f64;
        assert!((40.0..=52.0).contains(&mean), "near 45: mean {mean}: {settled:?}");
        assert!(settled.iter().all(|l| *l >= 32), "{settled:?}");
    }

    #[test]
    fn the_ceiling_bounds_it_and_a_server_that_keeps_scaling_gets_the_ceiling() {
        let mut rule = Rule::new(20);
        let limits = drive(&mut rule, 20, 40, |n| 100.0 * f64::from(n));
        assert!(limits.iter().all(|l| *l <= 20));
        let settled = &limits[10..];
        let at_ceiling = settled.iter().filter(|l| **l == 20).count();
        assert!(at_ceiling * 10 >= settled.len() * 8, "mostly at the ceiling: {settled:?}");
        // A ceiling lowered under it (a smaller grant) applies at once.
        assert_eq!(rule.observe(window(100.0, 20.0), 5), 5);
        assert_eq!(Rule::new(3).limit(), 3, "a ceiling below the start");
    }

    #[test]
    fn overload_halves_it() {
        for (from, to) in [(32, 16), (33, 16), (3, 1), (1, 1)] {
            let mut rule = Rule::new(1024);
            rule.limit = from;
            assert_eq!(rule.back_off(), to, "at {from}");
        }
    }

    #[test]
    fn windows_that_do_not_fill_the_limit_or_are_settling_teach_nothing() {
        let mut rule = Rule::with_settled_start(1024);
        assert_eq!(rule.observe(window(8000.0, 8.0), 1024), 16);
        assert_eq!(rule.observe(window(1.0, 16.0), 1024), 16, "the first window after a change is not judged");
        // Only 5 lines to send: throughput says nothing about the server.
        for _ in 0..10 {
            assert_eq!(rule.observe(window(5000.0, 5.0), 1024), 16);
        }
        assert_eq!(rule.observe(window(16000.0, 16.0), 1024), 32, "full again: doubling goes on");
    }

    /// A rule whose start doubled from 16 to 32 for nothing: it probes down from 16, to
    /// 13, and the window after that change (32 lines still in flight) settles.
    fn overshot() -> Rule {
        let mut rule = Rule::new(1024);
        rule.observe(crowded(800.0, 8.0), 1024);
        rule.observe(crowded(1600.0, 16.0), 1024);
        assert_eq!(rule.observe(crowded(1600.0, 32.0), 1024), 13);
        assert_eq!(rule.observe(window(1600.0, 30.0), 1024), 13, "the window after a change settles");
        rule
    }

    #[test]
    fn after_the_limit_comes_down_windows_still_draining_the_old_lines_are_not_judged() {
        // The 32 lines sent before drain for a while, the server's queue answering as
        // fast as 16 did: judged, 13 would look as good as 16 and the probe go lower.
        let mut rule = overshot();
        for in_flight in [24.0, 17.0] {
            assert_eq!(rule.observe(window(1600.0, in_flight), 1024), 13, "{in_flight} in flight: still draining");
        }
        // Drained: 13 loses a fifth of 16's throughput, and the limit goes back to 16.
        assert_eq!(rule.observe(window(1300.0, 13.0), 1024), 16);
    }

    #[test]
    fn a_limit_never_drained_to_is_judged_after_a_few_windows() {
        let mut rule = overshot();
        let limits: Vec<u32> = (0..MAX_DRAINING + 1).map(|_| rule.observe(window(1300.0, 20.0), 1024)).collect();
        assert_eq!(limits[..MAX_DRAINING as usize], [13; MAX_DRAINING as usize]);
        assert_eq!(limits[MAX_DRAINING as usize], 16, "judged: {limits:?}");
    }

    #[test]
    fn gain_is_relative_throughput_over_relative_limit() {
        let at =
            |limit, rate| Point { limit, size: f64::from(limit), tokens_per_sec: rate, lines_per_sec: rate / 10.0 };
        let cases = [
            (at(10, 100.0), at(20, 200.0), 1.0),
            (at(10, 100.0), at(20, 100.0), 0.0),
            (at(10, 100.0), at(20, 150.0), 0.5),
            (at(10, 100.0), at(8, 100.0), 0.0),
            (at(10, 100.0), at(8, 80.0), 1.0),
            (at(10, 0.0), at(20, 0.0), 0.0),
        ];
        for (base, here, expected) in cases {
            assert!((gain(&base, &here) - expected).abs() < 1e-9, "{base:?} → {here:?}");
        }
        // Without tokens, lines count.
        let lines = |limit, rate| Point { limit, size: f64::from(limit), tokens_per_sec: 0.0, lines_per_sec: rate };
        assert!((gain(&lines(10, 5.0), &lines(20, 10.0)) - 1.0).abs() < 1e-9);
    }
}
