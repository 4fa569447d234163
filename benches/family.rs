//! The night shift on a family of model servers (`just bench`): does the untuned batch
//! (a high ceiling and nothing else: the server's load signal is found beside its API)
//! find each server's room, alone and beside its users, as well as the best fixed
//! concurrency found in hindsight on that same server?
//!
//! Members: simulated servers (`tests/common/simulator.rs`) of 16, 64 and 256 sequences,
//! bound by sequences or by their KV cache, with a GPU-like step (nearly flat in the
//! batch's size) or a CPU-like one (growing with it), and one whose gauges lag its
//! answers as SGLang's do (set every 40 steps); and llama.cpp's `llama-server`
//! (a real engine, on the CPU here) with 2, 4 and 8 slots and two model sizes, when
//! tests/tools/install-engine.sh has installed it (`tests/run` does).
//!
//! For each member:
//! 1. **Alone**: batch output tokens/s at fixed concurrencies around the server's size;
//!    the best is the server's capacity. Then untuned: its share of the best, and of the
//!    best fixed concurrency run again beside it (each round runs it, then every build).
//! 2. **Beside users** (Poisson, `USER_TOKENS` output tokens each, at a share of that
//!    capacity): users' p99 with no batch; then fixed concurrencies beside the same
//!    users, and the hindsight best: the largest share of the idle capacity that a fixed
//!    concurrency reaches while keeping users' p99 within 1.2× (where none does, the one
//!    with the lowest p99). Then rounds: the users alone again, the hindsight's count
//!    again and untuned, one after another. Untuned is judged twice: against the sweep
//!    (users' p99 against theirs alone before it, its share against the hindsight
//!    best's), and round by round against the users alone and the hindsight's count
//!    of its own round, where a server's drift weighs on all three alike, window by
//!    window and pooled (the users' p99 over all the rounds' requests).
//!
//! Every run starts a fresh server and a fresh `serve` (release build, or
//! `NIGHTSHIFT_BINARY`): no run inherits another's queue. Batch tokens are counted from
//! `serve`'s `nightshift_lines_total` (every batch line asks for exactly
//! `BATCH_TOKENS`, and these servers answer exactly what is asked).
//!
//! Knobs: `FAMILY_BEFORE` (another build's binary: its untuned runs beside this one's,
//! on the same servers and against the same hindsight), `FAMILY` (members whose name
//! contains any of its `|`-separated parts;
//! default: all), `FAMILY_USERS` (comma-separated `pattern:percent`, patterns `steady`,
//! `bursty` (3× for 2 s in every 10), `daynight` (a quarter to 1.75× the rate over 30 s);
//! default `steady:40`; `none`: the runs alone only), `FAMILY_WARM_SECS` (default 8), `FAMILY_MEASURE_SECS` (default 15
//! alone, twice that beside users), `FAMILY_CAPACITY` (the server's capacity in batch
//! tokens/s, from an earlier run: skips the runs alone and the hindsight, for a quick
//! look at untuned beside users; `FAMILY_HINDSIGHT=1` still sweeps the hindsight beside
//! them), `FAMILY_REPEATS` (rounds: untuned runs per build, each a cell, and beside
//! users a verdict of them all at their medians and pooled; the users' p99 alone and
//! each fixed count of the hindsight's sweep stand at the median of as many windows,
//! and beside users each round runs the users alone and the hindsight's count again:
//! default 1).

#[allow(dead_code)]
#[path = "../tests/common/engine.rs"]
mod engine;
#[path = "common/input.rs"]
mod input;
#[allow(dead_code)]
#[path = "../tests/common/interactive.rs"]
mod interactive;
#[path = "family/members.rs"]
mod members;
#[path = "family/nightshift.rs"]
mod nightshift;
#[allow(dead_code)]
#[path = "../tests/common/ports.rs"]
mod ports;
#[path = "common/serve.rs"]
mod serve;
#[allow(dead_code)]
#[path = "../tests/common/simulator.rs"]
mod simulator;
#[allow(dead_code)]
#[path = "../tests/common/tools.rs"]
mod tools;

use std::time::{Duration, Instant};

use interactive::{Interactive, Pattern};
use members::{Kind, Member, Server, family};
use nightshift::{Batch, Serve};

const PROJECT: &str = "0f0e0d0c-0b0a-4909-8807-060504030201";
const KEY: &str = "family-key";
/// Output tokens of every batch line.
const BATCH_TOKENS: u32 = 32;
/// Output tokens of every user's request.
const USER_TOKENS: u32 = 32;
/// Users' p99 beside a batch may be this many times their p99 alone.
const P99_BOUND: f64 = 1.2;

