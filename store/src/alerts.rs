//! The alert half of the store: alert lifecycle rows, silences, and the
//! notification outbox.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::StoreError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKind {
    Pending,
    Firing { escalated: bool },
    Withdrawn,
    Resolved,
}

/// One notification to enqueue, already rendered for its channel.
#[derive(Debug, Clone, PartialEq)]
pub struct NewNotification {
    pub channel: String,
    pub idempotency_key: String,
    pub payload: String,
    /// Notifications of one channel and group that are due together go out
    /// as one message; empty for never grouped.
    pub group_key: String,
    /// Not sent before this time: a grouping wait lets companions arrive.
    pub deliver_at_ms: i64,
}

/// A rule's transition, to be applied to the alert's row.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertUpdate {
    pub fingerprint: String,
    pub rule: String,
    pub severity: String,
    pub kind: UpdateKind,
    pub at_ms: i64,
    /// JSON object.
    pub labels: String,
    pub summary: String,
    /// JSON object.
    pub details: String,
    /// What the job's owner can do about it; empty when the rule has no advice.
    pub remedy: String,
    /// Enqueued only when the transition is news to people: a first firing,
    /// an escalation not acknowledged, or the resolution of a notified alert.
    pub notifications: Vec<NewNotification>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlertOutcome {
    pub alert_id: Option<i64>,
    pub notified: bool,
}

/// Which alerts to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertFilter {
    /// Pending and firing.
    Active,
    Pending,
    Firing,
    Resolved,
}

