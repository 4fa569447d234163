//! Room kept free at the server for its users: a cap that leaves the server's other
//! traffic the places it uses, and a reserve for what arrives before the next reading.
//! Pure: the caller passes the time, the reading and its own requests in flight.
//!
//! The design: docs/src/night-shift-design.md#the-headroom-room-kept-for-the-users

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The reserve covers what other traffic grew by between two readings over this span.
pub const RESERVE_OVER: Duration = Duration::from_secs(5);
/// Other traffic counts at the most that the readings of this span saw, and the one
/// before them: a dip is not a departure.
pub const DIP: Duration = Duration::from_millis(250);
/// Alone, the batch keeps this share of the server's places queued there (a line at
/// least), where that pays ([`super::queue`] tries both) and the places are what the
/// server runs, not what its cache holds (there, none: `Headroom::bounded_places`): a
/// place freed mid-step is filled at the next one, not a round trip later. A quarter,
/// not an eighth or a half: at the family's 64-seq KV-bound simulator, when the queue
/// came on top of its cache too, both settled at 0.94 of the best fixed concurrency, a
/// quarter at 0.98.
pub const QUEUE_ALONE: f64 = 0.25;
/// Alone, before the server has queued anything, the cap is this times the lines in
/// flight that the server counts (the lines in flight, and the probe's line, at least):
/// a server that runs all it is sent has room for more, and with nobody else there an
/// overshoot costs a short queue of the batch's own lines, which shows the places. Lines
/// it has not counted yet are kept and add nothing: llama-server's count lags its
/// requests. A cap grown on what was sent, every reading, had 18 lines at 4 slots before
/// the server counted 8; one grown by half the lines counted on top of those in flight
/// still climbed a line a reading while it counted 2, to 12.
///
/// From the probe's line, not the throughput rule's start of 8: a slow server's users
/// come and go, and a fresh `serve` whose first readings saw none of them took
/// llama-server's small model with 4 slots for its batch's alone; the 8 lines ran some
/// 10 s there, and every user who came queued behind them (a line taken back from
/// llama-server's queue runs all the same). From one line, a server of 256 places fills
/// five readings (half a second) later than from 8.
pub const GROWTH_ALONE: f64 = 1.5;
/// Beside other traffic, before the server has queued anything, the batch may grow what
/// the server holds by this share of the most it was seen to run (a line at least) past
/// it: a server that ran all it was sent has those places at least, and the step that
/// finds where they end queues the users who come behind no more than it. Not held so,
/// the throughput rule's start doubled the batch from 128 lines to 256 beside users
/// holding some 90 of the family's 256-seq sequence-bound server (its cache said
/// thousands of places): 85 requests queued, users' among them, for the 0.6 s its
/// lines took, and the users' p99 went to 1.5–1.6× theirs alone over 30 s. The cache
/// and the reserve still bound the batch as they do once the places are known.
pub const GROWTH_BESIDE: f64 = 0.1;

/// One reading of the server, with this process's batch requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Occupancy {
    /// Requests the server runs (all traffic).
    pub running: f64,
    /// Requests it queues.
    pub waiting: f64,
    /// This process's requests the server has: sent and not answered.
    pub ours: u32,
    /// Of this process's requests answered since, those the server's gauges still count:
    /// gauges that lag its answers ([`super::lag`]).
    pub still_counted: u32,
    /// This process's batch requests in flight (the permits taken: also lines being
    /// prepared or written back), which the cap bounds.
    pub in_flight: u32,
    /// The share of its KV cache in use (0..1), where the server says.
    pub kv_cache_usage: Option<f64>,
    /// What the server holds besides this process's lines is the batch's own: a worker
    /// pod's siblings' lines, its grant saying the users have gone. The batch is alone
    /// there, as if one process held all its lines.
    pub siblings_only: bool,
}

impl Occupancy {
    /// What the server holds besides this process's lines (never below 0: a request
    /// on the wire is ours before the server counts it), and besides those answered
    /// that its gauges still count.
    pub(super) fn others(&self) -> f64 {
        (self.running + self.waiting - f64::from(self.ours) - f64::from(self.still_counted)).max(0.0)
    }

    /// The batch's lines at a server it has alone: those the server counts, or this
    /// process's lines sent and not answered, whichever is more. A server counts a line
    /// at its next step, and a line it has not counted yet holds a place all the same:
    /// taken for a free one, it was sent again (the cap grew by it, and its permit was
    /// taken up again once its answer came), and the batch alone kept twice its queue
    /// there (7.7 lines of 4 at the family's 16-seq CPU-like server). A line the server
    /// finished and whose answer is on its way is counted until the answer comes; its
    /// permit then goes to the next line. Nor is a line answered that the server's
    /// gauges still count (`still_counted`): its place is free. Worker pods alone
    /// together go by the count: a pod's own lines are a part of it that it cannot tell.
    fn held_alone(&self) -> f64 {
        if self.siblings_only { self.running + self.waiting } else { self.others() + f64::from(self.ours) }
    }
}

