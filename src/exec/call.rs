//! One line's request upstream, with its retries: the only place that talks HTTP to
//! a model server.

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use serde_json::value::RawValue;

use super::backoff::{Backoff, parse_retry_after};
use super::failure::{ATTEMPTS, Attempt, LineFailure, Verdict, bad_upstream_body, exhausted, judge};
use super::reachability;
use super::recalls::GOING_FOR;
use super::upstream::Upstream;
use crate::batches::Usage;
use crate::concurrency::priority::with_priority;
use crate::metrics::METRICS;

/// What became of a line.
#[derive(Debug)]
pub enum LineOutcome {
    Success { status: u16, request_id: Option<String>, body: Box<RawValue>, usage: Usage },
    Failure(LineFailure),
}

/// The fields of a response's `usage` that batches add up: a chat completion's names,
/// or the Responses API's (`input_tokens`, `output_tokens` and their `_details`).
#[derive(serde::Deserialize, Default)]
struct TokenCounts {
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
    /// Details are read leniently: one of an unexpected shape counts 0, and never costs
    /// the line its token counts.
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<serde_json::Value>,
    #[serde(default, alias = "output_tokens_details")]
    completion_tokens_details: Option<serde_json::Value>,
}

fn detail(details: Option<&serde_json::Value>, name: &str) -> u64 {
    details.and_then(|d| d.get(name)).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

#[derive(serde::Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<TokenCounts>,
}

/// A 2xx answer: its body must be one JSON object, kept byte for byte; its `usage`
/// is read on the way (one validating pass, one targeted one, no tree built).
pub(super) fn success(status: u16, request_id: Option<String>, bytes: &[u8]) -> LineOutcome {
    let Ok(text) = std::str::from_utf8(bytes) else { return LineOutcome::Failure(bad_upstream_body(status)) };
    let text = text.trim();
    if !text.starts_with('{') {
        return LineOutcome::Failure(bad_upstream_body(status));
    }
    let Ok(body) = serde_json::from_str::<Box<RawValue>>(text) else {
        return LineOutcome::Failure(bad_upstream_body(status));
    };
    let counts = serde_json::from_str::<UsageOnly>(text).ok().and_then(|u| u.usage).unwrap_or_default();
    let total = match counts.total_tokens {
        0 => counts.prompt_tokens + counts.completion_tokens,
        total => total,
    };
    let usage = Usage {
        input_tokens: counts.prompt_tokens,
        output_tokens: counts.completion_tokens,
        total_tokens: total,
        cached_tokens: detail(counts.prompt_tokens_details.as_ref(), "cached_tokens"),
        reasoning_tokens: detail(counts.completion_tokens_details.as_ref(), "reasoning_tokens"),
    };
    LineOutcome::Success { status, request_id, body, usage }
}

/// Sends `body` to `upstream`, with the batch's `priority` (else the upstream's),
/// retrying 429s, 5xx, timeouts and connection errors up to [`ATTEMPTS`] attempts in
/// all; counts what became of it for the adaptive limit. `None`: the request was taken
/// back from the server's queue ([`super::recalls`]), and the line is to be sent again.
pub async fn call_upstream(
    client: &reqwest::Client,
    upstream: &Upstream,
    endpoint: &str,
    body: Bytes,
    priority: Option<i64>,
) -> Option<LineOutcome> {
    let body = match priority.or(upstream.priority) {
        Some(priority) => with_priority(&body, priority),
        None => body,
    };
    let outcome = attempts(client, upstream, endpoint, body).await?;
    let tokens = match &outcome {
        LineOutcome::Success { usage, .. } => usage.output_tokens,
        LineOutcome::Failure(_) => 0,
    };
    upstream.observed.finished(tokens);
    Some(outcome)
}

async fn attempts(client: &reqwest::Client, upstream: &Upstream, endpoint: &str, body: Bytes) -> Option<LineOutcome> {
    let url = upstream.url_for(endpoint);
    let mut last = Attempt::Transport("no attempt made".into());
    for attempt in 1..=ATTEMPTS {
        let mut retry_after = None;
        if attempt > 1 {
            METRICS.upstream_retry(&upstream.name);
        }
        let Sent { sent, started, load_at_send } = send(client, upstream, url, &body).await?;
        match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                let remote = response.remote_addr();
                if status == 429 || status == 503 {
                    upstream.observed.overloaded();
                }
                let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
                let request_id = header("x-request-id");
                retry_after = header("retry-after").and_then(|v| parse_retry_after(&v, SystemTime::now()));
                let bytes = match response.bytes().await {
                    Ok(bytes) => bytes,
                    Err(error) => {
                        last = Attempt::Transport(describe(upstream, &error));
                        pause(upstream.backoff, attempt, None).await;
                        continue;
                    }
                };
                match judge(status, &bytes) {
                    Verdict::Success => {
                        let outcome = success(status, request_id, &bytes);
                        if let LineOutcome::Success { usage, .. } = &outcome {
                            upstream.observed.answered(usage.output_tokens, started.elapsed(), load_at_send);
                        }
                        return Some(outcome);
                    }
                    Verdict::Fail(failure) => {
                        upstream.log_rejection(status, remote, &failure.message);
                        return Some(LineOutcome::Failure(failure));
                    }
                    Verdict::Retry => last = Attempt::Status { status, body: bytes.to_vec() },
                }
            }
            Err(error) => {
                if error.is_timeout() {
                    upstream.observed.overloaded();
                }
                last = Attempt::Transport(describe(upstream, &error));
            }
        }
        pause(upstream.backoff, attempt, retry_after).await;
    }
    Some(LineOutcome::Failure(exhausted(&last)))
}

