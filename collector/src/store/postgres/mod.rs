//! Postgres: the production store. A batch is one transaction whose first
//! statement claims its seq, and whose inserts send whole columns as arrays
//! (`UNNEST`), one round trip per table rather than one per row.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

mod alerts;

use crate::model::{
    AllocatorRow, NodeSession, ProcessSampleRow, Registration, StoreBatch, WriteOutcome,
};
use crate::store::{
    AllocatorPoint, AllocatorSeries, AllocatorSeriesQuery, DeviceRow, DeviceView, EventView,
    NodeView, PROCESS_COLUMNS, ProcessBucket, ProcessKey, ProcessMeta, ProcessRow, ProcessSeries,
    ProcessView, SeriesPoint, SessionDevice, Store, StoreError, bucket_width_ms,
    process_series_from, session_from,
};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// The store's id of device `uuid`, for the reads that take a UUID.
    async fn device_id(&self, uuid: &str) -> Result<Option<i32>, StoreError> {
        Ok(sqlx::query_scalar("SELECT id FROM devices WHERE uuid = $1")
            .bind(uuid)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Every device the node ever registered, present or not: a batch sampled
/// before a MIG reconfiguration may arrive after it and still names the old
/// instances.
async fn load_session(
    tx: &mut Transaction<'_, Postgres>,
    node_id: i64,
    node: &str,
    boot_id: &str,
    committed_seq: i64,
) -> Result<NodeSession, StoreError> {
    let rows = sqlx::query_as::<_, SessionDevice>(
        "SELECT id::int8 AS id, uuid, gpu_index::int8 AS gpu_index, mig_profile, parent_id::int8 AS parent_id
             FROM devices WHERE node_id = $1",
    )
    .bind(node_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(session_from(node_id, node, boot_id, committed_seq, rows))
}

#[async_trait]
impl Store for PostgresStore {
    async fn register(&self, reg: &Registration, now_ms: i64) -> Result<NodeSession, StoreError> {
        let mut tx = self.pool.begin().await?;
        let node_id: i64 = sqlx::query_scalar(
            "INSERT INTO nodes (name, boot_id, agent_version, driver_version, sample_interval_ms, registered_at_ms, last_seen_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $6)
             ON CONFLICT (name) DO UPDATE SET boot_id = EXCLUDED.boot_id, agent_version = EXCLUDED.agent_version,
                 driver_version = EXCLUDED.driver_version, sample_interval_ms = EXCLUDED.sample_interval_ms,
                 registered_at_ms = EXCLUDED.registered_at_ms, last_seen_ms = GREATEST(nodes.last_seen_ms, EXCLUDED.last_seen_ms)
             RETURNING id",
        )
        .bind(&reg.node)
        .bind(&reg.boot_id)
        .bind(&reg.agent_version)
        .bind(&reg.driver_version)
        .bind(i32::try_from(reg.sample_interval_ms).unwrap_or(i32::MAX))
        .bind(now_ms)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO agent_boots (node_id, boot_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .execute(&mut *tx)
        .await?;
        let committed: i64 = sqlx::query_scalar(
            "SELECT committed_seq FROM agent_boots WHERE node_id = $1 AND boot_id = $2",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query("UPDATE devices SET present = FALSE WHERE node_id = $1")
            .bind(node_id)
            .execute(&mut *tx)
            .await?;
        let mut ids: HashMap<&str, i32> = HashMap::new();
        for d in &reg.devices {
            let parent_id = d.parent_uuid.as_deref().and_then(|p| ids.get(p).copied());
            let mig = d.mig.as_ref();
            let id: i32 = sqlx::query_scalar(
                "INSERT INTO devices (uuid, node_id, parent_id, gpu_index, name, memory_total, pcie_generation, pcie_width,
                     mig_gpu_instance_id, mig_compute_instance_id, mig_profile, present)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, TRUE)
                 ON CONFLICT (uuid) DO UPDATE SET node_id = EXCLUDED.node_id, parent_id = EXCLUDED.parent_id,
                     gpu_index = EXCLUDED.gpu_index, name = EXCLUDED.name, memory_total = EXCLUDED.memory_total,
                     pcie_generation = EXCLUDED.pcie_generation, pcie_width = EXCLUDED.pcie_width,
                     mig_gpu_instance_id = EXCLUDED.mig_gpu_instance_id,
                     mig_compute_instance_id = EXCLUDED.mig_compute_instance_id,
                     mig_profile = EXCLUDED.mig_profile, present = TRUE
                 RETURNING id",
            )
            .bind(&d.uuid)
            .bind(node_id)
            .bind(parent_id)
            .bind(i32::try_from(d.index).unwrap_or(i32::MAX))
            .bind(&d.name)
            .bind(d.memory_total)
            .bind(i32::try_from(d.pcie_generation).unwrap_or(0))
            .bind(i32::try_from(d.pcie_width).unwrap_or(0))
            .bind(mig.map(|m| i32::try_from(m.gpu_instance_id).unwrap_or(i32::MAX)))
            .bind(mig.map(|m| i32::try_from(m.compute_instance_id).unwrap_or(i32::MAX)))
            .bind(mig.map(|m| m.profile.as_str()))
            .fetch_one(&mut *tx)
            .await?;
            ids.insert(&d.uuid, id);
        }
        let session = load_session(&mut tx, node_id, &reg.node, &reg.boot_id, committed).await?;
        tx.commit().await?;
        Ok(session)
    }

    async fn session(&self, node: &str, boot_id: &str) -> Result<Option<NodeSession>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT n.id, b.committed_seq FROM nodes n JOIN agent_boots b ON b.node_id = n.id
             WHERE n.name = $1 AND b.boot_id = $2",
        )
        .bind(node)
        .bind(boot_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let session = load_session(
            &mut tx,
            row.try_get("id")?,
            node,
            boot_id,
            row.try_get("committed_seq")?,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(session))
    }

    async fn write_batch(&self, batch: &StoreBatch) -> Result<WriteOutcome, StoreError> {
        let seq = i64::try_from(batch.seq).unwrap_or(i64::MAX);
        let mut tx = self.pool.begin().await?;
        // Claiming the seq first takes the boot's row lock, so two copies of one
        // batch arriving at two collectors cannot both be written.
        let claimed = sqlx::query(
            "UPDATE agent_boots SET committed_seq = $3 WHERE node_id = $1 AND boot_id = $2 AND committed_seq < $3",
        )
        .bind(batch.node_id)
        .bind(&batch.boot_id)
        .bind(seq)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if claimed == 0 {
            let committed: Option<i64> = sqlx::query_scalar(
                "SELECT committed_seq FROM agent_boots WHERE node_id = $1 AND boot_id = $2",
            )
            .bind(batch.node_id)
            .bind(&batch.boot_id)
            .fetch_optional(&mut *tx)
            .await?;
            tx.rollback().await?;
            return Ok(WriteOutcome::Duplicate {
                committed_seq: committed.and_then(|c| u64::try_from(c).ok()).unwrap_or(0),
            });
        }

        if !batch.gpu_samples.is_empty() {
            let s = &batch.gpu_samples;
            let device: Vec<i32> = s.iter().map(|r| r.device_id as i32).collect();
            let ts: Vec<i64> = s.iter().map(|r| r.timestamp_ms).collect();
            let interval: Vec<i32> = s.iter().map(|r| r.interval_ms).collect();
            let polls: Vec<i32> = s.iter().map(|r| r.poll_count).collect();
            let last: Vec<i64> = s.iter().map(|r| r.used_last).collect();
            let min: Vec<i64> = s.iter().map(|r| r.used_min).collect();
            let max: Vec<i64> = s.iter().map(|r| r.used_max).collect();
            let reserved: Vec<i64> = s.iter().map(|r| r.reserved).collect();
            let total: Vec<i64> = s.iter().map(|r| r.total).collect();
            let util: Vec<Option<i16>> = s.iter().map(|r| r.utilization_pct).collect();
            let tx_rate: Vec<Option<i64>> = s.iter().map(|r| r.pcie_tx_bytes_per_s).collect();
            let rx_rate: Vec<Option<i64>> = s.iter().map(|r| r.pcie_rx_bytes_per_s).collect();
            sqlx::query(
                "INSERT INTO gpu_samples (device_id, ts_ms, interval_ms, poll_count, used_last, used_min, used_max,
                     reserved, total, utilization, pcie_tx, pcie_rx)
                 SELECT * FROM UNNEST($1::int4[], $2::int8[], $3::int4[], $4::int4[], $5::int8[], $6::int8[], $7::int8[],
                     $8::int8[], $9::int8[], $10::int2[], $11::int8[], $12::int8[])",
            )
            .bind(&device)
            .bind(&ts)
            .bind(&interval)
            .bind(&polls)
            .bind(&last)
            .bind(&min)
            .bind(&max)
            .bind(&reserved)
            .bind(&total)
            .bind(&util)
            .bind(&tx_rate)
            .bind(&rx_rate)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "INSERT INTO gpu_latest (device_id, ts_ms, used_last, used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx)
                 SELECT DISTINCT ON (d) d, t, l, mi, ma, r, tot, u, tr, rr
                 FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
                     $8::int2[], $9::int8[], $10::int8[]) AS s(d, t, l, mi, ma, r, tot, u, tr, rr)
                 ORDER BY d, t DESC
                 ON CONFLICT (device_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, used_last = EXCLUDED.used_last,
                     used_min = EXCLUDED.used_min, used_max = EXCLUDED.used_max, reserved = EXCLUDED.reserved,
                     total = EXCLUDED.total, utilization = EXCLUDED.utilization, pcie_tx = EXCLUDED.pcie_tx,
                     pcie_rx = EXCLUDED.pcie_rx
                 WHERE gpu_latest.ts_ms <= EXCLUDED.ts_ms",
            )
            .bind(&device)
            .bind(&ts)
            .bind(&last)
            .bind(&min)
            .bind(&max)
            .bind(&reserved)
            .bind(&total)
            .bind(&util)
            .bind(&tx_rate)
            .bind(&rx_rate)
            .execute(&mut *tx)
            .await?;
        }

        if !batch.process_samples.is_empty() {
            let p = &batch.process_samples;
            let device: Vec<i32> = p.iter().map(|r| r.device_id as i32).collect();
            let pid: Vec<i64> = p.iter().map(|r| r.pid).collect();
            let start: Vec<i64> = p.iter().map(|r| r.start_time_ms).collect();
            let ts: Vec<i64> = p.iter().map(|r| r.timestamp_ms).collect();
            let last: Vec<i64> = p.iter().map(|r| r.used_last).collect();
            let max: Vec<i64> = p.iter().map(|r| r.used_max).collect();
            let name: Vec<&str> = p.iter().map(|r| r.name.as_str()).collect();
            let uid: Vec<i64> = p.iter().map(|r| r.uid).collect();
            let user: Vec<&str> = p.iter().map(|r| r.user.as_str()).collect();
            let container: Vec<&str> = p.iter().map(|r| r.container_id.as_str()).collect();
            let pod: Vec<&str> = p.iter().map(|r| r.pod_uid.as_str()).collect();
            let job: Vec<&str> = p.iter().map(|r| r.slurm_job_id.as_str()).collect();
            let runtime: Vec<&str> = p.iter().map(|r| r.container_runtime.as_str()).collect();
            let qos: Vec<&str> = p.iter().map(|r| r.pod_qos_class.as_str()).collect();
            sqlx::query(
                "INSERT INTO processes AS p (device_id, pid, start_time_ms, name, uid, user_name, container_id, pod_uid,
                     slurm_job_id, container_runtime, pod_qos_class, first_seen_ms, last_seen_ms, memory_last, memory_peak)
                 SELECT DISTINCT ON (d, pid, st) d, pid, st, n, u, un, c, pod, j, rt, q, t, t, l, m
                 FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::text[],
                     $8::int8[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[])
                     AS s(d, pid, st, t, l, m, n, u, un, c, pod, j, rt, q)
                 ORDER BY d, pid, st, t DESC
                 ON CONFLICT (device_id, pid, start_time_ms) DO UPDATE SET
                     name = EXCLUDED.name, uid = EXCLUDED.uid, user_name = EXCLUDED.user_name,
                     container_id = EXCLUDED.container_id, pod_uid = EXCLUDED.pod_uid, slurm_job_id = EXCLUDED.slurm_job_id,
                     container_runtime = EXCLUDED.container_runtime, pod_qos_class = EXCLUDED.pod_qos_class,
                     first_seen_ms = LEAST(p.first_seen_ms, EXCLUDED.first_seen_ms),
                     memory_last = CASE WHEN EXCLUDED.last_seen_ms >= p.last_seen_ms THEN EXCLUDED.memory_last ELSE p.memory_last END,
                     last_seen_ms = GREATEST(p.last_seen_ms, EXCLUDED.last_seen_ms),
                     memory_peak = GREATEST(p.memory_peak, EXCLUDED.memory_peak)",
            )
            .bind(&device)
            .bind(&pid)
            .bind(&start)
            .bind(&ts)
            .bind(&last)
            .bind(&max)
            .bind(&name)
            .bind(&uid)
            .bind(&user)
            .bind(&container)
            .bind(&pod)
            .bind(&job)
            .bind(&runtime)
            .bind(&qos)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "INSERT INTO process_samples (process_id, ts_ms, used_last, used_max)
                 SELECT p.id, s.t, s.l, s.m
                 FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[]) AS s(d, pid, st, t, l, m)
                 JOIN processes p ON p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st",
            )
            .bind(&device)
            .bind(&pid)
            .bind(&start)
            .bind(&ts)
            .bind(&last)
            .bind(&max)
            .execute(&mut *tx)
            .await?;
            write_allocator_samples(&mut tx, p).await?;
        }

        if !batch.events.is_empty() {
            let e = &batch.events;
            let device: Vec<Option<i32>> =
                e.iter().map(|r| r.device_id.map(|d| d as i32)).collect();
            let ts: Vec<i64> = e.iter().map(|r| r.timestamp_ms).collect();
            let kind: Vec<&str> = e.iter().map(|r| r.kind).collect();
            let code: Vec<i64> = e.iter().map(|r| r.code).collect();
            let pid: Vec<i64> = e.iter().map(|r| r.pid).collect();
            let detail: Vec<&str> = e.iter().map(|r| r.detail.as_str()).collect();
            sqlx::query(
                "INSERT INTO events (node_id, device_id, ts_ms, kind, code, pid, detail)
                 SELECT $1, * FROM UNNEST($2::int4[], $3::int8[], $4::text[], $5::int8[], $6::int8[], $7::text[])",
            )
            .bind(batch.node_id)
            .bind(&device)
            .bind(&ts)
            .bind(&kind)
            .bind(&code)
            .bind(&pid)
            .bind(&detail)
            .execute(&mut *tx)
            .await?;
        }

        if let Some(newest) = batch.newest_timestamp_ms() {
            sqlx::query("UPDATE nodes SET last_seen_ms = GREATEST(last_seen_ms, $2) WHERE id = $1")
                .bind(batch.node_id)
                .bind(newest)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(WriteOutcome::Committed)
    }

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError> {
        Ok(sqlx::query_as::<_, NodeView>(
            "SELECT n.name, n.boot_id, n.agent_version, n.driver_version, n.sample_interval_ms::int8 AS sample_interval_ms,
                 n.registered_at_ms, n.last_seen_ms,
                 COUNT(d.id) FILTER (WHERE d.parent_id IS NULL) AS gpu_count,
                 COUNT(d.id) FILTER (WHERE d.parent_id IS NOT NULL) AS mig_instance_count
             FROM nodes n LEFT JOIN devices d ON d.node_id = n.id AND d.present
             GROUP BY n.id ORDER BY n.name",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    async fn latest_devices(&self) -> Result<Vec<DeviceView>, StoreError> {
        let rows = sqlx::query_as::<_, DeviceRow>(
            "SELECT d.uuid, n.name AS node, p.uuid AS parent_uuid, d.gpu_index::int8 AS gpu_index, d.name,
                 d.mig_profile, d.mig_gpu_instance_id::int8 AS mig_gpu_instance_id,
                 d.mig_compute_instance_id::int8 AS mig_compute_instance_id, d.memory_total,
                 l.ts_ms, l.used_last, l.used_min, l.used_max, l.reserved, l.total, l.utilization::int8 AS utilization,
                 l.pcie_tx, l.pcie_rx
             FROM devices d JOIN nodes n ON n.id = d.node_id
             LEFT JOIN devices p ON p.id = d.parent_id
             LEFT JOIN gpu_latest l ON l.device_id = d.id
             WHERE d.present
             ORDER BY n.name, d.gpu_index, d.parent_id NULLS FIRST, d.mig_gpu_instance_id, d.mig_compute_instance_id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(DeviceView::from).collect())
    }

    async fn device_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<SeriesPoint>>, StoreError> {
        let Some(device) = self.device_id(uuid).await? else {
            return Ok(None);
        };
        let points = sqlx::query_as::<_, SeriesPoint>(
            "SELECT MAX(ts_ms) AS timestamp_ms, COUNT(*) AS samples,
                 ROUND(AVG(used_last))::int8 AS memory_used_bytes, MIN(used_min) AS memory_used_min_bytes,
                 MAX(used_max) AS memory_used_max_bytes, MAX(reserved) AS memory_reserved_bytes,
                 MAX(total) AS memory_total_bytes, AVG(utilization)::float8 AS utilization_pct,
                 ROUND(AVG(pcie_tx))::int8 AS pcie_tx_bytes_per_s, ROUND(AVG(pcie_rx))::int8 AS pcie_rx_bytes_per_s
             FROM gpu_samples WHERE device_id = $1 AND ts_ms BETWEEN $2 AND $3
             GROUP BY (ts_ms - $2) / $4 ORDER BY 1",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .bind(bucket_width_ms(from_ms, to_ms, max_points))
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(points))
    }

    async fn processes(&self, since_ms: i64) -> Result<Vec<ProcessView>, StoreError> {
        let rows = sqlx::query_as::<_, ProcessRow>(&format!(
            "SELECT n.name AS node, d.uuid AS device_uuid, d.gpu_index::int8 AS gpu_index, {PROCESS_COLUMNS}
             FROM processes p JOIN devices d ON d.id = p.device_id JOIN nodes n ON n.id = d.node_id
             WHERE p.last_seen_ms >= $1
             ORDER BY p.memory_last DESC, n.name, p.pid"
        ))
        .bind(since_ms)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(ProcessView::from).collect())
    }

    async fn process_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<ProcessSeries>>, StoreError> {
        let Some(device) = self.device_id(uuid).await? else {
            return Ok(None);
        };
        let meta = sqlx::query_as::<_, ProcessMeta>(
            "SELECT id, pid, start_time_ms, name, user_name AS user, slurm_job_id, pod_uid FROM processes
             WHERE device_id = $1 AND last_seen_ms >= $2 AND first_seen_ms <= $3",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&self.pool)
        .await?;
        let buckets = sqlx::query_as::<_, ProcessBucket>(
            "SELECT s.process_id, LEAST($3, $2 + ((s.ts_ms - $2) / $4 + 1) * $4 - 1) AS timestamp_ms, MAX(s.used_max) AS used
             FROM process_samples s JOIN processes p ON p.id = s.process_id
             WHERE p.device_id = $1 AND p.last_seen_ms >= $2 AND p.first_seen_ms <= $3
                 AND s.ts_ms BETWEEN $2 AND $3
             GROUP BY s.process_id, (s.ts_ms - $2) / $4",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .bind(bucket_width_ms(from_ms, to_ms, max_points))
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(process_series_from(meta, buckets)))
    }

    async fn device_events(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        limit: i64,
    ) -> Result<Option<Vec<EventView>>, StoreError> {
        let Some(device) = self.device_id(uuid).await? else {
            return Ok(None);
        };
        Ok(Some(
            sqlx::query_as::<_, EventView>(
                "SELECT ts_ms AS timestamp_ms, kind, code, pid, detail FROM events
                 WHERE device_id = $1 AND ts_ms BETWEEN $2 AND $3
                 ORDER BY ts_ms DESC LIMIT $4",
            )
            .bind(device)
            .bind(from_ms)
            .bind(to_ms)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?,
        ))
    }

    async fn allocator_series(
        &self,
        q: &AllocatorSeriesQuery<'_>,
    ) -> Result<Option<AllocatorSeries>, StoreError> {
        let process = sqlx::query_as::<_, ProcessKey>(
            "SELECT p.id, p.start_time_ms FROM processes p JOIN devices d ON d.id = p.device_id
             WHERE d.uuid = $1 AND p.pid = $2 AND ($3::int8 IS NULL OR p.start_time_ms = $3)
             ORDER BY p.start_time_ms DESC LIMIT 1",
        )
        .bind(q.device_uuid)
        .bind(q.pid)
        .bind(q.start_time_ms)
        .fetch_optional(&self.pool)
        .await?;
        let Some(process) = process else {
            return Ok(None);
        };
        let points = sqlx::query_as::<_, AllocatorPoint>(
            "SELECT MAX(ts_ms) AS timestamp_ms, COUNT(*) AS reports, MAX(allocated) AS allocated_bytes,
                 MAX(reserved) AS reserved_bytes, MAX(reserved - allocated) AS fragmentation_bytes,
                 MAX(inactive_split) AS inactive_split_bytes, MAX(peak_allocated) AS peak_allocated_bytes,
                 MAX(alloc_retries) AS alloc_retries, MAX(ooms) AS ooms
             FROM allocator_samples WHERE process_id = $1 AND ts_ms BETWEEN $2 AND $3
             GROUP BY (ts_ms - $2) / $4 ORDER BY 1",
        )
        .bind(process.id)
        .bind(q.from_ms)
        .bind(q.to_ms)
        .bind(bucket_width_ms(q.from_ms, q.to_ms, q.max_points))
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(AllocatorSeries {
            device_uuid: q.device_uuid.to_owned(),
            pid: q.pid,
            start_time_ms: process.start_time_ms,
            points,
        }))
    }
}

