//! Every message row of the spec's validation table, with its exact text and line.

use super::*;

const URL: &str = "/v1/chat/completions";

fn line(custom_id: &str) -> String {
    format!(
        r#"{{"custom_id":"{custom_id}","method":"POST","url":"{URL}","body":{{"model":"m","messages":[{{"role":"user","content":"hi"}}]}}}}"#
    )
}

fn file(lines: &[String]) -> Vec<u8> {
    lines.iter().map(|l| format!("{l}\n")).collect::<String>().into_bytes()
}

fn refusal(input: &[u8]) -> InvalidInput {
    validate(input, URL, 5000).expect_err("input should be refused")
}

fn assert_refused(input: &[u8], message: &str, line: Option<u64>) {
    let error = refusal(input);
    assert_eq!(error.message, message);
    assert_eq!(error.line, line, "{message}");
}

/// A valid line 1, then `bad` as line 2.
fn second_line(bad: &str) -> Vec<u8> {
    file(&[line("first"), bad.to_owned()])
}

#[test]
fn a_valid_file_counts_requests_and_keeps_the_url() {
    let input = file(&[line("a"), line("b"), line("c")]);
    let valid = validate(&input, URL, 5000).unwrap();
    assert_eq!(valid.requests, 3);
    assert_eq!(valid.url, URL);
    assert_eq!(valid.shards.shards.len(), 1);
    assert_eq!(valid.shards.shards[0].byte_end, input.len() as u64);
}

#[test]
fn empty_or_whitespace_only_input_contains_no_jsonl_lines() {
    for input in [&b""[..], b"\n", b"  \n\t\n\r\n", b"   "] {
        assert_refused(input, "Input file contains no JSONL lines", None);
    }
}

#[test]
fn the_file_size_limit_has_its_message() {
    assert_eq!(file_too_large().message, "Input file exceeds maximum size of 209715200 bytes");
}

#[test]
fn more_than_50000_lines_is_refused() {
    let one = line("x");
    let mut input = Vec::new();
    for n in 0..50_001 {
        input.extend_from_slice(one.replace("\"x\"", &format!("\"id-{n}\"")).as_bytes());
        input.push(b'\n');
    }
    assert_refused(&input, "Input file exceeds maximum of 50000 lines", None);
    let exactly: Vec<u8> = input.split(|&b| b == b'\n').take(50_000).flat_map(|l| [l, b"\n"].concat()).collect();
    assert_eq!(validate(&exactly, URL, 5000).unwrap().requests, 50_000);
}

#[test]
fn invalid_json_is_reported_with_its_line() {
    for bad in ["{", "{\"custom_id\": }", "not json", "{\"a\":1} trailing", "[1,2", "{'single':'quotes'}"] {
        assert_refused(&second_line(bad), "Line 2 is not valid JSON", Some(2));
    }
}

#[test]
fn invalid_utf8_is_not_valid_json() {
    let mut input = file(&[line("first")]);
    input.extend_from_slice(b"{\"custom_id\":\"\xff\xfe\",\"method\":\"POST\"}\n");
    assert_refused(&input, "Line 2 is not valid JSON", Some(2));
}

#[test]
fn arrays_and_primitives_must_be_objects() {
    for bad in ["[1,2]", "42", "\"text\"", "null", "true", "[]"] {
        assert_refused(&second_line(bad), "Line 2 must be a JSON object", Some(2));
    }
}

#[test]
fn lines_over_one_megabyte_are_refused_even_split_across_chunks() {
    let padding = "x".repeat(MAX_LINE_BYTES);
    let long = line("long").replace("\"m\"", &format!("\"{padding}\""));
    let input = second_line(&long);
    assert_refused(&input, "Line 2 exceeds maximum size of 1048576 bytes", Some(2));
    for chunk_size in [1, 7, 4096, 65_536] {
        let mut validator = Validator::new(URL, 5000);
        let error = input.chunks(chunk_size).find_map(|chunk| validator.feed(chunk).err());
        let error = error.or_else(|| validator.finish().err()).unwrap();
        assert_eq!(error.line, Some(2), "chunk size {chunk_size}");
    }
    // A line of exactly 1 MiB passes the size rule.
    let base = line("exact");
    let fill = MAX_LINE_BYTES - base.len();
    let exact = base.replace("\"m\"", &format!("\"m{}\"", "y".repeat(fill)));
    assert_eq!(exact.len(), MAX_LINE_BYTES);
    assert_eq!(validate(&second_line(&exact), URL, 5000).unwrap().requests, 2);
    // ... and with a CRLF ending, fed whole or in pieces: the CR is not content.
    let crlf = format!("{}\n{exact}\r\n{}\n", line("a"), line("b")).into_bytes();
    for chunk_size in [crlf.len(), 64 * 1024, 7] {
        let mut validator = Validator::new(URL, 5000);
        crlf.chunks(chunk_size).for_each(|chunk| validator.feed(chunk).unwrap());
        assert_eq!(validator.finish().unwrap().requests, 3, "chunk size {chunk_size}");
    }
    let over = format!("{}\n{exact}y\r\n", line("a"));
    assert_eq!(refusal(over.as_bytes()).line, Some(2), "one byte of content over is still over");
}