fn secs(name: &str, default: u64) -> Duration {
    Duration::from_secs(std::env::var(name).ok().map_or(default, |v| v.parse().unwrap()))
}

/// What one run measured.
#[derive(Clone, Debug)]
struct Outcome {
    /// Batch output tokens/s.
    batch: f64,
    /// Users' output tokens/s, if there were users.
    users: Option<f64>,
    /// Every user's request's latency (s): their p99, and pooled with other runs'.
    latencies: Vec<f64>,
    /// Sequences the server preempted over the whole run (simulators only: their work is
    /// thrown away), and the batch's requests it dropped when they were taken back
    /// (users never hang up).
    preempted: Option<(u64, u64)>,
}

/// One run on a fresh `kind` server: users as `users` says, a batch as `batch` says
/// (by the build it names); measured after the warm-up.
async fn run(kind: &Kind, batch: Option<(Batch, &str)>, users: Option<Pattern>, measure: Duration) -> Outcome {
    let server = Server::start(kind).await;
    let users = users.map(|pattern| Interactive::start(&server.api(), pattern, USER_TOKENS));
    let warm = secs("FAMILY_WARM_SECS", 8);
    // Enough lines that none runs out: a thousand lines a second at most, here; no more
    // than an input file may hold (50,000).
    let lines = ((warm + measure).as_secs() as usize * 1_000).clamp(2_000, 50_000);
    let serve = match batch {
        Some((batch, nightshift)) => Some(Serve::start(nightshift, &server, batch, lines).await),
        None => None,
    };
    tokio::time::sleep(warm).await;
    if let Some(users) = &users {
        users.measure_from_now();
    }
    let before = match &serve {
        Some(serve) => serve.completed().await,
        None => 0.0,
    };
    let started = Instant::now();
    tokio::time::sleep(measure).await;
    let after = match &serve {
        Some(serve) => serve.completed().await,
        None => 0.0,
    };
    let elapsed = started.elapsed().as_secs_f64();
    // Before `serve` stops: its lines in flight then hang up too.
    let preempted = match &server {
        Server::Sim(sim) => Some((sim.stats().preempted, sim.stats().aborted)),
        Server::Engine(_) => None,
    };
    drop(serve);
    let (users, latencies) = match users {
        Some(users) => {
            let latencies = users.stop().await;
            if latencies.failed > 0 {
                println!("  ({} users' requests failed)", latencies.failed);
            }
            (Some(latencies.tokens as f64 / elapsed), latencies.seconds)
        }
        None => (None, Vec::new()),
    };
    Outcome { batch: (after - before) * f64::from(BATCH_TOKENS) / elapsed, users, latencies, preempted }
}

/// Fixed concurrencies to try: powers of two from `from` to `to` (at least 1).
fn powers(from: u32, to: u32) -> Vec<u32> {
    std::iter::successors(Some(from.max(1)), |n| Some(n * 2)).take_while(|n| *n <= to.max(1)).collect()
}

/// A build of `serve` to run untuned: this one, and `FAMILY_BEFORE`'s to compare.
struct Build {
    name: &'static str,
    binary: String,
}

fn builds() -> Vec<Build> {
    let mut builds = vec![Build { name: "this build", binary: serve::binary() }];
    if let Ok(binary) = std::env::var("FAMILY_BEFORE") {
        builds.push(Build { name: "before", binary });
    }
    builds
}

/// Alone: the best fixed concurrency and its tokens/s.
async fn best_alone(member: &Member) -> (u32, f64) {
    let measure = secs("FAMILY_MEASURE_SECS", 15);
    let mut best = (0, 0.0);
    for n in powers(member.places / 4, member.places * 2) {
        let outcome = run(&member.kind, Some((Batch::Fixed(n), &serve::binary())), None, measure).await;
        eprintln!("  {}: alone, fixed {n}: {:.0} tokens/s{}", member.name, outcome.batch, preempted(&outcome));
        if outcome.batch > best.1 {
            best = (n, outcome.batch);
        }
    }
    best
}

/// A run beside users: users' p99 against `alone_p99`, and the batch's share of what
/// they leave idle of `capacity`.
#[derive(Clone, Copy)]
struct Beside {
    p99_ratio: f64,
    share: f64,
}

