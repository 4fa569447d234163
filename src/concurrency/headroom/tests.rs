//! The headroom reading by reading: places learned, the reserve, the cache, alone and
//! beside others, and worker pods' shares.

use super::*;
use crate::concurrency::signals;

/// A headroom as a signal's defaults have it.
impl Default for Headroom {
    fn default() -> Self {
        Self::new(signals::MAX_KV_CACHE_USAGE)
    }
}

fn at(start: Instant, ms: u64) -> Instant {
    start + Duration::from_millis(ms)
}

/// A headroom that saw the server full (`first`), then `steady` for 6 s: places
/// learned, and the reserve back to its least.
fn learned(start: Instant, first: Occupancy, steady: Occupancy, share: f64) -> Headroom {
    let mut headroom = Headroom::default();
    headroom.read(start, first, share);
    for n in 1..=60 {
        headroom.read(at(start, n * 100), steady, share);
    }
    headroom
}

/// A reading with every line in flight at the server.
fn occupancy(running: f64, waiting: f64, in_flight: u32) -> Occupancy {
    Occupancy {
        running,
        waiting,
        ours: in_flight,
        still_counted: 0,
        in_flight,
        kv_cache_usage: None,
        siblings_only: false,
    }
}

#[test]
fn beside_others_the_batch_grows_by_a_tenth_of_what_ran_until_the_server_queues() {
    let start = Instant::now();
    let mut headroom = Headroom::default();
    // 20 ran with nothing waiting, 4 of them someone else's: the server may hold
    // 20 + 2, so the batch 2 more than its 16.
    assert_eq!(headroom.read(at(start, 100), occupancy(20.0, 0.0, 16), 1.0), 18.0);
    // 30 ran, 8 someone else's: 33, the batch 3 more than its 22.
    assert_eq!(headroom.read(at(start, 200), occupancy(30.0, 0.0, 22), 1.0), 25.0);
    assert_eq!(headroom.places, None, "nothing queued: the places are not known");
    // 32 run and 4 wait: 32 places. Others hold 36 − 28 = 8 (they grew by 4 since
    // the first reading: the reserve), so the batch may keep 32 − 8 − 4 = 20.
    assert_eq!(headroom.read(at(start, 300), occupancy(32.0, 4.0, 28), 1.0), 20.0);
    assert_eq!(headroom.places, Some(32.0));
    // More running later, without a queue: more places than the queue showed.
    headroom.read(at(start, 400), occupancy(34.0, 0.0, 26), 1.0);
    assert_eq!(headroom.places, Some(34.0));
    // A line at least past what ran.
    let mut headroom = Headroom::default();
    assert_eq!(headroom.read(at(start, 0), occupancy(3.0, 0.0, 1), 1.0), 2.0, "a line past 3");
    // The 256-seq sequence-bound server beside users holding 90: its cache says
    // thousands of places, the batch's 128 may grow by 21.8, not double.
    let young =
        |running, in_flight, usage| Occupancy { kv_cache_usage: Some(usage), ..occupancy(running, 0.0, in_flight) };
    let mut headroom = Headroom::default();
    let cap = headroom.read(at(start, 0), young(218.0, 128, 0.007), 1.0);
    assert!((cap - (128.0 + 21.8)).abs() < 1e-9, "{cap}");
    // Where the cache is the tighter, it holds: 128 fill 95% of it, the signal's
    // full, so 128 places, a place fewer than the batch's 64 and the others' 64
    // with a place of reserve.
    let mut headroom = Headroom::default();
    let cap = headroom.read(at(start, 0), young(128.0, 64, 0.95), 1.0);
    assert!((cap - (64.0 - 1.0)).abs() < 1e-9, "{cap}");
}

