//! Whether a batch alone at a server keeps a short queue of its own lines there
//! ([`super::headroom::QUEUE_ALONE`]), learned per server by trying both. A queue fills a
//! place the step it is freed: the simulated servers gained 0.02–0.13 of their throughput
//! from it. At llama-server with 2 slots it cost up to half in one day's runs and gained
//! 10–20% in another's; a server whose every waiting request slows its steps loses by
//! it. Which one a server is cannot be told from its metrics, so the batch measures: windows with the queue and without,
//! in the order with, without, without, with (a drift of the server's pace over the
//! trial weighs on both alike), then the better for [`KEEP_FOR`], then a trial again.
//! A trial starts once the lines have turned over (as many finished as the places) since
//! the server's count came to set the batch's lines: the lines that filled the places
//! together finish unevenly at first, and would weigh on the first window's side alone.
//! Pure: the caller passes the time, its finished counts and, where the server's count
//! sets the batch's lines now, the places (alone, with the places known, and bound by
//! what the server ran rather than by its KV cache, where no queue is kept either way).
//!
//! The design: docs/src/night-shift-design.md#the-headroom-room-kept-for-the-users

use std::time::{Duration, Instant};

use super::Counts;

/// After a switch, this long goes unmeasured: a queue drains, or fills, in a step or two.
pub const SETTLE: Duration = Duration::from_millis(500);
/// A window of the trial lasts at least this long (opened and closed at looks that saw
/// lines finish: lines that finish together are counted in whole cohorts)…
pub const WINDOW: Duration = Duration::from_millis(2500);
/// … and until this many lines have finished (a slow server's few lines a second would
/// make a short window's count a coin toss), or [`MAX_WINDOW`].
pub const WINDOW_LINES: u64 = 16;
pub const MAX_WINDOW: Duration = Duration::from_secs(15);
/// Without the queue is chosen only where it did at least this much better: the queue
/// is what gained on every simulated server, and a trial's two windows a side are noisy.
pub const NONE_BY: f64 = 1.03;
/// A choice holds this long before the next trial: the queue's cost or gain is the
/// server's, and changes little; a trial spends half its time on the worse side.
pub const KEEP_FOR: Duration = Duration::from_secs(120);
/// The trial's windows: with the queue, without, without, with.
const ORDER: [bool; 4] = [true, false, false, true];

#[derive(Clone, Copy, Debug)]
struct Trial {
    /// The window of [`ORDER`] running now.
    window: usize,
    /// When it began (its first [`SETTLE`] is not measured).
    began: Instant,
    /// When its measure began, and the counts then.
    measured_from: Option<(Instant, Counts)>,
    /// Tokens (and lines) finished and seconds measured, without the queue and with it.
    tokens: [u64; 2],
    lines: [u64; 2],
    seconds: [f64; 2],
}

/// The trial's outcome: output tokens per second, without the queue and with it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Chosen {
    pub queue: bool,
    pub rates: [f64; 2],
}

#[derive(Clone, Debug, Default)]
pub struct QueueChoice {
    trial: Option<Trial>,
    /// The counts at the look before.
    last: Option<Counts>,
    /// The counts when the server's count came to set the batch's lines (`None` while it
    /// does not).
    filling_from: Option<Counts>,
    /// The last trial's outcome, and when it ended.
    chosen: Option<(Chosen, Instant)>,
}

impl QueueChoice {
    /// Whether to keep the queue now.
    pub fn queue(&self) -> bool {
        match (&self.trial, &self.chosen) {
            (Some(trial), _) => ORDER[trial.window],
            (None, Some((chosen, _))) => chosen.queue,
            (None, None) => true,
        }
    }