/// The allocator reports that came with a batch's process samples: one row
/// per report (a report joined to several intervals is stored once), and
/// the newest one on the process's row.
async fn write_allocator_samples(
    tx: &mut Transaction<'_, Postgres>,
    samples: &[ProcessSampleRow],
) -> Result<(), StoreError> {
    let reporting: Vec<(&ProcessSampleRow, &AllocatorRow)> = samples
        .iter()
        .filter_map(|s| s.allocator.as_ref().map(|a| (s, a)))
        .collect();
    if reporting.is_empty() {
        return Ok(());
    }
    let column =
        |f: fn(&AllocatorRow) -> i64| -> Vec<i64> { reporting.iter().map(|(_, a)| f(a)).collect() };
    let device: Vec<i32> = reporting.iter().map(|(s, _)| s.device_id as i32).collect();
    let pid: Vec<i64> = reporting.iter().map(|(s, _)| s.pid).collect();
    let start: Vec<i64> = reporting.iter().map(|(s, _)| s.start_time_ms).collect();
    let ts = column(|a| a.timestamp_ms);
    let allocated = column(|a| a.allocated);
    let reserved = column(|a| a.reserved);
    let active = column(|a| a.active);
    let inactive_split = column(|a| a.inactive_split);
    let peak = column(|a| a.peak_allocated);
    let retries = column(|a| a.alloc_retries);
    let ooms = column(|a| a.ooms);
    sqlx::query(
        "INSERT INTO allocator_samples (process_id, ts_ms, allocated, reserved, active, inactive_split,
             peak_allocated, alloc_retries, ooms)
         SELECT p.id, s.t, s.a, s.r, s.ac, s.i, s.pk, s.rt, s.o
         FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
             $8::int8[], $9::int8[], $10::int8[], $11::int8[]) AS s(d, pid, st, t, a, r, ac, i, pk, rt, o)
         JOIN processes p ON p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st
         ON CONFLICT (process_id, ts_ms) DO NOTHING",
    )
    .bind(&device)
    .bind(&pid)
    .bind(&start)
    .bind(&ts)
    .bind(&allocated)
    .bind(&reserved)
    .bind(&active)
    .bind(&inactive_split)
    .bind(&peak)
    .bind(&retries)
    .bind(&ooms)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE processes p SET alloc_ts_ms = s.t, alloc_allocated = s.a, alloc_reserved = s.r,
             alloc_inactive_split = s.i, alloc_peak_allocated = s.pk, alloc_retries = s.rt, alloc_ooms = s.o
         FROM (SELECT DISTINCT ON (d, pid, st) *
               FROM UNNEST($1::int4[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[],
                   $8::int8[], $9::int8[], $10::int8[]) AS u(d, pid, st, t, a, r, i, pk, rt, o)
               ORDER BY d, pid, st, t DESC) s
         WHERE p.device_id = s.d AND p.pid = s.pid AND p.start_time_ms = s.st
             AND (p.alloc_ts_ms IS NULL OR p.alloc_ts_ms <= s.t)",
    )
    .bind(&device)
    .bind(&pid)
    .bind(&start)
    .bind(&ts)
    .bind(&allocated)
    .bind(&reserved)
    .bind(&inactive_split)
    .bind(&peak)
    .bind(&retries)
    .bind(&ooms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
