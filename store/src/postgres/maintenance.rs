//! The singleton jobs: partitions ahead of time, retention by dropping whole
//! partitions, and the minute and hour rollups. Every collector runs the
//! pass; only the one holding a session-level advisory lock does the work,
//! and when it dies its connection (and so the lock) goes with it, and the
//! next pass of another collector takes over.

use std::sync::Arc;
use std::time::Instant;

use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Postgres, Row, Transaction};
use tokio::sync::Mutex;

use super::packing;
use super::primary::Primary;
use super::rollup_packing;
use crate::StoreError;
use crate::model::GpuSampleRow;
use crate::model::ProcessPoint;
use crate::rollup::{
    DAY_MS, HOUR_MS, MINUTE_MS, MaintenanceReport, StorageConfig, Watermarks, bucket_start,
    contiguous_runs, next_minute_watermark,
};
use crate::views::LOW_HEADROOM_USED_TENTHS;

/// `pg_advisory_lock` key of the maintenance leader ("headroom" in ASCII).
const LEADER_LOCK: i64 = 0x6865_6164_726f_6f6d;
/// Transaction-level lock around partition creation, which both the leader
/// and a writer that met a missing partition may do.
const PARTITION_LOCK: i64 = LEADER_LOCK + 1;
/// Transaction-level lock that orders packing against minute rollups.
pub(super) const PACKING_LOCK: i64 = LEADER_LOCK + 2;
/// Transaction-level lock that orders packing an hour's minute rollups
/// (exclusive) against late minutes unpacking them (shared).
pub(super) const MINUTE_PACKING_LOCK: i64 = LEADER_LOCK + 3;
/// Transaction-level lock that orders packing a day's hour rollups
/// (exclusive) against an hour of it rolled up again (shared).
pub(super) const HOUR_PACKING_LOCK: i64 = LEADER_LOCK + 4;

/// Buckets rolled up per transaction: a day's catch-up is a few short
/// transactions rather than one long one.
const BUCKETS_PER_TRANSACTION: usize = 360;

#[derive(Debug, Clone, Copy)]
enum Keep {
    Raw,
    Minute,
    Hour,
}

#[derive(Debug)]
struct Partitioned {
    table: &'static str,
    width_ms: i64,
    keep: Keep,
}

const PARTITIONED: [Partitioned; 15] = [
    Partitioned {
        table: "gpu_samples",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "gpu_samples_packed",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "process_samples",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "process_samples_packed",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "allocator_samples",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "allocator_samples_packed",
        width_ms: DAY_MS,
        keep: Keep::Raw,
    },
    Partitioned {
        table: "events",
        width_ms: DAY_MS,
        keep: Keep::Minute,
    },
    Partitioned {
        table: "gpu_samples_1m",
        width_ms: DAY_MS,
        keep: Keep::Minute,
    },
    Partitioned {
        table: "process_samples_1m",
        width_ms: DAY_MS,
        keep: Keep::Minute,
    },
    Partitioned {
        table: "gpu_samples_1m_packed",
        width_ms: DAY_MS,
        keep: Keep::Minute,
    },
    Partitioned {
        table: "process_samples_1m_packed",
        width_ms: DAY_MS,
        keep: Keep::Minute,
    },
    Partitioned {
        table: "gpu_samples_1h",
        width_ms: 7 * DAY_MS,
        keep: Keep::Hour,
    },
    Partitioned {
        table: "process_samples_1h",
        width_ms: 7 * DAY_MS,
        keep: Keep::Hour,
    },
    Partitioned {
        table: "gpu_samples_1h_packed",
        width_ms: 7 * DAY_MS,
        keep: Keep::Hour,
    },
    Partitioned {
        table: "process_samples_1h_packed",
        width_ms: 7 * DAY_MS,
        keep: Keep::Hour,
    },
];

/// How far ahead partitions exist, so that a day boundary never waits on
/// maintenance.
const AHEAD_MS: i64 = 2 * DAY_MS;