impl Beside {
    /// This run's figures with its users' p99 against `to` instead of `from`.
    fn against(self, from: f64, to: f64) -> Beside {
        Beside { p99_ratio: self.p99_ratio * from / to, ..self }
    }

    /// Whether this run meets the target against the hindsight: the sweep's figures say
    /// whether a fixed count kept users within the bound (then the bound is the bar,
    /// else that count's p99 in `fixed`, the run to hold this one against), and the
    /// share is held against `fixed`'s.
    fn meets(&self, sweep: &Beside, fixed: &Beside) -> bool {
        let bar = if sweep.p99_ratio <= P99_BOUND { P99_BOUND } else { fixed.p99_ratio.max(P99_BOUND) };
        self.p99_ratio <= bar && self.share >= 0.9 * fixed.share
    }

    /// Several runs' p99 ratios and shares, each at its median.
    fn medians(runs: &[Beside]) -> Beside {
        Beside {
            p99_ratio: median(runs.iter().map(|run| run.p99_ratio)),
            share: median(runs.iter().map(|run| run.share)),
        }
    }
}

/// Users as a member's server sees them: their pattern, their p99 with no batch, and
/// the server's capacity (batch tokens/s alone at its best).
#[derive(Clone, Copy)]
struct Users {
    pattern: Pattern,
    alone_p99: f64,
    capacity: f64,
}

async fn beside(member: &Member, batch: Batch, nightshift: &str, users: Users) -> Beside {
    window(member, batch, nightshift, users).await.beside
}

/// One window beside users: its figures, and the users' latencies in it.
struct Window {
    beside: Beside,
    latencies: Vec<f64>,
}

async fn window(member: &Member, batch: Batch, nightshift: &str, users: Users) -> Window {
    let outcome = run(&member.kind, Some((batch, nightshift)), Some(users.pattern), measure_with_users()).await;
    let used = outcome.users.expect("users ran");
    let beside = Beside {
        p99_ratio: p99(&outcome.latencies) / users.alone_p99,
        share: outcome.batch / (users.capacity - used).max(1.0),
    };
    eprintln!(
        "  {}: {batch:?} beside users: p99 {:.2}×, share {:.2}{}",
        member.name,
        beside.p99_ratio,
        beside.share,
        preempted(&outcome)
    );
    Window { beside, latencies: outcome.latencies }
}

/// `FAMILY_REPEATS`: untuned runs per build and member (default 1), each a cell of its
/// row: one run's figure is one sample, and a build is judged run by run (beside users,
/// at the runs' medians as well). The users' p99 alone and the hindsight's fixed counts
/// run as many windows, at their medians.
fn repeats() -> usize {
    std::env::var("FAMILY_REPEATS").ok().map_or(1, |v| v.parse::<usize>().expect("FAMILY_REPEATS: a count").max(1))
}

/// [`repeats`] windows of `run`, one after another.
async fn windows<T, F: Future<Output = T>>(mut run: impl FnMut() -> F) -> Vec<T> {
    let mut runs = Vec::new();
    for _ in 0..repeats() {
        runs.push(run().await);
    }
    runs
}

/// The median of some figures (of an even count, the mean of the middle two).
fn median(figures: impl Iterator<Item = f64>) -> f64 {
    let mut figures: Vec<f64> = figures.collect();
    figures.sort_by(f64::total_cmp);
    let middle = figures.len() / 2;
    if figures.len().is_multiple_of(2) { (figures[middle - 1] + figures[middle]) / 2.0 } else { figures[middle] }
}

/// The verdict of each run beside users, and of several runs at their medians (as the
/// hindsight's fixed counts are judged).
fn verdicts(runs: &[Beside], met: impl Fn(&Beside) -> String) -> String {
    let each = cells(runs, &met);
    if runs.len() > 1 { format!("{each} (medians: {})", met(&Beside::medians(runs))) } else { each }
}

/// One cell for several runs: each run's figure, `/`-separated.
fn cells<T>(runs: &[T], cell: impl Fn(&T) -> String) -> String {
    runs.iter().map(cell).collect::<Vec<_>>().join(" / ")
}

/// One round beside users: the users' latencies alone, the hindsight's count beside them
/// (where it was swept) and every build's untuned window, each against that round's
/// users alone.
struct Round {
    alone: Vec<f64>,
    fixed: Option<Window>,
    builds: Vec<Window>,
}

