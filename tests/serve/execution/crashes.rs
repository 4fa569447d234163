//! A batch through crashes: `serve` killed mid-batch (once, and at random points, with
//! only the lines in flight sent again), a superseded run on one shard, a killed upload's
//! temporary file and a second `serve` on one directory, and a disk full at finalize.

use crate::common;

use std::time::{Duration, Instant};

use common::client::{Client, ids, input};
use common::serve::Serve;
use common::upstream::{Answer, MockUpstream};
use common::{KEY, PROJECT, write_config};
use serde_json::Value;
use tempfile::TempDir;

use super::{MINUTE, serve_with};

#[tokio::test]
async fn serve_killed_mid_batch_resumes_with_no_duplicate_and_no_lost_line() {
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(15));
    let data = TempDir::new().unwrap();
    let (serve, client) = serve_with(&data, &upstream, 4, "", "");
    let custom_ids = ids("k", 300);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    client.wait(&id, MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 60).await;
    serve.kill();
    common::committed::settle(&upstream).await;
    let store = nightshift::storage::DirStore::open(data.path().join("data")).await.unwrap();
    let committed = common::committed::committed_custom_ids(&store, &[]).await;
    let sent_at_kill = upstream.all_calls();
    assert!(sent_at_kill.len() < 300, "the kill came mid-batch");

    let (_serve, client) = serve_with(&data, &upstream, 4, "", "");
    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 300);
    // Nothing committed at the kill was sent again; only what was sent and not committed.
    let resent = common::committed::check_kill_laws(&sent_at_kill, &committed, &upstream.all_calls());
    eprintln!("{} committed at the kill, {} sent again", committed.len(), resent.len());
    // batch_req_ ids are stable: derived, not drawn.
    let ids: std::collections::HashSet<_> =
        results.output.values().map(|r| r["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ids.len(), 300);
}

/// The law of a crash at many random points in one batch: a line is sent again only if
/// it was in flight at the kill, since a finished line's permit goes to the next line
/// only once its record is durable. Odd kills come while the upstream holds every
/// answer and all the permits are at it (nothing waits for a commit then): exactly the
/// lines in flight are sent again. Even kills come at any instant: at most a permit's
/// worth of lines, and the upstream's count at the kill is reported beside it.
#[tokio::test(flavor = "multi_thread")]
async fn kills_at_random_points_resend_only_the_lines_in_flight() {
    const CONCURRENCY: u64 = 4;
    const KILLS: usize = 24;
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(20));
    let data = TempDir::new().unwrap();
    let store = nightshift::storage::DirStore::open(data.path().join("data")).await.unwrap();
    // A timeout no busy machine reaches: every call after the first is a re-send. One
    // shard: the permits all reach the upstream whenever four lines are left.
    let config = write_config(
        data.path(),
        &format!(
            "upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: {CONCURRENCY}\n    \
             timeout: 5m\nbatches:\n  shard_lines: 1500\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let start = || {
        let serve = Serve::start(&data.path().join("data"), &["--config", config.to_str().unwrap()]);
        let client = Client::new(&serve.url, PROJECT, KEY);
        (serve, client)
    };
    let (mut serve, mut client) = start();
    let custom_ids = ids("r", 1500);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut random = |below: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % below
    };
    struct Kill {
        held: bool,
        in_flight: u64,
        sent: std::collections::HashMap<String, u32>,
        committed: std::collections::HashSet<String>,
    }
    let mut kills = Vec::new();
    for round in 0..KILLS {
        let target = upstream.total_calls() + 3 + random(40);
        let deadline = Instant::now() + MINUTE;
        while upstream.total_calls() < target {
            assert!(Instant::now() < deadline, "round {round}: the batch made no progress");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The laws are about what was committed before a kill: the first kill waits for a
        // first commit, which a draw of 3 calls could come before.
        while round == 0 && common::committed::committed_custom_ids(&store, &[]).await.is_empty() {
            assert!(Instant::now() < deadline, "the batch committed nothing");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let held = round % 2 == 1;
        if held {
            upstream.hold();
            while upstream.in_flight() < CONCURRENCY {
                assert!(Instant::now() < deadline, "round {round}: the permits never all reached the upstream");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let (in_flight, total) = (upstream.in_flight(), upstream.total_calls());
        serve.kill();
        upstream.release();
        common::committed::settle(&upstream).await;
        // Requests that reached the upstream after the count had been sent before the kill.
        let in_flight = in_flight + (upstream.total_calls() - total);
        let committed = common::committed::committed_custom_ids(&store, &[]).await;
        kills.push(Kill { held, in_flight, sent: upstream.all_calls(), committed });
        (serve, client) = start();
    }
    let batch = client.wait_terminal(&id, 2 * MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 1500, "every line once");

    let end = upstream.all_calls();
    let (mut report, mut worst) = (Vec::new(), i64::MIN);
    for (k, kill) in kills.iter().enumerate() {
        let after = kills.get(k + 1).map_or(&end, |next| &next.sent);
        // Nothing committed at the kill is sent again, then or after a later kill.
        common::committed::check_kill_laws(&kill.sent, &kill.committed, after);
        for id in &kill.committed {
            assert_eq!(end.get(id), kill.sent.get(id), "{id} was committed at kill {k} and sent again later");
        }
        // Sent again after kill k: sent before it and again before the next one.
        let resent =
            kill.sent.iter().filter(|(id, calls)| after.get(*id).copied().unwrap_or(0) > **calls).count() as u64;
        assert!(resent <= CONCURRENCY, "kill {k}: {resent} lines sent again, more than the {CONCURRENCY} permits");
        if kill.held {
            assert_eq!(resent, kill.in_flight, "kill {k} (held): exactly the lines in flight are sent again");
        }
        worst = worst.max(resent as i64 - kill.in_flight as i64);
        report.push(format!("{}{resent}/{}", if kill.held { "h" } else { "" }, kill.in_flight));
    }
    eprintln!(
        "sent again / in flight at each kill (h: held): {}; worst excess over in flight: {worst}",
        report.join(" ")
    );
}

/// Two runs on one shard at once (as a pod the Job controller gave up on and its
/// replacement): a worker started by hand on serve's storage claims shard 0; serve's
/// run learns it at its next commit and stops, serve claims the shard back at its next
/// pass, and the hand-run worker learns it the same way and exits with an error. What
/// the shard's owner counts records each line exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn of_two_runs_on_one_shard_the_superseded_one_stops_and_its_later_commits_never_count() {
    // Shared S3, as two pods have (a data directory is locked by the process using it).
    let s3 = common::TestS3::start();
    let storage = s3.storage_yaml(&s3.endpoint, "");
    let upstream = MockUpstream::start().await;
    upstream.delay(Duration::from_millis(150));
    let data = TempDir::new().unwrap();
    let serve_config = write_config(
        data.path(),
        &format!(
            "{storage}upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 2\n    \
             timeout: 5s\nbatches:\n  shard_lines: 40\n  checkpoint_interval: 50ms\n  reconcile_interval: 100ms\n",
            upstream.base_url
        ),
    );
    let serve = Serve::start_configured(&serve_config);
    let client = Client::new(&serve.url, PROJECT, KEY);
    let custom_ids = ids("f", 40);
    let lines = input(&custom_ids, "mock-a");
    let file = client.upload(lines.clone()).await;
    let batch = client.create(&file).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    while upstream.total_calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // One shard of 40 lines: a run of it takes seconds, where taking it over takes a
    // commit and a pass (a fraction of one).
    let shard_end = lines.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(39).unwrap().0 + 1;
    let config = data.path().join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "{storage}upstreams:\n  - name: mock\n    base_url: {}\n    models: [\"mock-*\"]\n    max_concurrency: 2\n    \
             timeout: 5s\nbatches:\n  checkpoint_interval: 50ms\n",
            upstream.base_url
        ),
    )
    .unwrap();
    let worker = std::process::Command::new(env!("CARGO_BIN_EXE_nightshift"))
        .args(["worker", "--config", config.to_str().unwrap(), "--batch-id", &id, "--project-id", PROJECT])
        .args(["--input-file-id", &file, "--expires-at", &batch["expires_at"].to_string(), "--shard-index", "0"])
        .args(["--first-request", "0", "--requests", "40", "--byte-start", "0", "--byte-end", &shard_end.to_string()])
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let worker = tokio::task::spawn_blocking(move || worker.wait_with_output().unwrap());
    let worker = tokio::time::timeout(MINUTE, worker).await.expect("the superseded worker stops").unwrap();
    let stderr = String::from_utf8_lossy(&worker.stderr);
    assert!(!worker.status.success(), "a superseded run fails, so its Job does not complete: {stderr}");
    assert!(stderr.contains("a newer run claimed shard 0"), "{stderr}");

    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 40);
    let metrics = reqwest::get(&serve.metrics_url).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("nightshift_superseded_runs_total 1"), "serve's run of shard 0 was superseded once");

    let store = s3.store();
    let batch_id = nightshift::ids::BatchId::parse(&id).unwrap();
    let claims =
        nightshift::storage::ObjectStore::list(store.as_ref(), &nightshift::exec::layout::claims_prefix(&batch_id, 0))
            .await
            .unwrap();
    assert!(claims.len() >= 3, "serve, the worker, serve again: {claims:?}");
    common::committed::assert_counted_once(store.as_ref(), &batch_id, 0, 40).await;
}

