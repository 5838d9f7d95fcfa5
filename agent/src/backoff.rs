//! Reconnect delays: exponential with jitter, so a fleet of agents that lost
//! the collector at the same moment does not come back at the same moment.

use std::time::Duration;

use rand::Rng;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            ceiling: initial,
        }
    }

    /// The next delay: uniform in [ceiling/2, ceiling], then the ceiling doubles
    /// up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling;
        self.ceiling = (self.ceiling * 2).min(self.max);
        let low = ceiling / 2;
        let span = ceiling.saturating_sub(low).as_millis() as u64;
        low + Duration::from_millis(rand::rng().random_range(0..=span))
    }

    pub fn reset(&mut self) {
        self.ceiling = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_maximum_and_stay_jittered_within_bounds() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut ceilings = vec![];
        for _ in 0..8 {
            let d = b.next_delay();
            ceilings.push(d);
        }
        assert!(
            ceilings[0] >= Duration::from_millis(50) && ceilings[0] <= Duration::from_millis(100)
        );
        assert!(
            ceilings[1] >= Duration::from_millis(100) && ceilings[1] <= Duration::from_millis(200)
        );
        for d in &ceilings[5..] {
            assert!(
                *d >= Duration::from_millis(500) && *d <= Duration::from_secs(1),
                "{d:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