/// [`repeats`] rounds beside `users`. A server's pace drifts over a bench run
/// (llama-server's users alone had a p99 of 236 ms in one run and 452 ms in another):
/// judged against figures from its own round, an untuned window is not held against a
/// hindsight swept minutes earlier on a faster or slower server.
async fn rounds(member: &Member, users: Users, hindsight: Option<u32>, builds: &[Build]) -> Vec<Round> {
    let mut rounds = Vec::new();
    for _ in 0..repeats() {
        let alone = run(&member.kind, None, Some(users.pattern), measure_with_users()).await.latencies;
        let alone_p99 = p99(&alone);
        eprintln!("  {}: users alone: p99 {:.0} ms", member.name, alone_p99 * 1000.0);
        let users = Users { alone_p99, ..users };
        let fixed = match hindsight {
            Some(n) => Some(window(member, Batch::Fixed(n), &serve::binary(), users).await),
            None => None,
        };
        let mut runs = Vec::new();
        for build in builds {
            runs.push(window(member, Batch::Untuned, &build.binary, users).await);
        }
        rounds.push(Round { alone, fixed, builds: runs });
    }
    rounds
}

/// The 99th percentile of some latencies (s), by nearest rank.
fn p99(seconds: &[f64]) -> f64 {
    interactive::Latencies { seconds: seconds.to_vec(), failed: 0, tokens: 0 }.percentile(99.0)
}

/// Windows pooled: the users' p99 over all their requests against that of the users
/// alone over all theirs, and the batch's mean share. A 30-s window holds 100–200 user
/// requests, so its p99 is the second or third worst of them: the users alone of one
/// simulated server, whose steps never vary, gave 334 ms in one window and 494 ms in
/// the next. Pooled, three windows' p99 is the fifth worst or so.
fn pooled<'a>(alone: impl Iterator<Item = &'a Vec<f64>>, windows: &[&Window]) -> Beside {
    let alone: Vec<f64> = alone.flatten().copied().collect();
    let beside: Vec<f64> = windows.iter().flat_map(|window| window.latencies.iter().copied()).collect();
    Beside {
        p99_ratio: p99(&beside) / p99(&alone),
        share: windows.iter().map(|window| window.beside.share).sum::<f64>() / windows.len() as f64,
    }
}

/// A build's row of the round-by-round table: each round's figures and their pool, and
/// the verdict of each against the hindsight's count run in its round (and of the
/// pools).
fn round_row(
    member: &Member,
    users: &str,
    build: &str,
    rounds: &[Round],
    index: usize,
    sweep: Option<Beside>,
) -> String {
    let fixed: Vec<&Window> = rounds.iter().filter_map(|round| round.fixed.as_ref()).collect();
    let runs: Vec<&Window> = rounds.iter().map(|round| &round.builds[index]).collect();
    let pool = |windows: &[&Window]| pooled(rounds.iter().map(|round| &round.alone), windows);
    let figures = |run: &Beside| format!("{:.2}× at {:.2}", run.p99_ratio, run.share);
    let each = |windows: &[&Window]| {
        format!("{} (pooled: {})", cells(windows, |window| figures(&window.beside)), figures(&pool(windows)))
    };
    let met = match sweep.filter(|_| !fixed.is_empty()) {
        Some(sweep) => {
            let each = cells(&runs.iter().zip(&fixed).collect::<Vec<_>>(), |(run, fixed)| {
                verdict(run.beside.meets(&sweep, &fixed.beside))
            });
            format!("{each} (pooled: {})", verdict(pool(&runs).meets(&sweep, &pool(&fixed))))
        }
        None => "—".to_owned(),
    };
    format!(
        "| {} | {users} | {build} | {} (pooled: {:.0} ms) | {} | {} | {met} |",
        member.name,
        cells(rounds, |round| format!("{:.0} ms", p99(&round.alone) * 1000.0)),
        p99(&rounds.iter().flat_map(|round| round.alone.iter().copied()).collect::<Vec<_>>()) * 1000.0,
        if fixed.is_empty() { "not run".to_owned() } else { each(&fixed) },
        each(&runs)
    )
}

fn measure_with_users() -> Duration {
    secs("FAMILY_MEASURE_SECS", 15) * 2
}

