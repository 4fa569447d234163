//! What workers had committed at an instant, read from storage as finalize reads it:
//! the checkpoints and the chunks they make durable. The laws of a kill are checked
//! against it rather than against timing: a line committed before the kill is never
//! sent again, and a line sent again had been sent, uncommitted, when the kill came.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use nightshift::exec::checkpoint::CheckpointReader;
use nightshift::exec::layout::{ChunkKind, chunk_location};
use nightshift::ids::BatchId;
use nightshift::storage::ObjectStore;
use serde_json::Value;

use super::upstream::MockUpstream;

/// Waits until the upstream has seen every request a killed process sent (requests
/// already in its sockets are read, and counted, after the kill). Read what was committed
/// next, and the upstream's calls last: a line committed was sent before, so whatever
/// other worker still runs, every committed line is in the calls.
pub async fn settle(upstream: &MockUpstream) {
    for _ in 0..100 {
        if upstream.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// The custom_ids of every committed record of every batch in `store` but `except`
/// (counted or not by the shard's owner: a record committed by any run).
pub async fn committed_custom_ids(store: &dyn ObjectStore, except: &[&str]) -> HashSet<String> {
    let mut shards = std::collections::BTreeSet::new();
    for key in store.list("batches/").await.unwrap() {
        // batches/<batch id>/shard-<index>/...
        let parts: Vec<&str> = key.as_str().split('/').collect();
        if parts.len() >= 4 && parts[2].starts_with("shard-") && !except.contains(&parts[1]) {
            shards.insert((parts[1].to_owned(), parts[2].strip_prefix("shard-").unwrap().parse::<u32>().unwrap()));
        }
    }
    let reader = CheckpointReader::default();
    let mut ids = HashSet::new();
    for (batch, shard) in shards {
        let batch = BatchId::parse(&batch).unwrap();
        let (_, checkpoints) = reader.checkpoints(store, &batch, shard).await.unwrap();
        for checkpoint in checkpoints {
            for (kind, records) in [(ChunkKind::Out, &checkpoint.out), (ChunkKind::Err, &checkpoint.err)] {
                if records.is_empty() {
                    continue;
                }
                let (key, range) = chunk_location(&batch, shard, &checkpoint, kind);
                let mut stream = store.read(&key, range).await.unwrap();
                let mut chunk = Vec::new();
                while let Some(bytes) = futures_util::StreamExt::next(&mut stream).await {
                    chunk.extend_from_slice(&bytes.unwrap());
                }
                for line in chunk.split(|&b| b == b'\n').filter(|line| !line.is_empty()) {
                    let record: Value = serde_json::from_slice(line).unwrap();
                    ids.insert(record["custom_id"].as_str().unwrap().to_owned());
                }
            }
        }
    }
    ids
}

/// Checks that what a shard's owner counts (its newest claim's checkpoints and those it
/// adopted) records each of the shard's `requests` exactly once.
pub async fn assert_counted_once(store: &dyn ObjectStore, batch: &BatchId, shard: u32, requests: u32) {
    let ledger = CheckpointReader::default().ledger(store, batch, shard, u64::from(requests)).await.unwrap();
    let mut counted: Vec<u32> = ledger.checkpoints.iter().flat_map(|c| c.out.iter().chain(&c.err).copied()).collect();
    counted.sort();
    assert_eq!(counted, (0..requests).collect::<Vec<_>>(), "each line of shard {shard} recorded once in what counts");
}

/// Checks the laws of a kill, given the calls per custom_id when the killed process
/// was gone (`sent_at_kill`), what was committed then, and the calls once the batch
/// finished; returns the lines sent again.
pub fn check_kill_laws(
    sent_at_kill: &HashMap<String, u32>,
    committed: &HashSet<String>,
    calls_at_end: &HashMap<String, u32>,
) -> Vec<String> {
    assert!(!committed.is_empty(), "the kill came after a first commit");
    let mut resent = Vec::new();
    for (id, &calls) in calls_at_end {
        let before = sent_at_kill.get(id).copied().unwrap_or(0);
        if committed.contains(id) {
            assert_eq!(calls, before, "{id} was committed before the kill and was sent again");
        } else if calls > 1 {
            assert!(before > 0, "{id} was sent {calls} times but not before the kill");
            resent.push(id.clone());
        }
    }
    resent.sort();
    resent
}
