//! SQLite: the embedded store for one machine and the demo. Same schema and
//! semantics as Postgres; rows go in one by one inside a single transaction
//! (prepared statements are cached, so this is cheap on SQLite). Samples
//! wait in open chunks and are written as compressed chunks at a flush
//! (chunks.rs), unless `[storage] sample_writes = "rows"`.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Row, Sqlite, SqliteConnection, Transaction};

mod alerts;
mod chunks;
mod maintenance;

use crate::chart_fold as fold;
use crate::model::{
    AllocatorReport, AllocatorRow, FlushReport, GpuSampleRow, NodeSession, ProcessPoint,
    Registration, StoreBatch, WriteOutcome,
};
use crate::open_chunks::{HeldBatch, OpenChunks};
use crate::rollup::{
    MINUTE_MS, MaintenanceReport, SampleWrites, StorageConfig, Watermarks, fleet_source_bounds,
    late_minutes, resolution_for, source_bounds,
};
use crate::rows::{
    ALLOCATOR_REPORT_COLUMNS, DeviceRow, PROCESS_COLUMNS, ProcessBucket, ProcessKey, ProcessMeta,
    ProcessRow, SessionDevice, bucket_width_ms, counted_with, process_series_from, session_from,
};
use crate::views::{AlertBucketRow, FleetBucketRow, fleet_points};
use crate::{
    AllocatorSeries, AllocatorSeriesQuery, DeviceView, EventView, FleetDevices, FleetHistoryPoint,
    NodeView, ProcessSeries, ProcessView, ProcessesOn, SeriesPoint, Store, StoreError,
};
use headroom_common::Clock;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");

#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// Writes, and reads inside a write's transaction.
    pool: SqlitePool,
    /// Dashboard and API reads, on connections of their own: SQLite (in WAL
    /// mode) lets them run while a batch commits, instead of queueing behind
    /// every agent's write for a pool connection.
    reader: SqlitePool,
    storage: StorageConfig,
    /// Samples held until a flush writes them as chunks; `None` where they
    /// are written as rows.
    open_chunks: Option<Arc<Mutex<OpenChunks>>>,
    /// One flush at a time.
    flush_turn: Arc<tokio::sync::Mutex<()>>,
}

