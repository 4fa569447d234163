//! The users' pace: a cap on the batch's sequences that keeps the users' time per token
//! within a target of their pace alone, on servers whose steps slow with every sequence.
//! Pure: the caller passes the time, its cumulative [`Timing`] and each reading.
//!
//! The design: docs/src/night-shift-design.md#the-delay-the-users-pace

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::line::Line;
use super::signals::TokenTime;

/// A sample is the lines that finished over at least this long…
pub const SAMPLE: Duration = Duration::from_millis(500);
/// … and at least this many of them (a sample of fewer waits, up to [`LONGEST_SAMPLE`]).
/// Where the server says its own time a token, a sample is of every sequence it ran, and
/// needs no line of the batch's: any token the server counted over at least [`SAMPLE`].
pub const SAMPLE_LINES: u64 = 4;
pub const LONGEST_SAMPLE: Duration = Duration::from_secs(10);
/// The users' time per token may reach this times their pace alone, beside the batch.
pub const TARGET: f64 = 1.2;
/// The fit is over this many samples, the latest.
pub const FIT_SAMPLES: usize = 240;
/// … of which at least this many…
const FIT_LEAST: usize = 6;
/// … spread over sequences with at least this variance…
const FIT_SPREAD: f64 = 0.25;
/// … which explains at least this share of the pace's (R²): where steps hardly slow
/// with their sequences, noise is most of what varies…
const FIT_EXPLAINS: f64 = 0.5;
/// … or gives a slope this many of its standard errors from none (Student's t): a real
/// server's pace drifts with the machine's other work, and over many samples a slope
/// that explains a fifth of it is still no accident. (llama-server with the small model
/// beside users: R² 0.1–0.45 over its first 40 samples, the slope the same 4–6 ms a
/// sequence throughout.) A slope so slight that noise is most of the pace leaves more
/// room than the server has places.
const FIT_T: f64 = 3.0;
/// Beside other traffic and with no fit, the batch steps down to half its lines for this
/// many samples, once in [`FIT_SAMPLES`]: a steady batch's samples all saw about as many
/// sequences, and on a loaded machine their noise hides a slope that is there.
pub const STEP_SAMPLES: u32 = 2;
/// … when it has at least this many lines in flight (half of fewer spreads little).
const STEP_LEAST: u32 = 4;

/// The batch's answered lines so far (cumulative), with their output tokens, the time
/// they took at the upstream and the sequences the server ran meanwhile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timing {
    pub lines: u64,
    pub tokens: u64,
    pub micros: u64,
    /// Σ tokens × the sequences the server ran on average over their line's time, in
    /// thousandths.
    pub load: u64,
}

/// One reading of the server, with this process's batch requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Look {
    pub timing: Timing,
    /// Requests the server runs (all traffic)…
    pub running: f64,
    /// … and queues.
    pub waiting: f64,
    /// This process's requests the server has.
    pub ours: u32,
    /// This process's batch requests in flight, which the cap bounds.
    pub in_flight: u32,
    /// The server had traffic besides this process's lately.
    pub others: bool,
    /// Other processes send batch lines to the server too (worker pods): their lines
    /// count as other traffic here, and a pace learned by a step down, or kept past
    /// what the samples say, would hold the batch for its own lines. Neither, then.
    pub shared: bool,
    /// The server's own time a token, where it says: the pace without the queue's wait,
    /// so a sample counts beside a queue too.
    pub token_time: Option<TokenTime>,
}

#[derive(Clone, Debug, Default)]
pub struct Delay {
    cap: Option<f64>,
    open: Option<Open>,
    /// (sequences the server ran, microseconds a token), the latest last.
    samples: VecDeque<(f64, f64)>,
    /// The pace last fitted: kept while the samples do not spread enough to fit again
    /// (nothing new is not something else; not by a worker pod, [`Look::shared`]),
    /// dropped once they spread and the sequences do not explain the pace.
    pace: Option<Pace>,
    /// A step down to learn the slope: its cap, and the samples it still lasts.
    step: Option<(u32, u32)>,
    /// Samples since the last step down began (`None`: never).
    since_step: Option<usize>,
}

