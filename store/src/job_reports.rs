//! Job memory reports: written once a job has ended, read by job id, and
//! sent to their owners' routes through the outbox. Both backends share one
//! implementation: the SQL reads the same in both.

use async_trait::async_trait;
use serde::Serialize;

use super::StoreError;

/// One job's report as one collector saw it on one node.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct JobReportRow {
    /// `slurm` or `pod`.
    pub kind: String,
    pub job_id: String,
    pub node: String,
    pub started_at_ms: i64,
    pub ended_at_ms: i64,
    /// JSON object.
    pub report: String,
}

#[async_trait]
pub trait JobReportStore: Send + Sync {
    /// Writes a report, replacing one with the same job, node and start, and
    /// queues `notifications` in the same transaction: each is queued once
    /// whatever the retries (its idempotency key is unique in the outbox),
    /// so a report reaches each channel exactly once. Their outbox rows have
    /// `alert_id` 0: they are no alert's.
    async fn save_job_report(
        &self,
        row: &JobReportRow,
        notifications: &[crate::alerts::NewNotification],
    ) -> Result<(), StoreError>;
    /// Every row of the Slurm job or pod with this id, oldest first.
    async fn job_reports(&self, job_id: &str) -> Result<Vec<JobReportRow>, StoreError>;
}

macro_rules! impl_job_report_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::job_reports::JobReportStore for $store {
            async fn save_job_report(
                &self,
                row: &$crate::job_reports::JobReportRow,
                notifications: &[$crate::alerts::NewNotification],
            ) -> Result<(), $crate::StoreError> {
                let mut tx = self.pool.begin().await?;
                sqlx::query(
                    "INSERT INTO job_reports (kind, job_id, node, started_at_ms, ended_at_ms, report)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (kind, job_id, node, started_at_ms)
                     DO UPDATE SET ended_at_ms = excluded.ended_at_ms, report = excluded.report",
                )
                .bind(&row.kind)
                .bind(&row.job_id)
                .bind(&row.node)
                .bind(row.started_at_ms)
                .bind(row.ended_at_ms)
                .bind(&row.report)
                .execute(&mut *tx)
                .await?;
                for n in notifications {
                    sqlx::query(
                        "INSERT INTO outbox (alert_id, channel, idempotency_key, payload, created_at_ms, next_attempt_at_ms, group_key)
                         VALUES (0, $1, $2, $3, $4, $4, $5) ON CONFLICT (idempotency_key) DO NOTHING",
                    )
                    .bind(&n.channel)
                    .bind(&n.idempotency_key)
                    .bind(&n.payload)
                    .bind(n.deliver_at_ms)
                    .bind(&n.group_key)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn job_reports(
                &self,
                job_id: &str,
            ) -> Result<Vec<$crate::job_reports::JobReportRow>, $crate::StoreError> {
                Ok(sqlx::query_as(
                    "SELECT kind, job_id, node, started_at_ms, ended_at_ms, report
                     FROM job_reports WHERE job_id = $1 ORDER BY started_at_ms, node",
                )
                .bind(job_id)
                .fetch_all(&self.pool)
                .await?)
            }
        }
    };
}

pub(crate) use impl_job_report_store;
