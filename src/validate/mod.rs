//! Batch input validation: one streaming pass over the JSONL that applies every rule
//! of the spec, counts the requests and plans the shards. Pure: bytes in, a verdict
//! out; no I/O, so it is unit-tested row by row and fuzzed.
//!
//! Feed the file in chunks of any size with [`Validator::feed`], then call
//! [`Validator::finish`]. Memory is bounded by the longest line (at most 1 MiB) plus
//! the set of custom ids seen.

mod line;
mod rules;
mod shards;

pub use rules::{
    BATCHABLE_URLS, Endpoints, InvalidInput, MAX_FILE_BYTES, MAX_LINE_BYTES, MAX_LINES, endpoint_mismatch,
    file_too_large,
};
pub use shards::{Shard, ShardPlan};

use line::{Body, LineFacts, Text};
use rules::CustomIds;
use shards::ShardPlanner;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// What a valid input file turned out to hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidInput {
    /// Non-blank lines: the batch's `request_counts.total`.
    pub requests: u64,
    /// The url shared by every line.
    pub url: String,
    /// The `body.model` shared by every line, if they all name the same one.
    pub model: Option<String>,
    pub shards: ShardPlan,
}

/// The models the lines named so far.
#[derive(Debug, Default)]
enum Models {
    #[default]
    None,
    One(String),
    /// Lines differ, or one names none.
    Mixed,
}

impl Models {
    fn add(&mut self, model: &Text<'_>) {
        *self = match (std::mem::take(self), model) {
            (Self::None, Text::Value(model)) => Self::One(model.clone().into_owned()),
            (Self::One(seen), Text::Value(model)) if seen == *model => Self::One(seen),
            _ => Self::Mixed,
        };
    }

    fn single(self) -> Option<String> {
        match self {
            Self::One(model) => Some(model),
            Self::None | Self::Mixed => None,
        }
    }
}

pub struct Validator {
    endpoint: String,
    allowed: Endpoints,
    /// The unfinished line carried between chunks.
    pending: Vec<u8>,
    /// Bytes consumed before `pending` starts.
    offset: u64,
    /// 1-based number of the line being read (blank lines count, as in an editor).
    line_number: u64,
    requests: u64,
    url: Option<String>,
    models: Models,
    custom_ids: CustomIds,
    planner: ShardPlanner,
    failed: Option<InvalidInput>,
}

impl Validator {
    /// A validator for a batch created with this `endpoint`, cutting shards of
    /// `shard_lines` requests.
    pub fn new(endpoint: &str, shard_lines: u32) -> Self {
        Self::with_endpoints(endpoint, shard_lines, Endpoints::default())
    }

    /// As [`Validator::new`], with other endpoints enabled (`batches.endpoints`).
    pub fn with_endpoints(endpoint: &str, shard_lines: u32, allowed: Endpoints) -> Self {
        Self {
            endpoint: endpoint.to_owned(),
            allowed,
            pending: Vec::new(),
            offset: 0,
            line_number: 0,
            requests: 0,
            url: None,
            models: Models::default(),
            custom_ids: CustomIds::default(),
            planner: ShardPlanner::new(shard_lines.max(1)),
            failed: None,
        }
    }

    /// Consumes the next chunk. Returns the first error, after which the rest of the
    /// input needs no reading.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), InvalidInput> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        while !chunk.is_empty() {
            match memchr::memchr(b'\n', chunk) {
                Some(newline) => {
                    let (head, rest) = (&chunk[..newline], &chunk[newline + 1..]);
                    let consumed = (self.pending.len() + head.len() + 1) as u64;
                    let result = if self.pending.is_empty() {
                        self.check_line(head, self.offset, self.offset + consumed)
                    } else {
                        self.append_pending(head)?;
                        let mut line = std::mem::take(&mut self.pending);
                        let result = self.check_line(&line, self.offset, self.offset + consumed);
                        line.clear();
                        self.pending = line;
                        result
                    };
                    self.offset += consumed;
                    self.remember(result)?;
                    chunk = rest;
                }
                None => {
                    self.append_pending(chunk)?;
                    break;
                }
            }
        }
        Ok(())
    }

    /// Ends the input: checks the last line (which needs no newline) and the file as a whole.
    pub fn finish(mut self) -> Result<ValidInput, InvalidInput> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            let end = self.offset + line.len() as u64;
            let result = self.check_line(&line, self.offset, end);
            self.remember(result)?;
        }
        if self.requests == 0 {
            return Err(InvalidInput::no_lines());
        }
        let url = self.url.take().unwrap_or_default();
        let model = std::mem::take(&mut self.models).single();
        Ok(ValidInput { requests: self.requests, url, model, shards: self.planner.finish() })
    }

    fn remember(&mut self, result: Result<(), InvalidInput>) -> Result<(), InvalidInput> {
        if let Err(error) = &result {
            self.failed = Some(error.clone());
        }
        result
    }

    fn append_pending(&mut self, bytes: &[u8]) -> Result<(), InvalidInput> {
        // One byte over the limit may be the CR of a CRLF ending: `check_line` decides.
        if self.pending.len() + bytes.len() > MAX_LINE_BYTES + 1 {
            // Too long already: no need to see its end, nor to keep it.
            self.pending = Vec::new();
            let error = InvalidInput::line_too_long(self.line_number + 1);
            self.failed = Some(error.clone());
            return Err(error);
        }
        self.pending.extend_from_slice(bytes);
        Ok(())
    }

    /// Applies every per-line rule, in the order of the spec's table.
    fn check_line(&mut self, line: &[u8], start: u64, end: u64) -> Result<(), InvalidInput> {
        self.line_number += 1;
        let n = self.line_number;
        // A UTF-8 byte order mark opening the file is not content: the line, and the
        // first shard's byte range (so workers never read it), start after it.
        let (line, start) = match line.strip_prefix(UTF8_BOM) {
            Some(rest) if start == 0 => (rest, UTF8_BOM.len() as u64),
            _ => (line, start),
        };
        // The size limit is on the content: a CRLF ending's CR is not counted.
        if line.strip_suffix(b"\r").unwrap_or(line).len() > MAX_LINE_BYTES {
            return Err(InvalidInput::line_too_long(n));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        if self.requests == MAX_LINES {
            return Err(InvalidInput::too_many_lines());
        }
        let facts = LineFacts::read(line).map_err(|shape| InvalidInput::bad_line(n, shape))?;
        rules::check(&facts, n, &mut self.custom_ids, &mut self.url, &self.endpoint, self.allowed)?;
        match &facts.body {
            Body::Object { model, .. } => self.models.add(model),
            _ => self.models.add(&Text::Missing),
        }
        self.planner.add(start, end);
        self.requests += 1;
        Ok(())
    }
}

/// Validates a whole input held in memory (tests, small inputs).
pub fn validate(input: &[u8], endpoint: &str, shard_lines: u32) -> Result<ValidInput, InvalidInput> {
    let mut validator = Validator::new(endpoint, shard_lines);
    validator.feed(input)?;
    validator.finish()
}

#[cfg(test)]
mod tests;