/// What the samples say of a step's pace.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fit {
    Pace(Pace),
    /// Too few samples, or spread over too few sequences, to say anything.
    Unspread,
    /// Spread, and the pace does not slow with the sequences (or noise is most of it).
    Flat,
}

#[derive(Clone, Copy, Debug)]
struct Open {
    started: Instant,
    at_start: Timing,
    token_time_at_start: Option<TokenTime>,
    readings: u32,
    /// Σ over its readings of the requests the server ran, and of the others' part.
    running: f64,
    others: f64,
    /// A reading saw requests wait: the lines' time includes the wait, not only steps.
    queued: bool,
}

/// A step's time as `fixed + per_sequence × sequences`, in microseconds a token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    pub fixed: f64,
    pub per_sequence: f64,
}

impl Delay {
    /// The cap on batch requests in flight now (`None`: no cap): the pace's, or a step
    /// down's.
    pub fn cap(&self) -> Option<u32> {
        let paced = self.cap.map(|cap| cap.floor() as u32);
        [paced, self.step.map(|(cap, _)| cap)].into_iter().flatten().min()
    }

    /// Takes a reading in, with the throughput rule's `limit`; returns the cap.
    pub fn read(&mut self, now: Instant, look: Look, limit: u32) -> Option<u32> {
        if !look.others {
            self.cap = None;
            self.step = None;
        }
        let Some((running, others, per_token)) = self.sampled(now, look) else { return self.cap() };
        self.samples.push_back((running, per_token));
        if self.samples.len() > FIT_SAMPLES {
            self.samples.pop_front();
        }
        self.pace = match fit(&self.samples) {
            Fit::Pace(pace) => Some(pace),
            Fit::Unspread if !look.shared => self.pace,
            Fit::Unspread | Fit::Flat => None,
        };
        self.since_step = self.since_step.map(|since| since + 1);
        self.step = self.step.and_then(|(cap, left)| (left > 1).then_some((cap, left - 1)));
        if !look.others {
            return None;
        }
        let Some(pace) = self.pace else {
            self.cap = None;
            if !look.shared {
                self.step_down(look.in_flight);
            }
            return self.cap();
        };
        let alone = pace.fixed + pace.per_sequence * others;
        let room = (TARGET - 1.0) * alone / pace.per_sequence;
        let target = (f64::from(look.in_flight) + room - f64::from(look.ours)).max(0.0);
        // Down at once; up a line a sample, while the batch uses its cap.
        let cap = match self.cap {
            Some(cap) if target > cap && f64::from(look.in_flight) + 1.0 >= cap => (cap + 1.0).min(target),
            Some(cap) if target > cap => cap,
            _ => target,
        };
        self.cap = (cap < f64::from(limit)).then_some(cap);
        self.cap()
    }

    /// Without a fit, steps the batch down to half its lines for [`STEP_SAMPLES`], if
    /// none did over the last [`FIT_SAMPLES`] and enough samples have come to try a fit.
    fn step_down(&mut self, in_flight: u32) {
        let due = self.since_step.is_none_or(|since| since >= FIT_SAMPLES);
        if self.step.is_none() && due && self.samples.len() >= FIT_LEAST && in_flight >= STEP_LEAST {
            self.step = Some((in_flight / 2, STEP_SAMPLES));
            self.since_step = Some(0);
        }
    }

    /// The pace of a step last fitted.
    pub fn pace(&self) -> Option<Pace> {
        self.pace
    }