impl SqliteStore {
    /// The store's id of device `uuid`, for the reads that take a UUID.
    async fn device_id(&self, uuid: &str) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar("SELECT id FROM devices WHERE uuid = ?1")
            .bind(uuid)
            .fetch_optional(&self.reader)
            .await?)
    }

    /// Opens (creating if needed) the database at `url`, e.g.
    /// `sqlite://headroom-data/headroom.db` or `sqlite::memory:`.
    pub async fn connect(url: &str, storage: StorageConfig) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        // An in-memory database exists once per connection: keep exactly one.
        let in_memory = url.contains(":memory:");
        if !in_memory {
            // Migrate on a connection of its own before the pool opens more:
            // a pool connection coming up mid-migration can make SQLite answer
            // "database is locked" to a schema change without waiting.
            let mut conn = SqliteConnection::connect_with(&options).await?;
            MIGRATOR.run(&mut conn).await?;
            conn.close().await?;
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(if in_memory { 1 } else { 4 })
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options.clone())
            .await?;
        let reader = if in_memory {
            MIGRATOR.run(&pool).await?;
            pool.clone()
        } else {
            SqlitePoolOptions::new()
                .max_connections(4)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options.read_only(true))
                .await?
        };
        Ok(Self {
            pool,
            reader,
            open_chunks: (storage.sample_writes == SampleWrites::Chunks)
                .then(|| Arc::new(Mutex::new(OpenChunks::new(storage.chunk_limits())))),
            flush_turn: Arc::default(),
            storage,
        })
    }

    /// The open chunks, whatever a panicking holder left: they are plain
    /// data, every update of which is complete before the lock is let go.
    fn open(&self) -> Option<std::sync::MutexGuard<'_, OpenChunks>> {
        self.open_chunks.as_deref().map(|open| {
            open.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        })
    }

    /// What the store now knows of a stream's durable mark.
    fn learn_durable(&self, session: &NodeSession) {
        if let Some(mut open) = self.open() {
            open.learn_durable(
                &(session.node_id, session.boot_id.clone()),
                session.durable_seq,
            );
        }
    }

    /// Writes the open chunks taken now; on failure they stay held and the
    /// next flush takes them again.
    async fn flush_open_chunks(&self, force: bool) -> Result<FlushReport, StoreError> {
        let _turn = self.flush_turn.lock().await;
        let taken = {
            let Some(mut open) = self.open() else {
                return Ok(FlushReport::default());
            };
            if !force && !open.due(Clock::System.now_ms()) {
                return Ok(FlushReport::default());
            }
            open.take()
        };
        let Some(taken) = taken else {
            return Ok(FlushReport::default());
        };
        let flushed = chunks::write_open_chunks(&self.pool, taken).await?;
        if let Some(mut open) = self.open() {
            open.flushed(&flushed.marks);
        }
        Ok(FlushReport {
            chunks: flushed.chunks,
            chunk_bytes: flushed.chunk_bytes,
            samples: flushed.samples,
            left_out: 0,
        })
    }

    /// Puts the samples of batches just committed (or replayed) into the
    /// open chunks: a failed write leaves the agent to send them again.
    fn hold(&self, held: Vec<CommittedBatch<'_>>) {
        let Some(mut open) = self.open() else { return };
        let now_ms = Clock::System.now_ms();
        for (batch, processes, allocator) in held {
            let samples = HeldBatch {
                gpu: &batch.gpu_samples,
                processes: &processes,
                allocator: &allocator,
            };
            open.push(
                &(batch.node_id, batch.boot_id.clone()),
                batch.seq,
                &samples,
                now_ms,
            );
        }
    }

    /// Samples of `device` in `[from_ms, to_ms]` in chunks and still held,
    /// a sample in both (as a flush commits) counted once.
    async fn chunked_gpu_samples(
        &self,
        device: i64,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<GpuSampleRow>, StoreError> {
        let mut samples =
            chunks::samples_between::<GpuSampleRow>(&self.reader, &[device], from_ms, to_ms)
                .await?;
        if let Some(open) = self.open() {
            samples.extend(open.gpu_between(device, from_ms, to_ms));
        }
        samples.sort_by_key(|r| r.timestamp_ms);
        samples.dedup_by_key(|r| r.timestamp_ms);
        Ok(samples)
    }

    async fn chunked_process_samples(
        &self,
        processes: &[i64],
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<ProcessPoint>, StoreError> {
        let mut samples =
            chunks::samples_between::<ProcessPoint>(&self.reader, processes, from_ms, to_ms)
                .await?;
        if let Some(open) = self.open() {
            samples.extend(open.processes_between(processes, from_ms, to_ms));
        }
        samples.sort_by_key(|r| (r.process_id, r.timestamp_ms));
        samples.dedup_by_key(|r| (r.process_id, r.timestamp_ms));
        Ok(samples)
    }

    /// Recomputes the fleet rollup rows of `[from_ms, to_ms)` at `step_ms`
    /// (a minute or an hour) from the device rollups already stored: what a
    /// rollup pass does for the buckets it rolls up, alone, for a
    /// benchmark to time it or fill the table after loading device rollups
    /// by hand.
    pub async fn refresh_fleet_rollups(
        &self,
        step_ms: i64,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        maintenance::roll_up_fleet(&mut conn, step_ms, from_ms, to_ms).await
    }
}

/// Every device the node ever registered, present or not: a batch sampled
/// before a MIG reconfiguration may arrive after it and still names the old
/// instances.
async fn load_session(
    tx: &mut Transaction<'_, Sqlite>,
    node_id: i64,
    node: &str,
    boot_id: &str,
    (committed_seq, durable_seq): (i64, i64),
) -> Result<NodeSession, StoreError> {
    let rows = sqlx::query_as::<_, SessionDevice>(
        "SELECT id, uuid, gpu_index, mig_profile, parent_id, memory_total FROM devices WHERE node_id = ?",
    )
    .bind(node_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(session_from(
        node_id,
        node,
        boot_id,
        committed_seq,
        durable_seq,
        rows,
    ))
}

crate::tokens::impl_token_store!(SqliteStore);
crate::job_reports::impl_job_report_store!(SqliteStore);

#[async_trait]
impl Store for SqliteStore {
    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn register(&self, reg: &Registration, now_ms: i64) -> Result<NodeSession, StoreError> {
        let mut tx = self.pool.begin().await?;
        let node_id: i64 = sqlx::query_scalar(
            "INSERT INTO nodes (name, boot_id, agent_version, driver_version, sample_interval_ms, registered_at_ms, last_seen_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)
             ON CONFLICT (name) DO UPDATE SET boot_id = excluded.boot_id, agent_version = excluded.agent_version,
                 driver_version = excluded.driver_version, sample_interval_ms = excluded.sample_interval_ms,
                 registered_at_ms = excluded.registered_at_ms, last_seen_ms = MAX(nodes.last_seen_ms, excluded.last_seen_ms)
             RETURNING id",
        )
        .bind(&reg.node)
        .bind(&reg.boot_id)
        .bind(&reg.agent_version)
        .bind(&reg.driver_version)
        .bind(i64::from(reg.sample_interval_ms))
        .bind(now_ms)
        .fetch_one(&mut *tx)
        .await?;
        let uuids: Vec<&str> = reg.devices.iter().map(|d| d.uuid.as_str()).collect();
        // Checked after the first write, which takes SQLite's write lock: a
        // read first would make the transaction fail, not wait, when another
        // writer holds it. A refusal rolls the node's row back with the rest.
        // Registrations are rare and SQLite is in-process: a lookup per
        // device costs less than building an IN list.
        for uuid in &uuids {
            let owner: Option<String> = sqlx::query_scalar(
                "SELECT n.name FROM devices d JOIN nodes n ON n.id = d.node_id
                 WHERE d.uuid = ?1 AND d.present = 1 AND n.name <> ?2",
            )
            .bind(uuid)
            .bind(&reg.node)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(owner) = owner {
                return Err(StoreError::DeviceOwned {
                    uuid: (*uuid).to_owned(),
                    owner,
                });
            }
        }
        let counted: Vec<String> = sqlx::query_scalar(
            "SELECT d.uuid FROM devices d JOIN nodes n ON n.id = d.node_id
             WHERE n.name = ?1 AND (d.present = 1 OR d.absent_since_ms >= ?2)",
        )
        .bind(&reg.node)
        .bind(now_ms.saturating_sub(reg.budget.forget_absent_after_ms))
        .fetch_all(&mut *tx)
        .await?;
        let on_record = counted_with(&counted, &uuids);
        reg.budget.check(&reg.node, on_record)?;
        sqlx::query(
            "INSERT INTO agent_boots (node_id, boot_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .execute(&mut *tx)
        .await?;
        let marks: (i64, i64) = sqlx::query_as(
            "SELECT committed_seq, durable_seq FROM agent_boots WHERE node_id = ?1 AND boot_id = ?2",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE devices SET present = 0, absent_since_ms = ?2 WHERE node_id = ?1 AND present = 1",
        )
        .bind(node_id)
        .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        let mut ids: HashMap<&str, i64> = HashMap::new();
        for d in &reg.devices {
            let parent_id = d.parent_uuid.as_deref().and_then(|p| ids.get(p).copied());
            let mig = d.mig.as_ref();
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO devices (uuid, node_id, parent_id, gpu_index, name, memory_total, pcie_generation, pcie_width,
                     mig_gpu_instance_id, mig_compute_instance_id, mig_profile, present)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 1)
                 ON CONFLICT (uuid) DO UPDATE SET node_id = excluded.node_id, parent_id = excluded.parent_id,
                     gpu_index = excluded.gpu_index, name = excluded.name, memory_total = excluded.memory_total,
                     pcie_generation = excluded.pcie_generation, pcie_width = excluded.pcie_width,
                     mig_gpu_instance_id = excluded.mig_gpu_instance_id,
                     mig_compute_instance_id = excluded.mig_compute_instance_id,
                     mig_profile = excluded.mig_profile, present = 1, absent_since_ms = NULL
                 RETURNING id",
            )
            .bind(&d.uuid)
            .bind(node_id)
            .bind(parent_id)
            .bind(i64::from(d.index))
            .bind(&d.name)
            .bind(d.memory_total)
            .bind(i64::from(d.pcie_generation))
            .bind(i64::from(d.pcie_width))
            .bind(mig.map(|m| i64::from(m.gpu_instance_id)))
            .bind(mig.map(|m| i64::from(m.compute_instance_id)))
            .bind(mig.map(|m| m.profile.as_str()))
            .fetch_one(&mut *tx)
            .await?;
            ids.insert(&d.uuid, id);
        }
        let session = load_session(&mut tx, node_id, &reg.node, &reg.boot_id, marks).await?;
        tx.commit().await?;
        self.learn_durable(&session);
        Ok(session)
    }

    async fn release_device(&self, uuid: &str, now_ms: i64) -> Result<Option<String>, StoreError> {
        // The write first, so the transaction waits for SQLite's write lock
        // rather than failing on an upgrade from a read.
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE devices SET absent_since_ms = CASE WHEN present = 1 THEN ?2 ELSE absent_since_ms END,
                 present = 0 WHERE uuid = ?1",
        )
        .bind(uuid)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        let owner: Option<String> = sqlx::query_scalar(
            "SELECT n.name FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.uuid = ?1",
        )
        .bind(uuid)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(owner)
    }

    async fn session(&self, node: &str, boot_id: &str) -> Result<Option<NodeSession>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT n.id, b.committed_seq, b.durable_seq FROM nodes n JOIN agent_boots b ON b.node_id = n.id
             WHERE n.name = ?1 AND b.boot_id = ?2",
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
            (row.try_get("committed_seq")?, row.try_get("durable_seq")?),
        )
        .await?;
        tx.commit().await?;
        self.learn_durable(&session);
        Ok(Some(session))
    }

    async fn write_batches(&self, batches: &[StoreBatch]) -> Result<Vec<WriteOutcome>, StoreError> {
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(open) = self.open()
            && open.overfull()
        {
            return Err(StoreError::Backlog {
                held_mib: open.bytes() >> 20,
            });
        }
        let chunked = self.open_chunks.is_some();
        let mut tx = self.pool.begin().await?;
        let mut outcomes = Vec::with_capacity(batches.len());
        let mut held = Vec::new();
        let mut accepted: HashMap<(i64, &str), u64> = HashMap::new();
        for batch in batches {
            let outcome = write_one(&mut tx, batch, chunked, &accepted, &mut held).await?;
            if outcome == WriteOutcome::Committed {
                accepted.insert((batch.node_id, batch.boot_id.as_str()), batch.seq);
            }
            outcomes.push(outcome);
        }
        if accepted.is_empty() {
            tx.rollback().await?;
            self.hold(held);
            return Ok(outcomes);
        }
        if chunked {
            tx.commit().await?;
            self.hold(held);
            return Ok(outcomes);
        }
        // SQLite has one writer at a time: the rollup pass cannot move the
        // watermark while this transaction holds the write lock.
        let watermark: Option<i64> =
            sqlx::query_scalar("SELECT done_until_ms FROM rollup_progress WHERE step_ms = ?1")
                .bind(MINUTE_MS)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(watermark) = watermark {
            let timestamps = batches
                .iter()
                .zip(&outcomes)
                .filter(|(_, o)| **o == WriteOutcome::Committed)
                .flat_map(|(b, _)| {
                    b.gpu_samples
                        .iter()
                        .map(|s| s.timestamp_ms)
                        .chain(b.process_samples.iter().map(|s| s.timestamp_ms))
                });
            for minute in late_minutes(timestamps, watermark) {
                sqlx::query(
                    "INSERT INTO rollup_pending (step_ms, bucket_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                )
                .bind(MINUTE_MS)
                .bind(minute)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    async fn flush(&self, force: bool) -> Result<FlushReport, StoreError> {
        self.flush_open_chunks(force).await
    }

    fn durable_seq(&self, node_id: i64, boot_id: &str) -> Option<u64> {
        let open = self.open()?;
        Some(open.durable(&(node_id, boot_id.to_owned())).unwrap_or(0))
    }

    async fn maintain(&self, now_ms: i64) -> Result<MaintenanceReport, StoreError> {
        maintenance::run(&self.pool, &self.storage, now_ms).await
    }

    async fn watermarks(&self) -> Result<Watermarks, StoreError> {
        maintenance::watermarks(&self.reader).await
    }

    fn parallel_writes(&self) -> bool {
        false
    }

    async fn close(&self) {
        // What is held would otherwise wait for the agents to send it again.
        crate::store::log_flush_on_close(self.flush(true).await);
        self.pool.close().await;
        self.reader.close().await;
    }

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError> {
        Ok(sqlx::query_as::<_, NodeView>(
            "SELECT n.name, n.boot_id, n.agent_version, n.driver_version, n.sample_interval_ms,
                 n.registered_at_ms, n.last_seen_ms,
                 COALESCE(SUM(CASE WHEN d.id IS NOT NULL AND d.parent_id IS NULL THEN 1 ELSE 0 END), 0) AS gpu_count,
                 COALESCE(SUM(CASE WHEN d.parent_id IS NOT NULL THEN 1 ELSE 0 END), 0) AS mig_instance_count
             FROM nodes n LEFT JOIN devices d ON d.node_id = n.id AND d.present
             GROUP BY n.id ORDER BY n.name",
        )
        .fetch_all(&self.reader)
        .await?)
    }

    async fn latest_devices(&self) -> Result<FleetDevices, StoreError> {
        let rows = sqlx::query_as::<_, DeviceRow>(
            "SELECT d.id AS device_id, d.uuid, n.name AS node, p.uuid AS parent_uuid, d.gpu_index, d.name,
                 d.mig_profile, d.mig_gpu_instance_id, d.mig_compute_instance_id, d.memory_total,
                 l.ts_ms, l.used_last, l.used_min, l.used_max, l.reserved, l.total, l.utilization,
                 l.pcie_tx, l.pcie_rx
             FROM devices d JOIN nodes n ON n.id = d.node_id
             LEFT JOIN devices p ON p.id = d.parent_id
             LEFT JOIN gpu_latest l ON l.device_id = d.id
             WHERE d.present
             ORDER BY n.name, d.gpu_index, d.parent_id IS NOT NULL, d.mig_gpu_instance_id, d.mig_compute_instance_id",
        )
        .fetch_all(&self.reader)
        .await?;
        Ok(FleetDevices::from_views(
            rows.into_iter().map(DeviceView::from).collect(),
        ))
    }

    async fn fleet_history(
        &self,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Vec<FleetHistoryPoint>, StoreError> {
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.reader).await?;
        let bounds = fleet_source_bounds(from_ms, to_ms, width, marks, &self.storage);
        // An hour row weighs as its 60 minutes in a bucket that also holds
        // minute rows.
        let rollups = sqlx::query_as::<_, FleetBucketRow>(
            "WITH src AS (
                 SELECT ts_ms AS at, 60 AS span, used_avg, used_max, capacity, devices, devices_below_10pct
                 FROM fleet_1h WHERE ts_ms >= ?1 AND ts_ms < ?3
                 UNION ALL
                 SELECT ts_ms, 1, used_avg, used_max, capacity, devices, devices_below_10pct
                 FROM fleet_1m WHERE ts_ms >= ?3 AND ts_ms < ?4)
             SELECT (at - ?1) / ?2 AS bucket,
                 CAST(ROUND(SUM(CAST(used_avg AS REAL) * span) / SUM(span)) AS INTEGER) AS used_bytes,
                 MAX(used_max) AS used_max_bytes, MAX(capacity) AS capacity_bytes,
                 MAX(devices) AS devices, MAX(devices_below_10pct) AS devices_below_10pct
             FROM src GROUP BY 1 ORDER BY 1",
        )
        .bind(from_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .fetch_all(&self.reader)
        .await?;
        // A few thousand rows at most: read at query time, not rolled up.
        let alerts = sqlx::query_as::<_, AlertBucketRow>(
            "SELECT (fired_at_ms - ?1) / ?3 AS bucket, COUNT(*) AS fired FROM alerts
             WHERE fired_at_ms >= ?1 AND fired_at_ms <= ?2 GROUP BY 1",
        )
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .fetch_all(&self.reader)
        .await?;
        Ok(fleet_points(rollups, alerts, from_ms, to_ms, width))
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
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.reader).await?;
        let bounds = source_bounds(
            resolution_for(from_ms, width, marks, &self.storage),
            from_ms,
            to_ms,
            marks,
        );
        let chunked = self
            .chunked_gpu_samples(device, bounds.minute_end_ms, to_ms)
            .await?;
        let packed = gpu_buckets_json(&fold::gpu_buckets(&chunked, from_ms, width))?;
        // Every source as sums over its samples (a rollup row is `samples`
        // samples of its mean; an optional figure counts only the samples
        // that have it), so a bucket mixing sources still averages per
        // sample. Chunked samples come folded into buckets, as JSON.
        let points = sqlx::query_as::<_, SeriesPoint>(
            "WITH src AS (
                 SELECT ts_ms AS at, last_ts_ms AS ts, samples, CAST(used_avg AS REAL) * samples AS used_sum,
                     used_min, used_max, reserved, total,
                     utilization * samples AS util_sum, CASE WHEN utilization IS NULL THEN 0 ELSE samples END AS util_n,
                     CAST(pcie_tx AS REAL) * samples AS tx_sum, CASE WHEN pcie_tx IS NULL THEN 0 ELSE samples END AS tx_n,
                     CAST(pcie_rx AS REAL) * samples AS rx_sum, CASE WHEN pcie_rx IS NULL THEN 0 ELSE samples END AS rx_n
                 FROM gpu_samples_1h WHERE device_id = ?1 AND ts_ms >= ?2 AND ts_ms < ?5
                 UNION ALL
                 SELECT ts_ms, last_ts_ms, samples, CAST(used_avg AS REAL) * samples, used_min, used_max, reserved, total,
                     utilization * samples, CASE WHEN utilization IS NULL THEN 0 ELSE samples END,
                     CAST(pcie_tx AS REAL) * samples, CASE WHEN pcie_tx IS NULL THEN 0 ELSE samples END,
                     CAST(pcie_rx AS REAL) * samples, CASE WHEN pcie_rx IS NULL THEN 0 ELSE samples END
                 FROM gpu_samples_1m WHERE device_id = ?1 AND ts_ms >= ?5 AND ts_ms < ?6
                 UNION ALL
                 SELECT ts_ms, ts_ms, 1, CAST(used_last AS REAL), used_min, used_max, reserved, total,
                     CAST(utilization AS REAL), CASE WHEN utilization IS NULL THEN 0 ELSE 1 END,
                     CAST(pcie_tx AS REAL), CASE WHEN pcie_tx IS NULL THEN 0 ELSE 1 END,
                     CAST(pcie_rx AS REAL), CASE WHEN pcie_rx IS NULL THEN 0 ELSE 1 END
                 FROM gpu_samples WHERE device_id = ?1 AND ts_ms >= ?6 AND ts_ms <= ?3
                 UNION ALL
                 SELECT value ->> 0, value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4,
                     value ->> 5, value ->> 6, value ->> 7, value ->> 8, value ->> 9, value ->> 10,
                     value ->> 11, value ->> 12
                 FROM json_each(?7))
             SELECT MAX(ts) AS timestamp_ms, SUM(samples) AS samples,
                 CAST(ROUND(SUM(used_sum) / SUM(samples)) AS INTEGER) AS memory_used_bytes,
                 MIN(used_min) AS memory_used_min_bytes, MAX(used_max) AS memory_used_max_bytes,
                 MAX(reserved) AS memory_reserved_bytes, MAX(total) AS memory_total_bytes,
                 SUM(util_sum) / NULLIF(SUM(util_n), 0) AS utilization_pct,
                 CAST(ROUND(SUM(tx_sum) / NULLIF(SUM(tx_n), 0)) AS INTEGER) AS pcie_tx_bytes_per_s,
                 CAST(ROUND(SUM(rx_sum) / NULLIF(SUM(rx_n), 0)) AS INTEGER) AS pcie_rx_bytes_per_s
             FROM src GROUP BY (at - ?2) / ?4 ORDER BY 1",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .bind(packed)
        .fetch_all(&self.reader)
        .await?;
        Ok(Some(points))
    }

    async fn processes(
        &self,
        since_ms: i64,
        on: ProcessesOn<'_>,
    ) -> Result<Vec<ProcessView>, StoreError> {
        let on_sql = match on {
            ProcessesOn::Fleet => "",
            ProcessesOn::Node(_) => "AND n.name = ?2",
            ProcessesOn::Devices(_) => "AND d.uuid IN (SELECT value FROM json_each(?2))",
            // `instr(x, '') = 1`: a part not asked for matches every process.
            ProcessesOn::Owners(_) => {
                "AND instr(p.user_name, ?2) > 0 AND instr(p.slurm_job_id, ?3) > 0 AND instr(p.pod_uid, ?4) > 0"
            }
        };
        let sql = format!(
            "SELECT n.name AS node, d.uuid AS device_uuid, d.gpu_index, {PROCESS_COLUMNS}
             FROM processes p JOIN devices d ON d.id = p.device_id JOIN nodes n ON n.id = d.node_id
             WHERE p.last_seen_ms >= ?1 {on_sql}
             ORDER BY p.memory_last DESC, n.name, p.pid"
        );
        let query = sqlx::query_as::<_, ProcessRow>(&sql).bind(since_ms);
        let query = match on {
            ProcessesOn::Fleet => query,
            ProcessesOn::Node(node) => query.bind(node.to_owned()),
            ProcessesOn::Devices(uuids) => query.bind(serde_json::json!(uuids).to_string()),
            ProcessesOn::Owners(owner) => query
                .bind(owner.user.to_owned())
                .bind(owner.slurm_job_id.to_owned())
                .bind(owner.pod_uid.to_owned()),
        };
        let rows = query.fetch_all(&self.reader).await?;
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
             WHERE device_id = ?1 AND last_seen_ms >= ?2 AND first_seen_ms <= ?3",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&self.reader)
        .await?;
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.reader).await?;
        let bounds = source_bounds(
            resolution_for(from_ms, width, marks, &self.storage),
            from_ms,
            to_ms,
            marks,
        );
        let ids: Vec<i64> = meta.iter().map(|m| m.id).collect();
        let chunked = self
            .chunked_process_samples(&ids, bounds.minute_end_ms, to_ms)
            .await?;
        let peaks: Vec<[i64; 3]> = fold::process_peaks(chunked, from_ms, width)
            .iter()
            .map(|p| [p.process_id, p.timestamp_ms, p.used_max])
            .collect();
        let packed = serde_json::to_string(&peaks)
            .map_err(|e| StoreError::Invalid(format!("process peaks as JSON: {e}")))?;
        let buckets = sqlx::query_as::<_, ProcessBucket>(
            "WITH procs AS (
                 SELECT id FROM processes WHERE device_id = ?1 AND last_seen_ms >= ?2 AND first_seen_ms <= ?3),
             src AS (
                 SELECT process_id, ts_ms AS at, used_max FROM process_samples_1h
                 WHERE process_id IN (SELECT id FROM procs) AND ts_ms >= ?2 AND ts_ms < ?5
                 UNION ALL
                 SELECT process_id, ts_ms, used_max FROM process_samples_1m
                 WHERE process_id IN (SELECT id FROM procs) AND ts_ms >= ?5 AND ts_ms < ?6
                 UNION ALL
                 SELECT process_id, ts_ms, used_max FROM process_samples
                 WHERE process_id IN (SELECT id FROM procs) AND ts_ms >= ?6 AND ts_ms <= ?3
                 UNION ALL
                 SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?7))
             SELECT process_id, MIN(?3, ?2 + ((at - ?2) / ?4 + 1) * ?4 - 1) AS timestamp_ms, MAX(used_max) AS used
             FROM src GROUP BY process_id, (at - ?2) / ?4",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .bind(packed)
        .fetch_all(&self.reader)
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
                 WHERE device_id = ?1 AND ts_ms BETWEEN ?2 AND ?3
                 ORDER BY ts_ms DESC LIMIT ?4",
            )
            .bind(device)
            .bind(from_ms)
            .bind(to_ms)
            .bind(limit)
            .fetch_all(&self.reader)
            .await?,
        ))
    }

    async fn allocator_series(
        &self,
        q: &AllocatorSeriesQuery<'_>,
    ) -> Result<Option<AllocatorSeries>, StoreError> {
        let process = sqlx::query_as::<_, ProcessKey>(
            "SELECT p.id, p.start_time_ms FROM processes p JOIN devices d ON d.id = p.device_id
             WHERE d.uuid = ?1 AND p.pid = ?2 AND (?3 IS NULL OR p.start_time_ms = ?3)
             ORDER BY p.start_time_ms DESC LIMIT 1",
        )
        .bind(q.device_uuid)
        .bind(q.pid)
        .bind(q.start_time_ms)
        .fetch_optional(&self.reader)
        .await?;
        let Some(process) = process else {
            return Ok(None);
        };
        let width = bucket_width_ms(q.from_ms, q.to_ms, q.max_points);
        let mut folded = fold::AllocatorFold::new(q.from_ms, width);
        // Held first: a flush committing meanwhile leaves a report in both
        // (counted once, but for a long replay's chunk read as its
        // minutes), never in neither.
        if let Some(open) = self.open() {
            for report in open.allocator_between(&[process.id], q.from_ms, q.to_ms) {
                folded.add(report);
            }
        }
        chunks::fold_allocator_chunks(
            &self.reader,
            process.id,
            (q.from_ms, q.to_ms),
            width >= MINUTE_MS,
            &mut folded,
        )
        .await?;
        // Written before allocator chunks, or with `sample_writes = "rows"`.
        let select = format!(
            "SELECT {ALLOCATOR_REPORT_COLUMNS} FROM allocator_samples
             WHERE process_id = ?1 AND ts_ms BETWEEN ?2 AND ?3"
        );
        let mut rows = sqlx::query_as::<_, AllocatorReport>(&select)
            .bind(process.id)
            .bind(q.from_ms)
            .bind(q.to_ms)
            .fetch(&self.reader);
        while let Some(report) = rows.try_next().await? {
            folded.add(report);
        }
        Ok(Some(AllocatorSeries {
            device_uuid: q.device_uuid.to_owned(),
            pid: q.pid,
            start_time_ms: process.start_time_ms,
            points: folded.points(),
        }))
    }
}