#[test]
fn the_batch_fills_what_others_leave_less_what_they_grew_by_lately() {
    let start = Instant::now();
    // Others hold 3, reading after reading: they never grew.
    let mut headroom = learned(start, occupancy(32.0, 1.0, 30), occupancy(32.0, 0.0, 29), 1.0);
    assert_eq!(headroom.reserve(), 1.0, "at least one place");
    assert_eq!(headroom.read(at(start, 6100), occupancy(32.0, 0.0, 29), 1.0), 28.0);
    // Users come: others 3 → 7 (+4) → 9 (+2): the batch gives way by what they take
    // and by the largest jump besides.
    assert_eq!(headroom.read(at(start, 6200), occupancy(32.0, 1.0, 26), 1.0), 32.0 - 7.0 - 4.0);
    assert_eq!(headroom.read(at(start, 6300), occupancy(32.0, 0.0, 23), 1.0), 32.0 - 9.0 - 4.0);
    // They ebb: once the readings of the last 250 ms and the one before them agree,
    // the batch takes their places back; the reserve stays 4 for 5 s.
    let ebbed = occupancy(25.0, 0.0, 21);
    for ms in [6400, 6500, 6600] {
        assert_eq!(headroom.read(at(start, ms), ebbed, 1.0), 32.0 - 9.0 - 4.0);
    }
    assert_eq!(headroom.read(at(start, 6700), ebbed, 1.0), 32.0 - 4.0 - 4.0);
    assert_eq!(headroom.reserve(), 4.0);
    assert_eq!(headroom.read(at(start, 11_400), occupancy(29.0, 0.0, 25), 1.0), 32.0 - 4.0 - 1.0);
    // Users alone fill the server: no batch line.
    assert_eq!(headroom.read(at(start, 11_500), occupancy(32.0, 6.0, 2), 1.0), 0.0);
}

#[test]
fn a_server_with_no_other_traffic_lately_keeps_no_reserve() {
    let start = Instant::now();
    // The batch alone on a server of four places: it may fill all four, and queue a
    // line there.
    let mut headroom = Headroom::default();
    assert_eq!(headroom.read(at(start, 0), occupancy(4.0, 2.0, 6), 1.0), 5.0);
    assert_eq!(headroom.reserve(), 0.0);
    assert_eq!(headroom.read(at(start, 100), occupancy(4.0, 0.0, 4), 1.0), 5.0);
    // A user comes: one place is theirs, and one kept for the next.
    assert_eq!(headroom.read(at(start, 200), occupancy(4.0, 1.0, 4), 1.0), 4.0 - 1.0 - 1.0);
    assert_eq!(headroom.reserve(), 1.0);
    // Gone, and nobody for 5 s more: the reserve goes too.
    headroom.read(at(start, 300), occupancy(2.0, 0.0, 2), 1.0);
    assert_eq!(headroom.reserve(), 1.0);
    assert_eq!(headroom.read(at(start, 5_300), occupancy(2.0, 0.0, 2), 1.0), 5.0);
}

#[test]
fn alone_the_cap_grows_by_half_a_reading_until_the_server_queues() {
    let start = Instant::now();
    let mut headroom = Headroom::default();
    assert_eq!(headroom.read(at(start, 0), occupancy(0.0, 0.0, 0), 1.0), 1.0, "the probe's line");
    assert_eq!(headroom.read(at(start, 100), occupancy(8.0, 0.0, 8), 1.0), 12.0);
    // Lines on their way in are kept, but add nothing until the server counts them,
    // however many readings it takes.
    assert_eq!(headroom.read(at(start, 200), occupancy(9.0, 0.0, 12), 1.0), 13.5);
    assert_eq!(headroom.read(at(start, 250), occupancy(1.0, 0.0, 13), 1.0), 13.0);
    assert_eq!(headroom.read(at(start, 260), occupancy(1.0, 0.0, 13), 1.0), 13.0);
    assert_eq!(headroom.read(at(start, 270), occupancy(12.0, 0.0, 13), 1.0), 18.0);
    assert_eq!(headroom.queue_places(), None, "no places yet to queue on top of");
    // It queues 2 of 18: 16 places, and 4 (a quarter of them) to queue.
    assert_eq!(headroom.read(at(start, 300), occupancy(16.0, 2.0, 18), 1.0), 20.0);
    assert_eq!(headroom.queue_places(), Some(16.0));
    // A young cache says more places than the server has: alone, it bounds them only
    // once the server was seen full (8 lines that fill 2% of it would be 400).
    let young =
        |running, in_flight, usage| Occupancy { kv_cache_usage: Some(usage), ..occupancy(running, 0.0, in_flight) };
    let mut headroom = Headroom::default();
    assert_eq!(headroom.read(at(start, 0), young(8.0, 8, 0.02), 1.0), 12.0);
    assert_eq!(headroom.read(at(start, 100), young(12.0, 12, 0.03), 1.0), 18.0);
}

