//! A run's journal, where storage can write in place (a local directory): one file per
//! worker run, `journal-<writer>.jsonl` under the shard's prefix, that every commit
//! extends by one frame: a header line (the commit's [`Checkpoint`], with the byte
//! counts of its records) followed by its output records, then its error records.
//!
//! A commit is then one write at the journal's end, not two new objects: creating files
//! is what a commit per finished line would spend its time on. A frame counts once it
//! is whole; a reader that finds a partial frame at the end (a commit being written, or
//! cut by a crash) stops there, and a header it cannot read ends the journal.

use std::sync::Arc;

use super::layout::Checkpoint;

/// A frame: `checkpoint`'s header line, then `out` and `err` as they are.
pub fn encode(checkpoint: &Checkpoint, out: &[u8], err: &[u8]) -> Vec<u8> {
    let header =
        Checkpoint { out_bytes: Some(out.len() as u64), err_bytes: Some(err.len() as u64), ..checkpoint.clone() };
    let mut frame = serde_json::to_vec(&header).expect("checkpoints serialize");
    frame.push(b'\n');
    frame.reserve(out.len() + err.len());
    frame.extend_from_slice(out);
    frame.extend_from_slice(err);
    frame
}

/// What a read of a journal from `at` found.
#[derive(Clone, Debug, Default)]
pub struct Decoded {
    /// The whole frames' checkpoints, each knowing where its records are.
    pub checkpoints: Vec<Arc<Checkpoint>>,
    /// Bytes of whole frames: the next read starts at `at + consumed`.
    pub consumed: u64,
    /// A header could not be read: nothing after it counts, ever.
    pub broken: bool,
}

/// The whole frames in `bytes`, read from offset `at` of a journal.
pub fn decode(bytes: &[u8], at: u64) -> Decoded {
    let mut decoded = Decoded::default();
    let mut rest = bytes;
    while let Some(newline) = memchr::memchr(b'\n', rest) {
        let Ok(mut checkpoint) = serde_json::from_slice::<Checkpoint>(&rest[..newline]) else {
            decoded.broken = true;
            break;
        };
        let records = checkpoint.out_bytes.unwrap_or(0) + checkpoint.err_bytes.unwrap_or(0);
        let frame = newline as u64 + 1 + records;
        if (rest.len() as u64) < frame {
            break;
        }
        checkpoint.journal_at = Some(at + decoded.consumed + newline as u64 + 1);
        decoded.checkpoints.push(Arc::new(checkpoint));
        decoded.consumed += frame;
        rest = &rest[frame as usize..];
    }
    decoded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::Usage;

    fn checkpoint(seq: u32, out: Vec<u32>, err: Vec<u32>) -> Checkpoint {
        Checkpoint { seq, writer: "w".into(), out, err, usage: Usage::default(), ..Checkpoint::default() }
    }

    #[test]
    fn frames_decode_whole_and_stop_at_a_partial_or_broken_one() {
        let first = encode(&checkpoint(0, vec![0, 1], vec![]), b"{\"a\":0}\n{\"a\":1}\n", b"");
        let second = encode(&checkpoint(1, vec![], vec![2]), b"", b"{\"e\":2}\n");
        let journal = [first.clone(), second.clone()].concat();

        let whole = decode(&journal, 100);
        assert_eq!(whole.checkpoints.len(), 2);
        assert_eq!(whole.consumed, journal.len() as u64);
        let header = first.iter().position(|&b| b == b'\n').unwrap() as u64 + 1;
        assert_eq!(whole.checkpoints[0].journal_at, Some(100 + header), "records follow their header");
        assert_eq!(whole.checkpoints[1].err_bytes, Some(8));
        assert!(!whole.broken);

        for cut in [first.len() + 3, journal.len() - 1] {
            let partial = decode(&journal[..cut], 0);
            assert_eq!(partial.checkpoints.len(), 1, "a frame cut at {cut} waits");
            assert_eq!(partial.consumed, first.len() as u64);
            assert!(!partial.broken);
        }
        let broken = decode(&[&first[..], b"garbage\n", &second[..]].concat(), 0);
        assert_eq!(broken.checkpoints.len(), 1);
        assert!(broken.broken, "an unreadable header ends the journal");
    }
}
