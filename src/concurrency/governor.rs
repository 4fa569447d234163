//! The adaptive limit of one upstream over time: cuts windows of observations for the
//! [`Rule`] and backs off at once on overload. Pure: the
//! caller passes the time and what it observed, wherever that came from (this process's
//! counters in `serve`, every worker pod's acknowledgments on Kubernetes).

use std::time::{Duration, Instant};

use super::Counts;
use super::rule::{Rule, Window};

/// A window lasts at least this long…
pub const MIN_WINDOW: Duration = Duration::from_secs(1);
/// … and until twice the limit's worth of lines have finished (every request in flight
/// has turned over, whatever the latency), or this long.
pub const MAX_WINDOW: Duration = Duration::from_secs(30);
/// While the limit doubles from the start, a window is one round trip instead: the
/// limit's worth of lines finished, and at least this long. A doubling then costs a
/// round trip (judged as it runs: [`Rule::new`]), not two seconds: a batch of a few
/// thousand lines at a slow upstream no longer spends its life climbing. Only where the
/// counts are this process's own ([`Governor::new`]); counts that arrive late (worker
/// pods' acknowledgments, [`Governor::with_late_counts`]) keep whole windows and a
/// settling one after each doubling, or a doubling would be judged before its lines
/// were counted.
pub const START_WINDOW: Duration = Duration::from_millis(250);
/// After overload cut the adaptive limit (429s, 503s, timeouts), the throughput rule
/// governs a batch alone for this long, where the server's count would fill it
/// ([`Look::overruled`]).
pub const OVERLOAD_RULES_FOR: Duration = Duration::from_secs(10);
/// Overload cuts the limit at most this often (a burst of 429s is one signal).
const BACKOFF_EVERY: Duration = Duration::from_secs(1);

/// One look at the upstream.
#[derive(Clone, Copy, Debug)]
pub struct Look {
    pub now: Instant,
    /// Finished requests so far (cumulative).
    pub counts: Counts,
    /// Requests in flight now.
    pub in_flight: u32,
    /// `max_concurrency`: the limit never goes past it.
    pub ceiling: u32,
    /// Someone besides this process is at the server, as far as it can tell (its load
    /// signal: [`Window::crowded`]).
    pub crowded: bool,
    /// Something else sets the lines in flight now (the server's own count, for a batch
    /// alone there): what is observed is not the limit's doing, and is not judged.
    pub overruled: bool,
}

#[derive(Clone, Debug)]
struct Open {
    started: Instant,
    at_start: Counts,
    in_flight_sum: f64,
    samples: u32,
    crowded: bool,
}

impl Open {
    fn at(look: &Look) -> Self {
        Self { started: look.now, at_start: look.counts, in_flight_sum: 0.0, samples: 0, crowded: false }
    }
}

#[derive(Clone, Debug)]
pub struct Governor {
    rule: Rule,
    /// While the limit doubles from the start: the shortest window, and the turnovers of
    /// the limit's lines it waits for.
    start_window: (Duration, u64),
    window: Option<Open>,
    last_backoff: Option<Instant>,
    last_counts: Option<Counts>,
}

impl Governor {
    /// A governor over counts of this process, up to date at every look.
    pub fn new(ceiling: u32) -> Self {
        Self {
            rule: Rule::new(ceiling),
            start_window: (START_WINDOW, 1),
            window: None,
            last_backoff: None,
            last_counts: None,
        }
    }

    /// A governor over counts of this process that starts at a limit found before.
    pub fn resume(ceiling: u32, limit: u32) -> Self {
        Self { rule: Rule::resume(ceiling, limit), ..Self::new(ceiling) }
    }

    /// A governor over counts that reach it late (reported by other processes).
    pub fn with_late_counts(ceiling: u32) -> Self {
        Self { rule: Rule::with_settled_start(ceiling), start_window: (MIN_WINDOW, 2), ..Self::new(ceiling) }
    }

    pub fn limit(&self) -> u32 {
        self.rule.limit()
    }

    /// Whether the limit is one measured at the server (past the doubling from the start).
    pub fn has_measured(&self) -> bool {
        !self.rule.is_starting()
    }

    /// Something else set the lines in flight ([`Look::overruled`]), and they are
    /// `in_flight`: the rule, once it governs again, measures from there rather than from
    /// where it stood before. Worker pods alone at a server fill it between them while the
    /// controller's rule stands aside; one pod that sees users for a moment hands the
    /// lines back to the rule, which had stood at its start.
    pub fn filled(&mut self, in_flight: u32, ceiling: u32) {
        self.rule.filled(in_flight, ceiling);
    }

    /// Whether overload cut the limit within `span` of `now`.
    pub fn backed_off_within(&self, now: Instant, span: Duration) -> bool {
        self.last_backoff.is_some_and(|at| now.saturating_duration_since(at) < span)
    }

