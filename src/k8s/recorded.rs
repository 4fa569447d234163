//! What each unfinished batch's checkpoints held at the controller's last pass over it,
//! so that each pass counts into the line and token metrics only what is new.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use crate::batches::Batch;
use crate::exec::checkpoint::ShardLedger;
use crate::exec::failure::known_code;
use crate::metrics::METRICS;

/// Lines and tokens of a batch's checkpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Recorded {
    completed: u64,
    codes: BTreeMap<String, u64>,
    tokens: u64,
}

impl Recorded {
    fn of(ledgers: &[ShardLedger]) -> Self {
        let mut recorded = Self::default();
        for ledger in ledgers {
            recorded.completed += ledger.completed;
            recorded.tokens += ledger.usage.total_tokens;
            for (code, count) in &ledger.codes {
                *recorded.codes.entry(code.clone()).or_default() += count;
            }
        }
        recorded
    }

    /// What is new since `before`: completed lines, failed ones by code, tokens.
    fn since(&self, before: &Recorded) -> (u64, Vec<(&str, u64)>, u64) {
        let failed = self
            .codes
            .iter()
            .map(|(code, count)| (code.as_str(), count.saturating_sub(before.codes.get(code).copied().unwrap_or(0))))
            .filter(|(_, count)| *count > 0)
            .collect();
        (self.completed.saturating_sub(before.completed), failed, self.tokens.saturating_sub(before.tokens))
    }
}

/// What each unfinished batch's checkpoints held at its last pass, by batch id.
#[derive(Default)]
pub struct RecordedMarks(Mutex<HashMap<String, Recorded>>);

impl RecordedMarks {
    /// Counts into the metrics what a pass finds beyond the last one. A batch seen for
    /// the first time by this process only sets the mark: its earlier lines were counted
    /// by the controller that led then.
    pub fn count(&self, batch: &Batch, ledgers: &[ShardLedger]) {
        let now = Recorded::of(ledgers);
        let before = self.0.lock().expect("recorded").insert(batch.spec.id.to_string(), now.clone());
        if let Some(before) = before {
            let (completed, failed, tokens) = now.since(&before);
            // Codes are the spec's fixed vocabulary; an unknown one is counted as such.
            let failed: Vec<(&'static str, u64)> =
                failed.into_iter().map(|(code, count)| (known_code(code).unwrap_or("unknown"), count)).collect();
            METRICS.recorded(completed, &failed, batch.spec.project_id.as_str(), tokens);
        }
    }

    /// Forgets the batches that are not in `unfinished`.
    pub fn keep_only(&self, unfinished: &HashSet<String>) {
        self.0.lock().expect("recorded").retain(|id, _| unfinished.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_pass_finds_beyond_the_last_is_counted_once() {
        let before = Recorded { completed: 3, codes: [("server_error".to_owned(), 1)].into(), tokens: 30 };
        let now = Recorded {
            completed: 5,
            codes: [("server_error".to_owned(), 1), ("rate_limit_exceeded".to_owned(), 2)].into(),
            tokens: 50,
        };
        assert_eq!(now.since(&before), (2, vec![("rate_limit_exceeded", 2)], 20));
        assert_eq!(now.since(&now), (0, vec![], 0), "nothing new, nothing counted");
    }
}
