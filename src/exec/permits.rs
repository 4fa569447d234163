//! The loop that sets an upstream's permits in a process, every [`TICK`]: the ceiling
//! (`max_concurrency` in `serve`, the controller's grant in a worker pod), the adaptive
//! limit under it (found here in `serve`; on Kubernetes the grant already is the
//! controller's share of it), and under that the load signal's caps: the gate's, cut as
//! soon as requests queue at the server ([`crate::concurrency::gate`]), and, where the server says
//! what it runs, the room its other traffic leaves ([`crate::concurrency::headroom`]) and the lines
//! that keep its users' pace within a target ([`crate::concurrency::delay`]). Each process
//! reads the signal and holds its own lines; a signal gone stale is set aside
//! ([`crate::concurrency::staleness`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;

use super::remembered::LimitMemory;
use super::upstream::{Upstream, Upstreams};
use crate::clock;
use crate::concurrency::PROBE_LINES;
use crate::concurrency::control::Mode;
use crate::concurrency::delay::{self, Delay};
use crate::concurrency::discovery::{Discovery, Found};
use crate::concurrency::gate::{Gate, Pressure};
use crate::concurrency::governor::{Governor, Look, OVERLOAD_RULES_FOR};
use crate::concurrency::headroom::{self, Headroom, Occupancy};
use crate::concurrency::lag::Lag;
use crate::concurrency::queue::QueueChoice;
use crate::concurrency::recall;
use crate::concurrency::signals;
use crate::concurrency::staleness::{Sample, Stale, Staleness};
use crate::concurrency::view::Presence;
use crate::metrics::METRICS;
use crate::storage::ObjectStore;
use crate::telemetry::LogThrottle;

/// How often the loop looks.
pub const TICK: Duration = Duration::from_millis(50);
/// A failing load signal is logged at most this often (it is counted every time).
const WARN_EVERY: Duration = Duration::from_secs(60);
/// Worker pods that share a server take turns at the probe, this long each in the order
/// their grants give them: one probe between them, where a probe each would be four
/// lines at a server of four slots.
pub const PROBE_TURN: Duration = Duration::from_secs(5);

/// Runs every upstream's loop, forever. With `memory` (`serve`'s storage), an adaptive
/// limit is kept there and resumed from by the next run ([`super::remembered`]).
pub async fn govern_all(
    upstreams: &Upstreams,
    client: &reqwest::Client,
    mode: Mode,
    memory: Option<Arc<dyn ObjectStore>>,
) {
    futures_util::future::join_all(upstreams.iter().map(|upstream| {
        let memory = memory.clone().filter(|_| mode == Mode::Local && upstream.adaptive);
        govern(upstream, client, mode, memory.and_then(|store| LimitMemory::new(store, &upstream.name)))
    }))
    .await;
}

/// Runs forever (the caller drops it to stop).
pub async fn govern(upstream: &Upstream, client: &reqwest::Client, mode: Mode, mut memory: Option<LimitMemory>) {
    let limiter = &upstream.limiter;
    let recalled = match memory.as_mut() {
        Some(memory) => memory.recall().await,
        None => None,
    };
    if let Some(limit) = recalled {
        tracing::info!(upstream = %upstream.name, limit, "resuming from the limit the last run settled on");
    }
    let mut governor = recalled.map_or_else(
        || Governor::new(upstream.max_concurrency),
        |limit| Governor::resume(upstream.max_concurrency, limit),
    );
    let mut caps = LoadCaps::new(upstream);
    let limit_gauge = METRICS.concurrency_limit_of(&upstream.name);
    let mut last_limit = None;
    // The first look at once (the limit is known from the start), the next on the wall
    // clock's beat: worker pods that share a server read its signal at the same instants
    // (`LoadCaps::read_when_due`), and their views of it agree.
    let first = tokio::time::Instant::now() + clock::until_beat(clock::since_epoch(), TICK, Duration::ZERO);
    let mut ticks = tokio::time::interval_at(first, TICK);
    // A late tick skips those missed and keeps to the beat.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Permits follow the target while the loop waits for the load signal.
    let looping = async {
        loop {
            let now = std::time::Instant::now();
            let limit = match mode {
                Mode::Granted => upstream.control.grant.load(Ordering::Relaxed),
                Mode::Local if upstream.adaptive => governor.look(Look {
                    now,
                    counts: upstream.observed.counts(),
                    in_flight: limiter.in_flight(),
                    ceiling: upstream.max_concurrency,
                    crowded: caps.crowded(),
                    overruled: fills(mode, upstream, &caps, &governor, now),
                }),
                Mode::Local => upstream.max_concurrency,
            };
            if last_limit.replace(limit) != Some(limit) {
                tracing::debug!(upstream = %upstream.name, limit, in_flight = limiter.in_flight(), "the limit moved");
            }
            if let Some(memory) = memory.as_mut().filter(|_| governor.has_measured()) {
                memory.keep(governor.limit(), now).await;
            }
            let filling = fills(mode, upstream, &caps, &governor, now);
            caps.read_when_due(upstream, client, mode, limit, filling).await;
            let target = match caps.cap() {
                Some(cap) if fills(mode, upstream, &caps, &governor, now) => cap.min(upstream.max_concurrency),
                cap => cap.map_or(limit, |cap| cap.min(limit)),
            };
            limit_gauge.set(i64::from(target));
            limiter.set_target(target);
            caps.take_back(upstream, target);
            ticks.tick().await;
        }
    };
    tokio::select! {
        () = limiter.apply() => {}
        () = looping => {}
    }
}

