//! Durations written the way operators write them in YAML: `24h`, `90m`, `30s`, `1h30m`.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub fn parse(raw: &str) -> Option<Duration> {
    let raw = raw.trim();
    if raw.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in raw.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            'd' => 86_400,
            'h' => 3_600,
            'm' => 60,
            's' => 1,
            _ => return None,
        };
        let value: u64 = digits.parse().ok()?;
        total = total.checked_add(value.checked_mul(unit)?)?;
        digits.clear();
    }
    // A bare number is seconds; a number after the last unit is a typo.
    if !digits.is_empty() {
        if total != 0 {
            return None;
        }
        total = digits.parse().ok()?;
    }
    Some(Duration::from_secs(total))
}

/// Like [`parse`], also taking milliseconds: `250ms`.
pub fn parse_precise(raw: &str) -> Option<Duration> {
    match raw.trim().strip_suffix("ms") {
        Some(millis) => millis.trim().parse::<u64>().ok().map(Duration::from_millis),
        None => parse(raw),
    }
}

/// `#[serde(deserialize_with = "duration::deserialize_precise")]`
pub fn deserialize_precise<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let raw = String::deserialize(deserializer)?;
    parse_precise(&raw)
        .ok_or_else(|| serde::de::Error::custom(format!("{raw:?} is not a duration like 500ms, 30s or 1m")))
}

/// `#[serde(deserialize_with = "duration::deserialize")]`
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let raw = String::deserialize(deserializer)?;
    parse(&raw).ok_or_else(|| serde::de::Error::custom(format!("{raw:?} is not a duration like 24h, 30m or 10s")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_operator_durations() {
        assert_eq!(parse("24h"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse("1h30m"), Some(Duration::from_secs(5_400)));
        assert_eq!(parse("45"), Some(Duration::from_secs(45)));
        assert_eq!(parse("2d"), Some(Duration::from_secs(172_800)));
        for bad in ["", "h", "1x", "1h30", "-1s", "99999999999999999999s"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(parse_precise("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_precise("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse("250ms"), None, "whole units only where milliseconds make no sense");
    }
}