#[test]
fn alone_the_batch_keeps_the_places_full_and_a_short_queue() {
    let start = Instant::now();
    let mut headroom = Headroom::default();
    headroom.read(at(start, 0), occupancy(16.0, 4.0, 20), 1.0);
    assert!(headroom.alone());
    // 6 of the 20 finished there: 6 more lines, so that 16 run and 4 (a quarter of
    // 16) queue.
    assert_eq!(headroom.read(at(start, 100), occupancy(14.0, 0.0, 14), 1.0), 14.0 + 6.0);
    // Full and queueing 4: as many as it has.
    assert_eq!(headroom.read(at(start, 200), occupancy(16.0, 4.0, 20), 1.0), 20.0);
    // 4 lines sent since the server's last step, which it has not counted yet: they
    // are not free places, and are not sent again.
    let uncounted = Occupancy { ours: 20, ..occupancy(16.0, 0.0, 20) };
    assert_eq!(headroom.read(at(start, 300), uncounted, 1.0), 20.0);
    // 6 lines the server finished, their answers on their way: counted until they
    // come, when their permits go to the next lines (the cap is on permits).
    let answering = Occupancy { ours: 20, ..occupancy(14.0, 0.0, 20) };
    assert_eq!(headroom.read(at(start, 400), answering, 1.0), 20.0);
    // Over-full (lines sent on answers heard since the last reading): none until the
    // queue is back to 4.
    assert_eq!(headroom.read(at(start, 500), occupancy(16.0, 7.0, 23), 1.0), 20.0);
    // Where a queue costs the server: its places and no more.
    headroom.keep_queue(false);
    assert_eq!(headroom.read(at(start, 600), occupancy(14.0, 0.0, 14), 1.0), 16.0);
    assert_eq!(headroom.read(at(start, 700), occupancy(16.0, 4.0, 20), 1.0), 16.0);
}

#[test]
fn the_cache_fills_to_where_the_load_signal_calls_it_full() {
    let start = Instant::now();
    let reading = Occupancy { kv_cache_usage: Some(0.5), ..occupancy(40.0, 0.0, 30) };
    // The server ran 200 earlier (a tenth past them does not bound the batch here),
    // and now 10 users and 30 lines fill half the cache: 80 would fill it, 64 fill 0.8.
    let ran = occupancy(200.0, 0.0, 190);
    let mut careful = Headroom::new(0.8);
    careful.read(start, ran, 1.0);
    assert_eq!(careful.read(start, reading, 1.0), 30.0 + 64.0 - 30.0 - 10.0 - 1.0);
    let mut usual = Headroom::default();
    usual.read(start, ran, 1.0);
    assert_eq!(usual.read(start, reading, 1.0), 30.0 + 76.0 - 30.0 - 10.0 - 1.0);
}