    /// Takes a look in (`places`: where the server's count sets the batch's lines now,
    /// the places a queue would be kept on top of); returns the trial's outcome when one
    /// ends at this look. A trial that the fill stops governing is dropped: what it
    /// measured was not the queue's doing.
    pub fn look(&mut self, now: Instant, counts: Counts, places: Option<f64>) -> Option<Chosen> {
        // A window opens and closes at a look that saw lines finish: the family's
        // simulators finish a step's lines together, a cohort of the places at a time,
        // and a window cut between cohorts holds two of them or three (the CPU-like one's
        // trials measured 410 tokens/s a side where it runs 478). Cut at cohorts, it
        // holds whole ones; where lines finish at every look, nothing changes.
        let finished = self.last.replace(counts).is_some_and(|last| counts.lines > last.lines);
        let Some(places) = places else {
            self.trial = None;
            self.filling_from = None;
            return None;
        };
        let turned_over = counts.since(self.filling_from.get_or_insert(counts)).lines as f64 >= places;
        let due = turned_over && self.chosen.is_none_or(|(_, at)| now.saturating_duration_since(at) >= KEEP_FOR);
        let trial = match &mut self.trial {
            Some(trial) => trial,
            None if due => self.trial.insert(Trial {
                window: 0,
                began: now,
                measured_from: None,
                tokens: [0; 2],
                lines: [0; 2],
                seconds: [0.0; 2],
            }),
            None => return None,
        };
        let Some((from, at_start)) = trial.measured_from else {
            if finished && now.saturating_duration_since(trial.began) >= SETTLE {
                trial.measured_from = Some((now, counts));
            }
            return None;
        };
        let elapsed = now.saturating_duration_since(from);
        let done = counts.since(&at_start);
        if !(elapsed >= MAX_WINDOW || (finished && elapsed >= WINDOW && done.lines >= WINDOW_LINES)) {
            return None;
        }
        let side = usize::from(ORDER[trial.window]);
        trial.tokens[side] += done.tokens;
        trial.lines[side] += done.lines;
        trial.seconds[side] += elapsed.as_secs_f64();
        trial.window += 1;
        if trial.window < ORDER.len() {
            // The same side twice running needs no settling.
            let settled = ORDER[trial.window] == ORDER[trial.window - 1];
            trial.began = now;
            trial.measured_from = settled.then_some((now, counts));
            return None;
        }
        let trial = self.trial.take().expect("a trial is running");
        let counted = if trial.tokens.iter().all(|tokens| *tokens > 0) { trial.tokens } else { trial.lines };
        let rates = [0, 1].map(|side| counted[side] as f64 / trial.seconds[side].max(f64::EPSILON));
        let chosen = Chosen { queue: rates[0] < NONE_BY * rates[1], rates };
        self.chosen = Some((chosen, now));
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server of 4 places that finishes `per_sec[queue]` lines of 10 tokens a second:
    /// looks every 100 ms from `start` for `secs`, filling; returns the outcomes and the
    /// side of every look.
    fn run(choice: &mut QueueChoice, start: Instant, secs: u64, per_sec: [f64; 2]) -> (Vec<Chosen>, Vec<bool>) {
        let (mut finished, mut outcomes, mut sides) = (0.0, Vec::new(), Vec::new());
        for n in 0..secs * 10 {
            let side = choice.queue();
            sides.push(side);
            finished += per_sec[usize::from(side)] / 10.0;
            let counts = Counts { lines: finished as u64, tokens: 10 * finished as u64, overloads: 0 };
            outcomes.extend(choice.look(start + Duration::from_millis(100 * n), counts, Some(4.0)));
        }
        (outcomes, sides)
    }

    #[test]
    fn a_server_that_loses_by_a_queue_is_sent_none_after_a_trial_of_both() {
        let start = Instant::now();
        let mut choice = QueueChoice::default();
        assert!(choice.queue(), "the queue until a trial says otherwise");
        let (outcomes, sides) = run(&mut choice, start, 20, [30.0, 15.0]);
        assert_eq!(outcomes.len(), 1, "{outcomes:?}");
        assert!(!outcomes[0].queue);
        assert!((outcomes[0].rates[0] / outcomes[0].rates[1] - 2.0).abs() < 0.1, "{outcomes:?}");
        // With, without, without, with: the first side switches once to none, once back.
        let switches = sides.windows(2).filter(|pair| pair[0] != pair[1]).count();
        assert_eq!(switches, 3, "{sides:?}");
        assert!(!choice.queue());
    }

    #[test]
    fn lines_that_finish_together_are_counted_in_whole_cohorts() {
        // 16 lines of 32 tokens finish together every 1.07 s, with the queue or not
        // (478 tokens a second, as the family's CPU-like simulator runs): looks every
        // 50 ms, at twelve phases of the cohorts.
        let start = Instant::now();
        let period = Duration::from_millis(1070);
        for offset in (0..1070).step_by(90) {
            let mut choice = QueueChoice::default();
            let mut outcomes = Vec::new();
            for n in 0..800u64 {
                let at = Duration::from_millis(offset + 50 * n);
                let cohorts = (at.as_secs_f64() / period.as_secs_f64()).floor() as u64;
                let counts = Counts { lines: 16 * cohorts, tokens: 16 * 32 * cohorts, overloads: 0 };
                outcomes.extend(choice.look(start + Duration::from_millis(50 * n), counts, Some(16.0)));
            }
            let chosen = outcomes.first().expect("a trial ended");
            let per_sec = 16.0 * 32.0 / period.as_secs_f64();
            for rate in chosen.rates {
                assert!((rate / per_sec - 1.0).abs() < 0.03, "offset {offset} ms: {chosen:?}, {per_sec}");
            }
            assert!(chosen.queue, "offset {offset} ms: {chosen:?}");
        }
    }

    #[test]
    fn a_trial_waits_until_the_lines_that_filled_the_places_have_turned_over() {
        // 16 places filled together, and their lines finish unevenly: the first 16 at
        // 8 a second, then 30 a second with the queue or without.
        let start = Instant::now();
        let (mut choice, mut finished, mut outcomes) = (QueueChoice::default(), 0.0, Vec::new());
        for n in 0..300 {
            finished += if finished < 16.0 { 0.8 } else { 3.0 };
            let counts = Counts { lines: finished as u64, tokens: 10 * finished as u64, overloads: 0 };
            outcomes.extend(choice.look(start + Duration::from_millis(100 * n), counts, Some(16.0)));
        }
        let chosen = outcomes.first().expect("a trial ended");
        assert!(chosen.queue, "{chosen:?}");
        for rate in chosen.rates {
            assert!((rate / 300.0 - 1.0).abs() < 0.03, "{chosen:?}");
        }
    }

    #[test]
    fn a_server_that_gains_by_a_queue_or_barely_loses_keeps_it() {
        for per_sec in [[30.0, 33.0], [30.0, 30.0], [30.5, 30.0]] {
            let mut choice = QueueChoice::default();
            let (outcomes, _) = run(&mut choice, Instant::now(), 20, per_sec);
            assert_eq!(outcomes.iter().map(|chosen| chosen.queue).collect::<Vec<_>>(), [true], "{per_sec:?}");
        }
    }

    #[test]
    fn the_choice_holds_for_a_while_then_is_tried_again() {
        let start = Instant::now();
        let mut choice = QueueChoice::default();
        let (outcomes, _) = run(&mut choice, start, 20, [30.0, 15.0]);
        assert_eq!(outcomes.len(), 1);
        let (later, sides) = run(&mut choice, start + Duration::from_secs(20), 100, [30.0, 15.0]);
        assert!(later.is_empty() && sides.iter().all(|side| !side), "held: {later:?}");
        // The server changed: a queue pays now.
        let (again, _) = run(&mut choice, start + KEEP_FOR + Duration::from_secs(10), 20, [15.0, 30.0]);
        assert_eq!(again.iter().map(|chosen| chosen.queue).collect::<Vec<_>>(), [true]);
    }

    #[test]
    fn a_slow_server_is_judged_over_enough_lines_and_a_trial_left_unfinished_is_dropped() {
        let start = Instant::now();
        let mut choice = QueueChoice::default();
        // Two lines a second: a window waits for its 16 lines, 8 s, so four windows and
        // their settling take some 33 s.
        let (outcomes, sides) = run(&mut choice, start, 40, [2.0, 2.0]);
        assert_eq!(outcomes.len(), 1, "{outcomes:?}");
        let ended = sides.windows(2).rposition(|pair| pair[0] != pair[1]).unwrap();
        assert!(ended >= 240, "the last window began after 24 s: {ended}");
        // Users came in the middle of a trial: it is dropped, and starts over when they go.
        let mut choice = QueueChoice::default();
        let counts = Counts::default();
        choice.look(start, counts, Some(0.0));
        choice.look(start + Duration::from_secs(1), counts, Some(0.0));
        assert!(choice.trial.is_some());
        assert_eq!(choice.look(start + Duration::from_secs(2), counts, None), None);
        assert!(choice.trial.is_none() && choice.queue());
    }
}
