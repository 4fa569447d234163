//! The delay against simulated servers whose steps slow with every sequence, beside
//! users whose number goes round, and against samples fed by hand.

use super::*;

const LIMIT: u32 = 64;
const READING: Duration = Duration::from_millis(100);

/// A server whose step takes `fixed + per_sequence × sequences` ms, running users
/// whose number goes round `users`, and a batch that keeps its cap's lines in flight
/// (the throughput rule's 64 without one, one at least: the probe), each of 32 tokens,
/// from the second reading on: the server is read before the batch's first line.
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
    /// The batch's lines answered that the server's gauges still count at every reading
    /// (they lag its answers), which the reader knows.
    still_counted: u32,
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
            still_counted: 0,
        }
    }

    fn in_flight(&self) -> u32 {
        if self.readings == 0 {
            return 0;
        }
        self.delay.cap().unwrap_or(LIMIT).clamp(1, LIMIT)
    }

    fn step_ms(&self, users: u32, batch: u32) -> f64 {
        self.fixed + self.per_sequence * f64::from(users + batch)
    }

    /// One reading's span of it (users change every second); returns the cap after.
    fn read(&mut self) -> Option<u32> {
        let users = self.users[self.readings / 10 % self.users.len()];
        let in_flight = self.in_flight();
        self.readings += 1;
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
            running: f64::from(users + in_flight + self.still_counted),
            waiting: self.waiting,
            ours: in_flight,
            still_counted: self.still_counted,
            in_flight,
            others: users > 0,
            share: 1.0,
            users: None,
            probing: true,
            token_time: self.token_time,
        };
        self.delay.read(self.now, look, LIMIT, 0.5)
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
fn lines_answered_that_lagging_gauges_still_count_are_not_the_users() {
    // Taken for users' sequences, ten lines would tell the delay that its users alone
    // run slower than they do, and leave the batch more room than keeps them within the
    // target: at 12 ms + 0.125 ms a sequence beside 3 users, 21.8 lines' room where it is 19.8.
    for (fixed, per_sequence) in [(12.0, 0.125), (5.0, 0.04)] {
        let held = |still_counted| {
            let mut server = Server::new(fixed, per_sequence, &[2, 3, 4, 3]);
            server.still_counted = still_counted;
            server.settle(60);
            server.in_flight()
        };
        assert_eq!(held(10), held(0), "{fixed} + {per_sequence}");
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
    // Eight such samples could be an accident: they only bound the slope, steeper than
    // the server's.
    let Fit::Bound(bound) = fit(&samples(8)) else { panic!("a bound: {:?}", fit(&samples(8))) };
    assert!(bound.per_sequence > 2000.0, "{bound:?}");
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
    let caps = server.settle(120);
    // The probe's line while the samples come (a line's four a sample, at 0.65 s a
    // line: the most it waits for them), then nothing.
    let learned = caps.iter().position(Option::is_none).expect("let go");
    assert!(caps[..learned].iter().all(|cap| *cap == Some(0)), "{caps:?}");
    assert!(learned <= 1 + LEARN_AT_MOST.as_millis() as usize / 100, "{learned}");
    assert!(caps[learned..].iter().all(Option::is_none), "{caps:?}");
}

#[test]
fn beside_users_the_batch_holds_the_probe_until_samples_come_and_keeps_what_they_teach() {
    let mut server = Server::new(2.0, 2.0, &[3]);
    let caps = server.settle(30);
    // The batch holds the probe's line from its first reading beside the users…
    let released = caps.iter().position(Option::is_none).expect("let go");
    assert!(released > 0 && caps[..released].iter().all(|cap| *cap == Some(0)), "{caps:?}");
    // … until the samples, which all saw the 3 users and the one line, say nothing: let
    // go, it spreads them, and they give the slope and the room it leaves (0.2 × 8 / 2
    // = 0.8).
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
fn noise_that_hides_the_slope_holds_the_batch_to_the_steepest_slope_it_allows() {
    let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
    // A loaded machine: samples over 10 to 12 sequences whose pace is mostly noise.
    let noisy: VecDeque<_> =
        (0..20).map(|n| (10.0 + f64::from(n % 3), 20_000.0 + 6000.0 * f64::from((n * 7) % 5))).collect();
    let Fit::Bound(bound) = fit(&noisy) else { panic!("a bound: {:?}", fit(&noisy)) };
    // Through the samples' means, so steep that its fixed part is none…
    assert!(bound.fixed == 0.0 && bound.per_sequence > 5000.0, "{bound:?}");
    feed.delay.samples = noisy.clone();
    feed.delay.read(feed.now, beside_users(Timing::default(), 12.0, 1), LIMIT, 0.5);
    // … and which leaves the batch a fifth of the 11 users' sequences (taken for no
    // slope at all, the delay held nothing).
    assert_eq!(feed.sample(12.0, 1, LIMIT), Some(2));
    assert!(feed.delay.pace().is_some_and(|pace| pace.per_sequence > 5000.0), "{:?}", feed.delay.pace());
    // A worker pod's samples mix its siblings' lines with its users': it holds nothing
    // by a bound.
    let mut pod = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: true };
    pod.delay.samples = noisy;
    pod.delay.read(pod.now, beside_users(Timing::default(), 12.0, 1), LIMIT, 0.5);
    assert_eq!(pod.sample(12.0, 1, LIMIT), None);
}

#[test]
fn a_steady_batch_whose_samples_do_not_spread_steps_down_once_a_fit_window() {
    let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
    // Samples that all saw 14 sequences (users and the batch alike steady), on a loaded
    // machine.
    let steady: VecDeque<_> = (0..20).map(|n| (14.0, 20_000.0 + 6000.0 * f64::from((n * 7) % 5))).collect();
    assert_eq!(fit(&steady), Fit::Unspread);
    feed.delay.samples = steady.clone();
    let opening = beside_users(Timing::default(), 14.0, 11);
    feed.delay.read(feed.now, opening, LIMIT, 0.5);
    let caps: Vec<_> = (0..2 * FIT_SAMPLES).map(|_| feed.sample(14.0, 11, LIMIT)).collect();
    let steps: Vec<_> = caps.iter().enumerate().filter(|(_, cap)| cap.is_some()).map(|(at, _)| at).collect();
    assert_eq!(steps, [0, 1, FIT_SAMPLES, FIT_SAMPLES + 1], "{caps:?}");
    assert!(caps.iter().flatten().all(|cap| *cap == 5));
    // A worker pod beside its siblings takes their lines for users': it does not step
    // down to learn a pace that would hold the batch for its own lines.
    let mut pod = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: true };
    pod.delay.samples = steady;
    pod.delay.read(pod.now, opening, LIMIT, 0.5);
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
        let look =
            Look { share: if self.shared { 0.25 } else { 1.0 }, ..beside_users(self.timing, running, in_flight) };
        self.delay.read(self.now, look, limit, 0.5)
    }
}

