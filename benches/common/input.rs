//! A batch input file as the night-shift benches send it: lines that ask a model to
//! summarise a document, and their upload to the Files API.

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

/// Uploads `input` as a batch input file by `files` (a POST to the Files API's
/// `/v1/files`, authenticated as its project); returns the file's id.
pub async fn upload(files: reqwest::RequestBuilder, input: String) -> String {
    let form = reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part("file", reqwest::multipart::Part::bytes(input.into_bytes()).file_name("batch.jsonl"));
    let file: serde_json::Value = files.multipart(form).send().await.unwrap().json().await.unwrap();
    file["id"].as_str().unwrap_or_else(|| panic!("no file uploaded: {file}")).to_owned()
}