/// What a reading saw of the server, with this process's lines at it (`ours`) and in
/// flight.
fn occupancy(runs: Runs, ours: u32, still_counted: u32, in_flight: u32, siblings_only: bool) -> Occupancy {
    let Runs { running, waiting, kv_cache_usage, .. } = runs;
    Occupancy { running, waiting, ours, still_counted, in_flight, kv_cache_usage, siblings_only }
}

/// Whether the headroom's cap sets the batch's lines by itself, up to the ceiling: a batch
/// alone at a server that says its places fills them, as the server counts, and the
/// throughput rule's knee does not hold it below. Only the adaptive limit of `serve` is
/// overruled (a worker pod keeps to its grant, and a fixed limit is the user's: the
/// controller overrules its own rule when every pod fills, `crate::k8s::granting`), and
/// not for a while after overload cut it.
fn fills(mode: Mode, upstream: &Upstream, caps: &LoadCaps, governor: &Governor, now: std::time::Instant) -> bool {
    mode == Mode::Local
        && upstream.adaptive
        && caps.alone_with_room()
        && !governor.backed_off_within(now, OVERLOAD_RULES_FOR)
}

/// The caps an upstream's load signal sets, and when to read it next.
struct LoadCaps {
    gate: Gate,
    headroom: Headroom,
    /// Whether the headroom keeps a queue of the batch's lines alone: tried and chosen.
    queue: QueueChoice,
    /// The headroom's cap as of the last reading (none once a reading fails).
    room: Option<u32>,
    delay: Delay,
    /// The delay's cap as of the last reading (none once a reading fails).
    paced: Option<u32>,
    /// The last reading that said what the server runs.
    ran_at: Option<std::time::Instant>,
    /// The last reading saw nothing queue (or failed).
    clear: bool,
    /// It is this process's turn at the probe ([`PROBE_TURN`]).
    probing: bool,
    /// The last reading said what the server runs, and other traffic was there lately.
    others: bool,
    /// What the reading of this look saw, until lines are taken back by it.
    seen: Option<Occupancy>,
    /// That reading saw users come to a server the batch had to itself (the headroom
    /// alone before it, not after).
    came: bool,
    /// Whether a worker pod's users have gone, as its grant says.
    users: Presence,
    staleness: Staleness,
    /// Whether the server's gauges lag its answers, and which of this process's lines
    /// they still count.
    lag: Lag,
    /// Where the signal is looked for, where none is configured.
    discovery: Option<Discovery>,
    /// Readings ask for the signal's metrics by name ([`signals::read`]) until the server
    /// refuses the query.
    by_name: bool,
    next_read: tokio::time::Instant,
    /// The failing signal's warning, at most every [`WARN_EVERY`].
    warned: LogThrottle,
    upstream: String,
    held: Gauge,
}