#[test]
fn a_byte_order_mark_opening_the_file_is_skipped_by_validation_and_by_workers() {
    let input = [b"\xEF\xBB\xBF".as_slice(), &file(&[line("a"), line("b")])].concat();
    let valid = validate(&input, URL, 1).unwrap();
    assert_eq!(valid.requests, 2);
    let first = &valid.shards.shards[0];
    assert_eq!(first.byte_start, 3, "the first shard's range starts after the mark");
    let range = &input[first.byte_start as usize..first.byte_end as usize];
    assert!(range.starts_with(b"{"), "a worker reads JSON from its first byte");
    // Only at the very start: elsewhere it is a line that is not JSON.
    let inside = [file(&[line("a")]).as_slice(), b"\xEF\xBB\xBF", &file(&[line("b")])].concat();
    assert_eq!(refusal(&inside).line, Some(2));
}

#[test]
fn custom_id_must_be_a_non_empty_string() {
    for bad in [
        r#"{"method":"POST","url":"/v1/chat/completions","body":{"a":1}}"#,
        r#"{"custom_id":7,"method":"POST","url":"/v1/chat/completions","body":{"a":1}}"#,
        r#"{"custom_id":"","method":"POST","url":"/v1/chat/completions","body":{"a":1}}"#,
        r#"{"custom_id":null,"method":"POST","url":"/v1/chat/completions","body":{"a":1}}"#,
        r#"{"custom_id":["a"],"method":"POST","url":"/v1/chat/completions","body":{"a":1}}"#,
    ] {
        assert_refused(&second_line(bad), "Line 2 is missing custom_id", Some(2));
    }
}

#[test]
fn duplicated_custom_ids_name_the_id_and_the_later_line() {
    let input = file(&[line("req-1"), line("req-2"), line("req-3"), line("req-4"), line("req-1")]);
    let error = refusal(&input);
    assert_eq!(error.message, "Line 5 duplicates custom_id \"req-1\"");
    assert_eq!(error.line, Some(5));
    assert_eq!(error.param, None, "as in the spec's example");
    // Escapes are decoded before comparing, and long ids are compared too.
    assert_refused(&file(&[line("req-1"), line("req-\\u0031")]), "Line 2 duplicates custom_id \"req-1\"", Some(2));
    let long_id = "z".repeat(5000);
    let input = file(&[line(&long_id), line("other"), line(&long_id)]);
    assert_eq!(refusal(&input).line, Some(3));
}

#[test]
fn method_must_be_post_in_any_case() {
    for bad in ["GET", "PUT", "", "POSTS"] {
        let bad_line = line("b").replace("\"POST\"", &format!("\"{bad}\""));
        assert_refused(&second_line(&bad_line), "Line 2 method must be \"POST\"", Some(2));
    }
    let missing = line("b").replace("\"method\":\"POST\",", "");
    assert_refused(&second_line(&missing), "Line 2 method must be \"POST\"", Some(2));
    let lower = line("b").replace("\"POST\"", "\"post\"");
    assert!(validate(&second_line(&lower), URL, 5000).is_ok());
}

#[test]
fn url_must_be_present() {
    let missing = line("b").replace(&format!("\"url\":\"{URL}\","), "");
    assert_refused(&second_line(&missing), "Line 2 is missing url", Some(2));
    let number = line("b").replace(&format!("\"{URL}\""), "5");
    assert_refused(&second_line(&number), "Line 2 is missing url", Some(2));
}

