//! An alert as the rules and the engine share it: the handle a rule judges
//! its alert through ([`Alert`]), what that handle records when the alert
//! changes ([`AlertChange`]), the identity that survives restarts
//! ([`fingerprint`], [`RestoredAlert`]) and what a rule says ([`Message`]).
//! It stands below both: rules judge through it, the engine creates it, and
//! it knows neither the catalogue nor any rule.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use crate::config::Severity;
use crate::lifecycle::{Lifecycle, Phase, Transition};

/// What an alert says when it changes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Message {
    pub summary: String,
    pub details: serde_json::Value,
}

impl Message {
    pub(crate) fn new(summary: String, details: serde_json::Value) -> Self {
        Self { summary, details }
    }
}

/// A transition of one alert, with everything a notification needs.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertChange {
    /// Stable across restarts and collectors: rule plus the series identity.
    pub fingerprint: String,
    pub rule: &'static str,
    pub transition: Transition,
    pub severity: Severity,
    pub at_ms: i64,
    pub labels: BTreeMap<String, String>,
    pub summary: String,
    pub details: serde_json::Value,
    /// What the job's owner can do about it; empty when the rule has none.
    pub remedy: String,
}

/// An alert the store holds as active, handed back after a restart so the
/// engine neither forgets it nor fires it twice.
#[derive(Debug, Clone)]
pub struct RestoredAlert {
    pub fingerprint: String,
    pub rule: String,
    pub severity: Severity,
    pub firing: bool,
    pub since_ms: i64,
    pub labels: BTreeMap<String, String>,
}

pub fn fingerprint(rule: &str, identity: &[(&str, &str)]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(rule.as_bytes());
    for (k, v) in identity {
        hasher.update(b"\n");
        hasher.update(k.as_bytes());
        hasher.update(b"=");
        hasher.update(v.as_bytes());
    }
    hasher.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An alert's identity and where it stands in its lifecycle.
#[derive(Debug)]
pub(crate) struct Tracked {
    fingerprint: String,
    lifecycle: Lifecycle,
}

impl Tracked {
    /// Pending or firing.
    pub(crate) fn is_active(&self) -> bool {
        self.lifecycle.is_active()
    }

    pub(crate) fn new(fingerprint: String, restored: &mut HashMap<String, RestoredAlert>) -> Self {
        let lifecycle = match restored.remove(&fingerprint) {
            Some(r) if r.firing => Lifecycle {
                phase: Phase::Firing {
                    since_ms: r.since_ms,
                    severity: r.severity,
                },
            },
            Some(r) => Lifecycle {
                phase: Phase::Pending {
                    since_ms: r.since_ms,
                    severity: r.severity,
                },
            },
            None => Lifecycle::default(),
        };
        Self {
            fingerprint,
            lifecycle,
        }
    }
}

/// One rule's alert on one series, as the rule sees it while judging. The
/// rule reports its condition; stepping the lifecycle, and turning a step
/// into an [`AlertChange`], stays here, so no rule can skip the `for`, fire
/// twice or resolve with the wrong severity.
#[derive(Debug)]
pub(crate) struct Alert<'a> {
    rule: &'static str,
    tracked: &'a mut Tracked,
    labels: &'a BTreeMap<String, String>,
    out: &'a mut Vec<AlertChange>,
}

impl<'a> Alert<'a> {
    pub(crate) fn new(
        rule: &'static str,
        tracked: &'a mut Tracked,
        labels: &'a BTreeMap<String, String>,
        out: &'a mut Vec<AlertChange>,
    ) -> Self {
        Self {
            rule,
            tracked,
            labels,
            out,
        }
    }

    /// Pending or firing: rules hold an alert up on a weaker condition than
    /// the one that raised it (hysteresis).
    pub(crate) fn is_active(&self) -> bool {
        self.tracked.lifecycle.is_active()
    }

    /// The series' labels, for the message; they outlive the handle so a
    /// message closure can hold them while the alert steps.
    pub(crate) fn labels(&self) -> &'a BTreeMap<String, String> {
        self.labels
    }

    /// Steps the lifecycle with the condition as it holds at `at_ms`. The
    /// message is built only when the alert changes.
    pub(crate) fn step(
        &mut self,
        at_ms: i64,
        condition: Option<Severity>,
        for_ms: i64,
        message: impl FnOnce() -> Message,
    ) {
        self.step_with_remedy(at_ms, condition, for_ms, message, String::new);
    }

    /// As [`Alert::step`], with advice for the job's owner.
    pub(crate) fn step_with_remedy(
        &mut self,
        at_ms: i64,
        condition: Option<Severity>,
        for_ms: i64,
        message: impl FnOnce() -> Message,
        remedy: impl FnOnce() -> String,
    ) {
        let lifecycle = &mut self.tracked.lifecycle;
        let before = lifecycle.phase;
        let Some(transition) = lifecycle.step(at_ms, condition, for_ms) else {
            return;
        };
        // A resolution carries the severity it fired with, so it reaches
        // the same channels the firing did.
        let severity = match (lifecycle.phase, before) {
            (Phase::Pending { severity, .. } | Phase::Firing { severity, .. }, _)
            | (Phase::Inactive, Phase::Pending { severity, .. } | Phase::Firing { severity, .. }) => {
                severity
            }
            (Phase::Inactive, Phase::Inactive) => condition.unwrap_or(Severity::Info),
        };
        let Message { summary, details } = message();
        // Advice goes with a pending or firing alert, not with its resolution.
        let remedy = match transition {
            Transition::Pending { .. } | Transition::Firing { .. } => remedy(),
            Transition::Withdrawn | Transition::Resolved => String::new(),
        };
        self.out.push(AlertChange {
            fingerprint: self.tracked.fingerprint.clone(),
            rule: self.rule,
            transition,
            severity,
            at_ms,
            labels: self.labels.clone(),
            summary,
            details,
            remedy,
        });
    }
}