impl LoadCaps {
    fn new(upstream: &Upstream) -> Self {
        if let Some(signal) = upstream.load_signal() {
            METRICS.load_signal_read(&upstream.name, signal.server.name(), "configured");
        }
        Self {
            gate: Gate::default(),
            headroom: Headroom::new(
                upstream.load_signal().map_or(signals::MAX_KV_CACHE_USAGE, |s| s.max_kv_cache_usage),
            ),
            queue: QueueChoice::default(),
            room: None,
            delay: Delay::default(),
            paced: None,
            ran_at: None,
            clear: true,
            probing: true,
            others: false,
            seen: None,
            came: false,
            users: Presence::default(),
            staleness: Staleness::default(),
            lag: Lag::default(),
            discovery: upstream.discovery.clone(),
            by_name: true,
            next_read: tokio::time::Instant::now(),
            warned: LogThrottle::every(WARN_EVERY),
            upstream: upstream.name.clone(),
            held: METRICS.dispatch_held_of(&upstream.name),
        }
    }

    /// A reading that failed or was set aside: counted every time, logged at most every
    /// [`WARN_EVERY`]. Batches go on, governed by throughput alone: at once when it was
    /// set aside, after [`crate::concurrency::staleness::FAILED_HOLD`] of failures.
    fn failed(&mut self, reason: &'static str, detail: &str) {
        METRICS.load_signal_failures_of(&self.upstream, reason).inc();
        if self.warned.due(std::time::Instant::now()) {
            tracing::warn!(upstream = %self.upstream, reason, detail, "the load signal failed; batches go on without it");
        }
    }

    /// Whether the signal sees anyone but this process at the server: requests queueing
    /// (the batch's own, alone, are not counted: the gate stands aside then), or other
    /// traffic running lately. Without a signal nobody is seen.
    fn crowded(&self) -> bool {
        !self.clear || self.others
    }

    /// Alone at the server, with its places known: the headroom's cap fills them. (A
    /// room is known only from the last reading, and only where it said what runs.)
    fn alone_with_room(&self) -> bool {
        self.room.is_some() && self.headroom.alone()
    }

    /// The lowest of the gate's cap, the headroom's and the delay's (`None`: none holds
    /// the batch), but [`PROBE_LINES`] at least while nothing queues, in its turn.
    fn cap(&self) -> Option<u32> {
        let cap = [self.gate.cap(), self.room, self.paced].into_iter().flatten().min()?;
        Some(if self.clear && self.probing { cap.max(PROBE_LINES) } else { cap })
    }

