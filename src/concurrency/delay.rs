//! The users' pace: a cap on the batch's sequences that keeps the users' time per token
//! within a target of their pace alone, on servers whose steps slow with every sequence.
//! Pure: the caller passes the time, its cumulative [`Timing`] and each reading.
//!
//! The design: docs/src/night-shift-design.md#the-delay-the-users-pace

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::line::Line;
use super::signals::TokenTime;
use super::view::Presence;

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
/// room than the server has places. Short of either, the steepest slope within this
/// many standard errors of the fit bounds the batch in `serve` ([`Fit::Bound`]).
const FIT_T: f64 = 3.0;
/// Beside other traffic and with no fit, the batch steps down to half its lines for this
/// many samples, once in [`FIT_SAMPLES`]: a steady batch's samples all saw about as many
/// sequences, and on a loaded machine their noise hides a slope that is there.
pub const STEP_SAMPLES: u32 = 2;
/// … when it has at least this many lines in flight (half of fewer spreads little).
const STEP_LEAST: u32 = 4;
/// Beside users in `serve`, the batch holds the probe's line until [`FIT_LEAST`] samples
/// have come, or this long since it began to ([`Delay::learning`]): a server that does
/// not say its own time a token takes [`SAMPLE_LINES`] of the batch's lines a sample,
/// which at one line in flight could take minutes.
pub const LEARN_AT_MOST: Duration = Duration::from_secs(10);
/// A process's part of the batch's `room`: all of it in `serve`. A worker pod's is its
/// `share` of it, but the pod whose turn it is at the probe keeps a line whatever the
/// caps, as `serve` does: its part counts the line, and the others share what it leaves,
/// so that a room of less than a line is one line between the pods, not one and the
/// others' parts.
fn part(room: f64, share: f64, probing: bool) -> f64 {
    let share = share.clamp(0.0, 1.0);
    if share >= 1.0 || probing {
        return share * room;
    }
    let others = (1.0 / share - 1.0).max(1.0);
    (room - (share * room).max(f64::from(super::PROBE_LINES))).max(0.0) / others
}

/// A cap as whole requests: in `serve` (`share` 1) its floor, which keeps the users
/// within the target; a worker pod's part of the room is a fraction, its floor one more
/// with the probability of the fraction (`draw`: uniform in 0..1), as the headroom's
/// ([`super::headroom::take`]): rounded down, four pods' parts of a line of room would
/// be none.
fn whole(cap: f64, share: f64, draw: f64) -> u32 {
    if share < 1.0 { super::headroom::take(cap, draw) } else { cap.max(0.0).floor() as u32 }
}

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
    /// This process's requests answered that the server's gauges still count (they lag
    /// its answers: [`super::lag`]): `running` counts them, and they are nobody else's.
    pub still_counted: u32,
    /// This process's batch requests in flight, which the cap bounds.
    pub in_flight: u32,
    /// The server had traffic besides this process's lately.
    pub others: bool,
    /// This process's part of the batch's room (1 in `serve`; a worker pod's is an equal
    /// part with the other pods that send to the server): below 1, a pace learned by a
    /// step down, or kept past what the samples say, could hold the batch for its
    /// siblings' lines, which come and go as theirs do. Neither, then.
    pub share: f64,
    /// The users' requests the server holds (runs, or queues: few do beside a paced
    /// batch), as every process that sends it the batch's lines saw them together (a
    /// worker pod's grant says, a second late; [`super::view`]). `None`: as this process
    /// sees them, which in `serve` is all of them; a worker pod that has not been told
    /// yet holds nothing for them.
    pub users: Option<f64>,
    /// This process keeps the probe's line now, whatever the caps
    /// ([`super::PROBE_LINES`]; worker pods in turns, `serve` always).
    pub probing: bool,
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
    /// The pace last fitted, or in `serve` the steepest the samples allow
    /// ([`Fit::Bound`]): kept while the samples do not spread enough to fit again
    /// (nothing new is not something else; not by a worker pod, [`Look::share`]),
    /// dropped once they spread and the pace does not slow with the sequences.
    pace: Option<Pace>,
    /// The pace's cap made whole when it was set ([`whole`]).
    held: Option<u32>,
    /// A step down to learn the slope: its cap, and the samples it still lasts.
    step: Option<(u32, u32)>,
    /// Samples since the last step down began (`None`: never).
    since_step: Option<usize>,
    /// Whether a worker pod's users have gone, over its samples.
    users: Presence,
    /// When the batch began to hold the probe's line beside users, before a pace: its
    /// first reading with lines in flight (the signal is read before any batch comes).
    learning_since: Option<Instant>,
}

