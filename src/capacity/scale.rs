//! When to change the replicas of the workload that serves an upstream, within the
//! bounds the operator set. Pure: the backlog's need, the workload's replicas and what
//! the last passes saw in; a decision out. The caller applies it (the controller, through
//! the workload's `scale` subresource) and keeps the [`History`].
//!
//! - **Wake:** lines wait and the workload has no replica: to the floor, or one.
//! - **Deadline:** every replica is ready, a batch's projection misses its window, and
//!   more replicas would make the pace: to the replicas needed, at most the ceiling, at
//!   most once a `cooldown`.
//! - **Idle:** nothing has been left for a `cooldown`, and no change came in the last
//!   one: back to the floor.
//! - **Floor:** below `min_replicas` (set by someone else): up to it.
//!
//! Never below the floor, never above the ceiling; a workload that is still starting
//! replicas is left to start them. Meanwhile the lines wait ([`dispatch`]).

use crate::clock::UnixSeconds;

/// The operator's bounds for one workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub min: u32,
    /// At least one and at least `min` (the configuration checks it).
    pub max: u32,
    /// Seconds between two changes, and of an empty backlog before going back to `min`.
    pub cooldown: i64,
}

/// The workload as read now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Replicas asked for (`spec.replicas`).
    pub replicas: u32,
    pub ready: u32,
}

/// What the backlog needs of the workload ([`super::backlog::UpstreamBacklog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    /// Lines without a record yet, in flight included.
    pub lines_left: u64,
    pub slack: Option<i64>,
    pub replicas: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Floor,
    Wake,
    Deadline,
    Idle,
}

impl Reason {
    /// For Events and the metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Floor => "floor",
            Self::Wake => "wake",
            Self::Deadline => "deadline",
            Self::Idle => "idle",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Keep,
    Scale { to: u32, reason: Reason },
}

/// What the decisions remember between passes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct History {
    /// Since when nothing has been left.
    pub idle_since: Option<UnixSeconds>,
    /// When the last change was decided.
    pub last_change: Option<UnixSeconds>,
    /// Since when lines have waited with no replica ready.
    pub waiting_since: Option<UnixSeconds>,
}

/// Whether an upstream's batch lines go out now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatch {
    Send,
    /// No replica is ready yet: the lines wait for one.
    Hold,
    /// None became ready within `max_wait`: the lines go out anyway.
    GaveUp,
}

/// Lines wait while no replica is ready, from the first pass that saw them so, for at
/// most `max_wait` seconds; a ready replica (its readiness, not a timer) releases them.
pub fn dispatch(ready: u32, lines_left: u64, max_wait: i64, history: &mut History, now: UnixSeconds) -> Dispatch {
    if ready > 0 || lines_left == 0 {
        history.waiting_since = None;
        return Dispatch::Send;
    }
    let since = *history.waiting_since.get_or_insert(now);
    match now - since < max_wait {
        true => Dispatch::Hold,
        false => Dispatch::GaveUp,
    }
}

/// The decision for now; notes in `history` what the next passes need.
pub fn decide(need: Need, workload: Workload, bounds: Bounds, history: &mut History, now: UnixSeconds) -> Decision {
    let cooled = |history: &History| history.last_change.is_none_or(|at| now - at >= bounds.cooldown);
    let decision = if need.lines_left > 0 {
        history.idle_since = None;
        busy(need, workload, bounds, cooled(history))
    } else {
        let idle_since = *history.idle_since.get_or_insert(now);
        match workload.replicas > bounds.min && now - idle_since >= bounds.cooldown && cooled(history) {
            true => Decision::Scale { to: bounds.min, reason: Reason::Idle },
            false => Decision::Keep,
        }
    };
    let decision = match decision {
        Decision::Keep if workload.replicas < bounds.min => Decision::Scale { to: bounds.min, reason: Reason::Floor },
        decision => decision,
    };
    if let Decision::Scale { .. } = decision {
        history.last_change = Some(now);
    }
    decision
}