    /// Reads the upstream's load signal, if it has one and a reading is due, and sets the
    /// caps from it (`filling`: the headroom's cap alone sets the batch's lines now).
    async fn read_when_due(
        &mut self,
        upstream: &Upstream,
        client: &reqwest::Client,
        mode: Mode,
        limit: u32,
        filling: bool,
    ) {
        if upstream.load_signal().is_none() {
            self.discover(upstream, client).await;
        }
        let Some(signal) = upstream.load_signal() else { return };
        if tokio::time::Instant::now() < self.next_read {
            return;
        }
        // On the wall clock's beat of `every`, as the ticks are: processes that share the
        // server read it at the same instants. (Not `now + every`: a tick falls a hair
        // before that, which would make every reading wait one more tick.)
        self.next_read =
            tokio::time::Instant::now() + clock::until_beat(clock::since_epoch(), signal.every, Duration::ZERO);
        // The server counted this process's lines at some moment of the scrape: at most
        // those it had before, and those sent meanwhile. Counted after the scrape, a line
        // the server still had but whose answer came meanwhile would be taken for
        // someone else's, and a batch alone for a batch beside users.
        let mark = upstream.observed.mark();
        let Some((pressure, runs)) = self.read(upstream, client, signal).await else { return };
        let in_flight = upstream.limiter.in_flight();
        let now = std::time::Instant::now();
        let ours = upstream.observed.at_upstream_since(mark);
        let still_counted = runs.map_or(0, |Runs { running, waiting, kv_cache_usage, .. }| {
            self.lag.read(now, (running, waiting, kv_cache_usage), ours, self.headroom.alone())
        });
        let part = share(mode, upstream);
        self.probing = probing(mode, upstream, std::time::SystemTime::now());
        self.choose_queue(upstream, now, filling);
        let siblings_only = part < 1.0
            && users(mode, upstream).is_some_and(|users| self.users.gone_for(now, users, headroom::RESERVE_OVER));
        self.read_room(now, part, runs.map(|runs| occupancy(runs, ours, still_counted, in_flight, siblings_only)));
        // Alone at the server, a queue there is the batch's own lines: the headroom holds
        // the batch to the places that queue showed, and the gate, which makes room for
        // users, has nobody to make room for (it would halve the batch for its own queue).
        let runs_known = runs.is_some();
        let alone = runs_known && self.headroom.alone();
        self.others = runs_known && !alone;
        if alone {
            self.gate = Gate::default();
        }
        let pressure = if alone { Pressure::Clear } else { pressure };
        // The gate grows with this process's part of the server's places: a worker pod's cap is
        // its part of the room, and regrows in the time a lone process's does.
        let places = self.headroom.places().map(|places| places * part);
        let cap = self.gate.read(now, pressure, in_flight, limit, places);
        self.note_ran(upstream, mode, runs, ours + still_counted, now);
        self.paced = runs.and_then(|Runs { running, waiting, token_time, .. }| {
            let look = delay::Look {
                timing: upstream.observed.timing(),
                running,
                waiting,
                ours,
                still_counted,
                in_flight,
                others: !self.headroom.alone(),
                share: part,
                users: users(mode, upstream),
                probing: self.probing,
                token_time,
            };
            self.delay.read(now, look, limit, rand::random())
        });
        tracing::debug!(
            upstream = %upstream.name, ?pressure, ?runs, ours, still_counted, in_flight, users = ?users(mode, upstream), ?cap, room = ?self.room,
            reserve = self.headroom.reserve(), paced = ?self.paced, pace = ?self.delay.pace(), limit, "load signal read"
        );
        self.clear = pressure == Pressure::Clear;
        self.held.set(i64::from(!self.clear));
        if mode == Mode::Granted {
            upstream.control.filling.store(self.alone_with_room(), Ordering::Relaxed);
        }
    }

    /// Looks for the upstream's signal at the server, where none is configured and a
    /// look is due ([`crate::concurrency::discovery`]).
    async fn discover(&mut self, upstream: &Upstream, client: &reqwest::Client) {
        let Some(discovery) = self.discovery.as_mut().filter(|d| d.due(std::time::Instant::now())) else { return };
        let first = discovery.first();
        let found = discovery.look(client).await;
        discovery.looked(std::time::Instant::now(), &found);
        match found {
            Found::Signal(signal) => {
                tracing::info!(
                    upstream = %upstream.name, url = %signal.url, server = ?signal.server,
                    "found the server's load signal: batches make way for its users by it"
                );
                METRICS.load_signal_read(&upstream.name, signal.server.name(), "found");
                upstream.signal_found(signal);
            }
            // Said once; the looks again every 10 minutes are not.
            Found::Nothing if first => tracing::info!(
                upstream = %upstream.name,
                "no load signal of a known server beside its API (set upstreams[].load_signal): the throughput rule alone governs"
            ),
            Found::Nothing => {}
            Found::Unanswered => {
                tracing::debug!(upstream = %upstream.name, "the server did not answer a look for its load signal")
            }
        }
    }

    /// The headroom's cap from what this reading saw, and whether it saw users come to a
    /// server the batch had to itself.
    fn read_room(&mut self, now: std::time::Instant, part: f64, seen: Option<Occupancy>) {
        self.seen = seen;
        let was_alone = self.headroom.alone();
        self.room = self
            .seen
            .map(|occupancy| self.headroom.read(now, occupancy, part))
            .map(|cap| headroom::take(cap, rand::random()));
        self.came = was_alone && !self.headroom.alone();
    }

    /// Takes back the batch's youngest lines that the server queues beyond `target`, the
    /// lines it may hold now, at the reading that saw its users come ([`recall`]).
    fn take_back(&mut self, upstream: &Upstream, target: u32) {
        let Some(occupancy) = self.seen.take() else { return };
        let lines = recall::lines_to_take_back(&occupancy, target, std::mem::take(&mut self.came));
        let taken = upstream.recalls.take_back(lines);
        if taken > 0 {
            tracing::debug!(upstream = %upstream.name, taken, ?occupancy, target, "took lines back from the server's queue");
        }
    }