impl AlertFilter {
    /// The matching states as an SQL list; constants, never user input.
    pub(crate) fn sql_states(self) -> &'static str {
        match self {
            Self::Active => "('pending', 'firing')",
            Self::Pending => "('pending')",
            Self::Firing => "('firing')",
            Self::Resolved => "('resolved')",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct AlertView {
    pub id: i64,
    pub fingerprint: String,
    pub rule: String,
    pub severity: String,
    pub state: String,
    #[sqlx(json)]
    pub labels: serde_json::Value,
    pub summary: String,
    #[sqlx(json)]
    pub details: serde_json::Value,
    pub started_at_ms: i64,
    pub fired_at_ms: Option<i64>,
    pub resolved_at_ms: Option<i64>,
    pub updated_at_ms: i64,
    pub acknowledged_by: Option<String>,
    pub acknowledged_at_ms: Option<i64>,
    /// What the job's owner can do about it; empty when the rule has no advice.
    pub remedy: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSilence {
    /// Label → exact value; an alert is silenced when every matcher matches.
    pub matchers: std::collections::BTreeMap<String, String>,
    pub comment: String,
    /// Over the API, a signed-in user's own name replaces it.
    #[serde(default)]
    pub created_by: String,
    pub ends_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SilenceView {
    pub id: i64,
    #[sqlx(json)]
    pub matchers: serde_json::Value,
    pub comment: String,
    pub created_by: String,
    pub starts_at_ms: i64,
    pub ends_at_ms: i64,
}

impl SilenceView {
    pub fn matches(&self, labels: &serde_json::Map<String, serde_json::Value>) -> bool {
        match self.matchers.as_object() {
            Some(m) if !m.is_empty() => m.iter().all(|(k, v)| labels.get(k) == Some(v)),
            _ => false,
        }
    }
}

/// A claimed notification, leased to this collector until it reports back.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct OutboxItem {
    pub id: i64,
    /// The alert it announces (0 for a job's memory report):
    /// notifications of one alert are sent in order, those of different
    /// alerts side by side.
    pub alert_id: i64,
    /// The time of the sample that changed the alert (for a job report,
    /// when it was due).
    pub created_at_ms: i64,
    pub channel: String,
    pub idempotency_key: String,
    pub payload: String,
    pub attempts: i64,
    pub group_key: String,
}

#[async_trait]
pub trait AlertStore: Send + Sync {
    /// Applies a transition atomically: the alert row and, when the change is
    /// news, its notifications in the same transaction.
    async fn apply_alert(&self, update: &AlertUpdate) -> Result<AlertOutcome, StoreError>;
    async fn alerts(&self, filter: AlertFilter, limit: i64) -> Result<Vec<AlertView>, StoreError>;
    async fn acknowledge_alert(&self, id: i64, by: &str, now_ms: i64) -> Result<bool, StoreError>;
    async fn create_silence(&self, silence: &NewSilence, now_ms: i64) -> Result<i64, StoreError>;
    /// Silences in force at `now_ms`.
    async fn silences(&self, now_ms: i64) -> Result<Vec<SilenceView>, StoreError>;
    async fn expire_silence(&self, id: i64, now_ms: i64) -> Result<bool, StoreError>;
    /// Due notifications, each leased for `lease_ms` so that no other
    /// collector sends it meanwhile; counts the attempt.
    async fn claim_notifications(
        &self,
        now_ms: i64,
        lease_ms: i64,
        limit: i64,
    ) -> Result<Vec<OutboxItem>, StoreError>;
    /// Marks `ids` delivered at `now_ms`, in one write.
    async fn notifications_delivered(&self, ids: &[i64], now_ms: i64) -> Result<(), StoreError>;
    async fn notification_failed(
        &self,
        id: i64,
        retry_at_ms: i64,
        error: &str,
    ) -> Result<(), StoreError>;
    /// Notifications not yet delivered.
    async fn undelivered_notifications(&self) -> Result<i64, StoreError>;
    /// How many alerts are pending and how many firing, counted in the
    /// database (an alert storm must not make a scrape load every row).
    async fn active_alert_counts(&self) -> Result<ActiveAlertCounts, StoreError>;
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ActiveAlertCounts {
    pub pending: i64,
    pub firing: i64,
}

/// Shared by both backends: plain SQL both dialects read the same way.
pub(crate) const ACTIVE_ALERT_COUNTS_SQL: &str = "SELECT
        COALESCE(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END), 0) AS pending,
        COALESCE(SUM(CASE WHEN state = 'firing' THEN 1 ELSE 0 END), 0) AS firing
     FROM alerts WHERE state IN ('pending', 'firing')";

/// What the store decides for a transition given the alert's current row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowAction {
    Insert {
        state: &'static str,
        fired: bool,
        notify: bool,
    },
    Update {
        state: &'static str,
        fired: bool,
        resolved: bool,
        notify: bool,
    },
    Nothing,
}

/// The lifecycle rules shared by both backends. `current` is the active row's
/// state and whether it was acknowledged.
pub(crate) fn decide(kind: UpdateKind, current: Option<(&str, bool)>) -> RowAction {
    match (kind, current) {
        (UpdateKind::Pending, None) => RowAction::Insert {
            state: "pending",
            fired: false,
            notify: false,
        },
        (UpdateKind::Pending, Some(_)) => RowAction::Update {
            state: "pending",
            fired: false,
            resolved: false,
            notify: false,
        },
        (UpdateKind::Firing { .. }, None) => RowAction::Insert {
            state: "firing",
            fired: true,
            notify: true,
        },
        (UpdateKind::Firing { .. }, Some(("pending", _))) => RowAction::Update {
            state: "firing",
            fired: true,
            resolved: false,
            notify: true,
        },
        (UpdateKind::Firing { escalated }, Some((_, acknowledged))) => RowAction::Update {
            state: "firing",
            fired: false,
            resolved: false,
            notify: escalated && !acknowledged,
        },
        (UpdateKind::Withdrawn, Some(("pending", _))) => RowAction::Update {
            state: "withdrawn",
            fired: false,
            resolved: true,
            notify: false,
        },
        (UpdateKind::Resolved | UpdateKind::Withdrawn, Some(("firing", _))) => RowAction::Update {
            state: "resolved",
            fired: false,
            resolved: true,
            notify: true,
        },
        (UpdateKind::Withdrawn | UpdateKind::Resolved, _) => RowAction::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_firing_alert_is_announced_once_and_its_resolution_once() {
        assert!(matches!(
            decide(UpdateKind::Firing { escalated: false }, None),
            RowAction::Insert { notify: true, .. }
        ));
        assert!(matches!(
            decide(
                UpdateKind::Firing { escalated: false },
                Some(("firing", false))
            ),
            RowAction::Update { notify: false, .. }
        ));
        assert!(matches!(
            decide(UpdateKind::Resolved, Some(("firing", false))),
            RowAction::Update { notify: true, .. }
        ));
        assert_eq!(decide(UpdateKind::Resolved, None), RowAction::Nothing);
    }

    #[test]
    fn escalation_is_announced_unless_acknowledged() {
        assert!(matches!(
            decide(
                UpdateKind::Firing { escalated: true },
                Some(("firing", false))
            ),
            RowAction::Update { notify: true, .. }
        ));
        assert!(matches!(
            decide(
                UpdateKind::Firing { escalated: true },
                Some(("firing", true))
            ),
            RowAction::Update { notify: false, .. }
        ));
    }

    #[test]
    fn pending_that_never_fired_is_withdrawn_quietly() {
        assert!(matches!(
            decide(UpdateKind::Pending, None),
            RowAction::Insert { notify: false, .. }
        ));
        assert!(matches!(
            decide(UpdateKind::Withdrawn, Some(("pending", false))),
            RowAction::Update {
                state: "withdrawn",
                notify: false,
                ..
            }
        ));
    }
}
