//! Postgres: the production store. Time-series tables are partitioned by
//! day (week for hourly rollups) and expire by dropping partitions. A group
//! of batches is one transaction whose first statement claims their seqs,
//! and whose inserts send whole columns as arrays (`UNNEST`), one round trip
//! per table rather than one per row.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

mod alerts;
mod checkpoints;
mod chunk_flush;
mod compaction;
mod copy;
mod fleet_layout;
mod maintenance;
mod packing;
mod primary;
mod process_cache;
mod rollup_packing;
mod write;
mod write_connections;

use crate::chart_fold as fold;
use crate::model::{AllocatorReport, ProcessPoint};
use crate::model::{
    FlushReport, GpuSampleRow, NodeSession, Registration, StoreBatch, WriteOutcome,
};
use crate::open_chunks::OpenChunks;
use crate::peers::{OpenSamples, OpenSamplesQuery, PeerLink};
use crate::rollup::{
    self, MINUTE_MS, MaintenanceReport, SampleWrites, StorageConfig, Watermarks,
    fleet_source_bounds, resolution_for, source_bounds,
};
use crate::rows::{
    ALLOCATOR_REPORT_COLUMNS, PROCESS_COLUMNS, ProcessBucket, ProcessMeta, ProcessRow,
    SessionDevice, bucket_width_ms, counted_with, process_series_from, session_from,
};
use crate::views::{AlertBucketRow, FleetBucketRow, fleet_points};
use crate::{
    AllocatorSeries, AllocatorSeriesQuery, EventView, FleetDevices, FleetHistoryPoint, NodeView,
    ProcessSeries, ProcessView, ProcessesOn, SeriesPoint, Store, StoreError,
};
use headroom_common::Clock;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    storage: StorageConfig,
    leadership: Arc<maintenance::Leadership>,
    process_cache: Arc<process_cache::ProcessCache>,
    latest_cache: Arc<checkpoints::LatestCache>,
    /// The fleet overview's layout, read again only when it changed.
    layout_cache: Arc<fleet_layout::LayoutCache>,
    /// This collector's id in `gpu_latest.writer`, unique on the database:
    /// its overview need not fetch the rows it wrote itself.
    writer: i64,
    node_cache: Arc<checkpoints::NodeCache>,
    process_seen: Arc<checkpoints::ProcessSeenCache>,
    allocator_seen: Arc<checkpoints::AllocatorSeenCache>,
    /// Paces the checkpoint rows (`gpu_latest`, process last-seen times).
    clock: Clock,
    writers: Arc<write_connections::WriteConnections>,
    /// Samples held until a flush writes them as chunks; `None` where they
    /// are written as rows.
    open_chunks: Option<Arc<std::sync::Mutex<OpenChunks>>>,
    /// One flush at a time: a second would take nothing the first has not.
    flush_turn: Arc<tokio::sync::Mutex<()>>,
    /// Reads across the collectors sharing the database, once linked.
    peers: Arc<std::sync::OnceLock<PeerLink>>,
}