    /// What the server ran since the reading before, for the lines' own averages
    /// ([`delay`]); a gap of more than a second says nothing of it. And, in a worker pod,
    /// what it held besides the pod's lines (`counted`: those the reading counts, its
    /// lines at the server and those answered that gauges which lag still count), for
    /// its acknowledgment (`serve` has none).
    fn note_ran(&mut self, upstream: &Upstream, mode: Mode, runs: Option<Runs>, counted: u32, now: std::time::Instant) {
        match runs {
            Some(Runs { running, waiting, .. }) => {
                if mode == Mode::Granted {
                    upstream.observed.seen(running + waiting, counted);
                }
                if let Some(since) = self.ran_at.map(|at| now.saturating_duration_since(at))
                    && since <= Duration::from_secs(1)
                {
                    upstream.observed.ran(running, since);
                }
                self.ran_at = Some(now);
            }
            None => self.ran_at = None,
        }
    }

    /// Whether the headroom keeps a queue of the batch's lines alone: as tried at this
    /// server ([`crate::concurrency::queue`]), while the fill is what sets the batch's
    /// lines and a queue would be kept on top of its places (not while they grow, nor
    /// where the KV cache bounds them: both sides of a trial would be alike there).
    fn choose_queue(&mut self, upstream: &Upstream, now: std::time::Instant, filling: bool) {
        let places = self.headroom.queue_places().filter(|_| filling);
        if let Some(chosen) = self.queue.look(now, upstream.observed.counts(), places) {
            tracing::debug!(
                upstream = %upstream.name, queue = chosen.queue, without = chosen.rates[0], with = chosen.rates[1],
                "tried the batch alone with a queue at the server and without"
            );
        }
        self.headroom.keep_queue(self.queue.queue());
    }

    /// One reading of the signal: the pressure it shows and, where the server says what
    /// it runs, what it holds. `None` once a stale reading has been set aside (nothing of
    /// the signal holds then), and for a failed reading while what the last one believed
    /// said still holds (`staleness::FAILED_HOLD`); past that a failed reading is clear,
    /// as without one.
    async fn read(
        &mut self,
        upstream: &Upstream,
        client: &reqwest::Client,
        signal: &signals::LoadSignalConfig,
    ) -> Option<(Pressure, Option<Runs>)> {
        let read = match signals::read(client, signal, &mut self.by_name).await {
            Ok((reading, digest)) => {
                let pressure = reading.pressure(signal);
                let sample = Sample {
                    digest,
                    numbers: [reading.waiting, reading.running.unwrap_or(-1.0), reading.kv_cache_usage.unwrap_or(-1.0)]
                        .map(f64::to_bits),
                    holding: pressure != Pressure::Clear,
                    finished: upstream.observed.counts().lines,
                };
                let stale = self.staleness.judge(std::time::Instant::now(), sample);
                upstream.control.signal_stale.store(stale.is_some(), Ordering::Relaxed);
                match stale {
                    None => {
                        let runs = reading.running.map(|running| Runs {
                            running,
                            waiting: reading.waiting,
                            kv_cache_usage: reading.kv_cache_usage,
                            token_time: reading.token_time,
                        });
                        (pressure, runs)
                    }
                    Some(stale) => {
                        let detail = match stale {
                            Stale::SameSample => "the same answer while lines finished at the server",
                            Stale::FrozenHold => "a hold whose numbers have not moved in a minute",
                        };
                        self.failed("stale", detail);
                        // The throughput rule alone, at once: nothing of the signal holds.
                        self.gate = Gate::default();
                        self.room = None;
                        self.paced = None;
                        self.clear = true;
                        self.others = false;
                        self.held.set(0);
                        return None;
                    }
                }
            }
            Err(failure) => {
                upstream.control.signal_stale.store(false, Ordering::Relaxed);
                self.failed(failure.reason, &failure.detail);
                // A server too busy to answer in time is busy, not empty: the caps stay.
                if self.staleness.holds_through_failure(std::time::Instant::now()) {
                    return None;
                }
                (Pressure::Clear, None)
            }
        };
        Some(read)
    }
}

