//! Fencing: one owner per shard at a time, so that a superseded worker (a pod the Job
//! controller gave up on while its node was unreachable) stops, and nothing it commits
//! after it was superseded is ever read.
//!
//! Before it sends anything, a worker run claims its shard: it writes
//! `owners/<epoch>-<writer>.json` under the shard's prefix, with an epoch one above the
//! newest it saw and the checkpoints it counted (per writer, the highest `seq`: what it
//! *adopts*). The newest claim (highest epoch, then writer id) owns the shard. What a
//! shard has recorded is what its owner says: the owner's own checkpoints and those it
//! adopted; the rest is never read. A run checks that it still owns the shard at every
//! commit, while its chunk is being written, and writes the checkpoint only if it does,
//! so a superseded run learns it at its next commit at the latest, and stops.
//!
//! No conditional write is needed: two runs claiming at once with the same epoch are
//! ordered by writer id, and the loser's commits count for nothing because the winner
//! did not adopt them. A checkpoint the owner has not adopted is at worst work done
//! twice, never a record read twice.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::layout::Checkpoint;
use crate::storage::Key;

/// A run's claim on a shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub epoch: u32,
    pub writer: String,
    /// Per writer, the highest checkpoint `seq` this run counted when it claimed.
    pub adopted: BTreeMap<String, u32>,
}

impl Claim {
    /// The claim a run makes over what a ledger counted: the next epoch, everything adopted.
    pub fn over(newest_epoch: Option<u32>, writer: &str, counted: &[Arc<Checkpoint>]) -> Self {
        let mut adopted = BTreeMap::new();
        for checkpoint in counted {
            let seq = adopted.entry(checkpoint.writer.clone()).or_insert(checkpoint.seq);
            *seq = (*seq).max(checkpoint.seq);
        }
        Self { epoch: newest_epoch.map_or(1, |epoch| epoch + 1), writer: writer.to_owned(), adopted }
    }

    /// Whether a checkpoint counts under this owner.
    pub fn counts(&self, checkpoint: &Checkpoint) -> bool {
        checkpoint.writer == self.writer
            || self.adopted.get(&checkpoint.writer).is_some_and(|&seq| checkpoint.seq <= seq)
    }
}

/// A claim's place in the order of claims, read off its key alone.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimName {
    pub epoch: u32,
    pub writer: String,
}

impl ClaimName {
    pub fn parse(key: &Key) -> Option<Self> {
        let name = key.as_str().rsplit('/').next()?.strip_suffix(".json")?;
        let (epoch, writer) = name.split_once('-')?;
        Some(Self { epoch: epoch.parse().ok()?, writer: writer.to_owned() })
    }
}

/// The newest of the claims under a shard's prefix.
pub fn newest(keys: &[Key]) -> Option<(ClaimName, &Key)> {
    keys.iter().filter_map(|key| ClaimName::parse(key).map(|name| (name, key))).max_by(|a, b| a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::layout::claim_key;
    use crate::ids::BatchId;

    fn checkpoint(writer: &str, seq: u32) -> Arc<Checkpoint> {
        Arc::new(Checkpoint { seq, writer: writer.into(), ..Checkpoint::default() })
    }

    #[test]
    fn a_claim_adopts_the_highest_seq_of_each_writer_and_counts_nothing_later() {
        let counted = [checkpoint("a", 0), checkpoint("a", 1), checkpoint("b", 2)];
        let claim = Claim::over(Some(4), "c", &counted);
        assert_eq!(claim.epoch, 5);
        assert_eq!(claim.adopted, [("a".to_owned(), 1), ("b".to_owned(), 2)].into());
        let table = [
            (checkpoint("a", 1), true, "adopted"),
            (checkpoint("a", 3), false, "a's commit after the claim"),
            (checkpoint("b", 2), true, "adopted"),
            (checkpoint("d", 0), false, "a writer the owner never saw (a raced claim)"),
            (checkpoint("c", 7), true, "the owner's own"),
        ];
        for (checkpoint, counts, why) in table {
            assert_eq!(claim.counts(&checkpoint), counts, "{why}");
        }
        assert_eq!(Claim::over(None, "x", &[]).epoch, 1, "the first claim");
    }

    #[test]
    fn the_newest_claim_is_the_highest_epoch_then_the_highest_writer() {
        let batch = BatchId::parse("batch_01HZX").unwrap();
        let keys = [claim_key(&batch, 3, 2, "b"), claim_key(&batch, 3, 10, "a"), claim_key(&batch, 3, 10, "c")];
        let (name, key) = newest(&keys).unwrap();
        assert_eq!((name.epoch, name.writer.as_str()), (10, "c"), "epochs compare as numbers; ties by writer");
        assert_eq!(key, &keys[2]);
        assert!(key.as_str().starts_with("batches/batch_01HZX/shard-00003/owners/"));
        let garbage = Key::parse("batches/batch_01HZX/shard-00003/owners/x.json").unwrap();
        assert!(newest(&[garbage]).is_none(), "a name that is no claim is ignored");
    }
}
