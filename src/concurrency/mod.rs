//! The night shift: how many requests in flight each upstream gets, so that batches
//! fill a model server's idle capacity without a guessed number and without making its
//! interactive users wait.
//!
//! The design: docs/src/night-shift-design.md#the-parts-and-where-they-run

pub mod control;
pub mod delay;
pub mod discovery;
pub mod gate;
pub mod governor;
pub mod headroom;
pub mod lag;
pub mod line;
pub mod presets;
pub mod priority;
pub mod queue;
pub mod recall;
pub mod rule;
pub mod signals;
pub mod staleness;
pub mod view;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Lines a batch keeps in flight, whatever the caps, while the last reading saw nothing
/// queue: a probe (`crate::exec::permits`; worker pods take turns at it). At none, a
/// batch would learn nothing more of the server (its places are learned from what runs,
/// its queue from what waits): a server whose users queue now and then on their own
/// would hold it at none for good.
pub const PROBE_LINES: u32 = 1;

/// Counts of an upstream's finished requests, since the process started: the governor
/// takes the difference between two readings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Lines that got a final answer (success or not).
    pub lines: u64,
    /// Their output tokens.
    pub tokens: u64,
    /// Attempts answered 429 or 503, or timed out.
    pub overloads: u64,
}

impl Counts {
    /// What happened between `earlier` and `self` (a reading of another run: all of it).
    pub fn since(&self, earlier: &Counts) -> Counts {
        if self.lines < earlier.lines || self.tokens < earlier.tokens || self.overloads < earlier.overloads {
            return *self;
        }
        Counts {
            lines: self.lines - earlier.lines,
            tokens: self.tokens - earlier.tokens,
            overloads: self.overloads - earlier.overloads,
        }
    }

    pub fn add(&mut self, other: &Counts) {
        self.lines += other.lines;
        self.tokens += other.tokens;
        self.overloads += other.overloads;
    }
}

/// [`Counts`] as requests finish, shared by every shard of the process, and the
/// requests the upstream has now.
#[derive(Default)]
pub struct Observed {
    lines: AtomicU64,
    tokens: AtomicU64,
    overloads: AtomicU64,
    at_upstream: AtomicU32,
    /// Requests sent so far.
    sent: AtomicU64,
    timed_lines: AtomicU64,
    timed_tokens: AtomicU64,
    timed_micros: AtomicU64,
    /// Σ output tokens × the sequences the server ran on average while their line ran,
    /// in thousandths.
    timed_load: AtomicU64,
    /// The sequences the server ran, integrated over time as the load signal read them
    /// (sequence-microseconds): a line's average is the difference over its time.
    load: AtomicU64,
    /// What the load signal saw since a worker pod last acknowledged its grant.
    views: view::Views,
}

/// A request sent and not answered yet, while it lives.
pub struct AtUpstream<'a>(&'a AtomicU32);

impl Drop for AtUpstream<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Observed {
    /// Counts a request as the upstream's from now until the guard is dropped (its
    /// answer came, or it failed). Unlike the permits in flight, this leaves out lines
    /// being prepared or written back: what the server itself counts as ours.
    pub fn sending(&self) -> AtUpstream<'_> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        self.at_upstream.fetch_add(1, Ordering::Relaxed);
        AtUpstream(&self.at_upstream)
    }

    pub fn at_upstream(&self) -> u32 {
        self.at_upstream.load(Ordering::Relaxed)
    }

    /// Requests sent so far (cumulative).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Where a scrape of the server begins: the requests it has, and those sent so far.
    pub fn mark(&self) -> (u32, u64) {
        (self.at_upstream(), self.sent())
    }

    /// This process's requests a scrape begun at `mark` counted, as many as it may
    /// have: those the server had when it began, and those sent meanwhile.
    pub fn at_upstream_since(&self, (had, sent): (u32, u64)) -> u32 {
        had.saturating_add(u32::try_from(self.sent() - sent).unwrap_or(u32::MAX))
    }

    pub fn finished(&self, output_tokens: u64) {
        self.lines.fetch_add(1, Ordering::Relaxed);
        self.tokens.fetch_add(output_tokens, Ordering::Relaxed);
    }

    /// An answer with `output_tokens` that took `took` at the upstream (its last attempt),
    /// sent when [`Self::load`] was `load_at_send`.
    pub fn answered(&self, output_tokens: u64, took: std::time::Duration, load_at_send: u64) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        if output_tokens == 0 || micros == 0 {
            return;
        }
        let running = self.load().saturating_sub(load_at_send) as f64 / micros as f64;
        self.timed_lines.fetch_add(1, Ordering::Relaxed);
        self.timed_tokens.fetch_add(output_tokens, Ordering::Relaxed);
        self.timed_micros.fetch_add(micros, Ordering::Relaxed);
        self.timed_load.fetch_add((output_tokens as f64 * running * 1000.0) as u64, Ordering::Relaxed);
    }

    /// The sequences the server ran, integrated over time so far.
    pub fn load(&self) -> u64 {
        self.load.load(Ordering::Relaxed)
    }

    /// The load signal saw the server run `running` sequences over the last `over`.
    pub fn ran(&self, running: f64, over: std::time::Duration) {
        self.load.fetch_add((running.max(0.0) * over.as_micros() as f64) as u64, Ordering::Relaxed);
    }

    pub fn timing(&self) -> delay::Timing {
        delay::Timing {
            lines: self.timed_lines.load(Ordering::Relaxed),
            tokens: self.timed_tokens.load(Ordering::Relaxed),
            micros: self.timed_micros.load(Ordering::Relaxed),
            load: self.timed_load.load(Ordering::Relaxed),
        }
    }

    /// A reading of the load signal: the server holds `held` requests (running or
    /// queued), and has `ours` of this process's ([`view::Views::add`]).
    pub fn seen(&self, held: f64, ours: u32) {
        self.views.add(held, ours);
    }

    /// What the load signal saw since this was last taken, stamped with the beat `until`
    /// ([`view::Views::take`]).
    pub fn take_view(&self, until: u64) -> Option<view::View> {
        self.views.take(until)
    }

    pub fn overloaded(&self) {
        self.overloads.fetch_add(1, Ordering::Relaxed);
    }

    pub fn counts(&self) -> Counts {
        Counts {
            lines: self.lines.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            overloads: self.overloads.load(Ordering::Relaxed),
        }
    }
}