/// What a reading says the server holds, where it says what it runs.
#[derive(Clone, Copy, Debug)]
struct Runs {
    running: f64,
    waiting: f64,
    /// The share of its KV cache in use, where it says.
    kv_cache_usage: Option<f64>,
    /// Its own time a token so far, where it says.
    token_time: Option<signals::TokenTime>,
}

/// The users' requests the upstream runs as the worker pods saw them together, as the
/// grant says (`None` in `serve`, where the load signal's reading less this process's
/// lines is all of them, and until a grant says).
fn users(mode: Mode, upstream: &Upstream) -> Option<f64> {
    match mode {
        Mode::Local => None,
        Mode::Granted => {
            let users = upstream.control.users.load(Ordering::Relaxed);
            (users != u64::MAX).then(|| users as f64 / 1000.0)
        }
    }
}

/// Whether it is this process's turn at the probe at `now`: always in `serve`; a worker
/// pod's turn is its place among the pods that send to the upstream, as its grant says,
/// every [`PROBE_TURN`] of the clock in turn ([`in_turn`]).
fn probing(mode: Mode, upstream: &Upstream, now: std::time::SystemTime) -> bool {
    match mode {
        Mode::Local => true,
        Mode::Granted => {
            let sharing = upstream.control.sharing.load(Ordering::Relaxed);
            let turn = upstream.control.turn.load(Ordering::Relaxed);
            let timing = upstream.observed.timing();
            let line = Duration::from_micros(timing.micros.checked_div(timing.lines).unwrap_or(0));
            in_turn(now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default(), sharing, turn, line)
        }
    }
}

/// Whether the pod at place `turn` among `sharing` may start the probe's line `since` the
/// epoch: in its turn of [`PROBE_TURN`], but not in the last `line` of it (the batch's
/// lines' average time at the upstream, half a turn at most), so that its last line ends
/// about when the next pod's turn begins. A line started at the turn's end ran on beside
/// the next pod's: two lines at a server of four slots, where the pods meant one.
fn in_turn(since: Duration, sharing: u32, turn: u32, line: Duration) -> bool {
    if sharing <= 1 {
        return true;
    }
    let (every, at) = (PROBE_TURN.as_millis(), since.as_millis());
    let ours = (at / every) % u128::from(sharing) == u128::from(turn % sharing);
    ours && at % every + line.min(PROBE_TURN / 2).as_millis() < every
}

/// This process's part of the room at the server: all of it in `serve`; in a worker
/// pod, an equal part with the other pods sending to the upstream.
fn share(mode: Mode, upstream: &Upstream) -> f64 {
    match mode {
        Mode::Local => 1.0,
        Mode::Granted => 1.0 / f64::from(upstream.control.sharing.load(Ordering::Relaxed).max(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_take_turns_at_the_probe_and_leave_the_next_one_room_for_the_last_line() {
        let at = |ms: u64| Duration::from_millis(ms);
        let turn = PROBE_TURN.as_millis() as u64;
        let probers =
            |ms: u64, line: Duration| (0..4).filter(|place| in_turn(at(ms), 4, *place, line)).collect::<Vec<_>>();
        // One pod at a time, in order, and round again.
        assert_eq!(probers(0, Duration::ZERO), [0]);
        assert_eq!(probers(turn + 1, Duration::ZERO), [1]);
        assert_eq!(probers(3 * turn + 1, Duration::ZERO), [3]);
        assert_eq!(probers(4 * turn + 1, Duration::ZERO), [0]);
        // Lines of a second: none starts in the last second of a turn, so none runs on
        // into the next pod's.
        assert_eq!(probers(turn - 1_500, at(1_000)), [0]);
        assert!(probers(turn - 500, at(1_000)).is_empty());
        // Lines longer than a turn: each still probes for half of it.
        assert_eq!(probers(turn / 2 - 1, at(60_000)), [0]);
        assert!(probers(turn / 2 + 1, at(60_000)).is_empty());
        // A pod alone always probes.
        assert!(in_turn(at(turn - 1), 1, 0, at(60_000)) && in_turn(at(turn - 1), 0, 0, Duration::ZERO));
    }
}
