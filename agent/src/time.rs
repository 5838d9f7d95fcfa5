//! Wall-clock time as the protocol carries it: Unix epoch milliseconds.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn epoch_ms_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
