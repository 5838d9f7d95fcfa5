//! Which NVML call a GPU's thread is in, and since when. NVML calls can
//! block for seconds (a GPU falling off the bus, a driver in trouble); the
//! source reads this to report a call that hangs instead of hanging with it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub(crate) struct Watchdog {
    current: Mutex<Option<(&'static str, Instant)>>,
}

impl Watchdog {
    /// Runs `call` (the NVML function `name`) under watch.
    pub(crate) fn run<T>(&self, name: &'static str, call: impl FnOnce() -> T) -> T {
        self.set(Some((name, Instant::now())));
        let result = call();
        self.set(None);
        result
    }

    /// The call in progress and how long it has been running.
    pub(crate) fn in_flight(&self) -> Option<(&'static str, Duration)> {
        let current = self.current.lock().ok()?;
        current.map(|(name, since)| (name, since.elapsed()))
    }

    fn set(&self, value: Option<(&'static str, Instant)>) {
        if let Ok(mut current) = self.current.lock() {
            *current = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_call_in_flight_and_clears_it_after() {
        let watchdog = Watchdog::default();
        let seen = watchdog.run("nvmlDeviceGetMemoryInfo_v2", || watchdog.in_flight());
        assert_eq!(
            seen.map(|(name, _)| name),
            Some("nvmlDeviceGetMemoryInfo_v2")
        );
        assert_eq!(watchdog.in_flight(), None);
    }
}
