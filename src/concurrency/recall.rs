//! Lines taken back from a server's queue when its users come: how many, at the reading
//! that sees them come.
//! Alone, a batch keeps a short queue of its own lines at the server
//! ([`super::headroom::QUEUE_ALONE`]); users who come then wait behind it until lines
//! finish, some 0.4–1.1 s at a CPU-like server, however fast the cap comes down. A
//! request the server still queues has cost it nothing, and a server that drops one
//! whose client hangs up (vLLM aborts it;
//! [`ServerKind::drops_hung_up`](super::presets::ServerKind::drops_hung_up)) gives its
//! place to the users: taken back, the line goes out again later, as a line in flight at
//! a crash would.
//! Pure: the caller passes the reading and the caps.
//!
//! The design: docs/src/night-shift-design.md#lines-taken-back-when-users-come

use super::headroom::Occupancy;

/// How many of this process's youngest lines at the server to take back at a reading
/// that saw users come (`came`: the batch had the server to itself at the reading
/// before): those over `cap` (the most the batch may hold now), but never more than the
/// server certainly queues of them. Of the requests it queues, at most the other
/// traffic's are not the batch's (`waiting − others`, where others are all it holds
/// besides this process's lines), so none of the lines taken back is running there: a
/// server queues in order of arrival, and the youngest are the ones it queues. Only
/// when users come: beside them the headroom keeps their room, and lines the batch
/// queues there now and then went where a reading saw room.
pub fn lines_to_take_back(occupancy: &Occupancy, cap: u32, came: bool) -> u32 {
    if !came || occupancy.waiting < 1.0 || occupancy.in_flight <= cap {
        return 0;
    }
    let queued_ours = (occupancy.waiting - occupancy.others()).floor().max(0.0) as u32;
    let over = occupancy.in_flight - cap;
    // Bounded by the lines at the server (`ours`), which `in_flight` may exceed.
    queued_ours.min(over).min(occupancy.ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn occupancy(running: f64, waiting: f64, ours: u32) -> Occupancy {
        Occupancy {
            running,
            waiting,
            ours,
            still_counted: 0,
            in_flight: ours,
            kv_cache_usage: None,
            siblings_only: false,
        }
    }

    #[test]
    fn users_who_come_to_a_server_the_batch_filled_get_its_queue_back() {
        // 16 places, all the batch's, and 4 of its lines queued; 3 users come and queue.
        let came = occupancy(16.0, 7.0, 20);
        // The cap came down to 12: the 4 queued lines go, none of those running.
        assert_eq!(lines_to_take_back(&came, 12, true), 4);
        // Cut only to 18: the 2 over it.
        assert_eq!(lines_to_take_back(&came, 18, true), 2);
        // Within the cap: nothing.
        assert_eq!(lines_to_take_back(&came, 20, true), 0);
        // Users were there at the reading before too: the headroom keeps their room, and
        // nothing is taken back.
        assert_eq!(lines_to_take_back(&came, 12, false), 0);
    }

    #[test]
    fn nothing_is_taken_back_that_may_be_running() {
        // Users run 6 of 16 places and queue 2; the batch has 10 running and 2 queued
        // (waiting 4 − others 8: none certainly the batch's).
        assert_eq!(lines_to_take_back(&occupancy(16.0, 4.0, 12), 4, true), 0);
        // Nothing queued: nothing taken back, however far over the cap.
        assert_eq!(lines_to_take_back(&occupancy(16.0, 0.0, 16), 4, true), 0);
    }
}
