//! When to try a line again: exponential backoff with jitter, or the upstream's
//! `Retry-After` when it sent one. Pure.

use std::time::{Duration, SystemTime};

/// The longest `Retry-After` honoured; a longer one is treated as this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failed attempt, doubled after each further one.
    pub base: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { base: Duration::from_millis(500), max: Duration::from_secs(30) }
    }
}

impl Backoff {
    /// The wait after failed attempt number `attempt` (1-based). `jitter` in `[0, 1)`
    /// spreads retries of many lines so they do not return in lockstep: the wait is
    /// between half and all of the exponential step.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(MAX_RETRY_AFTER);
        }
        let step = self.base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20)).min(self.max);
        step.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0)
    }
}

/// `Retry-After` as seconds or as an HTTP date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds.min(1e6)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_within_jitter_bounds_and_cap() {
        let backoff = Backoff { base: Duration::from_millis(100), max: Duration::from_secs(1) };
        assert_eq!(backoff.delay(1, None, 0.0), Duration::from_millis(50));
        assert_eq!(backoff.delay(1, None, 1.0), Duration::from_millis(100));
        assert_eq!(backoff.delay(3, None, 1.0), Duration::from_millis(400));
        assert_eq!(backoff.delay(30, None, 1.0), Duration::from_secs(1));
    }

    #[test]
    fn retry_after_wins_and_is_bounded() {
        let backoff = Backoff::default();
        assert_eq!(backoff.delay(1, Some(Duration::from_secs(3)), 0.9), Duration::from_secs(3));
        assert_eq!(backoff.delay(1, Some(Duration::from_secs(3600)), 0.9), MAX_RETRY_AFTER);
    }

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("0.25", now), Some(Duration::from_millis(250)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(12));
        assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(12)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(12));
        assert_eq!(parse_retry_after(&earlier, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-3", now), None);
    }
}