    /// The open sample's average sequences at the server, other traffic's part of them
    /// and time per token, when it is complete (and a new one opens).
    fn sampled(&mut self, now: Instant, look: Look) -> Option<(f64, f64, f64)> {
        let fresh = Open {
            started: now,
            at_start: look.timing,
            token_time_at_start: look.token_time,
            readings: 0,
            running: 0.0,
            others: 0.0,
            queued: false,
        };
        let open = self.open.get_or_insert(fresh);
        let (timing, at_start) = (look.timing, open.at_start);
        let went_back = timing.lines < at_start.lines
            || timing.tokens < at_start.tokens
            || timing.micros < at_start.micros
            || timing.load < at_start.load;
        // The server's own time a token came or went, or its counts went back (a restart).
        let server_changed = match (look.token_time, open.token_time_at_start) {
            (Some(now), Some(start)) => now.went_back(start),
            (now, start) => now.is_some() != start.is_some(),
        };
        if went_back || server_changed {
            self.open = Some(fresh);
            return None;
        }
        open.readings += 1;
        open.running += look.running;
        open.others += (look.running - f64::from(look.ours)).max(0.0);
        open.queued |= look.waiting > 0.0;
        let elapsed = now.saturating_duration_since(open.started);
        if elapsed < SAMPLE {
            return None;
        }
        if let (Some(token_time), Some(start)) = (look.token_time, open.token_time_at_start) {
            return Self::server_sample(open, token_time.since(start), elapsed, fresh);
        }
        let lines = timing.lines - at_start.lines;
        if lines < SAMPLE_LINES && (elapsed < LONGEST_SAMPLE || lines == 0) {
            return None;
        }
        let closed = std::mem::replace(open, fresh);
        let tokens = timing.tokens - at_start.tokens;
        (tokens > 0 && !closed.queued).then(|| {
            let per_token = (timing.micros - at_start.micros) as f64 / tokens as f64;
            let running = (timing.load - at_start.load) as f64 / 1000.0 / tokens as f64;
            (running, closed.others / f64::from(closed.readings), per_token)
        })
    }

    /// A sample of the server's own time a token (`seconds` a token since it opened, if
    /// any token came): over every sequence the server ran, so beside the readings'
    /// average of them, the batch's lines or not. A sample no token ends is dropped after
    /// [`LONGEST_SAMPLE`].
    fn server_sample(open: &mut Open, seconds: Option<f64>, elapsed: Duration, fresh: Open) -> Option<(f64, f64, f64)> {
        if seconds.is_none() && elapsed < LONGEST_SAMPLE {
            return None;
        }
        let closed = std::mem::replace(open, fresh);
        let readings = f64::from(closed.readings);
        seconds.map(|seconds| (closed.running / readings, closed.others / readings, seconds * 1e6))
    }
}