fn keep_ms(keep: Keep, storage: &StorageConfig) -> i64 {
    match keep {
        Keep::Raw => storage.raw_retention_ms(),
        Keep::Minute => storage.minute_retention_ms(),
        Keep::Hour => storage.hour_retention_ms(),
    }
}

/// The connection that holds the leader lock, while this collector leads.
#[derive(Debug)]
pub(super) struct Leadership {
    primary: Arc<Primary>,
    /// The connection holding the lock, and when it was opened.
    held: Mutex<Option<(PgConnection, Instant)>>,
}

impl Leadership {
    pub(super) fn new(primary: Arc<Primary>) -> Self {
        Self {
            primary,
            held: Mutex::new(None),
        }
    }

    /// True while this collector holds the lock; tries to take it when not.
    async fn lead(&self) -> bool {
        let mut held = self.held.lock().await;
        if let Some((conn, opened)) = held.as_mut() {
            // A lock on a host no longer written to (after a failover) leads
            // nothing.
            if *opened >= self.primary.switched_at() && conn.ping().await.is_ok() {
                return true;
            }
            tracing::warn!("lost the maintenance lock's connection; trying to take it again");
            *held = None;
        }
        let opened = Instant::now();
        let Ok(mut conn) = PgConnection::connect_with(&self.primary.options()).await else {
            return false;
        };
        let taken: Result<bool, _> = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(LEADER_LOCK)
            .fetch_one(&mut conn)
            .await;
        if matches!(taken, Ok(true)) {
            tracing::info!("this collector now runs storage maintenance");
            *held = Some((conn, opened));
            true
        } else {
            false
        }
    }

    /// Gives the lock up (shutdown), so another collector takes over at once.
    pub(super) async fn resign(&self) {
        if let Some((mut conn, _)) = self.held.lock().await.take() {
            // Unlocked before the connection closes: the server releases a
            // closed session's locks only once its backend has exited,
            // which on a busy host can trail the close, and the next
            // collector's pass should find the lock free at once.
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(LEADER_LOCK)
                .execute(&mut conn)
                .await;
            if let Err(error) = unlocked {
                tracing::debug!(%error, "could not unlock the maintenance lock; closing releases it");
            }
            let _ = conn.close().await;
        }
    }
}

pub(super) async fn watermarks(pool: &PgPool) -> Result<Watermarks, StoreError> {
    Ok(sqlx::query_as::<_, Watermarks>(
        "SELECT COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = $1), 0) AS minute_ms,
                COALESCE((SELECT done_until_ms FROM rollup_progress WHERE step_ms = $2), 0) AS hour_ms",
    )
    .bind(MINUTE_MS)
    .bind(HOUR_MS)
    .fetch_one(pool)
    .await?)
}

pub(super) async fn run(
    pool: &PgPool,
    leadership: &Leadership,
    storage: &StorageConfig,
    now_ms: i64,
) -> Result<MaintenanceReport, StoreError> {
    let mut report = MaintenanceReport {
        leader: leadership.lead().await,
        ..MaintenanceReport::default()
    };
    if report.leader {
        // From the oldest minute still to roll up (a collector catching up
        // writes rollups that far back) or the oldest sample accepted.
        let oldest = watermarks(pool).await?.minute_ms;
        let from = oldest.min(now_ms - storage.raw_retention_ms());
        report.partitions_created = ensure_partitions(pool, from, now_ms + AHEAD_MS).await?;
        advance_minutes(pool, now_ms).await?;
        report.minutes_rolled_up = roll_up_minutes(pool).await?;
        report.hours_rolled_up = roll_up_hours(pool).await?;
        let marks = watermarks(pool).await?;
        report.partitions_dropped = drop_expired(pool, storage, now_ms, marks).await?;
        report.rows_expired = expire_fleet(pool, storage, now_ms, marks).await?;
        report.samples_packed =
            packing::pack_cold_days(pool, storage, now_ms, marks.minute_ms).await?;
        let deadline = Instant::now() + storage.pack_time_per_pass();
        let compacted = super::compaction::compact_closed_hours(pool, now_ms, deadline).await?;
        report.chunks_compacted = compacted.chunks_folded;
        report.minute_rows_packed = compacted.minute_rows_packed;
        report.hour_rows_packed = rollup_packing::pack_closed_days(
            pool,
            marks.hour_ms,
            now_ms - storage.hour_retention_ms(),
            deadline,
        )
        .await?;
    }
    report.watermarks = Some(watermarks(pool).await?);
    Ok(report)
}