#[test]
fn a_url_that_is_not_batchable_is_refused() {
    for bad in [
        "/v1/embeddings",
        "/v1/chat/completions/",
        "https://api.openai.com/v1/chat/completions",
        "/v1/chat/completions?x=1",
    ] {
        let bad_line = line("a").replace(URL, bad);
        let input = file(&[bad_line]);
        assert_refused(&input, &format!("Line 1 url \"{bad}\" is not an allowed batch endpoint"), Some(1));
    }
}

#[test]
fn lines_that_disagree_on_url_are_refused() {
    let two = Endpoints::from_urls(&["/v1/chat/completions", "/v1/embeddings"]).unwrap();
    let other = line("b").replace(URL, "/v1/embeddings");
    let input = file(&[line("a"), other]);
    let mut validator = Validator::with_endpoints(URL, 5000, two);
    let error = validator.feed(&input).err().or_else(|| validator.finish().err()).unwrap();
    assert_eq!(
        error.message,
        "Line 2 url \"/v1/embeddings\" does not match the batch endpoint \"/v1/chat/completions\""
    );
    assert_eq!(error.line, Some(2));
    // With today's single batchable url, a later line's other url reads as a mismatch too.
    let error = refusal(&file(&[line("a"), line("b").replace(URL, "/v1/responses")]));
    assert_eq!(
        error.message,
        "Line 2 url \"/v1/responses\" does not match the batch endpoint \"/v1/chat/completions\""
    );
}

#[test]
fn body_must_be_a_non_empty_object() {
    for body in ["{}", "[]", "null", "\"text\"", "3"] {
        let bad = line("b").replace(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#, body);
        assert_refused(&second_line(&bad), "Line 2 is missing body", Some(2));
    }
    let missing = r#"{"custom_id":"b","method":"POST","url":"/v1/chat/completions"}"#;
    assert_refused(&second_line(missing), "Line 2 is missing body", Some(2));
}

#[test]
fn stream_true_is_refused_but_other_stream_values_are_not() {
    let streaming = line("b").replace("\"model\":\"m\"", "\"model\":\"m\",\"stream\":true");
    assert_refused(
        &second_line(&streaming),
        "Line 2 has stream=true; streaming is not supported in batch mode",
        Some(2),
    );
    for value in ["false", "\"true\"", "null", "1"] {
        let fine = line("b").replace("\"model\":\"m\"", &format!("\"model\":\"m\",\"stream\":{value}"));
        assert!(validate(&second_line(&fine), URL, 5000).is_ok(), "stream: {value}");
    }
}

#[test]
fn the_create_endpoint_must_match_the_files_url() {
    let error = validate(&file(&[line("a")]), "/v1/embeddings", 5000).unwrap_err();
    assert_eq!(
        error.message,
        "endpoint \"/v1/embeddings\" does not match the url \"/v1/chat/completions\" used by the input file"
    );
    assert_eq!(error.line, None);
    assert_eq!(error.param, Some("endpoint"));
}

#[test]
fn blank_lines_are_skipped_but_counted_for_line_numbers() {
    let input = format!("\n{}\n\n   \n{}\n", line("a"), line("a"));
    assert_refused(input.as_bytes(), "Line 5 duplicates custom_id \"a\"", Some(5));
    let valid = format!("\n{}\n\n{}", line("a"), line("b"));
    assert_eq!(validate(valid.as_bytes(), URL, 5000).unwrap().requests, 2, "no trailing newline needed");
}

#[test]
fn crlf_line_endings_are_accepted() {
    let input = format!("{}\r\n{}\r\n", line("a"), line("b"));
    assert_eq!(validate(input.as_bytes(), URL, 5000).unwrap().requests, 2);
}

#[test]
fn shards_cover_every_request_with_exact_byte_ranges() {
    let lines: Vec<String> = (0..23).map(|n| line(&format!("r{n}"))).collect();
    let mut input = Vec::new();
    for (n, l) in lines.iter().enumerate() {
        if n % 4 == 0 {
            input.extend_from_slice(b"\n");
        }
        input.extend_from_slice(l.as_bytes());
        input.extend_from_slice(b"\n");
    }
    let plan = validate(&input, URL, 5).unwrap().shards;
    assert_eq!(plan.shards.len(), 5);
    assert_eq!(plan.shards.iter().map(|s| s.requests).sum::<u64>(), 23);
    for shard in &plan.shards {
        let bytes = &input[shard.byte_start as usize..shard.byte_end as usize];
        let requests: Vec<&[u8]> = bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
        assert_eq!(requests.len() as u64, shard.requests);
        let first = String::from_utf8_lossy(requests[0]);
        assert!(first.contains(&format!("\"r{}\"", shard.first_request)), "{first}");
    }
}

#[test]
fn chunk_boundaries_do_not_change_the_verdict() {
    let input = file(&[line("a"), line("b"), "[1]".into(), line("c")]);
    for size in 1..40 {
        let mut validator = Validator::new(URL, 2);
        let error = input.chunks(size).find_map(|chunk| validator.feed(chunk).err());
        let error = error.or_else(|| validator.finish().err()).unwrap();
        assert_eq!(error.message, "Line 3 must be a JSON object", "chunk size {size}");
    }
    let valid = file(&[line("a"), line("b"), line("c")]);
    let whole = validate(&valid, URL, 2).unwrap();
    for size in 1..40 {
        let mut validator = Validator::new(URL, 2);
        for chunk in valid.chunks(size) {
            validator.feed(chunk).unwrap();
        }
        assert_eq!(validator.finish().unwrap(), whole, "chunk size {size}");
    }
}

mod fuzz {
    use proptest::prelude::*;

    use super::*;

    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(line("a")),
            Just(line("b")),
            Just("{\"custom_id\":".to_owned()),
            Just("\"body\":{\"stream\":true}".to_owned()),
            Just("\n".to_owned()),
            Just("[".to_owned()),
            Just("}".to_owned()),
            Just("\\u00".to_owned()),
            "\\PC{0,12}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), chunk in 1usize..64) {
            let mut validator = Validator::new(URL, 3);
            let mut failed = false;
            for piece in bytes.chunks(chunk) {
                if validator.feed(piece).is_err() { failed = true; break; }
            }
            if !failed { let _ = validator.finish(); }
        }

        #[test]
        fn near_valid_jsonl_never_panics_and_agrees_across_chunkings(parts in proptest::collection::vec(fragment(), 0..30), chunk in 1usize..97) {
            let input = parts.concat().into_bytes();
            let whole = validate(&input, URL, 2);
            let mut validator = Validator::new(URL, 2);
            let mut split = None;
            for piece in input.chunks(chunk) {
                if let Err(error) = validator.feed(piece) { split = Some(Err(error)); break; }
            }
            let split = split.unwrap_or_else(|| validator.finish());
            prop_assert_eq!(whole, split);
        }
    }
}