    /// Takes a look in; returns the limit to use now (before the load signal's cap,
    /// which the caller applies: [`super::gate`]).
    pub fn look(&mut self, look: Look) -> u32 {
        let overloaded = self.last_counts.is_some_and(|last| look.counts.overloads > last.overloads);
        self.last_counts = Some(look.counts);
        let may_back_off = self.last_backoff.is_none_or(|at| look.now.duration_since(at) >= BACKOFF_EVERY);
        if overloaded && may_back_off {
            self.rule.back_off();
            self.last_backoff = Some(look.now);
            self.window = None;
        }
        if look.overruled {
            self.window = None;
            return self.rule.limit().min(look.ceiling.max(1));
        }
        // Nothing in flight, and nothing finished since the window opened: the upstream
        // is idle, and idle time is part of no window. A batch's first window would
        // otherwise average the wait before its lines in, be found not busy and cost a
        // round trip at the first limit.
        let idle = self.window.as_ref().is_none_or(|window| look.counts.since(&window.at_start).lines == 0);
        if look.in_flight == 0 && idle {
            self.window = None;
            return self.rule.limit().min(look.ceiling.max(1));
        }
        let window = self.window.get_or_insert_with(|| Open::at(&look));
        window.in_flight_sum += f64::from(look.in_flight);
        window.samples += 1;
        window.crowded |= look.crowded;
        let elapsed = look.now.duration_since(window.started);
        let finished = look.counts.since(&window.at_start);
        let (shortest, turns) = if self.rule.is_starting() { self.start_window } else { (MIN_WINDOW, 2) };
        let turned_over = finished.lines >= turns * u64::from(self.rule.limit());
        if elapsed >= shortest && (turned_over || elapsed >= MAX_WINDOW) {
            // The next window starts at this look: no time goes unobserved between two.
            let window = self.window.replace(Open::at(&look)).expect("a window is open");
            let observed = Window {
                in_flight: window.in_flight_sum / f64::from(window.samples.max(1)),
                tokens: finished.tokens,
                lines: finished.lines,
                seconds: elapsed.as_secs_f64(),
                crowded: window.crowded,
            };
            self.rule.observe(observed, look.ceiling);
        }
        self.rule.limit().min(look.ceiling.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Server {
        now: Instant,
        counts: Counts,
        owed: f64,
        /// The looks say something else sets the lines in flight.
        overruled: bool,
    }

    impl Server {
        fn new() -> Self {
            Self { now: Instant::now(), counts: Counts::default(), owed: 0.0, overruled: false }
        }

        /// Runs `ticks` ticks at a steady `per_sec`, for a governor to settle.
        fn settle(&mut self, governor: &mut Governor, ticks: usize, per_sec: impl Fn(u32) -> f64) {
            for _ in 0..ticks {
                self.tick(governor, 0, &per_sec);
            }
        }

        /// 100 ms of a server that nobody sends to.
        fn idle(&mut self, governor: &mut Governor) -> u32 {
            self.now += Duration::from_millis(100);
            let (counts, overruled) = (self.counts, self.overruled);
            governor.look(Look { now: self.now, counts, in_flight: 0, ceiling: 256, crowded: false, overruled })
        }

        /// 100 ms of a server that finishes `per_sec(limit)` lines of 10 tokens a second.
        fn tick(&mut self, governor: &mut Governor, overloads: u64, per_sec: impl Fn(u32) -> f64) -> u32 {
            self.look(governor, overloads, false, per_sec)
        }

        /// The same, with someone else seen at the server (`crowded`) or not.
        fn look(
            &mut self,
            governor: &mut Governor,
            overloads: u64,
            crowded: bool,
            per_sec: impl Fn(u32) -> f64,
        ) -> u32 {
            let limit = governor.limit();
            self.now += Duration::from_millis(100);
            // Whole lines, the fractions carried to the next tick.
            self.owed += per_sec(limit) / 10.0;
            let lines = self.owed.floor();
            self.owed -= lines;
            let lines = lines as u64;
            self.counts.add(&Counts { lines, tokens: 10 * lines, overloads });
            let overruled = self.overruled;
            governor.look(Look {
                now: self.now,
                counts: self.counts,
                in_flight: limit,
                ceiling: 256,
                crowded,
                overruled,
            })
        }
    }

    /// A governor settled over `ticks` ticks at a server batching 64, and the server.
    fn settled(ticks: usize) -> (Server, Governor) {
        let mut server = Server::new();
        let mut governor = Governor::new(256);
        server.settle(&mut governor, ticks, batching(64));
        (server, governor)
    }

    fn batching(batch: u32) -> impl Fn(u32) -> f64 {
        move |n| f64::from(n.min(batch)) * 20.0 / (1.0 + 0.01 * f64::from(n.min(batch)))
    }

    #[test]
    fn it_finds_the_batch_size_of_a_batching_server() {
        let mut server = Server::new();
        let mut governor = Governor::new(256);
        let limits: Vec<u32> = (0..1200).map(|_| server.tick(&mut governor, 0, batching(24))).collect();
        let late = &limits[600..];
        let mean = late.iter().map(|l| f64::from(*l)).sum::<f64>() / late.len() as f64;
        assert!((22.0..=30.0).contains(&mean), "near 24: {mean}");
    }

    #[test]
    fn overload_cuts_at_once_but_one_burst_cuts_once() {
        let (mut server, mut governor) = settled(200);
        let before = governor.limit();
        assert!(before >= 32, "{before}");
        let after = server.tick(&mut governor, 3, batching(64));
        assert_eq!(after, before / 2, "429s halve it");
        assert_eq!(server.tick(&mut governor, 5, batching(64)), after, "the same burst a moment later");
        server.settle(&mut governor, 10, batching(64));
        assert_eq!(server.tick(&mut governor, 1, batching(64)), after / 2, "a second later, another burst");
    }

    /// A server out of reach for ten minutes (restarting: its lines wait, none finishes)
    /// leaves the limit where it was, instead of a step down every window it lasted.
    #[test]
    fn an_outage_in_which_nothing_finishes_leaves_the_limit_alone() {
        let (mut server, mut governor) = settled(600);
        let before = governor.limit();
        let during: Vec<u32> = (0..6000).map(|_| server.tick(&mut governor, 0, |_| 0.0)).collect();
        assert!(during.iter().all(|limit| *limit == before), "held at {before}: {:?}", dedup(&during));
    }

    /// While something else sets the lines in flight (a batch alone filling a server
    /// that says its places), no window is judged: the limit is where it was when that
    /// ends, not where minutes of lines it did not set would have moved it. Overload
    /// still cuts it, and says so.
    #[test]
    fn overruled_looks_leave_the_limit_where_it_was_but_overload_still_cuts_it() {
        let (mut server, mut governor) = settled(600);
        let before = governor.limit();
        // As many lines finish whatever the limit: a probe down would lose nothing.
        server.overruled = true;
        let during: Vec<u32> = (0..3000).map(|_| server.tick(&mut governor, 0, |_| 1000.0)).collect();
        assert!(during.iter().all(|limit| *limit == before), "held at {before}: {:?}", dedup(&during));
        assert!(!governor.backed_off_within(server.now, Duration::from_secs(10)));
        assert_eq!(server.tick(&mut governor, 2, |_| 1000.0), before / 2, "429s halve it");
        assert!(governor.backed_off_within(server.now, Duration::from_secs(10)));
        assert!(!governor.backed_off_within(server.now + Duration::from_secs(10), Duration::from_secs(10)));
    }

    fn dedup(limits: &[u32]) -> Vec<u32> {
        let mut limits = limits.to_vec();
        limits.dedup();
        limits
    }

    /// An upstream that answers every line in 300 ms whatever the concurrency: from the
    /// start the limit doubles every round trip (it took two seconds a doubling, then two
    /// round trips), and alone it leaps fourfold after the first doubling.
    #[test]
    fn from_the_start_the_limit_doubles_or_leaps_every_round_trip() {
        let scaling = |n: u32| f64::from(n) / 0.3;
        let reached = |governor: &mut Governor, crowded: bool| {
            let mut server = Server::new();
            let limits: Vec<u32> = (0..40).map(|_| server.look(governor, 0, crowded, scaling)).collect();
            let tick = limits.iter().position(|limit| *limit == 256).map(|tick| tick + 1);
            (tick, dedup(&limits))
        };
        // Alone: 8, 16, then 64 and 256, a round trip each.
        let (tick, limits) = reached(&mut Governor::new(256), false);
        assert_eq!(limits, [8, 16, 64, 256]);
        assert!(tick.is_some_and(|tick| tick <= 10), "256 within about a second: {tick:?}");
        // Beside someone else: 5 doublings. With windows of a second and two turnovers it
        // took 9 s; with a settling round trip after each doubling, 3 s.
        let (tick, limits) = reached(&mut Governor::new(256), true);
        assert_eq!(limits, [8, 16, 32, 64, 128, 256]);
        assert!(tick.is_some_and(|tick| tick <= 18), "256 within about 1.5 s: {tick:?}");
        // Seconds with nothing sent before the batch change nothing: its first window
        // starts with its lines.
        let mut server = Server::new();
        let mut governor = Governor::new(256);
        for _ in 0..30 {
            assert_eq!(server.idle(&mut governor), 8);
        }
        let limits: Vec<u32> = (0..40).map(|_| server.look(&mut governor, 0, false, scaling)).collect();
        let after_idle = limits.iter().position(|limit| *limit == 256).map(|tick| tick + 1);
        assert_eq!((after_idle, dedup(&limits)), reached(&mut Governor::new(256), false), "as without the wait");
        // Counts that arrive late wait a settling window after each doubling.
        let mut server = Server::new();
        let mut governor = Governor::with_late_counts(256);
        let limits: Vec<u32> = (0..40).map(|_| server.tick(&mut governor, 0, scaling)).collect();
        assert_eq!(limits[..20].iter().max(), Some(&16), "two windows of a second a doubling: {limits:?}");
    }
}