/// A reading in `serve` beside other traffic: the server runs `running`, of them
/// `in_flight` of this process's, all it has in flight, and nothing waits.
fn beside_users(timing: Timing, running: f64, in_flight: u32) -> Look {
    Look {
        timing,
        running,
        waiting: 0.0,
        ours: in_flight,
        still_counted: 0,
        in_flight,
        others: true,
        share: 1.0,
        users: None,
        probing: true,
        token_time: None,
    }
}

#[test]
fn the_cap_comes_down_at_once_and_grows_back_a_line_a_sample_while_used() {
    let mut feed = Feed { delay: Delay::default(), now: Instant::now(), timing: Timing::default(), shared: false };
    feed.delay.samples = (0..20).map(|n| (f64::from(n % 5), 2000.0 + 2000.0 * f64::from(n % 5))).collect();
    let opening = beside_users(Timing::default(), 11.0, 10);
    feed.delay.read(feed.now, opening, LIMIT, 0.5);
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
    let look = |timing, running, waiting| Look { waiting, ..beside_users(timing, running, 1) };
    feed.delay.read(feed.now, look(Timing::default(), 4.0, 0.0), LIMIT, 0.5);
    for n in 0..20_u64 {
        feed.timing.lines += 4;
        feed.timing.tokens += 128;
        feed.timing.micros += 128 * 50_000;
        feed.timing.load += 128 * 1000 * (4 + n % 4);
        feed.now += SAMPLE;
        feed.delay.read(feed.now, look(feed.timing, 4.0 + (n % 4) as f64, 1.0), LIMIT, 0.5);
    }
    assert!(feed.delay.samples.is_empty(), "every sample saw requests wait");
    // Paces that do not follow the sequences: nothing explains them, and they only bound
    // the slope.
    feed.delay.samples = (0..40).map(|n| (f64::from(n % 4), 5000.0 + 1000.0 * f64::from((n * 7) % 5))).collect();
    assert!(matches!(fit(&feed.delay.samples), Fit::Bound(_)), "{:?}", fit(&feed.delay.samples));
    // Paces that fall as sequences grow, for sure: flat.
    let falling: VecDeque<_> = (0..40).map(|n| (f64::from(n % 4), 9000.0 - 1000.0 * f64::from(n % 4))).collect();
    assert_eq!(fit(&falling), Fit::Flat);
}

