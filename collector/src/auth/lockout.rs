//! Slows token guessing: a peer address that fails [`MAX_FAILURES`] times
//! in [`FAILURE_WINDOW`] is refused without a look at its token until the
//! window ends, and the log gets one line for it rather than a flood.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
pub const MAX_FAILURES: u32 = 10;
/// Peers remembered at most; past it the oldest windows are forgotten.
const MAX_TRACKED_PEERS: usize = 10_000;

#[derive(Debug, Clone, Copy)]
struct FailureWindow {
    started: Instant,
    failures: u32,
}

#[derive(Debug)]
pub struct Lockout {
    /// What is refused, for the log: "an agent call", "a dashboard request".
    what: &'static str,
    failures: Mutex<HashMap<IpAddr, FailureWindow>>,
}

impl Lockout {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            failures: Mutex::default(),
        }
    }

    /// Logs a refusal and counts it against `peer`.
    pub fn record_failure(&self, peer: Option<IpAddr>, reason: &str) {
        let what = self.what;
        let Some(ip) = peer else {
            tracing::warn!(reason, "refused {what}");
            return;
        };
        let ip = peer_key(ip);
        let Ok(mut failures) = self.failures.lock() else {
            return;
        };
        let now = Instant::now();
        if failures.len() >= MAX_TRACKED_PEERS && !failures.contains_key(&ip) {
            failures.retain(|_, w| now.duration_since(w.started) < FAILURE_WINDOW);
            if failures.len() >= MAX_TRACKED_PEERS {
                // Full of live windows: log, but track no more.
                tracing::warn!(peer = %ip, reason, "refused {what}");
                return;
            }
        }
        let window = failures.entry(ip).or_insert(FailureWindow {
            started: now,
            failures: 0,
        });
        if now.duration_since(window.started) >= FAILURE_WINDOW {
            *window = FailureWindow {
                started: now,
                failures: 0,
            };
        }
        window.failures += 1;
        if window.failures == MAX_FAILURES {
            tracing::warn!(peer = %ip, reason, failures = MAX_FAILURES,
                "refused {what}; locking the peer out for the rest of the minute");
        } else if window.failures < MAX_FAILURES {
            tracing::warn!(peer = %ip, reason, "refused {what}");
        }
    }

    /// How long `ip` stays locked out, if it is.
    pub fn locked_out(&self, ip: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().ok()?;
        let window = failures.get(&peer_key(ip))?;
        let elapsed = window.started.elapsed();
        (window.failures >= MAX_FAILURES && elapsed < FAILURE_WINDOW)
            .then(|| FAILURE_WINDOW - elapsed)
    }
}

/// One IPv6 host holds a whole /64: key its failures by the prefix, so
/// rotating addresses within it neither escapes the lockout nor fills the map.
fn peer_key(ip: IpAddr) -> IpAddr {
    // An IPv4 client of a `[::]` listener (::ffff:a.b.c.d) is keyed as
    // itself, not by the /64 every IPv4 client shares.
    match ip.to_canonical() {
        v4 @ IpAddr::V4(_) => v4,
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_locked_out_after_max_failures_and_ipv6_by_its_64() {
        let lockout = Lockout::new("a test call");
        let a: IpAddr = "2001:db8:1:2::10".parse().unwrap_or(IpAddr::from([0; 4]));
        let same_64: IpAddr = "2001:db8:1:2:ffff::1"
            .parse()
            .unwrap_or(IpAddr::from([0; 4]));
        let other: IpAddr = "192.0.2.7".parse().unwrap_or(IpAddr::from([0; 4]));
        for _ in 0..MAX_FAILURES - 1 {
            lockout.record_failure(Some(a), "bad token");
        }
        assert_eq!(lockout.locked_out(same_64), None);
        lockout.record_failure(Some(same_64), "bad token");
        assert!(lockout.locked_out(a).is_some());
        assert!(lockout.locked_out(same_64).is_some());
        assert_eq!(lockout.locked_out(other), None);
        let mapped: IpAddr = "::ffff:192.0.2.8".parse().unwrap_or(IpAddr::from([0; 4]));
        assert_eq!(
            lockout.locked_out(mapped),
            None,
            "IPv4 clients of an IPv6 listener do not share one key"
        );
        for _ in 0..MAX_FAILURES {
            lockout.record_failure(Some(mapped), "bad token");
        }
        assert!(
            lockout
                .locked_out("192.0.2.8".parse().unwrap_or(IpAddr::from([0; 4])))
                .is_some()
        );
        assert_eq!(
            lockout.locked_out("::ffff:192.0.2.9".parse().unwrap_or(IpAddr::from([0; 4]))),
            None
        );
    }
}
