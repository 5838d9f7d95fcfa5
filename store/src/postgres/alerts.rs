//! Alerts, silences and the outbox on Postgres.

use async_trait::async_trait;
use sqlx::Row;

use super::PostgresStore;
use crate::StoreError;
use crate::alerts::{
    ACTIVE_ALERT_COUNTS_SQL, ActiveAlertCounts, AlertFilter, AlertOutcome, AlertStore, AlertUpdate,
    AlertView, NewSilence, OutboxItem, RowAction, SilenceView, decide,
};

const ALERT_COLUMNS: &str =
    "id, fingerprint, rule, severity, state, labels::jsonb AS labels, summary,
    details::jsonb AS details, started_at_ms, fired_at_ms, resolved_at_ms, updated_at_ms,
    acknowledged_by, acknowledged_at_ms, remedy";

#[async_trait]
impl AlertStore for PostgresStore {
    async fn apply_alert(&self, u: &AlertUpdate) -> Result<AlertOutcome, StoreError> {
        let mut tx = self.pool.begin().await?;
        let current = sqlx::query(
            "SELECT id, state, acknowledged_at_ms IS NOT NULL AS acked FROM alerts
             WHERE fingerprint = $1 AND state IN ('pending', 'firing') FOR UPDATE",
        )
        .bind(&u.fingerprint)
        .fetch_optional(&mut *tx)
        .await?;
        let current = match &current {
            Some(row) => Some((
                row.try_get::<i64, _>("id")?,
                row.try_get::<String, _>("state")?,
                row.try_get::<bool, _>("acked")?,
            )),
            None => None,
        };
        let action = decide(u.kind, current.as_ref().map(|(_, s, a)| (s.as_str(), *a)));
        let (alert_id, notify) = match action {
            RowAction::Nothing => {
                tx.rollback().await?;
                return Ok(AlertOutcome {
                    alert_id: None,
                    notified: false,
                });
            }
            RowAction::Insert {
                state,
                fired,
                notify,
            } => {
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO alerts (fingerprint, rule, severity, state, labels, summary, details, started_at_ms,
                         fired_at_ms, updated_at_ms, remedy)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $8, $10) RETURNING id",
                )
                .bind(&u.fingerprint)
                .bind(&u.rule)
                .bind(&u.severity)
                .bind(state)
                .bind(&u.labels)
                .bind(&u.summary)
                .bind(&u.details)
                .bind(u.at_ms)
                .bind(fired.then_some(u.at_ms))
                .bind(&u.remedy)
                .fetch_one(&mut *tx)
                .await?;
                (id, notify)
            }
            RowAction::Update {
                state,
                fired,
                resolved,
                notify,
            } => {
                let id = current.as_ref().map_or(0, |(id, _, _)| *id);
                // A resolution keeps the summary of what fired; the rest follows the latest evaluation.
                sqlx::query(
                    "UPDATE alerts SET state = $2, updated_at_ms = $3,
                         severity = CASE WHEN $6 THEN severity ELSE $4 END,
                         summary = CASE WHEN $6 THEN summary ELSE $5 END,
                         details = CASE WHEN $6 THEN details ELSE $7 END,
                         remedy = CASE WHEN $6 THEN remedy ELSE $9 END,
                         fired_at_ms = CASE WHEN $8 THEN $3 ELSE fired_at_ms END,
                         resolved_at_ms = CASE WHEN $6 THEN $3 ELSE resolved_at_ms END
                     WHERE id = $1",
                )
                .bind(id)
                .bind(state)
                .bind(u.at_ms)
                .bind(&u.severity)
                .bind(&u.summary)
                .bind(resolved)
                .bind(&u.details)
                .bind(fired)
                .bind(&u.remedy)
                .execute(&mut *tx)
                .await?;
                (id, notify)
            }
        };
        let notified = notify && !u.notifications.is_empty();
        if notified {
            for n in &u.notifications {
                sqlx::query(
                    "INSERT INTO outbox (alert_id, channel, idempotency_key, payload, created_at_ms, next_attempt_at_ms, group_key)
                     VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (idempotency_key) DO NOTHING",
                )
                .bind(alert_id)
                .bind(&n.channel)
                .bind(&n.idempotency_key)
                .bind(&n.payload)
                .bind(u.at_ms)
                .bind(n.deliver_at_ms)
                .bind(&n.group_key)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(AlertOutcome {
            alert_id: Some(alert_id),
            notified,
        })
    }

    async fn alerts(&self, filter: AlertFilter, limit: i64) -> Result<Vec<AlertView>, StoreError> {
        Ok(sqlx::query_as::<_, AlertView>(&format!(
            "SELECT {ALERT_COLUMNS} FROM alerts WHERE state IN {} ORDER BY updated_at_ms DESC, id DESC LIMIT $1",
            filter.sql_states()
        ))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    async fn acknowledge_alert(&self, id: i64, by: &str, now_ms: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE alerts SET acknowledged_by = $2, acknowledged_at_ms = $3
             WHERE id = $1 AND state IN ('pending', 'firing')",
        )
        .bind(id)
        .bind(by)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn create_silence(&self, s: &NewSilence, now_ms: i64) -> Result<i64, StoreError> {
        let matchers = serde_json::to_string(&s.matchers).unwrap_or_else(|_| "{}".into());
        Ok(sqlx::query_scalar(
            "INSERT INTO silences (matchers, comment, created_by, starts_at_ms, ends_at_ms)
             VALUES ($1, $2, $3, $4, $5) RETURNING id",
        )
        .bind(matchers)
        .bind(&s.comment)
        .bind(&s.created_by)
        .bind(now_ms)
        .bind(s.ends_at_ms)
        .fetch_one(&self.pool)
        .await?)
    }

    async fn silences(&self, now_ms: i64) -> Result<Vec<SilenceView>, StoreError> {
        Ok(sqlx::query_as::<_, SilenceView>(
            "SELECT id, matchers::jsonb AS matchers, comment, created_by, starts_at_ms, ends_at_ms
             FROM silences WHERE starts_at_ms <= $1 AND ends_at_ms > $1 ORDER BY id",
        )
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?)
    }

    async fn expire_silence(&self, id: i64, now_ms: i64) -> Result<bool, StoreError> {
        let done =
            sqlx::query("UPDATE silences SET ends_at_ms = $2 WHERE id = $1 AND ends_at_ms > $2")
                .bind(id)
                .bind(now_ms)
                .execute(&self.pool)
                .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn claim_notifications(
        &self,
        now_ms: i64,
        lease_ms: i64,
        limit: i64,
    ) -> Result<Vec<OutboxItem>, StoreError> {
        Ok(sqlx::query_as::<_, OutboxItem>(
            "UPDATE outbox SET next_attempt_at_ms = $1 + $2, attempts = attempts + 1
             WHERE id IN (SELECT id FROM outbox WHERE delivered_at_ms IS NULL AND next_attempt_at_ms <= $1
                          ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)
             RETURNING id, alert_id, created_at_ms, channel, idempotency_key, payload, attempts::int8 AS attempts, group_key",
        )
        .bind(now_ms)
        .bind(lease_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    async fn notifications_delivered(&self, ids: &[i64], now_ms: i64) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query("UPDATE outbox SET delivered_at_ms = $2, last_error = NULL WHERE id = ANY($1)")
            .bind(ids)
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn notification_failed(
        &self,
        id: i64,
        retry_at_ms: i64,
        error: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE outbox SET next_attempt_at_ms = $2, last_error = $3 WHERE id = $1")
            .bind(id)
            .bind(retry_at_ms)
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn undelivered_notifications(&self) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT COUNT(*) FROM outbox WHERE delivered_at_ms IS NULL")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn active_alert_counts(&self) -> Result<ActiveAlertCounts, StoreError> {
        Ok(sqlx::query_as(ACTIVE_ALERT_COUNTS_SQL)
            .fetch_one(&self.pool)
            .await?)
    }
}