#[test]
fn the_places_are_what_fills_the_cache_at_the_fullest_mix_lately() {
    let start = Instant::now();
    let kv = |running, waiting, ours, usage| Occupancy {
        ours,
        kv_cache_usage: Some(usage),
        ..occupancy(running, waiting, ours)
    };
    let mut headroom = Headroom::default();
    // The server ran 200 earlier (a tenth past them does not bound the batch here).
    // 10 users and 30 young lines fill half the cache: before any queue, the places
    // are the 80 that would fill it at this mix, 76 of them to fill 0.95 of it.
    headroom.read(at(start, 0), occupancy(200.0, 0.0, 190), 1.0);
    assert_eq!(headroom.read(at(start, 0), kv(40.0, 0.0, 30, 0.5), 1.0), 30.0 + 76.0 - 30.0 - 10.0 - 1.0);
    // Grown, the same 40 fill the whole cache: 38 places.
    assert_eq!(headroom.read(at(start, 100), kv(40.0, 0.0, 30, 1.0), 1.0), 30.0 + 38.0 - 30.0 - 10.0 - 1.0);
    // A young cohort fills the server's 64 places: the fullest mix of the last 5 s
    // still bounds them.
    assert_eq!(headroom.read(at(start, 200), kv(64.0, 1.0, 55, 0.7), 1.0), 55.0 + 38.0 - 55.0 - 10.0 - 1.0);
    assert_eq!(headroom.places, Some(64.0), "the server ran 64 when it was full");
    // Only younger mixes for 5 s: the places are what they would fill.
    for n in 3..=53 {
        headroom.read(at(start, n * 100), kv(40.0, 0.0, 30, 0.8), 1.0);
    }
    assert_eq!(headroom.read(at(start, 5_400), kv(40.0, 0.0, 30, 0.8), 1.0), 30.0 + 47.5 - 30.0 - 10.0 - 1.0);
    // No other traffic for 5 s: the batch alone fills the whole cache, not 0.95 of
    // it (30 lines fill it), and queues nothing there: the server would take a queued
    // line in as soon as its prompt fits, into room the running ones grow into.
    for n in 55..=110 {
        headroom.read(at(start, n * 100), kv(30.0, 0.0, 30, 1.0), 1.0);
    }
    assert!(headroom.alone());
    assert_eq!(headroom.read(at(start, 11_100), kv(30.0, 0.0, 30, 1.0), 1.0), 30.0);
    assert_eq!(headroom.queue_places(), None, "no queue to try where the cache bounds the places");
    // Younger for 5 s, the same 30 fill 0.4 of it (75 would fill it): up to the 64
    // places the server ran, and their queue (the places bound them, not the cache).
    for n in 112..=170 {
        headroom.read(at(start, n * 100), kv(30.0, 0.0, 30, 0.4), 1.0);
    }
    assert_eq!(headroom.read(at(start, 17_100), kv(30.0, 0.0, 30, 0.4), 1.0), 64.0 + 16.0);
    assert_eq!(headroom.queue_places(), Some(64.0));
}

#[test]
fn processes_sharing_a_server_each_take_their_share_of_the_free_room() {
    let start = Instant::now();
    let mut headroom = learned(start, occupancy(32.0, 2.0, 10), occupancy(32.0, 0.0, 10), 0.5);
    // Others leave 20 free (the readings agree for 300 ms), less the reserve of 1:
    // half of it each.
    for ms in [6100, 6200, 6300] {
        headroom.read(at(start, ms), occupancy(12.0, 0.0, 5), 0.5);
    }
    assert_eq!(headroom.read(at(start, 6400), occupancy(12.0, 0.0, 5), 0.5), 5.0 + 9.5);
    // Over-full by 5 (with the reserve): each gives back half.
    assert_eq!(headroom.read(at(start, 6500), occupancy(32.0, 4.0, 29), 0.5), 29.0 - 2.5);
}

#[test]
fn pods_alone_together_fill_the_places_as_one_process_would() {
    let start = Instant::now();
    // Four pods of 8 lines each at a server of 32 places that queued 8 of them: each
    // sees 24 lines that are not its own.
    let pod = |running, waiting, siblings_only| Occupancy { siblings_only, ..occupancy(running, waiting, 8) };
    let mut headroom = Headroom::default();
    assert_eq!(headroom.read(at(start, 0), pod(32.0, 0.0, true), 0.25), 8.0 * GROWTH_ALONE);
    assert!(headroom.alone());
    headroom.read(at(start, 100), pod(32.0, 8.0, true), 0.25);
    // 28 of the 40 finished: each pod takes a quarter of the places they free, and of
    // the queue a batch alone keeps.
    let freed = pod(24.0, 0.0, true);
    assert_eq!(headroom.read(at(start, 200), freed, 0.25), 8.0 + (32.0 + 8.0 - 24.0) / 4.0);
    // The grant says users came: the siblings' lines are others' again, at once.
    let told = headroom.read(at(start, 300), pod(24.0, 0.0, false), 0.25);
    assert!(!headroom.alone());
    assert!(told < 8.0 + 1.0, "no room beyond the siblings' lines and the reserve: {told}");
}