#[test]
fn the_model_is_kept_when_every_line_names_the_same_one() {
    let model = |lines: &[String]| validate(&file(lines), URL, 5000).unwrap().model;
    assert_eq!(model(&[line("a"), line("b")]).as_deref(), Some("m"));
    let other = line("b").replace("\"model\":\"m\"", "\"model\":\"n\"");
    assert_eq!(model(&[line("a"), other]), None, "different models");
    let none = line("b").replace("\"model\":\"m\",", "");
    assert_eq!(model(&[line("a"), none.clone()]), None, "a line without one");
    assert_eq!(model(&[none]), None);
    let escaped = line("a").replace("\"model\":\"m\"", r#""model":"m\u0031""#);
    assert_eq!(model(&[escaped]).as_deref(), Some("m1"), "escapes are decoded");
}

fn endpoint_line(url: &str, body: &str) -> String {
    format!(r#"{{"custom_id":"a","method":"POST","url":"{url}","body":{body}}}"#)
}

#[test]
fn enabled_endpoints_check_their_essential_body_fields() {
    let all = Endpoints::from_urls(&BATCHABLE_URLS).unwrap();
    let check = |url: &str, body: &str| {
        let mut validator = Validator::with_endpoints(url, 5000, all);
        validator.feed(format!("{}\n", endpoint_line(url, body)).as_bytes()).and_then(|()| validator.finish())
    };
    for (url, body) in [
        ("/v1/embeddings", r#"{"model":"e","input":"hello"}"#),
        ("/v1/embeddings", r#"{"model":"e","input":["a","b"]}"#),
        ("/v1/completions", r#"{"model":"c","prompt":"once upon"}"#),
        ("/v1/responses", r#"{"model":"r","input":[{"role":"user","content":"hi"}]}"#),
        ("/v1/moderations", r#"{"input":"text"}"#),
    ] {
        assert!(check(url, body).is_ok(), "{url} {body}");
    }
    for (url, body, message, param) in [
        (
            "/v1/embeddings",
            r#"{"model":"e"}"#,
            "Line 1 body is missing input, which /v1/embeddings requires",
            "body.input",
        ),
        (
            "/v1/embeddings",
            r#"{"model":"e","input":null}"#,
            "Line 1 body is missing input, which /v1/embeddings requires",
            "body.input",
        ),
        (
            "/v1/embeddings",
            r#"{"input":"x"}"#,
            "Line 1 body is missing model, which /v1/embeddings requires",
            "body.model",
        ),
        (
            "/v1/completions",
            r#"{"model":"c"}"#,
            "Line 1 body is missing prompt, which /v1/completions requires",
            "body.prompt",
        ),
        (
            "/v1/responses",
            r#"{"model":"r","input":"hi","stream":true}"#,
            "Line 1 has stream=true; streaming is not supported in batch mode",
            "body.stream",
        ),
        (
            "/v1/moderations",
            r#"{"model":"m"}"#,
            "Line 1 body is missing input, which /v1/moderations requires",
            "body.input",
        ),
    ] {
        let error = check(url, body).unwrap_err();
        assert_eq!((error.message.as_str(), error.param), (message, Some(param)), "{url} {body}");
    }
}

#[test]
fn an_endpoint_not_enabled_gets_the_specs_message() {
    // Not enabled (the default).
    let mut validator = Validator::new("/v1/embeddings", 5000);
    let error = validator
        .feed(format!("{}\n", endpoint_line("/v1/embeddings", r#"{"model":"e","input":"x"}"#)).as_bytes())
        .unwrap_err();
    assert_eq!(error.message, "Line 1 url \"/v1/embeddings\" is not an allowed batch endpoint");
    assert_eq!(Endpoints::from_urls(&["/v1/images"]), Err("/v1/images".to_owned()));
}

#[test]
fn a_key_repeated_in_a_line_or_its_body_refuses_the_line() {
    let cases = [
        (r#""custom_id":"b","#, r#""custom_id":"b","custom_id":"c","#, "custom_id", Some("custom_id")),
        (r#""method":"POST","#, r#""method":"POST","method":"POST","#, "method", Some("method")),
        (r#""url":"#, r#""url":"/v1/chat/completions","url":"#, "url", Some("url")),
        (r#""body":{"#, r#""body":{},"body":{"#, "body", Some("body")),
        (r#""model":"m","#, r#""model":"m","model":"other","#, "body.model", Some("body.model")),
        (r#""model":"m","#, r#""model":"m","temperature":1,"temperature":0,"#, "body.temperature", None),
        // Escapes spell the same key.
        (r#""custom_id":"b","#, r#""custom_id":"b","custom\u005fid":"c","#, "custom_id", Some("custom_id")),
    ];
    for (from, to, path, param) in cases {
        let bad = line("b").replacen(from, to, 1);
        assert_ne!(bad, line("b"), "{from}");
        let error = refusal(&second_line(&bad));
        let message = format!("Line 2 has the key \"{path}\" more than once; each key may appear once");
        assert_eq!((error.message.as_str(), error.line, error.param), (message.as_str(), Some(2), param), "{bad}");
    }
    // Keys repeated deeper in the body are the model server's to judge.
    let nested = line("b").replace(r#"{"role":"user","#, r#"{"role":"user","role":"user","#);
    assert!(validate(&file(&[line("a"), nested]), URL, 5000).is_ok());
}

#[test]
fn a_repeat_among_many_body_keys_is_found() {
    let keys: String = (0..1_000).map(|n| format!(r#""k{n}":0,"#)).collect();
    let many = line("b").replacen(r#""model":"m","#, &format!(r#""model":"m",{keys}"#), 1);
    assert!(validate(&file(std::slice::from_ref(&many)), URL, 5000).is_ok());
    for (after, again) in [("k999", "k7"), ("k999", "model"), ("k3", "k2")] {
        let repeated = many.replacen(&format!(r#""{after}":0,"#), &format!(r#""{after}":0,"{again}":1,"#), 1);
        let message = format!("Line 1 has the key \"body.{again}\" more than once; each key may appear once");
        assert_eq!(refusal(&file(&[repeated])).message, message);
    }
}
