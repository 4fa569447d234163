//! What one line of a shard needs before any upstream is asked: nothing (an earlier run
//! recorded it), a record at once (it can't be sent), or a send. Pure: the worker reads
//! lines and acts on the answer.

use bytes::Bytes;

use super::failure::{self, FailureCode, LineFailure};
use super::input::{custom_id, parse_request};
use super::upstream::Route;

#[derive(Debug, PartialEq)]
pub enum Step {
    /// An earlier run of the shard recorded it.
    Recorded,
    /// It is settled without an upstream: its record is this failure.
    Settle { custom_id: String, failure: LineFailure },
    /// Send `body` to the upstream at this position (`None`: the built-in echo model).
    Send { custom_id: String, upstream: Option<usize>, body: Bytes },
}

/// Classifies `line`; `recorded` says whether the shard's ledger has its record, and
/// `route` which upstream serves a model.
pub fn classify(line: &[u8], recorded: bool, route: impl Fn(&str) -> Route) -> Step {
    if recorded {
        return Step::Recorded;
    }
    let Some(request) = parse_request(line) else {
        // Validated at create: only a file changed behind our back gets here.
        let failure = LineFailure {
            code: FailureCode::InvalidRequestError,
            message: "[legacy:http_400] The input line can no longer be read as a request".into(),
            param: None,
        };
        return Step::Settle { custom_id: custom_id(line), failure };
    };
    let upstream = match route(&request.model) {
        Route::Upstream(position) => Some(position),
        Route::Echo => None,
        Route::Unserved => {
            return Step::Settle { failure: failure::no_upstream(&request.model), custom_id: request.custom_id };
        }
    };
    Step::Send { custom_id: request.custom_id, upstream, body: request.body }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Models starting with `llama` go to upstream 0, `echo` to the echo model.
    fn route(model: &str) -> Route {
        if model.starts_with("llama") {
            Route::Upstream(0)
        } else if model == "echo" {
            Route::Echo
        } else {
            Route::Unserved
        }
    }

    fn line(custom_id: &str, model: &str) -> String {
        format!(
            r#"{{"custom_id":"{custom_id}","method":"POST","url":"/v1/chat/completions","body":{{"model":"{model}","messages":[]}}}}"#
        )
    }

    #[test]
    fn a_recorded_line_is_left_alone_whatever_it_says() {
        assert_eq!(classify(b"not json", true, route), Step::Recorded);
        assert_eq!(classify(line("a", "llama").as_bytes(), true, route), Step::Recorded);
    }

    #[test]
    fn a_served_model_is_sent_with_the_body_as_written() {
        let step = classify(line("a", "llama-3").as_bytes(), false, route);
        let body = Bytes::from_static(br#"{"model":"llama-3","messages":[]}"#);
        assert_eq!(step, Step::Send { custom_id: "a".into(), upstream: Some(0), body });
        let Step::Send { upstream, .. } = classify(line("b", "echo").as_bytes(), false, route) else { panic!() };
        assert_eq!(upstream, None, "echo is served in-process");
    }

    #[test]
    fn an_unserved_model_is_settled_as_not_found_on_model() {
        let Step::Settle { custom_id, failure } = classify(line("c", "gpt-9").as_bytes(), false, route) else {
            panic!("settled")
        };
        assert_eq!(custom_id, "c");
        assert_eq!(failure, failure::no_upstream("gpt-9"));
        assert_eq!(failure.param.as_deref(), Some("model"));
    }

    #[test]
    fn a_line_that_no_longer_parses_is_settled_as_invalid_with_its_custom_id_if_any() {
        let Step::Settle { custom_id, failure } = classify(br#"{"custom_id":"d","body":7}"#, false, route) else {
            panic!("settled")
        };
        assert_eq!(custom_id, "d");
        assert_eq!(failure.code, FailureCode::InvalidRequestError);
        assert!(failure.message.starts_with("[legacy:http_400]"), "{}", failure.message);
        let Step::Settle { failure, .. } = classify(b"\xff garbage", false, route) else { panic!("settled") };
        assert_eq!(failure.code, FailureCode::InvalidRequestError);
    }
}
