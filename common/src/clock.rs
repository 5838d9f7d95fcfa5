//! The collector's notion of now, injectable so tests can move time.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Default)]
pub enum Clock {
    #[default]
    System,
    /// A clock that only moves when told to.
    Manual(Arc<AtomicI64>),
}

impl Clock {
    pub fn manual(start_ms: i64) -> Self {
        Self::Manual(Arc::new(AtomicI64::new(start_ms)))
    }

    pub fn now_ms(&self) -> i64 {
        match self {
            Self::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                .unwrap_or(0),
            Self::Manual(now) => now.load(Ordering::Relaxed),
        }
    }

    pub fn set_ms(&self, ms: i64) {
        if let Self::Manual(now) = self {
            now.store(ms, Ordering::Relaxed);
        }
    }
}
