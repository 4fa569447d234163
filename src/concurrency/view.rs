//! What the worker pods that send a batch's lines to a server saw of it together: its
//! users, apart from the batch. Each pod's load signal counts its siblings' lines with
//! the users'; a pod that took them for users' would let its room grow with theirs
//! ([`super::delay`]). Each pod sums its readings into a [`View`] between two of its
//! acknowledgments; the controller combines the views ([`users`], pure) and the grant
//! tells every pod the users' requests.
//!
//! The design: docs/src/night-shift-design.md#several-pods-at-one-server

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A worker's view of a server over its readings since its last acknowledgment, on
/// average, in thousandths of a request: what the server held (ran or queued) that was
/// not the worker's, and the worker's own lines it held. Queued too, not only run: a
/// batch that fills a server and queues there keeps the users who come behind its
/// queue, where a view of what ran would not see them; and its queued lines, counted
/// against what ran, hid the users that did run (four pods filling a server, users
/// came and the grants said none for 5.5 s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub others: u64,
    pub ours: u64,
    /// The beat it was taken on (`crate::grants::BEAT`), in milliseconds since the epoch:
    /// views of one beat cover the same readings' time.
    #[serde(default)]
    pub until: u64,
}

/// Readings summed as they come: the permit loop adds, the acknowledgment takes.
#[derive(Default)]
pub struct Views {
    readings: AtomicU64,
    others: AtomicU64,
    ours: AtomicU64,
}

impl Views {
    /// A reading: the server holds `held` requests (running or queued), and has `ours`
    /// of this process's (some perhaps still on their way: not held yet).
    pub fn add(&self, held: f64, ours: u32) {
        let held = held.max(0.0);
        let ours = f64::from(ours).min(held);
        self.readings.fetch_add(1, Ordering::Relaxed);
        self.others.fetch_add(((held - ours) * 1000.0) as u64, Ordering::Relaxed);
        self.ours.fetch_add((ours * 1000.0) as u64, Ordering::Relaxed);
    }

    /// The view since the last one taken, if a reading came, stamped with the beat
    /// `until`.
    pub fn take(&self, until: u64) -> Option<View> {
        let readings = self.readings.swap(0, Ordering::Relaxed);
        let (others, ours) = (self.others.swap(0, Ordering::Relaxed), self.ours.swap(0, Ordering::Relaxed));
        (readings > 0).then(|| View { others: others / readings, ours: ours / readings, until })
    }
}

/// The users' requests the server runs, in thousandths, as the workers saw them
/// together: each worker's view of what ran besides its own lines, less the lines the
/// other workers ran there (theirs from their views, or `unseen`: the requests in flight
/// of those without one), averaged over the workers with a view. The views cover about
/// the same half second, up to half a second apart: what one worker sees of the others'
/// growth since theirs is what they see of its own, and the mean cancels it out, where
/// each worker's own mistake would be the whole growth. `None` without a view.
pub fn users(views: &[View], unseen: u64) -> Option<u64> {
    let batch = views.iter().map(|view| i128::from(view.ours)).sum::<i128>() + i128::from(unseen);
    let each = views.iter().map(|view| i128::from(view.others) - (batch - i128::from(view.ours)));
    let count = i128::try_from(views.len()).ok().filter(|count| *count > 0)?;
    Some(u64::try_from(each.sum::<i128>() / count).unwrap_or(0))
}

/// The beat most of `views` were taken on (the later of two as common): the views the
/// controller combines ([`users`]). A pod whose acknowledgment of that beat has not come
/// yet, or came late, has a view of another half second, in which the others' lines
/// were not what they are in these; its requests in flight stand for its lines instead.
pub fn beat(views: &[View]) -> Option<u64> {
    let mut counts = std::collections::BTreeMap::new();
    for view in views {
        *counts.entry(view.until).or_insert(0_usize) += 1;
    }
    counts.into_iter().max_by_key(|(until, count)| (*count, *until)).map(|(until, _)| until)
}

/// A worker pod whose users held fewer requests than this (as its grant says, or on
/// average over a sample of the delay's) is alone with its siblings, if it stays so…
pub const USERS_LEAST: f64 = 0.5;
/// … for this long: a dip is not a departure. At a server of a few slots users come and
/// go between one grant's view and the next (at llama-server with 4 slots and users at
/// 1.6 a second, 0.0 to 3.0 in grants a second apart, and none for a second at most).
/// Not longer: users that are not there last about that long too. A pod that left took
/// its lines out of the sum before the other pods' views did, until its release carried
/// its last view; bridged for 5 s, those users held four pods alone a line or two each
/// for 6 s.
pub const USERS_GONE: Duration = Duration::from_secs(2);

/// Whether a worker pod's users have gone, over what it is told they run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Presence {
    /// The last time they held at least [`USERS_LEAST`].
    seen: Option<Instant>,
}

impl Presence {
    /// Takes in what the users held at `now`; returns whether they held less than
    /// [`USERS_LEAST`] for [`USERS_GONE`] (or ever).
    pub fn gone(&mut self, now: Instant, users: f64) -> bool {
        self.gone_for(now, users, USERS_GONE)
    }

