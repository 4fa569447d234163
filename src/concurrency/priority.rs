//! The `priority` field on batch lines, for servers that schedule by it (vLLM with
//! `--scheduling-policy priority`: lower values first, interactive requests default to
//! 0). Set per upstream (`upstreams[].priority`); a line that sets its own keeps it.

use bytes::{BufMut, Bytes, BytesMut};

/// `body` (a JSON object) with `"priority": priority` as its first member. A member of
/// the same name later in the body wins with every JSON parser that keeps the last
/// duplicate (Python's, vLLM's): the line's own choice.
pub fn with_priority(body: &Bytes, priority: i64) -> Bytes {
    let text = body.as_ref();
    let Some(open) = text.iter().position(|b| !b.is_ascii_whitespace()) else { return body.clone() };
    if text[open] != b'{' {
        return body.clone();
    }
    let rest = &text[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let field = format!("{{\"priority\":{priority}{}", if empty { "" } else { "," });
    let mut out = BytesMut::with_capacity(text.len() + field.len());
    out.put_slice(field.as_bytes());
    out.put_slice(rest);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_priority_goes_first_and_the_lines_own_wins() {
        let cases = [
            (r#"{"model":"m","messages":[]}"#, r#"{"priority":10,"model":"m","messages":[]}"#),
            ("  {\n\"model\":\"m\"}", "{\"priority\":10,\n\"model\":\"m\"}"),
            ("{ }", r#"{"priority":10 }"#),
            ("[1]", "[1]"),
            ("", ""),
        ];
        for (body, expected) in cases {
            let out = with_priority(&Bytes::from(body), 10);
            assert_eq!(std::str::from_utf8(&out).unwrap(), expected, "{body:?}");
        }
        let own = with_priority(&Bytes::from(r#"{"model":"m","priority":-5}"#), 10);
        let parsed: serde_json::Value = serde_json::from_slice(&own).unwrap();
        assert_eq!(parsed["priority"], -5, "the last duplicate wins: the line's own");
    }
}