/// Creates every partition of every table that `[from_ms, to_ms]` needs;
/// returns how many were missing.
pub(super) async fn ensure_partitions(
    pool: &PgPool,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64, StoreError> {
    create_partitions(pool, &PARTITIONED, from_ms, to_ms).await
}

/// Creates the partitions of `tables` (of those partitioned by time) that
/// `[from_ms, to_ms]` needs: for rollups packed further back than the
/// pass creates partitions for, after an upgrade.
pub(super) async fn ensure_partitions_of(
    pool: &PgPool,
    tables: &[&str],
    from_ms: i64,
    to_ms: i64,
) -> Result<u64, StoreError> {
    let chosen: Vec<&Partitioned> = PARTITIONED
        .iter()
        .filter(|p| tables.contains(&p.table))
        .collect();
    create_partitions(pool, chosen, from_ms, to_ms).await
}

async fn create_partitions<'a>(
    pool: &PgPool,
    tables: impl IntoIterator<Item = &'a Partitioned>,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(PARTITION_LOCK)
        .execute(&mut *tx)
        .await?;
    // Creating a partition briefly locks its parent; rather than queue every
    // writer behind a long query, give up and try again next pass.
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *tx)
        .await?;
    let mut created = 0u64;
    for p in tables {
        let n: i32 = sqlx::query_scalar("SELECT headroom_create_partitions($1, $2, $3, $4)")
            .bind(p.table)
            .bind(p.width_ms)
            .bind(from_ms)
            .bind(to_ms)
            .fetch_one(&mut *tx)
            .await?;
        created += u64::try_from(n).unwrap_or(0);
    }
    tx.commit().await?;
    if created > 0 {
        tracing::info!(created, "created partitions");
    }
    Ok(created)
}

/// A partition of one of the time-partitioned tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Partition {
    pub parent: String,
    pub name: String,
    pub from_ms: i64,
    pub to_ms: i64,
}

/// The range partitions of `parents`, each with its bounds.
pub(super) async fn partitions_of(
    pool: &PgPool,
    parents: &[&str],
) -> Result<Vec<Partition>, StoreError> {
    let rows = sqlx::query(
        "SELECT parent.relname AS parent, child.relname AS child,
                pg_get_expr(child.relpartbound, child.oid) AS bound
         FROM pg_inherits i
         JOIN pg_class parent ON parent.oid = i.inhparent
         JOIN pg_class child ON child.oid = i.inhrelid
         WHERE parent.relname = ANY($1) AND child.relkind = 'r'",
    )
    .bind(parents)
    .fetch_all(pool)
    .await?;
    let mut partitions = Vec::with_capacity(rows.len());
    for row in rows {
        let parent: String = row.try_get("parent")?;
        let name: String = row.try_get("child")?;
        let bound: String = row.try_get("bound")?;
        let Some((from_ms, to_ms)) = parse_bound(&bound) else {
            tracing::warn!(partition = %name, %bound, "partition bound not understood; left alone");
            continue;
        };
        partitions.push(Partition {
            parent,
            name,
            from_ms,
            to_ms,
        });
    }
    Ok(partitions)
}