/// The hindsight best fixed concurrency beside users: fixed concurrencies from a
/// sixteenth of the server's places (one at least) up, doubling while users' p99 stays
/// within the bound, then one between the last that did and the first that did not.
/// Returns it, its share and its p99 ratio. Each count runs [`repeats`] windows and
/// stands at their medians: picked from single windows, the best share within the bound
/// is the luckiest window of a count on the bound's edge.
async fn hindsight(member: &Member, users: Users) -> (u32, Beside) {
    let nightshift = &serve::binary();
    let fixed =
        |n| async move { Beside::medians(&windows(|| beside(member, Batch::Fixed(n), nightshift, users)).await) };
    let mut tried: Vec<(u32, Beside)> = Vec::new();
    for n in powers(member.places / 16, member.places * 2) {
        let result = fixed(n).await;
        let over = result.p99_ratio > P99_BOUND;
        tried.push((n, result));
        if over {
            let below = n / 2;
            if below >= 1 && n - below >= 2 {
                let middle = below + (n - below) / 2;
                tried.push((middle, fixed(middle).await));
            }
            break;
        }
    }
    let within = tried.iter().filter(|(_, b)| b.p99_ratio <= P99_BOUND).max_by(|a, b| a.1.share.total_cmp(&b.1.share));
    let pick = within.or_else(|| tried.iter().min_by(|a, b| a.1.p99_ratio.total_cmp(&b.1.p99_ratio)));
    let (n, best) = pick.expect("one run at least");
    (*n, Beside { p99_ratio: best.p99_ratio, share: best.share })
}

/// `FAMILY_HINDSIGHT=1`: sweep the hindsight beside users even where `FAMILY_CAPACITY`
/// skips the runs alone.
fn sweep_hindsight() -> bool {
    std::env::var("FAMILY_HINDSIGHT").is_ok_and(|v| v == "1")
}

/// `FAMILY_USERS`: the users' patterns at their share of capacity, with names.
fn user_patterns(capacity_tokens: f64) -> Vec<(String, Pattern)> {
    let spec = std::env::var("FAMILY_USERS").unwrap_or_else(|_| "steady:40".into());
    if spec == "none" {
        return Vec::new();
    }
    spec.split(',')
        .map(|part| {
            let (name, percent) = part.trim().split_once(':').expect("pattern:percent");
            let per_sec = percent.parse::<f64>().unwrap() / 100.0 * capacity_tokens / f64::from(USER_TOKENS);
            let pattern = match name {
                "steady" => Pattern::Steady { per_sec },
                "bursty" => Pattern::Bursty { per_sec, factor: 3.0, burst: 2.0, every: 10.0 },
                "daynight" => Pattern::DayNight { low: per_sec * 0.25, high: per_sec * 1.75, period: 30.0 },
                other => panic!("FAMILY_USERS: no pattern {other}"),
            };
            (format!("{name} {percent}%"), pattern)
        })
        .collect()
}

