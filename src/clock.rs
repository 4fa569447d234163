//! Wall-clock time as the API speaks it: Unix seconds.

use std::time::{SystemTime, UNIX_EPOCH};

pub type UnixSeconds = i64;

pub fn now() -> UnixSeconds {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}