/// One allocator report joined to a process sample: kept on the process's
/// row while it is the newest and, where samples are written as rows,
/// stored once however many intervals it was joined to (as chunks, the
/// report waits in open chunks).
async fn write_allocator_sample(
    tx: &mut Transaction<'_, Sqlite>,
    process_id: i64,
    a: &AllocatorRow,
    chunked: bool,
) -> Result<(), StoreError> {
    let [
        (weights, weights_dtype),
        (gradients, gradients_dtype),
        (optimizer, optimizer_dtype),
    ] = a.parts();
    if !chunked {
        sqlx::query(
        "INSERT INTO allocator_samples (process_id, ts_ms, allocated, reserved, active, inactive_split,
             peak_allocated, alloc_retries, ooms, weights, gradients, optimizer_state)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
         ON CONFLICT (process_id, ts_ms) DO NOTHING",
    )
    .bind(process_id)
    .bind(a.timestamp_ms)
    .bind(a.allocated)
    .bind(a.reserved)
    .bind(a.active)
    .bind(a.inactive_split)
    .bind(a.peak_allocated)
    .bind(a.alloc_retries)
    .bind(a.ooms)
    .bind(weights)
    .bind(gradients)
    .bind(optimizer)
    .execute(&mut **tx)
    .await?;
    }
    sqlx::query(
        "UPDATE processes SET alloc_ts_ms = ?2, alloc_allocated = ?3, alloc_reserved = ?4,
             alloc_inactive_split = ?5, alloc_peak_allocated = ?6, alloc_retries = ?7, alloc_ooms = ?8,
             alloc_weights = ?9, alloc_weights_dtype = ?10, alloc_gradients = ?11,
             alloc_gradients_dtype = ?12, alloc_optimizer_state = ?13, alloc_optimizer_state_dtype = ?14
         WHERE id = ?1 AND (alloc_ts_ms IS NULL OR alloc_ts_ms <= ?2)",
    )
    .bind(process_id)
    .bind(a.timestamp_ms)
    .bind(a.allocated)
    .bind(a.reserved)
    .bind(a.inactive_split)
    .bind(a.peak_allocated)
    .bind(a.alloc_retries)
    .bind(a.ooms)
    .bind(weights)
    .bind(weights_dtype)
    .bind(gradients)
    .bind(gradients_dtype)
    .bind(optimizer)
    .bind(optimizer_dtype)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Chunked samples folded into a chart's buckets, as a JSON array of rows
