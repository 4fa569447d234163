//! A batch input file as the night-shift benches send it: lines that ask a model to
//! summarise a document, and the multipart form that uploads them.

/// `lines` chat-completion lines for `model`, line `n` asking for `max_tokens(n)` tokens.
pub fn summaries(lines: usize, model: &str, max_tokens: impl Fn(usize) -> u32) -> String {
    (0..lines)
        .map(|n| {
            let body = format!(
                r#"{{"model":"{model}","max_tokens":{},"messages":[{{"role":"user","content":"Summarise document {n} of the archive in a few sentences, keeping names and dates."}}]}}"#,
                max_tokens(n)
            );
            format!("{{\"custom_id\":\"r{n}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{body}}}\n")
        })
        .collect()
}

/// The Files API's upload form for `input`, with `purpose: batch`.
pub fn upload_form(input: String) -> reqwest::multipart::Form {
    reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part("file", reqwest::multipart::Part::bytes(input.into_bytes()).file_name("batch.jsonl"))
}