/// One attempt's request as sent, when it started and the upstream's load then.
struct Sent {
    sent: Result<reqwest::Response, reqwest::Error>,
    started: Instant,
    load_at_send: u64,
}

/// One attempt: the request, sent again while its upstream refuses connections within
/// its patience ([`Reachability`](super::reachability::Reachability)); only the last
/// try's time is the upstream's latency. `None`: taken back before an answer came; it
/// hangs up at once, and counts as at the upstream for [`GOING_FOR`] more.
async fn send(client: &reqwest::Client, upstream: &Upstream, url: &reqwest::Url, body: &Bytes) -> Option<Sent> {
    let mut refusals = 0;
    loop {
        let request = post(client, upstream, url.clone(), body.clone());
        let started = Instant::now();
        let load_at_send = upstream.observed.load();
        let at_upstream = upstream.observed.sending();
        let ticket = upstream.recalls.enter();
        // The request is dropped (it hangs up) before the wait below, not after it.
        let sent = tokio::select! {
            biased;
            sent = request.send() => Some(sent),
            () = ticket.taken_back() => None,
        };
        drop(ticket);
        let Some(sent) = sent else {
            METRICS.line_taken_back(&upstream.name);
            tokio::time::sleep(GOING_FOR).await;
            drop(at_upstream);
            return None;
        };
        drop(at_upstream);
        let counts = match &sent {
            Err(error) if error.is_connect() && !error.is_timeout() => {
                upstream.reachability.refused(&upstream.name, Instant::now())
            }
            _ => {
                upstream.reachability.reached(&upstream.name);
                true
            }
        };
        if counts {
            upstream.latency.observe(started.elapsed().as_secs_f64());
            return Some(Sent { sent, started, load_at_send });
        }
        refusals += 1;
        METRICS.upstream_refused(&upstream.name);
        tokio::time::sleep(reachability::pause(upstream.backoff, refusals, rand::random::<f64>())).await;
    }
}

/// One attempt's request: the line's body, the upstream's key and timeout.
fn post(client: &reqwest::Client, upstream: &Upstream, url: reqwest::Url, body: Bytes) -> reqwest::RequestBuilder {
    let request = client.post(url).timeout(upstream.timeout).header("content-type", "application/json").body(body);
    match &upstream.api_key {
        Some(key) => request.bearer_auth(key),
        None => request,
    }
}

async fn pause(backoff: Backoff, attempt: u32, retry_after: Option<Duration>) {
    if attempt < ATTEMPTS {
        tokio::time::sleep(backoff.delay(attempt, retry_after, rand::random::<f64>())).await;
    }
}

/// A transport failure in words that name the upstream but not its address.
fn describe(upstream: &Upstream, error: &reqwest::Error) -> String {
    let what = if error.is_timeout() {
        format!("timed out after {}s", upstream.timeout.as_secs_f64())
    } else if error.is_connect() {
        "could not connect".to_owned()
    } else {
        "connection failed".to_owned()
    };
    format!("upstream {} {what}", upstream.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_hundreds_that_are_not_json_objects_fail_the_line() {
        assert!(matches!(success(200, None, b"[1,2]"), LineOutcome::Failure(_)));
        assert!(matches!(success(200, None, b"<html>"), LineOutcome::Failure(_)));
        assert!(matches!(success(200, None, b"{\"usage\":{\"total_tokens\":3}}"), LineOutcome::Success { .. }));
    }

    fn usage_of(body: &str) -> Usage {
        let LineOutcome::Success { usage, .. } = success(200, None, body.as_bytes()) else { panic!("{body}") };
        usage
    }

    #[test]
    fn usage_details_are_read_in_either_api_shape() {
        let chat = r#"{"usage":{"prompt_tokens":10,"completion_tokens":7,"total_tokens":17,
            "prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0},
            "completion_tokens_details":{"reasoning_tokens":5,"accepted_prediction_tokens":0}}}"#;
        let expected =
            Usage { input_tokens: 10, output_tokens: 7, total_tokens: 17, cached_tokens: 4, reasoning_tokens: 5 };
        assert_eq!(usage_of(chat), expected);
        let responses = r#"{"usage":{"input_tokens":10,"output_tokens":7,"total_tokens":17,
            "input_tokens_details":{"cached_tokens":4},"output_tokens_details":{"reasoning_tokens":5}}}"#;
        assert_eq!(usage_of(responses), expected);
        // Details absent or null (vLLM sends null): zero.
        let plain = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1,"prompt_tokens_details":null}}"#;
        assert_eq!(usage_of(plain), Usage { input_tokens: 1, output_tokens: 1, total_tokens: 2, ..Usage::default() });
        let odd = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1,"prompt_tokens_details":3,
            "completion_tokens_details":{"reasoning_tokens":"many"}}}"#;
        assert_eq!(usage_of(odd).total_tokens, 2, "odd details cost nothing else");
    }
}