/// for the chart query: newest time, samples, then each figure's sum (or
/// extreme) and, for an optional one, how many samples have it.
fn gpu_buckets_json(buckets: &[fold::GpuBucket]) -> Result<String, StoreError> {
    // Sums go as floats, as the query adds them: a 128-bit one does not
    // fit SQLite's integers.
    let sum = |s: fold::Sum| s.total().map(|t| t as f64);
    let rows: Vec<serde_json::Value> = buckets
        .iter()
        .map(|b| {
            serde_json::json!([
                b.newest_ms,
                b.samples,
                b.used_sum as f64,
                b.used_min,
                b.used_max,
                b.reserved,
                b.total,
                sum(b.utilization),
                b.utilization.samples,
                sum(b.pcie_tx),
                b.pcie_tx.samples,
                sum(b.pcie_rx),
                b.pcie_rx.samples,
            ])
        })
        .collect();
    serde_json::to_string(&rows)
        .map_err(|e| StoreError::Invalid(format!("chart buckets as JSON: {e}")))
}

/// A batch whose samples go to the open chunks once its transaction
/// commits, with its process samples and allocator reports by their
/// processes' row ids.
type CommittedBatch<'b> = (&'b StoreBatch, Vec<ProcessPoint>, Vec<AllocatorReport>);