/// What the samples say of a step's pace.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fit {
    Pace(Pace),
    /// Spread, but noise is most of the pace: a slope of nothing is not ruled out, and
    /// neither is this one, the steepest within [`FIT_T`] standard errors of the fit. In
    /// `serve` it holds the batch while the samples grow (each narrows it); a worker
    /// pod's samples mix its siblings' lines with its users' and it holds nothing by it.
    /// Taken for no slope at all, it let the batch take the places that a pace fitted
    /// later would have kept for the users: beside users at 40% of llama-server's
    /// small model on four slots, the batch held two or three lines in a third of the
    /// readings where fixed 1 holds one, and its users' p99 went to 1.73× their p99
    /// alone against fixed 1's 1.25×.
    Bound(Pace),
    /// Too few samples, or spread over too few sequences, to say anything.
    Unspread,
    /// Spread, and the pace does not slow with the sequences, for sure.
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
        [self.held, self.step.map(|(cap, _)| cap)].into_iter().flatten().min()
    }

    /// Takes a reading in, with the throughput rule's `limit`; returns the cap. `draw`
    /// (uniform in 0..1) makes a worker pod's part of the room whole ([`whole`]).
    pub fn read(&mut self, now: Instant, look: Look, limit: u32, draw: f64) -> Option<u32> {
        if !look.others {
            self.set(None, &look, draw);
            self.step = None;
        }
        let shared = look.share < 1.0;
        // Beside users with no pace yet, `serve` may hold the probe's line: set once a
        // reading, here where no sample completes, below where one does (it may end the
        // learning).
        let unpaced = look.others && !shared && self.pace.is_none();
        if unpaced && look.in_flight > 0 {
            self.learning_since.get_or_insert(now);
        }
        let Some((running, others, per_token)) = self.sampled(now, look) else {
            if unpaced {
                self.hold_while_learning(now, shared);
            }
            return self.cap();
        };
        self.samples.push_back((running, per_token));
        if self.samples.len() > FIT_SAMPLES {
            self.samples.pop_front();
        }
        self.pace = match fit(&self.samples) {
            Fit::Pace(pace) => Some(pace),
            Fit::Bound(pace) if !shared => Some(pace),
            Fit::Unspread if !shared => self.pace,
            Fit::Bound(_) | Fit::Unspread | Fit::Flat => None,
        };
        self.since_step = self.since_step.map(|since| since + 1);
        self.step = self.step.and_then(|(cap, left)| (left > 1).then_some((cap, left - 1)));
        // A worker pod beside its siblings alone (their lines are the batch's), or not
        // told yet what its users run. A dip is not a departure: a pod that let its cap
        // go at every sample of fewer than half a user held nothing for them some 10% of
        // its readings, at a server of four slots.
        if !look.others || (shared && (look.users.is_none() || self.users.gone(now, others))) {
            self.set(None, &look, draw);
            self.step = None;
            return None;
        }
        let Some(pace) = self.pace else {
            self.hold_while_learning(now, shared);
            if !shared {
                self.step_down(look.in_flight);
            }
            return self.cap();
        };
        let alone = pace.fixed + pace.per_sequence * others;
        let room = (TARGET - 1.0) * alone / pace.per_sequence;
        // This process's part of it (all of it in `serve`), less its lines the server has.
        let part = part(room, look.share, look.probing);
        let target = (f64::from(look.in_flight) + part - f64::from(look.ours)).max(0.0);
        // Down at once; up a line a sample, while the batch uses its cap.
        let cap = match self.cap {
            Some(cap) if target > cap && f64::from(look.in_flight) + 1.0 >= cap => (cap + 1.0).min(target),
            Some(cap) if target > cap => cap,
            _ => target,
        };
        self.set((cap < f64::from(limit)).then_some(cap), &look, draw);
        self.cap()
    }

    /// In `serve`, before the samples could say anything of the users' pace (fewer than
    /// [`FIT_LEAST`], for at most [`LEARN_AT_MOST`]): beside them, the batch holds the
    /// probe's line meanwhile, some three seconds where the server says its time a token.
    /// Lines taken before the pace is known outlive the readings that would have let them
    /// go: a line of llama-server's small model takes a second or more.
    fn learning(&self, now: Instant, shared: bool) -> bool {
        !shared
            && self.pace.is_none()
            && self.samples.len() < FIT_LEAST
            && self.learning_since.is_none_or(|since| now.saturating_duration_since(since) < LEARN_AT_MOST)
    }

    /// Holds the probe's line while [`Self::learning`], or lets go. The hold is no pace's
    /// cap: the first pace fitted sets its own at once, not a line a sample up from the
    /// hold. Climbing so from it, a batch beside 40 users at a simulated server of 128
    /// places and flat steps held 17 of the 88 they left over 27 s, a line more each
    /// half-second sample; the pace's own cap, 0.2 of the users' step over its slope,
    /// is the batch's from the first fit (llama-server's small model: a line or two).
    fn hold_while_learning(&mut self, now: Instant, shared: bool) {
        self.cap = None;
        self.held = self.learning(now, shared).then_some(0);
    }

    /// Sets the pace's cap, and makes it whole: once a sample, not a reading, where it
    /// is drawn. Lines outlive readings: drawn at each, a pod's cap of 1.3 would let a
    /// second line go at the first draw over 0.7, and it would hold two most of the time.
    fn set(&mut self, cap: Option<f64>, look: &Look, draw: f64) {
        self.cap = cap;
        self.held = cap.map(|cap| whole(cap, look.share, draw));
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
        let counted = f64::from(look.ours.saturating_add(look.still_counted));
        open.others += look.users.unwrap_or((look.running - counted).max(0.0));
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
/// standard errors from none to be an accident), and it slows with them; short of that,
/// the steepest pace they allow ([`Fit::Bound`]), where that slows with them.
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
        return Fit::Pace(Pace { fixed, per_sequence });
    }
    // Through the samples' means, as the fit is: the steeper, the less its fixed part.
    let steepest = per_sequence + FIT_T * line.slope_error();
    if steepest > 0.0 {
        Fit::Bound(Pace { fixed: (line.mean_y - steepest * line.mean_x).max(0.0), per_sequence: steepest })
    } else {
        Fit::Flat
    }
}

#[cfg(test)]
mod tests;