#[test]
fn a_reading_that_caught_our_lines_on_their_way_in_does_not_raise_the_reserve() {
    let start = Instant::now();
    let mut headroom = learned(start, occupancy(32.0, 1.0, 26), occupancy(32.0, 0.0, 26), 1.0);
    // Four lines of ours, sent together, are not counted by the server yet: other
    // traffic seems to drop from 6 to 2, and to be back at 6 in the next reading.
    // The places they seem to free are theirs: the cap stays where it was.
    let caught = Occupancy { ours: 26, ..occupancy(28.0, 0.0, 26) };
    assert_eq!(headroom.read(at(start, 6100), caught, 1.0), 26.0 - 1.0);
    assert_eq!(headroom.read(at(start, 6200), occupancy(32.0, 0.0, 26), 1.0), 26.0 - 1.0);
    assert_eq!(headroom.reserve(), 1.0);
    // Users that do come count from the level before.
    headroom.read(at(start, 6300), occupancy(32.0, 3.0, 26), 1.0);
    assert_eq!(headroom.reserve(), 3.0);
}

#[test]
fn a_dip_over_two_readings_is_not_a_departure_either() {
    let start = Instant::now();
    let mut headroom = learned(start, occupancy(32.0, 1.0, 20), occupancy(32.0, 0.0, 20), 1.0);
    // A cohort of 10 lines finished at the server, and this process hears of them
    // only after two readings: others seem to drop from 12 to 2 meanwhile.
    let unheard = Occupancy { ours: 20, ..occupancy(22.0, 0.0, 20) };
    assert_eq!(headroom.read(at(start, 6100), unheard, 1.0), 20.0 - 1.0);
    assert_eq!(headroom.read(at(start, 6200), unheard, 1.0), 20.0 - 1.0);
    // Heard, and replaced: others are back at 12. Growth counts from the two readings
    // before, so that is taken for users who came (the reserve is kept for them),
    // but the batch never took the places they seemed to leave.
    assert_eq!(headroom.read(at(start, 6300), occupancy(32.0, 0.0, 20), 1.0), 20.0 - 10.0);
    assert_eq!(headroom.reserve(), 10.0);
}

#[test]
fn lines_not_at_the_server_are_not_taken_for_other_traffic_but_count_against_the_cap() {
    let start = Instant::now();
    let mut headroom = Headroom::default();
    headroom.read(at(start, 0), occupancy(32.0, 1.0, 27), 1.0);
    // 30 permits, 26 lines at the server: others hold 6, not 2. Three lines being
    // written back and one about to be sent: the cap leaves room for them, so that
    // the lines at the server come to 32 − 6 − 1 = 25.
    let reading = Occupancy { ours: 26, ..occupancy(32.0, 0.0, 30) };
    assert_eq!(headroom.read(at(start, 100), reading, 1.0), 25.0 + 4.0);
    let reading = Occupancy { ours: 25, ..occupancy(31.0, 0.0, 29) };
    assert_eq!(headroom.read(at(start, 200), reading, 1.0), 25.0 + 4.0, "steady");
}

#[test]
fn a_fraction_of_a_place_is_taken_as_often_as_it_is_large() {
    assert_eq!(take(3.0, 0.0), 3);
    assert_eq!(take(3.0, 0.999), 3);
    assert_eq!(take(-2.5, 0.0), 0, "never below nothing");
    assert_eq!(take(0.25, 0.2), 1);
    assert_eq!(take(0.25, 0.3), 0);
    // Four pods' quarters of one free place: about one place between them.
    let draws = (0..1000).map(|n| f64::from(n) / 1000.0);
    let taken: u32 = draws.map(|draw| take(0.25, draw)).sum();
    assert_eq!(taken, 250);
    assert_eq!((0..1000).map(|n| take(2.5, f64::from(n) / 1000.0)).sum::<u32>(), 2500);
}