/// A serve killed during an upload leaves a temp file: the next start removes it. And
/// one data directory has one serve: a second is refused instead of sharing it.
#[tokio::test]
async fn a_restart_removes_a_killed_uploads_temp_file_and_a_second_serve_is_refused() {
    let data = TempDir::new().unwrap();
    let dir = data.path().join("data");
    let serve = Serve::start(&dir, &[]);
    let orphan = dir.join(".tmp").join("01KILLEDUPLOAD");
    std::fs::write(&orphan, vec![0u8; 64 * 1024]).unwrap();

    let second = std::process::Command::new(env!("CARGO_BIN_EXE_nightshift"))
        .args(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("in use by another nightshift process"), "{stderr}");
    assert!(orphan.exists(), "the refused serve touched nothing");

    serve.kill();
    let _serve = Serve::start(&dir, &[]);
    assert!(!orphan.exists(), "the restart removed what the killed upload left");
}

/// A tmpfs mounted over a directory for one test (the suite runs as root), unmounted
/// when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("mount runs");
        assert!(status.success(), "mounting a tmpfs needs root, as the rest of the suite does");
        Self(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system of `dir` but for about `leave` bytes, with `dir/filler`.
fn fill_disk(dir: &std::path::Path, leave: usize) {
    use std::io::Write;
    let reserve = dir.join("reserve");
    std::fs::write(&reserve, vec![1u8; leave]).unwrap();
    let mut filler = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![1u8; 64 * 1024];
    while filler.write_all(&block).is_ok() {}
    let _ = filler.sync_all();
    std::fs::remove_file(reserve).unwrap();
}

/// A full disk while the output files are written: the batch stays `finalizing` with
/// the cause in `errors` (a `storage_error`), finalize is retried, and once space is free
/// the batch completes with every line and no error left on it.
#[tokio::test]
async fn a_full_disk_at_finalize_is_said_on_the_batch_and_retried_until_it_completes() {
    let upstream = MockUpstream::start().await;
    let data = TempDir::new().unwrap();
    let disk = Tmpfs::mount(&data.path().join("data"), "24m");
    let (_serve, client) = serve_with(&data, &upstream, 8, "", "");
    let mut custom_ids = ids("d", 3_000);
    // The last line hangs three times (a 1 s timeout each, within its 4 attempts), so the
    // disk is filled (tens of milliseconds) while it runs: a 3 s window.
    let last = "d-last".to_owned();
    upstream.script(&last, vec![Answer::Hang, Answer::Hang, Answer::Hang, Answer::Ok]);
    custom_ids.push(last);
    let batch = client.create(&client.upload(input(&custom_ids, "mock-a")).await).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    // 429 shards of 7 lines: about a minute on a loaded machine, so three are allowed.
    client.wait(&id, 3 * MINUTE, |b| b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 3_000).await;
    fill_disk(&disk.0, 256 * 1024);

    let stuck = client.wait(&id, MINUTE, |b| b["errors"].is_object()).await;
    assert_eq!(stuck["status"], "finalizing", "{stuck}");
    let error = &stuck["errors"]["data"][0];
    assert_eq!(error["code"], "storage_error", "{stuck}");
    assert!(error["message"].as_str().unwrap().contains("No space left on device"), "{stuck}");
    assert_eq!(stuck["output_file_id"], Value::Null);
    // Still retried, still stuck, while the disk is full.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client.batch(&id).await["status"], "finalizing");

    std::fs::remove_file(disk.0.join("filler")).unwrap();
    let batch = client.wait_terminal(&id, MINUTE).await;
    assert_eq!(batch["status"], "completed", "{batch}");
    assert_eq!(batch["errors"], Value::Null, "the note went with the failure: {batch}");
    let results = client.results(&batch, &custom_ids).await;
    assert_eq!(results.output.len(), 3_001);
}