    /// Takes in what the users held at `now`; returns whether they held less than
    /// [`USERS_LEAST`] for `span` (or ever).
    pub fn gone_for(&mut self, now: Instant, users: f64, span: Duration) -> bool {
        if users >= USERS_LEAST {
            self.seen = Some(now);
        }
        self.seen.is_none_or(|at| now.saturating_duration_since(at) > span)
    }
}

/// The users a grant says: those it said before, while what the workers see now is
/// within an eighth of them or a quarter of a request, and on the same side of
/// [`USERS_LEAST`]. A pod's room moves by a twentieth of a line for a quarter of a user
/// ([`super::delay`]), and a grant rewritten at every controller pass for the noise of
/// half-second views is a write to storage every pass, for every pod.
pub fn steady(granted: Option<u64>, seen: u64) -> u64 {
    let least = (USERS_LEAST * 1000.0) as u64;
    match granted {
        Some(granted) if granted.abs_diff(seen) < (granted / 8).max(250) && (granted >= least) == (seen >= least) => {
            granted
        }
        _ => seen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_is_the_average_of_its_readings_and_starts_again_once_taken() {
        let views = Views::default();
        assert_eq!(views.take(500), None);
        views.add(10.0, 4);
        views.add(12.0, 2);
        // Lines of ours the server does not hold yet are not ours there, nor others'.
        views.add(3.0, 5);
        let (others, ours) = ((6_000 + 10_000) / 3, (4_000 + 2_000 + 3_000) / 3);
        assert_eq!(views.take(1_000), Some(View { others, ours, until: 1_000 }));
        assert_eq!(views.take(1_500), None);
    }

    #[test]
    fn the_users_are_what_each_saw_less_the_others_lines_and_growth_between_views_cancels() {
        // Three users; pods of 4, 5 and 6 lines, each seeing the rest as others.
        let view = |ours: u64| View { others: 3_000 + 15_000 - ours, ours, until: 0 };
        assert_eq!(users(&[view(4_000), view(5_000), view(6_000)], 0), Some(3_000));
        // Four pods growing a line every 100 ms, their views 100 ms apart: each saw the
        // others at a different moment, and alone would take some of them for users.
        let at = |ms: u64| 10_000 + ms * 10;
        let views: Vec<View> = (0..4_u64)
            .map(|pod| {
                let now = pod * 100;
                let others = 2_000 + (0..4_u64).filter(|other| *other != pod).map(|_| at(now)).sum::<u64>();
                View { others, ours: at(now), until: 0 }
            })
            .collect();
        let alone = views[3].others - views.iter().take(3).map(|view| view.ours).sum::<u64>();
        assert_eq!(alone, 2_000 + 3 * (at(300) - at(100)), "the last pod alone");
        assert_eq!(users(&views, 0), Some(2_000));
        // A pod without a view: its lines in flight are the batch's.
        assert_eq!(users(&[view(4_000), view(5_000)], 6_000), Some(3_000));
        // Nobody but the batch, seen with some noise: none, not less.
        let noisy = [View { others: 3_000, ours: 4_000, until: 0 }, View { others: 3_500, ours: 3_000, until: 0 }];
        assert_eq!(users(&noisy, 0), Some(0));
        assert_eq!(users(&[], 6_000), None);
    }

    #[test]
    fn the_views_combined_are_those_of_the_beat_most_pods_took_theirs_on() {
        let on = |until| View { until, ..View::default() };
        assert_eq!(beat(&[on(1_000), on(1_500), on(1_500)]), Some(1_500));
        assert_eq!(beat(&[on(1_000), on(1_000), on(1_500)]), Some(1_000), "one pod ahead");
        assert_eq!(beat(&[on(1_000), on(1_500)]), Some(1_500));
        assert_eq!(beat(&[]), None);
    }

    #[test]
    fn users_are_gone_once_none_ran_for_a_while_not_at_a_dip() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut presence = Presence::default();
        assert!(presence.gone(at(0), 0.2), "never seen");
        assert!(!presence.gone(at(100), 3.0));
        assert!(!presence.gone(at(1_100), 0.0), "a dip");
        assert!(!presence.gone(at(100) + USERS_GONE, 0.1));
        assert!(presence.gone(at(101) + USERS_GONE, 0.1), "gone");
        assert!(!presence.gone(at(9_000), 0.5), "back");
    }

    #[test]
    fn a_grant_keeps_its_users_through_noise() {
        assert_eq!(steady(None, 8_300), 8_300);
        assert_eq!(steady(Some(8_000), 8_900), 8_000, "within an eighth");
        assert_eq!(steady(Some(8_000), 9_000), 9_000);
        assert_eq!(steady(Some(8_000), 7_001), 8_000);
        assert_eq!(steady(Some(1_000), 1_240), 1_000, "within a quarter of a request");
        assert_eq!(steady(Some(1_000), 750), 750);
        assert_eq!(steady(Some(600), 450), 450, "across the least users: the pods judge by it");
        assert_eq!(steady(Some(0), 200), 0);
    }
}