/// Drops every partition whose whole range is older than its table keeps,
/// once the next rollup has what it holds.
async fn drop_expired(
    pool: &PgPool,
    storage: &StorageConfig,
    now_ms: i64,
    marks: Watermarks,
) -> Result<u64, StoreError> {
    let parents: Vec<&str> = PARTITIONED.iter().map(|p| p.table).collect();
    let mut dropped = 0;
    for partition in partitions_of(pool, &parents).await? {
        let Some(spec) = PARTITIONED.iter().find(|p| p.table == partition.parent) else {
            continue;
        };
        let rolled_up_until = match spec.keep {
            Keep::Raw => marks.minute_ms,
            Keep::Minute => marks.hour_ms,
            Keep::Hour => i64::MAX,
        };
        if partition.to_ms > now_ms - keep_ms(spec.keep, storage)
            || partition.to_ms > rolled_up_until
        {
            continue;
        }
        let mut tx = pool.begin().await?;
        sqlx::query("SET LOCAL lock_timeout = '5s'")
            .execute(&mut *tx)
            .await?;
        sqlx::query(&format!(
            "DROP TABLE \"{}\"",
            partition.name.replace('"', "\"\"")
        ))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(partition = %partition.name, "dropped a partition past retention");
        dropped += 1;
    }
    Ok(dropped)
}

/// The fleet rollups are a row per minute or hour, too small to partition:
/// they are deleted by time on the minute and hour tables' retention, the
/// minutes once the hours hold them.
async fn expire_fleet(
    pool: &PgPool,
    storage: &StorageConfig,
    now_ms: i64,
    marks: Watermarks,
) -> Result<u64, StoreError> {
    let minute_cutoff = (now_ms - storage.minute_retention_ms()).min(marks.hour_ms);
    let hour_cutoff = now_ms - storage.hour_retention_ms();
    let mut expired = 0;
    for (table, cutoff) in [("fleet_1m", minute_cutoff), ("fleet_1h", hour_cutoff)] {
        expired += sqlx::query(&format!("DELETE FROM {table} WHERE ts_ms < $1"))
            .bind(cutoff)
            .execute(pool)
            .await?
            .rows_affected();
    }
    Ok(expired)
}

/// `FOR VALUES FROM ('1764460800000') TO ('1764547200000')` → both bounds.
fn parse_bound(bound: &str) -> Option<(i64, i64)> {
    let numbers: Vec<i64> = bound
        .split(|c: char| !(c.is_ascii_digit() || c == '-'))
        .filter(|s| !s.is_empty() && *s != "-")
        .filter_map(|s| s.parse().ok())
        .collect();
    match numbers.as_slice() {
        [from, to] => Some((*from, *to)),
        _ => None,
    }
}

/// Moves the minute watermark up to the grace period (in bounded steps) and
/// marks the minutes it passed as pending. Takes the watermark row in update
/// mode, which waits for every write that read it in share mode.
async fn advance_minutes(pool: &PgPool, now_ms: i64) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    let Some(done): Option<i64> = sqlx::query_scalar(
        "SELECT done_until_ms FROM rollup_progress WHERE step_ms = $1 FOR UPDATE",
    )
    .bind(MINUTE_MS)
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(());
    };
    let Some(target) = next_minute_watermark(done, now_ms) else {
        return Ok(());
    };
    sqlx::query("UPDATE rollup_progress SET done_until_ms = $2 WHERE step_ms = $1")
        .bind(MINUTE_MS)
        .bind(target)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO rollup_pending (step_ms, bucket_ms)
         SELECT $1, generate_series($2::int8, $3::int8 - $1, $1)",
    )
    .bind(MINUTE_MS)
    .bind(done)
    .bind(target)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The buckets of one step that are pending when a pass reaches the step,
/// oldest first. The pass rolls up these and no others: marks that writers
/// add meanwhile (agents replaying hours of spool mark the same minutes
/// over and over) wait for the next pass, so a minute is rolled up at most
/// once a pass, however long its replay lasts.
async fn pending_buckets(pool: &PgPool, step_ms: i64) -> Result<Vec<i64>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT bucket_ms FROM rollup_pending WHERE step_ms = $1 ORDER BY bucket_ms",
    )
    .bind(step_ms)
    .fetch_all(pool)
    .await?)
}