impl PostgresStore {
    /// The store's id of device `uuid`, for the reads that take a UUID.
    async fn device_id(&self, uuid: &str) -> Result<Option<i32>, StoreError> {
        Ok(sqlx::query_scalar("SELECT id FROM devices WHERE uuid = $1")
            .bind(uuid)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Device `uuid`'s id and where the collector holding its node's
    /// stream answers, for the charts.
    async fn device_and_holder(
        &self,
        uuid: &str,
    ) -> Result<Option<(i32, Option<String>)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT d.id, n.stream_holder FROM devices d JOIN nodes n ON n.id = d.node_id
             WHERE d.uuid = $1",
        )
        .bind(uuid)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Connects to the database `url` names. A URL with a host list
    /// (`postgres://u@db-a:5432,db-b:5432/db?target_session_attrs=read-write`)
    /// connects to the first host that takes writes and follows a failover
    /// to another while the store runs (see `primary.rs`).
    pub async fn connect(url: &str, storage: StorageConfig) -> Result<Self, StoreError> {
        let primary = Arc::new(primary::Primary::parse(url)?);
        let mut pool_options = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10));
        if primary.has_standbys() {
            primary.find().await?;
            tracing::info!(host = primary.host(), "writing to this database host");
            // A connection to the host written to before a failover goes.
            let follows = Arc::downgrade(&primary);
            pool_options = pool_options.before_acquire(move |_conn, meta| {
                let fresh = follows
                    .upgrade()
                    .is_none_or(|primary| meta.age <= primary.switched_at().elapsed());
                Box::pin(async move { Ok(fresh) })
            });
        }
        let options: PgConnectOptions = primary.options();
        let pool = pool_options.connect_with(options).await?;
        MIGRATOR.run(&pool).await?;
        let writer: i64 = sqlx::query_scalar("SELECT nextval('gpu_latest_writers')")
            .fetch_one(&pool)
            .await?;
        let store = Self {
            writer,
            pool,
            leadership: Arc::new(maintenance::Leadership::new(primary.clone())),
            process_cache: Arc::default(),
            latest_cache: Arc::new(checkpoints::LatestCache::logging_changes()),
            layout_cache: Arc::default(),
            node_cache: Arc::default(),
            process_seen: Arc::default(),
            allocator_seen: Arc::default(),
            clock: Clock::System,
            writers: Arc::new(write_connections::WriteConnections::new(primary.clone())),
            open_chunks: (storage.sample_writes == SampleWrites::Chunks).then(|| {
                Arc::new(std::sync::Mutex::new(OpenChunks::new(
                    storage.chunk_limits(),
                )))
            }),
            flush_turn: Arc::default(),
            peers: Arc::default(),
            storage,
        };
        if primary.has_standbys() {
            tokio::spawn(follow_failover(
                Arc::downgrade(&primary),
                Arc::downgrade(&store.writers),
                store.pool.clone(),
            ));
        }
        // Today's partitions exist before the first batch, whoever leads.
        let now = Clock::System.now_ms();
        maintenance::ensure_partitions(
            &store.pool,
            now - store.storage.raw_retention_ms(),
            now + rollup::DAY_MS,
        )
        .await?;
        Ok(store)
    }

    /// Writes a group, creating the partitions it needs if a partition was
    /// missing (maintenance makes them ahead of time; this covers a
    /// collector that was down across a day boundary).
    async fn write_group_creating_partitions(
        &self,
        batches: &[StoreBatch],
    ) -> Result<Vec<WriteOutcome>, StoreError> {
        let write = || async {
            let mut conn = self.writers.take().await?;
            let caches = write::Caches {
                process: &self.process_cache,
                latest: &self.latest_cache,
                nodes: &self.node_cache,
                process_seen: &self.process_seen,
                allocator_seen: &self.allocator_seen,
                chunks: self.open_chunks.as_deref(),
                now_ms: self.clock.now_ms(),
                writer: self.writer,
            };
            let written = write::write_group(&mut conn, &caches, batches).await;
            if written.is_ok() {
                self.writers.give_back(conn);
            }
            written
        };
        match write().await {
            Err(StoreError::Database(e)) if is_missing_partition(&e) => {
                if let Some((from, to)) = write::time_span(batches) {
                    tracing::warn!(from, to, "a write met a missing partition; creating it");
                    maintenance::ensure_partitions(&self.pool, from, to).await?;
                }
                write().await
            }
            other => other,
        }
    }

    /// Where other collectors reach this one, once linked.
    fn own_url(&self) -> Option<&str> {
        self.peers.get().and_then(|link| link.own_url.as_deref())
    }

    /// What the store now knows of a stream's durable mark.
    fn learn_durable(&self, session: &NodeSession) {
        if let Some(open) = &self.open_chunks {
            lock(open).learn_durable(
                &(session.node_id, session.boot_id.clone()),
                session.durable_seq,
            );
        }
    }

    /// Samples in `query` held open, here and by the collector at
    /// `holder` (where that is another one). A chart reads them before its
    /// snapshot: a flush committing in between leaves a sample in both
    /// (merged once), never in neither.
    async fn open_here_and_at(&self, holder: Option<&str>, query: OpenSamplesQuery) -> OpenSamples {
        let mut open = self.open_samples(&query);
        if let Some(link) = self.peers.get()
            && let Some(url) = link.peer(holder)
        {
            let peer = link.read(url, &query).await;
            open.gpu.extend(peer.gpu);
            open.processes.extend(peer.processes);
            open.allocator.extend(peer.allocator);
        }
        open
    }

    /// Writes the open chunks taken now; on failure they stay held and the
    /// next flush takes them again.
    async fn flush_open_chunks(
        &self,
        open: &std::sync::Mutex<OpenChunks>,
        force: bool,
    ) -> Result<FlushReport, StoreError> {
        let _turn = self.flush_turn.lock().await;
        let taken = {
            let mut open = lock(open);
            if !force && !open.due(self.clock.now_ms()) {
                return Ok(FlushReport::default());
            }
            open.take()
        };
        let Some(taken) = taken else {
            return Ok(FlushReport::default());
        };
        let span = taken_span(&taken);
        let write = || async {
            let mut conn = self.pool.acquire().await?;
            chunk_flush::write_open_chunks(&mut conn, taken.clone()).await
        };
        let flushed = match write().await {
            Err(StoreError::Database(e)) if is_missing_partition(&e) => {
                if let Some((from, to)) = span {
                    tracing::warn!(from, to, "a flush met a missing partition; creating it");
                    maintenance::ensure_partitions(&self.pool, from, to).await?;
                }
                write().await
            }
            other => other,
        }?;
        lock(open).flushed(&flushed.marks);
        Ok(FlushReport {
            chunks: flushed.chunks,
            chunk_bytes: flushed.chunk_bytes,
            samples: flushed.samples,
            left_out: flushed.left_out,
        })
    }

    /// Paces checkpoints by `clock` instead of the system's (tests move
    /// time by hand).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Every GPU sample of `devices` in `[from_ms, to_ms]` on disk, rows
    /// and chunks alike, in device and time order: what outlives every
    /// collector (open chunks are not on disk). For checks from outside,
    /// such as the chaos test's.
    pub async fn stored_gpu_samples(
        conn: &mut sqlx::PgConnection,
        devices: &[i64],
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<GpuSampleRow>, StoreError> {
        use packing::PackedTable;
        let mut samples =
            packing::samples_between::<GpuSampleRow>(&mut *conn, devices, from_ms, to_ms).await?;
        let raw = sqlx::query(&format!(
            "SELECT {} FROM gpu_samples WHERE device_id = ANY($1) AND ts_ms >= $2 AND ts_ms <= $3",
            GpuSampleRow::COLUMNS
        ))
        .bind(
            devices
                .iter()
                .map(|d| i32::try_from(*d).unwrap_or(i32::MAX))
                .collect::<Vec<_>>(),
        )
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&mut *conn)
        .await?;
        for row in &raw {
            samples.push(GpuSampleRow::from_row(row)?);
        }
        samples.sort_by_key(|r| (r.device_id, r.timestamp_ms));
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

/// Samples read from the database and those held open, in order, a sample
/// in both (as a flush commits) once: the stored copy.
fn merged<T, K: Ord>(mut stored: Vec<T>, open: Vec<T>, key: impl Fn(&T) -> K) -> Vec<T> {
    if open.is_empty() {
        return stored;
    }
    stored.extend(open);
    stored.sort_by_key(&key);
    stored.dedup_by(|b, a| key(a) == key(b));
    stored
}

/// The open chunks, whatever a panicking holder left: they are plain data,
/// every update of which is complete before the lock is let go.
fn lock(open: &std::sync::Mutex<OpenChunks>) -> std::sync::MutexGuard<'_, OpenChunks> {
    open.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The oldest and newest sample time held in `samples` (an allocator
/// report's is when its process took it, which may precede its interval).
fn taken_span(samples: &crate::open_chunks::Samples) -> Option<(i64, i64)> {
    let gpu = samples.gpu.values().flatten().map(|h| h.row.timestamp_ms);
    let processes = samples
        .processes
        .values()
        .flatten()
        .map(|h| h.row.timestamp_ms);
    let reports = samples
        .allocator
        .values()
        .flatten()
        .map(|h| h.row.timestamp_ms);
    gpu.chain(processes)
        .chain(reports)
        .fold(None, |span, ts| match span {
            None => Some((ts, ts)),
            Some((lo, hi)) => Some((lo.min(ts), hi.max(ts))),
        })
}

/// Every device the node ever registered, present or not: a batch sampled
/// before a MIG reconfiguration may arrive after it and still names the old
/// instances.
async fn load_session(
    tx: &mut Transaction<'_, Postgres>,
    node_id: i64,
    node: &str,
    boot_id: &str,
    (committed_seq, durable_seq): (i64, i64),
) -> Result<NodeSession, StoreError> {
    let rows = sqlx::query_as::<_, SessionDevice>(
        "SELECT id::int8 AS id, uuid, gpu_index::int8 AS gpu_index, mig_profile, parent_id::int8 AS parent_id, memory_total
             FROM devices WHERE node_id = $1",
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

crate::tokens::impl_token_store!(PostgresStore);
crate::job_reports::impl_job_report_store!(PostgresStore);

#[async_trait]
impl Store for PostgresStore {
    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn register(&self, reg: &Registration, now_ms: i64) -> Result<NodeSession, StoreError> {
        let mut tx = self.pool.begin().await?;
        let uuids: Vec<&str> = reg.devices.iter().map(|d| d.uuid.as_str()).collect();
        let owned: Option<(String, String)> = sqlx::query_as(
            "SELECT d.uuid, n.name FROM devices d JOIN nodes n ON n.id = d.node_id
             WHERE d.uuid = ANY($1) AND d.present AND n.name <> $2 LIMIT 1",
        )
        .bind(&uuids)
        .bind(&reg.node)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((uuid, owner)) = owned {
            return Err(StoreError::DeviceOwned { uuid, owner });
        }
        let counted: Vec<String> = sqlx::query_scalar(
            "SELECT d.uuid FROM devices d JOIN nodes n ON n.id = d.node_id
             WHERE n.name = $1 AND (d.present OR d.absent_since_ms >= $2)",
        )
        .bind(&reg.node)
        .bind(now_ms.saturating_sub(reg.budget.forget_absent_after_ms))
        .fetch_all(&mut *tx)
        .await?;
        let on_record = counted_with(&counted, &uuids);
        reg.budget.check(&reg.node, on_record)?;
        // The stream is held here from now on: another collector's chart
        // asks this one for the node's open samples.
        let node_id: i64 = sqlx::query_scalar(
            "INSERT INTO nodes (name, boot_id, agent_version, driver_version, sample_interval_ms, registered_at_ms, last_seen_ms,
                 stream_holder)
             VALUES ($1, $2, $3, $4, $5, $6, $6, $7)
             ON CONFLICT (name) DO UPDATE SET boot_id = EXCLUDED.boot_id, agent_version = EXCLUDED.agent_version,
                 driver_version = EXCLUDED.driver_version, sample_interval_ms = EXCLUDED.sample_interval_ms,
                 registered_at_ms = EXCLUDED.registered_at_ms, last_seen_ms = GREATEST(nodes.last_seen_ms, EXCLUDED.last_seen_ms),
                 stream_holder = EXCLUDED.stream_holder, layout_version = nodes.layout_version + 1
             RETURNING id",
        )
        .bind(&reg.node)
        .bind(&reg.boot_id)
        .bind(&reg.agent_version)
        .bind(&reg.driver_version)
        .bind(i32::try_from(reg.sample_interval_ms).unwrap_or(i32::MAX))
        .bind(now_ms)
        .bind(self.own_url())
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO agent_boots (node_id, boot_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .execute(&mut *tx)
        .await?;
        let seqs: (i64, i64) = sqlx::query_as(
            "SELECT b.committed_seq, COALESCE(d.durable_seq, 0) FROM agent_boots b
             LEFT JOIN stream_durable d ON d.node_id = b.node_id AND d.boot_id = b.boot_id
             WHERE b.node_id = $1 AND b.boot_id = $2",
        )
        .bind(node_id)
        .bind(&reg.boot_id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE devices SET present = FALSE, absent_since_ms = $2 WHERE node_id = $1 AND present",
        )
        .bind(node_id)
        .bind(now_ms)
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
                     mig_profile = EXCLUDED.mig_profile, present = TRUE, absent_since_ms = NULL
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
        let session = load_session(&mut tx, node_id, &reg.node, &reg.boot_id, seqs).await?;
        self.learn_durable(&session);
        tx.commit().await?;
        Ok(session)
    }

    async fn release_device(&self, uuid: &str, now_ms: i64) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "WITH released AS (
                 UPDATE devices d SET present = FALSE,
                     absent_since_ms = CASE WHEN d.present THEN $2 ELSE d.absent_since_ms END
                 WHERE d.uuid = $1 RETURNING d.node_id)
             UPDATE nodes n SET layout_version = n.layout_version + 1
             FROM released r WHERE n.id = r.node_id RETURNING n.name",
        )
        .bind(uuid)
        .bind(now_ms)
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn session(&self, node: &str, boot_id: &str) -> Result<Option<NodeSession>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT n.id, b.committed_seq, COALESCE(d.durable_seq, 0) AS durable_seq
             FROM nodes n JOIN agent_boots b ON b.node_id = n.id
             LEFT JOIN stream_durable d ON d.node_id = b.node_id AND d.boot_id = b.boot_id
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
        if let Some(open) = &self.open_chunks {
            let open = lock(open);
            if open.overfull() {
                return Err(StoreError::Backlog {
                    held_mib: open.bytes() >> 20,
                });
            }
        }
        self.write_group_creating_partitions(batches).await
    }

    async fn flush(&self, force: bool) -> Result<FlushReport, StoreError> {
        match &self.open_chunks {
            Some(open) => self.flush_open_chunks(open, force).await,
            None => Ok(FlushReport::default()),
        }
    }

    fn durable_seq(&self, node_id: i64, boot_id: &str) -> Option<u64> {
        let open = self.open_chunks.as_ref()?;
        Some(
            lock(open)
                .durable(&(node_id, boot_id.to_owned()))
                .unwrap_or(0),
        )
    }

    async fn maintain(&self, now_ms: i64) -> Result<MaintenanceReport, StoreError> {
        maintenance::run(&self.pool, &self.leadership, &self.storage, now_ms).await
    }

    async fn watermarks(&self) -> Result<Watermarks, StoreError> {
        maintenance::watermarks(&self.pool).await
    }

    fn parallel_writes(&self) -> bool {
        true
    }

    async fn peer_secret(&self, fresh: &str) -> Result<Option<String>, StoreError> {
        sqlx::query(
            "INSERT INTO peer_secret (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
        )
        .bind(fresh)
        .execute(&self.pool)
        .await?;
        Ok(Some(
            sqlx::query_scalar("SELECT secret FROM peer_secret WHERE id = 1")
                .fetch_one(&self.pool)
                .await?,
        ))
    }

    fn link_peers(&self, link: PeerLink) {
        if self.peers.set(link).is_err() {
            tracing::warn!("reads across collectors were already linked; keeping the first link");
        }
    }

    fn open_samples(&self, query: &OpenSamplesQuery) -> OpenSamples {
        let Some(open) = &self.open_chunks else {
            return OpenSamples::default();
        };
        let open = lock(open);
        if query.allocator {
            return OpenSamples {
                allocator: open.allocator_between(&query.process_ids, query.from_ms, query.to_ms),
                ..OpenSamples::default()
            };
        }
        OpenSamples {
            gpu: open.gpu_between(query.device_id, query.from_ms, query.to_ms),
            processes: open.processes_between(&query.process_ids, query.from_ms, query.to_ms),
            allocator: Vec::new(),
        }
    }

    async fn close(&self) {
        // What is held would otherwise wait for the agents to send it again.
        crate::store::log_flush_on_close(self.flush(true).await);
        // Nothing is held here now: other collectors' charts need not ask.
        if let Some(url) = self.own_url()
            && let Err(error) =
                sqlx::query("UPDATE nodes SET stream_holder = NULL WHERE stream_holder = $1")
                    .bind(url)
                    .execute(&self.pool)
                    .await
        {
            tracing::warn!(%error, "could not clear this collector as the holder of its streams");
        }
        // Another collector would otherwise show this one's devices as they
        // were at their last checkpoint until their agents reconnect.
        let devices = self.latest_cache.take_unwritten();
        let nodes = self.node_cache.take_unwritten();
        let processes = self.process_seen.take_unwritten();
        let reports: Vec<_> = (self.allocator_seen.take_unwritten().into_iter())
            .map(|report| (report, None))
            .collect();
        if !devices.is_empty() || !nodes.is_empty() || !processes.is_empty() || !reports.is_empty()
        {
            let written: Result<(), StoreError> = async {
                let mut conn = self.pool.acquire().await?;
                write::write_checkpoints(&mut conn, self.writer, &devices, &nodes, &processes)
                    .await?;
                write::write_allocator_checkpoints(&mut conn, &reports).await
            }
            .await;
            if let Err(error) = written {
                tracing::warn!(%error, devices = devices.len(), nodes = nodes.len(), processes = processes.len(),
                    allocator_reports = reports.len(),
                    "could not write the newest samples to gpu_latest, nodes and processes on close");
            }
        }
        self.leadership.resign().await;
        self.writers.close().await;
        self.pool.close().await;
    }

    async fn nodes(&self) -> Result<Vec<NodeView>, StoreError> {
        let mut tx = chart_transaction(&self.pool).await?;
        let nodes = fleet_layout::nodes(&mut tx, &self.layout_cache, &self.node_cache).await?;
        tx.commit().await?;
        Ok(nodes)
    }

    async fn latest_devices(&self) -> Result<FleetDevices, StoreError> {
        let mut tx = chart_transaction(&self.pool).await?;
        let devices = fleet_layout::latest_devices(
            &mut tx,
            &self.layout_cache,
            &self.latest_cache,
            self.writer,
        )
        .await?;
        tx.commit().await?;
        Ok(devices)
    }

    async fn device_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<SeriesPoint>>, StoreError> {
        let Some((device, holder)) = self.device_and_holder(uuid).await? else {
            return Ok(None);
        };
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.pool).await?;
        let bounds = source_bounds(
            resolution_for(from_ms, width, marks, &self.storage),
            from_ms,
            to_ms,
            marks,
        );
        let open = self
            .open_here_and_at(
                holder.as_deref(),
                OpenSamplesQuery {
                    device_id: i64::from(device),
                    process_ids: Vec::new(),
                    from_ms: bounds.minute_end_ms,
                    to_ms,
                    allocator: false,
                },
            )
            .await;
        // Raw samples of days already packed come out of their chunks, read
        // in the snapshot of the query below: a pack or unpack committing
        // in between neither hides samples nor counts them twice.
        let mut tx = chart_transaction(&self.pool).await?;
        if bounds.minute_end_ms <= from_ms {
            // No rollup in the range: the samples (chunks, rows from before
            // the upgrade, open ones) make the points here.
            let stored =
                Self::stored_gpu_samples(&mut tx, &[i64::from(device)], from_ms, to_ms).await?;
            tx.commit().await?;
            let samples = merged(stored, open.gpu, |r| r.timestamp_ms);
            return Ok(Some(fold::series_points(&fold::gpu_buckets(
                &samples, from_ms, width,
            ))));
        }
        let stored = packing::samples_between::<GpuSampleRow>(
            &mut tx,
            &[i64::from(device)],
            bounds.minute_end_ms,
            to_ms,
        )
        .await?;
        let packed = fold::gpu_buckets(
            &merged(stored, open.gpu, |r| r.timestamp_ms),
            from_ms,
            width,
        );
        let column = |f: fn(&fold::GpuBucket) -> i64| packed.iter().map(f).collect::<Vec<i64>>();
        // 128-bit sums travel as text, for Postgres to read as numeric.
        let sum = |f: fn(&fold::GpuBucket) -> fold::Sum| {
            let sums: Vec<fold::Sum> = packed.iter().map(f).collect();
            (
                sums.iter()
                    .map(|s| s.total().map(|t| t.to_string()))
                    .collect::<Vec<_>>(),
                sums.iter().map(|s| s.samples).collect::<Vec<_>>(),
            )
        };
        let used_sum: Vec<String> = packed.iter().map(|b| b.used_sum.to_string()).collect();
        let (util_sum, util_samples) = sum(|b| b.utilization);
        let (tx_sum, tx_samples) = sum(|b| b.pcie_tx);
        let (rx_sum, rx_samples) = sum(|b| b.pcie_rx);
        // Every source as sums over its samples (a rollup row is `samples`
        // samples of its mean; an optional figure counts only the samples
        // that have it), so a bucket mixing sources or packed and raw
        // samples still averages per sample.
        let points = sqlx::query_as::<_, SeriesPoint>(
            "WITH src AS (
                 SELECT ts_ms AS at, last_ts_ms AS ts, samples::int8 AS samples,
                     used_avg::numeric * samples AS used_sum, used_min, used_max, reserved, total,
                     utilization::float8 * samples AS util_sum,
                     CASE WHEN utilization IS NULL THEN 0 ELSE samples END::int8 AS util_samples,
                     pcie_tx::numeric * samples AS tx_sum,
                     CASE WHEN pcie_tx IS NULL THEN 0 ELSE samples END::int8 AS tx_samples,
                     pcie_rx::numeric * samples AS rx_sum,
                     CASE WHEN pcie_rx IS NULL THEN 0 ELSE samples END::int8 AS rx_samples
                 FROM gpu_hours($2, $5) WHERE device_id = $1
                 UNION ALL
                 SELECT ts_ms, last_ts_ms, samples, used_avg::numeric * samples, used_min, used_max, reserved, total,
                     utilization::float8 * samples, CASE WHEN utilization IS NULL THEN 0 ELSE samples END,
                     pcie_tx::numeric * samples, CASE WHEN pcie_tx IS NULL THEN 0 ELSE samples END,
                     pcie_rx::numeric * samples, CASE WHEN pcie_rx IS NULL THEN 0 ELSE samples END
                 FROM gpu_minutes($5, $6) WHERE device_id = $1
                 UNION ALL
                 SELECT ts_ms, ts_ms, 1, used_last, used_min, used_max, reserved, total,
                     utilization, CASE WHEN utilization IS NULL THEN 0 ELSE 1 END,
                     pcie_tx, CASE WHEN pcie_tx IS NULL THEN 0 ELSE 1 END,
                     pcie_rx, CASE WHEN pcie_rx IS NULL THEN 0 ELSE 1 END
                 FROM gpu_samples WHERE device_id = $1 AND ts_ms >= $6 AND ts_ms <= $3
                 UNION ALL
                 SELECT ts, ts, samples, used_sum::numeric, used_min, used_max, reserved, total,
                     util_sum::float8, util_samples, tx_sum::numeric, tx_samples, rx_sum::numeric, rx_samples
                 FROM UNNEST($7::int8[], $8::int8[], $9::text[], $10::int8[], $11::int8[], $12::int8[],
                     $13::int8[], $14::text[], $15::int8[], $16::text[], $17::int8[], $18::text[],
                     $19::int8[])
                     AS packed (ts, samples, used_sum, used_min, used_max, reserved, total, util_sum,
                         util_samples, tx_sum, tx_samples, rx_sum, rx_samples))
             SELECT MAX(ts) AS timestamp_ms, SUM(samples)::int8 AS samples,
                 ROUND(SUM(used_sum) / SUM(samples))::int8 AS memory_used_bytes,
                 MIN(used_min) AS memory_used_min_bytes, MAX(used_max) AS memory_used_max_bytes,
                 MAX(reserved) AS memory_reserved_bytes, MAX(total) AS memory_total_bytes,
                 SUM(util_sum) / NULLIF(SUM(util_samples), 0) AS utilization_pct,
                 ROUND(SUM(tx_sum) / NULLIF(SUM(tx_samples), 0))::int8 AS pcie_tx_bytes_per_s,
                 ROUND(SUM(rx_sum) / NULLIF(SUM(rx_samples), 0))::int8 AS pcie_rx_bytes_per_s
             FROM src GROUP BY (at - $2) / $4 ORDER BY 1",
        )
        .bind(device)
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .bind(column(|b| b.newest_ms))
        .bind(column(|b| b.samples))
        .bind(&used_sum)
        .bind(column(|b| b.used_min))
        .bind(column(|b| b.used_max))
        .bind(column(|b| b.reserved))
        .bind(column(|b| b.total))
        .bind(&util_sum)
        .bind(&util_samples)
        .bind(&tx_sum)
        .bind(&tx_samples)
        .bind(&rx_sum)
        .bind(&rx_samples)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(points))
    }

    async fn fleet_history(
        &self,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Vec<FleetHistoryPoint>, StoreError> {
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.pool).await?;
        let bounds = fleet_source_bounds(from_ms, to_ms, width, marks, &self.storage);
        // An hour row weighs as its 60 minutes in a bucket that also holds
        // minute rows.
        let rollups = sqlx::query_as::<_, FleetBucketRow>(
            "WITH src AS (
                 SELECT ts_ms AS at, 60 AS span, used_avg, used_max, capacity, devices, devices_below_10pct
                 FROM fleet_1h WHERE ts_ms >= $1 AND ts_ms < $3
                 UNION ALL
                 SELECT ts_ms, 1, used_avg, used_max, capacity, devices, devices_below_10pct
                 FROM fleet_1m WHERE ts_ms >= $3 AND ts_ms < $4)
             SELECT (at - $1) / $2 AS bucket,
                 ROUND(SUM(used_avg::numeric * span) / SUM(span))::int8 AS used_bytes,
                 MAX(used_max) AS used_max_bytes, MAX(capacity) AS capacity_bytes,
                 MAX(devices)::int8 AS devices, MAX(devices_below_10pct)::int8 AS devices_below_10pct
             FROM src GROUP BY 1 ORDER BY 1",
        )
        .bind(from_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .fetch_all(&self.pool)
        .await?;
        // A few thousand rows at most, and no index on fired_at_ms: read
        // at query time rather than rolled up.
        let alerts = sqlx::query_as::<_, AlertBucketRow>(
            "SELECT (fired_at_ms - $1) / $3 AS bucket, COUNT(*) AS fired FROM alerts
             WHERE fired_at_ms >= $1 AND fired_at_ms <= $2 GROUP BY 1",
        )
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .fetch_all(&self.pool)
        .await?;
        Ok(fleet_points(rollups, alerts, from_ms, to_ms, width))
    }

    async fn processes(
        &self,
        since_ms: i64,
        on: ProcessesOn<'_>,
    ) -> Result<Vec<ProcessView>, StoreError> {
        // A node's or a few devices' processes: the devices picked first,
        // apart. Their processes are then as often found by a scan of the
        // fleet's (58 ms for 426 of 200,000 at 100,000 GPUs, in 213 devices)
        // as through each device's index: forced (a lateral subquery
        // fenced with `OFFSET 0`), that took 7.9 ms on a quiet table but
        // 1.4 s at the median under the ingest of a fleet that size. The
        // planner chooses.
        let picked = match on {
            ProcessesOn::Fleet | ProcessesOn::Owners(_) => None,
            ProcessesOn::Node(_) => Some("n.name = $3"),
            ProcessesOn::Devices(_) => Some("d.uuid = ANY($3)"),
        };
        // `strpos(x, '') = 1`: a part not asked for matches every process.
        let owners = match on {
            ProcessesOn::Owners(_) => {
                "AND strpos(p.user_name, $3) > 0 AND strpos(p.slurm_job_id, $4) > 0 AND strpos(p.pod_uid, $5) > 0"
            }
            _ => "",
        };
        // A steady process's row is a checkpoint: this collector may have
        // seen it since, though the row says otherwise. Only those rows go
        // by id (sending every process seen cost 200,000 ids at 100,000
        // GPUs).
        let seen = self.process_seen.seen_since_beyond_rows(since_ms);
        let sql = match picked {
            None => format!(
                "SELECT p.id AS process_id, n.name AS node, d.uuid AS device_uuid, d.gpu_index::int8 AS gpu_index,
                     {PROCESS_COLUMNS}
                 FROM processes p JOIN devices d ON d.id = p.device_id JOIN nodes n ON n.id = d.node_id
                 WHERE (p.last_seen_ms >= $1 OR p.id = ANY($2)) {owners}"
            ),
            Some(picked) => format!(
                "WITH picked AS MATERIALIZED (
                     SELECT d.id, d.uuid, d.gpu_index, n.name
                     FROM devices d JOIN nodes n ON n.id = d.node_id WHERE {picked}
                 )
                 SELECT p.id AS process_id, d.name AS node, d.uuid AS device_uuid, d.gpu_index::int8 AS gpu_index,
                     {PROCESS_COLUMNS}
                 FROM picked d JOIN processes p ON p.device_id = d.id
                 WHERE p.last_seen_ms >= $1 OR p.id = ANY($2)"
            ),
        };
        let query = sqlx::query_as::<_, ProcessIdRow>(&sql)
            .bind(since_ms)
            .bind(seen);
        let query = match on {
            ProcessesOn::Fleet => query,
            ProcessesOn::Node(node) => query.bind(node),
            ProcessesOn::Devices(uuids) => query.bind(uuids),
            ProcessesOn::Owners(owner) => query
                .bind(owner.user)
                .bind(owner.slurm_job_id)
                .bind(owner.pod_uid),
        };
        let rows = query.fetch_all(&self.pool).await?;
        let mut rows: Vec<ProcessRow> = rows
            .into_iter()
            .map(
                |ProcessIdRow {
                     process_id,
                     mut row,
                 }| {
                    if let Some(newer) = self
                        .process_seen
                        .newer_than(process_id, Some(row.last_seen_ms))
                    {
                        row.last_seen_ms = newer.timestamp_ms;
                        row.memory_used_bytes = newer.memory;
                    }
                    if let Some(newer) = self.allocator_seen.newer_than(process_id, row.alloc_ts_ms)
                    {
                        row.lay_allocator_over(&newer.report);
                    }
                    row
                },
            )
            .collect();
        rows.sort_by(|a, b| {
            b.memory_used_bytes
                .cmp(&a.memory_used_bytes)
                .then_with(|| a.node.cmp(&b.node))
                .then_with(|| a.pid.cmp(&b.pid))
        });
        Ok(rows.into_iter().map(ProcessView::from).collect())
    }

    async fn process_series(
        &self,
        uuid: &str,
        from_ms: i64,
        to_ms: i64,
        max_points: u32,
    ) -> Result<Option<Vec<ProcessSeries>>, StoreError> {
        let Some((device, holder)) = self.device_and_holder(uuid).await? else {
            return Ok(None);
        };
        let meta = sqlx::query_as::<_, ProcessMeta>(
            "SELECT id, pid, start_time_ms, name, user_name AS user, slurm_job_id, pod_uid FROM processes
             WHERE device_id = $1 AND last_seen_ms >= $2 AND first_seen_ms <= $3",
        )
        .bind(device)
        .bind(from_ms.saturating_sub(checkpoints::PROCESS_ROW_TRAILS_MS))
        .bind(to_ms)
        .fetch_all(&self.pool)
        .await?;
        let ids: Vec<i64> = meta.iter().map(|m| m.id).collect();
        let width = bucket_width_ms(from_ms, to_ms, max_points);
        let marks = maintenance::watermarks(&self.pool).await?;
        let bounds = source_bounds(
            resolution_for(from_ms, width, marks, &self.storage),
            from_ms,
            to_ms,
            marks,
        );
        let open = self
            .open_here_and_at(
                holder.as_deref(),
                OpenSamplesQuery {
                    device_id: i64::from(device),
                    process_ids: ids.clone(),
                    from_ms: bounds.minute_end_ms,
                    to_ms,
                    allocator: false,
                },
            )
            .await;
        let mut tx = chart_transaction(&self.pool).await?;
        let stored =
            packing::samples_between::<ProcessPoint>(&mut tx, &ids, bounds.minute_end_ms, to_ms)
                .await?;
        let packed = fold::process_peaks(
            merged(stored, open.processes, |r| (r.process_id, r.timestamp_ms)),
            from_ms,
            width,
        );
        let buckets = sqlx::query_as::<_, ProcessBucket>(
            "WITH src AS (
                 SELECT process_id, ts_ms AS at, used_max FROM process_hours($2, $5)
                 WHERE process_id = ANY($1)
                 UNION ALL
                 SELECT process_id, ts_ms, used_max FROM process_minutes($5, $6)
                 WHERE process_id = ANY($1)
                 UNION ALL
                 SELECT process_id, ts_ms, used_max FROM process_samples
                 WHERE process_id = ANY($1) AND ts_ms >= $6 AND ts_ms <= $3
                 UNION ALL
                 SELECT * FROM UNNEST($7::int8[], $8::int8[], $9::int8[]))
             SELECT process_id, LEAST($3, $2 + ((at - $2) / $4 + 1) * $4 - 1) AS timestamp_ms, MAX(used_max) AS used
             FROM src GROUP BY process_id, (at - $2) / $4",
        )
        .bind(&ids)
        .bind(from_ms)
        .bind(to_ms)
        .bind(width)
        .bind(bounds.hour_end_ms)
        .bind(bounds.minute_end_ms)
        .bind(packed.iter().map(|r| r.process_id).collect::<Vec<_>>())
        .bind(packed.iter().map(|r| r.timestamp_ms).collect::<Vec<_>>())
        .bind(packed.iter().map(|r| r.used_max).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
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
        let process: Option<(i64, i64, i32, Option<String>)> = sqlx::query_as(
            "SELECT p.id, p.start_time_ms, d.id, n.stream_holder FROM processes p
             JOIN devices d ON d.id = p.device_id JOIN nodes n ON n.id = d.node_id
             WHERE d.uuid = $1 AND p.pid = $2 AND ($3::int8 IS NULL OR p.start_time_ms = $3)
             ORDER BY p.start_time_ms DESC LIMIT 1",
        )
        .bind(q.device_uuid)
        .bind(q.pid)
        .bind(q.start_time_ms)
        .fetch_optional(&self.pool)
        .await?;
        let Some((process_id, start_time_ms, device, holder)) = process else {
            return Ok(None);
        };
        let open = self
            .open_here_and_at(
                holder.as_deref(),
                OpenSamplesQuery {
                    device_id: i64::from(device),
                    process_ids: vec![process_id],
                    from_ms: q.from_ms,
                    to_ms: q.to_ms,
                    allocator: true,
                },
            )
            .await;
        let width = bucket_width_ms(q.from_ms, q.to_ms, q.max_points);
        let mut folded = fold::AllocatorFold::new(q.from_ms, width);
        open.allocator.into_iter().for_each(|r| folded.add(r));
        let mut tx = chart_transaction(&self.pool).await?;
        packing::fold_allocator_chunks(
            &mut tx,
            process_id,
            (q.from_ms, q.to_ms),
            width >= MINUTE_MS,
            &mut folded,
        )
        .await?;
        // Written before allocator chunks, or by a collector writing rows.
        let select = format!(
            "SELECT {ALLOCATOR_REPORT_COLUMNS} FROM allocator_samples
             WHERE process_id = $1 AND ts_ms BETWEEN $2 AND $3"
        );
        let mut rows = sqlx::query_as::<_, AllocatorReport>(&select)
            .bind(process_id)
            .bind(q.from_ms)
            .bind(q.to_ms)
            .fetch(&mut *tx);
        while let Some(report) = rows.try_next().await? {
            folded.add(report);
        }
        Ok(Some(AllocatorSeries {
            device_uuid: q.device_uuid.to_owned(),
            pid: q.pid,
            start_time_ms,
            points: folded.points(),
        }))
    }
}