#[derive(Clone, Debug)]
pub struct Headroom {
    /// Beside other traffic, the share of a server's KV cache that the places fill at
    /// most ([`Headroom::new`]).
    cache_full: f64,
    places: Option<f64>,
    /// Other traffic in the readings of the last [`DIP`], and the one before them.
    others: VecDeque<(Instant, f64)>,
    /// When other traffic grew between two readings, and by how much.
    rises: VecDeque<(Instant, f64)>,
    /// The last reading that saw other traffic.
    others_seen: Option<Instant>,
    /// No reading saw other traffic over the last [`RESERVE_OVER`].
    alone: bool,
    /// The sequences that would fill the KV cache at each reading's mix (what runs over
    /// the share of the cache in use), over the last [`RESERVE_OVER`].
    fills: VecDeque<(Instant, f64)>,
    /// Alone, no queue is kept: it costs this server ([`super::queue`]).
    unqueued: bool,
    /// The most requests the server was seen to run.
    most_run: f64,
}

impl Headroom {
    /// A headroom that, beside other traffic on a server that says how full its KV
    /// cache is, holds the places to the sequences that fill `cache_full` of it at the
    /// fullest mix of the last [`RESERVE_OVER`]: where the load signal calls the cache
    /// full (`max_kv_cache_usage`, 0.95 by default). At 0.9, a tenth below the
    /// signal's own line, the family's KV-bound servers kept steady users' p99 at
    /// 1.02–1.04× and their batches 0.80–0.92 of the idle room (64 seqs) and 0.98–1.19
    /// (256); at 0.95 the same p99, at 0.91–1.07 and 1.04–1.26. Bursty users met one
    /// window at 1.36× in seven at 0.95 (16 sequences preempted), none in seven at 0.9
    /// (docs/src/night-shift-record.md#repeats-of-the-misses-beside-users-and-the-caches-share-at-095).
    pub fn new(cache_full: f64) -> Self {
        Self {
            cache_full,
            places: None,
            others: VecDeque::new(),
            rises: VecDeque::new(),
            others_seen: None,
            alone: false,
            fills: VecDeque::new(),
            unqueued: false,
            most_run: 0.0,
        }
    }

    /// The places kept free for other traffic now.
    pub fn reserve(&self) -> f64 {
        if self.alone {
            return 0.0;
        }
        self.rises.iter().map(|(_, rise)| *rise).fold(1.0, f64::max)
    }

    /// Whether a batch alone keeps [`QUEUE_ALONE`] queued at the server (it does unless
    /// told otherwise).
    pub fn keep_queue(&mut self, queue: bool) {
        self.unqueued = !queue;
    }

    /// The places a batch alone would keep [`QUEUE_ALONE`] on top of now: `None` until
    /// they are known, and where the server's cache bounds them rather than what it was
    /// seen to run (the queue is then none either way, and a trial of it compares two
    /// like sides).
    pub fn queue_places(&self) -> Option<f64> {
        self.bounded_places().filter(|(_, by_cache)| !by_cache).map(|(places, _)| places)
    }

    /// The server's places as learned: the most it ran when it was full, or since.
    pub fn places(&self) -> Option<f64> {
        self.places
    }

    /// No reading saw other traffic over the last [`RESERVE_OVER`].
    pub fn alone(&self) -> bool {
        self.alone
    }

    /// The places the batch and the server's other traffic share: the most the server
    /// ran when it was full, or since. Where the server says how full its cache is, no
    /// more than fill it at the fullest mix seen lately: sequences grow as they decode,
    /// and a cache that overflows preempts the newest and throws its work away. The
    /// fullest mix, not the latest: lines that started together grow together, and a
    /// cohort of young ones leaves room that is gone once they are old. Beside other
    /// traffic, [`Self::new`]'s share of the cache (the newest preempted is most often a
    /// user's); alone, all of it: held only by the places it had seen run, a batch alone
    /// at the family's 256-seq KV-bound simulator ran at 0.92 of fixed 128, preempting
    /// some 5,000 lines in 15 s, and at 0.95–1.00 held by the cache (some 1,200).
    ///
    /// Where the cache bounds the places, a batch alone queues nothing on top of them
    /// ([`QUEUE_ALONE`] is for places): the server takes a queued line in as soon as its
    /// prompt fits, into room its running lines grow into, and preempts them. Past a
    /// 30-s warm-up the queue took the 256-seq server to 0.95 of fixed 128 (some 2,200
    /// preempted), and without it 0.98–0.99 (some 180); the 64-seq one, whose best fixed
    /// count is past its cache, from 0.99–1.02 to 1.05–1.07 of it
    /// (docs/src/night-shift-record.md#no-queue-where-the-cache-bounds-the-places).
    ///
    /// A batch alone has its cache bound only once it has seen the server full: before,
    /// it grows by what the server runs ([`GROWTH_ALONE`]), where a young cache would
    /// say hundreds of places at the first reading.
    ///
    /// Returns the places, and whether the cache is what bounds them (the places the
    /// server ran are more, or not known).
    fn bounded_places(&self) -> Option<(f64, bool)> {
        let full = if self.alone { 1.0 } else { self.cache_full };
        let cache = self
            .fills
            .iter()
            .map(|(_, fill)| *fill)
            .reduce(f64::min)
            .filter(|_| !self.alone || self.places.is_some())
            .map(|fill| full * fill);
        match (self.places, cache) {
            (Some(places), Some(cache)) => Some((places.min(cache), cache < places)),
            (Some(places), None) => Some((places, false)),
            (None, cache) => cache.map(|cache| (cache, true)),
        }
    }