/// Takes the marks of `buckets` (at most a transaction's worth), every copy
/// committed when the statement began; returns the buckets taken. Deleting
/// them in the transaction that rolls them up means a crash leaves them
/// pending. A writer marking one of them meanwhile waits for nothing: its
/// mark, invisible to this delete, stays for the next pass, and the rollup
/// statements, which start later, may already see its rows. A bucket whose
/// marks another transaction holds is skipped.
async fn take_pending(
    tx: &mut Transaction<'_, Postgres>,
    step_ms: i64,
    buckets: &[i64],
) -> Result<Vec<i64>, StoreError> {
    Ok(sqlx::query_scalar(
        "WITH taken AS (
             DELETE FROM rollup_pending WHERE step_ms = $1 AND bucket_ms IN (
                 SELECT bucket_ms FROM rollup_pending WHERE step_ms = $1 AND bucket_ms = ANY($2)
                 FOR UPDATE SKIP LOCKED)
             RETURNING bucket_ms)
         SELECT DISTINCT bucket_ms FROM taken ORDER BY bucket_ms",
    )
    .bind(step_ms)
    .bind(buckets)
    .fetch_all(&mut **tx)
    .await?)
}

const GPU_ROLLUP_COLUMNS: &str =
    "device_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last,
    reserved, total, utilization, pcie_tx, pcie_rx";
const GPU_ROLLUP_UPDATE: &str = "ON CONFLICT (device_id, ts_ms) DO UPDATE SET last_ts_ms = EXCLUDED.last_ts_ms,
    samples = EXCLUDED.samples, used_min = EXCLUDED.used_min, used_max = EXCLUDED.used_max,
    used_avg = EXCLUDED.used_avg, used_last = EXCLUDED.used_last, reserved = EXCLUDED.reserved,
    total = EXCLUDED.total, utilization = EXCLUDED.utilization, pcie_tx = EXCLUDED.pcie_tx, pcie_rx = EXCLUDED.pcie_rx";
const PROCESS_ROLLUP_COLUMNS: &str =
    "process_id, ts_ms, last_ts_ms, samples, used_min, used_max, used_avg, used_last";
const PROCESS_ROLLUP_UPDATE: &str =
    "ON CONFLICT (process_id, ts_ms) DO UPDATE SET last_ts_ms = EXCLUDED.last_ts_ms,
    samples = EXCLUDED.samples, used_min = EXCLUDED.used_min, used_max = EXCLUDED.used_max,
    used_avg = EXCLUDED.used_avg, used_last = EXCLUDED.used_last";

/// The fleet tables of each step, and the device rollups they sum (loose
/// or packed, bounded by the query's `$1` and `$2`).
pub(super) fn fleet_tables(step_ms: i64) -> (&'static str, &'static str) {
    if step_ms == HOUR_MS {
        ("gpu_hours($1, $2)", "fleet_1h")
    } else {
        ("gpu_minutes($1, $2)", "fleet_1m")
    }
}