/// A process as the store reads it, with the id its checkpoint is kept by.
#[derive(sqlx::FromRow)]
struct ProcessIdRow {
    process_id: i64,
    #[sqlx(flatten)]
    row: ProcessRow,
}

/// Checks once a second that the host written to still takes writes, and
/// moves the pool, the ingest writers and (through them) the maintenance
/// lock to the first host that does when it stops. Ends with the store.
async fn follow_failover(
    primary: std::sync::Weak<primary::Primary>,
    writers: std::sync::Weak<write_connections::WriteConnections>,
    pool: PgPool,
) {
    const EVERY: Duration = Duration::from_secs(1);
    let mut outage_reported = false;
    loop {
        tokio::time::sleep(EVERY).await;
        let (Some(primary), Some(writers)) = (primary.upgrade(), writers.upgrade()) else {
            return;
        };
        if pool.is_closed() {
            return;
        }
        if primary.current_is_acceptable().await {
            continue;
        }
        let was = primary.host().to_owned();
        match primary.find().await {
            Ok(_) => {
                let now = primary.host().to_owned();
                if now != was {
                    pool.set_connect_options(primary.options());
                    writers.forget_idle();
                    tracing::warn!(from = %was, to = %now, "the database host taking writes changed; writing there");
                }
                outage_reported = false;
            }
            Err(error) => {
                // Once per outage, not once a second.
                if !outage_reported {
                    tracing::error!(%error, "no database host takes writes; agents keep their batches until one does");
                    outage_reported = true;
                }
            }
        }
    }
}

/// "no partition of relation … found for row" (a check violation).
fn is_missing_partition(error: &sqlx::Error) -> bool {
    error.as_database_error().is_some_and(|e| {
        e.code().as_deref() == Some("23514") && e.message().contains("no partition")
    })
}

/// A read-only transaction with one snapshot for all of a chart's reads.
async fn chart_transaction(pool: &PgPool) -> Result<Transaction<'static, Postgres>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}