    /// Takes a reading in; returns the cap on this process's batch requests in flight:
    /// until the server has queued, it grows by what the server runs ([`GROWTH_ALONE`],
    /// [`GROWTH_BESIDE`]). `share` (0 < share ≤ 1) is this process's part of the free
    /// room; the cap is a fraction where it is less than all of it ([`take`] makes it
    /// whole).
    pub fn read(&mut self, now: Instant, occupancy: Occupancy, share: f64) -> f64 {
        if occupancy.waiting > 0.0 || self.places.is_some() {
            self.places = Some(self.places.unwrap_or(0.0).max(occupancy.running));
        }
        self.most_run = self.most_run.max(occupancy.running);
        let others = occupancy.others();
        if others > 0.0 {
            self.others_seen = Some(now);
        }
        self.alone = occupancy.siblings_only
            || self.others_seen.is_none_or(|at| now.saturating_duration_since(at) > RESERVE_OVER);
        // A dip is not a departure (the module's doc): growth counts from the higher of
        // the two readings before, and other traffic from the most of this one, the
        // readings of the last `DIP` and the one before them.
        while self.others.get(1).is_some_and(|(at, _)| now.saturating_duration_since(*at) > DIP) {
            self.others.pop_front();
        }
        let last_two = self.others.iter().rev().take(2).map(|(_, others)| *others).reduce(f64::max);
        if let Some(before) = last_two
            && others > before
        {
            self.rises.push_back((now, others - before));
        }
        let level = self.others.iter().map(|(_, before)| *before).fold(others, f64::max);
        self.others.push_back((now, others));
        if let Some(usage) = occupancy.kv_cache_usage.filter(|usage| *usage > 0.0 && occupancy.running >= 1.0) {
            self.fills.push_back((now, occupancy.running / usage));
        }
        for spans in [&mut self.rises, &mut self.fills] {
            while spans.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > RESERVE_OVER) {
                spans.pop_front();
            }
        }
        // Beside others, before a queue showed the places: what the server may hold.
        let grown_beside = (!self.alone && self.places.is_none())
            .then(|| self.most_run + (GROWTH_BESIDE * self.most_run).max(1.0) - f64::from(occupancy.ours) - level);
        let free = match (self.bounded_places(), grown_beside) {
            // Alone, before the server has queued.
            (None, None) => {
                let counted = (occupancy.running + occupancy.waiting).min(f64::from(occupancy.ours));
                let grown = (GROWTH_ALONE * counted).max(f64::from(occupancy.in_flight));
                return grown.max(f64::from(super::PROBE_LINES));
            }
            (Some((places, _)), _) if self.alone => {
                let queue = self
                    .queue_places()
                    .filter(|_| !self.unqueued)
                    .map_or(0.0, |places| (QUEUE_ALONE * places).max(1.0));
                places + queue - occupancy.held_alone()
            }
            (Some((places, _)), grown) => {
                let kept = places - f64::from(occupancy.ours) - level - self.reserve();
                grown.map_or(kept, |grown| kept.min(grown))
            }
            (None, Some(grown)) => grown,
        };
        let cap = f64::from(occupancy.in_flight) + share.clamp(0.0, 1.0) * free;
        cap.max(0.0)
    }
}

/// A cap as whole requests: its floor, and one more with the probability of its fraction
/// (`draw`: uniform in 0..1). Processes that share a server each hold a part of its free
/// room: rounded down, four worker pods' quarters of one free place would be nothing,
/// reading after reading; rounded up, they would be four places. Drawn, they take about
/// the one place between them.
pub fn take(cap: f64, draw: f64) -> u32 {
    let whole = cap.max(0.0).floor();
    whole as u32 + u32::from(draw < cap - whole)
}

#[cfg(test)]
mod tests;
