//! Wall-clock time as the API speaks it (Unix seconds), and the wall clock's beats that
//! processes keep together: worker pods read a server's load signal at the same instants
//! and take their views of it on the same half second (`crate::concurrency::view`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub type UnixSeconds = i64;

pub fn now() -> UnixSeconds {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// The time since the epoch (zero for a clock set before it).
pub fn since_epoch() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

/// How long from `now` (since the epoch) until the next beat of `every`, `offset` after
/// one: processes that wait so wake together, whenever they started.
pub fn until_beat(now: Duration, every: Duration, offset: Duration) -> Duration {
    let every = every.as_micros().max(1);
    let since = (now.as_micros() + every - offset.as_micros() % every) % every;
    Duration::from_micros(u64::try_from(every - since).unwrap_or(0))
}

/// The beat of `every` nearest `now` (since the epoch), in milliseconds since the epoch.
pub fn nearest_beat(now: Duration, every: Duration) -> u64 {
    let every = every.as_millis().max(1);
    u64::try_from((now.as_millis() + every / 2) / every * every).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_wake_on_the_beat_whenever_they_started() {
        let ms = Duration::from_millis;
        assert_eq!(until_beat(ms(1_000_120), ms(500), Duration::ZERO), ms(380));
        assert_eq!(until_beat(ms(1_000_000), ms(500), Duration::ZERO), ms(500), "on the beat: the next one");
        assert_eq!(until_beat(ms(1_000_120), ms(500), ms(250)), ms(130));
        assert_eq!(until_beat(ms(1_000_400), ms(500), ms(250)), ms(350));
        assert_eq!(until_beat(ms(1_000_020), ms(50), Duration::ZERO), ms(30));
        assert_eq!(nearest_beat(ms(1_000_120), ms(500)), 1_000_000);
        assert_eq!(nearest_beat(ms(1_000_260), ms(500)), 1_000_500);
    }
}
