//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `info`), in colour only
//! on a terminal (a pod's log or a file gets plain text).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal();
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
}

/// A warning that may repeat (a signal failing reading after reading, an upstream failing
/// line after line) logged at most once per `every`; what it warns of is counted or
/// recorded every time elsewhere.
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    logged: Option<Instant>,
}

impl LogThrottle {
    pub const fn every(every: Duration) -> Self {
        Self { every, logged: None }
    }

    /// Whether the warning is due at `now`: never logged, or last logged `every` ago or
    /// more. A warning due is taken as logged.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = self.logged.is_none_or(|at| now.saturating_duration_since(at) >= self.every);
        if due {
            self.logged = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttled_warning_is_due_at_first_then_once_per_period() {
        let start = Instant::now();
        let mut throttle = LogThrottle::every(Duration::from_secs(60));
        assert!(throttle.due(start), "the first is logged");
        assert!(!throttle.due(start + Duration::from_secs(59)));
        assert!(throttle.due(start + Duration::from_secs(60)), "a period later, again");
        assert!(!throttle.due(start + Duration::from_secs(61)), "counted from the last one logged");
    }
}
