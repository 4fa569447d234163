//! OpenAI's expiry option, `{"anchor": "created_at", "seconds": N}`: `expires_after` on a
//! file upload and `output_expires_after` on a batch create. Parsed and checked here, with
//! OpenAI's error codes and wording; applied when the file is recorded.

use serde_json::Value;

/// The shortest and longest expiry OpenAI accepts: an hour and 30 days.
pub const MIN_SECONDS: u64 = 3_600;
pub const MAX_SECONDS: u64 = 2_592_000;

/// A checked expiry: the file expires this many seconds after it is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpiresAfter {
    pub seconds: u64,
}

/// Why an expiry option is refused (400), as OpenAI words it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ExpiryError {
    pub code: &'static str,
    pub message: String,
    /// `expires_after.seconds` and the like.
    pub param: String,
}

fn error(code: &'static str, param: String, message: String) -> ExpiryError {
    ExpiryError { code, message, param }
}

fn check(
    option: &str,
    anchor: Option<&str>,
    seconds: Option<Result<u64, String>>,
) -> Result<ExpiresAfter, ExpiryError> {
    let anchor_param = format!("{option}.anchor");
    let seconds_param = format!("{option}.seconds");
    let missing = |param: String| {
        error("missing_required_parameter", param.clone(), format!("Missing required parameter: '{param}'."))
    };
    match anchor {
        None => return Err(missing(anchor_param)),
        Some("created_at") => {}
        Some(other) => {
            return Err(error(
                "invalid_value",
                anchor_param,
                format!("Invalid value: '{other}'. Supported values are: 'created_at'."),
            ));
        }
    }
    let seconds = match seconds {
        None => return Err(missing(seconds_param)),
        Some(Err(got)) => {
            return Err(error(
                "invalid_type",
                seconds_param.clone(),
                format!("Invalid type for '{seconds_param}': expected an integer, but got {got} instead."),
            ));
        }
        Some(Ok(seconds)) => seconds,
    };
    if seconds < MIN_SECONDS {
        return Err(error(
            "integer_below_min_value",
            seconds_param.clone(),
            format!(
                "Invalid '{seconds_param}': integer below minimum value. Expected a value >= {MIN_SECONDS}, but got {seconds} instead."
            ),
        ));
    }
    if seconds > MAX_SECONDS {
        return Err(error(
            "integer_above_max_value",
            seconds_param.clone(),
            format!(
                "Invalid '{seconds_param}': integer above maximum value. Expected a value <= {MAX_SECONDS}, but got {seconds} instead."
            ),
        ));
    }
    Ok(ExpiresAfter { seconds })
}

/// How OpenAI names a JSON value's type in its `invalid_type` messages.
pub fn kind(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(_) => "a decimal".into(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// The option from a JSON body's field `option` (absent or null: none).
pub fn from_json(option: &str, value: Option<&Value>) -> Result<Option<ExpiresAfter>, ExpiryError> {
    let object = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(object)) => object,
        Some(other) => {
            return Err(error(
                "invalid_type",
                option.to_owned(),
                format!("Invalid type for '{option}': expected an object, but got {} instead.", kind(other)),
            ));
        }
    };
    let anchor = match object.get("anchor") {
        None | Some(Value::Null) => None,
        Some(Value::String(anchor)) => Some(anchor.as_str()),
        Some(other) => {
            let param = format!("{option}.anchor");
            let message = format!("Invalid type for '{param}': expected a string, but got {} instead.", kind(other));
            return Err(error("invalid_type", param, message));
        }
    };
    let seconds = match object.get("seconds") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64().map(Ok),
        // A negative integer is below the minimum, not of the wrong type.
        Some(Value::Number(n)) if n.as_i64().is_some() => Some(Ok(0)),
        Some(other) => Some(Err(kind(other))),
    };
    check(option, anchor, seconds).map(Some)
}

/// The option from multipart fields (`expires_after[anchor]`, `expires_after[seconds]`,
/// as the SDK sends them); neither given: none.
pub fn from_fields(
    option: &str,
    anchor: Option<&str>,
    seconds: Option<&str>,
) -> Result<Option<ExpiresAfter>, ExpiryError> {
    if anchor.is_none() && seconds.is_none() {
        return Ok(None);
    }
    let seconds = seconds.map(|raw| match raw.trim().parse::<i64>() {
        Ok(n) => Ok(u64::try_from(n).unwrap_or(0)),
        Err(_) => Err("a string".to_owned()),
    });
    check(option, anchor, seconds).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accepts_an_hour_to_thirty_days_from_creation() {
        let ok = |v: Value| from_json("expires_after", Some(&v)).unwrap();
        assert_eq!(ok(json!({"anchor": "created_at", "seconds": 3600})), Some(ExpiresAfter { seconds: 3600 }));
        assert_eq!(ok(json!({"anchor": "created_at", "seconds": 2_592_000})).unwrap().seconds, MAX_SECONDS);
        assert_eq!(from_json("expires_after", None).unwrap(), None);
        assert_eq!(from_json("expires_after", Some(&Value::Null)).unwrap(), None);
        assert_eq!(from_fields("expires_after", Some("created_at"), Some("7200")).unwrap().unwrap().seconds, 7200);
        assert_eq!(from_fields("expires_after", None, None).unwrap(), None);
    }

    #[test]
    fn refuses_what_openai_refuses_with_its_codes() {
        let refused = |v: Value| from_json("output_expires_after", Some(&v)).unwrap_err();
        let low = refused(json!({"anchor": "created_at", "seconds": 59}));
        assert_eq!((low.code, low.param.as_str()), ("integer_below_min_value", "output_expires_after.seconds"));
        assert_eq!(
            low.message,
            "Invalid 'output_expires_after.seconds': integer below minimum value. Expected a value >= 3600, but got 59 instead."
        );
        assert_eq!(refused(json!({"anchor": "created_at", "seconds": -5})).code, "integer_below_min_value");
        assert_eq!(refused(json!({"anchor": "created_at", "seconds": 2_592_001})).code, "integer_above_max_value");
        assert_eq!(refused(json!({"anchor": "created_at", "seconds": 3600.5})).code, "invalid_type");
        assert_eq!(refused(json!({"anchor": "created_at", "seconds": "3600"})).code, "invalid_type");
        let anchor = refused(json!({"anchor": "last_active_at", "seconds": 3600}));
        assert_eq!((anchor.code, anchor.param.as_str()), ("invalid_value", "output_expires_after.anchor"));
        assert_eq!(refused(json!({"seconds": 3600})).code, "missing_required_parameter");
        assert_eq!(refused(json!({"anchor": "created_at"})).param, "output_expires_after.seconds");
        assert_eq!(refused(json!(3600)).code, "invalid_type");
        let field = from_fields("expires_after", Some("created_at"), Some("soon")).unwrap_err();
        assert_eq!((field.code, field.param.as_str()), ("invalid_type", "expires_after.seconds"));
        assert_eq!(from_fields("expires_after", None, Some("3600")).unwrap_err().code, "missing_required_parameter");
    }
}