fn busy(need: Need, workload: Workload, bounds: Bounds, cooled: bool) -> Decision {
    if workload.replicas == 0 {
        return Decision::Scale { to: bounds.min.max(1).min(bounds.max), reason: Reason::Wake };
    }
    let starting = workload.ready < workload.replicas;
    let late = need.slack.is_some_and(|slack| slack < 0);
    let to = need.replicas.min(bounds.max);
    match !starting && late && cooled && to > workload.replicas {
        true => Decision::Scale { to, reason: Reason::Deadline },
        false => Decision::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds { min: 0, max: 3, cooldown: 60 };

    fn need(lines_left: u64, slack: Option<i64>, replicas: u32) -> Need {
        Need { lines_left, slack, replicas }
    }

    fn scale(to: u32, reason: Reason) -> Decision {
        Decision::Scale { to, reason }
    }

    #[test]
    fn one_pass_decides_by_the_backlog_the_workload_and_the_bounds() {
        let keep = Decision::Keep;
        let fresh = History::default();
        let changed_now = History { last_change: Some(1_000), ..History::default() };
        let changed_long_ago = History { last_change: Some(900), ..History::default() };
        let cases = [
            // (need, (replicas, ready), bounds, history, decision)
            (need(10, None, 1), (0, 0), BOUNDS, fresh, scale(1, Reason::Wake)),
            (need(10, None, 1), (0, 0), Bounds { min: 2, ..BOUNDS }, fresh, scale(2, Reason::Wake)),
            // Waking needs no cooldown: a batch waits.
            (need(10, None, 1), (0, 0), BOUNDS, changed_now, scale(1, Reason::Wake)),
            // Starting: left to start, whatever the deadline.
            (need(10, Some(-100), 3), (1, 0), BOUNDS, fresh, keep),
            (need(10, Some(-100), 3), (2, 1), BOUNDS, fresh, keep),
            // On time: kept, however many the pace would take.
            (need(10, Some(5), 3), (1, 1), BOUNDS, fresh, keep),
            (need(10, None, 3), (1, 1), BOUNDS, fresh, keep),
            // Late: up to what is needed, within the ceiling.
            (need(10, Some(-1), 2), (1, 1), BOUNDS, fresh, scale(2, Reason::Deadline)),
            (need(10, Some(-1), 9), (1, 1), BOUNDS, fresh, scale(3, Reason::Deadline)),
            (need(10, Some(-1), 9), (3, 3), BOUNDS, fresh, keep),
            // Late, but more replicas would not help, or the last change is too recent.
            (need(10, Some(-1), 1), (1, 1), BOUNDS, fresh, keep),
            (need(10, Some(-1), 2), (1, 1), BOUNDS, changed_now, keep),
            (need(10, Some(-1), 2), (1, 1), BOUNDS, changed_long_ago, scale(2, Reason::Deadline)),
            // Never down while lines are left, even above what is needed.
            (need(10, Some(500), 1), (3, 3), BOUNDS, changed_long_ago, keep),
            // Below the floor (someone else set it): up to it.
            (need(0, None, 0), (0, 0), Bounds { min: 1, ..BOUNDS }, fresh, scale(1, Reason::Floor)),
            (need(10, Some(10), 1), (1, 1), Bounds { min: 2, ..BOUNDS }, changed_now, scale(2, Reason::Floor)),
        ];
        for (need, (replicas, ready), bounds, mut history, expected) in cases {
            let decision = decide(need, Workload { replicas, ready }, bounds, &mut history, 1_000);
            assert_eq!(decision, expected, "{need:?} at {replicas}/{ready} ready, {bounds:?}");
            if let Decision::Scale { to, .. } = decision {
                assert!((bounds.min..=bounds.max).contains(&to), "within the bounds");
                assert_eq!(history.last_change, Some(1_000), "a change is remembered");
            }
        }
    }

    #[test]
    fn back_to_the_floor_once_idle_for_the_cooldown() {
        let mut history = History::default();
        let mut at = |now: i64, lines_left: u64, replicas: u32| {
            decide(need(lines_left, None, 1), Workload { replicas, ready: replicas }, BOUNDS, &mut history, now)
        };
        assert_eq!(at(0, 10, 0), scale(1, Reason::Wake));
        assert_eq!(at(30, 10, 1), Decision::Keep);
        // The backlog is gone at 100: the cooldown counts from there.
        assert_eq!(at(100, 0, 1), Decision::Keep);
        assert_eq!(at(159, 0, 1), Decision::Keep);
        // Lines again at 159 reset the idle clock.
        assert_eq!(at(159, 5, 1), Decision::Keep);
        assert_eq!(at(170, 0, 1), Decision::Keep);
        assert_eq!(at(229, 0, 1), Decision::Keep);
        assert_eq!(at(230, 0, 1), scale(0, Reason::Idle));
        // At the floor: nothing more to do.
        assert_eq!(at(400, 0, 0), Decision::Keep);
    }

    #[test]
    fn a_recent_change_holds_the_way_back_down() {
        // Woken at 0, the backlog gone at once: the floor waits for the change's cooldown.
        let mut history = History::default();
        assert_eq!(
            decide(need(1, None, 1), Workload { replicas: 0, ready: 0 }, BOUNDS, &mut history, 0),
            scale(1, Reason::Wake)
        );
        history.idle_since = Some(-100);
        let workload = Workload { replicas: 1, ready: 1 };
        assert_eq!(decide(need(0, None, 0), workload, BOUNDS, &mut history, 59), Decision::Keep);
        assert_eq!(decide(need(0, None, 0), workload, BOUNDS, &mut history, 60), scale(0, Reason::Idle));
    }

    #[test]
    fn lines_wait_for_a_ready_replica_at_most_max_wait() {
        let mut history = History::default();
        let cases = [
            // (now, ready, lines left, dispatch)
            (0, 0, 10, Dispatch::Hold),
            (50, 0, 10, Dispatch::Hold),
            // Ready: released at once, and the wait forgotten.
            (60, 1, 10, Dispatch::Send),
            (70, 0, 10, Dispatch::Hold),
            (169, 0, 10, Dispatch::Hold),
            (170, 0, 10, Dispatch::GaveUp),
            (500, 0, 10, Dispatch::GaveUp),
            // Nothing left: nothing to hold.
            (510, 0, 0, Dispatch::Send),
            (520, 0, 5, Dispatch::Hold),
        ];
        for (now, ready, lines_left, expected) in cases {
            assert_eq!(dispatch(ready, lines_left, 100, &mut history, now), expected, "at {now}");
        }
    }
}