fn main() {
    assert!(std::path::Path::new(&serve::binary()).exists(), "build the release binary first: cargo build --release");
    let wanted = std::env::var("FAMILY").unwrap_or_default();
    let members: Vec<Member> = family()
        .into_iter()
        .filter(|m| wanted.is_empty() || wanted.split('|').any(|part| m.name.contains(part.trim())))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let builds = builds();
        let mut alone_rows = Vec::new();
        let mut beside_rows = Vec::new();
        let mut round_rows = Vec::new();
        let known: Option<f64> = std::env::var("FAMILY_CAPACITY").ok().map(|v| v.parse().expect("FAMILY_CAPACITY: tokens/s"));
        for member in &members {
            let best = match known {
                Some(capacity) => capacity,
                None => alone(member, &builds, &mut alone_rows).await,
            };
            for (users_name, pattern) in user_patterns(best) {
                let alone = windows(|| async move {
                    p99(&run(&member.kind, None, Some(pattern), measure_with_users()).await.latencies)
                })
                .await;
                let alone_p99 = median(alone.into_iter());
                let users = Users { pattern, alone_p99, capacity: best };
                let (hindsight_cell, fixed) = match known {
                    Some(_) if !sweep_hindsight() => ("not run".to_owned(), None),
                    _ => {
                        let (n, fixed) = hindsight(member, users).await;
                        (format!("fixed {n}: {:.2}× at {:.2}", fixed.p99_ratio, fixed.share), Some((n, fixed)))
                    }
                };
                // Where no fixed concurrency keeps the bound, the best one's p99 is the bar;
                // with no hindsight, there is nothing to hold the share against.
                let against =
                    |run: &Beside| fixed.map_or("—".to_owned(), |(_, fixed)| format!("{:.2}", run.share / fixed.share));
                let met = |run: &Beside| fixed.map_or("—".to_owned(), |(_, fixed)| verdict(run.meets(&fixed, &fixed)));
                // Each round: the users alone, the hindsight's count again, then every build,
                // so that a server whose pace drifts weighs on them alike.
                let rounds = rounds(member, users, fixed.map(|(n, _)| n), &builds).await;
                for (index, build) in builds.iter().enumerate() {
                    let runs: Vec<Beside> = rounds
                        .iter()
                        .map(|round| round.builds[index].beside.against(p99(&round.alone), alone_p99))
                        .collect();
                    beside_rows.push(format!(
                        "| {} | {users_name} | {:.0} ms | {hindsight_cell} | {} | {} | {} | {} | {} |",
                        member.name,
                        alone_p99 * 1000.0,
                        build.name,
                        cells(&runs, |run| format!("{:.2}×", run.p99_ratio)),
                        cells(&runs, |run| format!("{:.2}", run.share)),
                        cells(&runs, against),
                        verdicts(&runs, met)
                    ));
                    round_rows.push(round_row(member, &users_name, build.name, &rounds, index, fixed.map(|(_, f)| f)));
                }
            }
        }
        println!("\n## Alone: untuned against the best fixed concurrency (batch output tokens/s)");
        println!(
            "| server | best fixed (again, a run each round) | build | untuned | untuned / best | untuned / fixed again | ≥ 0.95 |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        alone_rows.iter().for_each(|row| println!("{row}"));
        println!("\n## Beside users: users' p99 against theirs alone, and the batch's share of the idle capacity");
        println!(
            "| server | users | p99 alone | hindsight best fixed: p99, share | build | untuned: p99 | untuned: share | share / best | p99 kept, share ≥ 0.9 |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        beside_rows.iter().for_each(|row| println!("{row}"));
        println!("\n## Beside users, round by round: each against the users alone and the hindsight's count in its round");
        println!("| server | users | build | users' p99 alone | hindsight's count again: p99, share | untuned: p99, share | met in its round |");
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        round_rows.iter().for_each(|row| println!("{row}"));
    });
}

/// A member alone: the best fixed concurrency, and each build's untuned against it, as
/// rows. Returns the best's batch tokens/s (the server's capacity). Each round runs the
/// best fixed concurrency again, then every build: a server whose pace drifts (llama-server
/// on two shared cores gave one fixed concurrency 444 to 635 tokens/s in three bench
/// runs) weighs on the runs of one round alike, and each is also given against the fixed
/// run of its round.
async fn alone(member: &Member, builds: &[Build], rows: &mut Vec<String>) -> f64 {
    let (best_n, best) = best_alone(member).await;
    let measure = secs("FAMILY_MEASURE_SECS", 15);
    let mut again = Vec::new();
    let mut runs = vec![Vec::new(); builds.len()];
    for _ in 0..repeats() {
        let fixed = run(&member.kind, Some((Batch::Fixed(best_n), &serve::binary())), None, measure).await;
        eprintln!("  {}: alone, fixed {best_n} again: {:.0} tokens/s{}", member.name, fixed.batch, preempted(&fixed));
        again.push(fixed.batch);
        for (build, runs) in builds.iter().zip(&mut runs) {
            let outcome = run(&member.kind, Some((Batch::Untuned, &build.binary)), None, measure).await;
            eprintln!(
                "  {}: alone, untuned ({}): {:.0} tokens/s{}",
                member.name,
                build.name,
                outcome.batch,
                preempted(&outcome)
            );
            runs.push(outcome.batch);
        }
    }
    for (build, runs) in builds.iter().zip(&runs) {
        let beside: Vec<f64> = runs.iter().zip(&again).map(|(run, fixed)| run / fixed.max(1.0)).collect();
        rows.push(format!(
            "| {} | fixed {best_n}: {best:.0} (again: {}) | {} | {} | {} | {} | {} |",
            member.name,
            cells(&again, |run| format!("{run:.0}")),
            build.name,
            cells(runs, |run| format!("{run:.0}")),
            cells(runs, |run| format!("{:.2}", run / best)),
            cells(&beside, |ratio| format!("{ratio:.2}")),
            cells(runs, |run| verdict(run / best >= 0.95))
        ));
    }
    best
}

/// ", N preempted, M taken back" where the server says.
fn preempted(outcome: &Outcome) -> String {
    outcome.preempted.map_or_else(String::new, |(n, m)| format!(", {n} preempted, {m} taken back"))
}

fn verdict(met: bool) -> String {
    if met { "yes" } else { "**no**" }.to_owned()
}
