//! The life of one alert: pending while its condition has held for less than
//! the rule's `for`, then firing, then resolved. Rules only say whether their
//! condition holds now; this state machine turns that into transitions.

use crate::config::Severity;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Inactive,
    Pending { since_ms: i64, severity: Severity },
    Firing { since_ms: i64, severity: Severity },
}

/// What changed at one evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The condition started to hold; waiting for `for` to pass.
    Pending { severity: Severity },
    /// The alert fires, or fires again at a higher severity.
    Firing { severity: Severity, escalated: bool },
    /// A pending alert's condition went away before it fired: nobody was told.
    Withdrawn,
    /// A firing alert's condition went away.
    Resolved,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    pub phase: Phase,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            phase: Phase::Inactive,
        }
    }
}

impl Lifecycle {
    pub fn is_active(&self) -> bool {
        self.phase != Phase::Inactive
    }

    /// Advances with the condition as evaluated at `now_ms`.
    pub fn step(
        &mut self,
        now_ms: i64,
        condition: Option<Severity>,
        for_ms: i64,
    ) -> Option<Transition> {
        match (self.phase, condition) {
            (Phase::Inactive, None) => None,
            (Phase::Inactive, Some(severity)) => {
                if for_ms <= 0 {
                    self.phase = Phase::Firing {
                        since_ms: now_ms,
                        severity,
                    };
                    Some(Transition::Firing {
                        severity,
                        escalated: false,
                    })
                } else {
                    self.phase = Phase::Pending {
                        since_ms: now_ms,
                        severity,
                    };
                    Some(Transition::Pending { severity })
                }
            }
            (Phase::Pending { .. }, None) => {
                self.phase = Phase::Inactive;
                Some(Transition::Withdrawn)
            }
            (
                Phase::Pending {
                    since_ms,
                    severity: held,
                },
                Some(severity),
            ) => {
                let severity = severity.max(held);
                if now_ms - since_ms >= for_ms {
                    self.phase = Phase::Firing { since_ms, severity };
                    Some(Transition::Firing {
                        severity,
                        escalated: false,
                    })
                } else {
                    self.phase = Phase::Pending { since_ms, severity };
                    None
                }
            }
            (Phase::Firing { .. }, None) => {
                self.phase = Phase::Inactive;
                Some(Transition::Resolved)
            }
            (
                Phase::Firing {
                    since_ms,
                    severity: held,
                },
                Some(severity),
            ) => {
                if severity > held {
                    self.phase = Phase::Firing { since_ms, severity };
                    Some(Transition::Firing {
                        severity,
                        escalated: true,
                    })
                } else {
                    None
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Severity::{Critical, Warning};

    #[test]
    fn fires_only_after_the_condition_held_for_the_whole_for() {
        let mut l = Lifecycle::default();
        assert_eq!(
            l.step(0, Some(Warning), 30_000),
            Some(Transition::Pending { severity: Warning })
        );
        assert_eq!(l.step(29_999, Some(Warning), 30_000), None);
        assert_eq!(
            l.step(30_000, Some(Warning), 30_000),
            Some(Transition::Firing {
                severity: Warning,
                escalated: false
            })
        );
        assert_eq!(l.step(31_000, Some(Warning), 30_000), None, "fires once");
        assert_eq!(l.step(32_000, None, 30_000), Some(Transition::Resolved));
        assert!(!l.is_active());
    }

    #[test]
    fn a_blip_shorter_than_for_is_withdrawn_silently() {
        let mut l = Lifecycle::default();
        l.step(0, Some(Critical), 30_000);
        assert_eq!(l.step(5_000, None, 30_000), Some(Transition::Withdrawn));
        assert_eq!(l.step(6_000, None, 30_000), None);
    }

    #[test]
    fn escalation_fires_again_but_de_escalation_does_not() {
        let mut l = Lifecycle::default();
        l.step(0, Some(Warning), 0);
        assert_eq!(
            l.step(1_000, Some(Critical), 0),
            Some(Transition::Firing {
                severity: Critical,
                escalated: true
            })
        );
        assert_eq!(l.step(2_000, Some(Warning), 0), None);
    }

    #[test]
    fn zero_for_fires_at_once() {
        let mut l = Lifecycle::default();
        assert_eq!(
            l.step(0, Some(Warning), 0),
            Some(Transition::Firing {
                severity: Warning,
                escalated: false
            })
        );
    }
}