/// Recomputes the fleet's row of every bucket of `step_ms` in `[from, to)`
/// from all the devices' rollup rows of that bucket, so a bucket redone for
/// one late device is summed over the whole fleet again. Runs in the
/// transaction that wrote those device rows, so the fleet row never lags
/// them. Rows, not deltas: a bucket has no fleet row to fix up by hand.
pub(super) async fn roll_up_fleet(
    conn: &mut PgConnection,
    step_ms: i64,
    from: i64,
    to: i64,
) -> Result<(), StoreError> {
    let (source, target) = fleet_tables(step_ms);
    sqlx::query(&format!(
        "INSERT INTO {target} (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
         SELECT r.ts_ms,
             COALESCE(SUM(r.used_avg) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
             COALESCE(SUM(r.used_max) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
             COALESCE(SUM(r.total) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
             COUNT(*) FILTER (WHERE d.parent_id IS NULL)::int4,
             COUNT(DISTINCT COALESCE(d.parent_id, d.id))
                 FILTER (WHERE r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * $3)::int4
         FROM {source} r JOIN devices d ON d.id = r.device_id
         WHERE r.ts_ms >= $1 AND r.ts_ms < $2
         GROUP BY r.ts_ms
         ON CONFLICT (ts_ms) DO UPDATE SET used_avg = EXCLUDED.used_avg, used_max = EXCLUDED.used_max,
             capacity = EXCLUDED.capacity, devices = EXCLUDED.devices,
             devices_below_10pct = EXCLUDED.devices_below_10pct"
    ))
    .bind(from)
    .bind(to)
    .bind(LOW_HEADROOM_USED_TENTHS)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Rolls pending minutes up from raw samples into the 1 min tables, and
/// marks their hours pending. Returns how many minutes it rolled up.
async fn roll_up_minutes(pool: &PgPool) -> Result<u64, StoreError> {
    let mut total = 0;
    for buckets in pending_buckets(pool, MINUTE_MS)
        .await?
        .chunks(BUCKETS_PER_TRANSACTION)
    {
        let mut tx = pool.begin().await?;
        // Where packing stands, read under the lock every packing
        // transaction takes: should a second leader pack while this one
        // still rolls up (the lock's connection lost mid-pass), a minute is
        // either unpacked first or still whole in the raw table.
        packing::lock_against_packing(&mut tx).await?;
        let gpu_packed_until = packing::packed_until::<GpuSampleRow>(&mut tx).await?;
        let process_packed_until = packing::packed_until::<ProcessPoint>(&mut tx).await?;
        let minutes = take_pending(&mut tx, MINUTE_MS, buckets).await?;
        if minutes.is_empty() {
            continue;
        }
        for (from, to) in contiguous_runs(&minutes, MINUTE_MS) {
            if from < gpu_packed_until {
                packing::unpack_for_rollup::<GpuSampleRow>(&mut tx, from, to).await?;
            }
            if from < process_packed_until {
                packing::unpack_for_rollup::<ProcessPoint>(&mut tx, from, to).await?;
            }
            // The minutes rolled up here from raw rows replace those rows'
            // minutes, which must be loose for that.
            rollup_packing::unpack_for_raw_rollup(&mut tx, from, to).await?;
            // `(max(ARRAY[ts, v]))[2]` is the value at the newest timestamp:
            // "last" without sorting each group.
            sqlx::query(&format!(
                "INSERT INTO gpu_samples_1m ({GPU_ROLLUP_COLUMNS})
                 SELECT device_id, ts_ms - ts_ms % $3, max(ts_ms), count(*), min(used_min), max(used_max),
                     round(avg(used_last))::int8, (max(ARRAY[ts_ms, used_last]))[2], max(reserved), max(total),
                     avg(utilization)::real, round(avg(pcie_tx))::int8, round(avg(pcie_rx))::int8
                 FROM gpu_samples WHERE ts_ms >= $1 AND ts_ms < $2
                 GROUP BY device_id, ts_ms - ts_ms % $3
                 {GPU_ROLLUP_UPDATE}"
            ))
            .bind(from)
            .bind(to)
            .bind(MINUTE_MS)
            .execute(&mut *tx)
            .await?;
            roll_up_fleet(&mut tx, MINUTE_MS, from, to).await?;
            sqlx::query(&format!(
                "INSERT INTO process_samples_1m ({PROCESS_ROLLUP_COLUMNS})
                 SELECT process_id, ts_ms - ts_ms % $3, max(ts_ms), count(*), min(used_last), max(used_max),
                     round(avg(used_last))::int8, (max(ARRAY[ts_ms, used_last]))[2]
                 FROM process_samples WHERE ts_ms >= $1 AND ts_ms < $2
                 GROUP BY process_id, ts_ms - ts_ms % $3
                 {PROCESS_ROLLUP_UPDATE}"
            ))
            .bind(from)
            .bind(to)
            .bind(MINUTE_MS)
            .execute(&mut *tx)
            .await?;
        }
        let mut hours: Vec<i64> = minutes.iter().map(|m| bucket_start(*m, HOUR_MS)).collect();
        hours.sort_unstable();
        hours.dedup();
        sqlx::query(
            "INSERT INTO rollup_pending (step_ms, bucket_ms) SELECT $1, UNNEST($2::int8[])",
        )
        .bind(HOUR_MS)
        .bind(&hours)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        total += minutes.len() as u64;
    }
    Ok(total)
}

/// Rolls pending hours up from the 1 min tables, then moves the hour
/// watermark to the hour the minute watermark is in.
///
/// An hour the minute watermark has not passed yet stays pending: nothing
/// reads it from the hour tables (charts and the fleet history read its
/// minutes up to the hour watermark), and redone each pass for the whole
/// fleet it cost a read of every series' minutes so far, 9 million rows a
/// pass on average at 100,000 GPUs with two processes each.
async fn roll_up_hours(pool: &PgPool) -> Result<u64, StoreError> {
    let minute_mark = watermarks(pool).await?.minute_ms;
    let closed: Vec<i64> = pending_buckets(pool, HOUR_MS)
        .await?
        .into_iter()
        .filter(|hour| hour + HOUR_MS <= minute_mark)
        .collect();
    let mut total = 0;
    for buckets in closed.chunks(BUCKETS_PER_TRANSACTION) {
        let mut tx = pool.begin().await?;
        let hours = take_pending(&mut tx, HOUR_MS, buckets).await?;
        if hours.is_empty() {
            continue;
        }
        // Redone whole, so for every series marked in them too.
        sqlx::query("DELETE FROM hour_redo_series WHERE hour_ms = ANY($1)")
            .bind(&hours)
            .execute(&mut *tx)
            .await?;
        rollup_packing::before_hour_rollup(&mut tx).await?;
        for (from, to) in contiguous_runs(&hours, HOUR_MS) {
            roll_up_hour_rows(&mut tx, from, to, None).await?;
        }
        tx.commit().await?;
        total += hours.len() as u64;
    }
    total += redo_hours_of_series(pool, minute_mark).await?;
    // Hours before the one the minute watermark is in hold all their minutes,
    // unless a late minute is still pending (then that hour is redone on the
    // next pass and briefly reads a little stale).
    sqlx::query(
        "UPDATE rollup_progress SET done_until_ms = GREATEST(done_until_ms,
             (SELECT done_until_ms - done_until_ms % $2 FROM rollup_progress WHERE step_ms = $1))
         WHERE step_ms = $2",
    )
    .bind(MINUTE_MS)
    .bind(HOUR_MS)
    .execute(pool)
    .await?;
    Ok(total)
}

/// Hours the flushes marked for some series only (minutes merged before
/// the minute watermark, from a spool replayed after an outage), once they
/// have ended: each is redone for those series, and the fleet's hour summed
/// again. A late sample costs its own series' hours, not the fleet's.
async fn redo_hours_of_series(pool: &PgPool, minute_mark: i64) -> Result<u64, StoreError> {
    let hours: Vec<i64> = sqlx::query_scalar(
        "SELECT DISTINCT hour_ms FROM hour_redo_series WHERE hour_ms <= $2 - $1 ORDER BY hour_ms",
    )
    .bind(HOUR_MS)
    .bind(minute_mark)
    .fetch_all(pool)
    .await?;
    let mut total = 0;
    for batch in hours.chunks(BUCKETS_PER_TRANSACTION) {
        let mut tx = pool.begin().await?;
        // As take_pending: every mark committed when the statement began,
        // skipping marks another transaction holds.
        let marks: Vec<(i64, bool, i64)> = sqlx::query_as(
            "DELETE FROM hour_redo_series WHERE ctid IN (
                 SELECT ctid FROM hour_redo_series WHERE hour_ms = ANY($1) FOR UPDATE SKIP LOCKED)
             RETURNING hour_ms, process, series_id",
        )
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        rollup_packing::before_hour_rollup(&mut tx).await?;
        let mut by_hour: std::collections::BTreeMap<i64, (Vec<i64>, Vec<i64>)> =
            std::collections::BTreeMap::new();
        for (hour, process, series) in marks {
            let (gpus, processes) = by_hour.entry(hour).or_default();
            if process {
                processes.push(series);
            } else {
                gpus.push(series);
            }
        }
        // Each flush of a replay marks its series again.
        for (gpus, processes) in by_hour.values_mut() {
            gpus.sort_unstable();
            gpus.dedup();
            processes.sort_unstable();
            processes.dedup();
        }
        for (hour, (gpus, processes)) in &by_hour {
            roll_up_hour_rows(&mut tx, *hour, hour + HOUR_MS, Some((gpus, processes))).await?;
        }
        tx.commit().await?;
        total += by_hour.len() as u64;
    }
    Ok(total)
}

/// Rolls the hours of `[from, to)` up from their minutes, for every series
/// or for the GPUs and processes given, and sums the fleet's hours again.
async fn roll_up_hour_rows(
    tx: &mut Transaction<'_, Postgres>,
    from: i64,
    to: i64,
    series: Option<(&[i64], &[i64])>,
) -> Result<(), StoreError> {
    let (only_gpus, only_processes) = match series {
        Some(_) => (
            "WHERE device_id = ANY($4::int8[])",
            "WHERE process_id = ANY($4::int8[])",
        ),
        None => ("", ""),
    };
    // Averages of averages, weighted by how many samples each holds.
    let gpu_rows = format!(
        "INSERT INTO gpu_samples_1h ({GPU_ROLLUP_COLUMNS})
         SELECT device_id, ts_ms - ts_ms % $3, max(last_ts_ms), sum(samples), min(used_min), max(used_max),
             round(sum(used_avg::numeric * samples) / sum(samples))::int8,
             (max(ARRAY[last_ts_ms, used_last]))[2], max(reserved), max(total),
             (sum(utilization * samples) / NULLIF(sum(samples) FILTER (WHERE utilization IS NOT NULL), 0))::real,
             round(sum(pcie_tx::numeric * samples) / NULLIF(sum(samples) FILTER (WHERE pcie_tx IS NOT NULL), 0))::int8,
             round(sum(pcie_rx::numeric * samples) / NULLIF(sum(samples) FILTER (WHERE pcie_rx IS NOT NULL), 0))::int8
         FROM gpu_minutes($1, $2) {only_gpus}
         GROUP BY device_id, ts_ms - ts_ms % $3
         {GPU_ROLLUP_UPDATE}"
    );
    let process_rows = format!(
        "INSERT INTO process_samples_1h ({PROCESS_ROLLUP_COLUMNS})
         SELECT process_id, ts_ms - ts_ms % $3, max(last_ts_ms), sum(samples), min(used_min), max(used_max),
             round(sum(used_avg::numeric * samples) / sum(samples))::int8,
             (max(ARRAY[last_ts_ms, used_last]))[2]
         FROM process_minutes($1, $2) {only_processes}
         GROUP BY process_id, ts_ms - ts_ms % $3
         {PROCESS_ROLLUP_UPDATE}"
    );
    let mut gpu_query = sqlx::query(&gpu_rows).bind(from).bind(to).bind(HOUR_MS);
    let mut process_query = sqlx::query(&process_rows).bind(from).bind(to).bind(HOUR_MS);
    let (mut any_gpu, mut any_process) = (true, true);
    if let Some((gpus, processes)) = series {
        gpu_query = gpu_query.bind(gpus);
        process_query = process_query.bind(processes);
        (any_gpu, any_process) = (!gpus.is_empty(), !processes.is_empty());
    }
    // The fleet's rows sum GPUs only: an hour redone for processes alone
    // leaves them as they are.
    if any_gpu {
        gpu_query.execute(&mut **tx).await?;
        roll_up_fleet(tx, HOUR_MS, from, to).await?;
    }
    if any_process {
        process_query.execute(&mut **tx).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_bounds_parse() {
        assert_eq!(
            parse_bound("FOR VALUES FROM ('1764460800000') TO ('1764547200000')"),
            Some((1_764_460_800_000, 1_764_547_200_000))
        );
        assert_eq!(parse_bound("DEFAULT"), None);
    }
}
