//! The built-in `echo` model: answers at once, in the response shape of the batch's
//! endpoint, with the text it was given, counting words as tokens. It lets Nightshift
//! run offline, and tests run every endpoint without a model server.

use serde_json::{Value, json};
use sha2::Digest;

use super::call::{LineOutcome, success};

/// The text of a prompt, an input or a message's content: a string, or the texts of an
/// array's items (strings, or parts with `text` or `content`), joined by spaces.
fn text_of(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Object(part) => {
                    part.get("text").or_else(|| part.get("content")).map(text_of).unwrap_or_default()
                }
                other => text_of(other),
            })
            .filter(|text| !text.is_empty())
            .collect::<Vec<_>>()
            .join(" "),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

/// The last user message's text, and the words of all messages.
fn last_user_message(messages: &[Value]) -> (String, usize) {
    let content = |message: &Value| message.get("content").map(text_of).unwrap_or_default();
    let reply = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(content)
        .unwrap_or_default();
    (reply, messages.iter().map(|m| words(&content(m))).sum())
}

/// The items of an `input` that may be one value or an array of them.
fn items(input: Option<&Value>) -> Vec<Value> {
    match input {
        Some(Value::Array(items)) if !items.is_empty() && !items[0].is_number() => items.clone(),
        Some(value) => vec![value.clone()],
        None => Vec::new(),
    }
}

/// A small, deterministic vector for a text: the same text, the same embedding.
fn embedding(text: &str) -> Vec<f64> {
    let digest: [u8; 32] = sha2::Sha256::digest(text.as_bytes()).into();
    digest.chunks(4).map(|bytes| f64::from(bytes[0]) / 255.0 - 0.5).collect()
}

/// An embeddings answer: a vector per input, the same for the same text.
fn embeddings(request: &Value, model: Value) -> Value {
    let inputs = items(request.get("input"));
    let tokens: usize = inputs.iter().map(|input| words(&text_of(input))).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| json!({"object": "embedding", "index": index, "embedding": embedding(&text_of(input))}))
        .collect();
    json!({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
}

pub fn echo(endpoint: &str, body: &[u8]) -> LineOutcome {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let model = request.get("model").cloned().unwrap_or(Value::Null);
    let id = crate::ids::RequestId::generate();
    let suffix = &id.as_str()[4..];
    let now = crate::clock::now();
    let response = match endpoint {
        "/v1/embeddings" => embeddings(&request, model),
        "/v1/completions" => {
            let prompt = request.get("prompt").map(text_of).unwrap_or_default();
            let tokens = words(&prompt);
            json!({"id": format!("cmpl-{suffix}"), "object": "text_completion", "created": now, "model": model,
                   "choices": [{"text": prompt, "index": 0, "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": tokens, "completion_tokens": tokens, "total_tokens": 2 * tokens}})
        }
        "/v1/responses" => {
            let (reply, input_tokens) = match request.get("input") {
                Some(Value::Array(messages)) => last_user_message(messages),
                Some(other) => (text_of(other), words(&text_of(other))),
                None => (String::new(), 0),
            };
            let output_tokens = words(&reply);
            json!({"id": format!("resp_{suffix}"), "object": "response", "created_at": now, "status": "completed",
                   "model": model,
                   "output": [{"type": "message", "id": format!("msg_{suffix}"), "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": reply, "annotations": []}]}],
                   "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": input_tokens + output_tokens}})
        }
        "/v1/moderations" => {
            let results: Vec<Value> = items(request.get("input"))
                .iter()
                .map(|_| json!({"flagged": false, "categories": {}, "category_scores": {}}))
                .collect();
            json!({"id": format!("modr-{suffix}"), "model": model, "results": results})
        }
        _ => {
            let messages = request.get("messages").and_then(Value::as_array).cloned().unwrap_or_default();
            let (reply, prompt_tokens) = last_user_message(&messages);
            let completion_tokens = words(&reply);
            json!({
                "id": format!("chatcmpl-{suffix}"),
                "object": "chat.completion",
                "created": now,
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop", "logprobs": null}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
                "system_fingerprint": null,
            })
        }
    };
    success(200, Some(id.to_string()), response.to_string().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::Usage;

    fn answer(endpoint: &str, body: &str) -> (Value, Usage) {
        let LineOutcome::Success { status, body, usage, request_id } = echo(endpoint, body.as_bytes()) else {
            panic!("echo failed")
        };
        assert_eq!(status, 200);
        assert!(request_id.unwrap().starts_with("req_"));
        (serde_json::from_str(body.get()).unwrap(), usage)
    }

    #[test]
    fn echo_answers_with_the_last_user_message_and_counts_tokens() {
        let (body, usage) = answer(
            "/v1/chat/completions",
            r#"{"model":"echo","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello there world"}]}"#,
        );
        assert_eq!(body["choices"][0]["message"]["content"], "hello there world");
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(usage, Usage { input_tokens: 5, output_tokens: 3, total_tokens: 8, ..Usage::default() });
    }

    #[test]
    fn echo_answers_every_endpoint_in_its_shape() {
        let (body, usage) = answer("/v1/embeddings", r#"{"model":"echo","input":["one two","three"]}"#);
        assert_eq!((body["object"].as_str(), body["data"].as_array().unwrap().len()), (Some("list"), 2));
        assert_eq!(body["data"][1]["embedding"].as_array().unwrap().len(), 8);
        assert_eq!(
            body["data"][0]["embedding"],
            answer("/v1/embeddings", r#"{"input":"one two"}"#).0["data"][0]["embedding"]
        );
        assert_eq!((usage.input_tokens, usage.output_tokens, usage.total_tokens), (3, 0, 3));

        let (body, usage) = answer("/v1/completions", r#"{"model":"echo","prompt":"once upon a time"}"#);
        assert_eq!(
            (body["object"].as_str(), body["choices"][0]["text"].as_str()),
            (Some("text_completion"), Some("once upon a time"))
        );
        assert_eq!(usage.total_tokens, 8);

        let (body, usage) = answer(
            "/v1/responses",
            r#"{"model":"echo","input":[{"role":"user","content":[{"type":"input_text","text":"hi there"}]}]}"#,
        );
        assert_eq!(body["object"], "response");
        assert_eq!(body["output"][0]["content"][0]["text"], "hi there");
        assert_eq!((usage.input_tokens, usage.output_tokens, usage.total_tokens), (2, 2, 4));
        assert_eq!(
            answer("/v1/responses", r#"{"input":"plain text"}"#).0["output"][0]["content"][0]["text"],
            "plain text"
        );

        let (body, usage) = answer("/v1/moderations", r#"{"input":["a","b","c"]}"#);
        assert_eq!(body["results"].as_array().unwrap().len(), 3);
        assert_eq!(body["results"][0]["flagged"], false);
        assert_eq!(usage, Usage::default());
    }
}
