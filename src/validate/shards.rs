//! The shard plan: consecutive runs of requests, each with the byte range that holds
//! them, so that a worker reads only its own part of the input.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Shard {
    pub index: u32,
    /// 0-based ordinal of the shard's first request among all requests of the file.
    pub first_request: u64,
    pub requests: u64,
    /// `[byte_start, byte_end)` of the input file: from the first request's line to
    /// the end of the last one's (newline included).
    pub byte_start: u64,
    pub byte_end: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShardPlan {
    pub shard_lines: u32,
    pub shards: Vec<Shard>,
}

#[cfg(test)]
impl ShardPlan {
    /// Shards of these many requests each, one after the other (tests: no bytes behind them).
    pub(crate) fn of_sizes(sizes: &[u64]) -> Self {
        let mut first = 0;
        let shards = sizes
            .iter()
            .enumerate()
            .map(|(index, &requests)| {
                let shard = Shard { index: index as u32, first_request: first, requests, byte_start: 0, byte_end: 0 };
                first += requests;
                shard
            })
            .collect();
        Self { shard_lines: 10, shards }
    }
}

pub(super) struct ShardPlanner {
    plan: ShardPlan,
    requests: u64,
}

impl ShardPlanner {
    pub fn new(shard_lines: u32) -> Self {
        Self { plan: ShardPlan { shard_lines, shards: Vec::new() }, requests: 0 }
    }

    /// Adds the request whose line spans `[start, end)`.
    pub fn add(&mut self, start: u64, end: u64) {
        let full = self.plan.shards.last().is_none_or(|shard| shard.requests == u64::from(self.plan.shard_lines));
        if full {
            let index = self.plan.shards.len() as u32;
            self.plan.shards.push(Shard {
                index,
                first_request: self.requests,
                requests: 0,
                byte_start: start,
                byte_end: end,
            });
        }
        let shard = self.plan.shards.last_mut().expect("a shard was just ensured");
        shard.requests += 1;
        shard.byte_end = end;
        self.requests += 1;
    }

    pub fn finish(self) -> ShardPlan {
        self.plan
    }
}