/// Four worker pods of one batch at a server whose step takes `fixed + per_sequence ×
/// sequences` ms, beside users whose number goes round `users`: each pod reads the
/// server (all sequences) and its own lines and, when `told`, the users' (as the grant
/// says); untold, it takes its siblings' lines for users'. The throughput rule's limit
/// goes round `limits`, 3 s each. Returns the pods' lines in flight at each reading.
fn pods(fixed: f64, per_sequence: f64, users: &[u32], limits: &[u32], told: bool, seconds: usize) -> Vec<u32> {
    const PODS: usize = 4;
    let share = 1.0 / PODS as f64;
    let mut delays: [Delay; PODS] = Default::default();
    let mut timings = [Timing::default(); PODS];
    // Tokens as decoded, unrounded: a reading's few tokens rounded would each time skew a
    // sample's sequences and pace.
    let mut decoded = [0.0; PODS];
    // The server's own time a token, as llama-server and vLLM say: samples of half a
    // second, whatever the batch's lines.
    let mut server = TokenTime { seconds: 0.0, tokens: 0.0 };
    let mut lines = [LIMIT; PODS];
    let mut now = Instant::now();
    let mut totals = Vec::new();
    for reading in 0..seconds * 10 {
        let users = users[reading / 10 % users.len()];
        let limit = limits[reading / 30 % limits.len()];
        let batch: u32 = lines.iter().sum();
        let step_ms = fixed + per_sequence * f64::from(users + batch);
        now += READING;
        let steps = READING.as_secs_f64() * 1000.0 / step_ms;
        server.tokens += steps * f64::from(users + batch);
        server.seconds += steps * f64::from(users + batch) * step_ms / 1000.0;
        for pod in 0..PODS {
            let tokens = f64::from(lines[pod]) * READING.as_secs_f64() * 1000.0 / step_ms;
            let timing = &mut timings[pod];
            timing.micros += (tokens * step_ms * 1000.0) as u64;
            timing.load += (tokens * f64::from(users + batch) * 1000.0) as u64;
            decoded[pod] += tokens;
            timing.tokens = decoded[pod].round() as u64;
            timing.lines = timing.tokens / 32;
            let look = Look {
                timing: *timing,
                running: f64::from(users + batch),
                waiting: 0.0,
                ours: lines[pod],
                still_counted: 0,
                in_flight: lines[pod],
                others: true,
                share,
                // Told, the users as the pods saw them together; else what a pod sees
                // besides its own lines.
                users: Some(f64::from(if told { users } else { users + batch - lines[pod] })),
                // The first pod's turn at the probe.
                probing: pod == 0,
                token_time: Some(server),
            };
            // A draw that goes round the unit interval, as a uniform one would.
            let draw = (reading * PODS + pod) as f64 * 0.618_034 % 1.0;
            lines[pod] = delays[pod].read(now, look, limit, draw).unwrap_or(limit).clamp(1, limit);
        }
        totals.push(lines.iter().sum());
    }
    totals
}

#[test]
fn worker_pods_each_take_their_part_of_the_room_one_process_would_have() {
    // A CPU's steps: 20 ms and 1 ms a sequence, 5.5 users on average: 25.5 ms alone,
    // room for 0.2 × 25.5 = 5.1 of the batch's lines between the four pods.
    let (fixed, per_sequence, users) = (20.0, 1.0, [2, 9, 4, 7]);
    let slowed = |batch: f64| (fixed + per_sequence * (5.5 + batch)) / (fixed + per_sequence * 5.5);
    let last = |totals: &[u32]| totals[totals.len() - 200..].iter().map(|n| f64::from(*n)).sum::<f64>() / 200.0;
    let told = last(&pods(fixed, per_sequence, &users, &[LIMIT], true, 120));
    assert!(slowed(told) <= TARGET + 0.01, "{told:.2} lines: users {:.3}x", slowed(told));
    assert!(told >= 4.0, "the pods use the room: {told:.1} lines of 5");
}

#[test]
fn the_pod_at_the_probe_counts_its_line_in_its_part_and_the_others_share_what_it_leaves() {
    // Four pods and room for five lines: a part each, the probe within one of them.
    assert!((part(5.0, 0.25, true) - 1.25).abs() < 1e-9 && (part(5.0, 0.25, false) - 1.25).abs() < 1e-9);
    // Room for two: the probe's line, and a third of the other each.
    assert!((part(2.0, 0.25, true) - 0.5).abs() < 1e-9 && (part(2.0, 0.25, false) - 1.0 / 3.0).abs() < 1e-9);
    // Less than a line: the probe's, and nothing besides.
    assert_eq!(part(0.9, 0.25, false), 0.0);
    assert_eq!(part(0.9, 1.0, true), 0.9, "serve: all of it");
}

#[test]
fn worker_pods_alone_with_each_other_are_not_held() {
    // The batch's own lines go up and down with the throughput rule's limit: samples
    // that spread, and a pace fitted to them.
    let limits = [LIMIT, LIMIT / 4];
    let limit = |reading: usize| 4 * limits[reading / 30 % limits.len()];
    let told = pods(20.0, 1.0, &[0], &limits, true, 60);
    assert!(told.iter().enumerate().all(|(reading, n)| *n == limit(reading)), "{told:?}");
    // Untold, each pod takes the others' lines for users', and holds back for them.
    let untold = pods(20.0, 1.0, &[0], &limits, false, 60);
    assert!(untold.iter().rev().take(100).all(|n| *n <= 8), "{untold:?}");
}

#[test]
fn worker_pods_keep_holding_through_a_second_without_users() {
    // Users come and go at a server of a few places: a second with none in every four.
    // A dip, not a departure: the pods hold the room it leaves (0.2 × 20 ms: 4 lines),
    // not the throughput rule's limit, 64 a pod.
    let totals = pods(20.0, 1.0, &[4, 4, 4, 0], &[LIMIT], true, 60);
    let most = totals[totals.len() - 200..].iter().copied().max().unwrap();
    assert!(most <= 8, "the pods held at most {most} lines: {totals:?}");
}