/// The pace of a step fitted to `samples` by least squares, if they spread over enough
/// sequences, the sequences explain most of how the pace varies (or the slope is too many
/// standard errors from none to be an accident), and it slows with them.
fn fit(samples: &VecDeque<(f64, f64)>) -> Fit {
    if samples.len() < FIT_LEAST {
        return Fit::Unspread;
    }
    let line = Line::through(samples);
    if line.var_x < FIT_SPREAD {
        return Fit::Unspread;
    }
    let per_sequence = line.slope();
    // A fixed part under nothing is noise's: a step of no sequences takes no time.
    let fixed = (line.mean_y - per_sequence * line.mean_x).max(0.0);
    if per_sequence > 0.0 && (line.explained() >= FIT_EXPLAINS || line.t_squared() >= FIT_T * FIT_T) {
        Fit::Pace(Pace { fixed, per_sequence })
    } else {
        Fit::Flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u32 = 64;
    const READING: Duration = Duration::from_millis(100);

    /// A server whose step takes `fixed + per_sequence × sequences` ms, running users
    /// whose number goes round `users`, and a batch that keeps its cap's lines in flight
    /// (the throughput rule's 64 without one, one at least: the probe), each of 32 tokens.
    struct Server {
        fixed: f64,
        per_sequence: f64,
        users: Vec<u32>,
        delay: Delay,
        now: Instant,
        timing: Timing,
        tokens: f64,
        readings: usize,
        /// Requests wait at the server at every reading (users queue), each adding a
        /// step's time to a line's.
        waiting: f64,
        /// The server's own time a token, if it says it.
        token_time: Option<TokenTime>,
    }

    impl Server {
        fn new(fixed: f64, per_sequence: f64, users: &[u32]) -> Self {
            Self {
                fixed,
                per_sequence,
                users: users.to_vec(),
                delay: Delay::default(),
                now: Instant::now(),
                timing: Timing::default(),
                tokens: 0.0,
                readings: 0,
                waiting: 0.0,
                token_time: None,
            }
        }

        fn in_flight(&self) -> u32 {
            self.delay.cap().unwrap_or(LIMIT).clamp(1, LIMIT)
        }

        fn step_ms(&self, users: u32, batch: u32) -> f64 {
            self.fixed + self.per_sequence * f64::from(users + batch)
        }

        /// One reading's span of it (users change every second); returns the cap after.
        fn read(&mut self) -> Option<u32> {
            let users = self.users[self.readings / 10 % self.users.len()];
            self.readings += 1;
            let in_flight = self.in_flight();
            let step_ms = self.step_ms(users, in_flight);
            let tokens = f64::from(in_flight) * READING.as_secs_f64() * 1000.0 / step_ms;
            self.tokens += tokens;
            self.timing.micros += (tokens * step_ms * (1.0 + self.waiting) * 1000.0) as u64;
            if let Some(time) = &mut self.token_time {
                let all = f64::from(users + in_flight) * READING.as_secs_f64() * 1000.0 / step_ms;
                time.seconds += all * step_ms / 1000.0;
                time.tokens += all;
            }
            self.timing.load += (tokens * f64::from(users + in_flight) * 1000.0) as u64;
            self.timing.tokens = self.tokens as u64;
            self.timing.lines = self.timing.tokens / 32;
            self.now += READING;
            let look = Look {
                timing: self.timing,
                running: f64::from(users + in_flight),
                waiting: self.waiting,
                ours: in_flight,
                in_flight,
                others: users > 0,
                shared: false,
                token_time: self.token_time,
            };
            self.delay.read(self.now, look, LIMIT)
        }

        fn settle(&mut self, seconds: usize) -> Vec<Option<u32>> {
            (0..seconds * 10).map(|_| self.read()).collect()
        }
    }

    #[test]
    fn beside_users_the_batch_holds_what_keeps_their_pace_within_the_target() {
        // (fixed, per sequence) ms: a CPU (every sequence a step's worth again), a small
        // GPU, a large one.
        for (fixed, per_sequence) in [(2.0, 2.0), (12.0, 0.125), (5.0, 0.04)] {
            let mut server = Server::new(fixed, per_sequence, &[2, 3, 4, 3]);
            server.settle(60);
            let pace = server.delay.pace().expect("a fit");
            // Samples that straddle a change of users blur the fit a little.
            assert!((pace.fixed / (fixed * 1000.0) - 1.0).abs() < 0.1, "{pace:?}");
            assert!((pace.per_sequence / (per_sequence * 1000.0) - 1.0).abs() < 0.02, "{pace:?}");
            let held = server.in_flight();
            let room = (TARGET - 1.0) * (fixed + per_sequence * 3.0) / per_sequence;
            let slowed = server.step_ms(3, held) / server.step_ms(3, 0);
            assert!(slowed <= TARGET + 1e-9 || held == 1, "{fixed} + {per_sequence}: {held} lines, {slowed}×");
            assert!(f64::from(held) >= room.floor().min(f64::from(LIMIT)) - 1.0, "{held} lines for a room of {room}");
        }
    }

    #[test]
    fn beside_a_queue_the_pace_is_the_servers_own_time_a_token() {
        // Users queue at every reading: the lines' own time has the wait in it.
        let mut server = Server::new(2.0, 2.0, &[2, 3, 4, 3]);
        server.waiting = 1.0;
        server.settle(60);
        assert!(server.delay.samples.is_empty() && server.delay.pace().is_none(), "{:?}", server.delay.samples);
        // Where the server says its time a token, that is the pace, queue or not.
        let mut server = Server::new(2.0, 2.0, &[2, 3, 4, 3]);
        server.waiting = 1.0;
        server.token_time = Some(TokenTime { seconds: 0.0, tokens: 0.0 });
        server.settle(60);
        let pace = server.delay.pace().expect("a fit");
        assert!((pace.fixed / 2000.0 - 1.0).abs() < 0.1 && (pace.per_sequence / 2000.0 - 1.0).abs() < 0.02, "{pace:?}");
        let held = server.in_flight();
        assert!(server.step_ms(3, held) / server.step_ms(3, 0) <= TARGET + 1e-9 || held == 1, "{held} lines");
    }

    #[test]
    fn a_slope_many_samples_agree_on_is_a_pace_though_noise_is_most_of_the_pace() {
        // 2 ms + 2 ms a sequence over 1 to 4 sequences, and noise of up to ±6 ms that
        // has nothing to do with them.
        let samples = |n: usize| -> VecDeque<(f64, f64)> {
            (0..n)
                .map(|i| {
                    let sequences = 1.0 + (i % 4) as f64;
                    let noise = ((i * 7919 + i / 4 * 104_729) % 13) as f64 - 6.0;
                    (sequences, 1000.0 * (2.0 + 2.0 * sequences + noise))
                })
                .collect()
        };
        let many = samples(80);
        let explained = Line::through(&many).explained();
        assert!(explained < FIT_EXPLAINS, "noise is most of it: R² {explained}");
        let Fit::Pace(pace) = fit(&many) else { panic!("a pace: {:?}", fit(&many)) };
        assert!((pace.per_sequence / 2000.0 - 1.0).abs() < 0.3, "{pace:?}");
        // Eight such samples could be an accident.
        assert_eq!(fit(&samples(8)), Fit::Flat);
    }

    #[test]
    fn alone_nothing_is_held_however_slow_the_steps() {
        let mut server = Server::new(2.0, 2.0, &[0]);
        assert!(server.settle(60).iter().all(Option::is_none));
    }

    #[test]
    fn on_steps_that_hardly_slow_the_batch_is_not_held() {
        // A large server: 20 ms + 10 µs a sequence, 256 of them a step an eighth longer.
        let mut server = Server::new(20.0, 0.01, &[20, 40, 60, 40]);
        assert!(server.settle(120).iter().all(Option::is_none));
    }

    #[test]
    fn a_steady_batch_steps_down_once_to_learn_the_slope_and_keeps_what_it_learned() {
        let mut server = Server::new(2.0, 2.0, &[3]);
        let caps = server.settle(30);
        // The first samples all saw the 3 users and the batch's 64 lines: nothing to fit,
        // and so a step down to half of them.
        let first = caps.iter().position(Option::is_some).expect("a cap");
        assert_eq!(caps[first], Some(LIMIT / 2), "{caps:?}");
        // Which spreads the samples: the slope, and the room it leaves (0.2 × 8 / 2 = 0.8).
        let pace = server.delay.pace().expect("a fit");
        assert!((pace.per_sequence / 2000.0 - 1.0).abs() < 0.05, "{pace:?}");
        assert_eq!(caps.last(), Some(&Some(0)));
        // Minutes on, the samples all saw the users and the one line: they do not spread,
        // and what was learned holds (no step down, no flood).
        let caps = server.settle(600);
        assert!(server.delay.samples.iter().all(|(running, _)| *running == 4.0), "{:?}", server.delay.samples);
        assert!(caps.iter().all(|cap| *cap == Some(0)), "{caps:?}");
        let kept = server.delay.pace().expect("the pace learned");
        assert!((kept.per_sequence / pace.per_sequence - 1.0).abs() < 0.01, "{kept:?} after {pace:?}");
    }

    #[test]
    fn noise_that_hides_the_slope_steps_the_batch_down_once_a_fit_window() {
        let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
        // A loaded machine: samples over 10 to 12 sequences whose pace is mostly noise.
        let noisy: VecDeque<_> =
            (0..20).map(|n| (10.0 + f64::from(n % 3), 20_000.0 + 6000.0 * f64::from((n * 7) % 5))).collect();
        assert_eq!(fit(&noisy), Fit::Flat);
        feed.delay.samples = noisy.clone();
        let opening = Look {
            timing: Timing::default(),
            running: 14.0,
            waiting: 0.0,
            ours: 11,
            in_flight: 11,
            others: true,
            shared: false,
            token_time: None,
        };
        feed.delay.read(feed.now, opening, LIMIT);
        let caps: Vec<_> = (0..2 * FIT_SAMPLES).map(|_| feed.sample(14.0, 11, LIMIT)).collect();
        let steps: Vec<_> = caps.iter().enumerate().filter(|(_, cap)| cap.is_some()).map(|(at, _)| at).collect();
        assert_eq!(steps, [0, 1, FIT_SAMPLES, FIT_SAMPLES + 1], "{caps:?}");
        assert!(caps.iter().flatten().all(|cap| *cap == 5));
        // A worker pod beside its siblings takes their lines for users': it does not step
        // down to learn a pace that would hold the batch for its own lines.
        let mut pod = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: true };
        pod.delay.samples = noisy;
        pod.delay.read(pod.now, opening, LIMIT);
        assert!((0..FIT_SAMPLES).all(|_| pod.sample(14.0, 11, LIMIT).is_none()));
    }

    /// Samples a second apart of four lines each, at 2 ms + 2 ms a sequence.
    struct Feed {
        delay: Delay,
        now: Instant,
        timing: Timing,
        /// Sibling processes send the batch's lines too.
        shared: bool,
    }

    impl Feed {
        fn sample(&mut self, running: f64, in_flight: u32, limit: u32) -> Option<u32> {
            let per_token = 2000.0 + 2000.0 * running;
            self.timing.lines += 4;
            self.timing.tokens += 128;
            self.timing.micros += (128.0 * per_token) as u64;
            self.timing.load += (128.0 * running * 1000.0) as u64;
            self.now += SAMPLE;
            let look = Look {
                timing: self.timing,
                running,
                waiting: 0.0,
                ours: in_flight,
                in_flight,
                others: true,
                shared: self.shared,
                token_time: None,
            };
            self.delay.read(self.now, look, limit)
        }
    }

    #[test]
    fn the_cap_comes_down_at_once_and_grows_back_a_line_a_sample_while_used() {
        let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
        feed.delay.samples = (0..20).map(|n| (f64::from(n % 5), 2000.0 + 2000.0 * f64::from(n % 5))).collect();
        let opening = Look {
            timing: Timing::default(),
            running: 11.0,
            waiting: 0.0,
            ours: 10,
            in_flight: 10,
            others: true,
            shared: false,
            token_time: None,
        };
        feed.delay.read(feed.now, opening, LIMIT);
        // One user: alone 4 ms a token, room for 0.2 × 4 / 2 = 0.4 of a line.
        assert_eq!(feed.sample(11.0, 10, LIMIT), Some(0));
        // Eight users: 18 ms alone, room for 1.8: a line a sample.
        assert_eq!(feed.sample(9.0, 1, LIMIT), Some(1));
        assert_eq!(feed.sample(9.0, 1, LIMIT), Some(1));
        assert!((feed.delay.cap.unwrap() - 1.8).abs() < 1e-9, "{:?}", feed.delay.cap);
        // Forty users: room for 8.2, but a batch with one line in flight of its 5 does
        // not grow its cap.
        feed.delay.cap = Some(5.0);
        assert_eq!(feed.sample(41.0, 1, LIMIT), Some(5));
        // Used, it would grow past the limit: no cap.
        assert_eq!(feed.sample(41.0, 5, 6), None);
        let pace = feed.delay.pace().unwrap();
        assert!((pace.fixed - 2000.0).abs() < 1e-6 && (pace.per_sequence - 2000.0).abs() < 1e-6, "{pace:?}");
    }

    #[test]
    fn samples_that_saw_a_queue_are_left_out_and_noise_is_not_a_slope() {
        let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
        let look = |timing, running, waiting| Look {
            timing,
            running,
            waiting,
            ours: 1,
            in_flight: 1,
            others: true,
            shared: false,
            token_time: None,
        };
        feed.delay.read(feed.now, look(Timing::default(), 4.0, 0.0), LIMIT);
        for n in 0..20_u64 {
            feed.timing.lines += 4;
            feed.timing.tokens += 128;
            feed.timing.micros += 128 * 50_000;
            feed.timing.load += 128 * 1000 * (4 + n % 4);
            feed.now += SAMPLE;
            feed.delay.read(feed.now, look(feed.timing, 4.0 + (n % 4) as f64, 1.0), LIMIT);
        }
        assert!(feed.delay.samples.is_empty(), "every sample saw requests wait");
        // Paces that do not follow the sequences: nothing explains them, nothing is held.
        feed.delay.samples = (0..40).map(|n| (f64::from(n % 4), 5000.0 + 1000.0 * f64::from((n * 7) % 5))).collect();
        assert_eq!(fit(&feed.delay.samples), Fit::Flat);
    }
}