/// Writes one batch inside the group's transaction, unless its seq was
/// already committed: the claim comes first, so a duplicate writes nothing.
/// Where samples go to open chunks (`chunked`), they are added to `held`
/// instead of written, and a batch accepted before whose samples are not
/// yet durable is replayed: only its samples are taken again. `accepted`
/// holds the last seq this group accepted of each stream.
async fn write_one<'b>(
    tx: &mut Transaction<'_, Sqlite>,
    batch: &'b StoreBatch,
    chunked: bool,
    accepted: &HashMap<(i64, &str), u64>,
    held: &mut Vec<CommittedBatch<'b>>,
) -> Result<WriteOutcome, StoreError> {
    let seq = i64::try_from(batch.seq).unwrap_or(i64::MAX);
    // A write first, so the transaction holds the write lock from its start.
    // Where samples are rows, every accepted batch is durable at once.
    let claimed = sqlx::query(if chunked {
        "UPDATE agent_boots SET committed_seq = ?3
         WHERE node_id = ?1 AND boot_id = ?2 AND committed_seq < ?3"
    } else {
        "UPDATE agent_boots SET committed_seq = ?3, durable_seq = MAX(durable_seq, ?3)
         WHERE node_id = ?1 AND boot_id = ?2 AND committed_seq < ?3"
    })
    .bind(batch.node_id)
    .bind(&batch.boot_id)
    .bind(seq)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if claimed == 0 {
        let marks: Option<(i64, i64)> = sqlx::query_as(
            "SELECT committed_seq, durable_seq FROM agent_boots WHERE node_id = ?1 AND boot_id = ?2",
        )
        .bind(batch.node_id)
        .bind(&batch.boot_id)
        .fetch_optional(&mut **tx)
        .await?;
        let Some((committed, durable)) = marks else {
            return Ok(WriteOutcome::Duplicate { committed_seq: 0 });
        };
        let accepted_here = accepted
            .get(&(batch.node_id, batch.boot_id.as_str()))
            .is_some_and(|&last| batch.seq <= last);
        if chunked && durable < seq && seq <= committed && !accepted_here {
            let (points, reports) = replayed_process_points(tx, batch).await?;
            held.push((batch, points, reports));
            return Ok(WriteOutcome::Replayed);
        }
        // In open chunks, only the durable mark may be acknowledged.
        let reported = if chunked { durable } else { committed };
        return Ok(WriteOutcome::Duplicate {
            committed_seq: u64::try_from(reported).unwrap_or(0),
        });
    }

    for s in &batch.gpu_samples {
        if !chunked {
            sqlx::query(
                "INSERT INTO gpu_samples (device_id, ts_ms, interval_ms, poll_count, used_last, used_min, used_max,
                     reserved, total, utilization, pcie_tx, pcie_rx)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            )
            .bind(s.device_id)
            .bind(s.timestamp_ms)
            .bind(s.interval_ms)
            .bind(s.poll_count)
            .bind(s.used_last)
            .bind(s.used_min)
            .bind(s.used_max)
            .bind(s.reserved)
            .bind(s.total)
            .bind(s.utilization_pct)
            .bind(s.pcie_tx_bytes_per_s)
            .bind(s.pcie_rx_bytes_per_s)
            .execute(&mut **tx)
            .await?;
        }
        sqlx::query(
                "INSERT INTO gpu_latest (device_id, ts_ms, used_last, used_min, used_max, reserved, total, utilization, pcie_tx, pcie_rx)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                 ON CONFLICT (device_id) DO UPDATE SET ts_ms = excluded.ts_ms, used_last = excluded.used_last,
                     used_min = excluded.used_min, used_max = excluded.used_max, reserved = excluded.reserved,
                     total = excluded.total, utilization = excluded.utilization, pcie_tx = excluded.pcie_tx,
                     pcie_rx = excluded.pcie_rx
                 WHERE gpu_latest.ts_ms <= excluded.ts_ms",
            )
            .bind(s.device_id)
            .bind(s.timestamp_ms)
            .bind(s.used_last)
            .bind(s.used_min)
            .bind(s.used_max)
            .bind(s.reserved)
            .bind(s.total)
            .bind(s.utilization_pct)
            .bind(s.pcie_tx_bytes_per_s)
            .bind(s.pcie_rx_bytes_per_s)
            .execute(&mut **tx)
            .await?;
    }

    let mut points = Vec::new();
    let mut reports = Vec::new();
    for p in &batch.process_samples {
        let process_id: i64 = sqlx::query_scalar(
                "INSERT INTO processes AS p (device_id, pid, start_time_ms, name, uid, user_name, container_id, pod_uid,
                     slurm_job_id, first_seen_ms, last_seen_ms, memory_last, memory_peak, container_runtime, pod_qos_class)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?11, ?12, ?13, ?14)
                 ON CONFLICT (device_id, pid, start_time_ms) DO UPDATE SET
                     name = excluded.name, uid = excluded.uid, user_name = excluded.user_name,
                     container_id = excluded.container_id, pod_uid = excluded.pod_uid, slurm_job_id = excluded.slurm_job_id,
                     container_runtime = excluded.container_runtime, pod_qos_class = excluded.pod_qos_class,
                     first_seen_ms = MIN(p.first_seen_ms, excluded.first_seen_ms),
                     memory_last = CASE WHEN excluded.last_seen_ms >= p.last_seen_ms THEN excluded.memory_last ELSE p.memory_last END,
                     last_seen_ms = MAX(p.last_seen_ms, excluded.last_seen_ms),
                     memory_peak = MAX(p.memory_peak, excluded.memory_peak)
                 RETURNING id",
            )
            .bind(p.device_id)
            .bind(p.pid)
            .bind(p.start_time_ms)
            .bind(&p.name)
            .bind(p.uid)
            .bind(&p.user)
            .bind(&p.container_id)
            .bind(&p.pod_uid)
            .bind(&p.slurm_job_id)
            .bind(p.timestamp_ms)
            .bind(p.used_last)
            .bind(p.used_max)
            .bind(&p.container_runtime)
            .bind(&p.pod_qos_class)
            .fetch_one(&mut **tx)
            .await?;
        let point = ProcessPoint {
            process_id,
            timestamp_ms: p.timestamp_ms,
            used_last: p.used_last,
            used_max: p.used_max,
        };
        if chunked {
            points.push(point);
        } else {
            sqlx::query("INSERT INTO process_samples (process_id, ts_ms, used_last, used_max) VALUES (?1, ?2, ?3, ?4)")
                .bind(point.process_id)
                .bind(point.timestamp_ms)
                .bind(point.used_last)
                .bind(point.used_max)
                .execute(&mut **tx)
                .await?;
        }
        if let Some(a) = &p.allocator {
            write_allocator_sample(tx, process_id, a, chunked).await?;
            if chunked {
                reports.push(a.report(process_id));
            }
        }
    }

    for e in &batch.events {
        sqlx::query(
                "INSERT INTO events (node_id, device_id, ts_ms, kind, code, pid, detail) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .bind(batch.node_id)
            .bind(e.device_id)
            .bind(e.timestamp_ms)
            .bind(e.kind)
            .bind(e.code)
            .bind(e.pid)
            .bind(&e.detail)
            .execute(&mut **tx)
            .await?;
    }

    if let Some(newest) = batch.newest_timestamp_ms() {
        sqlx::query("UPDATE nodes SET last_seen_ms = MAX(last_seen_ms, ?2) WHERE id = ?1")
            .bind(batch.node_id)
            .bind(newest)
            .execute(&mut **tx)
            .await?;
    }
    if chunked {
        held.push((batch, points, reports));
    }
    Ok(WriteOutcome::Committed)
}

/// The process samples and allocator reports of a batch accepted before,
/// by the ids its write gave their processes. A process whose row is gone
/// (its node deleted since) has no chart to draw on, and its samples are
/// dropped.
async fn replayed_process_points(
    tx: &mut Transaction<'_, Sqlite>,
    batch: &StoreBatch,
) -> Result<(Vec<ProcessPoint>, Vec<AllocatorReport>), StoreError> {
    let mut points = Vec::with_capacity(batch.process_samples.len());
    let mut reports = Vec::new();
    for p in &batch.process_samples {
        let id: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM processes WHERE device_id = ?1 AND pid = ?2 AND start_time_ms = ?3",
        )
        .bind(p.device_id)
        .bind(p.pid)
        .bind(p.start_time_ms)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(process_id) = id {
            points.push(ProcessPoint {
                process_id,
                timestamp_ms: p.timestamp_ms,
                used_last: p.used_last,
                used_max: p.used_max,
            });
            reports.extend(p.allocator.map(|a| a.report(process_id)));
        }
    }
    Ok((points, reports))
}
